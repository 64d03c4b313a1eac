"""optimizer/shampoo.py against independent float64 NumPy references (matrix roots by float64
eigh, itself checked against SciPy's Schur-based power), blocks cut by hand, Adam written out; plus the
recompute schedule (roots cached, eigh skipped off-schedule), stacking, grafting, the diagonal
fallback and a toy problem that trains. Tiny shapes, jitted updates: the file runs in seconds."""

from __future__ import annotations

import dataclasses
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg
from helpers import EPS32, random_grads
from helpers import run_updates as run

from models.gpt import GPT, GPTConfig, param_labels
from optimizer import make_optimizer, shampoo
from optimizer.shampoo import Shampoo, scale_by_shampoo
from utils.errors import ConfigError

NO_BLOCKS = 10_000  # a block_size larger than every test matrix
EPS64 = float(np.finfo(np.float64).eps)


# --- references ----------------------------------------------------------------------------------


def np_root(stats, p, eps):
    """(S + eps·λmax·I)^{-1/p} by NumPy's float64 eigh (checked against SciPy just below)."""
    lam, vecs = np.linalg.eigh(np.asarray(stats, np.float64))
    lam = np.maximum(lam, 0.0) + eps * lam.max()
    return (vecs * lam ** (-1.0 / p)) @ vecs.T


def test_reference_root_agrees_with_scipy():
    """The reference itself, against SciPy's Schur-based fractional power: a check on the check."""
    g = np.random.default_rng(0).normal(size=(7, 3))
    stats = g @ g.T  # rank 3 of 7: the damping matters
    for p in (2, 4):
        expected = scipy.linalg.fractional_matrix_power(stats + 1e-3 * np.linalg.eigvalsh(stats).max() * np.eye(7),
                                                        -1.0 / p)
        # Both float64 and backward stable (eigh; Schur): each the root of a matrix off by <= ~7·EPS64·λmax,
        # which the root amplifies by κ/p (κ = 1 + 1/1e-3, the damping's condition) relative to its scale.
        atol = 7 * (1 + 1e3) / p * EPS64 * np.abs(expected).max()
        np.testing.assert_allclose(np_root(stats, p, 1e-3), np.real(expected), rtol=0, atol=atol)


def np_shampoo(grads, beta2, eps, every=1, start=1, left=True, right=True, p=None, perturb=None):
    """Directions L^{-1/p} G R^{-1/p} for a sequence of 2-D gradients, roots refreshed on steps
    start, start+every, ... and held in between (identity before the first refresh). `perturb`
    (statistic -> statistic) is applied to each statistic just before its root (shampoo_rtol)."""
    perturb = perturb or (lambda s: s)
    p = p or 2.0 * (left + right)
    m, n = grads[0].shape
    L, R = np.zeros((m, m)), np.zeros((n, n))
    root_l, root_r = np.eye(m), np.eye(n)
    out = []
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        if beta2 == 1.0:
            L, R = L + g @ g.T, R + g.T @ g
        else:
            L, R = beta2 * L + (1 - beta2) * g @ g.T, beta2 * R + (1 - beta2) * g.T @ g
        if t >= start and (t - start) % every == 0:
            root_l, root_r = np_root(perturb(L), p, eps), np_root(perturb(R), p, eps)
        out.append((root_l if left else np.eye(m)) @ g @ (root_r if right else np.eye(n)))
    return out


