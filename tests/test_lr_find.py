"""scripts/lr_find.py: a short sweep on gpt_tiny suggests an lr within 10x of the yaml default
and writes its PNG, CSV and JSON; every bad knob exits 2 with one line naming it before anything
is built; the sweep's schedule, its smoothing and both rules do what the docstring says.

Everything runs in-process through the script's `main(argv)` and functions. The sweep test uses
80 steps (the users' default is 300) over 1e-5..1 at batch 8 x 64 tokens: ~16 steps per decade,
enough to place the minimum (gpt_tiny's compilation costs more than the steps); it is the only
test here that compiles anything.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import load_script, rounding_rtol

ROOT = Path(__file__).resolve().parent.parent
lr_find = load_script("lr_find")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _yaml_lr(optimizer: str) -> float:
    """The default lr as the yamls set it: the optimizer's own lr_config.lr, else the cosine schedule's."""
    own = yaml.safe_load((ROOT / "conf" / "optimizer" / f"{optimizer}.yaml").read_text())
    if "lr" in (own.get("lr_config") or {}):
        return float(own["lr_config"]["lr"])
    return float(yaml.safe_load((ROOT / "conf" / "optimizer" / "lr_config" / "cosine.yaml").read_text())["lr"])


@pytest.mark.slow
def test_sweep_on_gpt_tiny_suggests_near_the_yaml_lr_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "lrf"
    argv = ["model=gpt_tiny", "dataset.batch_size=8", "dataset.context_length=64", "lr_find.steps=80",
            "lr_find.min_lr=1e-5", "lr_find.max_lr=1", f"lr_find.out_dir={out}"]
    assert lr_find.main(argv) == 0
    printed = capsys.readouterr().out

    summary = json.loads((out / "summary.json").read_text())
    yaml_lr = _yaml_lr("adamw")
    assert summary["optimizer"] == "adamw" and summary["yaml_lr"] == pytest.approx(yaml_lr)
    suggested = summary["suggested_lr"]
    assert yaml_lr / 10 <= suggested <= yaml_lr * 10, summary
    assert summary["suggested_lr"] == pytest.approx(summary["min_loss_lr"] / 10)
    assert summary["steepest_lr"] <= summary["min_loss_lr"]
    assert f"suggested lr: {suggested:.3g}" in printed and "min/10" in printed

    with open(out / "lr_find.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "lr", "loss", "smoothed"]
    assert 10 <= len(rows) == summary["steps_run"] <= 80
    lrs = np.array([float(r["lr"]) for r in rows])
    # the csv prints knobs.lrs() (float64, the same formula) as %.6e: 7 significant digits, within half a
    # unit of the 7th, <= 5e-7 relative; 1e-6 is 2x that
    np.testing.assert_allclose(lrs, lr_find.LRFindConfig(min_lr=1e-5, max_lr=1.0, steps=80).lrs()[:len(rows)],
                               rtol=1e-6)
    losses = np.array([float(r["loss"]) for r in rows])
    assert math.isclose(losses[0], math.log(257), rel_tol=0.05)  # byte tokens, untrained: ~uniform
    assert (out / "lr_find.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(("argv", "message"), [
    (["lr_find.min_lr=1", "lr_find.max_lr=0.1"], "lr_find.min_lr=1.0 must be below lr_find.max_lr=0.1"),
    (["lr_find.min_lr=0"], "lr_find.min_lr=0.0 must be a positive number"),
    (["lr_find.steps=5"], "lr_find.steps=5 must be >= 10"),
    (["lr_find.stop_factor=1"], "lr_find.stop_factor=1.0 must be > 1"),
    (["lr_find.smooth=0"], "lr_find.smooth=0.0 must be a positive number"),
    (["lr_find.steps=many"], "lr_find.steps='many' must be a int"),
    (["lr_find.max_steps=100"], "unknown knob lr_find.max_steps"),
    (["-m", "optimizer=adamw,sgdm"], "-m: lr_find.py takes Hydra overrides"),
    (["optimizer=nope"], "optimizer/nope': choose one of adafactor, "),  # Hydra's error, one line
    (["train.gradient_clip_val=-1"], "train.gradient_clip_val=-1"),  # the run's validation
    (["checkpoint.load=true", "checkpoint.load_path=ckpt/x"], "checkpoint.load"),
])
def test_bad_knob_exits_2_with_one_line_before_anything_is_built(argv, message, monkeypatch, capsys):
    import train_jax

    def never(*args, **kwargs):
        raise AssertionError("build_trainer called: a bad knob must fail before anything compiles")

    monkeypatch.setattr(train_jax, "build_trainer", never)
    assert lr_find.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_sweep_schedule_is_geometric_from_min_to_max_lr():
    knobs = lr_find.LRFindConfig(min_lr=1e-6, max_lr=10.0, steps=300)
    schedule = lr_find.sweep_schedule(knobs)
    lrs = knobs.lrs()
    assert lrs[0] == pytest.approx(1e-6) and lrs[-1] == pytest.approx(10.0)
    # float64 geometric steps (a power and a ratio each, ~1e-15): 1e-9 is room
    np.testing.assert_allclose(lrs[1:] / lrs[:-1], (1e7) ** (1 / 299), rtol=1e-9)
    # float32 min_lr·exp(log_ratio·s / last): log_ratio's rounding, the product and the division each
    # err by <= u·log_ratio in exp's argument (|arg| <= log_ratio = ln 1e7), passed on as relative
    # error; exp, min_lr's rounding and the product one rounding each
    schedule_rtol = rounding_rtol(3 * math.log(lrs[-1] / lrs[0]) + 3)
    for step in (0, 1, 150, 299):
        assert float(schedule(step)) == pytest.approx(lrs[step], rel=schedule_rtol)
    assert knobs.half_width == 9  # 0.2 decade at ~43 steps per decade


def test_muon_groups_keep_their_ratio_to_the_swept_lr(tiny_run):
    run = tiny_run("optimizer=muon")
    groups = lr_find.group_lrs_at(run, 1e-2)
    muon = run.optimizer.hparams
    assert groups["hidden"] == pytest.approx(1e-2)
    assert groups["embed"] == pytest.approx(1e-2 * muon.adam_lr / run.optimizer.schedule.lr)
    assert "head" not in groups  # tied embeddings: no head group to set


def test_rules_on_a_known_curve():
    # A smooth valley in log-lr with its minimum at lr 1e-2 and its steepest fall at 1e-3, plus noise.
    knobs = lr_find.LRFindConfig(min_lr=1e-5, max_lr=1.0, steps=200)
    lrs, x = knobs.lrs(), np.log10(knobs.lrs())
    curve = 3.0 - np.tanh((x + 3.0) * 1.5) + 0.3 * np.clip(x + 2.0, 0, None) ** 2 * 4
    noisy = curve + np.random.default_rng(0).normal(0, 0.05, len(curve))
    result = lr_find.suggest(lrs, noisy, knobs.half_width)
    assert 10 ** -2.2 < result["min_loss_lr"] < 10 ** -1.8
    assert result["suggested_lr"] == pytest.approx(result["min_loss_lr"] / 10)
    assert 10 ** -3.2 < result["steepest_lr"] < 10 ** -2.8
    assert result["notes"] == []
    # a straight line is kept as it is, ends included (no lag, no pull towards the middle)
    np.testing.assert_allclose(lr_find.local_linear(np.linspace(5, 2, 50), 6), np.linspace(5, 2, 50), atol=1e-9)


def test_a_loss_still_falling_at_max_lr_says_to_raise_it():
    knobs = lr_find.LRFindConfig(min_lr=1e-5, max_lr=1e-3, steps=50)
    result = lr_find.suggest(knobs.lrs(), np.linspace(5.5, 3.0, 50), knobs.half_width)
    assert result["min_loss_lr"] == pytest.approx(1e-3)
    assert any("raise lr_find.max_lr" in note for note in result["notes"])
