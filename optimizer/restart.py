"""A fresh optimizer state for a run that is already at step N (checkpoint.overwrite_optimizer).

optax counts the lr schedule's steps inside the optimizer state (`ScaleByScheduleState.count`),
so a fresh state would restart the warmup, never reach `min_lr`, and apply another lr than the
one logged (`schedule(run step)`). Moving those counters to the run's step makes the schedule
follow the run (Schedule-Free's lr clock, `step_count`, too). The moment estimates' own counts
(Adam's bias correction, Shampoo's preconditioning clock) stay at 0: their moments are fresh too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optimizer.nonfinite import map_schedule_counters


def schedules_at(opt_state: optax.OptState, step: jax.Array) -> optax.OptState:
    """`opt_state` with every lr-schedule counter set to `step` (traceable: use inside jit);
    Schedule-Free's step_count, which starts at 1, to step + 1 (optimizer/nonfinite.py)."""
    return map_schedule_counters(lambda c, offset: jnp.asarray(step + offset, c.dtype), opt_state)


def fresh_state(tx: optax.GradientTransformation, params, step: jax.Array, shardings) -> optax.OptState:
    """`tx`'s initial state for `params`, placed in `shardings`, its schedules continuing at `step`."""
    return jax.jit(lambda p, s: schedules_at(tx.init(p), s), out_shardings=shardings)(params, step)
