"""optimizer.ns_coefficients=polar_express (optimizer/muon.py): Muon's and NorMuon's Newton–Schulz
with Polar Express's per-iteration polynomials (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932).

  * it lands singular values closer to 1 than the quintic in as many iterations, within the interval
    the authors' design guarantees, and each where the scalar composition of its polynomials sends it;
  * it is the authors' algorithm (their normalisation X / (1.01·‖X‖_F + 1e-7), then their safety-
    factored coefficients in order), written again here in float64 NumPy: ours folds the 1/1.01 into
    the first polynomial and optax's eps, equal in exact arithmetic;
  * the default, quintic, is exactly the update Muon and NorMuon made before the knob existed;
  * Muon and NorMuon train the tiny model with it (the bit-identical resume: tests/test_checkpoint.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, learnable_losses
from optax.contrib import MuonState, scale_by_muon

from optimizer.diagnostics import find_states
from optimizer.muon import POLAR_EXPRESS_ABC, Muon, _stacked_dims, newton_schulz, scale_by_shape
from optimizer.normuon import NorMuon, scale_by_neuron_norm
from utils.errors import ConfigError

EPS64 = float(np.finfo(np.float64).eps)
QUINTIC = (3.4445, -4.7750, 2.0315)


def authors_polar_express(g: np.ndarray, steps: int) -> np.ndarray:
    """Polar Express as the authors' code runs it, in float64 (a stack of blocks, last two axes the
    matrix): the wide orientation, X / (1.01·‖X‖_F + 1e-7), then X <- aX + (bA + cA²)X, A = XXᵀ,
    with each published triple but the last taken as (a/1.01, b/1.01³, c/1.01⁵)."""
    safety = 1.01
    coeffs = [(a / safety, b / safety**3, c / safety**5) for a, b, c in POLAR_EXPRESS_ABC[:-1]]
    coeffs.append(POLAR_EXPRESS_ABC[-1])
    x = np.asarray(g, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = np.swapaxes(x, -1, -2)
    x = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) * safety + 1e-7)
    for a, b, c in coeffs[:steps]:
        a_BxKxK = x @ np.swapaxes(x, -1, -2)
        x = a * x + (b * a_BxKxK + c * a_BxKxK @ a_BxKxK) @ x
    return np.swapaxes(x, -1, -2) if tall else x


def authors_scalar_map(sigma: np.ndarray, steps: int) -> np.ndarray:
    """What the authors' iteration does to a singular value σ of the normalised input, in float64:
    an odd polynomial of X maps X = UΣVᵀ to U p(Σ) Vᵀ, so the iteration is its polynomials composed."""
    x = np.asarray(sigma, np.float64)
    safety = 1.01
    for t, (a, b, c) in enumerate(POLAR_EXPRESS_ABC[:steps]):
        if t < len(POLAR_EXPRESS_ABC) - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        x = a * x + b * x**3 + c * x**5
    return x


def polar_express_tol(steps: int, n: int, eps: float = EPS32, margin: float = 2) -> float:
    """Bound on the spectral norm of ours − the exact iteration (so on every element, and by Weyl's
    inequality on every singular value), for an input of wide side n in precision `eps`.

    One iteration X <- aX + (bA + cA²)X, A = XXᵀ, chains 3 matmuls of inner dimension <= n: a float32
    dot product errs by at most n·eps/2 of Σ|x||y| (Higham, Accuracy and Stability, §3.1), and X's
    spectral norm stays ~1 (<= 2 after the first polynomial's overshoot), so an iteration adds
    ~3·n·eps/2 at the result's scale, as newton_schulz_atol (tests/test_groups.py) counts quintic's.
    A perturbation made at iteration t then grows at most as the small singular values do through
    the later polynomials, by their slopes at 0, a_s (the ones near 1 are contracted): the sum over t
    of Π_{s>t} a_s (146 for 5 steps, where the quintic's 3.4445 gives ~100). The normalisation and the
    float32 coefficients are a few more roundings, relative, and shrink as σ·p'(σ)/p(σ) <= 1. Times
    `margin`. A worst case (the errors are in fact ~√n·eps and do not all grow): measured in float32,
    at most 1.4e-6 on these cases against 5.5e-3 allowed; a missing factor 1/1.01 moves the result by
    5e-2, a wrong coefficient by O(1)."""
    a = [a_t / 1.01 for a_t, _, _ in POLAR_EXPRESS_ABC[:steps]]
    growth = sum(float(np.prod(a[t + 1:])) for t in range(steps))
    return margin * 3 * n * eps / 2 * growth


def ill_conditioned(m: int, n: int, rng) -> np.ndarray:
    """An m×n matrix with singular values spread geometrically over [1e-3, 1] and random singular vectors."""
    k = min(m, n)
    u_MxK, _ = np.linalg.qr(rng.normal(size=(m, k)))
    v_NxK, _ = np.linalg.qr(rng.normal(size=(n, k)))
    return (u_MxK * np.geomspace(1e-3, 1.0, k)) @ v_NxK.T


def cases() -> dict[str, np.ndarray]:
    """Stacks of two float32 blocks: Gaussian wide and tall (normalised singular values ~0.03-0.2)
    and badly conditioned (normalised ones down to 4e-4, below the 1e-3 the coefficients assume)."""
    rng = np.random.default_rng(0)
    return {"gaussian_wide": rng.normal(size=(2, 64, 96)).astype(np.float32),
            "gaussian_tall": rng.normal(size=(2, 96, 64)).astype(np.float32),
            "ill_conditioned": np.stack([ill_conditioned(64, 96, rng) for _ in range(2)]).astype(np.float32)}


def ours(g: np.ndarray, hp: Muon) -> np.ndarray:
    """Our Newton–Schulz of hp's kind on the stack g, as the update computes it (jitted, float32 or
    float64 as g is), as float64 NumPy."""
    args = hp.newton_schulz_args()
    coeffs = jnp.asarray(args.get("ns_coeffs", QUINTIC), g.dtype)
    return np.asarray(jax.jit(lambda x: newton_schulz(x, coeffs, hp.ns_steps, args["eps"]))(g), np.float64)


def singular_values(x: np.ndarray) -> np.ndarray:
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


@pytest.mark.parametrize("name", sorted(cases()))
def test_polar_express_lands_singular_values_closer_to_1_than_quintic(name):
    """After 5 iterations: each singular value where the composed polynomials send it (within
    polar_express_tol); the worst |σ − 1| smaller than the quintic's by more than that tolerance;
    and, where the input's normalised singular values lie in [1e-3, 1] (the Gaussian ones), inside
    the interval the authors' design guarantees for that range: the image of [1e-3, 1]/1.01 under
    the composition, [0.840, 1.124] (the quintic's [0.68, 1.2] for the same iterations)."""
    g = cases()[name]
    steps, n = 5, max(g.shape[-2:])
    tol = polar_express_tol(steps, n)
    polar = singular_values(ours(g, Muon(ns_steps=steps, ns_coefficients="polar_express")))
    quintic = singular_values(ours(g, Muon(ns_steps=steps)))

    g64 = np.asarray(g, np.float64)
    normalised = singular_values(g64) / (1.01 * np.linalg.norm(g64, axis=(-2, -1))[:, None] + 1e-7)
    predicted = np.sort(authors_scalar_map(normalised, steps), axis=-1)
    np.testing.assert_allclose(np.sort(polar, axis=-1), predicted, rtol=0, atol=tol)

    worst_polar, worst_quintic = np.abs(polar - 1).max(), np.abs(quintic - 1).max()
    assert worst_polar + tol < worst_quintic, (worst_polar, worst_quintic)
    if normalised.min() >= 1e-3:
        design = authors_scalar_map(np.geomspace(1e-3, 1.0, 200001) / 1.01, steps)
        assert design.min() - tol <= polar.min() and polar.max() <= design.max() + tol, (polar.min(), polar.max())
        assert worst_polar < 0.17 < 0.3 < worst_quintic  # the design's 0.16 against the quintic's 0.32 (measured)


@pytest.mark.parametrize("steps", [1, 5, 8])
@pytest.mark.parametrize("name", sorted(cases()))
def test_polar_express_is_the_authors_algorithm(name, steps):
    """Ours (optax's normalisation X / (‖X‖_F + 1e-7/1.01), the 1/1.01 folded into the first
    polynomial) against the authors' order in float64 NumPy: in float64, to float64's rounding (the
    fold is exact algebra: a wrong fold or coefficient fails here by 1e-2 or more); in float32,
    within float32's (polar_express_tol with EPS32)."""
    g = cases()[name]
    n = max(g.shape[-2:])
    hp = Muon(ns_steps=steps, ns_coefficients="polar_express")
    reference = authors_polar_express(g, steps)
    np.testing.assert_allclose(ours(g, hp), reference, rtol=0, atol=polar_express_tol(steps, n))
    with jax.enable_x64(True):
        in_float64 = ours(g.astype(np.float64), hp)
    np.testing.assert_allclose(in_float64, reference, rtol=0, atol=polar_express_tol(steps, n, eps=EPS64))


def _updates(tx, grads_seq, params):
    """Three jitted updates of `tx` from its init: (the updates, the final state)."""
    def run(grads_seq, params):
        state, out = tx.init(params), []
        for g in grads_seq:
            u, state = tx.update(g, state, params)
            out.append(u)
        return out, state

    return jax.jit(run)(grads_seq, params)


@pytest.mark.parametrize("cls", [Muon, NorMuon])
def test_quintic_default_is_exactly_the_update_before_the_knob(cls):
    """ns_coefficients defaults to quintic, and then the hidden group's updates are bit for bit those
    of the chain Muon and NorMuon built before the knob: scale_by_muon with optax's default
    coefficients and eps. Polar Express's differ (its state holds the (ns_steps, 3) table)."""
    hp = cls()
    assert hp.ns_coefficients == "quintic"
    rng = np.random.default_rng(1)
    params = {"attn_qkv": jnp.asarray(rng.normal(size=(2, 16, 48)), jnp.float32),
              "mlp_out": jnp.asarray(rng.normal(size=(2, 64, 16)), jnp.float32)}
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    schedule = optax.constant_schedule(0.02)
    before = scale_by_muon(ns_steps=hp.ns_steps, beta=hp.momentum, nesterov=hp.nesterov,
                           weight_dimension_numbers=_stacked_dims)
    if cls is NorMuon:
        stages = (scale_by_neuron_norm(hp.b2, hp.eps, hp.shape_scale), scale_by_shape("reference"))
    else:
        stages = (scale_by_shape(hp.shape_scale),)
    old = optax.chain(before, *stages, optax.add_decayed_weights(hp.weight_decay),
                      optax.scale_by_learning_rate(schedule))
    got, state = _updates(hp.transform("hidden", schedule), grads_seq, params)
    want, _ = _updates(old, grads_seq, params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert find_states(state, MuonState)[0].ns_coeffs.shape == (3,)

    polar = cls(ns_coefficients="polar_express")
    other, polar_state = _updates(polar.transform("hidden", schedule), grads_seq, params)
    assert find_states(polar_state, MuonState)[0].ns_coeffs.shape == (polar.ns_steps, 3)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(want)))
    # The diagnostics recompute each one's Newton–Schulz from its state (its coefficient table and eps):
    # Polar Express's is nearer orthogonal (measured: ortho_err_max 0.18 against the quintic's 0.37).
    errors = {kind: float(hp_.diagnostics("hidden", st, params, grads_seq[-1])["ortho_err_max"])
              for kind, hp_, st in (("quintic", hp, state), ("polar_express", polar, polar_state))}
    assert errors["polar_express"] < 0.7 * errors["quintic"], errors


def test_the_knob_is_checked(tiny_run):
    assert tiny_run("optimizer=muon").optimizer.hparams.ns_coefficients == "quintic"
    run = tiny_run("optimizer=normuon", "optimizer.ns_coefficients=polar_express", "optimizer.ns_steps=8")
    assert (run.optimizer.hparams.ns_coefficients, run.optimizer.hparams.ns_steps) == ("polar_express", 8)
    with pytest.raises(ConfigError, match=r"^optimizer\.ns_coefficients='polar' must be one of quintic, polar_express"):
        tiny_run("optimizer=muon", "optimizer.ns_coefficients=polar")
    with pytest.raises(ConfigError, match=r"^optimizer\.ns_steps=9 exceeds the 8 published Polar Express iterations"
                                          r".*set optimizer\.ns_steps to at most 8$"):
        tiny_run("optimizer=muon", "optimizer.ns_coefficients=polar_express", "optimizer.ns_steps=9")
    assert tiny_run("optimizer=muon", "optimizer.ns_steps=9").optimizer.hparams.ns_steps == 9  # quintic: any


@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_muon_and_normuon_with_polar_express_train_the_tiny_model(tiny_run, name):
    """As tests/test_groups.py's every-optimizer check: 30 steps on a learnable fixed batch (the next
    token is the current one plus one) at the yaml's lr take the loss under 0.8 of its start."""
    run = tiny_run(f"optimizer={name}", "optimizer.ns_coefficients=polar_express", "train.max_steps=30",
                   "optimizer.lr_config.warmup=5")
    losses, _ = learnable_losses(run, 30)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], (name, losses[0], losses[-1])
