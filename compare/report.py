"""A comparison's report: a pure function of its directory.

    build_report("comparisons/2026-12-01_10-00-00")          # -> .../report.md
    build_report(directory, target=3.2)                  # time to a loss of 3.2 instead of AdamW's

Reads only what the runs wrote (`runs/<id>/run.json`, `runs/<id>/metrics.jsonl`, and
`compare.json` for the header) and writes, beside them, `results.csv` (one row per run),
`report.md` and its PNGs. docs/compare.md says what every table and number means; in short:

- A result (optimizer, lr, seed, budget S) is the cooldown branch with budget S: its val/loss
  at its last evaluation (step S). Its curve is the trunk's records up to the branch step, then
  the branch's; tokens are `data/tokens` as logged (absolute); seconds are training seconds: the
  step times the clean step time (the median `time/step_sec` the trunk and the branch logged:
  compilation, evaluation, saves and start-up left out; those are reported apart, in Cost).
- A failed or diverged branch, or one whose trunk failed before it could start, is a result with
  loss = inf: it appears in the tables and makes its mean inf. A branch not yet run (its trunk
  fine) is pending: left out, and counted in the header.
- Every planned run (compare.json's runs and evaluation runs, and lr.extend's on disk) is
  finished, diverged, failed, missing (its directory, run.json or metrics.jsonl gone, done
  without a final val/loss, or its trunk missing) or pending (classify); a missing result is
  never inf: it is left out and a mean over fewer seeds than planned says "(n=k of N)".
- summary.json, beside report.md, holds every number the tables print (summary_of).
- `metric=` (compare.json; compare/metric.py) names what a result is: val/loss, or a task's
  accuracy read as its error 1 − acc, so every choice below still minimises; D_eff is left out then.
- The best lr of an optimizer: the lowest mean final loss over seeds at the largest budget,
  on the tuning seeds (run.json "phase": "tune"); runs of phase "eval" (seeds.eval) are the
  chosen settings on fresh seeds, read only by the significance section.
- Runs whose `data/fingerprint` differ, or a directory without runs: a DataError, one line.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from compare import ladder, significance, sizes, stats, tune
from compare.metric import LOSS, VAL_LOSS, Metric
from compare.metric import parse as parse_metric
from utils.errors import ConfigError, DataError
from utils.files import atomic_write
from utils.logging.metrics_file import read_metrics as _read_metrics

REFERENCE = "adamw"  # the default baseline: every speedup, t-test and cost is relative to it (compare.py baseline=)
TAUS = (1.0, 1.5, 2.0, 3.0, 4.0)  # performance-profile points printed in the table (the PNG: 1..4)
ALPHA = 0.05  # family-wise error level of the verdicts (Holm), and 1 - the coverage of the printed CI
MIN_SEEDS = 3  # fewer seeds (pairs): the verdict is "inconclusive (n=k)"
CSV_FIELDS = ("id", "workload", "optimizer", "lr", "sweep", "seed", "budget", "kind", "status", "diverged",
              "final_val_loss", "final_metric", "steps", "tokens", "seconds", "step_sec", "state_bytes", "elapsed_sec",
              "compile_sec", "eval_sec", "startup_sec", "device")
VAL, TOKENS, ELAPSED, STEP_SEC = "val/loss", "data/tokens", "time/elapsed_sec", "time/step_sec"
COMPILE, EVAL, STARTUP, DEVICE = "time/compile_sec", "time/eval_sec", "time/startup_sec", "time/device"
FINGERPRINT, STATE_BYTES = "data/fingerprint", "optim/state_bytes"
RUN_KEYS = ("id", "workload", "optimizer", "lr", "seed", "kind", "budget", "trunk", "branch_step", "overrides",
            "status", "error", "diverged")  # run.json's fields, the engine's contract (and "phase", below)


# --------------------------------------------------------------------------------------------
# Reading the directory


@dataclass
class Run:
    info: dict  # run.json
    records: list[dict]  # metrics.jsonl, one merged record per step, ascending
    has_metrics: bool = True  # metrics.jsonl exists (a run.json "done" without it is missing)
    state: str = ""  # finished | diverged | failed | missing | pending (classify); "": no plan to check
    missing_why: str = ""  # what is gone, for a missing run

    def __getattr__(self, key):  # run.optimizer, run.lr, ... from run.json (None when absent)
        if key in RUN_KEYS and "info" in self.__dict__:
            return self.__dict__["info"].get(key)
        raise AttributeError(key)

    @property
    def setting(self) -> tuple:
        """The run's sweep values ((knob, value), ...), sorted; () without a sweep."""
        return tuple(sorted((self.info.get("sweep") or {}).items()))

    @property
    def failed(self) -> bool:
        return self.info.get("status") == "failed" or bool(self.info.get("diverged"))

    @property
    def phase(self) -> str:
        """"tune" (a run of the grid; also every run of a comparison without seeds.eval) or "eval"."""
        return self.info.get("phase") or "tune"

    @property
    def seed_key(self) -> tuple:
        """(random_seed, data_seed) as the run's overrides set them: runs of two optimizers with the
        same key share their initialisation and data order, so their results pair."""
        data = next((o.split("=", 1)[1] for o in self.info.get("overrides") or [] if o.startswith("data_seed=")), None)
        return self.seed, data


