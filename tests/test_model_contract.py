"""The model contract (models/contract.py): every family of models.MODELS, and the guide's
(docs/example_family.py, registered here as `tiny` for the test's length: what a new family gets by being
registered), meets the contract and goes through one matrix: the shared checks, forward shapes, groups,
axes and FLOPs against counts from the parameter tree, scan = unrolled = block-causal, 8 sharded devices =
1 (slow: a subprocess, tests/model_contract_check.py), an exactly resumed run (slow), and the Hugging Face
round trip where the family declares a layout (else the one-line refusal).

Tolerances: helpers.logits_atol (float32 sums of the longest dot products feeding a logit, both sides).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, compose_config, logits_atol
from model_contract_check import TINY, TINY_NAME, family_config, family_overrides
from omegaconf import OmegaConf

import models
import train_jax
from models import contract
from optimizer.groups import GROUPS
from utils.errors import ConfigError

FAMILIES = [*models.MODELS, TINY_NAME]
NONE = type(None)
OPTIONAL_KINDS = {"LORA_TARGETS": (tuple, NONE), "HF_MODEL_TYPES": tuple, "HF_MOE": bool,
                  "hf_lora_tensors": (types.FunctionType, NONE), "HF_LORA_FAN_IN_FAN_OUT": bool,
                  "scale_query_key": (types.FunctionType, NONE)}


@pytest.fixture(params=FAMILIES)
def name(request, monkeypatch) -> str:
    """A family's registry key, the guide's family registered for the test."""
    monkeypatch.setitem(models.MODELS, TINY_NAME, TINY)
    return request.param


@functools.cache
def tiny(name: str):
    """(config, model) of the family's tiny run config (dim 32, 2 blocks, context 16, vocab 64), built once."""
    cfg = family_config(name)
    return cfg, eqx.filter_jit(models.build)(cfg, jax.random.PRNGKey(0))


def with_cfg(model, cfg):
    """`model`'s weights under another config that changes only execution (static fields)."""
    treedef = jax.tree.structure(eqx.filter_eval_shape(models.family(cfg).Model, cfg, jax.random.PRNGKey(0)))
    return jax.tree.unflatten(treedef, jax.tree.leaves(model))


forward = eqx.filter_jit(lambda model, tokens_BxT, key=None, **kw: model(tokens_BxT, key=key, **kw))


def _tokens(cfg, shape, seed=0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape, dtype=np.int32))


def _leaves(tree, is_leaf=None) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


# ----------------------------------------------------------------------------- the contract itself


def test_the_contract_lists_every_optional_member_and_the_yamls_hold_the_shared_knobs():
    assert set(OPTIONAL_KINDS) == set(contract.OPTIONAL)  # a new optional member gets its kind here (and docs)
    for member, default in contract.OPTIONAL.items():
        assert isinstance(default, OPTIONAL_KINDS[member]), member
    shared = [f.name for f in dataclasses.fields(contract.ModelConfig)]
    assert set(contract.SHAPE_KNOBS) <= set(shared) and models.SHARED_KNOBS == contract.COMMON_KNOBS
    conf = Path(REPO) / "conf"
    assert set(OmegaConf.load(conf / "model_common.yaml")["model"]) == set(contract.COMMON_KNOBS)
    for path in sorted((conf / "model").glob("*.yaml")):  # the rest: each model yaml sets them (documented there)
        assert set(shared) - set(contract.COMMON_KNOBS) <= set(OmegaConf.load(path)), path.name


