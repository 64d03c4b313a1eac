"""Time to target and D_eff/D read off the budget ladder, with bootstrap intervals over seeds.

The ladder of an optimizer is its tuned frontier: per budget S, the lowest mean final val/loss
over seeds among its (sweep setting, lr) cells at that budget (each cell a cooled branch; a failed
or diverged seed makes its cell's mean inf). Both numbers come from where a ladder first reaches
a loss (`position`): the first budget whose loss is at or below it, interpolated in log S with the
budget before (the loss taken linear in log S between them); "≤ S_min" when the smallest budget
already reaches it, "> S_max" when no budget does.

- Time to target: the optimizer's own ladder at the target (AdamW's frontier at the largest
  budget, unless given). Its tokens and seconds are the ladder's (each budget's mean over the
  chosen cell's seeds) at the same place, also log-linearly interpolated. Speedup: AdamW's steps
  to target / the optimizer's.
- D_eff/D: AdamW's ladder at the optimizer's frontier loss of each budget (tokens), divided by
  the tokens the optimizer used; past AdamW's largest budget the power law of compare/fit.py,
  when it may be read (fit.py says when), else a bound.

Intervals: `BOOTSTRAP` resamples (RNG seed `BOOTSTRAP_SEED`: the report is reproducible). Each
resample draws the comparison's seeds with replacement, once, shared by every budget, optimizer,
setting and lr (their runs share the seed: its branches of every budget grow from one trunk),
rebuilds every ladder (the best cell per budget chosen again), the target, and the number;
the interval is the 2.5th to 97.5th percentile. A resample where the number is only a bound
counts at its bound, and an interval end that is a bound prints as one (e.g. "> 4.00").
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from compare import fit

BOOTSTRAP = 1000  # resamples of the seeds
BOOTSTRAP_SEED = 0  # the resampling RNG's seed: the same directory gives the same report
LEVEL = 0.95  # the intervals' coverage
REACH_RTOL = 1e-9  # a loss reaches the target when <= target (1 + 1e-9): AdamW reaches its own mean


# --------------------------------------------------------------------------------------------
# Where a ladder reaches a loss


def position(losses, target: float) -> tuple[int, float, str]:
    """(i, f, flag): the first budget i whose loss is <= target, f in [0, 1] the log-linear place
    between budget i-1 (f = 0) and i (f = 1): f = (L_{i-1} - target) / (L_{i-1} - L_i). flag "" for
    such a crossing; "≤" when budget 0 (or one after a failed budget, loss inf) already reaches it
    (i, f = 1); ">" when no budget does (i = last, f = 1). Budgets with a nan loss are skipped by the
    caller."""
    m = np.asarray(losses, float)
    hit = np.flatnonzero(~np.isnan(m) & (m <= target))
    if hit.size == 0:
        return m.size - 1, 1.0, ">"
    i = int(hit[0])
    if i == 0 and m[0] >= target - 2 * REACH_RTOL * abs(target):  # budget 0 is where it reaches it (exactly)
        return 0, 1.0, ""
    if i == 0 or not math.isfinite(m[i - 1]):
        return i, 1.0, "≤"
    return i, float((m[i - 1] - target) / (m[i - 1] - m[i])) if m[i - 1] != m[i] else 1.0, ""


def at(xs, i: int, f: float) -> float:
    """xs (one value per budget, > 0) at place (i, f), interpolated in log between i-1 and i."""
    xs = np.asarray(xs, float)
    if f >= 1.0 or i == 0:
        return float(xs[i])
    if not (xs[i - 1] > 0 and xs[i] > 0):
        return math.nan
    return float(math.exp(math.log(xs[i - 1]) + f * (math.log(xs[i]) - math.log(xs[i - 1]))))


# --------------------------------------------------------------------------------------------
# Ladders


@dataclass
class Ladder:
    """One optimizer's results by budget: cells x seeds losses (nan: no result), the cells' mean
    tokens and seconds per budget."""
    budgets: list[int]
    cells: list[list[tuple]]  # per budget: (setting, lr) of each row
    losses: list[np.ndarray]  # per budget: cells x seeds (the workload's seed axis)
    tokens: list[np.ndarray]  # per budget: per cell, mean final tokens over its seeds
    seconds: list[np.ndarray]
    choice: list[int] = field(default_factory=list)  # per budget: the frontier's row (-1: none)
    planned: list[np.ndarray] = field(default_factory=list)  # per budget: per cell, seeds planned (any state)
    mean: np.ndarray = None
    se: np.ndarray = None

    def frontier_tokens(self) -> np.ndarray:
        return np.array([t[c] if c >= 0 else math.nan for t, c in zip(self.tokens, self.choice)])

    def frontier_seconds(self) -> np.ndarray:
        return np.array([t[c] if c >= 0 else math.nan for t, c in zip(self.seconds, self.choice)])


def _cell_means(mat: np.ndarray) -> np.ndarray:
    """cells x ... x seeds -> the mean over seeds with a result (nan: none; inf: one is inf)."""
    have = ~np.isnan(mat)
    n = have.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        total = np.where(have, mat, 0.0).sum(axis=-1)
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def _frontier(means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cells x ... -> (min over cells ignoring nan, its row; nan and -1 where every cell is nan)."""
    filled = np.where(np.isnan(means), np.inf, means)
    row = np.argmin(filled, axis=0)
    best = np.take_along_axis(filled, row[None], axis=0)[0]
    none = np.isnan(means).all(axis=0)
    return np.where(none, np.nan, best), np.where(none, -1, row)