@dataclass
class Result:
    """One (optimizer, lr, seed, budget) branch, its trunk's records before it."""
    run: Run
    loss: float  # the final metric (metric=: val/loss, or 1 - a task's accuracy); inf: failed or diverged; nan: pending
    why: str  # "", "failed", "diverged", "trunk failed", "pending", "no val/loss" (no <metric>), "missing"
    curve: dict[str, np.ndarray] = field(default_factory=dict)  # step, tokens, seconds, loss (the metric) at evals

    @property
    def counted(self) -> bool:
        """A result the tables count (finite or ∞); a pending or missing one is left out of every mean."""
        return self.why not in ("pending", "missing")


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl -> one record per step, ascending (a step logged twice by a resumed run is
    merged, a later value winning per key); [] when absent."""
    return _read_metrics(path) if os.path.isfile(path) else []


def load_runs(compare_dir: str) -> dict[str, Run]:
    """Every runs/<id>/ with a run.json, by id (sorted). DataError when there is none."""
    runs_dir = os.path.join(compare_dir, "runs")
    ids = sorted(d for d in os.listdir(runs_dir) if os.path.isfile(os.path.join(runs_dir, d, "run.json"))) \
        if os.path.isdir(runs_dir) else []
    if not ids:
        raise DataError(f"{compare_dir}: no runs (no runs/<id>/run.json); run scripts/compare.py first, "
                        "or give the directory it made")
    runs = {}
    for run_id in ids:
        path = os.path.join(runs_dir, run_id, "run.json")
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read it as JSON ({e}); rerun the comparison to rewrite it") from None
        info.setdefault("id", run_id)
        info.setdefault("workload", "default")
        metrics = os.path.join(runs_dir, run_id, "metrics.jsonl")
        runs[run_id] = Run(info, read_metrics(metrics), os.path.isfile(metrics))
    return runs


# --------------------------------------------------------------------------------------------
# Completeness: every planned run is finished, diverged, failed, missing or pending

STATES = ("finished", "diverged", "failed", "missing", "pending")


def read_plan(compare_dir: str) -> list[dict] | None:
    """compare.json's planned runs: `runs` (the tuning runs) and `evaluation.runs`; None without a
    compare.json that holds a plan (a directory from before it did, or an unreadable one)."""
    path = os.path.join(compare_dir, "compare.json")
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("runs"), list) or not recorded["runs"]:
        return None
    phases = [recorded.get(k) if isinstance(recorded.get(k), dict) else {} for k in ("evaluation", "target")]
    planned = [*recorded["runs"], *(r for phase in phases for r in phase.get("runs") or [])]
    ok = lambda r: (isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("optimizer"), str)
                    and isinstance(r.get("lr"), (int, float))
                    and (r.get("kind") != "branch" or isinstance(r.get("budget"), int)))
    return [r for r in planned if ok(r)]  # an entry the report could not place is not checked


def _own_val(run: Run) -> list[float]:
    """The val/losses a branch logged after its branch point (a trunk: all it logged)."""
    at = float(run.info.get("branch_step") or 0) if run.kind == "branch" else -math.inf
    return [_number(r.get(VAL)) for r in run.records if VAL in r and r["step"] > at]


def classify(runs: dict[str, Run], plan: list[dict]) -> None:
    """Set every run's state, adding a placeholder Run (status "missing", no records) for each
    planned run whose run.json is gone. The runs on disk that the plan does not hold (lr.extend's,
    each with its run.json) are planned by that run.json. Missing: its directory, run.json or (a
    run done) metrics.jsonl is gone, it is done without a final val/loss, or its trunk is missing.
    Pending: not started (run.json "planned"; also "running"). A branch whose trunk failed: failed."""
    for entry in plan:
        if entry["id"] not in runs:
            info = {**{k: entry.get(k) for k in (*RUN_KEYS, "sweep", "phase")}, "status": "missing",
                    "diverged": False}
            info["workload"] = info.get("workload") or "default"
            runs[entry["id"]] = Run(info, [], False, "missing", "its directory or run.json is gone")
    for run in runs.values():  # trunks first: a branch's state reads its trunk's
        if run.state:
            continue
        if run.info.get("diverged"):
            run.state = "diverged"
        elif run.status == "failed":
            run.state = "failed"
        elif run.status == "done" and not run.has_metrics:
            run.state, run.missing_why = "missing", "metrics.jsonl is gone"
        elif run.status == "done" and run.kind == "branch" and not _own_val(run):
            run.state, run.missing_why = "missing", "done, but no final val/loss logged"
        elif run.status == "done" and not run.records:
            run.state, run.missing_why = "missing", "done, but metrics.jsonl is empty"
        else:
            run.state = "finished" if run.status == "done" else "pending"
    for run in runs.values():
        trunk = runs.get(run.info.get("trunk") or "") if run.kind == "branch" else None
        if run.kind != "branch" or run.state in ("diverged", "failed", "missing"):
            continue
        if trunk is None or trunk.state == "missing":
            run.state, run.missing_why = "missing", f"its trunk {run.info.get('trunk')} is missing"
        elif trunk.state in ("failed", "diverged") and run.state == "pending":
            run.state = "failed"


def completeness(runs: dict[str, Run]) -> dict[tuple[str, str], dict]:
    """(workload, optimizer) -> {"planned", each state's count, "missing_ids"}: every run, trunks
    and branches, tuning and evaluation."""
    out: dict[tuple[str, str], dict] = {}
    for run in sorted(runs.values(), key=lambda r: r.id):
        row = out.setdefault((run.workload, run.optimizer),
                             {"planned": 0, **{s: 0 for s in STATES}, "missing_ids": []})
        row["planned"] += 1
        row[run.state or "finished"] += 1
        if run.state == "missing":
            row["missing_ids"].append(run.id)
    return out


def check_fingerprints(runs: dict[str, Run]) -> str | None:
    """The one data fingerprint every run logged (None when none logged one); DataError naming
    the runs when they differ: their results are not comparable."""
    seen: dict[str, list[str]] = defaultdict(list)
    for run in runs.values():
        found = [r[FINGERPRINT] for r in run.records if FINGERPRINT in r]
        for fp in dict.fromkeys(found):
            seen[str(fp)].append(run.id)
    if len(seen) > 1:
        parts = "; ".join(f"{fp!r} in {', '.join(ids[:3])}{f' (+{len(ids) - 3} more)' if len(ids) > 3 else ''}"
                          for fp, ids in sorted(seen.items(), key=lambda kv: -len(kv[1])))
        raise DataError(f"runs trained on different data (data/fingerprint {parts}); rerun those runs with the "
                        "comparison's dataset and data_seed, or compare them in separate directories")
    return next(iter(seen), None)


# --------------------------------------------------------------------------------------------
# Results


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _column(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) where `key` is logged with a finite value."""
    pairs = [(r["step"], _number(r.get(key))) for r in records]
    pairs = [(s, v) for s, v in pairs if math.isfinite(v)]
    return np.array([p[0] for p in pairs], dtype=float), np.array([p[1] for p in pairs], dtype=float)


def _at(records: list[dict], key: str, steps: np.ndarray, origin: bool = True) -> np.ndarray:
    """`key` at each step, linearly interpolated between the records that logged it (`origin`: from
    0 at step 0, true of tokens; else nan before the first); nan beyond the last."""
    s, v = _column(records, key)
    if origin:
        s, v = np.concatenate([[0.0], s]), np.concatenate([[0.0], v])
    return np.interp(steps, s, v, left=np.nan, right=np.nan) if len(s) else np.full(np.shape(steps), np.nan)


def step_time(*runs: Run | None) -> float:
    """The clean step time of a history: the median of every `time/step_sec` its runs logged (each
    a running median of clean intervals: trainer/hooks.Throughput); nan when none did."""
    values = np.concatenate([_column(r.records, STEP_SEC)[1] for r in runs if r is not None] or [np.array([])])
    return float(np.median(values)) if len(values) else math.nan


def _total(run: Run, key: str) -> float:
    """The sum of `key` over the run's records (nan when it never logged it)."""
    values = _column(run.records, key)[1]
    return float(values.sum()) if len(values) else math.nan


def combined_records(branch: Run, trunk: Run | None) -> list[dict]:
    """The branch's whole history: the trunk's records up to the branch step, then the branch's
    after it, its `time/elapsed_sec` shifted by the trunk's at the branch step."""
    if trunk is None:
        return branch.records
    at = float(branch.info.get("branch_step") or 0)
    before = [r for r in trunk.records if r["step"] <= at]
    offset = float(_at(trunk.records, ELAPSED, np.array([at]), origin=False)[0]) if before else 0.0
    offset = 0.0 if math.isnan(offset) else offset
    after = [{**r, ELAPSED: r[ELAPSED] + offset} if math.isfinite(_number(r.get(ELAPSED))) else r
             for r in branch.records if r["step"] > at]
    return before + after


def make_result(branch: Run, trunk: Run | None, metric: Metric = VAL_LOSS) -> Result:
    """The branch's result on `metric` (its `score`: lower is better), its curve the metric's evaluations."""
    if branch.state == "missing":  # never ∞: left out of every mean, and counted as missing
        return Result(branch, math.nan, "missing", {k: np.array([]) for k in ("step", "tokens", "seconds", "loss")})
    records = combined_records(branch, trunk)
    steps, loss = _column(records, metric.name)
    curve = {"step": steps, "tokens": _at(records, TOKENS, steps), "seconds": steps * step_time(branch, trunk),
             "loss": np.array([metric.score(x) for x in loss])}
    own = [r for r in branch.records if r["step"] > float(branch.info.get("branch_step") or 0)]
    last_val = [metric.score(_number(r.get(metric.name))) for r in own if metric.name in r]
    if branch.status == "done" and not branch.diverged:
        if not last_val:
            return Result(branch, math.inf, f"no {metric.name}", curve)
        final = last_val[-1]
        return Result(branch, final if math.isfinite(final) else math.inf, "" if math.isfinite(final) else "diverged",
                      curve)
    if trunk is not None and trunk.failed:
        return Result(branch, math.inf, "trunk failed", curve)
    if branch.failed:
        return Result(branch, math.inf, "diverged" if branch.diverged else "failed", curve)
    return Result(branch, math.nan, "pending", curve)


def csv_row(run: Run, result: Result | None, trunk: Run | None, metric: Metric = VAL_LOSS) -> dict:
    """results.csv's row of a run: the final val/loss is the result's (a branch) or the last
    logged (a trunk); final_metric the comparison's metric as logged (an accuracy: the result's, a
    branch's; nan for a trunk); steps and tokens at the last record of the (combined) history, seconds those
    steps times the history's clean step time (step_time), elapsed_sec the wall clock there (the
    trunk's at the branch point plus the branch's own); step_sec the median of the run's own
    `time/step_sec`; state_bytes its `optim/state_bytes`; compile_sec and eval_sec the run's own
    summed, startup_sec its `time/startup_sec`, device its `time/device`."""
    records = combined_records(run, trunk) if result is not None else run.records
    if result is not None and metric.is_loss:
        final = result.loss
    else:
        vals = _column(run.records, VAL)[1]
        final = float(vals[-1]) if len(vals) else (math.inf if run.failed else math.nan)
    if result is not None and not metric.is_loss:  # the accuracy as logged (the report's numbers are 1 - it)
        logged = _column(run.records, metric.name)[1]
        final_metric = float(logged[-1]) if math.isfinite(result.loss) and len(logged) else result.loss
    else:
        final_metric = final if metric.is_loss else math.nan
    last = lambda key: (_column(records, key)[1][-1:] if records else np.array([]))
    pick = lambda a: float(a[0]) if len(a) else math.nan
    state = _column(run.records, STATE_BYTES)[1]
    steps = records[-1]["step"] if records else 0
    devices = [r[DEVICE] for r in run.records if isinstance(r.get(DEVICE), str)]
    return {"id": run.id, "workload": run.workload, "optimizer": run.optimizer, "lr": run.lr,
            "sweep": ";".join(f"{k}={v}" for k, v in run.setting), "seed": run.seed,
            "budget": run.info.get("budget"), "kind": run.kind,
            "status": "missing" if run.state == "missing" else run.status,
            "diverged": bool(run.info.get("diverged")), "final_val_loss": final,
            "final_metric": final_metric,
            "steps": steps, "tokens": pick(last(TOKENS)),
            "seconds": steps * step_time(run, trunk if result is not None else None), "step_sec": step_time(run),
            "state_bytes": int(state[0]) if len(state) else "", "elapsed_sec": pick(last(ELAPSED)),
            "compile_sec": _total(run, COMPILE), "eval_sec": _total(run, EVAL), "startup_sec": _total(run, STARTUP),
            "device": devices[0] if devices else ""}


# --------------------------------------------------------------------------------------------
# Formatting


def f_loss(mean: float, std: float = math.nan) -> str:
    if math.isnan(mean):
        return "–"
    if math.isinf(mean):
        return "∞"
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def f_mean(values: list[float], planned: int = 0) -> str:
    """mean ± std of `values`, and "(n=k of N)" when fewer than the N planned seeds have a result."""
    text = f_loss(*stats.mean_std(values))
    return f"{text} (n={len(values)} of {planned})" if len(values) < planned else text


def f_num(x: float, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def f_value(v) -> str:
    """A searched knob's value: an lr or float as %g, anything else as itself."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def f_lr(lr) -> str:
    return "–" if lr is None else f"{float(lr):.4g}"


def table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def _order(names, reference: str = REFERENCE) -> list[str]:
    return sorted(set(names), key=lambda n: (n != reference, n))


def metric_of(compare_dir: str) -> Metric:
    """compare.json's `metric` knob (val/loss without one: null, or a directory from before the knob)."""
    try:
        with open(os.path.join(compare_dir, "compare.json"), encoding="utf-8") as f:
            knobs = (json.load(f) or {}).get("knobs") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        knobs = {}
    name = knobs.get("metric") if isinstance(knobs, dict) else None
    try:
        return parse_metric(name)
    except ConfigError as e:
        raise DataError(f"{compare_dir}/compare.json: {e}") from None


def on_metric(lines: list[str], metric: Metric) -> list[str]:
    """The lines of a section computed on `metric`, their "val/loss" read as what they are (1 − acc)."""
    return lines if metric.is_loss else [line.replace(LOSS, metric.label) for line in lines]


def section_metric(metric: Metric) -> list[str]:
    """Which sections rank by the comparison's metric and which stay on (or need) val/loss."""
    if metric.is_loss:
        return []
    return [f"Metric: `{metric.name}` (compare.py metric=), higher is better; every number below marked "
            f"{metric.label} is its error, so that lower is better everywhere. On it: the results per optimizer, "
            "sweep and coordinate search, lr sensitivity, the curves, the budget ladder and time to target (the "
            "target: the baseline's error), the significance tests, the performance profiles and the best lr per "
            "size. On val/loss: results.csv's final_val_loss (final_metric: the accuracy as logged) and the cost. "
            "Left out: the speedup D_eff/D (its fit L(D) = E + A·D^−α is a loss's shape, not an accuracy's) and "
            "the target track (target.loss, refused with this metric).", ""]


def baseline_of(compare_dir: str, optimizers) -> str:
    """The optimizer the comparison is relative to: compare.json's `baseline` knob; without one (null,
    or a directory from before the knob), adamw when compared, else the first optimizer by name."""
    try:
        with open(os.path.join(compare_dir, "compare.json"), encoding="utf-8") as f:
            knobs = (json.load(f) or {}).get("knobs") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        knobs = {}
    names = sorted(set(optimizers))
    given = knobs.get("baseline") if isinstance(knobs, dict) else None
    if isinstance(given, str) and given in names:
        return given
    return REFERENCE if REFERENCE in names or not names else names[0]


# --------------------------------------------------------------------------------------------
# One workload


@dataclass
class Workload:
    name: str
    runs: list[Run]
    results: list[Result]
    target: float | None = None  # the loss time-to-target is measured at
    ttt: dict[str, dict] = field(default_factory=dict)  # optimizer -> {"steps","tokens","seconds","reached","n"}
    reference: str = REFERENCE  # the baseline every speedup, test and cost is relative to (baseline_of)
    metric: Metric = VAL_LOSS  # what every result is (metric_of): `loss` below is its score, lower is better

    def __post_init__(self):
        # The evaluation seeds' results (seeds.eval) stay out of every choice and tuning table below.
        evaluation = [res for res in self.results if res.run.phase == "eval"]
        # the target track's runs (target.runs) are read by section_target alone
        self.target_results = [res for res in self.results if res.run.phase == "target"]
        self.results = [res for res in self.results if res.run.phase == "tune"]
        self.evaluation: dict[tuple, list[Result]] = defaultdict(list)  # (optimizer, budget) -> per seed
        self.evaluation_planned: dict[tuple, int] = defaultdict(int)
        for res in sorted(evaluation, key=lambda r: (r.run.seed, r.run.id)):
            self.evaluation_planned[(res.run.optimizer, int(res.run.budget))] += 1
            if res.counted:
                self.evaluation[(res.run.optimizer, int(res.run.budget))].append(res)
        self.evaluation_pending = sum(res.why == "pending" for res in evaluation)
        self.optimizers = _order((r.optimizer for r in self.runs), self.reference)
        self.budgets = sorted({int(r.run.budget) for r in self.results})
        self.largest = self.budgets[-1] if self.budgets else None
        self.knobs = sorted({k for r in self.runs for k, _ in r.setting})  # the swept optimizer knobs
        self.planned: dict[tuple, int] = {}  # (optimizer, lr, budget) -> seeds planned at the best setting
        # With a sweep, each optimizer is shown at its best setting (sweep values): every lr-level
        # table below reads only that setting's runs; section_sweep shows the others.
        self.settings = {o: sorted({r.setting for r in self.runs if r.optimizer == o}, key=repr)
                         for o in self.optimizers}
        self.sweep_table = {o: {st: self._index([res for res in self.results if res.run.optimizer == o
                                                 and res.run.setting == st])[0] for st in self.settings[o]}
                            for o in self.optimizers}
        self.best_setting = {o: self._best_setting(o) for o in self.optimizers}
        chosen = [res for res in self.results if res.run.setting == self.best_setting[res.run.optimizer]]
        self.planned = {}  # the sweep tables' counts above are not the chosen setting's
        self.losses, self.by_key = self._index(chosen)  # (optimizer, lr, budget) -> per seed
        self.grid = {o: sorted({float(r.lr) for r in self.runs if r.optimizer == o and r.phase == "tune"
                                and r.setting == self.best_setting[o]}) for o in self.optimizers}
        self.best = {o: self._best_lr(o) for o in self.optimizers}

    def trials(self, optimizer: str) -> int:
        """The settings (sweep values, lr) the optimizer was tuned over: its tuning runs' distinct cells."""
        return len({(r.setting, float(r.lr)) for r in self.runs if r.optimizer == optimizer and r.phase == "tune"})

    def losses_at(self, optimizer: str, budget: int) -> list[float]:
        """Every finished result (finite or not) of `optimizer` at `budget`, over lrs and seeds."""
        return [x for (o, _, b), v in self.losses.items() if o == optimizer and b == budget for x in v]

    def _index(self, results: list[Result]) -> tuple[dict, dict]:
        losses: dict[tuple, list[float]] = defaultdict(list)
        by_key: dict[tuple, list[Result]] = defaultdict(list)
        for res in sorted(results, key=lambda r: (r.run.seed, r.run.id)):
            key = (res.run.optimizer, float(res.run.lr), int(res.run.budget))
            self.planned[key] = self.planned.get(key, 0) + 1
            if res.counted:
                key = (res.run.optimizer, float(res.run.lr), int(res.run.budget))
                losses[key].append(res.loss)
                by_key[key].append(res)
        return losses, by_key

    def setting_best(self, optimizer: str, setting: tuple) -> tuple[float, float | None]:
        """(the lowest mean final loss over the lrs of `setting` at the largest budget, its lr)."""
        losses = self.sweep_table[optimizer][setting]
        means = [(stats.mean_std(v)[0], lr) for (o, lr, b), v in losses.items() if b == self.largest]
        means = sorted((m, lr) for m, lr in means if math.isfinite(m))
        return means[0] if means else (math.inf, None)

    def _best_setting(self, optimizer: str) -> tuple:
        """The sweep values with the lowest mean final loss at their best lr (ties: the first listed)."""
        return min(self.settings[optimizer], key=lambda st: self.setting_best(optimizer, st)[0])

    def _best_lr(self, optimizer: str) -> float | None:
        """The lr with the lowest mean final loss over seeds at the largest budget (ties: the
        smaller lr); None when no lr has a finite mean."""
        means = [(stats.mean_std(self.losses[(optimizer, lr, self.largest)])[0], lr) for lr in self.grid[optimizer]]
        means = [(m, lr) for m, lr in means if math.isfinite(m)]
        return min(means)[1] if means else None

    def chosen(self, optimizer: str, budget: int) -> tuple[tuple, float] | None:
        """The (sweep values, lr) the tuning seeds choose at `budget`: the lowest mean final loss over
        every setting and lr (ties: the setting listed first, then the smaller lr); at the largest
        budget, (best_setting, best). None when nothing has a finite mean there."""
        means = []
        for i, st in enumerate(self.settings[optimizer]):
            for (_, lr, b), v in self.sweep_table[optimizer][st].items():
                m = stats.mean_std(v)[0]
                if b == budget and math.isfinite(m):
                    means.append((m, i, lr, st))
        if not means:
            return None
        _, _, lr, st = min(means, key=lambda t: t[:3])
        return st, lr

    def at_best(self, optimizer: str, budget: int) -> list[float]:
        lr = self.best[optimizer]
        return [] if lr is None else self.losses[(optimizer, lr, budget)]


def extension_note(w: Workload, o: str, extend: dict | None) -> str:
    """What to do about a best lr at the edge of its grid, given how far lr.extend already went
    (`extend`: compare.json's lr_extend and lr_extend_max, and the plan's own grid per optimizer)."""
    if not extend or not extend.get("on"):
        return "rerun with lr.extend=true (adds lrs past that edge) or extend the grid"
    base = extend.get("base", {}).get((w.name, o), set())
    best, grid = w.best[o], w.grid[o]
    beyond = [lr for lr in grid if (lr > max(base) if best == grid[-1] else lr < min(base))] if base else []
    if len(beyond) >= extend.get("max", 0):
        return (f"lr.extend already added {len(beyond)} lr(s) on that side, its lr.extend_max: rerun with a larger "
                "lr.extend_max, or extend the grid")
    return "lr.extend has not finished extending it (rerun the command to continue), or extend the grid"


def section_summary(w: Workload, h: str, extend: dict | None = None) -> list[str]:
    out = [f"{h} Results per optimizer", "",
           f"Final val/loss at the best lr, mean ± std over seeds (ddof=1), per budget (steps). Best lr: the lowest "
           f"mean final val/loss at the largest budget ({w.largest}). Runs: run directories (trunks and branches); "
           "failed: status failed; diverged: a NaN/inf loss. A failed or diverged result counts as ∞.", ""]
    rows, notes = [], []
    for o in w.optimizers:
        mine = [r for r in w.runs if r.optimizer == o]
        cells = [f_mean(w.at_best(o, b), w.planned.get((o, w.best[o], b), 0)) if w.best[o] is not None
                 else f_loss(math.nan) for b in w.budgets]
        best = dict(w.best_setting[o])
        rows.append([o, f_lr(w.best[o]), *(best.get(k, "–") for k in w.knobs), sum(r.status != "missing" for r in mine),
                     sum(r.status == "failed" for r in mine), sum(bool(r.info.get("diverged")) for r in mine), *cells])
        grid, best = w.grid[o], w.best[o]
        pending = sum(res.why == "pending" for res in w.results
                      if res.run.optimizer == o and int(res.run.budget) == w.largest)
        if best is None and not w.losses_at(o, w.largest):
            notes.append(f"- {o}: no run at budget {w.largest} has finished yet ({pending} pending): no best lr.")
        elif best is None:
            notes.append(f"- {o}: no lr has a finite mean at budget {w.largest} (every lr has a failed or diverged "
                         f"seed{f'; {pending} pending' if pending else ''}): no best lr.")
        elif len(grid) == 1:
            notes.append(f"- {o}: a grid of one lr ({f_lr(best)}): nothing to say it is the best; "
                         "rerun with lr.points > 1.")
        elif best in (grid[0], grid[-1]):
            side = "smallest" if best == grid[0] else "largest"
            notes.append(f"- {o}: best lr {f_lr(best)} is the {side} of its grid ({', '.join(map(f_lr, grid))}): "
                         f"the optimum may lie beyond it: {extension_note(w, o, extend)} "
                         f"(lr.grid.{o}=[...], a larger lr.factor).")
    out += table(["optimizer", "best lr", *(f"best {k}" for k in w.knobs), "runs", "failed", "diverged",
                  *(f"S={b}" for b in w.budgets)], rows)
    trials = {o: w.trials(o) for o in w.optimizers}
    out += ["Trials (the settings each optimizer was tuned over: lrs × sweep values, lr.extend's included): "
            + ", ".join(f"{o} {n}" for o, n in trials.items())
            + ("." if len(set(trials.values())) <= 1 else " (**not the same for every optimizer**: "
               "sweep.<optimizer>.<knob>, lr.extend or tune=coordinate's search gave some more).") , ""]
    if notes:
        out += ["Edge of the grid:", "", *notes, ""]
    return out


def section_sweep(w: Workload, h: str) -> list[str]:
    """With sweep.<knob>: every setting's best mean final val/loss at the largest budget."""
    if not w.knobs:
        return []
    out = [f"{h} Sweep", "", f"Per optimizer and setting of the swept knobs ({', '.join(w.knobs)}): the lowest mean "
           f"final val/loss over its lrs at the largest budget ({w.largest}) and that lr. Each optimizer's "
           "tables above and below are at its best setting (*).", ""]
    rows = []
    for o in w.optimizers:
        for st in w.settings[o]:
            loss, lr = w.setting_best(o, st)
            values = dict(st)
            rows.append([o + (" *" if st == w.best_setting[o] else ""), *(values.get(k, "–") for k in w.knobs),
                         f_lr(lr), f_loss(loss)])
    return out + table(["optimizer", *w.knobs, "best lr", "final val/loss"], rows)


def attach_search(w: Workload, recorded: dict) -> None:
    """tune=coordinate: w.search[optimizer] = the coordinate search's path, replayed from compare.json's
    "search" (each space) and the results, as compare.py replayed it to choose its runs."""
    knobs = recorded.get("knobs") or {}
    spaces = [e for e in recorded.get("search") or [] if e.get("workload") == w.name and e.get("optimizer")]
    if not spaces or not w.budgets:
        return
    loss_of = tune.cell_losses({w.name: w}, int(knobs.get("seeds") or 1), lambda name: max(w.budgets))
    w.search = {}
    for entry in spaces:
        space = tune.Space.from_json(entry)
        w.search[entry["optimizer"]] = (space, tune.coordinate_path(
            space, loss_of(w.name, entry["optimizer"], space), float(knobs.get("coordinate_threshold", 0.0)),
            knobs.get("coordinate_max_trials")))


def section_search(w: Workload, h: str) -> list[str]:
    """tune=coordinate: each optimizer's search, one row per knob varied: the values tried with their
    mean final val/loss at the largest budget, and the setting kept."""
    paths = getattr(w, "search", {})
    if not paths:
        return []
    out = [f"{h} Tuning path (tune=coordinate)", "",
           f"Coordinate descent (Wen et al. 2025): per round, each knob in turn is varied with the others held at the "
           f"best setting so far; a value is kept when its mean final val/loss over the tuning seeds at the largest "
           f"budget ({w.largest}) beats the kept one by more than coordinate.threshold. (*) marks the value kept.", ""]
    for o in w.optimizers:
        if o not in paths:
            continue
        space, path = paths[o]
        names = [k for k, _ in space.axes]
        rows = []
        for st in path.steps:
            kept = st.after[names.index(st.axis)]
            rows.append([o, str(st.round), st.axis, ", ".join(
                f"{f_value(v)}: {f_num(x, '.4f')}{' (*)' if v == kept else ''}" for v, x in st.tried),
                "moved" if st.moved else "kept"])
        out += table(["optimizer", "round", "knob", "value: mean final val/loss", "incumbent"], rows)
        final = ", ".join(f"{k}={f_value(v)}" for k, v in zip(names, path.incumbent))
        out += [f"{o}: {path.trials} settings tried; {path.stop or 'still running (rerun the command to continue)'}; "
                f"setting: {final}.", ""]
    return out


def target_track(w: Workload, loss: float) -> dict[str, dict]:
    """target.loss / target.runs: per optimizer, its target-track runs (the setting chosen at the largest
    budget on fresh seeds): the step each run's val/loss curve (trunk, then cooldown branch) first reaches
    `loss` (stats.crossing, interpolated between evaluations; inf: not reached, a failed or diverged run
    included), its final val/loss (inf: failed or diverged), and the tests against the baseline's."""
    out: dict[str, dict] = {}
    for o in w.optimizers:
        mine = sorted((r for r in w.target_results if r.run.optimizer == o), key=lambda r: (r.run.seed, r.run.id))
        done = [r for r in mine if r.counted]
        hit = [stats.crossing(r.curve["loss"], loss, r.curve["step"]) if math.isfinite(r.loss) else None for r in done]
        out[o] = {"planned": len(mine), "n": len(done), "steps": [h[0] if h else math.inf for h in hit],
                  "final": [r.loss for r in done], "lr": float(done[0].run.lr) if done else None,
                  "setting": dict(done[0].run.setting) if done else {}}
    ref = out.get(w.reference)
    for o, t in out.items():
        t["reached"] = sum(math.isfinite(x) for x in t["steps"])
        finite = t["n"] >= 2 and all(math.isfinite(x) for x in t["final"])
        # modded-nanogpt's claim: the mean final val/loss is below the target (one-sided one-sample t-test)
        t["below"] = one_sided(float(np.mean(t["final"])) - loss, _se(t["final"]), t["n"] - 1) if finite else math.nan
        t["steps_diff"] = None
        if ref is not None and o != w.reference and t["n"] >= 2 and ref["n"] >= 2:
            every = all(math.isfinite(x) for x in (*t["steps"], *ref["steps"]))
            if every:  # fewer steps than the baseline's: Welch's t-test, one-sided
                d = significance.welch(t["steps"], ref["steps"], ALPHA)
                t["steps_diff"] = {"mean": d.mean, "low": d.low, "high": d.high, "df": d.df,
                                   "p_fewer": one_sided(d.mean, d.se, d.df)}
    return out


def _se(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) >= 2 else math.nan


def one_sided(mean: float, se: float, df: float) -> float:
    """P(T <= mean/se) for T ~ t(df): the one-sided p-value of "the true mean is below 0"."""
    from scipy.stats import t as student

    if not (math.isfinite(mean) and math.isfinite(se) and df > 0):
        return math.nan
    if se == 0:
        return 0.0 if mean < 0 else 1.0
    return float(student.cdf(mean / se, df))


def section_target(w: Workload, h: str, loss: float, runs: int) -> list[str]:
    track = getattr(w, "target_track", {})
    out = [f"{h} Target track (target.loss={loss:g}, target.runs={runs})", "",
           "modded-nanogpt's protocol: each optimizer's setting chosen at the largest budget "
           f"({w.largest}) on {runs} fresh seeds. Steps to target: where each run's val/loss curve (trunk, then "
           "cooldown branch) first reaches the target, interpolated between evaluations (their spacing is the "
           "resolution; ∞ if it does not). Δ steps: the mean difference from the baseline's, with its "
           f"{1 - ALPHA:.0%} Welch interval and the one-sided p of 'fewer steps' (only when every run of both "
           "reaches the target). p(final < target): the one-sided one-sample t-test that the mean final val/loss "
           "is below the target, the claim modded-nanogpt's records make (at p < 0.01).", ""]
    if not any(t["planned"] for t in track.values()):
        return out + ["No target-track runs yet (they start once every earlier run has finished).", ""]
    rows = []
    for o, t in track.items():
        steps, d = [x for x in t["steps"] if math.isfinite(x)], t["steps_diff"]
        mean, std = stats.mean_std(steps)
        rows.append([o, f_lr(t["lr"]) + "".join(f", {k}={v}" for k, v in t["setting"].items()),
                     f"{t['n']} of {t['planned']}", f"{t['reached']}/{t['n']}",
                     f"{mean:.1f} ± {std:.1f}" if steps and len(steps) == t["n"] else
                     f"{t['n'] - len(steps)} not reached",
                     "–" if d is None else
                     f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}], p={d['p_fewer']:.3g}",
                     f_mean(t["final"]), f_num(t["below"], ".3g")])
    return out + table(["optimizer", "setting", "runs", "reached", "steps to target", f"Δ steps vs {w.reference}",
                        "final val/loss", "p(final < target)"], rows)