def np_adam(grads, b2=0.999, eps=1e-8):
    """Adam's direction without momentum: g / (sqrt(nu / (1 - b2^t)) + eps)."""
    nu, out = 0.0, []
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        nu = nu + g * g if b2 == 1.0 else b2 * nu + (1 - b2) * g * g
        out.append(g / (np.sqrt(nu / (1.0 if b2 == 1.0 else 1 - b2**t)) + eps))
    return out


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def shampoo_rtol(grads, beta2, eps, **kw) -> np.ndarray:
    """Per step, the float32 error of np_shampoo's direction relative to its norm (a bound for
    rel_err), propagated in float64. float32 eigh is backward stable: its roots are those of a
    statistic off by ~u·λmax (u = EPS32/2). So rerun the reference with every statistic shifted by
    ±u·λmax·I (every eigenvalue off by that at once, the worst case for S^{-1/p}, which amplifies it
    where λ is small: ~u·κ/p, large for roots held over new gradients), taken as is, and perturbed
    by random symmetric matrices of that norm (a typical error; it mixes eigenvectors, on a
    rank-deficient statistic into the damped null space), 4x. Plus the float32 sums of <= n terms
    (the statistic, the root from its eigenvectors, two products), ~√n·u each: 5 of them, 4x."""
    ref = np_shampoo(grads, beta2, eps, **kw)
    rng = np.random.default_rng(0)

    def shift(sign):
        return lambda s: s + sign * EPS32 / 2 * np.linalg.eigvalsh(s).max() * np.eye(len(s))

    def mix(s):
        z = rng.normal(size=s.shape)
        return s + EPS32 / 2 * np.linalg.eigvalsh(s).max() * (z + z.T) / np.linalg.norm(z + z.T, 2)

    def moves(perturb):
        return [rel_err(a, r) for a, r in zip(np_shampoo(grads, beta2, eps, perturb=perturb, **kw), ref, strict=True)]

    eigh_T = np.max([moves(shift(1)), moves(shift(-1)), 4 * np.maximum(moves(mix), moves(mix))], axis=0)
    return eigh_T + 4 * 5 * np.sqrt(max(np.shape(grads[0]))) * EPS32 / 2


def adam_rtol(b2: float, steps: int) -> float:
    """The float32 error of np_adam's direction relative to it, over `steps` steps. Its bias
    correction 1 - b2^t subtracts from 1 a float32 b2^t that is off by t times b2's own rounding
    plus ~1 ulp (EPS32/2 below 1) of the power: a large part of 1 - b2^t ≈ t·(1 - b2) (b2 = 0.999:
    up to 7e-5 of it), which the square root halves. The rest, g², the moment, the square root, the
    division: a few roundings, 8 EPS32."""
    if b2 == 1.0:  # sums, no correction
        return 8 * EPS32
    t = np.arange(1, steps + 1)
    b2_rounding = abs(float(np.float32(b2)) - b2)
    return float(np.max((t * b2_rounding + EPS32 / 2) / (1 - b2**t))) / 2 + 8 * EPS32


# --- the preconditioner --------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "beta2", "eps", "p"),
                         [((6, 4), 0.9, 1e-4, None), ((6, 4), 1.0, 1e-4, None),
                          ((5, 5), 0.9, Shampoo().precondition_eps, None), ((5, 5), 0.9, 1e-4, 2.0)],
                         ids=["ema", "sum", "default-eps", "exponent-override"])
def test_two_sided_matches_numpy(shape, beta2, eps, p):
    """A 6x4 gradient leaves L rank-deficient on step 1, where float32 eigh resolves the damped
    null space only to ~1e-7·λmax, too coarse for a tolerance of float32 rounding: eps 1e-4
    there; the square case has full-rank statistics from step 1 and runs at the default (see the
    rank-deficient test below for the default there)."""
    grads = random_grads({"w": shape}, 5)
    tx = scale_by_shampoo(block_size=NO_BLOCKS, beta2=beta2, epsilon=eps, precondition_every=1, graft="none",
                          exponent_override=p)
    outs, _ = run(tx, grads)
    ref = np_shampoo([g["w"] for g in grads], beta2, eps, p=p)
    tol = shampoo_rtol([g["w"] for g in grads], beta2, eps, p=p)
    for t, (u, r) in enumerate(zip(outs, ref), 1):
        assert rel_err(u["w"], r) < tol[t - 1], f"step {t}: {rel_err(u['w'], r)} >= {tol[t - 1]}"


