"""optimizer/schedules.py: every schedule's endpoints pinned by hand.

A run of N updates uses step indices 0..N-1 (optax counts from 0). The warmup starts at
lr/warmup (step warmup-1 uses lr) and every decaying schedule reaches exactly min_lr on step
N-1, the last update: a schedule that got there only at step N never ran its final lr. Plus
edge cases (decay of 0 or 1 steps, warmup filling the run, a 1-step run) and the knob checks.
Pure functions of a step: no model, no optimizer state except hand-checked SGD runs, and the
schedule across a step that train.skip_nonfinite skips (it follows the step counter)."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import optimizer_update, per_optimizer, rounding_rtol

import train_jax as T
from models import losses
from models.gpt import param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer.diagnostics import find_states
from optimizer.nonfinite import skip_nonfinite
from optimizer.schedules import SCHEDULES, Constant, Cosine, Linear, PiecewiseLinear, Trapezoid
from optimizer.sgdm import SGDM
from utils.config import build_section
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

LR, MIN_LR, WARMUP, N = 1.0, 0.1, 4, 20


def schedule_atol(lr: float = LR) -> float:
    """How far a float32 schedule value may be from the float64 one the tests write out, for a
    schedule of peak `lr` (every value and every intermediate term is at most lr in size): the
    step's fraction x (1 rounding); the shape: cosine's π·x (π's own float32 rounding and the
    product's: 3u relative on x, up to 3π·u ≈ 9.4u absolute in cos's argument, passed on by its
    slope <= 1) and cos's ulp, or 1 − √x (2u), or interp's (2u); 1 + cos; lr − min_lr, the product
    and + min_lr (1 each); lr's and min_lr's float32 rounding (2): <= 17 roundings of u·lr
    (u = EPS32/2), with rounding_rtol's 2x margin. One absolute bound (not rtol): near min_lr the
    value is ~10x smaller than the terms it was computed from."""
    return rounding_rtol(17) * lr


def _values(schedule, steps, lr: float = LR) -> np.ndarray:
    """The schedule eagerly and jitted on an int32 step (what optax's count is): both must agree
    (each within schedule_atol of the exact value, whatever XLA fuses or contracts)."""
    steps = list(steps)
    eager = np.array([float(schedule(jnp.asarray(s, jnp.int32))) for s in steps])
    jitted = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32)))
    np.testing.assert_allclose(jitted, eager, rtol=0, atol=2 * schedule_atol(lr))
    assert np.all(np.isfinite(eager)), eager
    return eager


def _cos(x: float) -> float:
    """The cosine decay from LR to MIN_LR at fraction x of the way."""
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * x)) / 2


# name -> (schedule, step index where the decay starts (first step below lr; None: never),
#          {step: hand-computed lr} in the decay)
DECAYING = {
    # Flat at lr on steps 3..6 (the last warmup step, then const=3), linear to MIN_LR on step 19.
    "linear": (Linear(lr=LR, warmup=WARMUP, const=3, min_lr=MIN_LR), 7,
               {6: 1.0, 7: 1 - 0.9 / 13, 12: 1 - 0.9 * 6 / 13}),
    # Cosine from lr on step 3 (the last warmup step) over 16 steps: half way on step 11.
    "cosine": (Cosine(lr=LR, warmup=WARMUP, min_lr=MIN_LR), WARMUP,
               {4: _cos(1 / 16), 11: 0.55, 15: _cos(12 / 16)}),
    # The last 6 steps (14..19) below lr, linear: 1 - 0.9·k/6 on the k-th of them.
    "trapezoid": (Trapezoid(lr=LR, warmup=WARMUP, decay=6, min_lr=MIN_LR), 14,
                  {13: 1.0, 14: 0.85, 16: 0.55, 18: 0.25}),
}


@pytest.mark.parametrize("name", sorted(DECAYING))
def test_decaying_schedule_endpoints(name):
    schedule, decay_start, points = DECAYING[name]
    s = schedule.build(N)
    np.testing.assert_allclose(_values(s, [0, WARMUP - 1, N - 1]), [LR / WARMUP, LR, MIN_LR], rtol=0,
                               atol=schedule_atol())
    np.testing.assert_allclose(_values(s, points), list(points.values()), rtol=0, atol=schedule_atol())
    # held after the end
    np.testing.assert_allclose(_values(s, [N, N + 1, 10 * N]), [MIN_LR] * 3, rtol=0, atol=schedule_atol())

    warmup = _values(s, range(WARMUP))
    np.testing.assert_allclose(warmup, LR * np.arange(1, WARMUP + 1) / WARMUP, rtol=0, atol=schedule_atol())
    after = _values(s, range(WARMUP - 1, N))
    flat, decay = after[: decay_start - (WARMUP - 1)], after[decay_start - (WARMUP - 1):]
    np.testing.assert_allclose(flat, LR, rtol=0, atol=schedule_atol())  # the last warmup step and any flat phase
    assert np.all(np.diff(decay) < 0) and decay[0] < LR, decay  # strictly falling, from the first decay step
    assert len(decay) == N - decay_start


def test_constant_endpoints():
    s = Constant(lr=LR, warmup=WARMUP).build(N)
    np.testing.assert_allclose(_values(s, [0, 1, WARMUP - 1, WARMUP, N - 1, 10 * N]),
                               [0.25, 0.5, LR, LR, LR, LR], rtol=0, atol=schedule_atol())
    np.testing.assert_allclose(_values(Constant(lr=LR).build(N), [0, 1, N - 1]), [LR] * 3, rtol=0, atol=schedule_atol())


@pytest.mark.parametrize("schedule", [Linear(lr=LR, min_lr=MIN_LR), Cosine(lr=LR, min_lr=MIN_LR),
                                      Trapezoid(lr=LR, decay=N, min_lr=MIN_LR)], ids=["linear", "cosine", "trapezoid"])
def test_without_warmup_the_first_update_uses_lr_and_the_last_min_lr(schedule):
    values = _values(schedule.build(N), range(N))
    np.testing.assert_allclose(values[[0, -1]], [LR, MIN_LR], rtol=0, atol=schedule_atol())
    assert np.all(np.diff(values) < 0)


def test_cosine_min_lr_null_is_a_tenth_of_lr():
    np.testing.assert_allclose(_values(Cosine(lr=2.0, warmup=2).build(10), [1, 9], lr=2.0), [2.0, 0.2], rtol=0,
                               atol=schedule_atol(2.0))


# --- edge cases: every value finite (checked in _values), the endpoints still as documented ------


def test_decay_of_one_step_is_the_last_update_at_min_lr():
    values = _values(Trapezoid(lr=LR, warmup=WARMUP, decay=1, min_lr=MIN_LR).build(N), range(N))
    np.testing.assert_allclose(values[WARMUP - 1:-1], LR, rtol=0, atol=schedule_atol())
    np.testing.assert_allclose(values[-1], MIN_LR, rtol=0, atol=schedule_atol())
    # Decay k steps = k steps below lr: 2 differs from 1 (with the decay anchored on its own first
    # step, both would give one step below lr).
    two = _values(Trapezoid(lr=LR, warmup=WARMUP, decay=2, min_lr=MIN_LR).build(N), [N - 3, N - 2, N - 1])
    np.testing.assert_allclose(two, [LR, (LR + MIN_LR) / 2, MIN_LR], rtol=0, atol=schedule_atol())


def test_one_minus_sqrt_decay_values():
    """decay_shape=1-sqrt: min_lr + (lr - min_lr)·(1 - sqrt(k/decay)) on the k-th of the last
    `decay` steps (k = 1..decay), so min_lr exactly on the last update, as the linear shape; the
    steps before the decay are the linear shape's (warmup, then lr) and Constant's, bit for bit."""
    decay = 6
    schedule = Trapezoid(lr=LR, warmup=WARMUP, decay=decay, min_lr=MIN_LR, decay_shape="1-sqrt")
    values = _values(schedule.build(N), range(N))
    expected = [MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(k / decay)) for k in range(1, decay + 1)]
    np.testing.assert_allclose(values[N - decay:], expected, rtol=0, atol=schedule_atol())
    assert values[-1] == np.float32(MIN_LR)
    linear = _values(Trapezoid(lr=LR, warmup=WARMUP, decay=decay, min_lr=MIN_LR).build(N), range(N))
    assert np.array_equal(values[:N - decay], linear[:N - decay])
    constant = _values(Constant(lr=LR, warmup=WARMUP).build(N), range(N))
    no_floor = _values(Trapezoid(lr=LR, warmup=WARMUP, decay=decay, decay_shape="1-sqrt").build(N), range(N))
    assert np.array_equal(no_floor[:N - decay], constant[:N - decay])  # a constant trunk is an exact branch point
    assert Trapezoid(lr=LR).decay_shape == "linear"  # the default keeps earlier runs' numbers


@pytest.mark.parametrize("warmup,steps", [(0, 1), (0, 9), (3, 9), (9, 9), (12, 9)])
def test_a_constant_schedule_is_its_trapezoid_bit_for_bit(warmup, steps):
    """Constant.as_trapezoid (what the train step is built from: a comparison's trunk then shares its
    branches' program) gives the constant's lrs bit for bit on every step of the run, with the knobs
    as the step takes them (float32 arguments of one jitted program) and as Python numbers; and its
    decay, past the run's end, is a real one (step `steps` is below lr), so the equality is not
    two constant programs. Warmups of 0, inside the run, filling it and outlasting it."""
    constant = Constant(lr=LR, warmup=warmup)
    trapezoid, length = constant.as_trapezoid(steps)
    assert (trapezoid.decay_shape, length) == ("1-sqrt", steps + 1)
    run = jnp.arange(steps + 1)

    def traced(schedule, n):
        knobs = {k: float(getattr(schedule, k)) for k in ("lr", "warmup", "decay") if getattr(schedule, k, 0)}
        build = lambda v, m: dataclasses.replace(schedule, **v).build(m)(run)
        return np.asarray(jax.jit(build)(knobs, float(n)))

    for ours, theirs in ((traced(constant, steps), traced(trapezoid, length)),
                         (_values(constant.build(steps), run), _values(trapezoid.build(length), run))):
        assert np.array_equal(ours[:steps], theirs[:steps]), (ours, theirs)
        assert theirs[steps] < ours[steps] or warmup > steps  # the decay exists, past the run


def test_decay_of_zero_steps_never_decays():
    values = _values(Trapezoid(lr=LR, warmup=WARMUP, decay=0, min_lr=MIN_LR).build(N), range(N))
    np.testing.assert_allclose(values[WARMUP - 1:], LR, rtol=0, atol=schedule_atol())


@pytest.mark.parametrize("schedule", [Linear(lr=LR, warmup=N - 1, min_lr=MIN_LR),
                                      Cosine(lr=LR, warmup=N - 1, min_lr=MIN_LR),
                                      Trapezoid(lr=LR, warmup=N - 1, decay=1, min_lr=MIN_LR)],
                         ids=["linear", "cosine", "trapezoid"])
def test_one_step_left_after_warmup_is_min_lr(schedule):
    np.testing.assert_allclose(_values(schedule.build(N), [N - 2, N - 1]), [LR, MIN_LR], rtol=0, atol=schedule_atol())


@pytest.mark.parametrize("schedule", [Linear(lr=LR, warmup=N, min_lr=MIN_LR),
                                      Linear(lr=LR, warmup=5, const=N - 5, min_lr=MIN_LR),
                                      Cosine(lr=LR, warmup=N, min_lr=MIN_LR),
                                      Trapezoid(lr=LR, warmup=N, decay=0, min_lr=MIN_LR)],
                         ids=["linear", "linear-const", "cosine", "trapezoid"])
def test_warmup_and_flat_phase_filling_the_run_hold_lr_to_the_end(schedule):
    """No room to decay: the last update uses lr (not a NaN, not a constant from a zero-length
    optax schedule); min_lr follows after the run."""
    np.testing.assert_allclose(_values(schedule.build(N), [N - 1, N]), [LR, MIN_LR], rtol=0, atol=schedule_atol())


@pytest.mark.parametrize("schedule", [Linear(lr=LR, min_lr=MIN_LR), Cosine(lr=LR, min_lr=MIN_LR),
                                      Trapezoid(lr=LR, decay=1, min_lr=MIN_LR), Constant(lr=LR, warmup=1)],
                         ids=["linear", "cosine", "trapezoid", "constant"])
def test_one_step_runs_are_finite(schedule):
    values = _values(schedule.build(1), [0, 1, 2])
    assert values[0] in (pytest.approx(LR), pytest.approx(MIN_LR))
    np.testing.assert_allclose(values[1:], values[2], rtol=0, atol=schedule_atol())


def test_warmup_longer_than_the_run_keeps_ramping():
    values = _values(Cosine(lr=LR, warmup=2 * N, min_lr=MIN_LR).build(N), [0, N - 1])
    np.testing.assert_allclose(values, [LR / (2 * N), LR / 2], rtol=0, atol=schedule_atol())


# --- piecewise_linear ----------------------------------------------------------------------------


def test_piecewise_linear_interpolates_on_update_indices_and_is_flat_outside():
    s = PiecewiseLinear(lr=2.0, steps=(10, 20, 40), scales=(0.0, 1.0, 0.5)).build(100)
    steps = [0, 10, 15, 20, 30, 40, 100]
    np.testing.assert_allclose(_values(s, steps, lr=2.0), [0, 0, 1, 2, 1.5, 1, 1], rtol=0, atol=schedule_atol(2.0))
    # Its points are update indices: ending a 20-step run at 0.1·lr takes the point (19, 0.1).
    end = PiecewiseLinear(lr=2.0, steps=(0, 19), scales=(1.0, 0.1)).build(20)
    np.testing.assert_allclose(_values(end, [0, 19], lr=2.0), [2.0, 0.2], rtol=0, atol=schedule_atol(2.0))


# --- through the optimizer: the run's last update uses min_lr ------------------------------------


def test_the_last_update_of_a_run_uses_min_lr():
    """Plain SGD on a gradient of 1: update k is -lr(k). Pins that the optimizer asks the
    schedule for steps 0..N-1, so the schedule's endpoints are the run's."""
    n = 6
    schedule = Linear(lr=LR, warmup=2, min_lr=MIN_LR).build(n)
    tx = make_optimizer(SGDM(momentum=0.0), schedule, {"w": "hidden"}, None, LR, {})
    params, grads = {"w": jnp.zeros(())}, {"w": jnp.ones(())}
    update = jax.jit(tx.update)
    state, lrs = tx.init(params), []
    for _ in range(n):
        u, state = update(grads, state, params)
        lrs.append(-float(u["w"]))
    np.testing.assert_allclose(lrs, [0.5, 1.0, 0.775, 0.55, 0.325, MIN_LR], rtol=0, atol=schedule_atol())


# --- with train.skip_nonfinite: a skipped step still moves the schedule -------------------------------


def test_after_a_skipped_step_the_applied_lr_is_the_logged_one_and_the_last_is_min_lr(tiny_run):
    """Four steps of cosine(0.1 -> 0.01) SGD, the second one skipped (a NaN in its loss mask makes
    the gradient NaN). The lr each finite step applied, read off its update (u = -lr·g, no
    momentum), is train/lr = schedule(step), and the last step applies min_lr. optax's
    apply_if_finite alone keeps the schedule's counter on a skipped step: steps 3 and 4 applied
    schedule(1) and schedule(2), one step behind what was logged, and min_lr was never reached."""
    run = tiny_run("train.skip_nonfinite=true", "train.max_steps=4", "optimizer=sgdm", "optimizer.momentum=0.0",
                   "optimizer/lr_config=cosine", "optimizer.lr_config.lr=0.1", "optimizer.lr_config.min_lr=0.01",
                   "optimizer.lr_config.warmup=0", "train.gradient_clip_val=null")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    schedule, _, state, step = T.init_training(run, mesh)
    labels = jax.tree.leaves(param_labels(state.model))
    grad_at = eqx.filter_jit(eqx.filter_grad(lambda m, b: losses.loss_fn(m, b, None, "float32")[0]))
    params = lambda model: [np.asarray(x, np.float64)
                            for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))]
    rng = np.random.default_rng(0)
    applied, logged = [], []
    for n in range(4):
        batch = {"tokens": rng.integers(0, 64, (1, 8, 17), dtype=np.int32),
                 "loss_mask": np.ones((1, 8, 16), np.float32)}
        if n == 1:
            batch["loss_mask"][0, 0, 0] = np.nan
        grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(
            grad_at(state.model, jax.tree.map(lambda v: jnp.asarray(v[0]), batch)))]
        before = params(state.model)
        state, metrics = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), True)
        assert int(metrics["train/skipped_steps"]) == (n >= 1)
        if n == 1:
            continue
        by_group: dict = {}
        for x_new, x, g, label in zip(params(state.model), before, grads, labels, strict=True):
            num, den = by_group.get(label, (0.0, 0.0))
            by_group[label] = (num + np.sum((x - x_new) * g), den + np.sum(g * g))  # least squares: x - x_new = lr·g
        applied.append({label: num / den for label, (num, den) in by_group.items()})
        logged.append({label: float(metrics[f"train/lr/{label}"]) for label in by_group} | {
            "run": float(metrics["train/lr"])})
    expected = [float(schedule(n)) for n in (0, 2, 3)]
    np.testing.assert_allclose(expected[-1], 0.01, rtol=0, atol=schedule_atol(0.1))  # the last update's lr: min_lr
    for n, got, log, want in zip((1, 3, 4), applied, logged, expected, strict=True):
        np.testing.assert_allclose(log["run"], want, rtol=0, atol=2 * schedule_atol(0.1), err_msg=f"step {n}: train/lr")
        for label, lr in got.items():
            # float32 weights: x - x_new carries ~1e-7·|x| per element, ~1e-4 of lr·g here
            np.testing.assert_allclose(lr, log[label], rtol=1e-3, err_msg=f"step {n}: the lr {label} applied")
            np.testing.assert_allclose(lr, want, rtol=1e-3, err_msg=f"step {n}: the lr {label} applied")  # the same


def three_steps_the_second_not_finite(tx, params, rng, hparams=None):
    """Steps 0, 1 and 2 of `tx` (built from `hparams`, for an update that reads a Hessian estimate:
    helpers.optimizer_update) on random gradients, step 1's all NaN: (the last updates, the state)."""
    update = jax.jit(lambda grads, state, params: optimizer_update(tx, grads, state, params, hparams))
    state = tx.init(params)
    for n in range(3):
        grads = {k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) * (np.nan if n == 1 else 1.0)
                 for k, p in params.items()}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return updates, state


@pytest.mark.parametrize("name", per_optimizer(sorted(OPTIMIZERS)))
def test_every_optimizers_schedule_counts_a_skipped_step(name):
    """A schedule that is 0 on step 1 only; step 1's gradient is NaN (skipped). Step 2 must use the
    schedule at step 2 (lr > 0, so every leaf moves), not at 1 (lr 0: nothing moves): every
    optimizer's lr goes through a counter that skip_nonfinite advances."""
    schedule = lambda count: jnp.where(count == 1, 0.0, 1e-2)
    shapes = {"w": ((2, 8, 12), "hidden"), "e": ((16, 8), "embed"), "h": ((8, 16), "head"), "b": ((8,), "scalar")}
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=shape), jnp.float32) for k, (shape, _) in shapes.items()}
    hparams = OPTIMIZERS[name]()
    tx = skip_nonfinite(make_optimizer(hparams, schedule, {k: g for k, (_, g) in shapes.items()}, None,
                                       1e-2, {}), max_consecutive_skips=3)
    updates, state = three_steps_the_second_not_finite(tx, params, rng, hparams)
    assert int(state.total_notfinite) == 1
    for k, u in updates.items():
        assert float(jnp.abs(u).max()) > 0, f"{name}: {k} did not move on step 2 (it used the lr of step 1)"
    assert {int(s.count) for s in find_states(state, optax.ScaleByScheduleState)} == {3}


