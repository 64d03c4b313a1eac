"""Dynamic loss scaling for `train.compute_dtype=float16`, as PyTorch AMP's GradScaler does it.

float16 keeps 5 exponent bits: values under 6.1e-5 lose digits (subnormal) and under 6e-8 flush
to zero, and a backward pass's cotangents are that small (the loss's is 1/tokens, then products
with 0.02-sized weights). Multiplying the loss by S multiplies every cotangent by S (exactly, for
a power of two), which lifts them into float16's normal range; the float32 gradient is divided
by S before clipping, the optimizer and the step metrics see it. Too large an S overflows a
cotangent to inf: that step's gradient is not finite, so it is skipped (train.skip_nonfinite's
mechanism, optimizer/nonfinite.py, always on under float16: weights and optimizer state kept,
the lr schedule following the step) and S is multiplied by `backoff_factor`; after
`growth_interval` finite steps in a row S is multiplied by `growth_factor`. The scale and its
count live in the TrainState (`loss_scale`) and the checkpoint (item `loss_scale`), so a resumed
run continues them exactly.

Not jmp's `DynamicLossScale` (DeepMind's; 0.0.4 installs and runs on jax 0.10.2): it has one
`factor` for growing and backing off where GradScaler has two, it has not been released since
2023, and its pytree drops `min_loss_scale` on unflattening. Here the same rule is an Equinox
module whose leaves the checkpoint names (`scale`, `good_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from utils.errors import ConfigError

METRIC = "train/loss_scale"
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class LossScaleConfig:
    """train.loss_scale: read only under train.compute_dtype=float16. GradScaler's defaults."""

    init: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def check(self, prefix: str) -> None:
        if not 0 < self.init < FLOAT32_MAX:
            raise ConfigError(f"{prefix}.init={self.init} must be a positive float32 number, e.g. 32768 (2^15)")
        if self.growth_interval <= 0:
            raise ConfigError(f"{prefix}.growth_interval={self.growth_interval} must be a positive integer (steps)")
        if not self.growth_factor > 1:
            raise ConfigError(f"{prefix}.growth_factor={self.growth_factor} must be > 1 (the scale grows), e.g. 2.0")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"{prefix}.backoff_factor={self.backoff_factor} must be positive and < 1 "
                              "(the scale shrinks on an overflow), e.g. 0.5")


class LossScale(eqx.Module):
    scale: jax.Array  # float32 scalar: the loss is multiplied by it before the gradient
    good_steps: jax.Array  # int32 scalar: finite steps in a row since the scale last changed
    init: float = eqx.field(static=True)  # the scale at step 0 (and of a run whose checkpoint had none)
    growth_interval: int = eqx.field(static=True)
    growth_factor: float = eqx.field(static=True)
    backoff_factor: float = eqx.field(static=True)

    def fresh(self) -> "LossScale":
        """The scale at step 0: `init`, no finite steps counted."""
        return LossScale(jnp.asarray(self.init, jnp.float32), jnp.zeros((), jnp.int32), self.init,
                         self.growth_interval, self.growth_factor, self.backoff_factor)

    def scaled(self, loss_fn: Callable) -> Callable:
        """`loss_fn` (-> (loss, aux)) with its loss, the differentiated output, times the scale; aux
        (the logged `loss` among it) stays unscaled."""
        def fn(*args):
            loss, aux = loss_fn(*args)
            return loss * self.scale, aux
        return fn

    def unscale(self, grads):
        """The gradient of the scaled loss divided by the scale (exact for a power of two; inf stays inf)."""
        return jax.tree.map(lambda g: (g / self.scale).astype(g.dtype), grads)

    def adjust(self, finite: jax.Array) -> "LossScale":
        """The state after a step whose unscaled gradient was `finite` (or not): GradScaler.update."""
        count = self.good_steps + 1
        grow = finite & (count >= self.growth_interval)
        grown = self.scale * self.growth_factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)  # never inf (jmp's guard; GradScaler lacks it)
        scale = jnp.where(finite, jnp.where(grow, grown, self.scale), self.scale * self.backoff_factor)
        good = jnp.where(finite & ~grow, count, 0).astype(jnp.int32)
        return LossScale(scale.astype(jnp.float32), good, self.init, self.growth_interval, self.growth_factor,
                         self.backoff_factor)


def initial(train) -> LossScale | None:
    """The TrainState's `loss_scale` at step 0 for a TrainConfig: None (no scaling) unless float16 compute."""
    if train.compute_dtype != "float16":
        return None
    c = train.loss_scale
    return LossScale(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), c.init, c.growth_interval,
                     c.growth_factor, c.backoff_factor).fresh()


def metric(state, grads, updates, aux) -> dict[str, jax.Array]:
    """train/loss_scale: the scale this step's loss was multiplied by (nothing without float16)."""
    scaler = getattr(state, "loss_scale", None)
    return {} if scaler is None else {METRIC: scaler.scale}
