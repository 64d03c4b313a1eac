"""The aux-state hook: every diagnostic against a direct NumPy computation, the flags' rules, the
buffers' absence when off, and a non-finite gradient counted and skipped."""

import itertools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rounding_rtol, sum_atol

import train_jax as T
from models import losses
from models.gpt import param_axes
from optimizer.diagnostics import find_states
from optimizer.restart import schedules_at
from trainer import aux_state
from trainer.aux_state import AuxConfig
from trainer.step import build_train_step, step_keys
from utils.errors import ConfigError
from utils.logging.sinks import logging_config
from utils.parallel import layout
from utils.parallel import mesh as meshlib

FLAGS = ("store_last_params", "store_last_grads", "store_past_grads", "compute_last_loss", "compute_last_grads")
ALL_ON = AuxConfig(**{f: True for f in FLAGS})


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def cos(a: np.ndarray, b: np.ndarray) -> float:
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / den) if den > 0 else 0.0


def expected(hist: list[dict], n: int) -> dict[str, float]:
    """The metrics of step n from the history of x, g, the update, f and the x(n-1) point."""
    x, g, u = hist[n]["x"], hist[n]["g"], hist[n]["u"]
    x_prev = hist[n - 1]["x"] if n else x  # x(-1) := x(0)
    g_prev = hist[n - 1]["g"] if n else np.zeros_like(g)
    past = sum((h["g"] for h in hist[:n]), np.zeros_like(g))
    delta = x - x_prev
    out = {}
    for name, v in (("params", x), ("grads", g), ("update", delta)):  # update/: Δ(n), trainit's full_log
        out.update({f"{name}/norm": np.linalg.norm(v), f"{name}/norm_l1": np.abs(v).sum(),
                    f"{name}/norm_inf": np.abs(v).max()})
    out.update({
        "params/cos(xn, x(n-1))": cos(x, x_prev),
        "update/<gn, xn-x(n-1)>": g @ delta, "update/<gn, Delta(n)>": g @ delta,
        "update/cos(gn, Delta(n))": cos(g, delta), "update/cos(Delta(n+1), Delta(n))": cos(u, delta),
        "grads/<gn, g(n-1)>": g @ g_prev, "grads/cos(gn, g(n-1))": cos(g, g_prev),
        "update/<g(n-1), Delta(n)>": g_prev @ delta, "update/cos(g(n-1), Delta(n))": cos(g_prev, delta),
        "grads/<gn, g(1:n-1)>": g @ past, "grads/cos(gn, g(1:n-1))": cos(g, past),
        "loss/fn-f(n-1)": hist[n]["f"] - hist[n]["f_prev"],
        "grads/cos(gn, g'(n-1))": cos(g, hist[n]["g_prev_point"]),
        "curvature/<gn-g'(n-1), Delta(n)>": (g - hist[n]["g_prev_point"]) @ delta,
        "grads/inf_grads": 0.0,
    })
    for name in ("update/<gn, xn-x(n-1)>", "update/<gn, Delta(n)>", "update/<g(n-1), Delta(n)>", "loss/fn-f(n-1)"):
        out[name + "_sum"] = sum(expected_one(hist, k, name) for k in range(n + 1))
    return out


def expected_one(hist, k, name):
    x_prev = hist[k - 1]["x"] if k else hist[k]["x"]
    delta = hist[k]["x"] - x_prev
    if name == "loss/fn-f(n-1)":
        return hist[k]["f"] - hist[k]["f_prev"]
    if name == "update/<g(n-1), Delta(n)>":
        return (hist[k - 1]["g"] if k else np.zeros_like(delta)) @ delta
    return hist[k]["g"] @ delta


def dot_atol(n: int, scale) -> float:
    """atol of a float32 inner product (or sum) of n terms, any summation order (the leafwise
    reductions), against float64 on the same float32 values, `scale` the sum of the terms'
    magnitudes: the smaller of helpers.sum_atol's worst case and its probabilistic bound (λ = 10,
    Higham–Mary): both hold, the second is the tighter one past ~100 terms. 2x margin (sum_atol's)."""
    return min(sum_atol(n, scale), sum_atol(n, scale, lam=10))


