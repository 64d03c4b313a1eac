"""The statistics of a comparison's report: pure functions of numbers (numpy, scipy).

Every function here is what `compare/report.py` prints and what
tests/test_compare_report.py recomputes, so each has one documented rule:

- `mean_std`: mean and sample standard deviation (ddof=1) over seeds; a failed or diverged seed
  (loss = inf) makes the mean inf: a diverged run is a result, not a gap.
- `fit_power_law` / `effective_data`: AdamW's L(D) = alpha * D**-beta + gamma fitted over the
  budgets (D in tokens), inverted at another optimizer's loss: D_eff = (alpha / (L - gamma))**(1/beta).
- `welch` / `hedges_g`: Welch's t-test (scipy's, equal_var=False) and Hedges' g (Cohen's d with
  the pooled standard deviation, times the small-sample correction 1 - 3 / (4 (n1 + n2) - 9)).
- `crossing`: where a loss curve first reaches a target, linearly interpolated between the two
  evaluations around the crossing.
- `performance_profile`: AlgoPerf's share of workloads on which an optimizer's time to the target
  is within tau times the best optimizer's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std with ddof=1) of the values; (nan, nan) for none, std nan for one value;
    (inf, nan) when any value is inf (a failed or diverged seed)."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    if not np.isfinite(x).all():
        return math.inf, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else math.nan


def power_law(d, alpha: float, beta: float, gamma: float):
    """L(D) = alpha * D**-beta + gamma."""
    return alpha * np.power(d, -beta) + gamma


def fit_power_law(tokens: Sequence[float], losses: Sequence[float]) -> tuple[float, float, float]:
    """(alpha, beta, gamma) of L(D) = alpha * D**-beta + gamma by least squares
    (scipy.optimize.curve_fit), over at least 3 finite points with alpha, beta > 0 and
    0 <= gamma < min(L). D is scaled by its largest value while fitting (alpha is of order L
    then), and alpha scaled back. Raises ValueError with fewer than 3 points."""
    from scipy.optimize import OptimizeWarning, curve_fit

    d = np.asarray(tokens, dtype=float)
    loss = np.asarray(losses, dtype=float)
    keep = np.isfinite(d) & np.isfinite(loss) & (d > 0)
    d, loss = d[keep], loss[keep]
    if d.size < 3:
        raise ValueError(f"a fit of alpha, beta, gamma needs >= 3 budgets with a finite loss, got {d.size}")
    scale = float(d.max())
    x = d / scale
    low = float(loss.min())
    p0 = (max(float(loss.max()) - 0.5 * low, 1e-3), 0.5, 0.5 * low)
    bounds = ([1e-12, 1e-6, 0.0], [np.inf, 10.0, max(low * (1 - 1e-9), 1e-12)])
    p0 = tuple(float(np.clip(v, lo, hi)) for v, lo, hi in zip(p0, *bounds))
    with warnings.catch_warnings():  # 3 budgets, 3 parameters: an exact fit has no covariance estimate
        warnings.simplefilter("ignore", OptimizeWarning)
        (a, b, g), _ = curve_fit(power_law, x, loss, p0=p0, bounds=bounds, maxfev=20000)
    return float(a * scale**b), float(b), float(g)


def effective_data(loss: float, alpha: float, beta: float, gamma: float) -> float:
    """D_eff: the tokens AdamW's fitted L(D) needs to reach `loss`; inf when loss <= gamma (beyond
    the fitted floor), nan when the loss is not finite."""
    if not math.isfinite(loss):
        return math.nan
    if loss <= gamma:
        return math.inf
    return float((alpha / (loss - gamma)) ** (1.0 / beta))


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(t, two-sided p) of Welch's t-test of a against b (scipy.stats.ttest_ind, equal_var=False)."""
    from scipy.stats import ttest_ind

    result = ttest_ind(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_var=False)
    return float(result.statistic), float(result.pvalue)


def hedges_g(a: Sequence[float], b: Sequence[float]) -> float:
    """Hedges' g of a minus b: (mean(a) - mean(b)) / pooled std (ddof=1 each), times
    1 - 3 / (4 (n_a + n_b) - 9). Negative: a's loss is lower. nan with fewer than 2 values each."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n1, n2 = x.size, y.size
    if n1 < 2 or n2 < 2:
        return math.nan
    pooled = math.sqrt(((n1 - 1) * x.var(ddof=1) + (n2 - 1) * y.var(ddof=1)) / (n1 + n2 - 2))
    if pooled == 0:
        return math.nan
    return float((x.mean() - y.mean()) / pooled * (1 - 3 / (4 * (n1 + n2) - 9)))


def crossing(losses: Sequence[float], target: float, *xs: Sequence[float]) -> tuple[float, ...] | None:
    """Where the loss curve first reaches `target` (loss <= target), in each x coordinate given
    (steps, tokens, seconds: one value per evaluation, ascending): at the first evaluation i with
    loss_i <= target, x = x_{i-1} + f (x_i - x_{i-1}) with f = (loss_{i-1} - target) /
    (loss_{i-1} - loss_i), the linear interpolation between the evaluation before and that one
    (x_0 when the first evaluation is already there). None when no evaluation reaches it."""
    loss = np.asarray(losses, dtype=float)
    hit = np.flatnonzero(np.isfinite(loss) & (loss <= target))
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0 or not math.isfinite(loss[i - 1]):
        return tuple(float(x[i]) for x in xs)
    f = (loss[i - 1] - target) / (loss[i - 1] - loss[i])
    return tuple(float(x[i - 1] + f * (x[i] - x[i - 1])) for x in xs)


def performance_profile(times: Mapping[str, Sequence[float]], taus: Sequence[float]) -> dict[str, np.ndarray]:
    """AlgoPerf's performance profiles: times[optimizer][w] is the time to the target on workload
    w (inf: not reached). For each optimizer, the share of workloads where its time is within
    tau x the best optimizer's time on that workload, at each tau. A workload no optimizer
    reached counts against every optimizer."""
    names = list(times)
    t = np.array([list(times[n]) for n in names], dtype=float)  # optimizers x workloads
    best = t.min(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isfinite(t) & np.isfinite(best), t / best, np.inf)
    taus = np.asarray(taus, dtype=float)
    return {n: (ratio[i][None, :] <= taus[:, None]).mean(axis=1) for i, n in enumerate(names)}


def profile_score(times: Mapping[str, Sequence[float]], tau_max: float = 4.0) -> dict[str, float]:
    """AlgoPerf's benchmark score: the area under each optimizer's performance profile from τ = 1 to
    tau_max, divided by tau_max - 1 (1: the fastest on every workload; 0: never within tau_max of it).
    The profile is a step function, so the area is exact: each workload where the optimizer's time is
    r ≤ tau_max times the best adds (tau_max - r) / W."""
    names = list(times)
    t = np.array([list(times[n]) for n in names], dtype=float)
    best = t.min(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isfinite(t) & np.isfinite(best), t / best, np.inf)
    area = np.where(ratio <= tau_max, tau_max - ratio, 0.0).mean(axis=1)
    return {n: float(area[i] / (tau_max - 1.0)) for i, n in enumerate(names)}


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log v)); nan for none, inf when any value is inf, 0 when any is 0."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0 or np.isnan(v).any():
        return math.nan
    if np.isinf(v).any():
        return math.inf
    if (v <= 0).any():
        return 0.0
    return float(np.exp(np.log(v).mean()))
