"""The host loop's parts without a run: hook schedules, step-metric variants, the sink registry.
Milliseconds each, except one tiny compiled step."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import train_jax as T
from trainer import hooks as H
from trainer import step_metrics
from utils.errors import ConfigError, TrainingError
from utils.logging import sinks
from utils.parallel import mesh as meshlib


class Recorder(H.Hook):
    def __init__(self, every=None, at_start=False, at_end=False):
        self.every, self.at_start, self.at_end, self.steps = every, at_start, at_end, []

    def __call__(self, ctx):
        self.steps.append(ctx.step)


def drive(hooks: list[H.Hook], start: int, end: int, record_at=(), state=None) -> H.LoopContext:
    """The loop's calls, with no model: start, then each step's hooks."""
    ctx = H.LoopContext(start, end, state=state, data=None)
    runner = H.Hooks(hooks)
    runner.run(ctx)
    for step in range(start + 1, end + 1):
        ctx.advance(step, state, {})
        if step in record_at:
            ctx.add({"train/loss": 1.0})
        runner.run(ctx)
    return ctx


def test_hook_schedules():
    every3, start_end, plain = Recorder(every=3), Recorder(at_start=True, at_end=True), Recorder()
    drive([every3, start_end, plain], start=4, end=11)  # a resumed segment: steps 5..11
    assert every3.steps == [6, 9]
    assert start_end.steps == [4, 11]
    assert plain.steps == []


def test_evaluation_schedule_follows_the_run_not_the_segment():
    """Every val_freq steps and at train.max_steps; the baseline only when the run starts at 0."""
    def fake_eval(model):
        return {"val/loss": 2.0}

    def steps_of(start, end):
        evaluation = H.Evaluation(fake_eval, val_freq=4, max_steps=10, at_start=True)
        ctx = H.LoopContext(start, end, state=type("State", (), {"model": None})(), data=None)
        runner = H.Hooks([evaluation])
        evaluated = []
        for step in range(start, end + 1):
            if step > start:
                ctx.advance(step, ctx.state, {})
            runner.run(ctx)
            if "val/loss" in ctx.record:
                evaluated.append(step)
        return evaluated

    assert steps_of(0, 6) == [0, 4]  # a first segment of 6: no evaluation at its end
    assert steps_of(6, 10) == [8, 10]  # the resumed one: step 8, and max_steps


def test_divergence_hook_stops_on_a_logged_nan():
    with pytest.raises(TrainingError, match=r"train/loss is nan at step 3"):
        ctx = H.LoopContext(0, 5, state=None, data=None)
        runner = H.Hooks([H.Divergence()])
        for step in range(1, 6):
            ctx.advance(step, None, {})
            ctx.add({"train/loss": float("nan") if step == 3 else 1.0})
            runner.run(ctx)


def test_hooks_close_all_even_when_one_fails():
    closed = []

    class Closing(H.Hook):
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise RuntimeError(self.name)

    with pytest.raises(RuntimeError, match="a"):
        H.Hooks([Closing("a", fail=True), Closing("b")]).close()
    assert closed == ["a", "b"]  # b (e.g. the checkpointer waiting for its writes) still closed


def test_logging_only_metrics_compile_a_second_variant(tiny_run):
    """A metric marked logging_only is computed by the logging variant only; without one, the two
    variants are one compiled function (the aux-state hook, off here, always asks for two)."""
    run = tiny_run("model.vocab_size=64", "logging.log_callback_data=false")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    batch = meshlib.put_batch(np.zeros((1, 8, 17), np.int32), meshlib.batch_sharding(mesh, 1))

    def max_abs_update(state, grads, updates, aux):
        return {"optim/max_abs_update": jax.numpy.stack([abs(u).max() for u in jax.tree.leaves(updates)]).max()}

    plain_only = T.init_training(run, mesh)[3]
    assert plain_only.plain is plain_only.logging

    _, _, state, step = T.init_training(run, mesh, metrics=[step_metrics.FnMetric(step_metrics.loss),
                                                           step_metrics.FnMetric(max_abs_update, logging_only=True)])
    assert step.plain is not step.logging
    state, plain_metrics = step(state, batch, logging=False)
    state, logging_metrics = step(state, batch, logging=True)
    assert set(plain_metrics) == {"train/loss"}
    assert set(logging_metrics) == {"train/loss", "optim/max_abs_update"}
    assert float(logging_metrics["optim/max_abs_update"]) > 0
    state, _ = step(state, batch, logging=False)
    assert step.compiled() == 2  # each variant traced once: no recompilation


def test_the_vouchers_are_metrics_every_step_reports(tiny_run):
    """check_finite reads a missing name as finite, so a voucher must be a metric that the plain
    step (no logging-only metric, no aux hook values) reports: this step's update norm, not the
    aux hook's update/norm (the previous update's, logging steps only)."""
    run = tiny_run("logging.log_callback_data=true", "logging.optim_diagnostics=false")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    _, metrics = step(state, meshlib.put_batch(np.zeros((1, 8, 17), np.int32), meshlib.batch_sharding(mesh, 1)),
                      logging=False)
    assert set(H.VOUCHERS) <= set(metrics) and step_metrics.UPDATE_NORM in H.VOUCHERS
    assert "update/norm" not in metrics


def test_logging_knobs_belong_to_sinks():
    cfg = sinks.logging_config({"log_every": 5, "progress_bar": False, "metrics_file": "m.jsonl", "tensorboard": True,
                                "wandb_project": "p", "wandb_mode": "offline"})
    assert cfg.log_every == 5
    assert [type(s).__name__ for s in cfg.sinks] == ["Console", "Jsonl", "TensorBoard", "Wandb"]
    with pytest.raises(ConfigError, match=r"unknown knob logging\.wandb: known knobs are"):
        sinks.logging_config({"wandb": True})  # gone: wandb_project set = on
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode='cloud' must be online, offline or disabled"):
        sinks.logging_config({"wandb_mode": "cloud"})


def test_a_registered_sink_receives_every_logged_step(tmp_path, monkeypatch):
    """The registry's contract: a new sink is a config class with `build` plus one SINKS entry."""
    from dataclasses import dataclass

    got = []

    @dataclass(frozen=True)
    class Memory:
        memory: bool = True

        def build(self, run_dir, total_steps, start_step, config, saved):
            class Sink:
                def log(self, step, metrics):
                    got.append((step, metrics))

                def close(self):
                    got.append("closed")

            return Sink() if self.memory else None

    monkeypatch.setitem(sinks.SINKS, "memory", Memory)
    cfg = sinks.logging_config({"progress_bar": False, "memory": True})
    opened = sinks.open_sinks(cfg, str(tmp_path), 10, 0, {})
    opened.log(3, {"train/loss": 1.5})
    opened.close()
    assert got == [(3, {"train/loss": 1.5}), "closed"]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 3, "train/loss": 1.5}]
    off = sinks.logging_config({"progress_bar": False, "memory": False, "metrics_file": None, "samples_file": None})
    assert all(type(s).__name__ == "ConsoleSink" for s in sinks.open_sinks(off, str(tmp_path), 10, 0, {}).sinks)


