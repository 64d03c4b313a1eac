"""Early stopping (train.early_stopping.*, trainer/early_stopping.py): the count against a
hand-worked sequence, the state across a resume, and a tiny run that stops, saves its last
checkpoint, logs train/stopped_early and stays stopped when resumed."""

from __future__ import annotations

import json
import math

import pytest
from helpers import compose_config

import train_jax
from trainer.early_stopping import EarlyStopping, EarlyStoppingConfig
from trainer.hooks import LoopContext
from utils.config import validate
from utils.errors import ConfigError


def evaluations(hook: EarlyStopping, vals: list[float], start: int = 0, every: int = 10) -> int | None:
    """Feed `vals` as the val/loss of successive evaluations; the step the hook ends the run at."""
    for i, val in enumerate(vals, 1):
        ctx = LoopContext(start, 1000, None, None)
        ctx.step = start + i * every
        ctx.add({"val/loss": val})
        hook(ctx)
        if ctx.finished:
            assert ctx.record["train/stopped_early"] == 1.0
            return ctx.step
        assert "train/stopped_early" not in ctx.record
    return None


def test_counts_evaluations_without_an_improvement_of_min_delta():
    # 5 -> 4 improves; 3.97 is not 0.05 better (1); 3.9 is (reset); 3.88, nan, 3.86: three in a row
    vals = [5.0, 4.0, 3.97, 3.9, 3.88, math.nan, 3.86, 1.0]
    assert evaluations(EarlyStopping(EarlyStoppingConfig(patience=3, min_delta=0.05)), vals) == 70
    assert evaluations(EarlyStopping(EarlyStoppingConfig(patience=4, min_delta=0.05)), vals) is None
    assert evaluations(EarlyStopping(EarlyStoppingConfig(patience=1, min_delta=0.0)), [5.0, 4.0, 4.0]) == 30


def test_a_resumed_hook_counts_on_from_its_saved_state():
    """Stopping after 3 evaluations in a row equals stopping after 2, saving, resuming, then 1 more."""
    hook = EarlyStopping(EarlyStoppingConfig(patience=3, min_delta=0.0))
    assert evaluations(hook, [5.0, 4.0, 4.5, 4.2]) is None
    saved = json.loads(json.dumps(hook.state_dict()))  # as the manifest stores it
    assert saved == {"best": 4.0, "bad": 2, "stopped_at": None}
    assert evaluations(EarlyStopping(EarlyStoppingConfig(patience=3), saved), [4.1], start=40) == 50
    stopped = EarlyStopping(EarlyStoppingConfig(patience=3), {"best": 4.0, "bad": 3, "stopped_at": 50})
    ctx = LoopContext(50, 100, None, None)
    stopped(ctx)  # at the start of a segment resumed from a stopped run
    assert ctx.finished and "stopped early at step 50" in ctx.finished


@pytest.mark.parametrize("overrides, message", [
    (["train.early_stopping.patience=0"], "train.early_stopping.patience=0 must be a positive number"),
    (["train.early_stopping.min_delta=-1"], "train.early_stopping.min_delta=-1.0 must be a finite number >= 0"),
    (["train.early_stopping.patience=2", "train.skip_validation=true"], "set one of them off"),
    (["+train.early_stopping.pateince=2"], "unknown knob train.early_stopping.pateince"),
])
def test_bad_knobs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose_config(*overrides))
    assert "\n" not in str(e.value)


def test_a_run_stops_early_saves_and_stays_stopped(tmp_path, monkeypatch, capsys):
    """min_delta 10 (no real improvement is that large): the baseline at step 0 sets the best, the
    evaluation at step 4 is the first without one, patience 1 ends the run there: the checkpoint of
    step 4 is saved ("early stop"), train/stopped_early is logged with step 4's record, nothing after.
    Resumed, it trains nothing; without early stopping the same run goes to max_steps."""
    monkeypatch.chdir(tmp_path)
    run = ("model.vocab_size=null", "train.max_steps=12", "train.val_freq=4", "train.max_val_steps=2",
           "logging.log_every=2",
           "checkpoint.save=true", "checkpoint.save_path=ck", "checkpoint.resume=auto", "checkpoint.save_steps=100",
           "train.early_stopping.patience=1", "train.early_stopping.min_delta=10")
    (tmp_path / "a").mkdir()
    last = train_jax.train(compose_config(*run), str(tmp_path / "a"))
    assert last["train/stopped_early"] == 1.0
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 4
    assert [r["step"] for r in records if "train/stopped_early" in r] == [4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("iter_")) == ["iter_4"]
    manifest = json.loads((tmp_path / "ck" / "iter_4" / "manifest" / "manifest.json").read_text())
    assert manifest["reason"] == "early stop" and manifest["early_stopping"]["stopped_at"] == 4
    out = capsys.readouterr().out
    assert "early stopping at step 4: val/loss" in out and "train.early_stopping.patience=1" in out
    (tmp_path / "b").mkdir()
    train_jax.train(compose_config(*run), str(tmp_path / "b"))
    assert "stopped early at step 4 before this resume; nothing to train" in capsys.readouterr().out
    resumed = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [4] and "train/loss" not in resumed[0]  # the start record only


def test_a_checkpoint_saved_before_the_first_evaluation_resumes(tmp_path, monkeypatch, capsys):
    """No baseline evaluation (val_at_start=false) and a save at step 2, before the first at step 4: the
    checkpoint's early-stopping state has no best yet (null). The resume counts on from it: the
    evaluations at 4 and 6 set the best and the count as in a run never interrupted."""
    monkeypatch.chdir(tmp_path)
    run = ("model.vocab_size=null", "train.max_steps=6", "train.val_freq=4", "train.max_val_steps=2",
           "train.val_at_start=false", "logging.log_every=2", "checkpoint.save=true", "checkpoint.save_path=ck",
           "checkpoint.resume=auto", "checkpoint.save_steps=2", "train.early_stopping.patience=2")
    (tmp_path / "a").mkdir()
    train_jax.train(compose_config(*run, "checkpoint.num_steps=2"), str(tmp_path / "a"))
    manifest = json.loads((tmp_path / "ck" / "iter_2" / "manifest" / "manifest.json").read_text())
    assert manifest["early_stopping"] == {"best": None, "bad": 0, "stopped_at": None}
    (tmp_path / "b").mkdir()
    train_jax.train(compose_config(*run), str(tmp_path / "b"))
    assert "resumed from" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert sorted(vals) == [4, 6]
    manifest = json.loads((tmp_path / "ck" / "iter_6" / "manifest" / "manifest.json").read_text())
    assert manifest["early_stopping"] == {"best": min(vals.values()), "bad": int(vals[6] >= vals[4]),
                                          "stopped_at": None}