def test_blocking_matches_per_block_references():
    """600x300 with block_size 256: rows [0:256, 256:512, 512:600] x cols [0:256, 256:300], each
    block its own L and R; the ragged blocks are computed on their true sub-blocks. Checked on
    step 3 (statistics summed over three steps, roots from them: the reference's start=3)."""
    grads = random_grads({"w": (600, 300)}, 3, seed=1)
    tx = scale_by_shampoo(block_size=256, beta2=0.9, epsilon=1e-4, precondition_every=1, graft="none")
    outs, states = run(tx, grads)
    assert states[-1].left_stats["w"].shape == (3, 2, 256, 256)
    assert states[-1].right_stats["w"].shape == (3, 2, 256, 256)
    for r0, r1 in [(0, 256), (256, 512), (512, 600)]:
        for c0, c1 in [(0, 256), (256, 300)]:
            block = [g["w"][r0:r1, c0:c1] for g in grads]
            ref = np_shampoo(block, 0.9, 1e-4, start=3)[-1]
            err, tol = rel_err(outs[-1]["w"][r0:r1, c0:c1], ref), shampoo_rtol(block, 0.9, 1e-4, start=3)[-1]
            assert err < tol, f"block rows {r0}:{r1} cols {c0}:{c1}: {err} >= {tol}"


def test_side_longer_than_max_dim_is_one_sided_and_both_is_diagonal():
    """5x12 with max_preconditioner_dim 8: only L, with root 1/2 (L^{-1/2} G); 12x12: diagonal."""
    grads = random_grads({"wide": (5, 12), "big": (12, 12)}, 4, seed=2)
    tx = scale_by_shampoo(block_size=4, max_preconditioner_dim=8, beta2=0.9, epsilon=1e-4,
                          precondition_every=1, graft="none")
    outs, states = run(tx, grads)
    # The long side is not cut into blocks: 2 row blocks (4 + padded 1), one column block of 12.
    assert states[-1].left_stats["wide"].shape == (2, 1, 4, 4)
    assert states[-1].right_stats["wide"].shape == (0,)
    assert states[-1].left_stats["big"].shape == (0,) and states[-1].nu["big"].shape == (12, 12)
    for r0, r1 in [(0, 4), (4, 5)]:
        block = [g["wide"][r0:r1] for g in grads]
        ref, tol = np_shampoo(block, 0.9, 1e-4, right=False), shampoo_rtol(block, 0.9, 1e-4, right=False)
        for u, r, tol_t in zip(outs, ref, tol):
            assert rel_err(u["wide"][r0:r1], r) < tol_t
    for u, r in zip(outs, np_adam([g["big"] for g in grads])):  # elementwise: no sums, relative to each entry
        np.testing.assert_allclose(u["big"], r, rtol=adam_rtol(0.999, len(grads)), atol=0)


def test_zero_statistics_give_the_identity_not_infinities():
    """A first gradient of zeros (say a frozen layer) must not cache an infinite root for the
    steps that follow: the root of an all-zero statistic is the identity."""
    grads = random_grads({"w": (6, 4)}, 3, seed=12)
    grads[0]["w"][:] = 0.0
    outs, states = run(scale_by_shampoo(block_size=NO_BLOCKS, precondition_every=10, graft="none"), grads)
    np.testing.assert_array_equal(states[0].left_roots["w"][0, 0], np.eye(6))
    np.testing.assert_array_equal(outs[0]["w"], 0.0)
    for u, g in zip(outs[1:], grads[1:]):  # roots held from step 1: identity, so the raw gradient
        np.testing.assert_array_equal(u["w"], g["w"])  # products with exact 1s and 0s: no rounding


