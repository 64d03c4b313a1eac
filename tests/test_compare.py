"""The comparison engine (scripts/compare.py, compare/plan.py and launch.py) on a tiny case:
one optimizer, one lr, one seed, budgets [10, 20] with warmup 2: a 16-step constant-lr trunk
saving at 8 and 16, and two cooldown branches (2 and 4 steps).

- a branch equals a run trained from scratch with the same warmup-stable-decay schedule, bit for bit;
- a comparison killed between two checkpoints and run again equals the uninterrupted one;
- a diverging lr is a failed run (diverged, its branches failed unrun) and the comparison goes on;
- bad knobs are one ConfigError line naming the knob, before anything trains.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import background
import jax
import pytest
from helpers import REPO, TINY_OVERRIDES, BackgroundProcess, evaluated_steps, load_script, per_optimizer

import train_jax as T
from compare import launch
from compare.plan import base_lrs, compare_config, make_plan, workload_lrs
from utils.config import compose_overrides
from utils.errors import ConfigError

KNOBS = {"optimizers": ["adamw"], "budgets": [10, 20], "lr": {"points": 1}, "seeds": 1, "warmup": 2}
RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
    "logging.log_every=1", "train.max_val_steps=2")
ARGV = ["optimizers=[adamw]", "budgets=[10,20]", "lr.points=1", "seeds=1", "warmup=2", *RUN]
TRUNK, S10, S20 = (f"default__adamw__lr0.003__seed0__{t}" for t in ("trunk", "S10", "S20"))


def losses(run_dir) -> dict[int, dict[str, float]]:
    """step -> {train/loss, val/loss} from a run's metrics.jsonl (the last record of a step wins)."""
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            out.setdefault(record["step"], {}).update(
                {k: record[k] for k in ("train/loss", "val/loss") if k in record})
    return {step: values for step, values in out.items() if values}


def plan(knobs=KNOBS, run=RUN):
    k = compare_config(knobs)
    return make_plan(k, run, base_lrs(k.optimizers, run))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, _cache_dir):
    """The uninterrupted comparison, through the script's main() (its report stubbed: another test's)."""
    path = tmp_path_factory.mktemp("compare") / "ref"
    script = load_script("compare")
    reports = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EQTRAIN_CACHE", str(_cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.setattr(script, "build_report", reports.append)
        assert script.main([*ARGV, f"dir={path}"]) == 0
    assert reports == [str(path)]
    return path


@pytest.mark.slow
def test_branch_equals_a_from_scratch_wsd_run(reference, tmp_path):
    runs = reference / "runs"
    for run_id, status in ((TRUNK, "done"), (S10, "done"), (S20, "done")):
        record = json.loads((runs / run_id / "run.json").read_text())
        assert record["status"] == status and record["error"] is None and not record["diverged"]
    branch = json.loads((runs / S20 / "run.json").read_text())
    assert (branch["kind"], branch["budget"], branch["branch_step"], branch["trunk"]) == ("branch", 20, 16, TRUNK)
    assert json.loads((reference / "compare.json").read_text())["knobs"]["cooldown_shape"] == "1-sqrt"
    # From scratch: the branch's own overrides (trapezoid, decay 4, 1-sqrt, the seeds), no checkpoint.
    # It evaluates where the trunk (its branch points) and the branch (its budget) did, to compare each.
    overrides = [o for o in branch["overrides"] if not o.startswith(("checkpoint.", "train.val_at="))]
    overrides.append("train.val_at=[8,16,20]")
    T.train(compose_overrides(overrides, job_name="test"), str(tmp_path))
    scratch = losses(tmp_path)
    trunk, cooled = losses(runs / TRUNK), losses(runs / S20)
    stitched = {**{s: v for s, v in trunk.items() if s <= 16}, **{s: v for s, v in cooled.items() if s > 16}}
    assert sorted(s for s, v in scratch.items() if "train/loss" in v) == list(range(1, 21))
    assert stitched == scratch  # every step's train/loss and val/loss, bit for bit
    assert cooled[20]["val/loss"] == scratch[20]["val/loss"]


@pytest.mark.slow
def test_killed_comparison_resumes_to_the_same_results(reference, tmp_path):
    """The trunk is killed at step 12, after its checkpoint at 8 (iter_12 removed, its metrics
    logged to 12): the rerun resumes it from 8, then runs the branches; every run's losses equal
    the uninterrupted comparison's, and a third invocation skips everything."""
    p, calls = plan(), []

    def killed(cfg, run_dir):
        calls.append(run_dir)
        cfg.checkpoint.num_steps = 12
        T.train(cfg, run_dir)
        shutil.rmtree(os.path.join(run_dir, "ckpt", "iter_12"))  # killed after step 12, before a save
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch.run_plan(p, str(tmp_path), train=killed)
    assert len(calls) == 1 and max(losses(tmp_path / "runs" / TRUNK)) == 12
    assert json.loads((tmp_path / "runs" / TRUNK / "run.json").read_text())["status"] == "running"
    assert json.loads((tmp_path / "runs" / S10 / "run.json").read_text())["status"] == "planned"
    lines = []
    summary = launch.run_plan(p, str(tmp_path), train=T.train, say=lines.append)
    assert f"[1/3] {TRUNK}: resumed from step 8" in lines
    # one line per run: its time and final val/loss (the uninterrupted run's), then the time left
    final = losses(reference / "runs" / S20)[20]["val/loss"]
    assert re.fullmatch(rf"\[3/3\] {S20}: done in \d+\.\d s \| val/loss {final:.4f}", lines[-2]), lines
    assert re.fullmatch(r"  2 runs left, about \d+ s", lines[2]), lines
    assert summary.done == [TRUNK, S10, S20] and not summary.failed
    # done, nothing needs the checkpoints any more (keep_checkpoints=false, the default)
    assert not any((tmp_path / "runs" / r / "ckpt").exists() for r in (TRUNK, S10, S20))
    # the trainer's own output went to each run's train.log, the resumed part appended
    log = (tmp_path / "runs" / TRUNK / "train.log").read_text()
    assert "resumed from" in log and "step     10" in log
    for run_id in (TRUNK, S10, S20):
        assert losses(tmp_path / "runs" / run_id) == losses(reference / "runs" / run_id), run_id
    lines = []
    summary = launch.run_plan(p, str(tmp_path), train=None, say=lines.append)
    assert summary.skipped == [TRUNK, S10, S20] and f"[2/3] {S10}: skipped (done before)" in lines


