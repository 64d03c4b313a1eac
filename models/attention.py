"""`model.attention`: which attention kernel a model runs, chosen once, outside the jitted code.

    xla      models/layers.causal_attention in one block: the attention every run had before the knob
    blocked  the same function with query blocks of `model.attn_block_size` (block-causal: the masked
             upper triangle mostly never computed; CPU's fastest at T=256)
    cudnn    jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's flash attention (GPU only)
    auto     blocked when model.attn_block_size is set (configs from before the knob keep their
             numbers), else cudnn where its requirements hold, else xla

The choice is made in two steps because the backend is not known when the config is validated
(asking for it would initialise JAX before `jax.distributed.initialize`): `check_config` refuses
what no machine can run (validate), `resolve` picks the kernel once the backend is up
(utils/config.py `resolve_vocab`, where the tokenizer's size is filled in too) and says why. The model
then carries the concrete choice in its static config: the jitted code never branches on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import mup
from models.layers import causal_attention
from utils.errors import ConfigError

CHOICES = ("auto", "xla", "cudnn", "blocked")
CUDNN_DTYPES = ("bfloat16", "float16")  # the flash kernel's inputs (fp8 too, which we never compute in)
QK_CLIP_CUDNN = ("optimizer.qk_clip_tau needs each head's largest attention logit, which model.attention=cudnn's "
                 "fused kernel never forms: set model.attention=xla (or blocked), or optimizer.qk_clip_tau=null")


def cudnn_head_dim_max(compute_capability: str | None) -> int:
    """cuDNN's flash attention takes head dims up to 256 from Hopper (compute capability 9.0) on,
    128 before (jax/_src/cudnn/fused_attention_stablehlo.py check_is_flash_attention)."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return 128
    return 256 if major >= 9 else 128


def cudnn_problems(*, backend: str | None, compute_dtype: str, head_dim: int, context_length: int,
                   document_mask: bool, compute_capability: str | None = None) -> list[str]:
    """Why cuDNN's flash attention cannot run this model here (empty: it can). `backend=None`
    checks everything but the machine (the config boundary, before JAX's backend starts).

    A document mask is passed as a dense boolean mask, which cuDNN reads as an additive bias of
    B x 1 x T x T (the public API has no segment ids): correct, but the training kernel then needs
    an even sequence length."""
    problems = []
    if backend is not None and backend != "gpu":
        problems.append(f"it needs an NVIDIA GPU (the backend is {backend})")
    if compute_dtype not in CUDNN_DTYPES:
        problems.append(f"it needs train.compute_dtype=bfloat16 or float16 (got {compute_dtype})")
    limit = cudnn_head_dim_max(compute_capability) if backend == "gpu" else 256
    if head_dim % 8 or head_dim > limit:
        problems.append(f"it needs a head dim (model.dim / model.num_heads) that is a multiple of 8 and "
                        f"<= {limit} (got {head_dim})")
    if document_mask and context_length % 2:
        problems.append(f"with dataset.document_mask its mask becomes a bias, which needs an even context "
                        f"length (got {context_length})")
    return problems


def check_config(cfg, prefix: str = "model") -> None:
    """The knob alone and with attn_block_size (the family Config's `check`)."""
    if cfg.attention not in CHOICES:
        raise ConfigError(f"{prefix}.attention={cfg.attention!r} must be one of {', '.join(CHOICES)}")
    if cfg.attention == "blocked" and cfg.attn_block_size is None:
        raise ConfigError(f"{prefix}.attention=blocked needs {prefix}.attn_block_size (the query block size, "
                          f"e.g. half the context): set it, or {prefix}.attention=xla")
    if cfg.attention in ("xla", "cudnn") and cfg.attn_block_size is not None:
        raise ConfigError(f"{prefix}.attn_block_size={cfg.attn_block_size} is read by {prefix}.attention=blocked "
                          f"only, but {prefix}.attention={cfg.attention}: set {prefix}.attn_block_size=null or "
                          f"{prefix}.attention=blocked")


def check_run(cfg, compute_dtype: str, context_length: int, document_mask: bool) -> None:
    """An explicit `cudnn` that no machine could run with this run's dtype, heads and masks: one line,
    at the config boundary (the backend is checked at `resolve`)."""
    if cfg.attention != "cudnn":
        return
    problems = cudnn_problems(backend=None, compute_dtype=compute_dtype, head_dim=cfg.head_dim,
                              context_length=context_length, document_mask=document_mask)
    if problems:
        raise ConfigError(f"model.attention=cudnn: {problems[0]}; or set model.attention=auto (or xla)")


