"""The target track (target.loss, target.runs: modded-nanogpt's protocol) through scripts/compare.py with a
stand-in trainer whose val/loss curves are known: the runs it adds, each run's steps to the target read
back from its metrics by this file's own code, and the tests against scipy's."""

import json
import math
import os

import numpy as np
import pytest
from helpers import TINY_OVERRIDES, evaluated_steps, load_script
from scipy import stats as sps

import train_jax as T
from compare.plan import compare_config
from utils.errors import ConfigError

RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size")))
SPEED = {"adamw": 10.0, "sgdm": 6.0}  # val/loss = 3 + SPEED/step + 0.01·seed: sgdm reaches a loss sooner
TARGET = 3.8


def fake_train(cfg, run_dir):
    opt, seed = cfg.optimizer.name, int(cfg.random_seed)
    start = int(cfg.checkpoint.load_file.split("_")[1]) if cfg.checkpoint.load else 0
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in evaluated_steps(cfg.train, start):
            f.write(json.dumps({"step": step, "val/loss": 3 + SPEED[opt] / step + 0.01 * seed, "data/tokens": step * 64,
                                "data/fingerprint": "fp", "time/elapsed_sec": step * 0.01}) + "\n")


def curve(root, run_id):
    """(steps, val/losses) of a branch: its trunk's evaluations up to the branch step, then its own."""
    info = json.loads((root / "runs" / run_id / "run.json").read_text())
    read = lambda rid: [json.loads(line) for line in (root / "runs" / rid / "metrics.jsonl").read_text().splitlines()]
    points = [(r["step"], r["val/loss"]) for r in read(info["trunk"]) if r["step"] <= info["branch_step"]]
    points += [(r["step"], r["val/loss"]) for r in read(run_id) if r["step"] > info["branch_step"]]
    return zip(*sorted(dict(points).items()))


def first_reach(steps, losses, target):
    for i, (s, x) in enumerate(zip(steps, losses)):
        if x <= target:
            if i == 0:
                return s
            f = (losses[i - 1] - target) / (losses[i - 1] - x)
            return steps[i - 1] + f * (s - steps[i - 1])
    return math.inf


@pytest.mark.slow  # 7 s: 18 runs and a report
def test_the_target_track_runs_fresh_seeds_and_tests_steps_and_final_loss(tmp_path, monkeypatch, capsys):
    script = load_script("compare")
    monkeypatch.setattr(T, "train", fake_train)
    argv = ["optimizers=[adamw,sgdm]", "budgets=[10,20]", "lr.points=1", "warmup=2", "val_every=2",
            f"target.loss={TARGET}", "target.runs=3", *RUN, f"dir={tmp_path}"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "compare: target: 12 runs (each optimizer's setting chosen at the largest budget, on seeds 1..3)" in out
    recorded = json.loads((tmp_path / "compare.json").read_text())["target"]
    assert recorded["seeds"] == [1, 2, 3] and {c["budget"] for c in recorded["chosen"]} == {20}
    ids = sorted(r["id"] for r in recorded["runs"])
    assert ids[0] == "default__adamw__lr0.003__target1__S20" and len(ids) == 2 * 3 * 2  # a trunk and a branch each
    summary = json.loads((tmp_path / "summary.json").read_text())["workloads"]["default"]["optimizers"]
    steps = {}
    for opt in SPEED:
        track = summary[opt]["target_track"]
        expect = [first_reach(*map(list, curve(tmp_path, f"default__{opt}__lr{track['lr']:g}__target{s}__S20")), TARGET)
                  for s in (1, 2, 3)]
        # the same interpolation of the same float64 numbers: equal to rounding (1e-12 relative is far above it)
        assert track["steps"] == pytest.approx(expect, rel=1e-12) and track["reached"] == track["n"] == 3
        steps[opt] = expect
        finals = [3 + SPEED[opt] / 20 + 0.01 * s for s in (1, 2, 3)]
        # the same float64 formula the stand-in logged, read back from JSON exactly: 1e-12 is far above rounding
        assert track["final"] == pytest.approx(finals, rel=1e-12)
        p = sps.ttest_1samp(finals, TARGET, alternative="less").pvalue
        assert track["below"] == pytest.approx(p, rel=1e-9)  # scipy's t cdf and ours: the same special function
    diff = summary["sgdm"]["target_track"]["steps_diff"]
    welch = sps.ttest_ind(steps["sgdm"], steps["adamw"], equal_var=False, alternative="less")
    # a difference of float64 means of 3 numbers ~10: ~1e-15 relative; 1e-12 is far above it. The p-values are
    # scipy's t cdf both sides, at float64 (the special function's own error ~1e-14): 1e-9 leaves room
    assert diff["mean"] == pytest.approx(np.mean(steps["sgdm"]) - np.mean(steps["adamw"]), rel=1e-12)
    assert diff["p_fewer"] == pytest.approx(welch.pvalue, rel=1e-9) and diff["p_fewer"] < 0.01  # (see above)
    assert summary["adamw"]["target_track"]["steps_diff"] is None  # the baseline
    md = (tmp_path / "report.md").read_text()
    section = md.split(f"## Target track (target.loss={TARGET:g}, target.runs=3)")[1].split("\n## ")[0]
    assert "| sgdm | " in section and f"p={diff['p_fewer']:.3g}" in section
    # the tuning tables read only the tuning seed: adamw's best-lr table counts one seed per budget
    assert summary["adamw"]["at_best"]["20"]["n"] == 1


@pytest.mark.parametrize("target, message", [
    ({"loss": 3.0}, "target.loss=3.0 and target.runs=0: the target track needs both"),
    ({"runs": 4}, "target.loss=None and target.runs=4"),
    ({"loss": 3.0, "runs": 1}, "target.runs=1: the target track's tests need at least 2"),
    ({"loss": -1.0, "runs": 3}, "target.loss=-1.0 must be a positive val/loss"),
    ({"loss": 3.0, "runs": 3, "steps": 5}, "target.steps"),
])
def test_bad_target_knobs_are_one_line(target, message):
    with pytest.raises(ConfigError) as e:
        compare_config({"optimizers": ["adamw"], "budgets": [10], "warmup": 2, "target": target})
    assert message in str(e.value) and "\n" not in str(e.value)