def test_default_epsilon_is_above_float32_eigh_noise_on_rank_deficient_statistics():
    """An 8x32 gradient gives a 32x32 right statistic of rank 8. Its roots, cached after step 1
    (precondition_every=10, the default), precondition step 2's gradient, which reaches the null
    space: the damping alone sizes those directions. At epsilon 1e-12 (the old default) that
    damping is below float32 eigh's ~1e-7·λmax noise, so the noise picked the result: step 2
    came out ~3,700x the gradient's norm and 55% away from the float64 computation of the same
    formula. The default gives what the formula says (~146x here) to within 0.5%."""
    eps = Shampoo().precondition_eps
    assert inspect.signature(scale_by_shampoo).parameters["epsilon"].default == eps
    grads = random_grads({"w": (8, 32)}, 2, seed=14)
    tx = scale_by_shampoo(block_size=NO_BLOCKS, beta2=0.999, epsilon=eps, precondition_every=10, graft="none")
    outs, states = run(tx, grads)
    np.testing.assert_array_equal(states[1].right_roots["w"], states[0].right_roots["w"])  # held from step 1
    right = np.asarray(states[0].right_stats["w"][0, 0], np.float64)
    # float32 sums of 8 products leave the null space's eigenvalues at ~√8·EPS32·λmax: 10x above that.
    assert np.linalg.matrix_rank(right, tol=10 * np.sqrt(8) * EPS32 * np.abs(right).max()) == 8
    ref = np_shampoo([g["w"] for g in grads], 0.999, eps, every=10)
    # Step 2: an eigh error of EPS32·λmax (_inverse_root) moves the damped null-space eigenvalues by
    # EPS32/eps of themselves, their root by a quarter of that: ~3%.
    tol = [shampoo_rtol([g["w"] for g in grads], 0.999, eps, every=10)[0], EPS32 / (4 * eps)]
    for t, (u, r) in enumerate(zip(outs, ref), 1):
        assert np.all(np.isfinite(u["w"]))
        assert rel_err(u["w"], r) < tol[t - 1], f"step {t}: {rel_err(u['w'], r)}"
    # Bounded by what epsilon allows: |u| <= |L^-1/4|·|R^-1/4|·|g| in operator norms.
    g1 = np.asarray(grads[0]["w"], np.float64) * np.sqrt(1 - 0.999)
    bound = np.linalg.norm(np_root(g1 @ g1.T, 4, eps), 2) * np.linalg.norm(np_root(g1.T @ g1, 4, eps), 2)
    growth = np.linalg.norm(outs[1]["w"]) / np.linalg.norm(grads[1]["w"])
    # float32 roots are no larger (their eigenvalues are clamped to >= the damping); the products
    # and norms round by ~√32·EPS32 each: 10x.
    assert growth <= (1 + 10 * np.sqrt(32) * EPS32) * bound


# --- the recompute schedule ----------------------------------------------------------------------


def test_roots_are_held_between_recomputes():
    """precondition_every=3: steps 2-3 use step 1's roots, 5-6 step 4's, though the statistics move."""
    grads = random_grads({"w": (5, 5)}, 7, seed=3)  # square: full-rank roots on step 1
    tx = scale_by_shampoo(block_size=NO_BLOCKS, beta2=0.9, epsilon=1e-4, precondition_every=3, graft="none")
    outs, states = run(tx, grads)
    ref = np_shampoo([g["w"] for g in grads], 0.9, 1e-4, every=3)
    tol = shampoo_rtol([g["w"] for g in grads], 0.9, 1e-4, every=3)  # step 1's L has κ ~2000: held, it dominates
    for t, (u, r) in enumerate(zip(outs, ref), 1):
        assert rel_err(u["w"], r) < tol[t - 1], f"step {t}: {rel_err(u['w'], r)} >= {tol[t - 1]}"
    roots = [np.asarray(s.left_roots["w"]) for s in states]
    stats = [np.asarray(s.left_stats["w"]) for s in states]
    for t in (2, 3, 5, 6):  # 1-based steps that must not recompute
        np.testing.assert_array_equal(roots[t - 1], roots[t - 2])
        assert not np.allclose(stats[t - 1], stats[t - 2])
    for t in (4, 7):
        assert not np.allclose(roots[t - 1], roots[t - 2])


@pytest.mark.parametrize(("every", "start", "steps", "recomputes"), [(3, 1, 7, 3), (2, 3, 6, 2)])
def test_eigh_branch_runs_only_on_recompute_steps(monkeypatch, every, start, steps, recomputes):
    """Count executions of the root computation with a callback inside it: lax.cond must skip it
    at run time (under jit), not compute and discard it. Two sides per recompute."""
    calls = []
    original = shampoo._inverse_root

    def counted(stats, p, eps):
        jax.debug.callback(lambda: calls.append(1))
        return original(stats, p, eps)

    monkeypatch.setattr(shampoo, "_inverse_root", counted)
    tx = scale_by_shampoo(block_size=NO_BLOCKS, precondition_every=every, start_preconditioning_step=start)
    run(tx, random_grads({"w": (6, 4)}, steps, seed=4))
    jax.effects_barrier()
    assert len(calls) == 2 * recomputes

    # And structurally: the only eigh is inside the cond's branch.
    grads = random_grads({"w": (6, 4)}, 1)[0]
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(grads)).jaxpr
    top = {eqn.primitive.name for eqn in jaxpr.eqns}
    assert "eigh" not in top and "cond" in top
    conds = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    assert any("eigh" in str(branch) for eqn in conds for branch in eqn.params["branches"])