def test_a_done_branch_drops_its_checkpoints_and_its_trunks_once_every_branch_is_done(tmp_path):
    """launch.prune_done: a done branch's own checkpoints go at once; its trunk's only when every
    branch of that trunk is done (a failed one keeps them, to run it again)."""
    p = plan({**KNOBS, "budgets": [10, 20]})
    trunk, s10, s20 = p.runs
    for r in p.runs:
        (tmp_path / "runs" / r.id / "ckpt" / "iter_8").mkdir(parents=True)
    status = lambda r, st: (tmp_path / "runs" / r.id / "run.json").write_text(json.dumps({"status": st}))
    status(trunk, "done"), status(s10, "done"), status(s20, "failed")
    launch.prune_done(p.runs, str(tmp_path), s10)
    assert not (tmp_path / "runs" / s10.id / "ckpt").exists() and (tmp_path / "runs" / trunk.id / "ckpt").exists()
    status(s20, "done")
    launch.prune_done(p.runs, str(tmp_path), s20)
    assert not (tmp_path / "runs" / s20.id / "ckpt").exists() and not (tmp_path / "runs" / trunk.id / "ckpt").exists()


def test_the_time_left_is_a_fixed_part_per_run_and_a_part_per_step():
    """launch.eta: per kind, a least-squares line through (steps, seconds) of the runs done: trunks of
    10 and 20 steps in 3 and 5 s are 1 s + 0.2 s/step, so one of 30 steps takes 7 s; branches (of
    budget - branch point steps) with one length so far are their mean."""
    from compare.plan import PlannedRun

    def run(kind, steps, branch_step=None):
        return PlannedRun("r", "w", "adamw", 1e-3, 0, kind, None, None, branch_step, (f"train.max_steps={steps}",))

    done = [(run("trunk", 10), 3.0), (run("trunk", 20), 5.0), (run("branch", 20, 16), 2.0),
            (run("branch", 20, 16), 4.0)]
    assert launch.eta(done, (run("trunk", 30),)) == pytest.approx(7.0)  # float64 arithmetic on exact data
    assert launch.eta(done, (run("branch", 40, 36),)) == pytest.approx(3.0)
    assert launch.eta([], (run("trunk", 30),)) is None


@pytest.mark.slow
def test_diverged_run_fails_its_branches_and_the_comparison_goes_on(tmp_path):
    knobs = {**KNOBS, "budgets": [10], "lr": {"points": 2, "grid": {"adamw": [1e30, 3e-3]}}}
    lines = []
    summary = launch.run_plan(plan(knobs), str(tmp_path), train=T.train, say=lines.append)
    bad, good = "default__adamw__lr1e+30__seed0", "default__adamw__lr0.003__seed0"
    assert summary.diverged == [f"{bad}__trunk", f"{bad}__S10"]
    assert summary.done == [f"{good}__trunk", f"{good}__S10"]
    trunk = json.loads((tmp_path / "runs" / f"{bad}__trunk" / "run.json").read_text())
    assert trunk["status"] == "failed" and trunk["diverged"] and trunk["error"]
    branch = json.loads((tmp_path / "runs" / f"{bad}__S10" / "run.json").read_text())
    assert branch["status"] == "failed" and branch["diverged"] and "trunk" in branch["error"]
    assert not (tmp_path / "runs" / f"{bad}__S10" / "metrics.jsonl").exists()  # never ran
    assert any(line.startswith(f"[1/4] {bad}__trunk: failed (diverged") for line in lines)
    assert lines[-1].startswith("compare: 4 runs: 2 done, 0 skipped (finished before), 2 failed (2 diverged)")


@pytest.mark.parametrize("change, knob", [
    ({"optimizers": ["adamw", "adamz"]}, "optimizers: unknown optimizer 'adamz'; choose from adamw"),
    ({"optimizers": []}, "optimizers="),
    ({"budgets": []}, "budgets="),
    ({"budgets": [20, 10]}, "budgets=.* strictly increasing"),
    ({"budgets": [10, 10]}, "budgets=.* strictly increasing"),
    ({"budgets": [3], "warmup": 3}, "budgets: 3 branches at step 2, before warmup=3 ends"),
    ({"budgets": [4], "warmup": 0, "cooldown": {"fraction": 0.1}}, "budgets: 4 leaves no cooldown step"),
    ({"lr": {"points": 0}}, "lr.points=0 must be an integer >= 1"),
    ({"lr": {"factor": 1.0}}, "lr.factor=1.0 must be > 1"),
    ({"lr": {"points": 1, "grid": {"sgdm": [0.1]}}}, "lr.grid.sgdm: 'sgdm' is not in optimizers"),
    ({"lr": {"points": 2, "grid": {"adamw": [1e-3]}}}, "lr.grid.adamw has 1 lrs but lr.points=2"),
    ({"seeds": 0}, r"seeds.tune=0 must be an integer >= 1"),  # seeds=K is seeds.tune=K
    ({"seeds": {"tune": 2, "eval": -1}}, r"seeds.eval=-1 must be an integer >= 0"),
    ({"seeds": {"vary_data": "yes"}}, "seeds.vary_data='yes' must be true or false"),
    ({"seeds": {"evaluate": 3}}, "unknown comparison knob 'seeds.evaluate': the seed knobs are"),
    ({"cooldown": {"shape": "cosine"}}, "cooldown.shape='cosine' must be one of linear, 1-sqrt"),
    ({"cooldown": {"fraction": 1.0}}, r"cooldown.fraction=1.0 must be in \(0, 1\)"),
    ({"seed": 3}, "unknown comparison knob 'seed'"),
])
def test_bad_knobs_are_one_line_config_errors(change, knob):
    with pytest.raises(ConfigError, match=knob) as e:
        compare_config({**KNOBS, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, knob", [
    ("optimizer=sgdm", "optimizers="), ("optimizer.lr_config.lr=1", "lr.points"),
    ("random_seed=1", "seeds.tune=K seeds.eval=M"),
    ("train.max_steps=9", "budgets="), ("checkpoint.save_path=x", "checkpoint.save_path"),
    ("hydra/launcher=slurm", "hydra/launcher"),
])
def test_run_overrides_of_the_comparisons_knobs_are_refused(override, knob):
    with pytest.raises(ConfigError, match=knob):
        make_plan(compare_config(KNOBS), [override], {"adamw": 1e-3})


