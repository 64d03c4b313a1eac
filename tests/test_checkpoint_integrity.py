"""Checkpoint integrity (utils/checkpoint/integrity.py): every file of a checkpoint has its size and
sha256 in the manifest, and the manifest its own sha256 beside it (manifest/manifest.json.sha256).

A byte flipped in an array file, a byte flipped in the manifest, a truncated file, a deleted file and
an extra file each stop a resume and an export with one line naming the file and what is wrong,
before any weights are read (orbax's restore is replaced by a trap). An intact checkpoint resumes bit
for bit; one written before the hashes (none in its manifest) loads with a one-line note that it is
unverified. The remote pull's check is in tests/test_remote.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import compose_config, load_script

import train_jax
from trainer import resume as resume_lib
from utils.checkpoint import storage
from utils.errors import CheckpointError

RUN = ("model.vocab_size=null", "train.max_steps=8", "logging.log_every=1", "train.val_freq=4",
       "train.max_val_steps=2", "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3",
       "checkpoint.save=true", "checkpoint.save_path=ck")
STEP = 4

export_script = load_script("export_model")


def train(where: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    run_dir = where / name
    run_dir.mkdir()
    return train_jax.train(compose_config(*RUN, *overrides), str(run_dir)), run_dir


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.fixture(scope="module")
def _segment(tmp_path_factory, _cache_dir) -> Path:
    """A run stopped after its first segment: ck/iter_4 (async save, the default), and the same run
    trained through in one go (full/) for the bit-identical resume."""
    tmp = tmp_path_factory.mktemp("integrity")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EQTRAIN_CACHE", str(_cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.chdir(tmp)
        train(tmp, "first", f"checkpoint.num_steps={STEP}")
        train(tmp, "full", "checkpoint.save_path=ck_full")
    return tmp


@pytest.fixture
def ck(_segment, tmp_path, monkeypatch) -> Path:
    """A private copy of the segment's save_path (tests corrupt it), the test's working directory beside it."""
    shutil.copytree(_segment / "ck", tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "ck"


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def manifest_path(ck: Path) -> Path:
    return ck / f"iter_{STEP}" / "manifest" / "manifest.json"


# Each corruption: (what it does to ck/iter_4, the file the error must name, what it must say)
def flip_array_byte(ck: Path):
    f = largest_file(ck / f"iter_{STEP}" / "model")  # the model's weights (an OCDBT data file)
    flip_byte(f)
    return f, r"does not match its sha256 in the manifest"


def flip_manifest_byte(ck: Path):
    """A digit of the save time: the JSON stays valid and says something else (an edit, not a garble)."""
    f = manifest_path(ck)
    text = f.read_bytes()
    at = text.index(b'"saved_at": "') + len(b'"saved_at": "') + 3  # the year's last digit
    flip_byte(f, at)
    json.loads(f.read_bytes())  # still valid JSON
    return f, r"does not match the sha256 in manifest.json.sha256 beside it"


def truncate_file(ck: Path):
    f = largest_file(ck / f"iter_{STEP}" / "model")
    size = f.stat().st_size
    with open(f, "r+b") as handle:
        handle.truncate(size - 100)
    return f, rf"has {size - 100} bytes, the manifest says {size}"


def delete_file(ck: Path):
    f = largest_file(ck / f"iter_{STEP}" / "opt_state")
    f.unlink()
    return f, r"is missing \(the manifest lists it"


def add_file(ck: Path):
    f = ck / f"iter_{STEP}" / "model" / "d" / "stray"
    f.write_bytes(b"not orbax's")
    return f, r"is not in the checkpoint's manifest"


CORRUPTIONS = [flip_array_byte, flip_manifest_byte, truncate_file, delete_file, add_file]


@pytest.fixture
def no_restore(monkeypatch):
    """Trap orbax's restore: an integrity error must come before any array is read."""
    def trap(*args, **kwargs):
        raise AssertionError("a corrupt checkpoint reached orbax's restore")
    monkeypatch.setattr(resume_lib, "restore", trap)
    monkeypatch.setattr(storage, "restore", trap)
    monkeypatch.setattr(storage, "restore_model", trap)


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_a_corrupt_checkpoint_stops_a_resume_with_one_line_naming_the_file(ck, tmp_path, corrupt, no_restore):
    path, says = corrupt(ck)
    with pytest.raises(CheckpointError) as e:
        train(tmp_path, "resumed", "checkpoint.resume=auto")
    line = str(e.value)
    assert "\n" not in line
    assert str(path) in line, line
    assert re.search(says, line), line
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_a_corrupt_checkpoint_stops_an_export_with_one_line_naming_the_file(ck, tmp_path, corrupt, no_restore,
                                                                             capsys):
    path, says = corrupt(ck)
    capsys.readouterr()
    assert export_script.main(["ck", "--out", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert str(path) in err[0], err[0]
    assert re.search(says, err[0]), err[0]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_every_file_is_in_the_manifest_with_its_size_and_sha256_and_the_manifest_digest_beside_it(ck):
    step_dir = ck / f"iter_{STEP}"
    manifest_bytes = manifest_path(ck).read_bytes()
    digest_line = (step_dir / "manifest" / "manifest.json.sha256").read_text()
    assert digest_line == f"{hashlib.sha256(manifest_bytes).hexdigest()}  manifest.json\n"  # sha256sum -c format
    listed = json.loads(manifest_bytes)["files"]
    on_disk = {p.relative_to(step_dir).as_posix(): p for p in step_dir.rglob("*") if p.is_file()}
    assert set(listed) == set(on_disk) - {"manifest/manifest.json", "manifest/manifest.json.sha256"}
    assert any(rel.startswith("model/") for rel in listed) and any(rel.startswith("opt_state/") for rel in listed)
    for rel, entry in listed.items():
        data = on_disk[rel].read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel


def test_a_synchronous_save_is_sealed_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(tmp_path, "sync", "checkpoint.async_save=false", "checkpoint.num_steps=2")
    step_dir = tmp_path / "ck" / "iter_2"
    assert (step_dir / "manifest" / "manifest.json.sha256").is_file()
    assert "files" in json.loads((step_dir / "manifest" / "manifest.json").read_text())


def test_an_intact_checkpoint_resumes_bit_identically(ck, tmp_path, _segment, capsys):
    capsys.readouterr()
    _, run_dir = train(tmp_path, "resumed", "checkpoint.resume=auto")
    out = capsys.readouterr().out
    assert f"resumed from {ck}/iter_{STEP} at step {STEP}" in out and "unverified" not in out
    full = losses(_segment / "full")
    assert {**losses(_segment / "first"), **losses(run_dir)} == full  # exact float equality, step by step


def as_unhashed(step_dir: Path) -> None:
    """What a checkpoint written before this change holds: a manifest without `files`, no digest."""
    path = step_dir / "manifest" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("files", None)
    path.write_text(json.dumps(manifest))
    (step_dir / "manifest" / "manifest.json.sha256").unlink(missing_ok=True)


def test_a_checkpoint_from_before_the_hashes_loads_with_a_note_that_it_is_unverified(ck, tmp_path, capsys):
    as_unhashed(ck / f"iter_{STEP}")
    capsys.readouterr()
    train(tmp_path, "resumed", "checkpoint.resume=auto", "checkpoint.num_steps=1")
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "unverified" in line]
    assert len(notes) == 1 and f"{ck}/iter_{STEP}" in notes[0], out
    assert f"resumed from {ck}/iter_{STEP} at step {STEP}" in out
    # Its successor is written with hashes.
    assert "files" in json.loads((ck / f"iter_{STEP + 1}" / "manifest" / "manifest.json").read_text())
    assert export_script.main(["ck", "--load-file", f"iter_{STEP}", "--out", "out"]) == 0
    assert "unverified" in capsys.readouterr().out


def test_a_manifest_that_lists_files_without_its_digest_is_refused(ck, tmp_path):
    """The digest gone but the hashes there: not a checkpoint from before them, a file lost."""
    digest = ck / f"iter_{STEP}" / "manifest" / "manifest.json.sha256"
    digest.unlink()
    with pytest.raises(CheckpointError, match=rf"{digest} is missing"):
        train(tmp_path, "resumed", "checkpoint.resume=auto")


def test_a_save_killed_while_hashing_never_becomes_a_checkpoint(tmp_path, monkeypatch, capsys):
    """The hashing runs after orbax's files are final and before the directory is named iter_N: a save
    that fails (or is killed) there leaves only a tmp directory, which the next run removes."""
    import types

    import jax
    import jax.numpy as jnp

    from utils.checkpoint import integrity

    def killed(root):
        raise OSError(f"killed while hashing {root}")
    monkeypatch.setattr(integrity, "seal", killed)
    state = types.SimpleNamespace(model={"w": jnp.ones((64,))}, opt_state={"mu": jnp.zeros((64,))},
                                  step=jnp.int32(3), key=jax.random.PRNGKey(0), metric_states={}, loss_scale=None)
    cfg = storage.CheckpointConfig(save=True, save_path=str(tmp_path / "ck"))
    saver = storage.Checkpointer(cfg, {}, {}, print)
    saver.save(3, state, {}, {}, "test")
    with pytest.raises(Exception, match="killed while hashing"):
        saver.close()
    left = sorted(os.listdir(tmp_path / "ck"))
    assert storage.complete_steps(str(tmp_path / "ck")) == [] and left == [f"iter_3{storage.TMP_MARKER}-sealing"]
    monkeypatch.undo()
    capsys.readouterr()
    storage.Checkpointer(cfg, {}, {}, print).close()
    assert "removing the incomplete checkpoint" in capsys.readouterr().out
    assert os.listdir(tmp_path / "ck") == []
