"""The TensorBoard and wandb sinks, driven directly with fake metric dicts (no training run):
TensorBoard's events read back with TensorBoard's own reader, wandb offline (no account, no
network) with its run id kept across a resume. About two seconds in all."""

from __future__ import annotations

import json
import os

import pytest

from utils.errors import ConfigError
from utils.logging import sinks

CONFIG = {"model": {"dim": 32, "num_blocks": 2}, "optimizer": {"name": "adamw", "lr": 3e-4},
          "hydra": {"run": {"dir": "outputs/x"}}}


def _accumulator(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events_read_back(tmp_path):
    cfg = sinks.logging_config({"progress_bar": False, "metrics_file": None, "samples_file": None, "tensorboard": True})
    opened = sinks.open_sinks(cfg, str(tmp_path), 100, 0, CONFIG)
    assert list(opened.named) == ["console", "tensorboard"]
    logged = {10: {"train/loss": 4.5, "train/lr": 1e-4}, 20: {"train/loss": 3.25, "train/lr": 2e-4, "val/loss": 3.5},
              30: {"train/loss": 2.75, "train/lr": 3e-4}}
    for step, metrics in logged.items():
        opened.log(step, metrics)

    # Flushed at each logged step: readable before close, as a killed run leaves it.
    acc = _accumulator(tmp_path / "tensorboard")
    assert _scalars(acc, "train/loss") == [(10, 4.5), (20, 3.25), (30, 2.75)]
    assert _scalars(acc, "val/loss") == [(20, 3.5)]
    assert [s for s, _ in _scalars(acc, "train/lr")] == [10, 20, 30]
    assert [v for _, v in _scalars(acc, "train/lr")] == pytest.approx([1e-4, 2e-4, 3e-4], rel=1e-6)  # float32
    # The resolved config once, as text (Hydra's own section left out).
    (config_event,) = acc.Tensors("config")
    text = config_event.tensor_proto.string_val[0].decode()
    assert json.loads("\n".join(line[4:] for line in text.splitlines())) == {
        k: v for k, v in CONFIG.items() if k != "hydra"}
    assert acc.summary_metadata["config"].plugin_data.plugin_name == "text"
    opened.close()
    assert opened.state_dict() == {}  # nothing to resume

    # A resumed segment (from a checkpoint at step 20) writes a second events file in the same
    # folder; the previous segment's step 30 is stale and TensorBoard's reader drops it.
    resumed = sinks.open_sinks(cfg, str(tmp_path), 100, 20, CONFIG)
    resumed.log(30, {"train/loss": 2.5, "train/lr": 3e-4})
    resumed.log(40, {"train/loss": 2.0, "train/lr": 4e-4})
    resumed.close()
    assert len([f for f in os.listdir(tmp_path / "tensorboard") if f.startswith("events.out.tfevents.")]) == 2
    assert _scalars(_accumulator(tmp_path / "tensorboard"), "train/loss") == [(10, 4.5), (20, 3.25), (30, 2.5),
                                                                               (40, 2.0)]

    off = sinks.logging_config({"progress_bar": False, "metrics_file": None, "samples_file": None})
    assert list(sinks.open_sinks(off, str(tmp_path / "off"), 100, 0, CONFIG).named) == ["console"]
    assert not (tmp_path / "off").exists()


def test_wandb_knobs():
    assert sinks.logging_config({}).sinks[-1].wandb_project is None  # off by default
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode='cloud' must be online, offline or disabled"):
        sinks.logging_config({"wandb_project": "p", "wandb_mode": "cloud"})


def test_wandb_off_builds_no_sink_and_keeps_saved_state(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # what wandb_mode=null follows
    for knobs in ({}, {"wandb_project": "p", "wandb_mode": "disabled"}, {"wandb_project": "p", "wandb_mode": None}):
        cfg = sinks.logging_config({"progress_bar": False, "metrics_file": None, "samples_file": None, **knobs})
        opened = sinks.open_sinks(cfg, str(tmp_path), 10, 5, CONFIG, saved={"wandb": {"id": "abc123"}})
        assert list(opened.named) == ["console"]
        # wandb off for one segment: its run id still goes into this segment's checkpoints.
        assert opened.state_dict() == {"wandb": {"id": "abc123"}}
        opened.close()
    assert not (tmp_path / "wandb").exists()


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb with nothing reaching the network or the terminal, and nothing written outside tmp."""
    home = tmp_path / "wandb_home"
    for key, value in {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true",
                       "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true", "WANDB_MODE": "offline",
                       "WANDB_API_KEY": "", "WANDB_CACHE_DIR": str(home / "cache"),
                       "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DATA_DIR": str(home / "data")}.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    pytest.importorskip("wandb")


def _offline_runs(run_dir):
    return sorted(d for d in os.listdir(os.path.join(run_dir, "wandb")) if d.startswith("offline-run-"))


def test_wandb_offline_run_resumes_with_its_saved_id(tmp_path, wandb_offline):
    """One test for every wandb assertion: each wandb.init starts its service (about a second)."""
    tmp_path = tmp_path / "run"
    tmp_path.mkdir()
    cfg = sinks.logging_config({"progress_bar": False, "metrics_file": None, "samples_file": None,
                                "wandb_project": "eqtrain-test", "wandb_name": "tiny", "wandb_mode": "offline"})
    first = sinks.open_sinks(cfg, str(tmp_path), 100, 0, CONFIG, saved=None)
    run = first.named["wandb"].run
    run_id = run.id
    assert run.name == "tiny" and run.project == "eqtrain-test"
    assert dict(run.config) == {k: v for k, v in CONFIG.items() if k != "hydra"}
    first.log(10, {"train/loss": 4.5})
    first.log(20, {"train/loss": 3.25})
    state = first.state_dict()
    assert state == {"wandb": {"id": run_id}}
    assert json.loads(json.dumps(state)) == state  # goes into the checkpoint manifest as JSON
    first.close()
    (folder,) = _offline_runs(tmp_path)
    assert folder.startswith("offline-run-") and folder.endswith(f"-{run_id}")

    # The next segment, handed the saved state, continues the same wandb run.
    second = sinks.open_sinks(cfg, str(tmp_path), 100, 20, CONFIG, saved=state)
    assert second.named["wandb"].run.id == run_id
    second.log(30, {"train/loss": 2.5})
    assert second.state_dict() == {"wandb": {"id": run_id}}
    second.close()
    folders = _offline_runs(tmp_path)
    # One folder per segment, named by the same id (`wandb sync` uploads them into one run, in
    # order); a segment started within the same second as the last gets wandb's "-1" suffix.
    assert len(folders) in (1, 2) and all(f"-{run_id}" in f for f in folders)
