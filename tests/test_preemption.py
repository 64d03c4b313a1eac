"""Preemption through real processes of `python train_jax.py`: SIGTERM / SIGUSR1 / SIGINT finish
the step, save it and exit with the documented code; `kill -9` between saves or in the middle of
a save loses only the steps since the newest complete checkpoint; and every resume
(checkpoint.resume=auto) continues bit-identically, on one device and on an 8-device
(4 data x 2 fsdp) mesh, with and without gradient accumulation.

Runs are subprocesses whose stdout/stderr go to files (a pipe nobody reads would fill and stall a
long run). Waits poll metrics.jsonl or the checkpoint directory against a deadline; nothing sleeps
a fixed time. Exact comparisons use a constant learning rate, so the loss at step k does not
depend on train.max_steps and any uninterrupted run is a reference for the steps it covers;
dropout is on, so the restored RNG key matters as much as the weights and the data position.

Time (2 cores): a process costs ~3 s of CPU once its executables are in the JAX compilation cache
this file shares between its runs, ~12 s (8 devices: ~17 s) when it compiles them. So each
configuration is compiled by as few runs as possible and independent runs go side by side: the
signal cases share one module fixture, the 8-device cases another, and the runs that compile
start together before the first test (~50-60 s for the file on 2 idle cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import CLI_TINY
from utils.checkpoint import TMP_MARKER, complete_steps, open_checkpoint
from utils.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED

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
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
VARIANTS = {"plain": (), "accumulation": ("dataset.total_batch_size=16",)}  # batch 8 x 2 micro-batches


# ----------------------------------------------------------------------------- processes


@pytest.fixture(scope="session")
def base_env(_cache_dir, tmp_path_factory) -> dict[str, str]:
    """Offline, W&B off, the session's tokenized-corpus cache, and a JAX compilation cache shared
    by the runs of this file (the session's, if conftest set one): a resumed run loads the
    executables its interrupted run compiled (the same executables: the numbers compared are
    unaffected; a resumed program that differed would have another cache key)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR", "SMOKE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", JAX_PLATFORMS="cpu",
               EQTRAIN_CACHE=str(_cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    if "JAX_COMPILATION_CACHE_DIR" not in env:  # conftest may already give the session one
        env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_compilation_cache"))
    return env


_STARTED: list["Run"] = []  # every run of this module, killed at its end if still going


class Run:
    """One `python train_jax.py` started in the background, in its own Hydra run dir."""

    def __init__(self, where: Path, name: str, args: tuple[str, ...], env: dict[str, str]):
        self.name, self.dir = name, where / name
        self._out, self._err = where / f"{name}.stdout", where / f"{name}.stderr"
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


@pytest.fixture
def launch(tmp_path, base_env):
    """launch(name, *overrides) -> Run in tmp_path; still running at teardown: killed."""
    runs: list[Run] = []

    def start(name: str, *args: str) -> Run:
        runs.append(Run(tmp_path, name, args, base_env))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


def poll(ready, runs: list[Run], what: str, every_s: float = 0.005) -> None:
    """Until ready(); fails (killing `runs`, which ready() may change) if one of them exits first
    or the deadline passes."""
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        dead = [r for r in runs if r.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for r in runs:
                r.stop()
            why = f"{dead[0].name} exited" if dead else f"{TIMEOUT_S} s passed"
            pytest.fail(f"{why} before {what}\n" + "\n".join(r.tail() for r in runs))
        time.sleep(every_s)


def save_args(ck: Path, *more: str) -> tuple[str, ...]:
    return ("checkpoint.save=true", f"checkpoint.save_path={ck}", *more)


def tmp_dirs(ck: Path) -> list[str]:
    return sorted(name for name in os.listdir(ck) if TMP_MARKER in name) if ck.is_dir() else []


def resumed_line(ck: Path, step: int) -> str:
    return f"resumed from {ck}/iter_{step} at step {step}"


def selected(request, param: str, choices) -> list[str]:
    """The values of `param` among this module's tests that the session runs (the module's
    fixtures start runs for those only)."""
    chosen = {item.callspec.params[param] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and param in item.callspec.params}
    return [c for c in choices if c in chosen]


@dataclass
class Early:
    reference: "Reference | None"
    eight_devices: "EightDevices | None"


@pytest.fixture(scope="module", autouse=True)
def early(request, tmp_path_factory, base_env):
    """Before this module's first test, start side by side the runs that compile: the reference
    (the tiny model; the signal and kill runs then load its executables from the cache) and the
    8-device first segments, for the tests the session runs. At the end, kill any run still going."""
    items = [item for item in request.session.items if item.module is request.module]
    wants_reference = any("reference" in item.fixturenames for item in items)
    variants = selected(request, "variant", VARIANTS)
    started = Early(Reference(tmp_path_factory.mktemp("reference"), base_env) if wants_reference else None,
                    EightDevices(tmp_path_factory.mktemp("eight_devices"), base_env, variants) if variants else None)
    yield started
    if started.eight_devices is not None:
        started.eight_devices.close()
    for run in _STARTED:
        run.stop()


class Reference:
    """Uninterrupted runs of TINY + EXACT (saving at the end, so the save path is compiled too)."""

    def __init__(self, where: Path, env: dict[str, str]):
        self.where, self.env = where, env
        self.runs: dict[int, Run] = {}
        self._start(REFERENCE_STEPS)

    def _start(self, steps: int) -> None:
        self.runs[steps] = Run(self.where, f"reference_{steps}", (*TINY, *EXACT, f"train.max_steps={steps}",
                               *save_args(self.where / f"ck_{steps}", f"checkpoint.save_steps={LONG}")), self.env)

    def losses(self, steps: int) -> dict[int, float]:
        """train/loss at steps 1..`steps` of an uninterrupted run."""
        if max(self.runs) < steps:
            self._start(steps)
        length = min(s for s in self.runs if s >= steps)
        run = self.runs[length]
        run.assert_ok()
        out = run.losses()
        assert sorted(out) == list(range(1, length + 1)), run.tail()
        return {s: out[s] for s in range(1, steps + 1)}


@pytest.fixture(scope="module")
def reference(early) -> Reference:
    return early.reference


# ----------------------------------------------------------------------------- signals


@dataclass
class Stopped:
    ck: Path
    stopped: Run  # trained "forever" until the signal
    n: int  # its last step in metrics.jsonl
    on_disk: list[str]  # save_path's entries once it had exited
    resumed: Run | None  # resume=auto to n + 3 (None when the stop already went wrong)


@pytest.fixture(scope="module")
def signalled(request, tmp_path_factory, base_env, reference) -> dict[str, Stopped]:
    """For each signal: a run that is sent it after >= 3 logged steps, then its resume to n + 3.
    The runs start once the reference is done (cache warm); each is signalled as soon as it has 3
    steps (a run left training while another waits would take a core from it); the resumes run
    side by side."""
    where = tmp_path_factory.mktemp("signals")
    names = selected(request, "signame", SIGNALS)
    cks = {sig: where / f"ck_{sig}" for sig in names}

    def start(sig: str, name: str, *more: str) -> Run:
        return Run(where, f"{name}_{sig}", (*TINY, *EXACT, *save_args(cks[sig], f"checkpoint.save_steps={LONG}"),
                                            *more), base_env)

    later, stopped = list(names), {}
    waiting: list[Run] = []  # started, not yet signalled

    def step() -> bool:
        if later and reference.runs[REFERENCE_STEPS].proc.poll() is not None:
            for sig in later:
                stopped[sig] = start(sig, "stopped", f"train.max_steps={LONG}")
                waiting.append(stopped[sig])
            later.clear()
        for sig, run in stopped.items():
            if run in waiting and run.last_step() >= 3:
                run.proc.send_signal(getattr(signal, sig))
                waiting.remove(run)
        return not waiting and not later

    poll(step, waiting, "3 training steps in every run")
    out = {}
    for sig in names:
        ok = stopped[sig].finish(EXIT_TIMEOUT_S) == SIGNALS[sig]
        n = stopped[sig].last_step()  # after the exit: the steps it finished after the signal count
        on_disk = sorted(os.listdir(cks[sig])) if cks[sig].is_dir() else []
        resumed = start(sig, "resumed", "checkpoint.num_steps=3", "checkpoint.resume=auto") if ok and n else None
        out[sig] = Stopped(cks[sig], stopped[sig], n, on_disk, resumed)
    for s in out.values():
        if s.resumed is not None:
            s.resumed.finish()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signame", list(SIGNALS))
def test_signal_saves_the_last_step_exits_and_resumes_exactly(signalled, reference, signame):
    s = signalled[signame]
    run, ck, n = s.stopped, s.ck, s.n
    assert run.finish() == SIGNALS[signame], run.tail()

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
def test_repeated_sigterm_does_not_kill_the_save_it_started(launch, tmp_path):
    """SIGTERM every 2 ms until the process exits (a launcher that re-sends it, or the scheduler
    signalling again): the save the first one started must still complete, and the exit code stay 3."""
    ck = tmp_path / "ck"
    run = launch("stopped", *TINY, *EXACT, *save_args(ck, f"checkpoint.save_steps={LONG}"), f"train.max_steps={LONG}")
    poll(lambda: run.last_step() >= 3, [run], "3 training steps")
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while run.proc.poll() is None and time.monotonic() < deadline:
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    code = run.finish(EXIT_TIMEOUT_S)
    n = run.last_step()
    on_disk = sorted(os.listdir(ck)) if ck.is_dir() else []
    assert on_disk == [f"iter_{n}"], f"exit {code}; {ck} holds {on_disk}"
    assert code == EXIT_PREEMPTED, run.tail()


# ----------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_between_saves_resumes_from_the_newest_complete_checkpoint(launch, reference, tmp_path):
    ck = tmp_path / "ck"
    run = launch("killed", *TINY, *EXACT, *save_args(ck, "checkpoint.save_steps=5"), f"train.max_steps={LONG}")

    def saved_and_moved_on() -> bool:
        steps = complete_steps(str(ck))
        return bool(steps) and run.last_step() >= steps[-1] + 3

    poll(saved_and_moved_on, [run], "a complete checkpoint and 3 more steps")
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL
    killed = run.losses()
    newest = complete_steps(str(ck))[-1]
    assert newest % 5 == 0 and max(killed) >= newest

    # A resume trains with the saved config (max_steps LONG): a 3-step segment stops it.
    resumed = launch("resumed", *TINY, *EXACT, *save_args(ck, "checkpoint.save_steps=5", "checkpoint.resume=auto",
                                                          "checkpoint.num_steps=3"), f"train.max_steps={LONG}")
    resumed.assert_ok()
    assert resumed_line(ck, newest) in resumed.stdout, resumed.tail()
    after = resumed.losses()
    assert sorted(after) == [newest + 1, newest + 2, newest + 3]
    for step in set(after) & set(killed):  # steps trained again after the kill: the same losses
        assert after[step] == killed[step], step
    assert {**{s: killed[s] for s in range(1, newest + 1)}, **after} == reference.losses(newest + 3)
    assert not tmp_dirs(ck) and complete_steps(str(ck))[-1] == newest + 3


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_a_tmp_dir_that_resume_removes(launch, reference, tmp_path):
    """A save every step. Even this tiny model's save keeps its iter_N.orbax-checkpoint-tmp-* dir
    for ~200 ms (measured; dim 256 x 4 blocks: ~800 ms, but a 4x slower start), and the directory
    is polled every 1 ms, so SIGKILL lands mid-save; if that save finished anyway, try again."""
    for attempt in range(3):
        ck = tmp_path / f"ck{attempt}"
        run = launch(f"killed{attempt}", *TINY, *EXACT, *save_args(ck, "checkpoint.save_steps=1"),
                     f"train.max_steps={LONG}")
        # A save in flight, and a complete checkpoint to go back to.
        poll(lambda: tmp_dirs(ck) and complete_steps(str(ck)), [run], "a save in flight", every_s=0.001)
        run.proc.kill()
        assert run.finish() == -signal.SIGKILL
        left = tmp_dirs(ck)
        if left:
            break
    else:
        pytest.fail("three saves finished between being seen and SIGKILL")
    killed = run.losses()
    newest = complete_steps(str(ck))[-1]
    assert max(killed) > newest  # the step whose save was cut off was trained and logged

    resumed = launch("resumed", *TINY, *EXACT, *save_args(ck, "checkpoint.save_steps=1", "checkpoint.resume=auto",
                                                          "checkpoint.num_steps=2"), f"train.max_steps={LONG}")
    resumed.assert_ok()
    out = resumed.stdout
    for name in left:
        assert f"removing the incomplete checkpoint {ck}/{name}" in out, resumed.tail()
    assert resumed_line(ck, newest) in out, resumed.tail()
    after = resumed.losses()
    assert sorted(after) == [newest + 1, newest + 2]
    assert {**{s: killed[s] for s in range(1, newest + 1)}, **after} == reference.losses(newest + 2)
    assert not tmp_dirs(ck) and complete_steps(str(ck))[-1] == newest + 2


# ----------------------------------------------------------------------------- 8 devices


@dataclass
class Segmented:
    full_ck: Path
    seg_ck: Path
    first: Run  # steps 1-4 (checkpoint.num_steps=4)
    full: Run | None = None  # 8 straight steps
    second: Run | None = None  # resume=auto, steps 5-8 (both None when `first` failed)


class EightDevices:
    """Per variant, the 4-step first segment starts at once (it compiles); when it is done (cache
    warm, its save included) a thread starts the 8-step full run and the resume side by side."""

    def __init__(self, where: Path, env: dict[str, str], variants: list[str]):
        self.where, self.env = where, {**env, **EIGHT_DEVICES}
        self.closed = False
        self.runs = {v: Segmented(where / f"ck_full_{v}", where / f"ck_seg_{v}",
                                  self._start(v, "first", where / f"ck_seg_{v}", "checkpoint.num_steps=4"))
                     for v in variants}
        self._threads = [threading.Thread(target=self._follow_up, args=(v,), daemon=True) for v in variants]
        for thread in self._threads:
            thread.start()

    def _start(self, variant: str, name: str, ck: Path, *more: str) -> Run:
        return Run(self.where, f"{name}_{variant}", (*TINY, *EXACT, *VARIANTS[variant], "parallel.fsdp=2",
                                                     "train.max_steps=8", *save_args(ck, *more)), self.env)

    def _follow_up(self, variant: str) -> None:
        s = self.runs[variant]
        try:
            code = s.first.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return  # results() reports it
        if code == 0 and not self.closed:
            s.full = self._start(variant, "full", s.full_ck)
            s.second = self._start(variant, "second", s.seg_ck, "checkpoint.resume=auto")

    def results(self) -> dict[str, Segmented]:
        for thread in self._threads:
            thread.join(TIMEOUT_S)
        for s in self.runs.values():
            for run in (s.first, s.full, s.second):
                if run is not None:
                    run.finish()
        return self.runs

    def close(self) -> None:
        """No follow-up starts any more (e.g. the session stopped before the 8-device tests)."""
        self.closed = True
        for s in self.runs.values():
            s.first.stop()
        for thread in self._threads:
            thread.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def eight_devices(early) -> dict[str, Segmented]:
    return early.eight_devices.results()


def arrays(ckpt_dir: Path, item: str) -> list[np.ndarray]:
    """Every array of one orbax item as numpy, gathered onto this process's one device (a bare
    StandardCheckpointer().restore(path) refuses arrays saved over 8 devices: "Topology mismatch")."""
    import jax
    import orbax.checkpoint as ocp

    path = os.fspath(ckpt_dir / item)
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device),
                          checkpointer.metadata(path).item_metadata)
    return [np.asarray(x) for x in jax.tree.leaves(checkpointer.restore(path, target))]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_8_devices_segmented_run_is_bit_identical(eight_devices, variant):
    """4 data x 2 fsdp on 8 forced host devices: 4 steps + resume=auto to 8 equals 8 straight
    steps, losses and final arrays alike (model, optimizer state, step and RNG key)."""
    s = eight_devices[variant]
    s.first.assert_ok()
    s.second.assert_ok()
    s.full.assert_ok()
    assert "8 cpu device(s)" in s.full.stdout
    assert resumed_line(s.seg_ck, 4) in s.second.stdout, s.second.tail()
    first, second, full = s.first.losses(), s.second.losses(), s.full.losses()
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == full  # exact, step by step
    assert complete_steps(str(s.full_ck)) == [8] and complete_steps(str(s.seg_ck)) == [4, 8]
    assert open_checkpoint(str(s.seg_ck), "iter_8", True).manifest["devices"] == 8
    for item in ("model", "opt_state", "progress"):
        xs, ys = arrays(s.full_ck / "iter_8", item), arrays(s.seg_ck / "iter_8", item)
        assert len(xs) == len(ys) and xs
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)
