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

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import find_states, is_masked, sqrt_v_stats
from optimizer.groups import check_non_negative, check_unit_interval
from utils.errors import ConfigError


def implied_v(v_row: jax.Array, v_col: jax.Array, v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The second moment optax.scale_by_factored_rms divides by, param-shaped: `v` itself where
    the leaf is not factored, else v_row ⊗ v_col / mean(v_row) over the two factored axes (the
    largest two, as optax picks them)."""
    if tuple(v.shape) == tuple(shape):  # not factored (a factored leaf keeps a (1,) placeholder)
        return v
    sorted_dims = np.argsort(shape)
    d1, d0 = int(sorted_dims[-2]), int(sorted_dims[-1])  # v_row lacks axis d0, v_col lacks d1
    reduced_d1 = d1 - 1 if d1 > d0 else d1
    row = v_row / jnp.mean(v_row, axis=reduced_d1, keepdims=True)
    return jnp.expand_dims(row, d0) * jnp.expand_dims(v_col, d1)


@dataclass(frozen=True)
class Adafactor(Optimizer):
    decay_rate: float = 0.8  # second-moment decay exponent: beta2_t = 1 - t^(-decay_rate)
    b1: float | None = None  # the first moment's decay (optax's momentum); null = none (the memory-saving original)
    clipping_threshold: float | None = 1.0  # update-RMS clipping; null = off
    multiply_by_parameter_scale: bool = False  # relative step sizes (off: lr means what it says)
    weight_decay: float = 0.0

    GROUP_KNOBS = ("lr", "weight_decay")

    @property
    def MUP_HIDDEN_LR_POWER(self) -> float | None:
        """model.mup (optimizer/mup.py): Adam-type without parameter scaling; relative steps have no rule here."""
        return None if self.multiply_by_parameter_scale else 1.0

    def check(self, prefix: str) -> None:
        if not 0.0 < self.decay_rate <= 1.0:
            raise ConfigError(f"{prefix}.decay_rate={self.decay_rate} must be in (0, 1]")
        check_unit_interval(prefix, self, "b1")
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
            optax.ema(self.b1, debias=False) if self.b1 is not None else optax.identity(),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sqrt_v_min / _median / _max of √v over the group, v the (factored) second moment the
        update divides by (`implied_v`, materialised param-sized; no bias correction: Adafactor's
        decay schedule needs none)."""
        states = find_states(group_state, optax.FactoredState)
        if not states:
            return {}
        state = states[0]
        vs: list = []
        jax.tree.map(lambda r, c, v, p: vs.append(implied_v(r, c, v, p.shape)) if hasattr(v, "shape") else None,
                     state.v_row, state.v_col, state.v, params, is_leaf=is_masked)
        return sqrt_v_stats(vs, None, None)