def evaluation_ready(w) -> bool:
    """Whether the ladders read the evaluation seeds (seeds.eval): planned, and none still to run.
    Then the tuning seeds choose each budget's setting and lr, and fresh seeds score the choice: the
    tuning seeds' own frontier is the lowest of several noisy means, biased low (the winner's curse)."""
    return bool(getattr(w, "evaluation_planned", None)) and w.evaluation_pending == 0


def build(w, evaluation: bool = False) -> tuple[dict[str, Ladder], list[int]]:
    """Every optimizer's ladder of workload `w` (compare.report.Workload), and the seed axis. On the
    tuning seeds each budget has a cell per (setting, lr) and the frontier is the best; with
    `evaluation`, one cell per budget: the evaluation seeds of the setting and lr chosen there."""
    if evaluation:
        pool = [r for v in w.evaluation.values() for r in v]
    else:
        pool = [r for r in w.results if r.counted]
    seeds = sorted({int(r.run.seed) for r in pool})
    col = {s: j for j, s in enumerate(seeds)}
    out = {}
    for o in w.optimizers:
        cells, losses, tokens, seconds, planned = [], [], [], [], []
        for b in w.budgets:
            mine: dict[tuple, list] = {}
            every: dict[tuple, int] = defaultdict(int)
            if evaluation:
                counted = w.evaluation.get((o, b), [])
                for r in counted:
                    every[(r.run.setting, float(r.run.lr))] = w.evaluation_planned[(o, b)]
            else:
                for r in w.results:
                    if r.run.optimizer == o and int(r.run.budget) == b:
                        every[(r.run.setting, float(r.run.lr))] += 1
                counted = [r for r in w.results if r.counted and r.run.optimizer == o and int(r.run.budget) == b]
            for r in counted:
                mine.setdefault((r.run.setting, float(r.run.lr)), []).append(r)
            keys = sorted(mine, key=lambda k: (repr(k[0]), k[1]))  # ties: the first setting, the smaller lr
            mat = np.full((len(keys), len(seeds)), np.nan)
            tok, sec = np.full(len(keys), np.nan), np.full(len(keys), np.nan)
            for i, k in enumerate(keys):
                for r in mine[k]:
                    mat[i, col[int(r.run.seed)]] = r.loss
                tok[i] = _last_mean(mine[k], "tokens")
                sec[i] = _last_mean(mine[k], "seconds")
            cells.append(keys)
            planned.append(np.array([every[k] for k in keys], dtype=int))
            losses.append(mat)
            tokens.append(tok)
            seconds.append(sec)
        lad = Ladder(list(w.budgets), cells, losses, tokens, seconds, planned=planned)
        mean, choice, se = [], [], []
        for mat in losses:
            if mat.shape[0] == 0:
                mean.append(math.nan), choice.append(-1), se.append(math.nan)
                continue
            m, c = _frontier(_cell_means(mat))
            mean.append(float(m)), choice.append(int(c))
            vals = mat[int(c)][np.isfinite(mat[int(c)])] if c >= 0 else np.array([])
            se.append(float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else math.nan)
        lad.mean, lad.choice, lad.se = np.array(mean), choice, np.array(se)
        out[o] = lad
    return out, seeds


