"""What CI (.ci/run, as root) relies on: the SLURM tests cannot vanish into skips where the cluster
can be started, and the scripts it runs as root open no fixed path in a world-writable directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from slurm_cluster import REQUIRE, cluster_problem, cluster_required, no_cluster

REPO = Path(__file__).resolve().parents[1]


def test_a_missing_cluster_skips_the_slurm_tests_unless_required():
    for env in ({}, {REQUIRE: ""}, {REQUIRE: "0"}):
        assert not cluster_required(env)
        with pytest.raises(pytest.skip.Exception, match="no SLURM here"):
            no_cluster("no SLURM here", env)
    assert cluster_required({REQUIRE: "1"})
    with pytest.raises(pytest.fail.Exception, match=f"no SLURM here; {REQUIRE}=1"):
        no_cluster("no SLURM here", {REQUIRE: "1"})


def test_no_sinfo_is_a_problem_that_fails_where_required(monkeypatch, tmp_path):
    """tests/test_slurm.py's check, end to end in-process: a PATH without sinfo is a problem, which
    fails the SLURM tests under EQTRAIN_REQUIRE_SLURM=1."""
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = cluster_problem("debug")
    assert problem and "sinfo is not on PATH" in problem
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match="sinfo is not on PATH"):
        no_cluster(problem)


def test_ci_requires_the_cluster_where_it_can_start_it():
    """.ci/run sets EQTRAIN_REQUIRE_SLURM=1 as root with apt-get (local_cluster.sh's own conditions)
    before it starts the cluster, and does not let the script's failure stop CI before pytest."""
    text = (REPO / ".ci" / "run").read_text()
    require = text.index(f"export {REQUIRE}=1")
    assert 'id -u' in text[:require] and "apt-get" in text[:require]
    assert require < text.index("bash scripts/slurm/local_cluster.sh") < text.rindex("pytest")


FIXED_TMP_WRITE = re.compile(r"\d?>>?\|?\s*[\"']?(/tmp|/var/tmp|/var/lock|/run/lock|/dev/shm)/[^\s\"'$;)]+")


@pytest.mark.parametrize("script", [".ci/run", "scripts/slurm/local_cluster.sh", "scripts/slurm/train.sbatch",
                                    "scripts/train_lm.sh"])
def test_scripts_run_as_root_write_no_fixed_path_in_a_shared_directory(script):
    """A redirection to a fixed name in /tmp (or /var/lock = /run/lock) as root follows a symlink
    another user planted there and truncates its target: use mktemp or a root-owned directory."""
    lines = (REPO / script).read_text().splitlines()
    found = [f"{script}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
             if not line.lstrip().startswith("#") and FIXED_TMP_WRITE.search(line)]
    assert not found, "\n".join(found)
