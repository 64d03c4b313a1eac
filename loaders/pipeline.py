"""From a dataset config and a tokenizer to the run's batches: whichever kind of source, the
same resumable, prefetched, process-sharded iterator, plus the fingerprint that shows two runs
saw the same data."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable

from loaders.batching import BatchIterator
from loaders.config import DataRequest, DatasetConfig
from loaders.prefetch import Prefetcher
from loaders.tokens import cached_windows
from loaders.windows import WindowDataset, batch_tokens
from utils.errors import CheckpointError, ConfigError

# Batches hashed into data/fingerprint: enough to tell two orders apart, cheap to read twice.
FINGERPRINT_BATCHES = 2


def source_windows(source, req: DataRequest, docs=None) -> tuple:
    """(train, val) of any source: its own `windows(req)`, or (when it has none, or it returns None)
    its documents tokenized and cached (`docs`: the (train, val) Documents if the caller already
    listed them for the tokenizer, so they are not listed and read again)."""
    built = source.windows(req) if hasattr(source, "windows") else None
    if built is not None:
        return built
    docs = docs if docs is not None else source.documents()
    return tuple(cached_windows(split_docs, req.tokenizer, req.cache_dir, source.name, split, req.window,
                                req.document_mask) for split_docs, split in zip(docs, ("train", "val")))


def source_documents(source, needs_documents: bool, tokenizer_name: str):
    """The source's (train, val) Documents for a tokenizer that trains on text; None when the
    tokenizer needs none. A source without documents (token files) cannot train one."""
    if hasattr(source, "documents"):
        return source.documents()  # listed and fingerprinted; read only if a cache misses
    if needs_documents:
        raise ConfigError(f"tokenizer={tokenizer_name} trains on the dataset's text, but dataset={source.name} "
                          "gives token ids, not text: use tokenizer=byte or tokenizer=hf (the one it was "
                          "prepared with)")
    return None


def batch_maker(train, d: DatasetConfig, seed: int) -> Callable[[int, int], object]:
    """(process_index, process_count) -> a fresh iterator over the training batches."""
    shape = (d.accum_steps, d.batch_size)
    if isinstance(train, WindowDataset):
        return lambda index, count: BatchIterator(train, shape, seed, d.shuffle, index, count)
    if dataclasses.is_dataclass(train) and hasattr(train, "shuffle"):  # orders windows itself (mixture)
        train = dataclasses.replace(train, shuffle=d.shuffle)
    return lambda index, count: train.batches(shape, seed, index, count)


def data_fingerprint(make: Callable[[int, int], object], n: int = FINGERPRINT_BATCHES) -> str:
    """A hash of the first `n` global batches' tokens: the same data_seed and data give the same
    value whatever random_seed, process count or resume point."""
    it, h = make(0, 1), hashlib.md5()
    for _ in range(n):
        h.update(batch_tokens(next(it)).astype("int32").tobytes())
    if hasattr(it, "close"):
        it.close()
    return h.hexdigest()[:12]


def state_kind(state: dict) -> str:
    """Which kind of iterator saved `state`: windows (a fixed-size source's BatchIterator), mixture
    (components, each with its own window order) or stream (dataset=hf with streaming)."""
    if "components" in state:
        return "mixture"
    return "stream" if "record" in state else "windows"


def check_state_kind(state: dict, fresh: dict) -> None:
    """A checkpoint's data state must come from the kind of iterator this run builds (`fresh`: its
    state at the start): a run resumed with checkpoint.overwrite_config=true may switch datasets."""
    saved, now = state_kind(state), state_kind(fresh)
    if saved != now:
        raise CheckpointError(
            f"the checkpoint's data iterator is a {saved} state but this run's dataset gives {now}: a resumed run "
            "cannot switch the kind of dataset (windows / mixture / stream), even with "
            "checkpoint.overwrite_config=true; resume with the checkpoint's dataset, or load it with "
            "checkpoint.overwrite_data=true (weights and optimizer state kept, the new dataset from its start)")


@dataclass
class Data:
    train: object  # yields this process's rows of (accum_steps, batch_size, T+1); state_dict()/load_state_dict()
    val: WindowDataset  # evaluate() scores a fixed seeded subset of it (loaders.batching.eval_indices)
    tokens_per_step: int
    fingerprint: str  # data/fingerprint
    info: dict  # numbers a source reports (e.g. data/truncated), logged once

    def close(self) -> None:
        """Stop the train iterator's prefetch thread, if it has one."""
        if hasattr(self.train, "close"):
            self.train.close()


def build_data(d: DatasetConfig, req: DataRequest, seed: int, process_index: int, process_count: int,
               docs=None, state: dict | None = None, windows: tuple | None = None) -> Data:
    """The run's data; `state` (a checkpoint's) puts the train iterator where the run stopped; `windows`:
    the source's (train, val) windows if the caller built them already (source_windows)."""
    train, val = windows if windows is not None else source_windows(d.source, req, docs)
    make = batch_maker(train, d, seed)
    fingerprint = data_fingerprint(make)
    batches = make(process_index, process_count)
    if state is not None:
        check_state_kind(state, batches.state_dict())
    if d.prefetch:
        batches = Prefetcher(batches, d.prefetch)
    if state is not None:
        batches.load_state_dict(state)
    info = dict(getattr(train, "info", {}) or {})
    return Data(batches, val, d.accum_steps * d.batch_size * (req.window - 1), fingerprint, info)
