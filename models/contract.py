"""The model contract, in one place: what every family of `models.MODELS` is and may declare, with
the defaults a family that declares nothing optional gets.

A family is one module (models/gpt.py, models/llama.py) registered in models/__init__.py's `MODELS`
under the `name` its yamls give. It exposes what `Family` lists:

    Config                 a frozen dataclass subclassing `ModelConfig`: the shared knobs below are
                           inherited (never copied), its own shape knobs added, its registry key the
                           default of `name`; `check_family(prefix)` refuses its own bad knobs
    Model(cfg, key)        an Equinox module whose call is `ModelCall` (float32 logits; with `collect`,
                           also the per-block activation RMS), its blocks stacked under `.blocks`
    param_labels(model)    the optimizer groups: hidden | embed | head | scalar per array
    PARAM_AXES             {(module, field): logical dimension names} (utils/parallel/layout.py)
    param_axes(model)      the same tree as `model`, each array replaced by its logical names
    flops_per_token(cfg, T)  training FLOPs per token (6N + attention), for MFU

and, optionally, what `OPTIONAL` lists with its default (LoRA target names, the Hugging Face hooks).
docs/extending.md ("A model family") says how to add one; tests/test_model_contract.py checks every
registered family against this module and runs each through the model matrix (forward shapes,
scan = unrolled, sharded = unsharded, exact resume, the Hugging Face round trip where declared).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from models import attention
from models import mup as mup_lib
from models.layers import check_run_knobs
from models.lora import LoraConfig
from models.moe import MoEConfig
from utils.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The knobs every family has with the same meaning (see the module docstring). Keyword-only,
    so a family's own knobs follow them whatever their defaults; configs are built by name (the
    yaml, a manifest, config.json), never by position."""

    dim: int  # the residual stream's width
    num_heads: int  # attention (query) heads per block
    num_blocks: int  # transformer blocks
    context_length: int  # the longest sequence
    vocab_size: int | None = None  # null: the tokenizer's, rounded up to vocab_multiple
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (fast matmuls)
    dropout: float = 0.0  # on each block's attention and MLP outputs, in training only
    tie_embeddings: bool = True  # the output head is the token embedding
    scan_blocks: bool = True  # lax.scan over the stacked blocks; false = an unrolled loop (same maths)
    remat: str = "dots"  # what the backward pass keeps of each block: dots | full | none (REMAT_POLICIES)
    scan_unroll: int = 1  # blocks per scan iteration (num_blocks = fully unrolled inside the scan)
    attn_block_size: int | None = None  # query block size of block-causal attention; null = one block
    # The knobs of conf/model_common.yaml (COMMON_KNOBS): merged into whichever model yaml is chosen.
    attention: str = "auto"  # auto | xla | cudnn | blocked (models/attention.py)
    name: str = ""  # the registry's key (models/__init__.py): each family's Config sets it as the default
    init_from: str | None = None  # a local Hugging Face directory (models/hf.py)
    lora: LoraConfig = LoraConfig()  # low-rank factors on a frozen base (models/lora.py)
    moe: MoEConfig = MoEConfig()  # Mixture-of-Experts blocks (models/moe.py)
    mup: bool = False  # the maximal-update parametrisation (models/mup.py)
    mup_base_dim: int = 256  # the width muP's factors are 1 at (models/mup.py)

    def check(self, prefix: str = "model") -> None:
        """Refuse a bad knob with one ConfigError line naming `{prefix}.<knob>`: the shared shape
        knobs, then the family's own (`check_family`), then the shared run, attention, MoE and muP
        knobs. A family overrides `check_family`, not this, so no family skips a shared check."""
        for knob in SHAPE_KNOBS:
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be a positive integer")
        self.check_family(prefix)
        self.moe.check_blocks(self.num_blocks, prefix)
        check_run_knobs(self, prefix)
        attention.check_config(self, prefix)
        mup_lib.check(self, prefix)

    def check_family(self, prefix: str) -> None:
        """The family's own knobs (default: none), one ConfigError line each."""

    @property
    def head_dim(self) -> int:
        """Each attention head's size (the attention kernels and muP read it); dim/num_heads unless
        the family sets heads apart from the width."""
        return self.dim // self.num_heads


# Positive integers in every family (checked first, so a family's checks may divide by them).
SHAPE_KNOBS = ("dim", "num_heads", "num_blocks", "context_length", "vocab_multiple")
# The shared knobs that live in conf/model_common.yaml rather than in each conf/model/*.yaml.
COMMON_KNOBS = ("init_from", "lora", "moe", "attention", "mup", "mup_base_dim")


