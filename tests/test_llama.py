"""models/llama.py: the forward pass against a float64 NumPy re-derivation (grouped-query attention
as explicit repeat-kv multi-head attention, rotary as complex rotation), causality, packed documents,
remat equivalence, dropout, parameter groups, FLOPs, bad knobs, the Hugging Face tensor mapping's round
trip, a short run through train_jax.train, golden losses, and 8 devices == 1. (Scan = unrolled =
block-causal runs for every family in tests/test_model_contract.py.)

Tolerances: the models are 2 blocks of dim 32 (dot products of <= 96 terms) with O(0.1-1) logits, so
float32 rounding is ~sqrt(96)·EPS32 ≈ 1.2e-6 of the values' scale (ROUNDING); logits_atol, 8 ROUNDING ≈
80 EPS32 of the logits' scale (1e-5 at scale 1), leaves ~8x room, while every bug the tests target (a
wrong kv head, a rotary off by one position, a norm gain dropped) moves logits by > 1e-3.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import background
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, ShardedCheck, compose_config
from test_golden import RTOL

import models
import train_jax as T
from models import llama
from models.layers import REMAT_POLICIES
from models.losses import cross_entropy
from utils.config import validate
from utils.errors import CheckpointError, ConfigError
from utils.parallel import mesh as meshlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = llama.LlamaConfig(dim=32, num_heads=4, num_kv_heads=2, num_blocks=2, context_length=16, vocab_size=64,
                        mlp_multiple=32)  # mlp width int(8/3·32) = 85 -> 96
# Every option on: qkv biases (Qwen2), QK-norm, an untied head, one kv head for all four query heads.
FULL_CFG = dataclasses.replace(CFG, num_kv_heads=1, qkv_bias=True, qk_norm=True, tie_embeddings=False,
                               rope_theta=500.0)
T_ = CFG.context_length
ROUNDING = math.sqrt(96) * EPS32  # see the module docstring
GRAD_ROUNDING = (math.sqrt(64) + math.sqrt(96)) * EPS32  # backward: also summed over a batch's 64 tokens


def scale(x) -> float:
    """The largest magnitude in x: the scale a float32 sum's rounding is relative to."""
    return float(np.abs(np.asarray(x)).max())


def logits_atol(want) -> float:
    """See the module docstring: each of two computations within ROUNDING of the exact logits, 4x."""
    return 8 * ROUNDING * scale(want)


