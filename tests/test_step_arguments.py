"""The optimizer's numeric knobs are arguments of the train step (optimizer/arguments.py): every
registered optimizer and schedule builds from float32 tracers and computes what its constants
did (within the rounding of a knob held in float32 instead of float64), runs that differ only in
those knobs (lr, warmup, budget, weight decay, clip, seed) trace one program, a constant-lr trunk
and its cooldown branches trace one program, and a comparison's runs after its first trunk compile
nothing: they load its programs.
"""

from __future__ import annotations

import collections
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, optimizer_update, per_optimizer, rounding_rtol

import models
import train_jax as T
from compare import launch
from compare.plan import base_lrs, compare_config, make_plan
from optimizer import OPTIMIZERS, arguments, make_optimizer
from optimizer.hyperball import HYPERBALL_GROUPS
from optimizer.schedules import SCHEDULES
from trainer import precompile
from utils.parallel import mesh as meshlib


def traced(o, clip, build, *args):
    """`build(o, clip, *args)` jitted with the knobs of `o` as constants, and with them as arguments
    (float32 tracers). `args` are arguments on both sides: a program of constants only would be
    evaluated by XLA's constant folder, whose arithmetic is not the compiled program's."""
    values = arguments.lift(o, clip)
    return (jax.jit(lambda *a: build(o, clip, *a))(*args),
            jax.jit(lambda v, *a: build(*arguments.bind(o, clip, v), *a))(arguments.as_arguments(values), *args))


def knob_rtol(values: arguments.Values, roundings: int) -> float:
    """A knob k in float32 errs by EPS32/2 relative; 1 - k (an EMA's weight) then errs by that times
    k/(1-k), the worst amplification among the knobs in (0, 1). Added to the `roundings` of the
    computation itself (rounding_rtol: first-order errors add), with rounding_rtol's margin of 2."""
    ks = [v for v in jax.tree.leaves(values) if 0 < v < 1]
    amplification = max([1.0] + [k / (1 - k) for k in ks])
    return 2 * EPS32 / 2 * amplification + rounding_rtol(roundings)


def eigenbasis_amplification(grads, beta: float) -> float:
    """Davis–Kahan: a relative perturbation ε of a symmetric matrix A turns its eigenvectors by up to
    ε‖A‖/gap (gap: the smallest distance between its eigenvalues), and an update computed in that
    eigenbasis moves by as much. The largest ‖A‖/gap over the statistics G Gᵀ and Gᵀ G that two
    gradients leave in an EMA at rate `beta` (float64)."""
    worst = 1.0
    for g1, g2 in zip(*(jax.tree.leaves(g) for g in grads)):
        g1, g2 = np.asarray(g1, np.float64), np.asarray(g2, np.float64)
        if g1.ndim != 2:
            continue
        for side in (lambda g: g @ g.T, lambda g: g.T @ g):
            a = beta * (1 - beta) * side(g1) + (1 - beta) * side(g2)
            eig = np.linalg.eigvalsh(a)
            worst = max(worst, eig[-1] / np.diff(eig).min())
    return worst


def dion_amplification(run, params, labels, grads) -> float:
    """QR's Q factor moves by up to κ₂(P) times a relative perturbation of P (Higham Thm 19.4, first
    order), and Dion's update P·Qᵀ with it: the largest κ₂ of the A·Q its two updates orthonormalise
    over the hidden blocks, re-run in float64 (tests/test_parity_dion.py's reference_step) from the
    optimizer's own initial Q on the gradients clipped as the run clips them."""
    from test_parity_dion import reference_step

    from optimizer.diagnostics import find_states
    from optimizer.dion import DionState

    o, hp = run.optimizer, run.optimizer.hparams
    tx = make_optimizer(hp, o.schedule.build(o.schedule_steps), labels, run.train.gradient_clip_val, o.schedule.lr)
    qs = [np.asarray(q, np.float64) for q in jax.tree.leaves(find_states(tx.init(params), DionState)[0].q)]
    hidden = [i for i, label in enumerate(jax.tree.leaves(labels)) if label == "hidden"]
    clipped = []
    for g in grads:
        leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
        norm = np.sqrt(sum(np.sum(x**2) for x in leaves))
        clipped.append([x * min(1.0, run.train.gradient_clip_val / norm) for x in leaves])
    worst = 1.0
    for i, q in zip(hidden, qs, strict=True):
        stack = clipped[0][i].shape[:-2]
        for b in np.ndindex(*stack):
            x, m, qb = np.zeros(clipped[0][i].shape[-2:][::-1]), np.zeros(clipped[0][i].shape[-2:][::-1]), q[b]
            for g in clipped:
                x, m, qb, kappa = reference_step(x, g[i][b].T, m, qb, 1.0, hp.momentum, 0.0, hp.eps)
                worst = max(worst, kappa)
    return worst


