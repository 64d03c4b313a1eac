"""A comparison ranked by a downstream task's accuracy (metric=eval/<task>/acc_norm; compare/metric.py):
the best lr, the tables and results.csv against a recomputation from the runs' metrics.jsonl, the
sections a loss-shaped fit needs left out with their reason, and the knob's one-line refusals."""

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_OVERRIDES, load_script

from compare.plan import base_lrs, compare_config, make_plan, run_json
from compare.report import build_report
from utils.errors import ConfigError

RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
    "logging.log_every=1", "train.max_val_steps=2")
GRID = [0.001, 0.003, 0.006]
ACC = "eval/t/acc_norm"
TASK_LINES = [{"context": "the cat sat on the", "choices": [" mat", " sky"], "gold": 0},
              {"context": "one two three", "choices": [" four", " nine"], "gold": 0},
              {"context": "up and", "choices": [" sideways", " down"], "gold": 1},
              {"context": "salt and", "choices": [" pepper", " glue"], "gold": 0}]


def task_file(folder: Path) -> str:
    path = folder / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TASK_LINES))
    return str(path)


def fake_metrics(opt: str, lr: float, steps: list[int]) -> list[dict]:
    """Two metrics that disagree: val/loss lowest at lr 10^-2.5 (the grid's 0.003), acc_norm highest at
    10^-2.2 (its 0.006); sgdm's val/loss worse than adamw's by 0.05, its accuracy better by 0.1."""
    out = []
    for step in steps:
        loss = 3 + (math.log10(lr) + 2.5) ** 2 + 1 / step + (0.05 if opt == "sgdm" else 0.0)
        acc = 0.8 - (math.log10(lr) + 2.2) ** 2 - 1 / step + (0.1 if opt == "sgdm" else 0.0)
        out.append({"step": step, "val/loss": loss, ACC: acc, "eval/t/acc": acc - 0.05, "data/tokens": step * 64,
                    "data/fingerprint": "fp", "time/elapsed_sec": step * 0.01})
    return out


def write_comparison(root: Path, metric: str) -> Path:
    """The directory scripts/compare.py would leave (compare.json from make_plan, a run.json and
    metrics.jsonl per run), every run done, its metrics from fake_metrics at its evaluations."""
    k = compare_config({"optimizers": ["adamw", "sgdm"], "budgets": [10, 20], "lr": {"points": 3, "grid": {
        "adamw": GRID, "sgdm": GRID}}, "seeds": 2, "warmup": 2, "metric": metric})
    plan = make_plan(k, RUN + (f"eval.tasks=[{root}/t.jsonl]",), {"adamw": 1e-3, "sgdm": 1e-3})
    root.mkdir(parents=True)
    (root / "compare.json").write_text(json.dumps(plan.to_json()))
    for run in plan.runs:
        d = root / "runs" / run.id
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({**run_json(run), "status": "done", "diverged": False}))
        end = run.budget or k.branch_step(20)
        steps = [s for s in (*range(5, end + 1, 5), run.branch_step or 0, end) if s > (run.branch_step or 0)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                fake_metrics(run.optimizer, run.lr, sorted(set(steps)))))
    return root


def final_values(root: Path, key: str) -> dict[tuple[str, float], list[float]]:
    """(optimizer, lr) -> the last `key` each branch of the largest budget logged, read from disk alone."""
    out: dict[tuple[str, float], list[float]] = {}
    largest = max(int(json.loads(p.read_text())["budget"] or 0) for p in root.glob("runs/*/run.json"))
    for info_path in sorted(root.glob("runs/*/run.json")):
        info = json.loads(info_path.read_text())
        if info["kind"] != "branch" or info["budget"] != largest:
            continue
        records = [json.loads(line) for line in (info_path.parent / "metrics.jsonl").read_text().splitlines()]
        out.setdefault((info["optimizer"], float(info["lr"])), []).append([r[key] for r in records if key in r][-1])
    return out


@pytest.fixture(scope="module")
def ranked_by_accuracy(tmp_path_factory):
    return write_comparison(tmp_path_factory.mktemp("metric") / "c", ACC)


@pytest.mark.slow  # build_report draws its PNGs: 3 s with matplotlib's first import (14 s under heavy load)
def test_the_best_lr_and_the_tables_follow_the_tasks_accuracy(ranked_by_accuracy):
    """The best lr is the argmax of the mean final acc_norm (recomputed from metrics.jsonl), not val/loss's;
    the printed result is 1 − acc; D_eff is left out with its reason; results.csv keeps both."""
    root = ranked_by_accuracy
    md = Path(build_report(str(root))).read_text()
    summary = json.loads((root / "summary.json").read_text())["workloads"]["default"]
    accs = final_values(root, ACC)
    for opt in ("adamw", "sgdm"):
        means = {lr: float(np.mean(accs[(opt, lr)])) for lr in GRID}
        best = max(GRID, key=lambda lr: (means[lr], -lr))  # ties: the smaller lr, as the report breaks them
        assert best == 0.006 and summary["optimizers"][opt]["best_lr"] == best
        # both sides: the mean of 2 float64 values, then 1 − it: ~3 roundings each of O(1) numbers, so
        # float64 eps 2.2e-16 × 6 roundings × margin 10 ≈ 1e-14
        assert summary["optimizers"][opt]["at_best"]["20"]["mean"] == pytest.approx(1 - means[best], abs=1e-14)
    assert "Metric: `eval/t/acc_norm`" in md and "Final 1 − eval/t/acc_norm at the best lr" in md
    assert "Left out: D_eff fits a loss's shape" in md and "d_eff_fit" not in summary
    assert json.loads((root / "summary.json").read_text())["metric"]["name"] == ACC
    rows = {r["id"]: r for r in csv.DictReader(open(root / "results.csv"))}
    branch = next(r for r in rows.values() if r["kind"] == "branch" and r["budget"] == "20")
    records = [json.loads(line) for line in (root / "runs" / branch["id"] / "metrics.jsonl").read_text().splitlines()]
    # csv's %r of a float64 round-trips exactly
    assert float(branch["final_metric"]) == records[-1][ACC]
    assert float(branch["final_val_loss"]) == records[-1]["val/loss"]