def _last_mean(results, key: str) -> float:
    v = [float(r.curve[key][-1]) for r in results if len(r.curve.get(key, [])) and math.isfinite(r.curve[key][-1])]
    return float(np.mean(v)) if v else math.nan


def resample(ladders: dict[str, Ladder], n_seeds: int, draws: int = BOOTSTRAP,
             seed: int = BOOTSTRAP_SEED) -> dict[str, np.ndarray]:
    """optimizer -> draws x budgets frontier means, the seeds drawn with replacement once per
    resample and shared by every budget, optimizer and cell: a seed's branches of every budget grow
    from one trunk (one initialisation, one data order), so its losses move together across budgets,
    and a draw per budget would treat them as independent."""
    rng = np.random.default_rng(seed)
    n_budgets = len(next(iter(ladders.values())).budgets) if ladders else 0
    idx = rng.integers(0, max(n_seeds, 1), size=(draws, max(n_seeds, 1)))
    out = {}
    for o, lad in ladders.items():
        rows = np.full((draws, n_budgets), np.nan)
        for k, mat in enumerate(lad.losses):
            if mat.shape[0] and n_seeds:
                rows[:, k] = _frontier(_cell_means(mat[:, idx]))[0]
        out[o] = rows
    return out


# --------------------------------------------------------------------------------------------
# Numbers with bounds, and their intervals

# A bounded number: (value, flag), flag "" exact, "≤"/"<" at most, "≥"/">" at least, "?" unknown.
UPPER, LOWER = ("≤", "<"), ("≥", ">")


def ratio(num: tuple[float, str], den: tuple[float, str]) -> tuple[float, str]:
    """num / den with the bound each carries: a numerator at most x, or a denominator at least y,
    makes the ratio at most; the opposite at least; both directions at once: unknown ("?")."""
    (a, fa), (b, fb) = num, den
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return math.nan, "?"
    up = (fa in UPPER) or (fb in LOWER)
    low = (fa in LOWER) or (fb in UPPER)
    if up and low:
        return math.nan, "?"
    strict = ">" in (fa, fb) or "<" in (fa, fb)
    return a / b, ("<" if strict else "≤") if up else (">" if strict else "≥") if low else ""


def interval(values: np.ndarray, flags: list[str], level: float = LEVEL) -> tuple[float, str, float, str, int]:
    """(lo, lo flag, hi, hi flag, unknown): the order statistics at (1-level)/2 and (1+level)/2 of
    the resamples with a value, a bound counting at its bound; an end that is a bound keeps its
    flag when it points outward (an upper bound at the low end, a lower bound at the high end).
    unknown: resamples with no value (flag "?" or nan)."""
    keep = [(v, f) for v, f in zip(values, flags) if f != "?" and not math.isnan(v)]
    unknown = len(values) - len(keep)
    if not keep:
        return math.nan, "", math.nan, "", unknown
    keep.sort(key=lambda p: p[0])
    n = len(keep)
    lo = keep[int(math.floor((1 - level) / 2 * (n - 1)))]
    hi = keep[int(math.ceil((1 + level) / 2 * (n - 1)))]
    return (lo[0], "≤" if lo[1] in UPPER else "", hi[0], "≥" if hi[1] in LOWER else "", unknown)


def f_bounded(value: float, flag: str, spec: str = ".3g") -> str:
    if flag == "?" or math.isnan(value):
        return "–"
    if math.isinf(value):
        return "∞" if not flag else f"{flag} ∞"
    return f"{flag} {value:{spec}}" if flag else f"{value:{spec}}"


def f_interval(iv: tuple, spec: str = ".3g") -> str:
    lo, lf, hi, hf, _ = iv
    if math.isnan(lo):
        return "–"
    return f"[{f_bounded(lo, lf, spec)}, {f_bounded(hi, hf, spec)}]"


