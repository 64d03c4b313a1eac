"""The command line, end to end: `python train_jax.py [overrides]` trains and logs, and every bad
input fails fast with one line naming the knob.

Runs of the real entry point are subprocesses (marked slow: ~5-15 s each, mostly JAX compile).
Most bad inputs are checked in-process instead, by composing the config with Hydra's compose
API and calling the same `validate` / `init_*` functions `main` calls; a few go through the
subprocess to prove the exit code, the single `error:` line and that nothing was compiled.

Time (2 cores): every subprocess the session's tests of this file need starts side by side, in
the background from the start of the session (background set-ups, tests/background.py), and a
test waits for its own. The five training smoke tests share one process: a Hydra multirun of four
jobs, AdamW + cosine, SGD-momentum + linear, a diverging SGD and AdamW + cosine again (the sweep
goes on past the diverged job, and the last job must repeat the first exactly: the default launcher
runs every job in the one process), each set by an option of a config group written for it to a tmp dir on
hydra.searchpath (the single-run entry point is exercised by the train_lm.sh, divergence and
bad-input runs).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import background
import pytest
import yaml
from helpers import CLI_TINY, offline_env, rounding_rtol
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from utils.config import validate
from utils.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(REPO / "conf")
TRAIN = str(REPO / "train_jax.py")

# Small enough that a step is milliseconds and compilation dominates; byte tokens (vocab 257 -> 320).
TINY = (*CLI_TINY, "train.sample_tokens=5", "logging.log_every=5")
SUBPROCESS_TIMEOUT_S = 300


# ----------------------------------------------------------------------------- helpers


def compose_tiny(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides])


def read_metrics(path: Path) -> list[dict]:
    assert path.is_file(), f"{path} was not written"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert records, f"{path} is empty"
    return records


def only(records: list[dict], step: int) -> dict:
    matches = [r for r in records if r["step"] == step]
    assert len(matches) == 1, f"expected one record at step {step}, got {len(matches)}"
    return matches[0]


def assert_one_line_error(text: str, knob: str) -> None:
    assert "\n" not in text.strip(), f"error spans several lines: {text!r}"
    assert knob in text, f"error does not name {knob}: {text!r}"


def cli_env(cache_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Offline, W&B off, the session's tokenized-corpus cache (and, inherited, its compilation cache)."""
    env = offline_env(cache_dir)
    # scripts/train_lm.sh calls plain `python`: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return {**env, **(extra or {})}


