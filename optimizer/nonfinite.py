"""train.skip_nonfinite: a step whose gradient (or another input of the update: Sophia's Hessian
estimate) is not finite is skipped, and the lr schedule still follows the run's step.

optax.apply_if_finite keeps the whole inner state on a skipped step, the schedule's counter
(`ScaleByScheduleState.count`) included: after k skips every later update would use the lr of k
steps earlier than the one logged (`train/lr` = schedule(step)), and min_lr would never be reached.
The convention here is trainit's and PyTorch's (a scheduler steps once per iteration): the
schedule follows the step counter, skipped steps included. So on a skipped step the schedule
counters advance and everything else stays: the moments and their own counts (Adam's bias
correction, Shampoo's preconditioning clock) describe the gradients actually taken.
Schedule-Free's `step_count` is a schedule counter too: optax evaluates the lr schedule at it for
the weight of its average (`max_lr`, one ahead of the count of scale_by_learning_rate inside it, as
it starts at 1), so it advances with them; its `weight_sum` and `max_lr` stay, as a moment's do.
(optimizer/restart.py sets the same counters to the run's step for a fresh optimizer state.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import ScheduleFreeState


def is_schedule_state(x) -> bool:
    """A state holding an lr-schedule counter: a schedule's own (`count`), Schedule-Free's clock (`step_count`)."""
    return isinstance(x, (optax.ScaleByScheduleState, ScheduleFreeState))


def map_schedule_counters(fn, opt_state: optax.OptState) -> optax.OptState:
    """`opt_state` with every lr-schedule counter c replaced by fn(c, offset): offset 0 for a
    schedule's count, 1 for Schedule-Free's step_count (it starts at 1: at run step n it is n + 1)."""

    def replace(s):
        if not is_schedule_state(s):
            return s
        if isinstance(s, ScheduleFreeState):  # its inner optimizer's schedule counts too
            return s._replace(step_count=fn(s.step_count, 1),
                              base_optimizer_state=map_schedule_counters(fn, s.base_optimizer_state))
        return s._replace(count=fn(s.count, 0))

    return jax.tree.map(replace, opt_state, is_leaf=is_schedule_state)


def advance_schedules(opt_state: optax.OptState, advance: jax.Array) -> optax.OptState:
    """`opt_state` with every lr-schedule counter one step further where `advance` (traceable)."""
    return map_schedule_counters(lambda c, _: jnp.where(advance, optax.safe_int32_increment(c), c), opt_state)


def skip_nonfinite(tx: optax.GradientTransformation, max_consecutive_skips: int) -> optax.GradientTransformation:
    """optax.apply_if_finite(tx) (its state, so `total_notfinite` and checkpoints are unchanged),
    with the schedule counters advanced on the steps it skips."""
    inner = optax.apply_if_finite(tx, max_consecutive_skips)

    def update(updates, state, params=None, **extra_args):
        extra = jax.tree.leaves(extra_args)
        if extra:  # another input of the update (Sophia's Hessian estimate) not finite: the step is skipped too
            finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in extra]))
            updates = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), updates)
        updates, new = inner.update(updates, state, params, **extra_args)
        # apply_if_finite applies the update anyway once the skips in a row exceed the limit
        skipped = jnp.logical_and(~new.last_finite, new.notfinite_count <= max_consecutive_skips)
        return updates, new._replace(inner_state=advance_schedules(new.inner_state, skipped))

    return optax.GradientTransformationExtraArgs(inner.init, update)
