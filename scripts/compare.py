"""Compare optimizers: per-optimizer lr sweeps at several budgets from one trunk run each, then a report.

    python scripts/compare.py optimizers=[adamw,muon] budgets=[100,200,400] lr.points=4 seeds=2
    python scripts/compare.py optimizers=[adamw,muon] budgets=[100,200,400] seeds.tune=2 seeds.eval=5
    python scripts/compare.py optimizers=[adamw,sgdm] budgets=[20,40] lr.points=2 warmup=4 \\
        model.dim=32 dataset.batch_size=8          # any other override goes to every run
    python scripts/compare.py optimizers=[adamw,muon] budgets=[200,400] tune=coordinate sweep.weight_decay=[0,0.1]
    python scripts/compare.py ... dir=comparisons/2026-12-01_10-00-00   # continue an interrupted comparison
    python scripts/compare.py --report comparisons/2026-12-01_10-00-00  # rebuild the report from the runs

The comparison's knobs are the top-level keys of conf/compare.yaml (optimizers, budgets, lr.points,
lr.factor, lr.grid.<optimizer>, seeds.tune, seeds.eval, seeds.vary_data, data_seed, warmup,
cooldown.fraction, cooldown.shape, tune, coordinate.threshold, coordinate.max_trials, dir, ...),
documented there; every other argument is a Hydra override passed to every run, as to
`train_jax.py`. Per (optimizer, lr, seed) a trunk trains warmup + constant lr and saves at
0.8·S for each budget S; each budget's branch resumes from that save and decays over the last 0.2·S
(compare/plan.py). The runs train in this process, one after another, into
{dir}/runs/<run_id>/ (compare/launch.py); the same command with the same dir= skips the
finished runs and resumes interrupted ones from their checkpoints. Then the report is built
from the directory alone (compare/report.py). With seeds.eval=M, once the tuning runs (and
lr.extend's) are done, the setting each optimizer's tuning seeds chose per workload and budget runs
on M fresh seeds (the evaluation phase, recorded in compare.json's "evaluation").

Exit codes: 0 when every run finished or diverged (a diverged run is a result: loss inf in the
report), 2 for a bad knob (one line, before anything trains) or a run that failed on another
user error, 3/130 when a signal stopped it after the current run saved (rerun to continue), 4
when building the report failed unexpectedly (one line; the traceback in {dir}/report_error.txt).
"""

from __future__ import annotations

import datetime
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def pack_flags(argv: list[str], environ) -> str | None:
    """XLA_FLAGS with XLA:CPU's vmapped-gradient workaround appended (utils/xla_workarounds.py) when
    argv asks for pack > 1 and it is not there yet; None otherwise."""
    from utils.xla_workarounds import has_ynn_flag, with_ynn_flag

    wanted = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "pack"]
    if not wanted or not wanted[-1].strip().isdigit() or int(wanted[-1]) <= 1 or has_ynn_flag(environ):
        return None
    return with_ynn_flag(environ)


if __name__ == "__main__" and (_flags := pack_flags(sys.argv[1:], os.environ)) is not None:
    os.environ["XLA_FLAGS"] = _flags  # before JAX is imported (below); an in-process caller's pack is checked instead

from utils.cli import script_argv  # after XLA_FLAGS
from utils.errors import ConfigError, EqtrainError
from utils.script_errors import script_error

# conf/compare.yaml's top-level keys: an argument whose key starts with one is a comparison knob.
COMPARE_KEYS = ("optimizers", "budgets", "lr", "seeds", "data_seed", "warmup", "cooldown", "sweep", "workloads",
                "val_every", "baseline", "tune", "coordinate", "target", "budget_unit", "dir", "save_every", "parallel",
                "keep_checkpoints", "metric", "variants", "pack")
# Keys of mappings that are empty in conf/compare.yaml: a new key there needs Hydra's `++`.
OPEN_MAPPINGS = ("lr.grid.", "sweep.", "workloads.", "variants.")