def test_plan_grid_and_schedules():
    k = compare_config({**KNOBS, "optimizers": ["adamw", "sgdm"], "budgets": [100, 250], "lr": {"points": 4},
                        "seeds": 2, "warmup": 10})
    p = make_plan(k, ["model.dim=32"], {"adamw": 1e-3, "sgdm": 0.3})
    assert len(p.runs) == 2 * 4 * 2 * 3
    assert sorted({r.lr for r in p.runs if r.optimizer == "adamw"}) == [2.5e-4, 5e-4, 1e-3, 2e-3]
    trunk, b100, b250 = p.runs[:3]
    assert trunk.id == "default__adamw__lr0.00025__seed0__trunk" and b250.id == "default__adamw__lr0.00025__seed0__S250"
    assert {"optimizer/lr_config=constant", "train.max_steps=200", "checkpoint.save_steps=[80,200]",
            "data_seed=0", "model.dim=32", "train.val_at=[80,200]"} <= set(trunk.overrides)
    assert not any(o.startswith("train.val_freq=") for o in trunk.overrides)  # val_every=null: the runs' own
    assert (b100.branch_step, b250.branch_step) == (80, 200)
    assert {"optimizer/lr_config=trapezoid", "train.max_steps=100", "optimizer.lr_config.decay=20",
            "optimizer.lr_config.decay_shape=1-sqrt", "optimizer.lr_config.warmup=10"} <= set(b100.overrides)
    assert "train.val_freq=5" in make_plan(k, ["train.val_freq=5"], {"adamw": 1e-3, "sgdm": 0.3}).runs[0].overrides
    assert [r.seed for r in p.runs[:6]] == [0, 0, 0, 1, 1, 1]


def test_a_directory_of_another_comparison_is_refused(tmp_path):
    p = make_plan(compare_config(KNOBS), RUN, {"adamw": 3e-3})
    (tmp_path / "compare.json").write_text(json.dumps({**p.to_json(), "run_overrides": ["model.dim=64"]}))
    with pytest.raises(ConfigError, match="holds another comparison .*run_overrides"):
        launch.run_plan(p, str(tmp_path), train=None)


def test_the_same_overrides_in_another_order_continue_the_same_comparison(tmp_path):
    launch.open_dir(make_plan(compare_config(KNOBS), RUN, {"adamw": 3e-3}), str(tmp_path))
    launch.open_dir(make_plan(compare_config(KNOBS), RUN[::-1], {"adamw": 3e-3}), str(tmp_path))  # no refusal
    with pytest.raises(ConfigError, match="holds another comparison"):  # a changed value still is another one
        launch.open_dir(make_plan(compare_config(KNOBS), (*RUN[::-1], "model.dim=64"), {"adamw": 3e-3}),
                        str(tmp_path))


def test_a_directory_made_before_newer_knobs_continues_when_they_keep_their_defaults(tmp_path):
    """compare.json written before tune, coordinate.*, target.*, budget_unit, workload_lr and
    workload_budgets existed (none of them recorded): the same command, those knobs at their defaults,
    continues it; a changed one that would change the runs made is refused."""
    p = make_plan(compare_config(KNOBS), RUN, {"adamw": 3e-3})
    old = p.to_json()
    newer = ("tune", "coordinate_threshold", "coordinate_max_trials", "target_loss", "target_runs", "budget_unit",
             "workload_lr", "workload_budgets")
    assert set(newer) <= set(old["knobs"])
    old["knobs"] = {k: v for k, v in old["knobs"].items() if k not in newer}
    (tmp_path / "compare.json").write_text(json.dumps(old))
    launch.open_dir(p, str(tmp_path))  # no refusal
    with pytest.raises(ConfigError, match="holds another comparison .its budget_unit differ"):
        launch.open_dir(make_plan(compare_config({**KNOBS, "budget_unit": "tokens"}), RUN, {"adamw": 3e-3}),
                        str(tmp_path))


def test_the_cli_refuses_another_comparisons_dir_before_saying_how_to_continue(tmp_path, capsys):
    """The refusal is the one line it prints: no 'to continue it later: ... dir=' first, which would
    tell the user to rerun into a directory that is refused."""
    (tmp_path / "c").mkdir()
    other = make_plan(compare_config(KNOBS), [*RUN, "model.dim=64"], {"adamw": 3e-3})
    (tmp_path / "c" / "compare.json").write_text(json.dumps(other.to_json()))
    assert load_script("compare").main([*ARGV, f"dir={tmp_path / 'c'}"]) == 2
    out, err = capsys.readouterr()
    assert "to continue it later" not in out and "holds another comparison" in err and len(err.splitlines()) == 1


def test_compare_json_records_each_set_up_that_ran_the_comparison(tmp_path, monkeypatch):
    """The code's commit (and whether it had uncommitted changes), the core versions, the CPU, the
    device and the date, once per differing session: a continuation on the same set-up adds nothing,
    one on another commit adds an entry, and the report's header says the sessions differ."""
    from compare import report
    from utils import versions

    p = make_plan(compare_config(KNOBS), RUN, {"adamw": 3e-3})
    launch.open_dir(p, str(tmp_path))
    first = json.loads((tmp_path / "compare.json").read_text())["provenance"]
    here = versions.git_state()
    assert len(first) == 1 and first[0]["commit"] == here["commit"] and first[0]["dirty"] == here["dirty"]
    assert first[0]["versions"] == versions.core_versions() and first[0]["cpu"] == versions.cpu_model()
    assert first[0]["device"].endswith(jax.devices()[0].device_kind)
    launch.open_dir(p, str(tmp_path))  # continued on the same set-up
    assert json.loads((tmp_path / "compare.json").read_text())["provenance"] == first
    monkeypatch.setattr(versions, "git_state", lambda repo=None: {"commit": "0" * 40, "dirty": True})
    monkeypatch.setattr(launch, "provenance", versions.provenance)
    launch.open_dir(p, str(tmp_path))  # continued on other code: recorded, and the plan check still passes
    sessions = json.loads((tmp_path / "compare.json").read_text())["provenance"]
    assert [s["commit"] for s in sessions] == [here["commit"], "0" * 40] and sessions[1]["dirty"] is True
    header = report.section_provenance(sessions)
    assert "2 sessions on different set-ups" in header[0] and "`000000000000` with uncommitted changes" in header[3]


