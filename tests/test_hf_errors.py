"""`model.init_from` and the Hugging Face directory layer on bad input, and the config boundary's
part of a good one: every failure is one line naming the knob or file and the fix, raised by
`validate` (before anything compiles) or by the export before any file is written. No torch: the
directories are written by our own save_hf (safetensors + JSON), edited where a test needs a fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import compose_config

import models
from models import hf
from utils.checkpoint.inference import export_hf
from utils.config import validate
from utils.errors import CheckpointError, ConfigError

GPT = {"name": "gpt", "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 32, "vocab_size": 64}


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.fixture
def gpt_dir(tmp_path, monkeypatch) -> Path:
    """tmp/pretrained: a gpt2 directory of a random tiny GPT (dim 32, context 32); cwd = tmp."""
    model = models.build(models.config_from_dict(GPT), jax.random.PRNGKey(0))
    hf.save_hf(str(tmp_path / "pretrained"), model)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "pretrained"


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / hf.CONFIG_FILE).read_text())
    (path / hf.CONFIG_FILE).write_text(json.dumps({**config, **changes}))


def run_with(*overrides: str):
    return validate(compose_config(*overrides))


def test_init_from_takes_the_directory_shapes_by_a_relative_path(gpt_dir):
    run = run_with("model.init_from=pretrained", "model.dim=64", "model.num_blocks=3", "model.dropout=0.1")
    m = run.model
    assert m.init_from == str(gpt_dir)  # resolved against the working directory, as typed
    assert (m.dim, m.num_heads, m.num_blocks, m.context_length, m.vocab_size) == (32, 4, 2, 32, 64)
    assert m.dropout == 0.1  # an execution knob: the run's own
    note = next(w for w in run.warnings if "model.init_from=pretrained" in w)
    assert "model.dim 64 -> 32" in note and "model.num_blocks 3 -> 2" in note
    assert run.tokenizer.name != "hf"  # the directory holds no tokenizer: the run keeps its own


def test_init_from_weights_are_the_files(gpt_dir):
    """models.build with init_from: the directory's arrays (read by callback), eager and under jit."""
    cfg = run_with("model.init_from=pretrained").model
    _, want = hf.load_hf(str(gpt_dir), cfg)
    for got in (models.build(cfg, jax.random.PRNGKey(0)), jax.jit(lambda: models.build(cfg, jax.random.PRNGKey(0)))()):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert models.abstract(cfg).wte_VxD.shape == (64, 32)


def test_unsupported_model_type(gpt_dir):
    edit_config(gpt_dir, model_type="bert")
    with pytest.raises(ConfigError) as e:
        run_with("model.init_from=pretrained")
    assert "model.init_from=pretrained" in one_line(e) and "model_type='bert'" in str(e.value)
    assert "supported model types are gpt2" in str(e.value)


