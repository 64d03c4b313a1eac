"""Packed runs (`compare.py ... pack=N`): compare/pack.py's grouping, trainer/pack.py's vmapped training.

The tests that train need XLA:CPU's vmapped-gradient workaround (utils/xla_workarounds.py), which JAX
reads once when it starts: in a session without it (the suite's), they are skipped here and
`test_the_packed_tests_pass_under_the_flag` runs this file again in a process that has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import EPS32, ON_CUDA, TINY_OVERRIDES

import train_jax as T
from compare import launch
from compare import pack as grouping
from compare.plan import base_lrs, compare_config, make_plan
from trainer import hooks as H
from trainer import pack as packing
from trainer import process_cache
from utils.config import compose_overrides, validate
from utils.errors import ConfigError
from utils.xla_workarounds import YNN_FLAG, has_ynn_flag

FLAGGED = ON_CUDA or has_ynn_flag(os.environ)
needs_flag = pytest.mark.skipif(not FLAGGED, reason="needs XLA_FLAGS with the YNN workaround: "
                                                    "test_the_packed_tests_pass_under_the_flag runs these")
TIMED = ("time/", "train/tokens_per_sec", "train/mfu")  # the wall clock's metrics (trainer/hooks.py Throughput)
RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
    "train.max_val_steps=2", "logging.log_every=2")
# Three lrs of adamw, the last one far past divergence: its weights overflow on its first update.
KNOBS = {"optimizers": ["adamw"], "budgets": [4, 6], "lr": {"points": 3, "grid": {"adamw": [1e-3, 3e-3, 1e30]}},
         "seeds": 1, "warmup": 1}
DIVERGED = "default__adamw__lr1e+30__seed0__trunk"


def plan(knobs=KNOBS, run=RUN):
    k = compare_config(knobs)
    return make_plan(k, run, base_lrs(k.optimizers, run))


def records(compare_dir) -> dict[str, list[dict]]:
    """Every run's metrics.jsonl records without the wall clock's metrics."""
    out = {}
    for run in sorted(os.listdir(os.path.join(compare_dir, "runs"))):
        path = os.path.join(compare_dir, "runs", run, "metrics.jsonl")
        if not os.path.exists(path):  # a branch of a failed trunk: never started
            continue
        with open(path) as f:
            out[run] = [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMED)} for line in f]
    return out


def curves(compare_dir) -> dict[str, dict[int, dict]]:
    """Per run, step -> its train/* and val/* values (a resumed run's extra start record at its
    checkpoint's step, which repeats the run's first-record facts, adds none)."""
    out = {}
    for run, recs in records(compare_dir).items():
        by_step = out.setdefault(run, {})
        for r in recs:
            by_step.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k.startswith(("train/", "val/"))})
    return out


def statuses(compare_dir) -> dict[str, tuple]:
    out = {}
    for run in sorted(os.listdir(os.path.join(compare_dir, "runs"))):
        r = json.loads(open(os.path.join(compare_dir, "runs", run, "run.json")).read())
        out[run] = (r["status"], r["diverged"], r["error"])
    return out


# --- no training: every session -----------------------------------------------------------------

def test_compare_py_appends_the_workaround_to_the_users_xla_flags_only_for_a_pack(monkeypatch):
    from helpers import load_script

    compare = load_script("compare")
    assert compare.pack_flags(["pack=4", "budgets=[4]"], {"XLA_FLAGS": "--xla_foo=1"}) == f"--xla_foo=1 {YNN_FLAG}"
    assert compare.pack_flags(["pack=4"], {}) == YNN_FLAG
    assert compare.pack_flags(["pack=1"], {"XLA_FLAGS": "--xla_foo=1"}) is None
    assert compare.pack_flags(["budgets=[4]"], {}) is None
    assert compare.pack_flags(["pack=2"], {"XLA_FLAGS": YNN_FLAG}) is None  # there already: left as it is


@pytest.mark.skipif(FLAGGED, reason="this process has the flag (or a GPU)")
def test_a_pack_on_a_cpu_without_the_workaround_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce") as e:
        packing.check_backend()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, knob", [
    ("model.moe.num_experts=4", "model.moe.capacity_factor"),
    ("train.early_stopping.patience=2", "train.early_stopping.patience"),
])
def test_what_a_pack_cannot_vmap_or_stop_alike_is_refused_naming_the_knob(override, knob):
    run = validate(compose_overrides([*RUN, "train.max_steps=4", override], job_name="compare"))
    with pytest.raises(ConfigError, match=knob.replace(".", r"\.")) as e:
        packing.check(run)
    assert "\n" not in str(e.value) and "pack=1" in str(e.value)


def test_a_pack_with_a_launcher_is_refused_before_anything_trains(tmp_path, capsys):
    from helpers import load_script

    compare = load_script("compare")
    code = compare.main(["optimizers=[adamw]", "budgets=[4]", "warmup=1", "pack=2", "hydra/launcher=local",
                         f"dir={tmp_path}/c", *RUN])
    err = capsys.readouterr().err
    assert code == 2 and "pack=2 trains its runs in this process" in err and not (tmp_path / "c").exists()


@pytest.mark.slow
def test_runs_are_grouped_by_program_start_and_data_up_to_n_in_plan_order(tmp_path, monkeypatch):
    """adamw and sgdm, 3 lrs, budgets 4 and 6, pack=2: trunks of one optimizer pack together (2, then
    the third alone), never across optimizers; a branch packs with branches of the same budget (the
    same branch point and length), only once its trunk is done; every run is trained exactly once.
    (The trainer is stubbed: only the grouping runs; composing 18 runs' configs is its time.)"""
    groups = []

    def fake_group(group, configs, compose, compare_dir, save_every, say, heads, quiet, on_outcome, t0, keep):
        groups.append([r.id for r in group])
        for r in group:
            overrides, json_path = launch.begin(r, compare_dir, save_every, say, heads[r.id], keep)
            on_outcome(r, *launch.finish(r, overrides, compare_dir, save_every, say, heads[r.id], t0), 0.0)

    alone = []

    def fake_one(run, compare_dir, train, compose, save_every, say, head, quiet, keep):
        alone.append(run.id)
        overrides, _ = launch.begin(run, compare_dir, save_every, say, head, keep)
        return launch.finish(run, overrides, compare_dir, save_every, say, head, 0.0)

    monkeypatch.setattr(grouping, "_train_group", fake_group)
    monkeypatch.setattr(grouping, "run_one", fake_one)
    p = plan({**KNOBS, "optimizers": ["adamw", "sgdm"], "lr": {"points": 3}})
    summary = launch.run_plan(p, str(tmp_path), train=None, say=lambda _: None, pack=2)
    assert sorted(summary.done) == sorted(r.id for r in p.runs)
    assert sorted(sum(groups, []) + alone) == sorted(r.id for r in p.runs)  # each once
    by_id = {r.id: r for r in p.runs}
    for g in groups:
        members = [by_id[i] for i in g]
        assert len(g) == 2 and len({(m.optimizer, m.kind, m.budget, m.branch_step) for m in members}) == 1, g
        assert [i for i in (r.id for r in p.runs) if i in g] == g  # in plan order
    assert len(groups) == 2 * 3 and len(alone) == 2 * 3  # per optimizer: trunks 2+1, each budget's branches 2+1


# --- packed training: under the flag ------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plan trained run by run (pack=1)."""
    d = tmp_path_factory.mktemp("alone")
    launch.run_plan(plan(), str(d), train=T.train, say=lambda _: None)
    return d


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The plan trained with pack=3; the PackedStep programs it built and the process cache's packed_step misses."""
    d = tmp_path_factory.mktemp("packed")
    built, make = [], packing.PackedStep.__init__

    def counting(self, *a, **k):
        make(self, *a, **k)
        built.append(self)

    packing.PackedStep.__init__ = counting
    try:
        lines = []
        summary = launch.run_plan(plan(), str(d), train=None, say=lines.append, pack=3)
    finally:
        packing.PackedStep.__init__ = make
    return d, summary, lines, built


@pytest.mark.slow
@needs_flag
def test_a_packed_comparison_equals_the_runs_trained_alone(reference, packed):
    """pack=3 and pack=1 give the same runs, statuses (the 1e30 lr's trunk diverged exactly as alone, its
    branches failed unrun) and every logged metric within float32 rounding."""
    d, summary, lines, _ = packed
    assert statuses(d) == statuses(reference)
    assert statuses(d)[DIVERGED][:2] == ("failed", True)
    assert "  packed: default__adamw__lr0.001__seed0__trunk, default__adamw__lr0.003__seed0__trunk, " \
           f"{DIVERGED}" in lines
    a, b = records(d), records(reference)
    assert a.keys() == b.keys()
    # A packed step is the same computation as a run's, its matmuls batched over the members: XLA may
    # sum their K terms in another order, each sum then erring by up to (K+1)·u·Σ|terms| (Higham 3.5;
    # u = EPS32/2) against the other. K: the longest reduction of the step, a weight gradient's over
    # B·T = 8·16 = 128 tokens; first-order errors add over the 6 steps of the longest run (trunk 5, then
    # a branch's 1 or 6 from 5: each step's error enters the weights once and is carried, not
    # amplified, at these lrs ≤ 3e-3), and a metric is a function of the weights a few roundings deep:
    # rtol = 6 steps × (128+1)·u × margin 4, relative to each metric's magnitude (a metric that is
    # itself a sum, e.g. a norm, carries Σ|terms| ≈ its value).
    rtol = 6 * (128 + 1) * EPS32 / 2 * 4
    worst = 0.0
    for run in b:
        if statuses(d)[run][0] != "done":
            continue
        assert [r.get("step") for r in a[run]] == [r.get("step") for r in b[run]], run
        for ra, rb in zip(a[run], b[run]):
            assert ra.keys() == rb.keys(), run
            for k, v in rb.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    diff = abs(ra[k] - v)
                    worst = max(worst, diff / max(abs(v), 1e-30))
                    assert diff <= rtol * abs(v) + 1e-30, (run, ra.get("step"), k, ra[k], v)
                else:
                    assert ra[k] == v, (run, k)
    print(f"worst relative difference {worst:.2e}, bound {rtol:.2e}")


@pytest.mark.slow
@needs_flag
def test_one_packed_program_per_step_function_and_n_each_variant_traced_once(packed):
    """Trunks (3 members) and branches (2 live members at both budgets) are two packed programs;
    each traced once per variant it called and never again: the trunks' 5 steps call plain and
    logging (log_every=2), the branches' (3 to 4, 5 to 6: each step its run's last) logging only."""
    _, _, _, built = packed
    assert len(built) == 2
    assert all(step.traces[0] == len(step.jitted) for step in built), [(s.traces, list(s.jitted)) for s in built]
    assert sorted(len(step.jitted) for step in built) == [1, 2]


@pytest.mark.slow
@needs_flag
def test_a_killed_packed_comparison_resumes_to_the_same_results(packed, tmp_path, monkeypatch):
    """The trunk pack is killed at step 4 (after its branch-point saves at 3; the diverged member is
    already recorded failed): the rerun resumes both live trunks as one pack from step 3, the branches
    restore the packed trunks' saves, and every run's records equal the uninterrupted packed comparison's
    bit for bit (the same program, lanes and checkpoints: every train/* and val/* value at every step);
    a third invocation trains nothing."""
    d, _, _, _ = packed
    call = H.Divergence.__call__
    killed = []

    def kill(self, ctx):
        if ctx.step == 4 and not killed:
            killed.append(ctx.step)
            raise KeyboardInterrupt
        return call(self, ctx)

    monkeypatch.setattr(H.Divergence, "__call__", kill)
    with pytest.raises(KeyboardInterrupt):
        launch.run_plan(plan(), str(tmp_path), train=None, say=lambda _: None, pack=3)
    monkeypatch.setattr(H.Divergence, "__call__", call)
    st = statuses(tmp_path)
    assert st[DIVERGED][:2] == ("failed", True)
    assert [r for r, s in st.items() if s[0] == "running"] == ["default__adamw__lr0.001__seed0__trunk",
                                                               "default__adamw__lr0.003__seed0__trunk"]
    lines = []
    launch.run_plan(plan(), str(tmp_path), train=None, say=lines.append, pack=3)
    assert sum("resumed from step 3" in line for line in lines) == 2, lines
    assert statuses(tmp_path) == statuses(d)
    assert curves(tmp_path) == curves(d)
    lines = []
    summary = launch.run_plan(plan(), str(tmp_path), train=None, say=lines.append, pack=3)
    assert not summary.done and len(summary.skipped) + len(summary.failed) == len(plan().runs)


@pytest.mark.slow
@pytest.mark.skipif(FLAGGED, reason="this process has the flag: the tests above ran here")
def test_the_packed_tests_pass_under_the_flag(tmp_path):
    """This file's packed-training tests in a fresh process whose XLA_FLAGS has the workaround."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {YNN_FLAG}".strip()}
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider",
                          "-k", "packed_comparison or packed_program or killed_packed"],
                         cwd=os.path.dirname(os.path.dirname(__file__)), env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "3 passed" in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
def test_compare_py_packs_on_a_cpu_with_the_workaround_it_sets_itself(tmp_path):
    """`python scripts/compare.py ... pack=2` started without the flag: it appends it to the user's
    XLA_FLAGS before JAX starts (trainer/pack.py would refuse otherwise), packs the two lrs' trunks and
    branches, each member's console output (a progress bar: not a terminal) in its train.log."""
    from helpers import offline_env

    env = {**offline_env(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    assert not has_ynn_flag(env)
    out = subprocess.run([sys.executable, "scripts/compare.py", "optimizers=[adamw]", "budgets=[4]", "lr.points=2",
                          "warmup=1", "pack=2", f"dir={tmp_path}/c", *RUN, "logging.progress_bar=true"],
                         cwd=os.path.dirname(os.path.dirname(__file__)), env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert sum(line.startswith("  packed: ") for line in out.stdout.splitlines()) == 2, out.stdout
    assert all(s[0] == "done" for s in statuses(tmp_path / "c").values())


def test_the_process_cache_keeps_one_packed_step_per_function_and_n():
    """packed_step: the same TrainStep function and N give the same PackedStep inside sharing()."""
    def fn(state, batch, args, logging):
        return state, {}

    class Step:
        pass

    s = Step()
    s.fn = fn
    with process_cache.sharing():
        a, b, c = packing.packed_step(s, 2), packing.packed_step(s, 2), packing.packed_step(s, 3)
    assert a is b and a is not c


def test_stacked_knobs_and_lanes_round_trip():
    """stack_args makes [N] float32 arrays of each knob; lane(stack(trees), i) is tree i."""
    import jax.numpy as jnp

    args = packing.stack_args([{"lr": 1e-3, "b": {"wd": 0.1}}, {"lr": 2e-3, "b": {"wd": 0.0}}])
    assert args["lr"].shape == (2,) and args["lr"].dtype == jnp.float32
    assert np.array_equal(np.asarray(args["b"]["wd"]), np.float32([0.1, 0.0]))
    trees = [{"w": jnp.full((2, 3), float(i)), "k": jnp.arange(2) + i} for i in range(3)]
    stacked = packing.stack(trees)
    for i in range(3):
        got = packing.lane(stacked, jnp.asarray(i, jnp.int32))
        assert np.array_equal(got["w"], trees[i]["w"]) and np.array_equal(got["k"], trees[i]["k"])