# --- config ----------------------------------------------------------------------------------------


def test_schedule_max_steps_defaults_to_train_max_steps(tiny_run):
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.lr=1.0", "optimizer.lr_config.warmup=0",
                   "optimizer.lr_config.min_lr=0.0", "train.max_steps=41")
    assert run.optimizer.schedule_steps == 41
    s = run.optimizer.schedule.build(run.optimizer.schedule_steps)
    np.testing.assert_allclose(_values(s, [0, 20, 40]), [1, 0.5, 0], rtol=0, atol=schedule_atol(1.0))
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.max_steps=25", "train.max_steps=40")
    assert run.optimizer.schedule_steps == 25


def test_trapezoid_longer_than_the_run_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match="warmup.*decay.*max_steps"):
        Trapezoid(lr=1.0, warmup=60, decay=50).check_steps("optimizer.lr_config", 100)
    # ... and validate() runs that check, before any data or compilation.
    with pytest.raises(ConfigError, match="optimizer.lr_config: warmup"):
        tiny_run("optimizer/lr_config=trapezoid", "optimizer.lr_config.warmup=60",
                 "optimizer.lr_config.decay=50", "train.max_steps=100")


def test_warmup_longer_than_the_run_is_a_warning_not_an_error(tiny_run):
    run = tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.warmup=50", "train.max_steps=10")
    assert len(run.warnings) == 1 and "optimizer.lr_config" in run.warnings[0] and "warmup" in run.warnings[0]
    assert tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.warmup=5", "train.max_steps=10").warnings == ()


