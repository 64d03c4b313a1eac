"""Weights & Biases, when logging.wandb=true: the run's resolved config and every logged metric.
wandb is imported only then, so a run without it never pays its import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from utils.errors import ConfigError

MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class Wandb:
    name: ClassVar[str] = "wandb"
    wandb: bool = False  # also log to Weights & Biases
    wandb_project: str = "eqtrain"
    wandb_mode: str = "online"  # online | offline (no account needed) | disabled

    def check(self, prefix: str) -> None:
        if self.wandb_mode not in MODES:
            raise ConfigError(f"{prefix}.wandb_mode={self.wandb_mode!r} must be {', '.join(MODES[:-1])} or {MODES[-1]}")

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict) -> "WandbSink | None":
        if not self.wandb or self.wandb_mode == "disabled":
            return None
        import wandb

        return WandbSink(wandb.init(project=self.wandb_project, mode=self.wandb_mode, dir=run_dir, config=config))


class WandbSink:
    def __init__(self, run):
        self._run = run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
