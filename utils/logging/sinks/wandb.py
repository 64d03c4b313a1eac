"""Weights & Biases, when logging.wandb_project is set: the run's resolved config and every logged
metric. wandb is imported only then, so a run without it never pays its import.

The wandb run id is this sink's state (`state_dict() -> {"id": ...}`), kept in the checkpoint, so
a resumed run continues the same wandb run (`wandb.init(id=..., resume="allow")`) instead of
starting a new one. Offline mode needs no account: runs are written under
{run dir}/wandb/offline-run-*-<id> and uploaded later with `wandb sync` (the segments of a resumed
run share one id and are synced into one wandb run, in order)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from utils.errors import ConfigError

MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class Wandb:
    name: ClassVar[str] = "wandb"
    wandb_project: str | None = None  # set = log to Weights & Biases under this project
    wandb_name: str | None = None  # the run's display name (default: wandb's)
    wandb_entity: str | None = None  # team or user (default: your wandb default)
    # online | offline (no account needed; wandb sync later) | disabled | null = WANDB_MODE's, else online
    wandb_mode: str | None = None

    def check(self, prefix: str) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in MODES:
            raise ConfigError(f"{prefix}.wandb_mode={self.wandb_mode!r} must be {', '.join(MODES[:-1])} or {MODES[-1]}")

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict,
              saved: dict | None = None) -> "WandbSink | None":
        # The knob wins over the environment's WANDB_MODE (as wandb.init's own argument does); null
        # leaves the mode to WANDB_MODE, e.g. exported as offline on a cluster with no network.
        mode = self.wandb_mode or os.environ.get("WANDB_MODE") or None
        if self.wandb_project is None or mode == "disabled":
            return None
        import wandb

        run_id = (saved or {}).get("id")  # set when this run was checkpointed with wandb on
        run = wandb.init(project=self.wandb_project, name=self.wandb_name, entity=self.wandb_entity,
                         mode=mode, dir=run_dir, config=wandb_config(config),
                         id=run_id, resume="allow" if run_id else None)
        return WandbSink(run)


def wandb_config(config: dict | None) -> dict:
    """The resolved config as wandb shows it: the run's own knobs, not Hydra's internals."""
    return {k: v for k, v in (config or {}).items() if k != "hydra"}


class WandbSink:
    def __init__(self, run: Any):
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # wandb keeps one step counter per run and drops (with a warning) a step below it: online,
        # a resumed segment's first logs that the previous segment already made (the steps it ran
        # past its last checkpoint) are dropped, not logged twice.
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        import wandb

        self._run.log({"samples": wandb.Table(columns=["prompt", "text"], data=[list(s) for s in samples])}, step=step)

    def state_dict(self) -> dict:
        return {"id": self._run.id}

    def close(self) -> None:
        self._run.finish()