@functools.lru_cache(maxsize=None)
def build(cfg: llama.LlamaConfig, seed: int = 0) -> llama.Llama:
    """A model whose norm gains and biases are random too (at init they are 1 and 0, which would
    hide a gain or bias applied in the wrong place)."""
    model = eqx.filter_jit(llama.Llama)(cfg, jax.random.PRNGKey(seed))
    labels = jax.tree.leaves(llama.param_labels(model))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape) if label == "scalar" else x
              for x, k, label in zip(leaves, keys, labels, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def with_cfg(model: llama.Llama, cfg: llama.LlamaConfig) -> llama.Llama:
    """`model`'s weights under another config that changes execution flags, not shapes."""
    treedef = jax.tree.structure(eqx.filter_eval_shape(llama.Llama, cfg, jax.random.PRNGKey(0)))
    return jax.tree.unflatten(treedef, jax.tree.leaves(model))


forward = eqx.filter_jit(lambda model, tokens_BxT, key=None, segment_ids_BxT=None, causal=True:
                         model(tokens_BxT, key=key, segment_ids_BxT=segment_ids_BxT, causal=causal))
loss_and_grads = eqx.filter_jit(eqx.filter_value_and_grad(cross_entropy, has_aux=True))


def _tokens(shape, vocab=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


# --- a float64 NumPy re-derivation ----------------------------------------------------------------


def np_rms_norm(x, gain, eps):
    return gain * x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps)


def np_llama3_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency rule as Meta's reference code writes it (llama/model.py `apply_scaling`,
    a loop over frequencies in float64), independent of transformers' vectorised form."""
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def np_yarn_scaling(freqs, K, theta, s, old):
    """YaRN's rule (Peng et al. 2023, sec. 3.2, as transformers rounds its range) in float64: pair i
    turns r_i = old·f_i/2π times in the original context; the pair indices where r = beta_fast and
    r = beta_slow (solved for i, floored/ceiled with truncate) bound a linear ramp γ from 0 (kept)
    to 1 (divided by factor)."""
    def index_turning(rotations):  # solve old·theta^(-2i/K) / 2π = rotations for i
        return np.log(old / (2 * np.pi * rotations)) / np.log(theta) * K / 2

    lo, hi = index_turning(s.beta_fast), index_turning(s.beta_slow)
    if s.truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0), min(hi, K - 1)
    gamma = np.clip((np.arange(K // 2) - lo) / (hi - lo if hi > lo else 0.001), 0, 1)
    return freqs * (1 - gamma) + freqs / s.factor * gamma


def np_inv_freq(K, theta, scaling=None, context_length=None, seq_len=None):
    """The K/2 rotary frequencies in float64: theta^(-2i/K), divided by factor (linear), by Llama 3.1's
    rule, by YaRN's, or (dynamic, a forward of seq_len > old positions) with theta raised to
    theta·(factor·seq_len/old − factor + 1)^(K/(K−2)) (NTK-aware: the lowest frequency is stretched
    by about that bracket, the highest kept)."""
    freqs = theta ** (-2.0 * np.arange(K // 2) / K)
    if scaling is None:
        return freqs
    if scaling.type == "linear":
        return freqs / scaling.factor
    old = scaling.original_context_length or context_length
    if scaling.type == "yarn":
        return np_yarn_scaling(freqs, K, theta, scaling, old)
    if scaling.type == "dynamic":
        if seq_len is None or seq_len <= old:
            return freqs
        grown = theta * (scaling.factor * seq_len / old - scaling.factor + 1) ** (K / (K - 2))
        return grown ** (-2.0 * np.arange(K // 2) / K)
    return np_llama3_scaling(freqs, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, old)


def np_attention_factor(s) -> float:
    """yarn's cos/sin factor, YaRN's sqrt(1/t) = 0.1·ln(s) + 1 (or DeepSeek's ratio of two mscales)."""
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale is not None:
        return (0.1 * s.mscale * np.log(s.factor) + 1) / (0.1 * s.mscale_all_dim * np.log(s.factor) + 1)
    return 0.1 * np.log(s.factor) + 1 if s.factor > 1 else 1.0


def np_rotary(x_HxTxK, positions_T, theta, freqs=None):
    """Rotary as complex multiplication: the pair (x_i, x_{i+K/2}) is the number x_i + j·x_{i+K/2},
    turned by pos·theta^(-2i/K) or pos·freqs[i] (Hugging Face's rotate-half pairing, derived independently)."""
    K = x_HxTxK.shape[-1]
    half = K // 2
    angle_TxH = positions_T[:, None] * (theta ** (-2.0 * np.arange(half) / K) if freqs is None else freqs)
    z = (x_HxTxK[..., :half] + 1j * x_HxTxK[..., half:]) * np.exp(1j * angle_TxH)
    return np.concatenate([z.real, z.imag], -1)


def np_forward(model: llama.Llama, tokens_T, segment_ids_T=None, causal=True, stats=None) -> np.ndarray:
    """Logits of one sequence; grouped-query attention written as multi-head attention over
    key/value heads repeated group-wise (query head h reads kv head h // (H/G)). `stats`, a dict of
    lists, gets each block's attention output, MLP output and stream after the block."""
    cfg, W = model.cfg, jax.tree.map(lambda a: np.asarray(a, np.float64), model)
    H, G, K, T = cfg.num_heads, cfg.kv_heads, cfg.head_dim, len(tokens_T)
    seg_T = np.zeros(T, int) if segment_ids_T is None else np.asarray(segment_ids_T)
    pos_T = np.array([t - np.flatnonzero(seg_T[: t + 1] != seg_T[t]).max(initial=-1) - 1 for t in range(T)], float)
    visible_TxT = (seg_T[:, None] == seg_T[None, :]) & (np.tril(np.ones((T, T), bool)) if causal else True)
    x = W.embed_VxD[tokens_T]
    b = W.blocks

    def proj(p, i, h):
        return h @ p.weight_IxO[i] + (0 if p.bias_O is None else p.bias_O[i])

    for i in range(cfg.num_blocks):
        h = np_rms_norm(x, b.attn_norm.gain_D[i], cfg.norm_eps)
        q = proj(b.q_proj, i, h).reshape(T, H, K).transpose(1, 0, 2)
        k = proj(b.k_proj, i, h).reshape(T, G, K).transpose(1, 0, 2)
        v = proj(b.v_proj, i, h).reshape(T, G, K).transpose(1, 0, 2)
        if cfg.qk_norm:
            q, k = np_rms_norm(q, b.q_norm.gain_D[i], cfg.norm_eps), np_rms_norm(k, b.k_norm.gain_D[i], cfg.norm_eps)
        freqs = np_inv_freq(K, cfg.rope_theta, cfg.rope_scaling, cfg.context_length, seq_len=T)
        q, k = np_rotary(q, pos_T, cfg.rope_theta, freqs), np_rotary(k, pos_T, cfg.rope_theta, freqs)
        q, k = q * np_attention_factor(cfg.rope_scaling), k * np_attention_factor(cfg.rope_scaling)
        k, v = np.repeat(k, H // G, axis=0), np.repeat(v, H // G, axis=0)
        s = np.where(visible_TxT, q @ k.transpose(0, 2, 1) / math.sqrt(K), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        a = (p / p.sum(-1, keepdims=True)) @ v
        attn = proj(b.o_proj, i, a.transpose(1, 0, 2).reshape(T, H * K))
        x = x + attn
        h = np_rms_norm(x, b.mlp_norm.gain_D[i], cfg.norm_eps)
        gate = proj(b.gate_proj, i, h)
        mlp = proj(b.down_proj, i, gate / (1 + np.exp(-gate)) * proj(b.up_proj, i, h))
        x = x + mlp
        for name, value in (("attn", attn), ("mlp", mlp), ("resid", x)) if stats is not None else ():
            stats.setdefault(name, []).append(value)
    x = np_rms_norm(x, W.final_norm.gain_D, cfg.norm_eps)
    return x @ (W.embed_VxD.T if W.head_DxV is None else W.head_DxV)


# Qwen3's shape (QK-norm, head size 16 apart from dim/heads = 8) with Llama 3.2's rotary factors; theta
# 500 and original context 32 put the 8 frequencies' wavelengths (6.3 ... 664) in all three of llama3's
# bands (under 32/4, between, over 32/1).
QWEN3_LLAMA3_CFG = dataclasses.replace(CFG, qk_norm=True, head_size=16, rope_theta=500.0,
                                       rope_scaling=llama.RopeScaling("llama3", 32.0, 1.0, 4.0, 32))


# yarn (factor 4 over an original context of 8, theta 500, head 8: pairs kept, blended and divided)
# and dynamic (original 8, so a 16-token row grows the base), each over the model's 16 positions.
YARN_CFG = dataclasses.replace(FULL_CFG, qk_norm=False, rope_scaling=llama.RopeScaling(
    "yarn", 4.0, original_context_length=8, beta_fast=4.0))
DYNAMIC_CFG = dataclasses.replace(CFG, rope_scaling=llama.RopeScaling("dynamic", 2.0, original_context_length=8))


@pytest.mark.parametrize("cfg", [CFG, FULL_CFG, QWEN3_LLAMA3_CFG, YARN_CFG, DYNAMIC_CFG],
                         ids=["gqa", "bias_qknorm_untied_mqa", "qknorm_head16_llama3", "qwen2_yarn", "dynamic"])
def test_logits_equal_a_numpy_repeat_kv_reference(cfg):
    model = build(cfg)
    tokens_BxT = _tokens((2, T_), seed=3)
    got_BxTxV = np.asarray(forward(model, jnp.asarray(tokens_BxT)))
    want_BxTxV = np.stack([np_forward(model, row) for row in tokens_BxT])
    assert 0.1 < np.abs(want_BxTxV).max() < 10  # the O(1) scale the docstring assumes
    np.testing.assert_allclose(got_BxTxV, want_BxTxV, rtol=0, atol=logits_atol(want_BxTxV))


@pytest.mark.parametrize("scaling", [llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                                     llama.RopeScaling("llama3", 32.0, 2.0, 3.0, None),
                                     llama.RopeScaling("linear", 4.0)], ids=["llama3.1", "llama3_null_original",
                                                                             "linear"])
def test_scaled_frequencies_match_metas_rule(scaling):
    """Llama 3.1's frequencies (head size 128, theta 500000: every band of the rule is populated) and
    a null original context (model.context_length, 2048, stands in) against the float64 loop."""
    K, theta, context = 128, 500000.0, 2048
    got = np.asarray(llama.rotary_inv_freq(K, theta, scaling, context))
    want = np_inv_freq(K, theta, scaling, context)
    if scaling.type == "llama3":
        wavelen = 2 * math.pi / np_inv_freq(K, theta)
        old = scaling.original_context_length or context
        kept, divided = wavelen < old / scaling.high_freq_factor, wavelen > old / scaling.low_freq_factor
        assert kept.any() and divided.any() and (~kept & ~divided).any()
    # float32 against float64: the power theta^(-2i/K) errs by ~(its exponent's size, <= ln(500000) = 13)
    # ulps, the division and llama3's blend (wavelength, smooth factor, two products, a sum) by 8 roundings
    # more: (13 + 8)·EPS32 relative, 2x.
    np.testing.assert_allclose(got, want, rtol=2 * (13 + 8) * EPS32, atol=0)


@pytest.mark.parametrize("scaling, seq_len", [
    (llama.RopeScaling("yarn", 4.0, original_context_length=2048), 8192),
    (llama.RopeScaling("yarn", 8.0, original_context_length=1024, beta_fast=16.0, beta_slow=2.0, truncate=False,
                       mscale=0.707, mscale_all_dim=1.0), 8192),
    (llama.RopeScaling("dynamic", 2.0, original_context_length=2048), 8192),
    (llama.RopeScaling("dynamic", 2.0, original_context_length=2048), 2048),
], ids=["yarn", "yarn_knobs", "dynamic_past", "dynamic_within"])
def test_yarn_and_dynamic_frequencies_match_a_float64_derivation(scaling, seq_len):
    """Head size 128, theta 500000, a forward of seq_len positions: yarn's three parts (kept,
    blended, divided) are all populated; dynamic grows only past the original context."""
    K, theta = 128, 500000.0
    got = np.asarray(llama.rotary_inv_freq(K, theta, scaling, 2048, seq_len=seq_len))
    want = np_inv_freq(K, theta, scaling, 2048, seq_len=seq_len)
    ratio = np_inv_freq(K, theta) / want
    if scaling.type == "yarn":
        # float64: kept is exactly 1, divided a division and a quotient from factor (2 roundings); 1e-12 >> 2·eps64
        kept, divided = np.isclose(ratio, 1, rtol=1e-12), np.isclose(ratio, scaling.factor, rtol=1e-12)
        assert kept.any() and divided.any() and (~kept & ~divided).any()
    else:
        assert (ratio[1:] > 1).all() if seq_len > 2048 else (ratio == 1).all()
    # float32 against float64: the power errs by ~(its exponent's size) ulps, <= ln(dynamic's grown
    # base, 500000·7^(128/126) = 3.6e6) = 15.1 -> 16; dynamic's base by its 5 roundings (product,
    # quotient, difference, power, product), passed on at most ×(2i/K)·K/(K−2) <= 1.02 -> 6; yarn's
    # or llama3's blend 8 roundings at most: (16 + 8)·EPS32 relative, 2x.
    np.testing.assert_allclose(got, want, rtol=2 * (16 + 8) * EPS32, atol=0)
    # float64 on both sides, a log, a product, a sum and a quotient each, in other orders: 4 roundings of
    # float64's eps each, 2x
    assert llama.rotary_attention_factor(scaling) == pytest.approx(np_attention_factor(scaling),
                                                                   rel=2 * 2 * 4 * np.finfo(float).eps / 2)


def test_rotary_matches_complex_rotation_and_depends_on_relative_position():
    K, theta = 8, 10000.0
    x_1xTxK = np.random.default_rng(0).normal(size=(1, 12, K)).astype(np.float32)
    pos_T = np.arange(12) * 7.0  # angles past 2π for the fast pairs
    cos, sin = llama.rotary_cos_sin(jnp.asarray(pos_T), K, theta)
    got = np.asarray(llama.apply_rotary(jnp.asarray(x_1xTxK), cos, sin))
    # Angles up to 77 rad computed in float32 are off by ~77·EPS32 (their rounding, relative to them),
    # which turns a pair by that: 77·EPS32 times the largest pair's norm, 2x.
    pair_norm = np.hypot(x_1xTxK[..., : K // 2], x_1xTxK[..., K // 2 :]).max()
    np.testing.assert_allclose(got, np_rotary(x_1xTxK.astype(np.float64), pos_T, theta), rtol=0,
                               atol=2 * 77 * EPS32 * pair_norm)
    # q·k after rotation depends only on the positions' difference: shift both by 5, same dot.
    q, k = jnp.asarray(x_1xTxK[:, :1]), jnp.asarray(x_1xTxK[:, 1:2])

    def dot(pq, pk):
        rq = llama.apply_rotary(q, *llama.rotary_cos_sin(jnp.asarray([pq]), K, theta))
        rk = llama.apply_rotary(k, *llama.rotary_cos_sin(jnp.asarray([pk]), K, theta))
        return float((rq * rk).sum())

    # Each dot: 8 products of entries turned by angles <= 8 rad (~8·EPS32/2 of rounding) and their sum
    # (~√8·EPS32), of |q||k|; two dots.
    tol = 2 * (8 / 2 + math.sqrt(8)) * EPS32 * float(jnp.linalg.norm(q) * jnp.linalg.norm(k))
    assert abs(dot(3, 1) - dot(8, 6)) < tol and abs(dot(3, 1) - dot(3, 2)) > 1e-3


def test_changing_a_token_changes_only_its_own_and_later_logits():
    model, t = build(CFG), 6
    tokens_BxT = _tokens((2, T_))
    changed_BxT = tokens_BxT.copy()
    changed_BxT[:, t + 1] = (changed_BxT[:, t + 1] + 17) % CFG.vocab_size
    before, after = np.asarray(forward(model, jnp.asarray(tokens_BxT))), np.asarray(forward(model, changed_BxT))
    # Equal in exact arithmetic and in float32 too (a masked probability is exactly 0, and adds exactly 0):
    # at most the forward's sums ordered differently, one ROUNDING.
    np.testing.assert_allclose(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=ROUNDING * scale(before))
    assert (np.abs(after - before).max(-1)[:, t + 1:] > 1e-5).all()
    # causal=False (mdlm): the earlier positions see it too, and match the reference.
    bidir = np.asarray(forward(model, changed_BxT, causal=False))
    assert (np.abs(bidir - np.asarray(forward(model, tokens_BxT, causal=False))).max(-1)[:, :t] > 1e-5).all()
    want = np_forward(model, changed_BxT[0], causal=False)
    np.testing.assert_allclose(bidir[0], want, rtol=0, atol=logits_atol(want))


def test_packed_documents_give_each_document_its_standalone_logits():
    """Two documents in one row: each gets the logits it gets alone, and the reference restarts
    positions. (Rotary scores depend only on relative positions, so in exact arithmetic a restart is
    invisible once attention stays inside each document; restarting keeps the angles those of the
    document alone, as transformers computes them for it, so float32 rounding matches too.)"""
    model = build(FULL_CFG)
    tokens_T = _tokens((T_,), seed=5)
    seg_1xT = np.array([[0] * 5 + [1] * 11])
    packed = np.asarray(forward(model, jnp.asarray(tokens_T[None]), segment_ids_BxT=jnp.asarray(seg_1xT)))[0]
    want = np_forward(model, tokens_T, seg_1xT[0])
    atol = logits_atol(want)
    np.testing.assert_allclose(packed[:5], np.asarray(forward(model, tokens_T[None, :5]))[0], rtol=0, atol=atol)
    np.testing.assert_allclose(packed[5:], np.asarray(forward(model, tokens_T[None, 5:]))[0], rtol=0, atol=atol)
    np.testing.assert_allclose(packed, want, rtol=0, atol=atol)


# --- equivalent execution paths, dropout ------------------------------------------------------------


def test_remat_policies_give_the_same_loss_and_gradients():
    tokens_BxT1 = jnp.asarray(_tokens((4, T_ + 1)))
    model = with_cfg(build(FULL_CFG), dataclasses.replace(FULL_CFG, remat="none"))
    (loss, _), grads = loss_and_grads(model, tokens_BxT1, None, jnp.float32)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == 17 and all(float(jnp.abs(g).max()) > 0 for g in leaves)  # every weight is used
    for remat in (r for r in REMAT_POLICIES if r != "none"):
        (loss_r, _), grads_r = loss_and_grads(with_cfg(model, dataclasses.replace(FULL_CFG, remat=remat)),
                                              tokens_BxT1, None, jnp.float32)
        # The same forward: the loss, a mean over 64 tokens, at most summed in another order (√64·EPS32).
        np.testing.assert_allclose(loss_r, loss, rtol=math.sqrt(64) * EPS32)
        for g, g_r in zip(leaves, jax.tree.leaves(grads_r), strict=True):  # recomputed, re-fused: 4x
            np.testing.assert_allclose(g_r, g, rtol=0, atol=4 * GRAD_ROUNDING * scale(g))


def test_bfloat16_compute_keeps_float32_logits_close_to_float32():
    """Matmuls in bfloat16 (8-bit mantissa: 2^-8 ≈ 4e-3 per rounding), logits float32. 15 matmuls in a
    row (7 a block, the head), each rounding both inputs: ~√30·2^-8 ≈ 2% of the logits' scale if
    those add up at random; within 2x that, and not equal (bfloat16 really ran)."""
    model, tokens_BxT = build(FULL_CFG), jnp.asarray(_tokens((2, T_)))
    f32 = np.asarray(forward(model, tokens_BxT))
    bf16 = eqx.filter_jit(lambda m, t: m(t, compute_dtype=jnp.bfloat16))(model, tokens_BxT)
    assert bf16.dtype == jnp.float32
    error = np.abs(np.asarray(bf16) - f32).max() / np.abs(f32).max()
    assert 1e-4 < error < 2 * math.sqrt(2 * 15) * 2.0**-8, error


def test_dropout_is_active_only_with_a_key():
    tokens_BxT = jnp.asarray(_tokens((2, T_)))
    model = build(CFG)
    dropping = with_cfg(model, dataclasses.replace(CFG, dropout=0.5))
    plain = np.asarray(forward(model, tokens_BxT))
    np.testing.assert_array_equal(np.asarray(forward(dropping, tokens_BxT)), plain)  # key=None: evaluation
    a = np.asarray(forward(dropping, tokens_BxT, jax.random.PRNGKey(1)))
    b = np.asarray(forward(dropping, tokens_BxT, jax.random.PRNGKey(2)))
    assert np.abs(a - plain).max() > 1e-3 and np.abs(a - b).max() > 1e-3


def test_collect_returns_each_blocks_activation_rms():
    model = build(CFG)
    tokens_BxT = _tokens((2, T_))
    logits, stats = eqx.filter_jit(lambda m, t: m(t, collect=True))(model, jnp.asarray(tokens_BxT))
    want_logits = np.asarray(forward(model, jnp.asarray(tokens_BxT)))  # the same ops: at most one ROUNDING
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=ROUNDING * scale(want_logits))
    want = {}
    for row in tokens_BxT:
        np_forward(model, row, stats=want)
    assert set(stats) == set(want) == {"attn", "mlp", "resid"}
    # Each activation carries ROUNDING of its scale into the RMS; the mean of 2·16·32 = 1024 squares, a
    # pairwise float32 sum, adds <= log2(1024)·EPS32/2: 4x.
    rms_rtol = 4 * (ROUNDING + math.log2(1024) * EPS32 / 2)
    for name, per_row_block in want.items():  # RMS over the batch: rows are equal-sized, so mean the squares
        squares_BxL = np.array([np.mean(np.square(v)) for v in per_row_block]).reshape(2, CFG.num_blocks)
        np.testing.assert_allclose(stats[name], np.sqrt(squares_BxL.mean(0)), rtol=rms_rtol, err_msg=name)


# --- parameters: init, groups, axes, FLOPs --------------------------------------------------------


def test_init_scales_and_shapes():
    """N(0, 0.02), the residual outputs (o_proj, down_proj) 0.02/sqrt(2L); unit gains; GQA's smaller
    k/v. Loose statistical bounds: each array holds >= 1024 values."""
    model = eqx.filter_jit(llama.Llama)(FULL_CFG, jax.random.PRNGKey(0))
    b, resid = model.blocks, 0.02 / math.sqrt(2 * FULL_CFG.num_blocks)
    for w, std in [(model.embed_VxD, 0.02), (model.head_DxV, 0.02), (b.q_proj.weight_IxO, 0.02),
                   (b.gate_proj.weight_IxO, 0.02), (b.o_proj.weight_IxO, resid), (b.down_proj.weight_IxO, resid)]:
        assert abs(float(jnp.std(w)) / std - 1) < 0.15
    assert b.k_proj.weight_IxO.shape == (2, 32, 8) and b.q_proj.weight_IxO.shape == (2, 32, 32)
    assert b.gate_proj.weight_IxO.shape == (2, 32, 96) and b.q_norm.gain_D.shape == (2, 8)
    assert not np.any(np.asarray(b.q_proj.bias_O)) and np.all(np.asarray(b.attn_norm.gain_D) == 1)
    assert b.o_proj.bias_O is None and b.gate_proj.bias_O is None


def test_param_labels_and_axes():
    model = build(FULL_CFG)
    labels = llama.param_labels(model)
    assert labels.embed_VxD == "embed" and labels.head_DxV == "head" and labels.final_norm.gain_D == "scalar"
    blocks = labels.blocks
    assert {blocks.q_proj.weight_IxO, blocks.down_proj.weight_IxO, blocks.k_proj.weight_IxO} == {"hidden"}
    assert {blocks.q_proj.bias_O, blocks.q_norm.gain_D, blocks.attn_norm.gain_D} == {"scalar"}
    assert models.param_labels(build(CFG)).head_DxV is None  # tied: no head
    axes = llama.param_axes(model)
    assert axes.blocks.k_proj.weight_IxO == ("layers", "embed", "heads")
    assert axes.blocks.o_proj.weight_IxO == ("layers", "heads", "embed")
    assert axes.blocks.down_proj.weight_IxO == ("layers", "mlp", "embed")
    assert axes.blocks.v_proj.bias_O == ("layers", "heads") and axes.embed_VxD == ("vocab", "embed")
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(labels)


def test_flops_per_token_counts_every_matmul_weight_and_attention():
    """6·(the matmul weights the model holds: the block matrices, the head) + 12·L·D·T, counted
    from the arrays themselves, so the smaller GQA k/v projections are counted as they are."""
    for cfg in (CFG, FULL_CFG):
        model = build(cfg)
        hidden = sum(w.size for w, label in zip(jax.tree.leaves(model), jax.tree.leaves(llama.param_labels(model)))
                     if label == "hidden")
        want = 6 * (hidden + cfg.dim * cfg.vocab_size) + 12 * cfg.num_blocks * cfg.dim * 16
        assert models.flops_per_token(cfg, 16) == want


def test_mlp_width_follows_llamas_rule():
    assert CFG.mlp_width == 96  # int(8/3·32) = 85 -> a multiple of 32
    assert llama.LlamaConfig(dim=4096, num_heads=32, num_blocks=1, context_length=8).mlp_width == 11008  # Llama 2 7B
    assert dataclasses.replace(CFG, mlp_hidden=40).mlp_width == 40


# --- bad knobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    (("model.num_kv_heads=3",), r"model.num_kv_heads=3 must divide model.num_heads=4"),
    (("model.dim=36", "model.num_heads=12", "model.num_kv_heads=null"), r"model.dim/model.num_heads=3 is odd"),
    (("model.dim=30",), r"model.dim=30 is not divisible by model.num_heads=4"),
    (("model.mlp_hidden=0",), r"model.mlp_hidden=0 must be positive"),
    (("model.rope_theta=0",), r"model.rope_theta=0.0 must be positive"),
    (("model.head_size=7",), r"model.head_size=7 is odd: rotary positions rotate pairs"),
    (("model.head_size=0",), r"model.head_size=0 must be a positive integer, or null"),
    (("model.rope_scaling={type:longrope,factor:4.0}",), r"model.rope_scaling.type='longrope' is not a rotary scaling "
     r"eqtrain implements: use linear, llama3, yarn, dynamic, or model.rope_scaling=null"),
    (("model.rope_scaling={type:linear,factor:0}",), r"model.rope_scaling.factor=0.0 must be positive"),
    (("model.rope_scaling={type:llama3,factor:8,low_freq_factor:4,high_freq_factor:1}",),
     r"model.rope_scaling.low_freq_factor=4.0 and high_freq_factor=1.0 must satisfy 0 < low < high"),
    (("model.rope_scaling={type:linear,factor:8,low_freq_factor:2}",),
     r"model.rope_scaling.type=linear does not read low_freq_factor \(knobs of llama3\): drop them"),
    (("model.rope_scaling={type:dynamic,factor:2,beta_fast:16,original_context_length:8}",),
     r"model.rope_scaling.type=dynamic does not read beta_fast \(knobs of yarn\)"),
    (("model.rope_scaling={type:yarn,factor:4,high_freq_factor:8}",),
     r"model.rope_scaling.type=yarn does not read high_freq_factor \(knobs of llama3\)"),
    (("model.rope_scaling={type:yarn,factor:4,beta_fast:1,beta_slow:2}",),
     r"model.rope_scaling.beta_slow=2.0 and beta_fast=1.0 must satisfy 0 < beta_slow < beta_fast"),
    (("model.rope_scaling={type:yarn,factor:4,mscale:0.7}",),
     r"model.rope_scaling.mscale=0.7 with mscale_all_dim=None: transformers reads the two only together"),
    (("model.rope_scaling={type:yarn,factor:4,attention_factor:1.2,mscale:0.7,mscale_all_dim:1}",),
     r"model.rope_scaling.attention_factor=1.2 with mscale=0.7: an explicit attention_factor replaces mscale's"),
    (("model.rope_scaling={type:yarn,factor:4,attention_factor:0}",),
     r"model.rope_scaling.attention_factor=0.0 must be positive, or null"),
    (("model.rope_scaling={type:dynamic,factor:2,original_context_length:0}",),
     r"model.rope_scaling.original_context_length=0 must be a positive integer, or null"),
    (("model.rope_scaling={factor:8}",), r"model.rope_scaling.type is missing"),
    (("model.rope_scaling={type:llama3,factor:8,scale:2}",), r"unknown knob model.rope_scaling.scale"),
    (("+model.mlp_ratio=4",), r"unknown knob model.mlp_ratio"),
    (("parallel.tensor=4",), r"parallel.tensor=4 must divide the model's 2 key/value heads"),
])
def test_bad_knobs_fail_with_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate(compose_config("model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2", *overrides))
    assert "\n" not in str(info.value)


def test_rows_longer_than_the_context_are_refused():
    """GPT's position table refuses them by its shape; rotary positions would quietly extrapolate."""
    model = build(FULL_CFG)
    T = FULL_CFG.context_length + 1
    with pytest.raises(ConfigError, match=rf"{T} tokens per row is more than model.context_length="):
        model(jnp.zeros((1, T), jnp.int32))


# --- Hugging Face mapping (without torch; the parity with transformers is tests/test_llama_hf.py) -----


def test_hf_tensors_round_trip_and_names():
    model = build(FULL_CFG)
    tensors = llama.hf_tensors(model)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (8, 32)  # torch Linear: (out, in)
    assert tensors["lm_head.weight"].shape == (64, 32) and "model.layers.0.self_attn.q_norm.weight" in tensors
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"],
                                  np.asarray(model.blocks.q_proj.weight_IxO[1]).T)
    back = llama.from_hf_tensors(FULL_CFG, tensors)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    tied = llama.hf_tensors(build(CFG))
    assert "lm_head.weight" not in tied and "model.layers.0.self_attn.q_proj.bias" not in tied


def test_hf_tensors_errors_name_the_tensor():
    tensors = llama.hf_tensors(build(CFG))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.up_proj.weight is missing"):
        llama.from_hf_tensors(CFG, missing)
    bad = {**tensors, "model.norm.weight": np.ones(31, np.float32)}
    with pytest.raises(CheckpointError, match=r"tensor model.norm.weight has shape \(31,\).*needs \(32,\)"):
        llama.from_hf_tensors(CFG, bad)


LLAMA3 = llama.RopeScaling("llama3", 32.0, 1.0, 4.0, 8)  # Llama 3.2's factors, original context 8 (< 16)


def test_hf_config_round_trip_and_refusals():
    base = dataclasses.replace(CFG, remat="full", scan_blocks=False, vocab_size=None)
    for cfg, model_type in [(CFG, "llama"), (dataclasses.replace(FULL_CFG, qk_norm=False), "qwen2"),
                            (dataclasses.replace(FULL_CFG, qkv_bias=False, head_size=16), "qwen3"),
                            (dataclasses.replace(CFG, rope_scaling=LLAMA3), "llama"),
                            (dataclasses.replace(CFG, rope_scaling=llama.RopeScaling("linear", 2.0)), "llama"),
                            (YARN_CFG, "qwen2"), (DYNAMIC_CFG, "llama"),
                            (dataclasses.replace(CFG, rope_scaling=llama.RopeScaling(
                                "yarn", 2.0, original_context_length=8, beta_fast=8.0, beta_slow=2.0, truncate=False,
                                mscale=0.7, mscale_all_dim=1.0)), "llama")]:
        hf = llama.hf_config(cfg)
        assert hf["model_type"] == model_type
        back = llama.config_from_hf(json.loads(json.dumps(hf)), base)
        assert back == dataclasses.replace(cfg, remat="full", scan_blocks=False, mlp_hidden=cfg.mlp_width)
    # dynamic's base grows past max_position_embeddings: the original context is written there, and read
    # back with the run's longer context_length (16) kept
    assert llama.hf_config(DYNAMIC_CFG)["max_position_embeddings"] == 8
    with pytest.raises(ConfigError, match="model.qk_norm=true with model.qkv_bias=true"):
        llama.hf_config(FULL_CFG)
    hf = llama.hf_config(CFG)
    for key, value in [("rope_scaling", {"rope_type": "llama3", "factor": 32.0}), ("hidden_act", "gelu"),
                       ("attention_bias", True), ("model_type", "gpt2"), ("head_dim", 7),
                       ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}),
                       ("rope_scaling", {"rope_type": "dynamic"}),
                       ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}),
                       ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                            "high_freq_factor": 1.0}),
                       ("rope_parameters", {"rope_type": "linear", "partial_rotary_factor": 0.5, "factor": 2.0})]:
        with pytest.raises(ConfigError, match=f"config.json {key}") as info:
            llama.config_from_hf({**hf, key: value}, base)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="config.json num_key_value_heads=3 does not divide num_attention_heads"):
        llama.config_from_hf({**hf, "num_key_value_heads": 3}, base)


