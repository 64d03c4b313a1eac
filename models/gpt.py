"""GPT-2 style decoder in Equinox.

The blocks are built once with `eqx.filter_vmap`, so every block weight carries a leading
`num_blocks` axis, and applied with `lax.scan`: compile time stays flat as the model deepens.
`scan_blocks=False` unrolls the same stacked weights into a Python loop (identical maths; on
a 2-core CPU it is a little faster for shallow models). All maths is written on whole batches
(`x_BxTxD`) so XLA sees large matmuls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

from utils.errors import ConfigError

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


@dataclass(frozen=True)
class GPTConfig:
    """Shape and behaviour of the model; `vocab_size=None` means "the tokenizer's, rounded up"."""

    dim: int
    num_heads: int
    num_blocks: int
    context_length: int
    vocab_size: int | None = None
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (fast matmuls)
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True
    scan_blocks: bool = True
    remat: str = "dots"  # what the backward pass keeps of each block: dots | full | none (see REMAT_POLICIES)
    scan_unroll: int = 1  # blocks per scan iteration (num_blocks = fully unrolled inside the scan)
    attn_block_size: int | None = None  # query block size of block-causal attention; null = one block

    def check(self, prefix: str = "model") -> None:
        for knob in ("dim", "num_heads", "num_blocks", "context_length", "mlp_ratio", "vocab_multiple"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be a positive integer")
        if self.dim % self.num_heads:
            raise ConfigError(
                f"{prefix}.dim={self.dim} is not divisible by {prefix}.num_heads={self.num_heads}: "
                "pick a head count that divides dim"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"{prefix}.remat={self.remat!r} must be one of {', '.join(REMAT_POLICIES)}")
        if self.scan_unroll <= 0:
            raise ConfigError(f"{prefix}.scan_unroll={self.scan_unroll} must be a positive integer "
                              f"(1 = one block per scan iteration, {prefix}.num_blocks = fully unrolled)")
        if self.attn_block_size is not None and self.attn_block_size <= 0:
            raise ConfigError(f"{prefix}.attn_block_size={self.attn_block_size} must be positive or null")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ConfigError(f"{prefix}.vocab_size={self.vocab_size} must be positive or null")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


class Linear(eqx.Module):
    weight_IxO: jax.Array
    bias_O: jax.Array | None

    def __call__(self, x_NxI: jax.Array) -> jax.Array:
        y = x_NxI @ self.weight_IxO.astype(x_NxI.dtype)
        return y if self.bias_O is None else y + self.bias_O.astype(y.dtype)


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


def _linear(key, d_in: int, d_out: int, std: float, bias: bool) -> Linear:
    weight = std * jax.random.normal(key, (d_in, d_out), jnp.float32)
    return Linear(weight, jnp.zeros((d_out,), jnp.float32) if bias else None)


def _head_major(qkv: Linear, num_heads: int) -> Linear:
    """Reorder a fused qkv projection's output columns from (q|k|v, head, K) to (head, q|k|v, K).
    The same random draw as before, so the same function: only the storage order changes, so that
    tensor parallelism can split the columns into whole heads."""
    d_in, d_out = qkv.weight_IxO.shape
    K = d_out // (3 * num_heads)
    order_O = jnp.arange(d_out).reshape(3, num_heads, K).transpose(1, 0, 2).reshape(-1)
    return Linear(qkv.weight_IxO[:, order_O], None if qkv.bias_O is None else qkv.bias_O[order_O])


def _layer_norm(dim: int, bias: bool) -> LayerNorm:
    return LayerNorm(jnp.ones((dim,), jnp.float32), jnp.zeros((dim,), jnp.float32) if bias else None)


class Block(eqx.Module):
    ln1: LayerNorm
    attn_qkv: Linear
    attn_out: Linear
    ln2: LayerNorm
    mlp_in: Linear
    mlp_out: Linear

    @staticmethod
    def init(key: jax.Array, cfg: GPTConfig) -> "Block":
        k_qkv, k_out, k_in, k_mlp_out = jax.random.split(key, 4)
        d, f = cfg.dim, cfg.mlp_ratio * cfg.dim
        # GPT-2: residual projections scaled by 1/sqrt(2 * num_blocks) so the residual stream's
        # variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * cfg.num_blocks)
        return Block(
            ln1=_layer_norm(d, cfg.bias),
            attn_qkv=_head_major(_linear(k_qkv, d, 3 * d, 0.02, cfg.bias), cfg.num_heads),
            attn_out=_linear(k_out, d, d, resid_std, cfg.bias),
            ln2=_layer_norm(d, cfg.bias),
            mlp_in=_linear(k_in, d, f, 0.02, cfg.bias),
            mlp_out=_linear(k_mlp_out, f, d, resid_std, cfg.bias),
        )

    def __call__(self, x_BxTxD: jax.Array, key: jax.Array | None, cfg: GPTConfig, compute_dtype,
                 segment_ids_BxT: jax.Array | None = None, causal: bool = True,
                 collect: bool = False) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """`x_BxTxD` is the float32 residual stream: the matmuls run in `compute_dtype`, but the
        sums of the stream stay float32 (in bfloat16 a block's small update would round away).
        `collect` (static) also returns the RMS of the attention and MLP outputs and of the stream
        after the block (logging.activation_norms)."""
        B, T, D = x_BxTxD.shape
        H, K = cfg.num_heads, cfg.head_dim
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)

        h_BxTxD = self.ln1(x_BxTxD).astype(compute_dtype)
        # Heads-major (3, B, H, T, K): XLA's batched matmuls run ~1.5x faster on CPU from this
        # layout than from jax.nn.dot_product_attention's (B, T, H, K).
        # The qkv columns are head-major (head, q|k|v, K): a contiguous split of them over the
        # tensor axis hands each device whole heads (see `_head_major`).
        w_DxHx3xK = self.attn_qkv.weight_IxO.astype(h_BxTxD.dtype).reshape(D, H, 3, K)
        qkv_3xBxHxTxK = jnp.einsum("btd,dhsk->sbhtk", h_BxTxD, w_DxHx3xK)
        if self.attn_qkv.bias_O is not None:
            b_Hx3xK = self.attn_qkv.bias_O.astype(h_BxTxD.dtype).reshape(H, 3, K)
            qkv_3xBxHxTxK = qkv_3xBxHxTxK + b_Hx3xK.transpose(1, 0, 2)[:, None, :, None, :]
        a_BxHxTxK = causal_attention(*qkv_3xBxHxTxK, block_size=cfg.attn_block_size, segment_ids_BxT=segment_ids_BxT,
                                     causal=causal)
        a_BxTxD = a_BxHxTxK.transpose(0, 2, 1, 3).reshape(B, T, D)
        attn_BxTxD = _dropout(self.attn_out(a_BxTxD), cfg.dropout, k_attn).astype(x_BxTxD.dtype)
        x_BxTxD = x_BxTxD + attn_BxTxD

        h_BxTxF = jax.nn.gelu(self.mlp_in(self.ln2(x_BxTxD).astype(compute_dtype)), approximate=True)
        mlp_BxTxD = _dropout(self.mlp_out(h_BxTxF), cfg.dropout, k_mlp).astype(x_BxTxD.dtype)
        if not collect:
            return x_BxTxD + mlp_BxTxD
        out_BxTxD = x_BxTxD + mlp_BxTxD
        rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32))))
        return out_BxTxD, {"attn": rms(attn_BxTxD), "mlp": rms(mlp_BxTxD), "resid": rms(out_BxTxD)}


def causal_attention(q_BxHxTxK: jax.Array, k_BxHxTxK: jax.Array, v_BxHxTxK: jax.Array,
                     block_size: int | None = None, segment_ids_BxT: jax.Array | None = None,
                     causal: bool = True) -> jax.Array:
    """Softmax attention where position t sees positions <= t; scores and softmax in float32.
    With `segment_ids_BxT` (packed documents), t sees only earlier positions of its own document.
    `causal=False` (a static flag: the objective's, e.g. masked diffusion) lets t see every
    position (of its document), and `block_size` is moot.

    With `block_size`, queries go in blocks and block i only multiplies against keys
    [0, (i+1)·block_size): the masked-out upper triangle is mostly never computed (at two
    blocks 25% fewer attention FLOPs, at four 37%), at the price of smaller matmuls.
    """
    T, K = q_BxHxTxK.shape[-2:]
    if not block_size or block_size >= T or T % block_size or not causal:
        block_size = T
    outs = []
    for start in range(0, T, block_size):
        q_BxHxCxK = q_BxHxTxK[..., start : start + block_size, :]
        keys = start + block_size  # keys this block can see
        scores_BxHxCxS = jnp.matmul(q_BxHxCxK, jnp.swapaxes(k_BxHxTxK[..., :keys, :], -1, -2),
                                    preferred_element_type=jnp.float32)
        visible_CxS = jnp.arange(keys)[None, :] <= (start + jnp.arange(block_size))[:, None]
        visible_CxS = visible_CxS if causal else jnp.ones_like(visible_CxS)
        if segment_ids_BxT is not None:
            same_BxCxS = segment_ids_BxT[:, start : start + block_size, None] == segment_ids_BxT[:, None, :keys]
            visible_CxS = (visible_CxS & same_BxCxS)[:, None]  # B x 1 x C x S, broadcast over heads
        scores_BxHxCxS = jnp.where(visible_CxS, scores_BxHxCxS * (1.0 / math.sqrt(K)), -1e30)
        probs_BxHxCxS = jax.nn.softmax(scores_BxHxCxS, axis=-1).astype(v_BxHxTxK.dtype)
        outs.append(jnp.matmul(probs_BxHxCxS, v_BxHxTxK[..., :keys, :]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)


def document_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Each token's position inside its packed document: t minus the index where its segment
    starts (a segment starts at t = 0 and wherever the id changes)."""
    t_T = jnp.arange(segment_ids_BxT.shape[-1])
    starts_BxT = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], dtype=bool),
                                  segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    return t_T - jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class GPT(eqx.Module):
    wte_VxD: jax.Array
    wpe_TxD: jax.Array
    blocks: Block  # every leaf stacked: leading axis = num_blocks
    ln_f: LayerNorm
    head_DxV: jax.Array | None  # None when tied to wte_VxD
    cfg: GPTConfig = eqx.field(static=True)

    def __init__(self, cfg: GPTConfig, key: jax.Array):
        if cfg.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be resolved before building the model")
        k_wte, k_wpe, k_blocks, k_head = jax.random.split(key, 4)
        self.cfg = cfg
        self.wte_VxD = 0.02 * jax.random.normal(k_wte, (cfg.vocab_size, cfg.dim), jnp.float32)
        self.wpe_TxD = 0.02 * jax.random.normal(k_wpe, (cfg.context_length, cfg.dim), jnp.float32)
        self.blocks = eqx.filter_vmap(lambda k: Block.init(k, cfg))(jax.random.split(k_blocks, cfg.num_blocks))
        self.ln_f = _layer_norm(cfg.dim, cfg.bias)
        self.head_DxV = (
            None
            if cfg.tie_embeddings
            else 0.02 * jax.random.normal(k_head, (cfg.dim, cfg.vocab_size), jnp.float32)
        )

    def __call__(
        self,
        tokens_BxT: jax.Array,
        *,
        key: jax.Array | None = None,
        compute_dtype: jnp.dtype = jnp.float32,
        segment_ids_BxT: jax.Array | None = None,
        causal: bool = True,
        collect: bool = False,
    ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """Logits (float32) for every position. `key=None` disables dropout (evaluation);
        `segment_ids_BxT` keeps attention inside each packed document, and positions restart at 0
        at each document's first token (as when the document is sampled or evaluated alone).
        `causal` is the objective's (models/objectives.py): False lets every position attend to
        every other, as masked diffusion needs; the weights are the same either way. `collect`
        (static) returns (logits, per-block activation RMS {"attn","mlp","resid"}, each (num_blocks,))."""
        cfg = self.cfg
        T = tokens_BxT.shape[1]
        if segment_ids_BxT is None:
            wpe = self.wpe_TxD[:T]
        else:
            wpe = jnp.take(self.wpe_TxD, document_positions(segment_ids_BxT), axis=0)
        # The residual stream stays float32 whatever compute_dtype is (see Block.__call__).
        x_BxTxD = (jnp.take(self.wte_VxD, tokens_BxT, axis=0) + wpe).astype(jnp.float32)
        keys_L = jax.random.split(key, cfg.num_blocks) if key is not None else None

        def apply(x_BxTxD, block_and_key):
            block, k = block_and_key
            out = block(x_BxTxD, k, cfg, compute_dtype, segment_ids_BxT, causal, collect)
            return out if collect else (out, None)

        if cfg.remat != "none":
            apply = jax.checkpoint(apply, policy=REMAT_POLICIES[cfg.remat])
        if cfg.scan_blocks:
            x_BxTxD, stats_L = jax.lax.scan(apply, x_BxTxD, (self.blocks, keys_L), unroll=cfg.scan_unroll)
        else:
            per_block = []
            for i in range(cfg.num_blocks):
                block_i = jax.tree.map(lambda a, i=i: a[i], self.blocks)
                x_BxTxD, stats = apply(x_BxTxD, (block_i, None if keys_L is None else keys_L[i]))
                per_block.append(stats)
            stats_L = jax.tree.map(lambda *v: jnp.stack(v), *per_block) if collect else None

        x_BxTxD = self.ln_f(x_BxTxD).astype(compute_dtype)
        head_DxV = self.wte_VxD.T if self.head_DxV is None else self.head_DxV
        # float32 accumulation: bfloat16 logits would round the loss's inputs to 3 significant digits.
        logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV.astype(compute_dtype),
                                  preferred_element_type=jnp.float32)
        return (logits_BxTxV, stats_L) if collect else logits_BxTxV


