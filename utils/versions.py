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


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
