"""A comparison's start-up once per process: what every run of it would build alike (the
tokenizer, the source's documents and windows, the evaluation batches, the traced and compiled
train step) is built by the first run that needs it and reused by the later ones.

Why: the in-process launcher (compare/launch.py) trains hundreds of small runs one after another
in one process, and each run used to build all of this anew: tokenizing, tracing and lowering the
step (0.7-0.9 s on the 2-core VM), loading its executable from the persistent cache (0.3-0.4 s),
while its steps took milliseconds.

Off unless a caller opens `sharing()` (the comparison's in-process launcher does): a single run,
and a test session, build everything per run as before. Inside it each table is keyed by exactly
what determines its value:
  * data (`data_key`): the tokenizer and dataset-source sections, cache_dir, the window length
    and document masking; the source's files are assumed not to change while the process runs;
  * the train step (`step_key`): `step_view(run)`, the only config the step is built from
    (train_jax.init_training), with the knobs the step takes as arguments (optimizer/arguments.py's
    lift) masked, plus the mesh and the state's shardings. Since the step's builders never see
    anything but that view and those arguments, two runs with one key trace one program; shapes
    and dtypes follow from the view (jit retraces on any other signature all the same). init_training
    takes the view of the run with a constant lr as its trapezoid (optimizer/arguments.py `canonical`),
    so trunks share their branches' step;
  * the state's shapes (`abstract_state`) and the memory check's estimate (`state_bytes`):
    `view_key(run)`, the same masked view, which they follow from;
  * conf/'s composition (`composed`, utils/config.compose_reusing): the overrides that select
    config groups (and the job name); each run's value overrides are applied to a copy.
Tables are small LRUs (a comparison has a handful of optimizers and shapes); closing the
outermost `sharing()` empties them. Inside it, checkpoints are also held in memory for the runs
that restore them next (utils/checkpoint/memory.py: a branch its trunk's save).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax

from optimizer import arguments
from utils.checkpoint import memory

MAX_ENTRIES = 8  # per table: a comparison's optimizers × shapes × variants (an LRU drops the oldest beyond)

_depth = [0]  # open sharing() blocks
_tables: dict[str, collections.OrderedDict] = {}
_stats: collections.Counter = collections.Counter()  # "<table>/hit", "<table>/miss": what a test or bench reads


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Runs inside share what they build alike (re-entrant), and restore the checkpoints that runs before
    them saved from memory (utils/checkpoint/memory.py); the tables are emptied when the outermost block ends."""
    _depth[0] += 1
    try:
        with memory.holding():
            yield
    finally:
        _depth[0] -= 1
        if not _depth[0]:
            _tables.clear()


def active() -> bool:
    return _depth[0] > 0


def remember(table: str, key: Any, build: Callable[[], Any], keep: Callable[[Any], bool] = lambda _: True) -> Any:
    """build(), or inside `sharing()` the value an earlier call with an equal `key` built (and `keep` kept)."""
    if not active():
        return build()
    entries = _tables.setdefault(table, collections.OrderedDict())
    if key in entries:
        _stats[f"{table}/hit"] += 1
        entries.move_to_end(key)
        return entries[key]
    _stats[f"{table}/miss"] += 1
    value = build()
    if keep(value):
        entries[key] = value
    while len(entries) > MAX_ENTRIES:
        entries.popitem(last=False)
    return value


def stats() -> dict[str, int]:
    """Hits and misses per table since the process started."""
    return dict(_stats)


def data_key(run) -> tuple:
    """What determines a run's tokenizer and documents: the tokenizer and source sections (frozen
    dataclasses: their repr lists every knob) and the cache they are read from. Its windows add the
    window length and document masking (train_jax.init_data)."""
    return repr(run.tokenizer), repr(run.dataset.source), run.cache_dir


# What train_jax.init_training's step builders (the optimizer, its schedule, the step metrics, the
# model's loss) read of each section; the rest of the config is reset to its defaults in the view.
# None: the whole section.
STEP_FIELDS: dict[str, frozenset[str] | None] = {
    "model": None,
    "objective": None,
    "optimizer": None,
    "train": frozenset({"gradient_clip_val", "param_dtype", "compute_dtype", "skip_nonfinite", "max_consecutive_skips",
                        "weight_average", "weight_average_half_life", "weight_average_tail", "loss_scale"}),
    "logging": frozenset({"aux", "activation_norms"}),
    "parallel": frozenset({"data", "fsdp", "tensor", "expert", "shard_optimizer_state"}),
    "dataset": frozenset({"batch_size", "total_batch_size", "context_length", "document_mask"}),
}
BLANK = {"tokenizer": None, "random_seed": 0, "data_seed": 0, "cache_dir": "", "config_dict": None}


def _only(obj, keep: frozenset[str]):
    """`obj` (a config dataclass) with every field but `keep` at its default."""
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(obj) if f.name not in keep
                and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}
    return dataclasses.replace(obj, **defaults)


def step_view(run):
    """The run config the train step is built from: STEP_FIELDS kept, the rest at defaults. train.max_steps
    is kept under weight_average=tail (the tail's first step is a constant of the step: weight_average.py)."""
    changes = {}
    for f in dataclasses.fields(run):
        keep = STEP_FIELDS.get(f.name, frozenset())
        value = getattr(run, f.name)
        if f.name in BLANK:
            changes[f.name] = BLANK[f.name]
        elif keep is not None and dataclasses.is_dataclass(value):
            if f.name == "train" and value.weight_average == "tail":
                keep = keep | {"max_steps"}
            changes[f.name] = _only(value, keep)
        elif keep is not None and f.default is not dataclasses.MISSING:
            changes[f.name] = f.default
    return dataclasses.replace(run, **changes)


ARGUMENT = "<step argument>"  # a lifted knob's place in the key: its value is an argument, not in the program


def masked(view):
    """`view` with each knob the step takes as an argument (arguments.lift) replaced by ARGUMENT:
    which knobs are lifted (non-zero ones) stays in it, their values do not."""
    values = arguments.lift(view.optimizer, view.train.gradient_clip_val)
    o, clip = arguments.bind(view.optimizer, view.train.gradient_clip_val, jax.tree.map(lambda _: ARGUMENT, values))
    return dataclasses.replace(view, optimizer=o, train=dataclasses.replace(view.train, gradient_clip_val=clip))


def step_key(view, mesh, shardings) -> tuple:
    """Everything static in the step program of a run whose step_view is `view`."""
    leaves, treedef = jax.tree.flatten(shardings)
    return repr(masked(view)), mesh, tuple(leaves), treedef


def view_key(run) -> str:
    """What determines the shapes of a run's state (the model, the optimizer's structure, the dtypes,
    the step metrics' states): its step view with the argument knobs masked (no value of those changes a
    shape: one program serves them all), its schedule as the step is built from it (a constant lr as
    its trapezoid: arguments.canonical)."""
    return repr(masked(step_view(dataclasses.replace(run, optimizer=arguments.canonical(run.optimizer)))))
