"""Optimizer diagnostics (optimizer/diagnostics.py): each `optim/...` value equals a direct NumPy
computation on the optimizer state, the function jits, and the state is found by type through
clipping chains, multi_transform and masks. References here index the state by its known
layout (chain -> PartitionState -> MaskedState -> the group's chain) on purpose: the code under
test must find the same arrays by isinstance."""

from __future__ import annotations

import functools
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, adam_sqrt_v_rtol, eigvalsh_atol, optimizer_update, rounding_rtol, sum_atol
from optax.contrib import MuonState, ProdigyState

import train_jax as T
from models import losses
from models.gpt import GPT, GPTConfig, param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer.adafactor import Adafactor, implied_v
from optimizer.adamw import AdamW
from optimizer.adopt import ADOPT
from optimizer.diagnostics import (
    find_states,
    kth_smallest_nonneg,
    median_nonneg,
    optimizer_metrics,
    state_bytes,
    state_bytes_metric,
)
from optimizer.dion import Dion, DionState
from optimizer.muon import Muon, orthogonality_error, shape_factor
from optimizer.normuon import NeuronNormState, NorMuon
from optimizer.prodigy import Prodigy
from optimizer.shampoo import Shampoo, ShampooState
from utils.parallel import mesh as meshlib

# dim 32: hidden leaves (2, 32, 96), (2, 32, 32), (2, 32, 128), (2, 128, 32); untied head (32, 64).
SMALL = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64, tie_embeddings=False)
GROUPS = ("embed", "head", "hidden", "scalar")


def _setup(cfg, hparams, clip: float | None = 1.0, overrides=None, updates: int = 3, seed: int = 0):
    """(tx, params, labels, [opt_state after 0..updates updates]) with random grads; `cfg` a
    GPTConfig (the GPT's params and labels) or {name: (shape, label)} (a dict of params)."""
    rng = np.random.default_rng(seed)
    if isinstance(cfg, GPTConfig):
        model = eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0))
        labels = param_labels(model)
    else:
        model = {k: jax.ShapeDtypeStruct(shape, jnp.float32) for k, (shape, _) in cfg.items()}
        labels = {k: label for k, (_, label) in cfg.items()}
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    tx = make_optimizer(hparams, optax.constant_schedule(1e-2), labels, clip, 1e-2, overrides or {})
    step = jax.jit(lambda g, s, p: optimizer_update(tx, g, s, p, hparams)[1])
    states = [tx.init(params)]
    for _ in range(updates):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        states.append(step(grads, states[-1], params))
    return tx, params, labels, states


@functools.cache
def _jitted_metrics(hparams, overrides: tuple):
    return jax.jit(lambda s, p: optimizer_metrics(hparams, s, p, {g: dict(o) for g, o in overrides}))


def _metrics(hparams, state, params, overrides=None):
    """optimizer_metrics, jitted once per optimizer and overrides (then per state structure)."""
    frozen = tuple(sorted((g, tuple(sorted(o.items()))) for g, o in (overrides or {}).items()))
    return _jitted_metrics(hparams, frozen)(state, params)


def _group_state(state, group):
    """The known layout of make_optimizer's state: (clip, PartitionState) -> MaskedState."""
    return state[1].inner_states[group].inner_state


