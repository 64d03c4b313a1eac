"""checkpoint.remote (utils/checkpoint/remote.py) against a real S3-compatible server: SeaweedFS,
started by this module (tests/s3_server.py; skipped without its binary, failed in CI).

- a run uploads every checkpoint, each marker after all of its files, and prunes the remote by
  max_to_keep; a snapshot survives a local deletion mid-upload; list-pinned steps stay;
- a run killed (SIGKILL) during an upload leaves that checkpoint without a marker; a fresh
  save_path with resume=auto pulls the previous complete one and trains on bit-identically;
- bad input (a URL that does not parse, an unreachable endpoint, missing or refused credentials, a
  missing bucket, a prefix already used) is a one-line ConfigError raised before anything is built;
- neither the credentials nor the endpoint are written to a log, a config, a manifest or the remote.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import background
import numpy as np
import pytest
import s3_server
from helpers import compose_config, offline_env, restore_item

import train_jax
from utils.checkpoint import remote
from utils.checkpoint.storage import STEP_PREFIX, complete_steps
from utils.errors import ConfigError

BUCKET = "eqtrain"
# Shuffled data, dropout on (so the RNG key matters) and a loss record at every step; saves at 4, 8, 12.
RUN = ("model.vocab_size=null", "train.max_steps=12", "logging.log_every=1", "train.val_freq=6",
       "train.max_val_steps=2", "model.dropout=0.1", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3",
       "checkpoint.save=true", "checkpoint.save_steps=4", "checkpoint.max_to_keep=2", "checkpoint.keep_best=true")
KILL_AFTER_FILES = 3  # the killed run stalls after this many files of iter_8 are up, then gets SIGKILL
TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the server


class Unavailable:
    """The server set-up's handle when it could not start: the tests that need it skip, or fail in CI."""

    def __init__(self, problem: str):
        self.problem = problem

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


@background.setup
def s3(ctx):
    """SeaweedFS on free loopback ports with one bucket, from the module's start to the session's end."""
    try:
        server = s3_server.start(str(ctx.tmp_path_factory.mktemp("seaweedfs")))
    except RuntimeError as e:
        return Unavailable(str(e))
    server.client().create_bucket(Bucket=BUCKET)
    return server


@pytest.fixture
def s3_env(s3, monkeypatch):
    """This test's process talks to the server: its endpoint and keys in the environment."""
    if isinstance(s3, Unavailable):
        s3_server.unavailable(s3.problem)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def url(name: str) -> remote.RemoteURL:
    return remote.RemoteURL(BUCKET, f"tests/{name}")


def remote_state(server, name: str) -> tuple[dict[int, dict[str, int]], list[int]]:
    listed = remote.listing(server.client(), url(name))
    return listed, remote.complete(listed)


def local_files(step_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}


def remote_files(server, name: str, step: int) -> dict[str, bytes]:
    client, u = server.client(), url(name)
    keys = remote.listing(client, u)[step]
    return {rel: client.get_object(Bucket=BUCKET, Key=u.key(f"{STEP_PREFIX}_{step}", rel))["Body"].read()
            for rel in keys}


# ----------------------------------------------------------------------------- the runs


class Recorder:
    """Spies on the mirror's two writes (files, then the marker) in the order they happen; the
    objects still go to the real server."""

    def __init__(self):
        self.keys: list[str] = []
        self._put, self._marker = remote.Mirror._put_file, remote.Mirror._put_marker

    def install(self, mp: pytest.MonkeyPatch) -> None:
        put, marker, keys = self._put, self._marker, self.keys
        mp.setattr(remote.Mirror, "_put_file", lambda m, path, key: (keys.append(key), put(m, path, key))[1])
        mp.setattr(remote.Mirror, "_put_marker", lambda m, body, key: (keys.append(key), marker(m, body, key))[1])


def train(where: Path, name: str, *overrides: str) -> tuple[Path, str]:
    """One in-process run in where/name; returns (run dir, what it printed)."""
    run_dir = where / name
    run_dir.mkdir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_jax.train(compose_config(*RUN, *overrides), str(run_dir))
    return run_dir, out.getvalue()


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def arrays(step_dir: Path, item: str) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(restore_item(step_dir / item))]


