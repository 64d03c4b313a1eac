"""Compare optimizers: per-optimizer lr sweeps at several budgets from one trunk run each, then a report.

    python scripts/compare.py optimizers=[adamw,muon] budgets=[100,200,400] lr.points=4 seeds=2
    python scripts/compare.py optimizers=[adamw,sgdm] budgets=[20,40] lr.points=2 warmup=4 \\
        model.dim=32 dataset.batch_size=8          # any other override goes to every run
    python scripts/compare.py ... dir=compare/2026-12-01_10-00-00   # continue an interrupted comparison
    python scripts/compare.py --report compare/2026-12-01_10-00-00  # rebuild the report from the runs

The comparison's knobs are the top-level keys of conf/compare.yaml (optimizers, budgets, lr.points,
lr.factor, lr.grid.<optimizer>, seeds, data_seed, warmup, cooldown.fraction, cooldown.shape, dir),
documented there; every other argument is a Hydra override passed to every run, as to
`train_jax.py`. Per (optimizer, lr, seed) a trunk trains warmup + constant lr and saves at
0.8·S for each budget S; each budget's branch resumes from that save and decays over the last 0.2·S
(utils/compare/plan.py). The runs train in this process, one after another, into
{dir}/runs/<run_id>/ (utils/compare/launch.py); the same command with the same dir= skips the
finished runs and resumes interrupted ones from their checkpoints. Then the report is built
from the directory alone (utils/compare/report.py).

Exit codes: 0 when every run finished or diverged (a diverged run is a result: loss inf in the
report), 2 for a bad knob (one line, before anything trains) or a run that failed on another
user error, 3/130 when a signal stopped it after the current run saved (rerun to continue).
"""

from __future__ import annotations

import datetime
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from utils.cli import script_argv
from utils.errors import ConfigError, EqtrainError
from utils.script_errors import script_error

# conf/compare.yaml's top-level keys: an argument whose key starts with one is a comparison knob.
COMPARE_KEYS = ("optimizers", "budgets", "lr", "seeds", "data_seed", "warmup", "cooldown", "dir")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the comparison's overrides, the runs' overrides). `lr.grid.<opt>=...` is a new key of an
    empty mapping, which Hydra adds only with `++`: added here."""
    from utils.compare.plan import override_key

    ours, theirs = [], []
    for arg in argv:
        if arg.startswith("-"):
            raise ConfigError(f"{arg}: compare.py takes knobs and Hydra overrides only (and --report DIR); see "
                              "`python scripts/compare.py --help`")
        key = override_key(arg)
        if key.split(".")[0].split("/")[0] in COMPARE_KEYS:
            ours.append(f"++{arg.lstrip('+')}" if key.startswith("lr.grid.") else arg)
        else:
            theirs.append(arg)
    return ours, theirs


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


def build_report(compare_dir: str) -> None:
    """utils.compare.report.build_report, where it exists (built beside this engine)."""
    try:
        from utils.compare.report import build_report as build
    except ImportError:
        print(f"compare: no report builder (utils/compare/report.py) yet; the runs are in {compare_dir}")
        return
    build(compare_dir)


def compare(argv: list[str]) -> int:
    import train_jax
    from utils.compare.launch import run_plan
    from utils.compare.plan import base_lrs, compare_config, make_plan
    from utils.files import user_path

    ours, theirs = split_argv(argv)
    node = compose_knobs(ours)
    knobs = compare_config(node)
    plan = make_plan(knobs, theirs, base_lrs(knobs.optimizers, tuple(theirs)))
    compare_dir = user_path(node.get("dir") or os.path.join(
        "compare", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
    check_runs(plan)
    print(f"compare: {len(plan.runs)} runs ({sum(r.kind == 'trunk' for r in plan.runs)} trunks) in {compare_dir}; "
          f"to continue it later: the same command with dir={compare_dir}")
    summary = run_plan(plan, compare_dir, train=train_jax.train)
    build_report(compare_dir)
    return 2 if summary.user_errors else 0


def check_runs(plan) -> None:
    """Every knob of the runs checked before anything trains: one trunk and one branch per
    optimizer composed and validated (the others differ from them in lr, seed and budget only)."""
    from utils.compare.launch import run_overrides
    from utils.config import compose_overrides, validate

    seen = set()
    for run in plan.runs:
        if (run.optimizer, run.kind) not in seen:
            seen.add((run.optimizer, run.kind))
            validate(compose_overrides(run_overrides(run, "/nonexistent-compare-dir"), job_name="compare"))


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv, __doc__)
    if argv is None:
        return 0
    from utils.checkpoint.signals import Preempted

    try:
        if argv and argv[0] == "--report":
            if len(argv) != 2:
                raise ConfigError("--report takes one comparison directory: python scripts/compare.py --report DIR")
            build_report(argv[1])
            return 0
        return compare(argv)
    except Preempted as e:
        print(f"compare: {e}; rerun the same command (with its dir=) to continue the comparison", file=sys.stderr)
        return e.exit_code
    except (EqtrainError, OSError) as e:
        return script_error(e, hint="check dir= and the disk")


if __name__ == "__main__":
    sys.exit(main())
