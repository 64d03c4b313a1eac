"""Checkpoints, in-process: which iterations are saved and kept, exact resume, which config wins
on load, overwrite_optimizer, and every corruption ending in a CheckpointError naming the file.

Runs go through `train_jax.train`, the function `main` calls after Hydra composes the config,
so what is tested is the command line's path minus the process boundary (signals and kill -9,
which need a real process, are in test_preemption.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from helpers import compose_config, restore_item, with_old_names

import train_jax
from utils.checkpoint import integrity, storage
from utils.checkpoint.storage import complete_steps, open_checkpoint
from utils.errors import CheckpointError, ConfigError
from utils.logging import sinks

# Shuffled data, dropout on (so the RNG key matters) and a log record at every step.
RUN = ("model.vocab_size=null", "train.max_steps=12", "logging.log_every=1", "train.val_freq=6",
       "train.max_val_steps=2", "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Every run starts in its own directory and names its checkpoints relative to it, as the
    docs' commands do (`checkpoint.save_path=ckpt/run1`)."""
    monkeypatch.chdir(tmp_path)


def train(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """One in-process run in its own run dir; returns (final metrics, run dir)."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = compose_config(*RUN, *overrides)
    return train_jax.train(cfg, str(run_dir)), run_dir


def losses(run_dir: Path, name: str = "train/loss", upto: int | None = None) -> dict[int, float]:
    """{step: the metric `name`} of a run's metrics.jsonl, of steps <= `upto` when given."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[name] for r in records if name in r and (upto is None or r["step"] <= upto)}


def arrays(ckpt_dir: Path, item: str) -> list[np.ndarray]:
    """Every array of one orbax item, read back as numpy (no target needed)."""
    tree = restore_item((ckpt_dir / item).resolve())
    return [np.asarray(x) for x in __import__("jax").tree.leaves(tree)]


def assert_same_arrays(a: Path, b: Path, item: str) -> None:
    xs, ys = arrays(a, item), arrays(b, item)
    assert len(xs) == len(ys) and xs
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- what is saved


def test_interval_saves_every_n_and_keeps_the_newest(tmp_path):
    ck = tmp_path / "ck"
    train(tmp_path, "a", "checkpoint.save=true", f"checkpoint.save_path={ck}", "checkpoint.save_steps=4",
          "checkpoint.max_to_keep=2")
    assert complete_steps(str(ck)) == [8, 12]  # 4 was saved, then retired by max_to_keep
    src = open_checkpoint(str(ck), "latest", with_opt_state=True)
    assert src.step == 12 and src.manifest["step"] == 12 and src.config["train"]["max_steps"] == 12
    assert src.manifest["data"]["position"] == 12 * 8  # 12 batches of 8 windows consumed
    assert (ck / "iter_12" / "config" / "config.yaml").is_file()
    assert (ck / "iter_12" / "manifest" / "manifest.json").is_file()
    assert not list(ck.rglob("*.pkl")) and not list(ck.rglob("*.pickle"))


def test_list_saves_exactly_those_iterations_and_keeps_them(tmp_path):
    ck = tmp_path / "ck"
    train(tmp_path, "a", "checkpoint.save=true", f"checkpoint.save_path={ck}", "checkpoint.save_steps=[3,7]",
          "checkpoint.max_to_keep=1")
    # 3 and 7 from the list (kept despite max_to_keep=1), 12 because the run ended there.
    assert complete_steps(str(ck)) == [3, 7, 12]
    assert open_checkpoint(str(ck), "iter_7.ckpt", True).step == 7  # the older spelling loads too


def test_existing_save_path_is_refused_before_training(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"checkpoint.save_path=.*already exists.*checkpoint.resume=auto"):
        train(tmp_path, "a", "checkpoint.save=true", f"checkpoint.save_path={ck}")
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    assert [p.name for p in ck.iterdir()] == ["keep.txt"]


def test_keep_best_holds_the_lowest_val_loss(tmp_path):
    ck = tmp_path / "ck"
    metrics, run_dir = train(tmp_path, "a", "checkpoint.save=true", f"checkpoint.save_path={ck}",
                             "checkpoint.keep_best=true", "checkpoint.save_steps=100")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    best_step = min((s for s in vals if s > 0), key=vals.get)
    assert complete_steps(str(ck / "best")) == [best_step]
    best = open_checkpoint(str(ck / "best"), "latest", True)
    assert best.manifest["metrics"]["val/loss"] == pytest.approx(vals[best_step])


# ----------------------------------------------------------------------------- exact resume


def as_unhashed(step_dir: Path, **manifest_changes) -> None:
    """The manifest as eqtrain wrote it before it hashed every file (no `files`, no digest beside it),
    with `manifest_changes` applied: what an older eqtrain's checkpoint holds."""
    path = step_dir / "manifest" / "manifest.json"
    manifest = {k: v for k, v in json.loads(path.read_text()).items() if k != "files"}
    path.write_text(json.dumps({**manifest, **manifest_changes}))
    (step_dir / "manifest" / "manifest.json.sha256").unlink()


def as_legacy_aux_checkpoint(step_dir: Path) -> None:
    """Rewrite a checkpoint the way eqtrain saved it before step metrics kept their states by name:
    the aux hook's state alone, as the item `aux`, and no `metric_states` item (and no file hashes,
    which came later)."""
    states = restore_item((step_dir / "metric_states").resolve())
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.fspath((step_dir / "aux").resolve()), states["aux"])
    shutil.rmtree(step_dir / "metric_states")
    as_unhashed(step_dir)