def readme_compare_argv() -> list[str]:
    """The README's comparison command's arguments (its `python scripts/compare.py ...` block), as typed."""
    import shlex

    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    start = text.index("python scripts/compare.py optimizers=")
    command = text[start:text.index("\n```", start)].replace("\\\n", " ").split("#")[0]
    return shlex.split(command)[2:]


def _all_optimizers():
    from optimizer import OPTIMIZERS

    return sorted(OPTIMIZERS)


@pytest.mark.parametrize("name", per_optimizer(_all_optimizers()))
def test_the_readme_comparison_takes_any_registered_optimizer(name):
    """The README's comparison with one more optimizer in `optimizers=[...]` and no other change plans,
    and every run it plans (a trunk and a branch per optimizer) composes and validates: a new optimizer
    joins a comparison by its name alone (its yaml's lr centres its grid)."""
    script = load_script("compare")
    argv = [a if not a.startswith("optimizers=") else f"optimizers=[adamw,{name}]" if name != "adamw" else a
            for a in readme_compare_argv()]
    ours, theirs, _ = script.split_argv(argv)
    from compare.plan import with_steps

    knobs, _ = with_steps(compare_config(script.compose_knobs(ours)), tuple(theirs))
    plan = make_plan(knobs, theirs, workload_lrs(knobs, tuple(theirs)))
    assert name in {run.optimizer for run in plan.runs}
    script.check_runs(plan)  # raises ConfigError on a knob a run would refuse


def test_cli_bad_knob_is_one_line_before_anything_trains(tmp_path, capsys):
    script = load_script("compare")
    assert script.main(["optimizers=[adamw,foo]", f"dir={tmp_path / 'c'}"]) == 2
    from optimizer import OPTIMIZERS

    assert capsys.readouterr().err.strip() == ("error: optimizers: unknown optimizer 'foo'; choose from "
                                               + ", ".join(OPTIMIZERS))
    assert script.main(["budgets=[20,10]"]) == 2
    assert script.main(["lr.points=1", "budgets=[10]", "warmup=2", "model.dimm=3"]) == 2
    assert "model.dimm" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# --- workloads, sweeps, lr.extend, save_every: the plan, and the loop with a stand-in trainer ---------------


def test_workloads_and_sweeps_cross_every_lr_and_seed():
    k = compare_config({**KNOBS, "optimizers": ["adamw", "sgdm"], "lr": {"points": 2}, "seeds": 2,
                        "sweep": {"weight_decay": [0.0, 0.1]},
                        "workloads": {"small": "model.dim=16", "big": ["model.dim=32", "dataset.batch_size=4"]}})
    assert k.workloads == (("big", ("model.dim=32", "dataset.batch_size=4")), ("small", ("model.dim=16",)))
    lrs = {"big": {"adamw": 1e-3, "sgdm": 0.3}, "small": {"adamw": 2e-3, "sgdm": 0.3}}
    p = make_plan(k, ["model.num_blocks=1"], lrs)
    assert len(p.runs) == 2 * 2 * 2 * 2 * 2 * 3  # workloads x optimizers x lrs x weight decays x seeds x (trunk + 2)
    trunk = p.runs[0]
    assert trunk.id == "big__adamw__lr0.0005__weight_decay0__seed0__trunk" and trunk.sweep == (("weight_decay", 0.0),)
    assert {"optimizer.weight_decay=0", "model.num_blocks=1", "model.dim=32"} <= set(trunk.overrides)
    assert trunk.overrides.index("model.num_blocks=1") < trunk.overrides.index("model.dim=32")  # the workload wins
    small = {r.lr for r in p.runs if r.workload == "small" and r.optimizer == "adamw"}
    assert small == {1e-3, 2e-3}  # each workload's grid is around its own yaml lr
    assert {r.sweep for r in p.runs} == {(("weight_decay", 0.0),), (("weight_decay", 0.1),)}
    assert json.loads(json.dumps(p.to_json()))["runs"][0]["sweep"] == {"weight_decay": 0.0}


def test_a_workload_may_centre_an_optimizers_lr_grid():
    """`lr.<optimizer>=X` in a workload's overrides centres that optimizer's grid there (not passed to
    the runs); the other workload and optimizer keep their yaml lrs."""
    k = compare_config({**KNOBS, "optimizers": ["adamw", "sgdm"], "lr": {"points": 2},
                        "workloads": {"small": "model.dim=16 lr.sgdm=0.1", "big": "model.dim=32"}})
    assert k.workloads == (("big", ("model.dim=32",)), ("small", ("model.dim=16",)))
    lrs = workload_lrs(k, RUN)
    yaml = base_lrs(("adamw", "sgdm"), RUN)
    assert lrs == {"big": yaml, "small": {"adamw": yaml["adamw"], "sgdm": 0.1}}
    p = make_plan(k, RUN, lrs)
    grid = lambda w, o: sorted({r.lr for r in p.runs if r.workload == w and r.optimizer == o})
    assert grid("small", "sgdm") == [0.05, 0.1] and grid("big", "sgdm") == [yaml["sgdm"] / 2, yaml["sgdm"]]
    assert not any(o.startswith("lr.") for r in p.runs for o in r.overrides)
    k = compare_config({**KNOBS, "optimizers": ["adamw", "sgdm"], "lr": {"points": 2},
                        "workloads": {"small": "model.dim=16 lr.grid.sgdm=[0.2,0.7]", "big": "model.dim=32"}})
    p = make_plan(k, RUN, workload_lrs(k, RUN))  # the workload's own grid, as given
    assert grid("small", "sgdm") == [0.2, 0.7] and grid("big", "sgdm") == [yaml["sgdm"] / 2, yaml["sgdm"]]


