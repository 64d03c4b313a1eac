"""The command line around the work: what `train_jax.main` does around a run as a Hydra job (the
exit codes, what a job hands back to its launcher or sweeper), and the scripts' shared prologue.

- A user error (EqtrainError) is one `error: ...` line on stderr and exit 2; a preempted run
  (saved on a signal) is one `eqtrain: ...` line and its documented exit code (3, or 130 for
  Ctrl-C), which `scripts/slurm/train.sbatch` and submitit requeue on.
- In a multirun whose jobs share this process (Hydra's default launcher, which the Optuna sweeper
  uses too) a failed job does not end the sweep: it is one line, `error: job N (its overrides):
  why`, and the next job starts; at the end, `MultirunSummary` lists the failed jobs and the
  process exits 2 (1 if a job failed on something other than an EqtrainError, a bug: its traceback
  is printed first). A preempted job (exit 3 or 130) stops the whole multirun: the signal was for
  the process, not for one job; the same command with the same hydra.sweep.dir and
  checkpoint.resume=auto continues it. Jobs that run in their own processes (hydra/launcher=local
  or slurm) end the same way: a failed job prints its line in its own log and hands back nothing
  (exit 0, so submitit does not raise its traceback in the sweep's process), its outcome written
  to `{job dir}/job_outcome.json`, which `MultirunSummary` reads at the end. A preempted one keeps
  its exit code (3), which submitit requeues on.
- Under the Optuna sweeper a failed trial's objective is the worst value (+inf when minimising):
  optuna 2.10 refuses NaN (the plugin then crashes), and +inf keeps the study going and steers
  the sampler away. A study whose only failures are diverged trials (TrainingError) is a
  success (exit 0, the summary names them) as long as one trial finished.
- A multirun job that saves without a save_path saves under its own job directory, so a requeued
  or rerun sweep resumes every job with checkpoint.resume=auto.
- Under the Optuna sweeper the job returns one float, the objective: the final val/loss (else
  train/loss); otherwise the latest value of every metric.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from hydra.experimental.callback import Callback

from utils import compile_cache
from utils.checkpoint.signals import Preempted
from utils.config import to_dict
from utils.errors import EqtrainError, TrainingError
from utils.files import atomic_write


def renamed_argv(argv: list[str]) -> list[str]:
    """train_jax.py's arguments with old optimizer knob names renamed (utils.config.renamed_overrides),
    a warning line each on stderr, before Hydra (which refuses a key the yaml lacks) parses them; a
    refusal (both names given) is one `error:` line and exit 2, as any user error."""
    from utils.config import renamed_overrides

    try:
        return renamed_overrides(argv, lambda line: print(f"warning: {line}", file=sys.stderr))
    except EqtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


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


@dataclass(frozen=True)
class JobOutcome:
    """One job of a multirun run in this process: `error` is None when it finished."""
    num: int
    overrides: tuple[str, ...]
    error: str | None = None
    user_error: bool = True  # an EqtrainError (else a bug: the traceback was printed)
    diverged: bool = False  # a TrainingError


# The jobs of the multirun this process runs (Hydra's default launcher): run_job appends, the
# MultirunSummary callback reads them at the end of the sweep.
JOBS: list[JobOutcome] = []
# A job run in its own process (hydra/launcher=local|slurm) writes its outcome here, in its job dir.
OUTCOME_FILE = "job_outcome.json"


def record(outcome: JobOutcome, shared: bool, run_dir: str) -> None:
    """A multirun job's outcome, where the end of the sweep finds it: JOBS in this process, else a
    file in the job's directory (the sweep's process reads them, utils.cli.job_outcomes)."""
    if shared:
        JOBS.append(outcome)
        return
    with atomic_write(os.path.join(run_dir, OUTCOME_FILE)) as tmp:  # a job killed mid-write leaves none
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(outcome), f)


def job_outcomes(sweep_dir: str, since: float) -> list[JobOutcome]:
    """The outcomes the jobs of a multirun wrote in `sweep_dir`'s job directories since `since`
    (its start: a rerun of a sweep in the same directory ignores the files of jobs it did not run)."""
    found = []
    for name in os.listdir(sweep_dir) if os.path.isdir(sweep_dir) else ():
        path = os.path.join(sweep_dir, name, OUTCOME_FILE)
        if os.path.isfile(path) and os.path.getmtime(path) >= since:
            with open(path) as f:
                fields = json.load(f)
            found.append(JobOutcome(**{**fields, "overrides": tuple(fields["overrides"])}))
    return sorted(found, key=lambda j: j.num)


def run_job(cfg, train: Callable[..., dict[str, float]]) -> dict[str, float] | float | None:
    """`train(config, run_dir)` for the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    quiet_jax_probe()
    hydra_cfg = HydraConfig.get()
    run_dir, config = hydra_cfg.runtime.output_dir, to_dict(cfg)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    ck = config.get("checkpoint") or {}
    if multirun and ck.get("save") and not ck.get("save_path"):
        config["checkpoint"] = {**ck, "save_path": os.path.join(run_dir, "checkpoints")}
    sweeper = hydra_cfg.sweeper
    optuna = multirun and "optuna" in str(sweeper.get("_target_", "")).lower()
    # The jobs share this process: one job's failure must not end the others (SystemExit would).
    shared = multirun and "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    num, overrides = (hydra_cfg.job.num, tuple(hydra_cfg.overrides.task)) if multirun else (0, ())
    job = f"job {num} ({' '.join(overrides)})"
    worst = -math.inf if "max" in str(sweeper.get("direction", "")).lower() else math.inf
    try:
        compile_cache.enable(config)  # before the first compilation; `compile_cache: false` leaves it off
        out = train(config, run_dir)
    except Preempted as e:
        print(f"eqtrain: {job + ': ' if multirun else ''}{e}", file=sys.stderr)
        if shared:  # the signal is for the process, so for the jobs after this one too
            print(f"eqtrain: the multirun stops at job {num}; the same command with "
                  f"hydra.sweep.dir={hydra_cfg.sweep.dir} and checkpoint.resume=auto continues it", file=sys.stderr)
            summarise(JOBS, optuna)
        sys.exit(e.exit_code)
    except EqtrainError as e:
        if not multirun:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"error: {job}: {e}", file=sys.stderr)
        record(JobOutcome(num, overrides, str(e), diverged=isinstance(e, TrainingError)), shared, run_dir)
        return worst if optuna else None
    except Exception as e:  # a bug (or e.g. out of memory) in one job of a sweep: the others go on
        if not multirun:
            raise
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"error: {job}: {reason}", file=sys.stderr)
        record(JobOutcome(num, overrides, reason, user_error=False), shared, run_dir)
        return worst if optuna else None
    if multirun:
        record(JobOutcome(num, overrides), shared, run_dir)
    if optuna:
        return float(out.get("val/loss", out.get("train/loss", worst)))
    return out