def as_old_names_checkpoint(step_dir: Path) -> None:
    """Rewrite the config a checkpoint holds with the optimizer knob names it had before
    optimizer/renames.py's renames (what an older eqtrain saved), its file hashes sealed anew."""
    path = step_dir / "config" / storage.CONFIG_FILE
    path.write_text(yaml.safe_dump(with_old_names(yaml.safe_load(path.read_text())), sort_keys=False))
    integrity.seal(str(step_dir))


@pytest.mark.slow
@pytest.mark.parametrize("extra,legacy", [((), False), (("dataset.total_batch_size=16",), True),
                                          (("optimizer=shampoo", "optimizer.precondition_every=3"), "old-names"),
                                          (("optimizer=nadamw",), False), (("optimizer=schedule_free_adamw",), False),
                                          (("optimizer=ademamix",), False),
                                          (("optimizer=soap", "optimizer.precondition_every=3"), "old-names"),
                                          (("optimizer=mars",), False), (("optimizer=kron",), False),
                                          (("optimizer=adopt",), False), (("optimizer=prodigy",), False),
                                          (("optimizer=normuon",), False), (("optimizer=adam_mini",), False),
                                          (("optimizer=scion",), False),
                                          (("optimizer=dion", "optimizer.rank_fraction=0.5"), False),
                                          # a Hessian estimate at steps 0, 3, 6, 9: before and after the resume at 5
                                          (("optimizer=sophia", "optimizer.precondition_every=3"), False),
                                          (("optimizer=muon", "optimizer.ns_coefficients=polar_express"), False),
                                          (("optimizer=muon", "optimizer.hyperball=true", "model.tie_embeddings=false"),
                                           False),
                                          # QK-clip keeps no state (each step's scales are its own logits'):
                                          # τ = 0.01 clips gpt_tiny's heads on both sides of the resume
                                          (("optimizer=muon", "optimizer.qk_clip_tau=0.01"), False),
                                          (("train.compute_dtype=float16", "train.loss_scale.growth_interval=2"),
                                           False)],
                         ids=["plain", "accumulation-legacy-aux-item", "shampoo", "nadamw", "schedule_free_adamw",
                              "ademamix", "soap", "mars", "kron", "adopt", "prodigy", "normuon", "adam_mini",
                              "scion", "dion", "sophia", "muon-polar-express",
                              "muon-hyperball", "muon-qk-clip", "float16-loss-scale"])
