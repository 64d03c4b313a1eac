"""Learning-rate schedules, one frozen dataclass per `conf/optimizer/lr_config/*.yaml`.

Each `build(max_steps)` returns an optax schedule (step -> lr) made from optax's own pieces;
`max_steps` is `optimizer.lr_config.max_steps`, or `train.max_steps` when that is null.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import optax

from utils.errors import ConfigError


def _check_common(prefix: str, lr: float, warmup: int, max_steps: int | None, min_lr: float = 0.0) -> None:
    if lr <= 0:
        raise ConfigError(f"{prefix}.lr={lr} must be positive")
    if not 0.0 <= min_lr <= lr:
        raise ConfigError(f"{prefix}.min_lr={min_lr} must be in [0, lr={lr}]")
    if warmup < 0:
        raise ConfigError(f"{prefix}.warmup={warmup} must be >= 0")
    if max_steps is not None and max_steps <= 0:
        raise ConfigError(f"{prefix}.max_steps={max_steps} must be positive (or null for train.max_steps)")


def _warmup_then(lr: float, warmup: int, after: optax.Schedule) -> optax.Schedule:
    """Linear warmup, lr·(step+1)/warmup for steps 0..warmup-1 (so the first update is not a
    no-op), then `after`, counted from step `warmup`."""
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(lr / warmup, lr, max(warmup - 1, 1))
    return optax.join_schedules([ramp, after], [warmup])


def warmup_warning(prefix: str, steps: int, max_steps: int, what: str = "warmup") -> str | None:
    """A schedule whose warmup (and flat phase) outlasts the run never reaches its lr: worth a
    warning (short smoke runs do it on purpose), not an error."""
    if steps <= max_steps:
        return None
    return (f"{prefix}: {what} ({steps} steps) outlasts the schedule's {max_steps} steps, so the lr never "
            f"reaches {prefix}.lr; shorten it or train longer")


@dataclass(frozen=True)
class Constant:
    """Warmup, then `lr` for ever."""

    lr: float
    warmup: int = 0

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, self.warmup, None)

    def build(self, max_steps: int) -> optax.Schedule:
        return _warmup_then(self.lr, self.warmup, optax.constant_schedule(self.lr))


@dataclass(frozen=True)
class Linear:
    """Warmup, `const` steps at `lr` (null: none), then linear decay to `min_lr` at `max_steps`."""

    lr: float
    warmup: int = 0
    const: int | None = None
    min_lr: float = 0.0
    max_steps: int | None = None

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, self.warmup, self.max_steps, self.min_lr)
        if self.const is not None and self.const < 0:
            raise ConfigError(f"{prefix}.const={self.const} must be >= 0 or null")

    def warning(self, prefix: str, max_steps: int) -> str | None:
        return warmup_warning(prefix, self.warmup + (self.const or 0), max_steps, "warmup + const")

    def build(self, max_steps: int) -> optax.Schedule:
        const = self.const or 0
        decay = max(max_steps - self.warmup - const, 1)
        flat_then_decay = optax.join_schedules(
            [optax.constant_schedule(self.lr), optax.linear_schedule(self.lr, self.min_lr, decay)], [const]
        )
        return _warmup_then(self.lr, self.warmup, flat_then_decay)


@dataclass(frozen=True)
class Cosine:
    """Warmup, then cosine from `lr` down to `min_lr` (null: lr / 10) at `max_steps`."""

    lr: float
    warmup: int = 0
    min_lr: float | None = None
    max_steps: int | None = None

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, self.warmup, self.max_steps, self.final_lr)

    def build(self, max_steps: int) -> optax.Schedule:
        decay = max(max_steps - self.warmup, 1)
        return _warmup_then(
            self.lr, self.warmup, optax.cosine_decay_schedule(self.lr, decay, alpha=self.final_lr / self.lr)
        )


@dataclass(frozen=True)
class Trapezoid:
    """Warmup-stable-decay: warmup, flat at `lr`, linear decay to `min_lr` over the last `decay` steps."""

    lr: float
    warmup: int = 0
    decay: int = 0
    min_lr: float = 0.0
    max_steps: int | None = None

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, self.warmup, self.max_steps, self.min_lr)
        if self.decay < 0:
            raise ConfigError(f"{prefix}.decay={self.decay} must be >= 0")

    def check_steps(self, prefix: str, max_steps: int) -> None:
        if self.warmup + self.decay > max_steps:
            raise ConfigError(
                f"{prefix}: warmup ({self.warmup}) + decay ({self.decay}) exceed the schedule's {max_steps} steps "
                "(optimizer.lr_config.max_steps, or train.max_steps when null): shorten them or train longer"
            )

    def build(self, max_steps: int) -> optax.Schedule:
        flat = max_steps - self.warmup - self.decay
        flat_then_decay = optax.join_schedules(
            [optax.constant_schedule(self.lr), optax.linear_schedule(self.lr, self.min_lr, max(self.decay, 1))],
            [flat],
        )
        return _warmup_then(self.lr, self.warmup, flat_then_decay)


@dataclass(frozen=True)
class PiecewiseLinear:
    """`lr` times a multiplier interpolated linearly between (`steps[i]`, `scales[i]`) points;
    flat before the first point and after the last."""

    lr: float
    steps: tuple[int, ...] = (0,)
    scales: tuple[float, ...] = (1.0,)

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, 0, None)
        if len(self.steps) != len(self.scales) or not self.steps:
            raise ConfigError(f"{prefix}.steps and {prefix}.scales must be non-empty lists of equal length")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise ConfigError(f"{prefix}.steps={list(self.steps)} must be strictly increasing")

    def build(self, max_steps: int) -> optax.Schedule:
        xs = jnp.asarray(self.steps, jnp.float32)
        ys = self.lr * jnp.asarray(self.scales, jnp.float32)
        return lambda step: jnp.interp(jnp.asarray(step, jnp.float32), xs, ys)


SCHEDULES = {
    "constant": Constant,
    "linear": Linear,
    "cosine": Cosine,
    "trapezoid": Trapezoid,
    "wsd": Trapezoid,
    "piecewise_linear": PiecewiseLinear,
}
