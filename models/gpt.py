"""GPT-2 style decoder in Equinox.

The blocks are built once with `eqx.filter_vmap`, so every block weight carries a leading
`num_blocks` axis, and applied with `lax.scan`: compile time stays flat as the model deepens.
`scan_blocks=False` unrolls the same stacked weights into a Python loop (identical maths; on
a 2-core CPU it is a little faster for shallow models). All maths is written on whole batches
(`x_BxTxD`) so XLA sees large matmuls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from models import attention, hf_keys
from models import mup as mup_lib
from models.contract import ModelConfig
from models.layers import (
    LayerNorm,
    Linear,
    apply_blocks,
    document_positions,
    dropout,
    layer_norm,
    linear,
    output_logits,
    rms,
    split_heads,
)
from models.lora import LoraLinear, branch_keys
from models.moe import MoE, init_blocks, logical_axes, run_blocks
from models.moe import flops_per_token as moe_flops
from utils.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GPTConfig(ModelConfig):
    """GPT-2's shape: the shared knobs (models/contract.py ModelConfig) plus its MLP width and biases."""

    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * dim
    bias: bool = True  # biases in linear layers and layer norms
    name: str = "gpt"  # the registry's key (models/__init__.py): every model yaml names its family

    def check_family(self, prefix: str) -> None:
        if self.mlp_ratio <= 0:
            raise ConfigError(f"{prefix}.mlp_ratio={self.mlp_ratio} must be a positive integer")
        if self.dim % self.num_heads:
            raise ConfigError(
                f"{prefix}.dim={self.dim} is not divisible by {prefix}.num_heads={self.num_heads}: "
                "pick a head count that divides dim"
            )
        if self.moe.on and self.moe.shared_expert_hidden:
            raise ConfigError(f"{prefix}.moe.shared_expert_hidden={self.moe.shared_expert_hidden}: the shared expert "
                              "is a SwiGLU MLP (Qwen2-MoE's), which the gpt family lacks: set it to 0, or use "
                              "model=llama_tiny (or another llama yaml)")


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
        # variance does not grow with depth. model.mup: every std x 1/sqrt(width/base) (models/mup.py).
        std = mup_lib.hidden_std(cfg, 0.02)
        resid_std = std / math.sqrt(2 * cfg.num_blocks)
        return Block(
            ln1=layer_norm(d, cfg.bias),
            attn_qkv=_head_major(linear(k_qkv, d, 3 * d, std, cfg.bias), cfg.num_heads),
            attn_out=linear(k_out, d, d, resid_std, cfg.bias),
            ln2=layer_norm(d, cfg.bias),
            mlp_in=linear(k_in, d, f, std, cfg.bias),
            mlp_out=linear(k_mlp_out, f, d, resid_std, cfg.bias),
        )

    def __call__(self, x_BxTxD: jax.Array, key: jax.Array | None, cfg: GPTConfig, compute_dtype,
                 segment_ids_BxT: jax.Array | None = None, causal: bool = True,
                 collect: bool = False, router_mask_BxT: jax.Array | None = None, max_logits: bool = False
                 ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """`x_BxTxD` is the float32 residual stream: the matmuls run in `compute_dtype`, but the
        sums of the stream stay float32 (in bfloat16 a block's small update would round away).
        `collect` (static) also returns the RMS of the attention and MLP outputs and of the stream
        after the block (logging.activation_norms); `max_logits` (static) each head's largest
        attention logit under "max_logit" (H,) (optimizer.qk_clip_tau)."""
        B, T, D = x_BxTxD.shape
        H, K = cfg.num_heads, cfg.head_dim
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        k_qkv, k_out, k_in, k_mlp_out = branch_keys(key, cfg.lora, 4)  # LoRA's dropout; Nones without it

        h_BxTxD = self.ln1(x_BxTxD).astype(compute_dtype)
        # One plain (tokens x D) @ (D x 3D) matmul (LoRA's term included by Linear), then heads-major
        # q, k, v (B, H, T, K) by one transposing split (split_heads). The qkv columns are head-major
        # (head, q|k|v, K): a contiguous split of them over the tensor axis hands each device whole
        # heads (see `_head_major`).
        q_BxHxTxK, k_BxHxTxK, v_BxHxTxK = split_heads(self.attn_qkv(h_BxTxD, k_qkv), H, K)
        a_BxHxTxK = attention.attend(cfg, q_BxHxTxK, k_BxHxTxK, v_BxHxTxK, segment_ids_BxT=segment_ids_BxT,
                                     causal=causal, max_logits=max_logits)
        a_BxHxTxK, max_logit = a_BxHxTxK if max_logits else (a_BxHxTxK, None)
        a_BxTxD = a_BxHxTxK.transpose(0, 2, 1, 3).reshape(B, T, D)
        attn_BxTxD = dropout(self.attn_out(a_BxTxD, k_out), cfg.dropout, k_attn).astype(x_BxTxD.dtype)
        x_BxTxD = x_BxTxD + attn_BxTxD

        mlp_BxTxD, router = self.mlp(self.ln2(x_BxTxD).astype(compute_dtype), cfg, k_in, k_mlp_out, router_mask_BxT)
        mlp_BxTxD = dropout(mlp_BxTxD, cfg.dropout, k_mlp).astype(x_BxTxD.dtype)
        if not collect and router is None and not max_logits:
            return x_BxTxD + mlp_BxTxD
        out_BxTxD = x_BxTxD + mlp_BxTxD
        stats = {"attn": rms(attn_BxTxD), "mlp": rms(mlp_BxTxD), "resid": rms(out_BxTxD)} if collect else {}
        stats = {**stats, "max_logit": max_logit} if max_logits else stats
        return out_BxTxD, stats if router is None else {**stats, "moe": router}  # an MoE block's router statistics

    def mlp(self, h_BxTxD: jax.Array, cfg: GPTConfig, k_in, k_out, router_mask_BxT=None
            ) -> tuple[jax.Array, dict | None]:
        """The GELU MLP (no router statistics); an MoEBlock's mixture of experts returns its own,
        over the tokens `router_mask_BxT` counts (models/moe.py)."""
        return self.mlp_out(jax.nn.gelu(self.mlp_in(h_BxTxD, k_in), approximate=True), k_out), None


class GeluExperts(eqx.Module):
    """GPT's MLP as a stack of experts: every weight and bias with a leading expert axis."""

    mlp_in: Linear
    mlp_out: Linear

    def __call__(self, x: jax.Array, groups) -> jax.Array:
        return groups.linear(jax.nn.gelu(groups.linear(x, self.mlp_in), approximate=True), self.mlp_out)


class MoEBlock(Block):
    """A Block whose MLP is a mixture of experts (models/moe.py): the same attention, `mlp_in` and
    `mlp_out` None, the experts and the router under `moe`."""

    moe: MoE

    @staticmethod
    def init(key: jax.Array, cfg: GPTConfig) -> "MoEBlock":
        dense = Block.init(key, cfg)  # the attention and norms as a dense block at this key would have them
        k_router, k_in, k_out = jax.random.split(jax.random.fold_in(key, 1), 3)
        d, f, E = cfg.dim, cfg.mlp_ratio * cfg.dim, cfg.moe.num_experts
        std = mup_lib.hidden_std(cfg, 0.02)  # as Block.init's
        resid_std = std / math.sqrt(2 * cfg.num_blocks)
        stack = lambda k, i, o, std: eqx.filter_vmap(lambda k: linear(k, i, o, std, cfg.bias))(jax.random.split(k, E))
        experts = GeluExperts(stack(k_in, d, f, std), stack(k_out, f, d, resid_std))
        return MoEBlock(ln1=dense.ln1, attn_qkv=dense.attn_qkv, attn_out=dense.attn_out, ln2=dense.ln2, mlp_in=None,
                        mlp_out=None, moe=MoE(router=linear(k_router, d, E, 0.02, False), experts=experts))

    def mlp(self, h_BxTxD: jax.Array, cfg: GPTConfig, k_in, k_out, router_mask_BxT=None) -> tuple[jax.Array, dict]:
        return self.moe(h_BxTxD, cfg.moe, router_mask_BxT)


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
        if cfg.moe.on:  # MoE blocks (all, or the last of each group of `every`): models/moe.py
            self.blocks = init_blocks(k_blocks, cfg, lambda k: Block.init(k, cfg), lambda k: MoEBlock.init(k, cfg))
        else:
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
        router_mask_BxT: jax.Array | None = None,
        max_logits: bool = False,
    ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """Logits (float32) for every position. `key=None` disables dropout (evaluation);
        `segment_ids_BxT` keeps attention inside each packed document, and positions restart at 0
        at each document's first token (as when the document is sampled or evaluated alone).
        `causal` is the objective's (models/objectives.py): False lets every position attend to
        every other, as masked diffusion needs; the weights are the same either way. `collect`
        (static) returns (logits, per-block activation RMS {"attn","mlp","resid"}, each (num_blocks,)).
        `router_mask_BxT` (MoE only): the tokens the router statistics count (models/moe.py).
        `max_logits` (static) returns (logits, stats) with stats["max_logit"] (num_blocks, num_heads):
        each head's largest attention logit (optimizer.qk_clip_tau)."""
        cfg = self.cfg
        T = tokens_BxT.shape[1]
        if segment_ids_BxT is None:
            wpe = self.wpe_TxD[:T]
        else:
            wpe = jnp.take(self.wpe_TxD, document_positions(segment_ids_BxT), axis=0)
        # The residual stream stays float32 whatever compute_dtype is (see Block.__call__).
        x_BxTxD = (jnp.take(self.wte_VxD, tokens_BxT, axis=0) + wpe).astype(jnp.float32)

        stats_out = collect or max_logits  # (static) the blocks return statistics

        def apply(x_BxTxD, block_and_key):
            block, k = block_and_key
            out = block(x_BxTxD, k, cfg, compute_dtype, segment_ids_BxT, causal, collect, max_logits=max_logits)
            return out if stats_out else (out, None)

        if cfg.moe.on:  # router statistics per MoE block come back under stats_L["moe"] (with `collect`)
            x_BxTxD, stats_L = run_blocks(lambda block, x, k: block(x, k, cfg, compute_dtype, segment_ids_BxT, causal,
                                                                    collect, router_mask_BxT, max_logits=max_logits),
                                          x_BxTxD, self.blocks, key, cfg, stats_out)
        else:
            x_BxTxD, stats_L = apply_blocks(apply, x_BxTxD, self.blocks, key, cfg.num_blocks, cfg.remat,
                                            cfg.scan_blocks, cfg.scan_unroll, stats_out)

        head_DxV = self.wte_VxD.T if self.head_DxV is None else self.head_DxV
        # model.mup: logits x base/width (MuReadout's multiplier; 1 without muP, a constant XLA folds)
        logits_BxTxV = output_logits(self.ln_f(x_BxTxD), head_DxV, compute_dtype, mup_lib.width_ratio(cfg))  # float32
        return (logits_BxTxV, stats_L) if stats_out else logits_BxTxV


def scale_query_key(block: Block, q_scale_xH: jax.Array, k_scale_xH: jax.Array) -> Block:
    """`block` (leaves with the leading axes of the scales, e.g. (num_blocks,)) with each head's query
    columns of the fused qkv projection times q_scale and its key columns times k_scale, bias too
    (q = x·W_q + b_q scales exactly only if b_q does), values untouched (optimizer.qk_clip_tau). The
    columns are head-major (head, q|k|v, K) (`_head_major`). A scale of exactly 1 leaves the bits."""
    qkv = block.attn_qkv
    K = qkv.weight_IxO.shape[-1] // (3 * q_scale_xH.shape[-1])
    col_xHx3 = jnp.stack([q_scale_xH, k_scale_xH, jnp.ones_like(q_scale_xH)], axis=-1).astype(jnp.float32)
    col_xO = jnp.broadcast_to(col_xHx3[..., None], (*col_xHx3.shape, K)).reshape(*col_xHx3.shape[:-2], -1)
    scaled = lambda a, col: (a.astype(jnp.float32) * col).astype(a.dtype)
    out = eqx.tree_at(lambda b: b.attn_qkv.weight_IxO, block, scaled(qkv.weight_IxO, col_xO[..., None, :]))
    if qkv.bias_O is not None:
        out = eqx.tree_at(lambda b: b.attn_qkv.bias_O, out, scaled(qkv.bias_O, col_xO))
    return out


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
LORA_TARGETS = ("attn_qkv", "attn_out", "mlp_in", "mlp_out")  # model.lora.targets: the block's projections

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
    ("router", "weight_IxO"): ("layers", "embed", "router"),  # MoE: the router is not split over experts
}