# --------------------------------------------------------------------------------------------
# Time to target on the ladder


def _finite_budgets(lad: Ladder, mean: np.ndarray) -> np.ndarray:
    return np.flatnonzero(~np.isnan(mean))


def ttt(lad: Ladder, mean: np.ndarray, target: float) -> dict:
    """{"steps", "tokens", "seconds", "flag"} of the ladder's means `mean` at the target."""
    keep = _finite_budgets(lad, mean)
    if keep.size == 0 or target is None or not math.isfinite(target):
        return {"steps": math.nan, "tokens": math.nan, "seconds": math.nan, "flag": "?"}
    goal = target + REACH_RTOL * abs(target)
    i, f, flag = position(mean[keep], goal)
    pick = lambda xs: at(np.asarray(xs, float)[keep], i, f)
    return {"steps": pick(lad.budgets), "tokens": pick(lad.frontier_tokens()),
            "seconds": pick(lad.frontier_seconds()), "flag": flag}


def ladder_ttt(w, ladders: dict[str, Ladder], reps: dict[str, np.ndarray], reference: str,
               target_given: bool) -> dict[str, dict]:
    """Per optimizer: the ladder time to target, its speedup over the reference, and the speedup's
    bootstrap interval (and the steps' interval)."""
    out = {o: ttt(lad, lad.mean, w.target) for o, lad in ladders.items()}
    ref = ladders.get(reference)
    draws = next(iter(reps.values())).shape[0] if reps else 0
    for o, lad in ladders.items():
        t = out[o]
        t["speedup"] = ratio((out[reference]["steps"], out[reference]["flag"]), (t["steps"], t["flag"])) \
            if ref is not None else (math.nan, "?")
        steps, sp = [], []
        for k in range(draws):
            target = w.target if target_given or ref is None else _last_finite(reps[reference][k])
            mine = ttt(lad, reps[o][k], target)
            steps.append((mine["steps"], mine["flag"]))
            if ref is not None:
                theirs = ttt(ref, reps[reference][k], target)
                sp.append(ratio((theirs["steps"], theirs["flag"]), (mine["steps"], mine["flag"])))
        t["steps_ci"] = interval(np.array([v for v, _ in steps]), [f for _, f in steps]) if steps else None
        t["speedup_ci"] = interval(np.array([v for v, _ in sp]), [f for _, f in sp]) if sp else None
        t["speedup_draws"] = sp  # per resample (value, flag): compare/sizes.py fits its trend across sizes on them
    return out


def _last_finite(row: np.ndarray) -> float:
    """The largest budget's frontier mean of a resample (the target); nan when it has none."""
    return float(row[-1]) if row.size and math.isfinite(row[-1]) else math.nan


# --------------------------------------------------------------------------------------------
# D_eff / D


@dataclass
class Reader:
    """How D_eff is read from a reference frontier: its budgets' tokens and means, and the power
    law beyond the largest budget (None: none may be read)."""
    tokens: np.ndarray
    mean: np.ndarray
    law: fit.PowerLaw | None


def d_eff(reader: Reader, loss: float) -> tuple[float, str]:
    """(D_eff, flag) of a loss on the reference frontier: interpolated between its budgets, the
    power law past the largest (up to EXTRAPOLATE x its tokens), else a bound."""
    if math.isnan(loss):
        return math.nan, "?"
    i, f, flag = position(reader.mean, loss + REACH_RTOL * abs(loss))
    d = at(reader.tokens, i, f)
    if flag != ">":
        return d, flag
    if reader.law is None:
        return float(reader.tokens[-1]), ">"
    limit = fit.EXTRAPOLATE * float(reader.tokens[-1])
    dl = reader.law.data(loss)
    if math.isnan(dl) or dl > limit:
        return limit, ">"
    return max(dl, float(reader.tokens[-1])), "fit"