def test_every_family_meets_the_contract(name):
    family = models.MODELS[name]
    contract.check_family_module(name, family)  # also what the registry runs at import
    assert isinstance(family, contract.Family)
    cls = family.Config
    assert issubclass(cls, contract.ModelConfig) and cls.__dataclass_params__.frozen
    # the shared knobs are inherited, not copied: only `name` (its registry key) is set again
    own = {c for c in cls.__mro__ if c is not contract.ModelConfig and issubclass(c, contract.ModelConfig)}
    copied = {f for c in own for f in c.__dict__.get("__annotations__", {})} & set(
        contract.ModelConfig.__dataclass_fields__)
    assert copied == {"name"}, f"{name} copies {copied - {'name'}}: models/contract.py ModelConfig gives them"
    assert "check" not in vars(cls)  # the shared checks run for every family (check_family is its own)
    signature = inspect.signature(family.Model.__call__)
    want = inspect.signature(contract.ModelCall.__call__)
    assert list(signature.parameters) == list(want.parameters)
    for p in list(want.parameters.values())[2:]:  # every call knob keyword-only, with the contract's default
        got = signature.parameters[p.name]
        assert got.kind is inspect.Parameter.KEYWORD_ONLY and got.default == p.default, p.name
    for member, kind in OPTIONAL_KINDS.items():
        assert isinstance(contract.optional(family, member), kind), (name, member)
    if contract.hf_support(family):
        assert all(callable(getattr(family, hook)) for hook in contract.HF_HOOKS if hook != "HF_KEYS")


@pytest.mark.parametrize("knob, value, match", [
    ("dim", 0, r"model\.dim=0 must be a positive integer"),
    ("context_length", -4, r"model\.context_length=-4 must be a positive integer"),
    ("dropout", 1.0, r"model\.dropout=1\.0 must be in \[0, 1\)"),
    ("remat", "most", r"model\.remat='most' must be one of"),
    ("attention", "flash", r"model\.attention='flash' must be one of"),
    ("mup_base_dim", 0, r"model\.mup_base_dim=0 must be a positive integer"),
    ("moe", {"num_experts": 2, "every": 3}, r"model\.moe\.every=3"),
    ("lora", {"rank": 2, "targets": ["nowhere"]}, r"model\.lora\.targets"),
])
def test_every_family_gets_the_shared_checks_in_one_line(name, knob, value, match):
    cfg, _ = tiny(name)
    with pytest.raises(ConfigError, match=match) as e:
        models.config_from_dict({**models.as_dict(cfg), knob: value})
        if knob == "lora":  # a family without LORA_TARGETS: refused when the factors attach
            models.abstract(models.config_from_dict({**models.as_dict(cfg), knob: value}))
    assert "\n" not in str(e.value)


def test_a_family_missing_a_member_is_refused_at_registration():
    good = {k: getattr(TINY, k) for k in ("Config", "Model", "param_labels", "param_axes", "PARAM_AXES",
                                          "flops_per_token")}
    contract.check_family_module(TINY_NAME, types.SimpleNamespace(**good))
    no_flops = types.SimpleNamespace(**{k: v for k, v in good.items() if k != "flops_per_token"})
    with pytest.raises(TypeError, match="lacks flops_per_token"):
        contract.check_family_module(TINY_NAME, no_flops)
    with pytest.raises(TypeError, match="lacks HF_KEYS, hf_config, config_from_hf, hf_tensors, from_hf_tensors"):
        contract.check_family_module(TINY_NAME, types.SimpleNamespace(**good, HF_MODEL_TYPES=("gpt2",)))
    with pytest.raises(TypeError, match="name must default to 'other'"):
        contract.check_family_module("other", types.SimpleNamespace(**good))
    overrides = dataclasses.make_dataclass("Overrides", [], bases=(TINY.Config,), frozen=True,
                                           namespace={"check": lambda self, prefix="model": None})
    with pytest.raises(TypeError, match="overrides check; override check_family"):
        contract.check_family_module(TINY_NAME, types.SimpleNamespace(**{**good, "Config": overrides}))

    class Positional(TINY.Model):
        def __call__(self, tokens_BxT, key=None):
            return super().__call__(tokens_BxT, key=key)

    with pytest.raises(TypeError, match=r"the contract's is \(tokens_BxT, \*, key, compute_dtype"):
        contract.check_family_module(TINY_NAME, types.SimpleNamespace(**{**good, "Model": Positional}))


