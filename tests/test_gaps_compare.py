"""Comparison cases the main files leave out (tests/test_compare_report.py's synthetic directories
and recomputations are reused): the best lr when it differs between budgets (the largest decides,
and every budget's cell is read at that lr), time to target when a seed at the best lr diverged, and
the plan of budgets whose 0.8·S is not an integer (rounded to the nearest step)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import test_compare_report as tcr

from compare import report
from compare.plan import compare_config, make_plan

TWO = {o: tcr.OPTS[o] for o in ("adamw", "muon")}  # fewer runs: the report's rules are per optimizer


def losses_by_key(root: Path) -> tuple[dict, dict]:
    """(optimizer, lr, budget) -> per-seed results (by seed), and the runs, recomputed from the files."""
    runs = tcr.read(root)
    out: dict[tuple, list[float]] = {}
    for r in sorted((r for r in runs.values() if r["kind"] == "branch"), key=lambda r: (r["seed"], r["id"])):
        loss = tcr.result(r, runs)
        if loss is not None:
            out.setdefault((r["optimizer"], r["lr"], r["budget"]), []).append(loss)
    return out, runs


def check_ttt(row: list[str], runs: dict, optimizer: str, lr: float, budget: int, target: float) -> None:
    """A Time to target row against the curves of (optimizer, lr, budget)'s seeds, recomputed as in
    tests/test_compare_report.py's main test (its cells' tolerances: the table's printed digits)."""
    seeds = [r for r in runs.values() if r["kind"] == "branch" and (r["optimizer"], r["lr"], r["budget"]) ==
             (optimizer, lr, budget)]
    curves = [tcr.curve(r, runs) for r in seeds]
    goal = target + 1e-9 * abs(target)  # the report's own reach rule (report.time_to_target)
    assert tcr.close(row[1], lr)
    assert row[2] == f"{sum(np.isfinite(tcr.to_target(c, goal)[0]) for c in curves)}/{len(seeds)}"
    hit = tcr.to_target(np.mean(curves, axis=0), goal)
    assert np.isfinite(hit[0]) and tcr.close(row[3], hit[0], abs_=0.06) and tcr.close(row[5], hit[2], abs_=0.006)


def test_the_largest_budget_decides_the_best_lr_when_budgets_disagree(tmp_path, monkeypatch):
    """AdamW's optimal lr falls as training goes on (4e-3·(step/50)^(-2/3)): on its grid 2e-3 is
    best at S=100 and 200, 1e-3 at S=400. The summary's best lr is 1e-3, every budget's cell is the
    loss at 1e-3 (not at that budget's own best), and time to target uses 1e-3's curves."""
    base = tcr.base_loss

    def drifting(opt, lr, seed, step):
        if opt != "adamw":
            return base(opt, lr, seed, step)
        _, _, alpha, _, _ = tcr.OPTS[opt]
        best = 4e-3 * (step / 50) ** (-2 / 3)
        return alpha * (step * tcr.TOK) ** -0.5 + 2.0 + 0.2 * math.log2(lr / best) ** 2 + \
            tcr.SEED_NOISE[seed] * (1 + lr * 10)

    monkeypatch.setattr(tcr, "base_loss", drifting)
    tcr.make_comparison(tmp_path, opts=TWO, diverged=(), failed_trunk=())
    md = Path(report.build_report(str(tmp_path))).read_text()
    losses, runs = losses_by_key(tmp_path)
    mean = lambda o, lr, b: float(np.mean(losses[(o, lr, b)]))
    grid = TWO["adamw"][0]
    assert min(grid, key=lambda lr: mean("adamw", lr, 100)) == 2e-3 == min(grid, key=lambda lr: mean("adamw", lr, 200))
    assert min(grid, key=lambda lr: mean("adamw", lr, 400)) == 1e-3  # the budgets disagree

    t = tcr.tables(md)
    rows = {row[0]: row for row in t["Results per optimizer"][1:]}
    assert tcr.close(rows["adamw"][1], 1e-3) and tcr.close(rows["muon"][1], 0.02)
    for cell, b in zip(rows["adamw"][5:], (100, 200, 400)):
        assert tcr.loss_cell(cell, losses[("adamw", 1e-3, b)]), (b, cell)
    target = mean("adamw", 1e-3, 400)
    assert f"Target val/loss {target:.4f}" in md
    ttt = {row[0]: row for row in t[tcr.SECONDARY][1:]}
    check_ttt(ttt["adamw"], runs, "adamw", 1e-3, 400, target)
    check_ttt(ttt["muon"], runs, "muon", 0.02, 400, target)


