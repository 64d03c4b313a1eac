"""Block-partitioned Kronecker-factor statistics of matrix parameters, shared by Shampoo and SOAP.

Both keep, for each block of a gradient matrix G (m×n), a left statistic L (bm×bm) and a right
one R (bn×bn): L <- beta·L + (1-beta)·G Gᵀ, R <- beta·R + (1-beta)·Gᵀ G (beta = 1: plain sums).
They differ in what they do with them (Shampoo: inverse roots; SOAP: eigenbases), so this module
holds only what decides and computes the statistics:

  * which leaves are matrices (`leaf_plans`): with `labels`, `scalar` leaves are not; every other
    leaf with ndim >= 2 is a stack of matrices (its last two axes the matrix, every leading axis a
    stack axis: the scan-stacked `hidden` weights are (num_blocks, d_in, d_out)). Without labels,
    `stacked_leading_axes` says how many leading axes are stack axes, and a leaf with exactly two
    axes left is a matrix. A matrix side longer than `max_dim` gets no statistic; both sides too
    long: not a matrix ("diag", whatever the optimizer does with those).
  * the blocking (`to_blocks`/`from_blocks`): a side longer than `block_size` is cut into blocks
    (the last one zero-padded); each block has its own L and R, shaped (*stack, R, C, b, b). Zero
    rows add zero to R and a zero block to L, so the true entries equal the per-block computation
    on the true sub-blocks. A side that gets no statistic is not cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optimizer.trees import map_unzipped

HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls in full precision (GPUs default to TF32)


@dataclass(frozen=True)
class Plan:
    """How one leaf is treated; static (Python ints), derived from its shape alone."""

    kind: str  # "skip" (not an array: MaskedNode/None), "diag" (not a matrix) or "matrix"
    m: int = 0  # matrix rows / cols (the last two axes)
    n: int = 0
    bm: int = 0  # block rows / cols
    bn: int = 0
    rows: int = 1  # blocks along m / n
    cols: int = 1
    left: bool = False  # whether the side has a statistic (m <= max_dim / n <= max_dim)
    right: bool = False

    def padded(self) -> bool:
        return self.rows * self.bm != self.m or self.cols * self.bn != self.n

    def has(self, side: str) -> bool:
        return self.kind == "matrix" and (self.left if side == "left" else self.right)

    def block(self, side: str) -> int:
        return self.bm if side == "left" else self.bn


def is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def is_function(labels) -> bool:
    """A function params -> labels, not a labels tree; as optax decides for masks (an Equinox
    model of labels is itself callable, but its leaves are strings)."""
    leaves = jax.tree.leaves(labels)
    return bool(leaves) and all(callable(leaf) for leaf in leaves)


def plan_leaf(x, matrix: bool, block_size: int, max_dim: int) -> Plan:
    if not is_array(x):
        return Plan("skip")
    if not matrix:
        return Plan("diag")
    m, n = x.shape[-2:]
    left, right = m <= max_dim, n <= max_dim
    if not (left or right):
        return Plan("diag")
    bm = min(m, block_size) if left else m
    bn = min(n, block_size) if right else n
    return Plan("matrix", m, n, bm, bn, -(-m // bm), -(-n // bn), left, right)


def leaf_plans(tree, labels: Any, stacked_leading_axes: int | Callable[[jax.Array], int], block_size: int,
               max_dim: int):
    """A `Plan` per leaf of `tree` (see the module docstring). labels: a tree of group names like
    the params, or a function params -> such a tree, or None (then `stacked_leading_axes`)."""
    if labels is None:
        def plan(x):
            stack = stacked_leading_axes(x) if callable(stacked_leading_axes) else stacked_leading_axes
            return plan_leaf(x, x.ndim - stack == 2, block_size, max_dim)

        return jax.tree.map(plan, tree)
    tree_labels = labels(tree) if is_function(labels) else labels

    def plan_labelled(label, x):
        return plan_leaf(x, label != "scalar" and is_array(x) and x.ndim >= 2, block_size, max_dim)

    # Labels first: where a param is a MaskedNode/None (another group's leaf), the whole subtree
    # arrives as `x` and the leaf is skipped.
    return jax.tree.map(plan_labelled, tree_labels, tree)


def for_each(fn, plan_tree, *trees):
    """fn(plan, *leaves) on the array leaves; a skipped position keeps the first tree's subtree."""
    return jax.tree.map(lambda plan, x, *rest: x if plan.kind == "skip" else fn(plan, x, *rest), plan_tree, *trees)


def for_each_unzipped(fn, n: int, plan_tree, *trees) -> tuple:
    """`for_each` with fn returning n values per leaf: n trees, each like the first tree (a
    skipped position keeps its subtree in all n)."""
    return map_unzipped(lambda plan, x, *rest: (x,) * n if plan.kind == "skip" else fn(plan, x, *rest), n,
                        plan_tree, *trees)


