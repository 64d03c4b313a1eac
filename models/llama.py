"""Llama-style decoder in Equinox: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Covers Llama 2/3 (no biases; Llama 3.1+'s long-context `rope_scaling`), Mistral without a sliding
window, Qwen2 (`qkv_bias`) and QK-norm models (`qk_norm`: per head as Qwen3, with its `head_size`;
over all heads together as OLMoE, `qk_norm_scope: all`).
The module names and weight layouts follow Hugging Face's (`q_proj`, `gate_proj`, rotary in the
rotate-half layout), so its checkpoints map 1:1 with a transpose and no permutation
(`hf_tensors` / `from_hf_tensors`). Blocks are stacked and run exactly as GPT's
(models/layers.py `apply_blocks`: scan or unrolled, remat), the residual stream float32, matmuls
in compute_dtype, logits float32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from models import attention, hf_keys, hf_moe
from models import mup as mup_lib
from models.contract import ModelConfig
from models.layers import (
    Linear,
    RMSNorm,
    apply_blocks,
    document_positions,
    dropout,
    linear,
    output_logits,
    rms,
)
from models.lora import LoraLinear, branch, branch_keys
from models.moe import MoE, init_blocks, logical_axes, run_blocks
from models.moe import flops_per_token as moe_flops
from utils.errors import CheckpointError, ConfigError

ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic")  # model.rope_scaling.type: transformers' rope_type of that name
# The knobs each type reads beside `type` and `factor`; any other knob off its default is refused.
ROPE_KNOBS = {
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_context_length"),
    "yarn": ("original_context_length", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
             "truncate"),
    "dynamic": ("original_context_length",),
}
QK_NORM_SCOPES = ("head", "all")  # model.qk_norm_scope


@dataclass(frozen=True)
class RopeScaling:
    """`model.rope_scaling`: rotary frequencies stretched so a model pretrained on a shorter context
    reads a longer one, as transformers computes them (modeling_rope_utils.py: `linear`, `llama3`,
    `yarn`, `dynamic`), so a Llama 3.1+ or Qwen2.5 long-context checkpoint keeps its positions."""

    type: str  # linear | llama3 | yarn | dynamic
    factor: float  # the context's stretch: linear divides every frequency by it, llama3 and yarn the low ones
    low_freq_factor: float = 1.0  # llama3: wavelengths over original_context_length/low_freq_factor are divided
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_context_length/high_freq_factor are kept
    original_context_length: int | None = None  # llama3, yarn, dynamic: the pretraining context; null = context_length
    beta_fast: float = 32.0  # yarn: frequencies turning more than beta_fast times in the original context are kept
    beta_slow: float = 1.0  # yarn: frequencies turning fewer than beta_slow times are divided by factor
    mscale: float | None = None  # yarn (with mscale_all_dim): attention_factor = m(factor, mscale)/m(factor, all_dim)
    mscale_all_dim: float | None = None  # yarn: the denominator's mscale (DeepSeek's configs set both)
    attention_factor: float | None = None  # yarn: cos and sin times this; null = 0.1·ln(factor) + 1 (or mscale's ratio)
    truncate: bool = True  # yarn: the correction range's ends rounded outwards to whole dimensions

    def check(self, prefix: str = "model.rope_scaling") -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError(f"{prefix}.type={self.type!r} is not a rotary scaling eqtrain implements: use "
                              f"{', '.join(ROPE_TYPES)}, or {prefix}=null for plain rotary positions")
        if not self.factor > 0:
            raise ConfigError(f"{prefix}.factor={self.factor} must be positive (the context's stretch, e.g. 8.0)")
        taken = ROPE_KNOBS[self.type]
        stray = [f.name for f in dataclasses.fields(self) if f.name not in ("type", "factor", *taken)
                 and getattr(self, f.name) != f.default]
        if stray:
            owners = {t for t, knobs in ROPE_KNOBS.items() if set(stray) & set(knobs)}
            raise ConfigError(f"{prefix}.type={self.type} does not read {', '.join(stray)} (knobs of "
                              f"{' or '.join(sorted(owners))}): drop them, or pick the type that takes them")
        if self.original_context_length is not None and self.original_context_length <= 0:
            raise ConfigError(f"{prefix}.original_context_length={self.original_context_length} must be a "
                              "positive integer, or null for model.context_length")
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"{prefix}.low_freq_factor={self.low_freq_factor} and high_freq_factor="
                              f"{self.high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1.0 and 4.0)")
        if self.type == "yarn":
            if not 0 < self.beta_slow < self.beta_fast:
                raise ConfigError(f"{prefix}.beta_slow={self.beta_slow} and beta_fast={self.beta_fast} must satisfy "
                                  "0 < beta_slow < beta_fast (rotations in the original context; YaRN's 1 and 32)")
            for knob in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, knob) is not None and not getattr(self, knob) > 0:
                    raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be positive, or null")
            if (self.mscale is None) != (self.mscale_all_dim is None):
                raise ConfigError(f"{prefix}.mscale={self.mscale} with mscale_all_dim={self.mscale_all_dim}: "
                                  "transformers reads the two only together; set both, or neither")
            if self.attention_factor is not None and self.mscale is not None:
                raise ConfigError(f"{prefix}.attention_factor={self.attention_factor} with mscale={self.mscale}: "
                                  "an explicit attention_factor replaces mscale's; set one of the two")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
    """Llama's shape: the shared knobs (models/contract.py ModelConfig) plus grouped-query attention,
    rotary positions, RMSNorm and the SwiGLU MLP (and the variants Qwen2/3 and OLMoE take)."""

    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); null = num_heads
    head_size: int | None = None  # each head's size (config.json's head_dim); null = dim/num_heads
    mlp_hidden: int | None = None  # SwiGLU width; null = 8/3·dim rounded up to mlp_multiple (Llama's rule)
    mlp_multiple: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # long-context rotary frequencies (Llama 3.1+); null = plain rotary
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before rotary (Qwen3, OLMo2)
    qk_norm_scope: str = "head"  # head: each head's q, k normalised alone (Qwen3); all: all heads' together (OLMoE)
    name: str = "llama"  # the registry's key (models/__init__.py)

    def check_family(self, prefix: str) -> None:
        if self.mlp_multiple <= 0:
            raise ConfigError(f"{prefix}.mlp_multiple={self.mlp_multiple} must be a positive integer")
        if self.head_size is not None and self.head_size <= 0:
            raise ConfigError(f"{prefix}.head_size={self.head_size} must be a positive integer, or null for "
                              f"{prefix}.dim/{prefix}.num_heads")
        if self.head_size is None and self.dim % self.num_heads:
            raise ConfigError(f"{prefix}.dim={self.dim} is not divisible by {prefix}.num_heads={self.num_heads}: "
                              f"pick a head count that divides dim, or set {prefix}.head_size")
        if self.head_dim % 2:
            size = f"{prefix}.head_size" if self.head_size is not None else f"{prefix}.dim/{prefix}.num_heads"
            raise ConfigError(f"{size}={self.head_dim} is odd: rotary positions rotate pairs of a head's "
                              "dimensions; pick an even head size")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ConfigError(f"{prefix}.num_kv_heads={self.num_kv_heads} must divide {prefix}.num_heads="
                              f"{self.num_heads} (each key/value head serves a group of query heads): pick a "
                              "divisor, or null for one per query head")
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ConfigError(f"{prefix}.mlp_hidden={self.mlp_hidden} must be positive, or null for Llama's rule")
        for knob in ("rope_theta", "norm_eps"):
            if not getattr(self, knob) > 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be positive")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ConfigError(f"{prefix}.qk_norm_scope={self.qk_norm_scope!r} must be one of "
                              f"{', '.join(QK_NORM_SCOPES)} (head: Qwen3's per-head norm; all: OLMoE's over all heads)")
        if self.rope_scaling is not None:
            self.rope_scaling.check(f"{prefix}.rope_scaling")

    @property
    def head_dim(self) -> int:
        """Each head's size: `head_size`, or dim/num_heads (Qwen3 and Mistral Nemo set it apart from dim)."""
        return self.head_size or self.dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolved (utils/config.py checks parallel.tensor divides them)."""
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        """The SwiGLU hidden width: `mlp_hidden`, or Llama's int(8/3·dim) rounded up to mlp_multiple
        (a SwiGLU MLP has three matrices, so 8/3 keeps GPT's 4·dim two-matrix parameter count)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-int(8 * self.dim / 3) // self.mlp_multiple) * self.mlp_multiple


def rotary_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                    context_length: int | None = None, seq_len: int | None = None) -> jax.Array:
    """The head_dim/2 rotary frequencies, float32, with transformers' operations in its order
    (modeling_rope_utils.py), so a scaled checkpoint's angles match its own to the rounding:
    plain theta^(-2i/head_dim); `linear` divides them all by factor; `llama3` divides those whose
    wavelength 2π/f exceeds original/low_freq_factor, keeps those under original/high_freq_factor,
    and blends in between; `yarn` blends by dimension between kept and divided (`_yarn_inv_freq`);
    `dynamic` raises theta for a forward of `seq_len` positions past the original context
    (`_dynamic_inv_freq`). `context_length` stands in for a null original_context_length."""
    inv_freq_K2 = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq_K2
    factor = scaling.factor
    if scaling.type == "linear":
        return inv_freq_K2 / factor
    old = scaling.original_context_length or context_length
    if old is None:
        raise ValueError(f"{scaling.type} rotary scaling needs original_context_length or the model's context_length")
    if scaling.type == "dynamic":
        return _dynamic_inv_freq(inv_freq_K2, head_dim, theta, factor, old, seq_len)
    if scaling.type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, old)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    low_freq_wavelen, high_freq_wavelen = old / low, old / high
    wavelen_K2 = 2 * math.pi / inv_freq_K2
    scaled_K2 = jnp.where(wavelen_K2 > low_freq_wavelen, inv_freq_K2 / factor, inv_freq_K2)
    smooth_K2 = (old / wavelen_K2 - low) / (high - low)
    smoothed_K2 = (1 - smooth_K2) * scaled_K2 / factor + smooth_K2 * scaled_K2
    medium_K2 = ~(wavelen_K2 < high_freq_wavelen) & ~(wavelen_K2 > low_freq_wavelen)
    return jnp.where(medium_K2, smoothed_K2, scaled_K2)


