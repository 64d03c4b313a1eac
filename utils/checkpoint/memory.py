"""Checkpoints also kept in this process's memory, so that a run restoring one that an earlier run of
the same process saved (a comparison's branch its trunk's) reads no file.

Why: a comparison trains hundreds of small runs in one process (compare/launch.py), and each
cooldown branch restores its trunk's save, which the trunk wrote moments before: orbax spent ~0.2 s
of a branch's few seconds reading back a state of a few MB (docs/performance.md).

Off unless a caller opens `holding()` (trainer/process_cache.py's `sharing()` does, as the in-process
launcher runs its plan): a single run, and every test that does not ask for it, reads its checkpoint
from disk as before. The runs still write every checkpoint to disk (a killed comparison resumes from
there); the copy here holds the same arrays orbax writes (`keep`, from the save's arguments), as host
NumPy copies, so `restore` gives bit for bit what orbax's restore would (tests/test_checkpoint_memory.py).
Bounded: MAX_ENTRIES checkpoints and MAX_BYTES of arrays, oldest dropped first; a state larger than
MAX_BYTES is not kept. Closing the outermost `holding()` empties it.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, Iterator

import jax
import numpy as np

MAX_ENTRIES = 8  # a trunk's branch points (one per budget) and a few more: the trunk's branches run next
MAX_BYTES = 512 * 2**20  # of host memory at most: tiny comparisons' states are a few MB each

_depth = [0]
_held: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()  # iter_N path -> {item: tree}
_bytes = [0]


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Checkpoints saved inside are also held in memory (re-entrant); emptied when the outermost block ends."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if not _depth[0]:
            _held.clear()
            _bytes[0] = 0


def active() -> bool:
    return _depth[0] > 0


def _size(entry: dict[str, Any]) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(entry))


def keep(path: str, items: dict[str, Any]) -> None:
    """Inside `holding()`: hold `items` ({item name: pytree of arrays}, what the save of checkpoint
    `path` writes) as host copies. A copy, not a view: the next step donates the state's buffers."""
    if not active():
        return
    entry = jax.tree.map(lambda x: np.array(x, copy=True), items)
    size = _size(entry)
    forget(path)
    if size > MAX_BYTES:
        return
    _held[os.path.abspath(path)] = entry
    _bytes[0] += size
    while len(_held) > MAX_ENTRIES or _bytes[0] > MAX_BYTES:
        _bytes[0] -= _size(_held.popitem(last=False)[1])


def forget(path: str) -> None:
    entry = _held.pop(os.path.abspath(path), None)
    if entry is not None:
        _bytes[0] -= _size(entry)


def held(path: str) -> dict[str, Any] | None:
    """The items held for checkpoint `path`, or None (not held, or outside `holding()`)."""
    return _held.get(os.path.abspath(path)) if active() else None


def shapes(tree: Any) -> list[tuple[tuple[int, ...], Any]]:
    return [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree)]


def restore(entry: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any] | None:
    """{name: target's tree of arrays}, each held array placed in its target leaf's sharding, when every
    target (a pytree of ShapeDtypeStructs) has the held tree's structure, shapes and dtypes; else None
    (the caller reads the files, which casts and reports as orbax does)."""
    for name, target in targets.items():
        tree = entry.get(name)
        if tree is None or jax.tree.structure(tree) != jax.tree.structure(target) or shapes(tree) != shapes(target):
            return None
    # may_alias=False: a device array of its own (on a CPU it could share the NumPy buffer), which the run's
    # step then donates without touching the held copy another run may restore.
    place = lambda x, t: jax.device_put(x, getattr(t, "sharding", None), may_alias=False)
    return {name: jax.tree.map(place, entry[name], target) for name, target in targets.items()}