def section_special(runs: dict[str, Run]) -> list[str]:
    """How optimizers that need no cooldown or read the run's length were run (plan.py), from
    their optimizer classes and what their runs' overrides say."""
    from optimizer import OPTIMIZERS

    notes = []
    for name in _order(r.optimizer for r in runs.values()):
        cls = OPTIMIZERS.get(name)
        if cls is not None and not cls.COOLDOWN:
            notes.append(f"- {name} needs no cooldown (its averaging replaces the lr decay): its branches keep the "
                         "trunk's constant lr to each budget.")
        knob = cls.RUN_LENGTH_KNOB if cls is not None else None
        if knob:
            values = sorted({o.split("=", 1)[1] for r in runs.values() if r.optimizer == name
                             for o in (r.info.get("overrides") or []) if o.startswith(f"optimizer.{knob}=")})
            notes.append(f"- {name} reads the run's length through optimizer.{knob}: set to "
                         f"{', '.join(values) or 'its default'} for every run, trunks and branches alike, so a "
                         "branch equals its run from scratch.")
    return ["Optimizers run apart from the protocol:", "", *notes, ""] if notes else []


def section_sensitivity(w: Workload, h: str, png: str) -> list[str]:
    out = [f"{h} LR sensitivity", "", f"Final val/loss at the largest budget ({w.largest}) per lr, mean ± std over "
           f"seeds; n: seeds with a result (∞: a failed or diverged seed).", "", f"![lr sensitivity]({png})", ""]
    rows = []
    for o in w.optimizers:
        for lr in w.grid[o]:
            vals = w.losses[(o, lr, w.largest)]
            rows.append([o, f_lr(lr), len(vals), f_mean(vals, w.planned.get((o, lr, w.largest), 0))])
    return out + table(["optimizer", "lr", "n", "final val/loss"], rows)