def split_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(the comparison's overrides, the runs' overrides, the launcher's: hydra/launcher=... and
    hydra.launcher.*)."""
    from compare.plan import override_key

    ours, theirs, launcher = [], [], []
    for arg in argv:
        if arg.startswith("-"):
            raise ConfigError(f"{arg}: compare.py takes knobs and Hydra overrides only (and --report DIR); see "
                              "`python scripts/compare.py --help`")
        key = override_key(arg)
        if key == "hydra/launcher" or key.startswith("hydra.launcher."):
            launcher.append(arg)
        elif key.split(".")[0].split("/")[0] in COMPARE_KEYS:
            value = arg.split("=", 1)[1] if "=" in arg else ""
            if key == "seeds":  # seeds=K: an alias of seeds.tune=K (so seeds.eval=M may come before or after)
                arg = f"seeds.tune={value}"
            if key.startswith(("workloads.", "variants.")) and not value.startswith(("[", "'", '"')):
                # `workloads.small=model.dim=32 dataset.batch_size=8` or `variants.adamw_ema=adamw
                # train.weight_average=ema` (one shell word): a string to Hydra
                arg = f"{arg.split('=', 1)[0]}='{value.replace(chr(39), chr(92) + chr(39))}'"
            ours.append(f"++{arg.lstrip('+')}" if key.startswith(OPEN_MAPPINGS) else arg)
        else:
            theirs.append(arg)
    return ours, theirs, launcher


def compose_knobs(overrides: list[str]) -> dict:
    """conf/compare.yaml with the comparison's overrides, as plain Python values."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from utils.config import CONF_DIR

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="compare"):
            cfg = compose("compare", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    return OmegaConf.to_container(cfg, resolve=True)


class ReportError(EqtrainError):
    """The report could not be built for an unexpected reason; its traceback is saved in a file."""
    exit_code = 4


def build_report(compare_dir: str) -> None:
    """compare.report.build_report, where it exists (built beside this engine). An unexpected
    exception while building it (a bug, not bad data: DataError passes through) becomes one line
    naming the traceback it saved as {dir}/report_error.txt (ReportError, exit code 4); the runs
    are untouched, so `--report DIR` rebuilds it once fixed."""
    import traceback

    try:
        from compare.report import build_report as build
    except ImportError:
        print(f"compare: no report builder (compare/report.py) yet; the runs are in {compare_dir}")
        return
    try:
        build(compare_dir)
    except EqtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - any bug in the report: one line and a saved traceback
        path = os.path.join(os.path.abspath(compare_dir), "report_error.txt")
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(traceback.format_exc())
        except OSError:
            path = "(could not be saved: the directory is not writable)"
        first = (str(e).strip().splitlines() or [""])[0]
        raise ReportError(f"the report could not be built ({type(e).__name__}: {first}); traceback: {path}; "
                          "the runs are kept: fix it and rebuild with "
                          f"`python scripts/compare.py --report {compare_dir}`") from None


def compare(argv: list[str]) -> int:
    from compare.plan import compare_config, make_plan, start_values, with_steps, workload_lrs
    from utils.files import user_path

    ours, theirs, launcher = split_argv(argv)
    node = compose_knobs(ours)
    knobs, counted = with_steps(compare_config(node), tuple(theirs))
    for line in counted:
        print(f"compare: budget_unit={knobs.budget_unit}: {line}")
    starts = start_values(knobs, tuple(theirs)) if knobs.tune == "coordinate" else None
    plan = make_plan(knobs, theirs, workload_lrs(knobs, tuple(theirs)), starts)
    compare_dir = user_path(node.get("dir") or os.path.join(
        "comparisons", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
    save_every = _positive(node.get("save_every"), "save_every")
    keep = node.get("keep_checkpoints", False)
    if not isinstance(keep, bool):
        raise ConfigError(f"keep_checkpoints={keep!r} must be true or false")
    pack = _positive(node.get("pack", 1), "pack") or 1
    if pack > 1 and launcher:
        raise ConfigError(f"pack={pack} trains its runs in this process: drop {launcher[0]} or set pack=1")
    execute = executor(launcher, compare_dir, save_every, _positive(node.get("parallel"), "parallel"), keep, pack)
    from trainer import process_cache

    # One sharing() for the whole comparison: the check's compositions serve the first runs, and the
    # traced steps and data serve every phase (the tuning runs, lr.extend's, the evaluation seeds').
    with process_cache.sharing():
        summaries = run_phases(plan, knobs, compare_dir, execute, pack)
    build_report(compare_dir)
    return 2 if any(s.user_errors for s in summaries) else 0


def run_phases(plan, knobs, compare_dir: str, execute, pack: int) -> list:
    """Check every run's knobs, then train the plan and each phase that follows it (coordinate
    tuning's next settings, lr.extend's, the evaluation seeds', the target track's): their summaries."""
    check_runs(plan, pack)
    from compare.launch import open_dir

    open_dir(plan, compare_dir)  # refuses another comparison's directory before saying how to continue this one
    print(f"compare: {len(plan.runs)} runs ({sum(r.kind == 'trunk' for r in plan.runs)} trunks) in {compare_dir}; "
          f"to continue it later: the same command with dir={compare_dir}")
    trials = {o: knobs.trials(o) for o in knobs.optimizers}
    if knobs.tune == "coordinate":
        print("compare: tune=coordinate: one knob at a time around the best setting so far, at most "
              + ", ".join(f"{o} {n}" for o, n in trials.items()) + " settings; the report shows each search's path")
    elif len(set(trials.values())) > 1:  # sweep.<optimizer>.<knob> gives one optimizer more settings
        print("compare: the optimizers are tuned over different numbers of settings (lrs x sweep values): "
              + ", ".join(f"{o} {n}" for o, n in trials.items()) + "; the report states each")
    summaries = [execute(plan, None)]
    asked: tuple = ()
    while knobs.tune == "coordinate" and not summaries[-1].interrupted and (extra := coordinate(plan, compare_dir)):
        if extra == asked:  # their runs ended, yet their results are not there: the report says why
            print("compare: tune=coordinate: the runs it asked for again have no results (see the report's "
                  "completeness section); the search stops here")
            break
        asked = extra
        print(f"compare: tune=coordinate: {len(extra)} more runs (the next knob's settings)")
        summaries.append(execute(plan, extra))
    while knobs.lr_extend and (extra := extension(plan, compare_dir)):
        print(f"compare: lr.extend: {len(extra)} more runs beyond the edge of a grid")
        summaries.append(execute(plan, extra))
    if knobs.seeds_eval and any(s.interrupted for s in summaries):
        print("compare: seeds.eval: the evaluation phase waits until every tuning run has finished; rerun the "
              f"command with dir={compare_dir} to continue")
    elif knobs.seeds_eval:
        from compare.launch import record_evaluation

        runs = record_evaluation(plan, compare_dir, *evaluation(plan, compare_dir))
        print(f"compare: seeds.eval: {len(runs)} runs of the chosen settings on evaluation seeds "
              f"{knobs.seeds}..{knobs.seeds + knobs.seeds_eval - 1}")
        summaries.append(execute(plan, runs))
    if knobs.target_runs and any(s.interrupted for s in summaries):
        print("compare: target: the target track waits until every earlier run has finished; rerun the command "
              f"with dir={compare_dir} to continue")
    elif knobs.target_runs:
        from compare.launch import record_evaluation
        from compare.plan import phase_seeds

        runs = record_evaluation(plan, compare_dir, *evaluation(plan, compare_dir, "target"), phase="target")
        seeds = phase_seeds(knobs, "target")
        print(f"compare: target: {len(runs)} runs (each optimizer's setting chosen at the largest budget, on seeds "
              f"{seeds[0]}..{seeds[-1]}), each read for the step it reaches val/loss {knobs.target_loss:g}")
        summaries.append(execute(plan, runs))
    return summaries


def _positive(value, knob: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{knob}={value!r} must be a positive integer or null")
    return value


def executor(launcher: list[str], compare_dir: str, save_every: int | None, parallel: int | None,
             keep_checkpoints: bool = False, pack: int = 1):
    """execute(plan, runs): in this process, or a job per run with hydra/launcher=local|slurm."""
    import train_jax
    from compare.launch import run_jobs, run_plan

    if not launcher:
        return lambda plan, runs: run_plan(plan, compare_dir, train=train_jax.train, runs=runs, save_every=save_every,
                                           keep_checkpoints=keep_checkpoints, pack=pack)
    from compare.executor import make_submit

    names = [a.split("=", 1)[1] for a in launcher if a.split("=", 1)[0].lstrip("+") == "hydra/launcher"]
    if not names:
        raise ConfigError(f"{launcher[0]}: hydra.launcher.* settings need hydra/launcher=local or slurm too")
    command = lambda run: [sys.executable, os.path.abspath(__file__), "--run", compare_dir, run.id,
                           *([f"save_every={save_every}"] if save_every else []),
                           *(["keep_checkpoints=true"] if keep_checkpoints else [])]
    overrides = [a for a in launcher if a.startswith(("hydra.", "+hydra.", "++hydra."))]
    submit, default = make_submit(names[-1], overrides, compare_dir, command)
    return lambda plan, runs: run_jobs(plan, compare_dir, submit, parallel or default, runs=runs,
                                       keep_checkpoints=keep_checkpoints)


def extension(plan, compare_dir: str):
    """lr.extend: the runs of one more lr for each (workload, optimizer) whose best lr sits at the
    edge of the lrs run so far (at most lr.extend_max added per side); () when none."""
    from compare.plan import base_grid, extension_lr, extension_runs
    from compare.report import load_workloads

    new = {}
    for w in load_workloads(compare_dir):
        for opt in w.optimizers:
            lr = extension_lr(w.grid[opt], w.best[opt], base_grid(plan, w.name, opt), plan.knobs.lr_extend_max)
            if lr is not None:
                new[(w.name, opt)] = lr
    return extension_runs(plan, new)


def coordinate(plan, compare_dir: str):
    """tune=coordinate: the runs of the settings each search asks for next; () when all have ended."""
    from compare.plan import coordinate_runs
    from compare.report import load_workloads
    from compare.tune import cell_losses

    workloads = {w.name: w for w in load_workloads(compare_dir)}
    largest = lambda workload: max(plan.knobs.budgets_of(workload))
    return coordinate_runs(plan, cell_losses(workloads, plan.knobs.seeds, largest))


def evaluation(plan, compare_dir: str, phase: str = "eval"):
    """seeds.eval: (the setting the tuning seeds chose per (workload, optimizer) and budget, the
    runs of those settings on the evaluation seeds). Nothing is chosen for a budget where every
    setting failed (the report then shows that optimizer without an evaluation there).
    phase="target": the same at the largest budget only, on the target track's seeds."""
    from compare.plan import evaluation_runs
    from compare.report import load_workloads

    chosen = {}
    for w in load_workloads(compare_dir):
        for opt in w.optimizers:
            budgets = w.budgets[-1:] if phase == "target" else w.budgets
            per_budget = {b: c for b in budgets if (c := w.chosen(opt, b)) is not None}
            if per_budget:
                chosen[(w.name, opt)] = per_budget
    return chosen, evaluation_runs(plan, chosen, phase)


def run_one(compare_dir: str, run_id: str, rest: list[str]) -> int:
    """What a launcher's job runs (`--run DIR ID [save_every=N] [keep_checkpoints=true]`): one run of the comparison."""
    import train_jax
    from compare.launch import load_run
    from compare.launch import run_one as train_one

    save_every, keep = None, False
    for arg in rest:
        if arg.startswith("save_every="):
            save_every = _positive(int(arg.split("=", 1)[1]), "save_every")
        elif arg == "keep_checkpoints=true":
            keep = True
        else:
            raise ConfigError(f"{arg}: --run DIR ID takes only save_every=N and keep_checkpoints=true after them")
    compare_dir = os.path.abspath(compare_dir)
    outcome, record = train_one(load_run(compare_dir, run_id), compare_dir, train_jax.train, save_every=save_every,
                                keep_checkpoints=keep)
    return 2 if outcome == "failed" and not record.get("diverged") else 0


def check_runs(plan, pack: int = 1) -> None:
    """Every knob of the runs checked before anything trains: one trunk and one branch per workload,
    optimizer and sweep combination composed and validated (the others differ in lr, seed and budget only);
    with pack > 1 also what a pack refuses (trainer/pack.py's check) and the backend's flag."""
    from compare.launch import run_overrides
    from utils.config import compose_reusing, validate

    seen = set()
    for run in plan.runs:
        if (run.workload, run.optimizer, run.kind, run.sweep) not in seen:
            seen.add((run.workload, run.optimizer, run.kind, run.sweep))
            config = validate(compose_reusing(run_overrides(run, "/nonexistent-compare-dir"), job_name="compare"))
            if pack > 1:
                from trainer import pack as packing

                packing.check(config)
    if pack > 1:
        from trainer import pack as packing

        packing.check_backend()


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv, __doc__)
    if argv is None:
        return 0
    from utils.checkpoint.signals import Preempted

    try:
        if argv and argv[0] == "--run":
            if len(argv) < 3:
                raise ConfigError("--run takes a comparison directory and a run id: --run DIR RUN_ID")
            return run_one(argv[1], argv[2], argv[3:])
        if argv and argv[0] == "--report":
            if len(argv) != 2:
                raise ConfigError("--report takes one comparison directory: python scripts/compare.py --report DIR")
            build_report(argv[1])
            return 0
        return compare(argv)
    except Preempted as e:
        print(f"compare: {e}; rerun the same command (with its dir=) to continue the comparison", file=sys.stderr)
        return e.exit_code
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return ReportError.exit_code
    except (EqtrainError, OSError) as e:
        return script_error(e, hint="check dir= and the disk")


if __name__ == "__main__":
    sys.exit(main())
