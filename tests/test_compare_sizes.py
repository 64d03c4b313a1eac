"""A model-size ladder (compare/sizes.py) on synthetic comparison directories (tests/test_compare_report.py's
make_comparison): two workloads of known parameter counts on which muon is exactly C times as data-efficient
as AdamW, C differing by size, so the speedup per size, the slope of its trend per 10x parameters and the
best lr's exponent are known in closed form."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import test_compare_report as tcr

from compare import sizes
from compare.report import build_report

SIZES = {"small": (1_000_000, 4.0, 2e-3), "large": (10_000_000, 2.0, 1e-3)}  # params, C, both optimizers' best lr
LRS = (5e-4, 1e-3, 2e-3, 4e-3)


def _with_params(root: Path, workload: str, params: int) -> None:
    """Add `model/params` to the first record of each of the workload's runs, as train_jax logs it."""
    for metrics in (root / "runs").glob(f"{workload}-*/metrics.jsonl"):
        lines = metrics.read_text().splitlines()
        if lines:
            first = {**json.loads(lines[0]), sizes.PARAMS: params}
            metrics.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


def make_ladder(root: Path, monkeypatch) -> str:
    """Per size, muon's loss at budget S is AdamW's at C·S (C = 4 small, 2 large: the crossings of AdamW's
    loss at 400 fall on the budgets 100 and 200, exactly), both at the size's best lr."""
    base = tcr.base_loss
    for name, (params, c, best) in SIZES.items():
        monkeypatch.setitem(tcr.OPTS, "adamw", (LRS, best, *tcr.OPTS["adamw"][2:]))
        faster = lambda opt, lr, seed, step, c=c: base("adamw", lr, seed, step * (c if opt == "muon" else 1))
        monkeypatch.setattr(tcr, "base_loss", faster)
        tcr.make_comparison(root, workload=name, opts={"adamw": tcr.OPTS["adamw"], "muon": tcr.OPTS["adamw"]},
                            diverged=(), failed_trunk=())
        _with_params(root, name, params)
    monkeypatch.setattr(tcr, "base_loss", base)
    return Path(build_report(str(root))).read_text()


def test_speedup_against_size_its_trend_and_the_best_lrs_exponent(tmp_path, monkeypatch):
    md = make_ladder(tmp_path, monkeypatch)
    summary = json.loads((tmp_path / "summary.json").read_text())["sizes"]
    assert summary["params"] == {"small": 1_000_000, "large": 10_000_000} and summary["reference"] == "adamw"
    muon = summary["optimizers"]["muon"]["time_to_target_speedup"]
    # AdamW's loss at 400 is muon's at 400 / C, a budget: the speedup is C, read where the loss reaches the target
    # raised by ladder.REACH_RTOL (1e-9 relative, ~2e-9 in loss): that moves the log-linear crossing by ~2e-9 over
    # the loss's drop between budgets (~0.07) times log 2, ~3e-8 relative; RTOL = 1e-6 leaves a 30x margin
    RTOL = 1e-6
    for name, (_, c, _) in SIZES.items():
        assert muon["per_size"][name]["value"] == pytest.approx(c, rel=RTOL) and muon["per_size"][name]["flag"] == ""
    # two sizes a decade apart: the slope is the speedup's change, (2 - 4) / (7 - 6) = -2 per 10x parameters; the
    # seeds' offsets cancel in every resample (they are the same at every budget), so the interval is the slope
    # (the slope and intercept combine the two speedups' errors, RTOL·C each: within 4·RTOL relative of 2 and 16)
    assert muon["slope"] == pytest.approx(-2.0, rel=4 * RTOL) and muon["intercept"] == pytest.approx(16.0, rel=4 * RTOL)
    iv = muon["slope_interval"]
    # every resample's slope is the point's, each end within the point's 4·RTOL (above)
    assert iv["low"] == pytest.approx(-2.0, rel=4 * RTOL) and iv["high"] == pytest.approx(-2.0, rel=4 * RTOL)
    # D_eff/D at 400: C·400 is past AdamW's largest budget (a lower bound, no fit from 3 budgets): no trend
    deff = summary["optimizers"]["muon"]["d_eff_over_d"]
    assert {v["flag"] for v in deff["per_size"].values()} == {">"} and deff["slope"] is None
    # the best lr halves over a decade of parameters: lr ∝ N^e with e = log10(1/2)
    for o in ("adamw", "muon"):
        assert summary["optimizers"][o]["best_lr"] == {"small": 2e-3, "large": 1e-3}
        # log10 of exact grid lrs and params in float64: ~1e-16 relative each; 1e-12 is far above it
        assert summary["optimizers"][o]["lr_exponent"] == pytest.approx(math.log10(0.5), rel=1e-12)
    section = md.split("## Across model sizes")[1]
    assert "| optimizer | speedup | small (1M) | large (10M) | slope per 10× params |" in section
    assert "| muon | time-to-target speedup | 4.000 [4.000, 4.000] | 2.000 [2.000, 2.000] | -2.000 [-2.000, -2.000] |" \
        in section
    assert "| adamw | 0.002 | 0.001 | -0.301 |" in section
    assert (tmp_path / "speedup_vs_size.png").stat().st_size > 0