@pytest.mark.slow  # build_report: 1 s after another report, 3 s with matplotlib's first import
def test_the_same_runs_ranked_by_val_loss_choose_val_losss_lr(ranked_by_accuracy, tmp_path):
    """The report is a function of the directory: the same runs with metric=val/loss in compare.json
    choose val/loss's optimum, 0.003, and keep the D_eff section."""
    copy = tmp_path / "c"
    copy.mkdir()
    os.symlink(ranked_by_accuracy / "runs", copy / "runs")
    recorded = json.loads((ranked_by_accuracy / "compare.json").read_text())
    recorded["knobs"]["metric"] = "val/loss"
    (copy / "compare.json").write_text(json.dumps(recorded))
    md = Path(build_report(str(copy))).read_text()
    summary = json.loads((copy / "summary.json").read_text())["workloads"]["default"]
    losses = final_values(copy, "val/loss")
    for opt in ("adamw", "sgdm"):
        best = min(GRID, key=lambda lr: (float(np.mean(losses[(opt, lr)])), lr))
        assert best == 0.003 and summary["optimizers"][opt]["best_lr"] == best
    assert "Metric:" not in md and "Left out: D_eff" not in md


@pytest.mark.parametrize("knobs, run, message", [
    ({"metric": "eval/t/f1"}, (), r"metric='eval/t/f1' must be val/loss or a task's accuracy eval/<task>/acc"),
    ({"metric": ACC}, (), r"metric=eval/t/acc_norm needs the task 't' scored: add the run override "
                          r"eval.tasks=\[<dir>/t.jsonl\] \(its tasks now: none\)"),
    ({"metric": ACC}, ("eval.tasks=[data/u.jsonl]",), r"\(its tasks now: \['u'\]\)"),
    ({"metric": ACC, "target": {"loss": 3.0, "runs": 2}}, (), r"target.loss=3.0 with metric=eval/t/acc_norm: the "
                                                               r"target track reads val/loss curves"),
])
def test_metric_refusals_are_one_line(knobs, run, message):
    with pytest.raises(ConfigError, match=message) as e:
        k = compare_config({"optimizers": ["adamw"], "budgets": [10], "warmup": 2, **knobs})
        make_plan(k, RUN + run, base_lrs(k.optimizers, RUN))
    assert "\n" not in str(e.value)


def test_a_task_named_among_the_runs_overrides_plans():
    k = compare_config({"optimizers": ["adamw"], "budgets": [10], "warmup": 2, "metric": ACC, "lr": {"points": 1}})
    plan = make_plan(k, RUN + ("eval.tasks=[some/dir/t.jsonl]",), base_lrs(k.optimizers, RUN))
    assert plan.to_json()["knobs"]["metric"] == ACC and len(plan.runs) == 2


@pytest.mark.slow  # four tiny trainings through scripts/compare.py, then the report
def test_a_tiny_comparison_trained_with_a_task_file_ranks_by_its_accuracy(tmp_path, monkeypatch):
    """Real runs score the task file at their evaluations (eval.tasks): the report's best lr is the
    argmax of the final acc_norm the branches logged (ties: the smaller lr) and its table prints 1 − it."""
    script = load_script("compare")
    monkeypatch.setattr(script, "build_report", lambda d: None)
    root = tmp_path / "c"
    argv = ["optimizers=[adamw]", "budgets=[10]", "lr.points=2", "lr.factor=8", "seeds=1", "warmup=2",
            f"metric={ACC}", f"eval.tasks=[{task_file(tmp_path)}]", *RUN, f"dir={root}"]
    assert script.main(argv) == 0
    summary_md = Path(build_report(str(root))).read_text()
    accs = final_values(root, ACC)
    assert len(accs) == 2 and all(len(v) == 1 for v in accs.values())
    best = max(accs, key=lambda k: (accs[k][0], -k[1]))[1]
    summary = json.loads((root / "summary.json").read_text())["workloads"]["default"]["optimizers"]["adamw"]
    assert summary["best_lr"] == best  # the same float64 lr: run.json and summary.json round-trip it exactly
    # acc_norm over 4 examples is k/4, exact in binary; 1 − it is exact too
    assert summary["at_best"]["10"]["mean"] == 1 - accs[("adamw", best)][0]
    assert "Final 1 − eval/t/acc_norm at the best lr" in summary_md
