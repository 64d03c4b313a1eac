"""train.skip_nonfinite: a step whose gradient is not finite is skipped, and the lr schedule still
follows the run's step.

optax.apply_if_finite keeps the whole inner state on a skipped step, the schedule's counter
(`ScaleByScheduleState.count`) included: after k skips every later update would use the lr of k
steps earlier than the one logged (`train/lr` = schedule(step)), and min_lr would never be reached.
The convention here is trainit's and PyTorch's (a scheduler steps once per iteration): the
schedule follows the step counter, skipped steps included. So on a skipped step the schedule
counters advance and everything else stays: the moments and their own counts (Adam's bias
correction, Shampoo's preconditioning clock) describe the gradients actually taken.
(optimizer/restart.py sets the same counters to the run's step for a fresh optimizer state.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _is_schedule_state(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def advance_schedules(opt_state: optax.OptState, advance: jax.Array) -> optax.OptState:
    """`opt_state` with every lr-schedule counter one step further where `advance` (traceable)."""
    return jax.tree.map(
        lambda s: s._replace(count=jnp.where(advance, optax.safe_int32_increment(s.count), s.count))
        if _is_schedule_state(s) else s, opt_state, is_leaf=_is_schedule_state)


def skip_nonfinite(tx: optax.GradientTransformation, max_consecutive_skips: int) -> optax.GradientTransformation:
    """optax.apply_if_finite(tx) (its state, so `total_notfinite` and checkpoints are unchanged),
    with the schedule counters advanced on the steps it skips."""
    inner = optax.apply_if_finite(tx, max_consecutive_skips)

    def update(updates, state, params=None, **extra_args):
        updates, new = inner.update(updates, state, params, **extra_args)
        # apply_if_finite applies the update anyway once the skips in a row exceed the limit
        skipped = jnp.logical_and(~new.last_finite, new.notfinite_count <= max_consecutive_skips)
        return updates, new._replace(inner_state=advance_schedules(new.inner_state, skipped))

    return optax.GradientTransformationExtraArgs(inner.init, update)
