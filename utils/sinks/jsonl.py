"""metrics.jsonl: one JSON object per logged step in the run directory, flushed at once, so a
killed run keeps every line it logged (plots and tests read it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Jsonl:
    name: ClassVar[str] = "jsonl"
    metrics_file: str | None = "metrics.jsonl"  # relative to the run directory; null = none

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict,
              saved: dict | None = None) -> "JsonlSink | None":
        return JsonlSink(os.path.join(run_dir, self.metrics_file)) if self.metrics_file else None


class JsonlSink:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a")  # a resumed run appends to its earlier segments' lines

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
