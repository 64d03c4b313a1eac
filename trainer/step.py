"""The train step, whatever the model: a state, gradients through the model's loss with gradient
accumulation, the optimizer update and the step metrics (trainer/step_metrics.py: stateful
ones, like the aux-state hook, keep their state in the TrainState), jitted with shardings and
buffer donation (the old state's buffers become the new state's). The model, its loss and the
metrics come from train_jax; nothing here knows what they are.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from optimizer import arguments
from trainer import qk_clip, step_metrics
from utils.parallel import mesh as meshlib


class TrainState(eqx.Module):
    model: Any  # an Equinox module
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer updates done
    key: jax.Array  # uint32[2]: dropout randomness, split once per step
    metric_states: dict = eqx.field(default_factory=dict)  # {name: state} of the stateful step metrics
    loss_scale: Any = None  # float16 compute: a LossScale (trainer/loss_scale.py); else None, no scaling


def initial_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(the model's init key, the training key) of a run's random_seed: the run draws its weights from
    the first, and whatever rebuilds them (a LoRA base saved by reference) draws the same."""
    model_key, train_key = jax.random.split(jax.random.PRNGKey(seed))
    return model_key, train_key


def num_micro_batches(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def with_loss_norm(batch):
    """A masked batch gains `loss_norm` (one per micro-batch): its masked-in target count over the
    number of micro-batches, so each micro-batch's masked loss sum divided by it, averaged over
    micro-batches, is the exact mean over every masked-in target of the step (not a mean of
    per-micro-batch means, which would weigh a short chat reply like a long one)."""
    if not isinstance(batch, dict) or "loss_mask" not in batch:
        return batch
    accum = num_micro_batches(batch)
    norm = jnp.maximum(batch["loss_mask"].sum(), 1.0) / accum
    return {**batch, "loss_norm": jnp.full((accum,), norm, jnp.float32)}


def step_keys(key: jax.Array, accum: int) -> tuple[jax.Array, jax.Array]:
    """(the next state's key, one dropout key per micro-batch) from a state's key: every
    micro-batch gets its own, and x(n-1) is evaluated with the same ones (trainer/aux_state.py)."""
    key, step_key = jax.random.split(key)
    return key, jax.random.split(step_key, accum)


def over_micro_batches(fn: Callable, batch_AxBxT1, keys_A: jax.Array):
    """(mean over micro-batches of fn's first output, fn's second output stacked): gradient
    accumulation as a scan over the batch's leading axis (the batch: a token array or a dict of
    arrays). With one micro-batch there is no loop and no zero-filled accumulator, so XLA fuses
    the step end to end."""
    accum = num_micro_batches(batch_AxBxT1)
    if accum == 1:
        out, aux = fn(jax.tree.map(lambda x: x[0], batch_AxBxT1), keys_A[0])
        return out, jax.tree.map(lambda x: x[None], aux)

    def micro(total, xs):
        out, aux = fn(*xs)
        return jax.tree.map(jnp.add, total, out), aux

    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], batch_AxBxT1), keys_A[0])[0]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, aux = jax.lax.scan(micro, zeros, (batch_AxBxT1, keys_A))
    return jax.tree.map(lambda t: t / accum, total), aux


# fold_in data of the key the Hutchinson probes z are drawn from (a stream of its own: the dropout keys stay)
HESSIAN_STREAM = 0x48657373


