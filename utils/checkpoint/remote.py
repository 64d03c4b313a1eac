"""Checkpoints mirrored to S3-compatible storage: `checkpoint.remote=s3://bucket/prefix`.

orbax keeps writing `checkpoint.save_path` on local disk (atomic by rename, and fast), and each
checkpoint it completes is copied up in the background with boto3. Not orbax writing to S3
directly: its commit is a directory rename, which S3 does not have, and a training step must
never wait on the network. Remote layout:

    s3://bucket/prefix/iter_{N}/...                  every file of save_path/iter_N, same relative paths
    s3://bucket/prefix/iter_{N}/MIRROR_COMPLETE.json  written last: the files and their sizes
    s3://bucket/prefix/best/iter_{N}/...             checkpoint.keep_best's checkpoint, the same way

A remote checkpoint is complete if and only if its marker exists: an upload killed halfway leaves
objects without one, which are never pulled and are cleared by the next upload or prune.

- `prepare` (from resume_source, before anything is built): the URL's credentials, endpoint and
  bucket are checked (one-line ConfigError each); a new run refuses a prefix that already holds
  checkpoints; resume=auto pulls the newest complete remote checkpoint when it is newer than
  save_path's newest (on a fresh machine: an empty save_path), checks each file's size against the
  marker and the whole checkpoint against its manifest's hashes (utils/checkpoint/integrity.py),
  then resumes from it as usual.
- `Mirror` (the Checkpointer's, on process 0): a watcher thread waits until each submitted save
  is complete (orbax has renamed it to iter_N) and hard-links its files into
  save_path/.remote-staging/iter_N, so a local max_to_keep deletion cannot cut an upload short;
  an uploader thread (at nice 10: training keeps the cores) uploads them, the marker last, then
  prunes the remote copies by the local policy (the max_to_keep newest, list save_steps kept;
  best/: the newest). `close` waits for pending uploads and prints their progress.

Credentials and the endpoint come from boto3's standard chain (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3, ...) and are never
written to logs, configs or manifests: only the s3:// URL is.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax

from utils.checkpoint import integrity
from utils.checkpoint.storage import STEP_PREFIX, TMP_MARKER, CheckpointConfig, complete_steps, step_path
from utils.errors import CheckpointError, ConfigError
from utils.logging.messages import say, warn

KNOB = "checkpoint.remote"
MARKER = "MIRROR_COMPLETE.json"
STAGING = ".remote-staging"  # in save_path; orbax and complete_steps see no iter_N in it
BEST = "best"
POLL_S = 0.1  # how often the watcher looks for a save's rename
PROGRESS_S = 10.0  # how often close() reports uploads still going
NICE = 10  # the uploader's threads yield the cores to training's
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_STEP_DIR = re.compile(rf"{STEP_PREFIX}_(\d+)")


@dataclass(frozen=True)
class RemoteURL:
    bucket: str
    prefix: str  # without leading or trailing '/'; '' is the bucket's root

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, name: str) -> "RemoteURL":
        return RemoteURL(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_url(url: Any) -> RemoteURL:
    """`s3://bucket[/prefix]` -> RemoteURL; anything else a one-line ConfigError naming the knob."""
    m = re.fullmatch(r"s3://([^/]+)(?:/(.*))?", url) if isinstance(url, str) else None
    if m is None:
        raise ConfigError(f"{KNOB}={url!r} is not an S3 URL: write s3://bucket/prefix (the endpoint comes from "
                          "AWS_ENDPOINT_URL for S3-compatible servers)")
    bucket, prefix = m.group(1), (m.group(2) or "").rstrip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"{KNOB}={url}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.', '-')")
    if prefix and (any(p in ("", ".", "..") for p in prefix.split("/")) or not prefix.isprintable()):
        raise ConfigError(f"{KNOB}={url}: the prefix {prefix!r} has an empty, '.' or '..' part or an unprintable "
                          "character")
    return RemoteURL(bucket, prefix)


# ----------------------------------------------------------------------------- the client


def connect(url: RemoteURL):
    """A boto3 S3 client for `url`, checked: credentials found, endpoint reachable, bucket there
    and listable. A one-line ConfigError otherwise (boto3 is imported here: only runs that mirror
    pay its import)."""
    import boto3
    import botocore.config
    from botocore import exceptions as bx

    where = f"{KNOB}={url}"
    try:
        session = boto3.session.Session()
        credentials = session.get_credentials()
    except bx.BotoCoreError as e:  # a profile that does not exist, a malformed config file
        raise ConfigError(f"{where}: the AWS configuration is unusable ({type(e).__name__}): check AWS_PROFILE and "
                          "the AWS config files") from None
    if credentials is None:
        raise ConfigError(f"{where}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(or AWS_PROFILE)")
    # Checksums only where the API requires them: botocore's default CRC32 on every upload costs
    # CPU the training steps share, and some S3-compatible servers refuse its trailing headers;
    # SigV4 (over http) or TLS already guards the bytes, and pull() checks every file's size and sha256.
    config = botocore.config.Config(connect_timeout=10, read_timeout=120,
                                    retries={"max_attempts": 4, "mode": "standard"},
                                    request_checksum_calculation="when_required",
                                    response_checksum_validation="when_required")
    client = session.client("s3", config=config)
    try:
        client.head_bucket(Bucket=url.bucket)
        client.list_objects_v2(Bucket=url.bucket, Prefix=url.key(), MaxKeys=1)
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError) as e:
        raise ConfigError(f"{where}: cannot reach the S3 endpoint ({type(e).__name__}): check AWS_ENDPOINT_URL "
                          "(or the profile's endpoint_url) and that the server is up") from None
    except bx.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", "?"))
        if code in ("404", "NoSuchBucket"):
            raise ConfigError(f"{where}: the bucket {url.bucket!r} does not exist on the S3 server: "
                              "create it") from None
        if code in ("401", "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ConfigError(f"{where}: the S3 server refused these credentials for bucket {url.bucket!r} ({code}): "
                              "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and their "
                              "permissions") from None
        raise ConfigError(f"{where}: the S3 server answered {code} to a listing of the bucket") from None
    except bx.BotoCoreError as e:  # the message may name the endpoint: only its type is shown
        raise ConfigError(f"{where}: cannot use the S3 endpoint ({type(e).__name__}): check AWS_ENDPOINT_URL and "
                          "the credentials") from None
    return client


def listing(client, url: RemoteURL) -> dict[int, dict[str, int]]:
    """{step: {path inside iter_N/: size}} of every iter_N/ under `url` (complete or not)."""
    base = url.key() + "/" if url.prefix else ""
    out: dict[int, dict[str, int]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=base):
        for obj in page.get("Contents", []):
            top, _, rest = obj["Key"][len(base):].partition("/")
            m = _STEP_DIR.fullmatch(top)
            if m and rest:
                out.setdefault(int(m.group(1)), {})[rest] = obj["Size"]
    return out


def complete(listed: dict[int, dict[str, int]]) -> list[int]:
    """The steps of a listing whose marker exists, oldest first."""
    return sorted(step for step, files in listed.items() if MARKER in files)


def delete(client, url: RemoteURL, step: int, files) -> None:
    """Remove iter_{step}/ under `url`: the marker first, so it is never complete with files missing."""
    keys = [url.key(f"{STEP_PREFIX}_{step}", rel) for rel in files if rel != MARKER]
    if MARKER in files:
        client.delete_object(Bucket=url.bucket, Key=url.key(f"{STEP_PREFIX}_{step}", MARKER))
    for i in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys at most
        client.delete_objects(Bucket=url.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                         "Quiet": True})


# ----------------------------------------------------------------------------- before a run


def prepare(cfg: CheckpointConfig) -> None:
    """Before anything is built, on every process: check the remote (ConfigError), refuse a new run
    on a prefix that holds checkpoints, and with resume=auto pull the newest complete remote
    checkpoint (and best/'s) into save_path when it is newer than what save_path holds. Process 0
    downloads (save_path is shared, as orbax needs); the others wait for it."""
    url = parse_url(cfg.remote)
    client = connect(url)
    targets = [(url, cfg.save_path)] + ([(url.child(BEST), os.path.join(cfg.save_path, BEST))] if cfg.keep_best else [])
    listed = {u: listing(client, u) for u, _ in targets}
    if cfg.resume != "auto":
        held = [f"{u}/{STEP_PREFIX}_{s}" for u, steps in listed.items() for s in sorted(steps)]
        if held:
            raise ConfigError(f"{KNOB}={url} already holds checkpoints ({', '.join(held[:3])}"
                              f"{', ...' if len(held) > 3 else ''}): pass checkpoint.resume=auto to continue that "
                              f"run, or choose another {KNOB} prefix")
    elif jax.process_index() == 0:
        for u, directory in targets:
            remote, local = complete(listed[u]), complete_steps(directory)
            if remote and (not local or remote[-1] > local[-1]):
                pull(client, u, remote[-1], directory)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("eqtrain checkpoint.remote pull")


def pull(client, url: RemoteURL, step: int, directory: str) -> str:
    """Download the complete remote iter_{step} into directory/iter_{step}: into a tmp directory
    (a killed download is removed like a killed save), each file checked against the marker's
    size, then the whole checkpoint against its manifest's hashes (integrity.verify), renamed once
    whole. Returns the local path."""
    name = f"{STEP_PREFIX}_{step}"
    began = time.perf_counter()
    marker = json.loads(client.get_object(Bucket=url.bucket, Key=url.key(name, MARKER))["Body"].read())
    files: dict[str, int] = marker["files"]
    final = step_path(directory, step)
    tmp = final + TMP_MARKER
    say(f"checkpoint.remote: pulling {url}/{name} ({len(files)} files, {sum(files.values()) / 1e6:.1f} MB) "
        f"into {directory}")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, size in sorted(files.items()):
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CheckpointError(f"{url}/{name}/{MARKER} lists {rel!r}, a path outside the checkpoint: it is corrupt")
        path = os.path.join(tmp, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            client.download_file(url.bucket, url.key(name, rel), path)
        except Exception as e:  # noqa: BLE001 - botocore/s3transfer raise many types; the user needs the object
            raise CheckpointError(f"cannot pull {url}/{name}/{rel} ({type(e).__name__}): the remote checkpoint is "
                                  "incomplete or unreachable; delete it to resume from the one before") from None
        if os.path.getsize(path) != size:
            raise CheckpointError(f"{url}/{name}/{rel} has {os.path.getsize(path)} bytes, its marker says {size}: "
                                  "the remote checkpoint is corrupt; delete it to resume from the one before")
    # The sizes match the marker's; the bytes must match the checkpoint's own hashes (a remote object can
    # rot or be overwritten with the same size): checked before the pull is renamed to iter_N.
    integrity.verify(tmp, where=lambda rel: f"{url}/{name}/{rel}",
                     fix=f"delete {url}/{name} to resume from the one before")
    os.makedirs(directory, exist_ok=True)
    os.rename(tmp, final)
    say(f"checkpoint.remote: pulled {url}/{name} in {time.perf_counter() - began:.1f} s")
    return final


# ----------------------------------------------------------------------------- during a run


def keep_policy(max_to_keep: int | None, pinned: tuple[int, ...] | None) -> Callable[[list[int]], set[int]]:
    """The local preservation policy over a sorted step list: the max_to_keep newest (all if None),
    and every list-pinned step (orbax's LatestN + CustomSteps in storage._manager)."""

    def keep(steps: list[int]) -> set[int]:
        newest = steps if max_to_keep is None else steps[len(steps) - max_to_keep:]
        return set(newest) | (set(steps) & set(pinned or ()))

    return keep


def transfer_config(bandwidth_mb: float | None):
    """boto3's transfer settings for the uploads. Uncapped: its defaults (multipart, 10 threads).
    Capped (`checkpoint.remote_bandwidth`): one connection at that rate, so an upload's CPU (the
    client's, and the server's where it shares the machine) is spread over more training steps and
    takes a smaller share of each (docs/performance.md)."""
    from boto3.s3.transfer import TransferConfig

    if bandwidth_mb is None:
        return TransferConfig()
    return TransferConfig(max_concurrency=1, max_bandwidth=int(bandwidth_mb * 1e6))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # Linux: per thread, inherited
    except (AttributeError, OSError):
        pass


class Mirror:
    """Uploads each complete checkpoint of `directory` to `url` in the background, marker last,
    and prunes the remote by `keep`. `saving()` is orbax's "a save is still being written"."""

    def __init__(self, url: RemoteURL, directory: str, keep: Callable[[list[int]], set[int]],
                 saving: Callable[[], bool], client=None, bandwidth_mb: float | None = None):
        self.url, self.directory, self._keep, self._saving = url, directory, keep, saving
        self._transfer = transfer_config(bandwidth_mb)
        self._client = client if client is not None else connect(url)
        self._staging = os.path.join(directory, STAGING)
        shutil.rmtree(self._staging, ignore_errors=True)  # a killed run's snapshots
        self._submitted: queue.Queue = queue.Queue()  # steps saved, maybe still being written
        self._staged: queue.Queue = queue.Queue()  # (step, snapshot dir) ready to upload
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # submitted and not yet uploaded or given up
        self.progress: tuple[int, int, int, int, int] | None = None  # step, files done/all, bytes done/all
        self.uploaded: list[int] = []
        self.failed: list[int] = []
        self._closed = False
        self._live = False  # past the start-up's catch-up uploads: a backlog from now on means uploads lag
        self._lag_warned = False
        self._threads = [threading.Thread(target=self._watch, name="checkpoint.remote watcher", daemon=True),
                         threading.Thread(target=self._upload_all, name="checkpoint.remote uploader", daemon=True)]
        for t in self._threads:
            t.start()
        # A resumed run: kept local checkpoints the remote lacks (an upload killed with its run) go up first.
        remote = listing(self._client, url)
        for step in sorted(keep(complete_steps(directory))):
            if MARKER not in remote.get(step, {}):
                self.submit(step)
        self._live = True

    @classmethod
    def of(cls, cfg: CheckpointConfig, saving: Callable[[], bool], best: bool = False) -> "Mirror | None":
        """The Checkpointer's mirror of save_path (or of save_path/best), on process 0; None elsewhere."""
        if not cfg.remote or jax.process_index() != 0:
            return None
        url = parse_url(cfg.remote)
        if best:
            return cls(url.child(BEST), os.path.join(cfg.save_path, BEST), keep_policy(1, None), saving,
                       bandwidth_mb=cfg.remote_bandwidth)
        return cls(url, cfg.save_path, keep_policy(cfg.max_to_keep, cfg.save_at), saving,
                   bandwidth_mb=cfg.remote_bandwidth)

    def submit(self, step: int) -> None:
        """A save of `step` has started (or finished): upload it once orbax has completed it."""
        with self._lock:
            if step in self._pending:
                return
            behind = sorted(self._pending) if self._live else []
            self._pending.add(step)
        if behind and not self._lag_warned:  # once per run: the saves outpace the uploads
            self._lag_warned = True
            warn(f"checkpoint.remote: {STEP_PREFIX}_{step} was saved while {STEP_PREFIX}_{behind[0]} is still "
                 f"uploading to {self.url}: uploads fall behind the saves; raise checkpoint.remote_bandwidth "
                 "(or set it to null) or save less often")
        self._submitted.put(step)

    def busy(self) -> bool:
        """Whether a submitted checkpoint is not uploaded (or given up) yet."""
        with self._lock:
            return bool(self._pending)

    def _finish(self, step: int, failed: bool, why: str = "") -> None:
        if failed:
            self.failed.append(step)
            warn(f"checkpoint.remote: {STEP_PREFIX}_{step} was not uploaded ({why}); it is only in {self.directory}")
        else:
            self.uploaded.append(step)
        with self._lock:
            self._pending.discard(step)

    # -- the watcher: waits for orbax's rename, snapshots by hard links

    def _watch(self) -> None:
        while (step := self._submitted.get()) is not None:
            path = step_path(self.directory, step)
            while not os.path.isdir(path) and self._saving():
                time.sleep(POLL_S)
            if not os.path.isdir(path):  # the save failed; orbax reports that to the run
                self._finish(step, True, "its local save did not complete")
                continue
            snapshot = os.path.join(self._staging, os.path.basename(path))
            try:
                shutil.rmtree(snapshot, ignore_errors=True)
                shutil.copytree(path, snapshot, copy_function=_link_or_copy)
            except (OSError, shutil.Error) as e:
                self._finish(step, True, f"cannot snapshot it: {type(e).__name__}")
                continue
            self._staged.put((step, snapshot))
        self._staged.put(None)

    # -- the uploader: files, then the marker, then the prune

    def _upload_all(self) -> None:
        _lower_priority()
        while (item := self._staged.get()) is not None:
            step, snapshot = item
            try:
                self._upload(step, snapshot)
                self._prune()
            except Exception as e:  # noqa: BLE001 - a failed upload must not stop training: reported, the next one tried
                self._finish(step, True, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            else:
                self._finish(step, False)
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

    def _upload(self, step: int, snapshot: str) -> None:
        name = f"{STEP_PREFIX}_{step}"
        began = time.perf_counter()
        stale = listing(self._client, self.url).get(step)
        if stale:  # a killed upload's objects (or an older copy): never mixed with this one's
            delete(self._client, self.url, step, stale)
        files = {}
        for root, _, names in os.walk(snapshot):
            for n in names:
                path = os.path.join(root, n)
                files[os.path.relpath(path, snapshot).replace(os.sep, "/")] = os.path.getsize(path)
        total, done = sum(files.values()), 0
        for i, rel in enumerate(sorted(files)):
            self.progress = (step, i, len(files), done, total)
            self._put_file(os.path.join(snapshot, *rel.split("/")), self.url.key(name, rel))
            done += files[rel]
        marker = {"step": step, "files": files, "bytes": total,
                  "uploaded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self._put_marker(json.dumps(marker, indent=1).encode(), self.url.key(name, MARKER))
        self.progress = None
        say(f"checkpoint.remote: uploaded {self.url}/{name} ({total / 1e6:.1f} MB in "
            f"{time.perf_counter() - began:.1f} s)")

    def _put_file(self, path: str, key: str) -> None:
        """One file up (multipart for large ones); a seam the tests spy on, as is _put_marker."""
        self._client.upload_file(path, self.url.bucket, key, Config=self._transfer)

    def _put_marker(self, body: bytes, key: str) -> None:
        self._client.put_object(Bucket=self.url.bucket, Key=key, Body=body)

    def _prune(self) -> None:
        """Remote checkpoints the policy does not keep, and incomplete ones no upload is writing, go."""
        listed = listing(self._client, self.url)
        kept = self._keep(complete(listed))
        with self._lock:
            pending = set(self._pending)
        for step in sorted(set(listed) - kept - pending):
            delete(self._client, self.url, step, listed[step])

    # -- the end

    def close(self) -> None:
        """Wait for every submitted upload, saying what is still going every PROGRESS_S seconds."""
        if self._closed:
            return
        self._closed = True
        self._submitted.put(None)
        began, last = time.perf_counter(), None
        while any(t.is_alive() for t in self._threads):
            now = time.perf_counter()
            if last is None or now - last >= PROGRESS_S:
                with self._lock:
                    pending = sorted(self._pending)
                if pending:
                    at = self.progress
                    doing = (f" ({STEP_PREFIX}_{at[0]}: {at[1]}/{at[2]} files, {at[3] / 1e6:.1f}/{at[4] / 1e6:.1f} MB)"
                             if at else "")
                    say(f"checkpoint.remote: waiting for {len(pending)} upload(s) to {self.url}"
                        f"{doing}, {now - began:.0f} s so far")
                last = now
            for t in self._threads:
                t.join(timeout=0.2)
        shutil.rmtree(self._staging, ignore_errors=True)