def test_min_lr_above_lr_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match=r"optimizer\.lr_config\.min_lr"):
        tiny_run("optimizer/lr_config=cosine", "optimizer.lr_config.min_lr=1.0", "optimizer.lr_config.lr=0.003")


@pytest.mark.parametrize("name, node, knob", [
    ("cosine", {"lr": 0.0}, "lr"),
    ("cosine", {"lr": 1.0, "warmup": -1}, "warmup"),
    ("linear", {"lr": 1.0, "const": -5}, "const"),
    ("trapezoid", {"lr": 1.0, "decay": -1}, "decay"),
    ("trapezoid", {"lr": 1.0, "decay": 2, "decay_shape": "cosine"}, "decay_shape"),
    ("cosine", {"lr": 1.0, "max_steps": 0}, "max_steps"),
    ("piecewise_linear", {"lr": 1.0, "steps": [0, 10], "scales": [1.0]}, "steps"),
    ("piecewise_linear", {"lr": 1.0, "steps": [0, 10, 10], "scales": [1.0, 0.5, 0.1]}, "steps"),
    ("constant", {}, "lr"),  # lr is required
])
def test_bad_schedule_knobs_raise_config_error(name, node, knob):
    with pytest.raises(ConfigError, match=rf"optimizer\.lr_config\.{knob}"):
        build_section(SCHEDULES[name], node, "optimizer.lr_config")


