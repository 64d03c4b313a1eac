"""Hugging Face `datasets` as a corpus (`dataset=hf`): a hub dataset, downloaded or streamed, or
local json/jsonl/csv/parquet/text files through the same `load_dataset` path (loaders.records).

A record's text is one field or several joined (loaders.records.record_text). Validation is a
named split (`val_split`) or, by default, the records of the train split whose text hashes below
`val_fraction` (md5 of the text, `corpus.is_val`): by content rather than by position because a
stream's order is shuffled shard by shard and epoch by epoch, so only the content names a record
the same way in both modes, and duplicates never straddle the two splits.

Two modes:
- `streaming=false`: `documents()` gives lazy (train, val) `corpus.Documents`, tokenized and
  cached by the pipeline. Local files are fingerprinted by their stats without being read; a hub
  dataset is loaded (memory-mapped from the datasets cache, cheap once downloaded) for the
  fingerprint `datasets` gives it.
- `streaming=true`: `windows(req)` gives an endless train stream (`HFStream`), read and tokenized
  as training goes, and validation read into memory (the first `max_val_documents` documents).
  Nothing is downloaded up front and nothing is cached.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from loaders import corpus
from loaders.batching import local_slots
from loaders.config import DataRequest
from loaders.records import (
    BadRecord,
    BadRecords,
    RecordSpec,
    as_globs,
    as_tuple,
    check_record_knobs,
    iter_records,
    load_records,
    local_files,
    record_text,
    shown_keys,
    text_fields,
)
from loaders.tokens import tokenize_documents
from loaders.windows import WindowDataset
from utils.errors import CheckpointError, ConfigError, DataError

# Bumped whenever which records land in which split changes: it keys the token caches.
_RECIPE = "hf-v1"
# Records read (and tokenized) at once: Arrow hands out columns far faster than single rows.
READ_BATCH = 512


def content_key(text: str) -> str:
    """The split key of a document: its text's md5 (surrogatepass: json allows lone surrogates)."""
    return hashlib.md5(text.encode("utf-8", "surrogatepass")).hexdigest()


def read_rows(records, columns: list[str] | None, start: int = 0) -> Iterator[tuple[int, dict]]:
    """(index, record) of a Dataset or IterableDataset from record `start` on, read a column batch
    at a time; `columns` (None: all) restricts what is read. Skipped records are never built."""
    if columns is not None:
        records = records.select_columns(columns)
    index = 0
    for batch in records.iter(batch_size=READ_BATCH):
        names = list(batch)
        size = len(batch[names[0]]) if names else 0
        if index + size <= start:
            index += size
            continue
        for values in zip(*(batch[c] for c in names)):
            if index >= start:
                yield index, dict(zip(names, values))
            index += 1


