"""eqtrain on a real SLURM cluster: the one-node cluster of scripts/slurm/local_cluster.sh (run it
as root first; CI does). Skipped when `sinfo` is not on PATH or the cluster does not answer.

- a sweep through hydra/launcher=slurm (hydra-submitit-launcher): one SLURM job per point, each
  with its own run dir, metrics.jsonl and checkpoint dir;
- `srun --ntasks=2 python train_jax.py`: two processes join by jax.distributed from SLURM's
  environment and train exactly as one process with the same two-device mesh;
- scripts/slurm/train.sbatch at a real time limit: SLURM signals the batch script, the trainer
  saves and exits 3, the script requeues the job, and the next start resumes: the losses equal an
  uninterrupted run's, bit for bit.

Every job gets a unique name; whatever a test leaves queued is cancelled by that name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import CLI_TINY, FAST_COMPILE, offline_env

REPO = Path(__file__).resolve().parents[1]
PARTITION = os.environ.get("EQTRAIN_TEST_PARTITION", "debug")
RUN = (*CLI_TINY, "train.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
       "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _cluster_problem() -> str | None:
    """Why the SLURM tests cannot run here, or None."""
    if shutil.which("sinfo") is None:
        return "no SLURM here: sinfo is not on PATH (as root, `bash scripts/slurm/local_cluster.sh` starts a local cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%T"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "the SLURM cluster does not answer: sinfo took more than 5 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    states = out.stdout.split()
    if not states:
        return f"the SLURM cluster has no partition {PARTITION!r} (set EQTRAIN_TEST_PARTITION)"
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") and not s.endswith("*")
               for s in states):
        return f"no node of partition {PARTITION!r} is up (sinfo: {' '.join(states)})"
    return None


@pytest.fixture(scope="module", autouse=True)
def _cluster():
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def job_name(request):
    """A name unique to this test; its jobs are cancelled by that name afterwards."""
    name = f"eqtrain-test-{request.node.name[:20]}-{uuid.uuid4().hex[:6]}"
    yield name
    subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)


def job_env(**extra: str) -> dict[str, str]:
    """The test's environment for jobs: offline, the session's caches, CPU, and this venv's
    python first on PATH (the batch script calls `python`)."""
    env = offline_env(os.environ["EQTRAIN_CACHE"])
    env.update(JAX_PLATFORMS="cpu", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), **extra)
    return env


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every line of metrics.jsonl, in file order (duplicates kept)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["train/loss"]) for r in map(json.loads, lines) if "train/loss" in r]


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict ({} once SLURM has forgotten the job)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def test_sweep_through_the_slurm_launcher(tmp_path, job_name):
    """Two sweep points become two SLURM jobs (an array); each writes its own run dir with its
    metrics and its own checkpoint dir under it."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train_jax.py", "-m", "hydra/launcher=slurm", f"hydra.launcher.partition={PARTITION}",
           "hydra.launcher.timeout_min=10", f"hydra.launcher.name={job_name}", f"hydra.sweep.dir={sweep}", *RUN,
           "train.max_steps=10", "optimizer=adamw,sgdm", "checkpoint.save=true"]  # save_path null: per job
    try:
        out = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the sweep did not finish in 300 s\n{e.stdout}\n{e.stderr}")
    logs = "\n".join(p.read_text() for p in sorted(sweep.glob(".submitit/*/*_log.*")))
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{logs[-3000:]}"
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
    assert "Submitit 'slurm' sweep output dir" in out.stdout + out.stderr


def test_srun_two_processes_train_as_one(tmp_path, job_name):
    """`srun --ntasks=2 python train_jax.py`: jax.distributed starts from SLURM's environment, each
    process feeds half of every global batch, and the losses are those of one process with the same
    two-device mesh (XLA's forced host devices), bit for bit."""
    args = [*RUN, "train.max_steps=10"]
    two = subprocess.Popen(
        ["srun", "--ntasks=2", f"--partition={PARTITION}", "--time=10", f"--job-name={job_name}",
         sys.executable, "train_jax.py", *args, f"hydra.run.dir={tmp_path / 'two'}"],
        cwd=REPO, env=job_env(), stdout=open(tmp_path / "two.log", "w"), stderr=subprocess.STDOUT)
    one = subprocess.Popen(  # outside SLURM, side by side with the job
        [sys.executable, "train_jax.py", *args, f"hydra.run.dir={tmp_path / 'one'}"], cwd=REPO,
        env=job_env(XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=2"),  # the job's codegen too
        stdout=open(tmp_path / "one.log", "w"),
        stderr=subprocess.STDOUT)
    codes = {name: p.wait(timeout=300) for name, p in (("two", two), ("one", one))}
    for name, code in codes.items():
        assert code == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    log = (tmp_path / "two.log").read_text()
    assert "2 cpu device(s)" in log, log[-2000:]  # the two processes' devices form one mesh
    two_losses = losses(tmp_path / "two")
    assert [s for s, _ in two_losses] == list(range(1, 11))
    assert two_losses == losses(tmp_path / "one")  # exact


STEPS = 3000  # ~30 s of training on an idle core: the time-limit signal comes while it trains


def test_time_limit_requeue_resumes_bit_identically(tmp_path, job_name):
    """train.sbatch with a 1-minute limit and the signal 30 s before it: SLURM signals the batch
    script (its clock ticks every ~30 s, so anywhere in the first half minute), the trainer saves
    and exits 3, the script requeues the job; the test then lifts the limit so that the second start
    finishes the run. Its metrics.jsonl (both segments) equals an uninterrupted run's, bit for bit."""
    ck, run = tmp_path / "ck", tmp_path / "run"
    args = [*RUN, f"train.max_steps={STEPS}", "checkpoint.save_steps=100000"]
    submit = subprocess.run(
        ["sbatch", "--parsable", f"--partition={PARTITION}", "--time=1", "--signal=B:USR1@30",
         f"--job-name={job_name}", f"--output={tmp_path / 'job.out'}", "scripts/slurm/train.sbatch", *args],
        cwd=REPO, env=job_env(EQTRAIN_SAVE_PATH=str(ck), EQTRAIN_RUN_DIR=str(run)), capture_output=True, text=True,
        timeout=30)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    reference = subprocess.Popen(
        [sys.executable, "train_jax.py", *args, f"hydra.run.dir={tmp_path / 'ref'}"], cwd=REPO, env=job_env(),
        stdout=open(tmp_path / "ref.log", "w"), stderr=subprocess.STDOUT)

    deadline, lifted, fields = time.monotonic() + 300, False, {}
    while time.monotonic() < deadline:
        fields = job_fields(job_id) or fields
        if not lifted and int(fields.get("Restarts", "0")) >= 1:
            # Requeued once: without a longer limit the next start is signalled again at once.
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True, timeout=30)
            lifted = True
        if fields.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert fields.get("JobState") == "COMPLETED", f"{fields.get('JobState')}\n{out[-4000:]}"
    assert lifted, f"the job finished without a requeue (the signal came after the run: raise STEPS)\n{out[-3000:]}"
    assert reference.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]

    stop = re.search(r"stopped by SIGUSR1 after step (\d+): saved (\S+);", out)
    assert stop, out[-4000:]
    k = int(stop.group(1))
    assert 0 < k < STEPS
    assert "requeueing job" in out and f"resumed from {ck}/iter_{k} at step {k}" in out, out[-4000:]
    got = losses(run)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # each step once: segment 1 to k, segment 2 after
    assert got == losses(tmp_path / "ref")  # bit for bit


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