# --- the pipeline: a short run, golden losses, 8 devices ---------------------------------------------

LLAMA_TINY = ("model=llama_tiny", "model.num_heads=4", "model.num_kv_heads=2")  # dim 32, 2 blocks (TINY_OVERRIDES)
# (loss logged at step 1, 2, 3; loss of the weights after step 3): AdamW, tests/test_golden.py's run
# and batch with model=llama_tiny at the tiny shape, float32 on CPU. Tolerance: test_golden.py's RTOL
# (imported) and its reasoning (a 2-block forward, dot products of <= 96 terms, first-order updates).
GOLDEN = [4.191713333129883, 4.169217109680176, 4.125115871429443, 4.063600063323975]


def golden_losses() -> list[float]:
    run = validate(compose_config(*LLAMA_TINY, "optimizer=adamw", "train.max_steps=30", "optimizer.lr_config.warmup=5"))
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch_1xBxT1 = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch = meshlib.put_batch(batch_1xBxT1, meshlib.batch_sharding(mesh, 1))
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    return losses


def test_golden_losses():
    got = golden_losses()
    np.testing.assert_array_less(np.abs(np.subtract(got, GOLDEN)), RTOL * np.abs(GOLDEN),
                                 err_msg=f"the tiny Llama's first AdamW losses changed ({got}). Update GOLDEN "
                                         "only for an intended numerical change, and say so in the commit message.")
    assert all(a > b for a, b in zip(got, got[1:])), got


