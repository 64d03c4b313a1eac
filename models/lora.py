"""LoRA fine-tuning (`model.lora.*`): low-rank factors beside a frozen base, for any model family.

A targeted projection y = x·W (+ b) becomes y = x·W (+ b) + s·dropout(x)·A·B with A (in x r),
B (r x out) and s = alpha/rank (Hu et al. 2021). B starts at zero, so a model with fresh factors
computes exactly what its base does; A starts Kaiming-uniform as in the paper's code (PEFT's
nn.Linear default: U(-1/sqrt(in), 1/sqrt(in))), so B's first gradient is not zero.

Where the factors live: a targeted `Linear` of the stacked blocks becomes a `LoraLinear` (a
subclass with `lora_a_IxR`, `lora_b_RxO`), so the factors stack and scan with their block, keep
the base weight's tree path (`blocks.attn_qkv.weight_IxO` is still there: export, sharding and
Hugging Face key maps see the base unchanged) and a family calling `Linear.__call__` gets the
branch for free (GPT's projections, its fused qkv included, all go through it). A family that
computes a projection another way (Llama's `_project`, which calls `Linear.__call__` on the base)
adds `branch(...)` to that output itself. Nothing here knows a family: targets are the field names of the blocks'
projections (a family may list them as `LORA_TARGETS` so a typo fails at validation).

Frozen base: the train step differentiates `stop_base(model)`, so every base array gets a zero
gradient (no weight-gradient matmuls are built), and `labels` sends base arrays to the optimizer
group `frozen` (optax.set_to_zero: no update, no state) and the factors to `lora`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

from models.layers import Linear, dropout
from utils.errors import ConfigError

FACTORS = ("lora_a_IxR", "lora_b_RxO")  # the field names of a LoraLinear's trained arrays
LORA_GROUP, FROZEN_GROUP = "lora", "frozen"  # optimizer groups (optimizer/groups.py)
_FACTOR_SALT = 0x10A  # folded into the model's key (factors) or a block's (dropout): the base's draws stay


@dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: rank 0 (the default) is no LoRA at all, the model and its program as without it."""

    rank: int = 0  # r of the factors; 0 = off (every weight trains as usual)
    alpha: float = 16.0  # the branch is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the branch's input, in training only
    targets: tuple[str, ...] | None = None  # projections that get factors; null = every one the family has

    def check(self, prefix: str = "model.lora") -> None:
        if self.rank < 0:
            raise ConfigError(f"{prefix}.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        if self.alpha <= 0:
            raise ConfigError(f"{prefix}.alpha={self.alpha} must be positive (the branch is scaled by alpha/rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        if self.targets is not None and not self.targets:
            raise ConfigError(f"{prefix}.targets=[] names no projection: list some, or null for every one")

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check_targets(self, available, prefix: str = "model.lora") -> None:
        """Every requested target is one of the model's projections (`available`), or one line says which exist."""
        unknown = [t for t in self.targets or () if t not in available]
        if unknown:
            raise ConfigError(f"{prefix}.targets: {unknown[0]!r} is not a projection of this model; "
                              f"its targets are {', '.join(available)}")


class LoraLinear(Linear):
    """A projection with a trained low-rank branch: x·W (+ b) + scale·dropout(x)·A·B."""

    lora_a_IxR: jax.Array
    lora_b_RxO: jax.Array
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __call__(self, x_NxI: jax.Array, key: jax.Array | None = None) -> jax.Array:
        return super().__call__(x_NxI) + branch(self, x_NxI, key)


def branch(linear: Linear, x_NxI: jax.Array, key: jax.Array | None) -> jax.Array | None:
    """The low-rank term scale·dropout(x)·A·B of a LoraLinear (in x's dtype), None for a plain Linear."""
    if not isinstance(linear, LoraLinear):
        return None
    h_NxR = dropout(x_NxI, linear.dropout, key) @ linear.lora_a_IxR.astype(x_NxI.dtype)
    return (h_NxR @ linear.lora_b_RxO.astype(x_NxI.dtype)) * jnp.asarray(linear.scale, x_NxI.dtype)


def branch_keys(key: jax.Array | None, cfg: LoraConfig, n: int) -> tuple:
    """`n` dropout keys for a block's branches, drawn apart from the block's own (its dropout
    stays what it was); Nones when there is no LoRA dropout to draw."""
    if key is None or not cfg.on or cfg.dropout == 0.0:
        return (None,) * n
    return tuple(jax.random.split(jax.random.fold_in(key, _FACTOR_SALT), n))


def _name(path) -> str:
    return getattr(path[-1], "name", "") if path else ""


def projections(model) -> tuple[str, ...]:
    """The names of the model's stacked per-block projections: Linear fields under `blocks` whose
    weight is (num_blocks, in, out) (an expert-stacked weight has more axes and is not a target)."""
    found = []
    leaves = jax.tree_util.tree_leaves_with_path(model.blocks, is_leaf=lambda x: isinstance(x, Linear))
    for path, leaf in leaves:
        if isinstance(leaf, Linear) and leaf.weight_IxO.ndim == 3 and _name(path) not in found:
            found.append(_name(path))
    return tuple(found)


def attach(model, cfg: LoraConfig, key: jax.Array):
    """`model` with fresh factors on its targeted projections (unchanged at rank 0)."""
    if not cfg.on:
        return model
    available = projections(model)
    cfg.check_targets(available)
    targets = cfg.targets or available
    key, counter = jax.random.fold_in(key, _FACTOR_SALT), itertools.count()  # the base's draws stay as they were

    def with_factors(path, leaf):
        if not isinstance(leaf, Linear) or _name(path) not in targets:
            return leaf
        L, d_in, d_out = leaf.weight_IxO.shape
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=sqrt(5)) on an (r, in) weight, as LoRA's code
        a = jax.random.uniform(jax.random.fold_in(key, next(counter)), (L, d_in, cfg.rank), jnp.float32, -bound, bound)
        b = jnp.zeros((L, cfg.rank, d_out), jnp.float32)
        return LoraLinear(leaf.weight_IxO, leaf.bias_O, a, b, cfg.scale, cfg.dropout)

    blocks = jax.tree_util.tree_map_with_path(with_factors, model.blocks, is_leaf=lambda x: isinstance(x, Linear))
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


def has_factors(model) -> bool:
    return any(isinstance(x, LoraLinear) for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, LoraLinear)))


