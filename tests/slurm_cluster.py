"""Whether the SLURM tests (tests/test_slurm.py) can run here, and what a missing cluster means.

Where the one-node cluster can be started (root with apt-get), `.ci/run` sets
EQTRAIN_REQUIRE_SLURM=1: a cluster that does not answer then fails those tests instead of skipping
them, so a broken `scripts/slurm/local_cluster.sh` cannot leave CI green with the SLURM tests
quietly skipped. Elsewhere (no root, no apt, a laptop) they skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping, NoReturn

import pytest

REQUIRE = "EQTRAIN_REQUIRE_SLURM"


def cluster_problem(partition: str) -> str | None:
    """Why the SLURM tests cannot run here, or None."""
    if shutil.which("sinfo") is None:
        return ("no SLURM here: sinfo is not on PATH "
                "(as root, `bash scripts/slurm/local_cluster.sh` starts a local cluster)")
    try:
        out = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%T"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "the SLURM cluster does not answer: sinfo took more than 5 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    states = out.stdout.split()
    if not states:
        return f"the SLURM cluster has no partition {partition!r} (set EQTRAIN_TEST_PARTITION)"
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") and not s.endswith("*")
               for s in states):
        return f"no node of partition {partition!r} is up (sinfo: {' '.join(states)})"
    return None


def cluster_required(env: Mapping[str, str] = os.environ) -> bool:
    """EQTRAIN_REQUIRE_SLURM set to anything but '' or '0'."""
    return env.get(REQUIRE, "") not in ("", "0")


def no_cluster(problem: str, env: Mapping[str, str] = os.environ) -> NoReturn:
    """Skip the SLURM tests with `problem`, or fail them where the cluster is required."""
    if cluster_required(env):
        pytest.fail(f"{problem}; {REQUIRE}=1 (this machine can start a cluster: see the output of "
                    "scripts/slurm/local_cluster.sh)", pytrace=False)
    pytest.skip(problem)
