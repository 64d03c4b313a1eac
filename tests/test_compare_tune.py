"""tune=coordinate (compare/tune.py): the coordinate search on loss tables whose paths are worked
out by hand, against a brute-force argmin where coordinate descent must find it (an additive loss),
its knobs, and a whole comparison through scripts/compare.py with a stand-in trainer: the runs it
asks for, the report's path, a rerun, and a search continued after its last runs were lost."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from helpers import TINY_OVERRIDES, evaluated_steps, load_script

import train_jax as T
from compare.plan import compare_config
from compare.tune import Space, coordinate_path, start_value
from utils.errors import ConfigError

LRS, WDS = (1e-3, 2e-3, 4e-3, 8e-3), (0.0, 0.1, 0.2)
# loss[lr index][wd index]; from (2e-3, 0.1) the search walks: lr -> 4e-3, wd -> 0.0, lr -> 8e-3, then stops
TABLE = [[6.0, 5.0, 9.0],
         [5.0, 4.0, 4.5],
         [2.0, 3.0, 4.0],
         [1.5, 3.5, 6.0]]
SPACE = Space((("lr", LRS), ("weight_decay", WDS)), (2e-3, 0.1))


def table_loss(cell):
    return TABLE[LRS.index(cell[0])][WDS.index(cell[1])]


def test_the_search_follows_the_hand_worked_path_and_stops_when_a_round_moves_nothing():
    path = coordinate_path(SPACE, table_loss, threshold=1e-3)
    assert [(s.round, s.axis, s.after) for s in path.steps] == [
        (1, "lr", (4e-3, 0.1)), (1, "weight_decay", (4e-3, 0.0)),
        (2, "lr", (8e-3, 0.0)), (2, "weight_decay", (8e-3, 0.0)),
        (3, "lr", (8e-3, 0.0)), (3, "weight_decay", (8e-3, 0.0))]
    assert path.incumbent == (8e-3, 0.0) and path.todo == () and path.stop.startswith("converged")
    # the start, 3 more lrs, 2 wds, 3 lrs at wd 0, 1 wd at lr 8e-3: 10 of the grid's 12 settings
    assert path.trials == 10
    assert path.steps[0].tried == ((1e-3, 5.0), (2e-3, 4.0), (4e-3, 3.0), (8e-3, 3.5))


def test_a_move_must_beat_the_threshold():
    # 3.0 does not beat 4.0 by more than 1.2; nor does any wd at lr 2e-3 (5.0, 4.5): the start stands
    path = coordinate_path(SPACE, table_loss, threshold=1.2)
    assert path.incumbent == SPACE.start and path.trials == 6 and not any(s.moved for s in path.steps)


def test_the_trial_budget_cuts_an_axis_nearest_first_then_stops():
    path = coordinate_path(SPACE, table_loss, threshold=0.0, max_trials=5)
    # 4 lrs, then one wd of the two left: the nearer to 0.1 listed first (0.0); then no room for round 2
    assert [(s.axis, tuple(v for v, _ in s.tried)) for s in path.steps] == [("lr", LRS), ("weight_decay", (0.0, 0.1))]
    assert path.incumbent == (4e-3, 0.0) and path.trials == 5 and path.stop.startswith("trial budget spent")


def test_a_failed_setting_is_never_kept_and_a_failed_start_is_left():
    inf = {(2e-3, 0.1): math.inf, (8e-3, 0.1): math.inf}
    path = coordinate_path(SPACE, lambda c: inf.get(c, table_loss(c)), threshold=1e-3)
    assert path.steps[0].after == (4e-3, 0.1) and math.isfinite(table_loss(path.incumbent))
    everything_failed = coordinate_path(SPACE, lambda c: math.inf, threshold=0.0)
    assert everything_failed.incumbent == SPACE.start and everything_failed.stop.startswith("converged")


def test_the_replay_asks_for_each_axis_once_the_previous_one_is_in():
    known: dict = {}
    asked = []
    for _ in range(10):
        path = coordinate_path(SPACE, known.get, threshold=1e-3)
        if not path.todo:
            break
        asked.append(path.todo)
        known.update({c: table_loss(c) for c in path.todo})
    assert asked[0] == ((2e-3, 0.1), (1e-3, 0.1), (4e-3, 0.1), (8e-3, 0.1))  # nearest the start first
    assert asked[1] == ((4e-3, 0.0), (4e-3, 0.2))  # the wd axis at the new lr (its 0.1 is known)
    assert asked[2] == ((2e-3, 0.0), (8e-3, 0.0), (1e-3, 0.0))  # distance 1 both sides: the lower first
    assert asked[3] == ((8e-3, 0.2),)
    assert len(known) == path.trials == 10 and path.incumbent == (8e-3, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_on_an_additive_loss_the_search_finds_the_grids_best_setting(seed):
    """loss = a[i] + b[j] + c[k]: each axis's best value does not depend on the others, so one
    round reaches the grid's argmin (brute force) and the next moves nothing."""
    rng = np.random.default_rng(seed)
    axes = (("lr", (1.0, 2.0, 3.0, 4.0, 5.0)), ("b1", (0.8, 0.9, 0.95)), ("wd", (0.0, 0.1)))
    parts = [dict(zip(values, rng.normal(size=len(values)))) for _, values in axes]
    loss = lambda cell: sum(p[v] for p, v in zip(parts, cell))
    space = Space(axes, tuple(values[rng.integers(len(values))] for _, values in axes))
    path = coordinate_path(space, loss, threshold=0.0)
    grid = [(a, b, c) for a in axes[0][1] for b in axes[1][1] for c in axes[2][1]]
    assert path.incumbent == min(grid, key=loss)
    # round 1 varies each axis once, moving to its best; round 2 varies each axis around the argmin
    best = [min(values, key=p.get) for p, (_, values) in zip(parts, axes)]
    cells, incumbent = set(), list(space.start)
    for i, (_, values) in enumerate(axes):  # round 1: each axis at the incumbent, which takes its best
        cells |= {(*incumbent[:i], v, *incumbent[i + 1:]) for v in values}
        incumbent[i] = best[i]
    for i, (_, values) in enumerate(axes):  # round 2: each axis around the argmin
        cells |= {(*best[:i], v, *best[i + 1:]) for v in values}
    assert path.trials == len(cells)
    assert max(s.round for s in path.steps) == 2 and not any(s.moved for s in path.steps if s.round == 2)


