"""The aux-state hook: training diagnostics updated inside the jitted step, as trainit's
`update_aux_state` computes them, under the same metric names.

Notation (the step that starts from parameters x_n): z_n its batch, g_n = ∇f(x_n, z_n) the
averaged gradient before clipping, Δ_n = x_n − x_{n−1} the previous step's update and Δ_{n+1}
the update this step applies, ⟨·,·⟩ the inner product over all parameters, cos the normalised
one (0 when either norm is 0). The buffers x_{n−1}, g_{n−1} and Σ g_{1..n−1} live in the train
state (`AuxState`), shard like the parameters (utils.parallel.mesh gives every leaf of one shape the same
layout) and are saved in checkpoints, so a resumed run's diagnostics continue exactly.

Why the split between every step and logging steps: the `_sum` metrics and the buffers must be
updated at every step (a running sum over every step), so they are cheap, fused reductions; all
other values (norms, cosines) are computed only in the train step's logging variant.

A step whose gradient is not finite is counted (`grads/inf_grads`) and leaves every buffer
(x_{n−1} too, as trainit keeps its previous parameters on a rejected step) and the sums as they
were, so one bad batch skipped by `train.skip_nonfinite` does not poison every later cosine, and
the next finite step's Δ is the last update applied, not 0.

`update/norm`, `update/norm_l1`, `update/norm_inf` are trainit's `full_log` norms of Δ_n = x_n −
x_{n−1} (the previous step's update, so they need `store_last_params`; without it they are not
logged). The update this step applies, Δ_{n+1}, is `train/update_norm` (trainer/step_metrics.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from models.lora import FROZEN_GROUP
from trainer.step_metrics import FnMetric, StepInputs
from utils.logging.aux_flags import AuxConfig

F32 = jnp.float32


class AuxState(eqx.Module):
    last_params: Any  # x(n-1), or None without store_last_params
    last_grads: Any  # g(n-1), or None
    past_grads: Any  # sum of g(1..n-1), or None
    sums: dict  # running sums over every step, float32 scalars
    inf_grads: jax.Array  # int32: steps whose gradient was not finite


# ----------------------------------------------------------------------------- tree arithmetic, in float32


_REDUCTIONS = {"sum": (jax.lax.add, 0.0), "max": (jax.lax.max, -math.inf), "min": (jax.lax.min, math.inf)}
LeafStat = tuple[str, Callable[[dict[str, jax.Array]], jax.Array]]  # ("sum" | "max" | "min", leaf values -> array)


def leafwise(stats: dict[str, LeafStat], trees: dict[str, Any]) -> dict[str, jax.Array]:
    """Whole-tree reductions, computed together: {name: the reduction `op` over every element of
    every leaf of fn(leaf)} for `stats` {name: (op, fn)}; fn gets one leaf of each of `trees` (trees
    of one structure) as {tree name: that leaf in float32} and returns an array of the leaf's shape.

    Why together: every stat of one leaf is one variadic reduction, so one XLA kernel that reads
    the leaf's arrays once. One reduction per stat and leaf (optax.tree.norm, optax.tree.vdot) made
    the diagnostics ~15 kernels per leaf: a third of the train step's compile time on a CPU
    (issue 25) and as many passes over memory. The values are the same sums, rounded in another
    order (float32 summation error, as before)."""
    names = list(stats)
    ops = [_REDUCTIONS[stats[name][0]] for name in names]

    def combine(acc, x):
        return tuple(op(a, b) for (op, _), a, b in zip(ops, acc, x))

    per_leaf = []
    for leaves in zip(*(jax.tree.leaves(tree) for tree in trees.values()), strict=True):
        leaf = {k: v.astype(F32) for k, v in zip(trees, leaves)}
        operands = tuple(jnp.broadcast_to(stats[name][1](leaf), leaves[0].shape).astype(F32) for name in names)
        inits = tuple(jnp.asarray(init, F32) for _, init in ops)
        per_leaf.append(jax.lax.reduce(operands, inits, combine, tuple(range(len(leaves[0].shape)))))
    return {name: functools.reduce(op, [r[i] for r in per_leaf]) for i, (name, (op, _)) in enumerate(zip(names, ops))}


def cosine(dot: jax.Array, norm_a: jax.Array, norm_b: jax.Array) -> jax.Array:
    """dot / (|a| |b|), and 0 when either vector is 0 (the first step's Δ, a zero buffer)."""
    den = norm_a * norm_b
    return jnp.where(den > 0, dot / jnp.where(den > 0, den, 1.0), 0.0)


# ----------------------------------------------------------------------------- the hook


def init(cfg: AuxConfig, params) -> AuxState | None:
    """The buffers at step 0: x(-1) := x(0), so the first Δ is 0 and its cosines are 0."""
    if not cfg.on:
        return None
    zeros = lambda: optax.tree.zeros_like(params)
    return AuxState(last_params=jax.tree.map(jnp.copy, params) if cfg.store_last_params else None,
                    last_grads=zeros() if cfg.store_last_grads else None,
                    past_grads=zeros() if cfg.store_past_grads else None,
                    sums={name: jnp.zeros((), F32) for name in cfg.sum_names},
                    inf_grads=jnp.zeros((), jnp.int32))


@dataclass(frozen=True)
class LastPoint:
    """This step's batch evaluated at x(n-1): the loss, and the gradient g'(n-1) when asked for."""

    loss: jax.Array
    grads: Any = None


def update(cfg: AuxConfig, aux: AuxState, params, grads, updates, loss: jax.Array, last: LastPoint | None,
           logging: bool) -> tuple[AuxState, dict[str, jax.Array]]:
    """(the next AuxState, metrics): the `_sum`s and buffers at every step, every other value only
    when `logging`. `params` is x_n, `grads` g_n, `updates` Δ(n+1), `loss` f(x_n, z_n). A step
    whose gradient is not finite leaves the buffers and sums as they were. Every inner product and
    norm over the parameters is one `leafwise` pass (in float32)."""
    trees = {"x": params, "g": grads, "u": updates}
    delta = lambda v: v["x"] - v["x1"]  # Δ(n) = x(n) - x(n-1)
    stats: dict[str, LeafStat] = {"finite": ("min", lambda v: jnp.isfinite(v["g"]))}

    def norms(name: str, fn: Callable) -> None:  # the squared L2 norm, the L1 norm and max |.| of fn
        stats[name + "^2"] = ("sum", lambda v: jnp.square(fn(v)))
        stats[name + "_l1"] = ("sum", lambda v: jnp.abs(fn(v)))
        stats[name + "_inf"] = ("max", lambda v: jnp.abs(fn(v)))

    def dot(name: str, a: str, b: Callable) -> None:
        stats[name] = ("sum", lambda v: v[a] * b(v))

    if cfg.store_last_params:
        trees["x1"] = aux.last_params
        dot("<g, d>", "g", delta)
    if cfg.store_last_grads:
        trees["g1"] = aux.last_grads
        if cfg.store_last_params:
            dot("<g1, d>", "g1", delta)
    if cfg.store_past_grads:
        trees["gs"] = aux.past_grads
    if logging:
        norms("x", lambda v: v["x"])
        norms("g", lambda v: v["g"])
        if cfg.store_last_params:
            norms("d", delta)
            dot("<x, x1>", "x", lambda v: v["x1"])
            dot("x1^2", "x1", lambda v: v["x1"])
            dot("<u, d>", "u", delta)
            dot("u^2", "u", lambda v: v["u"])
        if cfg.store_last_grads:
            dot("<g, g1>", "g", lambda v: v["g1"])
            dot("g1^2", "g1", lambda v: v["g1"])
        if cfg.store_past_grads:
            dot("<g, gs>", "g", lambda v: v["gs"])
            dot("gs^2", "gs", lambda v: v["gs"])
        if last is not None and last.grads is not None:
            trees["g'"] = last.grads
            dot("<g, g'>", "g", lambda v: v["g'"])
            dot("g'^2", "g'", lambda v: v["g'"])
            stats["<g-g', d>"] = ("sum", lambda v: (v["g"] - v["g'"]) * delta(v))
    r = leafwise(stats, trees)
    norm = lambda name: jnp.sqrt(r[name + "^2"])

    finite = r["finite"] > 0
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    out: dict[str, jax.Array] = {}
    sums = dict(aux.sums)

    def add_sum(name: str, value: jax.Array) -> None:
        sums[name + "_sum"] = jnp.where(finite, sums[name + "_sum"] + value, sums[name + "_sum"])
        out[name] = value

    def log_norms(prefix: str, name: str) -> None:
        out.update({f"{prefix}/norm": norm(name), f"{prefix}/norm_l1": r[name + "_l1"],
                    f"{prefix}/norm_inf": r[name + "_inf"]})

    if logging:
        log_norms("params", "x")
        log_norms("grads", "g")
    if cfg.store_last_params:
        add_sum("update/<gn, xn-x(n-1)>", r["<g, d>"])
        add_sum("update/<gn, Delta(n)>", r["<g, d>"])  # Δ(n) is x(n) - x(n-1): the same product, trainit's two names
        if logging:
            log_norms("update", "d")  # Δ(n), as trainit's full_log; Δ(n+1) is train/update_norm
            out["params/cos(xn, x(n-1))"] = cosine(r["<x, x1>"], norm("x"), norm("x1"))
            out["update/cos(gn, Delta(n))"] = cosine(r["<g, d>"], norm("g"), norm("d"))
            out["update/cos(Delta(n+1), Delta(n))"] = cosine(r["<u, d>"], norm("u"), norm("d"))
    if cfg.store_last_grads:
        if logging:
            out["grads/<gn, g(n-1)>"] = r["<g, g1>"]
            out["grads/cos(gn, g(n-1))"] = cosine(r["<g, g1>"], norm("g"), norm("g1"))
        if cfg.store_last_params:
            add_sum("update/<g(n-1), Delta(n)>", r["<g1, d>"])
            if logging:
                out["update/cos(g(n-1), Delta(n))"] = cosine(r["<g1, d>"], norm("g1"), norm("d"))
    if cfg.store_past_grads and logging:
        out["grads/<gn, g(1:n-1)>"] = r["<g, gs>"]
        out["grads/cos(gn, g(1:n-1))"] = cosine(r["<g, gs>"], norm("g"), norm("gs"))
    if last is not None:
        add_sum("loss/fn-f(n-1)", loss.astype(F32) - last.loss.astype(F32))
        if last.grads is not None and logging:
            out["grads/cos(gn, g'(n-1))"] = cosine(r["<g, g'>"], norm("g"), norm("g'"))
            out["curvature/<gn-g'(n-1), Delta(n)>"] = r["<g-g', d>"]

    inf_grads = aux.inf_grads + (~finite).astype(jnp.int32)
    new = AuxState(
        last_params=keep(params, aux.last_params) if cfg.store_last_params else None,
        last_grads=keep(optax.tree.cast_like(grads, aux.last_grads), aux.last_grads) if cfg.store_last_grads else None,
        past_grads=keep(optax.tree.add(aux.past_grads, optax.tree.cast_like(grads, aux.past_grads)), aux.past_grads)
        if cfg.store_past_grads else None,
        sums=sums, inf_grads=inf_grads)
    if logging:
        out.update({name: value for name, value in sums.items()})
        out["grads/inf_grads"] = inf_grads
        return new, out
    return new, {}


@dataclass(frozen=True)
class AuxHook:
    """The aux-state hook as a step metric (trainer/step_metrics.py): its state is the
    AuxState, under `metric_states["aux"]`; x(n-1) is evaluated on this step's batch with the
    step's own dropout keys (`inputs.loss_at`) when compute_last_loss/compute_last_grads ask."""

    cfg: AuxConfig
    # The optimizer groups' labels (a tree like the model's), or None. Arrays labelled `frozen` (LoRA's
    # base) are left out of the buffers, which would otherwise hold three more copies of a fine-tuned
    # base: no step moves them, so their x(n-1) is x(n) and their gradients are zeros, which is what
    # each update fills them in with (every diagnostic stays the one over all arrays).
    labels: Any = field(default=None, compare=False)
    name = "aux"
    logging_only = False

    def _trained(self, tree):
        if self.labels is None or FROZEN_GROUP not in jax.tree.leaves(self.labels):
            return tree
        return eqx.filter(tree, jax.tree.map(lambda label: label != FROZEN_GROUP, self.labels))

    def _buffers(self, aux: AuxState, fn: Callable) -> AuxState:
        """`aux` with `fn(buffer, base)` applied to each kept buffer; base is what a frozen array's would hold."""
        return AuxState(*(None if buf is None else fn(buf, base) for buf, base in (
            (aux.last_params, "params"), (aux.last_grads, "zeros"), (aux.past_grads, "zeros"))),
            sums=aux.sums, inf_grads=aux.inf_grads)

    def init(self, params) -> AuxState | None:
        return init(self.cfg, self._trained(params))

    def update(self, aux: AuxState, inputs: StepInputs, logging: bool) -> tuple[AuxState, dict[str, jax.Array]]:
        model = inputs.state.model
        params = eqx.filter(model, eqx.is_inexact_array)
        fill = {"params": params, "zeros": optax.tree.zeros_like(params)}
        aux = self._buffers(aux, lambda buf, base: eqx.combine(buf, fill[base]))  # over every array again
        last = None
        if self.cfg.needs_last_point:
            last_model = eqx.combine(aux.last_params, eqx.filter(model, eqx.is_inexact_array, inverse=True))
            last = LastPoint(*inputs.loss_at(last_model, self.cfg.compute_last_grads))
        new, out = update(self.cfg, aux, params, inputs.grads, inputs.updates, inputs.aux["loss"].mean(), last,
                          logging)
        return self._buffers(new, lambda buf, _: self._trained(buf)), out


# ----------------------------------------------------------------------------- per-block norms


def per_layer(blocks_of: Callable[[Any], Any], num_blocks: int) -> FnMetric:
    """A step metric (logging steps only): `layers/<i>/{params,grads,update}/norm` for each block
    i of the stacked blocks `blocks_of(tree)` picks out (every leaf's leading axis is the block)."""

    def block_norms(tree) -> jax.Array:
        leaves = jax.tree.leaves(blocks_of(tree))
        return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(F32)).reshape(x.shape[0], -1), axis=1) for x in leaves))

    def metric(state, grads, updates, aux) -> dict[str, jax.Array]:
        out = {}
        for name, tree in (("params", eqx.filter(state.model, eqx.is_inexact_array)), ("grads", grads),
                           ("update", updates)):
            norms_L = block_norms(tree)
            out.update({f"layers/{i}/{name}/norm": norms_L[i] for i in range(num_blocks)})
        return out

    return FnMetric(metric, logging_only=True)
