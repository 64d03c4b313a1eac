"""A run's own export (checkpoint.export, trainer/run_export.py) against `scripts/export_model.py` of
the run's last checkpoint: the same files byte for byte, from the model the run evaluates (here
train.weight_average's average, not the trained point); the knobs refused in one line at validation;
the export only at the run's last step. The multi-process export is in tests/test_multiprocess.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import compose_config, load_script, restore_item, train_on_own_source
from safetensors.numpy import load_file

from models import hf_generation, hf_shards
from trainer import inference, run_export
from trainer.hooks import LoopContext
from utils.config import validate
from utils.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
# test_export.py's quick-compiling tiny run, with an average (half-life 2 steps: after 6 steps it is
# far from the trained weights) that evaluation and the export use.
RUN = ("model.vocab_size=null", "train.sample_tokens=0", f"train.max_steps={STEPS}", "train.skip_validation=true",
       "model.context_length=32", "model.remat=none", "model.scan_blocks=false", "optimizer=sgdm",
       "optimizer/lr_config=constant", "checkpoint.save=true", "dataset=text_files", "dataset.val_fraction=0.2",
       "train.weight_average=ema", "train.weight_average_half_life=2", "checkpoint.export=safetensors")

export_script = load_script("export_model")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, _cache_dir) -> Path:
    """save_path of a tiny run that exported itself at its last step (into save_path/export)."""
    tmp = tmp_path_factory.mktemp("run_export")
    train_on_own_source(tmp, _cache_dir, *RUN, "checkpoint.save_path=ck")
    return tmp / "ck"


@pytest.mark.slow  # the module's tiny run: ~9 s on 2 cores
def test_the_runs_export_is_export_model_of_its_last_checkpoint(ckpt, tmp_path):
    """Same writer, same model, same metadata: every file equal byte for byte."""
    ours = ckpt / run_export.DIRECTORY
    assert export_script.main([str(ckpt), "--out", str(tmp_path / "script")]) == 0
    assert sorted(os.listdir(ours)) == sorted(os.listdir(tmp_path / "script")) == ["config.json", "model.safetensors"]
    for name in os.listdir(ours):
        assert (ours / name).read_bytes() == (tmp_path / "script" / name).read_bytes(), name
    assert json.loads((ours / "config.json").read_text())["step"] == STEPS
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no scratch directory left beside it


@pytest.mark.slow  # the module's tiny run: ~9 s on 2 cores
def test_the_export_is_the_evaluated_average_not_the_trained_point(ckpt):
    """The checkpoint's eval_model (the average) bit for bit; the trained weights (its `model`) differ."""
    tensors = load_file(str(ckpt / run_export.DIRECTORY / "model.safetensors"))
    average = jax.tree_util.tree_flatten_with_path(restore_item(ckpt / f"iter_{STEPS}" / "eval_model"))[0]
    trained = jax.tree_util.tree_flatten_with_path(restore_item(ckpt / f"iter_{STEPS}" / "model"))[0]
    name = lambda path: ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    average, trained = {name(p): np.asarray(x) for p, x in average}, {name(p): np.asarray(x) for p, x in trained}
    assert set(tensors) == set(average) == set(trained)
    for key, x in tensors.items():
        np.testing.assert_array_equal(x, average[key], err_msg=key)
    assert any(not np.array_equal(x, trained[key]) for key, x in tensors.items())