def summarise(jobs: list[JobOutcome], optuna: bool = False) -> int:
    """Print which jobs of a multirun failed (stderr) and return the multirun's exit code: 0 when
    none did (or, under Optuna, when only diverged trials did and one trial finished), 2 when
    every failure was an EqtrainError, else 1. Each failed job shows the overrides that set it
    apart from the others."""
    failed = [j for j in jobs if j.error is not None]
    if not failed:
        return 0
    shared = set.intersection(*(set(j.overrides) for j in jobs)) if len(jobs) > 1 else set()
    if optuna and len(failed) < len(jobs) and all(j.diverged for j in failed):
        head = f"eqtrain: {len(failed)} of {len(jobs)} trials diverged (objective inf, the worst); the study went on:"
        code = 0
    else:
        head = f"error: {len(failed)} of {len(jobs)} jobs of the multirun failed:"
        code = 2 if all(j.user_error for j in failed) else 1
    lines = [f"  job {j.num} ({' '.join(o for o in j.overrides if o not in shared)}): {j.error}" for j in failed]
    print("\n".join([head, *lines]), file=sys.stderr)
    return code


class MultirunSummary(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks): at the end of a multirun, list the failed
    jobs and exit non-zero if one did (see `summarise`): the jobs this process ran (JOBS), or those
    that ran in their own processes and left their outcome in their job directories."""

    started = 0.0  # when this multirun began (time.time())

    def on_multirun_start(self, config, **kwargs) -> None:
        JOBS.clear()
        self.started = time.time() - 1.0  # file times are coarse on some filesystems

    def on_multirun_end(self, config, **kwargs) -> None:
        optuna = "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower()
        jobs = JOBS or job_outcomes(str(config.hydra.sweep.dir), self.started)
        code = summarise(jobs, optuna=optuna)
        if code:
            sys.exit(code)