def test_missing_directory_and_files(gpt_dir):
    with pytest.raises(ConfigError, match=r"model.init_from=nowhere: .*nowhere is not a directory"):
        run_with("model.init_from=nowhere")
    (gpt_dir / hf.WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        run_with("model.init_from=pretrained")
    (gpt_dir / hf.CONFIG_FILE).unlink()
    with pytest.raises(ConfigError, match=r"config.json is missing"):
        run_with("model.init_from=pretrained")


def test_shape_mismatch_names_the_tensor(gpt_dir):
    edit_config(gpt_dir, n_positions=48)  # the weights hold 32 positions
    with pytest.raises(CheckpointError) as e:
        run_with("model.init_from=pretrained")
    assert "transformer.wpe.weight has shape (32, 32), config.json says (48, 32)" in one_line(e)


def test_a_config_json_key_we_cannot_represent(gpt_dir):
    edit_config(gpt_dir, activation_function="relu")
    with pytest.raises(ConfigError) as e:
        run_with("model.init_from=pretrained")
    assert "activation_function='relu'" in one_line(e)


def test_family_mismatch_names_the_right_model_configs(gpt_dir):
    with pytest.raises(ConfigError) as e:
        run_with("model=llama_tiny", "model.init_from=pretrained")
    assert "holds a gpt model" in one_line(e) and "model=gpt2_124m or" in str(e.value)
    assert "model=gpt_tiny" in str(e.value)


def test_moe_cannot_start_from_a_directory(gpt_dir):
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=2: a run cannot start its MoE blocks"):
        run_with("model.init_from=pretrained", "model.moe.num_experts=2")


def test_the_directory_tokenizer_becomes_the_runs(gpt_dir):
    from loaders.tokenizers import BPETokenizer
    from loaders.tokenizers.bpe import _train_bpe

    bpe = BPETokenizer(_train_bpe(260, ["def f(x):\n    return x\n"] * 4), "bpe-260")
    assert hf.save_tokenizer(str(gpt_dir), bpe)
    run = run_with("model.init_from=pretrained", "tokenizer=bpe")
    assert (run.tokenizer.name, run.tokenizer.name_or_path) == ("hf", str(gpt_dir))
    assert any("tokenizer=bpe replaced" in w for w in run.warnings)


def test_export_refusals_write_nothing(tmp_path, tiny_run):
    no_bias = models.build(models.config_from_dict({**GPT, "bias": False}), jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match=r"model.bias=false cannot be exported as gpt2"):
        hf.save_hf(str(tmp_path / "a"), no_bias)
    assert not (tmp_path / "a").exists()
    model = models.build(models.config_from_dict(GPT), jax.random.PRNGKey(0))
    with pytest.raises(CheckpointError, match=r"objective=mdlm .* use --format safetensors"):
        export_hf(str(tmp_path / "b"), tiny_run("objective=mdlm"), model)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_resumed_run_restores_its_checkpoint_not_init_from(tmp_path, monkeypatch):
    """After the first segment the directory's weights are replaced (zeros, same shapes): the resumed
    run's model is its checkpoint's, so init_from's weights were not read again."""
    import jax.numpy as jnp

    import train_jax
    from models.export import abstract_model
    from utils.checkpoint.resume import merge_config, resume_source
    from utils.checkpoint.storage import restore_model
    from utils.config import to_dict

    byte_gpt = models.build(models.config_from_dict({**GPT, "vocab_size": 320}), jax.random.PRNGKey(0))
    hf.save_hf(str(tmp_path / "pretrained"), byte_gpt)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4})
                                                   + "\n" for i in range(40)))
    monkeypatch.chdir(tmp_path)
    run_knobs = ("model.init_from=pretrained", "tokenizer=byte", "dataset=text_files", "dataset.paths=[corpus.jsonl]",
                 "dataset.val_fraction=0.2", "train.skip_validation=true", "model.scan_blocks=false",
                 "model.remat=none", "optimizer=sgdm", "optimizer/lr_config=constant", "checkpoint.save=true",
                 "checkpoint.save_path=ck", "checkpoint.resume=auto")
    (tmp_path / "run").mkdir()
    train_jax.train(compose_config(*run_knobs, "train.max_steps=2"), str(tmp_path / "run"))
    hf.save_hf(str(tmp_path / "pretrained"), jax.tree.map(jnp.zeros_like, byte_gpt))

    config = to_dict(compose_config(*run_knobs, "train.max_steps=4"))
    run = validate(config)
    source = resume_source(run.checkpoint, lambda message: None)
    assert source is not None and source.step == 2
    trainer = train_jax.build_trainer(validate(merge_config(source, config, run.checkpoint, lambda m: None)), source)
    saved = restore_model(source, abstract_model(trainer.run.model, "float32"))
    for a, b in zip(jax.tree.leaves(trainer.state.model), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(trainer.state.model.wte_VxD).max()) > 0  # not the zeros now in the directory
    trainer.data.close()