@pytest.mark.slow  # the module's tiny run: ~9 s on 2 cores
def test_hf_knobs_write_what_the_scripts_flags_write(ckpt, tmp_path):
    """export_run (the hook's body) with export=hf, bfloat16 and a shard size that splits the tiny model
    in 3+ files equals `export_model.py --format hf --dtype bfloat16 --max-shard-size N` byte for byte."""
    source, run, model = inference.restore_for_inference(str(ckpt), "latest")
    generation = hf_generation.checked(source.manifest[hf_generation.MANIFEST_KEY], "manifest")
    size = str(os.path.getsize(ckpt / run_export.DIRECTORY / "model.safetensors") // 6)  # f32 -> bf16 halves: 3 shards
    ck = dataclasses.replace(run.checkpoint, export="hf", export_path=str(tmp_path / "ours"), export_dtype="bfloat16",
                             export_max_shard_size=size)
    run = dataclasses.replace(run, checkpoint=ck)
    assert run_export.export_run(run, model, source.step, None, generation) == str(tmp_path / "ours")
    flags = ["--format", "hf", "--dtype", "bfloat16", "--max-shard-size", size]
    assert export_script.main([str(ckpt), "--out", str(tmp_path / "script"), *flags]) == 0
    names = sorted(os.listdir(tmp_path / "ours"))
    assert names == sorted(os.listdir(tmp_path / "script")) and hf_shards.INDEX_FILE in names
    assert len([n for n in names if hf_shards.SHARD.fullmatch(n)]) >= 3
    for n in names:
        assert (tmp_path / "ours" / n).read_bytes() == (tmp_path / "script" / n).read_bytes(), n


@pytest.mark.parametrize("start,end,max_steps,finished_at,due", [
    (0, 6, 6, None, [6]),  # the run's end
    (0, 4, 6, None, []),  # a segment (checkpoint.num_steps) that stops before train.max_steps: not done
    (4, 6, 6, None, [6]),  # the segment that finishes it
    (0, 6, 6, 3, [3]),  # early stopping ends the run at step 3
])
def test_the_export_is_due_only_at_the_runs_last_step(start, end, max_steps, finished_at, due):
    """Preemption never calls it: a stop runs the hooks' on_stop, which Export leaves as Hook's (nothing)."""
    run = validate(compose_config(f"train.max_steps={max_steps}", "checkpoint.export=safetensors",
                                  "checkpoint.export_path=out"))
    hook, ctx = run_export.Export(run, None, None), LoopContext(start, end, None, None)
    assert not hook.due(ctx)  # never at the start
    got = []
    for step in range(start + 1, end + 1):
        ctx.advance(step, None, {})
        ctx.finished = "early stop" if step == finished_at else None
        if hook.due(ctx):
            got.append(step)
        if ctx.finished:  # the loop ends there
            break
    assert got == due
    assert type(hook).on_stop is run_export.Hook.on_stop


@pytest.mark.parametrize("overrides,says", [
    (["checkpoint.export=onnx"], "checkpoint.export='onnx' is not an export format"),
    (["checkpoint.export=safetensors"], "checkpoint.export=safetensors writes to checkpoint.export_path"),
    (["checkpoint.export_dtype=float16"], "checkpoint.export_dtype is set but checkpoint.export=null"),
    (["checkpoint.export=hf", "checkpoint.export_path=o", "checkpoint.export_dtype=float64"],
     "checkpoint.export_dtype=float64 is not an export dtype"),
    (["checkpoint.export=safetensors", "checkpoint.export_path=o", "checkpoint.export_max_shard_size=5GB"],
     "checkpoint.export_max_shard_size applies to checkpoint.export=hf"),
    (["checkpoint.export=hf", "checkpoint.export_path=o", "checkpoint.export_max_shard_size=5XB"],
     "checkpoint.export_max_shard_size=5XB is not a size"),
    (["checkpoint.export=hf", "checkpoint.export_path=o", "checkpoint.export_merge_lora=true"],
     "checkpoint.export_merge_lora=true: this run has no LoRA factors"),
    (["checkpoint.export=peft", "checkpoint.export_path=o"], "checkpoint.export=peft: this run has no LoRA factors"),
    (["checkpoint.export=peft", "checkpoint.export_path=o", "model.lora.rank=2"],
     "checkpoint.export=peft: this LoRA run's base is random"),
    (["checkpoint.export=hf", "checkpoint.export_path=o", "model.lora.rank=2"],
     "checkpoint.export=hf: this LoRA run's factors have no place"),
    (["checkpoint.export=hf", "checkpoint.export_path=o", "objective=mdlm"],
     "checkpoint.export=hf: objective=mdlm attends both ways"),
])
def test_bad_export_knobs_are_one_line_at_validation(overrides, says):
    """Refused by validate (before anything is built or compiled), one line naming the knob."""
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides))
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


# scripts/export_model.py's spelling of each option -> checkpoint.export*'s (flags first: "--max-shard-size" holds no
# other flag, and "add " is only the fix's verb)
AS_KNOBS = [("--max-shard-size", "checkpoint.export_max_shard_size"), ("--format ", "checkpoint.export="),
            ("--dtype ", "checkpoint.export_dtype="), ("leave it out", "null"), ("add ", "set ")]


@pytest.mark.parametrize("fmt,dtype,size", [("hf", "float64", None), ("safetensors", None, "5GB"),
                                            ("hf", None, "5XB"), ("hf", None, "0")])
def test_export_flags_and_knobs_are_refused_alike(fmt, dtype, size):
    """The script's flags and a run's knobs go through one check (trainer/export_options.py): the same
    refusal, word for word but for the names of the options and how a default is asked for."""
    flags = ["--format", fmt, *(["--dtype", dtype] if dtype else []), *(["--max-shard-size", size] if size else [])]
    knobs = [f"checkpoint.export={fmt}", "checkpoint.export_path=o",
             *([f"checkpoint.export_dtype={dtype}"] if dtype else []),
             *([f"checkpoint.export_max_shard_size={size}"] if size else [])]
    with pytest.raises(ConfigError) as by_flag:
        export_script.check_flags(export_script.parse_args(["ckpt", "--out", "o", *flags]))
    with pytest.raises(ConfigError) as by_knob:
        validate(compose_config(*knobs))
    said = str(by_flag.value)
    for flag, knob in AS_KNOBS:
        said = said.replace(flag, knob)
    assert said == str(by_knob.value)


@pytest.mark.parametrize("process,zero_wrote", [(0, False), (1, True), (1, False)])
def test_only_process_0_writes_and_every_process_fails_with_it(process, zero_wrote, tmp_path, monkeypatch):
    """The protocol on one process standing for each of two: process 0 writes (here its writer fails: it
    raises its own error); another writes nothing and returns once process 0 says it wrote, or raises
    a CheckpointError when process 0 says it failed. The collective is replaced by what process 0 sends."""
    from jax.experimental import multihost_utils

    import models
    from utils.errors import CheckpointError

    run = validate(compose_config("checkpoint.export=safetensors", f"checkpoint.export_path={tmp_path / 'out'}"))
    model = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), models.abstract(run.model))  # the writer is stubbed
    sent = []
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                        lambda x: sent.append(int(x)) or (x if process == 0 else np.int32(zero_wrote)))

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(inference, "write_export", fail)
    if process == 0:
        with pytest.raises(OSError, match="No space left"):
            run_export.export_run(run, model, 1, None, None)
        assert sent == [0]  # it told the others it failed before raising
    elif zero_wrote:
        assert run_export.export_run(run, model, 1, None, None) == str(tmp_path / "out")
    else:
        with pytest.raises(CheckpointError, match="process 0 failed to write"):
            run_export.export_run(run, model, 1, None, None)
    assert not (tmp_path / "out").exists()  # the writer (failing) ran on process 0 alone