def test_a_short_run_through_train_jax_lowers_the_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    T.train(compose_config(*LLAMA_TINY, "model.vocab_size=null", "train.max_steps=12", "logging.log_every=1",
                           "train.val_freq=100", "train.max_val_steps=1", "optimizer/lr_config=constant",
                           "optimizer.lr_config.lr=1e-2", "optimizer.lr_config.warmup=0"), str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses


@background.setup
def llama_sharded_check(ctx) -> ShardedCheck:
    return ShardedCheck(ctx.tmp_path_factory.mktemp("llama_sharded"), ctx.tmp_path_factory.mktemp("llama_cache"),
                        ("--model", "llama_tiny"))


@pytest.mark.slow
def test_data_fsdp_tensor_on_8_devices_equals_1_device(llama_sharded_check):
    """tests/sharded_step_check.py --model llama_tiny: 3 steps of 2 micro-batches on data 2 x fsdp 2 x
    tensor 2 against 1 device (the losses' tolerance below; the parameters' in sharded_step_check.py)."""
    r = llama_sharded_check.result()
    assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    # Each loss carries the forward's ROUNDING (relative, at O(1) logits), its sums ordered by the mesh;
    # the parameters, within sharded_step_check's tolerance, move it by less. 8x, as logits_atol.
    np.testing.assert_allclose(r["losses_tp"], r["losses_1"], rtol=8 * ROUNDING)
    assert r["params_allclose"] and r["kept"] and r["params_moved"] > 1e-3
    # Heads and MLP columns over tensor (q/k/v/gate/up column-, o/down row-parallel), FSDP on the other side.
    specs = r["specs"]
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert specs[name] == ["None", "fsdp", "tensor"], (name, specs)
    assert specs["o_proj"] == specs["down_proj"] == ["None", "tensor", "fsdp"]