def mean_curve(results: list[Result]) -> dict[str, np.ndarray] | None:
    """The seeds' curves averaged per evaluation (step, tokens, seconds, loss), over the evaluation
    steps every seed logged; None when a seed failed or diverged (its curve never gets there)."""
    if not results or any(not math.isfinite(r.loss) for r in results):
        return None
    steps = sorted(set.intersection(*(set(r.curve["step"].tolist()) for r in results)))
    if not steps:
        return None
    rows = [np.searchsorted(r.curve["step"], steps) for r in results]
    return {k: np.mean([r.curve[k][i] for r, i in zip(results, rows)], axis=0)
            for k in ("step", "tokens", "seconds", "loss")}


def time_to_target(w: Workload) -> None:
    """Per optimizer at its best lr and the largest budget: the steps, tokens and seconds where
    the seeds' mean curve (mean_curve) first reaches w.target, interpolated between evaluations
    (stats.crossing; reached: <= target + 1e-9 |target|, so AdamW's mean curve reaches its own
    mean final loss); inf: not reached. Also how many seeds' own curves reach it."""
    for o in w.optimizers:
        lr = w.best[o]
        seeds = w.by_key[(o, lr, w.largest)] if lr is not None else []
        goal = w.target + 1e-9 * abs(w.target)
        reached = sum(math.isfinite(r.loss) and stats.crossing(r.curve["loss"], goal, r.curve["step"]) is not None
                      for r in seeds)
        mean = mean_curve(seeds)
        hit = stats.crossing(mean["loss"], goal, mean["step"], mean["tokens"], mean["seconds"]) if mean else None
        steps, tokens, seconds = hit if hit is not None else (math.inf,) * 3
        w.ttt[o] = {"steps": steps, "tokens": tokens, "seconds": seconds, "reached": reached, "n": len(seeds)}


