"""optimizer/soap.py against a float64 NumPy SOAP written from the paper's Algorithms 3 and 4 (and
the authors' schedule: update 1 only initialises the eigenbases by eigh, QR refreshes every
`precondition_frequency` updates); plus blocking, padding, one-sided and Adam-only leaves, the
stacked layout, the state (no zero-size leaves) and the knobs. Tiny matrices, jitted updates."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, orthogonality_atol, random_grads, rounding_rtol
from helpers import run_updates as run

from models.gpt import GPT, GPTConfig, param_labels
from optimizer import make_optimizer
from optimizer.blocking import plan_leaf
from optimizer.diagnostics import optimizer_metrics
from optimizer.soap import SOAP, SOAPState, initial_basis, refresh_basis, scale_by_soap
from utils.errors import ConfigError

B1, B2, SHAMPOO_BETA, EPS = 0.9, 0.95, 0.9, 1e-8


# --- the reference ---------------------------------------------------------------------------------


def eig_desc(s):
    """Eigenvectors of a symmetric matrix as columns, eigenvalues descending (the paper's init)."""
    return np.linalg.eigh(s)[1][:, ::-1]


def power_qr(s, q):
    """Algorithm 4: one power-iteration step from the current basis, columns sorted by their
    estimated eigenvalue (descending), then QR; also the order (V is permuted with it)."""
    sq = s @ q
    order = np.argsort(-np.sum(q * sq, axis=0), kind="stable")
    return np.linalg.qr(sq[:, order])[0], order


def conditioning(s, method: str):
    """How much float32 rounding grows in a basis computed from the statistic s, by first-order
    perturbation theory: an eigh eigenvector's error is ~EPS32·λmax/(its eigenvalue gap) (the
    smallest gap taken; infinite when two eigenvalues coincide, as in a null space of dimension
    >= 2, where the eigenvectors are not unique); the Q of a QR of S·Q has ~EPS32·cond(S)
    (infinite for a singular S)."""
    lam = np.linalg.eigvalsh(s)
    tiny = 1e-12 * lam[-1]
    if method == "eigh":
        gap = np.min(np.diff(lam))
        return lam[-1] / gap if gap > tiny else np.inf
    return lam[-1] / lam[0] if lam[0] > tiny else np.inf


def basis_error(ours, ref):
    """max |Q_ours - Q_ref| with each reference column's sign matched to ours (eigenvectors and QR
    columns are defined up to sign; SOAP's update does not depend on it)."""
    signs = np.where(np.sum(ours * ref, axis=0) < 0, -1.0, 1.0)
    return np.abs(ours - ref * signs).max()


def np_soap(grads, freq, left=True, right=True, ours=None):
    """SOAP on one matrix in float64: (directions, [(basis error, its conditioning)], spread).

    `left`/`right` False: that side is not rotated (Q = I). `ours`: our bases after each update
    [(Q_L, Q_R)] (`our_bases`): every basis the reference computes (the eigh of update 1, each
    QR refresh) is compared with ours and ours is carried on, a QR refresh starting from our
    previous basis; so each basis is checked on its own, and the directions check everything
    else free of the bases' rounding (which Adam's division amplifies: see `spread`). `spread`:
    the largest RMS over entries of max√V/√V_ij, how much a rounding of the rotated moments (of
    the same absolute size on every entry) grows through the per-entry division."""
    m, n = grads[0].shape
    stats_l, stats_r, mom1, mom2 = np.zeros((m, m)), np.zeros((n, n)), np.zeros((m, n)), np.zeros((m, n))
    q_l, q_r = np.eye(m), np.eye(n)
    out, checks, spread = [], [], 1.0
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        if t == 1:
            out.append(np.zeros((m, n)))  # update 1 only initialises
        else:
            s = t - 1
            mom1 = B1 * mom1 + (1 - B1) * g
            mom2 = B2 * mom2 + (1 - B2) * (q_l.T @ g @ q_r) ** 2
            denom = np.sqrt(mom2)
            spread = max(spread, np.sqrt(np.mean((denom.max() / denom) ** 2)))
            out.append(q_l @ ((q_l.T @ mom1 @ q_r) / (denom + EPS)) @ q_r.T * np.sqrt(1 - B2**s) / (1 - B1**s))
        stats_l = SHAMPOO_BETA * stats_l + (1 - SHAMPOO_BETA) * g @ g.T
        stats_r = SHAMPOO_BETA * stats_r + (1 - SHAMPOO_BETA) * g.T @ g
        if t > 1 and (t - 1) % freq != 0:
            continue
        new = []
        for axis, (stats, q, on) in enumerate(((stats_l, q_l, left), (stats_r, q_r, right))):
            if on:
                if t == 1:
                    q = eig_desc(stats)
                else:
                    q, order = power_qr(stats, q)
                    mom2 = mom2[order, :] if axis == 0 else mom2[:, order]
                if ours is not None:
                    checks.append((basis_error(ours[t - 1][axis], q), conditioning(stats, "eigh" if t == 1 else "qr")))
                    q = ours[t - 1][axis]
            new.append(q)
        q_l, q_r = new
    return out, checks, spread


# A basis: EPS32·conditioning from the decomposition (`conditioning`), and as much again from
# the float32 statistic it starts from (a few roundings per entry, amplified the same way):
# 10·EPS32·conditioning. A direction, given the bases: each rotated moment entry carries a few
# EPS32 of the largest entry's size (products of three small matrices, <= 8 terms a sum; V and M
# summed over <= 8 updates), grown by Adam's division (`spread`), then rotated back:
# 20·EPS32·spread.
def assert_matches(outs, key, reference, where=""):
    """Update 1 exactly zero; every basis and every later direction within its tolerance."""
    ref, checks, spread = reference
    assert np.all(outs[0][key] == 0.0), where
    for k, (err, kappa) in enumerate(checks):
        assert err <= 10 * EPS32 * kappa, f"{where} basis {k}: {err:.2e} (conditioning {kappa:.1f})"
    for t in range(1, len(ref)):
        err = rel_err(outs[t][key], ref[t])
        assert err < 20 * EPS32 * spread, f"{where} update {t + 1}: {err:.2e} (spread {spread:.1f})"


# --- helpers ---------------------------------------------------------------------------------------




def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def soap(**kw):
    return scale_by_soap(b1=B1, b2=B2, shampoo_beta=SHAMPOO_BETA, eps=EPS, **kw)


def our_bases(states, key, index=(), rows=None, cols=None):
    """[(Q_L, Q_R)] of one block after each update (`index` into the leaf's (*stack, R, C) grid),
    float64, cropped to the block's true rows and columns; the identity for a side not rotated."""
    out = []
    for state in states:
        pair = []
        for side, true in (("left", rows), ("right", cols)):
            q = getattr(state, f"{side}_basis")[key]
            pair.append(np.eye(true) if q is None else np.asarray(q[index], np.float64)[:true, :true])
        out.append(tuple(pair))
    return out


# --- against the reference -------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "freq"), [((6, 6), 1), ((6, 6), 3), ((5, 5), 2)])
def test_square_matrix_matches_numpy_over_eight_updates(shape, freq):
    """Square gradients give full-rank statistics from update 1, so every eigenbasis is unique
    (up to signs, which cancel: V sees squares, the direction Q·(Qᵀ…Q)·Qᵀ both signs)."""
    grads = random_grads({"w": shape}, 8, seed=freq)
    outs, states = run(soap(precondition_frequency=freq), grads)
    ws = [g["w"] for g in grads]
    assert_matches(outs, "w", np_soap(ws, freq, ours=our_bases(states, "w", (0, 0), *shape)))
    # The reference on its own (its own float64 bases all along) agrees as closely as the bases'
    # conditioning allows: 10·EPS32·conditioning per basis, grown by `spread` through Adam.
    ref, checks, spread = np_soap(ws, freq)
    kappa = max(k for _, k in np_soap(ws, freq, ours=our_bases(states, "w", (0, 0), *shape))[1])
    for t in range(1, len(ref)):
        assert rel_err(outs[t]["w"], ref[t]) < 10 * EPS32 * kappa * spread, f"update {t + 1}"


def test_blocks_match_per_block_references():
    """8x8 with block_size 4: four independent 4x4 blocks, each with its own statistics and bases."""
    grads = random_grads({"w": (8, 8)}, 7, seed=4)
    outs, states = run(soap(block_size=4, precondition_frequency=2), grads)
    assert states[-1].left_stats["w"].shape == (2, 2, 4, 4) and states[-1].nu["w"].shape == (8, 8)
    for r in (0, 1):
        for c in (0, 1):
            block = [{"w": o["w"][4 * r:4 * r + 4, 4 * c:4 * c + 4]} for o in outs]
            reference = np_soap([g["w"][4 * r:4 * r + 4, 4 * c:4 * c + 4] for g in grads], 2,
                                ours=our_bases(states, "w", (r, c), 4, 4))
            assert_matches(block, "w", reference, f"block ({r}, {c})")


def _null_basis_cond(stat, b):
    """cond(P·E's first k columns) for `initial_basis` of the float64 statistic `stat` (its true
    block, in a b x b block): P the projector on its k-dimensional null space, E the fixed random
    b x b matrix; the factor by which the fixed null basis's orthogonality to the eigenvectors grows
    (test_a_null_space_gets_a_fixed_basis_that_rounding_does_not_move). 1 with no null space."""
    lam, vecs = np.linalg.eigh(stat)
    k = int(np.sum(lam <= np.sqrt(np.finfo(np.float64).eps) * lam[-1]))  # rank-deficient by construction
    if k == 0:
        return 1.0
    e = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (b, b), jnp.float32), np.float64)
    null = vecs[:, :k]
    return float(np.linalg.cond(null @ null.T @ e[:len(stat), :k]))


