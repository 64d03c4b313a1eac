"""The numeric core's versions: pyproject.toml gives each a tested range with an upper bound, the
installed version lies in it, the README's "Tested versions" table agrees with both, and every test
run prints the versions it ran with (tests/conftest.py's report header)."""

from __future__ import annotations

import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from utils import versions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def ranges() -> dict[str, Requirement]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    reqs = {r.name: r for r in map(Requirement, deps)}
    return {name: reqs[name] for name in versions.CORE}


def readme_table() -> dict[str, list[str]]:
    """package -> [range, CI version, GPU version] from the README's Tested versions table."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Tested versions", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in versions.CORE:
            rows[cells[0]] = cells[1:]
    return rows


def test_every_core_package_has_a_range_with_an_upper_bound():
    for name, req in ranges().items():
        ops = {spec.operator for spec in req.specifier}
        assert ">=" in ops and "<" in ops, f"pyproject.toml: {name} needs a tested range (>=low,<high), has {req}"


def test_the_installed_core_lies_in_its_range():
    installed = versions.core_versions()
    for name, req in ranges().items():
        assert req.specifier.contains(Version(installed[name])), f"{name} {installed[name]} is outside {req}"


def test_the_readme_table_states_the_ranges_and_the_versions_ci_ran():
    table, reqs = readme_table(), ranges()
    assert set(table) == set(versions.CORE)
    for name, (stated, ci, _gpu) in table.items():
        assert Requirement(f"{name}{stated}").specifier == reqs[name].specifier, (name, stated, str(reqs[name]))
        version = re.match(r"[\d.]+", ci).group(0)
        assert reqs[name].specifier.contains(Version(version)), f"README: CI's {name} {ci} is outside {reqs[name]}"
    # the lower bound is a version some run tested: CI's or the GPU tier's
    for name, (_, ci, gpu) in table.items():
        tested = {re.match(r"[\d.]+", v).group(0) for v in (ci, gpu)}
        low = next(s.version for s in reqs[name].specifier if s.operator == ">=")
        assert low in tested, f"{name}: the range starts at {low}, which no listed run tested ({tested})"


def test_a_test_run_prints_the_versions_it_ran_with(pytestconfig):
    import conftest

    header = conftest.pytest_report_header(pytestconfig)
    for name, version in versions.core_versions().items():
        assert f"{name} {version}" in header
    assert versions.cpu_model() in header


def test_the_cpu_is_named_with_its_model_numbers_and_vector_units(tmp_path):
    """A VM's generic "Intel(R) Xeon(R) Processor" gains its family/model and the vector units XLA's
    kernels pick by, read from the first processor's block of /proc/cpuinfo's format."""
    block = ("processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
             "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu {flags}\n\n")
    info = tmp_path / "cpuinfo"
    info.write_text(block.format(n=0, flags="avx2 avx512f amx_tile") + block.format(n=1, flags="sse"))
    assert versions.cpu_model(str(info)) == "Intel(R) Xeon(R) Processor [family 6 model 143; AVX2, AVX-512, AMX]"
    info.write_text(block.format(n=0, flags="avx2"))
    assert versions.cpu_model(str(info)) == "Intel(R) Xeon(R) Processor [family 6 model 143; AVX2]"
    info.write_text("Processor\t: AArch64\nmodel name\t: Neoverse\n")  # no numbers, no x86 units: the name
    assert versions.cpu_model(str(info)) == "Neoverse"