@pytest.fixture(scope="module")
def reference(s3, tmp_path_factory):
    """The uninterrupted run, mirrored to tests/reference, every upload recorded."""
    if isinstance(s3, Unavailable):
        return None
    where = tmp_path_factory.mktemp("remote_reference")
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        recorder.install(mp)
        run_dir, printed = train(where, "run", f"checkpoint.save_path={where / 'ck'}",
                                 f"checkpoint.remote=s3://{BUCKET}/tests/reference")
    return {"dir": run_dir, "ck": where / "ck", "keys": recorder.keys, "printed": printed}


# The killed run: `train_jax.train` in a child process whose mirror stalls after KILL_AFTER_FILES
# files of iter_8, where the parent kills it with SIGKILL (what a lost machine does).
KILLED = """
import sys, time
sys.path.insert(0, sys.argv[1])
from helpers import compose_config  # the suite's XLA flags, as in the test process
import train_jax
from utils.checkpoint import remote
flag, after, run_dir, overrides = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
put, sent = remote.Mirror._put_file, []
def stalling(self, path, key):
    if "/iter_8/" in key:
        sent.append(key)
        if len(sent) > after:
            open(flag, "w").close()
            time.sleep(3600)
    put(self, path, key)
remote.Mirror._put_file = stalling
train_jax.train(compose_config(*overrides), run_dir)
"""


