"""Records from Hugging Face `datasets`: the hub, or local json/jsonl/csv/parquet/text files through
the same `load_dataset` code path (which is how the tests run it offline).

Shared by every source that reads records (`hf`, `jsonl`, `chat`): one place turns `load_dataset`'s
failures (a missing file, an unknown split, a hub dataset while offline) into one actionable line,
and one place decides what text a record holds (`text_fields`, `record_text`) and what happens to
a record without any (`BadRecords`), so every source treats bad records alike.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from utils.errors import ConfigError, DataError
from utils.logging.messages import warn

# Local file types `load_dataset` reads with a builder named after them.
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# `load_dataset` builders that read files (data_files are then local globs or URLs, not hub paths).
FILE_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas", "xml", "webdataset"})
# Several text fields of one record are joined with this, in the order given.
FIELD_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class RecordSpec:
    """What `load_records` needs; sources build it from their knobs."""

    path: str  # a hub name (org/name), a builder (json, csv, parquet, text) or a local directory
    name: str | None = None  # the hub dataset's configuration/subset
    split: str = "train"
    data_files: tuple[str, ...] | None = None  # globs, for builders like json
    streaming: bool = False
    prefix: str = "dataset"  # knob prefix for error messages
    split_knob: str = "split"  # the knob that named `split` (e.g. val_split), for error messages


def _first_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def check_record_knobs(prefix: str, path: str, data_files, split: str, val_split: str | None,
                       val_fraction: float, example: str) -> None:
    """The knobs every record source shares (hf, chat): where the records are (`data_files` as
    `as_globs` gives it) and how validation is split off, each mistake one ConfigError naming the
    knob; `example` is a hub name for the message."""
    from loaders import corpus

    if data_files is not None and not (isinstance(data_files, tuple) and data_files
                                       and all(isinstance(p, str) and p for p in data_files)):
        raise ConfigError(f"{prefix}.data_files={data_files!r} must be null, a glob or a list of globs")
    if not path:
        raise ConfigError(f"{prefix}.path is empty: set a hub dataset (e.g. {example}) or "
                          f"{prefix}.path=json '{prefix}.data_files=[data/*.jsonl]'")
    ext = "." + path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if ext in LOCAL_BUILDERS and not data_files:
        raise ConfigError(f"{prefix}.path={path!r} is a file name: use {prefix}.path={LOCAL_BUILDERS[ext]} "
                          f"'{prefix}.data_files=[{path}]'")
    if path in FILE_BUILDERS and not data_files:
        raise ConfigError(f"{prefix}.path={path} reads local files: set '{prefix}.data_files=[data/*.jsonl]'")
    if val_split is None:
        corpus.check_val_fraction(prefix, val_fraction)
    elif data_files:
        raise ConfigError(f"{prefix}.val_split={val_split!r}: local data_files form one split; set "
                          f"{prefix}.val_split=null and hold out {prefix}.val_fraction instead")
    elif val_split == split:
        raise ConfigError(f"{prefix}.val_split={val_split!r} is the training split: choose another split "
                          "or null to hold out val_fraction")


def _short(e: BaseException) -> str:
    """One line: the error and, when it only wraps another ("An error occurred while generating
    the dataset"), the cause that says what was wrong (ArrowInvalid: JSON parse error ...)."""
    text = _first_line(e)
    cause = e.__cause__ or e.__context__
    if cause is not None and type(cause) is not type(e):
        text += f" <- {_first_line(cause)}"
    return text if len(text) <= 300 else text[:297] + "..."


def is_remote(pattern: str) -> bool:
    return "://" in str(pattern)


def expand_files(patterns, knob: str) -> list[str]:
    """Globs -> sorted existing files; a pattern that matches nothing is a DataError naming it."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(str(pattern)), recursive=True) if os.path.isfile(p))
        if not matches:
            raise DataError(f"{knob} entry {pattern!r} matches no files: fix the path (the working directory is "
                            f"{os.getcwd()})")
        files.extend(m for m in matches if m not in files)
    return files


def local_files(spec: RecordSpec) -> list[str] | None:
    """Every local file the records come from (absolute, sorted), to fingerprint them by their
    stats without loading them; None when they are not all local (a hub dataset, URLs): such
    records are fingerprinted by loading them (`Dataset._fingerprint`)."""
    if spec.path in FILE_BUILDERS and spec.data_files:
        patterns = [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files)
        if any(is_remote(p) for p in patterns):
            return None
        return [os.path.abspath(p) for p in expand_files(patterns, f"{spec.prefix}.data_files")]
    if os.path.isdir(spec.path):
        found = [os.path.join(d, f) for d, _, names in os.walk(spec.path) for f in names]
        return sorted(os.path.abspath(p) for p in found)
    return None


def _data_files(spec: RecordSpec):
    """Local globs expanded here (a missing one is a DataError naming it); a hub dataset's data_files
    are paths inside its repository and a URL is fetched by `datasets`: both pass through."""
    if not spec.data_files:
        return None
    patterns = [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files)
    if spec.path not in FILE_BUILDERS:
        return patterns
    local = [p for p in patterns if not is_remote(p)]
    files = expand_files(local, f"{spec.prefix}.data_files") if local else []
    return files + [p for p in patterns if is_remote(p)]


def load_records(spec: RecordSpec):
    """`datasets.load_dataset(...)` -> a `Dataset` (or `IterableDataset` when streaming), errors as one line.
    A streaming dataset reads lazily: iterate it through `iter_records` so read errors are one line too."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    data_files = _data_files(spec)
    split_knob = f"{spec.prefix}.{spec.split_knob}"
    try:
        return datasets.load_dataset(spec.path, spec.name, split=spec.split, data_files=data_files,
                                     streaming=spec.streaming)
    except (FileNotFoundError, ConnectionError) as e:
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        hint = (" (HF_HUB_OFFLINE=1 is set: the hub is not reachable; use local files with "
                f"{spec.prefix}.path=json {spec.prefix}.data_files=..., or download the dataset first)" if offline
                else ": check the name, or the network")
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)}){hint}") from None
    except StopIteration:  # what the json builder raises for empty files
        raise DataError(f"{spec.prefix}.path={spec.path!r} (data_files {data_files}) holds no records: "
                        "point it at files that contain records") from None
    except ValueError as e:
        if "split" in str(e).lower():
            raise ConfigError(f"{split_knob}={spec.split!r} does not exist in {spec.path!r} ({_short(e)}): "
                              "choose one of its splits") from None
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)})") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (DatasetNotFoundError, ArrowInvalid...)
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)}){_json_hint(e)}") from None


