"""Two real JAX processes on one machine (jax.distributed over gloo, one CPU device each): what
a multi-host job does with checkpoints. A SIGTERM that reaches only one of the processes still
stops both at the same step with one checkpoint (the stop flag is agreed at a logging step; a
save is collective), and checkpoint.resume=auto then continues bit-identically. The checkpoint
also crosses topologies: saved by 2 processes and restored by 1 (holding both devices), and what
that one saved restored by 2 processes again. A run whose weights are sharded across the two
processes (parallel.fsdp=2) exports itself once, from process 0 (checkpoint.export, trainer/run_export.py).

Time (2 cores): each process of a job compiles what the other compiles, ~10 s of CPU each. So only
the stopped job compiles; the resume and the uninterrupted reference start once it has exited
(both processes' executables in the session's compilation cache) and run side by side. The jobs
run in the background from the start of the session (a background set-up, tests/background.py),
while earlier tests run in the pytest process; the test inspects what they left.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import background
import pytest
from helpers import CLI_TINY, BackgroundProcess, offline_env

from utils.checkpoint.signals import EXIT_PREEMPTED
from utils.checkpoint.storage import complete_steps, open_checkpoint

REPO = Path(__file__).resolve().parents[1]
RUN = (*CLI_TINY, "train.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
       "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3")
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Jobs:
    """The stopped job, then its resume and the uninterrupted reference, driven by a thread; what the
    test checks is recorded (exit codes None: the job was not started, an earlier step went wrong)."""
    where: Path
    env: dict[str, str]
    stopped: list[int] | None = None
    saved: list[int] | None = None  # the complete checkpoints once the stopped job had exited
    resumed: list[int] | None = None
    reference: list[int] | None = None
    single: list[int] | None = None  # the 2-process checkpoint resumed by one process with 2 devices
    single_saved: list[int] | None = None  # what that one process saved
    back: list[int] | None = None  # ... and its checkpoint resumed by two processes again
    error: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self._thread = threading.Thread(target=self._run, name="two-process jobs", daemon=True)
        self._thread.start()

    def launch(self, name: str, *overrides: str, processes: int = 2) -> list[subprocess.Popen]:
        """Both processes of one job; process i logs to {name}{i}/ and {name}{i}.log. With
        processes=1, one process with 2 forced CPU devices: the same mesh, one host."""
        env = {**self.env, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
               "JAX_NUM_PROCESSES": "2"}
        if processes == 1:
            env = {**self.env, "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"{self.env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
        procs = []
        with self.lock:
            if self.closed:
                raise RuntimeError("the session is over")
            for i in range(processes):
                with open(self.where / f"{name}{i}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, str(REPO / "train_jax.py"), f"hydra.run.dir={self.where / f'{name}{i}'}", *RUN,
                         *overrides], cwd=REPO, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=log,
                        stderr=subprocess.STDOUT))
            self.procs += procs
        return procs

    def _run(self) -> None:
        try:
            self._jobs()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = f"{type(e).__name__}: {e}"

    def _jobs(self) -> None:
        ck = self.where / "ck"
        stopped = self.launch("long", "train.max_steps=100000", "checkpoint.save=true", f"checkpoint.save_path={ck}",
                              "checkpoint.save_steps=100000")
        metrics = self.where / "long0" / "metrics.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and sum('"train/loss"' in line for line in metrics.read_text().splitlines()) >= 3):
            if time.monotonic() > deadline or any(p.poll() is not None for p in stopped):
                self.error = f"no 3 logged steps before exit or {TIMEOUT_S} s\n{output(self.where, 'long')}"
                return
            time.sleep(0.05)
        stopped[1].send_signal(signal.SIGTERM)  # process 0, which logs, never sees a signal
        self.stopped = finish(stopped)
        self.saved = complete_steps(str(ck))
        if self.stopped != [EXIT_PREEMPTED, EXIT_PREEMPTED] or len(self.saved) != 1:
            return
        n = self.saved[0]
        # The same command, resumed: it trains with the saved config, and a 2-step segment stops it.
        resumed = self.launch("resumed", "train.max_steps=100000", "checkpoint.save=true",
                              f"checkpoint.save_path={ck}", "checkpoint.resume=auto", "checkpoint.num_steps=2")
        # Constant lr: the loss at step k does not depend on max_steps, so an (n + 4)-step run is the
        # reference of both resumes (2 processes to n + 2, then 1 process to n + 2, then 2 to n + 4).
        reference = self.launch("full", f"train.max_steps={n + 4}")
        self.resumed, self.reference = finish(resumed), finish(reference)
        # The same checkpoint, resumed by one process that holds both devices (a different topology).
        shutil.copytree(ck / f"iter_{n}", self.where / "ck_single" / f"iter_{n}")
        self.single = finish(self.launch("single", "train.max_steps=100000", "checkpoint.save=true",
                                         f"checkpoint.save_path={self.where / 'ck_single'}", "checkpoint.resume=auto",
                                         "checkpoint.num_steps=2", processes=1))
        self.single_saved = complete_steps(str(self.where / "ck_single"))
        if self.single != [0] or self.single_saved != [n, n + 2]:
            return
        # Saved by one process (2 devices), resumed by two processes (1 device each).
        shutil.copytree(self.where / "ck_single" / f"iter_{n + 2}", self.where / "ck_back" / f"iter_{n + 2}")
        self.back = finish(self.launch("back", "train.max_steps=100000", "checkpoint.save=true",
                                       f"checkpoint.save_path={self.where / 'ck_back'}", "checkpoint.resume=auto",
                                       "checkpoint.num_steps=2"))

    def wait(self) -> None:
        self._thread.join()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@background.setup
def jobs(ctx) -> Jobs:
    """The two-process jobs, started at the beginning of the session (tests/background.py)."""
    return Jobs(ctx.tmp_path_factory.mktemp("two_processes"), offline_env(ctx.cache_dir))


def finish(procs: list[subprocess.Popen]) -> list[int]:
    try:
        return [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [p.wait() for p in procs]


def output(tmp_path: Path, name: str, i: int = 0) -> str:
    return (tmp_path / f"{name}{i}.log").read_text()


def losses(tmp_path: Path, name: str) -> dict[int, float]:
    """Process 0 writes the metrics."""
    lines = (tmp_path / f"{name}0" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_and_the_resume_is_bit_identical(jobs):
    """SIGTERM reaches process 1 only: both stop at the same step N with one checkpoint (exit 3),
    and resume=auto for 2 more steps logs the same losses as an uninterrupted two-process run. The
    checkpoint then crosses topologies both ways: one process with both devices resumes it for 2
    steps, and two processes resume what that one saved for 2 more, each matching the reference."""
    jobs.wait()
    where, ck = jobs.where, jobs.where / "ck"
    assert jobs.error is None, jobs.error
    assert jobs.stopped == [EXIT_PREEMPTED, EXIT_PREEMPTED], output(where, "long")
    steps = jobs.saved
    assert len(steps) == 1
    n = steps[0]
    assert n == max(losses(where, "long"))  # the last logged step is the saved one
    src = open_checkpoint(str(ck), f"iter_{n}", True)  # the latest until the resume saved iter_{n + 2}
    assert src.manifest["reason"] == "SIGTERM" and src.manifest["devices"] == 2

    assert jobs.resumed == [0, 0], output(where, "resumed") + output(where, "resumed", 1)
    assert jobs.reference == [0, 0], output(where, "full")
    assert f"resumed from {ck}/iter_{n} at step {n}" in output(where, "resumed")
    after = losses(where, "resumed")
    assert sorted(after) == [n + 1, n + 2]
    full = losses(where, "full")
    assert {**losses(where, "long"), **after} == {k: full[k] for k in range(1, n + 3)}  # exact

    # Saved by 2 processes, restored by 1 (both devices in one process): the same next losses.
    assert jobs.single == [0], output(where, "single")
    single = losses(where, "single")
    assert sorted(single) == [n + 1, n + 2]
    # Bit for bit: each device runs the same SPMD-partitioned program (same HLO, same XLA, the tests'
    # flags), whether its peer is in this process or another; only the collectives' transport differs,
    # and a reduction over 2 devices adds 2 operands, a + b = b + a whatever the order (the halving of
    # a mean is exact). Exact as the resume above (and measured so).
    assert single == after, (single, after)

    # Saved by that 1 process, restored by 2 again: the uninterrupted run's next two losses.
    assert jobs.single_saved == [n, n + 2]
    assert jobs.back == [0, 0], output(where, "back") + output(where, "back", 1)
    assert f"resumed from {where / 'ck_back'}/iter_{n + 2} at step {n + 2}" in output(where, "back")
    back = losses(where, "back")
    assert sorted(back) == [n + 3, n + 4]
    assert back == {k: full[k] for k in (n + 3, n + 4)}, (back, full)  # exact: the same premise


# A two-process run whose weights are sharded across the processes (fsdp=2: one device each), so
# neither holds them all, that exports itself as a sharded transformers directory at its end.
EXPORT_STEPS = 3
EXPORT_RUN = ("parallel.fsdp=2", f"train.max_steps={EXPORT_STEPS}", "train.skip_validation=true",
              "checkpoint.save=true", "checkpoint.export=hf", "checkpoint.export_max_shard_size=50KB")


@dataclass
class ExportJob(Jobs):
    """The export run alone (Jobs' launching, its own job)."""
    exited: list[int] | None = None

    def _jobs(self) -> None:
        self.exited = finish(self.launch("export", *EXPORT_RUN, f"checkpoint.save_path={self.where / 'ck'}"))


@background.setup
def export_job(ctx) -> ExportJob:
    return ExportJob(ctx.tmp_path_factory.mktemp("two_process_export"), offline_env(ctx.cache_dir))


@pytest.mark.slow
def test_a_two_process_fsdp_run_exports_once_from_process_0(export_job, tmp_path):
    """checkpoint.export=hf in a two-process run with fsdp sharding across the processes: both exit 0,
    process 0 gathered sharded arrays and wrote the directory once (no scratch directory left), with
    the tensors (and files) of `export_model.py` of the run's checkpoint in one process; it loads in
    transformers with our logits."""
    import re

    import equinox as eqx
    import jax
    import numpy as np
    from helpers import hf_logits, load_script, logits_atol
    from safetensors.numpy import load_file

    from trainer import inference

    export_job.wait()
    where, ck = export_job.where, export_job.where / "ck"
    assert export_job.error is None, export_job.error
    assert export_job.exited == [0, 0], output(where, "export") + output(where, "export", 1)
    said = re.findall(r"export: hf of step (\d+) to (\S+) \(.*; (\d+) arrays gathered", output(where, "export"))
    assert len(said) == 1, output(where, "export")
    step, path, gathered = said[0]
    assert (int(step), path) == (EXPORT_STEPS, str(ck / "export")) and int(gathered) > 0  # fsdp: not addressable
    assert complete_steps(str(ck)) == [EXPORT_STEPS]
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]  # the scratch directory was renamed

    single = tmp_path / "single"
    flags = ["--format", "hf", "--max-shard-size", "50KB"]
    assert load_script("export_model").main([str(ck), "--out", str(single), *flags]) == 0
    names = sorted(p.name for p in (ck / "export").iterdir())
    assert names == sorted(p.name for p in single.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2, names  # the 50KB limit split the ~150 KB of float32 weights
    ours = {k: v for n in shards for k, v in load_file(str(ck / "export" / n)).items()}
    theirs = {k: v for n in shards for k, v in load_file(str(single / n)).items()}
    assert set(ours) == set(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)  # exact: the same arrays, gathered or read
    for n in names:
        assert (ck / "export" / n).read_bytes() == (single / n).read_bytes(), n

    pytest.importorskip("torch", reason="parity tier (transformers + torch): pip install -e '.[dev,parity]'")
    transformers = pytest.importorskip("transformers", reason="parity tier: pip install -e '.[dev,parity]'")
    _, _, model = inference.restore_for_inference(str(ck), "latest")
    tokens_BxT = np.array(jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 257))  # writable: torch takes it
    want_BxTxV = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, tokens_BxT))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ck / "export").eval()
    got_BxTxV = hf_logits(loaded, tokens_BxT)
    # helpers.logits_atol: the longest float32 sums feeding a logit (MLP width × (blocks + 1)) at the
    # logits' scale, both sides' worst case, margin 4
    np.testing.assert_allclose(got_BxTxV, want_BxTxV, rtol=0, atol=logits_atol(model.cfg, want_BxTxV))