def test_an_optimizers_own_search_space_is_crossed_with_its_lrs_only():
    """sweep.muon.adam_lr (Muon's AdamW-group lr, a knob AdamW lacks) beside the shared
    sweep.weight_decay: Muon's runs cross both with its lrs, AdamW's only the shared one; each
    optimizer's trial count follows (the report and compare.py state them)."""
    k = compare_config({**KNOBS, "optimizers": ["adamw", "muon"], "lr": {"points": 2},
                        "sweep": {"weight_decay": [0.0, 0.1], "muon": {"adam_lr": [1e-3, 3e-3]}}})
    assert k.sweep_of("adamw") == (("weight_decay", (0.0, 0.1)),)
    assert k.sweep_of("muon") == (("adam_lr", (1e-3, 3e-3)), ("weight_decay", (0.0, 0.1)))
    assert (k.trials("adamw"), k.trials("muon")) == (4, 8)
    p = make_plan(k, [], {"adamw": 1e-3, "muon": 0.02})
    trunks = [r for r in p.runs if r.kind == "trunk"]
    assert len([r for r in trunks if r.optimizer == "adamw"]) == 2 * 2  # lrs x weight decays (1 seed)
    assert len([r for r in trunks if r.optimizer == "muon"]) == 2 * 2 * 2  # lrs x adam_lrs x weight decays
    assert all(not any("adam_lr" in o for o in r.overrides) for r in p.runs if r.optimizer == "adamw")
    muon = next(r for r in trunks if r.optimizer == "muon")
    assert muon.sweep == (("adam_lr", 1e-3), ("weight_decay", 0.0))
    assert {"optimizer.adam_lr=0.001", "optimizer.weight_decay=0"} <= set(muon.overrides)
    assert "adam_lr0.001" in muon.id
    assert json.loads(json.dumps(p.to_json()))["knobs"]["sweep"] == {"muon.adam_lr": [1e-3, 3e-3],
                                                                     "weight_decay": [0.0, 0.1]}


