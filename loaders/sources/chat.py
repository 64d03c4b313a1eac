"""Chat / instruction fine-tuning data (`dataset=chat`): conversations rendered with a loss mask
(loaders/chat.py), packed whole into windows, so the model trains on the assistant's turns only.

Records come through `loaders.records` (the hub, or local json/jsonl/csv/parquet files). Each
conversation longer than a window (context_length+1 tokens) is cut to one, and they are counted
and reported, never silently. Conversations are then packed greedily in record order into bins of
exactly one window, the rest of a bin padded with eot tokens of mask 0, so no conversation
straddles two windows (and with `document_mask` none attends to another).

The packed tokens and masks of both splits are cached under `cache_dir/chat/`, keyed by the
tokenizer, its chat template, the window and the records (file stats for local files, the
Dataset's fingerprint for the hub), so a second run renders nothing and, for local files, reads
no records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from loaders import chat, corpus
from loaders.config import DataRequest
from loaders.records import RecordSpec, as_globs, check_record_knobs, iter_records, load_records, local_files
from loaders.tokenizers import Tokenizer
from loaders.tokens import token_dtype
from loaders.windows import WindowDataset
from utils.errors import ConfigError, DataError
from utils.files import atomic_write
from utils.logging.messages import warn

# Bumped whenever which records land in which split, or how they are packed, changes: it keys the caches.
_CHAT_RECIPE = "chat-source-v1"
SPLITS = ("train", "val")
PARTS = ("tokens", "mask", "starts")  # the cached arrays of each split, see `pack`


@dataclass(frozen=True)
class ChatStats:
    """Counts of one split, for logs: `metrics()` gives them under their `data/...` names."""

    conversations: int  # rendered and packed (truncated ones included)
    truncated: int  # longer than a window, cut to one
    skipped: int  # bad records skipped (dataset.skip_bad_records), over both splits
    tokens: int  # conversation tokens, after truncation, before padding
    windows: int
    window: int  # tokens per window: context_length+1

    def metrics(self) -> dict[str, float]:
        """Stable names for the run's sinks; padding_fraction is the share of window tokens that are pads."""
        return {"data/conversations": self.conversations, "data/truncated": self.truncated,
                "data/skipped_records": self.skipped,
                "data/padding_fraction": 1.0 - self.tokens / max(1, self.windows * self.window)}


