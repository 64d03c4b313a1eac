"""Preemption through real processes of `python train_jax.py`: SIGTERM / SIGUSR1 / SIGINT finish
the step, save it and exit with the documented code (a SIGTERM repeated every 2 ms included);
`kill -9` between saves and in the middle of a save loses only the steps since the newest complete
checkpoint; and every resume (checkpoint.resume=auto) continues bit-identically, on one device and
on an 8-device (4 data x 2 fsdp) mesh, with and without gradient accumulation.

Runs are subprocesses whose stdout/stderr go to files (a pipe nobody reads would fill and stall a
long run). Waits poll metrics.jsonl or the checkpoint directory against a deadline; nothing sleeps
a fixed time. Exact comparisons use a constant learning rate, so the loss at step k does not
depend on train.max_steps and any uninterrupted run is a reference for the steps it covers;
dropout is on, so the restored RNG key matters as much as the weights and the data position.

Time (2 cores): a process costs ~3 s of CPU once its executables are in the JAX compilation cache
this file shares between its runs, ~12 s (8 devices: ~17 s) when it compiles them. So each
configuration is compiled by one run, every scenario is a chain of runs that a thread drives in the
background from the start of the session (background set-ups, tests/background.py, while earlier
tests run in the pytest process; the runs that compile start at once, the others once the reference has filled the
cache), and the tests only inspect what the chains left behind. Runs are shared where one run can
show several things: the SIGTERM run is sent SIGTERM every 2 ms (the
repeated-signal case), one `kill -9` lands in a save with training steps after the newest complete
checkpoint (both kill cases), and the 8-device straight run also writes the checkpoint the
segmented run resumes from. 13 processes in all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import background
import numpy as np
import pytest
from helpers import CLI_TINY, SUITE_XLA_FLAGS, item_metadata, offline_env, restore_item

from utils.checkpoint.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED
from utils.checkpoint.storage import TMP_MARKER, complete_steps, open_checkpoint

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train_jax.py")

TINY = (
    *CLI_TINY,
    "train.sample_tokens=0",
    "logging.log_every=1",  # a train/loss record at every step
    "logging.progress_bar=false",
)
EXACT = ("optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3", "model.dropout=0.1",
         "train.skip_validation=true")
LONG = 100_000  # "forever": these runs end by a signal
TIMEOUT_S = 240  # per wait; a healthy run needs a small fraction of it
EXIT_TIMEOUT_S = 60  # from a signal to the exit: one step and one save
REFERENCE_STEPS = 30  # the shared uninterrupted run; a longer one is made if a test needs more
SIGNALS = {"SIGTERM": EXIT_PREEMPTED, "SIGUSR1": EXIT_PREEMPTED, "SIGINT": EXIT_INTERRUPTED}
STORM = "SIGTERM"  # this signal is sent again every 2 ms until the process exits
KILL_SAVE_STEPS = 5  # the kill -9 run saves every 5 steps: steps between saves, and a save to cut
EIGHT_DEVICES = {"XLA_FLAGS": f"{SUITE_XLA_FLAGS} --xla_force_host_platform_device_count=8"}
VARIANTS = {"plain": (), "accumulation": ("dataset.total_batch_size=16",)}  # batch 8 x 2 micro-batches


# ----------------------------------------------------------------------------- processes


def base_env(cache_dir) -> dict[str, str]:
    """Offline, W&B off, the session's tokenized-corpus cache, and the session's JAX compilation cache
    (tests/conftest.py's): a resumed run loads the executables its interrupted run compiled (the same
    executables: the numbers compared are unaffected; a resumed program that differed would have
    another cache key)."""
    return {**offline_env(cache_dir), "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


class ChainFailed(Exception):
    """A chain could not go on (a run exited early, a deadline passed); the tests report it."""


_STARTED: list["Run"] = []  # every run of this module, killed at its end if still going
_LOCK = threading.Lock()  # guards _STARTED and _CLOSED: no chain starts a run once the module is over
_CLOSED = threading.Event()


class Run:
    """One `python train_jax.py` started in the background, in its own Hydra run dir."""

    def __init__(self, where: Path, name: str, args: tuple[str, ...], env: dict[str, str]):
        self.name, self.dir = name, where / name
        self._out, self._err = where / f"{name}.stdout", where / f"{name}.stderr"
        with _LOCK:
            if _CLOSED.is_set():
                raise ChainFailed(f"{name}: not started, the module's tests are over")
            with open(self._out, "w") as out, open(self._err, "w") as err:
                self.proc = subprocess.Popen([sys.executable, TRAIN, f"hydra.run.dir={self.dir}", *args],
                                             cwd=REPO, env=env, stdout=out, stderr=err)
            _STARTED.append(self)

    @property
    def stdout(self) -> str:
        return self._out.read_text()

    @property
    def stderr(self) -> str:
        return self._err.read_text()

    def tail(self) -> str:
        return (f"{self.name}: exit {self.proc.poll()}\nstdout:\n{self.stdout[-3000:]}\n"
                f"stderr:\n{self.stderr[-3000:]}")

    def losses(self) -> dict[int, float]:
        """train/loss by step from metrics.jsonl (complete lines only: the run may be writing)."""
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return {}
        text = path.read_text()
        records = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
        return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}

    def last_step(self) -> int:
        return max(self.losses(), default=0)

    def finish(self, timeout_s: float = TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.name} did not exit within {timeout_s} s\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def assert_ok(self) -> None:
        assert self.finish() == 0, self.tail()
        assert "Traceback" not in self.stderr, self.tail()


def close_all() -> None:
    """Kill every run of this module still going; a chain still going fails at its next wait or start."""
    with _LOCK:
        _CLOSED.set()
        for run in _STARTED:
            run.stop()


def wait_for(ready: Callable[[], object], runs: list[Run], what: str, every_s: float = 0.005) -> None:
    """Until ready(); raises ChainFailed (killing `runs`) if one of them exits first or the
    deadline passes. Used in the chains' threads, where pytest.fail would be lost."""
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        dead = [r for r in runs if r.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for r in runs:
                r.stop()
            why = f"{dead[0].name} exited" if dead else f"{TIMEOUT_S} s passed"
            raise ChainFailed(f"{why} before {what}\n" + "\n".join(r.tail() for r in runs))
        time.sleep(every_s)


def exit_code(run: Run, timeout_s: float = TIMEOUT_S) -> int:
    try:
        return run.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        run.stop()
        raise ChainFailed(f"{run.name} did not exit within {timeout_s} s\n{run.tail()}") from None


def save_args(ck: Path, *more: str) -> tuple[str, ...]:
    return ("checkpoint.save=true", f"checkpoint.save_path={ck}", *more)


def tmp_dirs(ck: Path) -> list[str]:
    return sorted(name for name in os.listdir(ck) if TMP_MARKER in name) if ck.is_dir() else []


def resumed_line(ck: Path, step: int) -> str:
    return f"resumed from {ck}/iter_{step} at step {step}"


class Chain:
    """A function run in a background thread from the start of the module; result() waits for it
    and turns its failure into the test's."""

    def __init__(self, name: str, body: Callable[[], object]):
        self.name, self._body = name, body
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._body()
        except ChainFailed as e:
            self._error = str(e)
        except Exception as e:  # noqa: BLE001 - reported by result()
            self._error = f"{type(e).__name__}: {e}"

    def wait(self) -> None:  # a background handle (tests/background.py)
        self._thread.join()

    def close(self) -> None:
        close_all()

    def result(self):
        self._thread.join(4 * TIMEOUT_S)
        if self._thread.is_alive():
            pytest.fail(f"{self.name} still going after {4 * TIMEOUT_S} s")
        if self._error is not None:
            pytest.fail(f"{self.name}: {self._error}")
        return self._value


# ----------------------------------------------------------------------------- the chains


class Reference:
    """Uninterrupted runs of TINY + EXACT (saving at the end, so the save path is compiled too)."""

    def __init__(self, where: Path, env: dict[str, str]):
        self.where, self.env = where, env
        self.runs: dict[int, Run] = {}
        self._lock = threading.Lock()
        self._start(REFERENCE_STEPS)

    def _start(self, steps: int) -> None:
        self.runs[steps] = Run(self.where, f"reference_{steps}", (*TINY, *EXACT, f"train.max_steps={steps}",
                               *save_args(self.where / f"ck_{steps}", f"checkpoint.save_steps={LONG}")), self.env)

    def wait(self) -> None:  # a background handle (tests/background.py)
        for run in list(self.runs.values()):
            run.proc.wait()

    def close(self) -> None:
        close_all()

    def wait_warm(self) -> None:
        """Until the first reference run has exited: its executables are in the cache."""
        exit_code(self.runs[REFERENCE_STEPS])

    def losses(self, steps: int) -> dict[int, float]:
        """train/loss at steps 1..`steps` of an uninterrupted run."""
        with self._lock:
            if max(self.runs) < steps:
                self._start(steps)
            length = min(s for s in self.runs if s >= steps)
            run = self.runs[length]
        run.assert_ok()
        out = run.losses()
        assert sorted(out) == list(range(1, length + 1)), run.tail()
        return {s: out[s] for s in range(1, steps + 1)}


@dataclass
class Stopped:
    sig: str
    ck: Path
    stopped: Run  # trained "forever" until the signal
    code: int  # its exit code
    n: int  # its last step in metrics.jsonl
    on_disk: list[str]  # save_path's entries once it had exited
    resumed: Run | None  # resume=auto to n + 3 (None when the stop already went wrong)


def signal_chain(where: Path, env: dict[str, str], reference: Reference, sig: str) -> Stopped:
    """Once the reference is done (cache warm): a run sent `sig` after >= 3 logged steps (STORM: again
    every 2 ms until it exits), then its resume to n + 3."""
    ck = where / f"ck_{sig}"

    def start(name: str, *more: str) -> Run:
        return Run(where, f"{name}_{sig}", (*TINY, *EXACT, *save_args(ck, f"checkpoint.save_steps={LONG}"), *more), env)

    reference.wait_warm()
    run = start("stopped", f"train.max_steps={LONG}")
    wait_for(lambda: run.last_step() >= 3, [run], "3 training steps")
    run.proc.send_signal(getattr(signal, sig))
    if sig == STORM:  # a launcher that re-sends it, or the scheduler signalling again
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
            try:
                run.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:  # exited in between
                break
    code = exit_code(run, EXIT_TIMEOUT_S)
    n = run.last_step()  # after the exit: the steps it finished after the signal count
    on_disk = sorted(os.listdir(ck)) if ck.is_dir() else []
    resumed = (start("resumed", "checkpoint.num_steps=3", "checkpoint.resume=auto") if code == SIGNALS[sig] and n
               else None)
    if resumed is not None:
        exit_code(resumed)
    return Stopped(sig, ck, run, code, n, on_disk, resumed)


@dataclass
class Killed:
    ck: Path
    killed: dict[int, float]  # the killed run's losses
    left: list[str]  # the tmp dirs it left
    newest: int  # its newest complete checkpoint
    resumed: Run


def kill_chain(where: Path, env: dict[str, str], reference: Reference) -> Killed:
    """Once the reference is done: a run saving every KILL_SAVE_STEPS steps is sent SIGKILL while a save
    is in flight and a complete checkpoint exists, so it dies with steps trained after its newest
    checkpoint and a save cut off (the directory is polled every 1 ms; an orbax save of this model
    keeps its tmp dir ~200 ms; if that save finished anyway, another run tries again), then
    resume=auto for 3 steps."""
    reference.wait_warm()
    save = f"checkpoint.save_steps={KILL_SAVE_STEPS}"
    for attempt in range(3):
        ck = where / f"ck{attempt}"
        run = Run(where, f"killed{attempt}", (*TINY, *EXACT, *save_args(ck, save), f"train.max_steps={LONG}"), env)
        # A save in flight, and a complete checkpoint to go back to.
        wait_for(lambda ck=ck: tmp_dirs(ck) and complete_steps(str(ck)), [run], "a save in flight", every_s=0.001)
        run.proc.kill()
        if (code := exit_code(run)) != -signal.SIGKILL:
            raise ChainFailed(f"exit {code} after SIGKILL\n{run.tail()}")
        left = tmp_dirs(ck)
        if left:
            break
    else:
        raise ChainFailed("three saves finished between being seen and SIGKILL")
    killed, newest = run.losses(), complete_steps(str(ck))[-1]
    # A resume trains with the saved config (max_steps LONG): a 3-step segment stops it.
    resumed = Run(where, "resumed", (*TINY, *EXACT,
                                     *save_args(ck, save, "checkpoint.resume=auto", "checkpoint.num_steps=3"),
                                     f"train.max_steps={LONG}"), env)
    exit_code(resumed)
    return Killed(ck, killed, left, newest, resumed)


@dataclass
class Segmented:
    full_ck: Path
    seg_ck: Path
    full: Run  # 8 straight steps, saving iter_4 and iter_8
    second: Run | None = None  # resume=auto from a save_path holding only the full run's iter_4: steps 5-8


def eight_device_chain(where: Path, env: dict[str, str], variant: str) -> Segmented:
    """At once (it compiles): 8 straight steps saving at 4 and 8; then its iter_4 alone in a new
    save_path, which resume=auto continues to step 8."""
    env = {**env, **EIGHT_DEVICES}

    def start(name: str, ck: Path, *more: str) -> Run:
        return Run(where, f"{name}_{variant}", (*TINY, *EXACT, *VARIANTS[variant], "parallel.fsdp=2",
                                                "train.max_steps=8", *save_args(ck, *more)), env)

    full_ck = where / f"ck_full_{variant}"
    s = Segmented(full_ck, where / f"ck_seg_{variant}", start("full", full_ck, "checkpoint.save_steps=4"))
    if exit_code(s.full) == 0 and (s.full_ck / "iter_4").is_dir():
        shutil.copytree(s.full_ck / "iter_4", s.seg_ck / "iter_4")
        s.second = start("second", s.seg_ck, "checkpoint.resume=auto")
        exit_code(s.second)
    return s


# The background set-ups (tests/background.py): each starts at the beginning of the session if a
# selected test requests its fixture. The reference and the 8-device chains start runs at once
# (they compile); the signal and kill chains wait for the reference to exit (cache warm).


@background.setup
def reference(ctx) -> Reference:
    return Reference(ctx.tmp_path_factory.mktemp("reference"), base_env(ctx.cache_dir))


@background.setup(params=list(VARIANTS))
def eight_devices(ctx, variant: str) -> Chain:
    where, env = ctx.tmp_path_factory.mktemp(f"eight_devices_{variant}"), base_env(ctx.cache_dir)
    return Chain(f"8 devices, {variant}", lambda: eight_device_chain(where, env, variant))


@background.setup(params=list(SIGNALS))
def signal_run(ctx, sig: str) -> Chain:
    where, env, ref = ctx.tmp_path_factory.mktemp(f"signal_{sig}"), base_env(ctx.cache_dir), ctx.setup("reference")
    return Chain(sig, lambda: signal_chain(where, env, ref, sig))


@background.setup
def kill_run(ctx) -> Chain:
    where, env, ref = ctx.tmp_path_factory.mktemp("kill_9"), base_env(ctx.cache_dir), ctx.setup("reference")
    return Chain("kill -9", lambda: kill_chain(where, env, ref))


# ----------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_signal_saves_the_last_step_exits_and_resumes_exactly(signal_run, reference):  # one case per signal
    s = signal_run.result()
    signame, run, ck, n = s.sig, s.stopped, s.ck, s.n
    assert s.code == SIGNALS[signame], run.tail()

    before = run.losses()
    assert sorted(before) == list(range(1, n + 1)) and n >= 3
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.tail()  # one line, no traceback
    assert signame in lines[0] and f"{ck}/iter_{n}" in lines[0] and "checkpoint.resume=auto" in lines[0], lines[0]
    assert s.on_disk == [f"iter_{n}"]  # the step it stopped after, complete (no tmp dir)
    source = open_checkpoint(str(ck), f"iter_{n}", with_opt_state=True)
    assert source.manifest["step"] == n and source.manifest["reason"] == signame
    assert source.manifest["data"]["position"] == n * 8  # n batches of 8 windows consumed

    s.resumed.assert_ok()
    assert resumed_line(ck, n) in s.resumed.stdout, s.resumed.tail()
    after = s.resumed.losses()
    assert sorted(after) == [n + 1, n + 2, n + 3]
    assert complete_steps(str(ck)) == [n, n + 3]
    assert {**before, **after} == reference.losses(n + 3)  # exact, step by step


@pytest.mark.slow
@pytest.mark.parametrize("signal_run", [STORM], indirect=True)
def test_repeated_sigterm_does_not_kill_the_save_it_started(signal_run):
    """SIGTERM every 2 ms until the process exits (a launcher that re-sends it, or the scheduler
    signalling again): the save the first one started must still complete, and the exit code stay 3.
    The STORM run of the signal test: that test also checks its single stderr line, its manifest and
    its exact resume; SIGUSR1, handled by the same code, is the case of a single signal."""
    s = signal_run.result()
    assert s.on_disk == [f"iter_{s.n}"], f"exit {s.code}; {s.ck} holds {s.on_disk}"
    assert s.code == EXIT_PREEMPTED, s.stopped.tail()


# ----------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_between_saves_resumes_from_the_newest_complete_checkpoint(kill_run, reference):
    k = kill_run.result()
    ck, killed, newest = k.ck, k.killed, k.newest
    assert newest % KILL_SAVE_STEPS == 0 and max(killed) >= newest + 3  # steps trained after the newest save
    k.resumed.assert_ok()
    assert resumed_line(ck, newest) in k.resumed.stdout, k.resumed.tail()
    after = k.resumed.losses()
    assert sorted(after) == [newest + 1, newest + 2, newest + 3]
    for step in after:  # steps trained again after the kill: the same losses
        assert step in killed and after[step] == killed[step], step
    assert {**{s: killed[s] for s in range(1, newest + 1)}, **after} == reference.losses(newest + 3)
    assert not tmp_dirs(ck) and complete_steps(str(ck))[-1] == newest + 3


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_a_tmp_dir_that_resume_removes(kill_run, reference):
    """The same run: SIGKILL landed while a save was being written (the directory is polled every
    1 ms; even this tiny model's save keeps its tmp dir for ~200 ms)."""
    k = kill_run.result()
    ck, killed, newest = k.ck, k.killed, k.newest
    assert k.left and max(killed) > newest  # the step whose save was cut off was trained and logged
    k.resumed.assert_ok()
    out = k.resumed.stdout
    for name in k.left:
        assert f"removing the incomplete checkpoint {ck}/{name}" in out, k.resumed.tail()
    assert resumed_line(ck, newest) in out, k.resumed.tail()
    after = k.resumed.losses()
    assert sorted(after) == [newest + 1, newest + 2, newest + 3]
    assert {**{s: killed[s] for s in range(1, newest + 1)}, **after} == reference.losses(newest + 3)
    assert not tmp_dirs(ck) and complete_steps(str(ck))[-1] == newest + 3


# ----------------------------------------------------------------------------- 8 devices


def arrays(ckpt_dir: Path, item: str) -> list[np.ndarray]:
    """Every array of one orbax item as numpy, gathered onto this process's one device (a bare
    StandardCheckpointer().restore(path) refuses arrays saved over 8 devices: "Topology mismatch")."""
    import jax

    path = ckpt_dir / item
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), item_metadata(path))
    return [np.asarray(x) for x in jax.tree.leaves(restore_item(path, target))]


