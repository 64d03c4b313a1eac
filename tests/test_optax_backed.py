"""NAdamW, Schedule-Free AdamW, AdEMAMix, ADOPT and Prodigy are optax's (optimizer/nadamw.py,
schedule_free.py, ademamix.py, adopt.py, prodigy.py): what is ours is the wiring. Each is run
through `make_optimizer` (global-norm clipping, a warmup schedule, per-group lr and knob
overrides, weight decay on the decayed groups)
and compared with the optax function called directly on each parameter with that group's
arguments. Then: AdEMAMix's α/β3 warmup against the paper's formula, the diagnostics against NumPy
on the state, and the knobs that depend on the run (`for_run`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EPS32, adam_sqrt_v_rtol, rounding_rtol, sum_atol
from optax.contrib import ScaleByAdemamixState, ScheduleFreeState

from optimizer import eval_params, make_optimizer
from optimizer.ademamix import AdEMAMix, alpha_schedule, b3_schedule
from optimizer.adopt import ADOPT
from optimizer.diagnostics import optimizer_metrics
from optimizer.nadamw import NAdamW
from optimizer.prodigy import Prodigy
from optimizer.schedule_free import ScheduleFreeAdamW, rms_state
from utils.errors import ConfigError

SHAPES = {"w": ((2, 6, 10), "hidden"), "e": ((12, 6), "embed"), "h": ((6, 12), "head"), "b": ((6,), "scalar")}
BASE_LR, CLIP, STEPS, WARMUP = 1e-2, 1.0, 6, 4
GRAD_NORMS = (0.5, 3.0, 0.8, 5.0, 1.5, 0.2)  # the global norm of each step's gradient: clipped or not
HPARAMS = {"nadamw": NAdamW(weight_decay=0.1), "schedule_free_adamw": ScheduleFreeAdamW(weight_decay=0.1),
           "ademamix": AdEMAMix(alpha_b3_warmup=WARMUP),  # a warmup that ends within the run
           "adopt": ADOPT(weight_decay=0.1),
           # d0 = 1 (lr 1e-2 multiplies it): every group moves > 1e-3 in the 6 steps
           "prodigy": Prodigy(weight_decay=0.1, d0=1.0)}
# Every group differs from the defaults in its own way, so a group that gets another's settings shows.
OVERRIDES = {
    "nadamw": {"hidden": {"lr": 2e-2}, "embed": {"b1": 0.8}, "head": {"weight_decay": 0.05},
               "scalar": {"lr": 5e-3, "eps": 1e-6}},
    "schedule_free_adamw": {"hidden": {"lr": 2e-2}, "embed": {"b1": 0.8}, "head": {"weight_decay": 0.05},
                            "scalar": {"lr": 5e-3, "b2": 0.99}},
    "ademamix": {"hidden": {"lr": 2e-2}, "embed": {"alpha": 3.0, "b1": 0.8},
                 "head": {"weight_decay": 0.05, "b3": 0.999}, "scalar": {"lr": 5e-3}},
    "adopt": {"hidden": {"lr": 2e-2}, "embed": {"b1": 0.8}, "head": {"weight_decay": 0.05},
              "scalar": {"lr": 5e-3, "eps": 1e-4, "b2": 0.99}},
    "prodigy": {"hidden": {"lr": 2e-2}, "embed": {"b1": 0.8, "d_coef": 0.5},
                "head": {"weight_decay": 0.05, "b3": 0.9}, "scalar": {"lr": 5e-3, "d0": 0.5, "eps": 1e-6}},
}


def warmup(step):
    return BASE_LR * jnp.minimum(1.0, (jnp.asarray(step, jnp.float32) + 1.0) / 3.0)


def _knob(name: str, group: str, knob: str):
    return OVERRIDES[name].get(group, {}).get(knob, getattr(HPARAMS[name], knob))


def _reference_tx(name: str, group: str) -> optax.GradientTransformation:
    """The optax function itself, with the arguments the group's settings mean (written out here,
    not taken from optimizer.groups): its lr the warmup times lr/BASE_LR, its weight decay the
    override, else the optimizer's on hidden and head only."""
    factor = OVERRIDES[name].get(group, {}).get("lr", BASE_LR) / BASE_LR
    lr = lambda step: warmup(step) * factor
    decay = HPARAMS[name].weight_decay if group in ("hidden", "head") else 0.0
    wd = OVERRIDES[name].get(group, {}).get("weight_decay", decay)
    k = functools.partial(_knob, name, group)
    if name == "nadamw":
        return optax.nadamw(lr, b1=k("b1"), b2=k("b2"), eps=k("eps"), weight_decay=wd)
    if name == "adopt":
        return optax.chain(optax.contrib.scale_by_adopt(b1=k("b1"), b2=k("b2"), eps=k("eps"), use_clipping=k("clip")),
                           optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))
    if name == "prodigy":
        return optax.contrib.prodigy(lr, betas=(k("b1"), k("b2")), beta3=k("b3"), eps=k("eps"), estim_lr0=k("d0"),
                                     estim_lr_coef=k("d_coef"), weight_decay=wd, safeguard_warmup=k("safeguard_warmup"))
    if name == "schedule_free_adamw":
        return optax.contrib.schedule_free_adamw(lr, b1=k("b1"), b2=k("b2"), eps=k("eps"), weight_decay=wd,
                                                 weight_lr_power=k("weight_lr_power"))
    return optax.contrib.ademamix(lr, b1=k("b1"), b2=k("b2"), b3=b3_schedule(k("b1"), k("b3"), WARMUP),
                                  alpha=alpha_schedule(k("alpha"), WARMUP), eps=k("eps"), weight_decay=wd)