def make_reader(tokens, mean, se, allow_fit: bool) -> tuple[Reader | None, fit.Shape, fit.PowerLaw | None, str]:
    """(reader, shape, the fitted law (also when it may not be read), why no extrapolation) of a
    reference frontier; reader None when its shape gives no D_eff (flat, not decreasing)."""
    keep = np.isfinite(mean) & np.isfinite(tokens)
    t, m, s = np.asarray(tokens, float)[keep], np.asarray(mean, float)[keep], np.asarray(se, float)[keep]
    sh = fit.shape(t, m, s)
    if sh.label:
        return None, sh, None, sh.why
    law, why = None, ""
    if allow_fit and m.size >= fit.MIN_FIT_BUDGETS:
        law = fit.fit_power_law(t, m)
    if not allow_fit:
        why = ""
    elif m.size < fit.MIN_FIT_BUDGETS:
        why = (f"{m.size} budgets: a power law's 3 parameters would pass through every point (no residual to judge "
               f"it by), so none is fitted and D_eff is read between budgets only (≥ {fit.MIN_FIT_BUDGETS} budgets "
               "to extrapolate)")
    elif not sh.convex:
        why = f"the frontier is {sh.why}: no power law with γ ≥ 0 describes it, so none is extrapolated"
    elif law is None:
        why = "the power-law fit failed (no α > 0, γ ≥ 0 fits)"
    elif not fit.residual_ok(law, t, m, s):
        why = (f"a residual of the power-law fit exceeds {fit.NOISE_SE:g} standard errors of its budget's mean "
               "(the fit does not describe the frontier), so it is not extrapolated")
    usable = law if (allow_fit and not why) else None
    return Reader(t, m, usable), sh, law, why


def short(why: str) -> str:
    """The few words a bound cell carries for why it is not extrapolated."""
    for key, text in (("budgets: a power law", "no fit: < 4 budgets"), ("concave", "fit: concave"),
                      ("residual", "fit: residuals > noise"), ("failed", "fit: failed")):
        if key in why:
            return text
    return ""


def reader_of(ladder: Ladder, mean: np.ndarray, allow_fit: bool) -> Reader | None:
    """A resample's reader: the same rules as the report's (make_reader), no labels."""
    se = ladder.se if ladder.se is not None else np.full(len(mean), np.nan)
    return make_reader(ladder.frontier_tokens(), mean, se, allow_fit)[0]


def deff_table(ladders: dict[str, Ladder], reps: dict[str, np.ndarray], reference: str) -> dict:
    """The D_eff/D cells: {"reader", "shape", "law", "why", "cells": {optimizer: [per budget:
    (value, flag, interval or None)]}}."""
    ref = ladders[reference]
    reader, sh, law, why = make_reader(ref.frontier_tokens(), ref.mean, ref.se, True)
    out = {"reader": reader, "shape": sh, "law": law, "why": why, "cells": {}, "draws": {}}
    if reader is None:
        return out
    used_fit = reader.law is not None
    draws = reps[reference].shape[0] if reps else 0
    readers = [reader_of(ref, reps[reference][k], used_fit) for k in range(draws)]
    for o, lad in ladders.items():
        toks = lad.frontier_tokens()
        cells, out["draws"][o] = [], []  # draws: per budget, per resample (value, flag) (compare/sizes.py)
        for j in range(len(lad.budgets)):
            d = toks[j]
            if math.isnan(lad.mean[j]) or not math.isfinite(d):
                cells.append((math.nan, "?", None))
                out["draws"][o].append([])
                continue
            val, flag = _deff_ratio(reader, lad.mean[j], d)
            sample = [(_deff_ratio(r, reps[o][k][j], d) if r is not None else (math.nan, "?"))
                      for k, r in enumerate(readers)]
            iv = interval(np.array([v for v, _ in sample]), [f for _, f in sample]) if sample else None
            cells.append((val, flag, iv))
            out["draws"][o].append(sample)
        out["cells"][o] = cells
    return out


def _deff_ratio(reader: Reader, loss: float, d: float) -> tuple[float, str]:
    if math.isinf(loss):  # failed or diverged: worse than any loss AdamW logged
        return float(reader.tokens[0]) / d, "≤"
    val, flag = d_eff(reader, loss)
    if flag == "?" or not math.isfinite(d) or d <= 0:
        return math.nan, "?"
    return val / d, flag


