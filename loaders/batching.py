"""Windows -> batches of this process's rows, with exactly resumable order (`BatchIterator`), and
the fixed evaluation batches (`eval_batches`).

numpy only: the training loop places each batch on the Mesh itself. Everything per step is a
handful of vectorised numpy calls on a cached permutation (`loaders.order.WindowOrder`), so the
real loader costs microseconds next to a step, and there is never a Python loop over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from loaders.order import WindowOrder
from loaders.windows import WindowDataset, concat_rows
from utils.errors import ConfigError

# Fixed, not random_seed: every evaluation, resume and seed of a sweep scores the same windows, so
# val/loss compares across all of them.
VAL_SEED = 0


def local_slots(batch_shape: tuple[int, ...], process_index: int, process_count: int) -> np.ndarray:
    """Flat positions, in the global batch, of this process's rows [i*B/n, (i+1)*B/n) of axis -2
    (shaped like the local batch): every process walks the same global order and reads only these."""
    rows = batch_shape[-1]
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
    if rows % process_count:
        raise ConfigError(
            f"dataset.batch_size={rows} does not split over {process_count} processes: "
            f"set it to a multiple of {process_count}"
        )
    mine = slice(process_index * rows // process_count, (process_index + 1) * rows // process_count)
    return np.arange(math.prod(batch_shape)).reshape(batch_shape)[..., mine]


def read_slots(pieces: list[tuple[WindowDataset, np.ndarray, np.ndarray, int]], slots: np.ndarray):
    """Rows for `slots` (flat global positions, any shape) from pieces (dataset, global positions
    they fill, window indices, offset): only the requested positions are read."""
    parts, order = [], []
    flat = slots.reshape(-1)
    for dataset, positions, idx, offset in pieces:
        hit = np.isin(positions, flat)
        if hit.any():
            parts.append(dataset.get(idx[hit], offset))
            order.append(positions[hit])
    rows = parts[0] if len(parts) == 1 else concat_rows(parts)
    where = np.concatenate(order)
    if len(parts) > 1 or not np.array_equal(where, flat):  # pieces in position order -> slot order
        pick = np.argsort(where)[np.searchsorted(np.sort(where), flat)]
        rows = {k: v[pick] for k, v in rows.items()} if isinstance(rows, dict) else rows[pick]
    if isinstance(rows, dict):
        return {k: v.reshape(slots.shape + v.shape[1:]) for k, v in rows.items()}
    return rows.reshape(slots.shape + rows.shape[1:])


class BatchIterator:
    """Infinite iterator of batches of shape batch_shape + (window,), e.g. (accum_steps, batch_size, T+1):
    int32 arrays, or dicts of arrays (see WindowDataset) when the dataset is masked. The order of
    windows is a `WindowOrder` (shuffled per epoch, moving boundaries, exactly resumable).

    Multi-host: every process walks the same global stream and returns only its rows
    [process_index*B/process_count, (process_index+1)*B/process_count) of the batch axis (axis -2 of
    the output), so the processes' slices concatenate to the single-process batch. The state counts
    global windows, so it resumes correctly on a different number of processes too.
    """

    def __init__(
        self,
        dataset: WindowDataset,
        batch_shape: tuple[int, ...],
        seed: int,
        shuffle: bool,
        process_index: int = 0,
        process_count: int = 1,
        random_offset: bool = True,
    ):
        batch_shape = tuple(int(b) for b in batch_shape)
        if not batch_shape or min(batch_shape) < 1:
            raise ValueError(f"batch_shape must be non-empty and positive, got {batch_shape}")
        self.dataset = dataset
        self.batch_shape = batch_shape
        self.order = WindowOrder(dataset, seed, shuffle, random_offset)
        self._slots = local_slots(batch_shape, process_index, process_count)

    def __iter__(self):
        return self

    def __next__(self):
        pieces, begin = [], 0
        for idx, offset in self.order.take(math.prod(self.batch_shape)):
            pieces.append((self.dataset, np.arange(begin, begin + len(idx)), idx, offset))
            begin += len(idx)
        return read_slots(pieces, self._slots)

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)


def eval_indices(num_windows: int, max_windows: int, seed: int = VAL_SEED) -> np.ndarray:
    """min(num_windows, max_windows) window indices drawn by `seed`, sorted (memmap-friendly reads).

    Random, not the first windows: those come from the first files in path order. A prefix of one
    permutation, so raising train.max_val_steps only adds windows to the set evaluated before.
    """
    order_N = np.random.default_rng(seed).permutation(num_windows)
    return np.sort(order_N[: max(0, min(num_windows, max_windows))])


def eval_batches(
    dataset: WindowDataset,
    batch_size: int,
    max_batches: int,
    seed: int = VAL_SEED,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens_BxW int32, weights_B float32) covering `eval_indices` once each, this process's rows.

    The last batch is padded to `batch_size` (the compiled shape, divisible over devices) with copies
    of a real window whose weight is 0: a weighted mean then counts every selected window exactly
    once, where wrapping around would count some twice.
    """
    if batch_size % process_count:
        raise ConfigError(
            f"dataset.batch_size={batch_size} does not split over {process_count} processes: "
            f"set it to a multiple of {process_count}"
        )
    rows = slice(process_index * batch_size // process_count, (process_index + 1) * batch_size // process_count)
    idx_N = eval_indices(len(dataset), max_batches * batch_size, seed)
    for start in range(0, len(idx_N), batch_size):
        real = min(batch_size, len(idx_N) - start)
        idx_B = np.full(batch_size, idx_N[start], np.int64)
        idx_B[:real] = idx_N[start : start + real]
        weights_B = (np.arange(batch_size) < real).astype(np.float32)
        yield dataset.get(idx_B[rows]), weights_B[rows]
