"""What `train_jax.main` does around a run as a Hydra job: the exit codes, and what a job hands
back to its launcher or sweeper.

- A user error (EqtrainError) is one `error: ...` line on stderr and exit 2; a preempted run
  (saved on a signal) is one `eqtrain: ...` line and its documented exit code (3, or 130 for
  Ctrl-C), which `scripts/slurm/train.sbatch` and submitit requeue on.
- A multirun job that saves without a save_path saves under its own job directory, so a requeued
  or rerun sweep resumes every job with checkpoint.resume=auto.
- Under the Optuna sweeper the job returns one float, the objective: the final val/loss (else
  train/loss); otherwise the latest value of every metric.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from utils.config import to_dict
from utils.errors import EqtrainError
from utils.signals import Preempted


def run_job(cfg, train: Callable[..., dict[str, float]]) -> dict[str, float] | float:
    """`train(config, run_dir)` for the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" probe noise
    hydra_cfg = HydraConfig.get()
    run_dir, config = hydra_cfg.runtime.output_dir, to_dict(cfg)
    ck = config.get("checkpoint") or {}
    if hydra_cfg.mode == RunMode.MULTIRUN and ck.get("save") and not ck.get("save_path"):
        config["checkpoint"] = {**ck, "save_path": os.path.join(run_dir, "checkpoints")}
    try:
        out = train(config, run_dir)
    except Preempted as e:
        print(f"eqtrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except EqtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if "optuna" in str(hydra_cfg.sweeper.get("_target_", "")).lower():
        return float(out.get("val/loss", out.get("train/loss", float("nan"))))
    return out