def test_the_trend_is_the_least_squares_line_in_log_parameters():
    """Three sizes: the closed-form least squares (slope = Σ(x-x̄)(y-ȳ) / Σ(x-x̄)²), and a resample
    with a bound in it has no slope (counted as without one)."""
    params, ys = [1e6, 4e6, 3e7], [1.5, 1.3, 1.05]
    x = np.log10(params)
    b = float(np.sum((x - x.mean()) * (np.array(ys) - np.mean(ys))) / np.sum((x - x.mean()) ** 2))
    draws = [[(y, ""), (y, ""), (y, "≥")] for y in ys]  # the third resample of every size is a bound
    t = sizes.trend(params, [(y, "") for y in ys], draws)
    # float64 least squares on 3 points of order 1: rounding ~1e-16 × condition (~10): 1e-12 is far above it
    assert t["slope"] == pytest.approx(b, rel=1e-12) and t["intercept"] == pytest.approx(np.mean(ys) - b * x.mean(),
                                                                                        rel=1e-12)
    assert t["slope_interval"][4] == 1  # the bound's resample: no slope
    assert sizes.trend(params, [(ys[0], ""), (ys[1], "≥"), (ys[2], "")], draws) is None
    assert sizes.trend([1e6, 1e6], [(1.0, ""), (2.0, "")], []) is None  # one size: no line


def test_workloads_without_parameter_counts_or_of_one_size_are_no_ladder():
    run = lambda params: SimpleNamespace(records=[{"step": 10, **({sizes.PARAMS: params} if params else {})}])
    workload = lambda name, *counts: SimpleNamespace(name=name, runs=[run(c) for c in counts], reference="adamw",
                                                     optimizers=["adamw"], best={"adamw": 1e-3})
    assert sizes.ladder_of([workload("a", None), workload("b", 2_000)]) is None  # a size not logged
    assert sizes.ladder_of([workload("a", 1_000, 1_000), workload("b", 1_000)]) is None  # one size
    assert sizes.workload_params(workload("a", 1_000, 3_000, 2_000)) == 2_000  # the median
    lad = sizes.ladder_of([workload("b", 2_000), workload("a", 1_000)])
    assert lad["workloads"] == [("a", 1_000), ("b", 2_000)]  # ordered by size


def _with_overrides(root: Path, workload: str, *overrides: str) -> None:
    """Add run overrides to each of the workload's run.json, as a workload's `model.mup=true` puts them there."""
    for info_path in (root / "runs").glob(f"{workload}-*/run.json"):
        info = json.loads(info_path.read_text())
        info_path.write_text(json.dumps({**info, "overrides": [*info["overrides"], *overrides]}))


def test_a_width_ladder_run_with_and_without_mup_is_two_ladders_side_by_side(tmp_path, monkeypatch):
    """Four workloads, two sizes each way: under SP both optimizers' best lr halves over a decade of
    parameters (e = log10 1/2), under muP it stays (e = 0). Mixed into one ladder, two workloads of one
    size would make one fit of both; split by each run's model.mup, each ladder has its own exponent,
    and a table sets them side by side."""
    best = {"sp_small": (1_000_000, 2e-3), "sp_large": (10_000_000, 1e-3),
            "mup_small": (1_000_000, 2e-3), "mup_large": (10_000_000, 2e-3)}
    adamw = tcr.OPTS["adamw"]
    for name, (params, lr) in best.items():
        for o in ("adamw", "muon"):  # both optimizers' losses are adamw's curve at the workload's best lr
            monkeypatch.setitem(tcr.OPTS, o, (LRS, lr, *adamw[2:]))
        tcr.make_comparison(tmp_path, workload=name, opts={o: tcr.OPTS[o] for o in ("adamw", "muon")},
                            diverged=(), failed_trunk=())
        _with_params(tmp_path, name, params)
        if name.startswith("mup"):
            _with_overrides(tmp_path, name, "model.dim=64", "model.mup=true")
    md = Path(build_report(str(tmp_path))).read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sizes"]["params"] == {"sp_small": 1_000_000, "sp_large": 10_000_000}
    assert summary["sizes_mup"]["params"] == {"mup_small": 1_000_000, "mup_large": 10_000_000}
    for o in ("adamw", "muon"):
        # log10 of exact grid lrs and params in float64: ~1e-16 relative each; 1e-12 is far above it
        assert summary["sizes"]["optimizers"][o]["lr_exponent"] == pytest.approx(math.log10(0.5), rel=1e-12)
        # equal lrs: the fit's slope is 0 up to float64 rounding of log10 values ~1e-16 × ~10; 1e-12 is far above it
        assert summary["sizes_mup"]["optimizers"][o]["lr_exponent"] == pytest.approx(0.0, abs=1e-12)
    assert "## Across model sizes (SP)" in md and "## Across model sizes (muP)" in md
    side_by_side = md.split("### The lr's transfer, per parametrisation")[1]
    assert "| optimizer | e (SP) | e (muP) |" in side_by_side and "| adamw | -0.301 | +0.000 |" in side_by_side
    assert (tmp_path / "speedup_vs_size.png").stat().st_size > 0 and (tmp_path / "speedup_vs_size_mup.png").is_file()


def test_a_workloads_parametrisation_is_its_runs_last_word_on_model_mup():
    run = lambda *overrides: SimpleNamespace(info={"overrides": list(overrides)})
    w = lambda *runs: SimpleNamespace(runs=list(runs))
    assert sizes.parametrisation(w(run("model.dim=64"))) == "SP"
    assert sizes.parametrisation(w(run("model.mup=true"))) == "muP"
    assert sizes.parametrisation(w(run("model.mup=true", "model.mup=false"))) == "SP"
    assert sizes.parametrisation(w(run("++model.mup=True"))) == "muP"