def _inputs():
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=shape), jnp.float32) for k, (shape, _) in SHAPES.items()}
    grads = []
    for norm in GRAD_NORMS:
        g = {k: rng.normal(size=shape) for k, (shape, _) in SHAPES.items()}
        scale = norm / math.sqrt(sum(np.sum(x**2) for x in g.values()))
        grads.append({k: jnp.asarray(x * scale, jnp.float32) for k, x in g.items()})
    return params, grads


@functools.cache
def _runs(name: str):
    """(ours, reference): each [(params, state)] after 0..STEPS updates (the reference's state a
    dict of per-parameter states), both jitted."""
    params, grads = _inputs()
    labels = {k: label for k, (_, label) in SHAPES.items()}
    ours = make_optimizer(HPARAMS[name], warmup, labels, CLIP, BASE_LR, OVERRIDES[name])
    clip = optax.clip_by_global_norm(CLIP)
    ref = {k: _reference_tx(name, label) for k, (_, label) in SHAPES.items()}

    @jax.jit
    def run_ours(params, grads):
        state, out = ours.init(params), [(params, ours.init(params))]
        for g in grads:
            updates, state = ours.update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append((params, state))
        return out

    @jax.jit
    def run_reference(params, grads):
        clip_state, states = clip.init(params), {k: ref[k].init(p) for k, p in params.items()}
        out = [(params, states)]
        for g in grads:
            g, clip_state = clip.update(g, clip_state)
            new_params, new_states = {}, {}
            for k, p in params.items():
                u, new_states[k] = ref[k].update(g[k], states[k], p)
                new_params[k] = p + u
            params, states = new_params, new_states
            out.append((params, states))
        return out

    return run_ours(params, grads), run_reference(params, grads)


def _tolerance(*trees) -> float:
    """Both sides run the same float32 operations per element, but in two programs XLA may fuse
    (and so round) differently: allow 10 roundings of the largest value per step. A wiring slip (a
    group's lr, decay or knob) moves a weight by ~lr = 1e-2 per step: 10⁴× more."""
    largest = max(float(jnp.max(jnp.abs(x))) for t in trees for x in jax.tree.leaves(t))
    return 10 * STEPS * EPS32 * largest


@pytest.mark.parametrize("name", sorted(HPARAMS))
def test_wiring_equals_optax_called_directly_per_group(name):
    ours, reference = _runs(name)
    moved = {k: float(jnp.max(jnp.abs(ours[-1][0][k] - ours[0][0][k]))) for k in SHAPES}
    assert min(moved.values()) > 1e-3, moved  # every group trained
    for step, ((p, state), (p_ref, states_ref)) in enumerate(zip(ours, reference)):
        atol = _tolerance(p, p_ref)
        for k in SHAPES:
            np.testing.assert_allclose(p[k], p_ref[k], rtol=0, atol=atol, err_msg=f"{name} step {step}: {k}")
        if name == "schedule_free_adamw":  # the evaluation point x of every group, each with its own b1
            x = eval_params(HPARAMS[name], p, state)
            for k in SHAPES:
                x_ref = optax.contrib.schedule_free_eval_params(states_ref[k], p_ref[k])
                np.testing.assert_allclose(x[k], x_ref, rtol=0, atol=atol, err_msg=f"x, step {step}: {k}")
                if step == STEPS:  # x is not y: comparing x checks something more (after 1 update x = z = y)
                    assert float(jnp.max(jnp.abs(x[k] - p[k]))) > 2 * atol


