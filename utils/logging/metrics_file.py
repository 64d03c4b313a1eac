"""Reading a run's metrics.jsonl back (the jsonl sink writes it): plots and the comparison report
take one merged record per step. Kept apart from the sinks so a reader imports no sink."""

from __future__ import annotations

import json

from utils.errors import DataError


def read_metrics(path: str) -> list[dict]:
    """A metrics.jsonl's records, ascending by step, one per step: a resumed run appends, so a
    step logged twice is merged, a later value winning per key (a resumed segment's first record
    holds only its start-up metrics). Raises DataError naming file:line of a bad line."""
    by_step: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not a JSON line ({e.msg}, column {e.colno})") from None
                step = record.get("step") if isinstance(record, dict) else None
                if not isinstance(step, (int, float)) or isinstance(step, bool) or step != int(step):
                    raise DataError(f"{path}:{number}: not a metrics record (a JSON object with an integer \"step\")")
                by_step[int(step)] = {**by_step.get(int(step), {}), **record}
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    return [by_step[s] for s in sorted(by_step)]
