"""Shampoo (Gupta, Koren & Singer 2018) with blocking, grafting and a diagonal fallback.

`scale_by_shampoo` returns only the preconditioned direction; momentum, weight decay and the
learning rate are chained after it (see `Shampoo.transform`), as for the other optimizers here.
The `Shampoo` dataclass's knobs use the shared vocabulary (optimizer/renames.py); this module's
names are the paper's: precondition_b2 = beta2, precondition_eps = epsilon, max_precondition_dim =
max_preconditioner_dim, adam_b2 / adam_eps = graft_b2 / graft_eps.

For a gradient matrix G (m×n) it keeps a left statistic L (m×m) and a right one R (n×n),
    L <- beta2·L + (1-beta2)·G Gᵀ,   R <- beta2·R + (1-beta2)·Gᵀ G   (beta2 = 1: plain sums),
and returns L^{-1/4} G R^{-1/4}. The roots are recomputed only every `precondition_every`
updates (an eigendecomposition is far dearer than a step) and cached in the state in between.

Which leaves are preconditioned (the rule):
  * with `labels` (e.g. `models.gpt.param_labels`): `scalar` leaves take the diagonal path;
    every other leaf with ndim >= 2 is a stack of matrices: its last two axes are the matrix and
    every leading axis a stack axis (the scan-stacked `hidden` weights are (num_blocks, d_in,
    d_out)), preconditioned slice by slice, never flattened together;
  * without labels: `stacked_leading_axes` (an int, or a function leaf -> int) says how many
    leading axes are stack axes; a leaf with exactly two axes left is a matrix, anything else
    (vectors, scalars, >2-D) takes the diagonal path.
  * A matrix side longer than `max_preconditioner_dim` (e.g. a vocabulary axis) gets no
    statistic: only the other side is preconditioned, with root 1/2 instead of 1/4 so that the
    direction stays invariant to the gradient's scale (L^{-1/2} G is full-matrix Adagrad over
    that side). Both sides too long: the diagonal path.

Blocking (optimizer/blocking.py, shared with SOAP, as are the statistics and the rule above):
a preconditioned side longer than `block_size` is cut into blocks of `block_size`
(the last one zero-padded); each block of the matrix has its own L and R. Zero rows add zero to
R and a zero block to L, and the padded rows of G are zero, so the true entries of the result
equal the per-block computation on the true sub-blocks; the padding is sliced off. A side that
is not preconditioned is not cut: its whole length feeds the other side's statistics.

Diagonal path: the Adam direction without momentum, g / (sqrt(nu_hat) + graft_eps) with
nu <- graft_b2·nu + (1-graft_b2)·g² bias-corrected (graft_b2 = 1: Adagrad sums, no correction).

Grafting, per block (per matrix when it fits in one block; per stacked slice always): the
Shampoo direction takes its direction from Shampoo and its Frobenius norm from the graft:
"adam" the diagonal-path direction above, "sgd" the raw gradient, "none" no rescaling. Before
`start_preconditioning_step` the graft direction itself is returned (raw gradient for "none").

State: a count and, per field, a tree with the params' structure; statistics and roots are
float32 arrays (*stack, row_blocks, col_blocks, b, b) whose shapes follow from the param's; a
field a leaf does not use holds an empty (0,) array, so every field mirrors the params.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optimizer.blocking import (
    HIGHEST,
    Plan,
    eigh,
    for_each,
    from_blocks,
    is_array,
    leaf_plans,
    stats_shape,
    to_blocks,
    transpose,
    update_statistics,
    valid_mask,
)
from optimizer.contract import Optimizer
from optimizer.diagnostics import find_states, is_masked, median_nonneg
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError

GRAFTS = ("adam", "sgd", "none")


class ShampooState(NamedTuple):
    count: jax.Array  # int32 scalar: updates done
    left_stats: Any  # per leaf (*stack, R, C, M, M) or (0,)
    right_stats: Any  # per leaf (*stack, R, C, N, N) or (0,)
    left_roots: Any  # L^{-1/p} of each block, as of the last recompute
    right_roots: Any
    nu: Any  # diagonal second moment (param-shaped) where the diagonal path or Adam graft needs it


def _inverse_root(stats_BxB: jax.Array, p: float, epsilon: float) -> jax.Array:
    """(S + epsilon·λmax(S)·I)^{-1/p} of each symmetric PSD matrix in a batch, in float32.

    The damping is relative to the largest eigenvalue, so it does not depend on the gradient's
    scale; eigenvalues that rounding made negative are clamped to 0 first. float32 eigh is only
    accurate to ~1e-7·λmax, so on a rank-deficient statistic (a 32×128 gradient's 128×128 right
    statistic has rank ≤ 32; roots are cached for `precondition_every` steps while new gradients
    reach the null space) an epsilon below that noise lets the noise pick the null-space
    eigenvalues: at 1e-12 a step-2 direction (graft=none) came out 1,500-5,500× the gradient's
    norm and 55-90% away from the float64 result (a graft resets the norm, not the direction).
    1e-6 (Google's distributed Shampoo default, also relative to λmax) caps that amplification
    at epsilon^(-1/p) per side and agrees with float64 to ~1%. An all-zero statistic (nothing
    seen yet) has no information and gives the identity.
    """
    eigvals_B, eigvecs_BxB = eigh(stats_BxB.astype(jnp.float32))
    lam_max = jnp.max(eigvals_B, axis=-1, keepdims=True)
    positive = lam_max > 0
    lam_max = jnp.where(positive, lam_max, 1.0)
    scale_B = (jnp.maximum(eigvals_B / lam_max, 0.0) + epsilon) ** (-1.0 / p) * lam_max ** (-1.0 / p)
    root_BxB = jnp.matmul(eigvecs_BxB * scale_B[..., None, :], transpose(eigvecs_BxB), precision=HIGHEST)
    eye = jnp.eye(stats_BxB.shape[-1], dtype=jnp.float32)
    return jnp.where(positive[..., None], root_BxB, eye)


def statistics_spectrum(stats: jax.Array, side: str, true_len: int, epsilon: float
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(λmin, λmax, damped condition number) of every block of one leaf's statistic, each shaped
    (*stack, R, C). `side` "left" (blocks of rows: the row padding gives zero rows and columns)
    or "right" (of columns); `true_len` the param's length on that side. The eigenvalues are
    those of the true sub-block: the padding's exact zero eigenvalues (the smallest `pad` of the
    sorted spectrum) are left out. λmin is clamped at 0, as `_inverse_root` does; the condition
    number is that of S + epsilon·λmax·I, the matrix whose root the update uses: (1 + epsilon) /
    (λmin/λmax + epsilon), at most 1 + 1/epsilon; 1 for an all-zero statistic (identity root).
    Cost: one eigh per block (`optimizer.blocking.eigh`, as a root recompute)."""
    eigvals_RxCxB = eigh(stats.astype(jnp.float32))[0]  # ascending
    b, rows, cols = stats.shape[-1], stats.shape[-4], stats.shape[-3]
    blocks = rows if side == "left" else cols
    pad = np.maximum(0, (np.arange(blocks) + 1) * b - true_len)  # nonzero on the last block only
    pad = pad.reshape(-1, 1) if side == "left" else pad.reshape(1, -1)
    index = np.broadcast_to(pad, (rows, cols))[..., None]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (*eigvals_RxCxB.shape[:-1], 1))
    lam_min = jnp.maximum(jnp.take_along_axis(eigvals_RxCxB, index, axis=-1)[..., 0], 0.0)
    lam_max = eigvals_RxCxB[..., -1]
    positive = lam_max > 0
    rel_min = lam_min / jnp.where(positive, lam_max, 1.0)
    cond = jnp.where(positive, (1.0 + epsilon) / (rel_min + epsilon), 1.0)
    return lam_min, lam_max, cond