# --------------------------------------------------------------------------------------------
# The report's lines (compare/report.py's Time to target and Speedup sections call these)


def attach(w, reference: str, target_given: bool) -> None:
    """w.ladders, w.reps (the bootstrap's frontiers), w.ladder (time to target per optimizer), and
    w.ladder_seeds: "evaluation" when they read the evaluation seeds (evaluation_ready), whose
    reference frontier at the largest budget is then the target (unless one was given), else "tuning"."""
    w.ladder_seeds = "evaluation" if evaluation_ready(w) else "tuning"
    w.ladders, seeds = build(w, w.ladder_seeds == "evaluation")
    if w.ladder_seeds == "evaluation" and not target_given:
        ref = _last_finite(w.ladders[reference].mean) if reference in w.ladders else math.nan
        w.target = ref if math.isfinite(ref) else None
    w.reps = resample(w.ladders, len(seeds)) if w.ladders and w.budgets else {}
    w.ladder = ladder_ttt(w, w.ladders, w.reps, reference, target_given) if w.target is not None else {}


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def _unknown(iv) -> str:
    return f" ({iv[4]} of {BOOTSTRAP} resamples without one)" if iv and iv[4] else ""


def seeds_line(w) -> str:
    """Which seeds the ladders read, in bold when they are the biased ones."""
    if w.ladder_seeds == "evaluation":
        return ("These figures read the **evaluation seeds** (seeds.eval): the tuning seeds chose each budget's "
                "setting and lr, and its loss is the mean over the fresh seeds, which chose nothing.")
    pending = " (the evaluation runs have not all run yet)" if getattr(w, "evaluation_planned", None) else ""
    return ("**These figures read the tuning seeds**, which also chose each budget's setting and lr: the best of "
            f"several noisy means is biased low (toward the winner){pending}; seeds.eval=M scores the choices on "
            "fresh seeds.")


def ttt_lines(w, reference: str) -> list[str]:
    pct = f"{LEVEL:.0%}"
    out = [seeds_line(w), "",
           f"On the budget ladder (the headline): the smallest budget whose cooled branch reaches the target, at "
           "the optimizer's best setting and lr for that budget (its mean final val/loss over seeds), interpolated "
           "in log S with the budget before (the loss taken linear in log S between them); '≤ S_min' when the "
           "smallest budget already reaches it, '> S_max' when no budget does. Tokens and seconds: the same place "
           "on each budget's mean final tokens and seconds. Speedup: "
           f"{reference}'s steps to target / the optimizer's (a bound when either is). {pct} intervals: "
           f"{BOOTSTRAP} bootstrap resamples of the seeds (one draw shared by every budget: a seed's branches share "
           f"its trunk; RNG seed {BOOTSTRAP_SEED}), every ladder and the target rebuilt from each. They cover the "
           "seeds' noise, not the interpolation between budgets: a crossing between two budgets is read "
           "log-linearly, which on a convex loss reads early (a true 2× read 1.97× between budgets 150 and 250 on a "
           "power law).", ""]
    rows = []
    for o in w.optimizers:
        t = w.ladder.get(o)
        if t is None:
            continue
        s = f_bounded(t["steps"], t["flag"], ".1f")
        rows.append([o, s, f_interval(t["steps_ci"], ".1f") if t["steps_ci"] else "–",
                     f_bounded(t["tokens"], t["flag"], ".0f"), f_bounded(t["seconds"], t["flag"], ".2f"),
                     f_bounded(*t["speedup"], ".3f"), (f_interval(t["speedup_ci"], ".3f") + _unknown(t["speedup_ci"]))
                     if t["speedup_ci"] else "–"])
    return out + _table(["optimizer", "steps", f"{pct} interval", "tokens", "seconds", f"speedup vs {reference}",
                         f"{pct} interval"], rows)


