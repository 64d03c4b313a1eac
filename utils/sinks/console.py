"""The terminal: a progress bar (or plain lines when output is a file), metric lines, and every
message of a run. `say` is the one way text reaches the user: it goes to stdout (through the bar
when one is drawn, so lines do not tear it) and to the run's log file, from process 0 only."""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import ClassVar

import jax
from tqdm.auto import tqdm

# Under Hydra this logger writes {run dir}/train_jax.log (conf/hydra/job_logging/eqtrain.yaml).
file_log = logging.getLogger("eqtrain")

# (metric, short name, format) shown on the console; every metric still goes to the other sinks.
CONSOLE_KEYS = (("train/loss", "loss", "{:.4f}"), ("train/lr", "lr", "{:.2e}"),
                ("train/tokens_per_sec", "tok/s", "{:,.0f}"), ("train/mfu", "mfu", "{:.1%}"),
                ("val/loss", "val", "{:.4f}"))

_bar: tqdm | None = None  # the open console's bar, if it draws one


def say(text: str) -> None:
    if jax.process_index() != 0:
        return
    file_log.info(text)
    if _bar is not None:
        _bar.write(text)
    else:
        print(text, flush=True)


def warn(message: str) -> None:
    say(f"warning: {message}")


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
        global _bar
        if bar and jax.process_index() == 0:
            _bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step")
        self._bar = _bar

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
        global _bar
        if self._bar is not None:
            self._bar.close()
            if _bar is self._bar:
                _bar = None
