"""Learning-rate schedules, one frozen dataclass per `conf/optimizer/lr_config/*.yaml`.

Each `build(max_steps)` returns an optax schedule (step -> lr); `max_steps` is
`optimizer.lr_config.max_steps`, or `train.max_steps` when that is null.

Step indices are those of the run's updates: 0 for the first, max_steps-1 for the last (optax
counts from 0). So that the endpoints mean what the yaml says:
  * warmup: step s < warmup uses lr·(s+1)/warmup (the first update is not a no-op; step
    warmup-1 uses lr);
  * the decaying schedules (linear, cosine, trapezoid/wsd, whose decay is linear or 1-sqrt)
    peak at lr on the last warmup step (step 0 without warmup), stay there `const` more steps
    (linear) or until the last `decay` steps (trapezoid), then fall to min_lr, reached exactly
    on step max_steps-1, the last update, and held after it. A schedule that ended at step max_steps would never run its
    final lr.
They are written out in jnp rather than joined from optax pieces: optax's linear/cosine
schedules quietly turn constant when their length is <= 0, exactly the edge cases (decay of 1
step, warmup filling the run) where the endpoints matter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def _linear_shape(x):
    return 1.0 - x


def _cosine_shape(x):
    return 0.5 * (1.0 + jnp.cos(math.pi * x))


def _one_minus_sqrt_shape(x):
    """Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training
    Durations"): the cooldown that matches a cosine run's loss with the shortest decay."""
    return 1.0 - jnp.sqrt(x)


# trapezoid's decay_shape -> the fraction of (lr - min_lr) left at fraction x of the decay.
DECAY_SHAPES = {"linear": _linear_shape, "1-sqrt": _one_minus_sqrt_shape}
# The decay shape of the trapezoid a constant schedule's step program is built as (Constant.as_trapezoid):
# the comparison's default cooldown (conf/compare.yaml cooldown.shape), so that its trunks share their
# branches' program. Never reached within a run: any shape gives the same lrs.
CONSTANT_PROGRAM_SHAPE = "1-sqrt"


def _maximum(a, b):
    """max(a, b): in Python for Python numbers (a run's own schedule, built outside the step: an eager
    jnp op there would compile a program of its own), else jnp's (the step's float32 knobs). The
    knobs are step counts, integers below 2**24, so float64 and float32 arithmetic agree exactly."""
    return max(a, b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else jnp.maximum(a, b)


def _with_warmup(lr: float, warmup: int, after: Callable) -> optax.Schedule:
    """lr·(step+1)/warmup on steps 0..warmup-1, then `after(step)` (step as float32)."""

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        return jnp.where(s < warmup, lr * (s + 1.0) / jnp.maximum(warmup, 1), after(s))

    return schedule


def _decay(lr: float, min_lr: float, decay_start: int, max_steps: int, shape: Callable) -> Callable:
    """lr until `decay_start`, the first step below lr, then `shape` down to min_lr, reached on
    step max_steps-1 and held after it.

    The decay is anchored at lr on the step before `decay_start` (the last warmup or flat
    step), so no step is spent twice at the peak and a decay of k steps has k steps below lr;
    with nothing before it (decay_start 0) it is anchored at step 0, whose update uses lr. With
    no room left (warmup and flat phase fill the run) lr holds to the last step and min_lr
    follows it; the length is floored at 1, so no edge case divides by zero.
    """
    peak = _maximum(decay_start - 1, 0)
    span = _maximum(max_steps - 1 - peak, 1)

    def after(s):
        x = jnp.clip((s - peak) / span, 0.0, 1.0)
        return min_lr + (lr - min_lr) * shape(x)

    return after


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
        return _with_warmup(self.lr, self.warmup, lambda s: jnp.full_like(s, self.lr))

    def as_trapezoid(self, max_steps: int) -> tuple[Trapezoid, int]:
        """(a Trapezoid, its max_steps) equal to this schedule bit for bit on steps 0..max_steps-1:
        a decay of 1 step over max_steps + 1 starts after the run's last step. Built this way, a
        comparison's constant-lr trunk runs the same step program as its cooldown branches, which
        take these knobs as arguments (optimizer/arguments.py `canonical`).

        Why bit for bit: on steps below warmup both compute the same warmup expression; after it the
        trapezoid's decay fraction x = clip((s - peak) / span, 0, 1) with peak = max_steps - 1 is 0
        on every step up to max_steps - 1, where both shapes give exactly 1, and min_lr (0) + (lr - 0)·1
        is lr exactly in floating point."""
        return Trapezoid(self.lr, self.warmup, decay=1, decay_shape=CONSTANT_PROGRAM_SHAPE), max_steps + 1


@dataclass(frozen=True)
class Linear:
    """Warmup, `const` more steps at `lr` (null: none), then linear decay to `min_lr` on the last step."""

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
        start = self.warmup + (0 if self.const is None else self.const)
        return _with_warmup(self.lr, self.warmup, _decay(self.lr, self.min_lr, start, max_steps, _linear_shape))


@dataclass(frozen=True)
class Cosine:
    """Warmup, then cosine from `lr` down to `min_lr` (null: lr / 10), reached on the last step."""

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
        return _with_warmup(self.lr, self.warmup,
                            _decay(self.lr, self.final_lr, self.warmup, max_steps, _cosine_shape))


@dataclass(frozen=True)
class Trapezoid:
    """Warmup-stable-decay: warmup, flat at `lr`, then the last `decay` steps fall to `min_lr`,
    reached on the last step (decay 0: no decay), linearly or as lr·(1 - sqrt(progress))
    (`decay_shape`). Before the decay it equals `Constant(lr, warmup)` bit for bit, so a
    constant-lr trunk's checkpoint is an exact branch point for a cooldown (compare/)."""

    lr: float
    warmup: int = 0
    decay: int = 0
    min_lr: float = 0.0
    max_steps: int | None = None
    decay_shape: str = "linear"

    def check(self, prefix: str) -> None:
        _check_common(prefix, self.lr, self.warmup, self.max_steps, self.min_lr)
        if self.decay < 0:
            raise ConfigError(f"{prefix}.decay={self.decay} must be >= 0")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(f"{prefix}.decay_shape={self.decay_shape!r} must be one of {', '.join(DECAY_SHAPES)}")

    def check_steps(self, prefix: str, max_steps: int) -> None:
        if self.warmup + self.decay > max_steps:
            raise ConfigError(
                f"{prefix}: warmup ({self.warmup}) + decay ({self.decay}) exceed the schedule's {max_steps} steps "
                "(optimizer.lr_config.max_steps, or train.max_steps when null): shorten them or train longer"
            )

    def build(self, max_steps: int) -> optax.Schedule:
        start = _maximum(max_steps - self.decay, self.warmup)
        shape = DECAY_SHAPES[self.decay_shape]
        return _with_warmup(self.lr, self.warmup, _decay(self.lr, self.min_lr, start, max_steps, shape))


@dataclass(frozen=True)
class PiecewiseLinear:
    """`lr` times a multiplier interpolated linearly between (`steps[i]`, `scales[i]`) points;
    flat before the first point and after the last. Steps are update indices as everywhere here
    (0 = the first update, so a scale of 0 at step 0 makes it a no-op); max_steps is not used."""

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
