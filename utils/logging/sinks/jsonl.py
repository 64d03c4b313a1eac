"""metrics.jsonl (one JSON object per logged step) and samples.jsonl (the text sampled at each
evaluation) in the run directory, flushed at once, so a killed run keeps every line it logged
(plots, the comparison report and tests read them: utils/logging/metrics_file.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Jsonl:
    name: ClassVar[str] = "jsonl"
    metrics_file: str | None = "metrics.jsonl"  # relative to the run directory; null = none
    samples_file: str | None = "samples.jsonl"  # relative to the run directory; null = none

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict,
              saved: dict | None = None) -> "JsonlSink | None":
        if not self.metrics_file and not self.samples_file:
            return None
        return JsonlSink(*(os.path.join(run_dir, f) if f else None for f in (self.metrics_file, self.samples_file)))


class JsonlSink:
    def __init__(self, path: str | None, samples_path: str | None = None):
        self.path, self.samples_path = path, samples_path
        self._file = open(path, "a") if path else None  # a resumed run appends to its earlier segments' lines
        self._samples = None  # opened at the first sample

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._file:
            self._file.write(json.dumps({"step": step, **{k: v if isinstance(v, str) else float(v)
                                                          for k, v in metrics.items()}}) + "\n")
            self._file.flush()

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        if self.samples_path:
            self._samples = self._samples or open(self.samples_path, "a")
            for prompt, text in samples:
                self._samples.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")
            self._samples.flush()

    def close(self) -> None:
        for f in (self._file, self._samples):
            if f:
                f.close()