def test_padded_blocks_stay_out_of_the_rotation():
    """(2, 6, 7) with block_size 4: rows [0:4, 4:6] x cols [0:4, 4:7], the last blocks zero-padded.
    The bases are blockdiag(Q_true, Q_pad) exactly and orthogonal, the rotated padding of V is
    exactly zero, and each true sub-block follows the reference. (A non-square block's first
    statistic is rank-deficient: its null-space eigenvectors are any basis, unchecked (infinite
    conditioning); the later QR refreshes see full-rank statistics and are checked.)"""
    grads = random_grads({"w": (2, 6, 7)}, 7, seed=5)
    outs, states = run(soap(block_size=4, precondition_frequency=2, labels={"w": "hidden"}), grads)
    nu = np.asarray(states[-1].nu["w"])
    assert nu.shape == (2, 8, 8)
    assert np.all(nu[:, 6:, :] == 0) and np.all(nu[:, :, 7:] == 0) and np.all(nu[:, :6, :7] > 0)
    checked = 0
    for s in range(2):
        for r, (r0, r1) in enumerate([(0, 4), (4, 6)]):
            for c, (c0, c1) in enumerate([(0, 4), (4, 7)]):
                g1 = np.asarray(grads[0]["w"][s, r0:r1, c0:c1], np.float64)
                for side, true in (("left", r1 - r0), ("right", c1 - c0)):
                    first_stat = g1 @ g1.T if side == "left" else g1.T @ g1
                    for t, state in enumerate(states):
                        q = np.asarray(getattr(state, f"{side}_basis")["w"][s, r, c], np.float64)
                        assert np.all(q[:true, true:] == 0) and np.all(q[true:, :true] == 0), (side, s, r, c)
                        # Householder QR (the refreshes) and eigh give orthonormal columns to n·EPS32;
                        # update 1's fixed null basis only as far as cond(P·E) lets it (_null_basis_cond)
                        cond = _null_basis_cond(first_stat, 4) if t == 0 else 1.0
                        np.testing.assert_allclose(q.T @ q, np.eye(4), rtol=0, atol=orthogonality_atol(4, cond))
                reference = np_soap([g["w"][s, r0:r1, c0:c1] for g in grads], 2,
                                    ours=our_bases(states, "w", (s, r, c), r1 - r0, c1 - c0))
                checked += sum(np.isfinite(k) for _, k in reference[1])
                assert_matches([{"w": o["w"][s, r0:r1, c0:c1]} for o in outs], "w", reference,
                               f"slice {s} block ({r}, {c})")
    assert checked >= 2 * 4 * 2 * 3  # every QR refresh (updates 3, 5, 7) of every block side was checked


