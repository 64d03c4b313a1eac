"""Time to target read off the budget ladder and D_eff/D from AdamW's tuned frontier
(compare/ladder.py, compare/fit.py), on synthetic comparison directories built with
tests/test_compare_report.py's make_comparison: one optimizer exactly c times as data-efficient as
AdamW, and AdamW losses that are flat, concave or noisy across budgets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import test_compare_report as tcr
from helpers import load_script

from compare.report import build_report

C = 2.0  # the challenger's data efficiency: its loss at budget S is AdamW's at C·S
LADDER = {"adamw": tcr.OPTS["adamw"], "muon": tcr.OPTS["adamw"]}  # the same lr grid, best lr and alpha


def efficient(opt, lr, seed, step):
    """AdamW's synthetic loss; the challenger's is AdamW's at C times the steps (the same tokens per step)."""
    return tcr.LADDER_BASE("adamw", lr, seed, step * (C if opt == "muon" else 1.0))


def make_efficient(root: Path, budgets, monkeypatch) -> str:
    monkeypatch.setattr(tcr, "LADDER_BASE", tcr.base_loss, raising=False)
    monkeypatch.setattr(tcr, "base_loss", efficient)
    tcr.make_comparison(root, budgets=budgets, opts=LADDER, diverged=(), failed_trunk=())
    return Path(build_report(str(root))).read_text()


def _interval(cell: str) -> tuple[float, float]:
    """The reported interval of a cell "v [lo, hi]" (a bound end counts at its bound)."""
    lo, hi = cell.split("[", 1)[1].split("]")[0].split(", ")
    return tcr.num(lo.lstrip("≤≥ ")), tcr.num(hi.lstrip("≤≥ "))


def _value(cell: str) -> str:
    return cell.split(" [")[0]


@pytest.mark.parametrize("budgets", [(100, 200, 400), (100, 150, 250, 400)])
def test_a_c_times_as_data_efficient_optimizer_reads_c(tmp_path, monkeypatch, budgets):
    """muon's loss at budget S is AdamW's at C·S: the ladder's time to target (AdamW's loss at 400)
    is 400 / C, so its speedup is C, and D_eff/D is C wherever AdamW's frontier or its fit reaches
    C·S; each within its reported bootstrap interval. The old reading on the largest budget's curve
    gave 351 steps (1.14×): the muon trunk crosses the cooled target only inside its own cooldown."""
    md = make_efficient(tmp_path, budgets, monkeypatch)
    ttt = {row[0]: row for row in tcr.tables(md)["Time to target"][1:]}
    speedup = ttt["muon"][5]
    lo, hi = _interval(ttt["muon"][6])
    assert lo > 400 / 351  # excludes the old trunk reading's 1.14
    # A seed's offset is the same at every budget, and the bootstrap draws a seed for every budget at
    # once (its branches share one trunk): the offsets cancel, and the interval is the reading's own.
    if budgets == (100, 200, 400):  # 400 / C = 200 is a budget: the crossing is exact
        assert tcr.close(speedup, C) and tcr.close(ttt["muon"][1], 400 / C)
        assert (lo, hi) == pytest.approx((C, C), abs=5e-4)  # printed to 3 decimals: half a unit of the last
    else:  # between 150 and 250, log-linear: this file's own crossing of the exact losses
        front = [tcr.LADDER_BASE("adamw", 2e-3, 0, C * s) for s in budgets]
        target = tcr.LADDER_BASE("adamw", 2e-3, 0, budgets[-1])
        # seed 0's offset moves the frontier and the target alike, so the crossing is the seeds' mean's:
        # within float64 rounding amplified by L / (L_{i-1} - L_i) ~ 100, inside close()'s F64_RTOL
        steps, flag = tcr.ladder_cross(list(budgets), front, target)
        assert flag == "" and tcr.close(ttt["muon"][1], steps)
        assert lo - 5e-4 <= 400 / steps <= hi + 5e-4  # printed to 3 decimals: half a unit of the last
        # log-linear between budgets 150 and 250 reads a convex loss's crossing early: 1.968 for the
        # true 2; the intervals cover the seeds' noise, not that (the report says so)
        assert 0.98 * C < tcr.num(speedup) < C and "not the interpolation between budgets" in md
    rows = {row[0]: row[1:] for row in tcr._rows_after(md, "D_eff/D per budget")}
    read = 0
    for b, cell in zip(budgets, rows["muon"]):
        if _value(cell).startswith(">"):  # C·S past AdamW's largest budget, no fit to read it with
            assert len(budgets) == 3 and C * b > budgets[-1] and "no fit: < 4 budgets" in cell
            continue
        lo, hi = _interval(cell)
        value = tcr.num(_value(cell).split()[0])
        assert lo - 5e-4 <= value <= hi + 5e-4, (b, cell)  # printed to 3 decimals: half a unit of the last
        # C·S one of AdamW's budgets: exactly C (to the printed digits); between its budgets (log-linear)
        # or on its power law (a fit to 4 points): the reading's own error, under 2% here
        assert value == (pytest.approx(C, abs=5e-4) if len(budgets) == 3 else pytest.approx(C, rel=0.02)), (b, cell)
        read += 1
    assert read == (2 if len(budgets) == 3 else 4)  # with 4 budgets the power law reads 250 and 400 (x2, x1.25)
    if len(budgets) == 4:
        assert "(fit)" in rows["muon"][-1] and "residuals (fit − mean)" in md


