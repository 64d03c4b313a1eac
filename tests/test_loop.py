"""The host loop, in-process on a tiny model: its throughput arithmetic (driven by a fake clock,
so it is exact and never flaky) and the divergence check that guards every save."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import compose_config, restore_item

import train_jax
from trainer import hooks
from utils.checkpoint.storage import complete_steps
from utils.errors import TrainingError

RUN = ("model.vocab_size=null", "train.max_val_steps=1", "logging.log_every=4", "optimizer/lr_config=constant")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_step_time_leaves_out_evaluations_inside_a_logging_interval(tmp_path, monkeypatch):
    """Every train step takes 1 s and every evaluation 100 s of a fake clock; evaluations fall
    between logging steps (val_freq 2, log_every 4). Each logged time/step_sec must be exactly 1 s."""
    now, variants = [0.0], []
    monkeypatch.setattr(hooks, "clock", lambda: now[0])
    make_step, make_evaluate = train_jax.build_train_step, train_jax.make_evaluate

    class Timed:
        """The step, each call 1 s of the fake clock; bound to a run's knobs as the step is (`with_args`)."""

        def __init__(self, step):
            self.step, self.compiled = step, step.compiled  # compiled: what the loop asks to time compilations

        def __call__(self, state, batch, logging=True):
            now[0] += 1.0
            variants.append(logging)
            return self.step(state, batch, logging)

        def with_args(self, args):
            return Timed(self.step.with_args(args))

    def timed_make_step(*args, **kwargs):
        return Timed(make_step(*args, **kwargs))

    def slow_make_evaluate(*args, **kwargs):
        evaluate = make_evaluate(*args, **kwargs)

        def slow(model):
            now[0] += 100.0
            return evaluate(model)

        return slow

    monkeypatch.setattr(train_jax, "build_train_step", timed_make_step)
    monkeypatch.setattr(train_jax, "make_evaluate", slow_make_evaluate)
    train_jax.train(compose_config(*RUN, "train.max_steps=12", "train.val_freq=2", "logging.log_callback_data=true",
                                   "logging.optim_diagnostics=false"),
                    str(tmp_path))  # diagnostics on: two step variants
    timed = {r["step"]: r["time/step_sec"] for r in records(tmp_path) if "time/step_sec" in r}
    # Steps 1-2 hold the start (and the plain variant's compilation), steps 3-4 the logging variant's
    # compilation at step 4: neither interval is clean, so step 8 is the first with a step time.
    assert timed == {8: pytest.approx(1.0), 12: pytest.approx(1.0)}
    tokens = {r["step"]: r["train/tokens_per_sec"] for r in records(tmp_path) if "train/tokens_per_sec" in r}
    assert tokens[8] == pytest.approx(8 * 16)  # batch 8 x context 16 tokens per 1-s step
    # The two variants compiled at steps 1 and 4 (1 s each on this clock); batches never waited.
    assert {r["step"]: r["time/compile_sec"] for r in records(tmp_path) if "time/compile_sec" in r} == {4: 2.0}
    assert all(r["time/data_wait_sec"] == 0.0 for r in records(tmp_path) if "time/data_wait_sec" in r)
    assert [r["time/eval_sec"] for r in records(tmp_path) if "time/eval_sec" in r] == [100.0] * 7
    # The step variant with the logging-only metrics runs on logging steps only.
    assert [step for step, logging in enumerate(variants, start=1) if logging] == [4, 8, 12]


def test_a_diverged_state_is_never_saved(tmp_path, monkeypatch):
    """lr 1e6 without clipping: steps 1-2 are finite (if absurd), the loss is NaN from step 3 on,
    and no logging step comes before the saves at every step. The run must stop with the
    divergence error instead of saving NaN."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainingError, match=r"diverged"):
        train_jax.train(compose_config(*RUN, "train.max_steps=8", "logging.log_every=100", "optimizer=sgdm",
                                       "optimizer.lr_config.lr=1e6", "train.gradient_clip_val=null",
                                       "train.skip_validation=true", "checkpoint.save=true",
                                       "checkpoint.save_path=ck", "checkpoint.save_steps=1",
                                       "checkpoint.max_to_keep=null"), str(tmp_path))
    saved = complete_steps("ck")
    assert saved == [1, 2]
    for step in saved:
        for item in ("model", "opt_state"):
            leaves = jax.tree.leaves(restore_item(tmp_path / "ck" / f"iter_{step}" / item))
            assert all(np.isfinite(np.asarray(x)).all() for x in leaves), f"iter_{step}/{item} holds NaN/inf"


@pytest.mark.parametrize("val_at, message", [
    ("[5,3]", r"train\.val_at=\[5, 3\] must list positive steps in increasing order.*e\.g\. train\.val_at=\[3, 5\]"),
    ("[0,4]", r"train\.val_at=\[0, 4\] must list positive steps"),
    ("[4,4]", r"train\.val_at=\[4, 4\] must list positive steps .*without repeats"),
    ("[4,30]", r"train\.val_at=\[4, 30\] lists steps beyond train\.max_steps=20: drop them or raise"),
    ("[2.5]", r"train\.val_at\[0\]=2\.5 must be a int"),
])
def test_val_at_is_checked_naming_the_knob(val_at, message):
    from utils.config import validate
    from utils.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as e:
        validate(compose_config(f"train.val_at={val_at}"))
    assert "\n" not in str(e.value)


def test_val_at_evaluates_at_each_listed_step_once_across_a_resume(tmp_path, monkeypatch):
    """train.val_at=[3,4,7] beside val_freq 100 and max_steps 10: a first segment stops at step 4
    (checkpoint.num_steps), the resume trains to 10. Evaluations (raw metrics.jsonl lines, both
    segments appended) at 3, 4, 7 and max_steps 10, each exactly once."""
    monkeypatch.chdir(tmp_path)
    run = (*RUN, "train.max_steps=10", "train.val_freq=100", "train.val_at=[3,4,7]", "train.val_at_start=false",
           "checkpoint.save=true", "checkpoint.save_path=ck", "checkpoint.save_steps=[4]", "checkpoint.num_steps=4")
    train_jax.train(compose_config(*run), str(tmp_path))
    assert [r["step"] for r in records(tmp_path) if "val/loss" in r] == [3, 4]
    train_jax.train(compose_config(*run, "checkpoint.resume=auto", "checkpoint.num_steps=null"), str(tmp_path))
    assert [r["step"] for r in records(tmp_path) if "val/loss" in r] == [3, 4, 7, 10]
