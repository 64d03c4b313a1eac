"""Optimizer diagnostics: what an optimizer knows about itself, logged as `optim/...`.

The protocol is one optional method on an optimizer's config dataclass:

    def diagnostics(self, group: str, group_state, params) -> dict[str, jax.Array]

called once per parameter group with `self` the group's own hyperparameters (its
`optimizer.groups.<group>` overrides applied, as `transform` sees them), `group_state` that
group's optax state (the `optax.multi_transform` entry, MaskedState wrapper removed: whatever
`transform(group, ...)`'s `init` returned, chains included) and `params` the whole model's
arrays (a group's leaves are where `group_state`'s trees hold arrays and not `optax.MaskedNode`).
An optimizer whose update blends in the step's own gradient (Muon's Nesterov momentum) may take a
keyword `grads`: the gradient this update took (clipped as the optimizer's chain clips it), or None
where a caller has only the state. It returns scalar arrays keyed by a short stat name; `optimizer_metrics` logs each as
`optim/<group>/<stat>`. It must be pure and jittable (it runs in the logging variant of the
jitted train step), read only the state, and return {} for a group with no leaves (a tied head).
An optimizer without the method logs only `optim/state_bytes` (and, under optimizer.cautious,
`optim/cautious_kept_fraction`, under optimizer.hyperball `optim/<group>/hyperball_*`, which every
optimizer gets).

Find a transform's state by type with `find_states` (e.g. `optax.ScaleByAdamState`), never by
its position in a chain: chains, masks and wrappers change, types do not.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optimizer.arguments import clipping
from optimizer.cautious import CautiousState
from optimizer.groups import group_hparams
from optimizer.hyperball import HyperballState, frobenius

PREFIX = "optim"


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def is_masked(x) -> bool:
    """Another group's position in a group's state tree (pass as `is_leaf` to line it up with params)."""
    return isinstance(x, optax.MaskedNode)


def find_states(tree: Any, cls: type | tuple[type, ...]) -> list:
    """Every node of `tree` that is an instance of `cls`, outermost first, in tree order (the
    state of a chain is a tuple, of multi_transform a PartitionState, of a mask a MaskedState:
    all pytrees, so this reaches any depth)."""
    nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
    return [x for x in nodes if isinstance(x, cls)]


def group_states(opt_state: Any) -> dict[str, Any]:
    """{group: that group's inner state} from the state of `optimizer.make_optimizer` (or of any
    chain holding one `optax.multi_transform`); {} when there is none."""
    partitions = find_states(opt_state, optax.MultiTransformState)
    if not partitions:
        return {}
    out = {}
    for group, state in partitions[0].inner_states.items():
        while isinstance(state, optax.MaskedState):
            state = state.inner_state
        out[group] = state
    return out


def array_leaves(tree: Any) -> list[jax.Array]:
    """The arrays of a state tree (MaskedNode positions, other groups' leaves, have none)."""
    return [x for x in jax.tree.leaves(tree) if _is_array(x)]


# Radix select over the bits of a non-negative float32 (its int32 bit pattern orders as the
# value does, once the sign bit is cleared): three histogram passes of 11 bits (bits 22-32,
# 11-21, 0-10) pin the k-th smallest exactly.
_RADIX_BITS = 11


def kth_smallest_nonneg(flat: jax.Array, k: jax.Array | int) -> jax.Array:
    """The k-th smallest (0-based) element of a 1-D float32 array of values >= 0, exactly (NaNs
    count as the largest). Three scatter-add passes in a loop: on a 2-core CPU ~30× faster than
    jnp.sort on 10M elements (the median of √v over a GPT's hidden matrices), and quick to
    compile."""
    bits = jax.lax.bitcast_convert_type(flat.astype(jnp.float32), jnp.int32) & jnp.int32(0x7FFFFFFF)
    width = _RADIX_BITS

    def pass_(i, carry):
        prefix, k = carry  # the digits found so far; k: the rank among elements with that prefix
        shift = width * (2 - i)
        digit = (bits >> shift) & ((1 << width) - 1)
        in_prefix = ((bits >> jnp.minimum(shift + width, 31)) == prefix).astype(jnp.int32)  # (no shift by 33)
        below = jax.lax.cumsum(jnp.zeros(1 << width, jnp.int32).at[digit].add(in_prefix))  # counts <= digit
        d = jnp.argmax(below > k).astype(jnp.int32)
        return (prefix << width) | d, k - jnp.where(d > 0, below[d - 1], 0)

    prefix, _ = jax.lax.fori_loop(0, 3, pass_, (jnp.int32(0), jnp.asarray(k, jnp.int32)))
    return jax.lax.bitcast_convert_type(prefix, jnp.float32)


def median_nonneg(flat: jax.Array) -> jax.Array:
    """NumPy's median (the mean of the two middle elements when the size is even) of a 1-D
    array of values >= 0, by `kth_smallest_nonneg`: no sort."""
    n = flat.shape[0]
    lo = kth_smallest_nonneg(flat, (n - 1) // 2)
    if n % 2:
        return lo
    # the next element up: lo again if it occurs more than once past the middle, else the least above it
    hi = jnp.where(jnp.sum(flat <= lo) > n // 2, lo, jnp.min(jnp.where(flat > lo, flat, jnp.inf)))
    return 0.5 * (lo + hi)


def summary(values: list[jax.Array], stats: tuple[str, ...], name: str) -> dict[str, jax.Array]:
    """`name_min`, `name_median`, `name_mean`, `name_max` (those in `stats`) over every element
    of `values` (all >= 0 when the median is asked for), taken together; {} when there are none."""
    values = [v.reshape(-1).astype(jnp.float32) for v in values if v.size]
    if not values:
        return {}
    flat = jnp.concatenate(values) if len(values) > 1 else values[0]
    fns = {"min": jnp.min, "median": median_nonneg, "mean": jnp.mean, "max": jnp.max}
    return {f"{name}_{s}": fns[s](flat) for s in stats}


def sqrt_v_stats(nus: list[jax.Array], count: jax.Array | None, b2: float | None) -> dict[str, jax.Array]:
    """min / median / max of √v̂ over a group's second moments, v̂ = v / (1 − b2^count) (Adam's
    bias correction; `b2=None`: none), i.e. the denominator the update divides by (less eps).
    Before the first update (count 0) v is all zeros and so is √v̂."""
    if b2 is not None and count is not None:
        correction = jnp.where(count > 0, 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32), 1.0)
        nus = [nu / correction for nu in nus]
    return summary([jnp.sqrt(nu.astype(jnp.float32)) for nu in nus], ("min", "median", "max"), "sqrt_v")


def adam_sqrt_v(group_state: Any, b2: float) -> dict[str, jax.Array]:
    """sqrt_v_min / sqrt_v_median / sqrt_v_max of the (first) optax.ScaleByAdamState in a group's state."""
    adam = find_states(group_state, optax.ScaleByAdamState)
    if not adam:
        return {}
    return sqrt_v_stats(array_leaves(adam[0].nu), adam[0].count, b2)


def optimizer_metrics(hparams: Any, opt_state: Any, params: Any,
                      overrides: dict[str, dict[str, float]] | None = None, grads: Any = None,
                      clip: float | None = None) -> dict[str, jax.Array]:
    """`optim/<group>/<stat>` from each group's `diagnostics`, `optim/cautious_kept_fraction`
    under optimizer.cautious and `optim/<group>/hyperball_*` under optimizer.hyperball; pure and
    jittable.

    hparams: the run's optimizer dataclass (run.optimizer.hparams); overrides: its per-group
    overrides (run.optimizer.group_overrides), so a group's stats use its own b2/epsilon;
    params: the model's arrays (eqx.filter(model, eqx.is_array)), the ones this state goes with
    (their shapes; Schedule-Free reads their values, its y); grads: the step's gradient before
    clipping (or None), handed, clipped at `clip` as make_optimizer does, to a `diagnostics` that
    takes `grads`."""
    out: dict[str, jax.Array] = {**cautious_kept_fraction(opt_state, params), **hyperball_stats(opt_state, params)}
    if hparams.diagnostics is None:
        return out
    if grads is not None and clipping(clip):
        grads = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())[0]
    for group, state in group_states(opt_state).items():
        own = group_hparams(hparams, group, overrides or {})
        takes_grads = "grads" in inspect.signature(own.diagnostics).parameters
        for stat, value in own.diagnostics(group, state, params, **({"grads": grads} if takes_grads else {})).items():
            out[f"{PREFIX}/{group}/{stat}"] = value
    return out


def cautious_kept_fraction(opt_state: Any, params: Any) -> dict[str, jax.Array]:
    """{"optim/cautious_kept_fraction": components the last update kept / components masked},
    over every group's CautiousState (optimizer/cautious.py); {} without one (cautious off).
    The counts are int32 per leaf, summed in float32 (exact up to 2^24 kept components)."""
    pairs: list = []  # (kept count, leaf size) of every masked leaf
    for state in find_states(opt_state, CautiousState):
        jax.tree.map(lambda k, p: pairs.append((k, p.size)) if _is_array(k) else None, state.kept, params,
                     is_leaf=is_masked)
    size = sum(n for _, n in pairs)
    if not size:
        return {}
    return {f"{PREFIX}/cautious_kept_fraction": sum(k.astype(jnp.float32) for k, _ in pairs) / size}


def hyperball_stats(opt_state: Any, params: Any) -> dict[str, jax.Array]:
    """Per group kept on the sphere (optimizer/hyperball.py; {} with optimizer.hyperball off), over
    its matrices: `hyperball_step_ratio_mean` / `_max`, ‖W_new − W‖_F / R of the last update (lr_t
    at most: lower where the direction had a radial part, which the projection removes), and
    `hyperball_norm_error_max`, max |‖W‖_F − R| / R of `params` (the weights after that update):
    float32 rounding, ~1e-7, when the projection holds."""
    out: dict[str, jax.Array] = {}
    for group, state in group_states(opt_state).items():
        found = find_states(state, HyperballState)
        if not found:
            continue
        radii, treedef = jax.tree.flatten(found[0].radius, is_leaf=is_masked)  # other groups' leaves: MaskedNode
        triples = [(r, s, p) for r, s, p in zip(radii, treedef.flatten_up_to(found[0].step_ratio),
                                                treedef.flatten_up_to(params)) if _is_array(r)]
        ratios = [s.reshape(-1) for _, s, _ in triples]
        errors = [(jnp.abs(frobenius(p.astype(jnp.float32)) - r) / jnp.where(r > 0, r, 1.0)).reshape(-1)
                  for r, _, p in triples]
        if not ratios:  # a group with no leaves (a tied head)
            continue
        ratio, error = jnp.concatenate(ratios), jnp.concatenate(errors)
        out.update({f"{PREFIX}/{group}/hyperball_step_ratio_mean": jnp.mean(ratio),
                    f"{PREFIX}/{group}/hyperball_step_ratio_max": jnp.max(ratio),
                    f"{PREFIX}/{group}/hyperball_norm_error_max": jnp.max(error)})
    return out


def state_bytes(opt_state: Any) -> int:
    """Bytes of every array in the optimizer state (global shapes: a replicated or sharded
    array counts once, whatever the number of devices). Host-side, from shapes and dtypes only,
    so ShapeDtypeStructs work too; non-array leaves (none in optax's states) count 0."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(opt_state) if _is_array(x)))


def state_bytes_metric(opt_state: Any) -> dict[str, int]:
    """{"optim/state_bytes": ...}: to log once, at the start of a run."""
    return {f"{PREFIX}/state_bytes": state_bytes(opt_state)}
