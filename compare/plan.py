"""A comparison's plan: which runs to train, from its knobs (conf/compare.yaml) alone.

Many budgets from one run (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations"): per (optimizer, lr, seed) one *trunk* trains with warmup then
a constant lr up to b_max = round(0.8·S_max) steps, saving at b_k = round(0.8·S_k) for each budget
S_k; per budget a *branch* loads the trunk's `iter_{b_k}` and decays the lr over its last
S_k - b_k steps to 0 (`trapezoid` with `decay_shape`). Before its decay, `trapezoid` equals
`constant` with the same warmup bit for bit (optimizer/schedules.py), and a checkpoint holds the
weights, optimizer state, step, rng key and data position, so a branch trains exactly as a run
from scratch with the whole warmup-stable-decay schedule would (tests/test_compare.py checks it).
The cost is b_max + Σ (S_k - b_k) steps instead of Σ S_k.

Per workload (`workloads.<name>=[overrides]`, default: one named `default` with none), per
entry (an optimizer, or a variant `variants.<label>="<optimizer> <run overrides>"`: that optimizer
with fixed overrides, e.g. weight averaging, compared as an entry of its own under its label;
`entry_of` is the one place a label becomes its optimizer and overrides), every lr of its grid
is crossed with every combination of the `sweep.<knob>` values
(optimizer knobs, e.g. `sweep.weight_decay=[0,0.1]`) and every seed.

`make_plan` is a pure function of the knobs, the run overrides and each optimizer's yaml lr per
workload; `base_lrs` reads those. Every bad knob is one ConfigError line naming it, before anything
trains. Paths are not part of the plan: compare/launch.py adds the checkpoint paths of each
run. `extension_runs` adds the runs of one more lr beyond a grid's edge (`lr.extend=true`).

Tuning and evaluation seeds (`seeds.tune=K seeds.eval=M`): the plan's runs are the tuning runs
(random_seed 0..K-1, phase "tune"); once they are done, `evaluation_runs` adds, per workload,
optimizer and budget, the runs of the setting (lr and sweep values) chosen on them, on M fresh
seeds (random_seed K..K+M-1, phase "eval", ids `...__eval<seed>__...`), so the report's tests
compare settings on seeds they were not chosen on. Evaluation seed k of every optimizer has the
same random_seed and data_seed (`seeds.vary_data=true`: data_seed + random_seed), so the seeds pair.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from compare import metric as metric_lib
from compare.budgets import UNITS, to_steps, workload_scale
from compare.tune import TUNE, Space, coordinate_path, start_value
from optimizer import OPTIMIZERS
from optimizer.renames import new_name
from optimizer.schedules import DECAY_SHAPES
from utils.errors import ConfigError

WORKLOAD = "default"  # the workload's name when `workloads` is empty

# Run knobs the comparison sets itself; a run override that touches one is refused (the knob to
# use instead is named). Other checkpoint.* knobs (async_save, compress, max_to_keep) pass through.
CONTROLLED = {
    "optimizer": "optimizers=[...]",
    "optimizer/lr_config": "cooldown.shape (the schedules are the comparison's)",
    "optimizer.lr_config": "lr.points, lr.factor, lr.grid.<optimizer>, warmup and cooldown.* (in a workload, "
                           "lr.<optimizer>=X centres that optimizer's grid there)",
    "optimizer.name": "optimizers=[...]",
    "random_seed": "seeds.tune=K seeds.eval=M (random_seed 0..K+M-1)",
    "data_seed": "the comparison's data_seed (and seeds.vary_data=true)",
    "train.max_steps": "budgets=[...]",
    "checkpoint.save": "nothing: every run saves under its run directory",
    "checkpoint.save_path": "nothing: every run saves under its run directory",
    "checkpoint.save_steps": "nothing: trunks save at their branch points, branches at their end",
    "checkpoint.num_steps": "nothing: a comparison trains every run to its end",
    "checkpoint.resume": "nothing: a rerun of the same command resumes",
    "checkpoint.load": "nothing: branches load their trunk",
    "checkpoint.load_path": "nothing: branches load their trunk",
    "checkpoint.load_file": "nothing: branches load their trunk",
    "checkpoint.overwrite_config": "nothing: branches set it",
    "checkpoint.overwrite_optimizer": "nothing: a branch continues its trunk's optimizer state",
    "checkpoint.overwrite_data": "nothing: a branch continues its trunk's data stream",
    "logging.metrics_file": "nothing: the report reads metrics.jsonl",
    "train.val_at": "val_every=N (every run also evaluates at its branch points and budget)",
}
# Knobs of how a comparison runs, not of what it compares: a rerun may change them (not in compare.json).
EXECUTION = ("dir", "save_every", "parallel", "keep_checkpoints", "pack")
# Run knobs the comparison sets unless the run overrides set them: no end-of-run sample, no
# samples at evaluations (the report reads neither).
QUIET = ("train.sample_tokens=0", "logging.sample_prompts=[]")


@dataclass(frozen=True)
class CompareConfig:
    """conf/compare.yaml, checked."""

    optimizers: tuple[str, ...]
    budgets: tuple[float, ...]  # in budget_unit (steps: ints)
    lr_points: int = 4
    lr_factor: float = 2.0
    lr_grid: tuple[tuple[str, tuple[float, ...]], ...] = ()  # (optimizer, its lrs), explicit grids
    seeds: int = 1  # seeds.tune: random_seed 0..seeds-1, the seeds every setting is tuned on
    seeds_eval: int = 0  # seeds.eval: fresh seeds the chosen settings run on; 0: the tests use the tuning seeds
    seeds_vary_data: bool = False  # seeds.vary_data: each seed also sets data_seed = data_seed + random_seed
    data_seed: int = 0
    warmup: int = 0
    cooldown_fraction: float = 0.2
    cooldown_shape: str = "1-sqrt"
    lr_extend: bool = False  # add lrs beyond a grid's edge while the best lr sits there
    lr_extend_max: int = 2  # at most this many added lrs per optimizer and workload
    sweep: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (optimizer knob, its values), crossed with the lrs
    workloads: tuple[tuple[str, tuple[str, ...]], ...] = ((WORKLOAD, ()),)  # (name, its run overrides)
    workload_lr: tuple[tuple[str, str, float], ...] = ()  # (workload, optimizer, lr): its grid's centre there
    workload_lr_grid: tuple[tuple[str, str, tuple[float, ...]], ...] = ()  # (workload, optimizer, lrs): its grid there
    val_every: int | None = None  # train.val_freq of every run; None: the runs' own (conf/train.yaml's)
    baseline: str | None = None  # the optimizer the report is relative to; None: adamw if compared, else the first
    tune: str = "grid"  # grid: every lr x sweep combination; coordinate: compare/tune.py's coordinate descent
    coordinate_threshold: float = 1e-3  # tune=coordinate: a move must lower the mean final loss by more than this
    coordinate_max_trials: int | None = None  # tune=coordinate: at most this many settings per optimizer (None: no cap)
    target_loss: float | None = None  # target.loss: the target track's val/loss (modded-nanogpt's protocol)
    target_runs: int = 0  # target.runs: fresh seeds the chosen setting at the largest budget runs on for it
    budget_unit: str = "steps"  # steps | tokens | chinchilla (multiples of 20 tokens per parameter)
    workload_budgets: tuple[tuple[str, tuple[int, ...]], ...] = ()  # tokens|chinchilla: each workload's steps
    metric: str = metric_lib.LOSS  # what the best settings and the ranking minimise: val/loss or a task's accuracy
    variants: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (label, its optimizer, its fixed run overrides);
    # each label is also one of `optimizers` (the compared entries)

    def optimizer_of(self, entry: str) -> str:
        """The optimizer an entry (an optimizer's name or a variant's label) trains with."""
        return entry_of(self.variants, entry)[0]

    def overrides_of(self, entry: str) -> tuple[str, ...]:
        """A variant's fixed run overrides; () for a plain optimizer."""
        return entry_of(self.variants, entry)[1]

    def sweep_of(self, optimizer: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """The sweep an optimizer's lrs are crossed with: the shared `sweep.<knob>` values and its own
        `sweep.<optimizer>.<knob>` ones (held in `sweep` under the qualified name), sorted by knob."""
        owners = {*OPTIMIZERS, *(label for label, _, _ in self.variants)}
        shared = [(k, v) for k, v in self.sweep if k.split(".")[0] not in owners]
        own = [(k.split(".", 1)[1], v) for k, v in self.sweep if k.split(".")[0] == optimizer]
        return tuple(sorted(shared + own))

    def trials(self, optimizer: str) -> int:
        """Settings an optimizer is tuned over: its lrs times its sweep's combinations (with
        tune=coordinate, the most it may try: the search usually stops well before)."""
        every = self.lr_points * math.prod(len(v) for _, v in self.sweep_of(optimizer))
        return every if self.coordinate_max_trials is None else min(every, self.coordinate_max_trials)

    def budgets_of(self, workload: str) -> tuple[int, ...]:
        """A workload's budgets in optimizer steps (budget_unit=tokens|chinchilla: with_steps's conversion)."""
        return dict(self.workload_budgets).get(workload) or tuple(int(b) for b in self.budgets)

    def branch_step(self, budget: int) -> int:
        """round((1 - cooldown.fraction)·S): the trunk's step a budget's branch starts from."""
        return int(math.floor((1.0 - self.cooldown_fraction) * budget + 0.5))


@dataclass(frozen=True)
class PlannedRun:
    """One run of the plan: run.json's fields less its status (launch.py adds those)."""

    id: str
    workload: str
    optimizer: str
    lr: float
    seed: int
    kind: str  # "trunk" | "branch"
    budget: int | None  # null for a trunk
    trunk: str | None  # a branch's trunk id
    branch_step: int | None  # the trunk checkpoint a branch starts from
    overrides: tuple[str, ...]  # Hydra overrides, without the checkpoint paths (launch.py adds them)
    sweep: tuple[tuple[str, Any], ...] = ()  # (optimizer knob, value) of this run, one per sweep knob
    phase: str = "tune"  # "tune": a run of the grid; "eval": a chosen setting on an evaluation seed; "target": on
    # a target-track seed (target.runs)


@dataclass(frozen=True)
class Plan:
    knobs: CompareConfig
    run_overrides: tuple[str, ...]  # the user's overrides, passed to every run
    runs: tuple[PlannedRun, ...]  # in the order they run: each trunk, then its branches
    spaces: tuple[tuple[tuple[str, str], Space], ...] = ()  # tune=coordinate: ((workload, optimizer), its space)

    def to_json(self) -> dict:
        """compare.json's content (without paths: the same command plans the same comparison)."""
        knobs = asdict(self.knobs)
        knobs["lr_grid"] = {opt: list(lrs) for opt, lrs in self.knobs.lr_grid}
        knobs["sweep"] = {knob: list(values) for knob, values in self.knobs.sweep}
        knobs["workloads"] = {name: list(overrides) for name, overrides in self.knobs.workloads}
        for key in ("optimizers", "budgets"):
            knobs[key] = list(knobs[key])
        knobs["workload_budgets"] = {name: list(steps) for name, steps in self.knobs.workload_budgets}
        knobs["variants"] = {label: [opt, *overrides] for label, opt, overrides in self.knobs.variants}
        runs = [run_json(r) for r in self.runs]
        out = {"knobs": knobs, "run_overrides": list(self.run_overrides), "runs": runs}
        if self.spaces:  # where each coordinate search starts and what it varies (the report replays it)
            out["search"] = [{"workload": w, "optimizer": o, **space.to_json()} for (w, o), space in self.spaces]
        return out


def run_json(run: PlannedRun) -> dict:
    """A run as compare.json and run.json hold it (the sweep as a mapping)."""
    return {**asdict(run), "overrides": list(run.overrides), "sweep": dict(run.sweep)}


# ----------------------------------------------------------------------------- knobs


def _int(value: Any, knob: str, minimum: int, fix: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{knob}={value!r} must be an integer >= {minimum}: {fix}")
    return value


def _float(value: Any, knob: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{knob}={value!r} must be a number")
    return float(value)


def _list(value: Any, knob: str, example: str) -> list:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{knob}={value!r} must be a non-empty list, e.g. {knob}={example}")
    return list(value)


def _optimizer(name: Any, knob: str) -> str:
    if name not in OPTIMIZERS:
        raise ConfigError(f"{knob}: unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return name


def compare_config(node: dict) -> CompareConfig:
    """conf/compare.yaml's composed knobs -> CompareConfig, or one ConfigError line naming the knob."""
    node = dict(node)
    known = {"optimizers", "budgets", "lr", "seeds", "data_seed", "warmup", "cooldown", "sweep", "workloads",
             "val_every", "baseline", "tune", "coordinate", "target", "budget_unit", "metric", "variants", *EXECUTION}
    unknown = sorted(set(node) - known)
    if unknown:
        raise ConfigError(f"unknown comparison knob {unknown[0]!r}: the knobs are {', '.join(sorted(known))}")
    variants = _variants(node.get("variants") or {})
    labels = [label for label, _, _ in variants]
    optimizers = [o if o in labels else _optimizer(o, "optimizers")
                  for o in _list(node.get("optimizers"), "optimizers", "[adamw,muon]")]
    if len(set(optimizers)) != len(optimizers):
        raise ConfigError(f"optimizers={optimizers} lists an optimizer twice: name each once")
    optimizers += [label for label in labels if label not in optimizers]  # every variant is an entry of its own
    unit = node.get("budget_unit", "steps")
    if unit not in UNITS:
        raise ConfigError(f"budget_unit={unit!r} must be one of {', '.join(UNITS)}: what the numbers of budgets count")
    given = _list(node.get("budgets"), "budgets", "[200,400,800]")
    if unit == "steps":
        budgets = [_int(b, "budgets", 1, "budgets are train steps (budget_unit=steps)") for b in given]
    else:
        budgets = [_float(b, "budgets") for b in given]
        if any(not (b > 0 and math.isfinite(b)) for b in budgets):
            raise ConfigError(f"budgets={budgets} must be positive {unit} (budget_unit={unit})")
    if any(b <= a for a, b in zip(budgets, budgets[1:])):
        raise ConfigError(f"budgets={budgets} must be strictly increasing (no repeats), e.g. {sorted(set(budgets))}")
    tune, evaluate, vary_data = _seeds(node.get("seeds", 1))
    lr = dict(node.get("lr") or {})
    _known(lr, {"points", "factor", "grid", "extend", "extend_max"}, "lr",
           "lr knobs are lr.points, lr.factor, lr.grid.<optimizer>, lr.extend, lr.extend_max")
    extend = _bool(lr.get("extend", False), "lr.extend")
    points = _int(lr.get("points", 4), "lr.points", 1, "the number of lrs tried per optimizer")
    factor = _float(lr.get("factor", 2.0), "lr.factor")
    if factor <= 1:
        raise ConfigError(f"lr.factor={factor} must be > 1: the ratio between neighbouring lrs of the grid")
    grid = []
    for opt, lrs in (lr.get("grid") or {}).items():
        knob = f"lr.grid.{opt}"
        if opt not in optimizers:
            raise ConfigError(f"{knob}: {opt!r} is not in optimizers={optimizers}; add it there or drop the grid")
        values = [_float(v, knob) for v in _list(lrs, knob, "[1e-3,3e-3]")]
        if any(v <= 0 for v in values) or len({f"{v:g}" for v in values}) != len(values):
            raise ConfigError(f"{knob}={values} must be distinct positive lrs")
        if len(values) != points:
            raise ConfigError(f"{knob} has {len(values)} lrs but lr.points={points}: every optimizer gets the same "
                              f"number of trials; set lr.points={len(values)} or give {points} lrs")
        grid.append((opt, tuple(values)))
    cooldown = dict(node.get("cooldown") or {})
    unknown = sorted(set(cooldown) - {"fraction", "shape"})
    if unknown:
        raise ConfigError(f"unknown comparison knob 'cooldown.{unknown[0]}': the cooldown knobs are "
                          "cooldown.fraction, cooldown.shape")
    fraction = _float(cooldown.get("fraction", 0.2), "cooldown.fraction")
    if not 0 < fraction < 1:
        raise ConfigError(f"cooldown.fraction={fraction} must be in (0, 1): the share of each budget spent decaying")
    shape = cooldown.get("shape", "1-sqrt")
    if shape not in DECAY_SHAPES:
        raise ConfigError(f"cooldown.shape={shape!r} must be one of {', '.join(DECAY_SHAPES)}")
    workloads, centres = _workloads(node.get("workloads") or {}, optimizers)
    explicit = {opt for opt, _ in grid}
    both = next(((w, o) for w, o, _ in centres if o in explicit), None)
    if both:
        raise ConfigError(f"workloads.{both[0]} sets lr.{both[1]} or lr.grid.{both[1]}, and the comparison's "
                          f"lr.grid.{both[1]} gives its lrs everywhere: give one")
    for w, o, lrs in centres:
        if isinstance(lrs, tuple) and len(lrs) != points:
            raise ConfigError(f"workloads.{w}: lr.grid.{o} has {len(lrs)} lrs but lr.points={points}: every optimizer "
                              f"gets the same number of trials; give {points} lrs")
    twice = next(((w, o) for i, (w, o, _) in enumerate(centres) if any((w, o) == c[:2] for c in centres[:i])), None)
    if twice:
        raise ConfigError(f"workloads.{twice[0]} sets {twice[1]}'s lrs twice (lr.{twice[1]} and lr.grid.{twice[1]}, or "
                          "one of them repeated): give one")
    strategy = node.get("tune", "grid")
    if strategy not in TUNE:
        raise ConfigError(f"tune={strategy!r} must be one of {', '.join(TUNE)}: grid tries every lr x sweep setting, "
                          "coordinate varies one knob at a time around the best so far (docs/compare.md)")
    if strategy == "coordinate" and extend:
        raise ConfigError("lr.extend=true and tune=coordinate: the coordinate search keeps to the lr grid; give a "
                          "wider grid (lr.points, lr.factor or lr.grid.<optimizer>) and set lr.extend=false")
    coordinate = dict(node.get("coordinate") or {})
    _known(coordinate, {"threshold", "max_trials"}, "coordinate",
           "coordinate knobs are coordinate.threshold, coordinate.max_trials")
    threshold = _float(coordinate.get("threshold", 1e-3), "coordinate.threshold")
    if threshold < 0:
        raise ConfigError(f"coordinate.threshold={threshold} must be >= 0: the loss drop a move must exceed")
    max_trials = coordinate.get("max_trials")
    if max_trials is not None:
        max_trials = _int(max_trials, "coordinate.max_trials", 1, "the most settings tried per optimizer, or null")
    target = dict(node.get("target") or {})
    _known(target, {"loss", "runs"}, "target", "target knobs are target.loss, target.runs")
    target_loss = None if target.get("loss") is None else _float(target["loss"], "target.loss")
    target_runs = _int(target.get("runs", 0), "target.runs", 0, "fresh seeds the target track runs per optimizer")
    if (target_loss is None) != (target_runs == 0):
        raise ConfigError(f"target.loss={target_loss} and target.runs={target_runs}: the target track needs both, a "
                          "val/loss to reach and the runs per optimizer (e.g. target.loss=3.28 target.runs=8)")
    if target_runs == 1:
        raise ConfigError("target.runs=1: the target track's tests need at least 2 runs per optimizer")
    if target_loss is not None and not (target_loss > 0 and math.isfinite(target_loss)):
        raise ConfigError(f"target.loss={target_loss} must be a positive val/loss")
    metric = metric_lib.parse(node.get("metric"))
    if target_loss is not None and not metric.is_loss:
        raise ConfigError(f"target.loss={target_loss} with metric={metric.name}: the target track reads val/loss "
                          "curves; drop target.loss and target.runs, or set metric=val/loss")
    knobs = CompareConfig(
        metric=metric.name,
        budget_unit=unit,
        target_loss=target_loss, target_runs=target_runs,
        tune=strategy, coordinate_threshold=threshold, coordinate_max_trials=max_trials,
        optimizers=tuple(optimizers), budgets=tuple(budgets), lr_points=points, lr_factor=factor,
        lr_grid=tuple(sorted(grid)),
        seeds=tune, seeds_eval=evaluate, seeds_vary_data=vary_data,
        data_seed=_int(node.get("data_seed", 0), "data_seed", 0, "one data order for the whole comparison"),
        warmup=_int(node.get("warmup", 0), "warmup", 0, "linear warmup steps of every run"),
        cooldown_fraction=fraction, cooldown_shape=shape, lr_extend=extend,
        lr_extend_max=_int(lr.get("extend_max", 2), "lr.extend_max", 1, "lrs lr.extend may add per optimizer"),
        sweep=_sweep(node.get("sweep") or {}, optimizers, variants), workloads=workloads, variants=variants,
        workload_lr=tuple(c for c in centres if isinstance(c[2], float)),
        workload_lr_grid=tuple(c for c in centres if isinstance(c[2], tuple)),
        baseline=_baseline(node.get("baseline"), optimizers),
        val_every=None if node.get("val_every") is None else _int(
            node["val_every"], "val_every", 1, "evaluate every N steps besides the branch points and budgets"))
    if unit == "steps":
        check_steps(knobs, knobs.budgets_of(WORKLOAD))
    for label, _, overrides in variants:
        keys = {override_key(o) for o in overrides}
        if knobs.val_every is not None and "train.val_freq" in keys:
            raise ConfigError(f"variants.{label} sets train.val_freq and val_every={knobs.val_every} sets how often "
                              "every run evaluates: give only val_every")
        swept = next((k for k, _ in knobs.sweep_of(label) if f"optimizer.{k}" in keys), None)
        if swept:
            raise ConfigError(f"variants.{label} fixes optimizer.{swept}, which sweep.{swept} (or "
                              f"sweep.{label}.{swept}) sweeps: drop one")
    return knobs


def entry_of(variants, entry: str) -> tuple[str, tuple[str, ...]]:
    """A compared entry's (optimizer, fixed run overrides): a variant's label -> its own, an optimizer's
    name -> (it, ()). The one place a label is resolved; `variants`: CompareConfig.variants, or
    compare.json's `variants` mapping (label -> [optimizer, *overrides]; absent before variants existed)."""
    if isinstance(variants, dict):
        value = variants.get(entry)
        return (str(value[0]), tuple(value[1:])) if value else (entry, ())
    return next(((opt, tuple(overrides)) for label, opt, overrides in variants if label == entry), (entry, ()))


def _variants(node: dict) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """variants.<label>="<optimizer> <run override> ..." (one string, or a list) -> ((label, optimizer,
    overrides), ...), sorted by label; one ConfigError line for a label that is an optimizer's name or
    not a run-directory name, an unknown optimizer, or an override the comparison sets itself."""
    out = []
    for label, value in sorted(dict(node).items()):
        knob = f"variants.{label}"
        if label in OPTIMIZERS:
            raise ConfigError(f"{knob}: {label!r} is an optimizer's name; give the variant a label of its own, e.g. "
                              f"variants.{label}_ema")
        if not WORKLOAD_NAME.fullmatch(str(label)):
            raise ConfigError(f"{knob}: a variant's label is letters, digits, '.', '-' and single '_' (it is part of "
                              "every run's id), e.g. variants.adamw_ema")
        words = shlex.split(value) if isinstance(value, str) else list(value or [])
        if not words or any(not isinstance(w, str) for w in words) or any("=" not in w for w in words[1:]):
            raise ConfigError(f"{knob}={value!r} must be an optimizer then run overrides, e.g. "
                              f"'{knob}=adamw train.weight_average=ema train.weight_average_half_life=50'")
        opt, overrides = _optimizer(words[0], knob), tuple(words[1:])
        check_run_overrides(overrides, knob)
        keys = [override_key(o) for o in overrides]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"{knob}: sets {next(k for k in keys if keys.count(k) > 1)} twice: give it once")
        out.append((str(label), opt, overrides))
    return tuple(out)


def check_variants(knobs: CompareConfig, run_overrides: tuple[str, ...]) -> None:
    """Refuse a variant override that the run overrides or a workload also set (which one wins would
    depend on their order), and tail averaging anywhere (see below); one ConfigError line."""
    for name, extra in knobs.workloads:
        shared = {override_key(o): "the run overrides" for o in run_overrides}
        shared.update({override_key(o): f"workloads.{name}" for o in extra})
        for label, _, overrides in knobs.variants:
            clash = next((override_key(o) for o in overrides if override_key(o) in shared), None)
            if clash:
                raise ConfigError(f"variants.{label} sets {clash}, which {shared[clash]} also set: give it in one "
                                  "place")
        for entry in knobs.optimizers:
            for o in (*run_overrides, *extra, *knobs.overrides_of(entry)):
                if override_key(o) == "train.weight_average" and o.split("=", 1)[1].strip() == "tail":
                    # its window starts at round((1-f)·train.max_steps), which differs between a trunk and its
                    # branches: a branch would not equal its run from scratch (ema reads no run length)
                    raise ConfigError(f"{o} (for {entry}): tail averaging's window depends on train.max_steps, "
                                      "which differs between a trunk and its branches; compare "
                                      "train.weight_average=ema instead")


def check_steps(knobs: CompareConfig, steps: tuple[int, ...], where: str = "") -> None:
    """Every budget (in steps) has a cooldown and branches after the warmup; one ConfigError line otherwise."""
    fraction = knobs.cooldown_fraction
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ConfigError(f"budgets{where} round to {list(steps)} steps, not strictly increasing: space them further "
                          "apart")
    for budget in steps:
        b = knobs.branch_step(budget)
        if budget - b < 1:
            raise ConfigError(f"budgets{where}: {budget} leaves no cooldown step at cooldown.fraction={fraction}; "
                              f"use budgets of at least {math.ceil(1 / fraction)} steps")
        if b < max(knobs.warmup, 1):
            need = math.floor(max(knobs.warmup, 1) / (1 - fraction)) + 1
            raise ConfigError(f"budgets{where}: {budget} branches at step {b}, before warmup={knobs.warmup} ends; "
                              f"every budget must exceed warmup/(1-cooldown.fraction): use budgets >= {need} or a "
                              "shorter warmup")


def with_steps(knobs: CompareConfig, run_overrides: tuple[str, ...] = ()) -> tuple[CompareConfig, list[str]]:
    """budget_unit=tokens|chinchilla: the knobs with each workload's budgets in steps (workload_budgets),
    and a line per workload saying how they were counted; budget_unit=steps: the knobs as they are."""
    if knobs.budget_unit == "steps":
        return knobs, []
    out, lines = [], []
    for name, extra in knobs.workloads:
        tokens, params = workload_scale((*run_overrides, *extra), knobs.budget_unit == "chinchilla")
        steps = to_steps(knobs.budgets, knobs.budget_unit, tokens, params)
        where = f" ({knobs.budget_unit}) of workload {name}" if len(knobs.workloads) > 1 else f" ({knobs.budget_unit})"
        check_steps(knobs, steps, where)
        out.append((name, steps))
        size = f"{params:,} params, " if params is not None else ""
        given = ", ".join(f"{b:g}" for b in knobs.budgets)
        unit = "x Chinchilla" if knobs.budget_unit == "chinchilla" else "tokens"
        lines.append(f"workload {name}: {size}{tokens:,} tokens/step: budgets {given} {unit} = "
                     f"{', '.join(map(str, steps))} steps")
    return dataclasses.replace(knobs, workload_budgets=tuple(out)), lines


def _baseline(value: Any, optimizers: list[str]) -> str | None:
    """baseline=<optimizer>: one of the compared optimizers (null: adamw if compared, else the first by name)."""
    if value is None:
        return None
    if value not in optimizers:
        raise ConfigError(f"baseline={value!r} must be one of the compared optimizers ({', '.join(optimizers)}): "
                          "every speedup, test and cost is relative to it")
    return str(value)


def _known(node: dict, keys: set[str], what: str, names: str) -> None:
    """Refuse a key of `node` (a knob group) that is not one of `keys`, naming the group's knobs."""
    unknown = sorted(set(node) - keys)
    if unknown:
        raise ConfigError(f"unknown comparison knob '{what}.{unknown[0]}': the {names}")


def _bool(value: Any, knob: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{knob}={value!r} must be true or false")
    return value


def _seeds(node: Any) -> tuple[int, int, bool]:
    """seeds=K (an alias of seeds.tune=K) or seeds.{tune,eval,vary_data} -> (tune, eval, vary_data)."""
    if not isinstance(node, dict):
        node = {"tune": node}
    _known(node, {"tune", "eval", "vary_data"}, "seeds",
           "seed knobs are seeds.tune, seeds.eval, seeds.vary_data (seeds=K is seeds.tune=K)")
    vary_data = _bool(node.get("vary_data", False), "seeds.vary_data")
    tune = _int(node.get("tune", 1), "seeds.tune", 1, "the seeds (random_seed 0..K-1) every lr and setting is tuned on")
    evaluate = _int(node.get("eval", 0), "seeds.eval", 0, "fresh seeds the chosen settings are tested on (0: none)")
    return tune, evaluate, vary_data


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """{"groups": {"hidden": {"b2": [..]}}} -> {"groups.hidden.b2": [..]}."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def optimizer_knobs(name: str) -> list[str]:
    """The knobs `optimizer.<knob>` of an optimizer, as its conf/optimizer/<name>.yaml lists them (its
    class's fields, `groups`, `cautious`), less those the comparison sets (name, lr_config)."""
    from omegaconf import OmegaConf

    from utils.config import CONF_DIR

    node = OmegaConf.load(os.path.join(CONF_DIR, "optimizer", f"{name}.yaml"))
    return sorted(k for k in node if k not in ("defaults", "name", "lr_config"))


def current_name(optimizer: str, knob: str) -> str:
    """A swept knob (`b1`, `groups.hidden.beta2`) under its current name: a comparison planned with
    an old name (optimizer/renames.py) keeps it in its runs' overrides and ids, which compose renames."""
    parts = knob.split(".")
    group = parts[1] if len(parts) == 3 and parts[0] == "groups" else None
    new = new_name(optimizer, parts[-1], group)
    return ".".join([*parts[:-1], new]) if new else knob


def _sweep(node: dict, optimizers: list[str], variants=()) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """sweep.<optimizer knob>=[values] (every optimizer) and sweep.<optimizer>.<knob>=[values] (that
    one's own search space) -> ((knob, values), ...), sorted by knob, an optimizer's own knobs under
    their qualified name. A knob an optimizer lacks is refused, naming the optimizer and its knobs."""
    out = []
    entries = {*OPTIMIZERS, *(label for label, _, _ in variants)}  # what sweep.<entry>.<knob> may name
    for knob, values in sorted(_flatten(dict(node)).items()):
        name = f"sweep.{knob}"
        owner, _, own = knob.partition(".")
        owners, plain = ([owner], own) if owner in entries else (optimizers, knob)
        if owner in entries and owner not in optimizers:
            raise ConfigError(f"{name}: {owner} is not in optimizers={optimizers}; add it there or drop its sweep")
        if plain == "name" or plain.split(".")[0] == "lr_config" or plain.split(".")[-1] == "lr":
            raise ConfigError(f"{name}: the comparison sets the optimizer and its lr itself; sweep lrs with "
                              "lr.points/lr.factor/lr.grid.<optimizer>, other optimizer knobs with sweep.<knob> "
                              "or sweep.<optimizer>.<knob>")
        for entry in owners:
            opt = entry_of(variants, entry)[0]
            fields = optimizer_knobs(opt)
            # an old knob name (optimizer/renames.py) is accepted: the runs' composition renames it
            if plain.split(".")[0] not in fields and new_name(opt, plain) not in fields:
                raise ConfigError(f"{name}: {opt} has no knob {plain.split('.')[0]!r}; its knobs are "
                                  f"{', '.join(fields)}" + ("" if owner in entries else
                                                            " (sweep.<optimizer>.<knob> sweeps one optimizer's own)"))
        values = _list(values, name, "[0.0,0.1]")
        if any(isinstance(v, (dict, list)) for v in values) or len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"{name}={values} must be distinct plain values (numbers, true/false or names)")
        out.append((knob, tuple(values)))
    shared = {k for k, _ in out if k.split(".")[0] not in entries}
    for k, _ in out:
        if k.split(".")[0] in entries and k.split(".", 1)[1] in shared:
            raise ConfigError(f"sweep.{k} and sweep.{k.split('.', 1)[1]} both sweep it for "
                              f"{k.split('.')[0]}: give one")
    return tuple(out)


WORKLOAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(_[A-Za-z0-9.-]+)*")


def _workloads(node: dict, optimizers: list[str]) -> tuple[tuple[tuple[str, tuple[str, ...]], ...],
                                                            tuple[tuple[str, str, float], ...]]:
    """workloads.<name>=[overrides] (or one string of space-separated overrides) -> ((name, overrides), ...),
    and the lr centres its `lr.<optimizer>=X` items give ((name, optimizer, X), ...)."""
    out, centres = [], []
    for name, overrides in sorted(dict(node).items()):
        knob = f"workloads.{name}"
        if not WORKLOAD_NAME.fullmatch(str(name)):
            raise ConfigError(f"{knob}: a workload's name is letters, digits, '.', '-' and single '_' (it is part of "
                              "every run's directory name), e.g. workloads.small")
        if isinstance(overrides, str):
            overrides = shlex.split(overrides)
        if overrides is None:
            overrides = []
        if not isinstance(overrides, (list, tuple)) or any(not isinstance(o, str) or "=" not in o for o in overrides):
            raise ConfigError(f"{knob}={overrides!r} must be a list of run overrides, e.g. "
                              f"'{knob}=[model.dim=64,dataset.batch_size=16]'")
        runs = []
        for item in overrides:
            key, value = item.split("=", 1)
            if not key.startswith("lr."):
                runs.append(item)
                continue
            is_grid = key.startswith("lr.grid.")
            opt = key[len("lr.grid."):] if is_grid else key[3:]
            if opt not in optimizers:
                raise ConfigError(f"{knob}: {item}: lr.<optimizer>=X centres an optimizer's lr grid in this workload, "
                                  f"lr.grid.<optimizer>=[...] gives it; {opt!r} is not one of optimizers={optimizers}")
            values = value.strip("[]").split(",") if is_grid else [value]
            try:
                lrs = tuple(float(v) for v in values)
            except ValueError:
                lrs = (math.nan,)
            if any(not lr > 0 or math.isinf(lr) for lr in lrs) or len({f"{lr:g}" for lr in lrs}) != len(lrs):
                raise ConfigError(f"{knob}: {item}: the lrs must be distinct positive numbers, e.g. lr.{opt}=1e-3 or "
                                  f"lr.grid.{opt}=[1e-3,3e-3]")
            centres.append((str(name), opt, lrs if is_grid else lrs[0]))
        overrides = runs
        check_run_overrides(overrides, knob)
        out.append((str(name), tuple(overrides)))
    return tuple(out) or ((WORKLOAD, ()),), tuple(centres)


# ----------------------------------------------------------------------------- overrides


def override_key(override: str) -> str:
    """`+model.dim=32` -> `model.dim`; `optimizer/lr_config=x` -> `optimizer/lr_config`."""
    return override.split("=", 1)[0].lstrip("+~").strip()


def check_run_overrides(overrides: list[str] | tuple[str, ...], where: str = "") -> None:
    """Refuse a run override of a knob the comparison sets itself, naming the knob to use."""
    at = f" (in {where})" if where else ""
    for override in overrides:
        key = override_key(override)
        if key.startswith("hydra/") or key.startswith("hydra."):
            raise ConfigError(f"{override}{at}: only hydra/launcher=local|slurm and hydra.launcher.* are comparison "
                              "knobs (each run its own process or SLURM job); other hydra settings are not supported")
        for knob, instead in CONTROLLED.items():
            if key == knob or ("." in knob and key.startswith(knob + ".")):  # optimizer.<knob> passes
                raise ConfigError(f"{override}{at}: the comparison sets {knob} itself; use {instead}")


def base_lrs(optimizers: tuple[str, ...], run_overrides: tuple[str, ...] = (), variants=()) -> dict[str, float]:
    """Each entry's yaml lr (its optimizer's optimizer.lr_config.lr), as a run with these overrides
    (and a variant's own) composes it."""
    from utils.config import compose_overrides

    out = {}
    for entry in optimizers:
        opt, fixed = entry_of(variants, entry)
        cfg = compose_overrides([*run_overrides, *fixed, f"optimizer={opt}"], job_name="compare")
        out[entry] = float(cfg.optimizer.lr_config.lr)
    return out


def workload_lrs(knobs: CompareConfig, run_overrides: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """base_lrs per workload (a workload's overrides may change an optimizer's yaml lr), or the
    workload's own `lr.<optimizer>=X` centre."""
    out = {name: base_lrs(knobs.optimizers, (*run_overrides, *extra), knobs.variants)
           for name, extra in knobs.workloads}
    for name, opt, lr in knobs.workload_lr:
        out[name][opt] = lr
    return out


def start_values(knobs: CompareConfig, run_overrides: tuple[str, ...] = ()) -> dict[tuple[str, str], dict[str, Any]]:
    """tune=coordinate: per (workload, optimizer), the optimizer's own value of its lr and of each
    knob it sweeps, as a run of that workload composes them (where its coordinate search starts)."""
    from omegaconf import OmegaConf

    from utils.config import compose_overrides

    out = {}
    for name, extra in knobs.workloads:
        for opt in knobs.optimizers:
            cfg = compose_overrides([*run_overrides, *extra, *knobs.overrides_of(opt),
                                     f"optimizer={knobs.optimizer_of(opt)}"], job_name="compare")
            values = {"lr": dict(((w, o), lr) for w, o, lr in knobs.workload_lr).get(
                (name, opt), float(cfg.optimizer.lr_config.lr))}
            for knob, _ in knobs.sweep_of(opt):
                values[knob] = OmegaConf.select(cfg.optimizer, current_name(knobs.optimizer_of(opt), knob))
            out[(name, opt)] = values
    return out


def search_space(knobs: CompareConfig, optimizer: str, base_lr: float, own: dict[str, Any] | None = None,
                 workload: str = WORKLOAD) -> Space:
    """tune=coordinate: the lr grid, then each swept knob's values; the search starts at the
    optimizer's own values (`own`: start_values's) where the axes list them, else at their middle."""
    axes = (("lr", lr_grid(knobs, optimizer, base_lr, workload)), *knobs.sweep_of(optimizer))
    own = {"lr": base_lr, **(own or {})}
    return Space(axes, tuple(start_value(values, own.get(knob)) for knob, values in axes))


def lr_grid(knobs: CompareConfig, optimizer: str, base_lr: float, workload: str = WORKLOAD) -> tuple[float, ...]:
    """lr.grid.<optimizer> (the comparison's, or the workload's own), else base·factor^k for
    k = -(points//2) .. points - points//2 - 1."""
    explicit = dict(knobs.lr_grid).get(optimizer) or {(w, o): lrs for w, o, lrs in knobs.workload_lr_grid}.get(
        (workload, optimizer))
    if explicit:
        return explicit
    low = -(knobs.lr_points // 2)
    return tuple(base_lr * knobs.lr_factor ** k for k in range(low, low + knobs.lr_points))


def _value(v: Any) -> str:
    """A sweep value as a Hydra override value and in a run id."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_id(optimizer: str, lr: float, seed: int, budget: int | None = None, workload: str = WORKLOAD,
           sweep: tuple[tuple[str, Any], ...] = (), phase: str = "tune") -> str:
    tail = "trunk" if budget is None else f"S{budget}"
    swept = "".join(f"__{knob}{_value(v)}" for knob, v in sweep)
    tag = phase if phase in ("eval", "target") else "seed"
    return f"{workload}__{optimizer}__lr{lr:g}{swept}__{tag}{seed}__{tail}"


def data_seed(knobs: CompareConfig, seed: int) -> int:
    """The data_seed of a run with random_seed `seed`: the comparison's, plus the seed with seeds.vary_data."""
    return knobs.data_seed + seed if knobs.seeds_vary_data else knobs.data_seed


def _setting_runs(knobs: CompareConfig, workload: str, optimizer: str, lr: float, overrides: tuple[str, ...],
                  defaults: list[str], sweeps: list[tuple] | None = None, seeds: range | None = None,
                  budgets: tuple[int, ...] | None = None, phase: str = "tune") -> list[PlannedRun]:
    """The runs of one (workload, optimizer, lr): per sweep combination (`sweeps`, default: every one)
    and seed (default: the tuning seeds), a trunk to the branch point of the largest of `budgets`
    (default: every budget), then a branch per budget."""
    budgets = knobs.budgets_of(workload) if budgets is None else tuple(sorted(budgets))
    seeds = range(knobs.seeds) if seeds is None else seeds
    steps = sorted({knobs.branch_step(b) for b in budgets})
    runs: list[PlannedRun] = []
    # `optimizer` is the entry (a variant's label names its runs); its own optimizer and overrides train
    real, fixed = knobs.optimizer_of(optimizer), knobs.overrides_of(optimizer)
    overrides = (*fixed, *overrides)  # check_variants: no key of a variant's is among the others
    defaults = [o for o in defaults if override_key(o) not in {override_key(f) for f in fixed}]
    given = {override_key(o) for o in overrides}
    # An optimizer whose state depends on the run's length (a knob that defaults to it) gets the
    # largest budget for every run, trunk and branches alike, so a branch stays exact.
    horizon = OPTIMIZERS[real].RUN_LENGTH_KNOB
    horizon = [f"optimizer.{horizon}={max(knobs.budgets_of(workload))}"] \
        if horizon and f"optimizer.{horizon}" not in given else []
    # One that needs no cooldown (its own averaging) has branches that keep the trunk's constant lr.
    cooldown = OPTIMIZERS[real].COOLDOWN
    combos = itertools.product(*[[(knob, v) for v in values] for knob, values in knobs.sweep_of(optimizer)])
    for sweep in (tuple(c) for c in combos) if sweeps is None else sweeps:
        swept = [f"optimizer.{knob}={_value(v)}" for knob, v in sweep]
        for seed in seeds:
            common = [f"optimizer={real}", f"optimizer.lr_config.lr={lr!r}",
                      f"optimizer.lr_config.warmup={knobs.warmup}", *horizon, *swept, f"random_seed={seed}",
                      f"data_seed={data_seed(knobs, seed)}", *defaults, *overrides]
            trunk = run_id(optimizer, lr, seed, None, workload, sweep, phase)
            runs.append(PlannedRun(
                trunk, workload, optimizer, lr, seed, "trunk", None, None, None,
                ("optimizer/lr_config=constant", *common, f"train.max_steps={steps[-1]}",
                 f"checkpoint.save_steps=[{','.join(map(str, steps))}]",
                 f"train.val_at=[{','.join(map(str, steps))}]"), sweep, phase))
            for budget in budgets:
                b = knobs.branch_step(budget)
                schedule = ("optimizer/lr_config=trapezoid", *common, f"train.max_steps={budget}",
                            f"optimizer.lr_config.decay={budget - b}",
                            f"optimizer.lr_config.decay_shape={knobs.cooldown_shape}",
                            "optimizer.lr_config.min_lr=0.0", "optimizer.lr_config.max_steps=null") if cooldown else (
                    "optimizer/lr_config=constant", *common, f"train.max_steps={budget}")
                schedule = (*schedule, f"train.val_at=[{budget}]")  # explicit; the last step evaluates anyway
                runs.append(PlannedRun(
                    run_id(optimizer, lr, seed, budget, workload, sweep, phase), workload, optimizer, lr, seed,
                    "branch", budget, trunk, b, schedule, sweep, phase))
    return runs


def _workload_overrides(knobs: CompareConfig, run_overrides: tuple[str, ...], workload: str) -> tuple[list, tuple]:
    """(the defaults a workload's runs get, the user's run overrides then the workload's)."""
    overrides = (*run_overrides, *dict(knobs.workloads)[workload])
    given = {override_key(o) for o in overrides}
    if knobs.val_every is not None and "train.val_freq" in given:
        raise ConfigError(f"val_every={knobs.val_every} and the run override train.val_freq both set how often runs "
                          "evaluate: give only val_every")
    every = () if knobs.val_every is None else (f"train.val_freq={knobs.val_every}",)
    defaults = [o for o in (*QUIET, *every) if override_key(o) not in given]
    return defaults, overrides


def _check_ids(runs: list[PlannedRun]) -> None:
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"two runs would share the id {dup}: the lrs of lr.grid/lr.factor must differ in their "
                          "first 6 significant digits")


def make_plan(knobs: CompareConfig, run_overrides: list[str] | tuple[str, ...],
              lrs: dict[str, float] | dict[str, dict[str, float]],
              starts: dict[tuple[str, str], dict[str, Any]] | None = None) -> Plan:
    """The comparison's runs, each trunk followed by its branches. `lrs`: each optimizer's yaml lr,
    or per workload name such a mapping (workload_lrs). With tune=coordinate, the runs of each
    search's first axis (the lr grid at its start; `starts`: start_values's), the rest as the
    results come (coordinate_runs)."""
    run_overrides = tuple(run_overrides)
    check_run_overrides(run_overrides)
    check_variants(knobs, run_overrides)
    metric_lib.check_logged(metric_lib.parse(knobs.metric), knobs.workloads, run_overrides)
    runs: list[PlannedRun] = []
    spaces = []
    for workload, _ in knobs.workloads:
        defaults, overrides = _workload_overrides(knobs, run_overrides, workload)
        base = lrs[workload] if isinstance(lrs.get(workload), dict) else lrs
        for opt in knobs.optimizers:
            if knobs.tune == "coordinate":
                space = search_space(knobs, opt, base[opt], (starts or {}).get((workload, opt)), workload)
                spaces.append(((workload, opt), space))
                runs += _cell_runs(knobs, workload, opt, space, coordinate_path(
                    space, lambda cell: None, knobs.coordinate_threshold, knobs.coordinate_max_trials).todo,
                    overrides, defaults)
                continue
            for lr in lr_grid(knobs, opt, base[opt], workload):
                runs += _setting_runs(knobs, workload, opt, lr, overrides, defaults)
    _check_ids(runs)
    return Plan(knobs, run_overrides, tuple(runs), tuple(spaces))


def _cell_runs(knobs: CompareConfig, workload: str, optimizer: str, space: Space, cells, overrides, defaults
               ) -> list[PlannedRun]:
    """The runs of coordinate-search cells: per cell, its trunk and branches on every tuning seed."""
    return [run for cell in cells for run in _setting_runs(knobs, workload, optimizer, float(cell[0]), overrides,
                                                           defaults, [space.sweep(cell)])]


def coordinate_runs(plan: Plan, loss_of) -> tuple[PlannedRun, ...]:
    """tune=coordinate: the runs of the cells each search asks for next, replaying it on the
    results so far (`loss_of(workload, optimizer, space)` -> a cell's mean loss or None, tune.cell_losses);
    () when every search has ended."""
    runs: list[PlannedRun] = []
    for (workload, opt), space in plan.spaces:
        path = coordinate_path(space, loss_of(workload, opt, space), plan.knobs.coordinate_threshold,
                               plan.knobs.coordinate_max_trials)
        defaults, overrides = _workload_overrides(plan.knobs, plan.run_overrides, workload)
        runs += _cell_runs(plan.knobs, workload, opt, space, path.todo, overrides, defaults)
    _check_ids(runs)
    return tuple(runs)


def extension_lr(grid: list[float], best: float | None, base_grid: tuple[float, ...], most: int) -> float | None:
    """The next lr beyond the edge of `grid` (the lrs run so far, ascending) where `best` sits, at
    the ratio of the two lrs at that edge; None when best is inside, unknown, the grid has one lr,
    or `most` lrs were already added on that side of `base_grid`."""
    if best is None or len(grid) < 2 or best not in (grid[0], grid[-1]):
        return None
    if best == grid[-1]:
        added = sum(lr > max(base_grid) * (1 + 1e-9) for lr in grid)
        return None if added >= most else grid[-1] * (grid[-1] / grid[-2])
    added = sum(lr < min(base_grid) * (1 - 1e-9) for lr in grid)
    return None if added >= most else grid[0] / (grid[1] / grid[0])


def extension_runs(plan: Plan, new_lrs: dict[tuple[str, str], float]) -> tuple[PlannedRun, ...]:
    """The runs of each (workload, optimizer)'s added lr: every sweep combination, seed and budget."""
    runs: list[PlannedRun] = []
    for (workload, opt), lr in sorted(new_lrs.items()):
        defaults, overrides = _workload_overrides(plan.knobs, plan.run_overrides, workload)
        runs += _setting_runs(plan.knobs, workload, opt, lr, overrides, defaults)
    _check_ids([*plan.runs, *runs])
    return tuple(runs)


def evaluation_runs(plan: Plan, chosen: dict[tuple[str, str], dict[int, tuple[tuple, float]]],
                    phase: str = "eval") -> tuple[PlannedRun, ...]:
    """seeds.eval: per (workload, optimizer), `chosen[(workload, optimizer)][budget] = (sweep values,
    lr)`, the setting the tuning seeds chose at that budget; the runs of each distinct chosen setting
    on the evaluation seeds (random_seed seeds.tune .. seeds.tune + seeds.eval - 1): a trunk per seed
    to the branch point of its largest chosen budget, and a branch per budget it was chosen at.
    phase="target" (target.runs): the same on the target track's seeds, after the evaluation ones."""
    knobs = plan.knobs
    seeds = phase_seeds(knobs, phase)
    runs: list[PlannedRun] = []
    for (workload, opt), per_budget in sorted(chosen.items()):
        defaults, overrides = _workload_overrides(knobs, plan.run_overrides, workload)
        settings: dict[tuple, list[int]] = {}
        for budget, (sweep, lr) in sorted(per_budget.items()):
            settings.setdefault((tuple(sweep), float(lr)), []).append(int(budget))
        for (sweep, lr), budgets in settings.items():
            runs += _setting_runs(knobs, workload, opt, lr, overrides, defaults, [sweep], seeds, tuple(budgets),
                                  phase)
    _check_ids([*plan.runs, *runs])
    return tuple(runs)


def phase_seeds(knobs: CompareConfig, phase: str) -> range:
    """The random_seeds of a phase's runs: tune 0..K-1, eval K..K+M-1, target K+M..K+M+N-1 (disjoint)."""
    start = {"tune": 0, "eval": knobs.seeds, "target": knobs.seeds + knobs.seeds_eval}[phase]
    return range(start, start + {"tune": knobs.seeds, "eval": knobs.seeds_eval, "target": knobs.target_runs}[phase])


def base_grid(plan: Plan, workload: str, optimizer: str) -> tuple[float, ...]:
    """The lrs the plan itself gives (workload, optimizer), before any extension."""
    return tuple(sorted({r.lr for r in plan.runs if r.workload == workload and r.optimizer == optimizer}))