def _leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _aligned(tree, params, labels):
    """[(array of `tree`, param, label)] where `tree` (one group's, MaskedNode elsewhere) holds an array."""
    out = []
    jax.tree.map(lambda x, p, label: out.append((np.asarray(x, np.float64), p, label)) if hasattr(x, "shape") else None,
                 tree, params, labels, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return out


def _assert_close(metrics, name, expected, rtol, atol=0.0):
    np.testing.assert_allclose(float(metrics[name]), expected, rtol=rtol, atol=atol, err_msg=name)


# --- the median without a sort ------------------------------------------------------------------


def test_radix_median_equals_numpy_median():
    rng = np.random.default_rng(0)
    median, kth = jax.jit(median_nonneg), jax.jit(kth_smallest_nonneg)
    for n in (1000, 1001):  # even: the mean of the two middle values
        for x in (np.abs(rng.normal(size=n)) * 10.0 ** rng.integers(-30, 4, size=n),  # 1e-30 .. 1e4
                  rng.integers(0, 3, size=n),  # ties
                  np.zeros(n)):
            x = jnp.asarray(x, jnp.float32)
            # an element (odd n) or the mean of two (even n): a sum and a halving, 1 rounding
            np.testing.assert_allclose(median(x), np.median(np.asarray(x, np.float64)), rtol=rounding_rtol(1))
            if n == 1001:
                for k in (0, 1, 500, 999, 1000):
                    assert kth(x, k) == np.sort(np.asarray(x))[k]


# --- AdamW ------------------------------------------------------------------------------------


def test_adamw_sqrt_v_matches_numpy_per_group_with_group_b2():
    overrides = {"embed": {"b2": 0.5}}  # a group's own b2 sets its bias correction
    hp = AdamW(b2=0.9)
    _, params, _, states = _setup(SMALL, hp, overrides=overrides)
    metrics = _metrics(hp, states[-1], params, overrides)
    assert set(metrics) == {f"optim/{g}/sqrt_v_{s}" for g in GROUPS for s in ("min", "median", "max")}
    for group in GROUPS:
        adam = _group_state(states[-1], group)[0]
        assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 3
        b2 = overrides.get(group, {}).get("b2", hp.b2)
        sqrt_v = np.sqrt(np.concatenate([nu.ravel() for nu in _leaves(adam.nu)]) / (1 - b2**3))
        rtol = adam_sqrt_v_rtol(b2, 3)  # the bias correction's float32 rounding, halved by the square root
        _assert_close(metrics, f"optim/{group}/sqrt_v_min", sqrt_v.min(), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_median", np.median(sqrt_v), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_max", sqrt_v.max(), rtol=rtol)


def test_fresh_state_without_clipping_gives_zeros_and_an_empty_group_nothing():
    """count 0 (the step-0 state the first logging step sees): no 0/0 from the bias correction;
    clip=None puts optax.identity() first in the chain, found all the same; a group with no
    leaves (here head, as with tied embeddings) logs nothing."""
    hp = AdamW()
    _, params, _, states = _setup({"w": ((2, 4, 6), "hidden"), "e": ((5, 4), "embed"), "b": ((4,), "scalar")}, hp,
                                  clip=None, updates=0)
    metrics = _metrics(hp, states[0], params)
    assert {k.split("/")[1] for k in metrics} == {"embed", "hidden", "scalar"}
    assert len(metrics) == 9 and all(float(v) == 0.0 for v in metrics.values())


# --- ADOPT, Prodigy, NorMuon --------------------------------------------------------------------


def test_adopt_sqrt_v_is_the_uncorrected_second_moment():
    """ADOPT's v starts at g₀² (no bias correction): √v of the state as it is, per group."""
    hp = ADOPT()
    _, params, _, states = _setup(SMALL, hp)
    metrics = _metrics(hp, states[-1], params)
    for group in GROUPS:
        adopt = _group_state(states[-1], group)[0]
        assert isinstance(adopt, optax.ScaleByAdamState) and int(adopt.count) == 3
        sqrt_v = np.sqrt(np.concatenate([nu.ravel() for nu in _leaves(adopt.nu)]))
        rtol = rounding_rtol(3)  # the square root, and the median's mean of two values (a sum, a halving)
        _assert_close(metrics, f"optim/{group}/sqrt_v_min", sqrt_v.min(), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_median", np.median(sqrt_v), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_max", sqrt_v.max(), rtol=rtol)


def _adam_mini_blocks_numpy(name: str, g: np.ndarray, cfg: GPTConfig) -> tuple[list[np.ndarray], np.ndarray]:
    """Adam-mini's blocks for one GPT leaf, re-derived in float64 from the rules of the authors' code:
    q/k per head, other matrices and the head per output neuron (column), the token embedding per
    token (row), wpe and each norm gain one block, biases Adam. Returns (each block's mean of g²,
    once; the mean each coordinate's block has, shaped as g)."""
    sq = np.asarray(g, np.float64) ** 2
    H, K = cfg.num_heads, cfg.head_dim
    if name == "blocks.attn_qkv.weight_IxO":  # (L, D, 3D), columns (head, q|k|v, K)
        by_head = sq.reshape(*sq.shape[:2], H, 3, K)
        qk, v = by_head[..., :2, :].mean(axis=(1, 4)), by_head[..., 2, :].mean(axis=1)  # (L, H, 2), (L, H, K)
        coords = np.empty_like(by_head)
        coords[..., :2, :] = qk[:, None, :, :, None]
        coords[..., 2, :] = v[:, None]
        return [qk, v], coords.reshape(sq.shape)
    if "bias" in name:
        return [sq], sq
    if name == "wte_VxD" or "gain" in name:
        mean = sq.mean(axis=-1)
        return [mean], np.broadcast_to(mean[..., None], sq.shape)
    if name == "wpe_TxD":
        return [sq.mean()], np.full(sq.shape, sq.mean())
    mean = sq.mean(axis=-2)  # blocks' matrices and head_DxV: one per column
    return [mean], np.broadcast_to(mean[..., None, :], sq.shape)


def test_adam_mini_blocks_and_sqrt_v_match_a_numpy_rederivation():
    """After 3 updates of known gradients (no clipping), the second moment each coordinate is divided
    by (the leaf's stored v broadcast back over the axes its `Blocks` says, as the update does) is
    the EMA at b2 of its block's mean g², re-derived in float64 per the authors' partition (so a wrong block, a block
    averaged over the wrong axis or a missing head split fails), and optim/<group>/sqrt_v_* are the
    min / median / max of √v̂ over the group's blocks, each block counted once."""
    from optimizer.adam_mini import AdamMini, ScaleByAdamMiniState, leaf_blocks

    hp, b2, steps = AdamMini(), AdamMini().b2, 3
    model = eqx.filter_eval_shape(GPT, SMALL, jax.random.PRNGKey(0))
    labels = param_labels(model)
    rng = np.random.default_rng(11)
    draw = lambda: jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    params, grads = draw(), [draw() for _ in range(steps)]
    tx = make_optimizer(hp, optax.constant_schedule(1e-2), labels, None, 1e-2, {})
    state = jax.jit(lambda p, grads: functools.reduce(lambda s, g: tx.update(g, s, p)[1], grads, tx.init(p)))(
        params, grads)  # one program: init and the 3 updates
    metrics = _metrics(hp, state, params)
    dotted = lambda path: ".".join(k.name for k in path if hasattr(k, "name"))  # GPT's field names only
    named = lambda tree: {dotted(path): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}
    ema = lambda per_step: sum((1 - b2) * b2 ** (steps - 1 - s) * x for s, x in enumerate(per_step))
    expected: dict[str, list] = {}
    for name, label in named(labels).items():
        numpy = [_adam_mini_blocks_numpy(name, named(g)[name], SMALL) for g in grads]
        expected.setdefault(label, []).extend(ema(blocks) for blocks in zip(*(b for b, _ in numpy)))
        nu = find_states(_group_state(state, label), ScaleByAdamMiniState)[0]
        [(path, v)] = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(nu.nu) if dotted(p) == name]
        shape = named(params)[name].shape
        blocks = leaf_blocks(label, path, shape, SMALL.head_dim)
        ours = np.broadcast_to(np.expand_dims(np.asarray(v, np.float64), blocks.axes), shape)
        # a float32 mean of <= D·K = 512 squares (sum_atol, relative to the mean), 3 EMA steps (2 roundings each)
        rtol = sum_atol(512, 1.0) + rounding_rtol(2 * steps)
        np.testing.assert_allclose(ours, ema([c for _, c in numpy]), rtol=rtol, err_msg=name)
    for group, blocks in expected.items():
        sqrt_v = np.sqrt(np.concatenate([np.ravel(b) for b in blocks]) / (1 - b2**steps))
        # the EMA's own error (above), halved by the square root, plus the bias correction's
        rtol = sum_atol(512, 1.0) + rounding_rtol(2 * steps) + adam_sqrt_v_rtol(b2, steps)
        _assert_close(metrics, f"optim/{group}/sqrt_v_min", sqrt_v.min(), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_median", np.median(sqrt_v), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_max", sqrt_v.max(), rtol=rtol)


