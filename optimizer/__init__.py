"""Optimizer registry: `optimizer.name` in a yaml -> the frozen dataclass that builds its update.

Adding an optimizer: one file here with a frozen dataclass (its hyperparameters as fields,
`GROUP_KNOBS` naming those a parameter group may override, or `group_knobs(group)` where groups
differ, `check(prefix)` raising ConfigError, `transform(group, schedule)` returning the optax
update of one group, its `weight_decay` decoupled and times the lr), one yaml in
`conf/optimizer/`, one line below. See docs/extending.md, "An optimizer".
"""

from __future__ import annotations

import optax

from optimizer.adafactor import Adafactor
from optimizer.adamw import AdamW
from optimizer.groups import group_schedules, per_group
from optimizer.lion import Lion
from optimizer.muon import Muon
from optimizer.sgdm import SGDM
from optimizer.shampoo import Shampoo

OPTIMIZERS = {
    "adamw": AdamW,
    "sgdm": SGDM,
    "muon": Muon,
    "lion": Lion,
    "adafactor": Adafactor,
    "shampoo": Shampoo,
}


def make_optimizer(hparams, schedule: optax.Schedule, labels, clip: float | None, base_lr: float | None = None,
                   overrides: dict[str, dict[str, float]] | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then the per-group optimizer, whose last stage applies the lr."""
    clip_tx = optax.clip_by_global_norm(clip) if clip else optax.identity()
    return optax.chain(clip_tx, per_group(hparams, schedule, labels, base_lr, overrides))


__all__ = ["OPTIMIZERS", "make_optimizer", "group_schedules"]
