"""JSON-lines files (`dataset=jsonl`): one record per line, its text one field or several joined
(loaders.records.record_text).

Read line by line here rather than by the `datasets` json builder, so a malformed line is named
as `file:line` (the builder reports a row of an Arrow block) and one bad line can be skipped
instead of failing a whole file. Split keys are `relative path:line`, as text_files gives .jsonl
lines, so moving the data directory keeps the split. Files ending in .gz are read decompressed.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from loaders import corpus
from loaders.records import BadRecord, BadRecords, as_tuple, record_text, shown_keys, text_fields
from loaders.sources.text_files import keyed_files
from utils.errors import ConfigError, DataError

# Bumped whenever which lines land in which split, or what text a line gives, changes: it keys the caches.
_RECIPE = "jsonl-v1"


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")  # a stray byte is U+FFFD, not a lost file


def read_jsonl(files: list[tuple[str, str]], fields: tuple[str, ...], bad: BadRecords, source: str
               ) -> list[tuple[str, str]]:
    """(split key, text) of every line with text; blank lines are ignored, bad lines go to `bad`.
    A field of a list that no record has is a DataError: it is mistyped, and would drop silently."""
    keyed, total, seen, first_keys = [], 0, set(), None
    for path, key in files:
        with _open(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                total += 1
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    bad(f"{path}:{lineno}", f"is not valid JSON ({e.msg} at column {e.colno})", malformed=True)
                    continue
                if isinstance(record, dict):
                    seen.update(field for field in fields if field in record)
                    first_keys = record.keys() if first_keys is None else first_keys
                try:
                    text = record_text(record, fields)
                except BadRecord as e:
                    bad(f"{path}:{lineno}", str(e), record.keys() if isinstance(record, dict) else None)
                    continue
                if text:
                    keyed.append((f"{key}:{lineno}", text))
    if not total:
        raise DataError(f"{source} holds no records (every file is empty): point dataset.paths at files with "
                        "one JSON object per line")
    missing = [field for field in fields if field not in seen]
    if len(fields) > 1 and missing and seen:
        raise DataError(f"dataset.text_field entry {missing[0]!r} is in no record of {source} (the first record's "
                        f"keys: {shown_keys(first_keys or ())}): fix the field name or drop it from the list")
    bad.report(total, source)
    if not keyed:
        raise DataError(f"{source}: none of its {total:,} records has text in dataset.text_field="
                        f"{fields[0] if len(fields) == 1 else list(fields)!r} ({bad.count:,} skipped as bad, the rest "
                        "empty): check dataset.text_field")
    return keyed


@dataclass(frozen=True)
class Jsonl:
    name: ClassVar[str] = "jsonl"

    paths: Any = ()  # globs (one or a list) of JSON-lines files (.jsonl, .json, .jsonl.gz); ~ and ** work
    text_field: Any = "text"  # the field holding the text, or a list of fields joined by a blank line
    val_fraction: float = 0.05  # share of lines held out, by a stable hash of file:line
    skip_bad_records: bool = False  # true: skip (count, warn about) malformed lines and records without text

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, str) else as_tuple(self.paths)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "text_field", as_tuple(self.text_field))

    def check(self, prefix: str) -> None:
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            raise ConfigError(f"{prefix}.paths={list(self.paths) if self.paths else []} must be one or more globs "
                              f"of .jsonl files, e.g. '{prefix}.paths=[data/*.jsonl]'")
        text_fields(self.text_field, f"{prefix}.text_field")
        corpus.check_val_fraction(prefix, self.val_fraction)

    def documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        """(train, val): the globs are expanded and the files stat-fingerprinted now (a glob that
        matches nothing fails here), read on first access."""
        paths = list(self.paths)
        files = keyed_files(paths)
        fields = text_fields(self.text_field, "dataset.text_field")
        source = f"dataset.paths={paths}"

        def read_keyed() -> list[tuple[str, str]]:
            return read_jsonl(files, fields, BadRecords("dataset", fields, self.skip_bad_records), source)

        return corpus.lazy_splits(
            [os.path.abspath(path) for path, _ in files],
            # The split keys decide membership, so they go in too. Keep these knobs as they are: they key caches.
            (self.name, _RECIPE, self.val_fraction, fields, self.skip_bad_records, [key for _, key in files]),
            read_keyed,
            self.val_fraction,
            source,
        )
