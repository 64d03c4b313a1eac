"""A fine-tuning LoRA run's checkpoints hold the factors alone, the frozen base by reference to its
model.init_from directory (utils/checkpoint/frozen.py): the fingerprint is the exact integer hash it
claims to be; a saved checkpoint names only factors and records the directory; sampling and export
read the base from it; a resume is bit-identical; a base that no longer hashes the same (edited
weights, another param_dtype) is refused in one line before training; a random base, or one that
moved during training, is saved whole."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, restore_item
from safetensors.numpy import load_file, save_file
from test_checkpoint import assert_same_arrays, losses

import models
import train_jax
from models import hf, lora
from trainer import inference
from utils.checkpoint import frozen
from utils.checkpoint.storage import _saved_shapes, complete_steps, step_path
from utils.config import validate
from utils.errors import CheckpointError

RUN = ("model.vocab_size=null", "train.max_steps=4", "logging.log_every=1", "train.skip_validation=true",
       "train.sample_tokens=0", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3",
       "model.lora.rank=4", "model.lora.alpha=8", "optimizer.groups.lora.lr=1e-2", "checkpoint.save=true")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # checkpoint and init_from paths relative to it, as users type them


def train(tmp_path: Path, name: str, *overrides: str) -> dict:
    (tmp_path / name).mkdir()
    return train_jax.train(compose_config(*RUN, *overrides), str(tmp_path / name))


def latest(ck: str) -> tuple[Path, dict]:
    path = Path(step_path(ck, complete_steps(ck)[-1])).resolve()  # orbax reads absolute paths
    return path, json.loads((path / "manifest" / "manifest.json").read_text())


def is_factor_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in lora.FACTORS


def named(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- the fingerprint


def reference_fingerprint_sums(x: np.ndarray) -> tuple[int, int]:
    """The two sums frozen._leaf_sums computes, in exact Python integers (mod 2^32)."""
    x = np.where(x == 0, np.zeros_like(x), x)
    bits = x.view(f"uint{8 * x.dtype.itemsize}").astype(np.uint64).ravel()
    weight = (np.arange(x.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
    return int(bits.sum() % 2**32), int(((bits * weight) % 2**32).sum() % 2**32)


def test_fingerprint_sums_are_exact_integer_sums():
    """Exactly the integer sums (so no reduction order, hence no mesh, can change them), -0.0 read as 0.0."""
    x = np.random.default_rng(0).normal(size=(3, 1000)).astype(np.float32)
    x[0, :7] = -0.0
    got = np.asarray(frozen._leaf_sums([jnp.asarray(x)]))[0]
    assert tuple(int(v) for v in got) == reference_fingerprint_sums(x)


def test_fingerprint_sees_every_change_of_a_frozen_array():
    rng = np.random.default_rng(1)
    base = {"a": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), "b": jnp.zeros((5,), jnp.float32)}
    fp = frozen.fingerprint(base)
    assert frozen.fingerprint({"a": base["a"], "b": -base["b"]}) == fp  # -0.0: a zero update's trace
    one_ulp = base["a"].at[2, 3].set(jnp.nextafter(base["a"][2, 3], jnp.inf))
    swapped = base["a"].at[0, 0].set(base["a"][0, 1]).at[0, 1].set(base["a"][0, 0])
    for changed in ({"a": one_ulp, "b": base["b"]}, {"a": swapped, "b": base["b"]},
                    {"a": base["a"].astype(jnp.bfloat16), "b": base["b"]}, {"c": base["a"], "b": base["b"]},
                    {"a": base["a"].reshape(8, 4), "b": base["b"]}):
        assert frozen.fingerprint(changed) != fp
    assert frozen.fingerprint({"b": base["b"], "a": base["a"], "factor": None}) == fp  # None leaves: not part of it


# ----------------------------------------------------------------------------- whole runs


@pytest.fixture
def pretrained(tmp_path) -> Path:
    """tmp/pretrained: a gpt2 Hugging Face directory of a random tiny GPT (vocab 320 holds the byte tokens)."""
    cfg = models.config_from_dict({"name": "gpt", "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 32,
                                   "vocab_size": 320})
    hf.save_hf(str(tmp_path / "pretrained"), models.build(cfg, jax.random.PRNGKey(0)))
    return tmp_path / "pretrained"


FINE_TUNE = ("model.init_from=pretrained", "model.dropout=0.0")


@pytest.mark.parametrize("family, dtype", [("gpt", "float32"), ("llama", "bfloat16")])
def test_a_hugging_face_directory_is_read_without_jax(tmp_path, family, dtype):
    """model.init_from's arrays are read inside the init program's pure_callbacks, several at once on
    XLA's threads: a JAX array made there (safetensors' flax reader, a jnp.asarray) waits for those
    threads and deadlocked every model of a few MB. So the read is numpy through and through, which a
    transfer guard checks (it raises on any host-to-device copy), bfloat16 files included."""
    shape = {"dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 32, "vocab_size": 320}
    cfg = models.config_from_dict({"name": family, **shape, **({"num_kv_heads": 2} if family == "llama" else {})})
    hf.save_hf(str(tmp_path / "d"), models.build(cfg, jax.random.PRNGKey(0), dtype))
    with jax.transfer_guard("disallow_explicit"):
        leaves = hf._host_leaves(cfg, str(tmp_path / "d"), np.float32)
    assert leaves and all(type(x) is np.ndarray for x in leaves)
    want = jax.tree.leaves(models.build(cfg, jax.random.PRNGKey(0), dtype))
    for a, b in zip(leaves, want):
        np.testing.assert_array_equal(a, np.asarray(b, np.float32))  # bfloat16 widens exactly


def test_a_lora_checkpoint_holds_the_factors_and_a_reference_to_its_base(tmp_path, pretrained, capsys):
    """model and eval_model (Schedule-Free's x) items name the factors alone; the manifest records the
    base's directory and fingerprint; sampling/export's restore reads the base from that directory
    under the saved factors (x's, not the y the step trains)."""
    train(tmp_path, "run", *FINE_TUNE, "checkpoint.save_path=ck", "optimizer=schedule_free_adamw")
    run = validate(compose_config(*RUN, *FINE_TUNE, "checkpoint.save=false"))
    factors = lora.factor_count(models.abstract(run.model))
    assert f"M params ({factors:,} trained: LoRA factors)" in capsys.readouterr().out  # the header says what trains
    path, manifest = latest("ck")
    for item in ("model", "eval_model"):
        saved = _saved_shapes(str(path / item))
        assert saved and all(is_factor_name(n) for n in saved), (item, sorted(saved))
    record = manifest[frozen.MANIFEST_KEY]
    assert record["source"] == {"model.init_from": str(pretrained), "train.param_dtype": "float32"}
    _, run, model = inference.restore_for_inference("ck", "latest")
    got = named(model)
    _, base = hf.load_hf(str(pretrained), dataclasses.replace(run.model, lora=lora.LoraConfig()))
    assert {n for n in got if not is_factor_name(n)} == set(named(base))
    for name, x in named(base).items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    x_factors = named(restore_item(path / "eval_model"))
    y_factors = named(restore_item(path / "model"))
    assert set(x_factors) == {n for n in got if is_factor_name(n)}
    for name, x in x_factors.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    assert any(not np.array_equal(x_factors[n], y_factors[n]) for n in x_factors)  # x is not y: the test can tell
    assert np.abs(got["blocks.mlp_in.lora_b_RxO"]).max() > 0  # B trained off its zero start


@pytest.mark.slow
def test_a_fine_tuning_resume_is_bit_identical_and_a_changed_base_is_refused(tmp_path, pretrained):
    """resume=auto rebuilds the base from the directory the checkpoint names: losses and factors equal
    an unbroken run's. Once the directory's weights change, or train.param_dtype does, the restore is
    refused in one line naming them, before any step."""
    train(tmp_path, "full", *FINE_TUNE, "checkpoint.save_path=ck_full")
    train(tmp_path, "first", *FINE_TUNE, "checkpoint.save_path=ck", "checkpoint.num_steps=2")
    train(tmp_path, "second", *FINE_TUNE, "checkpoint.save_path=ck", "checkpoint.resume=auto")
    assert complete_steps("ck")[-1] == 4
    assert {**losses(tmp_path / "first"), **losses(tmp_path / "second")} == losses(tmp_path / "full")
    for item in ("model", "opt_state"):
        assert_same_arrays(latest("ck_full")[0], latest("ck")[0], item)

    with pytest.raises(CheckpointError) as info:
        train(tmp_path, "bf16", *FINE_TUNE, "checkpoint.save_path=ck2", "checkpoint.load=true",
              "checkpoint.load_path=ck", "checkpoint.overwrite_config=true", "train.param_dtype=bfloat16")
    assert "\n" not in str(info.value) and "train.param_dtype=float32" in str(info.value)
    assert not (tmp_path / "bf16" / "metrics.jsonl").exists()

    weights = pretrained / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.float32(1e-3)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^\S+ holds LoRA factors over a frozen base made from "
                                              r"model\.init_from=\S+pretrained.*weights in model\.init_from changed"):
        inference.restore_for_inference("ck", "latest")


@pytest.mark.slow
def test_a_random_or_moved_base_is_saved_whole(tmp_path, pretrained, monkeypatch, capsys):
    """A random base (no model.init_from) is saved whole: a seed is no bit-exact reference. Never lost
    work: when a fine-tuned base no longer hashes as at the start (simulated by a reference that does
    not match), the save warns once and writes the whole model, which then resumes and stays whole."""
    train(tmp_path, "random", "checkpoint.save_path=ck_random", "train.max_steps=1")
    path, manifest = latest("ck_random")
    assert frozen.MANIFEST_KEY not in manifest and not all(map(is_factor_name, _saved_shapes(str(path / "model"))))

    real = train_jax.frozen_base

    def wrong(trainer, source):
        part = real(trainer, source)
        return frozen.FrozenPart(part.is_frozen, part.source, "0" * 16)

    monkeypatch.setattr(train_jax, "frozen_base", wrong)
    train(tmp_path, "run", *FINE_TUNE, "checkpoint.save_path=ck", "checkpoint.num_steps=2")
    path, manifest = latest("ck")
    assert frozen.MANIFEST_KEY not in manifest
    assert not all(map(is_factor_name, _saved_shapes(str(path / "model"))))
    assert capsys.readouterr().out.count("the frozen LoRA base changed") == 1
    monkeypatch.setattr(train_jax, "frozen_base", real)
    train(tmp_path, "resumed", *FINE_TUNE, "checkpoint.save_path=ck", "checkpoint.resume=auto")
    path, manifest = latest("ck")
    assert complete_steps("ck")[-1] == 4 and frozen.MANIFEST_KEY not in manifest  # a whole base is not vouched for