class Started:
    """`python train_jax.py *args` (or `argv + args`) started in the background from the repo root,
    its output going to files; result() waits and gives a CompletedProcess."""

    def __init__(self, where: Path, name: str, args, env: dict[str, str], argv: list[str] | None = None,
                 run_dir: Path | None = None):
        self.name, self.run_dir = name, run_dir
        self._out, self._err = where / f"{name}.stdout", where / f"{name}.stderr"
        self.cmd = (argv or [sys.executable, TRAIN]) + list(args)
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)

    def output(self) -> tuple[str, str]:
        return self._out.read_text(), self._err.read_text()

    def result(self, timeout_s: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.output()
            pytest.fail(f"{self.cmd} did not exit within {timeout_s} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
        return subprocess.CompletedProcess(self.cmd, code, *self.output())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait(self) -> None:  # a background handle (tests/background.py)
        self.proc.wait()

    close = stop


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}"
                                  f"\nstderr:\n{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr


# The two jobs of the shared multirun: config group `cli_case`, one option per job, each a Hydra
# "experiment" config (global package, overriding the optimizer and its schedule).
ADAMW_LR, ADAMW_WARMUP = 3e-3, 15
SGDM_LR, SGDM_WARMUP, SGDM_DECAY_END = 0.5, 5, 30
CASES = {
    "adamw_cosine": f"""# @package _global_
defaults:
  - override /optimizer: adamw
  - override /optimizer/lr_config: cosine
optimizer:
  lr_config: {{lr: {ADAMW_LR}, warmup: {ADAMW_WARMUP}, min_lr: 3.0e-4}}
train: {{max_steps: 40, val_freq: 20}}
""",
    "sgdm_linear": f"""# @package _global_
defaults:
  - override /optimizer: sgdm
  - override /optimizer/lr_config: linear
optimizer:
  lr_config: {{lr: {SGDM_LR}, warmup: {SGDM_WARMUP}, max_steps: {SGDM_DECAY_END}}}
train: {{max_steps: 30}}
""",
    "sgdm_diverge": """# @package _global_
defaults:
  - override /optimizer: sgdm
  - override /optimizer/lr_config: constant
optimizer:
  lr_config: {lr: 1.0e30}
train: {max_steps: 20, gradient_clip_val: null}
""",
}
# Job 2 diverges; job 3 repeats job 0 after another optimizer and a diverged run.
SWEEP_JOBS = ("adamw_cosine", "sgdm_linear", "sgdm_diverge", "adamw_cosine")

# Bad inputs through the real CLI: (overrides, extra env, knob named in the error), by test id.
USER_ERRORS = {
    "negative-lr": (["optimizer.lr_config.lr=-1"], {}, "optimizer.lr_config.lr"),
    "glob-matches-nothing": (["dataset=text_files", "dataset.paths=[/nonexistent-eqtrain-dir/*.txt]"], {},
                             "dataset.paths"),
    "batch-not-divisible-over-2-devices": (["dataset.batch_size=3"], {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}, "dataset.batch_size"),
    # conf/ exists and holds no checkpoint: both refusals come before anything is built or written.
    "save-path-exists": (["checkpoint.save=true", "checkpoint.save_path=conf"], {}, "checkpoint.resume=auto"),
    "load-path-without-checkpoints": (["checkpoint.load=true", "checkpoint.load_path=conf"], {},
                                      "checkpoint.load_path"),
}
DIVERGED = ("train.max_steps=20", "optimizer=sgdm", "optimizer/lr_config=constant", "optimizer.lr_config.lr=1e30",
            "train.gradient_clip_val=null")
# Optuna's TPE sampler with seed 0 (conf/hydra/sweeper/optuna_lr.yaml) draws choices 1, 3, 0 of four
# for its first three trials: 3e-3, then 1e30 (AdamW diverges), then 1e-3.
OPTUNA_LRS = 'optimizer.lr_config.lr: "choice(1e-3, 3e-3, 1e-2, 1e30)"'


@dataclass
class Smoke:
    """scripts/train_lm.sh twice: stopped by SIGUSR1 after its first logged step, then again; a
    thread drives them."""
    first_dir: Path
    second_dir: Path
    first: subprocess.CompletedProcess | None = None
    second: subprocess.CompletedProcess | None = None
    error: str | None = None
    started: list[Started] = field(default_factory=list)
    closed: bool = False  # the session is over: start nothing more
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    def start(self, *args, **kwargs) -> Started:
        with self.lock:
            if self.closed:
                raise RuntimeError("the module's tests are over")
            self.started.append(Started(*args, **kwargs))
            return self.started[-1]

    def wait(self) -> None:
        self.thread.join()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for started in self.started:
                started.stop()


def smoke_chain(where: Path, env: dict[str, str], smoke: Smoke) -> None:
    try:
        _smoke_runs(where, env, smoke)
    except BaseException as e:  # noqa: BLE001 - pytest.fail's exception included: the test reports it
        smoke.error = f"{type(e).__name__}: {e}"


def _smoke_runs(where: Path, env: dict[str, str], smoke: Smoke) -> None:
    args = [*TINY, "train.max_steps=400", "logging.log_every=1", "train.val_freq=1000", "checkpoint.save=true",
            f"checkpoint.save_path={where / 'ck'}", "checkpoint.resume=auto", "checkpoint.save_steps=1000"]
    script, env = ["bash", str(REPO / "scripts" / "train_lm.sh")], {**env, "SMOKE": "1"}
    shell = smoke.start(where, "first", [f"hydra.run.dir={smoke.first_dir}", *args], env, argv=script)
    metrics = smoke.first_dir / "metrics.jsonl"
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not metrics.exists() or "train/loss" not in metrics.read_text():
        if shell.proc.poll() is not None or time.monotonic() > deadline:
            shell.stop()
            out, err = shell.output()
            smoke.error = (f"no train/loss before exit {shell.proc.poll()}\nstdout:\n{out[-3000:]}"
                           f"\nstderr:\n{err[-3000:]}")
            return
        time.sleep(0.005)
    shell.proc.send_signal(signal.SIGUSR1)
    smoke.first = shell.result()
    if smoke.first.returncode == 3:
        smoke.second = smoke.start(where, "second", [f"hydra.run.dir={smoke.second_dir}", *args], env,
                                   argv=script).result()


# The subprocess runs of this module's tests, as background set-ups (tests/background.py): each
# starts at the beginning of the session, side by side with the others, if a selected test
# requests its fixture; the tests inspect what the runs left.


def cli_run(ctx, name: str, *args: str, extra_env: dict[str, str] | None = None) -> Started:
    """`python train_jax.py *args` in its own run dir."""
    where = ctx.tmp_path_factory.mktemp(f"cli_{name}")
    return Started(where, name, [f"hydra.run.dir={where / 'run'}", *TINY, *args], cli_env(ctx.cache_dir, extra_env),
                   run_dir=where / "run")


@background.setup
def sweep_run(ctx) -> Started:
    """The shared multirun (see `sweep`), its jobs in run_dir/0 ... run_dir/3."""
    where = ctx.tmp_path_factory.mktemp("cli_sweep")
    cases = where / "cases"
    (cases / "cli_case").mkdir(parents=True)
    for name, text in CASES.items():
        (cases / "cli_case" / f"{name}.yaml").write_text(text)
    return Started(where, "sweep", ["-m", f"hydra.sweep.dir={where / 'sweep'}", f"hydra.searchpath=[file://{cases}]",
                                    *TINY, f"+cli_case={','.join(SWEEP_JOBS)}"], cli_env(ctx.cache_dir),
                   run_dir=where / "sweep")


@background.setup
def smoke(ctx) -> Smoke:
    """scripts/train_lm.sh stopped by SIGUSR1, then run again (smoke_chain)."""
    where = ctx.tmp_path_factory.mktemp("cli_smoke")
    (where / "runs").mkdir()
    out = Smoke(where / "first", where / "second")
    out.thread = threading.Thread(target=smoke_chain, args=(where / "runs", cli_env(ctx.cache_dir), out), daemon=True)
    out.thread.start()
    return out


@background.setup
def diverged(ctx) -> Started:
    return cli_run(ctx, "diverged", *DIVERGED)


@background.setup(params=list(USER_ERRORS))
def user_error(ctx, case: str) -> Started:
    """One bad input of USER_ERRORS; the handle's name is the case."""
    overrides, extra, _ = USER_ERRORS[case]
    return cli_run(ctx, case, *overrides, extra_env=extra)


@background.setup
def optuna_sweep(ctx) -> Started:
    where = ctx.tmp_path_factory.mktemp("cli_optuna")
    return Started(where, "optuna", ["-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=3",
                                     f"hydra.sweeper.params={{{OPTUNA_LRS}}}", f"hydra.sweep.dir={where / 'sweep'}",
                                     *TINY, "train.max_steps=10", "train.val_freq=10", "train.sample_tokens=0",
                                     "optimizer.lr_config.warmup=2"], cli_env(ctx.cache_dir), run_dir=where / "sweep")


@background.setup
def local_launcher_sweep(ctx) -> Started:
    """Two jobs in their own processes (hydra/launcher=local), one diverging (SGD at lr 1e30)."""
    where = ctx.tmp_path_factory.mktemp("cli_local_sweep")
    return Started(where, "local_sweep", ["-m", "hydra/launcher=local", f"hydra.sweep.dir={where / 'sweep'}", *TINY,
                                          *DIVERGED[:-2], "train.max_steps=10", "train.gradient_clip_val=null",
                                          "optimizer.lr_config.lr=1e30,1e-2"],
                   cli_env(ctx.cache_dir), run_dir=where / "sweep")


@background.setup
def unknown_group(ctx) -> Started:
    return cli_run(ctx, "unknown_group", "optimizer=nope")


@pytest.fixture(scope="module")
def sweep(sweep_run) -> tuple[subprocess.CompletedProcess, Path]:
    """The shared multirun: job 0 AdamW + cosine (40 steps, val every 20), job 1 SGD-momentum + linear
    (30 steps), job 2 SGD at lr 1e30 (diverges), job 3 job 0 again. It exits 2 for job 2."""
    proc = sweep_run.result()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, sweep_run.run_dir


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_sweep_in_its_own_processes_summarises_its_failed_jobs_without_a_traceback(local_launcher_sweep):
    """hydra/launcher=local (and slurm) run each job in its own process: a failed job is its one
    error line and an outcome file in its job dir, not an exit that submitit turns into an
    UncompletedJobError traceback in the sweep's process; the sweep's end lists it by its overrides
    and exits 2, and the other job ran to its end."""
    proc = local_launcher_sweep.result()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    summary = proc.stderr.strip().splitlines()[-2:]
    assert summary[0] == "error: 1 of 2 jobs of the multirun failed:", proc.stderr[-3000:]
    assert summary[1].startswith("  job 0 (optimizer.lr_config.lr=1e+30): train/loss is nan"), summary[1]
    sweep_dir = local_launcher_sweep.run_dir
    assert json.loads((sweep_dir / "0" / "job_outcome.json").read_text())["diverged"] is True
    finished = read_metrics(sweep_dir / "1" / "metrics.jsonl")
    assert finished[-1]["step"] == 10 and math.isfinite(finished[-1]["train/loss"])


@pytest.mark.slow
def test_train_40_steps_val_loss_falls(sweep):
    proc, sweep_dir = sweep
    run_dir = sweep_dir / "0"
    lr, warmup = ADAMW_LR, ADAMW_WARMUP
    run_log = (run_dir / "train_jax.log").read_text()  # the run's log: what it printed, time-stamped
    assert "eqtrain: " in run_log and "step     40 | loss" in run_log and "---- sample ----" in run_log
    assert "adamw + cosine" in run_log and "sgdm" not in run_log  # this job's log only
    records = read_metrics(run_dir / "metrics.jsonl")

    assert [r["step"] for r in records] == list(range(0, 41, 5))  # step 0 (val_at_start) + every log_every
    assert [r["step"] for r in records if "val/loss" in r] == [0, 20, 40]  # val_freq and the last step
    first_val, last_val = only(records, 0)["val/loss"], only(records, 40)["val/loss"]
    assert last_val < 0.85 * first_val, f"val/loss did not fall: {first_val} -> {last_val}"
    for r in records:
        if "val/loss" in r:
            # math.exp of the very float64 the record holds (JSON writes a float's repr: exact): equal
            assert r["val/perplexity"] == math.exp(r["val/loss"])
            assert 0.0 <= r["val/accuracy"] <= 1.0

    train = [r for r in records if r["step"] > 0]
    for r in train:
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    # Throughput is timed from the second logged interval on (the first holds compilation).
    for r in train[1:]:
        assert math.isfinite(r["train/tokens_per_sec"]) and r["train/tokens_per_sec"] > 0
        assert math.isfinite(r["train/mfu"]) and r["train/mfu"] > 0

    lrs = {r["step"]: r["train/lr"] for r in train}
    warmup_lrs = [lrs[s] for s in (5, 10, 15)]
    assert warmup_lrs == sorted(warmup_lrs) and len(set(warmup_lrs)) == 3, f"lr not warming up: {warmup_lrs}"
    # Warmup is lr·(k+1)/warmup for the k-th update (0-based): the 5th logged update used 5/15 of the peak.
    assert lrs[5] == pytest.approx(lr * 5 / warmup, rel=1e-5)
    # the logged float32 lr is within EPS32/2 of lr (one rounding): 1e-6 is 8 EPS32
    assert max(lrs.values()) <= lr * (1 + 1e-6)
    decaying = [lrs[s] for s in range(20, 41, 5)]  # cosine from the peak at step 15 down to min_lr
    assert decaying == sorted(decaying, reverse=True) and len(set(decaying)) == 5, f"lr not decaying: {decaying}"
    assert lrs[40] < 0.2 * lr

    assert "eqtrain:" in proc.stdout and "adamw + cosine" in proc.stdout
    assert "---- sample ----\ndef " in proc.stdout  # the sample continues train.sample_prompt


@pytest.mark.slow
def test_sgdm_linear_schedule_decays_and_loss_falls(sweep):
    proc, sweep_dir = sweep
    run_dir = sweep_dir / "1"
    lr, warmup, decay_end = SGDM_LR, SGDM_WARMUP, SGDM_DECAY_END
    assert "sgdm + linear" in proc.stdout and "sgdm + linear" in (run_dir / "train_jax.log").read_text()
    records = read_metrics(run_dir / "metrics.jsonl")

    first_val, last_val = only(records, 0)["val/loss"], only(records, 30)["val/loss"]
    assert last_val < 0.85 * first_val, f"val/loss did not fall: {first_val} -> {last_val}"
    assert all(math.isfinite(r["train/loss"]) for r in records if r["step"] > 0)

    lrs = {r["step"]: r["train/lr"] for r in records if r["step"] > 0}
    assert lrs[30] < 0.1 * lr and lrs[30] < max(lrs.values())
    # Linear decay: equal drops between logged steps after the warmup (cosine would not be).
    decaying = [lrs[s] for s in range(10, 31, 5)]
    drop_per_log = lr / (decay_end - warmup) * 5
    # each float32 lr is lr·(1 − x) with x = (s − peak) / span: x, 1 − x and the product round (lr = 0.5
    # and min_lr = 0 are exact): <= 3 roundings of u·lr each, 6 in a difference (exact in float64)
    for a, b in zip(decaying, decaying[1:]):
        assert a - b == pytest.approx(drop_per_log, rel=0, abs=rounding_rtol(6) * lr)


@pytest.mark.slow
def test_multirun_two_optimizers(sweep):
    """`-m` with a swept config group: one job per option, in the sweep dir's 0/ and 1/, each with its
    own composed config, command-line overrides (here logging.log_every=5) reaching every job, and
    both jobs training to their end in the one process Hydra's default launcher runs them in."""
    proc, sweep_dir = sweep
    final_losses = []
    for job, name, steps in (("0", "adamw", 40), ("1", "sgdm", 30)):
        job_dir = sweep_dir / job
        config = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
        assert config["optimizer"]["name"] == name and config["train"]["max_steps"] == steps
        assert config["logging"]["log_every"] == 5
        records = read_metrics(job_dir / "metrics.jsonl")
        last = records[-1]
        assert last["step"] == steps and math.isfinite(last["train/loss"])  # the job ran to the end
        assert [r["step"] for r in records] == list(range(0, steps + 1, 5))  # logging.log_every reached the job
        final_losses.append(last["train/loss"])
    assert "adamw + cosine" in proc.stdout and "sgdm + linear" in proc.stdout
    assert final_losses[0] != final_losses[1]  # the two jobs really trained differently


@pytest.mark.slow
def test_multirun_jobs_carry_no_state_from_one_to_the_next(sweep):
    """Hydra's default launcher runs a multirun's jobs one after another in one process. Job 3 is
    job 0's config, run after job 1 trained another optimizer and job 2 diverged, and repeats job 0 exactly: every
    loss, norm, lr and val score, the samples, and its log (one header, no line doubled by a
    logging handler an earlier job left). Nothing of an earlier job (RNG, mesh, signal handlers,
    caches, the prefetch thread, the sinks) reaches a later one."""
    _, sweep_dir = sweep

    def deterministic(job: str) -> list[dict]:  # all but wall-clock figures
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("train/tokens_per_sec",
                                                                                      "train/mfu")}
                for r in read_metrics(sweep_dir / job / "metrics.jsonl")]

    assert (sweep_dir / "3").is_dir(), "job 3 did not run: the multirun stopped at the diverged job 2"
    first, again = deterministic("0"), deterministic("3")
    assert [r["step"] for r in again] == list(range(0, 41, 5))
    assert again == first  # exact
    assert (sweep_dir / "3" / "samples.jsonl").read_text() == (sweep_dir / "0" / "samples.jsonl").read_text()
    logs = [(sweep_dir / job / "train_jax.log").read_text().splitlines() for job in ("0", "3")]
    assert [sum("eqtrain: " in line for line in log) for log in logs] == [1, 1]
    assert len(logs[1]) == len(logs[0]) and "sgdm" not in "\n".join(logs[1])


