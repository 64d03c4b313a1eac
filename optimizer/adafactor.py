"""Adafactor (factored second moments: O(m+n) state for an m×n matrix), from optax.

Stacked block weights (num_blocks, d_in, d_out) are factored over their last two axes, so each
block keeps its own row and column statistics.
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

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.adafactor(
            learning_rate=schedule,
            decay_rate=self.decay_rate,
            momentum=self.momentum,
            clipping_threshold=self.clipping_threshold,
            multiply_by_parameter_scale=self.multiply_by_parameter_scale,
            weight_decay_rate=self.weight_decay or None,
        )
