"""optimizer.hyperball (optimizer/hyperball.py): every registered optimizer's update kept on the
sphere, against a float64 NumPy re-derivation of the reference's rule (Levanter's muonh.py /
adamh.py) applied to that optimizer's own update; the weight norms of the tiny GPT's hidden and
head matrices after training steps against their initial norms; the tiny GPT learning under
adamw+hyperball and muon+hyperball; the diagnostics against NumPy; the schedule counter moved by a
skipped step and a fresh state; the knob's refusals, each one line."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_bool_knob, learnable_losses, optimizer_update, per_optimizer, rounding_rtol, sum_atol

from models.gpt import param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer import hyperball as H
from optimizer.adamw import AdamW
from optimizer.diagnostics import find_states, optimizer_metrics
from optimizer.groups import group_lr
from optimizer.muon import Muon
from optimizer.nonfinite import skip_nonfinite
from optimizer.restart import schedules_at
from utils.errors import ConfigError

SHAPES = {"w": ((2, 8, 12), "hidden"), "h": ((12, 10), "head"), "e": ((10, 8), "embed"), "b": ((8,), "scalar")}
LABELS = {k: label for k, (_, label) in SHAPES.items()}
BASE_LR = 2e-2
OVERRIDES = {"head": {"lr": 5e-3}}  # a sphere group at its own peak: its step must follow its own lr
SCHEDULE = optax.linear_schedule(0.0, BASE_LR, 3)  # warmup from 0: the first step moves nothing
STEPS = 4


def norm_rtol(n: int, margin: float = 2) -> float:
    """Relative error of a float32 Frobenius norm of n elements against float64: the sum of squares
    errs by sum_atol(n, its own value) (the squares' roundings included), the square root halves
    that and rounds once more."""
    return sum_atol(n, 1.0, margin) / 2 + rounding_rtol(1, margin)


def matrix_norms(x: np.ndarray) -> np.ndarray:
    """float64 ‖·‖_F of each matrix (the last two axes), keeping them as 1."""
    x = np.asarray(x, np.float64)
    axes = tuple(range(max(x.ndim - 2, 0), x.ndim))
    return np.sqrt(np.sum(x * x, axis=axes, keepdims=True))


def reference_update(p, u, lr) -> np.ndarray:
    """Levanter's scale_invariant_update in float64: d = −u (the direction it subtracts),
    p' = p − lr·d·‖p‖/‖d‖, returned as p'·‖p‖/‖p'‖ − p, per matrix."""
    p, d = np.asarray(p, np.float64), -np.asarray(u, np.float64)
    moved = p - lr * d * matrix_norms(p) / matrix_norms(d)
    return moved / matrix_norms(moved) * matrix_norms(p) - p


def _random_tree(rng, scale=1.0):
    return {k: jnp.asarray(scale * rng.normal(size=shape), jnp.float32) for k, (shape, _) in SHAPES.items()}


def _without_decay(hp):
    return dataclasses.replace(hp, weight_decay=0.0) if hasattr(hp, "weight_decay") else hp


# --- every registered optimizer --------------------------------------------------------------------


@pytest.mark.parametrize("name", per_optimizer(sorted(OPTIMIZERS)))
def test_every_optimizer_steps_on_the_sphere_as_the_reference_does(name):
    """STEPS updates along the hyperball's own trajectory: on `hidden` and `head`, the update is the
    reference's rule applied to the optimizer's own update (the same optimizer without the knob,
    fed the same params and grads), at its group's lr; `embed` and `scalar` get that update
    unchanged; and every matrix keeps its initial norm. An optimizer that declares the knob
    unsupported is refused instead."""
    hp = _without_decay(OPTIMIZERS[name]())
    if getattr(hp, "HYPERBALL_UNSUPPORTED", None):
        with pytest.raises(ConfigError, match=rf"hyperball=true is not available for optimizer\.name={name}"):
            make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES, hyperball=True)
        return
    plain = make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES)
    ball = make_optimizer(hp, SCHEDULE, LABELS, 1.0, BASE_LR, OVERRIDES, hyperball=True)
    rng = np.random.default_rng(0)
    params = _random_tree(rng)
    grads_seq = [_random_tree(rng, scale=2.0) for _ in range(STEPS)]  # norm ~10 under clip 1

    @jax.jit
    def step(p, g, s_plain, s_ball):
        u_plain, s_plain = optimizer_update(plain, g, s_plain, p, hp)
        u_ball, s_ball = optimizer_update(ball, g, s_ball, p, hp)
        return u_plain, u_ball, s_plain, s_ball

    radii = {k: matrix_norms(params[k]) for k in ("w", "h")}
    peaks = {"hidden": BASE_LR, "head": OVERRIDES["head"]["lr"]}
    s_plain, s_ball = plain.init(params), ball.init(params)
    for t, grads in enumerate(grads_seq):
        u_plain, u_ball, s_plain, s_ball = step(params, grads, s_plain, s_ball)
        lr = float(SCHEDULE(t)) * 1.0 / BASE_LR  # the schedule's shape at step t, times each group's peak
        for k, label in LABELS.items():
            got = np.asarray(u_ball[k], np.float64)
            if label not in peaks:
                np.testing.assert_array_equal(got, np.asarray(u_plain[k]), err_msg=f"{name}: step {t + 1}, {k}")
                continue
            want = reference_update(params[k], u_plain[k], lr * peaks[label]) if t else np.zeros_like(got)
            n = int(np.prod(SHAPES[k][0][-2:]))
            # float32 against float64, at the scale of the weights: our R and the reference's ‖p‖
            # differ by one projection's norm error (the last step's) plus R's own; the update takes
            # three more norms (of u, of p + lr·R·û, of the result's R·x/‖x‖) and ~8 elementwise
            # roundings (the normalisation, the step, the rescale, the difference and conversions).
            bound = np.abs(np.asarray(params[k])).max() * (5 * norm_rtol(n) + rounding_rtol(8))
            assert np.all(np.abs(got - want) <= bound), f"{name}: step {t + 1}, leaf {k}: {np.abs(got - want).max()}"
        params = jax.tree.map(lambda p, u: p + u, params, u_ball)
        for k, r in radii.items():
            n = int(np.prod(SHAPES[k][0][-2:]))
            # R rounded once (at init) and the projection's norm once; then p + u rounds each element
            err = np.abs(matrix_norms(params[k]) - r) / r
            assert np.all(err <= 2 * norm_rtol(n) + rounding_rtol(3)), f"{name}: step {t + 1}, leaf {k}: {err.max()}"


