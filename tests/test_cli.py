"""The command line, end to end: `python train_jax.py [overrides]` trains and logs, and every bad
input fails fast with one line naming the knob.

Runs of the real entry point are subprocesses (marked slow: ~5-15 s each, mostly JAX compile).
Most bad inputs are checked in-process instead, by composing the config with Hydra's compose
API and calling the same `validate` / `init_*` functions `main` calls; a few go through the
subprocess to prove the exit code, the single `error:` line and that nothing was compiled.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from conftest import CLI_TINY
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


@pytest.fixture
def cli(tmp_path_factory):
    """cli(*args, env={...}, argv=None) -> CompletedProcess of `python train_jax.py *args` run from
    the repo root, offline, with W&B off and the tokenized-corpus cache in a tmp dir (shared by the
    session: conftest's autouse fixture sets EQTRAIN_CACHE; the fallback is for running this file alone)."""

    def run(*args: str, env: dict[str, str] | None = None, argv: list[str] | None = None, background: bool = False):
        full_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR", "SMOKE")}
        full_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
        full_env.setdefault("EQTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "eqtrain_cache_cli"))
        # scripts/train_lm.sh calls plain `python`: make it this interpreter.
        full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env.get("PATH", "")
        full_env.update(env or {})
        cmd = (argv or [sys.executable, TRAIN]) + list(args)
        if background:  # the caller signals it and collects it with communicate()
            return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S)

    return run


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_train_40_steps_val_loss_falls(cli, tmp_path):
    run_dir = tmp_path / "run"
    lr, warmup = 3e-3, 15
    proc = cli(f"hydra.run.dir={run_dir}", *TINY, "train.max_steps=40", "train.val_freq=20",
               "optimizer/lr_config=cosine", f"optimizer.lr_config.lr={lr}", f"optimizer.lr_config.warmup={warmup}",
               "optimizer.lr_config.min_lr=3e-4")
    assert_ok(proc)
    run_log = (run_dir / "train_jax.log").read_text()  # the run's log: what it printed, time-stamped
    assert "eqtrain: " in run_log and "step     40 | loss" in run_log and "---- sample ----" in run_log
    records = read_metrics(run_dir / "metrics.jsonl")

    assert [r["step"] for r in records] == list(range(0, 41, 5))  # step 0 (val_at_start) + every log_every
    assert [r["step"] for r in records if "val/loss" in r] == [0, 20, 40]  # val_freq and the last step
    first_val, last_val = only(records, 0)["val/loss"], only(records, 40)["val/loss"]
    assert last_val < 0.85 * first_val, f"val/loss did not fall: {first_val} -> {last_val}"
    for r in records:
        if "val/loss" in r:
            assert r["val/perplexity"] == pytest.approx(math.exp(r["val/loss"]), rel=1e-6)
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
    assert max(lrs.values()) <= lr * (1 + 1e-6)
    decaying = [lrs[s] for s in range(20, 41, 5)]  # cosine from the peak at step 15 down to min_lr
    assert decaying == sorted(decaying, reverse=True) and len(set(decaying)) == 5, f"lr not decaying: {decaying}"
    assert lrs[40] < 0.2 * lr

    assert "eqtrain:" in proc.stdout and "adamw + cosine" in proc.stdout
    assert "---- sample ----\ndef " in proc.stdout  # the sample continues train.sample_prompt


@pytest.mark.slow
def test_sgdm_linear_schedule_decays_and_loss_falls(cli, tmp_path):
    run_dir = tmp_path / "run"
    lr, warmup, decay_end = 0.5, 5, 30
    proc = cli(f"hydra.run.dir={run_dir}", *TINY, "train.max_steps=30", "optimizer=sgdm",
               "optimizer/lr_config=linear", f"optimizer.lr_config.lr={lr}", f"optimizer.lr_config.warmup={warmup}",
               f"optimizer.lr_config.max_steps={decay_end}")
    assert_ok(proc)
    assert "sgdm + linear" in proc.stdout
    records = read_metrics(run_dir / "metrics.jsonl")

    first_val, last_val = only(records, 0)["val/loss"], only(records, 30)["val/loss"]
    assert last_val < 0.85 * first_val, f"val/loss did not fall: {first_val} -> {last_val}"
    assert all(math.isfinite(r["train/loss"]) for r in records if r["step"] > 0)

    lrs = {r["step"]: r["train/lr"] for r in records if r["step"] > 0}
    assert lrs[30] < 0.1 * lr and lrs[30] < max(lrs.values())
    # Linear decay: equal drops between logged steps after the warmup (cosine would not be).
    decaying = [lrs[s] for s in range(10, 31, 5)]
    drop_per_log = lr / (decay_end - warmup) * 5
    for a, b in zip(decaying, decaying[1:]):
        assert a - b == pytest.approx(drop_per_log, rel=1e-3)


@pytest.mark.slow
def test_multirun_two_optimizers(cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli("-m", f"hydra.sweep.dir={sweep}", *TINY, "train.max_steps=10", "train.skip_validation=true",
               "train.sample_tokens=0", "optimizer=adamw,sgdm")
    assert_ok(proc)
    final_losses = []
    for job, name in (("0", "adamw"), ("1", "sgdm")):
        job_dir = sweep / job
        config = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
        assert config["optimizer"]["name"] == name
        records = read_metrics(job_dir / "metrics.jsonl")
        last = records[-1]
        assert last["step"] == 10 and math.isfinite(last["train/loss"])  # the job ran to the end
        assert not any("val/loss" in r for r in records)  # train.skip_validation reached the job
        final_losses.append(last["train/loss"])
    assert "adamw + cosine" in proc.stdout and "sgdm + cosine" in proc.stdout
    assert final_losses[0] != final_losses[1]  # the two jobs really trained differently


@pytest.mark.slow
def test_train_lm_script_smoke_forwards_the_slurm_signal_and_resumes(cli, tmp_path):
    """SMOKE=1 bash scripts/train_lm.sh, with checkpoints: SIGUSR1 sent to the script's shell (what
    `#SBATCH --signal=B:USR1@120` does) must reach the trainer, which saves and exits 3; the same
    command again resumes and finishes."""
    args = [*TINY, "train.max_steps=400", "logging.log_every=1", "train.val_freq=1000", "checkpoint.save=true",
            f"checkpoint.save_path={tmp_path / 'ck'}", "checkpoint.resume=auto", "checkpoint.save_steps=1000"]
    script = ["bash", str(REPO / "scripts" / "train_lm.sh")]
    first = tmp_path / "first"
    shell = cli(f"hydra.run.dir={first}", *args, argv=script, env={"SMOKE": "1"}, background=True)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not (first / "metrics.jsonl").exists() or "train/loss" not in (first / "metrics.jsonl").read_text():
        assert shell.poll() is None and time.monotonic() < deadline, shell.communicate()
        time.sleep(0.005)
    shell.send_signal(signal.SIGUSR1)
    out, err = shell.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert shell.returncode == 3, f"exit {shell.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "stopped by SIGUSR1" in err
    # SMOKE's recipe reached the run: batch 8 x accumulation 2 (total 16) x context 32 tokens per step.
    assert "adamw + cosine | 512 tokens/step" in out
    config = yaml.safe_load((first / ".hydra" / "config.yaml").read_text())
    assert config["dataset"]["total_batch_size"] == 16 and config["train"]["compute_dtype"] == "float32"
    stopped_at = read_metrics(first / "metrics.jsonl")[-1]["step"]

    second = tmp_path / "second"
    proc = cli(f"hydra.run.dir={second}", *args, argv=script, env={"SMOKE": "1"})
    assert_ok(proc)
    assert f"at step {stopped_at}" in proc.stdout
    records = read_metrics(second / "metrics.jsonl")
    assert records[0]["step"] == stopped_at + 1 and records[-1]["step"] == 400
    assert math.isfinite(records[-1]["train/loss"])


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
@pytest.mark.parametrize(
    "overrides, env, knob",
    [
        (["optimizer.lr_config.lr=-1"], {}, "optimizer.lr_config.lr"),
        (["dataset=text_files", "dataset.paths=[/nonexistent-eqtrain-dir/*.txt]"], {}, "dataset.paths"),
        (["dataset.batch_size=3"],
         {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}, "dataset.batch_size"),
        # conf/ exists and holds no checkpoint: both refusals come before anything is built or written.
        (["checkpoint.save=true", "checkpoint.save_path=conf"], {}, "checkpoint.resume=auto"),
        (["checkpoint.load=true", "checkpoint.load_path=conf"], {}, "checkpoint.load_path"),
    ],
    ids=["negative-lr", "glob-matches-nothing", "batch-not-divisible-over-2-devices", "save-path-exists",
         "load-path-without-checkpoints"],
)
def test_cli_user_error_exits_2_with_one_line(cli, tmp_path, overrides, env, knob):
    run_dir = tmp_path / "run"
    proc = cli(f"hydra.run.dir={run_dir}", *TINY, *overrides, env=env)
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert knob in lines[0]
    assert_failed_before_compiling(proc, run_dir)


@pytest.mark.slow
def test_cli_unknown_group_option_exits_1(cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(f"hydra.run.dir={run_dir}", *TINY, "optimizer=nope")
    assert proc.returncode == 1
    assert "Could not find 'optimizer/nope'" in proc.stderr
    assert "adamw" in proc.stderr and "sgdm" in proc.stderr  # Hydra lists the available options
    assert_failed_before_compiling(proc, run_dir)


@pytest.mark.slow
def test_diverged_run_exits_2_with_the_loss_and_the_fix(cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(f"hydra.run.dir={run_dir}", *TINY, "train.max_steps=20", "optimizer=sgdm",
               "optimizer/lr_config=constant", "optimizer.lr_config.lr=1e30", "train.gradient_clip_val=null")
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train/loss is nan"), proc.stderr
    assert "optimizer.lr_config.lr" in lines[0]
    assert "---- sample ----" not in proc.stdout  # no sample from a diverged model
    records = read_metrics(run_dir / "metrics.jsonl")  # what was logged up to the divergence is kept
    assert records and not math.isfinite(records[-1]["train/loss"])