def test_an_optimizers_own_sweep_from_the_command_line_runs_and_its_trials_are_stated(tmp_path, monkeypatch, capsys):
    """`sweep.muon.adam_lr=[...]` typed as a user would: Muon's runs carry it, the console and the
    report say the optimizers were tuned over different numbers of settings."""
    script = load_script("compare")
    monkeypatch.setattr(T, "train", fake_train)
    argv = ["optimizers=[adamw,muon]", "budgets=[10]", "lr.points=1", "sweep.muon.adam_lr=[1e-3,3e-3]", "warmup=2",
            *RUN, f"dir={tmp_path}"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "tuned over different numbers of settings (lrs x sweep values): adamw 1, muon 2" in out
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/run.json")]
    assert sorted(r["sweep"].get("adam_lr", 0) for r in runs if r["optimizer"] == "muon") == [1e-3, 1e-3, 3e-3, 3e-3]
    assert all(r["sweep"] == {} for r in runs if r["optimizer"] == "adamw")
    md = (tmp_path / "report.md").read_text()
    assert "lr.extend's included): adamw 1, muon 2 (**not the same for every optimizer**" in md
    assert json.loads((tmp_path / "summary.json").read_text())["workloads"]["default"]["optimizers"]["muon"][
        "trials"] == 2


@pytest.mark.parametrize("change, knob", [
    ({"sweep": {"muon": {"b2": [0.9]}}, "optimizers": ["adamw", "muon"]},
     "sweep.muon.b2: muon has no knob 'b2'; its knobs are adam_b1, adam_b2, "),
    ({"sweep": {"adam_lr": [1e-3]}, "optimizers": ["adamw", "muon"]},
     r"sweep.adam_lr: adamw has no knob 'adam_lr'; its knobs are .* \(sweep.<optimizer>.<knob> sweeps one"),
    ({"sweep": {"lion": {"b1": [0.9]}}, "optimizers": ["adamw", "muon"]},
     "sweep.lion.b1: lion is not in optimizers=.* add it there or drop its sweep"),
    ({"sweep": {"weight_decay": [0.0], "muon": {"weight_decay": [0.1]}}, "optimizers": ["adamw", "muon"]},
     "sweep.muon.weight_decay and sweep.weight_decay both sweep it for muon: give one"),
    ({"sweep": {"muon": {"lr": [1e-3]}}, "optimizers": ["adamw", "muon"]}, "sweep.muon.lr: the comparison sets"),
    ({"sweep": {"lr": [1e-3]}}, "sweep.lr: the comparison sets the optimizer and its lr itself"),
    ({"sweep": {"groups": {"hidden": {"lr": [1e-3]}}}}, "sweep.groups.hidden.lr: the comparison sets"),
    ({"sweep": {"weight_decay": [0.1, 0.1]}}, r"sweep.weight_decay=\[0.1, 0.1\] must be distinct"),
    ({"sweep": {"weight_decay": []}}, "sweep.weight_decay=.* must be a non-empty list"),
    ({"workloads": {"a__b": "model.dim=8"}}, "workloads.a__b: a workload's name is letters"),
    ({"workloads": {"a": ["model.dim"]}}, "workloads.a=.* must be a list of run overrides"),
    ({"workloads": {"a": "train.max_steps=5"}}, r"train.max_steps=5 \(in workloads.a\): the comparison sets"),
    ({"workloads": {"a": "lr.lion=1e-3"}}, r"workloads.a: lr.lion=1e-3: lr.<optimizer>=X centres .* 'lion' is not"),
    ({"workloads": {"a": "lr.adamw=-1"}}, "workloads.a: lr.adamw=-1: the lrs must be distinct positive numbers"),
    ({"workloads": {"a": "lr.adamw=fast"}}, "workloads.a: lr.adamw=fast: the lrs must be distinct positive"),
    ({"workloads": {"a": "lr.grid.adamw=[1e-3,1e-3]"}}, r"lr.grid.adamw=\[1e-3,1e-3\]: the lrs must be distinct"),
    ({"workloads": {"a": "lr.grid.adamw=[1e-3,2e-3]"}}, "workloads.a: lr.grid.adamw has 2 lrs but lr.points=1"),
    ({"workloads": {"a": "lr.adamw=1e-3 lr.grid.adamw=[1e-3]"}, "lr": {"points": 1}},
     "workloads.a sets adamw's lrs twice"),
    ({"workloads": {"a": "lr.adamw=1e-3"}, "lr": {"points": 1, "grid": {"adamw": [1e-3]}}},
     r"workloads.a sets lr.adamw or lr.grid.adamw, and the comparison's lr.grid.adamw gives its lrs everywhere"),
    ({"workloads": {"a": "optimizer.lr_config.lr=1e-3"}}, r"in a workload, lr.<optimizer>=X centres"),
    ({"lr": {"extend": "yes"}}, "lr.extend='yes' must be true or false"),
    ({"lr": {"extend_max": 0}}, "lr.extend_max=0 must be an integer >= 1"),
])
def test_bad_sweep_workload_and_extend_knobs(change, knob):
    with pytest.raises(ConfigError, match=knob) as e:
        compare_config({**KNOBS, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("grid, best, base, most, want", [
    ([1.0, 2.0, 4.0], 4.0, (1.0, 2.0, 4.0), 2, 8.0),        # best at the top: one more factor up
    ([1.0, 2.0, 4.0], 1.0, (1.0, 2.0, 4.0), 2, 0.5),        # at the bottom: one down
    ([1.0, 2.0, 4.0], 2.0, (1.0, 2.0, 4.0), 2, None),       # inside: done
    ([1.0, 3.0, 9.0, 27.0], 27.0, (1.0, 3.0), 2, None),     # two added above already
    ([1.0, 3.0, 9.0], 9.0, (1.0, 3.0), 2, 27.0),            # one added: one more
    ([2.0], 2.0, (2.0,), 2, None),                          # one lr: no edge to speak of
    ([1.0, 2.0], None, (1.0, 2.0), 2, None),                # every lr failed
])
def test_extension_lr(grid, best, base, most, want):
    from compare.plan import extension_lr

    assert extension_lr(grid, best, base, most) == want


def test_save_every_adds_interval_saves_and_keeps_the_branch_points(tmp_path):
    p = plan({**KNOBS, "budgets": [10, 30]})  # trunk to 24, saving at 8 and 24
    trunk, b10, b30 = p.runs
    saves = lambda run, every: next(o for o in launch.run_overrides(run, str(tmp_path), every)
                                    if o.startswith("checkpoint.save_steps="))
    assert saves(trunk, None) == "checkpoint.save_steps=[8,24]"
    assert saves(trunk, 5) == "checkpoint.save_steps=[5,8,10,15,20,24]"
    assert saves(b30, 5) == "checkpoint.save_steps=[5,10,15,20,25,30]"  # a branch starts at 24: 25, 30 matter
    assert launch.kept_steps(trunk) == {8, 24} and launch.kept_steps(b10) == {10}
    for step in (5, 8, 10, 24):
        (tmp_path / "ckpt" / f"iter_{step}").mkdir(parents=True)
    launch._prune(str(tmp_path), launch.kept_steps(trunk))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["iter_24", "iter_8"]


def test_a_branch_saves_its_end_only_when_its_checkpoints_are_kept(tmp_path):
    """A branch's end checkpoint is deleted as soon as it is done (prune_done), so it is not written
    (checkpoint.save_at_end=false) unless keep_checkpoints=true keeps it; a trunk's end is a branch
    point, always saved (its save_steps)."""
    trunk, b10, _ = plan().runs
    end_save = lambda run, keep: "checkpoint.save_at_end=false" not in launch.run_overrides(
        run, str(tmp_path), None, keep_checkpoints=keep)
    assert not end_save(b10, False) and end_save(b10, True)
    assert end_save(trunk, False) and end_save(trunk, True)


def fake_train(cfg, run_dir):
    """A stand-in for train_jax.train: val/loss = 3 + (log10(lr) + 2.5)² (best lr 10^-2.5 ≈ 3.2e-3)
    + 0.1·weight_decay + 1/step, logged where train_jax evaluates (every train.val_freq steps, at train.val_at
    and at train.max_steps) from the branch point on."""
    lr, wd = float(cfg.optimizer.lr_config.lr), float(cfg.optimizer.get("weight_decay", 0.0))
    start = int(cfg.checkpoint.load_file.split("_")[1]) if cfg.checkpoint.load else 0
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in evaluated_steps(cfg.train, start):
            loss = 3 + (math.log10(lr) + 2.5) ** 2 + 0.1 * wd + 1 / step
            f.write(json.dumps({"step": step, "val/loss": loss, "data/tokens": step * 64, "data/fingerprint": "fp",
                                "time/elapsed_sec": step * 0.01}) + "\n")


def test_a_comparison_grows_by_seeds_and_optimizers_and_trains_only_the_new_runs(tmp_path, monkeypatch, capsys):
    """The same dir= with a second seed and a second optimizer: 6 new runs beside the 2 done, which are
    kept untouched; a change of budgets would change the runs made, so it is refused in one line."""
    script = load_script("compare")
    trained = []
    monkeypatch.setattr(T, "train", lambda cfg, d: (trained.append(os.path.basename(d)), fake_train(cfg, d)))
    monkeypatch.setattr(script, "build_report", lambda d: None)
    common = ["lr.points=1", "warmup=2", *RUN, f"dir={tmp_path}"]
    assert script.main(["optimizers=[adamw]", "budgets=[10]", "seeds=1", *common]) == 0
    first = {d: (tmp_path / "runs" / d / "metrics.jsonl").read_text() for d in trained}
    assert len(first) == 2
    trained.clear()
    capsys.readouterr()
    assert script.main(["optimizers=[adamw,sgdm]", "budgets=[10]", "seeds=2", *common]) == 0
    out = capsys.readouterr().out
    assert f"compare: {tmp_path} grows by 6 runs" in out and "2 skipped" in out
    assert len(trained) == 6 and not set(trained) & set(first)
    assert {d: (tmp_path / "runs" / d / "metrics.jsonl").read_text() for d in first} == first
    plan = json.loads((tmp_path / "compare.json").read_text())
    assert len(plan["runs"]) == 8 and plan["knobs"]["optimizers"] == ["adamw", "sgdm"] and plan["knobs"]["seeds"] == 2
    assert script.main(["optimizers=[adamw,sgdm]", "budgets=[10,20]", "seeds=2", *common]) == 2
    err = capsys.readouterr().err
    assert "its budgets differ from this command's" in err and len(err.strip().splitlines()) == 1
    assert script.main(["optimizers=[sgdm]", "budgets=[10]", "seeds=2", *common]) == 2  # dropping runs is not growing
    assert "is not planned alike" in capsys.readouterr().err


def test_lr_extend_runs_lrs_past_the_edge_until_the_best_is_inside(tmp_path, monkeypatch, capsys):
    """lr.grid [1e-4, 3e-4]: the best (3e-4) is the top edge, so 9e-4 is added, then 2.7e-3; the
    best is then inside (2.7e-3 beats 9e-4, but 8.1e-3 would be a third: lr.extend_max=2 stops
    it). The sweep's best weight decay is 0. A rerun skips every run and adds nothing."""
    script = load_script("compare")
    monkeypatch.setattr(T, "train", fake_train)
    reports = []
    monkeypatch.setattr(script, "build_report", reports.append)
    argv = ["optimizers=[adamw]", "budgets=[10]", "lr.points=2", "lr.grid.adamw=[1e-4,3e-4]", "lr.extend=true",
            "sweep.weight_decay=[0.0,0.1]", "warmup=2", *RUN, f"dir={tmp_path}"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("compare: lr.extend: 4 more runs beyond the edge of a grid") == 2
    from compare.report import load_workloads

    (w,) = load_workloads(str(tmp_path))
    assert w.grid["adamw"] == pytest.approx([1e-4, 3e-4, 9e-4, 2.7e-3]) and w.best["adamw"] == pytest.approx(2.7e-3)
    assert w.best_setting["adamw"] == (("weight_decay", 0.0),)
    assert len(list((tmp_path / "runs").iterdir())) == 4 * 2 * 2
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "lr.extend" not in out and out.count("skipped (done before)") == 8 and "0 done, 8 skipped" in out
    assert reports == [str(tmp_path)] * 2
    # the report at each optimizer's best setting, and the Sweep table: every setting's best lr and loss
    from compare.report import build_report

    md = open(build_report(str(tmp_path))).read()
    expect = lambda lr, wd: 3 + (math.log10(lr) + 2.5) ** 2 + 0.1 * wd + 1 / 10
    sweep = md.split("## Sweep")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in sweep.splitlines() if line.startswith("| adamw")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("| adamw *", "0.0", "0.0027"), ("| adamw", "0.1", "0.0027")]
    assert [float(r[3].rstrip(" |")) for r in rows] == [round(expect(2.7e-3, 0.0), 4), round(expect(2.7e-3, 0.1), 4)]
    summary = md.split("## Results per optimizer")[1].split("\n## ")[0]
    assert "| optimizer | best lr | best weight_decay | runs |" in summary
    # the best lr still sits at the edge, but lr.extend has used up its lr.extend_max (2): say so
    assert "lr.extend already added 2 lr(s) on that side, its lr.extend_max" in summary
    assert "rerun with lr.extend=true" not in summary
    assert f"| adamw | 0.0027 | 0.0 | 16 | 0 | 0 | {expect(2.7e-3, 0.0):.4f} |" in summary
    assert "lr.extend's included): adamw 8." in summary  # 4 lrs (2 added by lr.extend) x 2 weight decays


def _launched(tmp_path, cache_dir, *launcher: str) -> tuple[list[str], object]:
    """The tiny comparison run through a launcher (its report stubbed): (its output lines, its dir)."""
    script = load_script("compare")
    path = tmp_path / "launched"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EQTRAIN_CACHE", str(cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.setattr(script, "build_report", lambda d: None)
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert script.main([*ARGV, *launcher, f"dir={path}"]) == 0
    return out.getvalue().splitlines(), path


def _same_as_reference(lines, path, reference):
    assert any(line.startswith(f"[1/3] {TRUNK}: submitted (job ") for line in lines)
    # the branches are submitted only once the trunk is done
    assert lines.index(next(x for x in lines if x.startswith(f"[1/3] {TRUNK}: done"))) < lines.index(
        next(x for x in lines if x.startswith(f"[2/3] {S10}: submitted")))
    assert lines[-1].startswith("compare: 3 runs: 3 done, 0 skipped")
    for run_id in (TRUNK, S10, S20):
        assert json.loads((path / "runs" / run_id / "run.json").read_text())["status"] == "done"
        assert losses(path / "runs" / run_id) == losses(reference / "runs" / run_id), run_id


@pytest.mark.slow
def test_local_launcher_runs_each_run_in_its_own_process(reference, tmp_path, _cache_dir):
    """hydra/launcher=local: a process per run (submitit's local executor), both branches at once
    (parallel=2) after their trunk; the losses equal the in-process comparison's bit for bit."""
    lines, path = _launched(tmp_path, _cache_dir, "hydra/launcher=local", "parallel=2")
    _same_as_reference(lines, path, reference)
    assert len([p for p in (path / ".submitit").iterdir() if p.name.isdigit()]) == 3  # a job folder per run


class SlurmComparison(BackgroundProcess):
    """The tiny comparison through hydra/launcher=slurm with its driver (scripts/compare.py, its
    report stubbed) in a subprocess started as a background set-up (tests/background.py): its half
    minute of waiting on SLURM overlaps the in-process tests. No driver without a cluster."""

    def __init__(self, where, cache_dir, problem: str | None):
        self.problem, self.path, self._out = problem, where / "launched", where / "driver.stdout"
        if problem:
            return
        code = ("import sys; sys.path.insert(0, 'tests'); from helpers import load_script; "
                "script = load_script('compare'); script.build_report = lambda d: None; "
                "sys.exit(script.main(sys.argv[1:]))")
        env = {**os.environ, "EQTRAIN_CACHE": str(cache_dir), "WANDB_MODE": "disabled"}
        with open(self._out, "w") as out, open(where / "driver.stderr", "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code, *ARGV, "hydra/launcher=slurm",
                                          "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10",
                                          "parallel=2", f"dir={self.path}"],
                                         cwd=REPO, env=env, stdout=out, stderr=err, text=True)

    def result(self) -> list[str]:
        """The driver's output lines, once it has exited 0."""
        code = self.proc.wait(600)
        assert code == 0, (self._out.parent / "driver.stderr").read_text()[-4000:]
        return self._out.read_text().splitlines()


@background.setup
def slurm_comparison(ctx) -> SlurmComparison:
    from slurm_cluster import cluster_problem

    return SlurmComparison(ctx.tmp_path_factory.mktemp("slurm_compare"), ctx.cache_dir, cluster_problem("debug"))


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_launcher_runs_each_run_as_a_slurm_job(reference, slurm_comparison):
    """hydra/launcher=slurm on the local one-node cluster (scripts/slurm/local_cluster.sh): a
    SLURM job per run, branches submitted when their trunk is done; the same losses as in-process."""
    from slurm_cluster import no_cluster

    if slurm_comparison.problem:
        no_cluster(slurm_comparison.problem)
    lines, path = slurm_comparison.result(), slurm_comparison.path
    _same_as_reference(lines, path, reference)
    scripts = [p.read_text() for p in (path / ".submitit").glob("*/*_submission.sh")]
    assert len(scripts) == 3 and all("#SBATCH --partition=debug" in s for s in scripts)  # sbatch scripts


def test_optimizers_that_need_no_cooldown_or_read_the_run_length():
    """Schedule-Free's branches keep the constant lr (it refuses a decay); AdEMAMix's warmup of
    alpha and b3 (null = the run's length) is the largest budget in every run, unless given."""
    k = compare_config({**KNOBS, "optimizers": ["schedule_free_adamw", "ademamix"], "budgets": [10, 20]})
    p = make_plan(k, RUN, {"schedule_free_adamw": 1e-3, "ademamix": 1e-3})
    sf = [r for r in p.runs if r.optimizer == "schedule_free_adamw"]
    assert all("optimizer/lr_config=constant" in r.overrides for r in sf)
    assert not any(o.startswith("optimizer.lr_config.decay") for r in sf for o in r.overrides)
    ad = [r for r in p.runs if r.optimizer == "ademamix"]
    assert all("optimizer.alpha_b3_warmup=20" in r.overrides for r in ad)
    assert "optimizer/lr_config=trapezoid" in ad[1].overrides
    given = make_plan(k, [*RUN, "optimizer.alpha_b3_warmup=5"], {"schedule_free_adamw": 1e-3, "ademamix": 1e-3})
    assert not any("alpha_b3_warmup=20" in o for r in given.runs for o in r.overrides)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["schedule_free_adamw", "ademamix"])
def test_branches_of_length_aware_optimizers_equal_from_scratch_runs(optimizer, tmp_path):
    """Branching stays exact for them too: the S20 branch (from the trunk's step 16) equals a run
    of its own overrides from scratch, bit for bit (AdEMAMix's warmup spans 20 steps in both)."""
    p = plan({**KNOBS, "optimizers": [optimizer]})
    summary = launch.run_plan(p, str(tmp_path / "c"), train=T.train, say=lambda _: None)
    assert len(summary.done) == 3
    run_id = next(r.id for r in p.runs if r.budget == 20)
    branch = json.loads((tmp_path / "c" / "runs" / run_id / "run.json").read_text())
    (tmp_path / "scratch").mkdir()
    scratch_overrides = [o for o in branch["overrides"] if not o.startswith(("checkpoint.", "train.val_at="))]
    T.train(compose_overrides([*scratch_overrides, "train.val_at=[8,16,20]"], job_name="test"),  # the runs' evaluations
            str(tmp_path / "scratch"))
    scratch, cooled = losses(tmp_path / "scratch"), losses(tmp_path / "c" / "runs" / run_id)
    trunk = losses(tmp_path / "c" / "runs" / run_id.replace("__S20", "__trunk"))
    assert {**{s: v for s, v in trunk.items() if s <= 16}, **{s: v for s, v in cooled.items() if s > 16}} == scratch
    from compare.report import build_report

    md = open(build_report(str(tmp_path / "c"))).read()
    assert {"schedule_free_adamw": "- schedule_free_adamw needs no cooldown",
            "ademamix": "- ademamix reads the run's length through optimizer.alpha_b3_warmup: set to 20 for every"
            }[optimizer] in md


def _evaluated_steps(run, yaml_val_freq: int) -> list[int]:
    """The steps train_jax's Evaluation hook evaluates a planned run at, from its overrides (a branch
    starts at its branch point: loaded, not resumed, so no baseline)."""
    from trainer import hooks as H

    values = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in run.overrides}
    at = tuple(int(s) for s in values.get("train.val_at", "[]").strip("[]").split(",") if s)
    end, start = int(values["train.max_steps"]), run.branch_step or 0
    evaluation = H.Evaluation(None, int(values.get("train.val_freq", yaml_val_freq)), end, True, at)
    ctx = H.LoopContext(start, end, state=None, data=None)
    steps = []
    for step in range(start, end + 1):
        ctx.step = step
        if evaluation.due(ctx):
            steps.append(step)
    return steps


