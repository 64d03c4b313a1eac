"""Lion (sign of an interpolated momentum), straight from optax: the smallest example of an
optimizer file. Use a ~3-10x smaller lr and larger weight decay than AdamW."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.contract import Optimizer
from optimizer.groups import check_non_negative, check_unit_interval


@dataclass(frozen=True)
class Lion(Optimizer):
    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.1

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: sign updates are Adam-type, hidden lr x base/width (optimizer/mup.py)

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2")
        check_non_negative(prefix, self, "weight_decay")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.lion(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
