"""MARS-AdamW (Yuan et al. 2024, "MARS: Unleashing the Power of Variance Reduction for Training
Large Models", arXiv:2411.10438): AdamW on a variance-reduced gradient.

Per matrix, with g the gradient and g' the previous update's (the paper's approximate variant,
`is_approx=True` in the authors' code AGI-Arena/MARS optimizers/mars.py, the one they train with):

    c  = g + gamma·b1/(1-b1)·(g - g')        (the scaled gradient correction; g' = 0 on update 1)
    c  = c / ‖c‖  where ‖c‖ > 1              (Frobenius norm, per matrix)
    m <- b1·m + (1-b1)·c,   v <- b2·v + (1-b2)·c²
    direction = m̂ / (√v̂ + eps)              (m̂, v̂ bias-corrected)

Decoupled weight decay and the lr are chained after (`MARS.transform`), as the authors' update
-lr·(wd·p + direction). "Per matrix": a stacked (num_blocks, d_in, d_out) leaf is num_blocks
matrices, each with its own norm, as the per-layer reference sees them. The `scalar` group
(biases, norm gains) runs AdamW at its own lr and betas (`adam_lr`, `adam_b1`, `adam_b2`: the
reference's lr_1d and betas_1d, optimize_1d=false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v, array_leaves, find_states
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from optimizer.trees import map_unzipped


class MARSState(NamedTuple):
    count: jax.Array  # int32 scalar: updates done
    mu: Any  # first moment of c, param-shaped
    nu: Any  # second moment of c, param-shaped
    last_grad: Any  # the previous update's gradient, param-shaped (zeros before the first)
    correction_norm: Any  # per matrix (the leaf's leading axes): ‖gamma·b1/(1-b1)·(g - g')‖ of the last update
    c_norm: Any  # per matrix: ‖c‖ of the last update before clipping (clipped where > 1)


def matrix_axes(x) -> tuple[int, ...]:
    """The axes one matrix spans: the last two (leading axes are a stack), all of a vector."""
    return tuple(range(max(x.ndim - 2, 0), x.ndim))


def scale_by_mars(b1: float = 0.95, b2: float = 0.99, gamma: float = 0.025, eps: float = 1e-8
                  ) -> optax.GradientTransformation:
    """The MARS-AdamW direction (bias-corrected, no learning rate); see the module docstring."""
    scale = gamma * b1 / (1.0 - b1)

    def init_fn(params):
        def per_matrix(x):
            return jnp.zeros(x.shape[: x.ndim - len(matrix_axes(x))], jnp.float32)

        def zeros():
            return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)

        return MARSState(jnp.zeros((), jnp.int32), zeros(), zeros(), zeros(), jax.tree.map(per_matrix, params),
                         jax.tree.map(per_matrix, params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t

        def leaf(g_in, mu, nu, last):
            g = g_in.astype(jnp.float32)
            correction = scale * (g - last)
            c = g + correction
            axes = matrix_axes(g)
            c_norm = jnp.sqrt(jnp.sum(c * c, axis=axes, keepdims=True))
            c = c / jnp.maximum(c_norm, 1.0)
            mu = b1 * mu + (1.0 - b1) * c
            nu = b2 * nu + (1.0 - b2) * c * c
            out = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
            correction_norm = jnp.sqrt(jnp.sum(correction * correction, axis=axes))
            return out.astype(g_in.dtype), mu, nu, g, correction_norm, jnp.squeeze(c_norm, axes)

        out, mu, nu, last, corr, c_norm = map_unzipped(leaf, 6, updates, state.mu, state.nu, state.last_grad)
        return out, MARSState(count, mu, nu, last, corr, c_norm)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class MARS(Optimizer):
    """MARS-AdamW on the matrices (hidden, embed, head) -> decoupled weight decay -> lr; AdamW on `scalar`."""

    b1: float = 0.95
    b2: float = 0.99
    gamma: float = 0.025
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_lr: float = 3e-3  # peak lr of the scalar group (the reference's lr_1d)
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8  # the scalar group's AdamW eps (before issue 36 it shared `eps`)

    MARS_KNOBS = ("lr", "weight_decay", "b1", "b2", "gamma", "eps")
    ADAM_KNOBS = ("lr", "weight_decay", "adam_b1", "adam_b2", "adam_eps")
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type, hidden lr x base/width (optimizer/mup.py)

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """`scalar` runs AdamW (adam_b1/adam_b2/adam_eps, no gamma), the others MARS (b1/b2/eps, gamma)."""
        return self.ADAM_KNOBS if group == "scalar" else self.MARS_KNOBS

    def group_knob_hint(self, group: str, knob: str) -> str:
        if group == "scalar":
            return ("the scalar group (biases, norm gains) runs AdamW under MARS; set adam_b1, adam_b2 or adam_eps "
                    "instead")
        return f"the {group} group runs MARS, not AdamW; set optimizer.groups.{group}.b1 or b2 instead"

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2", "adam_b1", "adam_b2")
        check_non_negative(prefix, self, "weight_decay", "gamma")
        check_positive(prefix, self, "eps", "adam_eps")
        check_positive(prefix, self, "adam_lr")

    def default_group_lr(self, group: str, base_lr: float) -> float:
        return self.adam_lr if group == "scalar" else base_lr

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if group == "scalar":
            return optax.adamw(schedule, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                               weight_decay=self.weight_decay)
        return optax.chain(
            scale_by_mars(b1=self.b1, b2=self.b2, gamma=self.gamma, eps=self.eps),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """MARS groups, over every matrix of the group at the last update: correction_norm_mean /
        correction_norm_max (‖gamma·b1/(1-b1)·(g - g')‖, the variance-reduction term; on update 1
        g' = 0) and clipped_frac (the fraction of matrices whose c was rescaled to norm 1). Scalar
        group (AdamW): sqrt_v_min / _median / _max. Read from the state: no extra pass."""
        if group == "scalar":
            return adam_sqrt_v(group_state, self.adam_b2)
        states = find_states(group_state, MARSState)
        corr = [x.reshape(-1) for x in array_leaves(states[0].correction_norm)] if states else []
        if not corr:
            return {}
        corr = jnp.concatenate(corr)
        c_norm = jnp.concatenate([x.reshape(-1) for x in array_leaves(states[0].c_norm)])
        return {"correction_norm_mean": jnp.mean(corr), "correction_norm_max": jnp.max(corr),
                "clipped_frac": jnp.mean((c_norm > 1.0).astype(jnp.float32))}
