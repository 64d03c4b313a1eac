"""Pre-tokenized corpora as raw token files (nanoGPT's train.bin/val.bin), written once by
`scripts/prepare_data.py` and memory-mapped by every run (`dataset=memmap dataset.path=DIR`).

Why: tokenizing a large corpus (OpenWebText: ~9B GPT-2 tokens) takes hours on one core and the
text pipeline's cache lives per machine; a directory of token files is tokenized once, in
parallel, can be copied between machines, and a run reads only the windows it trains on.

The format, version `FORMAT_VERSION`, one directory:
- `train.bin`, `val.bin`: every document's ids followed by the tokenizer's eot id (exactly the
  stream `loaders.tokens.tokenize_documents` builds), raw little-endian uint16 when the
  vocabulary fits (`loaders.tokens.token_dtype`), else uint32; no header.
- `meta.json`: the tokenizer (name, fingerprint, its config section), vocab_size, eot_id, dtype,
  tokens and documents per split, the dataset section it came from.

A run must use the tokenizer the files were written with: the fingerprints are compared, and a
mismatch is refused before anything compiles. The writer lives here beside the reader so the
format has one owner; the script only parses its command line.
"""

from __future__ import annotations

import collections
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loaders.config import DataRequest
from loaders.tokenizers import Tokenizer
from loaders.tokens import token_dtype, tokenize_documents
from loaders.windows import WindowDataset
from utils.errors import ConfigError, DataError
from utils.files import atomic_write, user_path

FORMAT_VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
PREPARE = "python scripts/prepare_data.py"


def split_file(split: str) -> str:
    return f"{split}.bin"


def tokenizer_overrides(node: dict) -> str:
    """A tokenizer config section as the command-line overrides that select it again, e.g.
    `tokenizer=hf tokenizer.name_or_path=gpt2`: what a mismatch error tells the user to type."""

    def show(value) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    node = dict(node or {})
    parts = [f"tokenizer={node.pop('name', '?')}"]
    return " ".join(parts + [f"tokenizer.{k}={show(v)}" for k, v in sorted(node.items())])


# --- reading --------------------------------------------------------------------------------------


def read_meta(path: str) -> dict:
    """meta.json of a prepared directory, its fields checked; DataError naming the file otherwise."""
    if not os.path.isdir(path):
        raise DataError(f"dataset.path={path} is not a directory: run `{PREPARE} ... out={path}` first, "
                        "or point dataset.path at the directory it wrote")
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{meta_path} is missing: dataset.path must be a directory written by {PREPARE}; "
                        "re-run it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}): re-run {PREPARE}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(f"{meta_path} has format_version={found!r}, this eqtrain reads {FORMAT_VERSION}: "
                        f"re-run {PREPARE} to rewrite the directory")
    needed = ["tokenizer", "tokenizer_fingerprint", "vocab_size", "eot_id", "dtype"]
    needed += [f"{split}_tokens" for split in SPLITS]
    missing = [k for k in needed if k not in meta]
    if missing:
        raise DataError(f"{meta_path} lacks the field {missing[0]!r}: the file was edited or truncated; "
                        f"re-run {PREPARE}")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{meta_path} has dtype={meta['dtype']!r}, expected one of {', '.join(DTYPES)}: "
                        f"re-run {PREPARE}")
    return meta


def check_tokenizer(meta: dict, path: str, tok: Tokenizer) -> None:
    """The run's tokenizer must be the one that wrote the ids: same fingerprint, same vocabulary."""
    written = meta.get("tokenizer_config")
    how = f"run with {tokenizer_overrides(written)}" if written else "run with the tokenizer knobs prepare_data used"
    if meta["tokenizer_fingerprint"] != tok.fingerprint:
        raise DataError(
            f"dataset.path={path} was tokenized by {meta['tokenizer']!r} (fingerprint {meta['tokenizer_fingerprint']}) "
            f"but this run's tokenizer is {tok.name!r} (fingerprint {tok.fingerprint}): {how}, "
            f"or re-run {PREPARE} with this run's tokenizer knobs"
        )
    if meta["vocab_size"] != tok.vocab_size:
        raise DataError(
            f"{os.path.join(path, META)} says vocab_size={meta['vocab_size']} but tokenizer {tok.name!r} has "
            f"{tok.vocab_size} ids: {how}, or re-run {PREPARE}"
        )