def test_a_side_longer_than_max_dim_is_not_rotated_and_both_is_adam():
    """6x12 with max_precondition_dim 8: only the left side rotates (the right has no statistic,
    None in the state); 10x12: neither, so plain Adam on that leaf (V param-shaped), with the
    same schedule (update 1 only initialises)."""
    grads = random_grads({"one": (6, 12), "adam": (10, 12)}, 6, seed=6)
    outs, states = run(soap(max_precondition_dim=8, precondition_frequency=2), grads)
    last = states[-1]
    assert last.right_stats["one"] is None and last.right_basis["one"] is None
    assert last.left_stats["one"].shape == (1, 1, 6, 6)
    assert last.left_stats["adam"] is None and last.nu["adam"].shape == (10, 12)
    reference = np_soap([g["one"] for g in grads], 2, right=False, ours=our_bases(states, "one", (0, 0), 6, 12))
    assert_matches(outs, "one", reference, "one-sided")
    assert_matches(outs, "adam", np_soap([g["adam"] for g in grads], 2, left=False, right=False), "adam")


def test_stacked_leaf_is_one_soap_per_slice_and_vectors_take_adam():
    """(3, 5, 5) labelled hidden: three independent 5x5 SOAPs; a `scalar`-labelled leaf is Adam."""
    grads = random_grads({"w": (3, 5, 5), "b": (3, 5)}, 6, seed=7)
    outs, states = run(soap(precondition_frequency=2, labels={"w": "hidden", "b": "scalar"}), grads)
    assert states[-1].left_basis["w"].shape == (3, 1, 1, 5, 5) and states[-1].left_basis["b"] is None
    for i in range(3):
        reference = np_soap([g["w"][i] for g in grads], 2, ours=our_bases(states, "w", (i, 0, 0), 5, 5))
        assert_matches([{"w": o["w"][i]} for o in outs], "w", reference, f"slice {i}")
        reference = np_soap([g["b"][i][None] for g in grads], 2, left=False, right=False)
        assert_matches([{"b": o["b"][i][None]} for o in outs], "b", reference, f"vector {i}")