# --- AdEMAMix's warmup of α and β3 ----------------------------------------------------------------


def _paper_alpha(t: int, alpha: float, warmup_steps: int) -> float:
    """Algorithm 1's f_α at step t (1-based): linear from 0, α from t = T on."""
    return alpha * t / warmup_steps if t < warmup_steps else alpha


def _paper_b3(t: int, b_start: float, b3: float, warmup_steps: int) -> float:
    """Algorithm 1's f_β3 at step t (1-based): linear in half-life t ↦ ln 0.5/ln β − 1, float64."""
    if t >= warmup_steps:
        return b3
    f = lambda beta: math.log(0.5) / math.log(beta) - 1
    a = t / warmup_steps
    return 0.5 ** (1 / ((1 - a) * f(b_start) + a * f(b3) + 1))


@pytest.mark.parametrize("b1, b3, alpha, warmup_steps", [(0.9, 0.9999, 8.0, 10), (0.95, 0.999, 5.0, 7)])
def test_alpha_and_b3_follow_the_papers_warmup(b1, b3, alpha, warmup_steps):
    """optax calls them with the slow EMA's count (0 on the first update), which is step t - 1.
    α is within float32 rounding of α (relative 2 EPS32); β3 is near 1, where float32 values lie
    EPS32 apart: within 2 EPS32 absolute."""
    counts = np.arange(warmup_steps + 3)
    got_alpha = jax.jit(jax.vmap(alpha_schedule(alpha, warmup_steps)))(counts)
    got_b3 = jax.jit(jax.vmap(b3_schedule(b1, b3, warmup_steps)))(counts)
    want_alpha = [_paper_alpha(c + 1, alpha, warmup_steps) for c in counts]
    want_b3 = [_paper_b3(c + 1, b1, b3, warmup_steps) for c in counts]
    np.testing.assert_allclose(got_alpha, want_alpha, rtol=2 * EPS32)
    np.testing.assert_allclose(got_b3, want_b3, rtol=0, atol=2 * EPS32)
    assert float(got_alpha[0]) == pytest.approx(alpha / warmup_steps) and b1 < float(got_b3[0]) < b3
    assert float(got_alpha[warmup_steps - 1]) == alpha and float(got_b3[warmup_steps - 1]) == np.float32(b3)


# --- Prodigy where its d estimate is 0/0 ---------------------------------------------------------


def test_prodigy_takes_no_step_while_d_is_undefined_then_follows_optax():
    """A first update at lr 0 (a warmup from 0, safeguard_warmup off) leaves d̂'s denominator at 0:
    optax.contrib.prodigy sets d to NaN and the weights with it; ours, as the authors' code, makes
    no update and keeps d (the moments advance). The next update, at lr > 0, is optax's from that
    state: exactly the same operations, so the same bits."""
    hp = Prodigy(d0=1e-2)
    schedule = lambda count: jnp.where(count == 0, 0.0, 1.0)
    params, grads = _inputs()
    params, grads = params["w"], [g["w"] for g in grads[:2]]
    ours, plain = hp.transform("hidden", schedule), optax.contrib.prodigy(schedule, estim_lr0=hp.d0)

    @jax.jit
    def run(params, grads):
        s_ours, s_plain = ours.init(params), plain.init(params)
        u_ours, s_ours = ours.update(grads[0], s_ours, params)
        u_plain, s_plain = plain.update(grads[0], s_plain, params)
        after = ours.update(grads[1], s_ours, params)[0]
        return u_ours, s_ours, u_plain, s_plain, after, plain.update(grads[1], s_ours.prodigy, params)[0]

    u_ours, s_ours, u_plain, s_plain, after, after_plain = run(params, grads)
    assert bool(jnp.all(jnp.isnan(u_plain))) and bool(jnp.isnan(s_plain.estim_lr))  # what is guarded against
    assert float(jnp.max(jnp.abs(u_ours))) == 0.0 and float(s_ours.prodigy.estim_lr) == np.float32(hp.d0)
    assert int(s_ours.prodigy.count) == 1 and float(jnp.max(jnp.abs(s_ours.prodigy.exp_avg))) > 0
    assert float(jnp.max(jnp.abs(after))) > 0
    np.testing.assert_array_equal(after, after_plain)