def _dynamic_inv_freq(inv_freq_K2: jax.Array, head_dim: int, theta: float, factor: float, old: int,
                      seq_len: int | None) -> jax.Array:
    """Dynamic NTK: up to `old` positions the plain frequencies; a forward of seq_len > old positions
    uses the base theta·(factor·seq_len/old − (factor − 1))^(K/(K−2)), computed in float32 as
    transformers' rotary forward computes it from the input's longest position (its
    `dynamic_frequency_update`). Here seq_len is the row length T, known when tracing."""
    if seq_len is None or seq_len <= old:
        return inv_freq_K2
    grown = jnp.asarray(seq_len, jnp.float32) * factor / old - (factor - 1)  # torch: factor·seq_len, same rounding
    base = theta * grown ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, old: int) -> jax.Array:
    """YaRN (transformers' `_compute_yarn_parameters`): dimension d's frequency is kept where it
    turns more than beta_fast times in the original context, divided by factor where it turns fewer
    than beta_slow times, and blended linearly in d between (the ramp's ends floored/ceiled with
    `truncate`)."""
    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times in `old` positions
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs_K2 = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    extrapolation_K2, interpolation_K2 = 1.0 / pos_freqs_K2, 1.0 / (scaling.factor * pos_freqs_K2)
    ramp_K2 = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep_K2 = 1 - ramp_K2
    return interpolation_K2 * (1 - keep_K2) + extrapolation_K2 * keep_K2


