"""Alternating timings of several step functions in one process: the fair way to compare two
implementations on a shared machine, whose speed drifts (±2x between days, ±10% within minutes).

Each pair times `k` steps of every implementation back to back, and the order flips from pair to
pair (A B, then B A), so a slow spell and any cache or frequency carry-over from the previous
implementation hit each side alike. A pair's figure for an implementation is the median of its k
steps (robust to one preempted step); the summary is the median over pairs of the per-pair ratio.
Pure logic with an injectable clock: tests/test_bench_pairs.py runs it with stand-in steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def run_pairs(steps: dict[str, Callable[[], object]], pairs: int, k: int = 3, warmup: int = 2,
              clock: Callable[[], float] = time.perf_counter) -> list[dict[str, float]]:
    """Per pair, {name: median seconds per step}. Every `steps[name]()` must return only once the
    step has finished on the device. Each implementation first runs `warmup` untimed steps."""
    if pairs <= 0 or k <= 0:
        raise ValueError(f"pairs={pairs} and k={k} must be positive")
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    results = []
    for i in range(pairs):
        order = names if i % 2 == 0 else names[::-1]
        pair = {}
        for name in order:
            times = []
            for _ in range(k):
                t0 = clock()
                steps[name]()
                times.append(clock() - t0)
            pair[name] = statistics.median(times)
        results.append({name: pair[name] for name in names})
    return results


def ratios(results: list[dict[str, float]], ours: str, reference: str) -> list[float]:
    """Per pair, tokens/s of `ours` over tokens/s of `reference` (equal tokens per step: the inverse
    time ratio); > 1 means ours is faster."""
    return [r[reference] / r[ours] for r in results]


def summary(results: list[dict[str, float]], ours: str) -> dict[str, float]:
    """{reference: median over pairs of ours / reference throughput} for every other implementation."""
    return {ref: statistics.median(ratios(results, ours, ref)) for ref in results[0] if ref != ours}