def cos_atol(n: int) -> float:
    """atol of a float32 cosine <a, b> / (|a|·|b|) of n-element vectors against float64 on the same
    vectors: the dot within dot_atol(n, |a|·|b|) (Cauchy–Schwarz: Σ|aᵢbᵢ| <= |a|·|b|), each squared
    norm within dot_atol(n, 1) of itself so each norm within half that, |cos| <= 1: 2·dot_atol(n, 1);
    the norms' product and the division: rounding_rtol(2)."""
    return 2 * dot_atol(n, 1.0) + rounding_rtol(2)


def metric_atol(name: str, hist: list[dict], n: int) -> float:
    """atol of aux_state's metric `name` at step n against expected(hist, n): the float32 values of
    x, g, u, f are the test's own, so only the hook's float32 arithmetic counts. Every vector has
    N + 2 terms' worth of error, N the parameters: Δ(n) = x(n) − x(n−1) is rounded once and the
    squares of it once more, and g(1:n−1) is a float32 running sum of gradients (<= 1 rounding in
    three steps). A dot <a, b>: dot_atol at Σ|aᵢbᵢ|; a norm: half its square's relative bound plus
    the square root's rounding; norm_l1: dot_atol at Σ|vᵢ|; norm_inf: Δ's rounding (a max is
    exact); a cosine: cos_atol; f(n) − f(n−1) of two float32 losses: one rounding; a `_sum`: its
    terms' atols plus the running sum's additions (sum_atol over the steps' |terms|)."""
    h = hist[n]
    x, g, gp = h["x"], h["g"], h["g_prev_point"]
    x1 = hist[n - 1]["x"] if n else x
    g1 = hist[n - 1]["g"] if n else np.zeros_like(g)
    d = x - x1
    vec = {"xn": x, "x(n-1)": x1, "gn": g, "g(n-1)": g1, "g(1:n-1)": sum((k["g"] for k in hist[:n]), 0 * g),
           "Delta(n)": d, "xn-x(n-1)": d, "Delta(n+1)": h["u"], "gn-g'(n-1)": g - gp}
    N = x.size + 2
    if name == "grads/inf_grads":
        return 0.0
    if name.endswith("_sum"):
        base = name.removesuffix("_sum")
        terms = [abs(expected_one(hist, k, base)) for k in range(n + 1)]
        return sum(metric_atol(base, hist, k) for k in range(n + 1)) + sum_atol(n + 1, sum(terms))
    if "cos(" in name:
        return cos_atol(N)
    if name == "loss/fn-f(n-1)":
        return rounding_rtol(1) * abs(h["f"] - h["f_prev"])
    prefix, kind = name.split("/")
    if kind.startswith("norm"):
        v = np.abs({"params": x, "grads": g, "update": d}[prefix])
        return {"norm": (dot_atol(N, 1.0) / 2 + rounding_rtol(1)) * np.linalg.norm(v),
                "norm_l1": dot_atol(N, v.sum()), "norm_inf": rounding_rtol(1) * v.max()}[kind]
    a, b = re.fullmatch(r"<(.+), (.+)>", kind).groups()
    return dot_atol(N, np.abs(vec[a]) @ np.abs(vec[b]))