@dataclass(frozen=True)
class HF:
    name: ClassVar[str] = "hf"

    path: str = ""  # a hub dataset (org/name), a builder (json, csv, parquet, text) with data_files, or a directory
    subset: str | None = None  # the hub dataset's configuration (load_dataset's `name`)
    split: str = "train"  # the split trained on
    data_files: Any = None  # globs (one or a list) of local files for path=json/csv/parquet/text
    streaming: bool = False  # true: read the records as training goes, nothing downloaded up front
    text_field: Any = "text"  # the field holding the text, or a list of fields joined by a blank line
    val_split: str | None = None  # a split to validate on; null = hold out val_fraction of `split`
    val_fraction: float = 0.05  # with val_split null: share of records held out, by an md5 of their text
    shuffle_buffer: int = 10_000  # streaming: records in the shuffle buffer; 0 = the stream's own order
    skip_bad_records: bool = False  # true: skip (count, warn about) records without text; false: stop at the first
    max_val_documents: int = 2000  # streaming: validation documents read into memory

    def __post_init__(self):
        object.__setattr__(self, "data_files", as_globs(self.data_files))
        object.__setattr__(self, "text_field", as_tuple(self.text_field))

    def check(self, prefix: str) -> None:
        check_record_knobs(prefix, self.path, self.data_files, self.split, self.val_split, self.val_fraction,
                           "roneneldan/TinyStories")
        text_fields(self.text_field, f"{prefix}.text_field")
        if self.shuffle_buffer < 0:
            raise ConfigError(f"{prefix}.shuffle_buffer={self.shuffle_buffer} must be >= 0 (0 = no shuffling)")
        if self.max_val_documents < 1:
            raise ConfigError(f"{prefix}.max_val_documents={self.max_val_documents} must be positive")

    # --- records ----------------------------------------------------------------------------------

    @property
    def fields(self) -> tuple[str, ...]:
        return text_fields(self.text_field, "dataset.text_field")

    def spec(self, split: str, split_knob: str = "split") -> RecordSpec:
        return RecordSpec(self.path, self.subset, split, self.data_files, self.streaming, "dataset", split_knob)

    def label(self, split: str) -> str:
        """The records in error messages: what the user typed to get them."""
        where = f"dataset.data_files={list(self.data_files)}" if self.data_files else f"dataset.path={self.path!r}"
        return where + (f" subset {self.subset!r}" if self.subset else "") + f" split {split!r}"

    def _knobs(self) -> tuple:
        """What picks the documents and their split: part of every cache key. Keep as they are."""
        return (self.name, _RECIPE, self.path, self.subset, self.split, self.data_files, self.val_split,
                self.val_fraction, self.fields, self.skip_bad_records)

    def columns(self, records, split: str) -> list[str] | None:
        """The columns to read (None: unknown up front, as for some streams). A field that is no
        column at all, or a column that does not hold text, is a DataError now: every record would
        be bad, or (one of a list) the field name is mistyped."""
        features = getattr(records, "features", None)
        if features is None:
            return None
        knob = self.fields[0] if len(self.fields) == 1 else list(self.fields)
        for field in self.fields:
            if field not in features:
                raise DataError(f"dataset.text_field={knob!r}: {self.label(split)} has no column {field!r} "
                                f"(its columns: {shown_keys(features)}): set dataset.text_field to the column(s) "
                                "holding the text")
            dtype = getattr(features[field], "dtype", None)
            if dtype not in ("string", "large_string", "null"):
                raise DataError(f"dataset.text_field={knob!r}: column {field!r} of {self.label(split)} holds "
                                f"{features[field]}, not text: set dataset.text_field to the column(s) holding "
                                f"the text (its columns: {shown_keys(features)})")
        return list(dict.fromkeys(self.fields))

    def text(self, record: dict, where: str, keys, bad: BadRecords) -> str | None:
        """The record's text; None for a bad record that `bad` lets be skipped."""
        try:
            return record_text(record, self.fields)
        except BadRecord as e:
            bad(where, str(e), keys if keys is not None else record.keys())
            return None

    def is_val(self, text: str) -> bool:
        return self.val_split is None and corpus.is_val(content_key(text), self.val_fraction)

    # --- streaming=false: documents ---------------------------------------------------------------

    def _read(self, records, split: str) -> list[str]:
        """Every non-empty document of a loaded Dataset, in order; bad records as `skip_bad_records` says."""
        if len(records) == 0:
            raise DataError(f"{self.label(split)} has no records: check dataset.path, dataset.subset and "
                            "dataset.split (or dataset.data_files)")
        bad = BadRecords("dataset", self.fields, self.skip_bad_records)
        columns = self.columns(records, split)
        keys = records.column_names
        docs = [text for i, record in read_rows(records, columns)
                if (text := self.text(record, f"{self.label(split)} record {i}", keys, bad))]
        bad.report(len(records), self.label(split))
        if not docs:
            raise DataError(f"{self.label(split)}: none of its {len(records):,} records has text in dataset.text_field="
                            f"{self.text_field!r} ({bad.count:,} skipped as bad, the rest empty): check "
                            "dataset.text_field and the split")
        return docs

    def documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        """(train, val) documents, read on first access. With streaming=true there is no list of
        documents (that is the point of streaming): reading them is a ConfigError, which only a
        tokenizer that trains on text (tokenizer=bpe) does."""
        if self.streaming:
            return self._no_documents()
        files = local_files(self.spec(self.split))
        loaded: dict = {}
        identity: tuple = ()
        if files is None:  # the hub, or URLs: the loaded Dataset's own fingerprint names its content
            loaded["train"] = load_records(self.spec(self.split))
            if self.val_split is not None:
                loaded["val"] = load_records(self.spec(self.val_split, "val_split"))
            identity = tuple(getattr(ds, "_fingerprint", None) for ds in loaded.values())
            files = []

        def split_records(which: str):
            name = self.split if which == "train" else self.val_split
            if which not in loaded:
                loaded[which] = load_records(self.spec(name, "split" if which == "train" else "val_split"))
            return loaded[which], name

        if self.val_split is None:
            def read_keyed() -> list[tuple[str, str]]:
                return [(content_key(doc), doc) for doc in self._read(*split_records("train"))]

            return corpus.lazy_splits(files, (*self._knobs(), identity), read_keyed, self.val_fraction,
                                      self.label(self.split))

        def reader(which: str):
            def read() -> list[str]:
                return self._read(*split_records(which))

            return read

        return tuple(corpus.Documents(reader(s), corpus.corpus_fingerprint(files, s, *self._knobs(), identity))
                     for s in ("train", "val"))

    def _no_documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        def refuse() -> list[str]:
            raise ConfigError("dataset.streaming=true gives no list of documents, and this tokenizer trains on "
                              "them: use tokenizer=byte or tokenizer=hf, or set dataset.streaming=false")

        fingerprint = "hf-stream-" + hashlib.md5(repr(self._knobs()).encode()).hexdigest()[:16]
        return corpus.Documents(refuse, fingerprint), corpus.Documents(refuse, fingerprint)

    # --- windows, both modes ----------------------------------------------------------------------

    def windows(self, req: DataRequest):
        """streaming=true: (HFStream, the validation WindowDataset). streaming=false: None, so the
        pipeline tokenizes and caches `documents()` like any text source."""
        if not self.streaming:
            return None
        records = load_records(self.spec(self.split))
        stream = HFStream(self, records, self.columns(records, self.split), req)
        return stream, self._stream_val(req, records)

    def _stream_val(self, req: DataRequest, train_records) -> WindowDataset:
        """The first max_val_documents documents of val_split, or of the held-out share of the train
        split, in the stream's own (unshuffled) order: the same ones on every start."""
        name = self.val_split or self.split
        records = train_records if self.val_split is None else load_records(self.spec(name, "val_split"))
        columns = self.columns(records, name)
        bad = BadRecords("dataset", self.fields, self.skip_bad_records)
        label, keys, docs, read = self.label(name), column_names(records), [], 0
        for i, record in read_rows_checked(records, columns, self.spec(name)):
            read += 1
            text = self.text(record, f"{label} record {i}", keys, bad)
            if text and (self.val_split is not None or self.is_val(text)):
                docs.append(text)
                if len(docs) == self.max_val_documents:
                    break
        bad.report(read, label)
        held_out = "" if self.val_split else f" held out by dataset.val_fraction={self.val_fraction}"
        if not docs:
            raise DataError(f"{label} gives no validation documents{held_out} out of {read:,} records: "
                            + ("raise dataset.val_fraction" if held_out else "check dataset.val_split"))
        tok = req.tokenizer
        tokens = tokenize_documents(docs, tok)
        if len(tokens) < req.window:
            raise DataError(f"the {len(docs):,} validation documents of {label}{held_out} give {len(tokens):,} "
                            f"tokens, fewer than one window of context_length+1={req.window}: raise "
                            "dataset.max_val_documents" + (" or dataset.val_fraction" if held_out else ""))
        return WindowDataset(tokens, req.window, eot_id=tok.eot_id, document_mask=req.document_mask)


