"""AdamW: Adam with decoupled weight decay (on >=2-D weights by default), optional Nesterov."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v
from optimizer.groups import check_adam


@dataclass(frozen=True)
class AdamW(Optimizer):
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    nesterov: bool = False

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")  # settable per group
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)

    def check(self, prefix: str) -> None:
        check_adam(prefix, self)

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.adamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
                           nesterov=self.nesterov)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sqrt_v_min / _median / _max: √v̂ of Adam's bias-corrected second moment (optimizer/diagnostics.py)."""
        return adam_sqrt_v(group_state, self.b2)
