"""The comparison engine (scripts/compare.py, utils/compare/plan.py and launch.py) on a tiny case:
one optimizer, one lr, one seed, budgets [10, 20] with warmup 2: a 16-step constant-lr trunk
saving at 8 and 16, and two cooldown branches (2 and 4 steps).

- a branch equals a run trained from scratch with the same warmup-stable-decay schedule, bit for bit;
- a comparison killed between two checkpoints and run again equals the uninterrupted one;
- a diverging lr is a failed run (diverged, its branches failed unrun) and the comparison goes on;
- bad knobs are one ConfigError line naming the knob, before anything trains.
"""

import json
import os
import shutil

import pytest
from helpers import TINY_OVERRIDES, load_script

import train_jax as T
from utils.compare import launch
from utils.compare.plan import base_lrs, compare_config, make_plan
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
    overrides = [o for o in branch["overrides"] if not o.startswith("checkpoint.")]
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
    assert f"[1/3] {TRUNK}: resumed from step 8" in lines and f"[3/3] {S20}: done" in lines
    assert summary.done == [TRUNK, S10, S20] and not summary.failed
    for run_id in (TRUNK, S10, S20):
        assert losses(tmp_path / "runs" / run_id) == losses(reference / "runs" / run_id), run_id
    lines = []
    summary = launch.run_plan(p, str(tmp_path), train=None, say=lines.append)
    assert summary.skipped == [TRUNK, S10, S20] and f"[2/3] {S10}: skipped (done before)" in lines


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
    ({"seeds": 0}, "seeds=0 must be an integer >= 1"),
    ({"cooldown": {"shape": "cosine"}}, "cooldown.shape='cosine' must be one of linear, 1-sqrt"),
    ({"cooldown": {"fraction": 1.0}}, r"cooldown.fraction=1.0 must be in \(0, 1\)"),
    ({"seed": 3}, "unknown comparison knob 'seed'"),
])
def test_bad_knobs_are_one_line_config_errors(change, knob):
    with pytest.raises(ConfigError, match=knob) as e:
        compare_config({**KNOBS, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, knob", [
    ("optimizer=sgdm", "optimizers="), ("optimizer.lr_config.lr=1", "lr.points"), ("random_seed=1", "seeds=K"),
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
            "data_seed=0", "model.dim=32", "train.val_freq=10"} <= set(trunk.overrides)
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


def test_cli_bad_knob_is_one_line_before_anything_trains(tmp_path, capsys):
    script = load_script("compare")
    assert script.main(["optimizers=[adamw,foo]", f"dir={tmp_path / 'c'}"]) == 2
    assert capsys.readouterr().err.strip() == ("error: optimizers: unknown optimizer 'foo'; choose from "
                                               "adamw, sgdm, muon, lion, adafactor, shampoo")
    assert script.main(["budgets=[20,10]"]) == 2
    assert script.main(["lr.points=1", "budgets=[10]", "warmup=2", "model.dimm=3"]) == 2
    assert "model.dimm" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
