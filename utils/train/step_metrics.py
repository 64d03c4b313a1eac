"""Metrics computed inside the jitted train step, from what the step already has.

A step metric is a pure function `(state, grads, updates, aux) -> dict[str, Array]`: `state` is
the TrainState the step started from, `grads` the averaged gradients, `updates` what the
optimizer adds to the weights, `aux` the loss's auxiliary outputs stacked over micro-batches
(`aux["loss"]` is loss_A). Values stay on the device; the host pulls them on logging steps.

A metric marked `after_update` gets the TrainState the step produced as `state` instead: its
`opt_state` is the one this update was computed with and left behind (Adam's bias-corrected
second moment is the denominator this update divided by, Shampoo's clock counts this update),
its `model` the new weights and its `step` one more. What describes the step being taken from
the state it started from (`train/lr`: the schedule at the step's own index) stays a plain metric.

A metric marked `logging_only` costs nothing on other steps: the step is compiled in two
variants and the loop calls the one that computes it only on logging steps (a second
compilation, so it is only made when some metric asks for it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import optax

MetricFn = Callable[[Any, Any, Any, dict], dict[str, jax.Array]]


@dataclass(frozen=True)
class StepMetric:
    fn: MetricFn
    logging_only: bool = False
    after_update: bool = False  # fn's `state` is the state the step produced, not the one it started from


def all_finite(tree) -> jax.Array:
    """One boolean: every element of every leaf is finite (apply_if_finite's own test)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def loss(state, grads, updates, aux) -> dict[str, jax.Array]:
    return {"train/loss": aux["loss"].mean()}


UPDATE_NORM = "train/update_norm"


def norms(state, grads, updates, aux) -> dict[str, jax.Array]:
    """Global L2 norms of the gradient (before clipping) and of the update this step applies,
    Δ(n+1) (trainit's `update/norm` is the previous one, Δ(n): utils/train/aux_state.py). The update
    norm also vouches, before every save, that the weights a step produced are finite
    (utils.train.hooks.check_finite)."""
    return {"train/grad_norm": optax.tree.norm(grads), UPDATE_NORM: optax.tree.norm(updates)}


def learning_rates(schedule: optax.Schedule, by_group: dict[str, optax.Schedule], groups: Iterable[str]) -> MetricFn:
    """train/lr (the run's schedule) and train/lr/<group> for each group the model has (a tied
    head has no group of its own), at the step being taken."""
    present = {g: by_group[g] for g in sorted(set(groups))}

    def lrs(state, grads, updates, aux) -> dict[str, jax.Array]:
        return {"train/lr": schedule(state.step), **{f"train/lr/{g}": s(state.step) for g, s in present.items()}}

    return lrs


def skipped_steps(state, grads, updates, aux) -> dict[str, jax.Array]:
    """Steps whose non-finite gradient optax.apply_if_finite skipped, this one included."""
    return {"train/skipped_steps": state.opt_state.total_notfinite + (~all_finite(grads)).astype(jnp.int32)}


def defaults(schedule: optax.Schedule, by_group: dict[str, optax.Schedule], groups: Iterable[str],
             skip_nonfinite: bool = False) -> list[StepMetric]:
    """What every run logs: train/loss, the norms, the learning rates (and the skipped steps)."""
    metrics = [StepMetric(loss), StepMetric(norms), StepMetric(learning_rates(schedule, by_group, groups))]
    return metrics + ([StepMetric(skipped_steps)] if skip_nonfinite else [])


def compute(metrics: Sequence[StepMetric], state, new_state, grads, updates, aux, logging: bool
            ) -> dict[str, jax.Array]:
    """Every metric due (all when `logging`, else those not logging-only), each given `state` (the
    step's start) or, marked `after_update`, `new_state` (what the step produced)."""
    out: dict[str, jax.Array] = {}
    for metric in metrics:
        if logging or not metric.logging_only:
            out.update(metric.fn(new_state if metric.after_update else state, grads, updates, aux))
    return out


@dataclass(frozen=True)
class TrainStep:
    """A compiled step in two variants: `logging` also computes the metrics marked logging-only.
    They are one function when no metric is, so nothing compiles twice."""

    plain: Callable
    logging: Callable

    def __call__(self, state, batch, logging: bool = True):
        return (self.logging if logging else self.plain)(state, batch)

    def compiled(self) -> int:
        """Programs compiled so far: grows on the call that traced and compiled a variant."""
        variants = [self.logging] if self.plain is self.logging else [self.plain, self.logging]
        return sum(f._cache_size() if hasattr(f, "_cache_size") else 0 for f in variants)


def compile_variants(step: Callable, metrics: Sequence[StepMetric], split: bool = False, **jit_kwargs) -> TrainStep:
    """`step(state, batch, logging)` jitted once per variant it needs (`logging` is static); `split`
    asks for both variants whatever the metrics (the aux-state hook computes values only when logging)."""
    logging_step = jax.jit(functools.partial(step, logging=True), **jit_kwargs)
    if not split and not any(m.logging_only for m in metrics):
        return TrainStep(logging_step, logging_step)
    return TrainStep(jax.jit(functools.partial(step, logging=False), **jit_kwargs), logging_step)