def test_adam_mini_finds_the_query_and_key_heads_of_both_model_families():
    """The head rule reads field names (models/gpt.py's attn_qkv, models/llama.py's q_proj/k_proj):
    renaming one would silently give its heads per-neuron blocks, so each family's leaves are
    classified here against the partition written out by name (Llama with GQA and qk-norm)."""
    from models.llama import Llama, LlamaConfig
    from models.llama import param_labels as llama_labels
    from optimizer.adam_mini import leaf_blocks

    llama = LlamaConfig(dim=32, num_heads=4, num_kv_heads=2, num_blocks=2, context_length=16, vocab_size=64,
                        mlp_hidden=48, qk_norm=True, tie_embeddings=False)
    expected = {
        "gpt": {"wte_VxD": "token", "wpe_TxD": "tensor", "head_DxV": "neuron", "blocks.attn_qkv.weight_IxO": "qkv",
                "blocks.attn_out.weight_IxO": "neuron", "blocks.mlp_in.weight_IxO": "neuron",
                "blocks.mlp_out.weight_IxO": "neuron", "ln_f.gain_D": "tensor", "blocks.ln1.gain_D": "tensor",
                "blocks.ln1.bias_D": "adam", "blocks.attn_qkv.bias_O": "adam"},
        "llama": {"embed_VxD": "token", "head_DxV": "neuron", "blocks.q_proj.weight_IxO": "head",
                  "blocks.k_proj.weight_IxO": "head", "blocks.v_proj.weight_IxO": "neuron",
                  "blocks.o_proj.weight_IxO": "neuron", "blocks.gate_proj.weight_IxO": "neuron",
                  "blocks.down_proj.weight_IxO": "neuron", "blocks.q_norm.gain_D": "tensor",
                  "final_norm.gain_D": "tensor"},
    }
    for family, (build, cfg, label_fn) in {"gpt": (GPT, SMALL, param_labels),
                                           "llama": (Llama, llama, llama_labels)}.items():
        model = eqx.filter_eval_shape(build, cfg, jax.random.PRNGKey(0))
        labels = {".".join(k.name for k in path): label
                  for path, label in jax.tree_util.tree_leaves_with_path(label_fn(model))}
        kinds = {".".join(k.name for k in path): leaf_blocks(labels[".".join(k.name for k in path)], path, x.shape,
                                                             cfg.head_dim)
                 for path, x in jax.tree_util.tree_leaves_with_path(model)}
        for name, kind in expected[family].items():
            assert kinds[name].kind == kind, (family, name, kinds[name])
        assert all(b.head_dim == cfg.head_dim for b in kinds.values() if b.kind in ("head", "qkv"))


def test_prodigy_d_is_each_groups_own_estimate_and_an_empty_group_logs_nothing():
    """optim/<group>/d is the group's d in its state (ProdigyState.estim_lr), one per group (how it
    grows is checked against pytorch_optimizer's, tests/test_parity_adopt_prodigy_normuon.py); a
    group with no leaves (head, as with tied embeddings) logs nothing."""
    hp = Prodigy()
    _, params, _, states = _setup({"w": ((2, 4, 6), "hidden"), "e": ((5, 4), "embed"), "b": ((4,), "scalar")}, hp)
    metrics = _metrics(hp, states[-1], params)
    assert set(metrics) == {"optim/hidden/d", "optim/embed/d", "optim/scalar/d"}
    for group in ("hidden", "embed", "scalar"):
        prodigy_state = find_states(_group_state(states[-1], group), ProdigyState)[0]
        assert float(metrics[f"optim/{group}/d"]) == float(prodigy_state.estim_lr)


def test_normuon_neuron_spread_matches_numpy():
    """neuron_spread: per block of every hidden leaf, max/min of √v over its output neurons."""
    hp = NorMuon()
    _, params, _, states = _setup(SMALL, hp)
    metrics = _metrics(hp, states[-1], params)
    norm_state = find_states(_group_state(states[-1], "hidden"), NeuronNormState)[0]
    spreads = []
    for v in _leaves(norm_state.v):
        root = np.sqrt(v.reshape(-1, v.shape[-1]))
        spreads.extend(root.max(axis=-1) / root.min(axis=-1))
    # two square roots and a division on our side (float64 here): 3 roundings
    _assert_close(metrics, "optim/hidden/neuron_spread_max", max(spreads), rtol=rounding_rtol(3))
    # the mean adds a float32 sum of the blocks' spreads
    _assert_close(metrics, "optim/hidden/neuron_spread_mean", np.mean(spreads),
                  rtol=rounding_rtol(3) + sum_atol(len(spreads), 1.0))
    assert max(spreads) > 1.0
    fresh = _metrics(hp, states[0], params)
    assert float(fresh["optim/hidden/neuron_spread_max"]) == 1.0  # v = 0 before the first update


