"""optimizer/kron.py against a float64 NumPy PSGD Kron written from Li's whitening preconditioner
fit (Q <- Q - lr·triu(A Aᵀ - B̄ B̄ᵀ)/‖A Aᵀ + B̄ B̄ᵀ‖·Q with A = Q G, B̄ = Q⁻ᵀ V), with the update
schedule, damping, norm bound and RMS clip of psgd_jax. The probes V are random: the reference
is given the same V (drawn by kron.probes from the transform's fixed key, as the update draws
them), so what is checked is everything the update does with them. Factor rebalancing (1% of
updates) rescales Q_L and Q_R by c and 1/c, which changes neither A, B̄ nor P in exact
arithmetic, so the reference leaves it out; it is checked on its own. Tiny matrices, jitted."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, rounding_rtol, sum_atol

from models.gpt import GPT, GPTConfig, param_labels
from optimizer import make_optimizer
from optimizer.diagnostics import optimizer_metrics
from optimizer.kron import Kron, KronState, balance, norm_lower_bound, probes, scale_by_kron
from utils.errors import ConfigError

DAMPING = np.sqrt(EPS32)
B1, PRECOND_LR = 0.9, 0.1


# --- the reference ---------------------------------------------------------------------------------


def np_lower_bound(a):
    """psgd's cheap spectral-norm lower bound of a symmetric matrix: from its row of largest norm,
    one power step; also the relative gap between the two largest row norms (the row chosen must
    not depend on rounding)."""
    max_abs = np.abs(a).max()
    a = a / max_abs
    rows = np.sum(a * a, axis=1)
    j = int(np.argmax(rows))
    x = a @ a[j]
    top2 = np.sort(rows)[-2:]
    return max_abs * np.linalg.norm(a.T @ (x / np.linalg.norm(x))), (top2[1] - top2[0]) / top2[1]


def np_kron(grads, vs, updates, diag=(False, False)):
    """Kron on one matrix (or a vector: one factor) in float64: (directions, the smallest row-norm
    gap any lower bound saw, the largest condition number of a triangular factor).
    `updates[t]`: whether update t fits the preconditioner; `diag`: which factors are diagonal."""
    shape = grads[0].shape
    qs = [np.ones(size) if d else np.eye(size) for size, d in zip(shape, diag)]
    mom = np.zeros(shape)
    out, gaps, conds = [], [1.0], [1.0]

    def apply(q, x, axis, inverse_transpose=False):
        if q.ndim == 1:
            q = 1 / q if inverse_transpose else q
            return x * (q[:, None] if x.ndim == 2 and axis == 0 else q)
        q = np.linalg.inv(q).T if inverse_transpose else q
        return q @ x if (axis == 0 or x.ndim == 1) else x @ q.T

    for t, (g, v, fit) in enumerate(zip(grads, vs, updates), 1):
        mom = B1 * mom + (1 - B1) * np.asarray(g, np.float64)
        m_hat = mom / (1 - B1**t)
        if fit:
            v = np.asarray(v, np.float64)
            a, b = m_hat + DAMPING * np.mean(np.abs(m_hat)) * v, v
            for axis, q in enumerate(qs):  # A = Q_L G Q_Rᵀ, B̄ = Q_L⁻ᵀ V Q_R⁻¹
                a = apply(q, a, axis)
                if q.ndim == 2 and axis == 1:
                    b = b @ np.linalg.inv(q)
                else:
                    b = apply(q, b, axis, inverse_transpose=True)
            new = []
            for axis, q in enumerate(qs):
                if a.ndim == 1:
                    ta, tb = a * a, b * b
                elif q.ndim == 1:
                    ta, tb = np.sum(a * a, axis=1 - axis), np.sum(b * b, axis=1 - axis)
                else:
                    ta, tb = (a @ a.T, b @ b.T) if axis == 0 else (a.T @ a, b.T @ b)
                if q.ndim == 1:
                    new.append(q - PRECOND_LR * (ta - tb) * q / np.abs(ta + tb).max())
                else:
                    bound, gap = np_lower_bound(ta + tb)
                    gaps.append(gap)
                    new.append(q - PRECOND_LR * np.triu(ta - tb) / bound @ q)
                    conds.append(np.linalg.cond(new[-1]))
            qs = new
        p = m_hat
        for axis, q in enumerate(qs):  # P m̂ = Q_Lᵀ Q_L m̂ Q_Rᵀ Q_R
            if q.ndim == 1:
                p = p * ((q * q)[:, None] if p.ndim == 2 and axis == 0 else q * q)
            else:
                p = q.T @ q @ p if axis == 0 else p @ q.T @ q
        out.append(p / max(1.0, np.sqrt(np.mean(p * p)) / 1.1))
    return out, min(gaps), max(conds)


def tolerance(cond):
    """Relative (Frobenius) tolerance of a direction: each preconditioner update is a few products
    and one triangular solve per factor (error ~EPS32·cond(Q)·√n of the result), carried forward
    through <= 6 updates and applied twice per factor in P m̂: 100·EPS32·cond(Q) covers that."""
    return 100 * EPS32 * cond


# --- helpers ---------------------------------------------------------------------------------------


def run(tx, grads_seq, seed=0):
    """Jitted init + updates -> (updates as NumPy, states, the V each update drew)."""
    state = jax.jit(tx.init)(grads_seq[0])
    update = jax.jit(tx.update)
    draw = jax.jit(lambda count, tree: probes(seed, count, tree))
    outs, states, vs = [], [], []
    for g in grads_seq:
        vs.append(jax.tree.map(np.asarray, draw(state.count, g)[1]))
        u, state = update(g, state)
        outs.append(jax.tree.map(np.asarray, u))
        states.append(state)
    return outs, states, vs


def random_grads(shapes: dict, steps: int, seed=0):
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)]


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def assert_matches(outs, key, ref, gap, cond, where=""):
    assert gap > 1e-3, f"{where}: a near-tie between row norms ({gap:.1e}) would make the bound rounding-dependent"
    for t, r in enumerate(ref):
        err = rel_err(outs[t][key], r)
        assert err < tolerance(cond), f"{where} update {t + 1}: {err:.2e} (tolerance {tolerance(cond):.2e})"


# --- against the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 4), (4, 4), (3, 6)])
def test_matrix_matches_numpy_over_six_updates(shape):
    """Both factors triangular; the preconditioner is fitted on every update (the schedule's
    flat start)."""
    grads = random_grads({"w": shape}, 6, seed=shape[0])
    outs, states, vs = run(scale_by_kron(B1, PRECOND_LR), grads)
    ref, gap, cond = np_kron([g["w"] for g in grads], [v["w"] for v in vs], [True] * 6)
    assert_matches(outs, "w", ref, gap, cond)
    assert states[-1].q_left["w"].shape == (shape[0], shape[0])
    assert np.all(np.tril(np.asarray(states[-1].q_left["w"]), -1) == 0)  # stays upper-triangular


def test_diagonal_factors_and_vectors_match_numpy():
    """max_size_triangular 4: the 6-long side of a 6x3 matrix gets a diagonal factor; a
    memory_save_mode=all_diag matrix two; a `scalar`-labelled (2, 5) leaf is two vectors with one
    diagonal factor each."""
    grads = random_grads({"w": (6, 3), "b": (2, 5)}, 6, seed=7)
    outs, states, vs = run(scale_by_kron(B1, PRECOND_LR, max_size_triangular=4, labels={"w": "hidden", "b": "scalar"}),
                           grads)
    assert states[-1].q_left["w"].shape == (6,) and states[-1].q_right["w"].shape == (3, 3)
    assert states[-1].q_left["b"] is None and states[-1].q_right["b"].shape == (2, 5)
    ref, gap, cond = np_kron([g["w"] for g in grads], [v["w"] for v in vs], [True] * 6, diag=(True, False))
    assert_matches(outs, "w", ref, gap, cond, "one diagonal")
    for i in range(2):
        ref, gap, cond = np_kron([g["b"][i] for g in grads], [v["b"][i] for v in vs], [True] * 6, diag=(True,))
        assert_matches([{"b": o["b"][i]} for o in outs], "b", ref, gap, cond, f"vector {i}")
    outs, _, vs = run(scale_by_kron(B1, PRECOND_LR, memory_save_mode="all_diag"), [{"w": g["w"]} for g in grads])
    ref, gap, cond = np_kron([g["w"] for g in grads], [v["w"] for v in vs], [True] * 6, diag=(True, True))
    assert_matches(outs, "w", ref, gap, cond, "all diagonal")


def test_stacked_leaf_is_one_kron_per_matrix():
    """(3, 4, 5) labelled hidden: three independent 4x5 Krons (own factors, damping and clip)."""
    grads = random_grads({"w": (3, 4, 5)}, 5, seed=8)
    outs, states, vs = run(scale_by_kron(B1, PRECOND_LR, labels={"w": "hidden"}), grads)
    assert states[-1].q_left["w"].shape == (3, 4, 4)
    for i in range(3):
        ref, gap, cond = np_kron([g["w"][i] for g in grads], [v["w"][i] for v in vs], [True] * 5)
        assert_matches([{"w": o["w"][i]} for o in outs], "w", ref, gap, cond, f"slice {i}")


def test_update_schedule_after_the_flat_start():
    """flat_start 0, max 0.5, decay 0: p = 0.5, so the preconditioner is fitted on every second
    update (the counter reaching 1/p), and held in between."""
    grads = random_grads({"w": (4, 3)}, 6, seed=9)
    tx = scale_by_kron(B1, PRECOND_LR, update_prob_max=0.5, update_prob_min=0.5, update_prob_decay=0.0,
                       update_prob_flat_start=0)
    outs, states, vs = run(tx, grads)
    fits = [False, True] * 3
    previous = np.eye(4)
    for state, fit in zip(states, fits):
        q = np.asarray(state.q_left["w"])
        assert np.array_equal(q, previous) != fit
        previous = q
    ref, gap, cond = np_kron([g["w"] for g in grads], [v["w"] for v in vs], fits)
    assert_matches(outs, "w", ref, gap, cond)


# --- the pieces ------------------------------------------------------------------------------------


def test_balance_keeps_the_product_and_equalises_max_norms():
    rng = np.random.default_rng(10)
    q1, q2 = np.triu(rng.normal(size=(4, 4))) * 100, np.triu(rng.normal(size=(3, 3))) / 100
    b1, b2 = balance([jnp.asarray(q1), jnp.asarray(q2)])
    # per entry of b1 ⊗ b2 = q1 ⊗ q2 · g²/(n1·n2), g = √(n1·n2): the inputs' float32 rounding (2), the
    # norms' product (1), the power (counted twice: squared), the two ratios and scalings (4); zeros stay 0
    np.testing.assert_allclose(np.kron(b1, b2), np.kron(q1, q2), rtol=rounding_rtol(9), atol=0)
    # each max is n·(g/n): a ratio and a product from the same g
    np.testing.assert_allclose(np.abs(b1).max(), np.abs(b2).max(), rtol=rounding_rtol(4))


def test_norm_lower_bound_is_a_lower_bound_within_sqrt_two():
    rng = np.random.default_rng(11)
    for n in (3, 8, 20):
        x = rng.normal(size=(n, n))
        a = x @ x.T
        bound = float(norm_lower_bound(jnp.asarray(a, jnp.float32)))
        ref, _ = np_lower_bound(a)
        # float32: x = a·a_j and aᵀ·x̂ are dots of n terms, each entry within sum_atol(n) of the rows'
        # norms' product, relative to ‖x‖ >= |x_j| = ‖a_j‖² (the largest row): √n·sum_atol(n) in norm,
        # twice, plus the norm's own sum of n squares
        np.testing.assert_allclose(bound, ref, rtol=(2 * np.sqrt(n) + 1) * sum_atol(n, 1.0))
        # float64 on both sides (~n·2^-53 ≈ 1e-15 of rounding): 1e-12 is room, not a tolerance of float32
        assert ref <= np.linalg.norm(a, 2) * (1 + 1e-12) and np.linalg.norm(a, 2) <= np.sqrt(2) * ref
    assert float(norm_lower_bound(jnp.zeros((3, 3)))) == 0.0


def test_probes_are_a_function_of_the_seed_and_count():
    tree = {"a": jnp.zeros((3, 4)), "b": jnp.zeros((5,))}
    first = probes(0, jnp.int32(3), tree)[1]
    again = probes(0, jnp.int32(3), tree)[1]
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(x, y)
    for other in (probes(1, jnp.int32(3), tree)[1], probes(0, jnp.int32(4), tree)[1]):
        assert not np.allclose(other["a"], first["a"])
    assert not np.allclose(first["a"].ravel()[:5], first["b"])  # leaves draw from different keys


# --- in the optimizer ------------------------------------------------------------------------------


@pytest.mark.slow  # a whole step of an optimizer outside helpers.QUICK_OPTIMIZERS
def test_groups_state_and_preconditioner_norm_diagnostic():
    """Every group runs Kron (scalar as stacks of vectors); no zero-size state; two jitted updates
    move every weight; precond_norm_* are psgd's cheap estimate of ‖P‖₂ per matrix: the NumPy
    lower bound of each triangular factor's Qᵀ Q (max q² for a diagonal one) multiplied, and
    within [‖P‖₂/2, ‖P‖₂] of the exact norm (NumPy's SVD)."""
    cfg = GPTConfig(dim=16, num_heads=2, num_blocks=2, context_length=8, vocab_size=32, tie_embeddings=False)
    model = eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(12)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    labels = param_labels(model)
    hp = Kron(weight_decay=0.1)
    tx = make_optimizer(hp, optax.constant_schedule(1e-2), labels, 1.0)

    update = jax.jit(tx.update)  # one compilation, two updates
    _, state = update(grads, jax.jit(tx.init)(params), params)
    updates, state = update(grads, state, params)
    assert all(x.size > 0 for x in jax.tree.leaves(state))
    for u in jax.tree.leaves(updates):
        assert np.all(np.isfinite(u)) and np.any(u != 0)
    metrics = jax.jit(lambda s, p: optimizer_metrics(hp, s, p))(state, params)
    for group in ("hidden", "embed", "head", "scalar"):
        kron = state[1].inner_states[group].inner_state[0]
        assert isinstance(kron, KronState)
        estimates, exact = [], []
        for ql, qr in zip(jax.tree.leaves(kron.q_left, is_leaf=lambda x: x is None), jax.tree.leaves(kron.q_right)):
            ql = None if ql is None else np.asarray(ql, np.float64)
            qr = np.asarray(qr, np.float64)
            stack = qr.shape[:-2] if group != "scalar" else qr.shape[:-1]
            for index in np.ndindex(*stack):
                estimate = norm = 1.0
                for q in (ql, qr):
                    if q is None:
                        continue
                    if q[index].ndim == 2:
                        bound, gap = np_lower_bound(q[index].T @ q[index])
                        assert gap > 1e-4  # the row the bound starts from does not depend on rounding
                        estimate *= bound
                        norm *= np.linalg.norm(q[index], 2) ** 2
                    else:
                        estimate *= np.max(q[index] ** 2)
                        norm *= np.max(q[index] ** 2)
                estimates.append(estimate)
                exact.append(norm)
        estimates, exact = np.array(estimates), np.array(exact)
        # float64 (products of a few float64 norms, ~1e-15 of rounding): 1e-9 is room for that alone
        assert np.all(estimates <= exact * (1 + 1e-9)) and np.all(estimates >= exact / 2)
        # float32: a product of two small factors, then one power step: ~10 EPS32 of relative error
        for stat, value in (("max", estimates.max()), ("min", estimates.min()), ("median", np.median(estimates))):
            # ~10 EPS32 (above) with 8x room
            np.testing.assert_allclose(metrics[f"optim/{group}/precond_norm_{stat}"], value, rtol=1e-5)
        assert estimates.max() != 1.0  # fitted: no longer the identity


@pytest.mark.parametrize(("knob", "value"), [
    ("momentum", 1.0), ("weight_decay", -0.1), ("precondition_lr", 0.0), ("precondition_init_scale", -1.0),
    ("max_size_triangular", 0), ("memory_save_mode", "smart_one_diag"), ("update_prob_min", 0.0),
    ("update_prob_max", 1.5), ("update_prob_decay", -1.0), ("update_prob_flat_start", -1),
])
def test_bad_knobs_are_config_errors(knob, value):
    Kron().check("optimizer")  # the defaults pass
    with pytest.raises(ConfigError, match=rf"^optimizer\.{knob}="):
        dataclasses.replace(Kron(), **{knob: value}).check("optimizer")
