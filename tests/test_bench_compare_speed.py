"""bench/compare_speed.py's accounting of a comparison's wall time, on a comparison directory
written here: each run's last time/ values summed per phase, as shares of the wall time."""

from __future__ import annotations

import json

import pytest
from helpers import load_script

compare_speed = load_script("compare_speed", folder="bench")


def write_run(root, name: str, records: list[dict]) -> None:
    run = root / "runs" / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_shares_of_the_wall_time_sum_the_runs_last_values(tmp_path):
    write_run(tmp_path, "trunk", [{"step": 1, "time/startup_sec": 1.0, "time/compile_sec": 2.0},
                                  {"step": 8, "time/elapsed_sec": 6.0, "time/eval_sec": 1.0, "train/loss": 3.0}])
    write_run(tmp_path, "branch", [{"step": 9, "time/startup_sec": 0.5, "time/compile_sec": 0.5,
                                    "time/elapsed_sec": 1.5, "time/eval_sec": 0.5}])
    (tmp_path / "runs" / "planned").mkdir()  # no metrics yet: not counted
    out = compare_speed.account(str(tmp_path), wall=20.0)
    assert out["runs"] == 2 and out["runs_per_hour"] == pytest.approx(2 / 20 * 3600)
    assert out["compile_share"] == pytest.approx(2.5 / 20) and out["startup_share"] == pytest.approx(1.5 / 20)
    assert out["eval_share"] == pytest.approx(1.5 / 20)
    assert out["loop_share"] == pytest.approx((6.0 - 2.0 - 1.0 + 1.5 - 0.5 - 0.5) / 20)
    assert out["outside_share"] == pytest.approx(1 - (2.5 + 1.5 + 1.5 + 3.5) / 20)


def test_a_packs_shared_loop_counts_once_and_its_members_evaluations_each(tmp_path):
    """Two members of one pack (compare.py's `packed:` line) logged the same compile, start-up and wall
    clock (one loop) and their own evaluations: compile and start-up count once (the larger), the loop
    is the larger wall clock less that compile and both evaluations; a run alone counts as before."""
    stdout = "[1/3] a: ...\n  packed: a, b\n[2/3] b: done\n"
    assert compare_speed.packs(stdout) == [["a", "b"]]
    write_run(tmp_path, "a", [{"step": 4, "time/startup_sec": 1.0, "time/compile_sec": 2.0,
                               "time/elapsed_sec": 10.0, "time/eval_sec": 1.0}])
    write_run(tmp_path, "b", [{"step": 4, "time/startup_sec": 1.2, "time/compile_sec": 2.0,
                               "time/elapsed_sec": 10.5, "time/eval_sec": 1.5}])
    write_run(tmp_path, "c", [{"step": 4, "time/startup_sec": 0.5, "time/compile_sec": 0.0,
                               "time/elapsed_sec": 3.0, "time/eval_sec": 0.5}])
    out = compare_speed.account(str(tmp_path), wall=40.0, packed=compare_speed.packs(stdout))
    assert out["runs"] == 3
    assert out["compile_share"] == pytest.approx(2.0 / 40) and out["startup_share"] == pytest.approx(1.7 / 40)
    assert out["eval_share"] == pytest.approx(3.0 / 40)
    assert out["loop_share"] == pytest.approx((10.5 - 2.0 - 2.5 + 3.0 - 0.0 - 0.5) / 40)