def test_dion_rank_and_error_feedback_norms_match_numpy():
    """rank_mean: the blocks' mean r (rank_fraction 1/2 of each block's short side: 4 of the stack
    of two 8×12 blocks, 3 of the 6×16 one); ef_norm: per block of every hidden leaf, the Frobenius
    norm of the momentum buffer the update left, nonzero after an update and zero before any."""
    hp = Dion(rank_fraction=0.5)
    cfg = {"w": ((2, 8, 12), "hidden"), "v": ((6, 16), "hidden"), "e": ((16, 8), "embed")}
    _, params, _, states = _setup(cfg, hp)
    metrics = _metrics(hp, states[-1], params)
    dion = find_states(_group_state(states[-1], "hidden"), DionState)[0]
    ranks = [q.shape[-1] for q in _leaves(dion.q) for _ in range(int(np.prod(q.shape[:-2])))]
    norms = [np.linalg.norm(block) for m in _leaves(dion.momentum) for block in m.reshape(-1, *m.shape[-2:])]
    assert sorted(ranks) == [3, 4, 4]
    _assert_close(metrics, "optim/hidden/rank_mean", np.mean(ranks), rtol=rounding_rtol(1))  # 11/3 rounded to float32
    # a norm sums <= 96 float32 squares (sum_atol's γ relative, halved by the root) and the mean
    # adds a sum of the blocks' norms
    n = max(m.shape[-2] * m.shape[-1] for m in _leaves(dion.momentum))
    _assert_close(metrics, "optim/hidden/ef_norm_max", max(norms), rtol=sum_atol(n, 1.0) / 2 + rounding_rtol(1))
    _assert_close(metrics, "optim/hidden/ef_norm_mean", np.mean(norms),
                  rtol=sum_atol(n, 1.0) / 2 + rounding_rtol(1) + sum_atol(len(norms), 1.0))
    assert min(norms) > 0
    assert float(_metrics(hp, states[0], params)["optim/hidden/ef_norm_max"]) == 0.0  # before any update


# --- Muon -------------------------------------------------------------------------------------


def _np_newton_schulz(x, coeffs, steps):
    """optax's quintic Newton–Schulz in float64: Frobenius-normalise, iterate on the wide side."""
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def _np_ortho_error(o):
    k = min(o.shape)
    gram = o @ o.T if o.shape[0] <= o.shape[1] else o.T @ o
    return np.linalg.norm(gram - np.eye(k)) / np.sqrt(k)


def _np_muon_errors(muon_state, steps):
    coeffs = np.asarray(muon_state.ns_coeffs, np.float64)
    return np.array([_np_ortho_error(_np_newton_schulz(block, coeffs, steps))
                     for mu in _leaves(muon_state.mu) for block in mu])


def _with_mu(state, fn):
    """`state` with every Muon momentum leaf replaced by fn(leaf)."""
    return jax.tree.map(lambda s: s._replace(mu=jax.tree.map(fn, s.mu)) if isinstance(s, MuonState) else s,
                        state, is_leaf=lambda x: isinstance(x, MuonState))


def _ortho_error_tol(o):
    """(rtol, atol) of orthogonality_error(O) for one float32 matrix O (as float64) against float64:
    each Gram entry a float32 dot of n terms (sum_atol at Σ|o_ik·o_jk|; a float32 O made from an
    orthogonal float64 one adds its own rounding, inside that margin), − I one rounding more (in the
    margin), ‖·‖_F / √k passes the Gram's error on as at most its Frobenius norm / √k (atol); the norm
    itself sums k² squares (γ_(k²) relative, halved by the square root: rtol)."""
    small = o if o.shape[0] <= o.shape[1] else o.T
    k, n = small.shape
    gram_error = sum_atol(n, np.abs(small) @ np.abs(small).T)
    return sum_atol(k * k, 1.0) / 2, np.linalg.norm(gram_error) / np.sqrt(k)


def test_orthogonality_error_is_zero_for_orthogonal_one_for_zero_and_matches_numpy():
    rng = np.random.default_rng(1)
    for shape in ((3, 8, 20), (3, 20, 8), (2, 12, 12)):
        q = np.stack([np.linalg.qr(rng.normal(size=shape[1:][::-1] if shape[1] < shape[2] else shape[1:]))[0]
                      for _ in range(shape[0])])
        q = np.swapaxes(q, -1, -2) if shape[1] < shape[2] else q
        assert q.shape == shape
        got = orthogonality_error(jnp.asarray(q, jnp.float32))
        for i, b in enumerate(q):
            np.testing.assert_allclose(got[i], 0.0, rtol=0, atol=_ortho_error_tol(b)[1])
        # ‖−I‖_F / √k: a float32 norm and a division by float32 √k, 2 roundings
        np.testing.assert_allclose(orthogonality_error(jnp.zeros(shape)), 1.0, rtol=rounding_rtol(2))
        x = np.asarray(rng.normal(size=shape).astype(np.float32), np.float64)
        got = orthogonality_error(jnp.asarray(x, jnp.float32))
        for i, b in enumerate(x):
            rtol, atol = _ortho_error_tol(b)
            np.testing.assert_allclose(got[i], _np_ortho_error(b), rtol=rtol, atol=atol)


