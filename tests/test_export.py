"""scripts/export_model.py and scripts/sample.py against one tiny checkpoint made in-process:
the exported tensors are the checkpoint's arrays bit for bit, a model rebuilt from the export
computes the same logits, and both scripts fail with exit 2 and one `error:` line.

The happy paths call each script's `main(argv)` in-process (no second JAX start-up); the
process boundary (exit code, stderr, stdout) is checked by two subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import docs_command, load_script, train_on_own_source
from safetensors.numpy import load_file

import models
from models import export
from models.gpt import GPT, GPTConfig
from utils.checkpoint.storage import open_checkpoint, restore_model

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
# What is trained hardly matters here, compile time does: no validation, no remat, an unrolled
# two-block loop and SGD compile about twice as fast as the defaults.
RUN = ("model.vocab_size=null", "train.sample_tokens=0", f"train.max_steps={STEPS}", "train.skip_validation=true",
       "model.context_length=32", "model.remat=none", "model.scan_blocks=false", "optimizer=sgdm",
       "optimizer/lr_config=constant", "checkpoint.save=true", "dataset=text_files", "dataset.val_fraction=0.2")


export_script, sample_script = load_script("export_model"), load_script("sample")


def run_script(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python scripts/<name>.py args` from the repo root (or `cwd`), as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, _cache_dir) -> Path:
    """A checkpoint save_path holding iter_{STEPS} of a tiny byte-tokenizer GPT."""
    tmp = tmp_path_factory.mktemp("export")
    train_on_own_source(tmp, _cache_dir, *RUN, "checkpoint.save_path=ck")
    return tmp / "ck"


@pytest.fixture(scope="module")
def restored(ckpt) -> GPT:
    """The checkpoint's model restored the plain way (restore_model's own recipe), not through models.export."""
    source = open_checkpoint(str(ckpt), "latest", with_opt_state=False)
    cfg = models.config_from_dict(source.manifest["model"])  # nested sections (model.lora, model.moe) typed
    abstract = eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0))
    return restore_model(source, abstract)


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ckpt.parent)  # `python scripts/export_model.py ck --out ...` beside the run
        assert export_script.main(["ck", "--out", os.path.relpath(out)]) == 0
    return out


def test_export_holds_the_checkpoints_arrays_exactly(exported, restored):
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors"]  # no tmp file left behind
    tensors = load_file(str(exported / "model.safetensors"))
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(restored, eqx.is_array))[0]
    want = {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x) for p, x in leaves}
    assert set(tensors) == set(want)
    assert tensors["blocks.attn_qkv.weight_IxO"].shape == (2, 32, 96)  # stacked blocks, dim 32 -> 3·32
    for name, x in want.items():
        assert tensors[name].dtype == x.dtype, name
        np.testing.assert_array_equal(tensors[name], x, err_msg=name)


def test_config_json_round_trips_to_the_models_config(exported, restored):
    config = json.loads((exported / "config.json").read_text())
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert models.config_from_dict({k: v for k, v in config.items() if k in fields}) == restored.cfg
    assert config["vocab_size"] == 320  # 257 byte ids padded to a multiple of 64, not the saved null
    assert config["step"] == STEPS and config["tokenizer"] == {"name": "byte"}
    assert config["trained_context_length"] == 32  # the window the samples stay inside
    assert export.read_export_config(str(exported))[0] == restored.cfg


def test_model_rebuilt_from_the_export_gives_identical_logits(exported, restored):
    rebuilt = export.load_export(str(exported))
    tokens_BxT = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 257)
    logits = eqx.filter_jit(lambda model, tokens: model(tokens))  # eager scan + remat is far slower than compiling
    want_BxTxV, got_BxTxV = np.asarray(logits(restored, tokens_BxT)), np.asarray(logits(rebuilt, tokens_BxT))
    assert want_BxTxV.shape == (2, 32, 320) and np.isfinite(want_BxTxV).all()
    np.testing.assert_array_equal(got_BxTxV, want_BxTxV)


def test_export_refuses_a_non_empty_out_dir_unless_forced(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_script("export_model", str(ckpt), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(out) in lines[0] and "--force" in lines[0]
    assert sorted(os.listdir(out)) == ["keep.txt"]

    assert export_script.main([str(ckpt), "--load-file", f"iter_{STEPS}", "--out", str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "keep.txt", "model.safetensors"]
    assert (out / "keep.txt").read_text() == "mine"


def test_greedy_sample_starts_with_the_prompt_and_repeats(ckpt, capsys, monkeypatch):
    """The script as a user runs it, then again in this process (a second start of the same program
    would prove no more): the same text both times."""
    args = ("ck", "--prompt", "def ", "--tokens", "24", "--temperature", "0")  # relative to the run's directory
    first = run_script("sample", *args, cwd=ckpt.parent)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def ") and len(first.stdout.rstrip("\n")) > len("def ")
    monkeypatch.chdir(ckpt.parent)
    capsys.readouterr()
    assert sample_script.main(list(args)) == 0
    assert first.stdout == capsys.readouterr().out


def test_export_files_have_umask_normal_permissions_and_round_trip(tmp_path):
    """No checkpoint needed: a fresh tiny GPT through save_export and load_export. The safetensors
    writer makes private 0600 files; an export is meant to be shared, so it gets what `open` gives."""
    cfg = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64)
    model = eqx.filter_jit(GPT)(cfg, jax.random.PRNGKey(0))  # one compile, not one per eager init op
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        export.save_export(str(out), model, 7, {"name": "byte"}, 16)
    finally:
        os.umask(old)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755  # what mkdir gives, not the scratch directory's 0700
    rebuilt = export.load_export(str(out))
    assert rebuilt.cfg == model.cfg and export.read_export_config(str(out))[1]["step"] == 7
    want, got = export.model_tensors(model), export.model_tensors(rebuilt)
    assert set(got) == set(want)
    for name, x in want.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)


@pytest.mark.parametrize("script", ["export_model", "sample"])
def test_a_missing_checkpoint_dir_is_one_line_naming_it(script, tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    argv = [str(missing), "--out", str(tmp_path / "out")] if script == "export_model" else [str(missing)]
    assert {"export_model": export_script, "sample": sample_script}[script].main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and str(missing) in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- --dtype, --max-shard-size


def test_the_docs_bfloat16_export_and_its_shards(ckpt, tmp_path, monkeypatch, capsys):
    """docs/models.md's `--format hf --dtype bfloat16 --max-shard-size 5GB` as typed (the tiny model fits
    one file), then with a limit it passes: transformers' shards, and --force leaves no single file."""
    import shutil

    from safetensors import safe_open

    from models import hf_shards

    shutil.copytree(ckpt, tmp_path / "ckpt" / "run1")
    monkeypatch.chdir(tmp_path)
    argv = docs_command("models.md", "python scripts/export_model.py ckpt/run1 --format hf --dtype bfloat16")
    assert export_script.main(argv) == 0
    assert "dtype: bfloat16 (--dtype)" in capsys.readouterr().out
    out = tmp_path / argv[argv.index("--out") + 1]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    total = (out / "model.safetensors").stat().st_size
    argv[argv.index("--max-shard-size") + 1] = str(total // 3)  # bytes: at least 3 shards
    assert export_script.main([*argv, "--force"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names and hf_shards.INDEX_FILE in names
    shards = [n for n in names if hf_shards.SHARD.fullmatch(n)]
    assert len(shards) >= 3 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch directory left


def test_export_defaults_to_the_runs_param_dtype(exported, capsys):
    """A run from scratch (no model.init_from) in float32: the export is float32 (exported above)."""
    tensors = load_file(str(exported / "model.safetensors"))
    assert {x.dtype for x in tensors.values()} == {np.dtype(np.float32)}


@pytest.mark.parametrize("flags,flag", [(["--dtype", "float64"], "--dtype"),
                                        (["--format", "hf", "--max-shard-size", "5XB"], "--max-shard-size"),
                                        (["--format", "hf", "--max-shard-size", "0"], "--max-shard-size"),
                                        (["--max-shard-size", "5GB"], "--max-shard-size")])
def test_bad_export_flags_are_one_line_before_the_checkpoint_is_read(tmp_path, capsys, flags, flag):
    """Checked before the checkpoint is opened: a checkpoint directory that does not exist is not what they say."""
    assert export_script.main([str(tmp_path / "no_such_run"), "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {flag}") and "no_such_run" not in err
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_out_as_it_was(ckpt, tmp_path, monkeypatch):
    """The weights half written when the writer fails: --out is not created, or keeps what it held."""
    from safetensors import numpy as st_numpy

    def fail(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device", path)

    out = tmp_path / "out"
    monkeypatch.setattr(st_numpy, "save_file", fail)
    assert export_script.main([str(ckpt), "--out", str(out)]) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "model.safetensors").write_text("previous")
    assert export_script.main([str(ckpt), "--out", str(out), "--force"]) == 2
    assert [p.name for p in out.iterdir()] == ["model.safetensors"] and (out / "model.safetensors").read_text() == \
        "previous"
    assert list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("flags,says", [(["--format", "peft"], "--format peft: this checkpoint has no LoRA factors"),
                                        (["--format", "peft", "--merge-lora"], "--format peft writes the factors")])
def test_peft_export_of_a_run_without_factors_is_one_line(ckpt, tmp_path, capsys, flags, says):
    assert export_script.main([str(ckpt), "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {says}")
    assert list(tmp_path.iterdir()) == []