def section_ttt(w: Workload, h: str, target_given: bool) -> list[str]:
    out = [f"{h} Time to target", ""]
    if w.target is None:
        return out + [f"No target: {w.reference} has no finite final val/loss at its best lr here, and no target= was "
                      "given.", ""]
    seeds = " over the evaluation seeds" if getattr(w, "ladder_seeds", "") == "evaluation" else ""
    source = "given as target=" if target_given else (f"{w.reference}'s mean final val/loss{seeds} at its chosen "
                                                       f"setting and lr at the largest budget ({w.largest})")
    out += [f"Target val/loss {w.target:.4f} ({source}).", ""]
    out += ladder.ttt_lines(w, w.reference)
    out += [f"{h}# Time to target on the largest budget's curve (secondary)", "",
            "At the best lr and the largest budget, on the seeds' mean "
            "val/loss curve (trunk, then cooldown branch; averaged per evaluation step, as are its tokens and "
            "seconds): the step, tokens and seconds where it first reaches the target, linearly interpolated "
            "between the two evaluations around the crossing; 'not reached' when it does not, or when a seed "
            "failed or diverged. Seeds: how many seeds' own curves reach the target. Secondary: the target is a "
            "cooled loss, so this constant-lr trunk mostly reaches it only inside its own final cooldown, and the "
            "figure is capped near the cooldown's start (the ladder above is the comparison's number).", ""]
    rows = []
    for o in w.optimizers:
        t = w.ttt[o]
        if not math.isfinite(t["steps"]):
            rows.append([o, f_lr(w.best[o]), f"{t['reached']}/{t['n']}", "not reached", "not reached", "not reached"])
        else:
            rows.append([o, f_lr(w.best[o]), f"{t['reached']}/{t['n']}", f"{t['steps']:.1f}", f"{t['tokens']:.0f}",
                         f"{t['seconds']:.2f}"])
    return out + table(["optimizer", "best lr", "seeds", "steps", "tokens", "seconds"], rows)


def section_speedup(w: Workload, h: str) -> list[str]:
    out = [f"{h} Speedup vs {w.reference} (data efficiency)", ""]
    if not w.metric.is_loss:
        return out + [f"Left out: D_eff fits a loss's shape L(D) = E + A·D^−α to the baseline's frontier, which an "
                      f"accuracy's error ({w.metric.label}) does not follow; rank by metric=val/loss for it.", ""]
    if w.reference not in w.optimizers or w.best.get(w.reference) is None:
        return out + [f"No {w.reference} result with a finite loss: no D_eff.", ""]
    return out + ladder.deff_lines(w, w.reference)


@dataclass
class Test:
    """One optimizer's comparison with the reference in one workload, at the largest budget."""
    optimizer: str
    seeds: str  # "evaluation" | "tuning"
    diff: significance.Difference  # the interval at 1 - ALPHA
    holm_p: float = math.nan
    holm: significance.Difference | None = None  # the interval at its Holm level
    verdict: str = ""


def _pairs(a: list[Result], b: list[Result]) -> tuple[list[float], list[float], bool]:
    """(a's losses, b's losses, paired): paired on the seeds both ran with the same (random_seed,
    data_seed) and a finite loss, in the same order; when no seed pairs, every finite loss of each
    side, unpaired (Welch)."""
    ka = {r.run.seed_key: r.loss for r in a if math.isfinite(r.loss)}
    kb = {r.run.seed_key: r.loss for r in b if math.isfinite(r.loss)}
    common = sorted(set(ka) & set(kb), key=repr)
    if common:
        return [ka[k] for k in common], [kb[k] for k in common], True
    return list(ka.values()), list(kb.values()), False


def _sample(w: Workload, optimizer: str) -> tuple[list[Result], str]:
    """The results a test reads: the evaluation seeds at the largest budget when the comparison has
    them, else the tuning seeds at the best lr (and setting)."""
    if any(o == optimizer and b == w.largest for o, b in w.evaluation):
        return w.evaluation[(optimizer, w.largest)], "evaluation"
    lr = w.best[optimizer]
    return (w.by_key.get((optimizer, lr, w.largest), []) if lr is not None else []), "tuning"


def significance_tests(workloads: list[Workload]) -> dict[tuple[str, str], Test]:
    """(workload, optimizer) -> its Test against the workload's baseline (w.reference): a paired t-test on the per-seed
    differences where the seeds pair, Welch's otherwise; the 95% CI; Holm's correction over the family
    of every test with >= MIN_SEEDS seeds across optimizers and workloads; the verdict read from the
    Holm interval (significance.verdict)."""
    tests: dict[tuple[str, str], Test] = {}
    for w in workloads:
        if w.reference not in w.optimizers or not w.budgets:
            continue
        ref, ref_seeds = _sample(w, w.reference)
        for o in w.optimizers:
            if o == w.reference:
                continue
            mine, seeds = _sample(w, o)
            a, b, paired = _pairs(mine, ref)
            test = significance.paired if paired else significance.welch
            tests[(w.name, o)] = Test(o, seeds if seeds == ref_seeds else "mixed", test(a, b, ALPHA))
    family = [k for k, t in tests.items() if t.diff.n >= MIN_SEEDS and not math.isnan(t.diff.p)]
    adjusted = significance.holm([tests[k].diff.p for k in family])
    levels = significance.holm_levels([tests[k].diff.p for k in family], ALPHA)
    for k, p, level in zip(family, adjusted, levels):
        tests[k].holm_p, tests[k].holm = p, tests[k].diff.at(level)
    for t in tests.values():
        t.verdict = significance.verdict(t.holm or t.diff, MIN_SEEDS)
    return tests


def _interval(d: significance.Difference | None) -> str:
    if d is None or math.isnan(d.low):
        return "–"
    return f"[{d.low:.4f}, {d.high:.4f}]"


def section_significance(w: Workload, h: str, tests: dict[tuple[str, str], Test], eval_planned: int = 0) -> list[str]:
    out = [f"{h} Significance vs {w.reference}", ""]
    if w.reference not in w.optimizers:
        return out + [f"No {w.reference} runs: no test.", ""]
    mine = [t for (name, _), t in tests.items() if name == w.name]
    family = [k for k, t in tests.items() if t.holm is not None]
    if any(t.seeds != "evaluation" for t in mine):
        why = (f"the evaluation runs (seeds.eval={eval_planned}) have not all run yet ({w.evaluation_pending} "
               "pending)" if eval_planned else "this comparison has no evaluation seeds (seeds.eval=0)")
        out += [f"**These tests use the tuning seeds**, the seeds each best lr and setting was chosen on, because "
                f"{why}: the chosen setting's mean is the lowest of several noisy means, so these tests are biased "
                "toward the winner (most for an optimizer with a flat lr landscape) and a verdict may be spurious. "
                "Rerun with seeds.eval=M to test the chosen settings on fresh seeds.", ""]
    else:
        out += [f"These tests use the evaluation seeds: each optimizer's setting chosen on the tuning seeds at the "
                f"largest budget ({w.largest}), run again on fresh seeds (seeds.eval), so the choice does not bias "
                "them.", ""]
    out += [f"Difference: the optimizer's final val/loss minus {w.reference}'s at the largest budget ({w.largest}), "
            f"negative: lower loss. **Paired** t-test on the per-seed differences where seed k of both ran with the "
            f"same random_seed and data_seed (the same initialisation and data order; seeds without a finite loss "
            "on both sides are left out; n: pairs); **Welch**'s t-test where no seed pairs (n: the smaller side). "
            f"CI: the {1 - ALPHA:.0%} confidence interval of the mean difference. **Holm**'s correction over the "
            f"family of every optimizer × workload compared with {w.reference} with ≥ {MIN_SEEDS} seeds "
            f"(m = {len(family)}: {', '.join(f'{o} in {n}' for n, o in family) or 'none'}): Holm p is the adjusted "
            f"p-value; the Holm interval is the interval at level 1 − {ALPHA}/(m − r + 1), r the test's rank by p "
            "(frozen at the rank where Holm's step-down stops), which excludes 0 exactly when Holm rejects. Verdict, "
            "from the Holm interval: **better** (all of it below 0), **worse** (above 0), else **inconclusive**; "
            f"with fewer than {MIN_SEEDS} seeds **inconclusive (n=k)**: not a finding of no difference.", ""]
    rows = []
    for t in mine:
        d = t.diff
        rows.append([t.optimizer, t.seeds, d.method, d.n, f_num(d.mean, ".4f"), _interval(d), _interval(t.holm),
                     f_num(d.p, ".3g"), f_num(t.holm_p, ".3g"), t.verdict])
    out += table(["optimizer", "seeds", "test", "n", f"mean − {w.reference}", f"{1 - ALPHA:.0%} CI", "Holm interval",
                  "p", "Holm p", "verdict"], rows)
    if w.evaluation:
        out += ["Evaluation seeds per budget: the setting the tuning seeds chose at each budget (lr and swept "
                "values), its final val/loss on the evaluation seeds, mean ± std (ddof=1), n seeds.", ""]
        rows = []
        for o in w.optimizers:
            cells = []
            for bud in w.budgets:
                res = w.evaluation.get((o, bud), [])
                if not res:
                    cells.append("–")
                    continue
                swept = "".join(f", {k}={v}" for k, v in res[0].run.setting)
                planned = max(w.evaluation_planned.get((o, bud), 0), len(res))
                cells.append(f"lr {f_lr(res[0].run.lr)}{swept}: {f_loss(*stats.mean_std([r.loss for r in res]))} "
                             f"(n={len(res)}" + (f" of {planned})" if len(res) < planned else ")"))
            rows.append([o, *cells])
        out += table(["optimizer", *(f"S={bud}" for bud in w.budgets)], rows)
    return out


def cost(w: Workload, optimizer: str) -> tuple[float, float]:
    """(median time/step_sec over every record of the optimizer's runs, median optim/state_bytes
    over its runs)."""
    mine = [r for r in w.runs if r.optimizer == optimizer]
    state = [v for r in mine for v in _column(r.records, STATE_BYTES)[1][:1]]
    return step_time(*mine), float(np.median(state)) if state else math.nan


def overheads(w: Workload, optimizer: str) -> dict[str, float]:
    """Per run of the optimizer, medians over its runs: compilation (`time/compile_sec` summed),
    evaluation (`time/eval_sec` summed), start-up (`time/startup_sec`), wall clock (the last
    `time/elapsed_sec`), and how many evaluations a run made."""
    mine = [r for r in w.runs if r.optimizer == optimizer]

    def med(xs):
        xs = [x for x in xs if math.isfinite(x)]
        return float(np.median(xs)) if xs else math.nan

    return {"compile": med([_total(r, COMPILE) for r in mine]), "eval": med([_total(r, EVAL) for r in mine]),
            "startup": med([_total(r, STARTUP) for r in mine]),
            "elapsed": med([float(v[-1]) for r in mine if len(v := _column(r.records, ELAPSED)[1])]),
            "evals": med([float(len(_column(r.records, EVAL)[1])) for r in mine])}


