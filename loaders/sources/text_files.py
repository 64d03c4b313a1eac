"""The user's corpus: globs of text files. A .jsonl file gives one document per line (field
`text_key`), any other file is one document. Split keys are paths relative to each glob's
literal prefix (plus `:line` for .jsonl), so moving the whole data directory keeps the split."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import ClassVar

from loaders import corpus
from utils.errors import ConfigError, DataError


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


def keyed_files(paths: list[str]) -> list[tuple[str, str]]:
    """(path, split key) of every file the globs match, in glob order then sorted, without duplicates."""
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


def _read_keyed(files: list[tuple[str, str]], paths: list[str], text_key: str) -> list[tuple[str, str]]:
    keyed = []
    for path, key in files:
        if path.endswith(".jsonl"):
            keyed.extend(_jsonl_documents(path, key, text_key))
        else:
            text = corpus.read_text(path)
            if text:
                keyed.append((key, text))
    if not keyed:
        raise DataError(f"dataset.paths={list(paths)} matches only empty files: point it at files that contain text")
    return keyed


@dataclass(frozen=True)
class TextFiles:
    name: ClassVar[str] = "text_files"

    paths: tuple[str, ...] = ()  # globs of .txt/.md/.py/.jsonl files; ~ and ** work
    text_key: str = "text"  # .jsonl: the field holding the text
    val_fraction: float = 0.05  # split by a stable hash of each file (or file:line for .jsonl)

    def check(self, prefix: str) -> None:
        corpus.check_val_fraction(prefix, self.val_fraction)
        if not self.paths:
            raise ConfigError(f"{prefix}.paths is empty: give globs of text files, e.g. dataset.paths='[data/*.txt]'")

    def documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        """(train, val): the globs are expanded and the files stat-fingerprinted now (a glob that matches
        nothing fails here), read on first access."""
        paths = [self.paths] if isinstance(self.paths, str) else list(self.paths)
        files = keyed_files(paths)
        return corpus.lazy_splits(
            [os.path.abspath(path) for path, _ in files],
            # The split keys decide membership, so they go in too. Keep these knobs as they are: they key caches.
            (self.name, self.val_fraction, self.text_key, [key for _, key in files]),
            lambda: _read_keyed(files, paths, self.text_key),
            self.val_fraction,
            f"dataset.paths={paths}",
        )
