"""The train step, whatever the model: a state, gradients through the model's loss with gradient
accumulation, the optimizer update and the step metrics, jitted with shardings and buffer
donation (the old state's buffers become the new state's). The model and its loss come from
train_jax; nothing here knows what they are.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from utils import mesh as meshlib
from utils import step_metrics


class TrainState(eqx.Module):
    model: Any  # an Equinox module
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer updates done
    key: jax.Array  # uint32[2]: dropout randomness, split once per step


def build_train_step(loss_fn: Callable, tx: optax.GradientTransformation, metrics: Sequence[step_metrics.StepMetric],
                     state_shardings, mesh, compute_dtype, use_dropout: bool) -> step_metrics.TrainStep:
    """One jitted update: gradient accumulation as a scan over micro-batches, clipping and the
    optimizer inside `tx`, metrics returned as device arrays (pulled only on logging steps).
    `loss_fn(model, tokens_BxT1, key or None, compute_dtype) -> (loss, aux)`."""
    grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)
    compute_dtype = jnp.dtype(compute_dtype)

    def train_step(state: TrainState, batch_AxBxT1: jax.Array, logging: bool):
        key, step_key = jax.random.split(state.key)
        micro_keys = jax.random.split(step_key, batch_AxBxT1.shape[0])

        def grads_of(tokens_BxT1, k):
            (_, aux), grads = grad_fn(state.model, tokens_BxT1, k if use_dropout else None, compute_dtype)
            return grads, aux

        accum = batch_AxBxT1.shape[0]
        if accum == 1:  # no loop, no zero-filled accumulator: XLA fuses the step end to end
            grads, aux = grads_of(batch_AxBxT1[0], micro_keys[0])
            aux = jax.tree.map(lambda x: x[None], aux)
        else:
            def micro(grads_sum, xs):
                grads, aux = grads_of(*xs)
                return jax.tree.map(jnp.add, grads_sum, grads), aux

            zeros = jax.tree.map(jnp.zeros_like, eqx.filter(state.model, eqx.is_array))
            grads_sum, aux = jax.lax.scan(micro, zeros, (batch_AxBxT1, micro_keys))
            grads = jax.tree.map(lambda g: g / accum, grads_sum)
        updates, opt_state = tx.update(grads, state.opt_state, eqx.filter(state.model, eqx.is_array))
        new_state = TrainState(eqx.apply_updates(state.model, updates), opt_state, state.step + 1, key)
        return new_state, step_metrics.compute(metrics, state, grads, updates, aux, logging)

    return step_metrics.compile_variants(train_step, metrics, donate_argnums=0,
                                         in_shardings=(state_shardings, meshlib.batch_sharding(mesh, 1)),
                                         out_shardings=(state_shardings, meshlib.replicated(mesh)))
