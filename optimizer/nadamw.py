"""NAdamW: Adam with Nesterov momentum (Dozat 2016, "Incorporating Nesterov Momentum into Adam")
and decoupled weight decay, straight from optax.nadamw. AlgoPerf's strongest external-tuning
baseline ("Benchmarking Neural Network Training Algorithms", Dahl et al. 2023).

optax.nadamw = scale_by_adam(nesterov=True) -> add_decayed_weights -> scale_by_learning_rate: the
decay is added after Adam's scaling and before the lr, so it is decoupled and times the lr.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v
from optimizer.groups import check_adam


@dataclass(frozen=True)
class NAdamW(Optimizer):
    b1: float = 0.973
    b2: float = 0.998
    eps: float = 1e-8
    weight_decay: float = 0.164

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)

    def check(self, prefix: str) -> None:
        check_adam(prefix, self)

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.nadamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sqrt_v_min / _median / _max, as AdamW's: the state is an optax.ScaleByAdamState too."""
        return adam_sqrt_v(group_state, self.b2)
