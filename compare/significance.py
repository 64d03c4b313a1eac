"""The significance statistics of a comparison's report: differences with confidence intervals,
paired or Welch, Holm's correction across a family, and a verdict read from an interval.

Pure functions of numbers (numpy, scipy.stats for t quantiles). Each rule, as the report states it:

- `paired`: a paired t-test on the per-seed differences a_k - b_k, for seeds that share their
  initialisation and data order (seed k of both optimizers ran with the same random_seed and
  data_seed): mean difference, its CI mean ± t_{1-γ/2, n-1}·sd/√n, t and two-sided p (scipy's
  ttest_rel gives the same numbers).
- `welch`: Welch's unequal-variance t-test of a against b, with the Welch–Satterthwaite degrees of
  freedom, for samples that do not pair (scipy's ttest_ind(equal_var=False) gives the same).
- `holm`: Holm's step-down adjusted p-values over a family of tests.
- `holm_levels`: the error level γ_i of each test's Holm interval: α/(m − r + 1) for the test of
  Holm rank r (its p the r-th smallest), or, after the first rank the step-down fails at, that
  rank's level for every later test. The interval at level 1 − γ_i excludes 0 exactly when Holm
  rejects test i (adjusted p < α), so the verdict can be read from an interval.
- `verdict`: "better" (the interval lies below 0: lower loss), "worse" (above 0), else
  "inconclusive"; "inconclusive (n=k)" with fewer than `min_n` seeds, whatever the interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) and what the test says of it."""

    method: str  # "paired" | "welch"
    n: int  # pairs (paired) or the smaller sample (welch)
    mean: float  # the mean difference a - b
    se: float  # its standard error
    df: float  # the t distribution's degrees of freedom
    t: float
    p: float  # two-sided
    level: float = 0.05  # the error level of `interval`: 1 - level coverage
    low: float = math.nan  # the interval at 1 - level
    high: float = math.nan

    def at(self, level: float) -> Difference:
        """The same difference with its interval at coverage 1 - level."""
        if not (math.isfinite(self.se) and math.isfinite(self.df) and self.df > 0):
            return replace(self, level=level, low=math.nan, high=math.nan)
        from scipy.stats import t as student

        half = float(student.ppf(1 - level / 2, self.df)) * self.se
        return replace(self, level=level, low=self.mean - half, high=self.mean + half)


def _test(method: str, n: int, mean: float, se: float, df: float, level: float) -> Difference:
    from scipy.stats import t as student

    if not (math.isfinite(se) and df > 0):
        return Difference(method, n, mean, se, df, math.nan, math.nan).at(level)
    if se == 0:  # every difference equal: no spread to test against
        t = math.copysign(math.inf, mean) if mean else math.nan
        p = 0.0 if mean else math.nan
        return Difference(method, n, mean, se, df, t, p, level, mean, mean)
    t = mean / se
    return Difference(method, n, mean, se, df, t, float(2 * student.sf(abs(t), df))).at(level)


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.05) -> Difference:
    """The paired t-test of a against b (a[k], b[k]: the same seed), interval at 1 - level."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = d.size
    if n < 2:
        return Difference("paired", n, float(d.mean()) if n else math.nan, math.nan, math.nan, math.nan, math.nan,
                          level)
    return _test("paired", n, float(d.mean()), float(d.std(ddof=1) / math.sqrt(n)), n - 1.0, level)


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.05) -> Difference:
    """Welch's t-test of a against b (independent samples), interval at 1 - level."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = min(x.size, y.size)
    mean = float(x.mean() - y.mean()) if x.size and y.size else math.nan
    if n < 2:
        return Difference("welch", n, mean, math.nan, math.nan, math.nan, math.nan, level)
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1)) if va + vb > 0 else math.inf
    return _test("welch", n, mean, se, float(df), level)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values: sorted ascending, p~_(r) = max_{j<=r} min(1, (m - j + 1) p_(j)).
    nan p-values are not in the family (m counts the others) and stay nan."""
    p = np.asarray(pvalues, dtype=float)
    keep = np.flatnonzero(~np.isnan(p))
    out = np.full(p.size, math.nan)
    m = keep.size
    order = keep[np.argsort(p[keep], kind="stable")]
    running = 0.0
    for r, i in enumerate(order):
        running = max(running, min(1.0, (m - r) * p[i]))
        out[i] = running
    return out.tolist()


def holm_levels(pvalues: Sequence[float], alpha: float = 0.05) -> list[float]:
    """Each test's Holm interval level γ (module docstring): α/(m - r + 1) at Holm rank r, frozen at
    the level of the first rank the step-down does not reject. nan for a nan p-value."""
    p = np.asarray(pvalues, dtype=float)
    keep = np.flatnonzero(~np.isnan(p))
    out = np.full(p.size, math.nan)
    m = keep.size
    level, stopped = alpha, False
    for r, i in enumerate(keep[np.argsort(p[keep], kind="stable")]):
        if not stopped:
            level = alpha / (m - r)
            stopped = not p[i] < level
        out[i] = level
    return out.tolist()


def verdict(diff: Difference, min_n: int) -> str:
    """better / worse / inconclusive from the difference's interval (lower loss is better)."""
    if diff.n < min_n:
        return f"inconclusive (n={diff.n})"
    if diff.high < 0:
        return "better"
    if diff.low > 0:
        return "worse"
    return "inconclusive"