@pytest.mark.parametrize("graft", ["adam", "none"])
def test_before_start_step_the_graft_direction_is_returned(graft):
    grads = random_grads({"w": (6, 4)}, 4, seed=5)
    tx = scale_by_shampoo(block_size=NO_BLOCKS, beta2=0.9, epsilon=1e-4, precondition_every=1,
                          start_preconditioning_step=3, graft=graft)
    outs, _ = run(tx, grads)
    gs = [g["w"] for g in grads]
    graft_dirs = np_adam(gs) if graft == "adam" else gs
    graft_rtol = adam_rtol(0.999, 2) if graft == "adam" else 0  # "none": the raw gradient, as is
    for t in (1, 2):
        np.testing.assert_allclose(outs[t - 1]["w"], graft_dirs[t - 1], rtol=graft_rtol, atol=0)
    shampoo_dirs = np_shampoo(gs, 0.9, 1e-4)  # statistics accumulate from step 1 all the same
    tol = shampoo_rtol(gs, 0.9, 1e-4)
    if graft == "adam":  # the norm grafted on carries Adam's error; two more norms, sums of 24 squares
        tol = tol + adam_rtol(0.999, 4) + 2 * np.sqrt(24) * EPS32
    for t in (3, 4):
        expected = shampoo_dirs[t - 1]
        if graft == "adam":
            expected = expected * np.linalg.norm(graft_dirs[t - 1]) / np.linalg.norm(expected)
        assert rel_err(outs[t - 1]["w"], expected) < tol[t - 1], f"step {t}"


# --- grafting ------------------------------------------------------------------------------------

BLOCKS_40x20 = [(slice(r0, r1), slice(c0, c1)) for r0, r1 in [(0, 16), (16, 32), (32, 40)]
                for c0, c1 in [(0, 16), (16, 20)]]


@pytest.mark.parametrize("graft", ["adam", "sgd"])
def test_grafting_takes_the_norm_per_block_and_keeps_the_direction(graft):
    grads = random_grads({"w": (40, 20)}, 3, seed=6)
    kw = {"block_size": 16, "beta2": 0.9, "epsilon": 1e-4, "precondition_every": 1}
    grafted, _ = run(scale_by_shampoo(graft=graft, **kw), grads)
    raw, _ = run(scale_by_shampoo(graft="none", **kw), grads)
    gs = [g["w"] for g in grads]
    graft_dirs = np_adam(gs) if graft == "adam" else gs
    # A block's norm in float32 (<= 256 squares) is off by ~√256·EPS32/4; the grafted one takes three
    # (the graft's, Shampoo's, this test's own), and the graft's own error with Adam: 4x.
    norm_rtol = (adam_rtol(0.999, 3) if graft == "adam" else 0) + 4 * 3 * np.sqrt(256) * EPS32 / 4
    # The same Shampoo direction in both runs, only rescaled: the rescale's rounding and two normalisations, 4x.
    direction_rtol = 4 * (1 + 2 * np.sqrt(256) / 4) * EPS32
    for t in range(3):
        for rows, cols in BLOCKS_40x20:
            u, v = grafted[t]["w"][rows, cols], raw[t]["w"][rows, cols]
            np.testing.assert_allclose(np.linalg.norm(u), np.linalg.norm(graft_dirs[t][rows, cols]), rtol=norm_rtol)
            assert rel_err(u / np.linalg.norm(u), v / np.linalg.norm(v)) < direction_rtol


# --- leaves: diagonal path and stacks ------------------------------------------------------------