def test_every_metric_matches_numpy_over_three_steps():
    """A quadratic f(x; z) = ½|x - z|² on a two-leaf tree with negative entries (norm_inf is max |x|,
    not max x), three SGD steps; the first step's Δ is 0, so its cosines must be exactly 0."""
    rng = np.random.default_rng(0)
    x = {"a": jnp.asarray(rng.normal(size=(3, 4)) - 2.0, jnp.float32),
         "b": jnp.asarray(-rng.random(5) * 3, jnp.float32)}
    f = lambda p, z: 0.5 * sum(jnp.sum((p[k] - z[k]) ** 2) for k in p)
    aux = aux_state.init(ALL_ON, x)
    hist, got = [], []
    for _ in range(3):
        z = jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape), jnp.float32), x)
        g = jax.grad(f)(x, z)
        u = jax.tree.map(lambda v: -0.3 * v, g)
        x_prev = aux.last_params
        last = aux_state.LastPoint(f(x_prev, z), jax.grad(f)(x_prev, z))
        aux, metrics = aux_state.update(ALL_ON, aux, x, g, u, f(x, z), last, logging=True)
        hist.append({"x": flat(x), "g": flat(g), "u": flat(u), "f": float(f(x, z)), "f_prev": float(last.loss),
                     "g_prev_point": flat(last.grads)})
        got.append({k: float(v) for k, v in metrics.items()})
        x = jax.tree.map(jnp.add, x, u)
    assert got[0]["update/cos(gn, Delta(n))"] == 0.0 and got[0]["grads/cos(gn, g(n-1))"] == 0.0
    assert got[2]["params/norm_inf"] > float(max(jnp.max(v) for v in jax.tree.leaves(x)))  # |x|, not x
    assert got[0]["update/norm"] == 0.0  # Δ(0) = x(0) - x(-1) = 0, not this step's update
    for n in range(3):
        want = expected(hist, n)
        assert set(got[n]) == set(want)
        for name, value in want.items():
            assert got[n][name] == pytest.approx(value, rel=0, abs=metric_atol(name, hist, n)), (n, name)


def test_non_logging_steps_return_nothing_but_keep_the_sums():
    x = {"w": jnp.arange(4.0)}
    g = {"w": jnp.ones(4)}
    aux = aux_state.init(ALL_ON, x)
    aux, metrics = aux_state.update(ALL_ON, aux, x, g, g, jnp.float32(1.0), aux_state.LastPoint(jnp.float32(0.5)),
                                    logging=False)
    assert metrics == {}
    assert float(aux.sums["loss/fn-f(n-1)_sum"]) == 0.5


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=len(FLAGS))),
                         ids=lambda fl: "".join("1" if f else "0" for f in fl))
def test_every_flag_combination_runs_or_is_refused_at_start(flags):
    node = {"log_callback_data": True, **dict(zip(FLAGS, flags))}
    cfg = dict(zip(FLAGS, flags))
    needs_params = cfg["compute_last_loss"] or cfg["compute_last_grads"]
    if needs_params and not cfg["store_last_params"]:
        with pytest.raises(ConfigError, match=r"logging\.compute_last_(loss|grads)=true .*store_last_params=true"):
            logging_config(node)
        return
    aux_cfg = logging_config(node).aux
    x = {"w": jnp.arange(3.0) - 1.0}
    state = aux_state.init(aux_cfg, x)
    last = aux_state.LastPoint(jnp.float32(0.0), x if cfg["compute_last_grads"] else None) if needs_params else None
    state, metrics = aux_state.update(aux_cfg, state, x, x, x, jnp.float32(1.0), last, logging=True)
    assert (state.last_params is None) == (not cfg["store_last_params"])
    assert ("grads/cos(gn, g(1:n-1))" in metrics) == cfg["store_past_grads"]
    assert ("loss/fn-f(n-1)" in metrics) == needs_params
    assert ("update/norm" in metrics) == cfg["store_last_params"]  # Δ(n) = x(n) - x(n-1) needs x(n-1)
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_with_log_callback_data_false_the_other_flags_are_moot():
    cfg = logging_config({"log_callback_data": False, "store_last_params": False, "compute_last_loss": True}).aux
    assert aux_state.init(cfg, {"w": jnp.zeros(3)}) is None and cfg.buffer_copies() == 0


# ----------------------------------------------------------------------------- through the real step


def params_of(model):
    return eqx.filter(model, eqx.is_inexact_array)


def assemble(tiny_run, *overrides):
    run = tiny_run(*overrides)
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, tx, state, step = T.init_training(run, mesh)
    return run, tx, state, step, mesh