def param_labels(model: GPT) -> GPT:
    """Same tree as `model`, each array replaced by its group name.

    Groups: `hidden` (matrices inside blocks), `embed` (token/position embeddings), `head`
    (untied output projection), `scalar` (biases and norm gains). Optimizers use these for
    weight-decay masks and per-group hyperparameters.
    """

    def label(path, leaf) -> str:
        names = [getattr(p, "name", "") for p in path]
        if names[0] == "blocks":
            return "hidden" if names[-1] == "weight_IxO" else "scalar"
        if names[0] in ("wte_VxD", "wpe_TxD"):
            return "embed"
        if names[0] == "head_DxV":
            return "head"
        return "scalar"

    return jax.tree_util.tree_map_with_path(label, model)


# The logical name of every parameter dimension, by (module, field): utils/parallel/layout.py maps `heads`
# and `mlp` to the tensor mesh axis (attention split by heads; the MLP column- then row-parallel)
# and lets FSDP take the largest dimension left. `layers` is the stacked-blocks axis.
PARAM_AXES = {
    ("wte_VxD",): ("vocab", "embed"),
    ("wpe_TxD",): ("position", "embed"),
    ("head_DxV",): ("embed", "vocab"),
    ("attn_qkv", "weight_IxO"): ("layers", "embed", "heads"),
    ("attn_qkv", "bias_O"): ("layers", "heads"),
    ("attn_out", "weight_IxO"): ("layers", "heads", "embed"),
    ("mlp_in", "weight_IxO"): ("layers", "embed", "mlp"),
    ("mlp_in", "bias_O"): ("layers", "mlp"),
    ("mlp_out", "weight_IxO"): ("layers", "mlp", "embed"),
}


