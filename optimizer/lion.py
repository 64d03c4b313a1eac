"""Lion (sign of an interpolated momentum), straight from optax: the smallest example of an
optimizer file. Use a ~3-10x smaller lr and larger weight decay than AdamW."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from utils.errors import ConfigError


@dataclass(frozen=True)
class Lion:
    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.1
    decay_embeddings: bool = False

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2")

    def check(self, prefix: str) -> None:
        for knob in ("b1", "b2"):
            if not 0.0 <= getattr(self, knob) < 1.0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"{prefix}.weight_decay={self.weight_decay} must be >= 0")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.lion(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