def deff_lines(w, reference: str) -> list[str]:
    pct = f"{LEVEL:.0%}"
    if w.ladder_seeds == "evaluation":
        what = ("per budget, the mean final val/loss over the evaluation seeds (± its standard error) of the "
                "setting and lr the tuning seeds chose at that budget")
    else:
        what = ("per budget, each optimizer's lowest mean final val/loss over its settings and lrs at that budget "
                "(± its standard error over seeds), and the lr")
    out = [seeds_line(w), "", f"Tuned frontier: {what}.", ""]
    rows = []
    for o in w.optimizers:
        lad = w.ladders[o]
        cells = []
        for j in range(len(lad.budgets)):
            c = lad.choice[j]
            if c < 0:
                cells.append("–")
                continue
            setting, lr = lad.cells[j][c]
            sweep = "".join(f", {k}={v}" for k, v in setting)
            m, se = lad.mean[j], lad.se[j]
            loss = "∞" if math.isinf(m) else f"{m:.4f}" + ("" if math.isnan(se) else f" ± {se:.4f}")
            n, planned = int((~np.isnan(lad.losses[j][c])).sum()), int(lad.planned[j][c])
            cells.append(f"{loss} (lr {lr:.4g}{sweep}" + (f"; n={n} of {planned})" if n < planned else ")"))
        rows.append([o, *cells])
    out += _table(["optimizer", *(f"S={b}" for b in w.budgets)], rows)
    table = deff_table(w.ladders, w.reps, reference)
    w.deff = table  # the summary (report.summary_of) reads the same cells
    sh, law, why = table["shape"], table["law"], table["why"]
    if table["reader"] is None:
        return out + [f"No D_eff/D: {reference}'s frontier is {sh.label} ({sh.why}); every cell reads "
                      f"'fit: {sh.label}'.", ""] + _table(
            ["optimizer", *(f"S={b}" for b in w.budgets)],
            [[o, *(f"fit: {sh.label}" for _ in w.budgets)] for o in w.optimizers if o != reference])
    if law is not None:
        resid = law.loss(table["reader"].tokens) - table["reader"].mean
        out += [f"{reference}'s frontier fitted as L(D) = α·D^−β + γ (D: training tokens; least squares, β profiled): "
                f"α = {law.alpha:.6g}, β = {law.beta:.6g}, γ = {law.gamma:.6g}; residuals (fit − mean) per budget:", ""]
        out += _table([f"S={b}" for b in w.budgets], [[f"{r:+.2e}" for r in resid]])
    method = ("between budgets: log-linear interpolation of the frontier; past the largest budget: the power law, "
              f"read up to {fit.EXTRAPOLATE:g}× the largest budget's tokens (cells marked 'fit')"
              if table["reader"].law is not None else
              f"between budgets: log-linear interpolation of the frontier; past the largest budget: no reading ({why})")
    out += [f"D_eff/D per budget: D_eff is the tokens {reference}'s tuned frontier needs to reach the optimizer's "
            "frontier loss at that budget, D the tokens the optimizer used; > 1: it needs less data than "
            f"{reference} for the same loss. Method: {method}. Bounds: '> x' when the loss is below what "
            f"{reference} reaches within the data it may be read on, '≤ x' when {reference}'s smallest budget "
            f"already reaches it. {pct} intervals: {BOOTSTRAP} bootstrap resamples of the seeds (one draw shared by "
            f"every budget; RNG seed {BOOTSTRAP_SEED}), both frontiers rebuilt from each.", ""]
    rows = []
    for o in w.optimizers:
        cells = []
        for val, flag, iv in table["cells"][o]:
            if flag == "?":
                cells.append("–")
                continue
            text = f"{val:.3f} (fit)" if flag == "fit" else f_bounded(val, flag, ".3f")
            if flag == ">" and short(why):
                text += f" ({short(why)})"
            cells.append(f"{text} {f_interval(iv, '.3f')}{_unknown(iv)}" if iv else text)
        rows.append([o, *cells])
    return out + _table(["optimizer", *(f"S={b}" for b in w.budgets)], rows)


def profile_seconds(w, optimizer: str) -> float:
    """The ladder's seconds to target for performance profiles and geometric means: '> S_max' is
    not reached (inf); '≤ S_min' counts at the smallest budget's seconds (an upper bound)."""
    t = getattr(w, "ladder", {}).get(optimizer)
    if t is None or t["flag"] in (">", "?") or math.isnan(t["seconds"]):
        return math.inf
    return float(t["seconds"])