def test_wsd_is_trapezoid():
    assert SCHEDULES["wsd"] is SCHEDULES["trapezoid"] is Trapezoid


def test_schedule_free_step_count_follows_the_run_across_a_skip_and_a_fresh_state():
    """Schedule-Free's own step counter is an lr clock (optax evaluates the schedule at it for the
    weight of the average, one ahead of scale_by_learning_rate's count, since it starts at 1). A
    skipped step must advance it as it advances the schedule's count, else the next update weighs
    its average by the lr of one step earlier: here a schedule whose step 2 is 100 would enter
    max_lr although the step that would have used it was skipped. A fresh state at run step N
    (checkpoint.overwrite_optimizer) puts it at N + 1, beside the schedule's count at N."""
    from optax.contrib import ScheduleFreeState

    from optimizer.restart import fresh_state
    schedule = lambda count: jnp.where(count == 2, 100.0, 1e-2)
    labels = {"w": "hidden", "b": "scalar"}
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 12)), jnp.float32), "b": jnp.asarray(rng.normal(size=8),
                                                                                       jnp.float32)}
    tx = skip_nonfinite(make_optimizer(OPTIMIZERS["schedule_free_adamw"](), schedule, labels, None, 1e-2, {}), 3)
    updates, state = three_steps_the_second_not_finite(tx, params, rng)
    assert int(state.total_notfinite) == 1
    sf = find_states(state, ScheduleFreeState)
    assert {int(s.count) for s in find_states(state, optax.ScaleByScheduleState)} == {3}
    assert {int(s.step_count) for s in sf} == {4}  # steps 0, 1 (skipped), 2 taken: the clock at 3 + 1
    # max_lr saw schedule(1) and schedule(3) (the two updates taken), never the skipped step's schedule(2)
    assert {float(s.max_lr) for s in sf} == {float(np.float32(1e-2))}  # exactly the float32 value, not 100
    fresh = fresh_state(tx, params, jnp.asarray(5, jnp.int32), None)
    assert {int(s.count) for s in find_states(fresh, optax.ScaleByScheduleState)} == {5}
    assert {int(s.step_count) for s in find_states(fresh, ScheduleFreeState)} == {6}
