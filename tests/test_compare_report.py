"""The comparison's report (compare/report.py, stats.py) on synthetic comparison directories:
run.json + metrics.jsonl written here with known curves, no training. Every number in report.md's
tables is recomputed from the metrics.jsonl files by code in this file (not the report's), and the
statistics are checked against scipy and hand formulas."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from compare import stats
from compare.report import build_report
from utils.errors import DataError

TOK = 256  # tokens per step
EVERY = 10  # a record every 10 steps, val/loss every 20
COOL = 0.05  # what the cooldown takes off the loss by the branch's end
FP = "fp-0123"
# optimizer -> (lr grid, the lr its loss is lowest at, alpha, seconds per step, state bytes)
OPTS = {
    "adamw": ((1e-3, 2e-3, 4e-3), 2e-3, 40.0, 0.010, 2000),
    "muon": ((0.01, 0.02, 0.04), 0.02, 30.0, 0.012, 1000),
    "shampoo": ((1e-3, 2e-3, 4e-3), 5e-4, 34.0, 0.020, 4000),  # best lr below the grid: an edge
}
SEED_NOISE = (-0.01, 0.004, 0.006)  # per seed, the same at every budget: L(D) stays a power law


def base_loss(opt: str, lr: float, seed: int, step: float) -> float:
    _, best, alpha, _, _ = OPTS[opt]
    return alpha * (step * TOK) ** -0.5 + 2.0 + 0.2 * math.log2(lr / best) ** 2 + SEED_NOISE[seed] * (1 + lr * 10)


def write_run(root: Path, info: dict, records: list[dict]) -> None:
    d = root / "runs" / info["id"]
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(info))
    with open(d / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def make_comparison(root: Path, budgets=(100, 200, 400), seeds=3, opts=OPTS, workload="w", fingerprint=FP,
                    diverged=("shampoo", 4e-3, 2, 400), failed_trunk=("muon", 0.04, 1), plan=True) -> None:
    """Trunks (warmup-free constant lr, saving at 0.8 S) and cooldown branches for every
    (optimizer, lr, seed, budget); one branch diverged, one trunk failed (its branches never ran).
    compare.json holds every run as its plan (`plan=False`: none, as a directory from before it did)."""
    planned = []

    def put(info, records):  # writes the run, and records it into the plan
        planned.append({k: v for k, v in info.items() if k not in ("status", "error", "diverged")})
        write_run(root, info, records)

    for opt, (lrs, _, _, sec, state) in opts.items():
        for lr in lrs:
            for seed in range(seeds):
                trunk_id = f"{workload}-{opt}-lr{lr:g}-s{seed}-trunk"
                end = int(0.8 * max(budgets))
                fail = (opt, lr, seed) == failed_trunk
                recs = []
                for step in range(EVERY, (50 if fail else end) + 1, EVERY):
                    r = {"step": step, "train/loss": base_loss(opt, lr, seed, step) + 0.1, "time/step_sec": sec,
                         "time/elapsed_sec": 1.0 + sec * step, "data/tokens": float(step * TOK)}
                    if step % 20 == 0:
                        r["val/loss"] = base_loss(opt, lr, seed, step)
                    if step == EVERY:
                        r.update({"data/fingerprint": fingerprint, "optim/state_bytes": state})
                    recs.append(r)
                common = {"workload": workload, "optimizer": opt, "lr": lr, "seed": seed, "overrides": [],
                          "diverged": False, "error": None}
                put({**common, "id": trunk_id, "kind": "trunk", "budget": None, "trunk": None,
                                 "branch_step": None, "status": "failed" if fail else "done",
                                 "error": "boom" if fail else None}, recs)
                for budget in budgets:
                    bs = int(0.8 * budget)
                    info = {**common, "id": f"{workload}-{opt}-lr{lr:g}-s{seed}-b{budget}", "kind": "branch",
                            "budget": budget, "trunk": trunk_id, "branch_step": bs, "status": "done"}
                    if fail:
                        put({**info, "status": "planned"}, [])
                        continue
                    recs = []
                    for step in range(bs + EVERY, budget + 1, EVERY):
                        loss = base_loss(opt, lr, seed, step) - COOL * (step - bs) / (budget - bs)
                        r = {"step": step, "train/loss": loss + 0.1, "time/step_sec": sec * 1.1,
                             "time/elapsed_sec": 0.5 + sec * (step - bs), "data/tokens": float(step * TOK)}
                        if step % 20 == 0 or step == budget:
                            r["val/loss"] = loss
                        if step == bs + EVERY:
                            r.update({"data/fingerprint": fingerprint, "optim/state_bytes": state})
                        recs.append(r)
                    if (opt, lr, seed, budget) == diverged:
                        recs[-1]["val/loss"] = float("nan")
                        info.update(status="failed", diverged=True, error="the loss became nan")
                    put(info, recs)
    compare = {"knobs": {"budgets": list(budgets)}, "run_overrides": []}
    if plan:
        compare["runs"] = planned
    if (root / "compare.json").exists():  # a second workload in the same directory: one plan for both
        before = json.loads((root / "compare.json").read_text())
        compare["runs"] = [*before.get("runs", []), *compare.get("runs", [])] if plan else before.get("runs", [])
    (root / "compare.json").write_text(json.dumps(compare))


# --- reading report.md ----------------------------------------------------------------------------

def tables(md: str) -> dict[str, list[list[str]]]:
    """Heading text -> the rows (cells) of the first table after it (the header row included);
    a later heading of the same text gets `text#2`."""
    out, heading, rows = {}, None, None
    for line in md.split("\n"):
        m = re.match(r"^#+ (.*)$", line)
        if m:
            heading, rows = m.group(1), None
            n = 2
            while heading in out:
                heading = f"{m.group(1)}#{n}"
                n += 1
        elif line.startswith("|") and heading is not None:
            if rows is None and heading not in out:
                rows = out[heading] = []
            if rows is not None and not re.match(r"^\|( --- \|)+$", line):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif not line.strip() and rows:
            rows = None
            heading = None if heading in out else heading
    return out


def num(cell: str) -> float:
    return {"∞": math.inf, "–": math.nan}[cell] if cell in ("∞", "–") else float(cell)


def printed_atol(cell: str) -> float:
    """Half a unit in the last digit `cell` shows ("0.1234": 5e-5, "1.23e-05": 5e-8): format()
    rounds to nearest, so the printed number is within that of the value it printed."""
    mantissa, _, exponent = cell.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


# The report and this file compute each statistic in float64, maybe in another order: a few hundred
# operations of at most float64's eps each, relative; 4096 eps bounds that with a margin.
F64_RTOL = 4096 * np.finfo(np.float64).eps


def close(cell: str, expected: float, rel: float = 0.0, abs_: float = 0.0) -> bool:
    """The printed cell equals `expected` to its printed digits (printed_atol) and float64 (F64_RTOL);
    `rel`, `abs_`: what the caller's own derivation adds (a fit's convergence)."""
    value = num(cell)
    if math.isinf(expected) or math.isnan(expected):
        return (math.isinf(value) and math.isinf(expected)) or (math.isnan(value) and math.isnan(expected))
    tol = printed_atol(cell) + abs_ + (rel + F64_RTOL) * abs(expected)
    return value == pytest.approx(expected, rel=0, abs=tol)


def loss_cell(cell: str, values: list[float]) -> bool:
    if any(math.isinf(v) for v in values):
        return cell == "∞"
    mean = float(np.mean(values))
    if len(values) == 1:
        return close(cell, mean)
    m, s = cell.split(" ± ")
    return close(m, mean) and close(s, float(np.std(values, ddof=1)))


# --- recomputing from the runs' files (independently of the report's code) ----------------------

def read(root: Path) -> dict[str, dict]:
    runs = {}
    for d in sorted((root / "runs").iterdir()):
        info = json.loads((d / "run.json").read_text())
        by_step: dict[int, dict] = {}
        for line in (d / "metrics.jsonl").read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
        info["records"] = [by_step[s] for s in sorted(by_step)]
        runs[info["id"]] = info
    return runs


def result(run: dict, runs: dict) -> float | None:
    """The branch's final val/loss; inf failed/diverged/trunk failed; None pending."""
    trunk = runs[run["trunk"]]
    if run["status"] == "done" and not run["diverged"]:
        return [r["val/loss"] for r in run["records"] if "val/loss" in r][-1]
    if trunk["status"] == "failed" or run["status"] == "failed" or run["diverged"]:
        return math.inf
    return None