# Optimizers that rotate the update into their statistics' eigenbasis: checked on square, full-rank
# gradients (a rank-deficient statistic's eigenbasis is arbitrary in its null space, so the update
# is not a continuous function of the knobs there), within the Davis–Kahan bound above.
EIGENBASIS = {"soap"}


@pytest.mark.parametrize("name", per_optimizer(sorted(OPTIMIZERS))
                         + [pytest.param("muon+hyperball", marks=pytest.mark.slow)])  # ~2.5 s
def test_every_optimizer_built_from_traced_knobs_updates_as_its_constants_do(tiny_run, name):
    """Two updates of the tiny model's weights: the optimizer built inside jit from the traced
    knobs against the one built from Python floats (each update compared relative to the largest
    element of its leaf: an update's elements share their computation's scale). `+knob`: with
    optimizer.<knob>=true (the hyperball's step reads the traced lr from its own schedule)."""
    name, *wrappers = name.split("+")
    run = tiny_run(f"optimizer={name}", "train.gradient_clip_val=1.0", *(f"optimizer.{w}=true" for w in wrappers))
    model = models.build(run.model, jax.random.PRNGKey(0))
    params = eqx.filter(model, eqx.is_array)
    labels = models.param_labels(model)
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (3.0 + i)) * 0.1, params) for i in range(2)]
    amplification = 1.0
    if name in EIGENBASIS:
        rng = np.random.default_rng(0)
        params = {g: jnp.asarray(rng.normal(size=(8, 8)), jnp.float32) for g in ("hidden", "embed", "head")}
        labels = {g: g for g in params}
        grads = [{g: jnp.asarray(rng.normal(size=(8, 8)) * 0.1, jnp.float32) for g in params} for _ in range(2)]
        amplification = eigenbasis_amplification(grads, run.optimizer.hparams.b2)
    if name == "dion":  # a QR of each hidden block's A·Q, as sensitive as that matrix is ill-conditioned
        amplification = dion_amplification(run, params, labels, grads)

    def two_updates(o, clip, params, grads):
        tx = make_optimizer(o.hparams, o.schedule.build(o.schedule_steps), labels, clip, o.schedule.lr,
                            o.group_overrides, o.cautious, o.hyperball)
        state, out = tx.init(params), []
        for g in grads:
            u, state = optimizer_update(tx, g, state, params, o.hparams)
            out.append(u)
        return out

    constants, from_arguments = traced(run.optimizer, run.train.gradient_clip_val, two_updates, params, grads)
    values = arguments.lift(run.optimizer, run.train.gradient_clip_val)
    assert values["schedule"]["lr"] == run.optimizer.schedule.lr  # the lr is one of the arguments
    rtol = knob_rtol(values, 32) * amplification  # an update: a few dozen float32 operations deep
    # The hyperball's update is new − p, two numbers of the weights' size: its rounding is the weights'.
    scales = [np.abs(np.asarray(p)).max() if "hyperball" in wrappers and label in HYPERBALL_GROUPS else 0.0
              for p, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels), strict=True)]
    for a, b, scale in zip(jax.tree.leaves(constants), jax.tree.leaves(from_arguments), scales * 2, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=0, atol=rtol * max(np.abs(a).max(), scale, 1e-30), err_msg=name)


