"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321):
Adam run in the eigenbasis of Shampoo's statistics.

For a gradient block G (m×n) it keeps Shampoo's statistics L (m×m) and R (n×n), EMAs of G Gᵀ and
Gᵀ G at rate `shampoo_beta` (optimizer/blocking.py: the same blocking and statistics code as
Shampoo), and their eigenbases Q_L, Q_R. Each update, as the authors' code (nikhilvyas/SOAP,
also pytorch_optimizer.SOAP) does it:

    G' = Q_Lᵀ G Q_R                     (the gradient in the eigenbasis)
    M  <- b1·M + (1-b1)·G               (first moment, in the original coordinates)
    V  <- b2·V + (1-b2)·G'⊙G'           (second moment, in the eigenbasis)
    N  = Q_L [(Q_Lᵀ M Q_R) / (√V + eps)] Q_Rᵀ · √(1-b2^s) / (1-b1^s)      (s = update - 1)
    L, R <- EMAs with this G; every `precondition_frequency` updates (s a multiple of it) the
    eigenbases are refreshed by one power-iteration step and a QR (the paper's Algorithm 4):
    Q <- QR(S·Q) with Q's columns first sorted by their estimated eigenvalue diag(Qᵀ S Q),
    descending, and V's rows (columns) permuted the same way.

The first update only initialises: the statistics take G, Q_L and Q_R become their
eigenvectors (eigh, eigenvalues descending) and the direction is zero, as in the authors' code
(there is no eigenbasis before a gradient). Decoupled weight decay and the lr are chained after
(`SOAP.transform`); the decay applies on the first update too.

Null spaces: where a statistic is singular (one gradient of an m×n block, m < n, leaves an
(n-m)-dimensional null space), its eigenvectors there are any orthonormal basis, and the
reference takes LAPACK's, which rounding picks; Adam's per-coordinate division in that basis
then makes the run depend on rounding (device layout, CPU). Here that basis is a fixed one
(`initial_basis`) and a QR refresh leaves null columns in place (`refresh_basis`): one of the
reference's valid choices, continuous in the statistic.

Sides and blocks: a matrix side longer than `max_precondition_dim` is not rotated (one-sided
SOAP); both sides too long, or a leaf that is not a matrix: plain Adam on that leaf (Q = I), as
the reference does. A side longer than `block_size` is cut into blocks, each with its own
statistics and bases (none, by default: the paper does not block). The zero-padded rows or
columns of a last block are kept out of the rotation: their statistic rows are zero, so before
an eigh or QR they are shifted to a negative eigenvalue (sorting their eigenvectors last) and
the bases are masked to blockdiag(Q_true, Q_pad) afterwards: the rotated padding then stays
exactly zero and never reaches the true entries.

State (no zero-size placeholders, checkpoints save it as is): `mu` param-shaped; `nu`
param-shaped (whole blocks: (*stack, R·bm, C·bn) when the last block is padded); statistics
and bases (*stack, R, C, b, b) per rotated side, None for a side that is not rotated.
"""

from __future__ import annotations

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
    for_each_unzipped,
    from_blocks,
    is_array,
    leaf_plans,
    qr_q,
    side_padding,
    stats_shape,
    to_blocks,
    transpose,
    update_statistics,
    valid_mask,
)
from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v, find_states, is_masked, median_nonneg
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError

SIDES = ("left", "right")
# Eigenvalues below this fraction of the largest are null: float32 eigh leaves ~1e-7·λmax of
# rounding on an exact zero (measured up to 1.1e-7 for 96..1024-sized statistics); 100x that.
NULL_TOL = 1e-5


class SOAPState(NamedTuple):
    count: jax.Array  # int32 scalar: updates done
    mu: Any  # first moment, param-shaped, original coordinates
    nu: Any  # second moment in the eigenbasis, param-shaped (whole blocks where padded)
    left_stats: Any  # per leaf (*stack, R, C, bm, bm), None where the side is not rotated
    right_stats: Any  # per leaf (*stack, R, C, bn, bn)
    left_basis: Any  # Q_L per block: eigenvectors as columns, estimated eigenvalues descending
    right_basis: Any


def _padding_B(plan: Plan, side: str) -> np.ndarray:
    """(R, C, b) booleans: True on the padded coordinates of each block along `side` (the last
    `pad` of the last block's b)."""
    b = plan.block(side)
    pad_RxC = np.broadcast_to(side_padding(plan, side), (plan.rows, plan.cols))
    return np.arange(b) >= (b - pad_RxC)[..., None]


def _shift_padding(stats_BxB: jax.Array, plan: Plan, side: str) -> jax.Array:
    """The statistic with its (zero) padded diagonal set to -(1 + trace): an eigenvalue below every
    true one (those are >= 0, up to rounding of ~1e-7·trace), so its eigenvectors sort last."""
    pad_B = _padding_B(plan, side)
    if not pad_B.any():
        return stats_BxB
    trace = jnp.trace(stats_BxB, axis1=-2, axis2=-1)[..., None]
    return stats_BxB - jnp.where(pad_B, 1.0 + trace, 0.0)[..., None] * jnp.eye(stats_BxB.shape[-1], dtype=jnp.float32)


def _mask_padding(q_BxB: jax.Array, plan: Plan, side: str) -> jax.Array:
    """blockdiag(Q_true, Q_pad): zero where a true coordinate meets a padding eigenvector or the
    reverse (rounding crumbs; the padding eigenvectors are the last columns)."""
    pad_B = _padding_B(plan, side)
    if not pad_B.any():
        return q_BxB
    return q_BxB * (pad_B[..., :, None] == pad_B[..., None, :])


def _null(values_B: jax.Array, lam_max: jax.Array) -> jax.Array:
    """True where an eigenvalue (estimate) is indistinguishable from 0 in float32: |λ| <= NULL_TOL·λmax
    (the padding's large negative ones are not)."""
    return jnp.abs(values_B) <= NULL_TOL * lam_max


def initial_basis(stats_BxB: jax.Array, plan: Plan, side: str) -> jax.Array:
    """Eigenvectors of each block's statistic as columns, eigenvalues descending (eigh); in the
    null space (`_null`), a fixed basis instead of LAPACK's: the Q of a QR of P·E, P the projector
    on the null space and E a fixed random matrix (the same every run), which moves only as much
    as P does. (A one-gradient statistic of an m×n block, m < n, has an (n-m)-dimensional null
    space, where eigh returns any orthonormal basis: whatever the rounding of the statistic picks,
    so that an EPS32 change of the weights moved the golden losses of update 3 by ~1300 EPS32
    and the 8-device run drifted 2e-4 from the 1-device one; with the fixed basis, ~3 EPS32.)"""
    values_B, vecs_BxB = eigh(_shift_padding(stats_BxB.astype(jnp.float32), plan, side))
    values_B, vecs_BxB = jnp.flip(values_B, axis=-1), jnp.flip(vecs_BxB, axis=-1)  # descending
    null_B = _null(values_B, values_B[..., :1])  # contiguous: after the true ones, before the padding
    b = vecs_BxB.shape[-1]
    n_BxB = vecs_BxB * null_B[..., None, :]  # the null columns (others zeroed): P = N Nᵀ
    e_BxB = jax.random.normal(jax.random.PRNGKey(0), (b, b), jnp.float32)
    fixed_BxB = qr_q(jnp.matmul(n_BxB, jnp.matmul(transpose(n_BxB), e_BxB, precision=HIGHEST), precision=HIGHEST))
    # the fixed basis's first k columns (k null eigenvalues) take the null columns' places
    column_B = jnp.clip(jnp.arange(b) - jnp.argmax(null_B, axis=-1, keepdims=True), 0, b - 1)
    fixed_BxB = jnp.take_along_axis(fixed_BxB, jnp.broadcast_to(column_B[..., None, :], fixed_BxB.shape), axis=-1)
    return _mask_padding(jnp.where(null_B[..., None, :], fixed_BxB, vecs_BxB), plan, side)


def refresh_basis(stats_BxB: jax.Array, q_BxB: jax.Array, plan: Plan, side: str) -> tuple[jax.Array, jax.Array]:
    """One power-iteration step and a QR from the current basis (the paper's Algorithm 4): the
    columns of S·Q sorted by their estimated eigenvalue diag(Qᵀ S Q), descending, then Q of their
    QR. A column whose estimate is null (`_null`) keeps its vector (S·q is rounding noise there,
    which QR would turn into an arbitrary direction; q already lies in the null space) and its
    place (estimate 0, a stable sort). Returns (new basis, the sort order per block: (..., b)
    indices, to permute V with)."""
    sq_BxB = jnp.matmul(_shift_padding(stats_BxB, plan, side), q_BxB, precision=HIGHEST)
    estimate_B = jnp.sum(q_BxB * sq_BxB, axis=-2)
    null_B = _null(estimate_B, jnp.max(estimate_B, axis=-1, keepdims=True))
    estimate_B = jnp.where(null_B, 0.0, estimate_B)
    order_B = jnp.argsort(-estimate_B, axis=-1, stable=True)
    power_BxB = jnp.where(null_B[..., None, :], q_BxB, sq_BxB)
    sorted_BxB = jnp.take_along_axis(power_BxB, order_B[..., None, :], axis=-1)
    return _mask_padding(qr_q(sorted_BxB), plan, side), order_B


def rotate(x_RxCxMxN: jax.Array, q_left, q_right, back: bool = False) -> jax.Array:
    """Q_Lᵀ X Q_R per block (into the eigenbasis), or with back=True Q_L X Q_Rᵀ; a None side stays."""
    if q_left is not None:
        x_RxCxMxN = jnp.matmul(q_left if back else transpose(q_left), x_RxCxMxN, precision=HIGHEST)
    if q_right is not None:
        x_RxCxMxN = jnp.matmul(x_RxCxMxN, transpose(q_right) if back else q_right, precision=HIGHEST)
    return x_RxCxMxN


def refreshes(count: jax.Array, frequency: int) -> jax.Array:
    """Eigenbasis computations after `count` updates: the eigh of update 1 and a QR refresh on
    every update u >= 2 with (u - 1) a multiple of `frequency`."""
    return jnp.where(count >= 1, 1 + (count - 1) // frequency, 0).astype(jnp.int32)


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    block_size: int | None = None,
    labels: Any = None,
    stacked_leading_axes: int = 0,
) -> optax.GradientTransformation:
    """The SOAP direction (bias-corrected, no learning rate); see the module docstring.

    shampoo_beta: the statistics' EMA rate (None: b2). block_size None: sides are not cut.
    labels / stacked_leading_axes: which leaves are stacks of matrices (optimizer/blocking.py)."""
    beta_stats = b2 if shampoo_beta is None else shampoo_beta

    def plans(tree):
        return leaf_plans(tree, labels, stacked_leading_axes, block_size or max_precondition_dim,
                          max_precondition_dim)

    def init_fn(params):
        plan_tree = plans(params)

        def side(plan, x, which, fill):
            if not plan.has(which):
                return None
            shape = stats_shape(plan, x, which)
            if fill == "zeros":
                return jnp.zeros(shape, jnp.float32)
            return jnp.broadcast_to(jnp.eye(shape[-1], dtype=jnp.float32), shape)

        def nu(plan, x):
            shape = x.shape if plan.kind == "diag" else (*x.shape[:-2], plan.rows * plan.bm, plan.cols * plan.bn)
            return jnp.zeros(shape, jnp.float32)

        fields = {f"{which}_{kind}": for_each(lambda plan, x, w=which, f=fill: side(plan, x, w, f), plan_tree, params)
                  for which in SIDES for kind, fill in (("stats", "zeros"), ("basis", "eye"))}
        return SOAPState(count=jnp.zeros((), jnp.int32),
                         mu=for_each(lambda plan, x: jnp.zeros(x.shape, jnp.float32), plan_tree, params),
                         nu=for_each(nu, plan_tree, params), **fields)

    def update_fn(updates, state, params=None):
        del params
        plan_tree = plans(updates)
        first = state.count == 0
        s = jnp.maximum(state.count, 1).astype(jnp.float32)  # the reference's step (unused on update 1)
        scale = jnp.sqrt(1.0 - b2**s) / (1.0 - b1**s)
        grads32 = for_each(lambda plan, g: g.astype(jnp.float32), plan_tree, updates)

        # 1. Adam in the current eigenbasis (a zero direction and unchanged moments on update 1).
        def adam(plan, g_in, g, mu, nu, q_left, q_right):
            mu_new = b1 * mu + (1.0 - b1) * g
            if plan.kind == "diag":
                nu_new = b2 * nu + (1.0 - b2) * g * g
                out = mu_new / (jnp.sqrt(nu_new) + eps)
            else:
                nu_RxCxMxN = to_blocks(nu, plan)
                nu_RxCxMxN = b2 * nu_RxCxMxN + (1.0 - b2) * jnp.square(rotate(to_blocks(g, plan), q_left, q_right))
                n_RxCxMxN = rotate(to_blocks(mu_new, plan), q_left, q_right) / (jnp.sqrt(nu_RxCxMxN) + eps)
                out = from_blocks(rotate(n_RxCxMxN, q_left, q_right, back=True), plan)
                nu_new = from_blocks(nu_RxCxMxN, plan, crop=False)
            out = jnp.where(first, 0.0, out * scale).astype(g_in.dtype)
            return out, jnp.where(first, mu, mu_new), jnp.where(first, nu, nu_new)

        out, mu, nu = for_each_unzipped(adam, 3, plan_tree, updates, grads32, state.mu, state.nu,
                                        state.left_basis, state.right_basis)

        # 2. Statistics, every update (after the direction, as the reference).
        left_stats = update_statistics(plan_tree, grads32, state.left_stats, "left", beta_stats)
        right_stats = update_statistics(plan_tree, grads32, state.right_stats, "right", beta_stats)

        # 3. Bases: eigh on update 1, a QR refresh every `precondition_frequency`; lax.switch runs one.
        def keep(operands):
            return operands[2], operands[3], operands[4]

        def initialise(operands):
            l_stats, r_stats, l_basis, r_basis, nu = operands

            def fn(which, stats, old):
                return for_each(lambda plan, st, q: initial_basis(st, plan, which) if plan.has(which) else q,
                                plan_tree, stats, old)

            return fn("left", l_stats, l_basis), fn("right", r_stats, r_basis), nu

        def refresh(operands):
            l_stats, r_stats, l_basis, r_basis, nu = operands

            def leaf(plan, nu_leaf, ls, rs, lq, rq):
                if plan.kind != "matrix":
                    return nu_leaf, lq, rq
                nu_RxCxMxN = to_blocks(nu_leaf, plan)
                if plan.left:
                    lq, order = refresh_basis(ls, lq, plan, "left")
                    nu_RxCxMxN = jnp.take_along_axis(nu_RxCxMxN, order[..., :, None], axis=-2)
                if plan.right:
                    rq, order = refresh_basis(rs, rq, plan, "right")
                    nu_RxCxMxN = jnp.take_along_axis(nu_RxCxMxN, order[..., None, :], axis=-1)
                return from_blocks(nu_RxCxMxN, plan, crop=False), lq, rq

            new_nu, new_l, new_r = for_each_unzipped(leaf, 3, plan_tree, nu, l_stats, r_stats, l_basis, r_basis)
            return new_l, new_r, new_nu

        refresh_now = (state.count % precondition_frequency == 0) & ~first  # s = count; refresh when s % f == 0
        branch = jnp.where(first, 1, jnp.where(refresh_now, 2, 0))
        left_basis, right_basis, nu = jax.lax.switch(
            branch, (keep, initialise, refresh), (left_stats, right_stats, state.left_basis, state.right_basis, nu))
        new_state = SOAPState(optax.safe_int32_increment(state.count), mu, nu, left_stats, right_stats,
                              left_basis, right_basis)
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def preconditioner_condition(nu: jax.Array, plan: Plan, eps: float) -> jax.Array:
    """Per block, (*stack, R, C): max / min over the block's true entries of √V + eps, the
    denominator SOAP divides the rotated first moment by (its bias correction is one scalar per
    update and cancels): the condition number of the diagonal preconditioner in the eigenbasis.
    The padded entries (exactly zero) are left out."""
    d_RxCxMxN = jnp.sqrt(to_blocks(nu, plan)) + eps
    valid = valid_mask(plan) > 0
    hi = jnp.max(jnp.where(valid, d_RxCxMxN, 0.0), axis=(-2, -1))
    lo = jnp.min(jnp.where(valid, d_RxCxMxN, jnp.inf), axis=(-2, -1))
    return hi / lo


@dataclass(frozen=True)
class SOAP(Optimizer):
    """SOAP direction -> decoupled weight decay -> learning rate; Adam on the groups it does not rotate."""

    b1: float = 0.95
    b2: float = 0.95
    precondition_b2: float | None = None  # the statistics' EMA rate (scale_by_soap's shampoo_beta); None: b2
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_every: int = 10  # scale_by_soap's precondition_frequency
    max_precondition_dim: int = 10000
    block_size: int | None = None
    precondition_embed_head: bool = True

    SOAP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps", "precondition_b2")
    ADAM_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")

    def rotates(self, group: str) -> bool:
        """Whether `group` runs SOAP (matrices) rather than Adam (scalar; embed/head when asked)."""
        return group == "hidden" or (group in ("embed", "head") and self.precondition_embed_head)

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """Groups that run Adam have no statistics, so no precondition_b2."""
        return self.SOAP_KNOBS if self.rotates(group) else self.ADAM_KNOBS

    def group_knob_hint(self, group: str, knob: str) -> str:
        return (f"the {group} group runs Adam under SOAP (biases and norm gains always; embed/head with "
                "optimizer.precondition_embed_head=false): it has no statistics; set b1, b2 or eps instead")

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2", "precondition_b2")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "eps")
        for knob in ("precondition_every", "max_precondition_dim", "block_size"):
            value = getattr(self, knob)
            if value is None and knob == "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " or null (no blocking)" if knob == "block_size" else ""
                raise ConfigError(f"{prefix}.{knob}={value!r} must be a positive integer{hint}")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if not self.rotates(group):
            return optax.adamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        return optax.chain(
            scale_by_soap(b1=self.b1, b2=self.b2, shampoo_beta=self.precondition_b2, eps=self.eps,
                          precondition_frequency=self.precondition_every,
                          max_precondition_dim=self.max_precondition_dim, block_size=self.block_size,
                          labels=lambda tree: jax.tree.map(lambda _: group, tree)),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """Rotated groups: precond_cond_max / precond_cond_median over every block of every
        rotated leaf (`preconditioner_condition`) and eigenbasis_refreshes (`refreshes`: the
        eigenbases computed so far, the first eigh included). Adam groups: sqrt_v_min / _median /
        _max. No eigh: a few reductions over the second moment."""
        if not self.rotates(group):
            return adam_sqrt_v(group_state, self.b2)
        states = find_states(group_state, SOAPState)
        if not states:
            return {}
        state, conds = states[0], []

        def collect(nu, param):
            if is_array(nu) and is_array(param) and param.ndim >= 2:
                plan = leaf_plans(param, None, param.ndim - 2, self.block_size or self.max_precondition_dim,
                                  self.max_precondition_dim)
                if plan.kind == "matrix":
                    conds.append(preconditioner_condition(nu, plan, self.eps).reshape(-1))

        jax.tree.map(collect, state.nu, params, is_leaf=is_masked)
        if not conds:
            return {}
        cond = jnp.concatenate(conds)
        return {"precond_cond_max": jnp.max(cond), "precond_cond_median": median_nonneg(cond),
                "eigenbasis_refreshes": refreshes(state.count, self.precondition_every)}