def test_muon_ortho_error_matches_numpy_newton_schulz():
    hp = Muon(ns_steps=5)
    _, params, _, states = _setup(SMALL, hp, updates=2)
    state = states[-1]
    muon = _group_state(state, "hidden")[0]
    assert isinstance(muon, MuonState)

    def check(state, label):
        metrics = _metrics(hp, state, params)
        expected = _np_muon_errors(_group_state(state, "hidden")[0], hp.ns_steps)
        for stat, value in (("mean", expected.mean()), ("max", expected.max())):
            # float32 Newton-Schulz against float64 on the same momentum: per step the Gram (n <= 128
            # terms), its square and the product with X (k = 32 terms each) err by ~(n + 2k)·u ≈ 1.2e-5
            # relative (sum_atol without margin); the quintic passes a relative error on by
            # |σp'(σ)/p(σ)|, 1 for small σ, < 1 in [0.3, 0.9], up to ~5 only near σ = 1.2, where few
            # singular values sit: first order over 5 steps ~5·1.2e-5 on σ, 2σ² ≈ 2x that on σ² − 1:
            # 1e-4 relative with atol 1e-5 for a tiny error. An estimate, not a worst case (that is
            # 5^5 times the per-step error and would bound nothing).
            np.testing.assert_allclose(float(metrics[f"optim/hidden/ortho_err_{stat}"]), value, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{label}: ortho_err_{stat}")
        return metrics, expected

    metrics, _ = check(state, "trained")  # the momentum after two random updates
    assert {k for k in metrics if k.startswith("optim/hidden/")} == {"optim/hidden/ortho_err_mean",
                                                                      "optim/hidden/ortho_err_max"}
    assert {k.split("/")[1] for k in metrics if "sqrt_v" in k} == {"embed", "head", "scalar"}  # AdamW groups

    # An exactly orthogonal momentum: NS maps every singular value, 1/√k after the Frobenius
    # scaling, through the same scalar quintic, so O = c·Q and the error is |c² − 1|, not 0:
    # Muon's coefficients deliberately leave singular values in ~[0.7, 1.2] rather than at 1.
    rng = np.random.default_rng(2)

    def orthogonal(mu):
        _, m, n = mu.shape
        q = np.stack([np.linalg.qr(rng.normal(size=(max(m, n), min(m, n))))[0] for _ in range(mu.shape[0])])
        return jnp.asarray(q if m >= n else np.swapaxes(q, -1, -2), jnp.float32)

    metrics, expected = check(_with_mu(state, orthogonal), "orthogonal")
    c = 1 / np.sqrt(32)  # k = 32 for every hidden leaf of SMALL
    a, b, c5 = np.asarray(muon.ns_coeffs, np.float64)
    for _ in range(hp.ns_steps):
        c = a * c + b * c**3 + c5 * c**5
    # Float64 on both sides: NS of the float32-rounded Q against the scalar recursion. That Q's Gram is
    # I within 2u per entry (u = EPS32/2), so each σ is 1 within k·u (Gershgorin; k = 32), and after
    # the Frobenius scaling (and its 1e-8) within 2k·u + 1e-8/√k of 1/√k, relative; each step passes a
    # relative deviation on by |σp'(σ)/p(σ)| at the scalar iterate; |σ² − 1| moves by 2σ² times it.
    gain, s = 1.0, 1 / np.sqrt(32)
    for _ in range(hp.ns_steps):
        gain *= abs(s * (a + 3 * b * s**2 + 5 * c5 * s**4) / (a * s + b * s**3 + c5 * s**5))
        s = a * s + b * s**3 + c5 * s**5
    ns_atol = 2 * 2 * s**2 * gain * (2 * 32 * EPS32 / 2 + 1e-8 / np.sqrt(32))  # 2x margin
    np.testing.assert_allclose(expected, abs(c**2 - 1), rtol=0, atol=ns_atol)
    # float32 NS of an exactly orthogonal momentum: the estimate of check() above
    np.testing.assert_allclose(float(metrics["optim/hidden/ortho_err_max"]), abs(c**2 - 1), rtol=1e-4)
    assert abs(c**2 - 1) < 0.6  # a bound of the coefficients' design (singular values left in ~[0.7, 1.2])

    # Rank one: NS cannot lift the zero singular values, so the error is ≥ √((k − 1)/k).
    def rank_one(mu):
        b, m, n = mu.shape
        return jnp.asarray(rng.normal(size=(b, m, 1)) * rng.normal(size=(b, 1, n)), jnp.float32)

    metrics, _ = check(_with_mu(state, rank_one), "rank one")
    assert float(metrics["optim/hidden/ortho_err_mean"]) > 0.95


# --- Shampoo ----------------------------------------------------------------------------------


def _np_spectrum(stats, param_shape, side, eps):
    """(λmin, λmax, damped cond) of every block's true (unpadded) sub-block, float64."""
    m, n = param_shape[-2:]
    b = stats.shape[-1]
    out = []
    for index in np.ndindex(*stats.shape[:-2]):
        r, c = index[-2], index[-1]
        true = min(b, (m - r * b) if side == "left" else (n - c * b))
        eig = np.linalg.eigvalsh(stats[index][:true, :true])
        lam_min, lam_max = max(eig[0], 0.0), eig[-1]
        out.append((lam_min, lam_max, (1 + eps) / (lam_min / lam_max + eps) if lam_max > 0 else 1.0))
    return out


def test_shampoo_eigenvalues_match_numpy_eigvalsh_of_the_statistics():
    # block 16: 20 = 16 + 4 and 30 = 16 + 14, so padded blocks on both sides (the padding's zero
    # eigenvalues must be left out). epsilon 1e-3: a condition number checkable against float64
    # (at 1e-6 float32 eigh noise on λmin, ~1e-7·λmax, moves it by ~10%); one group overrides it.
    overrides = {"head": {"precondition_eps": 1e-2}}
    hp = Shampoo(block_size=16, precondition_eps=1e-3)
    shapes = {"w": ((2, 20, 30), "hidden"), "w2": ((2, 30, 12), "hidden"), "head": ((30, 20), "head"),
              "wte": ((40, 20), "embed"), "b": ((20,), "scalar")}
    # 6 updates: every true sub-block has full rank (a 16-row block of a gradient with 4 columns
    # needs 4 updates), so each group's true λmin is > 0 while its padded blocks have λ = 0.
    _, params, labels, states = _setup(shapes, hp, overrides=overrides, updates=6)
    metrics = _metrics(hp, states[-1], params, overrides)
    stat_names = ("stats_eig_min", "stats_eig_max", "stats_cond_max", "stats_cond_median", "steps_since_roots")
    assert set(metrics) == {f"optim/{g}/{s}" for g in ("embed", "head", "hidden") for s in stat_names}
    for group in ("embed", "head", "hidden"):
        shampoo = _group_state(states[-1], group)[0]
        assert isinstance(shampoo, ShampooState)
        eps = overrides.get(group, {}).get("precondition_eps", hp.precondition_eps)
        blocks = []
        for side, tree in (("left", shampoo.left_stats), ("right", shampoo.right_stats)):
            for stats, param, label in _aligned(tree, params, labels):
                assert label == group
                if stats.size:
                    blocks += _np_spectrum(stats, param.shape, side, eps)
        lam_min, lam_max, cond = (np.array(x) for x in zip(*blocks))
        scale = lam_max.max()
        # float32 eigh of the same float32 16x16 blocks: each eigenvalue within eigvalsh_atol of its
        # block's λmax (<= scale); cond = (1 + eps)/(λmin/λmax + eps) moves by Δ(λmin/λmax) (<= 2x that,
        # relative to the block's λmax) over a denominator >= eps, plus its own 3 roundings
        _assert_close(metrics, f"optim/{group}/stats_eig_max", scale, rtol=0, atol=eigvalsh_atol(16, scale))
        _assert_close(metrics, f"optim/{group}/stats_eig_min", lam_min.min(), rtol=0, atol=eigvalsh_atol(16, scale))
        cond_rtol = 2 * eigvalsh_atol(16, 1.0) / eps + rounding_rtol(3)
        _assert_close(metrics, f"optim/{group}/stats_cond_max", cond.max(), rtol=cond_rtol)
        _assert_close(metrics, f"optim/{group}/stats_cond_median", np.median(cond), rtol=cond_rtol)
        assert lam_min.min() > 1e-4 * scale  # the padding's zero eigenvalues were left out


def test_shampoo_steps_since_roots_follows_the_recompute_interval():
    """Counted against when the cached roots actually change (a recompute), not the formula."""
    hp = Shampoo(block_size=64, precondition_every=3, start_preconditioning_step=2)
    _, params, _, states = _setup({"w": ((2, 4, 6), "hidden"), "e": ((5, 4), "embed")}, hp, updates=8)
    last, previous, seen = None, None, []
    for k, state in enumerate(states):
        roots = _leaves(_group_state(state, "hidden")[0].left_roots)
        if k and any(not np.array_equal(a, b) for a, b in zip(roots, previous)):
            last = k
        previous = roots
        metrics = _metrics(hp, state, params)
        seen.append(int(metrics["optim/hidden/steps_since_roots"]))
        assert seen[-1] == (-1 if last is None else k - last), (k, seen)
        assert int(metrics["optim/embed/steps_since_roots"]) == seen[-1]
    assert seen == [-1, -1, 0, 1, 2, 0, 1, 2, 0]


# --- Adafactor --------------------------------------------------------------------------------


ADAFACTOR_PARAMS = {"qkv": ((2, 128, 192), "hidden"), "down": ((2, 256, 128), "hidden"),  # stacked, factored
                    "wte": ((128, 128), "embed"),  # factored
                    "wpe": ((16, 128), "embed"), "bias": ((128,), "scalar")}  # not factored (a side < 128)


def test_adafactor_sqrt_v_of_the_factored_second_moment_matches_numpy():
    hp = Adafactor()
    _, params, labels, states = _setup(ADAFACTOR_PARAMS, hp, updates=2)
    metrics = _metrics(hp, states[-1], params)
    assert set(metrics) == {f"optim/{g}/sqrt_v_{s}" for g in ("embed", "hidden", "scalar")
                            for s in ("min", "median", "max")}
    factored = 0
    for group in ("embed", "hidden", "scalar"):
        fs = _group_state(states[-1], group)[0]
        assert isinstance(fs, optax.FactoredState)
        vs = []
        rows, cols = _aligned(fs.v_row, params, labels), _aligned(fs.v_col, params, labels)
        for (r, _, _), (c, _, _), (v, p, label) in zip(rows, cols, _aligned(fs.v, params, labels), strict=True):
            assert label == group
            if v.shape == p.shape:
                vs.append(v)
                continue
            factored += 1
            if p.shape[-1] >= p.shape[-2]:  # v_row: per row (axis -2), v_col: per column
                vs.append(r[..., :, None] * c[..., None, :] / r.mean(-1)[..., None, None])
            else:  # the largest axis is -2: v_row lacks it (so is per column), v_col is per row
                vs.append(c[..., :, None] * r[..., None, :] / r.mean(-1)[..., None, None])
        sqrt_v = np.sqrt(np.concatenate([v.ravel() for v in vs]))
        # float32 v_row ⊗ v_col / mean(v_row): the mean of <= 256 positive terms (sum_atol relative to
        # itself), a division and a product (2 roundings); the square root halves that and rounds once
        rtol = (sum_atol(256, 1.0) + rounding_rtol(2)) / 2 + rounding_rtol(1)
        _assert_close(metrics, f"optim/{group}/sqrt_v_min", sqrt_v.min(), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_median", np.median(sqrt_v), rtol=rtol)
        _assert_close(metrics, f"optim/{group}/sqrt_v_max", sqrt_v.max(), rtol=rtol)
    assert factored == 3


def test_adafactor_implied_v_is_what_the_update_divides_by():
    """u = g / √v for optax's own factored update: the reconstruction, checked without its formula."""
    rng = np.random.default_rng(5)
    params = {k: jnp.asarray(rng.normal(size=shape), jnp.float32) for k, (shape, _) in ADAFACTOR_PARAMS.items()}
    tx = optax.scale_by_factored_rms()

    @jax.jit
    def two_updates(grads1, grads2):
        state = tx.init(params)
        _, state = tx.update(grads1, state, params)
        updates, state = tx.update(grads2, state, params)
        return updates, {k: implied_v(state.v_row[k], state.v_col[k], state.v[k], p.shape) for k, p in params.items()}

    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
    updates, v = two_updates(*grads)
    # two float32 reconstructions of v (optax's, implied_v's: each a mean of <= 256 positive terms and 2
    # roundings, see the sqrt_v test), halved by the square root, plus the √ and the division on each side
    rtol = sum_atol(256, 1.0) + rounding_rtol(2) + 2 * rounding_rtol(2)
    for k in params:
        np.testing.assert_allclose(updates[k], grads[1][k] / jnp.sqrt(v[k]), rtol=rtol, err_msg=k)


# --- every optimizer ----------------------------------------------------------------------------


# Every optim/<group>/<stat> of the untied GPT, per optimizer: a stable interface (dashboards and
# comparisons read them), so a change must be intended. `python tests/test_golden.py --write NAME`
# writes an optimizer's row (with its golden losses); tests/data/golden_diagnostics.json holds them.
NAMES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_diagnostics.json")
with open(NAMES_FILE, encoding="utf-8") as _f:
    NAMES: dict[str, dict[str, list[str]]] = json.load(_f)


def diagnostic_names(name: str) -> dict[str, list[str]]:
    """{group: its stats, sorted} that optimizer `name`'s diagnostics give on the untied GPT (traced, not run)."""
    hp = OPTIMIZERS[name]()
    _, params, _, states = _setup(SMALL, hp, updates=0)
    shapes = jax.eval_shape(lambda s, p: optimizer_metrics(hp, s, p), states[0], params)
    assert all(x.shape == () for x in shapes.values()), name
    out: dict[str, list[str]] = {}
    for key in shapes:
        _, group, stat = key.split("/", 2)
        out.setdefault(group, []).append(stat)
    return {g: sorted(stats) for g, stats in sorted(out.items())}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_bytes_is_the_sum_of_leaf_nbytes_and_names_are_stable(name):
    hp = OPTIMIZERS[name]()
    tx, params, _, states = _setup(SMALL, hp, updates=0)
    expected = sum(np.asarray(x).nbytes for x in jax.tree.leaves(states[0]))
    assert state_bytes(states[0]) == expected > 0
    assert state_bytes(jax.eval_shape(tx.init, params)) == expected  # shapes alone suffice
    assert state_bytes_metric(states[0]) == {"optim/state_bytes": expected}
    # traced on the GPT's own tree (the state lined up with an Equinox module of params), not run
    assert name in NAMES, f"no diagnostics names for {name}: run `python tests/test_golden.py --write {name}`"
    assert diagnostic_names(name) == {g: sorted(stats) for g, stats in NAMES[name].items() if stats}, (
        f"{name}'s optim/<group>/<stat> names changed: if intended, `python tests/test_golden.py --write {name}` "
        "and say so in the commit message")


# --- through the train step: the state this update used and left --------------------------------


def _through_the_step(tiny_run, *overrides, steps: int = 3):
    """Logging steps of the tiny GPT with its default metrics (optim diagnostics on, the aux
    buffers off) on batches holding every token (no embedding row with a zero gradient). Per
    step: (metrics, grads, updates, opt_state after), the gradient and the update recomputed here
    with the run's own `tx` from a copy of the state the step started from."""
    run = tiny_run("logging.log_callback_data=true", "logging.store_last_params=false",
                   "logging.store_last_grads=false", "logging.store_past_grads=false",
                   "train.gradient_clip_val=null", "optimizer/lr_config=constant", "optimizer.lr_config.warmup=0",
                   *overrides)
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, tx, state, step = T.init_training(run, mesh)
    grad_fn = eqx.filter_jit(eqx.filter_grad(lambda m, t: losses.loss_fn(m, t, None, "float32")[0]))
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        batch = rng.permutation(np.arange(8 * 17) % 64).reshape(1, 8, 17).astype(np.int32)
        model, opt_state = jax.tree.map(jnp.copy, (eqx.filter(state.model, eqx.is_array), state.opt_state))
        state, metrics = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), True)  # donates
        grads = grad_fn(eqx.combine(model, state.model), jnp.asarray(batch[0]))
        updates, _ = update(grads, opt_state, model)
        out.append(({k: float(v) for k, v in metrics.items()}, grads, updates,
                    jax.tree.map(jnp.copy, state.opt_state)))
    return run, param_labels(state.model), out