@pytest.mark.slow
def test_multirun_goes_on_past_a_diverged_job(sweep):
    """A diverged job of a multirun (job 2: SGD at lr 1e30) is one `error: job N (overrides): why`
    line when it fails, and the sweep goes on (job 3 runs to its end); at the end the multirun lists
    the failed jobs, by the overrides that set them apart, and exits 2 (the fixture checks it)."""
    proc, sweep_dir = sweep
    failed = [line for line in proc.stderr.splitlines() if line.startswith("error: job ")]
    assert len(failed) == 1, proc.stderr[-3000:]
    assert failed[0].startswith("error: job 2 (") and "+cli_case=sgdm_diverge" in failed[0], failed[0]
    assert "train/loss is nan" in failed[0] and "optimizer.lr_config.lr" in failed[0]
    summary = proc.stderr.strip().splitlines()[-2:]
    assert summary[0] == "error: 1 of 4 jobs of the multirun failed:", proc.stderr[-3000:]
    assert summary[1].startswith("  job 2 (+cli_case=sgdm_diverge): train/loss is nan at step 5"), summary[1]
    diverged = read_metrics(sweep_dir / "2" / "metrics.jsonl")
    assert not math.isfinite(diverged[-1]["train/loss"])
    after = read_metrics(sweep_dir / "3" / "metrics.jsonl") if (sweep_dir / "3").is_dir() else []
    assert after and after[-1]["step"] == 40 and math.isfinite(after[-1]["train/loss"]), "job 3 did not finish"


