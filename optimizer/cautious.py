"""optimizer.cautious=true: the cautious mask (Liang et al. 2024, "Cautious Optimizers: Improving
Training with One Line of Code", arXiv:2411.16085) around any registered optimizer.

Per parameter (one leaf; a stacked (num_blocks, d_in, d_out) leaf counts as one tensor), the
components of the update direction whose sign disagrees with this step's gradient are zeroed
and the rest rescaled by 1/max(kept fraction, MIN_KEPT), so the update keeps its size on
average: u ← u·m / max(mean(m), MIN_KEPT), m = 1 where u and g agree.

Where the mask sits. The paper's C-AdamW masks the Adam direction and applies the decoupled
weight decay unmasked. Every optimizer here ends with `add_decayed_weights(weight_decay)` then
the group's lr (the package's contract, checked for every registered optimizer by
tests/test_optimizer.py), so a group's update is −lr_t·(d + weight_decay·p). The wrapper builds
the group's own transform with weight_decay=0, which gives −lr_t·d, masks that, and adds the
decay −lr_t·weight_decay·p itself (`decoupled_decay`), with the group's schedule counted like the
optimizer's own. So a new optimizer needs nothing for `optimizer.cautious=true`; one whose
`weight_decay` is not of that form (Schedule-Free's decays its z sequence, not the weights it
updates) sets `CAUTIOUS_UNSUPPORTED = "why"` on its dataclass and the knob is refused.

An optax update moves the params by u (u ≈ −lr·direction), so "agrees with the gradient" is
u·g < 0 here. The sign test compares signs, not the product, which can underflow to 0
(1e-30·1e-30 in float32). The direction includes the lr: on a step at lr 0 nothing moves and
nothing counts as kept. MIN_KEPT: the guard of the paper's current code and timm's (`mask.mean().clamp(min=1e-3)`);
it caps the rescale at 1000× where almost nothing is kept (the first release's numel/(sum + 1),
still pytorch_optimizer's, scaled a lone kept component of an n-element tensor by n/2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.arguments import known_zero
from utils.errors import ConfigError

MIN_KEPT = 1e-3


class CautiousState(NamedTuple):
    inner: Any  # the wrapped transform's state
    kept: Any  # per leaf: int32 count of the components the last update kept (0 before the first)


def mask_disagreeing(u: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(u with the components whose sign disagrees with g zeroed and the rest rescaled, the
    number kept), for one leaf."""
    agree = jnp.sign(u) * jnp.sign(g) < 0  # u moves the params: it agrees where it goes against g
    kept = jnp.sum(agree, dtype=jnp.int32)
    fraction = kept.astype(jnp.float32) / u.size
    masked = jnp.where(agree, u.astype(jnp.float32) / jnp.maximum(fraction, MIN_KEPT), 0.0)
    return masked.astype(u.dtype), kept


def cautious(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner`'s update, masked against the gradient it was computed from (the updates passed
    in: after global-norm clipping, a positive factor that changes no sign). Extra arguments of
    `update` (Sophia's `hessian_diag`) reach `inner`."""
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return CautiousState(inner.init(params), jax.tree.map(lambda _: jnp.zeros((), jnp.int32), params))

    def update_fn(grads, state, params=None, **extra_args):
        updates, inner_state = inner.update(grads, state.inner, params, **extra_args)
        flat_u, treedef = jax.tree.flatten(updates)
        pairs = [mask_disagreeing(u, g) for u, g in zip(flat_u, treedef.flatten_up_to(grads))]
        masked = treedef.unflatten([u for u, _ in pairs])
        kept = treedef.unflatten([k for _, k in pairs])
        return masked, CautiousState(inner_state, kept)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def decoupled_decay(weight_decay: float, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Adds −lr_t·weight_decay·p, lr_t = schedule(updates so far): what add_decayed_weights then
    scale_by_learning_rate add. Its counter is an optax.ScaleByScheduleState, so skipped steps
    (optimizer/nonfinite.py) and a fresh state at step N (optimizer/restart.py) move it as they
    move the optimizer's own schedule."""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decoupled_decay needs the params: pass them to update")
        step = -schedule(state.count) * weight_decay
        updates = jax.tree.map(lambda u, p: u + (step * p).astype(u.dtype), updates, params)
        return updates, optax.ScaleByScheduleState(count=optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def cautious_transform(hparams: Any, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
    """`hparams.transform(group, schedule)` with the mask on its direction and its decoupled
    weight decay (if any) added unmasked after it (see the module docstring)."""
    from optimizer import OPTIMIZERS  # the registry imports this module: at call time

    check(hparams, next((n for n, cls in OPTIMIZERS.items() if type(hparams) is cls), type(hparams).__name__))
    weight_decay = getattr(hparams, "weight_decay", 0.0)
    if weight_decay is None or known_zero(weight_decay):
        return cautious(hparams.transform(group, schedule))
    direction = dataclasses.replace(hparams, weight_decay=0.0).transform(group, schedule)
    return optax.chain(cautious(direction), decoupled_decay(weight_decay, schedule))


def check(hparams: Any, name: str) -> None:
    """optimizer.cautious=true is refused for an optimizer that declares it unsupported."""
    reason = hparams.CAUTIOUS_UNSUPPORTED
    if reason:
        raise ConfigError(f"optimizer.cautious=true is not available for optimizer.name={name}: {reason}; "
                          "set optimizer.cautious=false")
