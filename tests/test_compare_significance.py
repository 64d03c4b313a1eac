"""Selection and testing in a comparison (issue 34, item 3): tuning seeds choose each setting,
fresh evaluation seeds test it (compare/plan.py `evaluation_runs`, scripts/compare.py), paired
tests where seeds share init and data, 95% CIs, Holm across optimizers x workloads, and verdicts
read from an interval (compare/significance.py, report.py's significance section).

- the winner's curse, simulated through the report's own selection and tests: a flat-lr optimizer
  as good as AdamW gains a spurious difference on the tuning seeds, none on the evaluation seeds,
  and is declared better no more often than alpha there;
- paired vs Welch on correlated data, and both against scipy; Holm against a hand computation and
  a brute-force NumPy recomputation;
- the evaluation phase end to end with a stand-in trainer (ids, disjoint seeds, the per-budget
  choice, compare.json's record, a rerun), seeds.vary_data's pairing, and the report's verdict cells.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_OVERRIDES, evaluated_steps, load_script
from scipy import stats as sps

import train_jax as T
from compare import ladder, significance
from compare.plan import compare_config, evaluation_runs, make_plan
from compare.report import ALPHA, MIN_SEEDS, Result, Run, Workload, build_report, significance_tests
from utils.errors import ConfigError

# --- statistics against scipy and by hand -----------------------------------------------------------

# float64, the same formulas as scipy's in another order (a t quantile, a few sums): ~1e-15 apart;
# 1e-12 is room
F64 = 1e-12


def test_paired_and_welch_match_scipy():
    a, b = [3.01, 3.05, 2.98, 3.02, 3.04], [3.10, 3.07, 3.12, 3.0, 3.08]
    d, ref = significance.paired(a, b), sps.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    assert (d.method, d.n, d.df) == ("paired", 5, 4.0)
    assert (d.mean, d.t, d.p, d.low, d.high) == pytest.approx(
        (np.mean(a) - np.mean(b), ref.statistic, ref.pvalue, ci.low, ci.high), rel=F64)
    d, ref = significance.welch(a, b[:3]), sps.ttest_ind(a, b[:3], equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert (d.method, d.n) == ("welch", 3)
    assert (d.t, d.p, d.df, d.low, d.high) == pytest.approx((ref.statistic, ref.pvalue, ref.df, ci.low, ci.high),
                                                            rel=F64)
    wide = d.at(0.01)  # a 99% interval contains the 95% one
    assert wide.low < d.low and wide.high > d.high and wide.mean == d.mean
    assert math.isnan(significance.paired([1.0], [2.0]).p)


def test_paired_detects_a_consistent_small_difference_that_welch_misses():
    """Seed k of both optimizers shares an init and data effect (sd 0.05) much larger than the
    difference (-0.01) and the run noise (sd 0.002): the paired differences are -0.01 ± 0.003, so
    the paired interval lies below 0; Welch sees two samples spread by the seed effect and its
    interval straddles 0."""
    rng = np.random.default_rng(0)
    seed = rng.normal(0, 0.05, 6)
    adamw = 3.0 + seed + rng.normal(0, 0.002, 6)
    other = 3.0 - 0.01 + seed + rng.normal(0, 0.002, 6)
    p, w = significance.paired(other, adamw), significance.welch(other, adamw)
    assert significance.verdict(p, MIN_SEEDS) == "better" and p.high < 0
    assert significance.verdict(w, MIN_SEEDS) == "inconclusive" and w.low < 0 < w.high
    assert p.mean == pytest.approx(w.mean, rel=F64)  # the same difference, different uncertainty


def test_verdict_reads_the_interval_and_needs_seeds():
    d = significance.paired([1.0, 1.1, 0.9], [2.0, 2.2, 1.95])
    assert d.high < 0 and significance.verdict(d, 3) == "better"
    assert significance.verdict(significance.paired([2.0, 2.2, 1.95], [1.0, 1.1, 0.9]), 3) == "worse"
    # a huge difference on two seeds still claims nothing: too few to say
    assert significance.verdict(significance.paired([1.0, 1.1], [2.0, 2.2]), 3) == "inconclusive (n=2)"
    # an interval that straddles 0 is inconclusive, whatever the sign of the mean
    assert significance.verdict(significance.paired([1.0, 1.2, 0.9], [1.1, 1.0, 1.05]), 3) == "inconclusive"


def test_holm_by_hand_and_by_brute_force():
    # by hand: sorted 0.005, 0.01, 0.03, 0.04 (m = 4) -> 4·0.005 = 0.02, 3·0.01 = 0.03,
    # 2·0.03 = 0.06, max(0.06, 1·0.04) = 0.06; a nan is outside the family
    p = [0.01, 0.04, 0.03, 0.005, math.nan]
    got = significance.holm(p)
    assert got[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=F64) and math.isnan(got[4])
    # levels: rank 1 at 0.05/4 (0.005 < 0.0125: rejected), rank 2 at 0.05/3 (0.01 < 0.0167: rejected),
    # rank 3 at 0.05/2 (0.03 >= 0.025: the step-down stops), rank 4 frozen at 0.025
    assert significance.holm_levels(p)[:4] == pytest.approx([0.05 / 3, 0.025, 0.025, 0.05 / 4], rel=F64)
    rng = np.random.default_rng(1)
    for _ in range(200):
        m = int(rng.integers(1, 8))
        p = rng.uniform(0, 0.1, m) ** rng.uniform(0.5, 2)
        # the definition: p~_i = max over the tests ranked at or before i of min(1, (m - rank + 1) p)
        order = np.argsort(p, kind="stable")
        rank = np.empty(m, int)
        rank[order] = np.arange(m)
        want = [max(min(1.0, (m - rank[j]) * p[j]) for j in range(m) if rank[j] <= rank[i]) for i in range(m)]
        assert significance.holm(p) == pytest.approx(want, rel=F64)
        # the Holm interval excludes 0 exactly when Holm rejects: p < its level <=> adjusted p < alpha
        levels = significance.holm_levels(p, ALPHA)
        assert [pi < lv for pi, lv in zip(p, levels)] == [a < ALPHA for a in want]


# --- the winner's curse, simulated through the report's selection and tests -------------------------

LRS = (1e-3, 2e-3, 4e-3, 8e-3)
TUNE, EVAL = 3, 3  # seeds: the report's MIN_SEEDS on each phase
SIGMA_SEED, SIGMA_RUN = 0.005, 0.01  # a seed's effect, shared by every optimizer (init, data); a run's own noise
CURVE = 0.05  # AdamW's loss rises 0.05·k² k lrs away from its best: its best lr is clear, flat's is noise


def simulated_workload(rng, evaluate: bool, budget: int = 100) -> Workload:
    """AdamW (a peaked lr landscape) and "flat" (the same loss at every lr, equal to AdamW's best)
    on TUNE tuning seeds; with `evaluate`, each one's setting chosen by Workload.chosen on EVAL fresh
    seeds. Run and Result objects as report.py reads them from a directory."""
    shared = rng.normal(0, SIGMA_SEED, TUNE + EVAL)
    runs, results = [], []

    def add(opt, i, seed, phase):
        loss = 3.0 + (CURVE * (i - 1) ** 2 if opt == "adamw" else 0.0) + shared[seed] + rng.normal(0, SIGMA_RUN)
        run = Run({"id": f"{opt}-{i}-{phase}{seed}", "workload": "w", "optimizer": opt, "lr": LRS[i], "seed": seed,
                   "kind": "branch", "budget": budget, "status": "done", "diverged": False, "phase": phase,
                   "overrides": [f"random_seed={seed}", "data_seed=0"]}, [])
        runs.append(run)
        results.append(Result(run, loss, ""))

    for opt, i, seed in itertools.product(("adamw", "flat"), range(len(LRS)), range(TUNE)):
        add(opt, i, seed, "tune")
    if evaluate:
        tuned = Workload("w", list(runs), list(results))
        for opt in ("adamw", "flat"):
            _, lr = tuned.chosen(opt, budget)
            for seed in range(TUNE, TUNE + EVAL):
                add(opt, LRS.index(lr), seed, "eval")
    return Workload("w", runs, results)


def test_a_flat_lr_landscape_gains_nothing_on_evaluation_seeds():
    """Flat's best lr is the lowest of 4 noisy means, E[min of 4 N(0, s)] = -1.03 s with s =
    SIGMA_RUN/√3: on the tuning seeds it gains about -0.006 it does not have and is declared better
    ~5% of the time (at a two-sided alpha = 5%, 2.5% is the nominal rate of 'better'); on the
    evaluation seeds the difference is unbiased and 'better' comes at the nominal rate."""
    reps = 300
    found = {}
    for evaluate in (False, True):
        rng = np.random.default_rng(2)
        tests = [significance_tests([simulated_workload(rng, evaluate)])[("w", "flat")] for _ in range(reps)]
        assert {t.seeds for t in tests} == {"evaluation" if evaluate else "tuning"}
        assert {t.diff.method for t in tests} == {"paired"}  # every seed pairs
        found[evaluate] = (np.mean([t.diff.mean for t in tests]), np.mean([t.verdict == "better" for t in tests]))
    # the mean of `reps` paired differences, each the mean of 3 with sd √2·SIGMA_RUN: its standard error
    se = math.sqrt(2) * SIGMA_RUN / math.sqrt(TUNE) / math.sqrt(reps)
    bias = -1.029 * SIGMA_RUN / math.sqrt(TUNE)  # E[min of 4 standard normals] = -1.029, times s
    (tuned, tuned_rate), (fresh, fresh_rate) = found[False], found[True]
    assert tuned == pytest.approx(bias, abs=4 * se)  # 4 standard errors: the winner's curse is there
    assert abs(fresh) < 4 * se  # and gone on fresh seeds
    # the rate of "better" under no true difference: nominal alpha/2 = 2.5%, a binomial over `reps`
    # repetitions with sd √(0.025·0.975/reps) = 0.9%; alpha (the brief's bound) is 2.8 sd above
    assert fresh_rate <= ALPHA
    assert tuned_rate > fresh_rate


def test_the_ladders_frontier_is_unbiased_on_evaluation_seeds():
    """The same winner's curse in the time-to-target and D_eff/D figures: they read each budget's
    frontier, which on the tuning seeds is flat's lowest of 4 noisy means (biased low by 1.03 s, as
    above); once the evaluation seeds have run, the ladders read them (compare/ladder.py
    evaluation_ready) and flat's frontier minus AdamW's is unbiased."""
    reps = 300
    found = {}
    for evaluate in (False, True):
        rng = np.random.default_rng(5)
        gaps = []
        for _ in range(reps):
            w = simulated_workload(rng, evaluate)
            assert ladder.evaluation_ready(w) == evaluate
            ladders, _ = ladder.build(w, ladder.evaluation_ready(w))  # as ladder.attach builds them
            gaps.append(ladders["flat"].mean[0] - ladders["adamw"].mean[0])
        found[evaluate] = float(np.mean(gaps))
    # each gap: two means of 3 seeds' run noise (the seed effects shared): sd √2·SIGMA_RUN/√3
    se = math.sqrt(2) * SIGMA_RUN / math.sqrt(TUNE) / math.sqrt(reps)
    bias = -1.029 * SIGMA_RUN / math.sqrt(TUNE)
    assert found[False] == pytest.approx(bias, abs=4 * se)  # 4 standard errors
    assert abs(found[True]) < 4 * se


# --- the evaluation phase, end to end with a stand-in trainer -----------------------------------------

RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size")))


def fake_train(cfg, run_dir):
    """A stand-in for train_jax.train: val/loss = 3 + (log10(lr) - opt)² + 0.1·weight_decay +
    0.001·random_seed, opt = -3 for runs of 10 steps, -2.5 otherwise: budget 10 prefers lr 1e-3,
    budget 20 prefers 3e-3, both weight_decay 0."""
    lr, wd = float(cfg.optimizer.lr_config.lr), float(cfg.optimizer.get("weight_decay", 0.0))
    opt = -3.0 if cfg.train.max_steps == 10 else -2.5
    start = int(cfg.checkpoint.load_file.split("_")[1]) if cfg.checkpoint.load else 0
    loss = 3 + (math.log10(lr) - opt) ** 2 + 0.1 * wd + 0.001 * cfg.random_seed
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in evaluated_steps(cfg.train, start):  # where train_jax evaluates
            f.write(json.dumps({"step": step, "val/loss": loss, "data/tokens": step * 64, "data/fingerprint": "fp",
                                "time/elapsed_sec": step * 0.01}) + "\n")


@pytest.mark.slow  # ~20 runs through Hydra's compose: 10-25 s on a shared CPU
def test_evaluation_phase_runs_each_budgets_choice_on_fresh_seeds(tmp_path, monkeypatch, capsys):
    script = load_script("compare")
    monkeypatch.setattr(T, "train", fake_train)
    monkeypatch.setattr(script, "build_report", lambda d: None)
    argv = ["optimizers=[adamw]", "budgets=[10,20]", "lr.points=2", "lr.grid.adamw=[1e-3,3e-3]",
            "sweep.weight_decay=[0.0,0.1]", "seeds.eval=2", "seeds=1", "warmup=2", *RUN, f"dir={tmp_path}"]
    assert script.main(argv) == 0
    assert "compare: seeds.eval: 8 runs of the chosen settings on evaluation seeds 1..2" in capsys.readouterr().out
    record = json.loads((tmp_path / "compare.json").read_text())
    assert (record["knobs"]["seeds"], record["knobs"]["seeds_eval"]) == (1, 2)  # seeds=1 is seeds.tune=1
    ev = record["evaluation"]
    assert ev["seeds"] == [1, 2]
    assert [(c["budget"], c["lr"], c["sweep"]) for c in ev["chosen"]] == [
        (10, 1e-3, {"weight_decay": 0.0}), (20, 3e-3, {"weight_decay": 0.0})]  # each budget its own choice
    runs = {r["id"]: r for r in ev["runs"]}
    want = {f"default__adamw__lr{lr}__weight_decay0__eval{s}__{t}" for s in (1, 2)
            for lr, t in (("0.001", "trunk"), ("0.001", "S10"), ("0.003", "trunk"), ("0.003", "S20"))}
    assert set(runs) == want
    on_disk = {p.name: json.loads((p / "run.json").read_text()) for p in (tmp_path / "runs").iterdir()}
    tuning = {i: r for i, r in on_disk.items() if r["phase"] == "tune"}
    assert len(tuning) == 2 * 2 * 3 and {i for i, r in on_disk.items() if r["phase"] == "eval"} == want
    assert all(on_disk[i]["status"] == "done" for i in want)
    seed_of = lambda r: {o for o in r["plan_overrides"] if o.startswith(("random_seed=", "data_seed="))}
    assert {s for r in tuning.values() for s in seed_of(r)} == {"random_seed=0", "data_seed=0"}
    assert {s for i in want for s in seed_of(on_disk[i])} == {"random_seed=1", "random_seed=2", "data_seed=0"}
    # the lr chosen at budget 10 only needs a trunk to that budget's branch point (8)
    trunk = runs["default__adamw__lr0.001__weight_decay0__eval1__trunk"]["overrides"]
    assert "train.max_steps=8" in trunk and "checkpoint.save_steps=[8]" in trunk
    # a rerun trains nothing and keeps the recorded evaluation
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "0 done, 8 skipped" in out and " done\n" not in out
    assert json.loads((tmp_path / "compare.json").read_text())["evaluation"] == ev
    # the report: the tuning tables leave the evaluation runs out, the evaluation table shows each choice
    md = Path(build_report(str(tmp_path))).read_text()
    assert "| adamw | 0.003 | 0.0 | 20 |" in md  # best lr at the largest budget, from the tuning seeds
    assert "| adamw | lr 0.001, weight_decay=0.0: 3.0015 ± 0.0007 (n=2) | lr 0.003, weight_decay=0.0:" in md


def test_vary_data_gives_each_seed_its_order_shared_by_every_optimizer():
    k = compare_config({"optimizers": ["adamw", "sgdm"], "budgets": [10], "lr": {"points": 1}, "warmup": 2,
                        "data_seed": 5, "seeds": {"tune": 2, "eval": 3, "vary_data": True}})
    plan = make_plan(k, RUN, {"adamw": 1e-3, "sgdm": 0.1})
    seeds = lambda r: tuple(next(o for o in r.overrides if o.startswith(k)) for k in ("random_seed=", "data_seed="))
    assert {seeds(r) for r in plan.runs} == {("random_seed=0", "data_seed=5"), ("random_seed=1", "data_seed=6")}
    ev = evaluation_runs(plan, {("default", "adamw"): {10: ((), 1e-3)}, ("default", "sgdm"): {10: ((), 0.1)}})
    pairs = {opt: sorted(seeds(r) for r in ev if r.optimizer == opt and r.kind == "branch") for opt in k.optimizers}
    assert pairs["adamw"] == pairs["sgdm"] == [(f"random_seed={s}", f"data_seed={5 + s}") for s in (2, 3, 4)]
    assert {r.phase for r in ev} == {"eval"} and all("__eval" in r.id for r in ev)
    # budgets choosing different lrs: each chosen lr's trunk reaches only its own budgets' branch points
    k = compare_config({"optimizers": ["adamw"], "budgets": [10, 20], "lr": {"points": 2}, "warmup": 2,
                        "seeds": {"tune": 1, "eval": 1}})
    plan = make_plan(k, RUN, {"adamw": 2e-3})
    ev = evaluation_runs(plan, {("default", "adamw"): {10: ((), 1e-3), 20: ((), 2e-3)}})
    assert {(r.id, r.budget) for r in ev if r.kind == "branch"} == {
        ("default__adamw__lr0.001__eval1__S10", 10), ("default__adamw__lr0.002__eval1__S20", 20)}
    trunks = {r.lr: r.overrides for r in ev if r.kind == "trunk"}
    assert "train.max_steps=8" in trunks[1e-3] and "train.max_steps=16" in trunks[2e-3]


# --- the report's verdict cells -----------------------------------------------------------------------

# optimizer -> its loss minus AdamW's on every evaluation seed (before the run noise), evaluation seeds
EFFECTS = {"adamw": (0.0, 5), "lion": (0.01, 5), "muon": (-0.01, 5), "sgdm": (0.0, 5), "shampoo": (-0.05, 2)}


def write_comparison(root: Path, evaluation: bool = True) -> None:
    """One budget (100), lrs 1e-3 and 2e-3 (1e-3 is every optimizer's best), 3 tuning seeds; with
    `evaluation`, evaluation seeds 3.. at lr 1e-3. Seed k's effect (sd 0.05, far above the
    differences) is shared by every optimizer, a run's own noise is 0.001: only a paired test
    sees the 0.01 differences."""
    rng = np.random.default_rng(3)
    shared = rng.normal(0, 0.05, 8)
    (root / "compare.json").write_text(json.dumps({"knobs": {"budgets": [100], "seeds": 3, "seeds_eval": 5}}))
    for opt, (effect, n_eval) in EFFECTS.items():
        phases = [("tune", s, lr) for s in range(3) for lr in (1e-3, 2e-3)]
        phases += [("eval", s, 1e-3) for s in range(3, 3 + n_eval)] if evaluation else []
        for phase, seed, lr in phases:
            loss = 3.0 + effect + (0.05 if lr == 2e-3 else 0.0) + shared[seed] + rng.normal(0, 0.001)
            info = {"id": f"{opt}-lr{lr:g}-{phase}{seed}", "workload": "w", "optimizer": opt, "lr": lr, "seed": seed,
                    "phase": phase, "kind": "branch", "budget": 100, "trunk": None, "branch_step": 80,
                    "status": "done", "diverged": False, "error": None,
                    "overrides": [f"random_seed={seed}", "data_seed=0"]}
            d = root / "runs" / info["id"]
            d.mkdir(parents=True)
            (d / "run.json").write_text(json.dumps(info))
            (d / "metrics.jsonl").write_text("".join(json.dumps(
                {"step": s, "val/loss": loss + (100 - s) * 1e-3, "data/tokens": 64.0 * s, "time/elapsed_sec": 0.01 * s,
                 "time/step_sec": 0.01, "data/fingerprint": "fp"}) + "\n" for s in (90, 100)))


def significance_rows(md: str) -> dict[str, list[str]]:
    section = md.split("## Significance vs adamw")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| optimizer", "| ---"))]
    return {r[0]: r for r in rows if len(r) == 10}


def test_report_verdicts_from_paired_intervals_on_evaluation_seeds(tmp_path):
    write_comparison(tmp_path)
    md = Path(build_report(str(tmp_path))).read_text()
    rows = significance_rows(md)
    assert {o: r[-1] for o, r in rows.items()} == {"lion": "worse", "muon": "better", "sgdm": "inconclusive",
                                                     "shampoo": "inconclusive (n=2)"}
    assert {(r[1], r[2]) for r in rows.values()} == {("evaluation", "paired")}
    assert [int(rows[o][3]) for o in ("lion", "muon", "sgdm", "shampoo")] == [5, 5, 5, 2]
    assert "These tests use the evaluation seeds" in md and "biased toward the winner" not in md
    # the family: the three with >= 3 seeds; the Holm p of each recomputed from the printed p-values
    assert "(m = 3: lion in w, muon in w, sgdm in w)" in md
    runs = {p.name: json.loads((p / "run.json").read_text()) for p in (tmp_path / "runs").iterdir()}
    final = lambda o: [float(json.loads((tmp_path / "runs" / i / "metrics.jsonl").read_text().splitlines()[-1])
                             ["val/loss"]) for i in sorted(runs, key=lambda i: runs[i]["seed"])
                       if runs[i]["optimizer"] == o and runs[i]["phase"] == "eval"]
    ps = {o: sps.ttest_rel(final(o), final("adamw")[:len(final(o))]).pvalue for o in ("lion", "muon", "sgdm")}
    holm = dict(zip(ps, significance.holm(list(ps.values()))))
    for o, p in holm.items():
        cell = rows[o][8]
        # printed with 3 significant digits: half a unit of the last one, relative
        assert float(cell) == pytest.approx(p, rel=5e-3 if p < 1 else 0), (o, cell)
    # the 95% CI of the mean difference, printed to 4 decimals
    low, high = (float(x) for x in re.findall(r"-?\d+\.\d+", rows["muon"][5]))
    ci = sps.ttest_rel(final("muon"), final("adamw")).confidence_interval(0.95)
    # printed to 4 decimals: within half a unit of the last one
    assert (low, high) == pytest.approx((ci.low, ci.high), abs=5e-5)


def frontier_cells(md: str) -> dict[str, str]:
    section = md.split("Tuned frontier:")[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| optimizer", "| ---"))]
    return {r[0]: r[1] for r in rows}


def final_losses(root: Path, optimizer: str, phase: str, lr: float) -> list[float]:
    out = []
    for d in sorted((root / "runs").iterdir()):
        info = json.loads((d / "run.json").read_text())
        if info["optimizer"] == optimizer and info["phase"] == phase and info["lr"] == lr:
            out.append(json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])["val/loss"])
    return out


@pytest.mark.parametrize("evaluation", [True, False])
def test_time_to_target_and_d_eff_read_the_evaluation_seeds_once_they_ran(tmp_path, evaluation):
    """With the evaluation runs done, the frontier, the target and summary.json's figures are the
    evaluation seeds' means at the setting the tuning seeds chose (lr 1e-3 here); without them, the
    tuning seeds' best, and the report says in bold that those are biased."""
    write_comparison(tmp_path, evaluation)
    md = Path(build_report(str(tmp_path))).read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())["workloads"]["w"]
    phase = "eval" if evaluation else "tune"
    assert summary["ladder_seeds"] == ("evaluation" if evaluation else "tuning")
    assert ("These figures read the **evaluation seeds**" in md) == evaluation
    assert ("**These figures read the tuning seeds**" in md) == (not evaluation)
    for o in EFFECTS:
        losses = final_losses(tmp_path, o, phase, 1e-3)
        mean = float(np.mean(losses))
        # float64 means of the same few float64 values in another order: ~1e-16 apart, printed to 4 decimals
        assert summary["optimizers"][o]["frontier"]["100"]["mean"] == pytest.approx(mean, rel=1e-12)
        assert summary["optimizers"][o]["frontier"]["100"]["n"] == len(losses)
        assert frontier_cells(md)[o].startswith(f"{mean:.4f} ± ")
    # the same float64 mean in another order: ~1e-16 apart
    assert summary["target"] == pytest.approx(float(np.mean(final_losses(tmp_path, "adamw", phase, 1e-3))), rel=1e-12)