@pytest.mark.slow
def test_optuna_sweep_minimises_the_final_val_loss_past_a_diverged_trial(optuna_sweep):
    """The docs' `hydra/sweeper=optuna_lr`: three trials, each its own job dir with its own lr; one
    diverges, is reported in one line, counts as the worst value (+inf) and the study goes on; the
    best value Optuna reports is the lowest final val/loss of the others, and the study exits 0."""
    sweep_dir, proc = optuna_sweep.run_dir, optuna_sweep.result()
    assert_ok(proc)
    finals, lrs = {}, {}
    for job in ("0", "1", "2"):
        config = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        lrs[job] = config["optimizer"]["lr_config"]["lr"]
        finals[job] = [r for r in read_metrics(sweep_dir / job / "metrics.jsonl") if "val/loss" in r][-1]["val/loss"]
    assert len(set(lrs.values())) == 3
    diverged = [job for job, lr in lrs.items() if lr == 1e30]
    assert len(diverged) == 1, f"the seeded sampler drew {lrs}: no single diverging trial"
    job = diverged[0]
    assert not math.isfinite(read_metrics(sweep_dir / job / "metrics.jsonl")[-1]["train/loss"])
    failed = [line for line in proc.stderr.splitlines() if line.startswith("error: job ")]
    assert len(failed) == 1 and failed[0].startswith(f"error: job {job} (") and "train/loss is nan" in failed[0], \
        proc.stderr[-3000:]
    assert "1 of 3 trials diverged" in proc.stderr
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    others = [finals[j] for j in lrs if j != job]
    # the objective is the job's final val/loss, the float64 its metrics.jsonl holds; YAML and JSON
    # write a float's repr, which reads back exactly: equal
    assert best["best_value"] == min(others)
    assert set(best["best_params"]) == {"optimizer.lr_config.lr"}
    assert float(best["best_params"]["optimizer.lr_config.lr"]) != 1e30


