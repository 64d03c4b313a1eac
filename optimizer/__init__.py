"""Optimizer registry: the `optimizer.name` in a yaml -> the dataclass that builds its optax chain.

Adding an optimizer: one file here with a frozen dataclass (`check(prefix)`, `build(schedule,
labels)`), one yaml in `conf/optimizer/`, one line below.
"""

from __future__ import annotations

import optax

from optimizer.adamw import AdamW
from optimizer.sgdm import SGDM

OPTIMIZERS = {
    "adamw": AdamW,
    "sgdm": SGDM,
}


def make_optimizer(hparams, schedule: optax.Schedule, labels, clip: float | None) -> optax.GradientTransformation:
    """Global-norm clipping, then the optimizer, whose last stage applies the schedule."""
    clip_tx = optax.clip_by_global_norm(clip) if clip else optax.identity()
    return optax.chain(clip_tx, hparams.build(schedule, labels))
