"""What every data source shares: lazy, fingerprinted train/val splits of documents.

The sources themselves (the Python standard library, the user's text/jsonl files, ...) live in
`loaders.sources`, one file each; each lists its files, then calls `lazy_splits`.

A document is a plain string. Train/val membership is decided per document by an md5 of a stable
key (a relative path, or path:line for jsonl), never by Python's salted `hash()` and never by
position, so adding a file does not reshuffle which of the old files are validation.
A run gets each split as `Documents`: fingerprinted from file stats up front, read only if a cache misses.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from utils.errors import ConfigError, DataError


def is_val(key: str, val_fraction: float) -> bool:
    """Stable across runs, machines and Python versions: the split must not move on restart."""
    return int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def check_fraction(val_fraction: float) -> None:
    """Where documents are split: 0 is allowed (every document is train; an empty val split then
    fails when it is read), so notebooks and tests can take a whole corpus."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"dataset.val_fraction={val_fraction} must be in [0, 1): e.g. 0.05 for 5% validation")


def check_val_fraction(prefix: str, val_fraction: float) -> None:
    """At the config boundary: a run evaluates, so its validation split must not be empty by design."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"{prefix}.val_fraction={val_fraction} must be in (0, 1)")


def read_text(path: str) -> str:
    """A text file as a document; undecodable bytes become U+FFFD rather than an error."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _split_or_raise(keyed_docs: list[tuple[str, str]], split: str, val_fraction: float, source: str) -> list[str]:
    """Keep the split's documents; an empty split is an error here, not a crash in the model later."""
    docs = [doc for key, doc in keyed_docs if is_val(key, val_fraction) == (split == "val")]
    if not docs:
        raise DataError(
            f"dataset.val_fraction={val_fraction} leaves split {split!r} empty out of {len(keyed_docs)} documents "
            f"from {source}: add more documents (one file = one document; .jsonl gives one per line) "
            "or change dataset.val_fraction"
        )
    return docs


def corpus_fingerprint(files: Iterable[str], *extra: object) -> str:
    """Short hash of file names, sizes and mtimes (plus `extra`: source, split and the knobs that pick documents).

    Stats, not contents: cheap enough to run on every start, and any edit changes size or mtime.
    Keys every cache built from a corpus (tokenized splits, the BPE's training sample).
    """
    h = hashlib.md5()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", errors="replace"))
    for item in extra:
        h.update(f"{item!r}\n".encode("utf-8", errors="replace"))
    return h.hexdigest()[:16]


# Bumped whenever what lands in a split changes (which files, keys, skipping empty documents...),
# so caches keyed by `Documents.fingerprint` are not reused across that change.
_SPLIT_RECIPE = "split-v1"


class Documents(Sequence[str]):
    """One split's documents, read on first access: a run whose caches all hit never reads the corpus.

    `fingerprint` is known up front from file stats (`corpus_fingerprint`), so caches can be keyed
    by it before any text is read.
    """

    def __init__(self, read: Callable[[], list[str]], fingerprint: str):
        self._read = read
        self._docs: list[str] | None = None
        self.fingerprint = fingerprint

    def _load(self) -> list[str]:
        if self._docs is None:
            self._docs = self._read()
            self._read = None  # drop the closure's reference to the corpus's shared text
        return self._docs

    def __len__(self) -> int:
        return len(self._load())

    def __getitem__(self, i):
        return self._load()[i]

    def __iter__(self):
        return iter(self._load())


def in_memory_documents(docs: Sequence[str]) -> Documents:
    """Documents already in memory (tests, notebooks): fingerprinted by content, having no files to stat."""
    if isinstance(docs, Documents):
        return docs
    docs = list(docs)
    h = hashlib.md5(_SPLIT_RECIPE.encode())
    for doc in docs:
        data = doc.encode("utf-8", errors="replace")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        h.update(data)
    return Documents(lambda: docs, "mem-" + h.hexdigest()[:16])


def lazy_splits(
    files: Sequence[str], knobs: tuple, read_keyed: Callable[[], list[tuple[str, str]]], val_fraction: float,
    source: str,
) -> tuple[Documents, Documents]:
    """(train, val) of one source: fingerprinted now from `files`' stats and `knobs` (the source's
    name first, then whatever picks its documents), read on first access by `read_keyed`, which
    returns (split key, document) pairs. `source` names the corpus in errors.

    The first split to be read reads every file once for both, since membership is decided per
    document. A source lists and stats its files before calling this (missing globs fail at once).
    """
    check_fraction(val_fraction)
    shared: list[list[tuple[str, str]]] = []  # filled by whichever split is read first

    def reader(split: str) -> Callable[[], list[str]]:
        def read() -> list[str]:
            if not shared:
                shared.append(read_keyed())
            return _split_or_raise(shared[0], split, val_fraction, source)

        return read

    return tuple(Documents(reader(s), corpus_fingerprint(files, _SPLIT_RECIPE, s, *knobs)) for s in ("train", "val"))


def sample_documents(docs: Sequence[str], n: int, seed: int) -> list[str]:
    """`n` documents drawn without replacement by `seed`, in corpus order: the first n in path
    order would be a few packages' worth of text, not a picture of the whole corpus."""
    if len(docs) <= n:
        return list(docs)
    idx_N = np.sort(np.random.default_rng(seed).permutation(len(docs))[:n])
    return [docs[i] for i in idx_N.tolist()]