def test_eigh_on_update_one_and_qr_refreshes_on_schedule():
    """The bases change on updates 1, 1+f, 1+2f, ... only (f = 3), as the reference's QR step
    `s % f == 0` with s = update - 1."""
    grads = random_grads({"w": (4, 4)}, 8, seed=8)
    _, states = run(soap(precondition_frequency=3), grads)
    previous = np.eye(4)
    changed = []
    for t, state in enumerate(states, 1):
        q = np.asarray(state.left_basis["w"][0, 0])
        if not np.array_equal(q, previous):
            changed.append(t)
        previous = q
    assert changed == [1, 4, 7]


def test_a_null_space_gets_a_fixed_basis_that_rounding_does_not_move():
    """A one-gradient right statistic of a 3x8 block has a 5-dimensional null space, where eigh
    may return any orthonormal basis (LAPACK's choice, moved by rounding). Ours: the non-null
    columns are the eigenvectors, the null ones an orthonormal basis of the null space fixed by
    P = the null projector (the QR of P·E, E fixed). A 1e-7 relative symmetric perturbation (the
    rounding a different device layout brings) moves P by ~1e-7·λmax/λ3 (λ3 the smallest nonzero
    eigenvalue), and the fixed basis by cond(P·E's first 5 columns) times that: checked with 100x
    room. A QR refresh of a still-singular statistic keeps the null columns as they were."""
    rng = np.random.default_rng(11)
    g = rng.normal(size=(3, 8))
    stats = g.T @ g
    noise = rng.normal(size=(8, 8)) * 1e-7 * np.abs(stats).max()
    plan = plan_leaf(jnp.zeros((3, 8)), True, 8, 8)
    basis = jax.jit(lambda s: initial_basis(s, plan, "right"))
    q = np.asarray(basis(jnp.asarray(stats[None, None], jnp.float32))[0, 0], np.float64)
    q_moved = np.asarray(basis(jnp.asarray((stats + (noise + noise.T) / 2)[None, None], jnp.float32))[0, 0], np.float64)
    e = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (8, 8), jnp.float32), np.float64)
    null = np.linalg.eigh(stats)[1][:, :5]
    pe = null @ null.T @ e[:, :5]
    # Orthonormal columns: the eigh block (columns 0-2) and the fixed block (Householder QR of P·E,
    # columns 3-7) each to working precision; between the blocks, the fixed columns come from P·E
    # through a QR that divides by its R, so the eigenvectors' rounding (their n·EPS32 orthogonality
    # to columns 0-2) reaches them amplified by cond(P·E's first 5 columns) (61 here): first-order,
    # worst-case alignment, margin 1. (The fixed 1e-6 this replaces failed on a Xeon with AMX, 2.3e-6
    # = 19 EPS32 in the cross block; the in-block bound, 16 EPS32, is tighter than that 1e-6.)
    gram = np.abs(q.T @ q - np.eye(8))
    assert gram[:3, :3].max() <= orthogonality_atol(8) and gram[3:, 3:].max() <= orthogonality_atol(8), gram
    assert gram[:3, 3:].max() <= orthogonality_atol(8, np.linalg.cond(pe), margin=1), gram
    lam = np.linalg.eigvalsh(stats)[::-1]
    # the eigenvectors of λ1..λ3 (their gaps, and λ3's to the null cluster: g gᵀ's eigh and cond)
    kappa = max(conditioning(g @ g.T, "eigh"), conditioning(g @ g.T, "qr"))
    eigvec_error = basis_error(q[:, :3], eig_desc(stats)[:, :3])
    assert eigvec_error <= 10 * EPS32 * kappa
    # The fixed columns lie in the null space, as far as the two errors just checked allow: with
    # v_i the exact eigenvectors, |(S q_j)_k| <= ‖Λ Vᵀ q_j‖ <= λ1·√3·max_i |v_iᵀ q_j| and
    # |v_iᵀ q_j| <= |q_iᵀ q_j| + ‖v_i − q_i‖·‖q_j‖ <= cross + √8·eigvec_error·(1 + EPS32); the float64
    # product's own rounding (8 terms of 2^-53) is far below the EPS32·λ1 added.
    along_range = gram[:3, 3:].max() + np.sqrt(8) * eigvec_error * (1 + EPS32)
    assert np.abs(stats @ q[:, 3:]).max() <= lam[0] * (np.sqrt(3) * along_range + EPS32)
    bound = 100 * 1e-7 * lam[0] / lam[2] * np.linalg.cond(pe)
    assert np.abs(q_moved - q).max() <= bound, (np.abs(q_moved - q).max(), bound)
    refresh = jax.jit(lambda s, q: refresh_basis(s, q, plan, "right"))
    refreshed, order = refresh(jnp.asarray(stats[None, None], jnp.float32), jnp.asarray(q[None, None], jnp.float32))
    refreshed = np.asarray(refreshed[0, 0], np.float64)
    assert list(np.asarray(order[0, 0])[3:]) == [3, 4, 5, 6, 7]  # null columns keep their places ...
    # ... and their vectors (up to sign): the QR takes from each q_j its part along the power columns
    # S·q_0..2 (range(S): at most √3·along_range, above), along the null columns before it (4 of
    # them, each the in-block |q_kᵀ q_j|) and its norm's error (|q_jᵀ q_j − 1|), and rounds: the
    # QR's n·EPS32 with the float32 S·q's error turned by the power columns' conditioning λ1/λ3.
    moved = np.sqrt(3) * along_range + 5 * gram[3:, 3:].max() + orthogonality_atol(8, lam[0] / lam[2])
    assert basis_error(refreshed[:, 3:], q[:, 3:]) <= moved


