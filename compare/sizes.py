"""A model-size ladder: a comparison whose workloads are model sizes, read as Wen et al. 2025's
speedup-against-scale figure ("Fantastic Pretraining Optimizers and Where to Find Them": the
speedup over AdamW shrinks from ~1.4x at 0.1B parameters to ~1.1x at 1.2B).

Each workload's size is its runs' `model/params` (logged in every run's first record). Per
optimizer and size, the two speedups over the baseline the workload's own sections print
(time to target on the budget ladder, and D_eff/D at the largest budget, each with its
bootstrap interval), and their trend: the least-squares line of the speedup against
log10(parameters), whose slope (the change per 10x parameters) gets an interval from the
per-size bootstrap resamples joined draw by draw (the sizes' runs are independent, so draw k of
every size is one joint resample). A draw in which a size's value is a bound or unknown has no
slope; the report counts those. And the best lr per size, with the exponent of lr ∝ N^e.

A width ladder run both ways (issue: hyperparameter transfer): workloads whose runs train with
`model.mup=true` and workloads without form two ladders, one per parametrisation, so each
optimizer's best lr against size under muP (flat where it transfers: e ≈ 0) stands next to the
standard parametrisation's, instead of two workloads of one size mixing in one fit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from compare import ladder

PARAMS = "model/params"


def workload_params(w) -> int | None:
    """The workload's parameter count: the median of its runs' `model/params` (None when no run logged it)."""
    counts = []
    for run in w.runs:
        found = next((r[PARAMS] for r in run.records if PARAMS in r), None)
        if isinstance(found, (int, float)) and math.isfinite(found):
            counts.append(found)
    return int(np.median(counts)) if counts else None


def parametrisation(w) -> str:
    """"muP" when the workload's runs train with model.mup=true (the last `model.mup=` of a run's
    overrides, which hold the workload's), else "SP" (the standard parametrisation, the default)."""
    for run in w.runs:
        said = [o.split("=", 1)[1].strip().lower() for o in run.info.get("overrides") or []
                if o.lstrip("+").startswith("model.mup=")]
        if said:
            return "muP" if said[-1] == "true" else "SP"
    return "SP"


def ladders_of(workloads: list) -> list[tuple[str | None, dict]]:
    """[(parametrisation, ladder)]: one ladder (parametrisation None) when every workload shares one,
    else one per parametrisation that makes a ladder (SP first)."""
    groups: dict[str, list] = {}
    for w in workloads:
        groups.setdefault(parametrisation(w), []).append(w)
    if len(groups) == 1:
        lad = ladder_of(workloads)
        return [(None, lad)] if lad else []
    return [(name, lad) for name in sorted(groups, key=lambda n: n != "SP")
            if (lad := ladder_of(groups[name])) is not None]


def _exact(value: tuple[float, str]) -> bool:
    return value[1] == "" and math.isfinite(value[0])


def slope(log_n: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line y = intercept + slope·log10(N)."""
    b, a = np.polyfit(log_n, y, 1)
    return float(b), float(a)


def trend(params: list[int], points: list[tuple[float, str]], draws: list[list[tuple[float, str]]]) -> dict | None:
    """The line through (log10 N, speedup) when every size's value is exact; its slope's interval
    from the joint resamples (ladder.interval's form). None with fewer than 2 distinct sizes or a
    size without an exact value."""
    log_n = np.log10(np.asarray(params, float))
    if len(set(params)) < 2 or not all(_exact(p) for p in points):
        return None
    b, a = slope(log_n, np.array([p[0] for p in points]))
    out: dict[str, Any] = {"slope": b, "intercept": a, "slope_interval": None}
    n = min((len(d) for d in draws), default=0)
    if n:
        slopes = [slope(log_n, np.array([d[k][0] for d in draws]))[0] if all(_exact(d[k]) for d in draws) else math.nan
                  for k in range(n)]
        out["slope_interval"] = ladder.interval(np.array(slopes), ["" if math.isfinite(v) else "?" for v in slopes])
    return out


def ladder_of(workloads: list) -> dict | None:
    """{"workloads": [(workload, params)] by size, "reference", "optimizers": {opt: {"ttt": {...}, "deff":
    {...}, "lr": {...}}}}, or None when the workloads are not a ladder (fewer than 2 distinct sizes,
    or a workload without a parameter count)."""
    sized = [(w, workload_params(w)) for w in workloads]
    if any(p is None for _, p in sized) or len({p for _, p in sized}) < 2:
        return None
    sized.sort(key=lambda wp: (wp[1], wp[0].name))
    reference = sized[0][0].reference
    names = []
    for w, _ in sized:
        names += [o for o in w.optimizers if o not in names]
    params = [p for _, p in sized]
    out = {"workloads": [(w.name, p) for w, p in sized], "reference": reference, "optimizers": {}}
    for o in names:
        row: dict[str, Any] = {"lr": {w.name: w.best.get(o) for w, _ in sized}}
        if o != reference:
            for key, per_size in (("ttt", [_ttt(w, o) for w, _ in sized]), ("deff", [_deff(w, o) for w, _ in sized])):
                row[key] = {"per_size": per_size,
                            "trend": trend(params, [c[0] for c in per_size], [c[2] for c in per_size])}
        lrs = [row["lr"][w.name] for w, _ in sized]
        row["lr_exponent"] = slope(np.log10(np.asarray(params, float)), np.log10(np.asarray(lrs, float)))[0] \
            if all(lr is not None and lr > 0 for lr in lrs) else None
        out["optimizers"][o] = row
    return out


def _ttt(w, o: str) -> tuple[tuple[float, str], Any, list]:
    """(the time-to-target speedup, its interval, its resamples) of optimizer o in workload w."""
    t = getattr(w, "ladder", {}).get(o)
    if t is None:
        return (math.nan, "?"), None, []
    return t["speedup"], t["speedup_ci"], t.get("speedup_draws") or []


def _deff(w, o: str) -> tuple[tuple[float, str], Any, list]:
    """(D_eff/D at the workload's largest budget, its interval, its resamples)."""
    table = getattr(w, "deff", None)
    if table is None or o not in table.get("cells", {}) or not table["cells"][o]:
        return (math.nan, "?"), None, []
    val, flag, iv = table["cells"][o][-1]
    draws = table.get("draws", {}).get(o) or [[]]
    return (val, flag), iv, draws[-1]