@pytest.mark.slow
def test_8_devices_segmented_run_is_bit_identical(eight_devices):  # one case per variant
    """4 data x 2 fsdp on 8 forced host devices: resume=auto from the iter_4 of a straight 8-step run
    (in a save_path of its own) to 8 equals the straight steps 5-8, losses and final arrays alike
    (model, optimizer state, step and RNG key)."""
    s = eight_devices.result()
    s.full.assert_ok()
    assert s.second is not None, f"no iter_4 in {s.full_ck}: {sorted(os.listdir(s.full_ck))}"
    s.second.assert_ok()
    assert "8 cpu device(s)" in s.full.stdout and "8 cpu device(s)" in s.second.stdout
    assert resumed_line(s.seg_ck, 4) in s.second.stdout, s.second.tail()
    full, second = s.full.losses(), s.second.losses()
    assert sorted(full) == list(range(1, 9)) and sorted(second) == [5, 6, 7, 8]
    assert {**{k: full[k] for k in range(1, 5)}, **second} == full  # exact, step by step
    assert complete_steps(str(s.full_ck)) == [4, 8] and complete_steps(str(s.seg_ck)) == [4, 8]
    assert open_checkpoint(str(s.seg_ck), "iter_8", True).manifest["devices"] == 8
    for item in ("model", "opt_state", "progress"):
        xs, ys = arrays(s.full_ck / "iter_8", item), arrays(s.seg_ck / "iter_8", item)
        assert len(xs) == len(ys) and xs
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)