def rotary_attention_factor(scaling: RopeScaling | None) -> float:
    """yarn's factor on cos and sin (so on q·k, squared): `attention_factor`, else with mscale and
    mscale_all_dim m(factor, mscale)/m(factor, mscale_all_dim), else m(factor), where
    m(s, k) = 0.1·k·ln(s) + 1 (1 for s <= 1); 1 for every other type."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(m(scaling.factor, scaling.mscale) / m(scaling.factor, scaling.mscale_all_dim))
    return m(scaling.factor)


def rotary_cos_sin(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                   context_length: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's rotary angles, float32, shape positions.shape + (head_dim,).
    Hugging Face's layout: frequency i (`rotary_inv_freq`) for the pair (i, i + head_dim/2), so the
    angles are repeated for the two halves; both times yarn's attention factor. `dynamic` takes
    the row length T = positions.shape[-1] as transformers' longest input (packed rows too)."""
    inv_freq_K2 = rotary_inv_freq(head_dim, theta, scaling, context_length, seq_len=positions.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq_K2
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    attention_factor = rotary_attention_factor(scaling)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rotary(x_BxHxTxK: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate each (i, i + K/2) pair by its angle (rotate-half), in float32; cos/sin broadcast
    against x (TxK, or Bx1xTxK with per-document positions)."""
    x32 = x_BxHxTxK.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_BxHxTxK.dtype)


def _norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(jnp.ones((dim,), jnp.float32), eps)


def _project(linear: Linear, x_BxTxI: jax.Array, key: jax.Array | None) -> jax.Array:
    """x·W (+ b), plus LoRA's low-rank branch (with its dropout key) where `linear` carries factors."""
    y_BxTxO = Linear.__call__(linear, x_BxTxI)
    lora_BxTxO = branch(linear, x_BxTxI, key)
    return y_BxTxO if lora_BxTxO is None else y_BxTxO + lora_BxTxO


def _split_heads(x_BxTxN: jax.Array, heads: int) -> jax.Array:
    B, T, N = x_BxTxN.shape
    return x_BxTxN.reshape(B, T, heads, N // heads).transpose(0, 2, 1, 3)


class Block(eqx.Module):
    attn_norm: RMSNorm
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    o_proj: Linear
    mlp_norm: RMSNorm
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    @staticmethod
    def init(key: jax.Array, cfg: LlamaConfig) -> "Block":
        k_q, k_k, k_v, k_o, k_gate, k_up, k_down = jax.random.split(key, 7)
        d, f, K = cfg.dim, cfg.mlp_width, cfg.head_dim
        per_head = cfg.qk_norm_scope == "head"  # else one norm over all heads' q (and one over all k), OLMoE's
        # As GPT-2: the residual output projections (o_proj, down_proj) get 0.02/sqrt(2·num_blocks),
        # so the residual stream's variance does not grow with depth; everything else N(0, 0.02).
        # model.mup: every std x 1/sqrt(width/base) (models/mup.py).
        std = mup_lib.hidden_std(cfg, 0.02)
        resid_std = std / math.sqrt(2 * cfg.num_blocks)
        return Block(
            attn_norm=_norm(d, cfg.norm_eps),
            q_proj=linear(k_q, d, cfg.num_heads * K, std, cfg.qkv_bias),
            k_proj=linear(k_k, d, cfg.kv_heads * K, std, cfg.qkv_bias),
            v_proj=linear(k_v, d, cfg.kv_heads * K, std, cfg.qkv_bias),
            q_norm=_norm(K if per_head else cfg.num_heads * K, cfg.norm_eps) if cfg.qk_norm else None,
            k_norm=_norm(K if per_head else cfg.kv_heads * K, cfg.norm_eps) if cfg.qk_norm else None,
            o_proj=linear(k_o, cfg.num_heads * K, d, resid_std, False),
            mlp_norm=_norm(d, cfg.norm_eps),
            gate_proj=linear(k_gate, d, f, std, False),
            up_proj=linear(k_up, d, f, std, False),
            down_proj=linear(k_down, f, d, resid_std, False),
        )

    def __call__(self, x_BxTxD: jax.Array, key: jax.Array | None, cfg: LlamaConfig, compute_dtype,
                 cos_sin: tuple[jax.Array, jax.Array], segment_ids_BxT: jax.Array | None = None,
                 causal: bool = True, collect: bool = False, router_mask_BxT: jax.Array | None = None,
                 max_logits: bool = False):
        """`x_BxTxD` is the float32 residual stream (matmuls in `compute_dtype`, as GPT's Block).
        Key/value heads are repeated to the query heads (head h reads kv head h // group, Hugging
        Face's `repeat_kv`): the attention kernel stays the one GPT uses. `max_logits` (static): each
        query head's largest attention logit under "max_logit" (H,) (optimizer.qk_clip_tau)."""
        B, T, _ = x_BxTxD.shape
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        k_q, k_k, k_v, k_o, k_gate, k_up, k_down = branch_keys(key, cfg.lora, 7)  # LoRA's dropout; Nones without it

        h_BxTxD = self.attn_norm(x_BxTxD).astype(compute_dtype)
        q_BxTxHK, k_BxTxGK = _project(self.q_proj, h_BxTxD, k_q), _project(self.k_proj, h_BxTxD, k_k)
        all_heads = self.q_norm is not None and cfg.qk_norm_scope == "all"
        if all_heads:  # OLMoE: one RMSNorm over every head's q (and one over k), before the split
            q_BxTxHK, k_BxTxGK = self.q_norm(q_BxTxHK), self.k_norm(k_BxTxGK)
        q_BxHxTxK = _split_heads(q_BxTxHK, cfg.num_heads)
        k_BxGxTxK = _split_heads(k_BxTxGK, cfg.kv_heads)
        v_BxGxTxK = _split_heads(_project(self.v_proj, h_BxTxD, k_v), cfg.kv_heads)
        if self.q_norm is not None and not all_heads:
            q_BxHxTxK, k_BxGxTxK = self.q_norm(q_BxHxTxK), self.k_norm(k_BxGxTxK)
        q_BxHxTxK, k_BxGxTxK = apply_rotary(q_BxHxTxK, *cos_sin), apply_rotary(k_BxGxTxK, *cos_sin)
        group = cfg.num_heads // cfg.kv_heads
        k_BxHxTxK, v_BxHxTxK = jnp.repeat(k_BxGxTxK, group, axis=1), jnp.repeat(v_BxGxTxK, group, axis=1)
        a_BxHxTxK = attention.attend(cfg, q_BxHxTxK, k_BxHxTxK, v_BxHxTxK, segment_ids_BxT=segment_ids_BxT,
                                     causal=causal, max_logits=max_logits)
        a_BxHxTxK, max_logit = a_BxHxTxK if max_logits else (a_BxHxTxK, None)
        a_BxTxD = a_BxHxTxK.transpose(0, 2, 1, 3).reshape(B, T, -1)
        attn_BxTxD = dropout(_project(self.o_proj, a_BxTxD, k_o), cfg.dropout, k_attn).astype(x_BxTxD.dtype)
        x_BxTxD = x_BxTxD + attn_BxTxD

        mlp_BxTxD, router = self.mlp(self.mlp_norm(x_BxTxD).astype(compute_dtype), cfg, (k_gate, k_up, k_down),
                                     router_mask_BxT)
        mlp_BxTxD = dropout(mlp_BxTxD, cfg.dropout, k_mlp).astype(x_BxTxD.dtype)
        out_BxTxD = x_BxTxD + mlp_BxTxD
        if not collect and router is None and not max_logits:
            return out_BxTxD
        stats = {"attn": rms(attn_BxTxD), "mlp": rms(mlp_BxTxD), "resid": rms(out_BxTxD)} if collect else {}
        stats = {**stats, "max_logit": max_logit} if max_logits else stats
        return out_BxTxD, stats if router is None else {**stats, "moe": router}  # an MoE block's router statistics

    def mlp(self, h_BxTxD: jax.Array, cfg: LlamaConfig, keys: tuple, router_mask_BxT=None
            ) -> tuple[jax.Array, dict | None]:
        """The SwiGLU MLP (no router statistics); `keys`: LoRA's dropout keys of gate, up and down.
        An MoEBlock's mixture of experts returns its router's statistics instead of None (over the
        tokens `router_mask_BxT` counts, models/moe.py)."""
        k_gate, k_up, k_down = keys
        h_BxTxF = jax.nn.silu(_project(self.gate_proj, h_BxTxD, k_gate)) * _project(self.up_proj, h_BxTxD, k_up)
        return _project(self.down_proj, h_BxTxF, k_down), None


class SwiGLU(eqx.Module):
    """Llama's MLP on its own: the shared expert of an MoE block (models/moe.py `MoE.shared`)."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x_NxD)) * self.up_proj(x_NxD))


class SwiGLUExperts(eqx.Module):
    """Llama's MLP as a stack of experts (models/moe.py `Groups`): every weight (E, in, out)."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __call__(self, x: jax.Array, groups) -> jax.Array:
        h = jax.nn.silu(groups.linear(x, self.gate_proj)) * groups.linear(x, self.up_proj)
        return groups.linear(h, self.down_proj)


class MoEBlock(Block):
    """A Block whose MLP is a mixture of SwiGLU experts (models/moe.py): the same attention and
    norms, `gate_proj`/`up_proj`/`down_proj` None, the experts and the router under `moe`."""

    moe: MoE

    @staticmethod
    def init(key: jax.Array, cfg: LlamaConfig) -> "MoEBlock":
        dense = Block.init(key, cfg)  # the attention and norms a dense block at this key would have
        k_router, k_gate, k_up, k_down = jax.random.split(jax.random.fold_in(key, 1), 4)
        d, f, E = cfg.dim, cfg.mlp_width, cfg.moe.num_experts
        std = mup_lib.hidden_std(cfg, 0.02)  # as Block.init's
        resid_std = std / math.sqrt(2 * cfg.num_blocks)  # as Block.init's down_proj
        stack = lambda k, i, o, std: eqx.filter_vmap(lambda k: linear(k, i, o, std, False))(jax.random.split(k, E))
        experts = SwiGLUExperts(stack(k_gate, d, f, std), stack(k_up, d, f, std), stack(k_down, f, d, resid_std))
        shared, shared_gate, fs = None, None, cfg.moe.shared_expert_hidden
        if fs:  # Qwen2-MoE's shared expert and its gate, from keys of their own (the routed ones' draws unchanged)
            k_sg, k_su, k_sd, k_sgate = jax.random.split(jax.random.fold_in(key, 2), 4)
            shared = SwiGLU(linear(k_sg, d, fs, std, False), linear(k_su, d, fs, std, False),
                            linear(k_sd, fs, d, resid_std, False))
            shared_gate = linear(k_sgate, d, 1, 0.02, False)  # a gate like the router: not width-scaled
        fields = {field.name: getattr(dense, field.name) for field in dataclasses.fields(Block)}
        return MoEBlock(**{**fields, "gate_proj": None, "up_proj": None, "down_proj": None},
                        moe=MoE(router=linear(k_router, d, E, 0.02, False), experts=experts, shared=shared,
                                shared_gate=shared_gate))

    def mlp(self, h_BxTxD: jax.Array, cfg: LlamaConfig, keys: tuple, router_mask_BxT=None) -> tuple[jax.Array, dict]:
        return self.moe(h_BxTxD, cfg.moe, router_mask_BxT)


class Llama(eqx.Module):
    embed_VxD: jax.Array
    blocks: Block  # every leaf stacked: leading axis = num_blocks
    final_norm: RMSNorm
    head_DxV: jax.Array | None  # None when tied to embed_VxD
    cfg: LlamaConfig = eqx.field(static=True)

    def __init__(self, cfg: LlamaConfig, key: jax.Array):
        if cfg.vocab_size is None:
            raise ValueError("LlamaConfig.vocab_size must be resolved before building the model")
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.cfg = cfg
        self.embed_VxD = 0.02 * jax.random.normal(k_embed, (cfg.vocab_size, cfg.dim), jnp.float32)
        if cfg.moe.on:  # MoE blocks (all, or the last of each group of `every`): models/moe.py
            self.blocks = init_blocks(k_blocks, cfg, lambda k: Block.init(k, cfg), lambda k: MoEBlock.init(k, cfg))
        else:
            self.blocks = eqx.filter_vmap(lambda k: Block.init(k, cfg))(jax.random.split(k_blocks, cfg.num_blocks))
        self.final_norm = _norm(cfg.dim, cfg.norm_eps)
        self.head_DxV = (None if cfg.tie_embeddings
                         else 0.02 * jax.random.normal(k_head, (cfg.dim, cfg.vocab_size), jnp.float32))

    def __call__(self, tokens_BxT: jax.Array, *, key: jax.Array | None = None,
                 compute_dtype: jnp.dtype = jnp.float32, segment_ids_BxT: jax.Array | None = None,
                 causal: bool = True, collect: bool = False, router_mask_BxT: jax.Array | None = None,
                 max_logits: bool = False):
        """Logits (float32) for every position, with GPT's contract (models/gpt.py GPT.__call__):
        `key=None` disables dropout; with `segment_ids_BxT` attention stays inside each packed
        document and rotary positions restart at 0 at each document's first token; `causal=False`
        attends both ways (mdlm); `collect` also returns per-block activation RMS; `router_mask_BxT`
        (MoE only) the tokens the router statistics count; `max_logits` also returns stats["max_logit"]
        (num_blocks, num_heads), each query head's largest attention logit."""
        cfg = self.cfg
        T = tokens_BxT.shape[1]
        if T > cfg.context_length:  # GPT's position table refuses them by shape; rotary would extrapolate quietly
            raise ConfigError(f"{T} tokens per row is more than model.context_length={cfg.context_length}: "
                              "shorten the input or raise model.context_length")
        rope = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.context_length)
        if segment_ids_BxT is None:
            cos_TxK, sin_TxK = rotary_cos_sin(jnp.arange(T), *rope)
        else:  # per-row positions: B x 1 x T x K, broadcast over heads
            cos, sin = rotary_cos_sin(document_positions(segment_ids_BxT), *rope)
            cos_TxK, sin_TxK = cos[:, None], sin[:, None]
        x_BxTxD = jnp.take(self.embed_VxD, tokens_BxT, axis=0).astype(jnp.float32)

        stats_out = collect or max_logits  # (static) the blocks return statistics

        def call(block, x_BxTxD, k):
            return block(x_BxTxD, k, cfg, compute_dtype, (cos_TxK, sin_TxK), segment_ids_BxT, causal, collect,
                         router_mask_BxT, max_logits)

        def apply(x_BxTxD, block_and_key):
            out = call(block_and_key[0], x_BxTxD, block_and_key[1])
            return out if stats_out else (out, None)

        if cfg.moe.on:  # router statistics per MoE block come back under stats_L["moe"]
            x_BxTxD, stats_L = run_blocks(call, x_BxTxD, self.blocks, key, cfg, stats_out)
        else:
            x_BxTxD, stats_L = apply_blocks(apply, x_BxTxD, self.blocks, key, cfg.num_blocks, cfg.remat,
                                            cfg.scan_blocks, cfg.scan_unroll, stats_out)
        head_DxV = self.embed_VxD.T if self.head_DxV is None else self.head_DxV
        # model.mup: logits x base/width (MuReadout's multiplier; 1 without muP: no operation)
        logits_BxTxV = output_logits(self.final_norm(x_BxTxD), head_DxV, compute_dtype,
                                     mup_lib.width_ratio(cfg))  # float32
        return (logits_BxTxV, stats_L) if stats_out else logits_BxTxV


def scale_query_key(block: Block, q_scale_xH: jax.Array, k_scale_xG: jax.Array) -> Block:
    """`block` (leaves with the leading axes of the scales) with query head h's columns of q_proj
    times q_scale[h] and kv head g's of k_proj times k_scale[g], biases too (qkv_bias: q = x·W + b
    scales exactly only if b does), v untouched (optimizer.qk_clip_tau). Rotary is linear, so it
    scales the rotated q and k alike. Columns are head-major (`_split_heads`). A scale of 1 keeps the bits."""

    def scaled(linear: Linear, scale_xN: jax.Array) -> Linear:
        heads = scale_xN.shape[-1]
        col_xO = jnp.repeat(scale_xN.astype(jnp.float32), linear.weight_IxO.shape[-1] // heads, axis=-1)
        mul = lambda a, col: (a.astype(jnp.float32) * col).astype(a.dtype)
        out = eqx.tree_at(lambda lin: lin.weight_IxO, linear, mul(linear.weight_IxO, col_xO[..., None, :]))
        return out if linear.bias_O is None else eqx.tree_at(lambda lin: lin.bias_O, out, mul(linear.bias_O, col_xO))

    return eqx.tree_at(lambda b: (b.q_proj, b.k_proj), block,
                       (scaled(block.q_proj, q_scale_xH), scaled(block.k_proj, k_scale_xG)))


def param_labels(model: Llama) -> Llama:
    """Same tree as `model`, each array replaced by its group: `hidden` (block matrices), `embed`
    (token embeddings), `head` (untied output projection), `scalar` (norm gains, biases)."""

    def label(path, leaf) -> str:
        names = [getattr(p, "name", "") for p in path]
        if names[0] == "blocks":  # the shared expert's D x 1 gate is a vector: scalar, not a matrix
            return "hidden" if names[-1] == "weight_IxO" and "shared_gate" not in names else "scalar"
        return {"embed_VxD": "embed", "head_DxV": "head"}.get(names[0], "scalar")

    return jax.tree_util.tree_map_with_path(label, model)


# Logical dimension names (utils/parallel/layout.py): `heads` and `mlp` go to the tensor axis, so
# q/k/v are split column-wise into whole heads (query heads [0, H/t) with their kv heads [0, G/t):
# utils/config.py requires parallel.tensor to divide num_kv_heads), o_proj and down_proj row-wise.
PARAM_AXES = {
    ("embed_VxD",): ("vocab", "embed"),
    ("head_DxV",): ("embed", "vocab"),
    **{(proj, "weight_IxO"): ("layers", "embed", "heads") for proj in ("q_proj", "k_proj", "v_proj")},
    **{(proj, "bias_O"): ("layers", "heads") for proj in ("q_proj", "k_proj", "v_proj")},
    ("o_proj", "weight_IxO"): ("layers", "heads", "embed"),
    ("gate_proj", "weight_IxO"): ("layers", "embed", "mlp"),
    ("up_proj", "weight_IxO"): ("layers", "embed", "mlp"),
    ("down_proj", "weight_IxO"): ("layers", "mlp", "embed"),
    ("router", "weight_IxO"): ("layers", "embed", "router"),  # MoE: the router is not split over experts
    ("shared_gate", "weight_IxO"): ("layers", "embed", "router"),  # the shared expert's D x 1 gate, replicated
}


def param_axes(model: Llama) -> Llama:
    """Same tree as `model`, each array replaced by the logical names of its dimensions."""

    return logical_axes(model, PARAM_AXES)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, GPT's convention (models/gpt.py): 6·N for every matmul weight (the
    q and o projections H·K·dim each, k and v only kv_heads·K·dim each, three SwiGLU matrices, the
    head, tied or not) plus 12·num_blocks·dim·seq_len for attention's scores and values."""
    assert cfg.vocab_size is not None
    d, f, L, K = cfg.dim, cfg.mlp_width, cfg.num_blocks, cfg.head_dim
    attn = 2 * d * cfg.num_heads * K + 2 * d * cfg.kv_heads * K
    n_matmul = L * (attn + 3 * d * f) + d * cfg.vocab_size
    if cfg.moe.on:  # an MoE block's MLP: top_k SwiGLU experts per token and the router, instead of one MLP
        shared = 3 * d * cfg.moe.shared_expert_hidden + d if cfg.moe.shared_expert_hidden else 0  # + its gate
        n_matmul += len(cfg.moe.layers(L)) * (moe_flops(cfg.moe, d, 3 * d * f) + shared - 3 * d * f)
    return 6.0 * n_matmul + 12.0 * L * d * seq_len


# ---------------------------------------------------------------------------- Hugging Face


HF_MOE = True  # with model.moe on, written as mixtral, qwen2_moe or qwen3_moe (models/hf.py)
# the dense types, then the MoE ones (models/hf_moe.py)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *hf_moe.MOE_MODEL_TYPES)
# Our path -> (Hugging Face name, transposed): torch's Linear stores (out, in), ours (in, out).
# Block entries are under `model.layers.{i}.`; QK-norm's names are Qwen3's.
_HF_TOP = {
    ("embed_VxD",): ("model.embed_tokens.weight", False),
    ("final_norm", "gain_D"): ("model.norm.weight", False),
    ("head_DxV",): ("lm_head.weight", True),
}
_HF_BLOCK = {
    ("attn_norm", "gain_D"): ("input_layernorm.weight", False),
    **{(p, "weight_IxO"): (f"self_attn.{p}.weight", True) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{(p, "bias_O"): (f"self_attn.{p}.bias", False) for p in ("q_proj", "k_proj", "v_proj")},
    ("q_norm", "gain_D"): ("self_attn.q_norm.weight", False),
    ("k_norm", "gain_D"): ("self_attn.k_norm.weight", False),
    ("mlp_norm", "gain_D"): ("post_attention_layernorm.weight", False),
    **{(p, "weight_IxO"): (f"mlp.{p}.weight", True) for p in ("gate_proj", "up_proj", "down_proj")},
}


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  **hf_moe.ARCHITECTURES}


def hf_config(cfg: LlamaConfig) -> dict:
    """transformers' config.json fields for this model: `qwen3` with QK-norm, `qwen2` with qkv
    biases, else `llama` (a Mistral without a window is a llama: it is written as one); with MoE on,
    `mixtral`, `qwen2_moe` or `qwen3_moe` (models/hf_moe.py picks, or refuses in one line)."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise ConfigError("model.qk_norm=true with model.qkv_bias=true has no Hugging Face form (qwen3, the QK-norm "
                          "model type, biases o_proj as well when it biases q, k and v): export with the default "
                          "safetensors format, or train with one of the two false")
    mup_lib.refuse_hf_export(cfg)
    model_type = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    if cfg.moe.on:
        model_type = hf_moe.model_type(cfg)
    elif cfg.qk_norm and cfg.qk_norm_scope == "all":
        raise ConfigError("model.qk_norm_scope=all without MoE has no Hugging Face form here (olmoe, the type with "
                          "that norm, is MoE; olmo2 also moves its block norms): export with the default safetensors "
                          "format, or train with model.qk_norm_scope=head")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **_hf_rope_scaling(cfg)}
    out = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.mlp_width,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.num_blocks,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": _hf_max_positions(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers < 5 reads this; 5.x reads rope_parameters
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
    }
    if cfg.rope_scaling is not None:  # transformers < 5 reads the scaling here (5.x too, before rope_parameters)
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False)
    if cfg.moe.on:
        out.update(hf_moe.hf_config(cfg, model_type))
    return out


def _hf_rope_scaling(cfg: LlamaConfig) -> dict:
    """rope_parameters' scaling fields (transformers' names) of `cfg.rope_scaling`; {} without one."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {}
    if scaling.type in ("linear", "dynamic"):  # dynamic's original context is max_position_embeddings (hf_config)
        return {"rope_type": scaling.type, "factor": scaling.factor}
    original = scaling.original_context_length or cfg.context_length
    if scaling.type == "yarn":  # the knobs off transformers' defaults only, so a hub config comes back as it was
        knobs = {f.name: getattr(scaling, f.name) for f in dataclasses.fields(scaling)
                 if f.name in ROPE_KNOBS["yarn"] and f.name != "original_context_length"
                 and getattr(scaling, f.name) != f.default}
        return {"rope_type": "yarn", "factor": scaling.factor, "original_max_position_embeddings": original, **knobs}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor, "original_max_position_embeddings": original}