def test_the_train_step_carries_the_aux_state_and_matches_numpy(tiny_run):
    """Three steps of the tiny GPT with every flag: g(n-1)' and f(x(n-1), z(n)) recomputed here
    directly from saved copies of the weights."""
    flags = ["logging.log_callback_data=true", *(f"logging.{f}=true" for f in FLAGS),
             "logging.optim_diagnostics=false"]  # tested in test_optim_diagnostics.py; they double the compile
    run, _, state, step, mesh = assemble(tiny_run, "optimizer=sgdm", "optimizer/lr_config=constant",
                                         "optimizer.lr_config.lr=0.5", "optimizer.lr_config.warmup=0",
                                         "train.gradient_clip_val=null", *flags)
    rng = np.random.default_rng(1)
    params = lambda model: eqx.filter(model, eqx.is_inexact_array)
    grad_at = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: losses.loss_fn(m, t, None, "float32")[0]))
    xs, metrics = [], []
    for _ in range(3):
        batch = rng.integers(0, 64, (1, 8, 17), dtype=np.int32)
        xs.append((jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, state.model), batch))  # donated
        state, m = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), True)
        metrics.append({k: float(v) for k, v in m.items()})
    x0, x1, x2 = (flat(params(model)) for model, _ in xs)
    (f2, g2), (f2_prev, g2_prev) = (grad_at(m, jnp.asarray(xs[2][1][0])) for m in (xs[2][0], xs[1][0]))
    g1 = grad_at(xs[1][0], jnp.asarray(xs[1][1][0]))[1]
    g2, g2_prev, g1 = flat(g2), flat(g2_prev), flat(g1)
    got = metrics[2]
    # Tolerances: grad_at runs the step's loss_fn on the same inputs, so its losses and gradients are
    # the step's bit for bit (helpers.py's XLA flags; the first check below is that exactly); what
    # counts is the hook's float32 arithmetic over N parameters (dot_atol, cos_atol: any order), +1
    # term for Δ(n) = x(n) − x(n−1) rounded in float32 (here exact in float64). x3 − x2 is the applied
    # update Δ(n+1) after x2 + Δ(n+1) rounded (<= EPS32/2 of |x3| each): |x3|·EPS32/2 / |Δ(n+1)| more.
    N = x2.size + 1
    x3 = flat(params(state.model))
    applied = rounding_rtol(1, margin=1) * np.linalg.norm(x3) / np.linalg.norm(x3 - x2)
    assert got["loss/fn-f(n-1)"] == float(f2 - f2_prev)  # the same float32 subtraction of the same losses
    assert got["grads/cos(gn, g(n-1))"] == pytest.approx(cos(g2, g1), rel=0, abs=cos_atol(N))
    assert got["grads/cos(gn, g'(n-1))"] == pytest.approx(cos(g2, g2_prev), rel=0, abs=cos_atol(N))
    # g − g' rounds once more: N + 1 terms
    assert got["curvature/<gn-g'(n-1), Delta(n)>"] == pytest.approx(
        (g2 - g2_prev) @ (x2 - x1), rel=0, abs=dot_atol(N + 1, np.abs(g2 - g2_prev) @ np.abs(x2 - x1)))
    assert got["update/cos(Delta(n+1), Delta(n))"] == pytest.approx(cos(x3 - x2, x2 - x1), rel=0,
                                                                     abs=cos_atol(N) + 2 * applied)
    # trainit's update/norm* are Δ(n)'s; the update this step applied is train/update_norm
    norm_rtol = dot_atol(N + 1, 1.0) / 2 + rounding_rtol(1)  # the square of Δ's rounding: +1 term
    assert got["update/norm"] == pytest.approx(np.linalg.norm(x2 - x1), rel=norm_rtol)
    assert got["update/norm_l1"] == pytest.approx(np.abs(x2 - x1).sum(), rel=dot_atol(N, 1.0))
    assert got["update/norm_inf"] == pytest.approx(np.abs(x2 - x1).max(), rel=rounding_rtol(1))
    assert got["train/update_norm"] == pytest.approx(np.linalg.norm(x3 - x2), rel=norm_rtol + 2 * applied)
    # two steps' dots (step 0's Δ is 0) and the running sum's additions (2 roundings of their sum)
    terms = np.abs(g2) @ np.abs(x2 - x1) + np.abs(g1) @ np.abs(x1 - x0)
    assert got["update/<gn, Delta(n)>_sum"] == pytest.approx(g2 @ (x2 - x1) + g1 @ (x1 - x0), rel=0,
                                                              abs=dot_atol(N, terms) + rounding_rtol(2) * terms)
    assert step.compiled() == 1  # one variant used so far: the logging one