def column_names(records) -> list[str] | None:
    features = getattr(records, "features", None)
    return None if features is None else list(features)


def read_rows_checked(records, columns, spec: RecordSpec, start: int = 0) -> Iterator[tuple[int, dict]]:
    """`read_rows` with a failure while reading (a malformed file, a lost connection) a DataError."""
    return iter_records(read_rows(records, columns, start), spec)


class HFStream:
    """The train split as an endless stream of windows: epoch e is the split's records shuffled by
    `IterableDataset.shuffle(seed, shuffle_buffer)` with `set_epoch(e)` (deterministic for a seed:
    shards, then a buffer, both drawn from it), each document tokenized and followed by eot, the
    token stream cut into consecutive windows of `req.window` tokens; a window may span documents
    and the end of an epoch. Held-out validation documents and (with skip_bad_records) bad records
    are left out."""

    def __init__(self, source: HF, records, columns: list[str] | None, req: DataRequest):
        self.source, self.req = source, req
        self.keys = column_names(records)  # shown for a bad record: all of them, not just the ones read
        # Columns picked before shuffling: select_columns() of a shuffled stream forgets its set_epoch().
        self.records = records.select_columns(columns) if columns is not None else records

    def epoch_rows(self, seed: int, epoch: int, start: int) -> Iterator[tuple[int, dict]]:
        """(index, record) of epoch `epoch`'s order from record `start` on; skipped records are
        read but not tokenized, which is what makes resuming exact."""
        records = self.records
        if self.source.shuffle_buffer:
            records = records.shuffle(seed=seed, buffer_size=self.source.shuffle_buffer)
            records.set_epoch(epoch)
        return read_rows_checked(records, None, self.source.spec(self.source.split), start)

    def batches(self, batch_shape: tuple[int, ...], seed: int, process_index: int = 0,
                process_count: int = 1) -> StreamBatches:
        return StreamBatches(self, batch_shape, seed, process_index, process_count)