def test_resume_is_bit_identical(tmp_path, extra, legacy):
    """Stop at step 5 and resume: losses at every step and the final weights and optimizer state
    equal an uninterrupted run's exactly (data order and dropout keys included), and so do the
    aux-state diagnostics, whose buffers and running sums the checkpoint carries. The second case
    resumes a checkpoint written before metric_states (the aux hook's state as the item `aux`); the
    third, Shampoo's, whose state holds zero-size placeholders (orbax refuses to save those: the
    checkpoint leaves them out and the restore makes them anew), and whose saved config (as SOAP's)
    is rewritten with the knob names of before optimizer/renames.py's renames: the resume renames
    them. Schedule-Free evaluates x, not the y it trains (its val/loss checks that point too);
    AdEMAMix's α/β3 warmup (over the 12 steps) reads its step count from the optimizer state, so the
    resume at 5 lands mid-warmup. float16's loss
    scale grows every 2 finite steps: the resume at 5 lands mid-count (the item `loss_scale` holds both).
    SOAP refreshes its eigenbases on updates 4, 7 and 10 (frequency 3), across the resume; Kron draws
    its random probes from a key folded with the update count, so the resumed run draws the same.
    Prodigy's d, its initial weights x_0 and its lr counter come back with its state; NorMuon's
    neuron second moments too, and Adam-mini's per-block ones (its partition is not saved: it is
    read from the tree's field names each trace); ADOPT's first update (v only) is before the resume. Muon with Polar
    Express carries its (ns_steps, 3) coefficient table in the state, where the quintic has (3,).
    Dion at half rank carries its error-feedback buffer and its right factors Q (drawn once at init,
    never again). Hyperball keeps each hidden and head matrix's initial norm R in the state (and its own lr
    counter): the resumed run projects onto the radii of step 0, not onto norms re-read at step 5."""
    full_ck, seg_ck = Path("ckpt/full"), Path("ckpt/seg")  # relative, as in the docs
    # The aux diagnostics' buffers must resume exactly too; the optimizer's own diagnostics carry no
    # state (and double the compile), so they stay off.
    # Every case but the plain one resumes the uninterrupted run's own step-5 save: one run less per case,
    # and a mid-run save is the harder one (its data prefetched past step 5). The plain case stops a
    # second run at step 5 with checkpoint.num_steps.
    stopped_run = not extra
    extra = (*extra, "logging.log_callback_data=true", "logging.optim_diagnostics=false")
    if stopped_run:
        train(tmp_path, "full", *extra, "checkpoint.save=true", f"checkpoint.save_path={full_ck}")
        _, first = train(tmp_path, "first", *extra, "checkpoint.save=true", f"checkpoint.save_path={seg_ck}",
                         "checkpoint.num_steps=5")
    else:
        train(tmp_path, "full", *extra, "checkpoint.save=true", f"checkpoint.save_path={full_ck}",
              "checkpoint.save_steps=[5]")
        shutil.copytree(full_ck / "iter_5", seg_ck / "iter_5")
        first = tmp_path / "full"
    assert complete_steps(str(seg_ck)) == [5]
    if legacy == "old-names":
        as_old_names_checkpoint(tmp_path / seg_ck / "iter_5")
    elif legacy:
        as_legacy_aux_checkpoint(tmp_path / seg_ck / "iter_5")
    _, second = train(tmp_path, "second", *extra, "checkpoint.save=true", f"checkpoint.save_path={seg_ck}",
                      "checkpoint.resume=auto")

    full = losses(tmp_path / "full")
    resumed = {**losses(first, upto=5), **losses(second)}
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == full  # exact float equality, step by step
    assert 0 not in losses(second) and min(losses(second)) == 6
    if "optimizer.qk_clip_tau=0.01" in extra:  # the clip did act, before and after the resume, alike
        clipped = {**losses(first, "optim/qk_clip/clipped_heads"), **losses(second, "optim/qk_clip/clipped_heads")}
        assert clipped == losses(tmp_path / "full", "optim/qk_clip/clipped_heads")
        assert max(v for s, v in clipped.items() if s <= 5) > 0 and max(v for s, v in clipped.items() if s > 5) > 0
    scaled = "train.compute_dtype=float16" in extra
    for item in ("model", "opt_state", "progress", "metric_states") + (("loss_scale",) if scaled else ()):
        assert_same_arrays(full_ck / "iter_12", seg_ck / "iter_12", item)
    if scaled:
        assert len(set(losses(second, "train/loss_scale").values())) > 1  # it grew after the resume
        assert {**losses(first, "train/loss_scale", upto=5), **losses(second, "train/loss_scale")} == losses(
            tmp_path / "full", "train/loss_scale")
    for name in ("update/<gn, Delta(n)>_sum", "grads/cos(gn, g(n-1))", "grads/cos(gn, g(1:n-1))",
                 "update/cos(Delta(n+1), Delta(n))", "val/loss"):
        assert {**losses(first, name, upto=5), **losses(second, name)} == losses(tmp_path / "full", name), name


