"""Documents -> one token stream -> fixed windows -> batches, with exactly resumable order.

numpy only: the training loop places each batch on the Mesh itself. Everything per step is a
handful of vectorised numpy calls on a cached permutation, so the real loader costs microseconds
next to a step, and there is never a Python loop over tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.corpus import in_memory_documents
from loaders.tokenizers import Tokenizer
from utils.errors import CheckpointError, ConfigError, DataError
from utils.files import atomic_write

# Fixed, not random_seed: every evaluation, resume and seed of a sweep scores the same windows, so
# val/loss compares across all of them.
VAL_SEED = 0


# The knobs every data source shares, in `conf/dataset/*.yaml` beside the source's own.
BATCH_KNOBS = ("batch_size", "total_batch_size", "context_length", "shuffle", "document_mask", "prefetch")


@dataclass(frozen=True)
class DatasetConfig:
    """The `dataset` section: which source (built by `loaders.dataset_config`) and the batch shape."""

    name: str = "stdlib"  # the source's registry name (loaders.sources.SOURCES)
    source: Any = None  # that source's config dataclass, e.g. loaders.sources.Stdlib(...)
    batch_size: int = 32  # sequences per micro-batch, global (all devices together)
    total_batch_size: int | None = None  # sequences per optimizer step; null = batch_size
    context_length: int | None = None  # null = model.context_length
    shuffle: bool = True  # a fresh permutation of training windows every epoch
    document_mask: bool = False  # attention, loss and positions stay inside each document of a packed window
    prefetch: int = 2  # batches a background thread keeps ready; 0 = read in the loop

    def check(self, prefix: str) -> None:
        if self.batch_size <= 0:
            raise ConfigError(f"{prefix}.batch_size={self.batch_size} must be positive")
        total = self.total_batch_size
        if total is not None and (total <= 0 or total % self.batch_size):
            raise ConfigError(
                f"{prefix}.total_batch_size={total} must be a positive multiple of "
                f"{prefix}.batch_size={self.batch_size} (gradient accumulation = total / batch)"
            )
        if self.prefetch < 0:
            raise ConfigError(f"{prefix}.prefetch={self.prefetch} must be >= 0 (0 reads batches in the loop)")
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError(f"{prefix}.context_length={self.context_length} must be positive or null")

    @property
    def accum_steps(self) -> int:
        return (self.total_batch_size or self.batch_size) // self.batch_size


def token_dtype(vocab_size: int) -> np.dtype:
    """Half the memory and disk of int32 for every vocabulary up to 64k ids, which is most of them."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def tokenize_documents(
    docs: list[str], tok: Tokenizer, cache_path: str | None = None, docs_per_batch: int = 512
) -> np.ndarray:
    """Encode and concatenate `docs`, each followed by `tok.eot_id`; reuse `cache_path` if it exists.

    The cache is trusted as is: the caller's path must encode corpus, split and tokenizer (see
    `corpus.corpus_fingerprint`). A hit is memory-mapped, so a large corpus costs no RAM up front.
    """
    dtype = token_dtype(tok.vocab_size)
    if cache_path is not None and os.path.exists(cache_path):
        tokens = np.load(cache_path, mmap_mode="r")
        if tokens.ndim == 1 and tokens.dtype == dtype:
            return tokens
        # A file of the wrong kind cannot be this tokenizer's output: recompute and overwrite it.

    eot_1 = np.array([tok.eot_id], dtype=np.int32)
    chunks = []
    for start in range(0, len(docs), docs_per_batch):
        ids_list = tok.encode_batch(list(docs[start : start + docs_per_batch]))  # parallel in Rust for BPE/HF
        chunk = np.concatenate([part for ids in ids_list for part in (np.asarray(ids, np.int32), eot_1)])
        if chunk.size and (chunk.min() < 0 or chunk.max() >= tok.vocab_size):
            raise DataError(
                f"tokenizer {tok.name!r} emitted id {int(chunk.max())} outside its vocab_size={tok.vocab_size}: "
                "its vocab_size is wrong; use another tokenizer.name_or_path or tokenizer=byte"
            )
        chunks.append(chunk.astype(dtype))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)

    if cache_path is not None:
        with atomic_write(cache_path) as tmp, open(tmp, "wb") as f:
            np.save(f, tokens)  # a file object: given a path, np.save would append .npy to the tmp name
    return tokens