@runtime_checkable
class ModelCall(Protocol):
    """What `Model(cfg, key)` builds: an Equinox module with the config and stacked blocks."""

    cfg: ModelConfig
    blocks: Any  # every leaf with a leading num_blocks axis (MoE groups: models/moe.py per_block)

    def __call__(self, tokens_BxT: jax.Array, *, key: jax.Array | None = None, compute_dtype: Any = jnp.float32,
                 segment_ids_BxT: jax.Array | None = None, causal: bool = True, collect: bool = False,
                 router_mask_BxT: jax.Array | None = None, max_logits: bool = False
                 ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """(B, T, V) float32 logits. `key=None`: no dropout (evaluation). `compute_dtype`: the matmuls'
        dtype (the residual stream and logits stay float32). `segment_ids_BxT`: attention stays inside
        each packed document and positions restart at each document's first token. `causal=False`:
        every position attends to every other (the objective's, models/objectives.py). `collect`
        (static): also {"attn", "mlp", "resid"} activation RMS per block, each (num_blocks,), and with
        MoE "moe" router statistics. `router_mask_BxT`: the tokens MoE router statistics count.
        `max_logits` (static): (logits, stats) with stats["max_logit"] (num_blocks, num_heads), each
        (query) head's largest visible attention logit q·k·scale, outside the gradient
        (optimizer.qk_clip_tau; models/layers.py causal_attention); off, the program is unchanged."""
        ...


# The call's keyword arguments, in order (tests/test_model_contract.py compares each family's).
CALL_KEYWORDS = tuple(p for p in inspect.signature(ModelCall.__call__).parameters if p not in ("self", "tokens_BxT"))


@runtime_checkable
class Family(Protocol):
    """A family's module (see the module docstring); `isinstance(module, Family)` checks the members
    are there, `check_family_module` also their kinds."""

    Config: type[ModelConfig]
    Model: Callable[[ModelConfig, jax.Array], ModelCall]
    PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]]

    def param_labels(self, model: ModelCall) -> Any: ...

    def param_axes(self, model: ModelCall) -> Any: ...

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float: ...


# The optional members, each with its default (what a family that declares nothing gets) and why.
OPTIONAL: dict[str, Any] = {
    # model.lora.targets' names (the block's projections): refused at the config boundary when not one
    # of them; None: checked when the factors attach (models/lora.py).
    "LORA_TARGETS": None,
    # Hugging Face support (models/hf.py): the config.json model_types the family reads and writes; ()
    # = none (init_from and --format hf refuse it). With any, HF_HOOKS are required.
    "HF_MODEL_TYPES": (),
    # Whether hf_config writes MoE blocks (the llama family: mixtral, qwen2_moe, qwen3_moe, olmoe); False:
    # an MoE model of the family is refused at a Hugging Face export.
    "HF_MOE": False,
    # hf_lora_tensors(model) -> {PEFT name: array}: the factors as a PEFT adapter (models/hf_peft.py), with
    # HF_LORA_FAN_IN_FAN_OUT (its projections store weights (in, out), GPT-2's Conv1D); None: --format peft
    # is refused.
    "hf_lora_tensors": None,
    "HF_LORA_FAN_IN_FAN_OUT": False,
    # scale_query_key(block, q_scale_xH, k_scale_xG) -> block: a stacked block (leaves with the scales'
    # leading axes) with query head h's q projection (weight and bias) times q_scale[h] and kv head g's
    # k projection times k_scale[g] (trainer/qk_clip.py); None: optimizer.qk_clip_tau is refused.
    "scale_query_key": None,
}
# With HF_MODEL_TYPES: the conversions both ways (models/hf.py's docstring says each one's contract).
HF_HOOKS = ("HF_KEYS", "hf_config", "config_from_hf", "hf_tensors", "from_hf_tensors")


def optional(family: ModuleType, member: str) -> Any:
    """The family's `member`, or the contract's default for it (OPTIONAL)."""
    return getattr(family, member, OPTIONAL[member])


def hf_support(family: ModuleType) -> bool:
    """Whether the family declares a Hugging Face layout (the round trip tests then run on it)."""
    return bool(optional(family, "HF_MODEL_TYPES"))


def check_family_module(name: str, family: ModuleType) -> None:
    """TypeError naming what a registered family lacks or has of the wrong kind (the registry calls
    this at import, so a half-written family fails there, not in the middle of a run)."""
    where = f"model family {name!r} ({getattr(family, '__name__', family)})"
    missing = [m for m in (*Family.__annotations__, "param_labels", "param_axes", "flops_per_token")
               if not hasattr(family, m)]
    if hf_support(family):
        missing += [m for m in HF_HOOKS if not hasattr(family, m)]
    if missing:
        raise TypeError(f"{where} lacks {', '.join(missing)} (models/contract.py)")
    if not (isinstance(family.Config, type) and issubclass(family.Config, ModelConfig)):
        raise TypeError(f"{where}: Config must subclass models.contract.ModelConfig")
    if family.Config.__dataclass_fields__["name"].default != name:
        raise TypeError(f"{where}: {family.Config.__name__}.name must default to {name!r}, its registry key")
    if "check" in vars(family.Config):
        raise TypeError(f"{where}: {family.Config.__name__} overrides check; override check_family instead, so "
                        "the shared checks run")
    keywords = tuple(p for p in inspect.signature(family.Model.__call__).parameters if p not in ("self",))[1:]
    if keywords != CALL_KEYWORDS:
        raise TypeError(f"{where}: Model's call takes (tokens_BxT, *, {', '.join(keywords)}), the contract's is "
                        f"(tokens_BxT, *, {', '.join(CALL_KEYWORDS)})")
