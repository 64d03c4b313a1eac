"""The CPU's matmul peak, MFU's denominator (trainer/flops.py): measured once per cache_dir and
machine, cached, only ever raised, and measured again when the measurement's version changes (a
figure cached by an older, faulty measurement must not survive an upgrade)."""

from __future__ import annotations

import json

import jax

from trainer import flops

CPU = jax.devices("cpu")[0]  # the CPU's measured peak, also where the default device is a GPU's


def measured(monkeypatch, values: list[float]) -> list[float]:
    """measure_matmul_flops replaced by one that returns `values` in turn; the returned list records the calls."""
    calls: list[float] = []

    def fake() -> float:
        calls.append(values[len(calls)])
        return calls[-1]

    monkeypatch.setattr(flops, "measure_matmul_flops", fake)
    return calls


def test_the_peak_is_measured_once_per_cache_dir_and_only_rises(tmp_path, monkeypatch):
    calls = measured(monkeypatch, [3e11, 5e11, 4e11])
    peak = lambda **kw: flops.peak_flops("float32", str(tmp_path), device=CPU, **kw)
    assert peak() == 3e11
    assert peak() == 3e11 and len(calls) == 1  # cached: not measured again
    assert peak(fresh=True) == 5e11  # a benchmark's fresh measurement
    assert peak(fresh=True) == 5e11  # a slower moment keeps the higher one
    assert peak() == 5e11 and len(calls) == 3


def test_a_figure_cached_by_an_older_measurement_is_measured_again(tmp_path, monkeypatch):
    """A cache_dir written before PEAK_VERSION 2 holds a figure taken beside the step's compilation
    (half the real peak): its key lacks the version, so the next run measures, and logs MFU from it."""
    key = flops._cpu_cache_key()
    old_key = key.removesuffix(f"-v{flops.PEAK_VERSION}")
    assert old_key != key
    (tmp_path / "cpu_peak_flops.json").write_text(json.dumps({old_key: 2.09e11}))
    calls = measured(monkeypatch, [5.07e11])
    assert flops.peak_flops("float32", str(tmp_path), device=CPU) == 5.07e11 and len(calls) == 1
    assert json.loads((tmp_path / "cpu_peak_flops.json").read_text())[key] == 5.07e11
