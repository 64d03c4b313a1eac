"""Adafactor (factored second moments: O(m+n) state for an m×n matrix), from optax's pieces.

Stacked block weights (num_blocks, d_in, d_out) are factored over their last two axes, so each
block keeps its own row and column statistics.

Not `optax.adafactor` itself: it adds `weight_decay_rate·w` after its lr scaling, so a decay of
0.1 would remove 10% of every matrix per step whatever the lr. The same pieces are chained here
with the decay before the lr, so `weight_decay` means what it means for every optimizer in this
package: decoupled, w ← w·(1 − lr·weight_decay) per step, following the schedule and the group's lr.
(The momentum, when on, is likewise taken before the lr rather than of lr-scaled updates: the
same thing under a constant lr.)
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.groups import check_non_negative, check_unit_interval
from utils.errors import ConfigError


@dataclass(frozen=True)
class Adafactor:
    decay_rate: float = 0.8  # second-moment decay exponent: beta2_t = 1 - t^(-decay_rate)
    momentum: float | None = None  # null = no first moment (the memory-saving original)
    clipping_threshold: float | None = 1.0  # update-RMS clipping; null = off
    multiply_by_parameter_scale: bool = False  # relative step sizes (off: lr means what it says)
    weight_decay: float = 0.0
    decay_embeddings: bool = False

    GROUP_KNOBS = ("lr", "weight_decay")

    def check(self, prefix: str) -> None:
        if not 0.0 < self.decay_rate <= 1.0:
            raise ConfigError(f"{prefix}.decay_rate={self.decay_rate} must be in (0, 1]")
        check_unit_interval(prefix, self, "momentum")
        check_non_negative(prefix, self, "weight_decay")
        if self.clipping_threshold is not None and self.clipping_threshold <= 0:
            raise ConfigError(f"{prefix}.clipping_threshold={self.clipping_threshold} must be positive, or null for "
                              "no clipping")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            optax.scale_by_factored_rms(decay_rate=self.decay_rate),
            (optax.clip_by_block_rms(self.clipping_threshold) if self.clipping_threshold is not None
             else optax.identity()),
            optax.scale_by_param_block_rms() if self.multiply_by_parameter_scale else optax.identity(),
            optax.ema(self.momentum, debias=False) if self.momentum is not None else optax.identity(),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