def test_a_baseline_other_than_adamw_is_what_every_test_and_speedup_is_relative_to(tmp_path):
    """compare.json's `baseline` (compare.py baseline=muon): the tests take muon's losses from each
    optimizer's, so AdamW, 0.01 above muon here, is worse; the target and summary follow it."""
    write_comparison(tmp_path)
    recorded = json.loads((tmp_path / "compare.json").read_text())
    recorded["knobs"]["baseline"] = "muon"
    (tmp_path / "compare.json").write_text(json.dumps(recorded))
    md = Path(build_report(str(tmp_path))).read_text()
    assert "Baseline: muon" in md and "## Significance vs muon" in md and "## Speedup vs muon" in md
    rows = {r[0]: r for r in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in md.split("## Significance vs muon")[1].split("\n## ")[0].splitlines()
        if line.startswith("| ") and not line.startswith(("| optimizer", "| ---"))) if len(r) == 10}
    assert {o: r[-1] for o, r in rows.items()} == {"adamw": "worse", "lion": "worse", "sgdm": "worse",
                                                     "shampoo": "inconclusive (n=2)"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reference"] == "muon"
    # the same float64 mean in another order: ~1e-16 apart
    assert summary["workloads"]["w"]["target"] == pytest.approx(float(np.mean(final_losses(tmp_path, "muon", "eval",
                                                                                             1e-3))), rel=1e-12)


def test_the_baseline_knob_is_one_of_the_compared_optimizers():
    base = {"optimizers": ["adamw", "muon"], "budgets": [10, 20]}
    assert compare_config({**base, "baseline": "muon"}).baseline == "muon"
    assert compare_config(base).baseline is None  # the report then takes adamw
    with pytest.raises(ConfigError, match=r"baseline='lion' must be one of the compared optimizers \(adamw, muon\)"):
        compare_config({**base, "baseline": "lion"})


def test_report_on_tuning_seeds_says_its_tests_are_biased(tmp_path):
    write_comparison(tmp_path, evaluation=False)
    md = Path(build_report(str(tmp_path))).read_text()
    rows = significance_rows(md)
    assert {r[1] for r in rows.values()} == {"tuning"}
    assert "**These tests use the tuning seeds**" in md and "biased toward the winner" in md
    assert "the evaluation runs (seeds.eval=5) have not all run yet" in md  # planned in compare.json
