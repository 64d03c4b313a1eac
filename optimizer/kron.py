"""PSGD Kron (Li 2018, "Preconditioner on matrix Lie group for SGD", arXiv:1809.10232; Li 2024,
arXiv:2402.11858): momentum preconditioned by a Kronecker-factored P = Q_Lᵀ Q_L ⊗ Q_Rᵀ Q_R fitted
online to whiten the gradient, as in Evan Walters' psgd_jax (kron, 0.2.9) and kron_torch (0.3.3).

Per matrix (m×n; a vector is one diagonal factor), with m̂ the bias-corrected momentum:

    A     = Q_L G Q_Rᵀ,   G = m̂ + √eps32·mean|m̂|·V        (V ~ N(0, I): the probe, damped G)
    B̄     = Q_L⁻ᵀ V Q_R⁻¹
    Q_L  <- Q_L - lr_p · triu(A Aᵀ - B̄ B̄ᵀ) / ‖A Aᵀ + B̄ B̄ᵀ‖ · Q_L      (Q_R likewise from Aᵀ A, B̄ᵀ B̄)
    direction = Q_Lᵀ Q_L m̂ Q_Rᵀ Q_R, its RMS clipped to 1.1

with ‖·‖ psgd's cheap lower bound of the spectral norm. A factor is triangular unless its side is
longer than `max_size_triangular` (or `memory_save_mode` says diagonal: one_diag the longest
side, all_diag every side); a diagonal factor q updates as q <- q - lr_p·(a - b)·q / max|a + b|
with a, b the row (column) sums of A², B̄². The preconditioner is updated on a deterministic
schedule of probability p(t) = clip(max·exp(-decay·(t - flat_start)), min, max): whenever the
updates since the last reach 1/p (every update for the first `flat_start`). Before an update, with
probability 1% the factors of each matrix are rescaled to equal max-norms (their product, hence
P, unchanged: a guard against over/underflow).

Randomness: V and the 1% draw come from a key folded from a fixed seed (the group's index) and
the update count: the same run gives the same numbers, a resumed one too (the count is in the
state), whatever the device layout (`probes`).

Stacks: a stacked (num_blocks, d_in, d_out) leaf is num_blocks matrices, each with its own
factors, damping and RMS clip, as the per-layer reference treats them (psgd_jax's scanned layers
share the last two over the stack); `scalar` leaves (biases, norm gains: (num_blocks, d) or (d,))
are stacks of vectors with one diagonal factor, as the reference treats 1-D parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optimizer.blocking import HIGHEST, is_array, is_function
from optimizer.contract import Optimizer
from optimizer.diagnostics import find_states, is_masked, summary
from optimizer.groups import GROUPS, check_non_negative, check_unit_interval
from optimizer.trees import map_unzipped
from utils.errors import ConfigError

MEMORY_SAVE_MODES = (None, "one_diag", "all_diag")
DAMPING = float(np.sqrt(np.finfo(np.float32).eps))  # psgd_jax: √eps32 · mean|G| of noise added to G
BALANCE_PROB = 0.01  # psgd_jax / kron_torch: rebalance the factors on ~1% of preconditioner updates
RMS_CLIP = 1.1  # psgd_jax / kron_torch: the direction's RMS is capped here (whitened: ~1)
TINY = float(np.finfo(np.float32).tiny)


class KronState(NamedTuple):
    count: jax.Array  # int32 scalar: updates done
    update_counter: jax.Array  # int32 scalar: updates since the preconditioner was last updated
    mu: Any  # momentum, param-shaped
    q_left: Any  # per leaf (*stack, m, m) upper-triangular or (*stack, m) diagonal; None for vectors
    q_right: Any  # per leaf (*stack, n, n) or (*stack, n); a vector's one factor lives here


@dataclass(frozen=True)
class _Plan:
    """One leaf: its stack axes and, per side, whether the factor is diagonal (static)."""

    kind: str  # "skip" (not an array) or "kron"
    stack: tuple[int, ...] = ()  # the leading (stack) axes
    shape: tuple[int, ...] = ()  # one tensor: (m, n) a matrix, (d,) a vector
    diag: tuple[bool, ...] = ()  # per axis of `shape`


def _plan(x, label: str | None, max_size: int, memory_save_mode: str | None) -> _Plan:
    if not is_array(x):
        return _Plan("skip")
    order = 2 if (label != "scalar" and x.ndim >= 2) else 1
    shape = tuple(x.shape[x.ndim - order:]) if x.ndim else (1,)
    stack = tuple(x.shape[: x.ndim - order]) if x.ndim else ()
    diag = [size == 1 or size > max_size or order < 2 for size in shape]
    if memory_save_mode == "all_diag":
        diag = [True] * order
    elif memory_save_mode == "one_diag":
        diag[int(np.argsort(shape)[::-1][0])] = True  # the longest side (the last of equal ones), as psgd_jax
    return _Plan("kron", stack, shape, tuple(diag))


def init_factor(size: int, diag: bool, scale: float, stack: tuple[int, ...]) -> jax.Array:
    one = jnp.full((size,), scale, jnp.float32) if diag else scale * jnp.eye(size, dtype=jnp.float32)
    return jnp.broadcast_to(one, (*stack, *one.shape))


def norm_lower_bound(a_BxB: jax.Array) -> jax.Array:
    """psgd_jax's cheap lower bound of the spectral norm of a (symmetric) matrix: from the row or
    column of largest norm, one power step (‖A‖ <= √2 × this on random matrices, per its authors)."""
    max_abs = jnp.max(jnp.abs(a_BxB))

    def calc(a):
        a = a / max_abs
        aa = a * a
        sum0, sum1 = jnp.sum(aa, axis=0), jnp.sum(aa, axis=1)
        i, j = jnp.argmax(sum0), jnp.argmax(sum1)

        def by_column():
            x = jnp.matmul(a[:, i], a, precision=HIGHEST)
            return max_abs * jnp.linalg.norm(jnp.matmul(x / jnp.linalg.norm(x), a.T, precision=HIGHEST))

        def by_row():
            x = jnp.matmul(a, a[j], precision=HIGHEST)
            return max_abs * jnp.linalg.norm(jnp.matmul(a.T, x / jnp.linalg.norm(x), precision=HIGHEST))

        return jax.lax.cond(sum0[i] > sum1[j], by_column, by_row)

    return jax.lax.cond(max_abs > 0, calc, lambda _: max_abs, a_BxB)


def _apply(q, x, axis: int, transpose: bool = False):
    """Q (or Qᵀ) applied along `axis` of a matrix (axis 0: Q X, axis 1: X Qᵀ) or of a vector."""
    if q.ndim == 1:
        return x * (q[:, None] if (x.ndim == 2 and axis == 0) else q)
    q = q.T if transpose else q
    if x.ndim == 1:
        return jnp.matmul(q, x, precision=HIGHEST)
    return jnp.matmul(q, x, precision=HIGHEST) if axis == 0 else jnp.matmul(x, q.T, precision=HIGHEST)


def _solve(q, x, axis: int):
    """Q⁻ᵀ X along axis 0 (Q upper-triangular: a triangular solve), X Q⁻¹ along axis 1."""
    if q.ndim == 1:
        return x / (q[:, None] if (x.ndim == 2 and axis == 0) else q)
    if x.ndim == 1:
        return jax.lax.linalg.triangular_solve(q, x[None, :], left_side=False, lower=False)[0]
    if axis == 0:  # Q⁻ᵀ X = (Xᵀ Q⁻¹)ᵀ
        return jax.lax.linalg.triangular_solve(q, x.T, left_side=False, lower=False).T
    return jax.lax.linalg.triangular_solve(q, x, left_side=False, lower=False)


def _terms(a, b, axis: int, diag: bool):
    """(A-term, B̄-term) of the factor on `axis`: the contraction of A with itself over every other
    axis (A Aᵀ, Aᵀ A, or its diagonal: sums of squares for a diagonal factor)."""
    if a.ndim == 1:
        return a * a, b * b
    other = 1 - axis
    if diag:
        return jnp.sum(a * a, axis=other), jnp.sum(b * b, axis=other)
    if axis == 0:
        return jnp.matmul(a, a.T, precision=HIGHEST), jnp.matmul(b, b.T, precision=HIGHEST)
    return jnp.matmul(a.T, a, precision=HIGHEST), jnp.matmul(b.T, b, precision=HIGHEST)


def update_factors(qs: list, g, v, precond_lr: float) -> list:
    """One preconditioner update of one tensor's factors `qs` (one per axis of g) from the damped
    momentum g and the probe v: A = Q g, B̄ = Q⁻ᵀ v, each factor moved along its Lie group."""
    a, b = g, v
    for axis, q in enumerate(qs):
        a, b = _apply(q, a, axis), _solve(q, b, axis)
    new = []
    for axis, q in enumerate(qs):
        term_a, term_b = _terms(a, b, axis, q.ndim == 1)
        step = precond_lr * (term_a - term_b)
        if q.ndim == 1:
            new.append(q - step * q / (jnp.max(jnp.abs(term_a + term_b)) + TINY))
        else:
            step = jnp.triu(step) / (norm_lower_bound(term_a + term_b) + TINY)
            new.append(q - jnp.matmul(step, q, precision=HIGHEST))
    return new


def precondition(qs: list, g):
    """P g = Q_Lᵀ Q_L g Q_Rᵀ Q_R (a vector: q² ⊙ g)."""
    for axis, q in enumerate(qs):
        g = _apply(q, _apply(q, g, axis), axis, transpose=True)
    return g


def balance(qs: list) -> list:
    """Factors rescaled to equal max-norms, their product unchanged (psgd's _balance_Q)."""
    if len(qs) < 2:
        return qs
    norms = jnp.stack([jnp.max(jnp.abs(q)) for q in qs])
    gmean = jnp.prod(norms) ** (1.0 / len(qs))
    return [q * (gmean / n) for q, n in zip(qs, norms)]


def clip_rms(u):
    return u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(u * u)) / RMS_CLIP)