def param_axes(model: GPT) -> GPT:
    """Same tree as `model`, each array replaced by the logical names of its dimensions."""

    def axes(path, leaf) -> tuple:
        names = tuple(getattr(p, "name", "") for p in path)
        for key, logical in PARAM_AXES.items():
            if names[-len(key):] == key:
                return logical
        return ("layers",) * (names[0] == "blocks") + ("embed",) * (leaf.ndim - (names[0] == "blocks"))

    return jax.tree_util.tree_map_with_path(axes, model)


def count_params(model: GPT) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the matmul weights plus attention scores and values.

    N counts every weight a matmul touches (block matrices and the output head, tied or not);
    the embedding lookups and biases/norms do no matmul work. Attention adds
    12·num_blocks·dim·seq_len (forward QK^T and AV, times three for the backward), the PaLM
    convention without halving for the causal mask.
    """
    assert cfg.vocab_size is not None
    d, f, L = cfg.dim, cfg.mlp_ratio * cfg.dim, cfg.num_blocks
    n_matmul = L * (d * 3 * d + d * d + 2 * d * f) + d * cfg.vocab_size
    return 6.0 * n_matmul + 12.0 * L * d * seq_len


def unpack_batch(batch) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """(tokens_BxT1, loss_mask_BxT or None, segment_ids_BxT or None, loss_norm or None) of a batch:
    a bare token array, or the loaders' dict (`tokens`, optional `loss_mask` and `segment_ids`, and
    `loss_norm`, the train step's denominator for an exact masked mean over micro-batches)."""
    if not isinstance(batch, dict):
        return batch, None, None, None
    return batch["tokens"], batch.get("loss_mask"), batch.get("segment_ids"), batch.get("loss_norm")