def _hf_max_positions(cfg: LlamaConfig) -> int:
    """config.json's max_position_embeddings: context_length, except for `dynamic`, whose base
    transformers grows past max_position_embeddings: there it is the original context."""
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type == "dynamic":
        return scaling.original_context_length or cfg.context_length
    return cfg.context_length


# config.json keys config_from_hf reads (models/hf_keys.py checks each before anything is built)
INT, NUMBER, BOOL, STR, OBJECT = "a positive integer", "a positive number", "a boolean", "a string", "an object"
HF_KEYS = {
    "hidden_size": hf_keys.Key(INT, "the model width", required=True),
    "num_attention_heads": hf_keys.Key(INT, "query heads per block", required=True),
    "num_hidden_layers": hf_keys.Key(INT, "the number of blocks", required=True),
    "intermediate_size": hf_keys.Key(INT, "the SwiGLU MLP width", required=True),
    "vocab_size": hf_keys.Key(INT, "the embedding rows", required=True),
    "num_key_value_heads": hf_keys.Key(INT, "key/value heads; null = one per query head"),
    "head_dim": hf_keys.Key(INT, "each head's size; null = hidden_size/num_attention_heads (qwen3: 128)"),
    "max_position_embeddings": hf_keys.Key(INT, "the context length; missing = the run's model.context_length"),
    "rms_norm_eps": hf_keys.Key(NUMBER, "the RMSNorm epsilon", default=1e-6),
    "rope_theta": hf_keys.Key(NUMBER, "the rotary base, transformers < 5", default=10000.0),
    "rope_parameters": hf_keys.Key(OBJECT, "the rotary settings, transformers >= 5"),
    "rope_scaling": hf_keys.Key(OBJECT, "the rotary scaling, transformers < 5 (read before rope_parameters)"),
    "hidden_act": hf_keys.Key(STR, "the SwiGLU activation", default="silu"),
    "tie_word_embeddings": hf_keys.Key(BOOL, "whether the head is the embedding", default=False),
    "attention_bias": hf_keys.Key(BOOL, "biases on the attention projections", default=False),
    "mlp_bias": hf_keys.Key(BOOL, "biases on the MLP matrices", default=False),
    "use_sliding_window": hf_keys.Key(BOOL, "sliding-window attention (qwen2, qwen3)", default=False),
    "sliding_window": hf_keys.Key(INT, "mistral's attention window; null = full attention"),
}
HF_ROPE_KEYS = {  # inside rope_parameters (or rope_scaling)
    "rope_type": hf_keys.Key(STR, "the rotary variant: default, linear, llama3, yarn or dynamic"),
    "type": hf_keys.Key(STR, "the rotary variant, older spelling"),
    "rope_theta": hf_keys.Key(NUMBER, "the rotary base"),
    "factor": hf_keys.Key(NUMBER, "the context's stretch (linear, llama3, yarn, dynamic)"),
    "low_freq_factor": hf_keys.Key(NUMBER, "llama3's low-frequency bound"),
    "high_freq_factor": hf_keys.Key(NUMBER, "llama3's high-frequency bound"),
    "original_max_position_embeddings": hf_keys.Key(INT, "llama3's and yarn's pretraining context; null: "
                                                    "max_position_embeddings"),
    "beta_fast": hf_keys.Key(NUMBER, "yarn: rotations above which a frequency is kept", default=32.0),
    "beta_slow": hf_keys.Key(NUMBER, "yarn: rotations below which a frequency is divided", default=1.0),
    "mscale": hf_keys.Key(NUMBER, "yarn: the attention factor's numerator mscale (with mscale_all_dim)"),
    "mscale_all_dim": hf_keys.Key(NUMBER, "yarn: the attention factor's denominator mscale (with mscale)"),
    "attention_factor": hf_keys.Key(NUMBER, "yarn: cos and sin times this; null: from factor (and mscale)"),
    "truncate": hf_keys.Key(BOOL, "yarn: the correction range rounded to whole dimensions", default=True),
    "partial_rotary_factor": hf_keys.Key(NUMBER, "the rotated fraction of a head", default=1.0),
}
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config head_dim when config.json has none (not hidden_size/heads)