@pytest.mark.slow
def test_train_lm_script_smoke_forwards_the_slurm_signal_and_resumes(smoke):
    """SMOKE=1 bash scripts/train_lm.sh, with checkpoints: SIGUSR1 sent to the script's shell (what
    `#SBATCH --signal=B:USR1@120` does) must reach the trainer, which saves and exits 3; the same
    command again resumes and finishes."""
    smoke.thread.join(3 * SUBPROCESS_TIMEOUT_S)
    assert smoke.error is None, smoke.error
    first = smoke.first
    out, err = first.stdout, first.stderr
    assert first.returncode == 3, f"exit {first.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "stopped by SIGUSR1" in err
    # SMOKE's recipe reached the run: batch 8 x accumulation 2 (total 16) x context 32 tokens per step.
    assert "adamw + cosine | 512 tokens/step" in out
    config = yaml.safe_load((smoke.first_dir / ".hydra" / "config.yaml").read_text())
    assert config["dataset"]["total_batch_size"] == 16 and config["train"]["compute_dtype"] == "float32"
    stopped_at = read_metrics(smoke.first_dir / "metrics.jsonl")[-1]["step"]

    proc = smoke.second
    assert_ok(proc)
    assert f"at step {stopped_at}" in proc.stdout
    records = [r for r in read_metrics(smoke.second_dir / "metrics.jsonl") if "train/loss" in r]  # no optim/state_bytes
    assert records[0]["step"] == stopped_at + 1 and records[-1]["step"] == 400
    assert math.isfinite(records[-1]["train/loss"])


