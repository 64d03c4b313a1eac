"""Weight averaging (train.weight_average=ema|tail): an average of the trained weights, kept
beside them, that evaluation, samples, the best checkpoint's ranking and exports use.

Why a step metric: its state (the average, float32, one array per float parameter; with LoRA
factors one per factor, as the frozen base never changes) then lives in TrainState.metric_states,
so it shards like the parameters, is saved in every checkpoint and a resumed run continues it bit
for bit, with no new field in the state or the checkpoint. The loop reads it through the
eval-view seam Schedule-Free's average uses (optimizer.eval_view): `eval_view(train)` is the model
with its averaged leaves replaced by the average, cast back to each leaf's dtype.

Both averages are one update after each step t (1-based: the weights the step produced, p_t):

    avg_t = (1 − w_t)·avg_{t-1} + w_t·p_t,      avg_0 = p_0 (the initial weights)

(w_t = 1 makes it p_t exactly, whatever came before.)

- ema: the bias-corrected exponential moving average, w_t = (1 − d) / (1 − d^t) with the decay
  d = 0.5^(1/half_life). avg_t = Σ_{s=1..t} (1 − d)·d^(t−s)·p_s / (1 − d^t): the weights of the
  steps taken so far, weighted by d^(age), normalised to sum to 1 (Adam's bias correction of a
  zero-started average; w_1 = 1), so an early evaluation averages trained weights only, not the
  initial ones. 1 − d^t is computed as −expm1(−t·ln2/half_life): accurate to float32's rounding
  for long half-lives, where d rounds close to 1 and 1 − d would lose its digits.
- tail: the uniform average of the weights at steps start..t, start = round((1 − f)·max_steps)
  (f = train.weight_average_tail; LAWA / tail averaging): w_t = 1/(t − start + 1), and w_t = 1
  before the window (the average is the current weights until step `start`).

A run that starts averaging from a checkpoint without an average (switched on at a resume)
starts it at the restored weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from models import lora

NAME = "weight_average"  # its key in TrainState.metric_states


@dataclass(frozen=True)
class WeightAverage:
    """The step metric that keeps the average (see the module docstring); it logs nothing."""

    kind: str  # "ema" | "tail"
    half_life: float  # ema: in optimizer steps
    start: int  # tail: the first step whose weights the window holds
    name = NAME
    logging_only = False
    same_when_logging = True  # its update ignores `logging`: one compiled step serves both variants

    def init(self, params) -> Any:
        """The average at step 0: the weights (`params`: the model's float arrays, None elsewhere), float32."""
        return jax.tree.map(lambda p_: p_.astype(jnp.float32), averaged(params))

    def weight(self, t: jax.Array) -> jax.Array:
        """w_t, float32, of the step count `t` (int32: steps done, this one included)."""
        t = t.astype(jnp.float32)
        if self.kind == "ema":
            rate = math.log(2.0) / self.half_life  # −ln d
            # (1 − d) / (1 − d^t), at most 1: the clip keeps w_1 = 1 exactly (not 1 + an ulp)
            return jnp.minimum(jnp.float32(-math.expm1(-rate)) / -jnp.expm1(-t * rate), 1.0)
        return 1.0 / jnp.maximum(t - self.start + 1.0, 1.0)

    def update(self, avg, inputs, logging: bool) -> tuple[Any, dict]:
        w = self.weight(inputs.new_state.step)
        params = averaged(inputs.new_state.model)
        return jax.tree.map(lambda a, p_: (1.0 - w) * a + w * p_.astype(jnp.float32), avg, params), {}


def averaged(model) -> Any:
    """The arrays the average keeps: `model`'s float arrays, None elsewhere; with LoRA factors the
    factors alone (the frozen base is never trained: its average would be a copy of it)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    if not lora.has_factors(model):
        return params
    return jax.tree_util.tree_map_with_path(lambda path, x: x if lora.is_factor(path) else None, params)


def metric(train) -> WeightAverage | None:
    """The averaging step metric of `train` (utils.config.TrainConfig), or None for weight_average=none."""
    if train.weight_average == "none":
        return None
    return WeightAverage(train.weight_average, train.weight_average_half_life, tail_start(train))


def tail_start(train) -> int:
    """The first step of the tail window: round((1 − f)·max_steps)."""
    return round((1.0 - train.weight_average_tail) * train.max_steps)


def eval_view(train) -> Callable[[Any], Any] | None:
    """state -> the model with the average's weights (jitted), or None for weight_average=none."""
    if train.weight_average == "none":
        return None

    @eqx.filter_jit
    def view(model, avg):  # the average's leaves, cast to the weights' dtypes; the model's own elsewhere
        return eqx.combine(jax.tree.map(lambda a, p_: a.astype(p_.dtype), avg, averaged(model)), model)

    return lambda state: view(state.model, state.metric_states[NAME])
