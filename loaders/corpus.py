"""Where documents come from: the Python standard library (offline default) or the user's text/jsonl files.

A document is a plain string. Train/val membership is decided per document by an md5 of a stable
key (a relative path, or path:line for jsonl), never by Python's salted `hash()` and never by
position, so adding a file does not reshuffle which of the old files are validation.
A run gets each split as `Documents`: fingerprinted from file stats up front, read only if a cache misses.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from utils.errors import ConfigError, DataError

_ALWAYS_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})  # idle_test lives at idlelib/idle_test


def is_val(key: str, val_fraction: float) -> bool:
    """Stable across runs, machines and Python versions: the split must not move on restart."""
    return int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def _check_split(split: str, val_fraction: float) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"dataset.val_fraction={val_fraction} must be in [0, 1): e.g. 0.05 for 5% validation")


def _read_text(path: str) -> str:
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


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(include_tests: bool = False) -> list[str]:
    """Absolute paths of the stdlib's .py files, sorted by relative path: a few MB of real code on every machine."""
    root = stdlib_root()
    skipped = _ALWAYS_SKIPPED_DIRS if include_tests else _ALWAYS_SKIPPED_DIRS | _TEST_DIRS
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped]  # prune: test/ alone is a third of the stdlib
        rel_dir = os.path.relpath(dirpath, root)
        for fname in filenames:
            if fname.endswith(".py"):
                relpaths.append(os.path.normpath(os.path.join(rel_dir, fname)).replace(os.sep, "/"))
    return [os.path.join(root, rel) for rel in sorted(relpaths)]


def stdlib_documents(split: str, val_fraction: float = 0.05, include_tests: bool = False) -> list[str]:
    """The default offline corpus: one document per stdlib source file, split on its relative path."""
    _check_split(split, val_fraction)
    keyed = _stdlib_keyed(stdlib_files(include_tests))
    return _split_or_raise(keyed, split, val_fraction, f"the standard library at {stdlib_root()}")


def _stdlib_keyed(files: list[str]) -> list[tuple[str, str]]:
    root = stdlib_root()
    if not files:
        raise DataError(
            f"no .py files under the Python standard library at {root}: this Python ships without sources; "
            "set dataset.paths to your own text files"
        )
    keyed = [(os.path.relpath(path, root).replace(os.sep, "/"), _read_text(path)) for path in files]
    return [(key, text) for key, text in keyed if text]  # empty __init__.py files would be lone eots


def _glob_base(pattern: str) -> str:
    """The literal directory prefix of a glob, so split keys survive moving the whole data directory."""
    parts = pattern.split(os.sep)
    literal = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        literal.append(part)
    if not literal:
        return "."
    return os.sep.join(literal) or os.sep  # [""] is the root of an absolute pattern like /*.txt


def text_files(paths: list[str]) -> list[str]:
    """Every file the globs match, in glob order then sorted, without duplicates (e.g. for corpus_fingerprint)."""
    return [path for path, _ in _keyed_text_files(paths)]


def _keyed_text_files(paths: list[str]) -> list[tuple[str, str]]:
    """(path, split key): the key is relative to the glob's literal prefix, so moving the data keeps the split."""
    if isinstance(paths, str):
        paths = [paths]  # a lone string would otherwise be iterated character by character
    if not paths:
        raise DataError("dataset.paths is empty: set it to one or more globs, e.g. dataset.paths='[data/**/*.txt]'")
    files, seen = [], set()
    for pattern in paths:
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matches:
            raise DataError(
                f"dataset.paths entry {pattern!r} matches no files: fix the path (globs like data/**/*.jsonl "
                f"are expanded; the working directory is {os.getcwd()})"
            )
        base = _glob_base(pattern)
        for path in matches:
            real = os.path.realpath(path)
            if real not in seen:
                seen.add(real)
                files.append((path, os.path.relpath(path, base).replace(os.sep, "/")))
    return files


def _jsonl_documents(path: str, key: str, text_key: str) -> list[tuple[str, str]]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg}): fix the line or remove it") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                fields = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{path}:{lineno} has no string field dataset.text_key={text_key!r} (found {fields}): "
                    "set dataset.text_key to the field holding the text"
                )
            if text:
                docs.append((f"{key}:{lineno}", text))
    return docs


def text_file_documents(paths: list[str], split: str, val_fraction: float, text_key: str = "text") -> list[str]:
    """The user's corpus: .jsonl gives one document per line (field `text_key`), any other file is one document."""
    _check_split(split, val_fraction)
    if isinstance(paths, str):
        paths = [paths]
    keyed = _text_files_keyed(_keyed_text_files(paths), paths, text_key)
    return _split_or_raise(keyed, split, val_fraction, f"dataset.paths={list(paths)}")


def _text_files_keyed(keyed_files: list[tuple[str, str]], paths: list[str], text_key: str) -> list[tuple[str, str]]:
    keyed = []
    for path, key in keyed_files:
        if path.endswith(".jsonl"):
            keyed.extend(_jsonl_documents(path, key, text_key))
        else:
            text = _read_text(path)
            if text:
                keyed.append((key, text))
    if not keyed:
        raise DataError(f"dataset.paths={list(paths)} matches only empty files: point it at files that contain text")
    return keyed


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


def split_documents(
    name: str, val_fraction: float, include_tests: bool = False, paths: Sequence[str] = (), text_key: str = "text"
) -> tuple[Documents, Documents]:
    """(train, val) of source `name` (stdlib | text_files), fingerprinted now and read on first access.

    Listing and stat-ing the files is all that happens here (missing globs still fail at once). The
    first split to be read reads every file once for both, since membership is decided per document.
    """
    for split in ("train", "val"):
        _check_split(split, val_fraction)
    if name == "stdlib":
        files = stdlib_files(include_tests)
        source = f"the standard library at {stdlib_root()}"
        knobs: tuple = (name, val_fraction, include_tests)

        def read_keyed() -> list[tuple[str, str]]:
            return _stdlib_keyed(files)

    elif name == "text_files":
        paths = [paths] if isinstance(paths, str) else list(paths)
        keyed_files = _keyed_text_files(paths)
        files = [os.path.abspath(path) for path, _ in keyed_files]
        source = f"dataset.paths={paths}"
        # The split keys (paths relative to each glob's literal prefix) decide membership: they go in too.
        knobs = (name, val_fraction, text_key, [key for _, key in keyed_files])

        def read_keyed() -> list[tuple[str, str]]:
            return _text_files_keyed(keyed_files, paths, text_key)

    else:
        raise ConfigError(f"dataset.name={name!r} is unknown: use stdlib or text_files")

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