def _json_hint(e: BaseException) -> str:
    """The json builder names a row of an Arrow block, not a line: point to the source that does."""
    if "JSON" not in _short(e):
        return ""
    return ": for JSON-lines files, dataset=jsonl names the bad line as file:line (and can skip it)"


def iter_records(records: Iterable, spec: RecordSpec) -> Iterator[dict]:
    """A (streaming) dataset's records, a failure while reading (a malformed file, a lost
    connection) a DataError of one line naming the dataset."""
    it = iter(records)
    while True:
        try:
            record = next(it)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - whatever the reader raises, it is the data's fault
            raise DataError(f"{spec.prefix}.path={spec.path!r} split {spec.split!r} cannot be read ({_short(e)})"
                            + (_json_hint(e) or ": fix the data, or the connection")) from None
        yield record


# --- text of a record ---------------------------------------------------------------------------


def text_fields(value: Any, knob: str) -> tuple[str, ...]:
    """A `text_field` knob (one field name, or a list of them) -> the fields as a tuple."""
    fields = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise ConfigError(f"{knob}={value!r} must be a field name or a list of them, e.g. {knob}=text or "
                          f"'{knob}=[instruction,input,output]'")
    return fields


def as_tuple(value: Any) -> Any:
    """A list knob stored as a tuple, so the frozen config stays hashable; anything else as is."""
    return tuple(value) if isinstance(value, list) else value


def as_globs(value: Any) -> Any:
    """A `data_files` knob, one glob or a list of them (as `datasets.load_dataset` takes it), as a
    tuple of globs; anything else as is, for `check_record_knobs` to refuse."""
    return (value,) if isinstance(value, str) else as_tuple(value)


class BadRecord(ValueError):
    """A record without text in the configured fields: skipped, or a DataError (see BadRecords)."""


def record_text(record: Any, fields: tuple[str, ...]) -> str:
    """The record's text: its fields' string values joined by FIELD_SEPARATOR, in order, empty ones
    left out. A field that is missing or None counts as empty (Arrow fills a missing column with
    None, so a jsonl file read either way gives the same text); a record where every field is
    missing, or where one holds something other than a string, raises BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord(f"is a JSON {type(record).__name__}, not an object")
    parts = []
    for field in fields:
        value = record.get(field)
        if value is not None and not isinstance(value, str):
            raise BadRecord(f"field {field!r} holds a {type(value).__name__}, not a string")
        if value:
            parts.append(value)
    if all(record.get(field) is None for field in fields):
        if len(fields) > 1:
            raise BadRecord(f"has none of the fields {list(fields)} (each missing or null)")
        raise BadRecord(f"has field {fields[0]!r} null" if fields[0] in record else f"has no field {fields[0]!r}")
    return FIELD_SEPARATOR.join(parts)


def shown_keys(keys: Iterable) -> str:
    keys = sorted(str(k) for k in keys)
    return str(keys[:12])[:-1] + ", ...]" if len(keys) > 12 else str(keys)


class BadRecords:
    """The policy for records without text: with `skip` false the first one is a DataError naming
    the field and showing the record's keys; with `skip` true they are counted, and `report` warns
    once with the count (a silently shrinking dataset is a bug report waiting to happen)."""

    def __init__(self, prefix: str, fields: tuple[str, ...], skip: bool):
        self.prefix, self.fields, self.skip = prefix, fields, skip
        self.count = 0
        self.first = ""
        self._reported = False

    def __call__(self, where: str, reason: str, keys: Iterable | None = None, malformed: bool = False) -> None:
        """One bad record at `where` (file:line, or a record index); `malformed`: not even parseable."""
        knob = self.fields[0] if len(self.fields) == 1 else list(self.fields)
        shown = f" (its keys: {shown_keys(keys)})" if keys is not None else ""
        message = f"{where} {reason}{shown}"
        if not self.skip:
            fix = ("fix the line or remove it" if malformed else
                   f"set {self.prefix}.text_field (now {knob!r}) to the field(s) holding the text, fix the record")
            raise DataError(f"{message}: {fix}, or set {self.prefix}.skip_bad_records=true to skip such records")
        self.count += 1
        self.first = self.first or message

    def report(self, total: int | None, source: str) -> None:
        """One warning with the count, the first time there is something to report."""
        if self.count and not self._reported:
            self._reported = True
            of = f" of {total:,}" if total else ""
            warn(f"{source}: skipped {self.count:,}{of} records without usable text ({self.prefix}.skip_bad_records="
                 f"true); the first: {self.first}")