def _unsupported(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={hf_keys.json_text(value)}: {why}; the llama family cannot represent it "
                       "(pick a checkpoint without it)")


def _rope_from_hf(rope: dict, key: str, context_length: int, where: str) -> RopeScaling | None:
    """model.rope_scaling of config.json's rotary settings (`rope`, read from its object `key`):
    None for default rotary; linear, llama3, yarn and dynamic with transformers' defaults (dynamic's
    original context: `context_length`, i.e. max_position_embeddings); anything else refused."""
    type_key = "rope_type" if rope["rope_type"] else "type"
    rope_type = rope[type_key] or "default"
    if rope["partial_rotary_factor"] != 1:
        raise _unsupported(where, f"{key}.partial_rotary_factor", rope["partial_rotary_factor"],
                           "rotary positions here turn every dimension of a head")
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise _unsupported(where, f"{key}.{type_key}", rope_type,
                           f"the rotary types implemented are default, {', '.join(ROPE_TYPES)}")
    needs = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ()}.get(rope_type, ("factor",))
    for name in needs:
        if rope[name] is None:
            raise ConfigError(f"{where} {key}.{name} is missing: {rope_type} rotary scaling needs it, as transformers "
                              f"does; add it (e.g. {key}.{name}: {HF_ROPE_EXAMPLES[name]}) or save the directory again")
    original = rope["original_max_position_embeddings"] or context_length  # transformers' default
    if rope_type == "linear":
        scaling = RopeScaling("linear", float(rope["factor"]))
    elif rope_type == "dynamic":  # transformers grows the base past max_position_embeddings, whatever else is set
        scaling = RopeScaling("dynamic", float(rope["factor"]), original_context_length=context_length)
    elif rope_type == "yarn":  # a missing factor: max_position_embeddings/original (transformers, for DeepSeek's)
        mscales = {}  # transformers reads mscale only in pairs and only without attention_factor
        if rope["mscale"] and rope["mscale_all_dim"] and rope["attention_factor"] is None:
            mscales = {"mscale": float(rope["mscale"]), "mscale_all_dim": float(rope["mscale_all_dim"])}
        attention_factor = rope["attention_factor"]
        scaling = RopeScaling("yarn", float(rope["factor"] or context_length / original),
                              original_context_length=original, beta_fast=float(rope["beta_fast"]),
                              beta_slow=float(rope["beta_slow"]), truncate=rope["truncate"],
                              attention_factor=None if attention_factor is None else float(attention_factor), **mscales)
    else:  # transformers' default original context: max_position_embeddings
        scaling = RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]), original)
    try:
        scaling.check("rope_scaling")
    except ConfigError as e:
        raise ConfigError(f"{where} {key} describes a rotary scaling eqtrain rejects ({e}): correct config.json") \
            from None
    return scaling