def section_cost(w: Workload, h: str) -> list[str]:
    devices = sorted({r[DEVICE] for run in w.runs for r in run.records if isinstance(r.get(DEVICE), str)})
    out = [f"{h} Cost", "", "Step time: the median `time/step_sec` over every logged record of the optimizer's "
           "runs in this comparison (trunks and branches): each a running median of clean intervals, from which "
           "compilation, evaluation and saves are left out (docs/metrics.md); the curves' and time to target's "
           "seconds are steps × this. State: the median `optim/state_bytes` over its runs. "
           f"Relative: divided by {w.reference}'s. Measured on: {', '.join(devices) or 'not logged'}.", ""]
    ref_t, ref_b = cost(w, w.reference) if w.reference in w.optimizers else (math.nan, math.nan)
    rows = []
    for o in w.optimizers:
        t, b = cost(w, o)
        rows.append([o, f_num(t, ".6g"), f_num(t / ref_t, ".3f"), f_num(b, ".0f"), f_num(b / ref_b, ".3f")])
    out += table(["optimizer", "step time (s)", f"× {w.reference}", "state bytes", f"× {w.reference}"], rows)
    out += ["Overheads, apart from the step time, per run (the median over the optimizer's runs): compilation "
            "(`time/compile_sec` summed: each run, trunk or branch, compiles in a run of its own), "
            "evaluation (`time/eval_sec` summed, over that many evaluations), start-up before the first step "
            "(`time/startup_sec`: building, restoring) and the wall clock at the run's end (`time/elapsed_sec`, "
            "which holds all of these).", ""]
    rows = []
    for o in w.optimizers:
        x = overheads(w, o)
        rows.append([o, f_num(x["compile"], ".3g"), f_num(x["eval"], ".3g"), f_num(x["evals"], ".3g"),
                     f_num(x["startup"], ".3g"), f_num(x["elapsed"], ".3g")])
    return out + table(["optimizer", "compile (s)", "evaluation (s)", "evaluations", "start-up (s)", "elapsed (s)"],
                       rows)