@pytest.mark.parametrize("graft_b2", [0.99, 1.0])
def test_vectors_and_scalar_labelled_leaves_take_the_diagonal_path(graft_b2):
    """A (num_blocks, d) bias is 2-D but labelled scalar: Adam-style diagonal, like a 1-D leaf
    (graft_b2 = 1: Adagrad sums, no bias correction)."""
    shapes = {"bias": (3, 4), "gain": (5,), "w": (6, 4)}
    labels = {"bias": "scalar", "gain": "embed", "w": "head"}
    grads = random_grads(shapes, 4, seed=7)
    tx = scale_by_shampoo(block_size=NO_BLOCKS, graft="sgd", graft_b2=graft_b2, graft_eps=1e-6, labels=labels)
    outs, states = run(tx, grads)
    for k in ("bias", "gain"):
        for u, r in zip(outs, np_adam([g[k] for g in grads], graft_b2, 1e-6)):
            np.testing.assert_allclose(u[k], r, rtol=adam_rtol(graft_b2, len(grads)), atol=0)
        assert states[-1].left_stats[k].shape == (0,) and states[-1].nu[k].shape == shapes[k]
    assert states[-1].left_stats["w"].shape == (1, 1, 6, 6)
    assert states[-1].nu["w"].shape == (0,)  # sgd graft: no second moment for Shampoo leaves
    # Without labels the same (3, 4) leaf is a matrix.
    assert run(scale_by_shampoo(), grads[:1])[1][0].left_stats["bias"].shape == (1, 1, 3, 3)


def test_stacked_hidden_leaf_is_preconditioned_per_slice():
    """(3, 6, 4) `hidden` = three independent 6x4 matrices (grafted per slice), not one 18x4."""
    grads = random_grads({"w": (3, 6, 4)}, 4, seed=8)
    kw = {"block_size": NO_BLOCKS, "beta2": 0.9, "epsilon": 1e-4, "precondition_every": 2}
    stacked, states = run(scale_by_shampoo(labels={"w": "hidden"}, **kw), grads)
    slices = [{str(i): g["w"][i] for i in range(3)} for g in grads]
    separate, _ = run(scale_by_shampoo(labels={str(i): "hidden" for i in range(3)}, **kw), slices)
    assert states[-1].left_stats["w"].shape == (3, 1, 1, 6, 6)
    # Per slice the same float32 computation, batched or alone; were XLA to order its sums differently,
    # each side stays within Shampoo's float32 error (the graft's norm is elementwise Adam: the same).
    tol_TxS = np.stack([2 * shampoo_rtol([g["w"][i] for g in grads], 0.9, 1e-4, every=2) for i in range(3)], 1)
    for t in range(4):
        for i in range(3):
            want = separate[t][str(i)]
            np.testing.assert_allclose(stacked[t]["w"][i], want, rtol=0, atol=tol_TxS[t, i] * np.abs(want).max())
    # The same leaf with no labels: stacked_leading_axes as an int or as a function of the leaf.
    for axes in (1, lambda x: x.ndim - 2):
        unlabelled, _ = run(scale_by_shampoo(stacked_leading_axes=axes, **kw), grads)
        for t in range(4):
            want = stacked[t]["w"]
            np.testing.assert_allclose(unlabelled[t]["w"], want, rtol=0, atol=tol_TxS[t].max() * np.abs(want).max())


def test_masked_leaves_from_other_groups_pass_through():
    """Under optax.masked / multi_transform the other groups' leaves arrive as MaskedNode."""
    grads = random_grads({"w": (6, 4), "b": (4,)}, 2, seed=9)
    labels = {"w": "hidden", "b": "scalar"}
    tx = optax.masked(scale_by_shampoo(block_size=NO_BLOCKS, labels=labels), {"w": True, "b": False})
    outs, _ = run(tx, grads)
    np.testing.assert_array_equal(outs[0]["b"], grads[0]["b"])  # untouched by the masked transform
    assert not np.allclose(outs[0]["w"], grads[0]["w"])


# --- training ------------------------------------------------------------------------------------


def test_trains_a_least_squares_problem_under_jit():
    rng = np.random.default_rng(10)
    x_BxI = jnp.asarray(rng.normal(size=(64, 12)) * np.linspace(0.1, 3.0, 12), jnp.float32)  # ill-conditioned
    target_BxO = x_BxI @ jnp.asarray(rng.normal(size=(12, 6)), jnp.float32)
    params = {"w": jnp.zeros((12, 6)), "b": jnp.zeros((6,))}
    tx = optax.chain(scale_by_shampoo(block_size=8, precondition_every=5), optax.scale(-0.05))

    def loss_fn(p):
        return jnp.mean((x_BxI @ p["w"] + p["b"] - target_BxO) ** 2)

    @jax.jit
    def step(p, state):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    state = tx.init(params)
    losses = []
    for _ in range(40):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.05 * losses[0], losses


