"""SGD with momentum (heavy-ball or Nesterov) and decoupled weight decay.

Decay is added after momentum, so it is `lr * weight_decay * param` per step whatever the
momentum, as in AdamW, rather than being folded into the gradient as classic SGD does.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from optimizer.groups import decay_mask
from utils.errors import ConfigError


@dataclass(frozen=True)
class SGDM:
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_embeddings: bool = False

    def check(self, prefix: str) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"{prefix}.momentum={self.momentum} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"{prefix}.weight_decay={self.weight_decay} must be >= 0")

    def build(self, schedule: optax.Schedule, labels) -> optax.GradientTransformation:
        return optax.chain(
            optax.trace(decay=self.momentum, nesterov=self.nesterov),
            optax.add_decayed_weights(self.weight_decay, mask=decay_mask(labels, self.decay_embeddings)),
            optax.scale_by_learning_rate(schedule),
        )