def param_axes(model: GPT) -> GPT:
    """Same tree as `model`, each array replaced by the logical names of its dimensions."""

    return logical_axes(model, PARAM_AXES)


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
    if cfg.moe.on:  # an MoE block's MLP: top_k experts per token and the router, instead of one MLP
        n_matmul += len(cfg.moe.layers(L)) * (moe_flops(cfg.moe, d, 2 * d * f) - 2 * d * f)
    return 6.0 * n_matmul + 12.0 * L * d * seq_len




Config, Model = GPTConfig, GPT  # the registry's names (models/__init__.py)


# ----------------------------------------------------------------------------- Hugging Face (models/hf.py)
# transformers' GPT2LMHeadModel: its Conv1D weights are (in, out) like ours; its fused c_attn columns
# are (q|k|v, head, K) where ours are head-major (head, q|k|v, K) (`_head_major`); it always has biases.

HF_MODEL_TYPES = ("gpt2",)
_HF_GELU = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation, jax.nn.gelu(approximate=True)
_HF_BLOCK = {  # our block field -> GPT-2's module under transformer.h.<i>
    "ln1": "ln_1", "attn_qkv": "attn.c_attn", "attn_out": "attn.c_proj", "ln2": "ln_2",
    "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj",
}
_HF_PARAM = {"weight_IxO": "weight", "bias_O": "bias", "gain_D": "weight", "bias_D": "bias"}


