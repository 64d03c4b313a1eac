"""Prodigy (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive Parameter-Free
Learner", arXiv:2306.06101), from optax.contrib.prodigy: Adam whose step size d·lr is learned.

d estimates the distance from the initial weights x_0 to a solution, from how the gradients line
up with the path taken so far: d̂ = Σ_k λ_k·⟨g_k, x_0 − x_k⟩ / ‖Σ_k λ_k·g_k‖₁ (EMAs at `beta3`,
null = √b2, weighted by d_k·lr_k), and d = max(d, d̂), starting at `d0`. The update is
−d·lr_t·c_t·(m/(√v + d·eps) + weight_decay·x), m and v Adam's moments of d·g, c_t Adam's bias
correction √(1 − b2^t)/(1 − b1^t). So `lr` is a multiplier of the learned step, 1 at its peak
(the authors' advice), and a schedule scales it as usual.

What is ours around optax's function, and why:
  * The lr schedule is read from an `optax.ScaleByScheduleState` counter of its own, as every
    optimizer's here, not from Prodigy's moment count: a skipped non-finite step
    (optimizer/nonfinite.py) and a fresh state at step N (optimizer/restart.py) move the schedule
    with the run while the moments and their bias correction count the gradients actually taken.
  * d̂ is 0/0 while every term of its denominator is zero (all gradients so far zero, or every lr
    so far zero without `safeguard_warmup`): optax then sets d to NaN. The authors' code and
    pytorch_optimizer return before the parameter update; so does this one (no update, d kept),
    the moments advancing as theirs do.

Differences from the authors' code, by design (tests/test_parity_adopt_prodigy_normuon.py sets
the reference the same way): optax always applies Adam's bias correction c_t, which the authors'
code leaves off by default (`use_bias_correction=False`); and d is estimated per parameter group
(hidden, embed, head, scalar: each group is its own optax transform), where the authors' code
shares one d over all of an optimizer's parameter groups.

Weight decay: decoupled, times the step d·lr_t·c_t as in the authors' code (AdamW's is times its
step lr_t), not times lr_t alone: lr_t is a multiplier near 1 here, and lr_t·weight_decay would
shrink the weights by 10% a step at weight_decay 0.1. So the cautious mask, which splits off a
decay of −lr_t·weight_decay·x (optimizer/cautious.py), is refused.

State per parameter: m, v, the EMA of d·lr·g the denominator sums, and x_0: four param-sized arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import ProdigyState

from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states
from optimizer.groups import check_non_negative, check_positive, check_unit_interval


class ScheduledProdigyState(NamedTuple):
    schedule: optax.ScaleByScheduleState  # the lr schedule's counter (advanced on skipped steps)
    prodigy: ProdigyState


def prodigy(schedule: optax.Schedule, b1: float, b2: float, beta3: float | None, eps: float, d0: float,
            d_coef: float, weight_decay: float, safeguard_warmup: bool) -> optax.GradientTransformation:
    """optax.contrib.prodigy at lr schedule(its own counter), with no update while d̂ is 0/0 (see the
    module docstring). Needs the params."""

    def build(lr) -> optax.GradientTransformation:
        return optax.contrib.prodigy(lr, betas=(b1, b2), beta3=beta3, eps=eps, estim_lr0=d0, estim_lr_coef=d_coef,
                                     weight_decay=weight_decay, safeguard_warmup=safeguard_warmup)

    def init_fn(params):
        return ScheduledProdigyState(optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)),
                                     build(1.0).init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("prodigy needs the params: pass them to update")
        inner = build(schedule(state.schedule.count))
        new_updates, new = inner.update(updates, state.prodigy, params)
        leaves = jax.tree.leaves(new.grad_sum)
        denominator = sum((jnp.sum(jnp.abs(s)) for s in leaves), jnp.zeros([], jnp.float32))
        defined = denominator > 0  # d̂'s denominator, as optax sums it
        new_updates = jax.tree.map(lambda u: jnp.where(defined, u, jnp.zeros_like(u)), new_updates)
        new = new._replace(estim_lr=jnp.where(defined, new.estim_lr, state.prodigy.estim_lr))
        count = optax.ScaleByScheduleState(count=optax.safe_int32_increment(state.schedule.count))
        return new_updates, ScheduledProdigyState(count, new)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class Prodigy(Optimizer):
    b1: float = 0.9
    b2: float = 0.999
    b3: float | None = None  # the d estimate's EMAs (optax's beta3); None: √b2
    eps: float = 1e-8
    d0: float = 1e-6
    d_coef: float = 1.0
    safeguard_warmup: bool = False
    weight_decay: float = 0.0

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "b3", "eps", "d0", "d_coef")
    CAUTIOUS_UNSUPPORTED = ("Prodigy's weight decay is times its learned step d·lr, not the lr, so the mask cannot "
                            "split it off the direction")
    # optimizer.hyperball normalises each update to lr·‖W‖: the step size d·lr Prodigy learns would be discarded.
    HYPERBALL_UNSUPPORTED = "the hyperball fixes each step at lr·‖W‖, discarding the step size d·lr Prodigy learns"

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2", "b3")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "eps", "d0", "d_coef")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return prodigy(schedule, self.b1, self.b2, self.b3, self.eps, self.d0, self.d_coef, self.weight_decay,
                       self.safeguard_warmup)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """d: the group's learned step size (the distance estimate; `d0` before it grows), the one
        the next update multiplies lr_t by; {} for a group with no leaves."""
        states = find_states(group_state, ProdigyState)
        if not states or not array_leaves(states[0].exp_avg):
            return {}
        return {"d": jnp.asarray(states[0].estim_lr, jnp.float32)}