HF_ROPE_EXAMPLES = {"factor": "8.0", "low_freq_factor": "1.0", "high_freq_factor": "4.0"}  # Llama 3.1's


def config_from_hf(hf: dict, base: LlamaConfig, where: str = "config.json") -> LlamaConfig:
    """A Config of the model a transformers config.json describes: its shape knobs from `hf`, the
    execution knobs (scan_blocks, remat, dropout, attn_block_size, scan_unroll, ...) from `base`.
    `context_length` is max_position_embeddings (rotary has no position table: a limit, not a shape),
    or for yarn and dynamic the longer of it and `base.context_length` (their point is reading past it).
    model_type llama, mistral (no window: a llama), qwen2 (qkv biases) and qwen3 (QK-norm); the
    MoE types mixtral, qwen2_moe (qkv biases as its qkv_bias says) and qwen3_moe (QK-norm) set
    model.moe from config.json (models/hf_moe.py). Every fault is one ConfigError naming `where`
    (the file) and the key."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{where} model_type={hf_keys.json_text(model_type)} is not a llama-family model "
                          f"({', '.join(HF_MODEL_TYPES)}): use a checkpoint of one of those")
    if model_type == "qwen2_moe" and not hf.get("use_sliding_window") and hf.get("sliding_window") == 0:
        hf = {k: x for k, x in hf.items() if k != "sliding_window"}  # Qwen2MoeConfig writes 0 for "no window"
    v = hf_keys.read(hf, HF_KEYS, where)
    # transformers 5 reads rope_scaling first when it is set (configuration_utils: convert_rope_params_to_dict)
    rope_key = "rope_scaling" if v["rope_scaling"] else "rope_parameters"
    rope = hf_keys.read(v[rope_key] or {}, HF_ROPE_KEYS, where, prefix=f"{rope_key}.")
    context_length = v["max_position_embeddings"] or base.context_length
    if v["hidden_act"] != "silu":
        raise _unsupported(where, "hidden_act", v["hidden_act"], "SwiGLU here uses silu")
    scaling = _rope_from_hf(rope, rope_key, context_length, where)
    if scaling is not None and scaling.type in ("yarn", "dynamic"):  # they exist to read past max_position_embeddings:
        context_length = max(context_length, base.context_length)  # the run's longer model.context_length is kept
    if model_type in ("llama", "qwen3", "qwen3_moe", "olmoe") and v["attention_bias"]:
        raise _unsupported(where, "attention_bias", True, f"{model_type}'s attention_bias also puts a bias on o_proj")
    if v["mlp_bias"]:
        raise _unsupported(where, "mlp_bias", True, "the SwiGLU matrices have no biases")
    if v["use_sliding_window"]:
        raise _unsupported(where, "use_sliding_window", True, "attention here is always full")
    window = v["sliding_window"]
    if model_type in ("mistral", "mixtral") and window is not None and window < context_length:
        raise _unsupported(where, "sliding_window", window, f"attention here is always full, and a window shorter "
                           f"than the context ({context_length}) hides earlier tokens; a Mistral with sliding_window "
                           f"null (7B v0.2 and later, Mixtral 8x7B) loads")
    layer_types = hf.get("layer_types") if model_type == "qwen2_moe" else None
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise _unsupported(where, "layer_types", layer_types, "attention here is always full")
    heads, dim = v["num_attention_heads"], v["hidden_size"]
    head_dim = v["head_dim"] or (QWEN3_HEAD_DIM if model_type == "qwen3" else None)
    if head_dim is None:
        if dim % heads:
            raise ConfigError(f"{where} hidden_size={dim} is not divisible by num_attention_heads={heads}: each head "
                              "takes an equal share of the width; correct config.json, or give its head_dim")
        if (dim // heads) % 2:
            raise _unsupported(where, "hidden_size", dim, f"hidden_size/num_attention_heads={dim // heads} is odd, "
                               "and rotary positions rotate pairs of a head's dimensions")
        head_dim = dim // heads
    if head_dim % 2:
        raise _unsupported(where, "head_dim", head_dim, "it is odd, and rotary positions rotate pairs of a head's "
                           "dimensions")
    if model_type == "olmoe" and head_dim * heads != dim:
        raise _unsupported(where, "head_dim", head_dim, f"olmoe's q norm spans hidden_size={dim}, so its heads must "
                           f"split it ({heads} of {dim // heads})")
    kv_heads = v["num_key_value_heads"] or heads
    if heads % kv_heads:
        raise ConfigError(f"{where} num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}: "
                          "each key/value head serves a group of query heads; correct config.json")
    # a dense type: MoE stays off (models/hf.py refuses it on); an MoE type: its experts, routing and loss weights
    knobs = {"moe": base.moe, "mlp_hidden": v["intermediate_size"], "qkv_bias": model_type == "qwen2"}
    if model_type in hf_moe.MOE_MODEL_TYPES:
        knobs = hf_moe.from_hf(hf, where, v["num_hidden_layers"], v["intermediate_size"])
    cfg = dataclasses.replace(
        base, name="llama", dim=dim, num_heads=heads, num_blocks=v["num_hidden_layers"], num_kv_heads=kv_heads,
        head_size=None if head_dim * heads == dim else head_dim,
        vocab_size=v["vocab_size"], context_length=context_length,
        rope_theta=float(rope["rope_theta"] or v["rope_theta"]), rope_scaling=scaling,
        norm_eps=float(v["rms_norm_eps"]), tie_embeddings=v["tie_word_embeddings"],
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_scope="all" if model_type == "olmoe" else "head", **knobs)
    try:
        cfg.check("model")
    except ConfigError as e:
        raise ConfigError(f"{where} describes a model this family rejects: {e}") from None
    return cfg


def _hf_layout(template, naming: str | None = None) -> list[list[tuple[str, tuple, bool]]]:
    """For each array leaf of `template` (a Llama or its shapes), in leaf order, the Hugging Face
    tensors it holds: (name, the index into the leaf, transposed). A dense stacked leaf holds one
    tensor per block; with MoE every expert's weight is its own tensor (index (block, expert)), and
    grouped blocks (moe.every > 1, models/moe.py `Group`) index (group, block in group) for the
    dense ones and (group,) for the MoE one. `naming`: the experts' names (models/hf_moe.py), mixtral
    or qwen; None: the export's model type's."""
    cfg = template.cfg
    moe = cfg.moe if cfg.moe.on else None
    every, L = (moe.every if moe else 1), cfg.num_blocks
    if moe is not None and naming is None:
        naming = "mixtral" if hf_moe.model_type(cfg) == "mixtral" else "qwen"
    moe_names = hf_moe.tensor_names(naming) if moe is not None else {}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]:
        names = tuple(getattr(p, "name", "") for p in path)
        if names[0] != "blocks":
            if names not in _HF_TOP:
                raise ValueError(f"{'.'.join(names)} has no Hugging Face name: merge LoRA factors first (for_export)")
            out.append([(*_HF_TOP[names][:1], (), _HF_TOP[names][1])])
            continue
        part, rest = (names[1], names[2:]) if every > 1 else (None, names[1:])
        if rest in _HF_BLOCK:
            hf_name, transposed = _HF_BLOCK[rest]
        elif rest in moe_names:
            hf_name, transposed = moe_names[rest], True
        else:  # e.g. LoRA factors: merged before an export
            raise ValueError(f"{'.'.join(names)} has no Hugging Face name: merge LoRA factors first (for_export)")
        if part is None:
            layers = [((i,), i) for i in range(L)]
        elif part == "dense":
            layers = [((g, j), g * every + j) for g in range(L // every) for j in range(every - 1)]
        else:
            layers = [((g,), g * every + every - 1) for g in range(L // every)]
        experts = range(moe.num_experts) if rest[:2] == ("moe", "experts") else [None]
        out.append([(f"model.layers.{layer}." + hf_name.replace("{e}", str(e)), idx + ((e,) if e is not None else ()),
                     transposed) for idx, layer in layers for e in experts])
    return out


def hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """Every weight under its Hugging Face name and layout (no `lm_head.weight` when tied, as
    transformers' save_pretrained writes it; one tensor per expert, as it writes MoE models), host
    numpy in the model's dtype."""
    out = {}
    for slots, leaf in zip(_hf_layout(model), jax.tree.leaves(model), strict=True):
        array = np.asarray(leaf)
        for name, idx, transposed in slots:
            a = array[idx]
            out[name] = np.array(a.T if transposed else a, order="C")  # a writable copy
    return out


HF_LORA_FAN_IN_FAN_OUT = False  # torch Linear projections, weight (out, in)


def hf_lora_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The LoRA factors as PEFT names them (`model.layers.{i}.self_attn.q_proj.lora_A.weight`): lora_A
    (rank, in) = Aᵀ, lora_B (out, rank) = Bᵀ, so lora_B(lora_A(x)) = x·A·B as our branch computes."""
    out = {}
    for field in LORA_TARGETS:
        linear = getattr(model.blocks, field, None)
        if not isinstance(linear, LoraLinear):
            continue
        module = _HF_BLOCK[(field, "weight_IxO")][0].removesuffix(".weight")
        a, b = np.asarray(linear.lora_a_IxR), np.asarray(linear.lora_b_RxO)
        for i in range(model.cfg.num_blocks):
            out[f"model.layers.{i}.{module}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"model.layers.{i}.{module}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def from_hf_tensors(cfg: LlamaConfig, tensors: dict) -> Llama:
    """The model of `cfg` holding Hugging Face weights (`hf_tensors`' inverse), float32 (or the dtype
    of a `models.hf.Tensors` reader: `tensors.dtype`, each tensor read once). Extra
    tensors (a tied model's `lm_head.weight`, rotary buffers) are ignored; a missing or misshapen
    one is a CheckpointError naming it. MoE experts may carry Mixtral's or Qwen's names."""
    template = eqx.filter_eval_shape(lambda: Llama(cfg, jax.random.PRNGKey(0)))  # no device transfer: models/hf.py
    shapes = jax.tree.leaves(template)
    dtype = getattr(tensors, "dtype", np.float32)
    naming = hf_moe.naming_of(tensors, cfg) if cfg.moe.on else None
    leaves = []
    for slots, shape in zip(_hf_layout(template, naming), shapes, strict=True):
        leaf = np.empty(shape.shape, dtype)  # numpy: models/hf.py reads under a callback
        for key, idx, transposed in slots:
            part = shape.shape[len(idx):]
            want = part[::-1] if transposed else part
            if key not in tensors:
                raise CheckpointError(f"tensor {key} is missing from the Hugging Face weights: the checkpoint does "
                                      "not match its config.json (or model.qkv_bias/tie_embeddings); re-export it")
            a = np.asarray(tensors[key], dtype=dtype)
            if a.shape != tuple(want):
                raise CheckpointError(f"tensor {key} has shape {a.shape}, the config.json's model needs "
                                      f"{tuple(want)}: the weights and config.json disagree; re-export them together")
            leaf[idx] = a.T if transposed else a
        leaves.append(leaf)
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


# model.lora.targets: the block's projections (Hugging Face's names)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Config, Model = LlamaConfig, Llama  # the registry's names (models/__init__.py)
