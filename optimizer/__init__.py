"""Optimizer registry: `optimizer.name` in a yaml -> the frozen dataclass that builds its update.

Adding an optimizer: one file here with a frozen dataclass subclassing
`optimizer.contract.Optimizer` (the whole contract, its optional parts and their defaults, is
that class), one yaml in `conf/optimizer/`, one line below. See docs/extending.md, "An optimizer".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import optax

from optimizer.adafactor import Adafactor
from optimizer.adam_mini import AdamMini
from optimizer.adamw import AdamW
from optimizer.ademamix import AdEMAMix
from optimizer.adopt import ADOPT
from optimizer.arguments import clipping
from optimizer.dion import Dion
from optimizer.groups import group_schedules, per_group
from optimizer.kron import Kron
from optimizer.lion import Lion
from optimizer.mars import MARS
from optimizer.muon import Muon
from optimizer.nadamw import NAdamW
from optimizer.normuon import NorMuon
from optimizer.prodigy import Prodigy
from optimizer.schedule_free import ScheduleFreeAdamW
from optimizer.scion import Scion
from optimizer.sgdm import SGDM
from optimizer.shampoo import Shampoo
from optimizer.soap import SOAP
from optimizer.sophia import Sophia

OPTIMIZERS = {
    "adamw": AdamW,
    "sgdm": SGDM,
    "muon": Muon,
    "lion": Lion,
    "adafactor": Adafactor,
    "shampoo": Shampoo,
    "nadamw": NAdamW,
    "schedule_free_adamw": ScheduleFreeAdamW,
    "ademamix": AdEMAMix,
    "soap": SOAP,
    "mars": MARS,
    "kron": Kron,
    "adopt": ADOPT,
    "prodigy": Prodigy,
    "normuon": NorMuon,
    "adam_mini": AdamMini,
    "scion": Scion,
    "dion": Dion,
    "sophia": Sophia,
}


def make_optimizer(hparams, schedule: optax.Schedule, labels, clip: float | None, base_lr: float | None = None,
                   overrides: dict[str, dict[str, float]] | None = None,
                   cautious: bool = False, hyperball: bool = False,
                   lr_scales: dict[str, float] | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then the per-group optimizer, whose last stage applies the lr;
    `cautious` (optimizer.cautious) masks each group's direction (optimizer/cautious.py);
    `hyperball` (optimizer.hyperball) keeps the hidden and head matrices at their initial norms
    (optimizer/hyperball.py); `lr_scales` multiplies groups' lr (model.mup: optimizer/mup.py)."""
    clip_tx = optax.clip_by_global_norm(clip) if clipping(clip) else optax.identity()
    return optax.chain(clip_tx, per_group(hparams, schedule, labels, base_lr, overrides, cautious, hyperball,
                                          lr_scales))


def for_run(hparams, schedule_name: str, schedule, total_steps: int):
    """`hparams` completed and checked for one run, at validation (no JAX runs there): an
    optimizer whose knobs depend on the run defines `for_run(schedule_name, schedule, total_steps)`
    returning its dataclass (AdEMAMix sets its α/β3 warmup to the run's length; Schedule-Free
    refuses a decaying lr schedule with a ConfigError); the others come back as they are.
    `schedule` is the lr_config dataclass (optimizer.schedules), `total_steps` train.max_steps."""
    return hparams.for_run(schedule_name, schedule, total_steps)


def eval_params(hparams, params, opt_state):
    """The params to evaluate, sample from and export: `hparams.eval_params(params, opt_state)`
    where the optimizer trains one point and evaluates another (Schedule-Free: the average x, not
    the gradient point y the step holds), else `params` themselves."""
    return params if hparams.eval_params is None else hparams.eval_params(params, opt_state)


def eval_view(hparams) -> Callable[[Any], Any] | None:
    """state -> the model to evaluate (`eval_params` of its arrays, jitted; the state's own
    `model` and `opt_state`, e.g. a TrainState), or None when that is the state's model itself:
    callers then use it as it is, at no cost."""
    if hparams.eval_params is None:
        return None

    @eqx.filter_jit
    def view(model, opt_state):
        params, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(eval_params(hparams, params, opt_state), static)

    return lambda state: view(state.model, state.opt_state)


__all__ = ["OPTIMIZERS", "make_optimizer", "group_schedules", "for_run", "eval_params", "eval_view"]
