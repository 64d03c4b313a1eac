"""Running a comparison's plan: resumable, in this process or as one job per run.

    run_plan(plan, compare_dir, train=train_jax.train)              # in this process, one run after another
    run_jobs(plan, compare_dir, submit=..., parallel=4)             # a process or SLURM job per run

`train(cfg, run_dir)` is injected (utils/ never imports train_jax; scripts/compare.py passes it).
Each run composes its overrides as `train_jax.py` would (conf/config.yaml + the run's overrides +
its checkpoint paths) and trains into `{compare_dir}/runs/{run_id}/` (metrics.jsonl, ckpt/), whose
run.json says where it stands: planned -> running -> done | failed. Every run saves under its own
`ckpt/` with `checkpoint.resume=auto`, so the same command on the same directory

- skips done runs (and failed ones: a diverged run is a result; delete its directory to retry),
- resumes a run that was interrupted (its status still "running") from its newest checkpoint
  (a trunk's branch points, every `save_every` steps when set, or the save a SIGTERM/Ctrl-C made;
  a branch's end only with keep_checkpoints), first cutting its metrics.jsonl back to that
  checkpoint's step so the log reads as an uninterrupted run's,
- and refuses a directory whose compare.json (knobs, run overrides, plan) differs.

A run that raises an EqtrainError is "failed" (a TrainingError, a NaN/inf loss, also
`diverged`), and the comparison goes on; a failed trunk fails its branches without running
them. A signal (Preempted, KeyboardInterrupt) or a bug stops the comparison: the run stays
"running" and the next invocation resumes it.

With a launcher (`run_jobs`), each run is one job running `run_one` (scripts/compare.py --run DIR
ID); the driver submits trunks first and a branch only once its trunk's run.json says done (a
failed trunk's branches are recorded failed unrun), keeping at most `parallel` jobs in flight,
and reads each job's outcome back from run.json when it ends. A job that ends with its run still
"running" (killed, out of time) is reported interrupted: rerun the command to resume it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from compare.plan import CompareConfig, Plan, PlannedRun, entry_of, override_key, phase_seeds, run_json
from optimizer.renames import new_name
from trainer import process_cache
from utils import compile_cache
from utils.checkpoint.storage import complete_steps
from utils.config import to_dict
from utils.errors import ConfigError, EqtrainError, TrainingError
from utils.files import atomic_write
from utils.logging.metrics_file import read_metrics
from utils.versions import provenance

COMPARE_JSON = "compare.json"
# compare.json's list of the sessions that ran the comparison: each one's commit (and dirty flag),
# package versions, CPU, device and date; a continuation with the same set-up adds nothing.
PROVENANCE = "provenance"
RUN_JSON = "run.json"


@dataclass
class Summary:
    done: list[str] = field(default_factory=list)  # trained to the end in this invocation
    skipped: list[str] = field(default_factory=list)  # done (or failed) before
    failed: dict[str, str] = field(default_factory=dict)  # id -> why (this invocation or before)
    diverged: list[str] = field(default_factory=list)  # failed ones whose loss went non-finite
    interrupted: list[str] = field(default_factory=list)  # a job ended with its run unfinished

    @property
    def user_errors(self) -> list[str]:
        """Failed for another reason than divergence (a bad knob, unreadable data)."""
        return [r for r in self.failed if r not in self.diverged]

    def add(self, outcome: str, record: dict) -> None:
        run_id = record["id"]
        if outcome == "done":
            self.done.append(run_id)
        elif outcome == "skipped":
            self.skipped.append(run_id)
        elif outcome in ("failed", "failed before"):
            self.failed[run_id] = record.get("error") or "failed"
            if record.get("diverged"):
                self.diverged.append(run_id)
        else:
            self.interrupted.append(run_id)

    def line(self, total: int, compare_dir: str) -> str:
        stopped = f", {len(self.interrupted)} interrupted (rerun to resume)" if self.interrupted else ""
        return (f"compare: {total} runs: {len(self.done)} done, {len(self.skipped)} skipped (finished before), "
                f"{len(self.failed)} failed ({len(self.diverged)} diverged){stopped} | {compare_dir}")


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


def _save_steps(run: PlannedRun, save_every: int | None) -> list[int] | None:
    """The steps a run saves at with `save_every`: its multiples, the trunk's branch points (from
    its plan) and its end; None without save_every (the plan's own saves)."""
    if not save_every:
        return None
    end = max_steps(run)
    planned = next((o.split("=", 1)[1] for o in run.overrides if override_key(o) == "checkpoint.save_steps"), "[]")
    keep = {int(s) for s in planned.strip("[]").split(",") if s}
    return sorted({*range(save_every, end + 1, save_every), *keep, end})


def kept_steps(run: PlannedRun) -> set[int]:
    """The checkpoints a finished run keeps: a trunk's branch points, a branch's end."""
    if run.kind == "branch":
        return {int(run.budget)}
    planned = next(o.split("=", 1)[1] for o in run.overrides if override_key(o) == "checkpoint.save_steps")
    return {int(s) for s in planned.strip("[]").split(",") if s}


def run_overrides(run: PlannedRun, compare_dir: str, save_every: int | None = None,
                  keep_checkpoints: bool = False) -> list[str]:
    """The plan's overrides plus where the run saves (and, for a branch, which checkpoint it loads).
    A branch skips the save at its end unless `keep_checkpoints`: prune_done would delete it at once
    (a stop signal's save, and save_every's, still happen)."""
    ckpt = lambda run_id: os.path.join(run_dir(compare_dir, run_id), "ckpt")
    steps = _save_steps(run, save_every)
    out = [o for o in run.overrides if steps is None or override_key(o) != "checkpoint.save_steps"]
    if steps is not None:
        out.append(f"checkpoint.save_steps=[{','.join(map(str, steps))}]")
    out += ["checkpoint.save=true", f"checkpoint.save_path={ckpt(run.id)}", "checkpoint.resume=auto"]
    if run.kind == "branch":
        out += ["checkpoint.load=true", f"checkpoint.load_path={ckpt(run.trunk)}",
                f"checkpoint.load_file=iter_{run.branch_step}", "checkpoint.overwrite_config=true"]
        out += [] if keep_checkpoints else ["checkpoint.save_at_end=false"]
    return out


def jax_device() -> str:
    """This process's accelerator, as runs started from here see it (a launcher's jobs may run elsewhere)."""
    import jax

    return f"{jax.device_count()} x {jax.devices()[0].device_kind}"


def _setup(session: dict) -> tuple:
    return tuple(json.dumps(session.get(k), sort_keys=True) for k in ("commit", "dirty", "versions", "cpu", "device"))


def same_order(plan_json: dict) -> dict:
    """compare.json with every override list in one order (by knob; one knob's overrides keep theirs):
    Hydra applies overrides of different knobs alike in any order, so the same overrides typed in
    another order are the same comparison."""
    def order(overrides):
        return sorted(overrides, key=override_key)

    out = {**plan_json, "run_overrides": order(plan_json.get("run_overrides", []))}
    out["runs"] = [{**r, "overrides": order(r.get("overrides", []))} for r in plan_json.get("runs", [])]
    return out


EVALUATION = "evaluation"  # compare.json's record of the evaluation phase (seeds.eval), added once it starts
PHASE_RECORD = {"eval": EVALUATION, "target": "target"}  # compare.json's record of each phase after tuning
# Knobs whose change alters runs already made (their schedules, data or length): a comparison cannot grow by them.
FIXED_KNOBS = ("budgets", "budget_unit", "warmup", "cooldown_fraction", "cooldown_shape", "data_seed",
               "seeds_vary_data", "val_every")


def default_knobs() -> dict:
    """Every comparison knob's default as compare.json records it (Plan.to_json's JSON forms: an empty
    tuple default is the [] or {} a directory holds), less the two without one (optimizers, budgets)."""
    knobs = Plan(CompareConfig((), ()), (), ()).to_json()["knobs"]
    return {k: v for k, v in json.loads(json.dumps(knobs)).items() if k not in ("optimizers", "budgets")}


def growth_refused(planned: dict, wanted: dict, evaluated: bool) -> str | None:
    """None when `wanted` (this command's plan, same_order'd) grows `planned` (the directory's): the
    same run overrides and fixed knobs, and every run planned before planned alike (more seeds,
    optimizers, lrs, sweep values or workloads add runs beside them); else what differs."""
    if planned.get("run_overrides") != wanted.get("run_overrides"):
        return "its run_overrides differ from this command's"
    old_knobs, new_knobs = planned.get("knobs") or {}, wanted.get("knobs") or {}
    # a knob the directory does not record (older than the knob) had its default
    default = default_knobs()
    fixed = next((k for k in FIXED_KNOBS if old_knobs.get(k, default.get(k)) != new_knobs.get(k, default.get(k))), None)
    if fixed:
        return (f"its {fixed} differ from this command's, which would change the runs already made; a comparison "
                "grows by seeds, optimizers, lrs, sweep values and workloads only")
    runs = {r["id"]: r for r in wanted.get("runs", [])}
    changed = next((r["id"] for r in planned.get("runs", []) if runs.get(r["id"]) != r), None)
    if changed:
        return f"its runs differ from this command's: {changed} is not planned alike"
    if evaluated:
        return ("its evaluation phase (seeds.eval) or target track has chosen its settings already, so it cannot "
                "grow; its runs differ from this command's")
    return None


def old_knob_names(plan_json: dict) -> list[str]:
    """The optimizer knobs a comparison's runs set under a name since renamed (optimizer/renames.py):
    such a directory continues with the command that made it (its run ids hold the old names)."""
    found = set()
    variants = (plan_json.get("knobs") or {}).get("variants") or {}
    for run in plan_json.get("runs", []):
        for key in map(override_key, run.get("overrides", [])):
            parts = key.split(".")
            if parts[0] == "optimizer" and len(parts) in (2, 4):
                group = parts[2] if len(parts) == 4 and parts[1] == "groups" else None
                if new_name(entry_of(variants, run.get("optimizer", ""))[0], parts[-1], group):
                    found.add(key)
    return sorted(found)


def open_dir(plan: Plan, compare_dir: str, runs: tuple[PlannedRun, ...] = ()) -> None:
    """Write compare.json, or check that the one there is this plan's; then a run.json for every
    run of the plan (and of `runs`, lr.extend's) not there yet."""
    path = os.path.join(compare_dir, COMPARE_JSON)
    want = plan.to_json()
    have = read_json(path)
    session = provenance(jax_device())
    if have is None:
        os.makedirs(compare_dir, exist_ok=True)
        write_json(path, {**want, PROVENANCE: [session]})
    else:
        sessions = have.pop(PROVENANCE, [])
        # keys the plan does not make (the evaluation phase's record) are not part of the check
        planned = same_order({k: v for k, v in have.items() if k in want})
        wanted = same_order(json.loads(json.dumps(want)))
        # a knob added to the harness after the directory was made, left at its default, changes nothing
        defaults = default_knobs()
        recorded = planned.get("knobs") or {}
        wanted["knobs"] = {k: v for k, v in wanted.get("knobs", {}).items()
                           if k in recorded or k not in defaults or v != defaults[k]}
        if planned != wanted:
            refused = growth_refused(planned, wanted, any(k in have for k in PHASE_RECORD.values()))
            if refused:
                old = [k for k in old_knob_names(planned) if k not in old_knob_names(wanted)]
                if old:
                    refused += (f"; it was planned with the old knob names {', '.join(old)}, which still work: give "
                                "them as it did")
                raise ConfigError(f"{path} holds another comparison ({refused}): rerun the command that made it to "
                                  "continue it, or choose a new dir=")
            # it grows: every run planned before is planned alike; the new plan (with the old runs) replaces it
            new = len(wanted.get("runs", [])) - len(planned.get("runs", []))
            print(f"compare: {compare_dir} grows by {new} runs (more seeds, optimizers, lrs, sweep values or "
                  "workloads); its runs done before are kept" if new else
                  f"compare: {compare_dir}: its knobs change to this command's, which plans the same runs")
            have = {**{k: v for k, v in have.items() if k not in want}, **want}
            write_json(path, {**have, PROVENANCE: [*sessions, session] if not sessions or
                              _setup(sessions[-1]) != _setup(session) else sessions})
        elif not sessions or _setup(sessions[-1]) != _setup(session):  # a continuation on other code or machine
            write_json(path, {**have, PROVENANCE: [*sessions, session]})
    for run in (*plan.runs, *runs):  # the whole plan is on disk before the first run starts
        json_path = os.path.join(run_dir(compare_dir, run.id), RUN_JSON)
        if not os.path.exists(json_path):
            write_json(json_path, _record(run, run_overrides(run, compare_dir), "planned"))


def record_evaluation(plan: Plan, compare_dir: str, chosen: dict, runs: tuple[PlannedRun, ...],
                      phase: str = "eval") -> tuple[PlannedRun, ...]:
    """seeds.eval: the evaluation phase's chosen settings and runs, written into compare.json's
    "evaluation" the first time; later, the recorded runs (the choice made when the evaluation
    started stands, so a rerun finishes the same evaluation). Returns the runs to train.
    phase="target": the target track's, in compare.json's "target"."""
    path = os.path.join(compare_dir, COMPARE_JSON)
    have = read_json(path) or {}
    key = PHASE_RECORD[phase]
    if key in have:
        return tuple(PlannedRun(**{**r, "overrides": tuple(r["overrides"]), "sweep": tuple(r["sweep"].items())})
                     for r in have[key]["runs"])
    choice = [{"workload": w, "optimizer": o, "budget": b, "lr": lr, "sweep": dict(sweep)}
              for (w, o), per_budget in sorted(chosen.items()) for b, (sweep, lr) in sorted(per_budget.items())]
    have[key] = {"seeds": list(phase_seeds(plan.knobs, phase)), "chosen": choice, "runs": [run_json(r) for r in runs]}
    write_json(path, have)
    return runs


def load_run(compare_dir: str, run_id: str) -> PlannedRun:
    """A run back from its run.json (what a job is given: the directory and the id)."""
    record = read_json(os.path.join(run_dir(compare_dir, run_id), RUN_JSON))
    if record is None:
        raise ConfigError(f"{run_dir(compare_dir, run_id)}: no {RUN_JSON}; give a run id of that comparison")
    return PlannedRun(record["id"], record["workload"], record["optimizer"], record["lr"], record["seed"],
                      record["kind"], record["budget"], record["trunk"], record["branch_step"],
                      tuple(record["plan_overrides"]), tuple((record.get("sweep") or {}).items()),
                      record.get("phase", "tune"))


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


def _prune(directory: str, keep: set[int]) -> None:
    """Delete a finished run's checkpoints other than `keep` (save_every's, needed only to resume)."""
    ckpt = os.path.join(directory, "ckpt")
    for step in complete_steps(ckpt):
        if step not in keep:
            shutil.rmtree(os.path.join(ckpt, f"iter_{step}"), ignore_errors=True)


def prune_done(runs: tuple[PlannedRun, ...], compare_dir: str, run: PlannedRun) -> None:
    """After branch `run` is done, delete the checkpoints nothing needs any more: its own (the report
    reads metrics.jsonl; a done run is never resumed) and, once every branch of its trunk among `runs`
    is done, the trunk's (a failed branch keeps it, to be run again). compare.py's keep_checkpoints=true
    skips this."""
    if run.kind != "branch":
        return
    shutil.rmtree(os.path.join(run_dir(compare_dir, run.id), "ckpt"), ignore_errors=True)
    done = lambda run_id: (read_json(os.path.join(run_dir(compare_dir, run_id), RUN_JSON)) or {}).get("status")
    if all(done(r.id) == "done" for r in runs if r.kind == "branch" and r.trunk == run.trunk):
        shutil.rmtree(os.path.join(run_dir(compare_dir, run.trunk), "ckpt"), ignore_errors=True)


def _record(run: PlannedRun, overrides: list[str], status: str, error: str | None = None,
            diverged: bool = False) -> dict:
    info = run_json(run)
    return {**{k: info[k] for k in ("id", "workload", "optimizer", "lr", "seed", "kind", "budget", "trunk",
                                     "branch_step", "sweep", "phase")},
            "overrides": overrides, "status": status, "error": error, "diverged": diverged,
            "plan_overrides": info["overrides"]}  # without paths: what a job rebuilds the run from


def run_one(run: PlannedRun, compare_dir: str, train: Callable[..., Any], compose: Callable | None = None,
            save_every: int | None = None, say: Callable[[str], None] = print, head: str = "",
            quiet: bool = False, keep_checkpoints: bool = False) -> tuple[str, dict]:
    """Train `run` unless it is done or failed; (outcome, its run.json record after). Outcome:
    done | skipped | failed | failed before. A signal or a bug propagates, the run left "running".
    `quiet`: the trainer's output goes to the run's train.log (_logged)."""
    compose = compose or default_compose()
    head = head or f"{run.id}:"
    began = begin(run, compare_dir, save_every, say, head, keep_checkpoints)
    if isinstance(began[0], str):
        return began
    overrides, json_path = began
    directory = run_dir(compare_dir, run.id)
    t0 = time.perf_counter()
    try:
        config = compose(overrides)
        # As train_jax.py's entry point does: the persistent compilation cache, so that the runs, whose
        # knobs are the step's arguments (optimizer/arguments.py), load each other's programs.
        compile_cache.enable(to_dict(config))
        with _logged(directory, quiet):
            train(config, directory)
    except EqtrainError as e:
        return fail_with(run, overrides, json_path, say, head, e)
    return finish(run, overrides, compare_dir, save_every, say, head, t0)


def default_compose() -> Callable:
    """In a comparison process, conf/'s groups composed once per selection (compose_reusing)."""
    from utils.config import compose_reusing

    return lambda overrides: compose_reusing(overrides, job_name="compare")


def begin(run: PlannedRun, compare_dir: str, save_every: int | None, say: Callable[[str], None],
          head: str, keep_checkpoints: bool = False) -> tuple[str, dict] | tuple[list[str], str]:
    """Before `run` trains: (outcome, record) when it will not (done or failed before, its trunk failed);
    else (its overrides, its run.json path), the run recorded "running" and its metrics cut back to
    its newest checkpoint (a resumed run) or emptied."""
    directory = run_dir(compare_dir, run.id)
    json_path = os.path.join(directory, RUN_JSON)
    overrides = run_overrides(run, compare_dir, save_every, keep_checkpoints)
    before = read_json(json_path) or {}
    if before.get("status") == "done":
        say(f"{head} skipped (done before)")
        return "skipped", before
    if before.get("status") == "failed":
        say(f"{head} failed before ({before.get('error') or 'failed'}); delete {directory} to run it again")
        return "failed before", before
    if run.kind == "branch":
        trunk = read_json(os.path.join(run_dir(compare_dir, run.trunk), RUN_JSON)) or {}
        if trunk.get("status") == "failed":
            return _fail(run, overrides, json_path, say, head, f"its trunk {run.trunk} failed",
                         bool(trunk.get("diverged")))
        if trunk.get("status") != "done":
            raise ConfigError(f"{run.id}: its trunk {run.trunk} is {trunk.get('status') or 'missing'}, not done: "
                              "run the trunk first")
    if before.get("status") == "running":
        saved = complete_steps(os.path.join(directory, "ckpt"))
        _trim_metrics(directory, saved[-1] if saved else None)
        say(f"{head} resumed" + (f" from step {saved[-1]}" if saved else " from the start (no checkpoint yet)"))
    else:
        _trim_metrics(directory, None)  # planned: nothing of it counts yet
    write_json(json_path, _record(run, overrides, "running"))
    return overrides, json_path


def fail_with(run: PlannedRun, overrides: list[str], json_path: str, say: Callable[[str], None], head: str,
              e: EqtrainError) -> tuple[str, dict]:
    """A run that raised `e` recorded failed (a TrainingError: diverged)."""
    return _fail(run, overrides, json_path, say, head, str(e).splitlines()[0] if str(e) else type(e).__name__,
                 isinstance(e, TrainingError))


def finish(run: PlannedRun, overrides: list[str], compare_dir: str, save_every: int | None,
           say: Callable[[str], None], head: str, t0: float) -> tuple[str, dict]:
    """A run that trained to its end recorded done (save_every's checkpoints pruned)."""
    directory = run_dir(compare_dir, run.id)
    if save_every:
        _prune(directory, kept_steps(run))
    record = _record(run, overrides, "done")
    write_json(os.path.join(directory, RUN_JSON), record)
    loss = final_val_loss(directory)
    say(f"{head} done in {time.perf_counter() - t0:.1f} s" + (f" | val/loss {loss:.4f}" if loss is not None else ""))
    return "done", record


TRAIN_LOG = "train.log"  # a run's trainer output (stdout and stderr) when the comparison runs it in-process


@contextlib.contextmanager
def _logged(directory: str, quiet: bool):
    """With `quiet`, what the trainer prints goes to the run's own train.log (appended: a resumed run
    keeps its first part), so the console keeps one line per run."""
    if not quiet:
        yield
        return
    with open(os.path.join(directory, TRAIN_LOG), "a", buffering=1) as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def final_val_loss(directory: str) -> float | None:
    """The last val/loss a run logged (None: none)."""
    path = os.path.join(directory, "metrics.jsonl")
    losses = [r["val/loss"] for r in read_metrics(path) if "val/loss" in r] if os.path.isfile(path) else []
    return float(losses[-1]) if losses else None


def max_steps(run: PlannedRun) -> int:
    """A run's train.max_steps, from its plan's overrides."""
    return next(int(o.split("=", 1)[1]) for o in reversed(run.overrides) if override_key(o) == "train.max_steps")


def planned_steps(run: PlannedRun) -> int:
    """The optimizer steps a run trains: its train.max_steps, less the branch point for a branch."""
    return max_steps(run) - (run.branch_step or 0)


def eta(done: list[tuple[PlannedRun, float]], left: tuple[PlannedRun, ...]) -> float | None:
    """Seconds the runs `left` should take, from the runs trained so far (run, seconds): per kind
    (trunk, branch), a fixed part per run (compilation, start-up) and a part per step, fitted by
    least squares when the runs differ in length, else their mean per run. None: nothing to go on."""
    total = 0.0
    for kind in ("trunk", "branch"):
        todo = [planned_steps(r) for r in left if r.kind == kind]
        if not todo:
            continue
        mine = [(planned_steps(r), sec) for r, sec in done if r.kind == kind] or [
            (planned_steps(r), sec) for r, sec in done]
        if not mine:
            return None
        steps, secs = np.array(mine, dtype=float).T
        if len(set(steps)) > 1:
            slope = max(float(np.polyfit(steps, secs, 1)[0]), 0.0)
            fixed = max(float(np.mean(secs - slope * steps)), 0.0)  # least squares' intercept, given that slope
            total += sum(fixed + slope * n for n in todo)
        else:
            total += len(todo) * float(secs.mean())
    return total


def f_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


def _fail(run, overrides: list[str], json_path: str, say: Callable[[str], None], head: str, error: str,
          diverged: bool) -> tuple[str, dict]:
    """Record `run` as failed (a diverged run is a result: loss inf in the report) and say so."""
    record = _record(run, overrides, "failed", error, diverged)
    write_json(json_path, record)
    say(f"{head} failed ({'diverged: ' if diverged else ''}{error})")
    return "failed", record


def run_plan(plan: Plan, compare_dir: str, train: Callable[..., Any], say: Callable[[str], None] = print,
             compose: Callable[[list[str]], object] | None = None, runs: tuple[PlannedRun, ...] | None = None,
             save_every: int | None = None, quiet: bool = True, keep_checkpoints: bool = False,
             pack: int = 1) -> Summary:
    """Train every run of `plan` (or `runs`: lr.extend's) not done yet under `compare_dir`, in this
    process, one console line per run (its time and final val/loss) and an estimate of the time left;
    with `quiet` each run's trainer output goes to its train.log; without `keep_checkpoints` the
    checkpoints of finished runs go (prune_done). `compose(overrides)` builds a run's config (default:
    conf/ composed like train_jax.py's). `pack` > 1: runs that may train together do, up to `pack` per
    vmapped program (compare/pack.py; `train` is then unused: trainer/pack.py trains them)."""
    compare_dir = os.path.abspath(compare_dir)
    todo = plan.runs if runs is None else runs
    open_dir(plan, compare_dir, todo if runs is not None else ())
    summary, total, trained = Summary(), len(todo), []
    heads = {run.id: f"[{i}/{total}] {run.id}:" for i, run in enumerate(todo, 1)}
    ended = 0

    def on_outcome(run: PlannedRun, outcome: str, record: dict, seconds: float) -> None:
        nonlocal ended
        ended += 1
        summary.add(outcome, record)
        if outcome == "done" and not keep_checkpoints:
            prune_done(todo, compare_dir, run)
        if outcome in ("done", "failed"):
            trained.append((run, seconds))
        ids_ended.add(run.id)
        left = eta(trained, tuple(r for r in todo if r.id not in ids_ended)) if ended < total else None
        if left is not None and outcome in ("done", "failed"):
            say(f"  {total - ended} runs left, about {f_duration(left)}")

    ids_ended: set[str] = set()
    with process_cache.sharing():  # the tokenizer, data and traced steps built once for the runs alike
        if pack > 1:
            from compare.pack import run_packed

            run_packed(todo, compare_dir, pack, train, compose, save_every, say, heads, quiet, on_outcome,
                       keep_checkpoints)
        else:
            for run in todo:
                t0 = time.perf_counter()
                outcome, record = run_one(run, compare_dir, train, compose, save_every, say, heads[run.id], quiet,
                                          keep_checkpoints)
                on_outcome(run, outcome, record, time.perf_counter() - t0)
    say(summary.line(total, compare_dir))
    return summary


def run_jobs(plan: Plan, compare_dir: str, submit: Callable[[PlannedRun], Any], parallel: int = 1,
             say: Callable[[str], None] = print, runs: tuple[PlannedRun, ...] | None = None,
             poll_s: float = 1.0, keep_checkpoints: bool = False) -> Summary:
    """Train every run not done yet as its own job: `submit(run)` starts one (a submitit Job: its
    `done()`, `job_id`, `exception()`) that runs `run_one`. Trunks are submitted first; a branch once
    its trunk is done; at most `parallel` jobs at a time."""
    compare_dir = os.path.abspath(compare_dir)
    todo = plan.runs if runs is None else runs
    open_dir(plan, compare_dir, todo if runs is not None else ())
    summary, total = Summary(), len(todo)
    index = {run.id: i for i, run in enumerate(todo, 1)}
    status = lambda run_id: (read_json(os.path.join(run_dir(compare_dir, run_id), RUN_JSON)) or {})
    queue = []
    for run in todo:
        record = status(run.id)
        if record.get("status") in ("done", "failed"):
            before = "skipped" if record["status"] == "done" else "failed before"
            summary.add(before, record)
            say(f"[{index[run.id]}/{total}] {run.id}: {'skipped (done before)' if before == 'skipped' else before}")
        else:
            queue.append(run)
    flying: dict[str, tuple[Any, PlannedRun]] = {}
    while queue or flying:
        for run in list(queue):
            if len(flying) >= max(1, parallel):
                break
            head = f"[{index[run.id]}/{total}] {run.id}:"
            if run.kind == "branch":
                trunk = status(run.trunk).get("status")
                if trunk == "failed":
                    queue.remove(run)
                    summary.add(*run_one(run, compare_dir, None, save_every=None, say=say, head=head))
                    continue
                if trunk != "done" or run.trunk in flying:  # its trunk's job is over and done
                    if trunk != "done" and run.trunk not in flying and all(r.id != run.trunk for r in queue):
                        queue.remove(run)  # its trunk's job ended unfinished: nothing to branch from yet
                        summary.add("interrupted", status(run.id))
                        say(f"{head} not started (its trunk {run.trunk} did not finish)")
                    continue
            queue.remove(run)
            job = submit(run)
            flying[run.id] = (job, run)
            say(f"{head} submitted (job {job.job_id})")
        time.sleep(poll_s)
        for run_id, (job, _run) in list(flying.items()):
            if not job.done():
                continue
            del flying[run_id]
            record, head = status(run_id), f"[{index[run_id]}/{total}] {run_id}:"
            if record.get("status") == "done":
                summary.add("done", record)
                say(f"{head} done")
                if not keep_checkpoints:
                    prune_done(todo, compare_dir, _run)
            elif record.get("status") == "failed":
                summary.add("failed", record)
                say(f"{head} failed ({'diverged: ' if record.get('diverged') else ''}{record.get('error')})")
            else:
                summary.add("interrupted", record)
                try:
                    error = job.exception()
                except Exception as e:  # noqa: BLE001 (submitit: no result file from a killed job)
                    error = e
                why = str(error).strip().splitlines()[-1] if error else "it ended before the run did"
                say(f"{head} interrupted (job {job.job_id}: {why}); rerun the command to resume it")
    say(summary.line(total, compare_dir))
    return summary

