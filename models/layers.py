"""Building blocks every model family shares: linear layers, norms, attention, dropout, document
positions, and the loop over stacked blocks (scan, remat). A family (models/gpt.py, models/llama.py)
composes these; nothing here knows which family uses it.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

# What a block saves for the backward pass (`model.remat`):
#   none: everything JAX would save (every elementwise intermediate: most memory and traffic)
#   dots: only matmul outputs; cheap elementwise work (GELU, LayerNorm, softmax) is recomputed.
#         Under lax.scan this is also the fastest: saved residuals are stacked per block, and
#         fewer of them means less memory traffic.
#   full: nothing but the block input; the whole block is recomputed (least memory, ~1/3 more FLOPs)
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Linear(eqx.Module):
    weight_IxO: jax.Array
    bias_O: jax.Array | None

    def __call__(self, x_NxI: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """`key`: the dropout key of a LoRA projection's branch (models/lora.py); a plain one draws nothing.

        Leading axes are flattened into one (a free reshape) around the matmul: from a 3-D x
        (B x T x I) XLA:CPU turns the weight gradient into a transposing copy of the output
        gradient and a matmul with both operands transposed: ~85 GFLOP/s for gpt_bench's MLP weight
        gradients on 2 cores, ~170 from 2-D (bench/step_profile.py)."""
        x_MxI = x_NxI.reshape(-1, x_NxI.shape[-1])
        y_MxO = x_MxI @ self.weight_IxO.astype(x_NxI.dtype)
        y_MxO = y_MxO if self.bias_O is None else y_MxO + self.bias_O.astype(y_MxO.dtype)
        return y_MxO.reshape(*x_NxI.shape[:-1], y_MxO.shape[-1])


def output_logits(x_BxTxD: jax.Array, head_DxV: jax.Array, compute_dtype, multiplier: float = 1.0) -> jax.Array:
    """The output head's float32 logits: the matmul in `compute_dtype`, accumulated and returned in
    float32 (bfloat16 logits would round the loss's inputs to 3 significant digits), times
    `multiplier` (model.mup's base/width, models/mup.py; 1.0 adds no operation).

    Under a narrower compute_dtype its backward rounds the logits' gradient to that dtype before its
    two matmuls, as every other matmul of the model has it: left to JAX, the float32 gradient
    promotes both to float32 (TF32 on a GPU: 7.6 of GPT-2 124M's 58 ms step on an H100, 2026-11-27,
    bench/step_profile.py). PyTorch's autocast rounds it the same way (its logits are bfloat16)."""
    x_BxTxD, head_DxV = x_BxTxD.astype(compute_dtype), head_DxV.astype(compute_dtype)
    if jnp.dtype(compute_dtype) == jnp.float32:
        logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV, preferred_element_type=jnp.float32)
    else:
        logits_BxTxV = _narrow_head(x_BxTxD, head_DxV)
    return logits_BxTxV if multiplier == 1.0 else logits_BxTxV * jnp.float32(multiplier)


@jax.custom_vjp
def _narrow_head(x_BxTxD: jax.Array, head_DxV: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV, preferred_element_type=jnp.float32)


def _narrow_head_fwd(x_BxTxD, head_DxV):
    return _narrow_head(x_BxTxD, head_DxV), (x_BxTxD, head_DxV)


def _narrow_head_bwd(saved, g_BxTxV):
    x_BxTxD, head_DxV = saved
    g_BxTxV = g_BxTxV.astype(x_BxTxD.dtype)
    dx_BxTxD = jnp.einsum("btv,dv->btd", g_BxTxV, head_DxV, preferred_element_type=jnp.float32)
    dhead_DxV = jnp.einsum("btd,btv->dv", x_BxTxD, g_BxTxV, preferred_element_type=jnp.float32)
    return dx_BxTxD.astype(x_BxTxD.dtype), dhead_DxV.astype(head_DxV.dtype)


_narrow_head.defvjp(_narrow_head_fwd, _narrow_head_bwd)


class LayerNorm(eqx.Module):
    gain_D: jax.Array
    bias_D: jax.Array | None

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        # Statistics in float32 even under bfloat16 compute: small dims lose the mean otherwise.
        x32 = x_NxD.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.gain_D
        if self.bias_D is not None:
            y = y + self.bias_D
        return y.astype(x_NxD.dtype)


class RMSNorm(eqx.Module):
    gain_D: jax.Array
    eps: float = eqx.field(static=True, default=1e-6)

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        # float32 statistics, as LayerNorm; the gain applied after casting back (Hugging Face's Llama order).
        x32 = x_NxD.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
        return (self.gain_D * y.astype(x_NxD.dtype)).astype(x_NxD.dtype)


def linear(key, d_in: int, d_out: int, std: float, bias: bool) -> Linear:
    weight = std * jax.random.normal(key, (d_in, d_out), jnp.float32)
    return Linear(weight, jnp.zeros((d_out,), jnp.float32) if bias else None)


def layer_norm(dim: int, bias: bool) -> LayerNorm:
    return LayerNorm(jnp.ones((dim,), jnp.float32), jnp.zeros((dim,), jnp.float32) if bias else None)


def split_heads(qkv_BxTxN: jax.Array, num_heads: int, head_dim: int) -> list[jax.Array]:
    """q, k, v (each B x H x T x K, heads-major: XLA's batched attention matmuls run ~1.5x faster on
    CPU from it than from B x T x H x K) of a fused projection whose columns are (head, q|k|v, K).

    By `jnp.split`, not indexing: the gradient of a split is one concatenate of dq, dk, dv into the
    projection's layout, where indexing's is three full-size zero-padded copies added together."""
    B, T, _ = qkv_BxTxN.shape
    parts_BxTxHx1xK = jnp.split(qkv_BxTxN.reshape(B, T, num_heads, -1, head_dim), 3, axis=3)
    return [p[:, :, :, 0].transpose(0, 2, 1, 3) for p in parts_BxTxHx1xK]


def causal_attention(q_BxHxTxK: jax.Array, k_BxHxTxK: jax.Array, v_BxHxTxK: jax.Array,
                     block_size: int | None = None, segment_ids_BxT: jax.Array | None = None,
                     causal: bool = True, scale: float | None = None, max_logits: bool = False):
    """Softmax attention where position t sees positions <= t; scores and softmax in float32.
    With `segment_ids_BxT` (packed documents), t sees only earlier positions of its own document.
    `causal=False` (a static flag: the objective's, e.g. masked diffusion) lets t see every
    position (of its document), and `block_size` is moot. `scale`: the scores' factor, None =
    1/sqrt(K) (model.mup's 1/K-like factor: models/mup.py `attention_scale`).

    With `block_size`, queries go in blocks and block i only multiplies against keys
    [0, (i+1)·block_size): the masked-out upper triangle is mostly never computed (at two
    blocks 25% fewer attention FLOPs, at four 37%), at the price of smaller matmuls. The blocks
    are cut with `jnp.split` and the visible keys rebuilt by concatenation: the gradient then
    adds up block-sized pieces, where slicing's (a zero-padded full-length copy per query
    block) rewrote the whole of dk and dv once per block.
    """
    T, K = q_BxHxTxK.shape[-2:]
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    if not block_size or block_size >= T or T % block_size or not causal:
        block_size = T
    n = T // block_size
    q_blocks, k_blocks, v_blocks = ([a] if n == 1 else jnp.split(a, n, axis=-2)
                                    for a in (q_BxHxTxK, k_BxHxTxK, v_BxHxTxK))
    outs, maxes_H = [], []
    for i, q_BxHxCxK in enumerate(q_blocks):
        start, keys = i * block_size, (i + 1) * block_size  # this block's first query, the keys it can see
        if i == n - 1:
            k_BxHxSxK, v_BxHxSxK = k_BxHxTxK, v_BxHxTxK
        else:
            k_BxHxSxK, v_BxHxSxK = (jnp.concatenate(b[: i + 1], axis=-2) for b in (k_blocks, v_blocks))
        scores_BxHxCxS = jnp.matmul(q_BxHxCxK, jnp.swapaxes(k_BxHxSxK, -1, -2), preferred_element_type=jnp.float32)
        visible_CxS = jnp.arange(keys)[None, :] <= (start + jnp.arange(block_size))[:, None]
        visible_CxS = visible_CxS if causal else jnp.ones_like(visible_CxS)
        if segment_ids_BxT is not None:
            same_BxCxS = segment_ids_BxT[:, start:keys, None] == segment_ids_BxT[:, None, :keys]
            visible_CxS = (visible_CxS & same_BxCxS)[:, None]  # B x 1 x C x S, broadcast over heads
        scores_BxHxCxS = jnp.where(visible_CxS, scores_BxHxCxS * scale, -1e30)
        if max_logits:  # every query sees at least itself, so each head's max is a visible logit
            maxes_H.append(jnp.max(jax.lax.stop_gradient(scores_BxHxCxS), axis=(0, 2, 3)))
        probs_BxHxCxS = jax.nn.softmax(scores_BxHxCxS, axis=-1).astype(v_BxHxTxK.dtype)
        outs.append(jnp.matmul(probs_BxHxCxS, v_BxHxSxK))
    out_BxHxTxK = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)
    return (out_BxHxTxK, jnp.max(jnp.stack(maxes_H), axis=0)) if max_logits else out_BxHxTxK


