"""Completeness: the report checks every run of compare.json's plan, so a deleted run directory,
metrics.jsonl or trunk is listed as missing and left out of the means (n=k of N), never counted
as a divergence (∞) nor read as a truncated curve. Synthetic directories of test_compare_report."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import tests.test_compare_report as tcr
from compare.report import build_report


def expected(runs: dict, gone: set[str]) -> tuple[dict, dict, dict]:
    """From the runs as written (before any deletion), recomputed by test_compare_report's helpers:
    ((optimizer, lr, budget) -> losses without the runs in `gone`, -> planned seeds, optimizer -> best lr)."""
    losses: dict[tuple, list[float]] = {}
    planned: dict[tuple, int] = {}
    for r in sorted((r for r in runs.values() if r["kind"] == "branch"), key=lambda r: (r["seed"], r["id"])):
        key = (r["optimizer"], r["lr"], r["budget"])
        planned[key] = planned.get(key, 0) + 1
        loss = tcr.result(r, runs)
        if loss is not None and r["id"] not in gone:
            losses.setdefault(key, []).append(loss)
    top = max(b for _, _, b in planned)
    mean = lambda v: math.inf if any(math.isinf(x) for x in v) else float(np.mean(v))
    best = {o: min(tcr.OPTS[o][0], key=lambda lr, o=o: (mean(losses.get((o, lr, top), [math.inf])), lr))
            for o in tcr.OPTS}
    return losses, planned, best


def cell_matches(cell: str, values: list[float], planned: int) -> bool:
    """A printed mean cell: mean ± std of `values`, "(n=k of N)" exactly when k < N."""
    suffix = f" (n={len(values)} of {planned})" if len(values) < planned else ""
    if not cell.endswith(suffix) or (not suffix and "(n=" in cell):
        return False
    return tcr.loss_cell(cell[:len(cell) - len(suffix)] if suffix else cell, values)


def report_after(root: Path, delete) -> tuple[dict, str, dict]:
    tcr.make_comparison(root)
    runs = tcr.read(root)
    gone = delete(root, runs)
    md = Path(build_report(str(root))).read_text()
    return runs, md, {"gone": gone}


def check(root: Path, runs: dict, md: str, gone: set[str]) -> None:
    losses, planned, best = expected(runs, gone)
    top = max(b for _, _, b in planned)
    t = tcr.tables(md)
    summary = t["Results per optimizer"]
    budgets = [int(h[2:]) for h in summary[0][5:]]
    for row in summary[1:]:
        o = row[0]
        assert tcr.close(row[1], best[o]), (o, row[1], best[o])
        # failed and diverged are what the run.json files on disk say: a deletion adds neither
        on_disk = [r for r in runs.values() if r["optimizer"] == o and r["id"] not in gone]
        assert [int(c) for c in row[3:5]] == [sum(r["status"] == "failed" for r in on_disk),
                                              sum(bool(r["diverged"]) for r in on_disk)], (o, row)
        for cell, b in zip(row[5:], budgets):
            key = (o, best[o], b)
            assert cell_matches(cell, losses[key], planned[key]), (key, cell)
    for o, lr, n, cell in t["LR sensitivity"][1:]:
        key = (o, float(lr), top)
        assert int(n) == len(losses.get(key, [])) and cell_matches(cell, losses.get(key, []), planned[key]), (key, cell)
    # the completeness table lists each missing run by id, and counts no divergence for it
    comp = {row[0]: row for row in t["Optimizer comparison"][1:]}
    header = t["Optimizer comparison"][0]
    col = {h: i for i, h in enumerate(header)}
    for run_id in gone:
        o = runs[run_id]["optimizer"]
        assert run_id in comp[o][col["missing runs"]] or "more)" in comp[o][col["missing runs"]]
        assert int(comp[o][col["diverged"]]) == sum(bool(r["diverged"]) for r in runs.values()
                                                   if r["optimizer"] == o), comp[o]
    assert sum(int(row[col["missing"]]) for row in comp.values()) == len(gone)
    csv = (root / "results.csv").read_text().splitlines()
    for line in csv:
        if any(line.startswith(f"{g},") for g in gone):
            assert ",missing," in line and ",True," not in line, line


def test_a_deleted_branch_directory_is_missing_and_the_mean_says_n_of_planned(tmp_path):
    def delete(root, runs):
        shutil.rmtree(root / "runs" / "w-adamw-lr0.002-s0-b400")
        return {"w-adamw-lr0.002-s0-b400"}
    runs, md, x = report_after(tmp_path, delete)
    check(tmp_path, runs, md, x["gone"])
    assert "(n=2 of 3)" in md


def test_a_deleted_metrics_file_is_missing_not_a_divergence(tmp_path):
    def delete(root, runs):
        (root / "runs" / "w-muon-lr0.02-s0-b400" / "metrics.jsonl").unlink()
        return {"w-muon-lr0.02-s0-b400"}
    runs, md, x = report_after(tmp_path, delete)
    check(tmp_path, runs, md, x["gone"])
    summary = {row[0]: row for row in tcr.tables(md)["Results per optimizer"][1:]}
    assert tcr.close(summary["muon"][1], 0.02)  # as ∞ it flipped muon's best lr to 0.01


def test_a_deleted_trunk_makes_its_branches_missing_not_truncated_curves(tmp_path):
    def delete(root, runs):
        shutil.rmtree(root / "runs" / "w-muon-lr0.02-s2-trunk")
        return {"w-muon-lr0.02-s2-trunk", *(f"w-muon-lr0.02-s2-b{b}" for b in (100, 200, 400))}
    runs, md, x = report_after(tmp_path, delete)
    check(tmp_path, runs, md, x["gone"])


@pytest.mark.parametrize("drop_metrics", [False, True])
def test_a_branch_not_started_is_pending_not_missing(tmp_path, drop_metrics):
    run_id = "w-adamw-lr0.002-s1-b400"

    def delete(root, runs):
        path = root / "runs" / run_id / "run.json"
        path.write_text(path.read_text().replace('"status": "done"', '"status": "planned"'))
        (root / "runs" / run_id / "metrics.jsonl").write_text("")
        if drop_metrics:  # a run not started may have no metrics.jsonl yet
            (root / "runs" / run_id / "metrics.jsonl").unlink()
        return set()
    runs, md, _ = report_after(tmp_path, delete)
    losses, planned, best = expected(runs, {run_id})
    t = tcr.tables(md)
    header = t["Optimizer comparison"][0]
    adamw = dict(zip(header, next(row for row in t["Optimizer comparison"][1:] if row[0] == "adamw")))
    assert (adamw["pending"], adamw["missing"], adamw["missing runs"]) == ("1", "0", "–")
    summary = {row[0]: row for row in t["Results per optimizer"][1:]}
    assert cell_matches(summary["adamw"][-1], losses[("adamw", 2e-3, 400)], 3)
    assert "(n=2 of 3)" in summary["adamw"][-1] and "Pending (not run yet, left out of every table): 1" in md


def test_without_a_plan_the_report_says_it_did_not_check(tmp_path):
    tcr.make_comparison(tmp_path, plan=False)
    md = Path(build_report(str(tmp_path))).read_text()
    assert "Completeness: not checked" in md and "missing runs" not in md


# --- summary.json ---------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")


def numbers_of(x) -> list[float]:
    """Every number in summary.json: its values, and its keys that are numbers (the budgets)."""
    if isinstance(x, dict):
        return [v for k, val in x.items() for v in (numbers_of(k) if NUMBER.fullmatch(k) else []) + numbers_of(val)]
    if isinstance(x, list):
        return [v for val in x for v in numbers_of(val)]
    if isinstance(x, str):
        return [float(x)] if NUMBER.fullmatch(x) else []
    return [float(x)] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def test_summary_json_holds_every_number_the_tables_print_and_recomputes(tmp_path):
    fast_muon = {**tcr.OPTS, "muon": ((0.01, 0.02, 0.04), 0.02, 10.0, 0.012, 1000)}
    tcr.make_comparison(tmp_path, workload="small")
    tcr.make_comparison(tmp_path, workload="big", opts=fast_muon, diverged=(), failed_trunk=())
    runs = tcr.read(tmp_path)
    shutil.rmtree(tmp_path / "runs" / "small-adamw-lr0.002-s0-b400")  # a missing run, (n=2 of 3) cells
    md = Path(build_report(str(tmp_path))).read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    known = np.array(numbers_of(summary))
    unmatched = []
    for heading, rows in tcr.tables(md).items():
        for row in rows[1:]:
            for cell in row:
                for token in NUMBER.findall(cell):
                    v = float(token)
                    tol = tcr.printed_atol(token) + tcr.F64_RTOL * abs(v)
                    if not np.any(np.abs(known - v) <= tol):
                        unmatched.append((heading, cell, token))
    assert not unmatched, unmatched[:10]
    assert summary["completeness"]["checked"] and set(summary["workloads"]) == {"small", "big"}
    assert len(summary["profiles"]["share"]) == 3

    # its key numbers recomputed from the runs' files by test_compare_report's helpers
    for name in ("small", "big"):
        mine = {k: r for k, r in runs.items() if r["workload"] == name}
        gone = {"small-adamw-lr0.002-s0-b400"} if name == "small" else set()
        losses, planned, best = expected(mine, gone)
        top = max(b for _, _, b in planned)
        w = summary["workloads"][name]
        for o, x in w["optimizers"].items():
            assert x["best_lr"] == pytest.approx(best[o], rel=tcr.F64_RTOL)
            for b, cell in x["at_best"].items():
                vals = losses[(o, best[o], int(b))]
                assert (cell["n"], cell["planned"]) == (len(vals), planned[(o, best[o], int(b))])
                if any(math.isinf(v) for v in vals):
                    assert cell["mean"] == "inf"
                    continue
                assert cell["mean"] == pytest.approx(float(np.mean(vals)), rel=tcr.F64_RTOL)
                if len(vals) > 1:
                    assert cell["std"] == pytest.approx(float(np.std(vals, ddof=1)), rel=tcr.F64_RTOL)
            step = [r["time/step_sec"] for r in mine.values() if r["optimizer"] == o and r["id"] not in gone
                    for r in r["records"] if "time/step_sec" in r]
            assert x["cost"]["step_sec"] == pytest.approx(float(np.median(step)), rel=tcr.F64_RTOL)
        assert w["target"] == pytest.approx(float(np.mean(losses[("adamw", best["adamw"], top)])), rel=tcr.F64_RTOL)
    comp = {(c["workload"], c["optimizer"]): c for c in summary["completeness"]["per_optimizer"]}
    assert comp[("small", "adamw")]["missing_ids"] == ["small-adamw-lr0.002-s0-b400"]
    assert comp[("small", "adamw")]["planned"] == 36 and comp[("small", "adamw")]["missing"] == 1
