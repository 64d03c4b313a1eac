"""The model registry: `model.name` (each conf/model/*.yaml names its family) -> the module that
builds it. The rest of the pipeline (train_jax.py, utils/, scripts/, bench/) reaches a model only
through the functions here, so adding a family is one module and one line in MODELS.

A family's module exposes:

    Config                       frozen dataclass of its yaml's knobs, with `name`, `check(prefix)`,
                                 `num_blocks`, `context_length`, `vocab_size`, `vocab_multiple`,
                                 `dropout`, `tie_embeddings`, `attn_block_size`
    Model(cfg, key)              an Equinox module: `model(tokens_BxT, *, key, compute_dtype,
                                 segment_ids_BxT, causal, collect)` -> float32 logits (and, with
                                 `collect`, per-block activation RMS); its blocks stacked under
                                 `.blocks` (the per-block view of the per-layer metrics and the aux hook)
    param_labels(model)          the optimizer groups: hidden | embed | head | scalar per array
    param_axes(model)            logical dimension names for the sharding layout (utils/parallel/layout.py)
    flops_per_token(cfg, T)      training FLOPs per token (6N + attention), for MFU

The loss and evaluation sums are the family-independent `models.losses`.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import equinox as eqx
import jax

from models import gpt
from models.layers import count_params  # noqa: F401 - the registry's one-stop import
from utils.errors import ConfigError
from utils.sections import build_section

MODELS: dict[str, ModuleType] = {"gpt": gpt}
# The knobs of conf/model_common.yaml: fields every family's Config has, with the same meaning.
SHARED_KNOBS = ("init_from",)


def family(cfg_or_model: Any) -> ModuleType:
    """The module of a model config or model (by its `name`)."""
    cfg = getattr(cfg_or_model, "cfg", cfg_or_model)
    return MODELS[cfg.name]


def config_from_dict(raw: dict, prefix: str = "model"):
    """The model section of a run config (or a checkpoint's manifest) -> its family's Config,
    checked. A manifest written before the registry has no `name`: GPT was the only family."""
    name = raw.get("name", "gpt")
    if name not in MODELS:
        raise ConfigError(f"{prefix}.name={name!r} is not a model family: use one of {', '.join(MODELS)} "
                          "(conf/model/*.yaml name theirs)")
    return build_section(MODELS[name].Config, {**raw, "name": name}, prefix)


def build(cfg, key: jax.Array):
    """A freshly initialised model of `cfg` (vocab_size resolved)."""
    return family(cfg).Model(cfg, key)


def abstract(cfg):
    """The model's shapes and dtypes, without allocating it."""
    return eqx.filter_eval_shape(build, cfg, jax.random.PRNGKey(0))


def param_labels(model):
    return family(model).param_labels(model)


def param_axes(model):
    return family(model).param_axes(model)


def flops_per_token(cfg, seq_len: int) -> float:
    return family(cfg).flops_per_token(cfg, seq_len)


def blocks(tree):
    """The stacked blocks of a model-shaped tree (a model, its gradients, its updates)."""
    return tree.blocks


def as_dict(cfg) -> dict:
    """The config as a manifest and config.json record it (with `name`)."""
    return dataclasses.asdict(cfg)
