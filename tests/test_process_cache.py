"""A comparison's start-up once per process (trainer/process_cache.py): the traced step's key
changes with every config field the step is built from and with nothing it takes as an argument;
the view it is built from changes no character of its program; and a small in-process comparison
traces one step program per optimizer and schedule variant, with losses bit for bit those of
runs that share nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from helpers import TINY_OVERRIDES

import train_jax as T
from compare import launch
from compare.plan import base_lrs, compare_config, make_plan
from optimizer import arguments
from trainer import process_cache
from utils.parallel import mesh as meshlib

# Two starting points: the default tiny run, and one whose step reads more (Muon's groups, per-group
# overrides, the aux-state hook, a tail weight average, which makes train.max_steps a constant of the step).
BASES = {
    "default": (),
    "more": ("optimizer=muon", "optimizer.groups.hidden.lr=0.01", "logging.log_callback_data=true",
             "train.weight_average=tail", "train.weight_average_tail=0.3", "logging.activation_norms=true",
             "train.skip_nonfinite=true", "train.max_consecutive_skips=4", "train.gradient_clip_val=0.5"),
}


def leaves(obj, prefix: tuple = ()) -> list[tuple[str, ...]]:
    """Every field path of a config dataclass, into its nested dataclasses (dicts and tuples are leaves)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += leaves(value, prefix + (f.name,))
        else:
            out.append(prefix + (f.name,))
    return out


def perturbed(value):
    """Another value of the field's kind (the key is computed from the config's repr: no validation)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 1.5 + 1  # non-zero stays non-zero: a lifted knob stays lifted
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, tuple):
        return value + ("other",)
    if isinstance(value, dict):
        return {**value, "other": {}}  # a mapping of mappings (group_overrides) stays one
    return 7 if value is None else None


def replaced(obj, path: tuple[str, ...], value):
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    return dataclasses.replace(obj, **{path[0]: replaced(getattr(obj, path[0]), path[1:], value)})


def lifted_paths(run) -> set[tuple[str, ...]]:
    """The config paths of the knobs the step takes as arguments (arguments.lift)."""
    values = arguments.lift(run.optimizer, run.train.gradient_clip_val)
    paths = {("optimizer", "schedule", k) for k in values["schedule"]}
    paths |= {("optimizer", "hparams", k) for k in values["optimizer"]} | {("optimizer", "schedule_steps")}
    return paths | ({("train", "gradient_clip_val")} if "clip" in values else set())


def key(run, mesh=None, shardings=()):
    return process_cache.step_key(process_cache.step_view(run), mesh, shardings)


@pytest.mark.parametrize("base", sorted(BASES))
def test_the_step_key_changes_with_every_field_the_step_is_built_from(tiny_run, base):
    """Every field of the config (found by walking its dataclasses, not listed here) changed in
    turn: a field the step's view keeps changes the key unless it is a step argument, whose value
    must not (that is the sharing); a field outside the view reaches no builder of the step."""
    run = tiny_run(*BASES[base])
    lifted, entering, outside = lifted_paths(run), set(), set()
    for path in leaves(run):
        other = replaced(run, path, perturbed(_get(run, path)))
        if path in lifted:
            assert key(other) == key(run), f"{'.'.join(path)} is a step argument: its value must not key the step"
        elif repr(process_cache.step_view(other)) != repr(process_cache.step_view(run)):
            entering.add(".".join(path))
            assert key(other) != key(run), f"{'.'.join(path)} enters the step but not its key"
        else:
            outside.add(".".join(path))
    assert {"model.dim", "train.compute_dtype", "parallel.fsdp", "optimizer.cautious"} <= entering
    assert {"random_seed", "checkpoint.save_path", "train.val_freq", "logging.log_every"} <= outside
    assert ("train.max_steps" in entering) == (base == "more")  # the tail's first step is a constant of it
    assert lifted and lifted <= set(leaves(run))  # every argument knob was changed above


def _get(obj, path):
    for name in path:
        obj = getattr(obj, name)
    return obj


def test_the_data_key_changes_with_every_tokenizer_and_source_field_and_sharing_is_scoped(tiny_run):
    """Each field of the tokenizer and dataset-source sections (walked, not listed) and cache_dir
    changes the data's key; inside sharing() an equal key returns the first build, outside it
    every call builds, and the outermost block's end empties the tables."""
    run = tiny_run()
    sections = [("tokenizer",) + p for p in leaves(run.tokenizer)] + [
        ("dataset", "source") + p for p in leaves(run.dataset.source)] + [("cache_dir",)]
    assert ("cache_dir",) in sections and any(p[:2] == ("dataset", "source") for p in sections)
    for path in sections:
        assert process_cache.data_key(replaced(run, path, perturbed(_get(run, path)))) != process_cache.data_key(run)
    made = []
    build = lambda: made.append(object()) or made[-1]
    assert process_cache.remember("t", 1, build) is not process_cache.remember("t", 1, build)  # not sharing
    with process_cache.sharing():
        with process_cache.sharing():
            first = process_cache.remember("t", 1, build)
        assert process_cache.remember("t", 1, build) is first  # the inner block's end keeps the tables
        assert process_cache.remember("t", 2, build) is not first
        assert process_cache.remember("t", 3, build, keep=lambda _: False) is not process_cache.remember("t", 3, build)
    with process_cache.sharing():
        assert process_cache.remember("t", 1, build) is not first
    assert len(made) == 7  # 2 unshared, 1 + 0 (the hit) + 1 + 2 (not kept) shared, 1 after the tables emptied