def _diverging(opt, lr, seed, step):
    """AdamW's loss lowest at 1.8e-3: on its grid 2e-3 is best, then 1e-3 (4e-3 is further away)."""
    _, _, alpha, _, _ = tcr.OPTS[opt]
    best = 1.8e-3 if opt == "adamw" else tcr.OPTS[opt][1]
    return alpha * (step * tcr.TOK) ** -0.5 + 2.0 + 0.2 * math.log2(lr / best) ** 2 + \
        tcr.SEED_NOISE[seed] * (1 + lr * 10)


def test_a_diverged_seed_at_the_best_lr_moves_the_best_lr_and_its_time_to_target(tmp_path, monkeypatch):
    """Seed 1 of AdamW at 2e-3 (its best lr) diverges at the largest budget: that lr's mean is ∞, so
    the best lr is 1e-3, where every seed is finite: the target is its mean final loss and the time
    to target is read on its curves."""
    monkeypatch.setattr(tcr, "base_loss", _diverging)
    tcr.make_comparison(tmp_path, opts=TWO, diverged=("adamw", 2e-3, 1, 400), failed_trunk=())
    md = Path(report.build_report(str(tmp_path))).read_text()
    losses, runs = losses_by_key(tmp_path)
    assert math.isinf(losses[("adamw", 2e-3, 400)][1]) and np.mean(losses[("adamw", 2e-3, 200)]) < np.mean(
        losses[("adamw", 1e-3, 200)])  # without the divergence 2e-3 would be best
    t = tcr.tables(md)
    rows = {row[0]: row for row in t["Results per optimizer"][1:]}
    assert tcr.close(rows["adamw"][1], 1e-3) and rows["adamw"][4] == "1"  # one diverged run
    target = float(np.mean(losses[("adamw", 1e-3, 400)]))
    assert f"Target val/loss {target:.4f}" in md
    ttt = {row[0]: row for row in t[tcr.SECONDARY][1:]}
    check_ttt(ttt["adamw"], runs, "adamw", 1e-3, 400, target)
    check_ttt(ttt["muon"], runs, "muon", 0.02, 400, target)


def test_time_to_target_at_an_lr_with_a_diverged_seed_is_not_reached(tmp_path, monkeypatch):
    """time_to_target's own rule (docs/compare.md: 'not reached' when a seed failed), at the lr whose
    seed diverged: its curve reaches the target before it diverges, as do the other two seeds',
    yet the mean curve is not reached and the seed count holds only the two finite seeds."""
    monkeypatch.setattr(tcr, "base_loss", _diverging)
    tcr.make_comparison(tmp_path, opts=TWO, diverged=("adamw", 2e-3, 1, 400), failed_trunk=())
    (w,) = report.load_workloads(str(tmp_path))
    w.best["adamw"] = 2e-3
    seeds = w.by_key[("adamw", 2e-3, 400)]
    w.target = float(max(r.curve["loss"][len(r.curve["loss"]) // 2] for r in seeds))  # halfway: every seed gets there
    assert sum(math.isinf(r.loss) for r in seeds) == 1
    assert all(np.nanmin(r.curve["loss"]) <= w.target for r in seeds)  # the diverged one too, before diverging
    report.time_to_target(w)
    assert w.ttt["adamw"]["steps"] == math.inf and w.ttt["adamw"]["seconds"] == math.inf
    assert (w.ttt["adamw"]["reached"], w.ttt["adamw"]["n"]) == (2, 3)
    assert math.isfinite(w.ttt["muon"]["steps"])


@pytest.mark.parametrize("budgets, steps", [((13, 27), (10, 22)), ((12, 19), (10, 15))])
def test_budgets_whose_branch_point_is_not_an_integer_round_to_the_nearest_step(budgets, steps):
    """0.8·13 = 10.4 -> 10 (not ceil's 11), 0.8·27 = 21.6 -> 22 (not int()'s 21), 0.8·12 = 9.6 -> 10,
    0.8·19 = 15.2 -> 15: the trunk saves at those steps and runs to the last, each branch starts
    there and decays over the rest, and validation falls on every branch point and budget."""
    k = compare_config({"optimizers": ["adamw"], "budgets": list(budgets), "lr": {"points": 1}, "seeds": 1,
                        "warmup": 2})
    assert tuple(k.branch_step(b) for b in budgets) == steps
    trunk, *branches = make_plan(k, ["model.dim=32"], {"adamw": 3e-3}).runs
    assert trunk.kind == "trunk" and f"train.max_steps={steps[-1]}" in trunk.overrides
    assert f"checkpoint.save_steps=[{','.join(map(str, steps))}]" in trunk.overrides
    assert [(r.budget, r.branch_step) for r in branches] == list(zip(budgets, steps))
    for r, b, s in zip(branches, budgets, steps):
        assert f"optimizer.lr_config.decay={b - s}" in r.overrides and f"train.max_steps={b}" in r.overrides
    assert f"train.val_at=[{','.join(map(str, steps))}]" in trunk.overrides
    assert all(f"train.val_at=[{b}]" in r.overrides for r, b in zip(branches, budgets))