@pytest.mark.parametrize("last_grads", [True, False], ids=["last-grads", "last-loss-only"])
def test_x_n_minus_1_is_evaluated_with_the_steps_dropout_keys(tiny_run, last_grads):
    """Dropout on, two micro-batches: f(x(n-1), z(n)) (and g'(n-1)) must use this step's own
    per-micro-batch dropout keys (fresh keys would put dropout noise, not the change of x, into
    loss/fn-f(n-1) and the curvature). Both ways the step evaluates x(n-1): with its gradient, and
    the loss alone."""
    flags = ["logging.log_callback_data=true", *(f"logging.{f}=true" for f in FLAGS), "logging.optim_diagnostics=false",
             f"logging.compute_last_grads={str(last_grads).lower()}"]
    run, _, state, step, mesh = assemble(tiny_run, "model.dropout=0.5", "optimizer=sgdm", "optimizer.momentum=0.0",
                                         "optimizer/lr_config=constant", "optimizer.lr_config.lr=0.5",
                                         "optimizer.lr_config.warmup=0", "train.gradient_clip_val=null",
                                         "dataset.batch_size=4", "dataset.total_batch_size=8", *flags)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t, k: losses.loss_fn(m, t, k, "float32")[0]))
    copy = lambda model: jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    rng = np.random.default_rng(4)
    models, keys, batches, metrics = [], [], [], []
    for _ in range(2):
        batches.append(rng.integers(0, 64, (2, 4, 17), dtype=np.int32))
        models.append(copy(state.model))
        keys.append(step_keys(state.key, 2)[1])
        state, m = step(state, meshlib.put_batch(batches[-1], meshlib.batch_sharding(mesh, 1)), True)
        metrics.append({k: float(v) for k, v in m.items()})

    def at(model):  # (mean loss, flat mean gradient) over step 2's micro-batches at its keys
        out = [value_and_grad(model, jnp.asarray(b), k) for b, k in zip(batches[1], keys[1], strict=True)]
        return np.mean([float(v) for v, _ in out]), np.mean([flat(g) for _, g in out], axis=0)

    (f, g), (f_prev, g_prev) = at(models[1]), at(models[0])
    delta = flat(params_of(models[1])) - flat(params_of(models[0]))
    got = metrics[1]
    # The micro-batches' losses and gradients are the step's bit for bit (the same loss_fn at the same
    # keys: test_the_train_step_carries_the_aux_state_and_matches_numpy); the step's mean of two
    # float32 values rounds their sum once (the halving is exact), the test's float64 mean not at all.
    assert got["train/loss"] == pytest.approx(f, rel=rounding_rtol(1))
    # two such means, then their float32 difference (one rounding of it)
    assert got["loss/fn-f(n-1)"] == pytest.approx(f - f_prev, rel=rounding_rtol(1),
                                                  abs=rounding_rtol(2) * max(abs(f), abs(f_prev)))
    if not last_grads:
        assert "grads/cos(gn, g'(n-1))" not in got
        return
    # g and g' are float32 means of two micro-batches' gradients (one rounding each, <= EPS32/2 of
    # |g|: each cosine moves by at most that relative change of one vector), Δ(n) rounds once more
    N = delta.size + 1
    assert got["grads/cos(gn, g'(n-1))"] == pytest.approx(cos(g, g_prev), rel=0, abs=cos_atol(N) + rounding_rtol(2))
    assert got["curvature/<gn-g'(n-1), Delta(n)>"] == pytest.approx(
        (g - g_prev) @ delta, rel=0, abs=dot_atol(N + 1, np.abs(g - g_prev) @ np.abs(delta))
        + rounding_rtol(1) * (np.abs(g) + np.abs(g_prev)) @ np.abs(delta))