def test_the_step_key_changes_with_the_mesh_and_the_shardings(tiny_run):
    run = tiny_run()
    devices = np.array(jax.devices()[:1])
    a, b = jax.sharding.Mesh(devices, ("data",)), jax.sharding.Mesh(devices, ("fsdp",))
    replicated, split = (jax.sharding.NamedSharding(a, jax.sharding.PartitionSpec(*s)) for s in ((), ("data",)))
    assert key(run, a, (replicated,)) != key(run, b, (replicated,))
    assert key(run, a, (replicated,)) != key(run, a, (split,))
    assert key(run, a, (replicated,)) == key(run, a, (replicated,))



def test_a_run_outside_a_comparison_computes_no_step_key(tiny_run, monkeypatch):
    """The key (the masked view's repr, the shardings flattened) is for the shared table only: a single
    run builds its step without it; inside sharing() the table needs it, once per run."""
    run = tiny_run()
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    keys = []
    monkeypatch.setattr(process_cache, "step_key", lambda *a, k=process_cache.step_key: keys.append(k(*a)) or keys[-1])
    T.init_training(run, mesh)
    assert keys == []
    with process_cache.sharing():
        T.init_training(run, mesh)
    assert len(keys) == 1

def step_text(run) -> str:
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch = jax.ShapeDtypeStruct((1, run.dataset.batch_size, run.context_length + 1), np.int32)
    from trainer import precompile

    return step.logging.trace(*precompile.abstract((state, batch, step.args))).lower().as_text(debug_info=False)


@pytest.mark.slow  # two tiny steps traced and lowered: 1.6-10 s on the shared 2-core VM, by its load
@pytest.mark.parametrize("base", sorted(BASES))
def test_the_view_changes_no_character_of_the_step_program(tiny_run, base, monkeypatch):
    """The step built from step_view(run) (as every run now builds it) against the step built from
    the whole config (the view replaced by the identity): one program, so the view drops nothing
    the step's builders read."""
    run = tiny_run(*BASES[base], "train.max_steps=37", "random_seed=3", "train.val_freq=7")
    from_view = step_text(run)
    monkeypatch.setattr(process_cache, "step_view", lambda r: r)
    assert step_text(run) == from_view


TIMED = ("time/", "train/tokens_per_sec", "train/mfu")  # the wall clock's metrics (trainer/hooks.py Throughput)


def records(compare_dir: str) -> dict[str, list[dict]]:
    """Every run's metrics.jsonl, less what the wall clock measures."""
    out = {}
    for run in sorted(os.listdir(os.path.join(compare_dir, "runs"))):
        with open(os.path.join(compare_dir, "runs", run, "metrics.jsonl")) as f:
            out[run] = [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMED)} for line in f]
    return out


@pytest.mark.slow
def test_a_comparison_traces_one_step_per_variant_and_trains_as_unshared_runs(tmp_path, monkeypatch):
    """adamw and sgdm, 2 lrs, budgets 4 and 6 (per lr a trunk and 2 branches: 12 runs): the shared
    comparison builds one step per optimizer (a trunk's constant lr runs as its branches' trapezoid),
    traces each once per variant it calls (plain, logging) and never again, and the state's shapes
    and memory estimate once per optimizer; every logged value of every run equals, bit for bit, the
    same plan trained with nothing shared."""
    built = []
    build = T.build_train_step
    monkeypatch.setattr(T, "build_train_step", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    run = tuple(o for o in TINY_OVERRIDES if not o.startswith(("train.max_steps", "model.vocab_size"))) + (
        "train.max_val_steps=2",)
    k = compare_config({"optimizers": ["adamw", "sgdm"], "budgets": [4, 6], "lr": {"points": 2}, "seeds": 1,
                        "warmup": 1})
    plan = make_plan(k, run, base_lrs(k.optimizers, run))
    shared = str(tmp_path / "shared")
    before = process_cache.stats()
    summary = launch.run_plan(plan, shared, train=T.train, say=lambda line: None)
    assert len(summary.done) == len(plan.runs) == 12
    assert len(built) == 2  # adamw, sgdm: trunks and branches alike
    counted = {k: v - before.get(k, 0) for k, v in process_cache.stats().items()}
    for table in ("abstract_state", "state_bytes"):
        assert (counted[f"{table}/miss"], counted[f"{table}/hit"]) == (2, 10), counted
    assert all(step.compiled() == len(step.called) for step in built)  # one trace per variant, none later

    built.clear()
    alone = str(tmp_path / "alone")
    launch.open_dir(plan, alone)
    for planned in plan.runs:  # run_one outside run_plan: no sharing() block
        assert launch.run_one(planned, alone, T.train, say=lambda line: None)[0] == "done"
    assert len(built) == len(plan.runs)
    a, b = records(shared), records(alone)
    differ = [(run, r1.get("step"), k, r1.get(k), r2.get(k)) for run in b for r1, r2 in zip(a[run], b[run])
              for k in set(r1) | set(r2) if r1.get(k) != r2.get(k)]
    assert a.keys() == b.keys() and not differ, differ[:5]
