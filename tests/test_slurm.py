"""eqtrain on a real SLURM cluster: the one-node cluster of scripts/slurm/local_cluster.sh (run it
as root first; CI does). Skipped when `sinfo` is not on PATH or the cluster does not answer, except
where EQTRAIN_REQUIRE_SLURM=1 (.ci/run sets it as root with apt-get): there that fails them.

- a sweep through hydra/launcher=slurm (hydra-submitit-launcher): one SLURM job per point, each
  with its own run dir, metrics.jsonl and checkpoint dir;
- `srun --ntasks=2 python train_jax.py`: two processes join by jax.distributed from SLURM's
  environment and train exactly as one process with the same two-device mesh;
- scripts/slurm/train.sbatch at a real time limit: SLURM signals the batch script, the trainer
  saves and exits 3, the script requeues the job, and the next start resumes and finishes: the
  losses equal an uninterrupted run's, bit for bit, across the stop (the reference runs to 100
  steps past it; resumed deterministic training is then the same computation);
- train.sbatch with two tasks, signalled: both save and stop, one exiting well after the other,
  and the job is still requeued and resumes;
- the same job requeued by SLURM (`scontrol requeue`, as a preemption does): SIGTERM reaches every
  process at once, srun included, both trainers save within KillWait and the job resumes.

The jobs are submitted from the session's background (tests/background.py) while earlier tests
run in the pytest process, one scenario after another; the tests inspect what they left. Every job
gets a unique name; whatever is still queued when the session ends is cancelled by that name.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import background
import pytest
from helpers import CLI_TINY, SUITE_XLA_FLAGS, offline_env
from slurm_cluster import cluster_problem, no_cluster

REPO = Path(__file__).resolve().parents[1]
PARTITION = os.environ.get("EQTRAIN_TEST_PARTITION", "debug")
RUN = (*CLI_TINY, "train.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
       "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _cluster_problem() -> str | None:
    """Why the SLURM tests cannot run here, or None."""
    return cluster_problem(PARTITION)


@pytest.fixture(scope="module", autouse=True)
def _cluster():
    problem = _cluster_problem()
    if problem:
        no_cluster(problem)  # a skip, or a failure where EQTRAIN_REQUIRE_SLURM=1 (.ci/run as root with apt)


def job_env(cache_dir, **extra: str) -> dict[str, str]:
    """The environment of the jobs: offline, the session's caches, CPU, and this venv's python
    first on PATH (the batch script calls `python`)."""
    env = offline_env(cache_dir)
    env.update(JAX_PLATFORMS="cpu", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), **extra)
    return env


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every line of metrics.jsonl, in file order (duplicates kept)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["train/loss"]) for r in map(json.loads, lines) if "train/loss" in r]


def kill_wait_s() -> int:
    """SLURM's KillWait: how long a terminated step's processes have between SIGTERM and SIGKILL."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    found = re.search(r"^KillWait\s*=\s*(\d+)", out.stdout, re.M)
    return int(found.group(1)) if found else 30


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict ({} once SLURM has forgotten the job)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