def test_the_search_starts_at_the_optimizers_own_values():
    assert start_value((1.5e-3, 3e-3, 6e-3), 3e-3) == 3e-3
    assert start_value((1e-3, 1e-2), 3e-3) == 1e-2  # not listed: the middle (index len//2)
    assert start_value((0.0, 0.1, 0.2), 0.1) == 0.1 and start_value((0.0, 0.2), 0.1) == 0.2
    assert start_value((True, False), False) is False


KNOBS = {"optimizers": ["adamw"], "budgets": [10], "warmup": 2, "tune": "coordinate"}


@pytest.mark.parametrize("change, knob", [
    ({"tune": "random"}, "tune='random'"),
    ({"lr": {"extend": True}}, "lr.extend=true and tune=coordinate"),
    ({"coordinate": {"threshold": -0.1}}, "coordinate.threshold=-0.1"),
    ({"coordinate": {"max_trials": 0}}, "coordinate.max_trials=0"),
    ({"coordinate": {"rounds": 3}}, "coordinate.rounds"),
])
def test_bad_tune_knobs_are_one_line(change, knob):
    with pytest.raises(ConfigError) as e:
        compare_config({**KNOBS, **change})
    assert knob in str(e.value) and "\n" not in str(e.value)


RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size")))
TRAINED: list[str] = []


def fake_train(cfg, run_dir):
    """train_jax.train's stand-in: val/loss = 3 + (log10(lr) + 2.5)² + 0.1·weight_decay + 1/step."""
    TRAINED.append(os.path.basename(run_dir))
    lr, wd = float(cfg.optimizer.lr_config.lr), float(cfg.optimizer.weight_decay)
    start = int(cfg.checkpoint.load_file.split("_")[1]) if cfg.checkpoint.load else 0
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in evaluated_steps(cfg.train, start):
            f.write(json.dumps({"step": step, "val/loss": 3 + (math.log10(lr) + 2.5) ** 2 + 0.1 * wd + 1 / step,
                                "data/tokens": step * 64, "data/fingerprint": "fp",
                                "time/elapsed_sec": step * 0.01}) + "\n")


