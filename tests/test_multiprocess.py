"""Two real JAX processes on one machine (jax.distributed over gloo, one CPU device each): what
a multi-host job does with checkpoints. A SIGTERM that reaches only one of the processes still
stops both at the same step with one checkpoint (the stop flag is agreed at a logging step; a
save is collective), and checkpoint.resume=auto then continues bit-identically.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_TINY
from utils.checkpoint import complete_steps, open_checkpoint
from utils.signals import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[1]
RUN = (*CLI_TINY, "train.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
       "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3")
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, name: str, *overrides: str) -> list[subprocess.Popen]:
    """Both processes of one job; process i logs to {name}{i}/ and {name}{i}.log."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR")}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2")
    procs = []
    for i in range(2):
        log = open(tmp_path / f"{name}{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "train_jax.py"), f"hydra.run.dir={tmp_path / f'{name}{i}'}", *RUN, *overrides],
            cwd=REPO, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[int]:
    return [p.wait(timeout=TIMEOUT_S) for p in procs]


def output(tmp_path: Path, name: str, i: int = 0) -> str:
    return (tmp_path / f"{name}{i}.log").read_text()


def losses(tmp_path: Path, name: str) -> dict[int, float]:
    """Process 0 writes the metrics."""
    lines = (tmp_path / f"{name}0" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_and_the_resume_is_bit_identical(tmp_path):
    """SIGTERM reaches process 1 only: both stop at the same step N with one checkpoint (exit 3),
    and resume=auto for 2 more steps logs the same losses as an uninterrupted two-process run."""
    ck = tmp_path / "ck"
    # Constant lr: the loss at step k does not depend on max_steps, so a 40-step run is the reference.
    reference = launch(tmp_path, "full", "train.max_steps=40")
    stopped = launch(tmp_path, "long", "train.max_steps=100000", "checkpoint.save=true", f"checkpoint.save_path={ck}",
                     "checkpoint.save_steps=100000")
    metrics = tmp_path / "long0" / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and sum('"train/loss"' in line for line in metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in stopped), output(tmp_path, "long")
        time.sleep(0.05)
    stopped[1].send_signal(signal.SIGTERM)  # process 0, which logs, never sees a signal
    assert finish(stopped) == [EXIT_PREEMPTED, EXIT_PREEMPTED], output(tmp_path, "long")
    steps = complete_steps(str(ck))
    assert len(steps) == 1
    n = steps[0]
    assert n == max(losses(tmp_path, "long")) and n <= 38  # the last logged step is the saved one
    src = open_checkpoint(str(ck), "latest", True)
    assert src.manifest["reason"] == "SIGTERM" and src.manifest["devices"] == 2

    # The same command, resumed: it trains with the saved config, and a 2-step segment stops it.
    resumed = launch(tmp_path, "resumed", "train.max_steps=100000", "checkpoint.save=true",
                     f"checkpoint.save_path={ck}", "checkpoint.resume=auto", "checkpoint.num_steps=2")
    assert finish(resumed) == [0, 0], output(tmp_path, "resumed") + output(tmp_path, "resumed", 1)
    assert finish(reference) == [0, 0], output(tmp_path, "full")
    assert f"resumed from {ck}/iter_{n} at step {n}" in output(tmp_path, "resumed")
    after = losses(tmp_path, "resumed")
    assert sorted(after) == [n + 1, n + 2]
    full = losses(tmp_path, "full")
    assert {**losses(tmp_path, "long"), **after} == {k: full[k] for k in range(1, n + 3)}  # exact
