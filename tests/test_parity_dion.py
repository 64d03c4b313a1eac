"""Parity tier: Dion against a float64 NumPy re-derivation of microsoft/dion's `dion/dion.py` (the
algorithm they ship, github.com/microsoft/dion at commit 0a059a4542e5aa74b40dcd1dce363836c7afcd48:
`dion_update_ddp` with `_init_opt_state_dion`, `orthogonalize`, `fix_all_zero_or_nan`,
`column_normalize` and `foreach_baddbmm_`), stepped beside ours on the same weights, gradients and
initial Q. No installable package exists (microsoft/dion is not on PyPI), so the reference is
written here from their code, in their orientation (PyTorch's weights are out×in, ours d_in×d_out:
the reference steps the transposes).

Set up to be the same algorithm: their randomised Cholesky QR of a tall P and Householder QR of a
square one both compute P's Q factor, unique once R's diagonal is positive (made so here; ours is
Gram–Schmidt with re-orthogonalisation, positive by construction);
their Q starts from torch.randn, which no seed reproduces here, so the reference starts from ours.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32

from optimizer.diagnostics import find_states
from optimizer.dion import Dion, DionState, dion_rank

LR, WD, MU = 0.01, 0.1, 0.9
STEPS = 5
# (num_blocks, d_in, d_out): wide (out > in: their is_transposed=False), tall (transposed), square.
SHAPES = {"wide": (2, 8, 12), "tall": (2, 12, 8), "square": (1, 8, 8)}


def reference_step(x_OxI, g_OxI, m_OxI, q_NxR, lr, mu, wd, eps):
    """One of microsoft/dion's `dion_update_ddp` on one out×in matrix, float64: (x, m, q) after it,
    and the κ₂ of the P it orthonormalised."""
    m_OxI = m_OxI + g_OxI
    fan_out, fan_in = x_OxI.shape
    transposed = fan_out < fan_in
    a = m_OxI.T if transposed else m_OxI
    p0 = a @ q_NxR
    p, r_tri = np.linalg.qr(p0)
    p = p * np.where(np.diag(r_tri) < 0, -1.0, 1.0)  # the Q factor with a positive-diagonal R
    r = a.T @ p
    if np.all(a == 0):  # fix_all_zero_or_nan
        p, r = np.zeros_like(p), q_NxR
    ef = p @ r.T
    m_OxI = m_OxI - (1 - mu) * (ef.T if transposed else ef)
    q_new = r / (np.linalg.norm(r, axis=0, keepdims=True) + eps)
    u = p @ q_new.T
    x_OxI = (1 - lr * wd) * x_OxI - math.sqrt(fan_out / fan_in) * lr * (u.T if transposed else u)
    return x_OxI, m_OxI, q_new, np.linalg.cond(p0)


def dion_atol(kappas: list[float], m: int, n: int, scale: float) -> float:
    """atol of a float32 Dion quantity of size `scale` against float64 after the steps whose Ps had
    condition numbers `kappas`. Per step the inputs of the QR (A·Q: n-term dots) and the products
    after it (Aᵀ·P, P·Rᵀ, P·Qᵀ: m-, r- and r-term dots) err by <= (m + n)·EPS32 relative (Higham
    §3.1, worst case: (k+1)·u per k-term dot, u = EPS32/2, summed over the chain), and the Q factor
    by κ₂(P) times its input's relative error plus the factorisation's own error, γ(m·r) ≈ m·r·u
    times κ₂ for Householder QR (Higham Thm 19.4) and the same order for Gram–Schmidt with one
    re-orthogonalisation (Giraud et al. 2005) (m·r <= 12·8 here, taken as (m + n)² / 4 to bound it). The state (buffer,
    Q) carries each step's error into the next, where it passes the next QR's κ₂ again: summed over
    the steps, each step's term times its own κ₂ (first order). All worst cases already (measured:
    10³-10⁴ below it); 2x margin. κ₂ is what the random start Q₀ makes it: the first A·Q₀ of a
    full-rank block reaches 10²-10⁴ here, later ones 3-60."""
    per_step = (m + n) * EPS32 + (m + n) ** 2 / 4 * EPS32 / 2
    return 2 * sum(k * per_step for k in kappas) * scale


@pytest.mark.parametrize("rank_fraction", [1.0, 0.5])
def test_dion_matches_a_float64_rederivation_of_microsoft_dion(rank_fraction):
    """The hidden group per block over STEPS updates: the weight after each update (lr, the shape
    factor √(fan_out/fan_in), decoupled decay), the error-feedback buffer and Q, at full rank and at
    half rank (where the buffer keeps a real residual)."""
    hp = Dion(momentum=MU, weight_decay=WD, rank_fraction=rank_fraction)
    rng = np.random.default_rng(3)
    params = {k: (0.1 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]
    tx = hp.transform("hidden", optax.constant_schedule(LR))

    @jax.jit
    def step(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    p, state = dict(params), tx.init(params)
    q0 = find_states(state, DionState)[0].q
    blocks = {(k, b): (params[k][b].T.astype(np.float64), np.zeros(SHAPES[k][1:][::-1]),
                       np.asarray(q0[k][b], np.float64)) for k, s in SHAPES.items() for b in range(s[0])}
    kappas = {key: [] for key in blocks}
    for g in grads:
        p, state = step(p, state, g)
        dion = find_states(state, DionState)[0]
        for (k, b), (x, m, q) in list(blocks.items()):
            x, m, q, kappa = reference_step(x, g[k][b].T.astype(np.float64), m, q, LR, MU, WD, hp.eps)
            blocks[k, b] = (x, m, q)
            kappas[k, b].append(kappa)
            d_in, d_out = SHAPES[k][1:]
            assert q.shape[-1] == dion_rank(SHAPES[k], rank_fraction, 1)
            # The weight moves by lr·√(fan_out/fan_in)·P Qᵀ (entries <= 1: unit columns times an
            # orthonormal P) and rounds once per update on our side (EPS32/2 of |x|).
            step_scale = LR * math.sqrt(d_out / d_in)
            atol = dion_atol(kappas[k, b], d_in, d_out, step_scale) + len(kappas[k, b]) * EPS32 * np.abs(x).max()
            np.testing.assert_allclose(np.asarray(p[k][b], np.float64), x.T, rtol=0, atol=atol, err_msg=f"{k}[{b}] x")
            m_atol = dion_atol(kappas[k, b], d_in, d_out, np.abs(m).max())
            np.testing.assert_allclose(np.asarray(dion.momentum[k][b], np.float64), m.T, rtol=0, atol=m_atol,
                                       err_msg=f"{k}[{b}] m")
            np.testing.assert_allclose(np.asarray(dion.q[k][b], np.float64), q, rtol=0,
                                       atol=dion_atol(kappas[k, b], d_in, d_out, 1.0), err_msg=f"{k}[{b}] q")
    # The reference's weights moved by far more than the tolerances: the comparison says something.
    assert all(np.abs(x.T - params[k][b]).max() > 10 * dion_atol(kappas[k, b], *SHAPES[k][1:], LR)
               for (k, b), (x, _, _) in blocks.items())


def test_an_all_zero_buffer_steps_nothing_and_keeps_q():
    """The authors' fix_all_zero_or_nan: a zero gradient on a zero buffer gives P = 0 (no step, no
    NaN from the QR of a zero matrix) and R = the old Q, whose normalised columns become the new Q."""
    hp = Dion(weight_decay=0.0)
    tx = hp.transform("hidden", optax.constant_schedule(LR))
    params = {"w": jnp.ones((2, 8, 12), jnp.float32)}
    state = tx.init(params)
    u, after = jax.jit(tx.update)({"w": jnp.zeros((2, 8, 12), jnp.float32)}, state, params)
    assert np.array_equal(np.asarray(u["w"]), np.zeros((2, 8, 12)))
    q0 = np.asarray(find_states(state, DionState)[0].q["w"], np.float64)
    want = q0 / (np.linalg.norm(q0, axis=-2, keepdims=True) + hp.eps)
    # one norm (8 squares summed: sum_atol's 9·u) and a division: ~10 roundings of size-1 entries, 2x
    np.testing.assert_allclose(np.asarray(find_states(after, DionState)[0].q["w"]), want, rtol=0, atol=20 * EPS32)
