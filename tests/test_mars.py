"""optimizer/mars.py against a float64 NumPy MARS-AdamW written from the paper's Algorithm (the
approximate variant: the previous update's gradient), per matrix of a stack; its diagnostics
against the same reference; the AdamW scalar group and the knobs. Tiny arrays, jitted updates."""

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
from optimizer.mars import MARS, MARSState, scale_by_mars
from utils.errors import ConfigError

B1, B2, GAMMA, EPS = 0.95, 0.99, 0.025, 1e-8
# Gradient scales per update: the corrected gradient's norm crosses 1 both ways (clipped on some
# updates, not on others), so both branches of the clip are checked.
SCALES = (0.02, 0.3, 0.05, 0.25, 0.01, 0.15, 0.04)


def np_mars(grads):
    """(directions, correction norms, ‖c‖ before clipping) of MARS-AdamW on one matrix, float64."""
    mom1 = mom2 = last = 0.0
    out, corrections, c_norms = [], [], []
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        correction = GAMMA * B1 / (1 - B1) * (g - last)
        c = g + correction
        c_norm = np.linalg.norm(c)
        if c_norm > 1:
            c = c / c_norm
        mom1 = B1 * mom1 + (1 - B1) * c
        mom2 = B2 * mom2 + (1 - B2) * c * c
        out.append((mom1 / (1 - B1**t)) / (np.sqrt(mom2 / (1 - B2**t)) + EPS))
        corrections.append(np.linalg.norm(correction))
        c_norms.append(c_norm)
        last = g
    return out, corrections, c_norms


def grads_for(shape, seed):
    rng = np.random.default_rng(seed)
    return [(s * rng.normal(size=shape)).astype(np.float32) for s in SCALES]


def run(tx, grads_seq, params=None):
    state = jax.jit(tx.init)(grads_seq[0])
    update = jax.jit(tx.update)
    outs, states = [], []
    for g in grads_seq:
        u, state = update(g, state, params)
        outs.append(jax.tree.map(np.asarray, u))
        states.append(state)
    return outs, states


# float32 against float64: every entry of a direction is a ratio of two EMAs of at most 7 terms,
# each term a few roundings (the correction, the clip's norm over <= 20 entries, the square), so
# its relative error is below ~100 EPS32 (7 updates x ~10 roundings, plus √20 in the norm); the
# direction's entries are O(1) (Adam-normalised), so that is also an absolute bound.
RTOL = 100 * EPS32


def test_matrix_and_stack_match_numpy_per_matrix():
    """A 4x5 matrix and a (3, 4, 5) stack (three matrices, each its own norm and clip), 7 updates."""
    grads = [{"w": w, "s": s} for w, s in zip(grads_for((4, 5), 0), grads_for((3, 4, 5), 1))]
    outs, states = run(scale_by_mars(B1, B2, GAMMA, EPS), grads)
    ref, corr, c_norm = np_mars([g["w"] for g in grads])
    assert any(n > 1 for n in c_norm) and any(n < 1 for n in c_norm)  # both branches of the clip
    for t, (u, r) in enumerate(zip(outs, ref)):
        np.testing.assert_allclose(u["w"], r, rtol=RTOL, atol=RTOL, err_msg=f"update {t + 1}")
        np.testing.assert_allclose(states[t].correction_norm["w"], corr[t], rtol=RTOL)
        np.testing.assert_allclose(states[t].c_norm["w"], c_norm[t], rtol=RTOL)
    for i in range(3):
        ref, _, _ = np_mars([g["s"][i] for g in grads])
        for t, (u, r) in enumerate(zip(outs, ref)):
            np.testing.assert_allclose(u["s"][i], r, rtol=RTOL, atol=RTOL, err_msg=f"slice {i}, update {t + 1}")
    # One norm over the whole stack would be a different algorithm: the slices' norms differ.
    assert len({round(float(x), 6) for x in states[1].c_norm["s"]}) == 3


def test_the_correction_is_zero_for_a_repeated_gradient():
    """g = g' from update 2 on: c = g exactly (MARS reduces to AdamW on the clipped gradient)."""
    g = grads_for((4, 5), 2)[1]
    _, states = run(scale_by_mars(B1, B2, GAMMA, EPS), [{"w": g}] * 3)
    assert float(states[0].correction_norm["w"]) > 0  # update 1: g' = 0
    assert float(states[1].correction_norm["w"]) == 0.0 == float(states[2].correction_norm["w"])


# --- in the optimizer ------------------------------------------------------------------------------


CFG = GPTConfig(dim=16, num_heads=2, num_blocks=2, context_length=8, vocab_size=32, tie_embeddings=False)