def pack(convs: list[tuple[np.ndarray, np.ndarray]], window: int, eot_id: int,
         dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Conversations (each at most `window` tokens) -> (tokens, mask, starts) of n_bins*window,
    next-fit in order: a conversation that does not fit the current bin's rest starts the next bin,
    the rest padded with eot tokens of mask 0. `starts` is 1 at each conversation's first token
    and at the padding's: the document boundaries for `document_mask`, which cannot be read off
    the eots when a chat template closes every turn with the eot."""
    starts, fill, n_bins = [], window, 0  # fill = tokens used in the current bin; full at first: opens bin 0
    for ids_N, _ in convs:
        if fill + len(ids_N) > window:
            n_bins, fill = n_bins + 1, 0
        starts.append((n_bins - 1) * window + fill)
        fill += len(ids_N)
    tokens = np.full(n_bins * window, eot_id, dtype)
    mask = np.zeros(n_bins * window, np.uint8)
    doc_starts = np.zeros(n_bins * window, np.uint8)
    for start, (ids_N, mask_N) in zip(starts, convs):
        tokens[start : start + len(ids_N)] = ids_N
        mask[start : start + len(ids_N)] = mask_N
        doc_starts[start] = 1
        end = start + len(ids_N)
        if end % window:  # the padding after it, if the bin has any, is a document of its own
            doc_starts[end] = 1
    return tokens, mask, doc_starts


@dataclass(frozen=True)
class Chat:
    name: ClassVar[str] = "chat"
    loss_masked: ClassVar[bool] = True  # trains on the assistant's turns only: token files (prepare_data) can't hold it

    path: str = ""  # a hub dataset (org/name), a builder (json, csv, parquet) with data_files, or a local directory
    subset: str | None = None  # the hub dataset's configuration (load_dataset's `name`)
    split: str = "train"  # the split trained on, e.g. train_sft
    data_files: Any = None  # globs (one or a list) of local files for path=json/csv/parquet
    val_split: str | None = None  # a split to validate on, e.g. test_sft; null = hold out val_fraction of `split`
    val_fraction: float = 0.05  # with val_split null: share of records held out, by an md5 of the record index
    template: str = "auto"  # auto: the tokenizer's chat_template if it has one, else the plain one; plain: always plain
    skip_bad_records: bool = False  # true: skip (count, warn about) records no format matches; false: stop at the first

    def __post_init__(self):
        object.__setattr__(self, "data_files", as_globs(self.data_files))

    def check(self, prefix: str) -> None:
        check_record_knobs(prefix, self.path, self.data_files, self.split, self.val_split, self.val_fraction,
                           "HuggingFaceH4/ultrachat_200k")
        if self.template not in chat.TEMPLATES:
            raise ConfigError(f"{prefix}.template={self.template!r} is unknown: "
                              f"choose one of {', '.join(chat.TEMPLATES)}")

    # --- records ------------------------------------------------------------------------------

    def _spec(self, split: str) -> RecordSpec:
        knob = "val_split" if split == self.val_split else "split"
        return RecordSpec(self.path, self.subset, split, self.data_files, split_knob=knob)

    def _knobs(self) -> tuple:
        """What picks the records and their split: part of every cache key. Keep as they are."""
        return (_CHAT_RECIPE, self.path, self.subset, self.split, self.val_split, self.val_fraction,
                self.skip_bad_records)

    def _fingerprint(self) -> tuple[str, dict | None]:
        """(fingerprint of the records, the loaded Datasets or None). Local files (data_files, or a
        local directory) are fingerprinted by their stats without reading them; anything else is
        loaded (memory-mapped from the datasets cache) and fingerprinted by `datasets` itself."""
        files = local_files(self._spec(self.split))
        if files is not None:
            return corpus.corpus_fingerprint(files, *self._knobs()), None
        loaded = self._load()
        parts = [getattr(ds, "_fingerprint", None) for ds in loaded.values()]
        h = hashlib.md5(repr((parts, self._knobs())).encode())
        return "ds-" + h.hexdigest()[:16], loaded

    def _load(self) -> dict:
        loaded = {"train": load_records(self._spec(self.split))}
        if self.val_split is not None:
            loaded["val"] = load_records(self._spec(self.val_split))
        return loaded

    def _records(self, loaded: dict | None) -> Iterator[tuple[str, str, dict]]:
        """(split, where, record) of every record, one at a time: the val split's own records, or
        the train split's held out by an md5 of the record's index (stable: a record never changes side)."""
        loaded = loaded or self._load()
        label = f"dataset.path={self.path}" if not self.data_files else f"dataset.data_files={list(self.data_files)}"
        if "val" in loaded:
            for split, name in (("train", self.split), ("val", self.val_split)):
                for i, record in enumerate(iter_records(loaded[split], self._spec(name))):
                    yield split, f"{label} split {name!r} record {i}", record
            return
        for i, record in enumerate(iter_records(loaded["train"], self._spec(self.split))):
            yield "val" if corpus.is_val(str(i), self.val_fraction) else "train", f"{label} record {i}", record

    def _read(self, loaded: dict | None, convert: Callable, emit: Callable, chunk: int = 1024) -> dict:
        """`convert(where, record)` on every record, handed to `emit(split, results)` a chunk at a
        time (so no split's records or texts are all held at once) -> counts {records, skipped,
        first_skip, train, val}. A BadRecord stops the run unless skip_bad_records; a split left
        with no conversation is a DataError here, before any training."""
        counts = {"records": 0, "skipped": 0, "first_skip": "", "train": 0, "val": 0}
        pending: dict[str, list] = {s: [] for s in SPLITS}
        for split, where, record in self._records(loaded):
            counts["records"] += 1
            try:
                pending[split].append(convert(where, record))
            except chat.BadRecord as e:
                if not self.skip_bad_records:
                    raise
                counts["skipped"] += 1
                counts["first_skip"] = counts["first_skip"] or str(e)
                continue
            counts[split] += 1
            if len(pending[split]) >= chunk:
                emit(split, pending[split])
                pending[split] = []
        for split in SPLITS:
            if pending[split]:
                emit(split, pending[split])
            if not counts[split]:
                first = counts["first_skip"]
                raise DataError(
                    f"dataset=chat: the {split} split has no usable conversation out of {counts['records']:,} records "
                    f"({counts['skipped']:,} skipped{'; the first: ' + first if first else ''}): "
                    + ("set dataset.val_split to a non-empty split" if split == "val" and self.val_split
                       else "raise dataset.val_fraction or give more records" if split == "val"
                       else "check dataset.path/data_files and give records with " + chat.FORMATS)
                )
        return counts

    # --- text, for tokenizers that train on it ------------------------------------------------

    def documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        """(train, val) conversations as plain-template text (the tokenizer is not known yet when a
        BPE is trained on them). Local files are fingerprinted now and read on first access; a hub
        dataset is loaded now (memory-mapped) for its fingerprint."""
        fingerprint, loaded = self._fingerprint()
        texts: dict[str, list[str]] = {}  # filled by whichever split is read first

        def reader(split: str):
            def read() -> list[str]:
                if not texts:
                    texts.update({s: [] for s in SPLITS})
                    try:
                        self._read(loaded, lambda where, record: chat.plain_text(chat.to_turns(record, where)),
                                   lambda s, items: texts[s].extend(items))
                    except BaseException:
                        texts.clear()
                        raise
                return texts[split]

            return read

        return tuple(corpus.Documents(reader(s), f"chat-{s}-{fingerprint}") for s in SPLITS)

    # --- windows ------------------------------------------------------------------------------

    def _render(self, tok: Tokenizer, window: int, loaded: dict | None) -> tuple[dict, dict]:
        """Read, render, count, truncate and pack both splits -> ({split: (tokens, mask)}, counts:
        {split: {...}} plus the records read and skipped)."""
        dtype = token_dtype(tok.vocab_size)
        convs: dict[str, list] = {s: [] for s in SPLITS}  # (ids in the token dtype, mask), cut to the window
        lengths: dict[str, list[int]] = {s: [] for s in SPLITS}  # before the cut
        interior = {s: 0 for s in SPLITS}  # conversations with an eot before their end

        def emit(split: str, pieces: list) -> None:
            for ids_N, mask_N in chat.render_many(pieces, tok):
                if len(ids_N) and (ids_N.min() < 0 or ids_N.max() >= tok.vocab_size):
                    raise DataError(f"tokenizer {tok.name!r} emitted id {int(ids_N.max())} outside its "
                                    f"vocab_size={tok.vocab_size}: use another tokenizer.name_or_path "
                                    "or tokenizer=byte")
                lengths[split].append(len(ids_N))
                interior[split] += bool((ids_N[1:-1] == tok.eot_id).any())
                convs[split].append((ids_N[:window].astype(dtype), mask_N[:window]))

        counts = self._read(loaded, lambda where, record: chat.pieces(chat.to_turns(record, where), tok,
                                                                     self.template, where), emit)
        packed, stats = {}, {k: counts[k] for k in ("records", "skipped", "first_skip")}
        for split in SPLITS:
            lengths_N = np.asarray(lengths[split], np.int64)
            tokens, mask, doc_starts = pack(convs.pop(split), window, tok.eot_id, dtype)
            packed[split] = (tokens, mask, doc_starts)
            stats[split] = {"conversations": len(lengths_N), "truncated": int((lengths_N > window).sum()),
                            "tokens": int(np.minimum(lengths_N, window).sum()), "windows": len(tokens) // window,
                            "interior_eot": interior[split], "masked": int(mask.sum())}
        return packed, stats

    def _cache_base(self, req: DataRequest, fingerprint: str) -> str:
        tok = req.tokenizer
        key = hashlib.md5(repr((fingerprint, tok.fingerprint, chat.template_fingerprint(tok, self.template),
                                chat.RENDER_RECIPE, req.window)).encode()).hexdigest()[:16]
        readable = tok.name.replace("/", "_").replace(":", "_")
        return os.path.join(req.cache_dir, "chat", f"{readable}-w{req.window}-{key}")

    def windows(self, req: DataRequest) -> tuple[WindowDataset, WindowDataset]:
        """(train, val) WindowDatasets of packed conversations with their loss masks, each with a
        `stats` attribute (ChatStats) and `info`, its `data/...` metrics (data/truncated, ...)."""
        tok = req.tokenizer
        fingerprint, loaded = self._fingerprint()
        base = self._cache_base(req, fingerprint)
        meta_path = base + ".json"
        arrays, stats = None, None
        if os.path.exists(meta_path):  # written last: its presence means all four arrays are whole
            try:
                with open(meta_path, encoding="utf-8") as f:
                    stats = json.load(f)["stats"]
                arrays = {s: tuple(np.load(f"{base}-{s}-{part}.npy", mmap_mode="r") for part in PARTS)
                          for s in SPLITS}
                dtype = token_dtype(tok.vocab_size)
                if any(t.dtype != dtype or m.shape != t.shape or d.shape != t.shape or t.ndim != 1
                       or len(t) % req.window for t, m, d in arrays.values()):
                    arrays = None  # not this recipe's output: rebuild and overwrite it
            except (OSError, ValueError, KeyError, TypeError):  # a damaged cache: rebuild and overwrite it
                arrays = None
        if arrays is None:
            arrays, stats = self._render(tok, req.window, loaded)
            for s in SPLITS:
                for part, array in zip(PARTS, arrays[s]):
                    with atomic_write(f"{base}-{s}-{part}.npy") as tmp, open(tmp, "wb") as f:
                        np.save(f, array)
            with atomic_write(meta_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                json.dump({"stats": stats, "dataset": self._knobs()}, f)
        self._report(stats, req)
        out = []
        for s in SPLITS:
            tokens, mask, doc_starts = arrays[s]
            ds = WindowDataset(tokens, req.window, loss_mask=mask, eot_id=tok.eot_id, doc_starts=doc_starts,
                               document_mask=req.document_mask, aligned=True)
            ds.stats = ChatStats(stats[s]["conversations"], stats[s]["truncated"], stats["skipped"],
                                 stats[s]["tokens"], stats[s]["windows"], req.window)
            ds.info = ds.stats.metrics()  # what the pipeline logs once (loaders.pipeline.Data.info)
            out.append(ds)
        return tuple(out)

    def _report(self, stats: dict, req: DataRequest) -> None:
        """Warnings that must reach the user on every run, cache hit or not."""
        if stats["train"]["masked"] == 0:
            if stats["train"]["truncated"]:
                raise DataError(f"dataset=chat: truncating conversations to context_length+1={req.window} tokens cut "
                                "every assistant turn of the train split: raise model.context_length")
            raise DataError("dataset=chat: no conversation of the train split has an assistant turn to train on: "
                            "roles must be 'assistant' (ShareGPT: 'gpt'); check the records' roles")
        if stats["skipped"]:
            skipped, total = stats["skipped"], stats["records"]
            warn(f"dataset=chat: skipped {skipped:,} of {total:,} records ({skipped / total:.1%}) that are not usable "
                 f"conversations (dataset.skip_bad_records=true); the first: {stats['first_skip']}")
        n = sum(stats[s]["conversations"] for s in SPLITS)
        cut = sum(stats[s]["truncated"] for s in SPLITS)
        if cut:
            warn(f"dataset=chat: {cut:,} of {n:,} conversations ({cut / n:.1%}) are longer than "
                 f"context_length+1={req.window} tokens and were truncated; raise model.context_length "
                 "(or dataset.context_length) to keep them whole")