def test_resume_auto_without_checkpoint_starts_fresh_and_finished_run_is_a_no_op(tmp_path, capsys):
    ck = Path("ckpt/run1")
    common = ("checkpoint.save=true", f"checkpoint.save_path={ck}", "checkpoint.resume=auto")
    train(tmp_path, "a", *common)  # save_path does not exist: a new run
    assert complete_steps(str(ck)) == [12]
    capsys.readouterr()
    metrics, run_dir = train(tmp_path, "b", *common)
    assert "nothing to train" in capsys.readouterr().out
    assert not losses_file_has_training(run_dir)
    assert metrics["val/loss"] > 0  # the metrics saved with the checkpoint


def losses_file_has_training(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any("train/loss" in line for line in path.read_text().splitlines())


@pytest.mark.slow
def test_save_at_end_false_skips_the_runs_last_step_but_not_a_segments(tmp_path):
    """checkpoint.save_at_end=false: the run saves at its save_steps and at a shorter segment's end
    (checkpoint.num_steps: the next segment resumes from it), not at its last step (train.max_steps
    12; the default saves there: test_interrupted_save_is_removed_with_a_warning)."""
    overrides = ("checkpoint.save=true", "checkpoint.save_path=ck", "checkpoint.save_steps=[4]")
    train(tmp_path, "a", *overrides, "checkpoint.save_at_end=false", "checkpoint.num_steps=6")
    assert complete_steps("ck") == [4, 6]
    _, run_dir = train(tmp_path, "b", *overrides, "checkpoint.save_at_end=false", "checkpoint.resume=auto")
    assert min(losses(run_dir)) == 7 and max(losses(run_dir)) == 12 and complete_steps("ck") == [4, 6]


def test_interrupted_save_is_removed_with_a_warning(tmp_path, capsys):
    ck = Path("ck")
    train(tmp_path, "a", "checkpoint.save=true", f"checkpoint.save_path={ck}", "checkpoint.num_steps=4")
    # What kill -9 during a save leaves: orbax's tmp directory, never renamed to iter_N.
    shutil.copytree(ck / "iter_4", ck / "iter_8.orbax-checkpoint-tmp")
    shutil.rmtree(ck / "iter_8.orbax-checkpoint-tmp" / "opt_state")
    assert complete_steps(str(ck)) == [4]
    capsys.readouterr()
    _, run_dir = train(tmp_path, "b", "checkpoint.save=true", f"checkpoint.save_path={ck}", "checkpoint.resume=auto")
    out = capsys.readouterr().out
    assert "removing the incomplete checkpoint" in out and "iter_8.orbax-checkpoint-tmp" in out
    assert "resumed from" in out and "at step 4" in out
    assert not (ck / "iter_8.orbax-checkpoint-tmp").exists()
    assert min(losses(run_dir)) == 5 and complete_steps(str(ck)) == [4, 12]


# ----------------------------------------------------------------------------- load: which config wins


@pytest.fixture(scope="module")
def _base_once(tmp_path_factory, _cache_dir) -> Path:
    """One 6-step AdamW run with a checkpoint at iter_6, shared by the load and corruption tests."""
    tmp = tmp_path_factory.mktemp("base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EQTRAIN_CACHE", str(_cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.chdir(tmp)
        train(tmp, "base", "checkpoint.save=true", "checkpoint.save_path=ck", "checkpoint.num_steps=6")
    return tmp / "ck"


@pytest.fixture
def base(_base_once, tmp_path) -> Path:
    """A private copy of the shared checkpoint (tests corrupt it), named relative to the test's
    working directory as a user would name it."""
    shutil.copytree(_base_once, tmp_path / "ck_base")
    return Path("ck_base")


def test_load_keeps_saved_config_and_reports_ignored_overrides(tmp_path, base, capsys):
    new = Path("runs/new")
    capsys.readouterr()
    overrides = ("optimizer.lr_config.lr=0.5", "train.max_steps=8", "checkpoint.load=true",
                 f"checkpoint.load_path={base}", "checkpoint.load_file=iter_6", "checkpoint.save=true",
                 f"checkpoint.save_path={new}")
    train(tmp_path, "load", *overrides)
    out = capsys.readouterr().out
    assert "checkpoint.overwrite_config=false" in out
    assert "optimizer.lr_config.lr=0.5" in out and "train.max_steps=8" in out  # reported as ignored
    # The saved config trained (max_steps 12, lr 3e-3); the checkpoint group of this command line applied.
    assert complete_steps(str(new)) == [12]
    saved = open_checkpoint(str(new), "latest", True).config
    assert saved["optimizer"]["lr_config"]["lr"] == pytest.approx(3e-3)
    assert saved["checkpoint"]["save_path"] == str(new)


def test_requeued_fine_tuning_keeps_the_config_its_run_started_with(tmp_path, base, capsys):
    """The same command twice: a load that ignores the command line's lr and model, then its
    requeue (resume=auto), which must train on with the saved config, not switch to the command line's."""
    command = ("optimizer.lr_config.lr=0.5", "model.dim=64", "checkpoint.load=true", f"checkpoint.load_path={base}",
               "checkpoint.save=true", "checkpoint.save_path=runs/ft", "checkpoint.resume=auto",
               "checkpoint.num_steps=2")
    _, first = train(tmp_path, "first", *command)
    capsys.readouterr()
    _, second = train(tmp_path, "second", *command)
    out = capsys.readouterr().out
    assert "resumed from" in out and "optimizer.lr_config.lr=0.5" in out  # reported as ignored again
    for run_dir in (first, second):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        lrs = [r["train/lr"] for r in records if "train/lr" in r]
        assert lrs and lrs == pytest.approx([3e-3] * len(lrs))
    assert min(losses(second)) == 9 and complete_steps("runs/ft") == [8, 10]
    saved = open_checkpoint("runs/ft", "latest", True).config
    assert saved["optimizer"]["lr_config"]["lr"] == pytest.approx(3e-3) and saved["model"]["dim"] == 32


def test_a_checkpoint_from_more_devices_loads_on_this_machine(tmp_path, base):
    """parallel.* describes the hardware, not the run: a checkpoint saved with parallel.data=8
    loads on this one device without overwrite_config (the global batch stays the run's)."""
    config = base / "iter_6" / "config" / "config.yaml"
    config.write_text(config.read_text().replace("parallel:\n  data: -1", "parallel:\n  data: 8"))
    assert "data: 8" in config.read_text()
    integrity.seal(str(base / "iter_6"))  # hashed as that run's save hashed it
    _, run_dir = train(tmp_path, "load", "checkpoint.load=true", f"checkpoint.load_path={base}")
    assert min(losses(run_dir)) == 7 and max(losses(run_dir)) == 12


def test_load_with_overwrite_config_uses_the_new_config(tmp_path, base, capsys):
    new = Path("runs/new")
    capsys.readouterr()
    _, run_dir = train(tmp_path, "load", "train.max_steps=8", "optimizer.lr_config.lr=1e-3",
                       "train.param_dtype=bfloat16", "checkpoint.load=true", f"checkpoint.load_path={base}",
                       "checkpoint.overwrite_config=true", "checkpoint.save=true", f"checkpoint.save_path={new}")
    assert "train.max_steps: 12 -> 8" in capsys.readouterr().out
    assert complete_steps(str(new)) == [8] and min(losses(run_dir)) == 7
    # The float32 checkpoint was cast into this run's bfloat16 weights.
    assert {str(a.dtype) for a in arrays(new / "iter_8", "model")} == {"bfloat16"}
    assert {str(a.dtype) for a in arrays(base / "iter_6", "model")} == {"float32"}


def test_load_with_overwrite_config_and_another_model_shape_fails_clearly(tmp_path, base):
    with pytest.raises(CheckpointError, match=r"model.dim: 32 in the checkpoint, 64 now"):
        train(tmp_path, "load", "model.dim=64", "checkpoint.load=true", f"checkpoint.load_path={base}",
              "checkpoint.overwrite_config=true")


def test_overwrite_config_with_another_kind_of_dataset_fails_clearly_before_compiling(tmp_path, base, monkeypatch):
    """The checkpoint's data state is a BatchIterator's (windows): a mixture's iterator cannot take
    it, nor (the manifest edited to what a mixture run saves) a windows source a mixture's."""
    monkeypatch.setattr(train_jax, "init_training", lambda *a, **k: pytest.fail("compiled before refusing"))
    load = ("checkpoint.load=true", f"checkpoint.load_path={base}", "checkpoint.overwrite_config=true")
    with pytest.raises(CheckpointError, match=r"data iterator is a windows state but this run's dataset gives mixture"):
        train(tmp_path, "to_mixture", "dataset=mixture", "~dataset.components",
              "+dataset.components={code: {name: stdlib, weight: 1}}", *load)
    manifest = base / "iter_6" / "manifest" / "manifest.json"
    saved = json.loads(manifest.read_text())
    saved["data"] = {"batches": 6, "components": {"code": saved["data"]}}
    manifest.write_text(json.dumps(saved))
    integrity.seal(str(base / "iter_6"))  # hashed as a mixture run's save hashes it
    with pytest.raises(CheckpointError, match=r"data iterator is a mixture state but this run's dataset gives windows"):
        train(tmp_path, "from_mixture", *load)


def test_overwrite_optimizer_switches_adamw_to_sgdm(tmp_path, base):
    new = Path("runs/new")
    common = ("optimizer=sgdm", "optimizer.lr_config.lr=0.1", "checkpoint.load=true", f"checkpoint.load_path={base}")
    # Without overwrite_optimizer, AdamW's state cannot fill SGDM's: a clear error, not an orbax traceback.
    with pytest.raises(CheckpointError, match=r"overwrite_optimizer"):
        train(tmp_path, "refused", *common, "checkpoint.overwrite_config=true")
    _, run_dir = train(tmp_path, "switch", *common, "checkpoint.overwrite_optimizer=true", "checkpoint.save=true",
                       f"checkpoint.save_path={new}")
    assert min(losses(run_dir)) == 7  # step kept
    src = open_checkpoint(str(new), "latest", True)
    assert src.config["optimizer"]["name"] == "sgdm" and src.step == 12
    # SGDM keeps one momentum buffer per parameter (AdamW two): count the optimizer's big arrays.
    model_sizes = sorted(a.size for a in arrays(new / "iter_12", "model"))
    opt_sizes = sorted(a.size for a in arrays(new / "iter_12", "opt_state") if a.size > 1)
    base_sizes = sorted(a.size for a in arrays(base / "iter_6", "opt_state") if a.size > 1)
    assert opt_sizes == [s for s in model_sizes if s > 1]
    assert base_sizes == sorted(2 * [s for s in model_sizes if s > 1])
    # The fresh state's lr schedule continued at the run's step (warmup not restarted): optax's
    # schedule counters are SGDM's only integer arrays, one per parameter group.
    counts = [int(a) for a in arrays(new / "iter_12", "opt_state") if a.dtype.kind == "i"]
    assert counts and set(counts) == {12}


# ----------------------------------------------------------------------------- corruption


@pytest.mark.slow  # three runs; tests/test_resume.py checks the config and data-position rules in the quick set
def test_overwrite_data_trains_the_loaded_run_on_another_dataset_from_its_start(tmp_path, base, capsys):
    """checkpoint.overwrite_data=true: the weights, optimizer state and step of a load go on, on this
    command line's dataset (a relative glob, as typed), whose stream starts afresh instead of
    restoring the checkpoint's position in another dataset's windows (which the window count
    refuses); the new run's checkpoints hold the new dataset, so its own resumes continue that."""
    corpus = Path("corpus")
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40)
    new_data = ("dataset=text_files", "dataset.paths=[corpus/*.txt]")
    load = ("checkpoint.load=true", f"checkpoint.load_path={base}", "checkpoint.save=true")
    with pytest.raises(CheckpointError, match=r"load with checkpoint\.overwrite_data=true"):
        train(tmp_path, "no_switch", *load, *new_data, "checkpoint.overwrite_config=true",
              "checkpoint.save_path=ck_no_switch")
    capsys.readouterr()
    _, run_dir = train(tmp_path, "switch", *load, *new_data, "checkpoint.overwrite_data=true",
                       "checkpoint.save_path=ck_switch")
    out = capsys.readouterr().out
    assert "iter_6 at step 6, the dataset's stream from its start (checkpoint.overwrite_data)" in out, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(7, 13))  # the saved max_steps
    assert records[0]["data/fingerprint"] != _stdlib_fingerprint(tmp_path)
    saved = open_checkpoint("ck_switch", "latest", with_opt_state=True)
    assert saved.step == 12 and saved.config["dataset"]["name"] == "text_files"
    assert saved.config["dataset"]["paths"] == ["corpus/*.txt"] and saved.config["optimizer"]["name"] == "adamw"


def _stdlib_fingerprint(tmp_path) -> str:
    """data/fingerprint of a fresh run of the base's dataset (stdlib), 0 steps trained."""
    _, run_dir = train(tmp_path, "stdlib_fp", "train.max_steps=1")
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["data/fingerprint"]


def _load(tmp_path, base: Path, name: str = "load"):
    return train(tmp_path, name, "checkpoint.load=true", f"checkpoint.load_path={base}")


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("hashed, message", [
    (True, r"iter_6/model/\S*d/\w+ is missing \(the manifest lists it, \d+ bytes\); \d+ more listed files are "
           r"missing too: the checkpoint is incomplete"),
    (False, r"iter_6/model has none of its array files .* incomplete")], ids=["hashed", "before-hashes"])
def test_deleted_array_files_are_a_checkpoint_error_naming_them_before_orbax_reads(tmp_path, base, monkeypatch,
                                                                                    hashed, message):
    """Checked before orbax opens the item: orbax would read no metadata and return while tensorstore
    reads still call back into its closed event loop, a traceback printed after the one-line error.
    The manifest's file list names the first missing file; a checkpoint from before it, the item."""
    data_files = sorted((base / "iter_6" / "model").rglob("d/*"))
    assert data_files
    for f in data_files:
        f.unlink()
    if not hashed:
        as_unhashed(base / "iter_6")
    before = _snapshot(base)

    def orbax_read(item_dir):
        raise AssertionError(f"orbax read {item_dir}")
    monkeypatch.setattr(storage, "_saved_shapes", orbax_read)
    with pytest.raises(CheckpointError, match=message):
        _load(tmp_path, base)
    assert _snapshot(base) == before  # nothing was written into the checkpoint


def test_bad_manifest_json_is_a_checkpoint_error_naming_it(tmp_path, base):
    (base / "iter_6" / "manifest" / "manifest.json").write_text('{"step": 6, "da')
    with pytest.raises(CheckpointError, match=r"iter_6/manifest/manifest.json is not valid JSON"):
        _load(tmp_path, base)


def test_bad_config_yaml_is_a_checkpoint_error_naming_it(tmp_path, base):
    (base / "iter_6" / "config" / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(CheckpointError, match=r"iter_6/config/config.yaml is not valid YAML"):
        _load(tmp_path, base)


def test_another_models_checkpoint_is_a_checkpoint_error(tmp_path, base):
    other = tmp_path / "ck_other"
    train(tmp_path, "other", "model.dim=48", "model.num_heads=3", "checkpoint.save=true",
          f"checkpoint.save_path={other}", "checkpoint.num_steps=2")
    # Put the other model's arrays under this checkpoint's manifest and config: the shapes betray it.
    shutil.rmtree(base / "iter_6" / "model")
    shutil.copytree(other / "iter_2" / "model", base / "iter_6" / "model")
    integrity.seal(str(base / "iter_6"))  # consistent files: the shape check, not the hashes, must catch it
    with pytest.raises(CheckpointError, match=r"another model's checkpoint"):
        _load(tmp_path, base)


def test_a_checkpoint_of_an_older_format_is_refused_not_misread(tmp_path, base):
    """Format 1 stored the attention projection's columns in another order: its weights would load
    and compute something else, so it is refused before anything is restored."""
    as_unhashed(base / "iter_6", format=1)  # format 1 predates the file hashes too
    with pytest.raises(CheckpointError, match=r"checkpoint format 1, this eqtrain reads format 2"):
        _load(tmp_path, base)


def test_missing_load_file_lists_what_exists(tmp_path, base):
    with pytest.raises(CheckpointError, match=r"no iter_7 in .*complete checkpoints: iter_6"):
        train(tmp_path, "load", "checkpoint.load=true", f"checkpoint.load_path={base}", "checkpoint.load_file=iter_7")


# ----------------------------------------------------------------------------- bad knobs (no training)


@pytest.mark.parametrize("overrides, message", [
    (("checkpoint.save=true",), r"checkpoint.save=true needs checkpoint.save_path"),
    (("checkpoint.save_steps=0",), r"checkpoint.save_steps=0 must be a positive interval"),
    (("checkpoint.save_steps=[10,-1]",), r"checkpoint.save_steps=\[10, -1\] must be a non-empty list"),
    (("checkpoint.save_steps=often",), r"checkpoint.save_steps='often' must be an interval"),
    (("checkpoint.resume=yes",), r"checkpoint.resume='yes' must be null or auto"),
    (("checkpoint.resume=auto",), r"checkpoint.resume=auto continues checkpoint.save_path: set checkpoint.save=true"),
    (("checkpoint.load=true",), r"checkpoint.load=true needs checkpoint.load_path"),
    (("checkpoint.load_file=final",), r"checkpoint.load_file='final' must be iter_N, iter_N.ckpt or latest"),
    (("checkpoint.max_to_keep=0",), r"checkpoint.max_to_keep=0 must be a positive integer or null"),
    (("checkpoint.keep_best=true", "train.skip_validation=true"),
     r"checkpoint.keep_best=true .* train.skip_validation"),
    (("+checkpoint.every=5",), r"unknown knob checkpoint.every"),
])
def test_bad_checkpoint_knobs_are_one_line_config_errors(tiny_run, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_run(*overrides)
    assert "\n" not in str(e.value)


def test_list_steps_beyond_the_run_are_a_warning(tiny_run):
    run = tiny_run("checkpoint.save=true", "checkpoint.save_path=/nonexistent/x", "checkpoint.save_steps=[5,100]")
    assert any("checkpoint.save_steps [100] lie beyond train.max_steps=20" in w for w in run.warnings)


def test_a_resumed_run_hands_each_sink_its_saved_state(tmp_path, monkeypatch):
    """The wiring the wandb sink relies on to continue its run (tests/test_sinks.py checks wandb
    itself offline): a sink's state_dict goes into every checkpoint's manifest and comes back to
    its build when the run resumes. A recording sink stands in for wandb."""
    built = []

    class Stateful:
        def __init__(self, saved):
            self.id = (saved or {}).get("id") or f"run-{len(built)}"

        def log(self, step, metrics):
            pass

        def state_dict(self):
            return {"id": self.id}

        def close(self):
            pass

    @dataclass(frozen=True)
    class Recording:
        name: ClassVar[str] = "recording"

        def build(self, run_dir, total_steps, start_step, config, saved=None):
            sink = Stateful(saved)
            built.append(dict(saved or {}))
            return sink

    monkeypatch.setitem(sinks.SINKS, "recording", Recording)
    ck = Path("ckpt/run")
    overrides = ("train.max_steps=4", "checkpoint.save=true", f"checkpoint.save_path={ck}")
    train(tmp_path, "first", *overrides, "checkpoint.num_steps=2")
    assert open_checkpoint(str(ck), "latest", True).manifest["sinks"] == {"recording": {"id": "run-0"}}
    train(tmp_path, "second", *overrides, "checkpoint.resume=auto")
    assert built == [{}, {"id": "run-0"}]
    assert open_checkpoint(str(ck), "latest", True).manifest["sinks"] == {"recording": {"id": "run-0"}}
