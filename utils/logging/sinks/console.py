"""The terminal sink: a progress bar (or plain lines when output is a file) and metric lines.
Messages (`say`, `warn`) live in utils/logging/messages.py and pass through the bar while it is drawn."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import ClassVar

import jax
from tqdm.auto import tqdm

from utils.logging.messages import attach_bar, current_bar, detach_bar, file_log, say

# (metric, short name, format) shown on the console; every metric still goes to the other sinks.
CONSOLE_KEYS = (("train/loss", "loss", "{:.4f}"), ("train/lr", "lr", "{:.2e}"),
                ("train/tokens_per_sec", "tok/s", "{:,.0f}"), ("train/mfu", "mfu", "{:.1%}"),
                ("val/loss", "val", "{:.4f}"))

def short_metrics(metrics: dict[str, float]) -> dict[str, str]:
    return {short: fmt.format(metrics[k]) for k, short, fmt in CONSOLE_KEYS
            if k in metrics and math.isfinite(metrics[k])}


@dataclass(frozen=True)
class Console:
    name: ClassVar[str] = "console"
    progress_bar: bool = True  # a tqdm bar on a terminal; plain lines when output is a file (SLURM)

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict,
              saved: dict | None = None) -> "ConsoleSink":
        return ConsoleSink(self.progress_bar and sys.stderr.isatty(), total_steps, start_step)


class ConsoleSink:
    def __init__(self, bar: bool, total_steps: int, start_step: int):
        if bar and jax.process_index() == 0:
            attach_bar(tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step"))
        self._bar = current_bar()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = short_metrics(metrics)
        line = f"step {step:>6} | " + " | ".join(f"{k} {v}" for k, v in shown.items())
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            file_log.info(line)
        elif shown:
            say(line)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            detach_bar(self._bar)