def test_multirun_summary_names_the_failed_jobs_and_sets_the_exit_code(capsys):
    """The end of a multirun (utils/cli.summarise): each failed job by the overrides that set it apart,
    and the exit code: 0 with no failure, or under Optuna when only diverged trials failed and one
    finished; 2 when every failure was a user error; 1 when a job crashed on a bug."""
    from utils.cli import JobOutcome, summarise

    common = ("model.dim=32", "train.max_steps=10")
    ok = JobOutcome(0, (*common, "optimizer.lr_config.lr=0.001"))
    diverged = JobOutcome(1, (*common, "optimizer.lr_config.lr=1e+30"), "train/loss is nan at step 5", diverged=True)
    bad_knob = JobOutcome(2, (*common, "optimizer.lr_config.lr=-1"), "optimizer.lr_config.lr=-1 must be > 0")
    bug = JobOutcome(3, (*common, "optimizer.lr_config.lr=0.1"), "ZeroDivisionError: division by zero",
                     user_error=False)
    assert summarise([ok, ok]) == 0 and capsys.readouterr().err == ""
    assert summarise([ok, diverged]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: 1 of 2 jobs of the multirun failed:",
        "  job 1 (optimizer.lr_config.lr=1e+30): train/loss is nan at step 5"]
    assert summarise([ok, diverged], optuna=True) == 0
    assert capsys.readouterr().err.startswith("eqtrain: 1 of 2 trials diverged")
    assert summarise([diverged], optuna=True) == 2  # no trial finished: the study found nothing
    assert summarise([ok, diverged, bad_knob], optuna=True) == 2
    assert summarise([ok, diverged, bug]) == 1
    assert "  job 3 (optimizer.lr_config.lr=0.1): ZeroDivisionError" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad inputs, in-process