def document_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Each token's position inside its packed document: t minus the index where its segment
    starts (a segment starts at t = 0 and wherever the id changes)."""
    t_T = jnp.arange(segment_ids_BxT.shape[-1])
    starts_BxT = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], dtype=bool),
                                  segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    return t_T - jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def check_run_knobs(cfg, prefix: str) -> None:
    """The knobs every family's Config has for how its blocks run (dropout, remat, scan_unroll,
    attn_block_size) and vocab_size: one-line ConfigErrors, the same in every family."""
    from utils.errors import ConfigError

    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"{prefix}.dropout={cfg.dropout} must be in [0, 1)")
    if cfg.remat not in REMAT_POLICIES:
        raise ConfigError(f"{prefix}.remat={cfg.remat!r} must be one of {', '.join(REMAT_POLICIES)}")
    if cfg.scan_unroll <= 0:
        raise ConfigError(f"{prefix}.scan_unroll={cfg.scan_unroll} must be a positive integer "
                          f"(1 = one block per scan iteration, {prefix}.num_blocks = fully unrolled)")
    if cfg.attn_block_size is not None and cfg.attn_block_size <= 0:
        raise ConfigError(f"{prefix}.attn_block_size={cfg.attn_block_size} must be positive or null")
    if cfg.vocab_size is not None and cfg.vocab_size <= 0:
        raise ConfigError(f"{prefix}.vocab_size={cfg.vocab_size} must be positive or null")


def apply_blocks(apply, x_BxTxD: jax.Array, blocks, key: jax.Array | None, num_blocks: int, remat: str,
                 scan: bool, unroll: int, collect: bool):
    """Run `apply(x, (block, key)) -> (x, stats or None)` over stacked `blocks` (every leaf has a
    leading num_blocks axis): by lax.scan (compile time flat in depth) or an unrolled loop (same
    maths), with the block's `remat` policy. Returns (x, stats stacked per block, or None)."""
    keys_L = jax.random.split(key, num_blocks) if key is not None else None
    if remat != "none":
        apply = jax.checkpoint(apply, policy=REMAT_POLICIES[remat])
    if scan:
        return jax.lax.scan(apply, x_BxTxD, (blocks, keys_L), unroll=unroll)
    per_block = []
    for i in range(num_blocks):
        block_i = jax.tree.map(lambda a, i=i: a[i], blocks)
        x_BxTxD, stats = apply(x_BxTxD, (block_i, None if keys_L is None else keys_L[i]))
        per_block.append(stats)
    return x_BxTxD, (jax.tree.map(lambda *v: jnp.stack(v), *per_block) if collect else None)


def rms(a: jax.Array) -> jax.Array:
    """The root mean square of an activation, in float32 (logging.activation_norms)."""
    return jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32))))


def count_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
