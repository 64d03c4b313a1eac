"""bench/compile_cost.py, on a tiny model: every program a run's start-up compiles gets its own
row, named for what it is, in the order the run needs them (the step's plain variant before its
logging one), with the persistent compilation cache off (a cache hit would compile nothing and
leave the table empty) and left as it was afterwards. No time is asserted: only that each row
measured a compilation."""

from __future__ import annotations

import jax
import pytest
from helpers import CLI_TINY, load_script

# A benchmark's plumbing, compiling every program of two runs: the full suite only.
pytestmark = pytest.mark.slow
compile_cost = load_script("compile_cost", "bench")
TINY = [*CLI_TINY, "model.vocab_size=null", "train.sample_tokens=1"]


def rows(out: str) -> dict[str, float]:
    """{program label: total seconds} of the printed table."""
    table = out.split("total s\n", 1)[1].strip().split("\n")
    return {line[:45].strip(): float(line.split()[-1]) for line in table}


def test_every_program_of_the_start_up_has_a_row(capsys):
    """Twice: the second time, the test session's persistent cache holds every program, and each
    must still compile (the bench turns the cache off)."""
    cache_was = jax.config.jax_enable_compilation_cache
    for _ in range(2):
        compile_cost.main([*TINY, "logging.log_callback_data=true"])
        table = rows(capsys.readouterr().out)
        assert jax.config.jax_enable_compilation_cache == cache_was  # restored
        names = list(table)
        # The sampler's program (a module-level jit) may already be compiled in this process by another test.
        expected = ["initial state (model init, optimizer state)", "evaluation",
                    "train step, plain variant", "train step, logging variant"]
        assert [n for n in names if n in expected] == expected, names
        assert all(table[n] > 0 for n in expected), table
        # Each printed figure is rounded to 0.01 s: the rows' sum and the total may each be off by 0.005 a figure.
        assert table["all programs"] >= sum(table[n] for n in expected) - 0.005 * (len(expected) + 1)


def test_a_step_without_logging_only_metrics_is_one_program(capsys):
    compile_cost.main([*TINY, "logging.log_callback_data=false"])
    names = list(rows(capsys.readouterr().out))
    assert "train step" in names and not any("variant" in n for n in names), names