def token_losses(model: GPT, batch, key: jax.Array | None, compute_dtype: jnp.dtype
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(next-token loss per position, top-1 hit per position, loss mask or None), all BxT."""
    tokens_BxT1, mask_BxT, segment_ids_BxT, _ = unpack_batch(batch)
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    logits_BxTxV = model(inputs_BxT, key=key, compute_dtype=compute_dtype, segment_ids_BxT=segment_ids_BxT)
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return logz_BxT - target_logit_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT, mask_BxT


def cross_entropy(model: GPT, batch, key: jax.Array | None, compute_dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Mean next-token loss and the number of correct top-1 predictions over the window; with a
    loss mask, over the masked-in targets only (chat: the assistant's tokens)."""
    nll_BxT, hit_BxT, mask_BxT = token_losses(model, batch, key, compute_dtype)
    if mask_BxT is None:
        return jnp.mean(nll_BxT), jnp.sum(hit_BxT)
    norm = unpack_batch(batch)[3]
    norm = jnp.maximum(mask_BxT.sum(), 1.0) if norm is None else norm
    return jnp.sum(nll_BxT * mask_BxT) / norm, jnp.sum(hit_BxT * mask_BxT)


def loss_fn(model: GPT, batch, key: jax.Array | None, compute_dtype) -> tuple[jax.Array, dict]:
    """The train step's loss: (mean loss, aux), aux holding what step metrics may read, per micro-batch."""
    loss, correct = cross_entropy(model, batch, key, compute_dtype)
    return loss, {"loss": loss, "correct": correct}


def eval_sums(model: GPT, batch, weights_B: jax.Array, compute_dtype: jnp.dtype
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of counted targets' losses, of their correct predictions, count of counted targets).
    Sums, not means: padding rows weigh 0 and batches add up, so an evaluation averages over real
    (and, with a loss mask, masked-in) targets only."""
    nll_BxT, hit_BxT, mask_BxT = token_losses(model, batch, None, compute_dtype)
    weights_BxT = jnp.broadcast_to(weights_B[:, None], nll_BxT.shape)
    if mask_BxT is not None:
        weights_BxT = weights_BxT * mask_BxT
    return (weights_BxT * nll_BxT).sum(), (weights_BxT * hit_BxT).sum(), weights_BxT.sum()