def curve(run: dict, runs: dict) -> np.ndarray:
    """(step, tokens, seconds, val/loss) at each evaluation of trunk-then-branch; seconds: the step
    times the median time/step_sec of the trunk's and the branch's records (the clean step time)."""
    trunk = runs[run["trunk"]]
    bs = run["branch_step"]
    sec = float(np.median([r["time/step_sec"] for r in (*trunk["records"], *run["records"]) if "time/step_sec" in r]))
    rows = [(r["step"], r["data/tokens"], r["step"] * sec, r["val/loss"]) for r in trunk["records"]
            if r["step"] <= bs and "val/loss" in r]
    rows += [(r["step"], r["data/tokens"], r["step"] * sec, r["val/loss"]) for r in run["records"]
             if r["step"] > bs and "val/loss" in r]
    return np.array(rows, dtype=float)


def to_target(c: np.ndarray, target: float) -> np.ndarray:
    for i in range(len(c)):
        if c[i, 3] <= target:
            if i == 0:
                return c[0, :3]
            f = (c[i - 1, 3] - target) / (c[i - 1, 3] - c[i, 3])
            return c[i - 1, :3] + f * (c[i, :3] - c[i - 1, :3])
    return np.full(3, math.inf)


# --- stats ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("noise", [0.0, 1e-3])
def test_fit_recovers_alpha_beta_gamma(noise):
    alpha, beta, gamma = 120.0, 0.35, 2.1
    d = np.geomspace(1e5, 1e8, 8)
    rng = np.random.default_rng(0)
    loss = stats.power_law(d, alpha, beta, gamma) + rng.normal(0, noise, d.size)
    a, b, g = stats.fit_power_law(d, loss)
    if noise == 0:  # exact data: within xtol = 1e-8 x the fit's relative condition number (~50 for these
        # 8 budgets over 3 decades; see the report's fit below): ~5e-7, and 1e-4 is a wide margin
        assert (a, b, g) == pytest.approx((alpha, beta, gamma), rel=1e-4)
    else:  # the noise moves the fitted curve by about its own size: the parameters by a few percent
        assert np.abs(stats.power_law(d, a, b, g) - loss).max() < 4 * noise
        # statistics, not rounding: noise σ = 1e-3 on the 8 losses gives the least-squares parameters
        # the standard deviations √diag(σ²(JᵀJ)⁻¹), J the Jacobian at the truth: 0.19% of β, 1.6e-3 of
        # γ, 0.73% of α (its log trades off against β); bounds at 6 of them (a 2e-9 chance for any seed)
        assert b == pytest.approx(beta, rel=6 * 0.0019) and g == pytest.approx(gamma, abs=6 * 1.6e-3)
        assert a == pytest.approx(alpha, rel=6 * 0.0073)  # 6 standard deviations (above)
    # inverting the fit at a loss on the curve gives back its D
    assert stats.effective_data(stats.power_law(1e6, a, b, g), a, b, g) == pytest.approx(1e6, rel=1e-6)
    assert stats.effective_data(g - 0.01, a, b, g) == math.inf  # beyond the fitted floor
    with pytest.raises(ValueError, match=">= 3 budgets"):
        stats.fit_power_law(d[:2], loss[:2])