def test_eval_samples_go_to_samples_jsonl_at_each_evaluation(tmp_path):
    """Evaluations at steps 0, 2 and 4 (val_freq 2): each writes one line per fixed prompt; the
    sampler gets the same prompts and token count every time."""
    cfg = sinks.logging_config({"metrics_file": None, "samples_file": "samples.jsonl", "progress_bar": False})
    out = sinks.open_sinks(cfg, str(tmp_path), 4, 0, {})
    calls = []

    def sample(model, prompt, tokens):
        calls.append((prompt, tokens))
        return prompt + "x" * tokens

    evaluation = H.Evaluation(lambda model: {"val/loss": 1.0}, 2, 4, at_start=True)
    drive([evaluation, H.EvalSamples(sample, ("def ", "import "), 3, out)], 0, 4,
          state=type("State", (), {"model": None})())
    out.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"], r["text"]) for r in lines] == [
        (s, p, p + "xxx") for s in (0, 2, 4) for p in ("def ", "import ")]
    assert set(calls) == {("def ", 3), ("import ", 3)}
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_hook_before_the_producer_of_what_it_needs_is_an_error_naming_both():
    """Hooks declare what they read: the sinks must log this step's val/loss, so Log after Evaluation."""
    evaluation = H.Evaluation(lambda model: {"val/loss": 1.0}, val_freq=1, max_steps=2, at_start=False)
    log = H.Log(sinks.Sinks())
    with pytest.raises(ValueError, match=r"Log needs 'val/loss', which Evaluation produces after it"):
        H.Hooks([log, evaluation])
    with pytest.raises(ValueError, match=r"Divergence needs .*step's metrics.*Throughput"):
        H.Hooks([H.Divergence(), H.Throughput(1, 1, 1.0, None)])
    H.Hooks([H.Throughput(1, 1, 1.0, None), evaluation, log, H.Divergence()])  # the run's order