class ImportCheck(BackgroundProcess):
    """A fresh interpreter that imports train_jax and validates a config per optimizer, then says
    whether JAX's backend started. Its ~2 s of imports run beside the in-process tests."""

    CODE = ("import sys; sys.path.insert(0, 'tests'); from helpers import compose_config; import train_jax; "
            "from utils.config import validate; from jax._src import xla_bridge as xb; "
            "[validate(compose_config(f'optimizer={o}')) for o in __import__('optimizer').OPTIMIZERS]; "
            "print('started' if xb._backends else 'not started')")

    def __init__(self, where: Path, env: dict[str, str]):
        self.out, self.err = where / "stdout", where / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], cwd=REPO, env=env, stdout=out, stderr=err,
                                         text=True)


@background.setup
def import_check(ctx) -> ImportCheck:
    return ImportCheck(ctx.tmp_path_factory.mktemp("import_check"), offline_env(ctx.cache_dir))


def test_importing_and_validating_leaves_the_jax_backend_unstarted(import_check):
    """jax.distributed.initialize must come before anything starts JAX's backend; train() calls it
    after importing every module and validating the config (every registry: optimizers, objectives,
    sinks), so none of that may touch a device. A module that builds an optax state at import did,
    and every multi-process run then failed."""
    try:
        import_check.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        import_check.close()
    assert import_check.out.read_text().strip().splitlines()[-1:] == ["not started"], \
        import_check.err.read_text()[-2000:]