class Scenarios:
    """The SLURM jobs of the session's tests, one scenario after another in the order submitted, by
    a thread started from the session's background (tests/background.py) while earlier tests run in
    the pytest process: the time-limit scenario spends most of its two minutes waiting on SLURM's
    clock. Each scenario records what its test checks, or the error that stopped it; every job is
    named `eqtrain-test-<scenario>-<random>` and cancelled by that name when the session closes."""

    def __init__(self, where: Path, cache_dir):
        self.where, self.cache_dir = where, cache_dir
        self.results: dict[str, dict] = {}
        self.names: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self._done: dict[str, threading.Event] = {}
        self._pending: list[str] = []
        self._thread: threading.Thread | None = None  # running while scenarios are pending

    def submit(self, scenario: str) -> "Submitted":
        with self._lock:
            self.names[scenario] = f"eqtrain-test-{scenario}-{uuid.uuid4().hex[:6]}"
            self._done[scenario] = threading.Event()
            self._pending.append(scenario)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="slurm scenarios", daemon=True)
                self._thread.start()
        return Submitted(self, scenario)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                scenario = self._pending.pop(0)
            try:
                self.results[scenario] = getattr(self, scenario)(self.where / scenario, self.names[scenario])
            except BaseException as e:  # noqa: BLE001 - the scenario's test reports it
                self.results[scenario] = {"error": f"{type(e).__name__}: {e}"}
            self._done[scenario].set()

    def popen(self, cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is over")
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(self.cache_dir, **env), stdout=out,
                                        stderr=subprocess.STDOUT)
            self._procs.append(proc)
            return proc

    def result(self, scenario: str) -> dict:
        if not self._done[scenario].wait(600):
            pytest.fail(f"the {scenario} scenario did not finish within 600 s")
        found = self.results[scenario]
        assert "error" not in found, found["error"]
        return found

    def wait(self) -> None:  # a background handle (tests/background.py)
        for done in list(self._done.values()):
            done.wait()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for name in self.names.values():
            subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # ---- the scenarios: each returns what its test checks

    def time_limit(self, where: Path, name: str) -> dict:
        """train.sbatch with a 1-minute limit and the signal 30 s before it; once the job has been
        requeued, its limit is lifted so that the second start finishes the run. The reference, an
        uninterrupted run, starts once the job has said where it stopped (step k) and trains k +
        AFTER_STOP steps: the lr is constant, so the loss at a step does not depend on max_steps."""
        where.mkdir(parents=True)
        ck, run = where / "ck", where / "run"
        args = [*RUN, f"train.max_steps={STEPS}", "checkpoint.save_steps=100000"]
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is over")
            submit = subprocess.run(
                ["sbatch", "--parsable", f"--partition={PARTITION}", "--time=1", "--signal=B:USR1@30",
                 f"--job-name={name}", f"--output={where / 'job.out'}", "scripts/slurm/train.sbatch", *args],
                cwd=REPO, env=job_env(self.cache_dir, EQTRAIN_SAVE_PATH=str(ck), EQTRAIN_RUN_DIR=str(run)),
                capture_output=True, text=True, timeout=30)
        if submit.returncode != 0:
            return {"error": f"sbatch failed: {submit.stderr}"}
        job_id = submit.stdout.strip().split(";")[0]
        deadline, lifted, fields, reference = time.monotonic() + 300, False, {}, None
        while time.monotonic() < deadline and not self._closed:
            fields = job_fields(job_id) or fields
            if not lifted and int(fields.get("Restarts", "0")) >= 1:
                # Requeued once: without a longer limit the next start is signalled again at once.
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True, timeout=30)
                lifted = True
            stop = None
            if reference is None and (where / "job.out").exists():  # read until the stop is known
                stop = STOP_LINE.search((where / "job.out").read_text())
            if stop:
                steps = min(STEPS, int(stop.group(1)) + AFTER_STOP)
                reference = self.popen([sys.executable, "train_jax.py", *args, f"train.max_steps={steps}",
                                        f"hydra.run.dir={where / 'ref'}"], where / "ref.log")
            if fields.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(0.5)
        code = reference.wait(timeout=300) if reference is not None else None
        out = (where / "job.out").read_text() if (where / "job.out").exists() else ""
        return {"state": fields.get("JobState"), "lifted": lifted, "out": out, "ck": ck, "run": run,
                "reference": code, "ref": where / "ref"}

    def srun(self, where: Path, name: str) -> dict:
        """`srun --ntasks=2 python train_jax.py` and, outside SLURM and side by side with it, one
        process with two forced host devices (the same mesh, compiled like the job)."""
        where.mkdir(parents=True)
        args = [*RUN, "train.max_steps=10"]
        two = self.popen(["srun", "--ntasks=2", f"--partition={PARTITION}", "--time=10", f"--job-name={name}",
                          sys.executable, "train_jax.py", *args, f"hydra.run.dir={where / 'two'}"], where / "two.log")
        one = self.popen([sys.executable, "train_jax.py", *args, f"hydra.run.dir={where / 'one'}"], where / "one.log",
                         XLA_FLAGS=f"{SUITE_XLA_FLAGS} --xla_force_host_platform_device_count=2")
        codes = {"two": two.wait(timeout=300), "one": one.wait(timeout=300)}
        return {"codes": codes, "where": where}

    def two_tasks(self, where: Path, name: str) -> dict:
        """train.sbatch with two tasks (srun starts them; they join by jax.distributed): once they
        train, USR1 goes to the batch shell (`scancel --batch`, what --signal=B:USR1 does), both
        save and stop, the script requeues the job and the next start resumes and finishes. In the
        first start task 1 exits a few seconds more than SLURM's KillWait after task 0 (an atexit
        sleep from a sitecustomize on PYTHONPATH), as a process 0 that finishes a wandb upload or a
        slow save does: long enough for a step that srun terminates when task 0 exits (SIGTERM,
        which a stopped trainer ignores, then SIGKILL after KillWait) to kill it."""
        stop = lambda job_id: subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        return self._two_task_job(where, name, stop, slow_task=True)

    def two_tasks_requeue(self, where: Path, name: str) -> dict:
        """The same job ended from outside, the way SLURM preempts a job it requeues (PreemptMode=
        REQUEUE) or an admin moves it: `scontrol requeue`. SLURM sends SIGTERM to every process of
        the job at once (the batch shell, srun and both trainers) and SIGKILL after KillWait, and
        srun, on its SIGTERM, cancels its step ("forcing job termination"): the trainers must still
        save within that grace, and the requeued job resume from what they saved."""
        stop = lambda job_id: subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        return self._two_task_job(where, name, stop, slow_task=False)

    def _two_task_job(self, where: Path, name: str, stop: Callable[[str], Any], slow_task: bool) -> dict:
        where.mkdir(parents=True)
        ck, run = where / "ck", where / "run"
        (where / "site").mkdir()
        if slow_task:
            (where / "site" / "sitecustomize.py").write_text(
                "import atexit, os, time\n"
                "if os.environ.get('SLURM_PROCID') == '1' and os.environ.get('SLURM_RESTART_COUNT', '0') == '0':\n"
                f"    atexit.register(time.sleep, {kill_wait_s() + 3})\n")
        args = [*RUN, f"train.max_steps={TWO_TASK_STEPS}", "checkpoint.save_steps=100000"]
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is over")
            submit = subprocess.run(
                ["sbatch", "--parsable", f"--partition={PARTITION}", "--ntasks=2", "--time=10", f"--job-name={name}",
                 f"--output={where / 'job.out'}", "scripts/slurm/train.sbatch", *args],
                cwd=REPO, env=job_env(self.cache_dir, EQTRAIN_SAVE_PATH=str(ck), EQTRAIN_RUN_DIR=str(run),
                                      PYTHONPATH=str(where / "site")),
                capture_output=True, text=True, timeout=30)
        if submit.returncode != 0:
            return {"error": f"sbatch failed: {submit.stderr}"}
        job_id = submit.stdout.strip().split(";")[0]
        deadline, signalled, fields = time.monotonic() + 300, False, {}
        while time.monotonic() < deadline and not self._closed:
            fields = job_fields(job_id) or fields
            metrics = run / "metrics.jsonl"
            if not signalled and metrics.exists() and "train/loss" in metrics.read_text():
                stop(job_id)
                signalled = True
            if fields.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(0.5)
        out = (where / "job.out").read_text() if (where / "job.out").exists() else ""
        return {"state": fields.get("JobState"), "restarts": int(fields.get("Restarts", "0")), "signalled": signalled,
                "out": out, "ck": ck, "run": run}

    def sweep(self, where: Path, name: str) -> dict:
        """Two sweep points through hydra/launcher=slurm, checkpoints on without a save_path."""
        where.mkdir(parents=True)
        sweep = where / "sweep"
        proc = self.popen([sys.executable, "train_jax.py", "-m", "hydra/launcher=slurm",
                           f"hydra.launcher.partition={PARTITION}", "hydra.launcher.timeout_min=10",
                           f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep}", *RUN, "train.max_steps=10",
                           "optimizer=adamw,sgdm", "checkpoint.save=true"], where / "sweep.log")
        code = proc.wait(timeout=300)
        logs = "\n".join(p.read_text() for p in sorted(sweep.glob(".submitit/*/*_log.*")))
        return {"code": code, "sweep": sweep, "out": (where / "sweep.log").read_text(), "logs": logs}