class StreamBatches:
    """Batches of shape batch_shape + (window,) from an HFStream, this process's rows of axis -2
    (every process reads the whole stream; `batching.local_slots` picks its rows).

    The state is where the next unread token is: (epoch, index in that epoch's order of the record
    whose document holds it, token offset into that document). Resuming replays the epoch's
    shuffled order up to that record without tokenizing, so the next batch is exactly the one an
    uninterrupted run would have read. It does not depend on the batch shape or process count.
    """

    def __init__(self, stream: HFStream, batch_shape: tuple[int, ...], seed: int, process_index: int = 0,
                 process_count: int = 1):
        batch_shape = tuple(int(b) for b in batch_shape)
        if not batch_shape or min(batch_shape) < 1:
            raise ValueError(f"batch_shape must be non-empty and positive, got {batch_shape}")
        if int(seed) < 0:
            raise ConfigError(f"data_seed={seed} must be a non-negative integer")
        self.stream, self.seed = stream, int(seed)
        self.window = stream.req.window
        self._slots = local_slots(batch_shape, process_index, process_count)
        self._windows = math.prod(batch_shape)
        self.bad = BadRecords("dataset", stream.source.fields, stream.source.skip_bad_records)
        self._restart(0, 0, 0)

    def _restart(self, epoch: int, record: int, offset: int) -> None:
        self._pending: deque[tuple[int, int, np.ndarray]] = deque()  # (epoch, record, tokens) not fully read
        self._offset = offset  # tokens of the first pending document (or the next one read) already read
        self._epoch, self._record = epoch, record  # the next record to read
        self._rows: Iterator | None = None
        self._epoch_docs = 0  # documents read in this epoch, if it was read from its start
        self._whole_epoch = record == 0
        self._expect = (epoch, record) if offset else None  # after a resume: the document the offset is into

    def _read(self) -> None:
        """Read and tokenize the next READ_BATCH documents into `_pending`."""
        src, tok = self.stream.source, self.stream.req.tokenizer
        texts, where = [], []
        while len(texts) < READ_BATCH:
            if self._rows is None:
                self._rows = self.stream.epoch_rows(self.seed, self._epoch, self._record)
            item = next(self._rows, None)
            if item is None:  # the epoch is over: the next one is a fresh shuffle
                if self._whole_epoch and not self._epoch_docs:
                    raise DataError(f"{src.label(src.split)} gives no training documents out of {self._record:,} "
                                    "records (held-out validation, empty and skipped records left out): check "
                                    "dataset.text_field and dataset.split")
                if self._whole_epoch:
                    self.bad.report(self._record, src.label(src.split))
                self._epoch, self._record, self._rows = self._epoch + 1, 0, None
                self._epoch_docs, self._whole_epoch = 0, True
                continue
            index, record = item
            self._record = index + 1
            text = src.text(record, f"{src.label(src.split)} record {index} (epoch {self._epoch})", self.stream.keys,
                            self.bad)
            if text and not src.is_val(text):
                texts.append(text)
                where.append((self._epoch, index))
                self._epoch_docs += 1
        eot_1 = np.array([tok.eot_id], np.int32)
        for (epoch, index), ids in zip(where, tok.encode_batch(texts)):
            ids = np.concatenate([np.asarray(ids, np.int32), eot_1])
            if ids.min() < 0 or ids.max() >= tok.vocab_size:
                raise DataError(f"tokenizer {tok.name!r} emitted id {int(ids.max())} outside its vocab_size="
                                f"{tok.vocab_size}: its vocab_size is wrong; use another tokenizer")
            self._pending.append((epoch, index, ids))

    def _take(self, n: int) -> np.ndarray:
        """The next `n` tokens of the stream."""
        out_N = np.empty(n, np.int32)
        filled = 0
        while filled < n:
            if not self._pending:
                self._read()
                continue
            epoch, index, ids = self._pending[0]
            if self._expect is not None:
                if (epoch, index) != self._expect or self._offset >= len(ids):
                    raise CheckpointError(
                        f"the data stream's state points into record {self._expect[1]} of epoch {self._expect[0]} "
                        f"at token {self._offset}, which the dataset no longer has there: resume with the same "
                        "dataset, knobs, tokenizer and data_seed, or start a fresh run")
                self._expect = None
            take = min(len(ids) - self._offset, n - filled)
            out_N[filled : filled + take] = ids[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(ids):
                self._pending.popleft()
                self._offset = 0
        return out_N

    def __iter__(self):
        return self

    def __next__(self):
        W = self.window
        tokens_NxW = self._take(self._windows * W).reshape(self._windows, W)
        local_MxW = tokens_NxW[self._slots.reshape(-1)]
        shape = self._slots.shape
        if not self.stream.req.document_mask:
            return local_MxW.reshape(shape + (W,))
        rows = WindowDataset(local_MxW.reshape(-1), W, eot_id=self.stream.req.tokenizer.eot_id,
                             document_mask=True).get(np.arange(len(local_MxW)))
        return {k: v.reshape(shape + v.shape[1:]) for k, v in rows.items()}

    def state_dict(self) -> dict:
        """JSON-able; `window` lets a resume notice a changed context_length."""
        epoch, record = self._pending[0][:2] if self._pending else (self._epoch, self._record)
        return {"epoch": epoch, "record": record, "offset": self._offset, "window": self.window}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, record, offset = int(state["epoch"]), int(state["record"]), int(state["offset"])
            window = int(state.get("window", self.window))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"data stream state {state!r} is not a dataset=hf streaming state: resume with "
                                  "the dataset the checkpoint was trained on, or start a fresh run") from None
        if window != self.window:
            raise CheckpointError(f"the data stream was saved with windows of {window} tokens, this run cuts "
                                  f"{self.window}: resume with the same model.context_length, or start a fresh run")
        if min(epoch, record, offset) < 0:
            raise CheckpointError(f"data stream state {state!r} is invalid: the checkpoint is corrupt; resume from "
                                  "another one or start a fresh run")
        self._restart(epoch, record, offset)


__all__ = ["HF", "HFStream", "StreamBatches", "content_key", "read_rows"]
