"""Dion (Ahn, Xu, Abreu, Langford et al. 2025, "Dion: Distributed Orthonormalized Updates",
arXiv:2504.05295; microsoft/dion's `dion/dion.py`): low-rank orthonormalised updates with error
feedback for the block matrices, AdamW for the rest.

Muon orthogonalises the whole momentum each step (Newton–Schulz on every d_in×d_out block). Dion
keeps a rank-r factorisation instead, refreshed by ONE power-iteration step per update that starts
from the previous step's right factor Q (so the work is two m×n×r matmuls and an orthonormalisation
of an m×r matrix, and a sharded matrix needs only r-wide collectives). Per block, with A the momentum buffer
laid out with its longer side first (m >= n; the authors' `is_transposed`), Q (n, r):

    A ← A + G                           momentum: the gradient added, not averaged in
    P ← orthonormal basis of A Q        (m, r): the Q factor of its QR, R's diagonal positive
    R ← Aᵀ P                            (n, r)
    A ← A − (1 − momentum) P Rᵀ         error feedback: the buffer keeps what the rank-r update did not
                                        take, and decays by `momentum` only the part it did take
    Q ← R / (‖R's columns‖ + eps)       column-normalised: the next step's warm start
    update = −lr · √(fan_out/fan_in) · P Qᵀ

(An all-zero buffer gives P = 0 and keeps Q, as the authors' `fix_all_zero_or_nan`.) The shape
factor is the authors' √(fan_out/fan_in) (fan_out = d_out, the last axis here; PyTorch's weights
are out×in, ours in×out), without Muon's max(1, ·). The rank is ⌈rank_fraction·min(m, n)⌉ rounded
up to a multiple of `rank_multiple_of`, at most min(m, n) (the authors' `_init_opt_state_dion`);
the default rank_fraction 1 is full rank, the authors' default (they report 1/4 close to full rank
at 3B parameters). Decoupled weight decay times the lr as every optimizer here (the authors'
X·(1 − lr·weight_decay)). There is no Nesterov variant (the authors have none).

The authors orthonormalise a tall P by randomised Cholesky QR and a square one by Householder QR:
two algorithms for the same Q factor (unique once R's diagonal is positive; the signs of P's
columns cancel in P Qᵀ and P Rᵀ). Here it is Gram–Schmidt with re-orthogonalisation
(`orthonormal_basis`), a third algorithm for that factor, with R's diagonal positive by construction.

Q starts as a standard Gaussian (n, r) per block (the authors' `torch.randn`) from a fixed key folded
with the leaf's position in the group, so every run starts from the same Q and a resumed run carries
its own. Stacked weights (num_blocks, d_in, d_out) and MoE stacks (num_blocks, E, d_in, d_out) are
stacks of independent blocks: every leading axis is a batch axis of the matmuls and the orthonormalisation. The
embed, head and scalar groups run AdamW at `adam_lr`, as under Muon (the authors run AdamW or Lion
on their non-matrix parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import adam_sqrt_v, array_leaves, find_states
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError

Q_INIT_SEED = 0  # the fixed key Q's Gaussian start is drawn from (folded with the leaf's index)


class DionState(NamedTuple):
    momentum: Any  # per leaf, shaped like the parameter: the error-feedback momentum buffer
    q: Any  # per leaf (*stack, n, r): the right factor the next power iteration starts from


def dion_rank(shape: tuple[int, ...], rank_fraction: float, rank_multiple_of: int) -> int:
    """r of a stack of d_in×d_out blocks: ⌈rank_fraction·min⌉ up to a multiple, at most min(d_in, d_out)."""
    short = min(shape[-2:])
    r = rank_multiple_of * math.ceil(rank_fraction * short / rank_multiple_of)
    return min(r, short)


def _long_first(x_SxIxO: jax.Array) -> jax.Array:
    """The block with its longer side as rows (the authors' orientation; d_out first on a tie, as
    their out×in matrix is left as it is when out >= in)."""
    d_in, d_out = x_SxIxO.shape[-2:]
    return x_SxIxO if d_in > d_out else jnp.swapaxes(x_SxIxO, -1, -2)


def orthonormal_basis(p_SxMxR: jax.Array) -> jax.Array:
    """The Q factor of P = QR (m >= r, R's diagonal positive) per block, by classical Gram–Schmidt
    with one re-orthogonalisation (CGS2: orthonormal to float32 rounding for any P whose κ₂ is below
    1/EPS32, Giraud et al. 2005), one column after another in a loop of r steps of matrix–vector
    products. Not jnp.linalg.qr: on XLA:CPU its LAPACK call hung the train step (measured with jax
    0.10.2: the tiny GPT's step 13, and the 8-device step; jaxlib's batched LAPACK kernels deadlock
    the intra-op pool when several run at once, bench/jax_qr_hang_repro.py and docs/performance.md),
    and matrix–vector products also run on a P split over devices without gathering it. A column
    that is numerically a combination of the earlier ones (what is left of it <= m·EPS32 of its norm:
    a rank-deficient A·Q) becomes 0, so P·Qᵀ leaves out that direction where a QR would make one up."""
    hi = jax.lax.Precision.HIGHEST
    m, r = p_SxMxR.shape[-2:]
    tiny = m * float(jnp.finfo(jnp.float32).eps)

    def column(j, q_SxMxR):
        p_SxM = jax.lax.dynamic_index_in_dim(p_SxMxR, j, axis=-1, keepdims=False)
        v_SxM = p_SxM
        for _ in range(2):  # columns j.. of q are still 0: they project nothing out
            c_SxR = jnp.einsum("...mr,...m->...r", q_SxMxR, v_SxM, precision=hi)
            v_SxM = v_SxM - jnp.einsum("...mr,...r->...m", q_SxMxR, c_SxR, precision=hi)
        norm = jnp.linalg.norm(v_SxM, axis=-1, keepdims=True)
        kept = norm > tiny * jnp.linalg.norm(p_SxM, axis=-1, keepdims=True)
        v_SxM = jnp.where(kept, v_SxM / jnp.where(kept, norm, 1.0), 0.0)
        return jax.lax.dynamic_update_index_in_dim(q_SxMxR, v_SxM, j, axis=-1)

    return jax.lax.fori_loop(0, r, column, jnp.zeros_like(p_SxMxR))


def dion_block_update(m_SxIxO: jax.Array, g_SxIxO: jax.Array, q_SxNxR: jax.Array, momentum, eps
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the unscaled update P Qᵀ, the new momentum buffer, the new Q) of one stacked leaf, in float32
    (see the module docstring)."""
    hi = jax.lax.Precision.HIGHEST
    buf = m_SxIxO.astype(jnp.float32) + g_SxIxO.astype(jnp.float32)
    a_SxMxN = _long_first(buf)
    q = q_SxNxR.astype(jnp.float32)
    p_SxMxR = orthonormal_basis(jnp.matmul(a_SxMxN, q, precision=hi))
    r_SxNxR = jnp.matmul(jnp.swapaxes(a_SxMxN, -1, -2), p_SxMxR, precision=hi)
    all_zero = jnp.all(a_SxMxN == 0, axis=(-2, -1), keepdims=True)
    p_SxMxR = jnp.where(all_zero, 0.0, jnp.nan_to_num(p_SxMxR))
    r_SxNxR = jnp.where(all_zero, q, jnp.nan_to_num(r_SxNxR))
    a_SxMxN = a_SxMxN - (1 - momentum) * jnp.matmul(p_SxMxR, jnp.swapaxes(r_SxNxR, -1, -2), precision=hi)
    q_new = r_SxNxR / (jnp.linalg.norm(r_SxNxR, axis=-2, keepdims=True) + eps)
    u_SxMxN = jnp.matmul(p_SxMxR, jnp.swapaxes(q_new, -1, -2), precision=hi)
    back = (lambda x: x) if buf.shape[-2] > buf.shape[-1] else (lambda x: jnp.swapaxes(x, -1, -2))
    return back(u_SxMxN), back(a_SxMxN).astype(m_SxIxO.dtype), q_new.astype(q_SxNxR.dtype)


def scale_by_dion(momentum, eps, rank_fraction: float, rank_multiple_of: int) -> optax.GradientTransformation:
    """Dion's direction √(fan_out/fan_in)·P Qᵀ on every leaf of the group (each a stack of d_in×d_out blocks)."""

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        key = jax.random.key(Q_INIT_SEED)

        def q0(i, p):
            r = dion_rank(p.shape, rank_fraction, rank_multiple_of)
            n = min(p.shape[-2:])  # the short side: the columns of the long-side-first block
            return jax.random.normal(jax.random.fold_in(key, i), (*p.shape[:-2], n, r), jnp.float32)

        return DionState(momentum=jax.tree.map(jnp.zeros_like, params),
                         q=treedef.unflatten([q0(i, p) for i, p in enumerate(leaves)]))

    def update_fn(updates, state, params=None):
        del params
        flat, treedef = jax.tree.flatten(updates)
        out = [dion_block_update(m, g, q, momentum, eps) for g, m, q in
               zip(flat, treedef.flatten_up_to(state.momentum), treedef.flatten_up_to(state.q), strict=True)]
        scaled = [u * math.sqrt(g.shape[-1] / g.shape[-2]) for (u, _, _), g in zip(out, flat)]
        return (treedef.unflatten([u.astype(g.dtype) for u, g in zip(scaled, flat)]),
                DionState(momentum=treedef.unflatten([m for _, m, _ in out]),
                          q=treedef.unflatten([q for _, _, q in out])))

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class Dion(Optimizer):
    momentum: float = 0.95  # the authors' mu: the share of the applied rank-r part the buffer keeps
    rank_fraction: float = 1.0  # r / min(d_in, d_out) per block (1: full rank)
    rank_multiple_of: int = 1  # r rounded up to a multiple of this (at most min(d_in, d_out))
    eps: float = 1e-8  # added to R's column norms when Q is normalised
    weight_decay: float = 0.01
    adam_lr: float = 3e-3  # peak lr of the AdamW groups (embed, head, scalar); lr_config.lr is Dion's
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8

    DION_KNOBS: ClassVar[tuple[str, ...]] = ("lr", "weight_decay", "momentum")
    ADAM_KNOBS: ClassVar[tuple[str, ...]] = ("lr", "weight_decay", "adam_b1", "adam_b2", "adam_eps")
    # The rank fixes Q's shape: a compile-time constant, never a traced step argument.
    CONSTANT_KNOBS: ClassVar[tuple[str, ...]] = ("rank_fraction",)
    # model.mup (optimizer/mup.py): P Qᵀ has orthonormal columns on one side and unit columns on the
    # other, times √(fan_out/fan_in): spectrally scaled as Muon's `reference` factor, a constant at a
    # fixed aspect ratio, so the lr transfers across width as it is (the authors' README says the same).
    MUP_HIDDEN_LR_POWER: ClassVar[float] = 0.0

    def group_knobs(self, group: str) -> tuple[str, ...]:
        """`hidden` runs Dion (no adam_*), the other groups AdamW (no Dion momentum)."""
        return self.DION_KNOBS if group == "hidden" else self.ADAM_KNOBS

    def group_knob_hint(self, group: str, knob: str) -> str:
        if group == "hidden":
            return "the hidden group uses Dion, not AdamW; set optimizer.groups.hidden.momentum instead"
        return f"the {group} group uses AdamW under Dion; set optimizer.groups.{group}.adam_b1 instead"

    def default_group_lr(self, group: str, base_lr: float) -> float:
        return base_lr if group == "hidden" else self.adam_lr

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "momentum", "adam_b1", "adam_b2")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "eps", "adam_lr", "adam_eps")
        if not 0 < self.rank_fraction <= 1:
            raise ConfigError(f"{prefix}.rank_fraction={self.rank_fraction} must be in (0, 1]: "
                              f"the rank is rank_fraction x min(d_in, d_out) of each block")
        if self.rank_multiple_of < 1:
            raise ConfigError(f"{prefix}.rank_multiple_of={self.rank_multiple_of} must be a positive integer")

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        if group != "hidden":
            return optax.adamw(schedule, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                               weight_decay=self.weight_decay)
        return optax.chain(
            scale_by_dion(self.momentum, self.eps, self.rank_fraction, self.rank_multiple_of),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """hidden: rank_mean, the mean rank r over the group's blocks (fixed by the shapes and
        rank_fraction), and ef_norm_mean / ef_norm_max, the Frobenius norm per block of the momentum
        buffer the last update left: the error feedback, what the rank-r updates have not yet taken
        (at full rank the share `momentum` of the last applied part and what the one power iteration
        missed). Other groups (AdamW): sqrt_v_min / _median / _max."""
        if group != "hidden":
            return adam_sqrt_v(group_state, self.adam_b2)
        states = find_states(group_state, DionState)
        bufs, qs = (array_leaves(states[0].momentum), array_leaves(states[0].q)) if states else ([], [])
        if not bufs:
            return {}
        norms = jnp.concatenate([jnp.linalg.norm(b.astype(jnp.float32), axis=(-2, -1)).reshape(-1) for b in bufs])
        blocks = [math.prod(q.shape[:-2]) for q in qs]
        rank = sum(n * q.shape[-1] for n, q in zip(blocks, qs)) / sum(blocks)
        return {"rank_mean": jnp.asarray(rank, jnp.float32), "ef_norm_mean": jnp.mean(norms),
                "ef_norm_max": jnp.max(norms)}
