"""Sophia-H (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer for Language
Model Pre-training", arXiv:2305.14342), from optax.contrib.scale_by_sophia.

A momentum m of the gradients divided by an EMA h of Hutchinson estimates of the Hessian
diagonal, clipped per coordinate: u = clip(m̂ / max(γ·h, eps), ±clip_threshold), then decoupled
weight decay and the lr. The clip bounds every coordinate's step by lr·clip_threshold, so where
the curvature is small or negative (γ·h ≤ eps) Sophia takes a sign step; the share of clipped
coordinates is the authors' "win rate" complement (diagnostics: clip_fraction).

The Hessian estimate is not made here. A group's transform sees only its own leaves (the others
masked by optax.multi_transform) and no objective, so a Hutchinson estimate per group would need
the loss and cost one Hessian-vector product per group. The train step (trainer/step.py) instead
makes ONE estimate z ⊙ (H z) of the whole model's loss, z Rademacher, on the steps
`hessian_due(opt_state)` says, and passes it as `tx.update(..., hessian_diag=...)`; each group
reads its own leaves (`given_hessian_diagonal`, the `hessian_diagonal_fn` optax takes). Without
it the update refuses to run (tests use tests/helpers.py's `optimizer_update`).

optax's order, kept (tests/test_parity_sophia.py checks it against optax.contrib.sophia and
pytorch_optimizer's SophiaH): the update at optimizer step t (from 0) divides by the h of the
steps before it, and h takes the estimate made at step t when t % precondition_every == 0, so
the first update divides by h = 0 (a clipped sign step of m̂) and each estimate is read from the
next step on. The paper's Algorithm 3 folds the estimate in before the same step's update, and
leaves m without bias correction; optax corrects it (m̂ = m/(1 − b1^t)), so early steps are
larger than the paper's by 1/(1 − b1^t) before the clip.

Weight decay: decoupled and times the lr (the paper's θ ← θ − η·λ·θ), optax's add_decayed_weights.
State per parameter: m and h (two param-sized arrays), as Adam's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import SophiaState
from optax.contrib._sophia import scale_by_sophia  # optax.contrib exports only sophia(), not its scale_by_

from optimizer.contract import Optimizer
from optimizer.diagnostics import array_leaves, find_states, is_masked
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError


class SophiaClipState(NamedTuple):
    sophia: SophiaState
    clipped: jax.Array  # int32: coordinates of the group the last update clipped (0 before the first)
    size: jax.Array  # int32: coordinates of the group


def given_hessian_diagonal() -> optax.GradientTransformationExtraArgs:
    """scale_by_sophia's `hessian_diagonal_fn`: the group's leaves of the `hessian_diag` the train
    step passed to `tx.update` (unmasked: optax.multi_transform forwards extra arguments whole)."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, hessian_diag=None, **extra_args):
        del params, extra_args
        if hessian_diag is None:
            raise ValueError("sophia's update reads a Hessian-diagonal estimate: pass tx.update(..., hessian_diag=...) "
                             "(the train step does; in a test, tests/helpers.py's optimizer_update)")
        # `updates` holds this group's leaves and MaskedNode where another group's are.
        own = jax.tree.map(lambda u, h: u if is_masked(u) else h.astype(u.dtype), updates, hessian_diag,
                           is_leaf=is_masked)
        return own, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_sophia_counted(**knobs) -> optax.GradientTransformationExtraArgs:
    """optax.contrib.scale_by_sophia reading the step's estimate, with the number of coordinates its
    update clipped kept in the state (the diagnostics' clip_fraction: exact, where a recomputation
    from the state after a refresh would divide by the new h, not the one the update used)."""
    inner = scale_by_sophia(hessian_diagonal_fn=given_hessian_diagonal(), **knobs)
    threshold = knobs["clip_threshold"]

    def count(tree) -> jax.Array:
        return sum((jnp.asarray(x.size, jnp.int32) for x in array_leaves(tree)), jnp.zeros([], jnp.int32))

    def init_fn(params):
        return SophiaClipState(inner.init(params), jnp.zeros([], jnp.int32), count(params))

    def update_fn(updates, state, params=None, **extra_args):
        if not array_leaves(updates):  # a group with no leaves (a tied head): optax's clip count cannot reduce
            count = optax.safe_int32_increment(state.sophia.count)  # kept in step: hessian_due reads a count
            return updates, state._replace(sophia=state.sophia._replace(count=count))
        updates, new = inner.update(updates, state.sophia, params, **extra_args)
        # optax counts |u| < clip_threshold as not clipped; after the clip a clipped u is ±clip_threshold.
        clipped = sum((jnp.sum(jnp.abs(u) >= threshold, dtype=jnp.int32) for u in array_leaves(updates)),
                      jnp.zeros([], jnp.int32))
        return updates, SophiaClipState(new, clipped, state.size)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclass(frozen=True)
class Sophia(Optimizer):
    b1: float = 0.965
    b2: float = 0.99
    eps: float = 1e-8
    gamma: float = 0.01
    clip_threshold: float = 1.0
    precondition_every: int = 10
    weight_decay: float = 0.1

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps", "gamma", "clip_threshold")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: a clipped per-coordinate step as Adam's, hidden lr x base/width

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "eps", "gamma", "clip_threshold")
        every = self.precondition_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{prefix}.precondition_every={every} must be a whole number of steps >= 1 "
                              "(the steps between Hessian estimates; the authors' 10)")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            scale_by_sophia_counted(b1=self.b1, b2=self.b2, eps=self.eps, gamma=self.gamma,
                                    clip_threshold=self.clip_threshold, update_interval=self.precondition_every),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def hessian_due(self, opt_state) -> jax.Array:
        """True on the steps whose update folds a Hessian estimate into h: scale_by_sophia's own count
        (every group's advances together; a skipped non-finite step leaves it, so the next step is due
        again) a multiple of precondition_every."""
        states = find_states(opt_state, SophiaState)
        if not states:
            raise ValueError("hessian_due: no optax.contrib SophiaState in this optimizer state")
        return states[0].count % self.precondition_every == 0

    def diagnostics(self, group: str, group_state, params) -> dict:
        """clip_fraction: the share of the group's coordinates the last update clipped to
        ±clip_threshold (0 before the first; the authors advise a "win rate", 1 − this, of 0.1-0.5);
        hessian_mean: the mean of h, the EMA of the Hessian-diagonal estimates (not bias-corrected:
        what the update multiplies by gamma). {} for a group with no leaves."""
        states = find_states(group_state, SophiaClipState)
        if not states or not array_leaves(states[0].sophia.nu):
            return {}
        state = states[0]
        nus = [nu.reshape(-1).astype(jnp.float32) for nu in array_leaves(state.sophia.nu)]
        return {"clip_fraction": state.clipped.astype(jnp.float32) / state.size.astype(jnp.float32),
                "hessian_mean": jnp.sum(jnp.stack([jnp.sum(n) for n in nus])) / state.size.astype(jnp.float32)}
