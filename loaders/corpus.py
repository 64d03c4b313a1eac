"""Where documents come from: the Python standard library (offline default) or the user's text/jsonl files.

A document is a plain string. Train/val membership is decided per document by an md5 of a stable
key (a relative path, or path:line for jsonl), never by Python's salted `hash()` and never by
position, so adding a file does not reshuffle which of the old files are validation.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable

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
    root = stdlib_root()
    files = stdlib_files(include_tests)
    if not files:
        raise DataError(
            f"no .py files under the Python standard library at {root}: this Python ships without sources; "
            "set dataset.paths to your own text files"
        )
    keyed = [(os.path.relpath(path, root).replace(os.sep, "/"), _read_text(path)) for path in files]
    keyed = [(key, text) for key, text in keyed if text]  # empty __init__.py files would be lone eots
    return _split_or_raise(keyed, split, val_fraction, f"the standard library at {root}")


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
    keyed = []
    for path, key in _keyed_text_files(paths):
        if path.endswith(".jsonl"):
            keyed.extend(_jsonl_documents(path, key, text_key))
        else:
            text = _read_text(path)
            if text:
                keyed.append((key, text))
    if not keyed:
        raise DataError(f"dataset.paths={list(paths)} matches only empty files: point it at files that contain text")
    return _split_or_raise(keyed, split, val_fraction, f"dataset.paths={list(paths)}")


def corpus_fingerprint(files: Iterable[str], *extra: object) -> str:
    """Short hash of file names, sizes and mtimes (plus `extra`, e.g. split and tokenizer name) for cache keys.

    Stats, not contents: cheap enough to run on every start, and any edit changes size or mtime.
    """
    h = hashlib.md5()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", errors="replace"))
    for item in extra:
        h.update(f"{item!r}\n".encode("utf-8", errors="replace"))
    return h.hexdigest()[:16]
