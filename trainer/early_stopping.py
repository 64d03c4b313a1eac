"""Early stopping (train.early_stopping.*): end the run when val/loss has not improved by at least
`min_delta` for `patience` evaluations in a row: it stops when validation stops improving.

The decision is one hook after the evaluation: it sets `ctx.finished`, which makes that step the
segment's last (hooks.LoopContext.ending): the checkpointer saves it ("early stop"), the end-of-run
sample runs, `train/stopped_early` = 1 is logged with the step, and the loop ends without error.
Its state (the best value, the count, where it stopped) goes into every checkpoint's manifest, so
a resumed run counts on from where it was, and a run that had stopped stays stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.hooks import Hook, LoopContext
from utils.errors import ConfigError
from utils.logging.messages import say

MANIFEST_KEY = "early_stopping"


@dataclass(frozen=True)
class EarlyStoppingConfig:
    patience: int | None = None  # evaluations without an improvement before the run stops; null = off
    min_delta: float = 0.0  # the least decrease of val/loss that counts as an improvement

    def check(self, prefix: str) -> None:
        if self.patience is not None and self.patience < 1:
            raise ConfigError(f"{prefix}.patience={self.patience} must be a positive number of evaluations, "
                              "or null (off)")
        if self.min_delta < 0 or not math.isfinite(self.min_delta):
            raise ConfigError(f"{prefix}.min_delta={self.min_delta} must be a finite number >= 0")


class EarlyStopping(Hook):
    """Counts evaluations since val/loss last fell below best − min_delta; at `patience`, ends the run."""

    at_start = True  # a resumed run that had stopped stops again before its first step
    needs = ("val/loss",)
    produces = ("train/stopped_early",)

    def __init__(self, cfg: EarlyStoppingConfig, saved: dict | None = None, saver: Any = None):
        saved = saved or {}
        self.patience, self.min_delta = cfg.patience, cfg.min_delta
        # None: saved before the first finite val/loss (state_dict writes inf as null: the manifest is strict JSON)
        best = saved.get("best")
        self.best = math.inf if best is None else float(best)
        self.bad = int(saved.get("bad", 0))  # evaluations in a row without an improvement
        self.stopped_at: int | None = saved.get("stopped_at")
        if saver is not None:
            saver.add_to_manifest(MANIFEST_KEY, self.state_dict)

    def state_dict(self) -> dict:
        return {"best": self.best if math.isfinite(self.best) else None, "bad": self.bad,
                "stopped_at": self.stopped_at}

    def due(self, ctx: LoopContext) -> bool:
        return ctx.step == ctx.start or "val/loss" in ctx.record

    def __call__(self, ctx: LoopContext) -> None:
        if ctx.step == ctx.start and self.stopped_at is not None:
            ctx.finished = f"stopped early at step {self.stopped_at} before this resume"
            say(f"early stopping: the run {ctx.finished}; nothing to train")
            return
        if "val/loss" not in ctx.record:
            return
        val = ctx.record["val/loss"]
        if val < self.best - self.min_delta:
            self.best, self.bad = val, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            self.stopped_at = ctx.step
            ctx.finished = (f"val/loss {val:.4f} has not improved on {self.best:.4f} by {self.min_delta:g} for "
                            f"{self.bad} evaluations (train.early_stopping.patience={self.patience})")
            ctx.add({"train/stopped_early": 1.0})
            say(f"early stopping at step {ctx.step}: {ctx.finished}")
