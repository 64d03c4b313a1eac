"""Where metrics go: `metrics.jsonl` in the run directory, the console, and optionally wandb.

Only process 0 writes. The training loop hands over plain floats it already pulled from the
device on a logging step; nothing here touches device arrays.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

import jax
from tqdm.auto import tqdm

from utils.config import LoggingConfig

# Under Hydra this logger writes the run's log file (conf/hydra/job_logging/eqtrain.yaml).
file_log = logging.getLogger("eqtrain")

CONSOLE_KEYS = (("train/loss", "loss", "{:.4f}"), ("train/lr", "lr", "{:.2e}"),
                ("train/tokens_per_sec", "tok/s", "{:,.0f}"), ("train/mfu", "mfu", "{:.1%}"),
                ("val/loss", "val", "{:.4f}"))


def _fmt(metrics: dict[str, float]) -> dict[str, str]:
    return {short: fmt.format(metrics[k]) for k, short, fmt in CONSOLE_KEYS if k in metrics and math.isfinite(metrics[k])}


class RunLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: str, total_steps: int, start_step: int,
                 config_dict: dict[str, Any] | None = None):
        self.is_main = jax.process_index() == 0
        self.path = os.path.join(run_dir, cfg.metrics_file)
        self._file = open(self.path, "a") if self.is_main else None
        self._bar = None
        if self.is_main and cfg.progress_bar and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step")
        self._wandb = None
        if self.is_main and cfg.wandb and cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=run_dir,
                                     config=config_dict)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        shown = _fmt(metrics)
        line = f"step {step:>6} | " + " | ".join(f"{k} {v}" for k, v in shown.items())
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            file_log.info(line)
        elif shown:
            self.print(line)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        file_log.info(text)
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
