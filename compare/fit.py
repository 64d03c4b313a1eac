"""AdamW's loss against data, L(D), read so that it cannot crash and says how good it is.

D_eff of a loss L is the tokens AdamW's tuned frontier (its per-budget best mean final val/loss)
needs to reach L. Between AdamW's budgets it is read off the frontier itself (`ladder.position`:
the first budget that reaches L, log-linearly interpolated with the budget before); beyond its
largest budget only a power law L(D) = alpha * D**-beta + gamma fitted to the frontier can say
more, and only when:

- the frontier has >= 4 budgets (3 parameters through 3 points leave no residual to judge the fit by),
- it falls and is convex in log D (no power law with gamma >= 0 bends the other way: `shape`),
- every residual is within `NOISE_SE` standard errors of its budget's mean (`residual_ok`),

and then at most `EXTRAPOLATE` times past the largest budget. Otherwise D_eff is a bound
("> D_max", "<= D_min"). Everything here returns a value or a label; nothing raises on data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

EXTRAPOLATE = 4.0  # the power law is read at most this many times past AdamW's largest budget
NOISE_SE = 2.0  # a change within this many standard errors (of a difference, or of a mean) is noise
# Without a seed spread (one seed), changes below this share of the loss are rounding, not signal:
# a float32 loss logged to ~7 digits.
FLAT_RTOL = 1e-6
# With one seed (no standard error), a residual is acceptable up to this share of the frontier's
# total fall: the synthetic and real frontiers a power law describes fit within a fraction of a percent.
RESIDUAL_SHARE = 0.01
MIN_FIT_BUDGETS = 4


@dataclass
class Shape:
    """What AdamW's frontier looks like: `label` "" (falls; fine to read), "flat", "not decreasing"
    (a label for the D_eff cells), with a sentence `why`; `convex`: whether a power law could describe it."""
    label: str
    why: str
    convex: bool


def _noise(se: np.ndarray, *idx: int) -> float:
    s = np.nan_to_num(np.asarray(se, dtype=float)[list(idx)], nan=0.0)
    return NOISE_SE * float(np.sqrt((s ** 2).sum()))


def shape(budgets, losses, se) -> Shape:
    """Classify the frontier's means (ascending budgets, finite): flat (first and last budget within
    noise), not decreasing (the last above the first, or a rise between neighbours beyond noise), and
    whether it is convex in log D (each slope at least the one before, within noise)."""
    m, se, s = np.asarray(losses, float), np.asarray(se, float), np.asarray(budgets, float)
    if m.size < 2:
        return Shape("needs ≥ 2 budgets", f"{m.size} budget with a finite loss: nothing to read D_eff from", False)
    floor = lambda i, j: max(_noise(se, i, j), FLAT_RTOL * max(abs(m[i]), abs(m[j])))
    drop = m[0] - m[-1]
    if abs(drop) <= floor(0, m.size - 1):
        return Shape("flat", f"the loss at D={s[-1]:g} tokens ({m[-1]:.4f}) is within noise of D={s[0]:g}'s "
                     f"({m[0]:.4f}): the budgets do not tell losses apart", False)
    if drop < 0:
        return Shape("not decreasing", f"the loss rises from D={s[0]:g} tokens ({m[0]:.4f}) to D={s[-1]:g} "
                     f"({m[-1]:.4f})", False)
    for i in range(m.size - 1):
        if m[i + 1] - m[i] > floor(i, i + 1):
            return Shape("not decreasing", f"the loss rises beyond noise from D={s[i]:g} tokens ({m[i]:.4f}) to "
                         f"D={s[i + 1]:g} ({m[i + 1]:.4f})", False)
    x = np.log(s)
    convex = True
    for i in range(m.size - 2):  # second difference of L in log D, and its standard error
        h1, h2 = x[i + 1] - x[i], x[i + 2] - x[i + 1]
        c = np.array([1 / h1, -(1 / h1 + 1 / h2), 1 / h2])
        d2 = float(c @ m[i:i + 3])
        sd = NOISE_SE * float(np.sqrt(((c * np.nan_to_num(se[i:i + 3], nan=0.0)) ** 2).sum()))
        if d2 < -max(sd, FLAT_RTOL * float(abs(c) @ abs(m[i:i + 3]))):
            convex = False
    return Shape("", "" if convex else "concave in log D (the loss falls faster at larger budgets)", convex)


@dataclass
class PowerLaw:
    """L(D) = alpha * D**-beta + gamma, with D_max (the largest D fitted) kept for reading it in
    log space (no overflow)."""
    alpha_x: float  # alpha in units of D / d_max
    beta: float
    gamma: float
    d_max: float

    @property
    def alpha(self) -> float:
        return self.alpha_x * self.d_max ** self.beta

    def loss(self, d) -> np.ndarray:
        return self.alpha_x * np.power(np.asarray(d, float) / self.d_max, -self.beta) + self.gamma

    def data(self, loss: float) -> float:
        """D with L(D) = loss, in log space: inf at or below gamma; nan for a non-finite loss."""
        if not math.isfinite(loss):
            return math.nan
        if loss <= self.gamma:
            return math.inf
        log_x = (math.log(self.alpha_x) - math.log(loss - self.gamma)) / self.beta
        return math.inf if log_x > 700 else self.d_max * math.exp(log_x)


def fit_power_law(tokens, losses) -> PowerLaw | None:
    """Least squares of alpha * D**-beta + gamma over the points, profiled over beta: for each beta
    in [1e-3, 5] alpha and gamma are linear least squares (gamma >= 0, alpha > 0), beta then by a
    bounded scalar search of log beta. None with fewer than 3 finite points or no such fit."""
    from scipy.optimize import minimize_scalar

    d, loss = np.asarray(tokens, float), np.asarray(losses, float)
    keep = np.isfinite(d) & np.isfinite(loss) & (d > 0)
    d, loss = d[keep], loss[keep]
    if d.size < 3:
        return None
    d_max = float(d.max())
    x = d / d_max

    def solve(log_beta: float) -> tuple[float, float, float]:
        u = np.power(x, -math.exp(log_beta))
        a_mat = np.stack([u, np.ones_like(u)], axis=1)
        (a, g), *_ = np.linalg.lstsq(a_mat, loss, rcond=None)
        if g < 0:
            a, g = float(u @ loss / (u @ u)), 0.0
        if not (a > 0 and math.isfinite(a)):
            return math.inf, a, g
        return float(((a * u + g - loss) ** 2).sum()), float(a), float(g)

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        best = minimize_scalar(lambda lb: solve(lb)[0], bounds=(math.log(1e-3), math.log(5.0)), method="bounded",
                               options={"xatol": 1e-10})
        sse, a, g = solve(float(best.x))
    if not math.isfinite(sse):
        return None
    return PowerLaw(a, math.exp(float(best.x)), g, d_max)


def residual_ok(fit: PowerLaw, tokens, losses, se) -> bool:
    """Every residual within NOISE_SE standard errors of its mean (or, without a standard error,
    within RESIDUAL_SHARE of the frontier's fall)."""
    m = np.asarray(losses, float)
    r = np.abs(fit.loss(tokens) - m)
    fall = float(m[0] - m[-1])
    allowed = np.where(np.isfinite(se) & (np.asarray(se, float) > 0), NOISE_SE * np.nan_to_num(se), 0.0)
    allowed = np.maximum(allowed, RESIDUAL_SHARE * fall if not np.isfinite(se).any() else FLAT_RTOL * np.abs(m))
    return bool((r <= allowed).all())