class Submitted:
    """One scenario of Scenarios: a background handle (tests/background.py)."""

    def __init__(self, scenarios: Scenarios, scenario: str):
        self.scenarios, self.scenario = scenarios, scenario

    def result(self) -> dict:
        return self.scenarios.result(self.scenario)

    def wait(self) -> None:
        self.scenarios._done[self.scenario].wait()

    def close(self) -> None:
        self.scenarios.close()


# The background set-ups: `slurm_job` once per scenario that a selected test names (indirect
# parametrization), submitted in the order of `params` (the longest first: its waits overlap the
# others' compiles) to the one Scenarios of the session.


@background.setup
def slurm_scenarios(ctx) -> Scenarios | None:
    if _cluster_problem():
        return None  # the module's autouse fixture skips its tests
    return Scenarios(ctx.tmp_path_factory.mktemp("slurm"), ctx.cache_dir)


@background.setup(params=["time_limit", "two_tasks", "two_tasks_requeue", "srun", "sweep"])
def slurm_job(ctx, scenario: str) -> Submitted | None:
    scenarios = ctx.setup("slurm_scenarios")
    return None if scenarios is None else scenarios.submit(scenario)


@pytest.mark.parametrize("slurm_job", ["sweep"], indirect=True)
def test_sweep_through_the_slurm_launcher(slurm_job):
    """Two sweep points become two SLURM jobs (an array); each writes its own run dir with its
    metrics and its own checkpoint dir under it."""
    r = slurm_job.result()
    sweep = r["sweep"]
    assert r["code"] == 0, f"{r['out'][-3000:]}\n{r['logs'][-3000:]}"
    runs = {}
    for job in ("0", "1"):
        run = sweep / job
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        optimizer = re.search(r"optimizer=(\w+)", overrides).group(1)
        steps = [s for s, _ in losses(run)]
        assert steps == list(range(1, 11)), (job, steps)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_10"], job
        runs[optimizer] = losses(run)
    assert sorted(runs) == ["adamw", "sgdm"]
    assert runs["adamw"] != runs["sgdm"]
    assert "Submitit 'slurm' sweep output dir" in r["out"]