def to_blocks(x_MxN: jax.Array, plan: Plan) -> jax.Array:
    """(..., m, n) -> (..., R, C, bm, bn), zero-padded to whole blocks; an (..., R·bm, C·bn) array
    (already whole blocks, as `from_blocks(..., crop=False)` gives) is only regrouped."""
    lead = x_MxN.shape[:-2]
    pad_m, pad_n = plan.rows * plan.bm - x_MxN.shape[-2], plan.cols * plan.bn - x_MxN.shape[-1]
    x = jnp.pad(x_MxN, [(0, 0)] * len(lead) + [(0, pad_m), (0, pad_n)]) if pad_m or pad_n else x_MxN
    return jnp.swapaxes(x.reshape(*lead, plan.rows, plan.bm, plan.cols, plan.bn), -3, -2)


def from_blocks(x_RxCxMxN: jax.Array, plan: Plan, crop: bool = True) -> jax.Array:
    """(..., R, C, bm, bn) -> (..., m, n), or with crop=False (..., R·bm, C·bn), padding kept."""
    lead = x_RxCxMxN.shape[:-4]
    x = jnp.swapaxes(x_RxCxMxN, -3, -2).reshape(*lead, plan.rows * plan.bm, plan.cols * plan.bn)
    return x[..., : plan.m, : plan.n] if crop else x


def valid_mask(plan: Plan) -> np.ndarray:
    """1 on the true entries of the blocked layout, 0 on the padding (a trace-time constant)."""
    ones = np.ones((plan.m, plan.n), np.float32)
    pad = np.pad(ones, [(0, plan.rows * plan.bm - plan.m), (0, plan.cols * plan.bn - plan.n)])
    return pad.reshape(plan.rows, plan.bm, plan.cols, plan.bn).swapaxes(1, 2)


def side_padding(plan: Plan, side: str) -> np.ndarray:
    """Padded entries per block along `side`, shaped (R, 1) for left and (1, C) for right: nonzero
    on the last block only (a trace-time constant)."""
    b, true_len, blocks = (plan.bm, plan.m, plan.rows) if side == "left" else (plan.bn, plan.n, plan.cols)
    pad = np.maximum(0, (np.arange(blocks) + 1) * b - true_len)
    return pad.reshape(-1, 1) if side == "left" else pad.reshape(1, -1)


def transpose(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _per_matrix(fn, x_BxB: jax.Array):
    """fn (a LAPACK decomposition returning a tuple of arrays) over any leading batch axes; on
    CPU one matrix at a time.

    jaxlib 0.10's CPU LAPACK kernels fan a batch out over XLA's intra-op thread pool and block a
    pool thread until it is done; two batched decompositions running side by side (one per leaf,
    as here) can take every thread of a small pool and wait forever (seen with eigh on a 2-core
    machine; later jaxlibs drop that fan-out). A single matrix is not fanned out, so on CPU the
    batch is walked with lax.map; other backends keep the batched call.
    """

    def one_at_a_time(x):
        flat = x.reshape(-1, *x.shape[-2:])
        outs = jax.lax.map(lambda m: tuple(fn(m)), flat)
        return tuple(o.reshape(*x.shape[:-2], *o.shape[1:]) for o in outs)

    def batched(x):
        return tuple(fn(x))

    return jax.lax.platform_dependent(x_BxB, cpu=one_at_a_time, default=batched)


def eigh(stats_BxB: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(eigenvalues ascending, eigenvectors as columns) of symmetric matrices, batched (`_per_matrix`)."""
    return _per_matrix(jnp.linalg.eigh, stats_BxB)


def qr_q(x_BxB: jax.Array) -> jax.Array:
    """The orthogonal factor Q of x = QR for square matrices, batched (`_per_matrix`)."""
    return _per_matrix(lambda m: (jnp.linalg.qr(m)[0],), x_BxB)[0]


def stats_shape(plan: Plan, x, side: str) -> tuple[int, ...]:
    b = plan.block(side)
    return (*x.shape[:-2], plan.rows, plan.cols, b, b)


def accumulate(stats: jax.Array, outer: jax.Array, beta: float) -> jax.Array:
    """An EMA at rate `beta`; a plain sum for a constant beta of 1 (a traced beta is an EMA's)."""
    if isinstance(beta, (int, float)) and beta == 1.0:
        return stats + outer
    return beta * stats + (1.0 - beta) * outer


def block_outer(g_RxCxMxN: jax.Array, side: str) -> jax.Array:
    """G Gᵀ (left) or Gᵀ G (right) of every block, in full float32 precision."""
    if side == "left":
        return jnp.matmul(g_RxCxMxN, transpose(g_RxCxMxN), precision=HIGHEST)
    return jnp.matmul(transpose(g_RxCxMxN), g_RxCxMxN, precision=HIGHEST)


def update_statistics(plan_tree, grads32, stats_tree, side: str, beta: float):
    """Every leaf's `side` statistics after one more (float32) gradient; leaves without them as they are."""

    def fn(plan, g, stats):
        if not plan.has(side):
            return stats
        return accumulate(stats, block_outer(to_blocks(g, plan), side), beta)

    return for_each(fn, plan_tree, grads32, stats_tree)
