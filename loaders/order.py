"""The endless, exactly resumable order of a dataset's windows: a permutation per epoch (cached,
so O(num_windows) once per epoch, not per step), with window boundaries that move between epochs."""

from __future__ import annotations

import numpy as np

from loaders.windows import WindowDataset
from utils.errors import CheckpointError, ConfigError


class WindowOrder:
    """The endless, resumable order in which a dataset's windows are handed out: epoch 0's order,
    then epoch 1's, ... With shuffle=True each epoch's order is a fresh permutation from
    np.random.default_rng([seed, epoch]), and from epoch 1 on (with `random_offset`) the window
    boundaries move by a random offset drawn from the same generator, so every pair of adjacent
    tokens is a training pair in some epoch; epoch 0 keeps offset 0. An epoch whose offset leaves
    no room for the last window has one window fewer. An `aligned` dataset (window-sized bins of
    whole documents: chat) keeps offset 0 and every window in every epoch, only the order changes.
    With shuffle=False the order is 0, 1, 2, ...
    at offset 0 (validation). A request that reaches an epoch's end takes the rest from the start
    of the next epoch, so every window is handed out exactly once per epoch, none dropped or
    repeated at the boundary. The state counts windows, not batches or processes.
    """

    def __init__(self, dataset: WindowDataset, seed: int | tuple[int, ...], shuffle: bool, random_offset: bool = True):
        seed = tuple(int(s) for s in seed) if isinstance(seed, (tuple, list)) else (int(seed),)
        if min(seed) < 0:
            raise ConfigError(f"data_seed={seed[0]} must be a non-negative integer")
        self.dataset = dataset
        self.seed = seed  # parts of the generator's seed, the epoch appended
        self.shuffle = bool(shuffle)
        # Moving the boundaries of an aligned dataset would cut its documents across windows.
        self.random_offset = bool(random_offset) and self.shuffle and not getattr(dataset, "aligned", False)
        self._epoch = 0
        self._position = 0  # index into the current epoch's order of the next window to hand out
        self._order_epoch = -1
        self._order_N = np.zeros(0, np.int64)
        self._offset = 0

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's window order (and `_offset`), cached: a permutation costs O(num_windows) once
        per epoch, not per step."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            if self.shuffle:
                rng = np.random.default_rng([*self.seed, epoch])
                self._order_N = rng.permutation(n)
                self._offset = 0
                if self.random_offset and epoch > 0:
                    self._offset = int(rng.integers(0, self.dataset.window))
                    if self._offset > self.dataset.max_offset:  # the last window would run off the stream
                        self._order_N = self._order_N[self._order_N != n - 1]
            elif len(self._order_N) != n:
                self._order_N = np.arange(n)
            self._order_epoch = epoch
        return self._order_N

    def take(self, n: int) -> list[tuple[np.ndarray, int]]:
        """The next `n` windows as (window indices, offset) pieces: one per epoch touched."""
        pieces = []
        while n:  # once, twice at a boundary, more only if n > dataset
            order_N = self._order(self._epoch)
            take = min(n, len(order_N) - self._position)
            pieces.append((order_N[self._position : self._position + take], self._offset))
            n -= take
            self._position += take
            if self._position == len(order_N):
                self._epoch, self._position = self._epoch + 1, 0
        return pieces

    def state_dict(self) -> dict:
        """JSON-able; num_windows lets a resume notice that the dataset changed underneath it."""
        return {"epoch": self._epoch, "position": self._position, "num_windows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        num_windows = len(self.dataset)
        saved_windows = state.get("num_windows", num_windows)
        if saved_windows != num_windows:
            raise CheckpointError(
                f"the data iterator was saved over {saved_windows} windows but the dataset now has {num_windows}: "
                "resume with the same dataset, tokenizer and model.context_length; to train the loaded weights and "
                "optimizer state on another dataset, load with checkpoint.overwrite_data=true"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._order(epoch)):
            raise CheckpointError(
                f"data iterator state epoch={epoch} position={position} is invalid for {num_windows} windows: "
                "the checkpoint is corrupt; resume from another one or start a fresh run"
            )
        self._epoch, self._position = epoch, position
