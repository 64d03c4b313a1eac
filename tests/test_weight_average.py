"""train.weight_average (trainer/weight_average.py): the EMA or tail average of the trained weights,
kept in the train state, is what val/loss, samples, the best checkpoint and exports use, the
trained weights' loss is val/loss_raw.

A tiny run per kind saves a checkpoint at every step, so each step's weights p_t are on disk: the
average is recomputed from them in NumPy float64 and compared with the run's, and the logged
val/loss with the loss at the run's average. Resumes continue the average bit for bit; `none`
builds the run it always built (tests/test_golden.py pins that run's losses)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import compose_config, restore_item, rounding_rtol

import train_jax as T
from models import lora
from trainer import hooks as H
from trainer import weight_average as W
from utils.checkpoint.storage import EVAL_MODEL, complete_steps, open_checkpoint
from utils.config import validate
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

STEPS = 6
# A high constant lr moves the weights far between steps, so an average of the wrong steps (or
# weights) is far from the right one; a checkpoint at every step holds each step's weights.
RUN = ("model.vocab_size=null", f"train.max_steps={STEPS}", "train.val_freq=3", "train.max_val_steps=2",
       "logging.log_every=1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=1e-2")
EVERY_STEP = ("checkpoint.save=true", "checkpoint.save_path=ck", "checkpoint.save_steps=1",
              "checkpoint.max_to_keep=null")
KINDS = {"ema": ("train.weight_average=ema", "train.weight_average_half_life=2"),
         "tail": ("train.weight_average=tail", "train.weight_average_tail=0.5")}  # the window: steps 3..6


# --- the knobs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (("train.weight_average=swa",), r"train.weight_average='swa' must be one of none, ema, tail"),
    (("train.weight_average_half_life=0",), r"train.weight_average_half_life=0.0 must be > 0"),
    (("train.weight_average_half_life=-5",), r"train.weight_average_half_life=-5.0 must be > 0"),
    (("train.weight_average_tail=0",), r"train.weight_average_tail=0.0 must lie in \(0, 1\]"),
    (("train.weight_average_tail=1.5",), r"train.weight_average_tail=1.5 must lie in \(0, 1\]"),
    (("train.weight_average=ema", "optimizer=schedule_free_adamw"),
     r"train.weight_average=ema cannot be combined with optimizer=schedule_free_adamw.*train.weight_average=none"),
])
def test_bad_knobs_are_one_line_config_errors(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_run(*overrides)
    assert "\n" not in str(e.value)


def test_the_weights_of_each_step():
    """w_t (trainer/weight_average.py): the bias-corrected EMA's (1 − d)/(1 − d^t), w_1 = 1; the
    tail's 1/(t − start + 1) from the window's start on, 1 before."""
    ema = W.WeightAverage("ema", 2.0, 0)
    d = 0.5 ** (1 / 2)
    for t in (1, 2, 5, 40):
        # The weight in float32: the constant 1 − d, t·rate, expm1 and the division, 6 roundings (see
        # `_average_bound`), against float64.
        np.testing.assert_allclose(float(ema.weight(np.int32(t))), (1 - d) / (1 - d**t), rtol=rounding_rtol(6))
    assert float(ema.weight(np.int32(1))) == 1.0  # the first step's weights alone: no trace of p_0
    tail = W.WeightAverage("tail", 1.0, 3)
    want = np.float32([1.0, 1.0, 1.0, 1 / 2, 1 / 3, 1 / 4])  # 1/k rounded once, as the division rounds it
    assert [tail.weight(np.int32(t)) for t in range(1, 7)] == list(want)


def test_evaluation_logs_the_raw_weights_beside_the_view():
    """val/* of the eval view (the average), val/*_raw of the state's own model; without `raw`, no _raw."""
    evaluate = lambda model: {"val/loss": {"avg": 1.0, "raw": 2.0}[model]}
    ctx = H.LoopContext(0, 1, state=SimpleNamespace(model="raw"), data=None, eval_view=lambda state: "avg")
    ctx.advance(1, SimpleNamespace(model="raw"), {})
    H.Evaluation(evaluate, 1, 1, False, raw=True)(ctx)
    assert ctx.record["val/loss"] == 1.0 and ctx.record["val/loss_raw"] == 2.0
    ctx.advance(1, SimpleNamespace(model="raw"), {})
    H.Evaluation(evaluate, 1, 1, False)(ctx)
    assert "val/loss_raw" not in ctx.record


# --- a run per kind, a checkpoint at every step ---------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(KINDS))
def averaged_run(request, tmp_path_factory, _cache_dir):
    """(kind, the run's directory holding ck/iter_1..6 and run/metrics.jsonl)."""
    tmp = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:  # _offline_env is per test; a module fixture needs its own
        mp.setenv("EQTRAIN_CACHE", str(_cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.chdir(tmp)
        (tmp / "run").mkdir()
        T.train(compose_config(*RUN, *EVERY_STEP, *KINDS[request.param]), str(tmp / "run"))
    return request.param, tmp


def _leaves(step_dir: Path, item: str, key: str | None = None) -> list[np.ndarray]:
    tree = restore_item((step_dir / item).resolve())
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree[key] if key else tree)]


def _average_by_hand(kind: str, ps: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The average after the last of `ps` (p_1..p_t, each a list of leaves), float64, from its
    definition (not the run's recursion): the EMA's Σ (1 − d)·d^(t−s)·p_s / (1 − d^t) (half-life
    2), the tail's mean of p_3..p_t (p_t itself before step 3)."""
    t = len(ps)
    if kind == "ema":
        d = 0.5 ** (1 / 2)
        return [sum((1 - d) * d ** (t - s) * ps[s - 1][i] for s in range(1, t + 1)) / (1 - d**t)
                for i in range(len(ps[0]))]
    window = ps[2:] if t >= 3 else ps[-1:]
    return [sum(p[i] for p in window) / len(window) for i in range(len(ps[0]))]


def _average_bound(ps: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Elementwise bound on |float32 average − exact| after t = len(ps) steps of avg = (1 − w)·avg + w·p
    (M = max_s |p_s| of the element bounds |avg| and |p|; u = EPS32/2): w carries ≤ 6 roundings
    (the float32 constant 1 − d, the rate, t·rate, expm1 (≤ 2 ulp), the division; the tail's: 1), so
    w·p errs by ≤ (6 + 1)·M·u with its product's rounding; 1 − w by ≤ (6 + 1)·u absolutely, so
    (1 − w)·avg by ≤ (7 + 1)·M·u; the sum 1. An error already made is scaled by 1 − w ≤ 1, so
    each step adds at most 16·M·u: 17·t roundings of M (one to spare), margin 2."""
    m = [np.max([np.abs(p[i]) for p in ps], axis=0) for i in range(len(ps[0]))]
    return [rounding_rtol(17 * len(ps)) * m_i for m_i in m]


def test_the_average_is_the_float64_average_of_each_steps_weights(averaged_run):
    """At every step the checkpoint's average (metric_states) is the float64 recomputation from the
    weights of the steps before it, within `_average_bound`; at the end so is `eval_model` (what
    export reads), and it is far from the trained weights."""
    kind, tmp = averaged_run
    ck = tmp / "ck"
    assert complete_steps(str(ck)) == list(range(1, STEPS + 1))
    ps = [_leaves(ck / f"iter_{t}", "model") for t in range(1, STEPS + 1)]
    for t in range(1, STEPS + 1):
        saved = _leaves(ck / f"iter_{t}", "metric_states", W.NAME)
        for got, want, bound in zip(saved, _average_by_hand(kind, ps[:t]), _average_bound(ps[:t]), strict=True):
            np.testing.assert_array_less(np.abs(got - want), bound + 1e-30, err_msg=f"{kind} step {t}")
    exported = _leaves(ck / f"iter_{STEPS}", EVAL_MODEL)
    far = 0
    for got, want, bound, p in zip(exported, _average_by_hand(kind, ps), _average_bound(ps), ps[-1], strict=True):
        np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)
        far += np.any(np.abs(p - want) > 10 * bound)
    assert far == len(exported)  # every leaf of the average apart from the trained weights


def test_val_loss_is_the_average_and_val_loss_raw_the_trained_weights(averaged_run):
    """The logged val/loss at the last step is the loss at the run's average (the eval view of the
    restored state: the same jitted programs on the same arrays, so bit for bit), val/loss_raw the
    loss at the trained weights, and the two differ."""
    kind, tmp = averaged_run
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if "val/loss" in r}
    assert sorted(logged) == [0, 3, 6] and all("val/loss_raw" in r for r in logged.values())
    assert logged[0]["val/loss"] == logged[0]["val/loss_raw"]  # step 0: the average is the initial weights
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        source = open_checkpoint(str(tmp / "ck"), "latest", with_opt_state=True)
        trainer = T.build_trainer(validate(source.config), source)
    at_average = trainer.evaluate(trainer.eval_view(trainer.state))
    at_raw = trainer.evaluate(trainer.state.model)
    assert logged[STEPS]["val/loss"] == at_average["val/loss"]
    assert logged[STEPS]["val/loss_raw"] == at_raw["val/loss"]
    assert abs(at_average["val/loss"] - at_raw["val/loss"]) > 1e-3 * at_raw["val/loss"]  # far apart


# --- resume ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_continues_the_average_bit_for_bit(tmp_path, monkeypatch, kind):
    """12 steps at once, and 5 then 7 resumed: every logged loss (val/loss at the average,
    val/loss_raw) and the final weights, optimizer state, average and eval_model are equal exactly.
    The tail window (f = 0.75: steps 3..12) and the EMA's bias correction both span the resume."""
    monkeypatch.chdir(tmp_path)
    steps = ("model.vocab_size=null", "train.max_steps=12", "train.val_freq=3", "train.max_val_steps=2",
             "logging.log_every=1", "model.dropout=0.1", "train.weight_average_tail=0.75", *KINDS[kind][:1])

    def train(name: str, *overrides: str) -> dict[int, dict]:
        (tmp_path / name).mkdir()
        T.train(compose_config(*steps, "checkpoint.save=true", *overrides), str(tmp_path / name))
        return {r["step"]: r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())}

    full = train("full", "checkpoint.save_path=ck/full")
    first = train("first", "checkpoint.save_path=ck/seg", "checkpoint.num_steps=5")
    assert complete_steps("ck/seg") == [5]
    second = train("second", "checkpoint.save_path=ck/seg", "checkpoint.resume=auto")
    for name in ("train/loss", "val/loss", "val/loss_raw"):
        want = {s: r[name] for s, r in full.items() if name in r}
        assert {s: r[name] for seg in (first, second) for s, r in seg.items() if name in r} == want, name
    assert {s for s, r in second.items() if "val/loss" in r} == {6, 9, 12}
    for item in ("model", "opt_state", "progress", "metric_states", EVAL_MODEL):
        for a, b in zip(*(jax.tree.leaves(restore_item((tmp_path / "ck" / d / "iter_12" / item).resolve()))
                          for d in ("full", "seg")), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=item)


# --- none -----------------------------------------------------------------------------------------------


def test_none_builds_the_step_it_always_built():
    """weight_average=none (the default): no average in the state, no eval view, no val/loss_raw, the
    step compiled once for logging and plain steps; an average on keeps the one compilation (its
    update ignores `logging`) and adds only its state, the initial weights at step 0."""
    mesh = meshlib.make_mesh(1, 1, 8, devices=jax.devices()[:1])
    plain = validate(compose_config())
    assert plain.train.weight_average == "none"
    assert W.metric(plain.train) is None and W.eval_view(plain.train) is None
    _, _, state, step = T.init_training(plain, mesh)
    assert state.metric_states == {} and step.plain is step.logging
    averaged = validate(compose_config(*KINDS["ema"]))
    _, _, state, step = T.init_training(averaged, mesh)
    assert list(state.metric_states) == [W.NAME] and step.plain is step.logging
    for avg, p in zip(jax.tree.leaves(state.metric_states[W.NAME]), jax.tree.leaves(eqx.filter(
            state.model, eqx.is_inexact_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(avg), np.asarray(p))  # step 0: the initial weights


def test_a_lora_run_averages_the_factors_alone():
    """With LoRA factors the average holds them alone (the frozen base never changes: averaging it
    would only copy it); the eval view is the average's factors on the model's own base."""
    run = validate(compose_config("model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr_config.lr=1e-2",
                                  *KINDS["ema"]))
    mesh = meshlib.make_mesh(1, 1, 8, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(state.model, eqx.is_inexact_array))[0]
    factors = [p for p, _ in leaves if lora.is_factor(p)]
    assert 0 < len(factors) == len(jax.tree.leaves(state.metric_states[W.NAME])) < len(leaves)
    batch_2x1xBxT1 = np.random.default_rng(0).integers(0, 64, (2, 1, 8, 17), dtype=np.int32)
    for batch in batch_2x1xBxT1:
        state, _ = step(state, meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1)), False)
    view = W.eval_view(run.train)(state)
    average = iter(jax.tree.leaves(state.metric_states[W.NAME]))
    moved = 0
    for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(eqx.filter(view, eqx.is_array))[0],
                                 jax.tree_util.tree_flatten_with_path(eqx.filter(state.model, eqx.is_array))[0],
                                 strict=True):
        if lora.is_factor(path):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(next(average)))  # float32 weights: no cast
            moved += not np.array_equal(np.asarray(x), np.asarray(y))
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the base: the model's own
    assert moved  # after 2 steps the average's factors are not the trained ones


@pytest.mark.slow
def test_switching_averaging_on_at_a_resume_starts_it_at_the_restored_weights(tmp_path, monkeypatch, capsys):
    """A checkpoint without an average (weight_average=none) resumed with one (overwrite_config):
    the step metrics' states start afresh, the run says so, and the average is logged from there."""
    monkeypatch.chdir(tmp_path)
    run = (*RUN, "checkpoint.save=true", "checkpoint.save_path=ck")
    for name, extra in (("first", ("checkpoint.num_steps=3",)),
                        ("second", ("checkpoint.resume=auto", "checkpoint.overwrite_config=true", *KINDS["ema"]))):
        (tmp_path / name).mkdir()
        T.train(compose_config(*run, *extra), str(tmp_path / name))
    assert "holds no step-metric states in this run's layout (weight_average)" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val/loss_raw" in r] == [STEPS]