def choose(requested: str, block_size: int | None, **requirements) -> tuple[str, str]:
    """(the kernel, why) for `requested` given `cudnn_problems`' keyword arguments. Pure: the tests
    hand it fake backends and dtypes. An explicit cudnn that cannot run raises the one-line error."""
    if requested in ("xla", "blocked"):
        return requested, "as set"
    problems = cudnn_problems(**requirements)
    if requested == "cudnn":
        if problems:
            raise ConfigError(f"model.attention=cudnn: {problems[0]}; or set model.attention=auto (or xla)")
        return "cudnn", "as set"
    if block_size is not None:
        return "blocked", f"auto: model.attn_block_size={block_size} asks for block-causal attention"
    if problems:
        return "xla", f"auto: cuDNN flash attention not used because {problems[0]}"
    if requirements.get("document_mask"):  # correct on cuDNN (a dense bias) but unmeasured: keep XLA's
        return "xla", "auto: document masks stay on XLA's attention (cuDNN would read the mask as a dense bias)"
    return "cudnn", "auto: GPU, half-precision compute and the head dim suit cuDNN flash attention"


def machine() -> tuple[str, str | None]:
    """(JAX's default backend, the first device's compute capability or None): call after the backend starts."""
    return jax.default_backend(), getattr(jax.devices()[0], "compute_capability", None)


def resolve(cfg, compute_dtype: str, context_length: int, document_mask: bool,
            backend: str | None = None, compute_capability: str | None = None):
    """(cfg with `attention` the concrete kernel, the run header's line). The machine is this
    process's unless given; a concrete choice is re-checked (a checkpoint trained with cudnn and
    sampled on a CPU gets its one-line error, or `portable` first)."""
    if backend is None:
        backend, compute_capability = machine()
    impl, why = choose(cfg.attention, cfg.attn_block_size, backend=backend, compute_dtype=compute_dtype,
                       head_dim=cfg.head_dim, context_length=context_length, document_mask=document_mask,
                       compute_capability=compute_capability)
    return dataclasses.replace(cfg, attention=impl), f"attention: {impl} ({why})"


def portable(cfg):
    """A saved model config for inference on this machine: a `cudnn` run's model runs with
    XLA's attention where there is no GPU (the same function, other rounding)."""
    if getattr(cfg, "attention", "auto") == "cudnn" and jax.default_backend() != "gpu":
        return dataclasses.replace(cfg, attention="xla")
    return cfg


def attend(cfg, q_BxHxTxK: jax.Array, k_BxHxTxK: jax.Array, v_BxHxTxK: jax.Array,
           segment_ids_BxT: jax.Array | None = None, causal: bool = True, max_logits: bool = False):
    """The attention of `cfg.attention` (resolved; `auto` left unresolved, e.g. a model built in a
    test, runs XLA's, or blocked with attn_block_size). Heads-major in and out: B x H x T x K.
    A `cudnn` model called in float32 (sampling and export checks run the forward at full
    precision) runs XLA's attention there: cuDNN's kernel takes half-precision inputs only.
    `max_logits` (static): (out, each head's largest visible logit, float32 (H,)) for
    optimizer.qk_clip_tau; cuDNN's fused kernel never forms the logits, so it is refused there
    (validation refuses model.attention=cudnn with the knob first: utils/config.py)."""
    if cfg.attention != "cudnn" or q_BxHxTxK.dtype.name not in CUDNN_DTYPES:
        block_size = cfg.attn_block_size if cfg.attention in ("blocked", "auto") else None
        return causal_attention(q_BxHxTxK, k_BxHxTxK, v_BxHxTxK, block_size=block_size,
                                segment_ids_BxT=segment_ids_BxT, causal=causal, scale=mup.attention_scale(cfg),
                                max_logits=max_logits)
    if max_logits:
        raise ConfigError(QK_CLIP_CUDNN)
    to_btnh = lambda a: jnp.swapaxes(a, 1, 2)  # jax.nn.dot_product_attention's B x T x N x H layout
    mask_Bx1xTxT = None
    if segment_ids_BxT is not None:
        mask_Bx1xTxT = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
    out_BxTxHxK = jax.nn.dot_product_attention(to_btnh(q_BxHxTxK), to_btnh(k_BxHxTxK), to_btnh(v_BxHxTxK),
                                               mask=mask_Bx1xTxT, is_causal=causal, scale=mup.attention_scale(cfg),
                                               implementation="cudnn")
    return to_btnh(out_BxTxHxK)