@pytest.mark.parametrize("slurm_job", ["srun"], indirect=True)
def test_srun_two_processes_train_as_one(slurm_job):
    """`srun --ntasks=2 python train_jax.py`: jax.distributed starts from SLURM's environment, each
    process feeds half of every global batch, and the losses are those of one process with the same
    two-device mesh (XLA's forced host devices), bit for bit."""
    r = slurm_job.result()
    where = r["where"]
    for name, code in r["codes"].items():
        assert code == 0, (where / f"{name}.log").read_text()[-3000:]
    log = (where / "two.log").read_text()
    assert "2 cpu device(s)" in log, log[-2000:]  # the two processes' devices form one mesh
    two_losses = losses(where / "two")
    assert [s for s, _ in two_losses] == list(range(1, 11))
    assert two_losses == losses(where / "one")  # exact


STEPS = 3000  # ~30 s of training on an idle core: the time-limit signal comes while it trains
AFTER_STOP = 100  # steps of the second segment that the reference covers
STOP_LINE = re.compile(r"stopped by SIGUSR1 after step (\d+): saved (\S+);")
TERM_LINE = re.compile(r"stopped by SIGTERM after step (\d+): saved ")


@pytest.mark.parametrize("slurm_job", ["time_limit"], indirect=True)
def test_time_limit_requeue_resumes_bit_identically(slurm_job):
    """train.sbatch with a 1-minute limit and the signal 30 s before it: SLURM signals the batch
    script (its clock ticks every ~30 s, so anywhere in the first half minute), the trainer saves
    and exits 3, the script requeues the job; the test then lifts the limit so that the second start
    finishes the run. Its metrics.jsonl (both segments) has every step once and equals an
    uninterrupted run's, bit for bit, up to AFTER_STOP steps after the stop."""
    r = slurm_job.result()
    out, ck = r["out"], r["ck"]
    assert r["state"] == "COMPLETED", f"{r['state']}\n{out[-4000:]}"
    assert r["lifted"], f"the job finished without a requeue (the signal came after it: raise STEPS)\n{out[-3000:]}"
    assert r["reference"] == 0, (r["ref"].parent / "ref.log").read_text()[-3000:]

    stop = STOP_LINE.search(out)
    assert stop, out[-4000:]
    k = int(stop.group(1))
    assert 0 < k < STEPS
    assert "requeueing job" in out and f"resumed from {ck}/iter_{k} at step {k}" in out, out[-4000:]
    got = losses(r["run"])
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # each step once: segment 1 to k, segment 2 after
    assert all(math.isfinite(loss) for _, loss in got)
    reference = losses(r["ref"])
    assert len(reference) == min(STEPS, k + AFTER_STOP)
    assert got[:len(reference)] == reference  # bit for bit, across the stop