SCHEDULE_KNOBS = {
    "constant": {"lr": 0.3, "warmup": 7},
    "linear": {"lr": 0.3, "warmup": 5, "const": 9, "min_lr": 0.01},
    "cosine": {"lr": 0.3, "warmup": 5, "min_lr": 0.02},
    "trapezoid": {"lr": 0.3, "warmup": 5, "decay": 11, "min_lr": 0.01, "decay_shape": "1-sqrt"},
    "wsd": {"lr": 0.3, "warmup": 0, "decay": 11},
    "piecewise_linear": {"lr": 0.3, "steps": (0, 10, 30), "scales": (0.0, 1.0, 0.1)},
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_built_from_traced_knobs_matches_its_constants(name):
    """Every step of a 40-step schedule (and past its end), its lr, warmup, decay, min_lr and length
    traced: ~6 float32 operations on the knobs (the warmup's product and quotient, the decay's
    difference, quotient, shape and product), each knob itself rounded to float32 once."""
    schedule = SCHEDULES[name](**SCHEDULE_KNOBS[name])
    steps = jnp.arange(45)
    values = {k: float(getattr(schedule, k)) for k in arguments.schedule_knobs(schedule)}
    constant = schedule.build(40)(steps)
    from_arguments = jax.jit(lambda v, n: dataclasses.replace(schedule, **v).build(n)(steps))(values, 40.0)
    np.testing.assert_allclose(np.asarray(from_arguments), np.asarray(constant), rtol=rounding_rtol(7), atol=0)
    assert "lr" in values


def step_program(tiny_run, *overrides) -> str:
    """The HLO of a run's (plain) train step, without source locations."""
    run = tiny_run("logging.log_callback_data=false", *overrides)
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch = jax.ShapeDtypeStruct((1, run.dataset.batch_size, run.context_length + 1), jnp.int32)
    return step.plain.trace(*precompile.abstract((state, batch, step.args))).lower().as_text(debug_info=False)


@pytest.mark.parametrize("name", per_optimizer(sorted(OPTIMIZERS)))
def test_runs_that_differ_in_their_knobs_trace_one_step_program(tiny_run, name):
    """lr, warmup, the budget, weight decay, the clip and the seed change no character of the step's
    program (each non-zero on both sides: a zero knob is a constant); the model's width does (the
    comparison can tell programs apart)."""
    decays = any(f.name == "weight_decay" for f in dataclasses.fields(OPTIMIZERS[name]))

    def program(lr, steps, warmup, decay, clip, seed, *more):
        return step_program(tiny_run, f"optimizer={name}", f"optimizer.lr_config.lr={lr}", f"train.max_steps={steps}",
                            f"optimizer.lr_config.warmup={warmup}", f"train.gradient_clip_val={clip}",
                            f"random_seed={seed}", *([f"optimizer.weight_decay={decay}"] if decays else []), *more)

    base = program(0.002, 20, 5, 0.05, 1.0, 0)
    assert program(0.0123, 37, 3, 0.037, 0.5, 4) == base
    assert program(0.002, 20, 5, 0.05, 1.0, 0, "model.dim=48") != base


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_constant_lr_trunk_and_its_cooldown_branch_trace_one_step_program(tiny_run, name):
    """A comparison's trunk (constant lr) and branch (trapezoid, the default decay shape) run one
    program (arguments.canonical), so a comparison compiles one per optimizer, not two; a linear
    decay is another program (its shape is code), and so would be a broken canonical form."""
    program = lambda schedule, *knobs: step_program(
        tiny_run, f"optimizer={name}", f"optimizer/lr_config={schedule}", "optimizer.lr_config.warmup=3", *knobs)
    trunk = program("constant", "train.max_steps=40")
    assert program("trapezoid", "train.max_steps=50", "optimizer.lr_config.decay=7",
                   "optimizer.lr_config.decay_shape=1-sqrt") == trunk
    assert program("trapezoid", "train.max_steps=50", "optimizer.lr_config.decay=7",
                   "optimizer.lr_config.decay_shape=linear") != trunk


def test_a_zero_knob_stays_a_constant_and_a_traced_one_is_never_known_zero():
    """Zero-ness is structure (no weight-decay stage, no warmup): both sides of the step must agree."""
    assert arguments.known_zero(0.0) and arguments.known_zero(0) and not arguments.known_zero(0.1)
    assert not arguments.known_zero(jnp.float32(0.0)) and not arguments.clipping(None) and arguments.clipping(0.5)
    assert not arguments.clipping(0.0) and arguments.clipping(jnp.float32(1.0))
    from optimizer.adamw import AdamW

    assert "weight_decay" not in arguments.optimizer_knobs(AdamW(weight_decay=0.0))
    assert set(arguments.optimizer_knobs(AdamW())) == {"b1", "b2", "eps", "weight_decay"}


@pytest.mark.slow
def test_a_comparisons_later_runs_load_every_program(tmp_path):
    """The first trunk compiles (or loads) the step, evaluation and initialisation programs; every
    later run, branches included, whatever its lr, seed or budget, compiles nothing: it
    loads them, or reuses the ones traced in this process (trainer/process_cache.py). JAX's
    persistent-cache events counted per run, a miss being a compilation."""
    counts: collections.Counter = collections.Counter()
    counting = [False]
    jax.monitoring.register_event_listener(
        lambda event, **_: counting[0] and counts.update([event.rsplit("/", 1)[-1]]))
    per_run = {}

    def train(cfg, run_dir):
        before, counting[0] = dict(counts), True
        try:
            return T.train(cfg, run_dir)
        finally:
            counting[0] = False
            per_run[run_dir.rsplit("/", 1)[-1]] = {k: counts[k] - before.get(k, 0) for k in ("cache_misses",
                                                                                           "cache_hits")}

    from helpers import TINY_OVERRIDES

    run = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
        "train.max_val_steps=2", "logging.log_callback_data=false")
    # One optimizer (test_runs_that_differ_in_their_knobs_trace_one_step_program covers each one's step).
    k = compare_config({"optimizers": ["adamw"], "budgets": [4, 6], "lr": {"points": 2}, "seeds": 2, "warmup": 1})
    plan = make_plan(k, run, base_lrs(k.optimizers, run))
    summary = launch.run_plan(plan, str(tmp_path), train=train, say=lambda line: None)
    assert len(summary.done) == len(plan.runs) == 2 * 2 * 3
    first = plan.runs[0]  # what it compiles depends on what the session's cache holds already
    assert first.kind == "trunk"
    later = {rid: c for rid, c in per_run.items() if rid != first.id}
    assert len(later) == len(plan.runs) - 1
    assert all(c["cache_misses"] == 0 for c in later.values()), later
