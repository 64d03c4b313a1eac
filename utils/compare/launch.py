"""Running a comparison's plan: in this process, one run after another, resumable.

    run_plan(plan, compare_dir, train=train_jax.train)

`train(cfg, run_dir)` is injected (utils/ never imports train_jax; scripts/compare.py passes it).
Each run composes its overrides as `train_jax.py` would (conf/config.yaml + the run's overrides +
its checkpoint paths) and trains into `{compare_dir}/runs/{run_id}/` (metrics.jsonl, ckpt/), whose
run.json says where it stands: planned -> running -> done | failed. Every run saves under its own
`ckpt/` with `checkpoint.resume=auto`, so the same command on the same directory

- skips done runs (and failed ones: a diverged run is a result; delete its directory to retry),
- resumes a run that was interrupted (its status still "running") from its newest checkpoint
  (a trunk's branch points, a branch's end, or the save a SIGTERM/Ctrl-C made), first cutting
  its metrics.jsonl back to that checkpoint's step so the log reads as an uninterrupted run's,
- and refuses a directory whose compare.json (knobs, run overrides, plan) differs.

A run that raises an EqtrainError is "failed" (a TrainingError, a NaN/inf loss, also
`diverged`), and the comparison goes on; a failed trunk fails its branches without running
them. A signal (Preempted, KeyboardInterrupt) or a bug stops the comparison: the run stays
"running" and the next invocation resumes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

from utils.checkpoint.storage import complete_steps
from utils.compare.plan import Plan, PlannedRun
from utils.errors import ConfigError, EqtrainError, TrainingError
from utils.files import atomic_write

COMPARE_JSON = "compare.json"
RUN_JSON = "run.json"


@dataclass
class Summary:
    done: list[str] = field(default_factory=list)  # trained to the end in this invocation
    skipped: list[str] = field(default_factory=list)  # done (or failed) before
    failed: dict[str, str] = field(default_factory=dict)  # id -> why (this invocation or before)
    diverged: list[str] = field(default_factory=list)  # failed ones whose loss went non-finite

    @property
    def user_errors(self) -> list[str]:
        """Failed for another reason than divergence (a bad knob, unreadable data)."""
        return [r for r in self.failed if r not in self.diverged]

    def line(self, total: int, compare_dir: str) -> str:
        return (f"compare: {total} runs: {len(self.done)} done, {len(self.skipped)} skipped (finished before), "
                f"{len(self.failed)} failed ({len(self.diverged)} diverged) | {compare_dir}")


def write_json(path: str, obj: dict) -> None:
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_dir(compare_dir: str, run_id: str) -> str:
    return os.path.join(compare_dir, "runs", run_id)


def run_overrides(run: PlannedRun, compare_dir: str) -> list[str]:
    """The plan's overrides plus where the run saves (and, for a branch, which checkpoint it loads)."""
    ckpt = lambda run_id: os.path.join(run_dir(compare_dir, run_id), "ckpt")
    out = [*run.overrides, "checkpoint.save=true", f"checkpoint.save_path={ckpt(run.id)}", "checkpoint.resume=auto"]
    if run.kind == "branch":
        out += ["checkpoint.load=true", f"checkpoint.load_path={ckpt(run.trunk)}",
                f"checkpoint.load_file=iter_{run.branch_step}", "checkpoint.overwrite_config=true"]
    return out


def _open_dir(plan: Plan, compare_dir: str) -> None:
    """Write compare.json, or check that the one there is this plan's."""
    path = os.path.join(compare_dir, COMPARE_JSON)
    want = plan.to_json()
    have = read_json(path)
    if have is None:
        os.makedirs(compare_dir, exist_ok=True)
        write_json(path, want)
    elif have != json.loads(json.dumps(want)):
        what = next((k for k in want if have.get(k) != json.loads(json.dumps(want[k]))), "runs")
        raise ConfigError(f"{path} holds another comparison (its {what} differ from this command's): rerun the "
                          "command that made it to continue it, or choose a new dir=")
    for run in plan.runs:  # the whole plan is on disk before the first run starts
        json_path = os.path.join(run_dir(compare_dir, run.id), RUN_JSON)
        if not os.path.exists(json_path):
            write_json(json_path, _record(run, run_overrides(run, compare_dir), "planned"))


