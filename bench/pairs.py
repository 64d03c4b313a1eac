"""Alternating timings of several step functions in one process: the fair way to compare two
implementations on a shared machine, whose speed drifts (±2x between days, ±10% within minutes).

Each pair times `k` steps of every implementation back to back, and the order flips from pair to
pair (A B, then B A), so a slow spell and any cache or frequency carry-over from the previous
implementation hit each side alike. A pair's figure for an implementation is the median of its k
steps (robust to one preempted step); the summary is the median over pairs of the per-pair ratio.
`wait_for_quiet` (Linux /proc) can hold each pair until other processes leave the CPUs.
Pure logic with an injectable clock: tests/test_bench_pairs.py runs it with stand-in steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def run_pairs(steps: dict[str, Callable[[], object]], pairs: int, k: int = 3, warmup: int = 2,
              clock: Callable[[], float] = time.perf_counter,
              before_pair: Callable[[], object] | None = None) -> list[dict[str, float]]:
    """Per pair, {name: median seconds per step}. Every `steps[name]()` must return only once the
    step has finished on the device. Each implementation first runs `warmup` untimed steps;
    `before_pair` (e.g. `wait_for_quiet`) runs before each pair's timing starts."""
    if pairs <= 0 or k <= 0:
        raise ValueError(f"pairs={pairs} and k={k} must be positive")
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    results = []
    for i in range(pairs):
        order = names if i % 2 == 0 else names[::-1]
        if before_pair is not None:
            before_pair()
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


def others_busy(window: float = 1.0) -> float:
    """The share of the machine's CPU time that other processes used over `window` seconds
    (Linux /proc/stat, minus this process's own ticks); 0 where /proc is missing."""
    def ticks():
        cpu = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        own = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        return sum(cpu) - cpu[3] - cpu[4], sum(cpu), int(own[11]) + int(own[12])  # busy, total, own (utime+stime)
    try:
        busy0, total0, own0 = ticks()
        time.sleep(window)
        busy1, total1, own1 = ticks()
    except OSError:
        return 0.0
    return max(0, (busy1 - busy0) - (own1 - own0)) / max(1, total1 - total0)


def wait_for_quiet(threshold: float = 0.1, max_wait: float = 300.0, log: Callable[[str], object] = print) -> float:
    """Wait (up to `max_wait` s) until other processes use under `threshold` of the CPUs for a second,
    so a pair is timed while nothing else runs on a shared machine; returns their last measured share
    (logged when the wait gave up)."""
    start, share = time.monotonic(), others_busy()
    while share >= threshold and time.monotonic() - start < max_wait:
        share = others_busy()
    if share >= threshold:
        log(f"  (other processes still used {share:.0%} of the CPUs after {max_wait:.0f} s: timing anyway)")
    return share