@pytest.mark.skipif(os.geteuid() != 0, reason="local_cluster.sh sets up a cluster as root only")
def test_local_cluster_script_second_run_is_quick():
    """Run again on a running cluster, the script installs and restarts nothing, and says so."""
    conf = Path("/etc/slurm/slurm.conf")
    if not conf.exists() or "local_cluster.sh" not in conf.read_text():
        pytest.skip("this cluster was not set up by scripts/slurm/local_cluster.sh")
    start = time.monotonic()
    out = subprocess.run(["bash", "scripts/slurm/local_cluster.sh"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installing" not in out.stdout and "starting" not in out.stdout and "writing" not in out.stdout, out.stdout
    assert "sinfo, srun and sbatch are ready" in out.stdout
    assert time.monotonic() - start < 20
    nobody = subprocess.run(["su", "nobody", "-s", "/bin/bash", "-c", "bash scripts/slurm/local_cluster.sh"],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert nobody.returncode == 0 and nobody.stdout.strip().count("\n") == 0 and "not root" in nobody.stdout


TWO_TASK_STEPS = 100  # ~0.1 s a step (an all-gather and a log line each): the stop comes a few steps after the first


@pytest.mark.parametrize("slurm_job", ["two_tasks"], indirect=True)
def test_two_task_job_signalled_requeues_and_resumes(slurm_job):
    """A 2-task train.sbatch job (srun): USR1 to the batch shell reaches both trainers, which agree
    on a step, save together and exit 3, task 1 some seconds after task 0. The first exit must not
    make srun kill the other task (--kill-on-bad-exit) nor srun's status hide the 3 behind that kill:
    the job is requeued, and its next start resumes at the saved step and finishes, every step
    logged once."""
    r = slurm_job.result()
    out, ck = r["out"], r["ck"]
    assert r["signalled"], f"the job never logged a training step\n{out[-3000:]}"
    assert r["state"] == "COMPLETED" and r["restarts"] == 1, f"{r['state']}, {r['restarts']} restart(s)\n{out[-4000:]}"
    stop = STOP_LINE.search(out)
    assert stop, out[-4000:]
    k = int(stop.group(1))
    assert 0 < k < TWO_TASK_STEPS, f"the job finished before the signal (raise TWO_TASK_STEPS)\n{out[-3000:]}"
    assert "requeueing job" in out and f"resumed from {ck}/iter_{k} at step {k}" in out, out[-4000:]
    assert "2 task(s)" in out
    got = losses(r["run"])
    assert [s for s, _ in got] == list(range(1, TWO_TASK_STEPS + 1))  # each step once, across the stop
    assert all(math.isfinite(loss) for _, loss in got)


@pytest.mark.parametrize("slurm_job", ["two_tasks_requeue"], indirect=True)
def test_two_task_job_requeued_by_slurm_saves_on_sigterm_and_resumes(slurm_job):
    """`scontrol requeue` (SLURM's own requeue, as a preemption does) sends SIGTERM to every process
    of the 2-task job at once, srun included, which then cancels its step: both trainers still save
    the step they agreed on within KillWait, SLURM requeues the job itself (the script does not
    requeue a second time on SIGTERM), and the next start resumes there, every step logged once."""
    r = slurm_job.result()
    out, ck = r["out"], r["ck"]
    assert r["signalled"], f"the job never logged a training step\n{out[-3000:]}"
    assert r["state"] == "COMPLETED" and r["restarts"] == 1, f"{r['state']}, {r['restarts']} restart(s)\n{out[-4000:]}"
    stops = TERM_LINE.findall(out)
    assert len(stops) == 2 and stops[0] == stops[1], out[-4000:]  # both tasks, the same step
    k = int(stops[0])
    assert 0 < k < TWO_TASK_STEPS, f"the job finished before the signal (raise TWO_TASK_STEPS)\n{out[-3000:]}"
    assert "2 of 2 task(s) saved and stopped" in out and "requeueing job" not in out, out[-4000:]
    assert f"resumed from {ck}/iter_{k} at step {k}" in out, out[-4000:]
    got = losses(r["run"])
    assert [s for s, _ in got] == list(range(1, TWO_TASK_STEPS + 1))  # each step once, across the stop
    assert all(math.isfinite(loss) for _, loss in got)