def test_a_sphere_groups_default_lr_is_the_relative_step():
    """Muon's head runs AdamW at adam_lr; under the knob it steps at lr_config.lr (MuonH's lm_head
    takes the Muon lr), unless its group sets one; embed and scalar keep adam_lr."""
    hp = Muon()
    assert group_lr(hp, "head", BASE_LR, {}) == hp.adam_lr
    assert group_lr(hp, "head", BASE_LR, {}, hyperball=True) == BASE_LR
    assert group_lr(hp, "head", BASE_LR, OVERRIDES, hyperball=True) == OVERRIDES["head"]["lr"]
    assert group_lr(hp, "embed", BASE_LR, {}, hyperball=True) == hp.adam_lr


# --- diagnostics and counters ----------------------------------------------------------------------


def test_diagnostics_are_the_step_ratio_and_the_norm_error_of_each_sphere_group():
    hp = AdamW(weight_decay=0.0)
    tx = make_optimizer(hp, optax.constant_schedule(BASE_LR), LABELS, None, BASE_LR, OVERRIDES, hyperball=True)
    rng = np.random.default_rng(1)
    params, grads = _random_tree(rng), _random_tree(rng)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    got = jax.jit(lambda s, p: optimizer_metrics(hp, s, p))(state, new)
    assert {k for k in got if "hyperball" in k} == {f"optim/{g}/hyperball_{s}" for g in ("hidden", "head")
                                                    for s in ("step_ratio_mean", "step_ratio_max", "norm_error_max")}
    for group, k in (("hidden", "w"), ("head", "h")):
        r = matrix_norms(params[k])
        ratio = (matrix_norms(np.asarray(updates[k])) / r).ravel()
        error = (np.abs(matrix_norms(new[k]) - r) / r).ravel()
        n = int(np.prod(SHAPES[k][0][-2:]))
        # both sides take the same float32 update's norm; ours in float32 (one norm, one division)
        np.testing.assert_allclose(float(got[f"optim/{group}/hyperball_step_ratio_mean"]), ratio.mean(),
                                   rtol=norm_rtol(n) + rounding_rtol(3))
        np.testing.assert_allclose(float(got[f"optim/{group}/hyperball_step_ratio_max"]), ratio.max(),
                                   rtol=norm_rtol(n) + rounding_rtol(2))
        # the error itself is float32 rounding: compared to its size, at the norm's precision
        assert abs(float(got[f"optim/{group}/hyperball_norm_error_max"]) - error.max()) <= 3 * norm_rtol(n)
        assert error.max() <= 2 * norm_rtol(n) + rounding_rtol(3)
        # p + lr·R·û lies on a ball of radius lr·R around p: seen from 0 it turns p by at most
        # asin(lr), so the chord back on the sphere is at most 2·sin(asin(lr)/2)·R
        lr = OVERRIDES["head"]["lr"] if group == "head" else BASE_LR
        assert 0 < ratio.max() <= 2 * np.sin(np.arcsin(lr) / 2) * (1 + norm_rtol(n) + rounding_rtol(4))


