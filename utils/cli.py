"""The command line around the work: what `train_jax.main` does around a run as a Hydra job (the
exit codes, what a job hands back to its launcher or sweeper), and the scripts' shared prologue.

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


def quiet_jax_probe() -> None:
    """jax logs a warning for every accelerator plugin it probes and does not find ("no TPU")."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def script_argv(argv: list[str] | None, doc: str) -> list[str] | None:
    """A script's arguments (default: sys.argv[1:]), or None once `doc` is printed for -h/--help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return None
    quiet_jax_probe()
    return argv


def run_job(cfg, train: Callable[..., dict[str, float]]) -> dict[str, float] | float:
    """`train(config, run_dir)` for the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    quiet_jax_probe()
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
