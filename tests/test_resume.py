"""trainer/resume.py on plain dicts and empty directories (no training, no orbax write): which
config a run that starts from a checkpoint trains with, what it reports, and when a new run
refuses an existing save_path.

The end-to-end versions (a real load, a requeued resume) are in test_checkpoint.py."""

from __future__ import annotations

import pytest

from trainer.resume import LOCAL_KEYS, config_differences, merge_config, resume_source
from utils.checkpoint.storage import TMP_MARKER, CheckpointConfig, Source
from utils.errors import CheckpointError, ConfigError

SAVED = {
    "model": {"dim": 32, "num_blocks": 2},
    "optimizer": {"name": "adamw", "lr_config": {"lr": 1e-3}},
    "train": {"max_steps": 100},
    "checkpoint": {"save_path": "/old/ck", "load": False},
    "cache_dir": "/old/cache",
    "parallel": {"data": 8},
}


def source(config: dict = SAVED, resuming: bool = False) -> Source:
    return Source("/old/ck/iter_50", 50, {"step": 50}, config, with_opt_state=True, resuming=resuming)


def command_line(**changes) -> dict:
    """SAVED with whole top-level sections replaced, as a later command line composes it."""
    return {**SAVED, **changes}


class Warnings(list):
    def __call__(self, message: str) -> None:
        self.append(message)


def test_the_saved_config_wins_and_the_ignored_overrides_are_reported():
    warn = Warnings()
    current = command_line(train={"max_steps": 200}, model={"dim": 64, "num_blocks": 2})
    merged = merge_config(source(), current, CheckpointConfig(load=True, load_path="/old/ck"), warn)
    assert merged["train"] == {"max_steps": 100} and merged["model"] == SAVED["model"]
    assert len(warn) == 1 and "overwrite_config=false" in warn[0]
    assert "train.max_steps=200 (saved: 100)" in warn[0] and "model.dim=64 (saved: 32)" in warn[0]
    assert "num_blocks" not in warn[0]  # equal on both sides: not a difference


def test_overwrite_config_takes_the_command_line_and_reports_what_changed():
    warn = Warnings()
    current = command_line(train={"max_steps": 200})
    merged = merge_config(source(), current, CheckpointConfig(overwrite_config=True), warn)
    assert merged == current
    assert len(warn) == 1 and "train.max_steps: 100 -> 200" in warn[0]


def test_local_keys_come_from_the_command_line_without_a_report():
    warn = Warnings()
    local = {"checkpoint": {"save_path": "/new/ck", "load": True}, "cache_dir": "/new/cache", "compile_cache": False,
             "parallel": {"data": 4}, "hydra": {"run": {"dir": "out"}}}
    assert set(local) == set(LOCAL_KEYS)
    merged = merge_config(source(), command_line(**local), CheckpointConfig(), warn)
    assert {k: merged[k] for k in LOCAL_KEYS} == local
    assert {k: v for k, v in merged.items() if k not in LOCAL_KEYS} == {k: v for k, v in SAVED.items()
                                                                        if k not in LOCAL_KEYS}
    assert warn == []


@pytest.mark.parametrize("resuming", [False, True])
def test_overwrite_optimizer_takes_the_optimizer_group_on_a_load_but_not_on_a_resume(resuming):
    warn = Warnings()
    new_optimizer = {"name": "muon", "lr_config": {"lr": 2e-2}}
    current = command_line(optimizer=new_optimizer)
    merged = merge_config(source(resuming=resuming), current, CheckpointConfig(overwrite_optimizer=True), warn)
    if resuming:  # a requeued segment trains on with what its run settled on
        assert merged["optimizer"] == SAVED["optimizer"]
        assert len(warn) == 1 and "optimizer.name=muon (saved: adamw)" in warn[0]
    else:
        assert merged["optimizer"] == new_optimizer and warn == []


@pytest.mark.parametrize("resuming", [False, True])
def test_overwrite_data_takes_the_dataset_group_on_a_load_but_not_on_a_resume(resuming):
    warn = Warnings()
    saved = {**SAVED, "dataset": {"name": "stdlib", "batch_size": 8}}
    new_dataset = {"name": "text_files", "paths": ["corpus/*.txt"], "batch_size": 8}
    cfg = CheckpointConfig(load=True, load_path="/old/ck", overwrite_data=True)
    merged = merge_config(source(saved, resuming=resuming), {**saved, "dataset": new_dataset}, cfg, warn)
    if resuming:  # a requeued segment trains on with the dataset its run settled on
        assert merged["dataset"] == saved["dataset"] and "dataset.name=text_files" in warn[0]
    else:
        assert merged["dataset"] == new_dataset and warn == []
    assert merged["optimizer"] == SAVED["optimizer"]  # only the dataset group


def test_a_source_hands_over_its_data_position_unless_overwrite_data():
    manifest = {"step": 50, "data": {"epoch": 1, "position": 7}}
    kept = Source("/old/ck/iter_50", 50, manifest, SAVED, with_opt_state=True)
    fresh = Source("/old/ck/iter_50", 50, manifest, SAVED, with_opt_state=True, with_data_state=False)
    assert kept.data_state == manifest["data"] and fresh.data_state is None


def test_overwrite_data_without_a_load_is_refused_naming_the_knobs():
    with pytest.raises(ConfigError, match=r"checkpoint\.overwrite_data=true .* set checkpoint\.load=true"):
        CheckpointConfig(overwrite_data=True).check("checkpoint")
    CheckpointConfig(load=True, load_path="/old/ck", overwrite_data=True).check("checkpoint")


def test_config_differences_lists_only_real_differences():
    assert config_differences(SAVED, {**SAVED}) == []
    changed = command_line(optimizer={"name": "adamw", "lr_config": {"lr": 3e-4}, "b2": 0.95},
                           train={}, cache_dir="/elsewhere", parallel={"data": 2})
    assert config_differences(SAVED, changed) == [
        ("optimizer.b2", "<unset>", 0.95),  # new knob
        ("optimizer.lr_config.lr", 1e-3, 3e-4),  # nested
        ("train.max_steps", 100, "<unset>"),  # gone
    ]  # sorted; cache_dir and parallel.* are local and never listed


def test_a_new_run_refuses_an_existing_save_path(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(ConfigError, match="resume=auto"):
        resume_source(CheckpointConfig(save=True, save_path=str(tmp_path / "ck")), Warnings())


def test_resume_auto_without_a_complete_checkpoint_starts_fresh_and_clears_a_killed_save(tmp_path):
    ck = tmp_path / "ck"
    (ck / f"iter_10{TMP_MARKER}").mkdir(parents=True)
    warn = Warnings()
    assert resume_source(CheckpointConfig(save=True, save_path=str(ck), resume="auto"), warn) is None
    assert list(ck.iterdir()) == [] and len(warn) == 1 and "incomplete" in warn[0]
    assert resume_source(CheckpointConfig(save=True, save_path=str(tmp_path / "new"), resume="auto"), warn) is None


def test_a_load_of_a_missing_directory_names_it(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"load_path={missing} does not exist"):
        resume_source(CheckpointConfig(load=True, load_path=missing), Warnings())