def test_log_callback_data_false_leaves_no_aux_leaves(tiny_run):
    _, _, state, step, mesh = assemble(tiny_run, "logging.log_callback_data=false")
    assert state.metric_states.get("aux") is None
    state, metrics = step(state, meshlib.put_batch(np.zeros((1, 8, 17), np.int32), meshlib.batch_sharding(mesh, 1)))
    assert state.metric_states.get("aux") is None and not any(k.startswith(("params/", "grads/")) for k in metrics)
    assert step.plain is step.logging  # no logging-only work: one program


def test_a_nonfinite_gradient_is_counted_and_skipped(tiny_run):
    """A batch whose first token is 63 makes the loss (so the gradient) NaN. With skip_nonfinite the
    weights and optimizer state stay as they were (but for the lr schedule's counters, which follow
    the step: optimizer/nonfinite.py), the step is counted, and the next finite step trains on with
    buffers the NaN did not reach."""
    run = tiny_run("train.skip_nonfinite=true", "logging.log_callback_data=true")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, tx, state, _ = T.init_training(run, mesh)

    def poisoned_loss(model, tokens_BxT1, key, compute_dtype):
        loss, aux = losses.loss_fn(model, tokens_BxT1, key, compute_dtype)
        loss = loss * jnp.where(tokens_BxT1[0, 0] == 63, jnp.nan, 1.0)  # NaN reaches the gradient
        return loss, {**aux, "loss": loss}

    abstract = jax.eval_shape(lambda: state)
    shardings = layout.state_shardings(mesh, abstract, abstract.model, param_axes(abstract.model))
    from trainer import step_metrics
    metrics = step_metrics.defaults(optax.constant_schedule(1e-3), {}, [], skip_nonfinite=True)
    metrics.append(aux_state.AuxHook(run.logging.aux))
    step = build_train_step(poisoned_loss, tx, metrics, shardings, mesh, "float32", False)
    put = lambda b: meshlib.put_batch(b, meshlib.batch_sharding(mesh, 1))
    good = np.ones((1, 8, 17), np.int32)
    bad = good.copy()
    bad[0, 0, 0] = 63
    state, _ = step(state, put(good), True)
    kept = lambda s: [np.array(x) for x in jax.tree.leaves(eqx.filter(
        (s.model, schedules_at(s.opt_state.inner_state, 0), s.metric_states["aux"].last_params), eqx.is_array))]
    counters = lambda s: {int(x.count) for x in find_states(s.opt_state, optax.ScaleByScheduleState)}
    assert counters(state) == {1}
    before = kept(state)
    state, m = step(state, put(bad), True)
    after = kept(state)
    assert float(m["grads/inf_grads"]) == 1 and float(m["train/skipped_steps"]) == 1
    assert float(m["train/update_norm"]) == 0.0 and math.isnan(float(m["train/loss"]))
    assert counters(state) == {2}
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    state, m = step(state, put(good), True)
    assert all(math.isfinite(float(v)) for k, v in m.items() if k != "train/loss")
    assert float(m["train/skipped_steps"]) == 1 and float(m["grads/inf_grads"]) == 1
    assert (np.isfinite(flat(state.metric_states["aux"].last_grads)).all()
            and np.isfinite(flat(state.metric_states["aux"].past_grads)).all())