def test_welch_matches_scipy_and_hedges_g_the_hand_formula():
    a, b = [3.01, 3.05, 2.98, 3.02], [3.10, 3.07, 3.12]
    t, p = stats.welch(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    # float64, the same formulas as scipy's in another order: ~1e-15 apart; 1e-12 is room
    assert (t, p) == pytest.approx((ref.statistic, ref.pvalue), rel=1e-12)
    n1, n2 = len(a), len(b)
    s = math.sqrt(((n1 - 1) * np.var(a, ddof=1) + (n2 - 1) * np.var(b, ddof=1)) / (n1 + n2 - 2))
    d = (np.mean(a) - np.mean(b)) / s
    # float64 on both sides, a few operations: ~1e-15 apart; 1e-12 is room
    assert stats.hedges_g(a, b) == pytest.approx(d * (1 - 3 / (4 * (n1 + n2) - 9)), rel=1e-12)
    assert math.isnan(stats.hedges_g([1.0], b))


def test_crossing_interpolates_between_evaluations():
    loss, steps, secs = [5.0, 4.0, 3.0, 2.0], [10, 20, 30, 40], [1.0, 2.0, 4.0, 8.0]
    assert stats.crossing(loss, 3.5, steps, secs) == pytest.approx((25.0, 3.0))
    assert stats.crossing(loss, 6.0, steps, secs) == (10.0, 1.0)  # already there at the first evaluation
    assert stats.crossing(loss, 1.0, steps, secs) is None


def test_performance_profile_and_geometric_mean():
    times = {"a": [1.0, 2.0, math.inf], "b": [2.0, 1.0, 3.0]}
    rho = stats.performance_profile(times, [1.0, 2.0, 4.0])
    assert rho["a"].tolist() == pytest.approx([1 / 3, 2 / 3, 2 / 3])
    assert rho["b"].tolist() == pytest.approx([2 / 3, 1.0, 1.0])
    assert stats.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    # AlgoPerf's score, the profile's area over [1, 4] / 3, by hand: a's ratios 1, 2, inf give areas 3, 2, 0;
    # b's 2, 1, 1 (3 / 3, the best on the third) give 2, 3, 3
    assert stats.profile_score(times) == pytest.approx({"a": (3 + 2 + 0) / 3 / 3, "b": (2 + 3 + 3) / 3 / 3})
    grid = np.linspace(1.0, 4.0, 30001)
    for o, score in stats.profile_score(times).items():
        # and numerically: the mean of the profile on a grid of τ spaced 1e-4: a step function's mean there is
        # off by at most one spacing per step (2 steps per optimizer here), 2e-4 / 3 of the score; 1e-3 is room
        assert score == pytest.approx(float(stats.performance_profile(times, grid)[o].mean()), abs=1e-3)


# --- the report -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    make_comparison(root)
    return root, Path(build_report(str(root))).read_text()


def test_report_tables_are_recomputed_from_the_metrics(comparison):
    root, md = comparison
    runs = read(root)
    t = tables(md)
    branches = [r for r in runs.values() if r["kind"] == "branch"]
    losses: dict[tuple, list[float]] = {}
    for r in sorted(branches, key=lambda r: (r["seed"], r["id"])):
        loss = result(r, runs)
        if loss is not None:
            losses.setdefault((r["optimizer"], r["lr"], r["budget"]), []).append(loss)
    budgets = sorted({r["budget"] for r in branches})
    top = budgets[-1]
    mean = lambda v: math.inf if any(math.isinf(x) for x in v) else float(np.mean(v))
    best = {o: min(OPTS[o][0], key=lambda lr, o=o: (mean(losses[(o, lr, top)]), lr)) for o in OPTS}
    assert best == {"adamw": 2e-3, "muon": 0.02, "shampoo": 1e-3}

    summary = t["Results per optimizer"]
    assert summary[0] == ["optimizer", "best lr", "runs", "failed", "diverged", *(f"S={b}" for b in budgets)]
    assert [row[0] for row in summary[1:]] == ["adamw", "muon", "shampoo"]
    for row in summary[1:]:
        o = row[0]
        mine = [r for r in runs.values() if r["optimizer"] == o]
        assert close(row[1], best[o])
        assert [int(c) for c in row[2:5]] == [len(mine), sum(r["status"] == "failed" for r in mine),
                                              sum(r["diverged"] for r in mine)]
        for cell, b in zip(row[5:], budgets):
            assert loss_cell(cell, losses[(o, best[o], b)]), (o, b, cell)

    sens = t["LR sensitivity"]
    assert len(sens) == 1 + 9
    for o, lr, n, cell in sens[1:]:
        vals = losses[(o, float(lr), top)]
        assert int(n) == len(vals) and loss_cell(cell, vals), (o, lr, cell)
    assert any(c == "∞" for *_, c in sens[1:])  # the diverged seed makes its lr's mean inf

    # time to target: AdamW's mean final loss at its best lr and the largest budget
    target = mean(losses[("adamw", best["adamw"], top)])
    assert f"Target val/loss {target:.4f}" in md
    ttt = t[SECONDARY]
    goal = target + 1e-9 * abs(target)
    for o, lr, reached, *cells in ttt[1:]:
        assert close(lr, best[o])
        seeds = [r for r in branches if (r["optimizer"], r["lr"], r["budget"]) == (o, best[o], top)]
        curves = [curve(r, runs) for r in seeds]
        assert reached == f"{sum(np.isfinite(to_target(c, goal)[0]) for c in curves)}/{len(seeds)}"
        hit = to_target(np.mean(curves, axis=0), goal)  # every seed logged the same evaluation steps
        if not np.isfinite(hit[0]):
            assert cells == ["not reached"] * 3
        else:
            assert close(cells[0], hit[0]) and close(cells[1], hit[1]) and close(cells[2], hit[2])
    assert ttt[1][3] == "400.0" and ttt[3][3] == "not reached"  # adamw's mean reaches its own mean at the end

    # Time to target on the ladder and D_eff/D (3 budgets: read between budgets only, no fit): recomputed
    # from the per-budget tuned frontier (every lr's mean, the lowest) by this file's own crossing rule
    front = {o: [min(mean(losses[(o, lr, b)]) for lr in OPTS[o][0] if (o, lr, b) in losses) for b in budgets]
             for o in OPTS}
    lad = {row[0]: row for row in t["Time to target"][1:]}
    for o in OPTS:
        steps, flag = ladder_cross(budgets, front[o], goal)
        assert lad[o][1] == ({"": "", "≤": "≤ ", ">": "> "}[flag] + f"{steps:.1f}"), (o, lad[o])
        ref_steps, _ = ladder_cross(budgets, front["adamw"], goal)
        if not flag:
            assert close(lad[o][5], ref_steps / steps)
    assert "3 budgets: a power law's 3 parameters would pass through every point" in md
    rows = _rows_after(md, "D_eff/D per budget")
    for o, *cells in rows[1:]:
        for cell, b, loss in zip(cells, budgets, front[o]):
            d_eff, flag = ladder_cross([x * TOK for x in budgets], front["adamw"], loss + 1e-9 * abs(loss))
            value = cell.split(" [")[0].split(" (")[0]
            if flag == ">":  # beyond AdamW's largest budget, no fit to read: a bound at D_max / D
                assert value == f"> {budgets[-1] / b:.3f}", (o, b, cell)
            elif math.isinf(loss):
                assert value == f"≤ {budgets[0] / b:.3f}", (o, b, cell)
            else:
                assert value.startswith("≤ " if flag == "≤" else "") and close(value.lstrip("≤ "), d_eff / (b * TOK))

    # significance: no evaluation seeds here, so the tuning seeds at the best lr, paired by seed
    # (the synthetic runs share their seed's noise), Holm over muon and shampoo, verdict from the interval
    sig = t["Significance vs adamw"]
    assert sig[0] == ["optimizer", "seeds", "test", "n", "mean − adamw", "95% CI", "Holm interval", "p", "Holm p",
                      "verdict"]
    assert "**These tests use the tuning seeds**" in md and "biased toward the winner" in md
    ref = losses[("adamw", best["adamw"], top)]
    rows = {row[0]: row for row in sig[1:]}
    res = {o: sps.ttest_rel(losses[(o, best[o], top)], ref) for o in rows}
    ps = sorted((r.pvalue, o) for o, r in res.items())
    holm = {ps[0][1]: min(1, 2 * ps[0][0])}
    holm[ps[1][1]] = max(holm[ps[0][1]], ps[1][0])  # m = 2: 2·p_(1), then max(that, 1·p_(2))
    for o, (_, seeds, test, n, diff, ci, hi, p, hp, verdict) in rows.items():
        mine = losses[(o, best[o], top)]
        assert (seeds, test, int(n)) == ("tuning", "paired", len(ref))
        assert close(diff, np.mean(mine) - np.mean(ref)) and close(p, res[o].pvalue) and close(hp, holm[o])
        low, high = (num(c) for c in ci.strip("[]").split(", "))
        want = res[o].confidence_interval(0.95)
        assert close(f"{low:.4f}", want.low) and close(f"{high:.4f}", want.high)
        hlow, hhigh = (num(c) for c in hi.strip("[]").split(", "))
        assert hlow <= low and hhigh >= high  # the Holm interval is at least as wide as the 95% one
        assert verdict == ("better" if hhigh < 0 else "worse" if hlow > 0 else "inconclusive")
        assert (verdict != "inconclusive") == (holm[o] < 0.05)  # the interval and Holm's decision agree
    assert rows["muon"][-1] == "better" and rows["shampoo"][-1] == "worse"
    assert "m = 2: muon in w, shampoo in w" in md

    cost = t["Cost"]
    med = {o: float(np.median([r["time/step_sec"] for run in runs.values() if run["optimizer"] == o
                               for r in run["records"] if "time/step_sec" in r])) for o in OPTS}
    for o, st, rel_t, state, rel_b in cost[1:]:
        assert close(st, med[o]) and close(rel_t, med[o] / med["adamw"])
        assert int(state) == OPTS[o][4] and close(rel_b, OPTS[o][4] / OPTS["adamw"][4])
    assert "need ≥ 2 workloads" in md
    for png in ("lr_sensitivity.png", "curves_tokens.png", "curves_seconds.png"):
        assert (root / png).stat().st_size > 1000 and f"]({png})" in md


SECONDARY = "Time to target on the largest budget's curve (secondary)"


def ladder_cross(xs: list[float], losses: list[float], target: float) -> tuple[float, str]:
    """Where a ladder (one loss per budget, ascending) first reaches `target`: between the budget
    before and the first reaching one, the loss linear in log x; ("≤", x_0) when the first budget
    reaches it below the target, (">", x_last) when none does."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return xs[0], "" if loss >= target - 2e-9 * abs(target) else "≤"
            f = (losses[i - 1] - target) / (losses[i - 1] - loss)
            return math.exp(math.log(xs[i - 1]) + f * (math.log(xs[i]) - math.log(xs[i - 1]))), ""
    return xs[-1], ">"


def _rows_after(md: str, marker: str) -> list[list[str]]:
    """The first table after the paragraph that starts with `marker`."""
    rest = md.split(marker, 1)[1].split("\n")
    rows, started = [], False
    for line in rest:
        if line.startswith("|"):
            started = True
            if not re.match(r"^\|( --- \|)+$", line):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif started:
            break
    return rows


def test_results_csv_has_a_row_per_run(comparison):
    root, _ = comparison
    runs = read(root)
    with open(root / "results.csv") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(runs)
    div = next(r for r in rows.values() if r["diverged"] == "True")
    assert div["final_val_loss"] == "inf" and div["status"] == "failed"
    done = rows["w-adamw-lr0.002-s0-b400"]
    assert float(done["final_val_loss"]) == pytest.approx(base_loss("adamw", 2e-3, 0, 400) - COOL)
    assert int(done["steps"]) == 400 and float(done["tokens"]) == 400 * TOK
    # seconds: 400 steps x the median step time of the trunk's 32 records (0.010 s) and the branch's 8 (0.011 s)
    assert float(done["seconds"]) == pytest.approx(400 * 0.010)
    assert float(done["elapsed_sec"]) == pytest.approx((1.0 + 0.01 * 320) + (0.5 + 0.01 * 80))  # the wall clock
    assert float(done["step_sec"]) == pytest.approx(0.011) and int(done["state_bytes"]) == 2000
    assert rows["w-muon-lr0.04-s1-b100"]["final_val_loss"] == "inf"  # its trunk failed


def test_edge_of_the_grid_is_noted(comparison):
    _, md = comparison
    notes = [line for line in md.split("\n") if "rerun with lr.extend=true" in line]
    assert len(notes) == 1 and notes[0].startswith("- shampoo: best lr 0.001 is the smallest of its grid")


def test_two_budgets_and_two_seeds_make_no_fit_and_claim_nothing(tmp_path):
    make_comparison(tmp_path, budgets=(100, 200), seeds=2, diverged=(), failed_trunk=())
    md = Path(build_report(str(tmp_path))).read_text()
    assert "2 budgets: a power law's 3 parameters would pass through every point" in md  # read between budgets only
    verdicts = [row[-1] for row in tables(md)["Significance vs adamw"][1:]]
    assert verdicts == ["inconclusive (n=2)"] * 2  # too few seeds to claim anything, either way


def test_several_workloads_give_performance_profiles(tmp_path):
    make_comparison(tmp_path, workload="small", diverged=(), failed_trunk=())
    fast_muon = {**OPTS, "muon": (*OPTS["muon"][:3], 0.006, OPTS["muon"][4])}
    make_comparison(tmp_path, workload="big", opts=fast_muon, diverged=(), failed_trunk=())
    md = Path(build_report(str(tmp_path))).read_text()
    t = tables(md)
    assert "Workload big" in t or "## Workload big" in md
    ttt = {name: {row[0]: row for row in t[key][1:]} for name, key in (("big", "Time to target"),
                                                                       ("small", "Time to target#2"))}
    # the ladder's seconds: '> S_max' is not reached, '≤ S_min' counts at the smallest budget's seconds
    seconds = {o: [math.inf if ttt[w][o][4].startswith(">") else num(ttt[w][o][4].lstrip("≤ "))
                   for w in ("big", "small")] for o in OPTS}
    profile = t["Across workloads"]
    assert profile[0] == ["optimizer", "τ=1", "τ=1.5", "τ=2", "τ=3", "τ=4", "score"]
    for o, *cells in profile[1:]:
        for cell, tau in zip(cells, (1, 1.5, 2, 3, 4)):
            within = [s / min(seconds[x][i] for x in OPTS) <= tau for i, s in enumerate(seconds[o])]
            assert close(cell, float(np.mean(within)))
        ratios = [s / min(seconds[x][i] for x in OPTS) for i, s in enumerate(seconds[o])]
        # the seconds are read back at 2 decimals: a ratio r = s/b is off by up to 0.005 (1/s + 1/b) r
        # (first order), and the score, the mean over the 2 workloads of (4 - r) / 3, by the mean of those / 3
        err = [printed_atol("0.00") * (1 / s + 1 / min(seconds[x][i] for x in OPTS)) * r
               for i, (s, r) in enumerate(zip(seconds[o], ratios)) if math.isfinite(r)]
        assert close(cells[-1], float(np.mean([max(4 - r, 0) for r in ratios])) / 3, abs_=sum(err) / len(ratios) / 3)
    # on the ladder muon reaches AdamW's target at a smaller budget on both workloads (its loss is lower at
    # every budget), so its seconds are the fewest on both, though its steps are slower on "small"
    assert [row[1] for row in profile[1:]] == ["0.000", "1.000", "0.000"]
    for o, cell in _rows_after(md, "Geometric-mean speedup")[1:]:
        pairs = list(zip(seconds["adamw"], seconds[o]))
        ratios = [a / b if math.isfinite(b) else 0.0 for a, b in pairs]
        # the seconds read back are printed to 2 decimals (within 0.005 each): a ratio a/b is then off by
        # at most 0.005/a + 0.005/b relative (first order), the geometric mean by the mean of those
        errs = [printed_atol("0.00") * (1 / a + 1 / b) for a, b in pairs if math.isfinite(b)]
        rel = float(np.mean(errs)) if errs else 0.0  # no finite pair: the cell is exactly 0
        assert close(cell, math.exp(np.mean(np.log(ratios))) if min(ratios) > 0 else 0.0, rel=rel)
    assert (tmp_path / "performance_profile.png").is_file() and (tmp_path / "lr_sensitivity_big.png").is_file()


def test_differing_fingerprints_are_one_line_data_error(tmp_path):
    """Within a workload every run must have trained on the same data; workloads may differ (e.g.
    two datasets), and the header names each one's fingerprint."""
    make_comparison(tmp_path, workload="a", budgets=(100,), seeds=1, diverged=(), failed_trunk=())
    make_comparison(tmp_path, workload="b", budgets=(100,), seeds=1, diverged=(), failed_trunk=(), fingerprint="other")
    header = open(build_report(str(tmp_path))).read().split("\n")[2]
    assert f"data fingerprint: a: {FP}, b: other;" in header
    metrics = next((tmp_path / "runs").glob("b-*-trunk")) / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"other"', '"third"'))
    with pytest.raises(DataError) as e:
        build_report(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and message.startswith("workload b: runs trained on different data")
    assert "data/fingerprint" in message and "'third' in b-" in message and "data_seed" in message


def test_a_directory_without_runs_is_one_line_data_error(tmp_path):
    with pytest.raises(DataError, match=r"no runs \(no runs/<id>/run.json\)") as e:
        build_report(str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_comparison_with_nothing_finished_reports_pending_without_warnings(tmp_path):
    """Every run only planned (the state right after the command starts): the report builds, says
    pending (not 'failed'), and its plots draw a note instead of an empty legend, which matplotlib
    warns about."""
    import warnings

    from compare import launch
    from compare.plan import compare_config, make_plan

    knobs = {"optimizers": ["adamw", "muon"], "budgets": [10, 20], "lr": {"points": 2}, "seeds": 1, "warmup": 2}
    launch.open_dir(make_plan(compare_config(knobs), ("model.dim=32",), {"adamw": 3e-3, "muon": 0.02}),
                    str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        md = Path(build_report(str(tmp_path))).read_text()
    assert "- adamw: no run at budget 20 has finished yet (2 pending): no best lr." in md
    assert "failed" not in md.split("## Results per optimizer")[1].split("\n## ")[0].split("Edge of the grid")[1]
    for png in ("lr_sensitivity.png", "curves_tokens.png", "curves_seconds.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_the_lr_axis_is_labelled_at_the_lrs_run_and_the_bars_say_what_they_are():
    from compare import report

    fig, ax = report._figure()
    ax.errorbar([1e-3, 2e-3, 4e-3], [3.0, 2.9, 3.1], yerr=[0.1, 0.1, 0.1], label="adamw (± std, 2 seeds)")
    ax.set_xscale("log")
    report._lr_ticks(ax, [1e-3, 2e-3, 4e-3])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.001", "0.002", "0.004"]
    assert not [t for t in ax.xaxis.get_minor_ticks() if t.label1.get_text()]  # no minor labels to overlap
    report._lr_ticks(ax, [1e-4 * 2**k for k in range(20)])  # a long grid: at most 8 labels
    assert len(ax.get_xticks()) <= 8
    assert report._legend_or_note(ax, "nothing") is True
    fig2, ax2 = report._figure()
    assert report._legend_or_note(ax2, "nothing yet") is False and ax2.get_legend() is None


def test_seconds_and_cost_use_the_clean_step_time_not_the_wall_clock(tmp_path):
    """AdamW's runs spend 30 s compiling, Muon's 5 s; their clean steps take 0.01 s and 0.02 s. The
    wall clock (time/elapsed_sec) says Muon is the faster; the report's cost ratio, curve seconds and
    results.csv's seconds must say 2x slower per step (steps x time/step_sec, from 0 at step 0),
    with compilation, evaluation and start-up reported apart."""
    from compare.report import load_workloads

    sec, compile_sec = {"adamw": 0.01, "muon": 0.02}, {"adamw": 30.0, "muon": 5.0}
    (tmp_path / "compare.json").write_text(json.dumps({"knobs": {"budgets": [100]}, "run_overrides": []}))
    for opt in sec:
        common = {"workload": "w", "optimizer": opt, "lr": 1e-3, "seed": 0, "overrides": [], "diverged": False,
                  "error": None, "status": "done"}
        for kind, steps in (("trunk", range(10, 81, 10)), ("branch", range(90, 101, 10))):
            recs = []
            for step in steps:
                first = step in (10, 90)
                r = {"step": step, "time/step_sec": sec[opt], "data/tokens": float(step * TOK),
                     "time/elapsed_sec": compile_sec[opt] + 2.0 * first + sec[opt] * step}
                if step % 20 == 0 or step == 100:
                    r.update({"val/loss": 3.0 - step / 1000, "time/eval_sec": 0.5})
                if first:
                    r.update({"time/compile_sec": compile_sec[opt], "time/startup_sec": 2.0, "time/device": "cpu",
                              "data/fingerprint": FP})
                recs.append(r)
            branch = kind == "branch"
            info = {**common, "id": f"{opt}-{kind}", "kind": kind, "budget": 100 if branch else None,
                    "trunk": f"{opt}-trunk" if branch else None, "branch_step": 80 if branch else None}
            write_run(tmp_path, info, recs)
    md = Path(build_report(str(tmp_path))).read_text()
    cost = {row[0]: row for row in tables(md)["Cost"][1:]}
    assert close(cost["muon"][2], 2.0) and close(cost["adamw"][1], 0.01)
    over = {row[0]: row for row in _rows_after(md, "Overheads, apart from the step time")[1:]}
    # per run: compile as logged, 4 (trunk) or 1 (branch) evaluations of 0.5 s: median over 2 runs 1.25 s
    assert [over["adamw"][1:], over["muon"][1]] == [["30", "1.25", "2.5", "2", "30.9"], "5"]  # 30.8, 31.0: 30.9
    assert "Measured on: cpu." in md
    (w,) = load_workloads(str(tmp_path))
    for res in w.results:
        assert res.curve["seconds"].tolist() == (res.curve["step"] * sec[res.run.optimizer]).tolist()
    with open(tmp_path / "results.csv") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    assert float(rows["muon-branch"]["seconds"]) == 100 * 0.02 and float(rows["adamw-branch"]["seconds"]) == 100 * 0.01
    assert float(rows["adamw-trunk"]["compile_sec"]) == 30.0 and rows["adamw-trunk"]["device"] == "cpu"