@dataclass(frozen=True)
class DataRequest:
    """What a source that builds its own windows (`windows(req)`) is given: see loaders/sources/__init__.py."""

    tokenizer: Tokenizer
    cache_dir: str
    window: int  # context_length + 1 tokens per row
    document_mask: bool = False  # rows carry segment ids; attention and loss stay inside each document


def segment_ids(inputs_NxT: np.ndarray, eot_id: int) -> np.ndarray:
    """Document index of every input position, counted from the row's start: a document's eot
    belongs to it, the token after the eot starts the next one."""
    is_eot = (inputs_NxT == eot_id).astype(np.int32)
    return np.cumsum(is_eot, axis=-1) - is_eot


class WindowDataset:
    """Windows of `window` = context_length+1 tokens cut from a 1-D token stream (an array or a memmap).

    Window i at `offset` is stream[offset + i*window : offset + (i+1)*window]; `len()` counts the
    windows at offset 0 and `max_offset` is how far they can shift (the stream's leftover tokens, at
    most window-1), so a trainer can move the window boundaries every epoch. `aligned=True` pins
    them in every epoch (a stream laid out in window-sized bins, e.g. packed chat conversations).

    A row is the int32 token window, or a dict when the stream has a loss mask or documents are
    masked (`document_mask`): `tokens` (window), `loss_mask` (window-1, float32: 1 where the target
    token is trained on) and, with `document_mask`, `segment_ids` (window-1: attention stays inside
    each document, and the loss skips a target that starts the next document). Documents start
    after each eot, or where `doc_starts` (a uint8 stream beside the tokens) holds 1.
    Windows may start mid-document and span document ends: without document masks, the eot between
    documents is what tells the model a new one began.
    """

    def __init__(self, tokens: np.ndarray, window: int, *, loss_mask: np.ndarray | None = None,
                 eot_id: int | None = None, document_mask: bool = False, aligned: bool = False,
                 doc_starts: np.ndarray | None = None):
        tokens = np.asarray(tokens) if not isinstance(tokens, np.memmap) else tokens
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if window < 2:
            raise ValueError(f"window must be context_length+1 >= 2, got {window}")
        if loss_mask is not None and np.shape(loss_mask) != tokens.shape:
            raise ValueError(f"loss_mask has shape {np.shape(loss_mask)}, the tokens {tokens.shape}")
        if document_mask and eot_id is None and doc_starts is None:
            raise ValueError("document_mask needs the tokenizer's eot_id or the documents' starts")
        if doc_starts is not None and np.shape(doc_starts) != tokens.shape:
            raise ValueError(f"doc_starts has shape {np.shape(doc_starts)}, the tokens {tokens.shape}")
        num_windows = len(tokens) // window
        if num_windows == 0:
            raise DataError(
                f"the dataset has {len(tokens)} tokens, fewer than one window of model.context_length+1={window}: "
                "give the dataset more text (or raise dataset.val_fraction if this is the validation split), "
                "or lower model.context_length"
            )
        self.window = window
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.eot_id = eot_id
        self.document_mask = bool(document_mask)
        self.doc_starts = doc_starts
        self.num_windows = num_windows
        self.aligned = bool(aligned)  # the boundaries are the data's: never moved, no window dropped
        self.max_offset = 0 if aligned else min(window - 1, len(tokens) - num_windows * window)
        # A reshape of a contiguous prefix is a view: no copy of the stream, even when it is a memmap.
        self.windows_NxW = tokens[: num_windows * window].reshape(num_windows, window)

    def __len__(self) -> int:
        return self.num_windows

    @property
    def masked(self) -> bool:
        """Whether rows are dicts (a loss mask or segment ids) rather than bare token arrays."""
        return self.loss_mask is not None or self.document_mask

    def _rows(self, stream: np.ndarray, idx_N: np.ndarray, offset: int) -> np.ndarray:
        if offset == 0:
            return stream[: self.num_windows * self.window].reshape(self.num_windows, self.window)[idx_N]
        return stream[(idx_N * self.window + offset)[:, None] + np.arange(self.window)]

    def get(self, idx, offset: int = 0):
        """Rows for window indices `idx` (any shape) at `offset`: leaves of shape idx.shape + (...).
        int32 tokens: the embedding lookup wants signed ids, the stream stores uint16."""
        idx = np.asarray(idx)
        idx_N = idx.reshape(-1)
        if not 0 <= offset < self.window or (len(idx_N) and (idx_N.max() + 1) * self.window + offset > len(self.tokens)):
            raise ValueError(f"windows {idx_N.max()} at offset {offset} run past the stream's {len(self.tokens)} tokens")
        tokens_NxW = np.asarray(self._rows(self.tokens, idx_N, offset), dtype=np.int32)
        if not self.masked:
            return tokens_NxW.reshape(idx.shape + (self.window,))
        W = self.window
        weights_NxT = (np.ones((len(idx_N), W - 1), np.float32) if self.loss_mask is None
                       else np.asarray(self._rows(self.loss_mask, idx_N, offset)[:, 1:], np.float32))
        row = {"tokens": tokens_NxW}
        if self.document_mask:
            if self.doc_starts is None:  # a document starts after each eot
                starts_NxW = np.zeros(tokens_NxW.shape, np.int32)
                starts_NxW[:, 1:] = tokens_NxW[:, :-1] == self.eot_id
            else:  # given (chat templates may close every turn with the eot)
                starts_NxW = np.asarray(self._rows(self.doc_starts, idx_N, offset), np.int32)
            # segment of input t = starts in (0, t]; no loss on a target that starts the next document
            row["segment_ids"] = np.cumsum(starts_NxW[:, :-1], axis=-1) - starts_NxW[:, :1]
            weights_NxT = weights_NxT * (1 - starts_NxW[:, 1:])
        row["loss_mask"] = weights_NxT
        return {k: v.reshape(idx.shape + v.shape[1:]) for k, v in row.items()}