def test_a_coordinate_comparison_runs_the_search_reports_its_path_and_continues(tmp_path, monkeypatch, capsys):
    """adamw from its yaml (lr 3e-3, weight_decay 0.1): the lrs 1.5e-3/3e-3/6e-3 keep 3e-3; weight
    decay 0 wins (0.01 lower); round 2 tries the other lrs at weight decay 0 and keeps all: 7 of the
    grid's 9 settings, a trunk and a branch each."""
    script = load_script("compare")
    monkeypatch.setattr(T, "train", fake_train)
    argv = ["optimizers=[adamw]", "budgets=[10]", "lr.points=3", "warmup=2", "tune=coordinate",
            "sweep.weight_decay=[0.0,0.1,0.2]", *RUN, f"dir={tmp_path}"]
    TRAINED.clear()
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "tune=coordinate: one knob at a time" in out
    assert [line for line in out.splitlines() if "more runs (the next knob" in line] == [
        "compare: tune=coordinate: 4 more runs (the next knob's settings)",
        "compare: tune=coordinate: 4 more runs (the next knob's settings)"]
    cells = {(r.split("__")[2], r.split("__")[3]) for r in os.listdir(tmp_path / "runs")}
    assert cells == {("lr0.0015", "weight_decay0.1"), ("lr0.003", "weight_decay0.1"), ("lr0.006", "weight_decay0.1"),
                     ("lr0.003", "weight_decay0"), ("lr0.003", "weight_decay0.2"),
                     ("lr0.0015", "weight_decay0"), ("lr0.006", "weight_decay0")}
    assert len(TRAINED) == 14
    summary = json.loads((tmp_path / "summary.json").read_text())["workloads"]["default"]["optimizers"]["adamw"]
    assert summary["trials"] == 7 and summary["best_lr"] == 3e-3 and summary["best_setting"] == {"weight_decay": 0.0}
    search = summary["search"]
    assert search["trials"] == 7 and search["incumbent"] == [3e-3, 0.0] and search["stop"].startswith("converged")
    assert [(s["round"], s["knob"], s["after"]) for s in search["steps"]] == [
        (1, "lr", [3e-3, 0.1]), (1, "weight_decay", [3e-3, 0.0]), (2, "lr", [3e-3, 0.0]),
        (2, "weight_decay", [3e-3, 0.0])]
    expect = lambda lr, wd: 3 + (math.log10(lr) + 2.5) ** 2 + 0.1 * wd + 1 / 10
    # the stand-in's float64 formula, one seed (the mean is the value), read back from JSON: 1e-12 is far above it
    assert search["steps"][1]["tried"] == [[0.0, pytest.approx(expect(3e-3, 0.0), rel=1e-12)],
                                           [0.1, pytest.approx(expect(3e-3, 0.1), rel=1e-12)],
                                           [0.2, pytest.approx(expect(3e-3, 0.2), rel=1e-12)]]
    md = (tmp_path / "report.md").read_text()
    path = md.split("## Tuning path (tune=coordinate)")[1].split("\n## ")[0]
    assert f"| adamw | 1 | weight_decay | 0: {expect(3e-3, 0.0):.4f} (*), 0.1: {expect(3e-3, 0.1):.4f}," in path
    assert "adamw: 7 settings tried; converged" in path and "setting: lr=0.003, weight_decay=0." in path

    TRAINED.clear()  # a rerun trains nothing and asks for nothing new
    with monkeypatch.context() as mp:
        mp.setattr(script, "build_report", lambda d: None)
        assert script.main(argv) == 0
    assert TRAINED == [] and "more runs" not in capsys.readouterr().out  # the replay finds every result
    for run in os.listdir(tmp_path / "runs"):  # the last round's runs are lost: a rerun trains them again
        if run.split("__")[2] in ("lr0.0015", "lr0.006") and run.split("__")[3] == "weight_decay0":
            shutil.rmtree(tmp_path / "runs" / run)
    assert script.main(argv) == 0
    assert sorted(TRAINED) == sorted(r for r in os.listdir(tmp_path / "runs") if r.split("__")[3] == "weight_decay0"
                                     and r.split("__")[2] != "lr0.003")
    assert json.loads((tmp_path / "summary.json").read_text())["workloads"]["default"]["optimizers"]["adamw"][
        "search"] == search