def test_the_step_counter_moves_with_a_skipped_step_and_a_fresh_state():
    """The hyperball's lr counter is an optax.ScaleByScheduleState: after one skipped non-finite
    step it reads 1 with the inner optimizer's, and schedules_at sets it to the run's step."""
    tx = skip_nonfinite(make_optimizer(AdamW(weight_decay=0.0), SCHEDULE, LABELS, None, BASE_LR, OVERRIDES,
                                       hyperball=True), 3)
    rng = np.random.default_rng(2)
    params, grads = _random_tree(rng), _random_tree(rng)
    _, state = jax.jit(tx.update)(jax.tree.map(lambda g: g * np.nan, grads), tx.init(params), params)
    balls = find_states(state, H.HyperballState)
    assert len(balls) == 2  # hidden and head
    counters = find_states(state, optax.ScaleByScheduleState)
    assert len(counters) == 4 + 2 and all(int(c.count) == 1 for c in counters)
    assert all(int(b.schedule.count) == 9 for b in find_states(schedules_at(state, 9), H.HyperballState))


# --- through the train step ----------------------------------------------------------------------


@pytest.mark.slow  # ~4 s each: a train step compiled
@pytest.mark.parametrize("optimizer,extra", [
    ("adamw", ("optimizer.weight_decay=0", "optimizer.lr_config.lr=2e-2", "optimizer.groups.embed.lr=3e-3",
               "optimizer.groups.scalar.lr=3e-3")),
    ("muon", ()),
])
def test_gpt_tiny_learns_and_keeps_each_matrix_at_its_initial_norm(tiny_run, optimizer, extra):
    """30 steps on the learnable batch: the loss falls as every optimizer's does without the knob
    (tests/test_groups.py's bar), and every block matrix ends at its initial Frobenius norm. The
    head is tied (gpt_tiny's): an untied head on the sphere caps the logits at its 0.02-std init's
    norm times ln_f's gain, and learns far slower (docs/optimizers.md, "Hyperball"); its update on
    the sphere is checked above, as every group's."""
    run = tiny_run(f"optimizer={optimizer}", "optimizer.hyperball=true", "train.max_steps=30",
                   "optimizer.lr_config.warmup=5", *extra)
    weights: list = []
    losses, _ = learnable_losses(run, 30, weights)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], (optimizer, losses[0], losses[-1])
    before, after = weights
    labels = param_labels(before)
    moved = 0
    for w0, w1, label in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(labels), strict=True):
        if label not in H.HYPERBALL_GROUPS:
            continue
        n = int(np.prod(w0.shape[-2:]))
        r0, r1 = matrix_norms(w0), matrix_norms(w1)
        # the last projection's norm and R's (init), and p + u's rounding per element
        np.testing.assert_array_less(np.abs(r1 - r0) / r0, 2 * norm_rtol(n) + rounding_rtol(3))
        moved += 1 if np.abs(w1 - w0).max() > 0 else 0
    assert moved == 4  # attn_qkv, attn_out, mlp_in and mlp_out all trained


# --- the knob ----------------------------------------------------------------------------------


def test_the_knob_validates_and_defaults_to_off(tiny_run):
    check_bool_knob(tiny_run, "hyperball", "muon")


@pytest.mark.parametrize("overrides,message", [
    (("optimizer.hyperball=true",),  # adamw's default weight_decay 0.1
     r"optimizer\.weight_decay=0\.1 with optimizer\.hyperball=true: .*; set optimizer\.weight_decay=0$"),
    (("optimizer=muon", "optimizer.hyperball=true", "optimizer.groups.head.weight_decay=0.1"),
     r"optimizer\.groups\.head\.weight_decay=0\.1 with .*; set optimizer\.groups\.head\.weight_decay=0$"),
    (("optimizer=prodigy", "optimizer.hyperball=true", "optimizer.weight_decay=0"),
     r"optimizer\.hyperball=true is not available for optimizer\.name=prodigy: .*; set optimizer\.hyperball=false$"),
    (("optimizer=schedule_free_adamw", "optimizer/lr_config=constant", "optimizer.hyperball=true"),
     r"not available for optimizer\.name=schedule_free_adamw: .*; set optimizer\.hyperball=false$"),
    (("optimizer=muon", "optimizer.hyperball=true", "model.lora.rank=4"),
     r"optimizer\.hyperball=true with model\.lora\.rank=4: .*; set optimizer\.hyperball=false$"),
])
def test_bad_combinations_are_refused_in_one_line(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        tiny_run(*overrides)
    assert "\n" not in str(caught.value)


def test_weight_decay_only_on_groups_off_the_sphere_is_allowed(tiny_run):
    """Embeddings may decay (they are not on the sphere): every other group's decay set to 0."""
    run = tiny_run("optimizer.hyperball=true", "optimizer.weight_decay=0", "optimizer.decay_embeddings=true",
                   "optimizer.groups.embed.weight_decay=0.1")
    assert run.optimizer.group_overrides["embed"]["weight_decay"] == 0.1