def test_a_skipped_step_keeps_x_n_minus_1_so_the_next_delta_is_the_last_update(tiny_run):
    """Steps at x0 (finite), x1 (a NaN in the loss mask: gradient NaN, skipped) and x2 = x1
    (finite). The skipped step must leave x(n-1) = x0 (trainit keeps its previous parameters on a
    rejected step), so the third step's Δ(n) is x1 - x0, the last update applied, and no term of
    the `_sum`s is lost; overwriting it with x1 made that Δ 0."""
    run = tiny_run("train.skip_nonfinite=true", "logging.log_callback_data=true", "logging.optim_diagnostics=false",
                   "optimizer=sgdm", "optimizer.momentum=0.0", "optimizer/lr_config=constant",
                   "optimizer.lr_config.lr=0.5", "optimizer.lr_config.warmup=0", "train.gradient_clip_val=null")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    rng = np.random.default_rng(3)
    batches = [{"tokens": rng.integers(0, 64, (1, 8, 17), dtype=np.int32), "loss_mask": np.ones((1, 8, 16), np.float32)}
               for _ in range(3)]
    batches[1]["loss_mask"][0, 0, 0] = np.nan  # the loss, so every gradient element, is NaN
    params = lambda model: flat(eqx.filter(model, eqx.is_inexact_array))
    grad_at = eqx.filter_jit(eqx.filter_grad(lambda m, b: losses.loss_fn(m, b, None, "float32")[0]))
    xs, metrics = [], []
    for batch in batches:
        xs.append(params(state.model))
        g = flat(grad_at(state.model, jax.tree.map(lambda v: jnp.asarray(v[0]), batch)))
        state, m = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), True)
        metrics.append(({k: float(v) for k, v in m.items()}, g))
    x0, x1, x2 = xs
    (m1, _), (m2, _), (m3, g3) = metrics
    assert m2["train/skipped_steps"] == 1 and m2["grads/inf_grads"] == 1
    np.testing.assert_array_equal(x2, x1)  # skipped
    # the finite step after it moved x(n-1) on
    np.testing.assert_array_equal(flat(state.metric_states["aux"].last_params), x2)
    delta = x1 - x0
    assert np.linalg.norm(delta) > 0.1
    # g3 is the step's gradient bit for bit (the same loss_fn on the same batch); the hook's float32
    # reductions over N parameters, +1 term for Δ(n) = x(n) − x(n−1) rounded in float32
    N = delta.size + 1
    assert m3["update/norm"] == pytest.approx(np.linalg.norm(delta), rel=dot_atol(N + 1, 1.0) / 2 + rounding_rtol(1))
    dot_tol = dot_atol(N, np.abs(g3) @ np.abs(delta))
    assert m3["update/<gn, Delta(n)>"] == pytest.approx(g3 @ delta, rel=0, abs=dot_tol)
    assert m3["update/cos(gn, Delta(n))"] == pytest.approx(cos(g3, delta), rel=0, abs=cos_atol(N))
    # step 1's Δ is 0, step 2 is left out: the sum is step 3's term alone (0 + term: exact)
    assert m3["update/<gn, Delta(n)>_sum"] == pytest.approx(g3 @ delta, rel=0, abs=dot_tol)
    total = "update/<gn, Delta(n)>_sum"
    assert m3[total] == m1[total] + m3["update/<gn, Delta(n)>"]  # 0 + the term, exactly


@pytest.mark.parametrize("overrides", [
    ("logging.wandb_project=PROJECT_NAME",),
    ("logging.store_last_grads=false", "logging.store_past_grads=false", "logging.store_last_params=false",
     "logging.compute_last_loss=false", "logging.compute_last_grads=false"),
    ("logging.log_callback_data=false",),
], ids=["wandb", "all-flags-off", "no-diagnostics"])
def test_trainits_logging_commands_compose_and_validate(tiny_run, overrides):
    """trainit's README commands, as written (its `python train_jax.py ...` lines' overrides)."""
    run = tiny_run("logging.log_callback_data=true", *overrides)
    if "logging.wandb_project=PROJECT_NAME" in overrides:
        assert {type(s).__name__: s for s in run.logging.sinks}["Wandb"].wandb_project == "PROJECT_NAME"
    elif "logging.log_callback_data=false" in overrides:
        assert not run.logging.aux.on
    else:
        assert run.logging.aux.on and run.logging.aux.buffer_copies() == 0 and not run.logging.aux.needs_last_point
