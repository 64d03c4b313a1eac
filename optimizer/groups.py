"""Parameter groups: one optax transform per group, each with its own hyperparameters.

The model labels every parameter `hidden` (matrices inside blocks), `embed` (token/position
embeddings), `head` (untied output projection) or `scalar` (biases, norm gains); with LoRA
(models/lora.py) the factors are `lora` and everything else `frozen` (optax.set_to_zero: no
update, no state). An optimizer describes the update of ONE group (`transform(group,
schedule)`); `per_group` builds it once per group with that group's overrides from
`optimizer.groups.<group>` and combines them with `optax.multi_transform`. Each group's
schedule is the run's schedule rescaled to the group's peak lr, so warmup and decay stay in
step across groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from optimizer import hyperball as hyperball_lib
from optimizer.cautious import cautious_transform
from utils.errors import ConfigError

GROUPS = ("hidden", "embed", "head", "scalar", "lora")
BASE_GROUPS = GROUPS[:4]  # every model's; `lora` (the factors, models/lora.py) only with model.lora.rank > 0
FROZEN = "frozen"  # the label of weights nothing trains (LoRA's base): no update, no optimizer state


def decayed_groups(decay_embeddings: bool) -> frozenset[str]:
    """Where decoupled weight decay applies by default: block matrices and an untied head
    always, the embeddings only when asked; never biases or norm gains."""
    return frozenset({"hidden", "head"} | ({"embed"} if decay_embeddings else set()))


def group_knobs(hparams: Any, group: str) -> tuple[str, ...]:
    """The knobs `optimizer.groups.<group>` may set. An optimizer whose groups run different
    algorithms (Muon: Newton–Schulz on `hidden`, AdamW elsewhere) declares them per group with
    `group_knobs(group)`, so a knob the group would silently ignore is refused; the others list
    one `GROUP_KNOBS` for every group."""
    return tuple(hparams.group_knobs(group))


def scaled_schedule(schedule: optax.Schedule, factor) -> optax.Schedule:
    """`schedule` times `factor` (None: unchanged). A function per call, so every group keeps its
    own factor (no late binding)."""
    if factor is None:
        return schedule
    return lambda step: schedule(step) * factor


def group_hparams(hparams: Any, group: str, overrides: dict[str, dict[str, float]]) -> Any:
    """The optimizer dataclass as one group sees it: its overrides applied, and weight decay
    zeroed for groups that do not decay by default unless the override sets it."""
    own = {k: v for k, v in overrides.get(group, {}).items() if k != "lr"}
    if hasattr(hparams, "weight_decay") and "weight_decay" not in own:
        if group not in decayed_groups(hparams.decay_embeddings):
            own["weight_decay"] = 0.0
    return dataclasses.replace(hparams, **own)


def group_lr(hparams: Any, group: str, base_lr: float, overrides: dict[str, dict[str, float]],
             hyperball: bool = False) -> float:
    """Peak lr of a group: its override, else the optimizer's default for that group (Muon
    gives non-hidden groups their AdamW lr), else `optimizer.lr_config.lr`. Under
    `hyperball` a group on the sphere defaults to `optimizer.lr_config.lr`, its relative step
    (optimizer/hyperball.py)."""
    if "lr" in overrides.get(group, {}):
        return overrides[group]["lr"]
    if hyperball and group in hyperball_lib.HYPERBALL_GROUPS:
        return base_lr
    return hparams.default_group_lr(group, base_lr)


def group_schedules(hparams: Any, schedule: optax.Schedule, base_lr: float | None,
                    overrides: dict[str, dict[str, float]], hyperball: bool = False,
                    lr_scales: dict[str, float] | None = None) -> dict[str, optax.Schedule]:
    """Each group's lr schedule: the run's, rescaled to the group's peak lr, then times the group's
    `lr_scales` factor (model.mup's width scaling, optimizer/mup.py; it multiplies an override too:
    that is the value tuned at the base width). `base_lr=None` (a bare schedule with no known peak)
    gives every group the schedule unchanged but for `lr_scales`, as does a group whose peak is
    `base_lr` itself (the object: it may be a traced step argument, which cannot be compared in Python)."""
    lr_scales = lr_scales or {}

    def factor(g: str, lr):
        own = None if lr is base_lr else lr / base_lr
        scale = lr_scales.get(g)
        return own if scale is None else scale if own is None else own * scale

    if base_lr is None:
        return {g: scaled_schedule(schedule, lr_scales.get(g)) for g in GROUPS}
    lrs = {g: group_lr(hparams, g, base_lr, overrides, hyperball) for g in GROUPS}
    return {g: scaled_schedule(schedule, factor(g, lr)) for g, lr in lrs.items()}


def lr_scaled_decay(hparams: Any, scale: float | None) -> Any:
    """A group's dataclass with its weight decay divided by its lr factor: decay is times the lr
    here, so lr·weight_decay, the decay per step, stays what was tuned (optimizer/mup.py)."""
    if scale is None or not hasattr(hparams, "weight_decay"):
        return hparams
    return dataclasses.replace(hparams, weight_decay=hparams.weight_decay / scale)


def built_groups(labels) -> tuple[str, ...]:
    """The groups given a transform: without LoRA the four base groups, present or not (as before
    the `lora` group existed, so a run's optimizer state keeps its layout); with it, only `lora`
    (every other array is frozen: their groups would hold only step counts)."""
    return ("lora",) if "lora" in set(jax.tree.leaves(labels)) else BASE_GROUPS


def per_group(hparams: Any, schedule: optax.Schedule, labels, base_lr: float | None = None,
              overrides: dict[str, dict[str, float]] | None = None,
              cautious: bool = False, hyperball: bool = False,
              lr_scales: dict[str, float] | None = None) -> optax.GradientTransformation:
    """optax.multi_transform over the groups, each built by `hparams.transform`, or with
    `cautious` by `optimizer.cautious.cautious_transform` (the same, its direction masked); with
    `hyperball` the hidden and head groups' updates are then kept on their sphere
    (optimizer/hyperball.py). `lr_scales`: {group: factor} on a group's lr, its decay divided by
    it (model.mup: optimizer/mup.py)."""
    overrides, lr_scales = overrides or {}, lr_scales or {}
    schedules = group_schedules(hparams, schedule, base_lr, overrides, hyperball, lr_scales)
    build = cautious_transform if cautious else lambda hp, g, s: hp.transform(g, s)
    if hyperball:
        from optimizer import OPTIMIZERS  # the registry imports this module: at call time

        hyperball_lib.check(hparams, next((n for n, cls in OPTIMIZERS.items() if type(hparams) is cls),
                                          type(hparams).__name__), overrides)
    transforms = {}
    for g in built_groups(labels):
        transforms[g] = build(lr_scaled_decay(group_hparams(hparams, g, overrides), lr_scales.get(g)), g, schedules[g])
        if hyperball and g in hyperball_lib.HYPERBALL_GROUPS:
            transforms[g] = hyperball_lib.hyperball_transform(transforms[g], schedules[g])
    if FROZEN in set(jax.tree.leaves(labels)):
        transforms[FROZEN] = optax.set_to_zero()
    # A callable, because a labels tree that is itself callable (an Equinox model) would be called.
    return optax.multi_transform(transforms, lambda _params: labels)


def check_unit_interval(prefix: str, hparams: Any, *knobs: str) -> None:
    """Momentum-like knobs (betas, momentum) must lie in [0, 1)."""
    for knob in knobs:
        value = getattr(hparams, knob)
        if value is not None and not 0.0 <= value < 1.0:
            raise ConfigError(f"{prefix}.{knob}={value} must be in [0, 1)")


def check_adam(prefix: str, hparams: Any) -> None:
    """An Adam-type optimizer's knobs: b1 and b2 in [0, 1), weight decay >= 0, eps > 0."""
    check_unit_interval(prefix, hparams, "b1", "b2")
    check_non_negative(prefix, hparams, "weight_decay")
    check_positive(prefix, hparams, "eps")


def check_non_negative(prefix: str, hparams: Any, *knobs: str) -> None:
    for knob in knobs:
        if getattr(hparams, knob) < 0:
            raise ConfigError(f"{prefix}.{knob}={getattr(hparams, knob)} must be >= 0")


def check_positive(prefix: str, hparams: Any, *knobs: str) -> None:
    for knob in knobs:
        if getattr(hparams, knob) <= 0:
            raise ConfigError(f"{prefix}.{knob}={getattr(hparams, knob)} must be positive")
