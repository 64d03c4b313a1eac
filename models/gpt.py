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

from models.layers import (
    REMAT_POLICIES,
    LayerNorm,
    Linear,
    apply_blocks,
    causal_attention,
    document_positions,
    dropout,
    layer_norm,
    linear,
    rms,
)
from utils.errors import ConfigError


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
    name: str = "gpt"  # the registry's key (models/__init__.py): every model yaml names its family
    init_from: str | None = None  # a local Hugging Face directory (models/hf.py); conf/model_common.yaml

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


def _head_major(qkv: Linear, num_heads: int) -> Linear:
    """Reorder a fused qkv projection's output columns from (q|k|v, head, K) to (head, q|k|v, K).
    The same random draw as before, so the same function: only the storage order changes, so that
    tensor parallelism can split the columns into whole heads."""
    d_in, d_out = qkv.weight_IxO.shape
    K = d_out // (3 * num_heads)
    order_O = jnp.arange(d_out).reshape(3, num_heads, K).transpose(1, 0, 2).reshape(-1)
    return Linear(qkv.weight_IxO[:, order_O], None if qkv.bias_O is None else qkv.bias_O[order_O])


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
            ln1=layer_norm(d, cfg.bias),
            attn_qkv=_head_major(linear(k_qkv, d, 3 * d, 0.02, cfg.bias), cfg.num_heads),
            attn_out=linear(k_out, d, d, resid_std, cfg.bias),
            ln2=layer_norm(d, cfg.bias),
            mlp_in=linear(k_in, d, f, 0.02, cfg.bias),
            mlp_out=linear(k_mlp_out, f, d, resid_std, cfg.bias),
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
        attn_BxTxD = dropout(self.attn_out(a_BxTxD), cfg.dropout, k_attn).astype(x_BxTxD.dtype)
        x_BxTxD = x_BxTxD + attn_BxTxD

        h_BxTxF = jax.nn.gelu(self.mlp_in(self.ln2(x_BxTxD).astype(compute_dtype)), approximate=True)
        mlp_BxTxD = dropout(self.mlp_out(h_BxTxF), cfg.dropout, k_mlp).astype(x_BxTxD.dtype)
        if not collect:
            return x_BxTxD + mlp_BxTxD
        out_BxTxD = x_BxTxD + mlp_BxTxD
        return out_BxTxD, {"attn": rms(attn_BxTxD), "mlp": rms(mlp_BxTxD), "resid": rms(out_BxTxD)}


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
        self.ln_f = layer_norm(cfg.dim, cfg.bias)
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

        def apply(x_BxTxD, block_and_key):
            block, k = block_and_key
            out = block(x_BxTxD, k, cfg, compute_dtype, segment_ids_BxT, causal, collect)
            return out if collect else (out, None)

        x_BxTxD, stats_L = apply_blocks(apply, x_BxTxD, self.blocks, key, cfg.num_blocks, cfg.remat,
                                        cfg.scan_blocks, cfg.scan_unroll, collect)

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




Config, Model = GPTConfig, GPT  # the registry's names (models/__init__.py)