def hf_config(cfg: GPTConfig) -> dict:
    """transformers' GPT2Config fields of `cfg`. Dropout is exported as resid_pdrop (ours drops each
    block's attention and MLP outputs, which is GPT-2's residual dropout); GPT-2 has no bias-free form."""
    mup_lib.refuse_hf_export(cfg)
    if not cfg.bias:
        raise ConfigError("model.bias=false cannot be exported as gpt2: Hugging Face's GPT-2 always has biases "
                          "(export --format safetensors instead)")
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_positions": cfg.context_length, "n_embd": cfg.dim,
        "n_layer": cfg.num_blocks, "n_head": cfg.num_heads, "n_inner": cfg.mlp_ratio * cfg.dim,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": cfg.dropout, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
    }


# config.json keys config_from_hf reads (models/hf_keys.py checks each before anything is built)
INT, NUMBER, BOOL, STR = "a positive integer", "a positive number", "a boolean", "a string"
HF_KEYS = {
    "n_embd": hf_keys.Key(INT, "the model width", required=True),
    "n_head": hf_keys.Key(INT, "attention heads per block", required=True),
    "n_layer": hf_keys.Key(INT, "the number of blocks", required=True),
    "n_positions": hf_keys.Key(INT, "the context length: rows of the position table", required=True),
    "vocab_size": hf_keys.Key(INT, "the embedding rows", required=True),
    "n_inner": hf_keys.Key(INT, "the MLP width; null = 4 * n_embd"),
    "activation_function": hf_keys.Key(STR, "the MLP's GELU", default="gelu_new"),
    "layer_norm_epsilon": hf_keys.Key(NUMBER, "the LayerNorm epsilon", default=1e-5),
    "scale_attn_weights": hf_keys.Key(BOOL, "attention scores scaled by 1/sqrt(head size)", default=True),
    "scale_attn_by_inverse_layer_idx": hf_keys.Key(BOOL, "scores also scaled by 1/layer", default=False),
    "reorder_and_upcast_attn": hf_keys.Key(BOOL, "a float32 attention variant", default=False),
    "add_cross_attention": hf_keys.Key(BOOL, "encoder-decoder cross-attention", default=False),
    "tie_word_embeddings": hf_keys.Key(BOOL, "whether the head is the embedding", default=True),
}


