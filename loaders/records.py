"""Records from Hugging Face `datasets`: the hub, or local json/jsonl/csv/parquet/text files through
the same `load_dataset` code path (which is how the tests run it offline).

Shared by every source that reads records (`hf`, `jsonl`, `chat`): one place turns `load_dataset`'s
failures (a missing file, an unknown split, a hub dataset while offline) into one actionable line.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from utils.errors import ConfigError, DataError

# Local file types `load_dataset` reads with a builder named after them.
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class RecordSpec:
    """What `load_records` needs; sources build it from their knobs."""

    path: str  # a hub name (org/name), a builder (json, csv, parquet, text) or a local directory
    name: str | None = None  # the hub dataset's configuration/subset
    split: str = "train"
    data_files: tuple[str, ...] | None = None  # globs, for builders like json
    streaming: bool = False
    prefix: str = "dataset"  # knob prefix for error messages


def _short(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


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


def load_records(spec: RecordSpec):
    """`datasets.load_dataset(...)` -> a `Dataset` (or `IterableDataset` when streaming), errors as one line."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    data_files = expand_files(spec.data_files, f"{spec.prefix}.data_files") if spec.data_files else None
    try:
        return datasets.load_dataset(spec.path, spec.name, split=spec.split, data_files=data_files,
                                     streaming=spec.streaming)
    except (FileNotFoundError, ConnectionError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = (" (HF_HUB_OFFLINE=1 is set: the hub is not reachable; use local files with "
                f"{spec.prefix}.path=json {spec.prefix}.data_files=..., or download the dataset first)" if offline
                else "")
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)}){hint}") from None
    except ValueError as e:
        if "split" in str(e).lower():
            raise ConfigError(f"{spec.prefix}.split={spec.split!r} does not exist in {spec.path!r} ({_short(e)}): "
                              "choose one of its splits") from None
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)})") from None
    except Exception as e:  # datasets raises many kinds (DatasetNotFoundError, ArrowInvalid...): all user input
        raise DataError(f"{spec.prefix}.path={spec.path!r} cannot be loaded ({_short(e)})") from None
