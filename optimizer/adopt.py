"""ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any β2 with the Optimal
Rate", NeurIPS 2024), from optax.contrib.scale_by_adopt.

Two changes to Adam. The gradient is divided by the second moment of the steps BEFORE it,
g_t / max(√v_(t−1), eps), so the denominator is independent of the gradient it divides (Adam's
√v_t includes g_t, which is what lets Adam diverge for some β2); and the momentum averages those
normalised gradients (Adam normalises the momentum). The first update only sets v_0 = g_0² and
moves nothing (besides the weight decay). With `clip` (the authors' default, recommended for
training from scratch) each normalised gradient is clipped to ±t^(1/4) at update t+1, t the
number of updates taken so far: the paper's c_t = t^(1/4) over its steps t = 1, 2, ... after the
v_0 one. (The authors' code and pytorch_optimizer count that first step too and clip the first
real update at 2^(1/4); tests/test_parity_adopt_prodigy_normuon.py aligns it.)

No bias correction: v_0 = g_0², not 0, and the momentum averages quantities of size ~1.

Weight decay: scale_by_adopt -> add_decayed_weights -> scale_by_learning_rate, decoupled and
times the lr (the authors' `decouple=True`; their default decay is 0, as here).
"""

from __future__ import annotations

from dataclasses import dataclass

import optax
from optax.contrib import scale_by_adopt

from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states, sqrt_v_stats
from optimizer.groups import check_adam


@dataclass(frozen=True)
class ADOPT(Optimizer):
    b1: float = 0.9
    b2: float = 0.9999
    eps: float = 1e-6
    clip: bool = True
    weight_decay: float = 0.0

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)

    def check(self, prefix: str) -> None:
        check_adam(prefix, self)

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            scale_by_adopt(b1=self.b1, b2=self.b2, eps=self.eps, use_clipping=self.clip),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sqrt_v_min / _median / _max: √v over the group's elements, the denominator the NEXT
        update divides its gradient by (less its floor eps); no bias correction (v starts at g_0²).
        Zero before the first update. The state is an optax.ScaleByAdamState, as Adam's."""
        states = find_states(group_state, optax.ScaleByAdamState)
        if not states:
            return {}
        return sqrt_v_stats(array_leaves(states[0].nu), None, None)