# --- in the optimizer ------------------------------------------------------------------------------


def _gpt():
    cfg = GPTConfig(dim=16, num_heads=2, num_blocks=2, context_length=8, vocab_size=32, tie_embeddings=False)
    model = eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(9)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    return params, grads, param_labels(model)


@pytest.mark.slow  # an optimizer outside helpers.QUICK_OPTIMIZERS on a whole model
@pytest.mark.parametrize("embed_head", [True, False])
def test_groups_rotate_matrices_and_adam_the_rest_with_no_zero_size_state(embed_head):
    """hidden (stacked per block) always SOAP; embed and head SOAP unless precondition_embed_head
    is false; scalar Adam. Two jitted updates are finite, the second moves every weight; no state
    leaf has size 0 (orbax refuses those)."""
    params, grads, labels = _gpt()
    tx = make_optimizer(SOAP(precondition_embed_head=embed_head), optax.constant_schedule(0.01), labels, 1.0)

    update = jax.jit(tx.update)  # one compilation, two updates
    _, state = update(grads, jax.jit(tx.init)(params), params)
    updates, state = update(grads, state, params)
    inner = {g: state[1].inner_states[g].inner_state[0] for g in ("hidden", "embed", "head", "scalar")}
    assert isinstance(inner["hidden"], SOAPState)
    assert inner["hidden"].left_basis.blocks.mlp_in.weight_IxO.shape == (2, 1, 1, 16, 16)
    assert isinstance(inner["embed"], SOAPState) == embed_head == isinstance(inner["head"], SOAPState)
    assert isinstance(inner["scalar"], optax.ScaleByAdamState)
    assert all(x.size > 0 for x in jax.tree.leaves(state))
    for u in jax.tree.leaves(updates):
        assert np.all(np.isfinite(u)) and np.any(u != 0)