def is_factor(path) -> bool:
    return _name(path) in FACTORS


def factor_count(model) -> int:
    """How many values the factors hold (0 without LoRA): what a LoRA run trains. Abstract models too."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return sum(int(math.prod(x.shape)) for p, x in leaves if is_factor(p) and hasattr(x, "shape"))


def labels(model, base_labels):
    """The optimizer groups with LoRA: `lora` for factors, `frozen` for everything else; the
    family's labels unchanged when the model has no factors."""
    if not has_factors(model):
        return base_labels
    return jax.tree_util.tree_map_with_path(lambda p, _: LORA_GROUP if is_factor(p) else FROZEN_GROUP, model)


def stop_base(model):
    """`model` with every array but the factors under stop_gradient: the loss's gradient then
    reaches the factors alone (the base's come back as zeros, with no matmul spent on them)."""
    if not has_factors(model):
        return model
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if is_factor(p) or not eqx.is_inexact_array(x) else jax.lax.stop_gradient(x), model)


def factor_axes(axes):
    """A family's logical axes tree with each factor's named after its projection's weight: A
    (layers, in, lora_rank), B (layers, lora_rank, out), so a tensor-parallel split of the
    weight's in or out dimension splits the factor the same way and the rank stays whole."""
    def fix(node):
        if not isinstance(node, LoraLinear):
            return node
        layers, d_in, d_out = node.weight_IxO
        return eqx.tree_at(lambda n: (n.lora_a_IxR, n.lora_b_RxO), node,
                           ((layers, d_in, "lora_rank"), (layers, "lora_rank", d_out)))
    return jax.tree.map(fix, axes, is_leaf=lambda x: isinstance(x, LoraLinear))


def merge(model):
    """The model with every LoraLinear folded into a plain Linear, W + scale·A·B (float32
    product, cast to W's dtype), and its config's `lora` reset to rank 0: what `--merge-lora`
    exports, a model of the base family's shape that anything loading the base can load."""

    def fold(node):
        if not isinstance(node, LoraLinear):
            return node
        delta_LxIxO = jnp.einsum("lir,lro->lio", node.lora_a_IxR.astype(jnp.float32),
                                 node.lora_b_RxO.astype(jnp.float32)) * node.scale
        weight = (node.weight_IxO.astype(jnp.float32) + delta_LxIxO).astype(node.weight_IxO.dtype)
        return Linear(weight, node.bias_O)

    merged = jax.tree.map(fold, model, is_leaf=lambda x: isinstance(x, LoraLinear))
    # The config is static (no tree_at): the same arrays under the treedef of a rank-0 model's shell.
    cfg = dataclasses.replace(model.cfg, lora=LoraConfig())
    shell = eqx.filter_eval_shape(type(model), cfg, jax.random.PRNGKey(0))
    return jax.tree.unflatten(jax.tree.structure(shell), jax.tree.leaves(merged))


def for_export(model, merge_factors: bool, fmt: str):
    """What `scripts/export_model.py` writes: with `--merge-lora` the merged model; without it, a
    LoRA model as it is (base + factors + its `lora` config) in eqtrain's safetensors format, which
    `models.export.load_export` rebuilds, while `--format hf` (no place for the factors) is refused;
    `--format peft` (the factors alone, models/hf_peft.py) needs a LoRA model and no `--merge-lora`."""
    from utils.errors import CheckpointError

    if fmt == "peft" and merge_factors:
        raise CheckpointError("--format peft writes the factors themselves (a PEFT adapter), --merge-lora folds them "
                              "into the base: drop one of the two")
    if fmt == "peft" and not has_factors(model):
        raise CheckpointError("--format peft: this checkpoint has no LoRA factors (model.lora.rank=0), so there is no "
                              "adapter to write: use --format hf for the whole model")
    if merge_factors and not has_factors(model):
        raise CheckpointError("--merge-lora: this checkpoint has no LoRA factors (model.lora.rank=0): "
                              "drop --merge-lora")
    if merge_factors:
        return merge(model)
    if has_factors(model) and fmt == "hf":
        raise CheckpointError("--format hf: this checkpoint holds LoRA factors, which a Hugging Face model has no "
                              "place for: add --merge-lora to export the merged weights W + (alpha/rank)·A·B")
    return model