# --------------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas on bare Figures: no display, no pyplot state)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: str) -> None:
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _legend_or_note(ax, empty: str) -> bool:
    """The legend when something was drawn; else `empty` written across the axes (no legend, so
    matplotlib has nothing to warn about). True when something was drawn."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
        return True
    ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="grey")
    return False


def _lr_ticks(ax, lrs) -> None:
    """A log lr axis labelled at the lrs that were run (at most 8, thinned evenly), not at every
    minor tick: grids of factor 2 or 3 put minor labels on top of each other."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    lrs = sorted(set(lrs))
    if not lrs:
        return
    step = max(1, math.ceil(len(lrs) / 8))
    ax.xaxis.set_major_locator(FixedLocator(lrs[::step]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticklabels([f_lr(lr) for lr in lrs[::step]], rotation=30, ha="right", fontsize="small")


def _colours(names: list[str]) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def plot_sensitivity(w: Workload, path: str) -> None:
    fig, ax = _figure()
    fig.subplots_adjust(bottom=0.18)  # room for the slanted lr labels
    colour = _colours(w.optimizers)
    drawn = []
    for o in w.optimizers:
        pts = [(lr, *stats.mean_std(w.losses[(o, lr, w.largest)]), len(w.losses[(o, lr, w.largest)]))
               for lr in w.grid[o]]
        pts = [(lr, m, 0.0 if math.isnan(s) else s, n) for lr, m, s, n in pts if math.isfinite(m)]
        if pts:
            lr, m, s, n = zip(*pts)
            seeds = f"{min(n)}" if min(n) == max(n) else f"{min(n)}-{max(n)}"
            ax.errorbar(lr, m, yerr=s, marker="o", capsize=3, color=colour[o], label=f"{o} (± std, {seeds} seeds)")
            drawn += lr
    ax.set_xscale("log")
    _lr_ticks(ax, drawn)
    ax.set(xlabel="learning rate", ylabel=f"final {w.metric.label} (mean over seeds)",
           title=f"final {w.metric.label} vs lr (budget {w.largest}; bars: ± one std over seeds)")
    ax.grid(alpha=0.3)
    _legend_or_note(ax, "no finished run with a finite loss yet")
    _save(fig, path)


def plot_curves(w: Workload, x: str, path: str) -> None:
    fig, ax = _figure()
    colour = _colours(w.optimizers)
    for o in w.optimizers:
        lr = w.best[o]
        for i, r in enumerate(w.by_key.get((o, lr, w.largest), [])):
            c = r.curve
            keep = np.isfinite(c.get(x, np.array([]))) & np.isfinite(c.get("loss", np.array([])))
            if keep.any():
                ax.plot(c[x][keep], c["loss"][keep], color=colour[o], alpha=0.8, marker=".",
                        label=f"{o} lr={f_lr(lr)}" if i == 0 else None)
    if w.target is not None:
        ax.axhline(w.target, color="grey", linestyle=":", label="target")
    ax.set(xlabel="training tokens" if x == "tokens" else "training seconds (steps × clean step time)",
           ylabel=w.metric.label,
           title=f"{w.metric.label} at the best lr (budget {w.largest}, every seed)")
    ax.grid(alpha=0.3)
    _legend_or_note(ax, "no finished curve yet")
    _save(fig, path)


def plot_profiles(curves: dict[str, np.ndarray], taus: np.ndarray, path: str) -> None:
    fig, ax = _figure()
    colour = _colours(list(curves))
    for o, rho in curves.items():
        ax.step(taus, rho, where="post", color=colour[o], label=o)
    ax.set(xlabel="τ (time to target within τ × the best)", ylabel="share of workloads", ylim=(-0.02, 1.02),
           title="performance profiles (wall-clock time to target)")
    ax.grid(alpha=0.3)
    _legend_or_note(ax, "no optimizer reached the target yet")
    _save(fig, path)


# --------------------------------------------------------------------------------------------
# The report


def section_profiles(workloads: list[Workload], compare_dir: str, into: dict | None = None) -> list[str]:
    """The profiles section; `into` (a dict) gets the printed numbers (summary.json's "profiles")."""
    into = {} if into is None else into
    out = ["## Across workloads", ""]
    if len(workloads) < 2:
        return out + ["Performance profiles and the geometric-mean speedup need ≥ 2 workloads (run.json "
                      "\"workload\"); this comparison has one.", ""]
    reference = workloads[0].reference  # one baseline for the whole comparison (baseline_of)
    names = _order((o for w in workloads for o in w.optimizers), reference)
    times = {o: [ladder.profile_seconds(w, o) for w in workloads] for o in names}
    grid = np.linspace(1.0, 4.0, 301)
    plot_profiles(stats.performance_profile(times, grid), grid, os.path.join(compare_dir, "performance_profile.png"))
    printed = stats.performance_profile(times, TAUS)
    into.update(taus=list(TAUS), share={o: [float(v) for v in printed[o]] for o in names}, geometric_mean_speedup={})
    out += ["Performance profiles (AlgoPerf): for each τ, the share of workloads on which the optimizer's "
            "wall-clock seconds to its workload's target on the budget ladder (the time-to-target tables) are within "
            "τ × the best optimizer's; '> S_max' (not reached) counts as never within, '≤ S_min' at the smallest "
            "budget's seconds (an upper bound on its time).", "",
            "![performance profiles](performance_profile.png)", ""]
    score = stats.profile_score(times, TAUS[-1])
    into["score"] = {"tau_max": TAUS[-1], **score}
    out += [f"Score (AlgoPerf's): the area under the profile from τ = 1 to {TAUS[-1]:g}, divided by {TAUS[-1] - 1:g}; "
            f"1 is the fastest on every workload, 0 never within {TAUS[-1]:g}× of the fastest.", ""]
    out += table(["optimizer", *(f"τ={t:g}" for t in TAUS), "score"],
                 [[o, *(f"{v:.3f}" for v in printed[o]), f"{score[o]:.3f}"] for o in names])
    if reference in names:
        out += [f"Geometric-mean speedup over the workloads: {reference}'s seconds to target on the ladder divided "
                "by the optimizer's, per workload, over the workloads where at least one of the two reaches the target "
                f"within the largest budget (∞ where only the optimizer does, 0 where only {reference} does); a "
                "'≤ S_min' time counts at the smallest budget's seconds.", ""]
        rows = []
        for o in names:
            ratios = [a / b if math.isfinite(b) else 0.0 for a, b in zip(times[reference], times[o])
                      if math.isfinite(a) or math.isfinite(b)]
            into["geometric_mean_speedup"][o] = stats.geometric_mean(ratios)
            rows.append([o, f_num(stats.geometric_mean(ratios), ".3f")])
        out += table(["optimizer", "geometric-mean speedup"], rows)
    return out


def _f_trend(t: dict | None) -> str:
    if t is None:
        return "–"
    iv = t["slope_interval"]
    return f"{t['slope']:+.3f}" + (f" {f_iv(iv)}" if iv else "") + ladder._unknown(iv)


def f_params(n: float) -> str:
    """A parameter count as 8.94k, 124M, 1.2B (3 significant digits)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def f_iv(iv) -> str:
    """An interval as the ladder tables print it ([lo, hi], a bound's flag kept)."""
    return ladder.f_interval(iv, ".3f") if iv else "–"


def section_sizes(lad: dict | None, compare_dir: str) -> list[str]:
    """The workloads as a model-size ladder (compare/sizes.py): speedup against parameters, its trend, the best lrs."""
    if lad is None:
        return []
    ref, sized = lad["reference"], lad["workloads"]
    out = ["## Across model sizes", "",
           f"The workloads as model sizes (their runs' `model/params`). Per optimizer and size, the speedup over {ref} "
           "the workload's sections print: time to target on the budget ladder, and D_eff/D at the largest budget, "
           f"each with its {ladder.LEVEL:.0%} bootstrap interval; then the trend: the least-squares line of the "
           "speedup against log10(parameters), its slope the change per 10× parameters, with an interval from the "
           "sizes' resamples joined draw by draw (a draw where a size's value is a bound has no slope, and is "
           "counted).", "",
           "![speedup against model size](speedup_vs_size.png)", ""]
    rows = []
    for o, row in lad["optimizers"].items():
        for key, label in (("ttt", "time-to-target speedup"), ("deff", "D_eff/D at S_max")):
            if key in row:
                cells = [f"{ladder.f_bounded(*v, '.3f')} {f_iv(iv)}" for v, iv, _ in row[key]["per_size"]]
                rows.append([o, label, *cells, _f_trend(row[key]["trend"])])
    out += table(["optimizer", "speedup", *(f"{name} ({f_params(n)})" for name, n in sized), "slope per 10× params"],
                 rows)
    out += ["Best lr per size (the lowest mean final val/loss at the size's largest budget) and the exponent e of "
            "the least-squares fit lr ∝ N^e (0: the lr transfers across sizes).", ""]
    out += table(["optimizer", *(name for name, _ in sized), "e"],
                 [[o, *(f_lr(row["lr"][name]) for name, _ in sized), f_num(row["lr_exponent"], "+.3f")]
                  for o, row in lad["optimizers"].items()])
    plot_sizes(lad, os.path.join(compare_dir, "speedup_vs_size.png"))
    return out


def plot_sizes(lad: dict, path: str) -> None:
    """Speedup against parameters per optimizer (time to target: filled; D_eff/D: hollow), error bars
    the intervals, and each trend line."""
    fig, ax = _figure()
    params = np.array([n for _, n in lad["workloads"]], float)
    names = list(lad["optimizers"])
    colours = _colours(names)
    xs = np.geomspace(params.min(), params.max(), 50)
    for o, row in lad["optimizers"].items():
        for key, marker, label in (("ttt", "o", "time to target"), ("deff", "s", "D_eff/D")):
            if key not in row:
                continue
            per = row[key]["per_size"]
            ok = [i for i, ((v, f), _, _) in enumerate(per) if f != "?" and math.isfinite(v)]
            if not ok:
                continue
            y = np.array([per[i][0][0] for i in ok])
            lo = np.array([per[i][1][0] if per[i][1] else np.nan for i in ok])
            hi = np.array([per[i][1][2] if per[i][1] else np.nan for i in ok])
            err = np.vstack([np.where(np.isfinite(lo), np.maximum(y - lo, 0), 0),
                             np.where(np.isfinite(hi), np.maximum(hi - y, 0), 0)])
            ax.errorbar(params[ok], y, yerr=err, fmt=marker, color=colours[o], capsize=3,
                        mfc=colours[o] if key == "ttt" else "none", label=f"{o}: {label}")
            t = row[key]["trend"]
            if t is not None:
                ax.plot(xs, t["intercept"] + t["slope"] * np.log10(xs), color=colours[o],
                        linestyle="-" if key == "ttt" else "--", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"speedup over {lad['reference']}")
    ax.set_title("Speedup against model size")
    _legend_or_note(ax, "no speedup with a value")
    _save(fig, path)


def sizes_json(lad: dict) -> dict:
    """summary.json's "sizes": the numbers section_sizes prints."""
    out = {"params": dict(lad["workloads"]), "reference": lad["reference"], "optimizers": {}}
    for o, row in lad["optimizers"].items():
        x: dict = {"best_lr": row["lr"], "lr_exponent": row["lr_exponent"]}
        for key, name in (("ttt", "time_to_target_speedup"), ("deff", "d_eff_over_d")):
            if key in row:
                t = row[key]["trend"]
                x[name] = {"per_size": {wn: {"value": v, "flag": f, "interval": _interval_json(iv)}
                                        for (wn, _), ((v, f), iv, _) in zip(lad["workloads"], row[key]["per_size"])},
                           "slope": t["slope"] if t else None, "intercept": t["intercept"] if t else None,
                           "slope_interval": _interval_json(t["slope_interval"]) if t else None}
        out["optimizers"][o] = x
    return out


def load_workloads(compare_dir: str, target: float | None = None) -> list[Workload]:
    """The comparison under `compare_dir` read back: a Workload per workload name (sorted), each
    with its results and target. DataError: no runs, or a workload whose runs' data fingerprints differ."""
    return _load(os.path.abspath(compare_dir), target)[2]


def _load(compare_dir: str, target: float | None) -> tuple[dict[str, Run], dict[str, Result], list[Workload],
                                                          dict[str, str | None]]:
    runs = load_runs(compare_dir)
    plan = read_plan(compare_dir)
    if plan is not None:
        classify(runs, plan)
    names = sorted({r.workload for r in runs.values()})
    fingerprints = {}
    for name in names:
        # Runs of one workload train on one dataset; with seeds.vary_data each data_seed is its own order.
        orders: dict[str | None, dict[str, Run]] = defaultdict(dict)
        for k, r in runs.items():
            if r.workload == name:
                orders[r.seed_key[1]][k] = r
        try:
            found = {seed: check_fingerprints(group) for seed, group in orders.items()}
        except DataError as e:
            raise DataError(f"workload {name}: {e}" if len(names) > 1 else str(e)) from None
        logged = sorted({fp for fp in found.values() if fp is not None})
        fingerprints[name] = None if not logged else logged[0] if len(logged) == 1 else (
            f"{len(logged)} data orders (seeds.vary_data), e.g. {logged[0]}")
    metric = metric_of(compare_dir)
    results: dict[str, Result] = {}
    for run in runs.values():
        if run.kind == "branch":
            results[run.id] = make_result(run, runs.get(run.info.get("trunk") or ""), metric)
    workloads = []
    baseline = baseline_of(compare_dir, (r.optimizer for r in runs.values()))
    for name in names:
        w = Workload(name, [r for r in runs.values() if r.workload == name],
                     [res for res in results.values() if res.run.workload == name], reference=baseline, metric=metric)
        ref = stats.mean_std(w.at_best(baseline, w.largest))[0] if baseline in w.optimizers else math.nan
        w.target = target if target is not None else (ref if math.isfinite(ref) else None)
        ladder.attach(w, baseline, target is not None)  # with evaluation seeds: the target is theirs
        if w.target is not None:
            time_to_target(w)
        workloads.append(w)
    return runs, results, workloads, fingerprints


def knob_name(key: str) -> str:
    """compare.json's field -> the knob a user types (lr_points -> lr.points)."""
    if key == "seeds":
        return "seeds.tune"
    for group in ("lr_", "cooldown_", "seeds_"):
        if key.startswith(group):
            return f"{group[:-1]}.{key[len(group):]}"
    return key


def describe_session(session: dict) -> str:
    commit = str(session.get("commit", "unknown"))
    dirty = {True: " with uncommitted changes", False: "", None: ""}.get(session.get("dirty"), "")
    versions = ", ".join(f"{k} {v}" for k, v in (session.get("versions") or {}).items())
    machine = f"CPU {session.get('cpu', '?')}; device {session.get('device') or '?'}"
    python = f"Python {session.get('python', '?')}"
    return f"{session.get('date', '?')}: commit `{commit[:12]}`{dirty}; {versions}; {python}; {machine}"


def section_provenance(sessions: list[dict]) -> list[str]:
    """What the comparison ran with (compare.json's provenance, one entry per differing session)."""
    if not sessions:
        return ["Set-up: not recorded (a comparison directory from before compare.json kept it).", ""]
    if len(sessions) == 1:
        return [f"Set-up: {describe_session(sessions[0])}.", ""]
    return [f"Set-up: **the runs were started in {len(sessions)} sessions on different set-ups** (code, packages "
            "or machine): results may not compare.", "", *(f"- {describe_session(s)}" for s in sessions), ""]


MISSING_LISTED = 5  # missing run ids the completeness table names per optimizer


def section_completeness(runs: dict[str, Run], planned: bool, reference: str = REFERENCE) -> list[str]:
    """Every planned run of compare.json (and lr.extend's on disk) counted per optimizer as finished,
    diverged, failed, missing or pending; without a plan, one line saying nothing was checked."""
    if not planned:
        return ["Completeness: not checked (no plan in compare.json: a directory from before it held one); "
                "the tables read whatever runs are on disk.", ""]
    rows_of = completeness(runs)
    several = len({w for w, _ in rows_of}) > 1
    rows = []
    for (workload, o), c in sorted(rows_of.items(), key=lambda kv: (kv[0][0], kv[0][1] != reference, kv[0][1])):
        ids = c["missing_ids"]
        listed = ", ".join(ids[:MISSING_LISTED]) + (f" (+{len(ids) - MISSING_LISTED} more)"
                                                    if len(ids) > MISSING_LISTED else "")
        rows.append([*([workload] if several else []), o, c["planned"], *(c[st] for st in STATES), listed or "–"])
    out = ["Completeness: every run of the plan (compare.json's runs and evaluation runs, and lr.extend's "
           "on disk), trunks and branches. Missing: planned, but its directory, run.json or metrics.jsonl is gone, "
           "or it is done without a final val/loss, or its trunk is missing: left out of every mean (never ∞), "
           "and a mean over fewer seeds than planned says \"(n=k of N)\". Pending: not run yet.", ""]
    missing = sum(c["missing"] for c in rows_of.values())
    if missing:
        out += [f"**{missing} planned runs are missing**: their results are left out (rerun the comparison with "
                "the same dir= after deleting the broken run directories to run them again).", ""]
    return out + table([*(["workload"] if several else []), "optimizer", "planned", *STATES, "missing runs"], rows)


def build_report(compare_dir: str, target: float | None = None) -> str:
    """Read the runs under `compare_dir`, write results.csv, the PNGs and report.md there;
    return report.md's path. DataError: no runs, or runs whose data fingerprints differ."""
    compare_dir = os.path.abspath(compare_dir)
    runs, results, workloads, fingerprints = _load(compare_dir, target)
    planned = any(r.state for r in runs.values())  # _load checked the runs against compare.json's plan
    metric = metric_of(compare_dir)
    write_csv(compare_dir, runs, results, metric)
    tests = significance_tests(workloads)
    knobs, sessions, extend = {}, [], None
    if os.path.isfile(os.path.join(compare_dir, "compare.json")):
        with open(os.path.join(compare_dir, "compare.json"), encoding="utf-8") as f:
            recorded = json.load(f)
        knobs, sessions = recorded.get("knobs", {}), recorded.get("provenance", [])
        base: dict[tuple[str, str], set[float]] = defaultdict(set)
        for r in recorded.get("runs", []):  # the plan's own lrs: lr.extend's are not in it
            base[(r.get("workload"), r.get("optimizer"))].add(float(r.get("lr")))
        extend = {"on": knobs.get("lr_extend"), "max": knobs.get("lr_extend_max", 0), "base": dict(base)}
        for w in workloads:
            attach_search(w, recorded)
    names = [w.name for w in workloads]
    fingerprint = ", ".join(f"{n}: {fingerprints[n] or 'not logged'}" for n in names) if len(names) > 1 else (
        fingerprints[names[0]] or "not logged")

    pending = [r.run.id for r in results.values() if r.why == "pending"]
    trunks = sum(r.kind == "trunk" for r in runs.values())
    lines = ["# Optimizer comparison", "",
             f"{len(runs)} runs ({trunks} trunks, {len(results)} cooldown branches) in `{compare_dir}`; "
             f"data fingerprint: {fingerprint or 'not logged'}; workloads: {', '.join(names)}.", ""]
    if knobs:
        lines += ["Knobs: " + ", ".join(f"`{knob_name(k)}={v}`" for k, v in knobs.items()), ""]
    lines += section_provenance(sessions)
    baseline = workloads[0].reference if workloads else REFERENCE
    lines += [f"Baseline: {baseline} (every speedup, test and cost below is relative to it; compare.py baseline=).", ""]
    lines += section_completeness(runs, planned, baseline)
    if pending:
        lines += [f"Pending (not run yet, left out of every table): {len(pending)} branches "
                  f"({', '.join(pending[:5])}{' …' if len(pending) > 5 else ''}).", ""]
    lines += section_metric(metric)
    lines += on_metric(["A result is a cooldown branch's final val/loss; failed and diverged runs count as ∞, missing "
                        "ones are left out (n=k of N). Every number of the tables: `summary.json`. "
                        "Every run: `results.csv`. What each number means: docs/compare.md.", ""], metric)
    lines += section_special(runs)
    for w in workloads:
        h = "###" if len(workloads) > 1 else "##"
        suffix = f"_{w.name}" if len(workloads) > 1 else ""
        if len(workloads) > 1:
            lines += [f"## Workload {w.name}", ""]
        if not w.budgets:
            lines += ["No cooldown branches in this workload: nothing to compare.", ""]
            continue
        sens, tok, sec = (f"lr_sensitivity{suffix}.png", f"curves_tokens{suffix}.png", f"curves_seconds{suffix}.png")
        plot_sensitivity(w, os.path.join(compare_dir, sens))
        plot_curves(w, "tokens", os.path.join(compare_dir, tok))
        plot_curves(w, "seconds", os.path.join(compare_dir, sec))
        ranked = section_summary(w, h, extend) + section_sweep(w, h) + section_search(w, h)
        ranked += section_sensitivity(w, h, sens)
        ranked += [f"{h} Curves at the best lr", "", "val/loss of every seed at each optimizer's best lr and the "
                   "largest budget: the trunk, then the cooldown branch.", "", f"![vs tokens]({tok})", "",
                   f"![vs seconds]({sec})", ""]
        ranked += section_ttt(w, h, target is not None)
        lines += on_metric(ranked, metric) + section_speedup(w, h)
        lines += on_metric(section_significance(w, h, tests, int(knobs.get("seeds_eval") or 0)), metric)
        if knobs.get("target_loss") is not None:
            w.target_track = target_track(w, float(knobs["target_loss"]))
            lines += section_target(w, h, float(knobs["target_loss"]), int(knobs.get("target_runs") or 0))
        lines += section_cost(w, h)
    profiles: dict = {}
    lines += on_metric(section_profiles(workloads, compare_dir, profiles), metric)
    size_ladder = sizes.ladder_of(workloads)
    lines += on_metric(section_sizes(size_ladder, compare_dir), metric)
    write_summary(compare_dir, {**summary_of(runs, workloads, tests, planned, profiles),
                                "metric": {"name": metric.name, "reported_as": metric.label},
                                **({"sizes": sizes_json(size_ladder)} if size_ladder else {})})
    path = os.path.join(compare_dir, "report.md")
    with atomic_write(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines).rstrip() + "\n")
    return path


# --------------------------------------------------------------------------------------------
# summary.json: every derived number the report prints, from the same values


def _jsonable(x):
    """JSON without NaN/Infinity: nan -> null, ±inf -> "inf"/"-inf"; numpy scalars -> Python; tuple keys joined."""
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else str(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf") if math.isinf(x) else x
    return x


def _interval_json(iv) -> dict | None:
    """ladder.interval's (low, low flag, high, high flag, resamples without a number)."""
    if not iv:
        return None
    lo, lf, hi, hf, unknown = iv
    return {"low": lo, "low_flag": lf, "high": hi, "high_flag": hf, "resamples_without": unknown}


def _mean_json(values: list[float], planned: int) -> dict:
    m, sd = stats.mean_std(values)
    return {"mean": m, "std": sd, "n": len(values), "planned": max(planned, len(values))}


def _diff_json(d: significance.Difference | None) -> dict | None:
    return None if d is None else {"method": d.method, "n": d.n, "mean": d.mean, "se": d.se, "df": d.df, "t": d.t,
                                   "p": d.p, "level": d.level, "low": d.low, "high": d.high}


def workload_summary(w: Workload, tests: dict[tuple[str, str], Test]) -> dict:
    """One workload's numbers, each the value its report section prints."""
    deff = getattr(w, "deff", None)
    out = {"budgets": list(w.budgets), "largest": w.largest, "target": w.target,
           "ladder_seeds": getattr(w, "ladder_seeds", "tuning"), "optimizers": {}}
    if deff is not None:
        law = deff["law"]
        out["d_eff_fit"] = {"shape": deff["shape"].label or "ok", "why": deff["why"],
                            "alpha": law.alpha if law else None, "beta": law.beta if law else None,
                            "gamma": law.gamma if law else None,
                            "residuals": ({str(b): float(r) for b, r in zip(
                                w.budgets, law.loss(deff["reader"].tokens) - deff["reader"].mean)}
                                if law is not None and deff["reader"] is not None else None)}
    ref_t, ref_b = cost(w, w.reference) if w.reference in w.optimizers else (math.nan, math.nan)
    for o in w.optimizers:
        mine = [r for r in w.runs if r.optimizer == o]
        best = w.best[o]
        x: dict = {"best_lr": best, "best_setting": dict(w.best_setting[o]), "trials": w.trials(o),
                   "runs": sum(r.status != "missing" for r in mine), "failed": sum(r.status == "failed" for r in mine),
                   "diverged": sum(bool(r.info.get("diverged")) for r in mine)}
        x["at_best"] = {str(b): _mean_json(w.at_best(o, b), w.planned.get((o, best, b), 0)) for b in w.budgets} \
            if best is not None else {}
        x["sensitivity"] = [{"lr": lr, **_mean_json(w.losses[(o, lr, w.largest)], w.planned.get((o, lr, w.largest), 0))}
                            for lr in w.grid[o]]
        space, path = getattr(w, "search", {}).get(o, (None, None))
        if path is not None:
            x["search"] = {"trials": path.trials, "stop": path.stop or "running", "incumbent": list(path.incumbent),
                           "steps": [{"round": st.round, "knob": st.axis, "tried": [[v, loss] for v, loss in st.tried],
                                      "before": list(st.before), "after": list(st.after)} for st in path.steps]}
        if w.knobs:
            x["sweep"] = [{"setting": dict(st), "best_lr": w.setting_best(o, st)[1], "loss": w.setting_best(o, st)[0]}
                          for st in w.settings[o]]
        t = getattr(w, "ladder", {}).get(o)
        if t is not None:
            x["time_to_target"] = {"steps": t["steps"], "tokens": t["tokens"], "seconds": t["seconds"],
                                   "flag": t["flag"], "steps_interval": _interval_json(t["steps_ci"]),
                                   "speedup": t["speedup"][0], "speedup_flag": t["speedup"][1],
                                   "speedup_interval": _interval_json(t["speedup_ci"])}
        if o in w.ttt:
            x["time_to_target_secondary"] = dict(w.ttt[o])
        lad = getattr(w, "ladders", {}).get(o)
        if lad is not None:
            x["frontier"] = {}
            for j, b in enumerate(lad.budgets):
                c = lad.choice[j]
                if c < 0:
                    continue
                setting, lr = lad.cells[j][c]
                x["frontier"][str(b)] = {"mean": lad.mean[j], "se": lad.se[j], "lr": lr, "setting": dict(setting),
                                         "n": int((~np.isnan(lad.losses[j][c])).sum()),
                                         "planned": int(lad.planned[j][c])}
        if deff is not None and o in deff["cells"]:
            x["d_eff_over_d"] = {str(b): {"value": v, "flag": f, "label": ladder.short(deff["why"]) if f == ">" else "",
                                          "interval": _interval_json(iv)}
                                 for b, (v, f, iv) in zip(w.budgets, deff["cells"][o]) if f != "?"}
        elif deff is not None and deff["reader"] is None and o != w.reference:
            x["d_eff_over_d"] = {str(b): {"value": None, "flag": "?", "label": f"fit: {deff['shape'].label}",
                                          "interval": None} for b in w.budgets}
        test = tests.get((w.name, o))
        if test is not None:
            x["significance"] = {"seeds": test.seeds, "test": test.diff.method, "n": test.diff.n,
                                 "mean_diff": test.diff.mean, "ci": _diff_json(test.diff), "p": test.diff.p,
                                 "holm_p": test.holm_p, "holm": _diff_json(test.holm), "verdict": test.verdict}
        track = getattr(w, "target_track", {}).get(o)
        if track is not None:
            x["target_track"] = {k: track[k] for k in ("planned", "n", "reached", "steps", "final", "lr", "setting",
                                                       "below", "steps_diff")}
        evaluation = {}
        for b in w.budgets:
            res = w.evaluation.get((o, b), [])
            if res:
                evaluation[str(b)] = {"lr": float(res[0].run.lr), "setting": dict(res[0].run.setting),
                                      **_mean_json([r.loss for r in res], w.evaluation_planned.get((o, b), 0))}
        if evaluation:
            x["evaluation"] = evaluation
        step, state = cost(w, o)
        x["cost"] = {"step_sec": step, "step_sec_vs_reference": step / ref_t if ref_t else math.nan,
                     "state_bytes": state, "state_bytes_vs_reference": state / ref_b if ref_b else math.nan,
                     **{f"{k}_per_run": v for k, v in overheads(w, o).items()}}
        out["optimizers"][o] = x
    return out


def summary_of(runs: dict[str, Run], workloads: list[Workload], tests: dict[tuple[str, str], Test], planned: bool,
               profiles: dict) -> dict:
    """summary.json's content: what report.md prints, as numbers (docs/compare.md lists the fields)."""
    rows = completeness(runs) if planned else {}
    return _jsonable({
        "reference": workloads[0].reference if workloads else REFERENCE,
        "bootstrap": {"resamples": ladder.BOOTSTRAP, "seed": ladder.BOOTSTRAP_SEED, "level": ladder.LEVEL},
        "alpha": ALPHA,
        "completeness": {"checked": planned, "per_optimizer": [
            {"workload": wl, "optimizer": o, **c} for (wl, o), c in sorted(rows.items())]},
        "workloads": {w.name: workload_summary(w, tests) for w in workloads},
        "significance_family": [f"{o} in {n}" for (n, o), t in tests.items() if t.holm is not None],
        "profiles": profiles,
    })


def write_summary(compare_dir: str, summary: dict) -> str:
    path = os.path.join(compare_dir, "summary.json")
    with atomic_write(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, allow_nan=False)
            f.write("\n")
    return path


def write_csv(compare_dir: str, runs: dict[str, Run], results: dict[str, Result], metric: Metric = VAL_LOSS
              ) -> str:
    path = os.path.join(compare_dir, "results.csv")
    with atomic_write(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for run in runs.values():
                trunk = runs.get(run.info.get("trunk") or "") if run.id in results else None
                writer.writerow(csv_row(run, results.get(run.id), trunk, metric))
    return path