def open_split(path: str, meta: dict, split: str) -> np.memmap:
    """One split's token file, memory-mapped read-only; its size must be what meta.json says."""
    file = os.path.join(path, split_file(split))
    if not os.path.isfile(file):
        raise DataError(f"{file} is missing: dataset.path={path} is incomplete; re-run {PREPARE}")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    tokens = meta[f"{split}_tokens"]
    size = os.path.getsize(file)
    if not isinstance(tokens, int) or size != tokens * dtype.itemsize:
        raise DataError(
            f"{file} has {size} bytes but {META} says {tokens} {meta['dtype']} tokens "
            f"({tokens * dtype.itemsize if isinstance(tokens, int) else '?'} bytes): the file is truncated or "
            f"from another run; re-run {PREPARE}"
        )
    if tokens == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(tokens,))


def split_windows(path: str, meta: dict, split: str, req: DataRequest) -> WindowDataset:
    tokens = open_split(path, meta, split)
    if len(tokens) < req.window:
        raise DataError(
            f"{os.path.join(path, split_file(split))} holds {len(tokens)} tokens, fewer than one window of "
            f"model.context_length+1={req.window}: lower model.context_length (or dataset.context_length), or "
            f"re-run {PREPARE} on more text{' or a larger dataset.val_fraction' if split == 'val' else ''}"
        )
    return WindowDataset(tokens, req.window, eot_id=int(meta["eot_id"]), document_mask=req.document_mask)


@dataclass(frozen=True)
class Memmap:
    """Token files written by scripts/prepare_data.py. No `documents()`: tokenizer=bpe, which trains
    on text, cannot be used with it (prepare_data refuses bpe for the same reason)."""

    name: ClassVar[str] = "memmap"

    path: str | None = None  # the directory prepare_data wrote (train.bin, val.bin, meta.json)

    def __post_init__(self):
        # Resolved once, here at the config boundary: relative to the working directory as typed.
        if self.path:
            object.__setattr__(self, "path", user_path(self.path))

    def check(self, prefix: str) -> None:
        if not self.path:
            raise ConfigError(f"{prefix}.path is empty: set it to the directory {PREPARE} wrote, "
                              f"e.g. {prefix}.path=data/owt")

    def windows(self, req: DataRequest) -> tuple[WindowDataset, WindowDataset]:
        """(train, val) windows read straight from the memory-mapped files: no token is loaded until
        a batch needs it, whatever the corpus size."""
        meta = read_meta(self.path)
        check_tokenizer(meta, self.path, req.tokenizer)
        train, val = (split_windows(self.path, meta, split, req) for split in SPLITS)
        return train, val


# --- writing --------------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _fork_is_safe() -> bool:
    """fork lets the workers inherit the tokenizer as built (no pickling, no re-download), but
    forking a process whose JAX backend has started its threads can deadlock (a test session, a
    notebook): spawn then, and where fork does not exist."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    try:
        from jax._src import xla_bridge  # private, hence the fallback: assume started

        return not xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return "jax" not in sys.modules


def _init_worker(tok: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok
    # One thread per worker: the workers are the parallelism (HF tokenizers would start a pool each).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_chunk(docs: list[str]) -> np.ndarray:
    return tokenize_documents(docs, _worker_tokenizer)


def _chunks(docs: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(docs), size):
        yield list(docs[start : start + size])


def encode_chunks(docs: Sequence[str], tok: Tokenizer, workers: int, pool=None,
                  docs_per_chunk: int = 256) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, their token stream) per chunk of `docs`, in order: each document's ids followed
    by eot, as `tokenize_documents` builds them, so the concatenation does not depend on `workers`
    or the chunking. At most 4 chunks per worker are in flight, so memory stays bounded."""
    size = max(1, min(docs_per_chunk, math.ceil(len(docs) / (4 * workers))))
    if pool is None:
        for chunk in _chunks(docs, size):
            yield len(chunk), tokenize_documents(chunk, tok)
        return
    pending: collections.deque = collections.deque()
    for chunk in _chunks(docs, size):
        pending.append((len(chunk), pool.apply_async(_encode_chunk, (chunk,))))
        if len(pending) >= 4 * workers:
            n, result = pending.popleft()
            yield n, result.get()
    while pending:
        n, result = pending.popleft()
        yield n, result.get()