@pytest.mark.slow  # a train step of an optimizer outside helpers.QUICK_OPTIMIZERS
def test_shampoo_steps_since_roots_through_the_step_counts_the_logged_update(tiny_run):
    """Roots recomputed on updates 1, 4, 7, ... (precondition_every 3): steps 1-5 log 0, 1, 2, 0, 1
    (the state before the update would say -1, 0, 1, 2, 0), checked against when the roots in the
    step's own state changed."""
    _, _, steps = _through_the_step(tiny_run, "optimizer=shampoo", "optimizer.precondition_every=3",
                                    "optimizer.start_preconditioning_step=1", "optimizer.lr_config.lr=1e-3",
                                    steps=5)
    seen, last, previous = [], None, None
    for k, (metrics, _, _, opt_state) in enumerate(steps, start=1):
        roots = _leaves(_group_state(opt_state, "hidden")[0].left_roots)
        if k == 1 or any(not np.array_equal(a, b) for a, b in zip(roots, previous)):  # update 1 makes the first
            last = k
        previous = roots
        seen.append(int(metrics["optim/hidden/steps_since_roots"]))
        assert seen[-1] == k - last, (k, seen)
    assert seen == [0, 1, 2, 0, 1]


def test_adam_sqrt_v_is_the_denominator_the_logged_update_divided_by(tiny_run):
    """b1 = 0, no weight decay: Adam's update is -lr·g/(√v̂ + eps), so each element's √v̂ is
    lr·g/(−u) − eps, read off the update itself. Its min/median/max per group at every step must be
    what that step logged (before the fix: step 1 logged the fresh state's zeros, later steps the
    previous step's √v̂). float32: u and g carry ~1e-7 relative error, so √v̂ ~(√v̂ + eps)·1e-6."""
    run, labels, steps = _through_the_step(tiny_run, "optimizer=adamw", "optimizer.b1=0.0",
                                           "optimizer.weight_decay=0.0", "optimizer.lr_config.lr=1e-2")
    eps, b2 = run.optimizer.hparams.eps, run.optimizer.hparams.b2
    for k, (metrics, grads, updates, _) in enumerate(steps, start=1):
        by_group: dict[str, list] = {}
        for g, u, label in zip(jax.tree.leaves(grads), jax.tree.leaves(updates), jax.tree.leaves(labels), strict=True):
            g, u = np.asarray(g, np.float64).ravel(), np.asarray(u, np.float64).ravel()
            # Every token is in the batch: no zero row. An element can still be exactly 0 (a key bias's
            # gradient is 0 up to rounding: softmax ignores a shift of every score), and there u = 0
            # says nothing of √v̂: those few are left out.
            # u = 0 says nothing of √v̂: such an element is read as unknown, bounded by -inf and +inf below.
            known = g != 0
            assert known.mean() > 0.9, label
            recovered = np.where(known, metrics[f"train/lr/{label}"] * g / np.where(known, -u, 1.0) - eps, np.nan)
            by_group.setdefault(label, []).append(recovered)
        assert {"hidden", "embed", "scalar"} <= set(by_group) <= set(GROUPS)
        for group, parts in by_group.items():
            sqrt_v = np.concatenate(parts)
            low, high = np.nan_to_num(sqrt_v, nan=-np.inf), np.nan_to_num(sqrt_v, nan=np.inf)
            # the logged √v̂ and the update's each carry a float32 bias correction (adam_sqrt_v_rtol);
            # the recovered one √v̂ + eps = lr·g/(−u) carries the update's √, + eps, ÷, × lr and its own
            # ×, ÷ (6 roundings) of √v̂ + eps, which subtracting eps leaves as they were (absolute)
            rtol = 2 * adam_sqrt_v_rtol(b2, k)
            for stat, fn in (("min", np.min), ("median", np.median), ("max", np.max)):
                logged, bounds = metrics[f"optim/{group}/sqrt_v_{stat}"], sorted((fn(low), fn(high)))
                finite = [b for b in bounds if np.isfinite(b)]
                slack = rtol * max(finite) + rounding_rtol(6) * (max(finite) + eps)
                if bounds[0] == bounds[1]:  # every element known: equal within the rounding above
                    np.testing.assert_allclose(logged, bounds[0], rtol=rtol, atol=rounding_rtol(6) * (bounds[0] + eps),
                                               err_msg=f"step {k}: {group} sqrt_v_{stat}")
                else:  # an unknown element moves the statistic at most to its neighbour
                    assert bounds[0] - slack <= logged <= bounds[1] + slack, (k, group, stat, logged, bounds)