# --- diagnostics --------------------------------------------------------------------------------


def _metrics(name, state, params):
    return jax.jit(lambda s, p: optimizer_metrics(HPARAMS[name], s, p, OVERRIDES[name]))(state, params)


def _group_state(state, group):
    """The known layout of make_optimizer's state: (clip, PartitionState) -> MaskedState -> the group's."""
    return state[1].inner_states[group].inner_state


def _in_group(group):
    return [k for k, (_, label) in SHAPES.items() if label == group]


def _sqrt_v(nu: dict, count, b2: float, group: str) -> np.ndarray:
    v = np.concatenate([np.asarray(nu[k], np.float64).ravel() for k in _in_group(group)])
    return np.sqrt(v / (1 - b2 ** int(count)))


def _check_sqrt_v(metrics, group, sqrt_v, rtol):
    for stat, fn in (("min", np.min), ("median", np.median), ("max", np.max)):
        np.testing.assert_allclose(float(metrics[f"optim/{group}/sqrt_v_{stat}"]), fn(sqrt_v), rtol=rtol,
                                   err_msg=f"{group} sqrt_v_{stat}")


def test_schedule_free_distance_and_second_moment_match_numpy():
    """sf_distance_rms = RMS of y − x over the group, x = (y − (1 − b1)·z)/b1 from the state's z and b1
    in float64. The code forms x in float32 and subtracts it from y: each element carries ~2 roundings
    of max(|y|, |z|)/b1, the tolerance below (y − x is ~1e-3 here, so that is ~1e-4 of it)."""
    name = "schedule_free_adamw"
    ours, _ = _runs(name)
    params, state = ours[3]
    metrics = _metrics(name, state, params)
    assert set(metrics) == {f"optim/{g}/{s}" for g in ("hidden", "embed", "head", "scalar")
                            for s in ("sf_distance_rms", "sqrt_v_min", "sqrt_v_median", "sqrt_v_max")}
    for group in ("hidden", "embed", "head", "scalar"):
        sf = _group_state(state, group)
        assert isinstance(sf, ScheduleFreeState)
        b1 = float(sf.b1)
        assert b1 == pytest.approx(_knob(name, group, "b1"))
        y = [np.asarray(params[k], np.float64) for k in _in_group(group)]
        z = [np.asarray(sf.z[k], np.float64) for k in _in_group(group)]
        diff = np.concatenate([(yi - (yi - (1 - b1) * zi) / b1).ravel() for yi, zi in zip(y, z)])
        largest = max(np.abs(np.concatenate([a.ravel() for a in y + z])).max() / b1, 1.0)
        np.testing.assert_allclose(float(metrics[f"optim/{group}/sf_distance_rms"]), np.sqrt(np.mean(diff**2)),
                                   rtol=0, atol=2 * EPS32 * largest, err_msg=group)
        assert np.sqrt(np.mean(diff**2)) > 100 * EPS32 * largest  # y and x apart: the check is not vacuous
        rms = _group_state(state, group).base_optimizer_state[0]
        assert isinstance(rms, rms_state())
        b2 = _knob(name, group, "b2")
        _check_sqrt_v(metrics, group, _sqrt_v(rms.nu, rms.count, b2, group), adam_sqrt_v_rtol(b2, rms.count))