@pytest.mark.parametrize("budgets, val_every", [((10, 21), None), ((10, 21), 4), ((1000, 2500, 7001), None),
                                                 ((1000, 2500, 7001), 300)])
def test_runs_evaluate_at_branch_points_budgets_and_val_every_only(budgets, val_every):
    """The old plan set train.val_freq to the gcd of budgets and branch points: 1 for [10,21] and
    [1000,2500,7001], an evaluation at every step. Now a trunk evaluates at step 0, its branch points
    and every val_every steps (null: the runs' own train.val_freq, the yaml's), a branch at its budget
    and every val_every steps after its branch point; the report's val/loss at each is there."""
    import yaml

    with open(os.path.join(os.path.dirname(__file__), "..", "conf", "train.yaml")) as f:
        yaml_val_freq = yaml.safe_load(f)["train"]["val_freq"]
    every = val_every or yaml_val_freq
    knobs = {**KNOBS, "budgets": list(budgets), **({"val_every": val_every} if val_every else {})}
    k = compare_config(knobs)
    points = [k.branch_step(b) for b in budgets]
    trunk, *branches = make_plan(k, ["model.dim=32"], {"adamw": 3e-3}).runs
    assert _evaluated_steps(trunk, yaml_val_freq) == sorted({0, *points, *range(every, points[-1] + 1, every)})
    for run, budget, point in zip(branches, budgets, points):
        assert _evaluated_steps(run, yaml_val_freq) == sorted({budget, *range(every, budget + 1, every)} - set(
            range(point + 1))), run.id
    if val_every:  # and a run override of train.val_freq beside val_every is refused, naming both
        with pytest.raises(ConfigError, match=r"val_every=.*train\.val_freq.*give only val_every"):
            make_plan(k, ["train.val_freq=7"], {"adamw": 3e-3})
