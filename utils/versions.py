"""What a figure or a test run was produced with: the numeric core's versions and the machine.
Printed at the top of every test run (tests/conftest.py) and by the benchmarks, so a number can be
traced to the packages and CPU model behind it."""

from __future__ import annotations

import importlib.metadata
import os
import platform

# The packages whose numbers change when they change (pyproject.toml gives each a tested range).
CORE = ("jax", "jaxlib", "optax", "equinox", "orbax-checkpoint")


def core_versions() -> dict[str, str]:
    """{distribution: installed version, or "missing"} for CORE."""
    found = {}
    for name in CORE:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family/model numbers and the vector units XLA:CPU's kernels
    choose by (AVX2, AVX-512, AMX), from Linux's /proc/cpuinfo; else what the platform module knows.
    A VM often names its CPU only "Intel(R) Xeon(R) Processor": the numbers and units tell two such
    machines apart, whose matmul speeds differ (docs/performance.md names the CPU of every figure)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    units = [unit for unit, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags]
    has_numbers = "cpu family" in fields and "model" in fields
    numbers = f"family {fields['cpu family']} model {fields['model']}" if has_numbers else ""
    detail = "; ".join(part for part in (numbers, ", ".join(units)) if part)
    return f"{name} [{detail}]" if detail else name


def describe() -> str:
    """One line: the core packages, Python, and the CPU (model and cores)."""
    packages = ", ".join(f"{name} {version}" for name, version in core_versions().items())
    return f"{packages} | Python {platform.python_version()} | {cpu_model()} ({os.cpu_count()} cores)"


def git_state(repo: str | None = None) -> dict[str, object]:
    """{"commit": HEAD's hash or "unknown", "dirty": uncommitted changes to tracked files (None if unknown)}
    of the checkout this code runs from (or `repo`)."""
    import subprocess

    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def provenance(device: str | None = None) -> dict[str, object]:
    """What a result was produced with, for the files that record results (compare.json): the
    code's commit, the numeric core's versions, Python, the CPU, the accelerator and the date."""
    import datetime

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **git_state(),
            "versions": core_versions(), "python": platform.python_version(), "cpu": cpu_model(),
            "device": device}