def test_the_runs_hooks_are_in_a_valid_order(tiny_run, tmp_path):
    """make_hooks builds every hook a run can have (evaluation, samples, checkpoints) in an order
    that satisfies every declared need."""
    run = tiny_run("model.vocab_size=null", "checkpoint.save=true", f"checkpoint.save_path={tmp_path}/ck",
                   "checkpoint.keep_best=true",
                   "logging.sample_prompts=[a]", "train.sample_tokens=2")
    trainer = T.build_trainer(run)
    with T.StopSignals(catch_interrupt=False) as stop_signals:
        hooks = T.make_hooks(trainer.run, trainer, str(tmp_path), stop_signals)
        try:
            names = [type(h).__name__ for h in hooks.hooks]
            assert names == ["Throughput", "Evaluation", "Log", "EvalSamples", "Divergence", "Checkpoint",
                             "StopOnSignal", "Sample"]
        finally:
            hooks.close()
            trainer.data.train.close()


# ----------------------------------------------------------------------------- saved state


def stateful_hooks() -> set[type]:
    """Every Hook subclass in the project's modules with a `state_dict` (what checkpoints keep of it),
    found by importing trainer/, utils/ and train_jax.py: a new stateful hook is covered without being listed."""
    import importlib
    import pkgutil

    import trainer
    import utils

    for package in (trainer, utils):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(module.name)
    found, todo = set(), [H.Hook]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if hasattr(cls, "state_dict") and cls.__module__.split(".")[0] in ("trainer", "utils", "train_jax"):
            found.add(cls)
    return found


def _early_stopping(saved):
    from trainer.early_stopping import EarlyStopping, EarlyStoppingConfig

    return EarlyStopping(EarlyStoppingConfig(patience=2, min_delta=0.01), saved)


# Each stateful hook as make_hooks builds it, from its saved state (None: a fresh run).
STATEFUL_HOOKS = {"EarlyStopping": _early_stopping}


def test_every_hooks_saved_state_round_trips_from_its_initial_value():
    """A checkpoint saved before a hook's state changed (early stopping before the first finite val/loss:
    best is null) must resume: state_dict() is strict JSON (the manifest), and a hook built from it
    saves the same state again."""
    import inspect

    found = {cls.__name__: cls for cls in stateful_hooks()}
    assert found, "no Hook subclass has a state_dict: the discovery is broken"
    assert set(found) == set(STATEFUL_HOOKS), (
        f"stateful hooks {sorted(set(found) - set(STATEFUL_HOOKS))} have no entry in STATEFUL_HOOKS: add how "
        "make_hooks builds each from its saved state")
    for name, make in STATEFUL_HOOKS.items():
        assert "saved" in inspect.signature(found[name]).parameters, f"{name} must take its state back as `saved`"
        initial = make(None).state_dict()
        saved = json.loads(json.dumps(initial, allow_nan=False))  # as the manifest stores it: no NaN/Infinity
        assert make(saved).state_dict() == initial, name
        assert make(json.loads(json.dumps(make(saved).state_dict(), allow_nan=False))).state_dict() == initial, name


def test_step_time_is_the_median_of_clean_intervals(monkeypatch):
    """A fake clock: every step takes 1 s, a step that waits for a compilation 50 s more, and an
    off-the-clock hook (an evaluation, a save) 100 s. time/step_sec, logged every 2 steps, must be
    exactly 1 s, and absent until a clean interval (not the first, no compilation in it) ended:
    a median that took in the slow intervals would read 26 s at step 6 and 8."""
    now = [0.0]
    monkeypatch.setattr(H, "clock", lambda: now[0])
    compiling, slow_at = {3, 12}, {7, 10}

    class OffTheClock(H.Hook):  # an evaluation at steps 7 (between logging steps) and 10 (at one)
        off_the_clock = True

        def due(self, ctx):
            return ctx.step in slow_at

        def __call__(self, ctx):
            now[0] += 100.0

    throughput = H.Throughput(log_every=2, tokens_per_step=10, flops_per_step=1.0, peak=None)
    ctx = H.LoopContext(0, 16, state=None, data=None)
    runner = H.Hooks([throughput, OffTheClock()])
    runner.run(ctx)
    timed = {}
    for step in range(1, 17):
        ctx.compile_sec = 50.0 if step in compiling else 0.0
        now[0] += 1.0 + ctx.compile_sec
        ctx.advance(step, None, {})
        runner.run(ctx)
        if "time/elapsed_sec" in ctx.record:
            timed[step] = ctx.record.get("time/step_sec")
    # step 2: the segment's first interval; 4: compiled at 3; 12: waited at 12; 8: the evaluation at 7 restarted it
    assert timed == {2: None, 4: None, 6: 1.0, 8: 1.0, 10: 1.0, 12: 1.0, 14: 1.0, 16: 1.0}
    assert list(throughput.clean) == [1.0] * 5  # the intervals ending at 6, 8, 10, 14, 16 (12 compiled)