def test_tiny_config_is_valid():
    """The control for the cases below: the base they all start from passes validation."""
    run = validate(compose_tiny())
    assert run.context_length == 32 and run.dataset.batch_size == 8


@pytest.mark.parametrize(
    "overrides, knob",
    [
        (["optimizer.lr_config.lr=-1"], "optimizer.lr_config.lr"),
        (["optimizer.lr_config.lr=0"], "optimizer.lr_config.lr"),
        (["optimizer=sgdm", "optimizer/lr_config=linear", "optimizer.lr_config.lr=-0.5"], "optimizer.lr_config.lr"),
        (["train.max_steps=0"], "train.max_steps"),
        (["train.max_steps=-3"], "train.max_steps"),
        (["train.max_steps=abc"], "train.max_steps"),
        (["dataset.batch_size=0"], "dataset.batch_size"),
        (["dataset.total_batch_size=12"], "dataset.total_batch_size"),  # batch 8
        (["dataset.context_length=64"], "dataset.context_length"),  # model 32
        (["dataset=text_files"], "dataset.paths"),  # paths: []
        (["+train.nope=1"], "train.nope"),  # a knob nothing reads
        (["optimizer.groups.head.lr=1e-3"], "optimizer.groups.head.lr"),  # tied embeddings: no head
        (["model.attn_block_size=12"], "model.attn_block_size"),  # does not divide the context of 32
        (["model.attn_block_size=32"], "model.attn_block_size"),  # one block: blocking silently off
        (["model.scan_unroll=0"], "model.scan_unroll"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_validate_rejects_bad_knob(overrides, knob):
    cfg = compose_tiny(*overrides)
    with pytest.raises(ConfigError, match=re.escape(knob)) as excinfo:
        validate(cfg)
    assert_one_line_error(str(excinfo.value), knob)


def test_text_files_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.txt")
    run = validate(compose_tiny("dataset=text_files", f"dataset.paths=[{pattern}]"))
    with pytest.raises(DataError, match=re.escape("dataset.paths")) as excinfo:
        run.dataset.source.documents()
    assert_one_line_error(str(excinfo.value), pattern)


def test_hf_tokenizer_missing_offline():
    import train_jax

    run = validate(compose_tiny("tokenizer=hf", "tokenizer.name_or_path=definitely/not-a-model"))
    with pytest.raises(ConfigError, match=re.escape("tokenizer.name_or_path")) as excinfo:
        train_jax.init_tokenizer(run, ["some text"])
    assert_one_line_error(str(excinfo.value), "definitely/not-a-model")


def test_unknown_group_option_lists_choices():
    with pytest.raises(MissingConfigException) as excinfo:
        compose_tiny("optimizer=nope")
    message = str(excinfo.value)
    assert "optimizer/nope" in message and "adamw" in message and "sgdm" in message


def test_unknown_key_is_hydra_error():
    with pytest.raises(ConfigCompositionException, match=re.escape("train.nope")):
        compose_tiny("train.nope=1")


# ----------------------------------------------------------------------------- bad inputs, real CLI


def assert_failed_before_compiling(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "metrics.jsonl").exists()
    assert "eqtrain:" not in proc.stdout  # the banner comes after model and step are built


@pytest.mark.slow
def test_cli_user_error_exits_2_with_one_line(user_error):  # one case per USER_ERRORS entry
    knob = USER_ERRORS[user_error.name][2]
    run_dir, proc = user_error.run_dir, user_error.result()
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert knob in lines[0]
    assert_failed_before_compiling(proc, run_dir)


@pytest.mark.slow
def test_cli_unknown_group_option_exits_1(unknown_group):
    run_dir, proc = unknown_group.run_dir, unknown_group.result()
    assert proc.returncode == 1
    assert "Could not find 'optimizer/nope'" in proc.stderr
    assert "adamw" in proc.stderr and "sgdm" in proc.stderr  # Hydra lists the available options
    assert_failed_before_compiling(proc, run_dir)


@pytest.mark.slow
def test_diverged_run_exits_2_with_the_loss_and_the_fix(diverged):
    run_dir, proc = diverged.run_dir, diverged.result()
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train/loss is nan"), proc.stderr
    assert "optimizer.lr_config.lr" in lines[0]
    assert "---- sample ----" not in proc.stdout  # no sample from a diverged model
    records = read_metrics(run_dir / "metrics.jsonl")  # what was logged up to the divergence is kept
    assert records and not math.isfinite(records[-1]["train/loss"])