def _trim_metrics(directory: str, step: int | None) -> None:
    """Drop metrics.jsonl lines logged after `step` (all of them when None): what an interrupted
    run logged after its last checkpoint is trained again on resume."""
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [] if step is None else [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        with atomic_write(path) as tmp, open(tmp, "w") as f:
            f.writelines(kept)


def _record(run: PlannedRun, overrides: list[str], status: str, error: str | None = None,
            diverged: bool = False) -> dict:
    return {"id": run.id, "workload": run.workload, "optimizer": run.optimizer, "lr": run.lr, "seed": run.seed,
            "kind": run.kind, "budget": run.budget, "trunk": run.trunk, "branch_step": run.branch_step,
            "overrides": overrides, "status": status, "error": error, "diverged": diverged}


def _fail(summary, run, overrides: list[str], json_path: str, say: Callable[[str], None], head: str, error: str,
          diverged: bool) -> None:
    """Record `run` as failed (a diverged run is a result: loss inf in the report) and say so."""
    write_json(json_path, _record(run, overrides, "failed", error, diverged))
    summary.failed[run.id] = error
    if diverged:
        summary.diverged.append(run.id)
    say(f"{head} failed ({'diverged: ' if diverged else ''}{error})")


def run_plan(plan: Plan, compare_dir: str, train: Callable[..., dict], say: Callable[[str], None] = print,
             compose: Callable[[list[str]], object] | None = None) -> Summary:
    """Train every run of `plan` not done yet under `compare_dir` (absolute or relative to the cwd).
    `compose(overrides)` builds a run's config (default: conf/ composed like train_jax.py's)."""
    if compose is None:
        from utils.config import compose_overrides

        compose = lambda overrides: compose_overrides(overrides, job_name="compare")
    compare_dir = os.path.abspath(compare_dir)
    _open_dir(plan, compare_dir)
    summary, total = Summary(), len(plan.runs)
    for i, run in enumerate(plan.runs, 1):
        directory = run_dir(compare_dir, run.id)
        json_path = os.path.join(directory, RUN_JSON)
        overrides = run_overrides(run, compare_dir)
        before = read_json(json_path) or {}
        head = f"[{i}/{total}] {run.id}:"
        if before.get("status") == "done":
            summary.skipped.append(run.id)
            say(f"{head} skipped (done before)")
            continue
        if before.get("status") == "failed":
            summary.failed[run.id] = before.get("error") or "failed"
            if before.get("diverged"):
                summary.diverged.append(run.id)
            say(f"{head} failed before ({summary.failed[run.id]}); delete {directory} to run it again")
            continue
        if run.kind == "branch" and run.trunk in summary.failed:
            _fail(summary, run, overrides, json_path, say, head, f"its trunk {run.trunk} failed",
                  run.trunk in summary.diverged)
            continue
        if before.get("status") == "running":
            saved = complete_steps(os.path.join(directory, "ckpt"))
            _trim_metrics(directory, saved[-1] if saved else None)
            say(f"{head} resumed" + (f" from step {saved[-1]}" if saved else " from the start (no checkpoint yet)"))
        else:
            _trim_metrics(directory, None)  # planned: nothing of it counts yet
        write_json(json_path, _record(run, overrides, "running"))
        try:
            train(compose(overrides), directory)
        except EqtrainError as e:
            _fail(summary, run, overrides, json_path, say, head, str(e).splitlines()[0] if str(e) else type(e).__name__,
                  isinstance(e, TrainingError))
            continue
        write_json(json_path, _record(run, overrides, "done"))
        summary.done.append(run.id)
        say(f"{head} done")
    say(summary.line(total, compare_dir))
    return summary