def hutchinson_diagonal(grad_fn: Callable, params, key: jax.Array):
    """z ⊙ (H z), z Rademacher (one key per leaf from `key`), H the Hessian of the loss whose
    gradient is `grad_fn(params)`: an unbiased estimate of H's diagonal (E[z_i (Hz)_i] = H_ii, as
    E[z_i z_j] = δ_ij). H z is the forward-mode derivative of the gradient along z (jax.jvp), one
    Hessian-vector product for the whole model. `params`: the inexact arrays (others None)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    z = treedef.unflatten([jax.random.rademacher(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    hz = jax.jvp(grad_fn, (params,), (z,))[1]
    return jax.tree.map(lambda a, b: a * b.astype(a.dtype), z, hz)


def build_train_step(loss_fn: Callable, tx: optax.GradientTransformation, metrics: Sequence[step_metrics.StepMetric],
                     state_shardings, mesh, compute_dtype, use_dropout: bool,
                     knobs: dict | None = None, recipe: Callable | None = None,
                     qk_clip_tau: float | None = None,
                     hessian_due: Callable | None = None) -> step_metrics.TrainStep:
    """One jitted update: gradient accumulation as a scan over micro-batches, clipping and the
    optimizer inside `tx`, every step metric updated (its state carried in `metric_states`),
    metrics returned as device arrays (pulled only on logging steps). `loss_fn(model, batch_BxT1,
    key or None, compute_dtype) -> (loss, aux)`, where a batch is a token array or a dict of
    arrays (see `with_loss_norm`). A state with a `loss_scale` (float16 compute) has its loss scaled
    before the gradient and the gradient unscaled after, and the scale adjusted to whether it was
    finite (trainer/loss_scale.py).

    With `knobs` (optimizer/arguments.py's values: Python floats) and `recipe(knobs) -> (tx,
    metrics)`, those numbers are the step's third argument, float32 arrays bound to the returned
    TrainStep, and the step rebuilds `tx` and `metrics` from them while it is traced: runs that
    differ only in them (lr, schedule, budget, weight decay...) share one program. `tx` and
    `metrics` are then recipe(knobs) (the optimizer state's layout, the metrics' names and states).
    Without them, every number is a constant of the program, as a test's own tx needs.

    `qk_clip_tau` (optimizer.qk_clip_tau; then `loss_fn`'s aux must hold "max_logit", as
    models.train_loss(..., max_logits=True) makes it): the new weights' attention heads whose largest
    logit this step passed it are rescaled after the update (trainer/qk_clip.py), and the step's
    metrics gain optim/qk_clip/*. The metrics read the rescaled weights; `updates` stay the optimizer's.

    `hessian_due(opt_state)` (the optimizer's contract member, optimizer/contract.py; None or
    returning None: nothing of this is traced): where it is true, one Hutchinson estimate of this
    step's loss (`hutchinson_diagonal`) is passed as `tx.update(..., hessian_diag=...)`, under
    lax.cond so other steps pay nothing but zeros. Its z come from the state's key (fold_in
    HESSIAN_STREAM): deterministic, so a resumed run draws the same. With gradient accumulation the
    Hessian-vector product runs over the same micro-batches with the same dropout keys, the
    derivative of the very mean gradient the update takes: the estimate is of the objective being
    descended, and its cost (about two gradients' worth, once per interval) stays a fixed share."""
    grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)
    compute_dtype = jnp.dtype(compute_dtype)
    step_metrics.stateful(metrics)  # unique state names, checked once here

    def train_step(state: TrainState, batch_AxBxT1: jax.Array, args, logging: bool):
        step_tx, step_metric_list = (tx, metrics) if recipe is None else recipe(args)
        batch_AxBxT1 = with_loss_norm(batch_AxBxT1)
        key, micro_keys = step_keys(state.key, num_micro_batches(batch_AxBxT1))
        scaler = state.loss_scale  # static: None unless float16 compute
        value_and_grad = grad_fn if scaler is None else eqx.filter_value_and_grad(scaler.scaled(loss_fn), has_aux=True)

        def grads_at(model):
            def fn(tokens_BxT1, k):
                (_, aux), grads = value_and_grad(model, tokens_BxT1, k if use_dropout else None, compute_dtype)
                return grads, aux
            return fn

        def mean_grads(model):
            """(this batch's gradient at `model`, averaged over micro-batches and unscaled; aux stacked)."""
            grads, aux = over_micro_batches(grads_at(model), batch_AxBxT1, micro_keys)
            return (grads if scaler is None else scaler.unscale(grads)), aux

        def loss_at(model, with_grads: bool):
            """This batch at `model`, with this step's dropout keys: (mean loss, mean grads or None)."""
            if with_grads:
                grads, aux = mean_grads(model)
                return aux["loss"].mean(), grads

            def fn(tokens_BxT1, k):
                return (), loss_fn(model, tokens_BxT1, k if use_dropout else None, compute_dtype)[1]
            return over_micro_batches(fn, batch_AxBxT1, micro_keys)[1]["loss"].mean(), None

        grads, aux = mean_grads(state.model)
        params = eqx.filter(state.model, eqx.is_array)
        due = None if hessian_due is None else hessian_due(state.opt_state)
        extra = {} if due is None else {"hessian_diag": hessian_diag(state, due, mean_grads, grads)}
        # A non-finite gradient (under float16: an overflow) is skipped inside `tx` (optimizer/nonfinite.py).
        updates, opt_state = step_tx.update(grads, state.opt_state, params, **extra)
        new_model, clip_metrics = eqx.apply_updates(state.model, updates), {}
        if qk_clip_tau is not None:
            new_model, clip_metrics = qk_clip.clip(new_model, qk_clip.step_max_logits(aux), qk_clip_tau)
        new_state = TrainState(new_model, opt_state, state.step + 1, key, state.metric_states,
                               None if scaler is None else scaler.adjust(step_metrics.all_finite(grads)))
        inputs = step_metrics.StepInputs(state, new_state, grads, updates, aux, loss_at, batch_AxBxT1)
        metric_states, out = step_metrics.compute(step_metric_list, inputs, logging)
        return eqx.tree_at(lambda s: s.metric_states, new_state, metric_states), {**out, **clip_metrics}

    def hessian_diag(state: TrainState, due: jax.Array, mean_grads: Callable, grads):
        """The Hutchinson estimate of this step's loss where `due`, zeros (like `grads`) elsewhere."""
        inexact, static = eqx.partition(state.model, eqx.is_inexact_array)

        def estimate():
            def grad_fn(p):
                return mean_grads(eqx.combine(p, static))[0]
            return hutchinson_diagonal(grad_fn, inexact, jax.random.fold_in(state.key, HESSIAN_STREAM))

        return jax.lax.cond(due, estimate, lambda: jax.tree.map(jnp.zeros_like, grads))

    replicated = meshlib.replicated(mesh)
    args = None if recipe is None else arguments.as_arguments(knobs)
    return step_metrics.compile_variants(train_step, metrics, args=args, donate_argnums=0,
                                         in_shardings=(state_shardings, meshlib.batch_sharding(mesh, 1), replicated),
                                         out_shardings=(state_shardings, replicated))
