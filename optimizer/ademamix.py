"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older"),
straight from optax.contrib.ademamix: Adam whose numerator mixes the usual fast EMA of the
gradient with a slow one, (m̂1 + α·m2) / (√v̂ + eps), m2 ← b3·m2 + (1 − b3)·g with b3 ~ 0.9999.

A slow EMA that starts at 0 would swamp the first steps, so α and b3 warm up over
`alpha_b3_warmup` steps (the paper's T_α = T_β3 = the run's length, Algorithm 1): α linearly from
0, b3 from b1 along a straight line in half-life, t ↦ 0.5^(1/(t+1)) with t = ln 0.5/ln b − 1. As in
Algorithm 1 (and the authors' PyTorch code) the update at 0-based index n uses t = n + 1, so the
last update of the warmup uses α and b3 themselves. optax takes α and b3 as schedules of the
slow EMA's own step count (`ScaleByAdemamixState.count_m2`), which lives in the optimizer state:
a resumed run continues the warmup exactly; a fresh state (checkpoint.overwrite_optimizer)
restarts it, as its slow EMA restarts from 0.

Weight decay: optax's ademamix chains add_decayed_weights after the mixing and before
scale_by_learning_rate: decoupled, times the lr.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp
import optax
from optax.contrib import ScaleByAdemamixState, ademamix

from optimizer.arguments import known_zero
from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states, sqrt_v_stats
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError


def _half_life(beta: float) -> float:
    """ln 0.5 / ln beta − 1 (the paper's f), in float64 at trace time: ln of a b3 near 1 loses
    three digits in float32. beta = 0 has half-life 0: f = −1."""
    return math.log(0.5) / math.log(beta) - 1.0 if beta > 0 else -1.0


def alpha_schedule(alpha: float, warmup: int) -> optax.Schedule:
    """count -> α·(count + 1)/warmup until count + 1 reaches warmup, then α."""

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) + 1.0
        return jnp.where(t < warmup, alpha * t / warmup, alpha)

    return schedule


def b3_schedule(b_start: float, b3: float, warmup: int) -> optax.Schedule:
    """count -> b3 interpolated from b_start in half-life (the paper's f_β3) until count + 1
    reaches warmup, then b3."""
    f_start, f_end = _half_life(b_start), _half_life(b3)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) + 1.0
        a = t / warmup
        return jnp.where(t < warmup, jnp.power(0.5, 1.0 / ((1.0 - a) * f_start + a * f_end + 1.0)), b3)

    return schedule


def _norm(leaves: list) -> jnp.ndarray:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


@dataclass(frozen=True)
class AdEMAMix(Optimizer):
    b1: float = 0.9
    b2: float = 0.999
    b3: float = 0.9999
    alpha: float = 8.0
    alpha_b3_warmup: int | None = None  # None: the run's train.max_steps (set by for_run); 0: no warmup
    eps: float = 1e-8
    weight_decay: float = 0.1

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "b3", "alpha", "eps")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)
    # The knob whose null means "the run's length": a comparison's trunk and branches have
    # different lengths, so it sets it to the largest budget for all of them (compare/plan.py).
    RUN_LENGTH_KNOB = "alpha_b3_warmup"
    # constants of the step (optimizer/arguments.py): b3's warmup reads their half-lives in float64 at trace time
    CONSTANT_KNOBS = ("b1", "b3")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2", "b3")
        check_non_negative(prefix, self, "weight_decay", "alpha")
        check_positive(prefix, self, "eps")
        if self.alpha_b3_warmup is not None and self.alpha_b3_warmup < 0:
            raise ConfigError(f"{prefix}.alpha_b3_warmup={self.alpha_b3_warmup} must be >= 0 "
                              "(or null for train.max_steps)")

    def for_run(self, schedule_name: str, schedule, total_steps: int) -> "AdEMAMix":
        """alpha_b3_warmup null -> the run's length (train.max_steps), the paper's T."""
        if self.alpha_b3_warmup is not None:
            return self
        return dataclasses.replace(self, alpha_b3_warmup=total_steps)

    def schedules(self) -> tuple:
        """(α, b3) as optax takes them: schedules of count_m2 during a warmup, else constants."""
        if self.alpha_b3_warmup is None or known_zero(self.alpha_b3_warmup):  # None outside a validated run
            return self.alpha, self.b3
        return (alpha_schedule(self.alpha, self.alpha_b3_warmup),
                b3_schedule(self.b1, self.b3, self.alpha_b3_warmup))

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        alpha, b3 = self.schedules()
        return ademamix(schedule, b1=self.b1, b2=self.b2, b3=b3, alpha=alpha, eps=self.eps,
                        weight_decay=self.weight_decay)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """slow_ema_norm: ‖m2‖ (L2 over the group's elements), the slow EMA; fast_ema_norm: ‖m̂1‖,
        the bias-corrected fast EMA, the update's other numerator term (compare alpha·slow_ema_norm
        with it); alpha, b3: the values the latest update used (the first update's before any);
        sqrt_v_min / _median / _max as AdamW's."""
        states = find_states(group_state, ScaleByAdemamixState)
        m2 = array_leaves(states[0].m2) if states else []
        if not m2:
            return {}
        s = states[0]
        count = s.count.astype(jnp.float32)
        correction = jnp.where(s.count > 0, 1.0 - jnp.float32(self.b1) ** count, 1.0)
        alpha, b3 = self.schedules()
        last = jnp.maximum(s.count_m2 - 1, 0)
        return {
            "slow_ema_norm": _norm(m2),
            "fast_ema_norm": _norm(array_leaves(s.m1)) / correction,
            "alpha": jnp.asarray(alpha(last) if callable(alpha) else alpha, jnp.float32),
            "b3": jnp.asarray(b3(last) if callable(b3) else b3, jnp.float32),
            **sqrt_v_stats(array_leaves(s.nu), s.count, self.b2),
        }
