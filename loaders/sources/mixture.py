"""Several sources mixed by weight (`dataset=mixture`), deterministically.

Each window slot of global batch b comes from a component drawn from
np.random.default_rng([data_seed, b]) with the weights, and each component hands out its windows
in its own `WindowOrder` (shuffled per epoch, seeded by [data_seed, component index]; in order with
dataset.shuffle=false). So the mix
depends on data_seed alone, a resume needs only the batch count and each component's position,
and a small component is cycled through epochs while a large one is still in its first.
Validation is every component's validation windows together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from loaders.batching import local_slots, read_slots
from loaders.config import DataRequest
from loaders.order import WindowOrder
from loaders.windows import WindowDataset
from utils.errors import CheckpointError, ConfigError


def _components(raw: Any, prefix: str) -> list[tuple[str, float, Any]]:
    """(name, weight, built source config) per component, every knob checked."""
    from loaders.sources import SOURCES  # here, not at import: the registry imports this module
    from utils.sections import build_registered

    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{prefix}.components must map names to sources with a weight, e.g. "
                          f"{prefix}.components.code='{{name: stdlib, weight: 0.5}}'")
    built = []
    for name, node in raw.items():
        where = f"{prefix}.components.{name}"
        if not isinstance(node, dict):
            raise ConfigError(f"{where} must be a mapping with a source `name` and a `weight`, got {node!r}")
        node = dict(node)
        weight = node.pop("weight", None)
        if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0
                or not math.isfinite(weight)):
            raise ConfigError(f"{where}.weight={weight!r} must be a positive number (weights are normalised)")
        if node.get("name") == "mixture":
            raise ConfigError(f"{where}.name=mixture: a mixture cannot contain a mixture; list its sources directly")
        built.append((str(name), float(weight), build_registered(SOURCES, node, where)[1]))
    return built


class _Unmasked:
    """A plain component's rows as dicts with an all-ones loss mask, so they batch with a masked one's."""

    def __init__(self, dataset: WindowDataset):
        self.dataset, self.window = dataset, dataset.window

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, idx, offset: int = 0) -> dict:
        tokens = self.dataset.get(idx, offset)
        return {"tokens": tokens, "loss_mask": np.ones(tokens.shape[:-1] + (self.window - 1,), np.float32)}


def _uniform(datasets: list) -> list:
    """Make every component's rows the same kind: dicts with a loss mask if any has one."""
    if any(getattr(d, "masked", False) for d in datasets) and not all(d.masked for d in datasets):
        return [d if d.masked else _Unmasked(d) for d in datasets]
    return datasets


class ConcatWindows:
    """Several datasets' windows as one (validation): index i is the i-th window of them in order."""

    def __init__(self, datasets: list):
        self.parts = _uniform(datasets)
        self.window = datasets[0].window
        self.starts = np.cumsum([0] + [len(d) for d in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, idx, offset: int = 0):
        idx = np.asarray(idx)
        flat = idx.reshape(-1)
        part_N = np.searchsorted(self.starts, flat, side="right") - 1
        pieces = [(self.parts[p], np.nonzero(part_N == p)[0], flat[part_N == p] - self.starts[p], offset)
                  for p in np.unique(part_N)]
        return read_slots(pieces, np.arange(len(flat)).reshape(idx.shape))


class MixtureBatches:
    """The iterator of MixtureTrain.batches: see the module docstring."""

    def __init__(self, names, datasets, weights_K, batch_shape, seed, process_index, process_count, shuffle):
        self.names, self.datasets, self.weights_K = names, _uniform(datasets), weights_K
        self.seed, self.batch_shape = int(seed), batch_shape
        self.orders = [WindowOrder(d, (self.seed, k), shuffle)
                       for k, d in enumerate(datasets)]
        self.slots = local_slots(batch_shape, process_index, process_count)
        self.batches = 0

    def __iter__(self):
        return self

    def __next__(self):
        n = math.prod(self.batch_shape)
        comp_N = np.random.default_rng([self.seed, self.batches]).choice(len(self.datasets), n, p=self.weights_K)
        pieces = []
        for k, (dataset, order) in enumerate(zip(self.datasets, self.orders)):
            positions = np.nonzero(comp_N == k)[0]
            begin = 0
            for idx, offset in order.take(len(positions)) if len(positions) else ():
                pieces.append((dataset, positions[begin : begin + len(idx)], idx, offset))
                begin += len(idx)
        self.batches += 1
        return read_slots(pieces, self.slots)

    def state_dict(self) -> dict:
        return {"batches": self.batches, "components": {n: o.state_dict() for n, o in zip(self.names, self.orders)}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("components", {})
        if sorted(saved) != sorted(self.names):
            raise CheckpointError(f"the checkpoint's data mixture has components {sorted(saved)}, this run "
                                  f"{sorted(self.names)}: resume with the same dataset.components")
        for name, order in zip(self.names, self.orders):
            order.load_state_dict(saved[name])
        self.batches = int(state["batches"])


@dataclass(frozen=True)
class MixtureTrain:
    names: tuple[str, ...]
    datasets: tuple
    weights_K: np.ndarray
    shuffle: bool = True  # dataset.shuffle, set by loaders.pipeline.batch_maker; false: each component in order

    def batches(self, batch_shape, seed, process_index, process_count) -> MixtureBatches:
        return MixtureBatches(self.names, list(self.datasets), self.weights_K, batch_shape, seed, process_index,
                              process_count, self.shuffle)


@dataclass(frozen=True)
class Mixture:
    name: ClassVar[str] = "mixture"

    components: Any = None  # {name: {name: <source>, weight: w, <that source's knobs>}}

    def check(self, prefix: str) -> None:
        _components(self.components, prefix)

    def windows(self, req: DataRequest):
        from loaders.pipeline import source_windows  # the pipeline builds each component like a whole source

        names, trains, vals, weights = [], [], [], []
        for name, weight, source in _components(self.components, "dataset"):
            train, val = source_windows(source, req)
            if not isinstance(train, WindowDataset):
                raise ConfigError(f"dataset.components.{name} is a stream (dataset.name={source.name} with "
                                  "streaming): mixtures take sources with a fixed size; prepare it with "
                                  "scripts/prepare_data.py and mix the memmap")
            names.append(name), trains.append(train), vals.append(val), weights.append(weight)
        weights_K = np.asarray(weights) / sum(weights)
        return MixtureTrain(tuple(names), tuple(trains), weights_K), ConcatWindows(vals)
