"""SGD with momentum (heavy-ball or Nesterov) and decoupled weight decay.

Decay is added after momentum, so it is `lr * weight_decay * param` per step whatever the
momentum, as in AdamW, rather than being folded into the gradient as classic SGD does.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.contract import Optimizer
from optimizer.groups import check_non_negative, check_unit_interval


@dataclass(frozen=True)
class SGDM(Optimizer):
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0

    GROUP_KNOBS = ("lr", "weight_decay", "momentum")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum")
        check_non_negative(prefix, self, "weight_decay")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            optax.trace(decay=self.momentum, nesterov=self.nesterov),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