def scale_by_shampoo(
    block_size: int = 256,
    beta2: float = 0.999,
    epsilon: float = 1e-6,
    precondition_every: int = 10,
    start_preconditioning_step: int = 1,
    max_preconditioner_dim: int = 4096,
    graft: str = "adam",
    graft_b2: float = 0.999,
    graft_eps: float = 1e-8,
    exponent_override: float | None = None,
    labels: Any = None,
    stacked_leading_axes: int | Callable[[jax.Array], int] = 0,
) -> optax.GradientTransformation:
    """The Shampoo direction (no learning rate, no momentum); see the module docstring.

    epsilon: damping relative to each statistic's largest eigenvalue. exponent_override: the p
    of every root S^{-1/p} (default 4 for two-sided, 2 for one-sided). start_preconditioning_step:
    the first update (counting from 1) that is preconditioned; roots are recomputed on it and on
    every `precondition_every`-th update after it, and never before it. labels: a tree of group
    names like the params, or a function params -> such a tree.
    """
    if graft not in GRAFTS:
        raise ValueError(f"graft={graft!r} must be one of {GRAFTS}")

    def plans(tree):
        return leaf_plans(tree, labels, stacked_leading_axes, block_size, max_preconditioner_dim)

    def root_p(plan: Plan, side: str) -> float | None:
        """The p of `side`'s root S^{-1/p}; None where the side has no statistic."""
        if not plan.has(side):
            return None
        return exponent_override or 2.0 * (plan.left + plan.right)

    def empty():  # a field this leaf does not use
        return jnp.zeros((0,), jnp.float32)

    def uses_nu(plan):
        return plan.kind == "diag" or graft == "adam"

    def init_fn(params):
        plan_tree = plans(params)

        def side(plan, x, which, fill):
            if not plan.has(which):
                return empty()
            shape = stats_shape(plan, x, which)
            if fill == "zeros":
                return jnp.zeros(shape, jnp.float32)
            return jnp.broadcast_to(jnp.eye(shape[-1], dtype=jnp.float32), shape)

        fields = {
            f"{which}_{kind}": for_each(lambda plan, x, w=which, f=fill: side(plan, x, w, f), plan_tree, params)
            for which in ("left", "right")
            for kind, fill in (("stats", "zeros"), ("roots", "eye"))
        }
        nu = for_each(lambda plan, x: jnp.zeros(x.shape, jnp.float32) if uses_nu(plan) else empty(),
                      plan_tree, params)
        return ShampooState(count=jnp.zeros((), jnp.int32), nu=nu, **fields)

    def update_fn(updates, state, params=None):
        del params
        plan_tree = plans(updates)
        step = state.count + 1  # this update, counting from 1
        grads32 = for_each(lambda plan, g: g.astype(jnp.float32), plan_tree, updates)

        # 1. Statistics, every step.
        left_stats = update_statistics(plan_tree, grads32, state.left_stats, "left", beta2)
        right_stats = update_statistics(plan_tree, grads32, state.right_stats, "right", beta2)

        # 2. Roots, only on recompute steps: lax.cond runs one branch, so other steps skip eigh.
        def recompute_roots(operands):
            left_stats, right_stats, left_roots, right_roots = operands

            def fn(which):
                def root(plan, stats, old):
                    p = root_p(plan, which)
                    if p is None:
                        return old
                    new = _inverse_root(stats, p, epsilon)
                    finite = jnp.all(jnp.isfinite(new), axis=(-2, -1), keepdims=True)
                    return jnp.where(finite, new, old)  # a NaN/inf block keeps its previous root

                stats, old = (left_stats, left_roots) if which == "left" else (right_stats, right_roots)
                return for_each(root, plan_tree, stats, old)

            return fn("left"), fn("right")

        recompute = (step >= start_preconditioning_step) & (
            (step - start_preconditioning_step) % precondition_every == 0)
        left_roots, right_roots = jax.lax.cond(
            recompute, recompute_roots, lambda operands: (operands[2], operands[3]),
            (left_stats, right_stats, state.left_roots, state.right_roots))

        # 3. Diagonal second moment (diagonal path and Adam graft).
        def new_nu(plan, g, nu):
            if not uses_nu(plan):
                return nu
            if graft_b2 == 1.0:
                return nu + g * g
            return graft_b2 * nu + (1.0 - graft_b2) * g * g

        nu = for_each(new_nu, plan_tree, grads32, state.nu)
        correction = 1.0 if graft_b2 == 1.0 else 1.0 - graft_b2 ** step.astype(jnp.float32)

        def adam_direction(g, nu):
            return g / (jnp.sqrt(nu / correction) + graft_eps)

        # 4. Direction.
        def direction(plan, g_in, g, nu, left_root, right_root):
            if plan.kind == "diag":
                return adam_direction(g, nu).astype(g_in.dtype)
            graft_MxN = adam_direction(g, nu) if graft == "adam" else g
            g_RxCxMxN = to_blocks(g, plan)
            p_RxCxMxN = g_RxCxMxN
            if plan.left:
                p_RxCxMxN = jnp.matmul(left_root, p_RxCxMxN, precision=HIGHEST)
            if plan.right:
                p_RxCxMxN = jnp.matmul(p_RxCxMxN, right_root, precision=HIGHEST)
            if plan.padded():  # numerical crumbs on the padding would bias the block norms
                p_RxCxMxN = p_RxCxMxN * valid_mask(plan)
            if graft != "none":
                graft_RxCxMxN = to_blocks(graft_MxN, plan)
                graft_norm = jnp.linalg.norm(graft_RxCxMxN, axis=(-2, -1), keepdims=True)
                shampoo_norm = jnp.linalg.norm(p_RxCxMxN, axis=(-2, -1), keepdims=True)
                ratio = graft_norm / jnp.where(shampoo_norm > 0, shampoo_norm, 1.0)
                p_RxCxMxN = jnp.where(shampoo_norm > 0, p_RxCxMxN * ratio, graft_RxCxMxN)
            out_MxN = jnp.where(step >= start_preconditioning_step, from_blocks(p_RxCxMxN, plan), graft_MxN)
            return out_MxN.astype(g_in.dtype)

        out = for_each(direction, plan_tree, updates, grads32, nu, left_roots, right_roots)
        new_state = ShampooState(optax.safe_int32_increment(state.count), left_stats, right_stats,
                                 left_roots, right_roots, nu)
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class Shampoo(Optimizer):
    """Shampoo direction -> momentum -> decoupled weight decay -> learning rate."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    block_size: int = 256
    precondition_b2: float = 0.999  # scale_by_shampoo's beta2
    precondition_eps: float = 1e-6  # scale_by_shampoo's epsilon: relative to λmax, as Google's distributed Shampoo
    precondition_every: int = 10
    start_preconditioning_step: int = 1
    max_precondition_dim: int = 4096
    graft: str = "adam"
    adam_b2: float = 0.999  # the Adam graft's and the diagonal path's (scale_by_shampoo's graft_b2)
    adam_eps: float = 1e-8  # likewise (graft_eps)

    GROUP_KNOBS = ("lr", "weight_decay", "momentum", "precondition_b2", "precondition_eps", "adam_b2", "adam_eps")
    # constants of the step (optimizer/arguments.py): a value of 1 turns their EMA into a plain sum
    CONSTANT_KNOBS = ("precondition_b2", "adam_b2")

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """`scalar` leaves take the diagonal path: no statistics, so precondition_b2 and precondition_eps would
        be ignored."""
        if group == "scalar":
            return tuple(k for k in self.GROUP_KNOBS if k not in ("precondition_b2", "precondition_eps"))
        return self.GROUP_KNOBS

    def group_knob_hint(self, group: str, knob: str) -> str:
        return ("the scalar group (biases, norm gains) takes Shampoo's diagonal Adam-style path, which has no "
                "preconditioner statistics; set optimizer.groups.scalar.adam_b2 or adam_eps instead")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum")
        check_non_negative(prefix, self, "weight_decay")
        for knob in ("block_size", "precondition_every", "start_preconditioning_step", "max_precondition_dim"):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{prefix}.{knob}={value!r} must be a positive integer")
        for knob in ("precondition_b2", "adam_b2"):
            if not 0.0 < getattr(self, knob) <= 1.0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be in (0, 1] (1 = plain sums)")
        if not 0.0 < self.precondition_eps < 1.0:
            raise ConfigError(f"{prefix}.precondition_eps={self.precondition_eps} must be in (0, 1): it is relative "
                              "to the largest eigenvalue of each statistic (try 1e-6 to 1e-4; float32 eigh noise is "
                              "~1e-7)")
        check_positive(prefix, self, "adam_eps")
        if self.graft not in GRAFTS:
            raise ConfigError(f"{prefix}.graft={self.graft!r} must be one of {', '.join(GRAFTS)}")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        """One parameter group's update (optimizer.groups.per_group): every leaf it sees carries
        `group`'s label, so `scalar` takes the diagonal path; weight decay is the group's own."""
        return optax.chain(
            scale_by_shampoo(
                block_size=self.block_size,
                beta2=self.precondition_b2,
                epsilon=self.precondition_eps,
                precondition_every=self.precondition_every,
                start_preconditioning_step=self.start_preconditioning_step,
                max_preconditioner_dim=self.max_precondition_dim,
                graft=self.graft,
                graft_b2=self.adam_b2,
                graft_eps=self.adam_eps,
                labels=lambda tree: jax.tree.map(lambda _: group, tree),
            ),
            optax.trace(decay=self.momentum, nesterov=self.nesterov),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def steps_since_roots(self, count: jax.Array) -> jax.Array:
        """Updates since the inverse roots were last recomputed, after `count` updates (0 right
        after a recompute); -1 before the first (start_preconditioning_step not reached)."""
        since = (count - self.start_preconditioning_step) % self.precondition_every
        return jnp.where(count >= self.start_preconditioning_step, since, -1).astype(jnp.int32)

    def diagnostics(self, group: str, group_state, params) -> dict:
        """Of every block statistic of the group (left and right, every leaf; not the roots, which
        lag up to precondition_every − 1 updates behind): stats_eig_min, stats_eig_max (over all
        blocks), stats_cond_max, stats_cond_median (over blocks, damped; see
        `statistics_spectrum`) and steps_since_roots. A group with no statistics (scalar: the
        diagonal path) reports nothing. Cost: one eigh per statistic block, like a root recompute."""
        states = find_states(group_state, ShampooState)
        if not states:
            return {}
        state = states[0]
        found: list = []

        def collect(side, stats, param):
            if is_array(stats) and stats.size and is_array(param):
                true_len = param.shape[-2] if side == "left" else param.shape[-1]
                found.append(statistics_spectrum(stats, side, true_len, self.precondition_eps))

        for side, tree in (("left", state.left_stats), ("right", state.right_stats)):
            jax.tree.map(lambda stats, param, side=side: collect(side, stats, param), tree, params, is_leaf=is_masked)
        if not found:
            return {}
        lam_min, lam_max, cond = (jnp.concatenate([f[i].reshape(-1) for f in found]) for i in range(3))
        return {"stats_eig_min": jnp.min(lam_min), "stats_eig_max": jnp.max(lam_max),
                "stats_cond_max": jnp.max(cond), "stats_cond_median": median_nonneg(cond),
                "steps_since_roots": self.steps_since_roots(state.count)}