def _gpt(seed=3):
    model = eqx.filter_eval_shape(GPT, CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    grads = [jax.tree.map(lambda x, s=s: jnp.asarray(s * rng.normal(size=x.shape), jnp.float32), model)
             for s in (0.02, 0.3, 0.05)]
    return params, grads, param_labels(model)


def test_groups_and_diagnostics_match_the_reference_per_matrix():
    """hidden, embed and head run MARS (per block of the stacked hidden leaves), scalar AdamW at
    adam_lr; correction_norm_mean/_max and clipped_frac over a group's matrices equal the NumPy
    reference's after 3 updates (clip=None, so the gradients reach the optimizer unchanged)."""
    params, grads, labels = _gpt()
    hp = MARS()
    tx = make_optimizer(hp, optax.constant_schedule(1e-2), labels, None, 1e-2)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])
    state = tx.init(params)
    for g in grads:
        state = step(g, state, params)
    inner = {g: state[1].inner_states[g].inner_state for g in ("hidden", "embed", "head", "scalar")}
    assert isinstance(inner["hidden"][0], MARSState) and isinstance(inner["scalar"][0], optax.ScaleByAdamState)
    metrics = jax.jit(lambda s, p: optimizer_metrics(hp, s, p))(state, params)
    for group in ("hidden", "embed", "head"):
        corr, clipped = [], []
        for path_leaf, label in zip(jax.tree.leaves(jax.tree.map(lambda *gs: np.stack(gs), *grads)),
                                    jax.tree.leaves(labels), strict=True):
            if label != group:
                continue
            per_matrix = path_leaf.reshape(3, -1, *path_leaf.shape[-2:])  # (updates, matrices, m, n)
            for i in range(per_matrix.shape[1]):
                _, c, n = np_mars(list(per_matrix[:, i]))
                corr.append(c[-1])
                clipped.append(n[-1] > 1)
        # ‖γ·b1/(1−b1)·(g − g')‖ in float32 per matrix of <= 1024 entries: the difference of two float32
        # gradients (1 rounding, relative to itself), the constant and its product (2), the squares (1),
        # their sum (positive terms: sum_atol relative to the sum; probabilistic, λ = 10), halved by the
        # square root, which rounds once; the mean over the group's <= 8 matrices sums positive terms too
        rtol = (sum_atol(1024, 1.0, lam=10) + rounding_rtol(4)) / 2 + rounding_rtol(1) + sum_atol(8, 1.0)
        np.testing.assert_allclose(metrics[f"optim/{group}/correction_norm_mean"], np.mean(corr), rtol=rtol)
        np.testing.assert_allclose(metrics[f"optim/{group}/correction_norm_max"], np.max(corr), rtol=rtol)
        # a count over a count: one division
        np.testing.assert_allclose(metrics[f"optim/{group}/clipped_frac"], np.mean(clipped), rtol=rounding_rtol(1))
    assert {k for k in metrics if k.startswith("optim/scalar/")} == {f"optim/scalar/sqrt_v_{s}"
                                                                     for s in ("min", "median", "max")}


def test_scalar_group_is_adamw_at_its_own_lr_and_betas():
    hp = MARS(adam_lr=1e-3, adam_b1=0.8, adam_b2=0.9, weight_decay=0.0)
    assert hp.default_group_lr("scalar", 3e-3) == 1e-3 and hp.default_group_lr("hidden", 3e-3) == 3e-3
    rng = np.random.default_rng(4)
    params = {"b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
    grads = [{"b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)} for _ in range(3)]
    ours, _ = run(hp.transform("scalar", optax.constant_schedule(1e-3)), grads, params)
    reference, _ = run(optax.adamw(1e-3, b1=0.8, b2=0.9, eps=hp.eps, weight_decay=0.0), grads, params)
    for a, b in zip(ours, reference):
        np.testing.assert_array_equal(a["b"], b["b"])


@pytest.mark.parametrize(("knob", "value"), [
    ("b1", 1.0), ("b2", -0.1), ("adam_b1", 1.0), ("adam_b2", 1.5), ("gamma", -0.1), ("eps", 0.0),
    ("weight_decay", -0.1), ("adam_lr", 0.0),
])
def test_bad_knobs_are_config_errors(knob, value):
    MARS().check("optimizer")  # the defaults pass
    with pytest.raises(ConfigError, match=rf"^optimizer\.{knob}="):
        dataclasses.replace(MARS(), **{knob: value}).check("optimizer")


def test_group_knobs_follow_what_each_group_runs():
    assert "gamma" in MARS().group_knobs("hidden") and "adam_b1" not in MARS().group_knobs("head")
    assert "adam_b1" in MARS().group_knobs("scalar") and "gamma" not in MARS().group_knobs("scalar")
