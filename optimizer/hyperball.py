"""optimizer.hyperball=true: each trained matrix kept on the sphere of its initial Frobenius norm
(Wen et al. 2026, arXiv:2606.16899; Levanter's `muonh.py` / `adamh.py`, MuonH and AdamH), around
any registered optimizer.

The reference's rule, per matrix p with update direction u from the inner optimizer:
    p' = p − lr·u·‖p‖/‖u‖,    p_new = p'·‖p‖/‖p'‖,
so every step moves a matrix by the same fraction `lr` of its norm, whatever the size of the
inner optimizer's update, and the norm never changes: the norm control weight decay gave is
replaced by the constraint (the authors' suggested lr is √(lr·weight_decay) of a tuned decayed run).

Ours, and where it differs from the reference:
  * The radius R = ‖W_0‖_F of each matrix is taken once, when the optimizer state is built, and kept
    in the state (`HyperballState.radius`), where the reference reads ‖p‖ again each step. The two
    are equal in exact arithmetic; with R kept, a step's rounding of the norm (most with bfloat16
    weights) is undone by the next projection, where re-reading ‖p‖ accumulates it as a random walk.
    A fresh state at step N (checkpoint.overwrite_optimizer) takes R from the weights it resumes
    with: their norms, which are the radii.
  * "A matrix" is each d_in×d_out matrix of a stacked leaf (the last two axes; every leading axis,
    blocks and experts, a batch axis), as Muon here orthogonalises them (optimizer/muon.py); the
    reference's stacked case takes axes 1.. together, the same for (num_blocks, d_in, d_out).
  * The groups: `hidden` and an untied `head`, the matrices both references put on the sphere
    (AdamH: every Linear; MuonH: hidden Linears by Muon, lm_head by Adam). Embeddings, biases and
    norm gains keep the inner optimizer as it is. Their lr is the relative step: under the knob a
    hyperball group's default peak lr is optimizer.lr_config.lr, not the optimizer's own group
    default (Muon's adam_lr for the head), as MuonH steps its lm_head at the Muon lr.
  * Weight decay on a hyperball group is refused (one line), not ignored: the norm is fixed, so it
    could do nothing there. An optimizer whose direction is not a step of the form −lr·d sets
    `HYPERBALL_UNSUPPORTED = "why"` on its dataclass and the knob is refused for it.

How it is built: the group's own transform (its lr schedule included) gives the update u ≈ −lr_t·d;
this stage normalises u per matrix, so the inner lr cancels, and takes lr_t from its own schedule
counter (an optax.ScaleByScheduleState, so a skipped non-finite step and a fresh state at step N
move it as they move the inner optimizer's; optimizer/nonfinite.py, optimizer/restart.py). A step
at lr 0 (warmup's first) has u = 0 and leaves the matrix where it is. A matrix of norm 0 stays 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.arguments import known_zero
from utils.errors import ConfigError

HYPERBALL_GROUPS = ("hidden", "head")


class HyperballState(NamedTuple):
    schedule: optax.ScaleByScheduleState  # the lr schedule's counter
    radius: Any  # per leaf: float32 ‖W_0‖_F of each matrix, shape (*leading axes, 1, 1)
    step_ratio: Any  # per leaf: float32 ‖W_new − W‖_F / R of each matrix at the last update (0 before it)


def matrix_axes(x) -> tuple[int, ...]:
    """The axes one matrix spans: the last two (every leading axis a batch of matrices); a leaf of
    fewer dimensions is one vector."""
    return tuple(range(max(x.ndim - 2, 0), x.ndim))


def frobenius(x_f32: jax.Array) -> jax.Array:
    """‖x‖_F per matrix (`matrix_axes`), keeping the reduced axes as 1."""
    return jnp.sqrt(jnp.sum(jnp.square(x_f32), axis=matrix_axes(x_f32), keepdims=True))


def _safe(norm: jax.Array) -> jax.Array:
    return jnp.where(norm > 0, norm, 1.0)  # a zero direction or matrix divides by 1: it stays zero


def project(u: jax.Array, p: jax.Array, radius: jax.Array, lr: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the update taking p to R·(p + lr·R·û)/‖p + lr·R·û‖, û = u/‖u‖ per matrix; ‖update‖/R per
    matrix), for one leaf. u is an optax update (it moves p by +u, so û already points downhill)."""
    u32, p32 = u.astype(jnp.float32), p.astype(jnp.float32)
    moved = p32 + (lr * radius) * (u32 / _safe(frobenius(u32)))
    new = moved * (radius / _safe(frobenius(moved)))
    delta = new - p32
    return delta.astype(u.dtype), frobenius(delta) / _safe(radius)


def hyperball(schedule: optax.Schedule) -> optax.GradientTransformation:
    """The stage after a group's transform: its update rescaled to lr_t·R per matrix and the result
    projected back onto the sphere of radius R (see the module docstring). Needs the params."""

    def init_fn(params):
        radius = jax.tree.map(lambda p: frobenius(p.astype(jnp.float32)), params)
        return HyperballState(optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)), radius,
                              jax.tree.map(jnp.zeros_like, radius))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("hyperball needs the params: pass them to update")
        lr = jnp.asarray(schedule(state.schedule.count), jnp.float32)
        flat_u, treedef = jax.tree.flatten(updates)
        pairs = [project(u, p, r, lr) for u, p, r in
                 zip(flat_u, treedef.flatten_up_to(params), treedef.flatten_up_to(state.radius))]
        counter = optax.ScaleByScheduleState(count=optax.safe_int32_increment(state.schedule.count))
        return (treedef.unflatten([d for d, _ in pairs]),
                HyperballState(counter, state.radius, treedef.unflatten([r for _, r in pairs])))

    return optax.GradientTransformation(init_fn, update_fn)


def hyperball_transform(inner: optax.GradientTransformation, schedule: optax.Schedule) -> optax.GradientTransformation:
    """`inner` (a group's transform, without weight decay) followed by the hyperball stage."""
    return optax.chain(inner, hyperball(schedule))


def check(hparams: Any, name: str, overrides: dict[str, dict[str, float]] | None = None) -> None:
    """optimizer.hyperball=true is refused for an optimizer that declares it unsupported, and with
    weight decay on a group it puts on the sphere (the norm is fixed: decay could do nothing)."""
    from optimizer.groups import group_hparams  # groups imports this module: at call time

    reason = hparams.HYPERBALL_UNSUPPORTED
    if reason:
        raise ConfigError(f"optimizer.hyperball=true is not available for optimizer.name={name}: {reason}; "
                          "set optimizer.hyperball=false")
    overrides = overrides or {}
    for group in HYPERBALL_GROUPS:
        decay = getattr(group_hparams(hparams, group, overrides), "weight_decay", 0.0)
        if decay is not None and not known_zero(decay):
            knob = (f"optimizer.groups.{group}.weight_decay" if "weight_decay" in overrides.get(group, {})
                    else "optimizer.weight_decay")
            raise ConfigError(f"{knob}={decay} with optimizer.hyperball=true: the hyperball keeps each {group} "
                              f"matrix at its initial norm, so weight decay cannot act there; set {knob}=0")