# ----------------------------------------------------------------------------- the model matrix


def test_forward_shapes_groups_axes_and_flops(name):
    cfg, model = tiny(name)
    B, T, V, L = 2, cfg.context_length, cfg.vocab_size, cfg.num_blocks
    tokens_BxT = _tokens(cfg, (B, T))
    logits = forward(model, tokens_BxT)
    assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
    # bfloat16 matmuls, two packed documents, both directions: still float32 (B, T, V)
    segments_BxT = jnp.asarray(np.repeat([[0, 1]], B, 0).repeat(T // 2, 1))
    for kw in ({"compute_dtype": jnp.bfloat16}, {"segment_ids_BxT": segments_BxT}, {"causal": False}):
        out = forward(model, tokens_BxT, **kw)
        assert out.shape == (B, T, V) and out.dtype == jnp.float32, kw
    collected, stats = forward(model, tokens_BxT, collect=True)
    np.testing.assert_array_equal(collected, logits)  # the same program's logits, the statistics beside them
    assert set(stats) == {"attn", "mlp", "resid"} and all(stats[k].shape == (L,) for k in stats)
    assert models.blocks(model) is not None and all(x.shape[0] == L for x in jax.tree.leaves(models.blocks(model)))
    # every array in one optimizer group, every dimension named (the stacked axis of blocks: `layers`)
    labels = _leaves(models.param_labels(model))
    axes = _leaves(models.param_axes(model), is_leaf=lambda x: isinstance(x, tuple))
    arrays = _leaves(eqx.filter(model, eqx.is_array))
    assert set(labels) == set(arrays) and set(labels.values()) <= set(GROUPS)
    assert {"hidden", "embed"} <= set(labels.values())
    for path, x in arrays.items():
        if path in axes:
            assert len(axes[path]) == x.ndim, path
        if path.startswith(".blocks"):
            assert axes.get(path, ("layers",))[0] == "layers", path
    # FLOPs: 6 per matmul weight (every `hidden` array and the head, tied or not, V x D) at seq_len 0,
    # plus an attention term linear in seq_len. Integers in float64: exact.
    n_matmul = sum(x.size for path, x in arrays.items() if labels[path] == "hidden") + V * cfg.dim
    assert models.flops_per_token(cfg, 0) == 6 * n_matmul
    f = [models.flops_per_token(cfg, t) for t in (0, T, 2 * T)]
    assert f[2] - f[1] == f[1] - f[0] > 0


def test_scan_unroll_and_block_causal_attention_give_the_same_logits(name):
    """Execution knobs change how, not what: unrolled blocks, two per scan step, query blocks of 4."""
    cfg, model = tiny(name)
    tokens_BxT = _tokens(cfg, (2, cfg.context_length))
    want = forward(model, tokens_BxT)
    for flags in ({"scan_blocks": False}, {"scan_unroll": 2}, {"attn_block_size": 4}):
        got = forward(with_cfg(model, dataclasses.replace(cfg, **flags)), tokens_BxT)
        np.testing.assert_allclose(got, want, rtol=0, atol=logits_atol(cfg, want), err_msg=str(flags))


def test_scanned_and_unrolled_blocks_draw_the_same_dropout(name):
    """With dropout on, block i gets the same key scanned or unrolled, so the same masks."""
    cfg, model = tiny(name)
    tokens_BxT = _tokens(cfg, (2, cfg.context_length))
    want = forward(model, tokens_BxT)
    key, dropout = jax.random.PRNGKey(4), dataclasses.replace(cfg, dropout=0.5)
    dropped = forward(with_cfg(model, dropout), tokens_BxT, key)
    unrolled = forward(with_cfg(model, dataclasses.replace(dropout, scan_blocks=False)), tokens_BxT, key)
    np.testing.assert_allclose(unrolled, dropped, rtol=0, atol=logits_atol(cfg, dropped))
    # dropout at 0.5 moves logits by O(their scale); rounding by logits_atol (~1e-4 at scale 1): 1e-2 between
    assert np.abs(np.asarray(dropped) - np.asarray(want)).max() > 1e-2


@pytest.mark.slow
def test_every_family_sharded_over_8_devices_equals_1_device():
    """tests/model_contract_check.py: data 2 x fsdp 2 x tensor 2, each family's parameters laid out by its
    own param_axes; logits within logits_atol, the loss within mean_loss_atol (both derived there)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "model_contract_check.py")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == set(FAMILIES)  # the guide's family included: a new family gets this check
    for fam, r in result.items():
        assert r["devices"] == 8 and r["tensor_split"] > 0 and r["fsdp_split"] > 0, (fam, r)
        assert r["logits_diff"] <= r["logits_atol"], (fam, r)
        assert abs(r["loss"][0] - r["loss"][1]) <= r["loss_atol"], (fam, r)


@pytest.mark.slow
def test_a_resumed_run_is_bit_identical(name, tmp_path, monkeypatch):
    """Stopped after 3 of 6 steps and resumed: every step's loss, the final weights and the optimizer
    state equal an unbroken run's exactly (dropout on, so the keys resume too)."""
    from test_checkpoint import assert_same_arrays, losses

    monkeypatch.chdir(tmp_path)
    run = (*family_overrides(name), "model.vocab_size=null", "train.max_steps=6", "logging.log_every=1",
           "train.val_freq=6", "train.max_val_steps=1", "model.dropout=0.1", "checkpoint.save=true")

    def train(run_name, *overrides):
        (tmp_path / run_name).mkdir()
        train_jax.train(compose_config(*run, *overrides), str(tmp_path / run_name))
        return tmp_path / run_name

    full = train("full", "checkpoint.save_path=ckpt/full")
    first = train("first", "checkpoint.save_path=ckpt/seg", "checkpoint.num_steps=3")
    second = train("second", "checkpoint.save_path=ckpt/seg", "checkpoint.resume=auto")
    assert min(losses(second)) == 4
    assert {**losses(first), **losses(second)} == losses(full)  # exact float equality, step by step
    for item in ("model", "opt_state"):
        assert_same_arrays(tmp_path / "ckpt/full/iter_6", tmp_path / "ckpt/seg/iter_6", item)


def test_the_hugging_face_round_trip_where_the_family_declares_one(name, tmp_path):
    """save_hf then load_hf: the same arrays bit for bit, the same config.json, the same logits; a family
    with no HF_MODEL_TYPES is refused in one line before any file is written."""
    from models import hf

    cfg, model = tiny(name)
    if not contract.hf_support(models.MODELS[name]):
        with pytest.raises(ConfigError, match=rf"^the {name} family has no Hugging Face layout.*--format safetensors$"):
            hf.save_hf(str(tmp_path / "out"), model)
        assert not (tmp_path / "out").exists()
        return
    hf.save_hf(str(tmp_path), model)
    back_cfg, back = hf.load_hf(str(tmp_path), dataclasses.replace(cfg, vocab_size=None))
    family = models.MODELS[name]
    assert family.hf_config(back_cfg) == family.hf_config(cfg)
    want, got = _leaves(eqx.filter(model, eqx.is_array)), _leaves(eqx.filter(back, eqx.is_array))
    assert set(got) == set(want)
    for path, x in want.items():
        np.testing.assert_array_equal(got[path], x, err_msg=path)
    tokens_BxT = _tokens(cfg, (2, cfg.context_length))
    logits = forward(model, tokens_BxT)  # the same arrays; the config's resolved nulls may change the program
    np.testing.assert_allclose(forward(back, tokens_BxT), logits, rtol=0, atol=logits_atol(cfg, logits))

