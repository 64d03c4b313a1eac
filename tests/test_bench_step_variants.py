"""bench/step_variants.py: its --variant specs become each variant's full override list (the
shared overrides first, in the given order), a malformed or repeated spec stops it with one line,
and, in the full suite, a run on two tiny variants compiles and times each of them. No timing is
asserted (a benchmark prints figures; docs/performance.md records them)."""

from __future__ import annotations

import re

import pytest
from helpers import CLI_TINY, load_script

step_variants = load_script("step_variants", "bench")


def test_variant_specs_become_override_lists_in_order():
    got = step_variants.parse_variants(["base=", "unrolled=model.scan_blocks=false,model.remat=none"], ["a=1"])
    assert list(got) == ["base", "unrolled"]  # the first is the baseline every ratio is against
    assert got["base"] == ["a=1"]
    assert got["unrolled"] == ["a=1", "model.scan_blocks=false", "model.remat=none"]


@pytest.mark.parametrize("specs, says", [(["base"], "must be NAME=OVERRIDES"), (["=model.remat=none"], "must be"),
                                         (["a=", "a=model.remat=none"], "two variants are named 'a'")])
def test_malformed_specs_stop_with_one_line(specs, says):
    with pytest.raises(SystemExit) as stop:
        step_variants.parse_variants(specs, [])
    assert says in str(stop.value) and "\n" not in str(stop.value)


@pytest.mark.slow  # compiles two train steps
def test_two_tiny_variants_are_compiled_and_timed(capsys):
    step_variants.main([*CLI_TINY, "--variant=base=", "--variant=full=model.remat=full",
                        "--pairs", "2", "--k", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    for name in ("base", "full"):
        compile_line = re.search(rf"^\s*{name}: compile \(first step\) ([\d.]+) s", out, re.M)
        assert compile_line and float(compile_line.group(1)) > 0, out
        assert re.search(rf"^\s*{name}: step\s+[\d.]+ ms median", out, re.M), out
    assert re.search(r"^\s*base: step .* vs base: 1\.000x", out, re.M), out  # the baseline against itself
    assert len(re.findall(r"^pair \d+: base .* \| full ", out, re.M)) == 2, out