class Killed:
    """The child and the thread that kills it once its flag appears; wait() until it is dead."""

    def __init__(self, where: Path, env: dict[str, str]):
        self.where, self.flag, self.error = where, where / "stalled", None
        (where / "run").mkdir()
        self._log = open(where / "output.txt", "w")
        args = [sys.executable, "-c", KILLED, str(REPO / "tests"), str(self.flag), str(KILL_AFTER_FILES),
                str(where / "run"), *RUN, f"checkpoint.save_path={where / 'ck'}",
                f"checkpoint.remote=s3://{BUCKET}/tests/killed"]
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._thread = threading.Thread(target=self._kill_when_stalled, daemon=True)
        self._thread.start()

    def _kill_when_stalled(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not self.flag.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.flag.exists():
            self.error = f"the run never stalled in iter_8's upload (exit {self.proc.poll()}): see {self._log.name}"
        self.close()

    def wait(self) -> None:
        self._thread.join()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@background.setup
def killed_run(ctx):
    server = ctx.setup("s3")
    if isinstance(server, Unavailable):
        return server
    return Killed(ctx.tmp_path_factory.mktemp("remote_killed"), {**offline_env(ctx.cache_dir), **server.env()})


# ----------------------------------------------------------------------------- uploads


@pytest.mark.slow
def test_a_run_uploads_each_checkpoint_marker_last_and_prunes_by_max_to_keep(s3_env, reference):
    ck, keys = reference["ck"], reference["keys"]
    assert complete_steps(str(ck)) == [8, 12]
    listed, done = remote_state(s3_env, "reference")
    assert done == [8, 12] and sorted(listed) == [8, 12]  # iter_4 went up, then max_to_keep=2 pruned it
    for step in (4, 8, 12):
        name = f"tests/reference/{STEP_PREFIX}_{step}/"  # not best/'s
        mine = [i for i, k in enumerate(keys) if name in k]
        assert keys[mine[-1]].endswith(name + remote.MARKER)  # the marker is its checkpoint's last write
        assert len(mine) > 10 and sum(k.endswith(remote.MARKER) for k in keys if name in k) == 1
    for step in (8, 12):  # the remote copy is the local checkpoint, byte for byte, plus the marker
        up = remote_files(s3_env, "reference", step)
        marker = json.loads(up.pop(remote.MARKER))
        here = local_files(ck / f"{STEP_PREFIX}_{step}")
        assert up == here
        assert marker["files"] == {rel: len(data) for rel, data in here.items()} and marker["step"] == step
    assert not (ck / remote.STAGING).exists()
    assert f"uploaded s3://{BUCKET}/tests/reference/{STEP_PREFIX}_12" in reference["printed"]
    best = complete_steps(str(ck / "best"))  # keep_best's checkpoint goes to best/, the newest kept
    assert len(best) == 1 and remote_state(s3_env, "reference/best")[1] == best


@pytest.mark.slow
def test_neither_the_credentials_nor_the_endpoint_are_written_anywhere(s3_env, reference):
    secrets = [s3_server.ACCESS_KEY, s3_server.SECRET_KEY, s3_env.endpoint, s3_env.endpoint.split("//")[1]]
    files = [p for d in (reference["dir"], reference["ck"]) for p in d.rglob("*") if p.is_file()]
    assert len(files) > 20
    texts = {str(p): p.read_bytes().decode("latin-1") for p in files}
    texts["stdout"] = reference["printed"]
    for step in (8, 12):
        texts.update({f"remote {step} {k}": v.decode("latin-1") for k, v in remote_files(s3_env, "reference",
                                                                                         step).items()})
    leaks = [(where, s) for where, text in texts.items() for s in secrets if s in text]
    assert not leaks
    assert f"s3://{BUCKET}/tests/reference" in texts[str(reference["ck"] / "iter_12" / "config" / "config.yaml")]


def fake_checkpoint(directory: Path, step: int, files: int = 4) -> Path:
    """What the mirror sees of a checkpoint: a directory iter_{step} of files."""
    for i in range(files):
        path = directory / f"{STEP_PREFIX}_{step}" / ("model" if i % 2 else "opt_state") / f"part{i}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(1000 + 7 * i + step))
    return directory / f"{STEP_PREFIX}_{step}"


def test_prune_keeps_the_newest_and_the_list_pinned_steps(s3_env, tmp_path):
    """save_steps=[4] pinned, max_to_keep=1: as locally, 4 and the newest stay."""
    mirror = remote.Mirror(url("pinned"), str(tmp_path), remote.keep_policy(1, (4,)), saving=lambda: False)
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
        mirror.submit(step)
    mirror.close()
    assert mirror.uploaded == [2, 4, 6, 8] and mirror.failed == []
    listed, done = remote_state(s3_env, "pinned")
    assert done == [4, 8] and sorted(listed) == [4, 8]


def test_a_local_deletion_during_an_upload_does_not_cut_it_short(s3_env, tmp_path, monkeypatch):
    """orbax's max_to_keep may delete iter_N locally while it is going up: the mirror uploads a
    hard-linked snapshot taken when the save completed."""
    import shutil

    mirror = remote.Mirror(url("snapshot"), str(tmp_path), remote.keep_policy(None, None), saving=lambda: False)
    step_dir = fake_checkpoint(tmp_path, 3, files=6)
    expected = local_files(step_dir)
    put = remote.Mirror._put_file

    def deleting(mirror, path, key):
        shutil.rmtree(step_dir, ignore_errors=True)
        put(mirror, path, key)

    monkeypatch.setattr(remote.Mirror, "_put_file", deleting)
    mirror.submit(3)
    mirror.close()
    assert not step_dir.exists() and mirror.uploaded == [3]
    up = remote_files(s3_env, "snapshot", 3)
    up.pop(remote.MARKER)
    assert up == expected
    assert not (tmp_path / remote.STAGING).exists()


def test_a_resumed_mirror_uploads_what_a_killed_upload_left_and_clears_its_objects(s3_env, tmp_path):
    """Same machine after a kill: iter_5 is complete locally, the remote holds part of it (and an
    object this copy does not have) and no marker: the mirror uploads it whole, the leftover goes."""
    step_dir = fake_checkpoint(tmp_path, 5)
    client, u = s3_env.client(), url("requeued")
    client.put_object(Bucket=BUCKET, Key=u.key("iter_5", "model", "part1"), Body=b"half")
    client.put_object(Bucket=BUCKET, Key=u.key("iter_5", "stale"), Body=b"from another copy")
    assert remote_state(s3_env, "requeued")[1] == []
    mirror = remote.Mirror(u, str(tmp_path), remote.keep_policy(3, None), saving=lambda: False)
    mirror.close()
    up = remote_files(s3_env, "requeued", 5)
    up.pop(remote.MARKER)
    assert up == local_files(step_dir)


def test_a_remote_checkpoint_missing_a_file_is_a_checkpoint_error_and_leaves_no_iter_dir(s3_env, tmp_path):
    from utils.errors import CheckpointError

    mirror = remote.Mirror(url("broken"), str(tmp_path / "a"), remote.keep_policy(3, None), saving=lambda: False)
    fake_checkpoint(tmp_path / "a", 6)
    mirror.submit(6)
    mirror.close()
    client, u = s3_env.client(), url("broken")
    client.delete_object(Bucket=BUCKET, Key=u.key("iter_6", "model", "part1"))
    with pytest.raises(CheckpointError, match=r"cannot pull s3://eqtrain/tests/broken/iter_6/model/part1"):
        remote.pull(client, u, 6, str(tmp_path / "b"))
    assert complete_steps(str(tmp_path / "b")) == []


def test_a_remote_object_changed_at_the_same_size_is_a_checkpoint_error_and_leaves_no_iter_dir(
        s3_env, reference, tmp_path):
    """The marker's sizes cannot see a byte that rotted or an object overwritten at the same size: the
    pull checks the download against the checkpoint's own hashes (utils/checkpoint/integrity.py)."""
    import shutil

    from utils.errors import CheckpointError

    shutil.copytree(reference["ck"] / "iter_12", tmp_path / "a" / "iter_12")
    mirror = remote.Mirror(url("tampered"), str(tmp_path / "a"), remote.keep_policy(3, None), saving=lambda: False)
    mirror.close()
    assert mirror.uploaded == [12]
    client, u = s3_env.client(), url("tampered")
    rel = max(remote.listing(client, u)[12].items(), key=lambda kv: kv[1] if kv[0].startswith("model/") else -1)[0]
    body = bytearray(client.get_object(Bucket=BUCKET, Key=u.key("iter_12", rel))["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=BUCKET, Key=u.key("iter_12", rel), Body=bytes(body))
    with pytest.raises(CheckpointError, match=rf"s3://eqtrain/tests/tampered/iter_12/{rel} does not match its "
                                              "sha256 in the manifest") as e:
        remote.pull(client, u, 12, str(tmp_path / "b"))
    assert "\n" not in str(e.value)
    assert complete_steps(str(tmp_path / "b")) == []


def test_a_save_that_never_completes_is_reported_not_waited_for(s3_env, tmp_path, capsys):
    mirror = remote.Mirror(url("failed"), str(tmp_path), remote.keep_policy(3, None), saving=lambda: False)
    mirror.submit(7)  # no iter_7 appears and orbax says nothing is being written
    mirror.close()
    assert mirror.failed == [7] and remote_state(s3_env, "failed") == ({}, [])
    assert "iter_7 was not uploaded (its local save did not complete)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- kill, then resume from the remote


@pytest.mark.slow
def test_a_kill_during_an_upload_leaves_no_marker_and_a_fresh_machine_resumes_from_the_one_before(
        s3_env, killed_run, reference, tmp_path):
    killed_run.wait()
    assert killed_run.error is None, killed_run.error
    listed, done = remote_state(s3_env, "killed")
    assert done == [4]  # iter_8 is partly up: no marker, never taken for complete
    assert remote.MARKER not in listed[8] and len(listed[8]) == KILL_AFTER_FILES

    # A fresh machine: an empty save_path, the same command with resume=auto.
    run_dir, printed = train(tmp_path, "resumed", f"checkpoint.save_path={tmp_path / 'ck'}", "checkpoint.resume=auto",
                             f"checkpoint.remote=s3://{BUCKET}/tests/killed")
    assert f"pulling s3://{BUCKET}/tests/killed/iter_4" in printed
    assert f"resumed from {tmp_path / 'ck'}/iter_4 at step 4" in printed
    resumed, full = losses(run_dir), losses(reference["dir"])
    assert sorted(resumed) == list(range(5, 13))
    assert resumed == {step: full[step] for step in range(5, 13)}  # exact float equality, step by step
    for item in ("model", "opt_state", "progress"):
        for a, b in zip(arrays(tmp_path / "ck" / "iter_12", item), arrays(reference["ck"] / "iter_12", item),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    listed, done = remote_state(s3_env, "killed")
    assert done == [8, 12] and sorted(listed) == [8, 12]  # the killed upload's objects are gone
    up = remote_files(s3_env, "killed", 8)
    up.pop(remote.MARKER)
    assert up == local_files(tmp_path / "ck" / "iter_8")


# ----------------------------------------------------------------------------- bad input, before anything is built


def test_a_bandwidth_cap_reaches_every_upload_and_uploads_the_same_bytes(s3_env, tmp_path, monkeypatch):
    """checkpoint.remote_bandwidth: each file goes up over one connection at the cap (boto3's
    TransferConfig), and the remote copy is byte-identical; no cap keeps boto3's defaults."""
    step_dir = fake_checkpoint(tmp_path, 2, files=4)
    configs = []
    real = remote.Mirror._put_file

    def spying(mirror, path, key):
        configs.append(mirror._transfer)
        real(mirror, path, key)

    monkeypatch.setattr(remote.Mirror, "_put_file", spying)
    mirror = remote.Mirror(url("capped"), str(tmp_path), remote.keep_policy(3, None), saving=lambda: False,
                           bandwidth_mb=2.5)
    mirror.submit(2)
    mirror.close()
    assert mirror.uploaded == [2] and len(configs) == 4
    assert {(c.max_concurrency, c.max_bandwidth) for c in configs} == {(1, 2_500_000)}
    up = remote_files(s3_env, "capped", 2)
    up.pop(remote.MARKER)
    assert up == local_files(step_dir)
    default = remote.transfer_config(None)
    assert default.max_bandwidth is None and default.max_concurrency > 1


def test_a_save_while_an_upload_is_still_going_warns_once(s3_env, tmp_path, monkeypatch, capsys):
    """Saves that outpace the uploads (a low checkpoint.remote_bandwidth, frequent saves) are said
    once, naming the knob; both checkpoints still go up, in order."""
    release = threading.Event()
    real = remote.Mirror._put_file

    def stalled(mirror, path, key):
        release.wait(60)
        real(mirror, path, key)

    monkeypatch.setattr(remote.Mirror, "_put_file", stalled)
    mirror = remote.Mirror(url("lagging"), str(tmp_path), remote.keep_policy(3, None), saving=lambda: False)
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step, files=2)
    mirror.submit(2)
    mirror.submit(4)
    mirror.submit(6)
    release.set()
    mirror.close()
    out = capsys.readouterr().out
    assert out.count("uploads fall behind the saves") == 1 and "checkpoint.remote_bandwidth" in out
    assert "iter_4 was saved while iter_2 is still uploading" in out
    assert mirror.uploaded == [2, 4, 6]


@pytest.mark.parametrize("value", ["0", "-3", "true"])
def test_a_bad_bandwidth_cap_is_a_one_line_config_error(tiny_run, tmp_path, value):
    with pytest.raises(ConfigError, match=r"^checkpoint\.remote_bandwidth=") as e:
        tiny_run("checkpoint.save=true", f"checkpoint.save_path={tmp_path / 'ck'}", "checkpoint.remote=s3://bucket/run",
                 f"checkpoint.remote_bandwidth={value}")
    assert "\n" not in str(e.value)


def test_a_bandwidth_cap_without_a_remote_is_a_config_error(tiny_run, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.remote_bandwidth caps the upload to checkpoint\.remote"):
        tiny_run("checkpoint.save=true", f"checkpoint.save_path={tmp_path / 'ck'}", "checkpoint.remote_bandwidth=10")


@pytest.mark.parametrize("value", ["bucket/run1", "gs://bucket/run1", "s3://", "s3://Bucket_1/run",
                                   "s3://ab/run", "s3://bucket//run", "s3://bucket/a/../b", 7])
def test_a_remote_url_that_does_not_parse_is_a_one_line_config_error(tiny_run, tmp_path, value):
    with pytest.raises(ConfigError, match=r"^checkpoint\.remote=") as e:
        tiny_run("checkpoint.save=true", f"checkpoint.save_path={tmp_path / 'ck'}", f"checkpoint.remote={value}")
    assert "\n" not in str(e.value)


def test_a_remote_without_save_is_a_config_error(tiny_run):
    with pytest.raises(ConfigError, match=r"checkpoint\.remote mirrors checkpoint\.save_path: set checkpoint\.save"):
        tiny_run("checkpoint.remote=s3://bucket/run1")


def refuse(monkeypatch, tmp_path: Path, *overrides: str) -> str:
    """train_jax.train's ConfigError for this run, checked to come before anything is built."""
    def built(*_, **__):
        raise AssertionError("the run was built before the remote was checked")

    monkeypatch.setattr(train_jax, "run_training", built)
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(*RUN, f"checkpoint.save_path={tmp_path / 'ck'}", *overrides)
    with pytest.raises(ConfigError) as e:
        train_jax.train(cfg, str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and message.startswith("checkpoint.remote=")
    return message


def no_aws(monkeypatch) -> None:
    """No credentials or endpoint from this machine's environment or files, no instance-metadata probe."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)


def test_missing_credentials_are_one_line_before_training(monkeypatch, tmp_path):
    no_aws(monkeypatch)
    message = refuse(monkeypatch, tmp_path, "checkpoint.remote=s3://bucket/run1")
    assert "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message


def test_an_unreachable_endpoint_is_one_line_before_training(monkeypatch, tmp_path):
    import socket

    no_aws(monkeypatch)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "some-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "some-secret")
    message = refuse(monkeypatch, tmp_path, "checkpoint.remote=s3://bucket/run1")
    assert "cannot reach the S3 endpoint" in message and "AWS_ENDPOINT_URL" in message
    assert str(port) not in message and "some-secret" not in message


def test_refused_credentials_are_one_line_before_training(s3_env, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    message = refuse(monkeypatch, tmp_path, f"checkpoint.remote=s3://{BUCKET}/tests/refused")
    assert "refused these credentials" in message and "not-the-secret" not in message


def test_a_missing_bucket_is_one_line_before_training(s3_env, monkeypatch, tmp_path):
    message = refuse(monkeypatch, tmp_path, "checkpoint.remote=s3://no-such-bucket/run1")
    assert "the bucket 'no-such-bucket' does not exist" in message


def test_a_new_run_refuses_a_prefix_that_holds_checkpoints(s3_env, monkeypatch, tmp_path):
    fake_checkpoint(tmp_path / "elsewhere", 3)
    mirror = remote.Mirror(url("used"), str(tmp_path / "elsewhere"), remote.keep_policy(3, None), lambda: False)
    mirror.close()  # the local iter_3 went up at start
    message = refuse(monkeypatch, tmp_path, f"checkpoint.remote=s3://{BUCKET}/tests/used")
    assert "already holds checkpoints" in message and "checkpoint.resume=auto" in message



def test_an_incomplete_remote_checkpoint_never_saved_again_is_pruned(s3_env, tmp_path):
    """A killed upload left iter_3 and iter_9 without markers (iter_9 newer than anything this run
    has: another machine's); this run only ever saves iter_5. Neither step is uploaded again, so no
    upload clears them: the prune after iter_5's upload does, and only iter_5 stays."""
    client, u = s3_env.client(), url("orphans")
    for step in (3, 9):
        client.put_object(Bucket=BUCKET, Key=u.key(f"{STEP_PREFIX}_{step}", "model", "part1"), Body=b"half")
    assert sorted(remote_state(s3_env, "orphans")[0]) == [3, 9] and remote_state(s3_env, "orphans")[1] == []
    mirror = remote.Mirror(u, str(tmp_path), remote.keep_policy(3, None), saving=lambda: False)
    fake_checkpoint(tmp_path, 5)
    mirror.submit(5)
    mirror.close()
    assert mirror.uploaded == [5] and mirror.failed == []
    listed, done = remote_state(s3_env, "orphans")
    assert done == [5] and sorted(listed) == [5]