@pytest.mark.parametrize("updates", [2, STEPS])  # during the warmup (t = 2 < 4) and after it
def test_ademamix_ema_norms_mix_and_second_moment_match_numpy(updates):
    """Norms: float32 sums of <= 120 squares, within 1e-5 relative (120 EPS32 at worst); α and β3 of
    the latest update by the paper's formula (float64), β3 within 2 EPS32 as above."""
    name = "ademamix"
    ours, _ = _runs(name)
    params, state = ours[updates]
    metrics = _metrics(name, state, params)
    for group in ("hidden", "embed", "head", "scalar"):
        s = _group_state(state, group)[0]
        assert isinstance(s, ScaleByAdemamixState) and int(s.count_m2) == updates
        b1 = _knob(name, group, "b1")
        keys = _in_group(group)
        norm = lambda tree, keys=keys: math.sqrt(sum(np.sum(np.asarray(tree[k], np.float64) ** 2) for k in keys))
        # float32 sums of <= 120 squares (positive: sum_atol relative to the sum, the squares' rounding in
        # its margin), halved by the square root, which rounds once; the fast norm's bias correction
        # 1 − b1^t carries t times b1's float32 rounding (relative to 1 − b1^t) and a division
        rtol = sum_atol(120, 1.0) / 2 + rounding_rtol(1)
        np.testing.assert_allclose(float(metrics[f"optim/{group}/slow_ema_norm"]), norm(s.m2), rtol=rtol)
        b1_rounding = updates * abs(float(np.float32(b1)) - b1) / (1 - b1**updates)
        np.testing.assert_allclose(float(metrics[f"optim/{group}/fast_ema_norm"]), norm(s.m1) / (1 - b1**updates),
                                   rtol=rtol + 2 * b1_rounding + rounding_rtol(2))
        alpha = _paper_alpha(updates, _knob(name, group, "alpha"), WARMUP)
        np.testing.assert_allclose(float(metrics[f"optim/{group}/alpha"]), alpha, rtol=2 * EPS32)
        b3 = _paper_b3(updates, b1, _knob(name, group, "b3"), WARMUP)
        np.testing.assert_allclose(float(metrics[f"optim/{group}/b3"]), b3, rtol=0, atol=2 * EPS32)
        b2 = _knob(name, group, "b2")
        _check_sqrt_v(metrics, group, _sqrt_v(s.nu, s.count, b2, group), adam_sqrt_v_rtol(b2, s.count))


# --- knobs that depend on the run ---------------------------------------------------------------


def test_ademamix_warmup_defaults_to_the_runs_length(tiny_run):
    assert tiny_run("optimizer=ademamix", "train.max_steps=37").optimizer.hparams.alpha_b3_warmup == 37
    assert tiny_run("optimizer=ademamix", "optimizer.alpha_b3_warmup=5").optimizer.hparams.alpha_b3_warmup == 5
    off = tiny_run("optimizer=ademamix", "optimizer.alpha_b3_warmup=0").optimizer.hparams
    assert off.schedules() == (off.alpha, off.b3)  # no warmup: the constants themselves
    with pytest.raises(ConfigError, match=r"optimizer\.alpha_b3_warmup=-1"):
        tiny_run("optimizer=ademamix", "optimizer.alpha_b3_warmup=-1")


@pytest.mark.parametrize("overrides", [
    ("optimizer/lr_config=cosine",),
    ("optimizer/lr_config=linear",),
    ("optimizer/lr_config=trapezoid", "optimizer.lr_config.warmup=5", "optimizer.lr_config.decay=5"),
    ("optimizer/lr_config=piecewise_linear", "optimizer.lr_config.steps=[0,10]", "optimizer.lr_config.scales=[1,0.5]"),
], ids=["cosine", "linear", "trapezoid-decay", "piecewise-falling"])
def test_schedule_free_refuses_a_decaying_lr_schedule(tiny_run, overrides):
    name = overrides[0].split("=")[1]
    with pytest.raises(ConfigError, match=rf"optimizer/lr_config={name} decays the lr.*optimizer/lr_config=constant"):
        tiny_run("optimizer=schedule_free_adamw", *overrides)


def test_schedule_free_takes_a_warmup_and_flat_schedules(tiny_run):
    for overrides in (("optimizer.lr_config.warmup=5",),
                      ("optimizer/lr_config=trapezoid", "optimizer.lr_config.warmup=5", "optimizer.lr_config.decay=0"),
                      ("optimizer/lr_config=piecewise_linear", "optimizer.lr_config.steps=[0,10]",
                       "optimizer.lr_config.scales=[0.1,1]")):
        assert tiny_run("optimizer=schedule_free_adamw", *overrides).optimizer.name == "schedule_free_adamw"
    with pytest.raises(ConfigError, match=r"optimizer\.b1=0\.0 must be in \(0, 1\)"):
        tiny_run("optimizer=schedule_free_adamw", "optimizer.b1=0")