def _adamw_loss(kind: str):
    """AdamW's loss by step, of a given shape across budgets (muon stays the test file's)."""
    def loss(opt, lr, seed, step):
        if opt != "adamw":
            return tcr.LADDER_BASE(opt, lr, seed, step)
        lr_pen = 0.2 * math.log2(lr / 2e-3) ** 2
        if kind == "flat":
            return 2.3 + lr_pen + tcr.SEED_NOISE[seed]
        if kind == "rising":
            return 2.0 + 0.05 * math.log(step) + lr_pen + tcr.SEED_NOISE[seed]
        if kind == "concave":  # falls faster in log S the longer it trains (2.2 at 100 steps, 1.4 at 800)
            return 3.47 - 0.06 * math.log(step) ** 2 + lr_pen + tcr.SEED_NOISE[seed]
        # noisy: a seed-and-step dependent offset as large as the fall between budgets
        return tcr.LADDER_BASE(opt, lr, seed, step) + 0.03 * math.sin(7.0 * seed + step)
    return loss


@pytest.mark.parametrize("kind, budgets, expect", [
    ("flat", (100, 200, 400), "fit: flat"),
    ("rising", (100, 200, 400), "fit: not decreasing"),
    ("concave", (100, 200, 400, 800), "no reading (the frontier is concave in log D"),
    ("noisy", (100, 200, 400, 800), None),
])
def test_flat_concave_rising_and_noisy_adamw_losses_give_clear_cells(tmp_path, monkeypatch, kind, budgets, expect):
    """No traceback (flat losses raised OverflowError in the old power-law inversion), no silent
    number: flat and rising frontiers label every D_eff cell; a concave one is read between
    budgets and bounded past the largest, saying why; a noisy one gets a number or bound with
    an interval in every cell."""
    monkeypatch.setattr(tcr, "LADDER_BASE", tcr.base_loss, raising=False)
    monkeypatch.setattr(tcr, "base_loss", _adamw_loss(kind))
    tcr.make_comparison(tmp_path, budgets=budgets, opts={"adamw": tcr.OPTS["adamw"], "muon": tcr.OPTS["muon"]},
                        diverged=(), failed_trunk=())
    md = Path(build_report(str(tmp_path))).read_text()
    labelled = "No D_eff/D" in md
    cells = {row[0]: row[1:] for row in tcr._rows_after(md, "No D_eff/D" if labelled else "D_eff/D per budget")}["muon"]
    if expect is not None and expect.startswith("fit:"):
        assert cells == [expect] * len(budgets)
    elif expect is not None:  # read between budgets (no model needed), never extrapolated, and it says why
        assert expect in md and "residuals (fit − mean)" in md
    for c in cells:  # noisy: a label for the whole frontier, or every number with its interval
        assert c == "–" or c.startswith("fit: ") or "[" in c, c


def test_a_bug_in_the_report_is_one_line_and_a_saved_traceback(tmp_path, monkeypatch, capsys):
    """scripts/compare.py's report step: an unexpected exception (here a stand-in RuntimeError) is
    one `error:` line naming the traceback file it saved in the comparison directory, exit code 4."""
    import compare.report

    script = load_script("compare")

    def broken(compare_dir, target=None):
        raise RuntimeError("a bug\nsecond line")

    monkeypatch.setattr(compare.report, "build_report", broken)
    assert script.main(["--report", str(tmp_path)]) == 4
    err = capsys.readouterr().err.strip()
    saved = tmp_path / "report_error.txt"
    assert err.count("\n") == 0 and err.startswith("error: the report could not be built (RuntimeError: a bug)")
    assert str(saved) in err and "--report" in err
    assert "Traceback" in saved.read_text() and "second line" in saved.read_text()
