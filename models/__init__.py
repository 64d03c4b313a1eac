"""The model registry: `model.name` (each conf/model/*.yaml names its family) -> the module that
builds it. The rest of the pipeline (train_jax.py, utils/, scripts/, bench/) reaches a model only
through the functions here, so adding a family is one module and one line in MODELS.

What a family's module exposes, required and optional (with the defaults), is the model contract,
models/contract.py: a `Config` subclassing `ModelConfig` (the shared knobs and their checks), a
`Model(cfg, key)` whose call is `ModelCall`, `param_labels`, `PARAM_AXES`/`param_axes` and
`flops_per_token`. Every family is checked against it here, at import, and
tests/test_model_contract.py runs each through the model matrix; docs/extending.md ("A model
family") is the guide. The loss and evaluation sums are the family-independent `models.losses`.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

import equinox as eqx
import jax

from models import contract, gpt, llama, lora, moe
from models.layers import count_params  # noqa: F401 - the registry's one-stop import
from utils.errors import ConfigError
from utils.sections import build_section

MODELS: dict[str, ModuleType] = {"gpt": gpt, "llama": llama}
for _name, _family in MODELS.items():
    contract.check_family_module(_name, _family)
# The knobs of conf/model_common.yaml: fields of the contract's ModelConfig, merged into every model yaml.
SHARED_KNOBS = contract.COMMON_KNOBS


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
    cfg = build_section(MODELS[name].Config, {**raw, "name": name}, prefix)
    targets = contract.optional(MODELS[name], "LORA_TARGETS")  # None: checked when the factors attach
    if cfg.lora.on and targets is not None:
        cfg.lora.check_targets(targets, f"{prefix}.lora")
    if cfg.lora.on and cfg.moe.on:  # docs/models.md "Mixture-of-Experts"
        raise ConfigError(f"{prefix}.lora.rank={cfg.lora.rank} with {prefix}.moe.num_experts={cfg.moe.num_experts}: "
                          "LoRA factors on Mixture-of-Experts models are not supported (factors take one stacked "
                          f"axis; experts and grouped blocks have two): set {prefix}.lora.rank=0 or "
                          f"{prefix}.moe.num_experts=0")
    return cfg


def build(cfg, key: jax.Array, param_dtype=None):
    """A freshly initialised model of `cfg` (vocab_size resolved), or with `model.init_from` the
    weights of that Hugging Face directory (models/hf.py; read lazily, never under eval_shape);
    its float arrays cast to `param_dtype` (train.param_dtype) when given."""
    if cfg.init_from:
        from models import hf  # here: models.hf imports this registry

        model = lora.attach(hf.build_from_hf(cfg, key, param_dtype), cfg.lora, key)  # read in param_dtype
    else:
        model = lora.attach(family(cfg).Model(cfg, key), cfg.lora, key)  # model.lora: factors on a frozen base
    if param_dtype is None:
        return model
    return jax.tree.map(lambda x: x.astype(param_dtype) if eqx.is_inexact_array(x) else x, model)


def abstract(cfg, param_dtype=None):
    """The model's shapes and dtypes (in `param_dtype`, as `build` makes them), without allocating it."""
    return eqx.filter_eval_shape(build, cfg, jax.random.PRNGKey(0), param_dtype)


def param_labels(model):
    """The family's groups, or with LoRA factors `lora` (them) and `frozen` (the rest)."""
    return lora.labels(model, family(model).param_labels(model))


def param_axes(model):
    return lora.factor_axes(family(model).param_axes(model))


def train_loss(cfg, objective, max_logits: bool = False):
    """The objective's loss as the train step differentiates it: with LoRA, the base under
    stop_gradient (models/lora.py), so only the factors get a gradient. `max_logits`
    (optimizer.qk_clip_tau): its aux also holds "max_logit", each block's per-head largest attention logit."""
    loss_fn = functools.partial(objective.loss_fn, max_logits=True) if max_logits else objective.loss_fn
    if not cfg.lora.on:
        return loss_fn
    return lambda model, *args, **kwargs: loss_fn(lora.stop_base(model), *args, **kwargs)


def for_export(model, merge_lora: bool, fmt: str):
    """The model an export writes (`--merge-lora`, `--format`; models/lora.py `for_export`)."""
    return lora.for_export(model, merge_lora, fmt)


def uses_key(cfg, objective) -> bool:
    """Whether a train step draws randomness: dropout (LoRA's too), or an objective's (mdlm's masks)."""
    return cfg.dropout > 0 or (cfg.lora.on and cfg.lora.dropout > 0) or objective.needs_key


def flops_per_token(cfg, seq_len: int) -> float:
    """The family's 6·N + attention; with LoRA, the frozen base's weight gradients are never computed
    (its matmuls cost 4·N: forward, and the input gradient the earlier factors need), and each factor
    value costs 6 (x·A and h·B forward, both gradients backward)."""
    flops = family(cfg).flops_per_token(cfg, seq_len)
    if not cfg.lora.on:
        return flops
    n_matmul = family(cfg).flops_per_token(cfg, 0) / 6.0  # the attention term is the part linear in seq_len
    return flops - 2.0 * n_matmul + 6.0 * lora.factor_count(abstract(cfg))


def scale_query_key(model, q_scale_LxH: jax.Array, k_scale_LxG: jax.Array):
    """`model` with block l's query head h scaled by q_scale[l, h] and its key/value head g's key
    projection by k_scale[l, g] (the family's `scale_query_key`; grouped MoE blocks (models/moe.py
    Group) split into their dense and MoE stacks): optimizer.qk_clip_tau's rescale."""
    scale = family(model).scale_query_key
    blocks = model.blocks
    if isinstance(blocks, moe.Group):
        G = jax.tree.leaves(blocks.moe)[0].shape[0]
        q, k = (s.reshape(G, -1, s.shape[-1]) for s in (q_scale_LxH, k_scale_LxG))
        blocks = moe.Group(scale(blocks.dense, q[:, :-1], k[:, :-1]), scale(blocks.moe, q[:, -1], k[:, -1]))
    else:
        blocks = scale(blocks, q_scale_LxH, k_scale_LxG)
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


def blocks(tree):
    """The stacked blocks of a model-shaped tree (a model, its gradients, its updates), every leaf
    with a leading num_blocks axis (grouped MoE blocks padded into place: models/moe.py per_block)."""
    return moe.per_block(tree.blocks)


def as_dict(cfg) -> dict:
    """The config as a manifest and config.json record it (with `name`)."""
    return dataclasses.asdict(cfg)