def update_probability(step: jax.Array, max_prob: float, min_prob: float, decay: float, flat_start: int):
    """psgd_jax's precond_update_prob_schedule at `step` (counting updates from 1)."""
    prob = max_prob * jnp.exp(-decay * (step.astype(jnp.float32) - flat_start))
    return jnp.minimum(jnp.maximum(prob, min_prob), max_prob)


def probes(seed: int, count: jax.Array, tree) -> tuple[jax.Array, Any]:
    """(whether to rebalance, V per array leaf of `tree`) for the update after `count` updates:
    the one key folded from `seed` and `count`, split into the 1% draw and one key per leaf (in
    leaf order), V ~ N(0, I) shaped like the leaf, float32."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
    balance_key, probe_key = jax.random.split(key)
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(probe_key, max(len(leaves), 1))
    vs = [jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
    return jax.random.uniform(balance_key) < BALANCE_PROB, jax.tree.unflatten(treedef, vs)


def _per_tensor(fn, plan: _Plan, *arrays):
    """fn over each tensor of a stacked leaf (the stack axes flattened into one). On CPU one
    tensor at a time (lax.map): vmapped, the triangular solves become batched LAPACK calls, which
    jaxlib 0.10 fans out over XLA's intra-op thread pool and which, side by side (one per leaf),
    can deadlock a small pool (seen here on 2 cores, as with Shampoo's eigh: see
    optimizer.blocking._per_matrix); other backends vmap."""
    if not plan.stack:
        return fn(*arrays)

    def flat(x):
        return None if x is None else x.reshape(-1, *x.shape[len(plan.stack):])

    def unflat(x):
        return x.reshape(*plan.stack, *x.shape[1:])

    def one_at_a_time(*xs):
        return jax.lax.map(lambda args: fn(*args), xs)

    def batched(*xs):
        return jax.vmap(fn)(*xs)

    out = jax.lax.platform_dependent(*[flat(x) for x in arrays], cpu=one_at_a_time, default=batched)
    return jax.tree.map(unflat, out)


def scale_by_kron(
    b1: float = 0.9,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    max_size_triangular: int = 8192,
    memory_save_mode: str | None = None,
    update_prob_max: float = 1.0,
    update_prob_min: float = 0.03,
    update_prob_decay: float = 0.001,
    update_prob_flat_start: int = 500,
    labels: Any = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """The Kron direction (no learning rate); see the module docstring. labels: a tree of group
    names like the params (or a function params -> one); `scalar` leaves are stacks of vectors,
    others stacks of matrices (their last two axes). None: every leaf with ndim >= 2 a matrix."""
    if memory_save_mode not in MEMORY_SAVE_MODES:
        raise ValueError(f"memory_save_mode={memory_save_mode!r} must be one of {MEMORY_SAVE_MODES}")

    def plans(tree):
        tree_labels = labels if labels is not None else jax.tree.map(lambda _: None, tree)
        tree_labels = tree_labels(tree) if is_function(tree_labels) else tree_labels
        return jax.tree.map(lambda label, x: _plan(x, label, max_size_triangular, memory_save_mode),
                            tree_labels, tree, is_leaf=lambda x: x is None)

    def for_each(fn, n, plan_tree, *trees):
        return map_unzipped(lambda plan, x, *rest: (x,) * n if plan.kind == "skip" else fn(plan, x, *rest), n,
                            plan_tree, *trees)

    def init_fn(params):
        plan_tree = plans(params)

        def factors(plan, x):
            scale = preconditioner_init_scale ** (1.0 / len(plan.shape))
            qs = [init_factor(size, d, scale, plan.stack) for size, d in zip(plan.shape, plan.diag)]
            return (None, qs[0]) if len(qs) == 1 else (qs[0], qs[1])

        q_left, q_right = for_each(factors, 2, plan_tree, params)
        mu = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
        return KronState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), mu, q_left, q_right)

    def update_fn(updates, state, params=None):
        del params
        plan_tree = plans(updates)
        count = optax.safe_int32_increment(state.count)
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g.astype(jnp.float32), state.mu, updates)
        m_hat = jax.tree.map(lambda m: m / (1.0 - b1 ** count.astype(jnp.float32)), mu)

        prob = update_probability(count, update_prob_max, update_prob_min, update_prob_decay, update_prob_flat_start)
        counter = state.update_counter + 1
        do_update = counter.astype(jnp.float32) >= 1.0 / prob
        counter = jnp.where(do_update, 0, counter)

        def fit(operands):
            q_left, q_right = operands
            rebalance, vs = probes(seed, state.count, m_hat)

            def leaf(plan, m, v, ql, qr):
                def one(m, v, ql, qr):
                    qs = [q for q in (ql, qr) if q is not None]
                    qs = jax.lax.cond(rebalance, balance, lambda qs: qs, qs)
                    g = m.reshape(plan.shape) + DAMPING * jnp.mean(jnp.abs(m)) * v.reshape(plan.shape)
                    qs = update_factors(qs, g, v.reshape(plan.shape), preconditioner_lr)
                    return (None, qs[0]) if ql is None else (qs[0], qs[1])

                return _per_tensor(one, plan, m, v, ql, qr)

            return for_each(leaf, 2, plan_tree, m_hat, vs, q_left, q_right)

        q_left, q_right = jax.lax.cond(do_update, fit, lambda operands: operands, (state.q_left, state.q_right))

        def direction(plan, g_in, m, ql, qr):
            def one(m, ql, qr):
                qs = [q for q in (ql, qr) if q is not None]
                return clip_rms(precondition(qs, m.reshape(plan.shape))).reshape(m.shape)

            return (_per_tensor(one, plan, m, ql, qr).astype(g_in.dtype),)

        (out,) = for_each(direction, 1, plan_tree, updates, m_hat, q_left, q_right)
        return out, KronState(count, counter, mu, q_left, q_right)

    return optax.GradientTransformation(init_fn, update_fn)


def preconditioner_norms(plan: _Plan, q_left, q_right) -> jax.Array:
    """An estimate of ‖P‖₂ = ‖Q_L‖₂²·‖Q_R‖₂² for every tensor of one leaf, shaped like its stack
    (the spectral norm of a Kronecker product is the product of its factors'): ‖Qᵀ Q‖₂ by psgd's
    `norm_lower_bound` for a triangular factor (a lower bound, within √2 of it on random
    matrices per its authors, exact at the identity), max q² for a diagonal one. So the estimate
    lies in [‖P‖₂/2, ‖P‖₂]. (Exactly it would take an eigh per factor on every logging step, which
    on gpt_tiny cost more than the rest of the step: Kron otherwise has none.)"""
    out = jnp.ones(plan.stack, jnp.float32)
    for q, diag in zip([q for q in (q_left, q_right) if q is not None], plan.diag):
        if diag:
            out = out * jnp.max(q * q, axis=-1)
            continue
        flat_NxBxB = q.reshape(-1, *q.shape[-2:])
        gram_NxBxB = jnp.matmul(jnp.swapaxes(flat_NxBxB, -1, -2), flat_NxBxB, precision=HIGHEST)
        out = out * jax.vmap(norm_lower_bound)(gram_NxBxB).reshape(plan.stack)
    return out


@dataclass(frozen=True)
class Kron(Optimizer):
    """Kron direction -> decoupled weight decay -> learning rate, on every group."""

    momentum: float = 0.9  # scale_by_kron's b1 (bias-corrected)
    weight_decay: float = 0.0
    precondition_lr: float = 0.1  # scale_by_kron's preconditioner_lr
    precondition_init_scale: float = 1.0  # scale_by_kron's preconditioner_init_scale
    max_size_triangular: int = 8192
    memory_save_mode: str | None = None
    update_prob_max: float = 1.0
    update_prob_min: float = 0.03
    update_prob_decay: float = 0.001
    update_prob_flat_start: int = 500

    GROUP_KNOBS = ("lr", "weight_decay", "momentum")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum")
        check_non_negative(prefix, self, "weight_decay", "update_prob_decay", "update_prob_flat_start")
        for knob in ("precondition_lr", "precondition_init_scale"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be positive")
        if isinstance(self.max_size_triangular, bool) or self.max_size_triangular < 1:
            raise ConfigError(f"{prefix}.max_size_triangular={self.max_size_triangular!r} must be a positive integer")
        if self.memory_save_mode not in MEMORY_SAVE_MODES:
            raise ConfigError(f"{prefix}.memory_save_mode={self.memory_save_mode!r} must be null, one_diag or all_diag")
        if not 0.0 < self.update_prob_min <= 1.0:
            raise ConfigError(f"{prefix}.update_prob_min={self.update_prob_min} must be in (0, 1]")
        if not self.update_prob_min <= self.update_prob_max <= 1.0:
            raise ConfigError(f"{prefix}.update_prob_max={self.update_prob_max} must be in "
                              f"[update_prob_min, 1] = [{self.update_prob_min}, 1]")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            scale_by_kron(b1=self.momentum, preconditioner_lr=self.precondition_lr,
                          preconditioner_init_scale=self.precondition_init_scale,
                          max_size_triangular=self.max_size_triangular, memory_save_mode=self.memory_save_mode,
                          update_prob_max=self.update_prob_max, update_prob_min=self.update_prob_min,
                          update_prob_decay=self.update_prob_decay, update_prob_flat_start=self.update_prob_flat_start,
                          labels=lambda tree: jax.tree.map(lambda _: group, tree), seed=GROUPS.index(group)),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """precond_norm_min / _median / _max: the spectral norm of the preconditioner P of every
        matrix (vector) of the group, psgd's cheap estimate (`preconditioner_norms`: within a
        factor 2 below; 1 at the start); costs one Qᵀ Q product per triangular factor."""
        states = find_states(group_state, KronState)
        if not states:
            return {}
        norms = []

        def collect(mu, param, q_left, q_right):
            if is_array(mu) and is_array(param):
                plan = _plan(param, group, self.max_size_triangular, self.memory_save_mode)
                norms.append(preconditioner_norms(plan, q_left, q_right))

        state = states[0]
        jax.tree.map(collect, state.mu, params, state.q_left, state.q_right, is_leaf=is_masked)
        return summary(norms, ("min", "median", "max"), "precond_norm")