def _gpt(cfg: GPTConfig, seed: int):
    model = eqx.filter_eval_shape(GPT, cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    return params, grads, param_labels(model)


@pytest.mark.slow  # an optimizer outside helpers.QUICK_OPTIMIZERS on a whole model
def test_config_builds_on_gpt_params():
    """Shampoo through make_optimizer (as the trainer builds it) on the model's labels: hidden
    stacks per block, embeddings and head as matrices, biases and gains diagonal; one jitted step
    is finite and moves every weight. (With batched CPU eighs side by side this step deadlocked
    jaxlib 0.10.2 on 2 cores: see _eigh.)"""
    cfg = GPTConfig(dim=32, num_heads=2, num_blocks=2, context_length=16, vocab_size=64, tie_embeddings=False)
    params, grads, labels = _gpt(cfg, 11)
    tx = make_optimizer(Shampoo(weight_decay=0.1, block_size=64), optax.constant_schedule(0.01), labels, 1.0)
    updates, state = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)

    def shampoo_state(group):  # chain(clip, multi_transform) -> the group's chain -> its ShampooState
        return state[1].inner_states[group].inner_state[0]

    hidden, embed, scalar = shampoo_state("hidden"), shampoo_state("embed"), shampoo_state("scalar")
    assert hidden.left_stats.blocks.mlp_in.weight_IxO.shape == (2, 1, 2, 32, 32)  # (num_blocks, R, C, 32, 32)
    assert hidden.right_stats.blocks.mlp_in.weight_IxO.shape == (2, 1, 2, 64, 64)  # 128 columns -> 2 blocks
    assert embed.left_stats.wte_VxD.shape == (1, 1, 64, 64)
    assert scalar.left_stats.blocks.mlp_in.bias_O.shape == (0,) and scalar.nu.blocks.mlp_in.bias_O.shape == (2, 128)
    for u in jax.tree.leaves(updates):
        assert np.all(np.isfinite(u)) and np.any(u != 0)


def test_per_group_optimizer_matches_one_whole_model_chain():
    """make_optimizer's per-group Shampoo (one scale_by_shampoo per group under
    optax.multi_transform) gives the updates of a single scale_by_shampoo over the whole model
    with the model's labels, followed by momentum, decay on the decayed groups and the lr."""
    cfg = GPTConfig(dim=16, num_heads=2, num_blocks=2, context_length=8, vocab_size=64)
    params, grads, labels = _gpt(cfg, 13)
    opt, lr = Shampoo(block_size=16, precondition_every=1, weight_decay=0.1), 0.1
    grouped = make_optimizer(opt, optax.constant_schedule(lr), labels, None)
    whole = optax.chain(
        scale_by_shampoo(block_size=16, precondition_every=1, labels=labels),
        optax.trace(decay=opt.momentum),
        optax.add_decayed_weights(0.1, mask=jax.tree.map(lambda label: label in ("hidden", "head"), labels)),
        optax.scale(-lr),
    )

    def first_update(tx):
        return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)

    for a, b in zip(jax.tree.leaves(first_update(whole)), jax.tree.leaves(first_update(grouped)), strict=True):
        # The same float32 ops per leaf, only the tree around them differs: at most a sum ordered
        # differently, ~√256·EPS32/2 (a 16x16 block's norm, the longest) of the leaf's scale.
        np.testing.assert_allclose(a, b, rtol=0, atol=np.sqrt(256) / 2 * EPS32 * np.abs(b).max())


# --- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("knob", "value"), [
    ("momentum", 1.0), ("block_size", 0), ("precondition_every", 0), ("start_preconditioning_step", 0),
    ("max_precondition_dim", 2.5), ("precondition_b2", 0.0), ("precondition_b2", 1.5), ("adam_b2", 0.0),
    ("precondition_eps", 0.0), ("adam_eps", 0.0), ("graft", "adagrad"), ("weight_decay", -0.1),
])
def test_bad_knobs_are_config_errors(knob, value):
    Shampoo().check("optimizer")  # the defaults pass
    with pytest.raises(ConfigError, match=rf"^optimizer\.{knob}="):
        dataclasses.replace(Shampoo(), **{knob: value}).check("optimizer")