def config_from_hf(hf: dict, base: GPTConfig, where: str = "config.json") -> GPTConfig:
    """The GPTConfig of a gpt2 config.json: its shape knobs, `base`'s execution knobs (scan, remat,
    dropout, attention blocks). Every fault is one ConfigError naming `where` (the file) and the key."""
    if hf.get("model_type") not in HF_MODEL_TYPES:
        raise ConfigError(f"{where} model_type={hf_keys.json_text(hf.get('model_type'))} is not a gpt2 model: "
                          "use a gpt2 checkpoint")
    v = hf_keys.read(hf, HF_KEYS, where)

    def refuse(key: str, fix: str) -> ConfigError:
        return ConfigError(f"{where} {key}={hf_keys.json_text(v[key])} has no eqtrain gpt equivalent: {fix}")

    if v["activation_function"] not in _HF_GELU:
        raise refuse("activation_function", f"eqtrain's GPT uses the tanh GELU ({' / '.join(_HF_GELU)})")
    if abs(float(v["layer_norm_epsilon"]) - 1e-5) > 1e-12:
        raise refuse("layer_norm_epsilon", "eqtrain's LayerNorm uses 1e-5")
    for key, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if v[key] != ours:
            raise refuse(key, f"eqtrain's GPT attention is the plain {key}={str(ours).lower()} form")
    dim, heads, inner = v["n_embd"], v["n_head"], v["n_inner"] or 4 * v["n_embd"]
    if dim % heads:
        raise ConfigError(f"{where} n_embd={dim} is not divisible by n_head={heads}: each head takes an equal "
                          "share of the width; correct config.json")
    if inner % dim:
        raise refuse("n_inner", f"the MLP width must be a multiple of n_embd={dim} (model.mlp_ratio)")
    cfg = dataclasses.replace(
        base, name="gpt", dim=dim, num_heads=heads, num_blocks=v["n_layer"], context_length=v["n_positions"],
        vocab_size=v["vocab_size"], mlp_ratio=inner // dim, tie_embeddings=v["tie_word_embeddings"], bias=True)
    try:
        cfg.check("model")
    except ConfigError as e:
        raise ConfigError(f"{where} describes a model this family rejects: {e}") from None
    return cfg


def _qkv_perm(cfg: GPTConfig) -> np.ndarray:
    """Column order taking GPT-2's (q|k|v, head, K) c_attn to ours (head, q|k|v, K); argsort inverts it."""
    return np.arange(3 * cfg.dim).reshape(3, cfg.num_heads, cfg.head_dim).transpose(1, 0, 2).reshape(-1)


def hf_tensors(model: GPT) -> dict:
    """The model's arrays as GPT2LMHeadModel's state dict (numpy, Hugging Face names and layouts)."""
    cfg = model.cfg
    if not cfg.bias:
        hf_config(cfg)  # the one-line refusal
    to_hf = np.argsort(_qkv_perm(cfg))
    out = {"transformer.wte.weight": np.asarray(model.wte_VxD), "transformer.wpe.weight": np.asarray(model.wpe_TxD),
           "transformer.ln_f.weight": np.asarray(model.ln_f.gain_D),
           "transformer.ln_f.bias": np.asarray(model.ln_f.bias_D)}
    if model.head_DxV is not None:
        out["lm_head.weight"] = np.asarray(model.head_DxV).T  # torch Linear: (out, in)
    for ours, theirs in _HF_BLOCK.items():
        for field, param in _HF_PARAM.items():
            stacked = getattr(getattr(model.blocks, ours), field, None)
            if stacked is None:
                continue
            stacked = np.asarray(stacked)
            if ours == "attn_qkv":
                stacked = stacked[..., to_hf]
            for i in range(cfg.num_blocks):
                out[f"transformer.h.{i}.{theirs}.{param}"] = stacked[i]
    return out


HF_LORA_FAN_IN_FAN_OUT = True  # GPT-2's projections are Conv1D, weight (in, out): PEFT's fan_in_fan_out


def hf_lora_tensors(model: GPT) -> dict[str, np.ndarray]:
    """The LoRA factors as PEFT names them under GPT2LMHeadModel (`transformer.h.{i}.attn.c_attn.lora_A.weight`):
    lora_A (rank, in) = Aᵀ and lora_B (out, rank) = Bᵀ, PEFT's nn.Linear layouts over a Conv1D too
    (its forward adds lora_B(lora_A(x)) = x·A·B); c_attn's B in GPT-2's (q|k|v, head, K) column order."""
    out = {}
    for ours, theirs in _HF_BLOCK.items():
        linear = getattr(model.blocks, ours)
        if not isinstance(linear, LoraLinear):
            continue
        a, b = np.asarray(linear.lora_a_IxR), np.asarray(linear.lora_b_RxO)
        if ours == "attn_qkv":
            b = b[..., np.argsort(_qkv_perm(model.cfg))]
        for i in range(model.cfg.num_blocks):
            out[f"transformer.h.{i}.{theirs}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"transformer.h.{i}.{theirs}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def from_hf_tensors(cfg: GPTConfig, tensors: dict, where: str = "model.safetensors") -> GPT:
    """A GPT of `cfg` from GPT2LMHeadModel's (or GPT2Model's) tensors; CheckpointError naming a
    missing or misshapen one. Buffers GPT-2 once saved (attn.bias, attn.masked_bias) are ignored."""
    from models.hf import expect, fill  # here: models.hf imports the registry, which imports this module

    pre = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""  # GPT2Model has none
    D, V, L, F = cfg.dim, cfg.vocab_size, cfg.num_blocks, cfg.mlp_ratio * cfg.dim
    shapes = {"ln_1": {"weight": (D,), "bias": (D,)}, "attn.c_attn": {"weight": (D, 3 * D), "bias": (3 * D,)},
              "attn.c_proj": {"weight": (D, D), "bias": (D,)}, "ln_2": {"weight": (D,), "bias": (D,)},
              "mlp.c_fc": {"weight": (D, F), "bias": (F,)}, "mlp.c_proj": {"weight": (F, D), "bias": (D,)}}
    to_ours = _qkv_perm(cfg)
    named = {"wte_VxD": expect(tensors, f"{pre}wte.weight", (V, D), where),
             "wpe_TxD": expect(tensors, f"{pre}wpe.weight", (cfg.context_length, D), where),
             "ln_f.gain_D": expect(tensors, f"{pre}ln_f.weight", (D,), where),
             "ln_f.bias_D": expect(tensors, f"{pre}ln_f.bias", (D,), where)}
    if not cfg.tie_embeddings:
        named["head_DxV"] = expect(tensors, "lm_head.weight", (V, D), where).T
    for ours, theirs in _HF_BLOCK.items():
        for field, param in _HF_PARAM.items():
            if (field in ("gain_D", "bias_D")) != ours.startswith("ln"):
                continue
            stacked = np.stack([expect(tensors, f"{pre}h.{i}.{theirs}.{param}", shapes[theirs][param], where)
                                for i in range(L)])
            named[f"blocks.{ours}.{field}"] = stacked[..., to_ours] if ours == "attn_qkv" else stacked
    return fill(cfg, named, where, getattr(tensors, "dtype", None))  # a models.hf.Tensors reader's dtype