def test_muon_ortho_error_is_that_of_the_logged_update(tiny_run):
    """Without Nesterov, Muon's hidden update is -lr·shape_factor·NS(momentum after this step), so
    the orthogonality error of u/(−lr·factor), block by block, is what the step must log (before the
    fix: the previous momentum's, 1.0 at step 1 from the zero momentum)."""
    run, labels, steps = _through_the_step(tiny_run, "optimizer=muon", "optimizer.nesterov=false",
                                           "optimizer.weight_decay=0.0", "optimizer.lr_config.lr=2e-2", steps=2)
    for k, (metrics, _, updates, _) in enumerate(steps, start=1):
        lr = metrics["train/lr/hidden"]
        errs = np.concatenate([
            np.asarray(orthogonality_error(u / (-lr * shape_factor(u.shape, run.optimizer.hparams.shape_scale))))
            for u, label in zip(jax.tree.leaves(updates), jax.tree.leaves(labels), strict=True) if label == "hidden"])
        assert errs.size == 8  # 4 stacked hidden leaves x 2 blocks
        # float32 Newton-Schulz of a gradient recomputed outside the step: ~1e-5 relative
        np.testing.assert_allclose(metrics["optim/hidden/ortho_err_mean"], errs.mean(), rtol=1e-3, err_msg=f"step {k}")
        # the same for the max: ~1e-5 estimated, 100x room
        np.testing.assert_allclose(metrics["optim/hidden/ortho_err_max"], errs.max(), rtol=1e-3, err_msg=f"step {k}")


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_ortho_error_describes_the_matrix_the_update_orthogonalised(nesterov):
    """The Newton–Schulz output the update used, read off the update itself (no weight decay, a
    constant lr: O = −u / (lr · shape factor)), has the logged orthogonality error. With Nesterov
    that is NS of the momentum blended with the step's (clipped) gradient, not NS of the momentum:
    a first gradient of rank one leaves a momentum near rank one, which the second gradient's
    blend lifts, so the two errors are far apart. The gradients' norm is above the clip, so the
    diagnostic must clip them as the update did."""
    lr, shape, clip = 1e-2, (2, 16, 24), 1.0
    hp = Muon(nesterov=nesterov, weight_decay=0.0)
    labels = {"w": "hidden", "b": "scalar"}
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32), "b": jnp.asarray(rng.normal(size=16),
                                                                                     jnp.float32)}
    tx = make_optimizer(hp, optax.constant_schedule(lr), labels, clip, lr, {})
    state = tx.init(params)
    rank_one = rng.normal(size=(2, 16, 1)) * rng.normal(size=(2, 1, 24))
    for g_w in (10 * rank_one, rng.normal(size=shape)):
        grads = {"w": jnp.asarray(g_w, jnp.float32), "b": jnp.asarray(rng.normal(size=16), jnp.float32)}
        updates, state = jax.jit(tx.update)(grads, state, params)
    o = -np.asarray(updates["w"], np.float64) / (lr * shape_factor(shape, hp.shape_scale))
    want = np.array([_np_ortho_error(block) for block in o])
    metrics = jax.jit(lambda s, p, g: optimizer_metrics(hp, s, p, None, g, clip))(state, params, grads)
    # Both float32 Newton–Schulz of the same input (the check() estimate of
    # test_muon_ortho_error_matches_numpy_newton_schulz bounds float32 against float64 by 1e-4 relative,
    # atol 1e-5); O read off the update adds 2 roundings (÷ lr, ÷ factor), far inside that.
    ns_rtol, ns_atol = 1e-4, 1e-5
    np.testing.assert_allclose(float(metrics["optim/hidden/ortho_err_max"]), want.max(), rtol=ns_rtol, atol=ns_atol)
    np.testing.assert_allclose(float(metrics["optim/hidden/ortho_err_mean"]), want.mean(), rtol=ns_rtol, atol=ns_atol)
    momentum_alone = _np_muon_errors(_group_state(state, "hidden")[0], hp.ns_steps)
    if nesterov:  # the case tells the blend from the momentum alone, and the clipped gradient from the raw one
        assert abs(momentum_alone.mean() - want.mean()) > 100 * (ns_rtol * want.mean() + ns_atol)
        unclipped = float(optimizer_metrics(hp, state, params, None, grads, None)["optim/hidden/ortho_err_mean"])
        assert abs(unclipped - want.mean()) > 100 * (ns_rtol * want.mean() + ns_atol)
    else:
        np.testing.assert_allclose(momentum_alone.mean(), want.mean(), rtol=ns_rtol, atol=ns_atol)