def concat_rows(rows: list):
    """Rows from several `get` calls (arrays or dicts alike) joined along the first axis."""
    if isinstance(rows[0], dict):
        return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    return np.concatenate(rows)


def batch_tokens(batch) -> np.ndarray:
    """The token array of a batch, whichever form it has."""
    return batch["tokens"] if isinstance(batch, dict) else batch


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
                "resume with the same dataset, tokenizer and model.context_length, or start a fresh run"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._order(epoch)):
            raise CheckpointError(
                f"data iterator state epoch={epoch} position={position} is invalid for {num_windows} windows: "
                "the checkpoint is corrupt; resume from another one or start a fresh run"
            )
        self._epoch, self._position = epoch, position


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


def cached_windows(docs, tokenizer: Tokenizer, cache_dir: str, source: str, split: str, window: int,
                   document_mask: bool = False) -> WindowDataset:
    """`docs` tokenized (or read from `cache_dir/tokens/`) and cut into windows of `window` tokens.
    The cache is keyed by the tokenizer's fingerprint (not its name: two BPEs share one) and the
    split's stat fingerprint, so a hit reads no corpus text and a retrained tokenizer never reuses ids."""
    docs = in_memory_documents(docs)  # a lazy corpus.Documents passes through unread
    readable = tokenizer.name.replace("/", "_").replace(":", "_")
    name = f"{source}-{split}-{readable}-{tokenizer.fingerprint}-{docs.fingerprint}.npy"
    tokens = tokenize_documents(docs, tokenizer, os.path.join(cache_dir, "tokens", name))
    return WindowDataset(tokens, window, eot_id=tokenizer.eot_id, document_mask=document_mask)