class Progress:
    """One stderr line, rewritten at most twice a second (a new line every 30 s when stderr is a
    file or pipe, so logs stay short)."""

    def __init__(self, split: str, total_docs: int, stream=None):
        self.split, self.total = split, total_docs
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = 0

    def line(self) -> str:
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        return (f"{self.split}: {self.docs:,}/{self.total:,} documents  {self.tokens:,} tokens  "
                f"{rate / 1e6:.2f}M tokens/s")

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= (0.5 if self.tty else 30.0):
            self.last = now
            print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=self.stream, flush=True)

    def close(self) -> None:
        print(("\r" if self.tty else "") + self.line(), file=self.stream, flush=True)


def write_split(file: str, docs: Sequence[str], tok: Tokenizer, workers: int, pool=None, split: str = "",
                progress_stream=None) -> tuple[int, int]:
    """`docs` tokenized into the raw file `file`; (documents, tokens) written."""
    dtype = token_dtype(tok.vocab_size).newbyteorder("<")
    progress = Progress(split or os.path.basename(file), len(docs), progress_stream)
    with open(file, "wb") as f:
        for n, tokens in encode_chunks(docs, tok, workers, pool):
            f.write(tokens.astype(dtype, copy=False).tobytes())
            progress.update(n, len(tokens))
    progress.close()
    return progress.docs, progress.tokens


def check_out(out: str, force: bool, shown: str | None = None) -> None:
    """`out` must not exist, or (force) be an earlier output of prepare_data or empty: force never
    deletes a directory that holds anything else (a typo like out=. must not wipe a checkout)."""
    shown = shown or out
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out) or os.path.islink(out):
        raise ConfigError(f"out={shown} exists and is not a directory: choose another out")
    if not force:
        raise ConfigError(f"out={shown} already exists: pass force=true to replace it, or choose another out")
    if os.listdir(out) and not os.path.isfile(os.path.join(out, META)):
        raise ConfigError(f"out={shown} exists and was not written by prepare_data (no {META}): force=true only "
                          "replaces earlier outputs; choose another out")


def write_dataset(out: str, splits: dict[str, Sequence[str]], tok: Tokenizer, workers: int, *, force: bool = False,
                  extra_meta: dict | None = None, shown: str | None = None, progress_stream=None) -> dict:
    """Tokenize every split into `out` (train.bin, val.bin, meta.json); returns the meta.

    Atomic: everything is written into a hidden temporary directory beside `out` and renamed to
    `out` at the end, so a killed run leaves either no dataset or a whole one under `out` (at worst
    a `.NAME.*.tmp` directory to delete). `force` replaces an earlier output the same way."""
    check_out(out, force, shown)
    if workers < 1:
        raise ConfigError(f"workers={workers} must be >= 1")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # what os.makedirs would give; mkdtemp's 0700 would hide the data from others
    meta = {"format_version": FORMAT_VERSION, "tokenizer": tok.name, "tokenizer_fingerprint": tok.fingerprint,
            "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id), "dtype": token_dtype(tok.vocab_size).name,
            "byteorder": "little", **(extra_meta or {})}
    pool = None
    try:
        if workers > 1:
            method = "fork" if _fork_is_safe() else "spawn"
            pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (tok,))
        for split, docs in splits.items():
            n_docs, n_tokens = write_split(os.path.join(tmp, split_file(split)), docs, tok, workers, pool, split,
                                           progress_stream)
            meta[f"{split}_tokens"], meta[f"{split}_documents"] = n_tokens, n_docs
        with atomic_write(os.path.join(tmp, META)) as path, open(path, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        _replace_dir(tmp, out, force, shown or out)
    finally:
        if pool is not None:
            pool.terminate()
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _replace_dir(tmp: str, out: str, force: bool, shown: str) -> None:
    """Rename the finished `tmp` to `out`; an earlier output is moved aside first and deleted after."""
    check_out(out, force, shown)  # again: another run may have written out meanwhile
    old = None
    if os.path.isdir(out):
        old = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)), prefix=f".{os.path.basename(out)}.",
                               suffix=".old")
        os.replace(out, os.path.join(old, "data"))
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