def test_diagnostics_are_the_denominators_spread_and_the_bases_computed_so_far():
    """precond_cond_max/_median over a group's blocks: max/min of √V + eps over each block's true
    entries, from the state's V by NumPy (the padding, exactly zero, left out); eigenbasis_refreshes:
    how many times the bases have changed so far, counted from the states (frequency 2: updates
    1, 3, 5). The scalar group logs Adam's sqrt_v_*."""
    hp = SOAP(block_size=4, precondition_every=2)
    shapes = {"w": ((2, 6, 7), "hidden"), "e": ((5, 5), "embed"), "b": ((4,), "scalar")}
    rng = np.random.default_rng(12)
    params = {k: jnp.asarray(rng.normal(size=shape), jnp.float32) for k, (shape, _) in shapes.items()}
    labels = {k: label for k, (_, label) in shapes.items()}
    tx = make_optimizer(hp, optax.constant_schedule(1e-2), labels, None, 1e-2)
    step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    metrics_of = jax.jit(lambda s: optimizer_metrics(hp, s, params))
    state, changes, previous = tx.init(params), 0, None
    for t in range(1, 6):
        state = step({k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) for k, p in params.items()}, state)
        soap_state = state[1].inner_states["hidden"].inner_state[0]
        basis = np.asarray(soap_state.left_basis["w"])
        changes += previous is None or not np.array_equal(basis, previous)
        previous = basis
        metrics = metrics_of(state)
        assert int(metrics["optim/hidden/eigenbasis_refreshes"]) == changes == (t + 1) // 2
        nu = np.asarray(soap_state.nu["w"], np.float64)
        conds = []
        for s in range(2):
            for r0, r1 in ((0, 4), (4, 6)):
                for c0, c1 in ((0, 4), (4, 7)):
                    d = np.sqrt(nu[s, r0:r1, c0:c1]) + hp.eps
                    conds.append(d.max() / d.min())
        # the same float32 ν: √ and + eps on max and min (2 roundings each), their ratio (1); the
        # median may average two (1 more)
        np.testing.assert_allclose(metrics["optim/hidden/precond_cond_max"], max(conds), rtol=rounding_rtol(5))
        np.testing.assert_allclose(metrics["optim/hidden/precond_cond_median"], np.median(conds),
                                   rtol=rounding_rtol(6))
        if t > 1:
            assert max(conds) > 1.0
    assert {k.split("/")[1] for k in metrics} == {"hidden", "embed", "scalar"}
    assert "optim/scalar/sqrt_v_max" in metrics


@pytest.mark.parametrize(("knob", "value"), [
    ("b1", 1.0), ("b2", -0.1), ("precondition_b2", 1.0), ("eps", 0.0), ("weight_decay", -0.1),
    ("precondition_every", 0), ("max_precondition_dim", 2.5), ("block_size", 0), ("block_size", True),
])
def test_bad_knobs_are_config_errors(knob, value):
    SOAP().check("optimizer")  # the defaults pass
    dataclasses.replace(SOAP(), block_size=None, precondition_b2=None).check("optimizer")  # nulls are allowed
    with pytest.raises(ConfigError, match=rf"^optimizer\.{knob}="):
        dataclasses.replace(SOAP(), **{knob: value}).check("optimizer")


def test_group_knobs_follow_what_each_group_runs():
    assert "precondition_b2" in SOAP().group_knobs("hidden") and "precondition_b2" in SOAP().group_knobs("embed")
    assert "precondition_b2" not in SOAP().group_knobs("scalar")
    assert "precondition_b2" not in SOAP(precondition_embed_head=False).group_knobs("head")
