"""How a comparison searches each optimizer's settings: `tune=grid` (every lr crossed with every
sweep combination) or `tune=coordinate` (Wen et al. 2025, "Fantastic Pretraining Optimizers and
Where to Find Them": coordinate descent, one knob at a time around the incumbent).

A setting is a *cell*: one value per axis, the lr axis first, then each swept knob (sorted). The
coordinate search starts at `Space.start` and, round after round, varies one axis with the others
held at the incumbent; the axis's best cell (the lowest mean final val/loss over the tuning seeds
at the largest budget) becomes the incumbent when it beats the incumbent by more than
`coordinate.threshold`. It stops when a whole round moves nothing (converged) or when the next
axis's cells would exceed `coordinate.max_trials`.

The search keeps no state of its own: `coordinate_path` replays it from the results, so a
comparison that is stopped and rerun, and the report that shows the path, reach the same cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TUNE = ("grid", "coordinate")

Cell = tuple  # one value per axis of a Space, in its order


@dataclass(frozen=True)
class Space:
    """One (workload, optimizer)'s search space: the axes (("lr", lrs), (knob, values), ...) and
    the cell the search starts from."""

    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    start: Cell

    def sweep(self, cell: Cell) -> tuple[tuple[str, Any], ...]:
        """A cell's sweep values ((knob, value), ...) without its lr: PlannedRun.sweep's form."""
        return tuple((knob, v) for (knob, _), v in zip(self.axes[1:], cell[1:]))

    def to_json(self) -> dict:
        return {"axes": [[knob, list(values)] for knob, values in self.axes], "start": list(self.start)}

    @staticmethod
    def from_json(node: dict) -> Space:
        return Space(tuple((knob, tuple(values)) for knob, values in node["axes"]), tuple(node["start"]))


def start_value(values: tuple[Any, ...], default: Any) -> Any:
    """Where an axis starts: the optimizer's own value (its yaml lr or knob) when the axis lists it
    (for an lr, the listed lr nearest to it on a log scale), else the axis's middle value."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values) and \
            isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0:
        near = min(values, key=lambda v: abs(math.log(v / default)))
        if abs(math.log(near / default)) < 1e-6:
            return near
    return default if default in values else values[len(values) // 2]


@dataclass(frozen=True)
class Step:
    """One axis of one round: the cells tried (value, mean loss) and the incumbent before and after."""

    round: int
    axis: str
    tried: tuple[tuple[Any, float], ...]
    before: Cell
    after: Cell

    @property
    def moved(self) -> bool:
        return self.after != self.before


@dataclass(frozen=True)
class Path:
    steps: tuple[Step, ...]
    incumbent: Cell
    trials: int  # distinct cells the search has asked for so far
    todo: tuple[Cell, ...]  # cells asked for whose results are not in yet ((): the search is over)
    stop: str  # why the search ended ("" while it runs)


def _nearest_first(values: tuple, at: Any) -> list:
    """An axis's values ordered by their distance (in list position) from the incumbent's."""
    i = values.index(at)
    return sorted(values, key=lambda v: (abs(values.index(v) - i), values.index(v)))


def coordinate_path(space: Space, loss_of: Callable[[Cell], float | None], threshold: float,
                    max_trials: int | None = None) -> Path:
    """Replay the coordinate search on the results known: `loss_of(cell)` is the cell's mean final
    loss over the tuning seeds (inf: a seed failed or diverged), None while not every seed has
    finished. Returns the path so far and the cells to run next."""
    incumbent, steps, tried = space.start, [], {space.start}
    for rnd in range(1, 10_000):  # each move lowers the incumbent's loss: a finite grid ends long before
        moved = False
        for i, (knob, values) in enumerate(space.axes):
            cells = [incumbent[:i] + (v,) + incumbent[i + 1:] for v in _nearest_first(values, incumbent[i])]
            new = [c for c in cells if c not in tried]
            if max_trials is not None and len(tried) + len(new) > max_trials:
                cells = [c for c in cells if c in tried or c in new[:max(0, max_trials - len(tried))]]
                new = [c for c in cells if c not in tried]
                if not new:
                    return Path(tuple(steps), incumbent, len(tried), (), "trial budget spent "
                                f"(coordinate.max_trials={max_trials})")
            tried.update(new)
            losses = {c: loss_of(c) for c in cells}
            waiting = tuple(c for c in cells if losses[c] is None)
            if waiting:
                return Path(tuple(steps), incumbent, len(tried), waiting, "")
            best = min(cells, key=lambda c: (losses[c], c != incumbent, values.index(c[i])))
            after = best if losses[best] < losses[incumbent] - threshold else incumbent
            listed = sorted(cells, key=lambda c: values.index(c[i]))  # the axis's order, not the trial order
            steps.append(Step(rnd, knob, tuple((c[i], losses[c]) for c in listed), incumbent, after))
            moved |= after != incumbent
            incumbent = after
        if not moved:
            return Path(tuple(steps), incumbent, len(tried), (),
                        f"converged: no knob improved the loss by more than coordinate.threshold={threshold:g}")
    raise AssertionError("coordinate search did not end")  # pragma: no cover - a move always lowers the loss


def cell_losses(workloads: dict[str, Any], seeds: int, budget_of: Callable[[str], int]):
    """`loss_of(workload, optimizer, space)` for coordinate_path from the report's Workloads (by name):
    a cell's mean final val/loss over its `seeds` tuning seeds at the workload's largest budget
    (`budget_of(workload)`, in steps); inf when one failed or diverged; None while fewer than `seeds`
    results are in (pending, missing or not run)."""
    def for_search(workload: str, optimizer: str, space: Space) -> Callable[[Cell], float | None]:
        w, budget = workloads.get(workload), budget_of(workload)
        table: dict[tuple, list[float]] = {}
        for res in (w.results if w is not None else ()):  # the Workload keeps the evaluation seeds apart
            run = res.run
            if run.optimizer == optimizer and res.counted and int(run.budget) == budget:
                table.setdefault((float(run.lr), run.setting), []).append(res.loss)

        def loss_of(cell: Cell) -> float | None:
            losses = table.get((float(cell[0]), tuple(sorted(space.sweep(cell)))), [])
            if len(losses) < seeds:
                return None
            return math.fsum(losses) / len(losses) if all(math.isfinite(x) for x in losses) else math.inf
        return loss_of
    return for_search
