"""Every file of a checkpoint, hashed when it is written and checked before it is read.

When orbax has written every file of `iter_N` (its commit files included) and before the directory
is renamed to `iter_N`, `seal` records each file's size and sha256 in the manifest
(`manifest/manifest.json`, entry "files": {path inside iter_N: {"bytes": n, "sha256": hex}}) and the
manifest's own sha256 beside it, in `manifest/manifest.json.sha256` (`sha256sum -c` reads it). The
hook is `SealingRename`, orbax's atomic-rename commit with the hashing put before the rename (orbax
runs the commit in its background thread for an async save, after every process has written its
files): a directory named `iter_N` is complete and sealed, a kill mid-hash leaves a tmp directory.

`verify` (open_checkpoint: a resume, a load, export and sampling; remote.pull after a download)
checks the manifest against its digest, then that exactly the listed files are there with their
sizes, then their hashes, and raises a one-line CheckpointError naming the first file that is
missing, extra, truncated or changed, before any array is read. A checkpoint written before this
(a manifest without "files" and no digest) loads with a one-line note that it is unverified.

Hashing streams 1 MiB chunks (hashlib releases the GIL, so training steps go on beside an async
save's). Cost: docs/performance.md#checkpoint-cost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
from typing import Callable, Iterable

from orbax.checkpoint._src.path import atomicity

from utils.errors import CheckpointError

ALGORITHM = "sha256"
FILES_KEY = "files"  # the manifest's entry: {path inside iter_N: {"bytes": n, "sha256": hex}}
MANIFEST = "manifest/manifest.json"
DIGEST = MANIFEST + "." + ALGORITHM  # "<hex>  manifest.json\n", as sha256sum writes it
CHUNK = 1 << 20
WORKERS = min(4, os.cpu_count() or 1)  # files hashed at once
SEALING = "-sealing"  # iter_N{TMP_MARKER}-sealing: orbax's files are final, the hashes are being written


def file_digest(path: str) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of the file at `path`, read in CHUNK-sized pieces into one buffer."""
    h = hashlib.new(ALGORITHM)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _digests(root: str, rels: Iterable[str]) -> dict[str, tuple[int, str]]:
    """{rel: file_digest(root/rel)}, WORKERS files at a time (hashlib releases the GIL: the threads
    hash in parallel), the largest first so that one big array file does not start last."""
    paths = {rel: os.path.join(root, *rel.split("/")) for rel in rels}
    order = sorted(paths, key=lambda rel: -os.path.getsize(paths[rel]))
    with concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="eqtrain checkpoint hash") as pool:
        return dict(zip(order, pool.map(lambda rel: file_digest(paths[rel]), order)))


def _files(root: str) -> list[str]:
    """Every file under `root` as a '/'-separated path relative to it, sorted; the manifest and its digest left out."""
    out = []
    for directory, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
            if rel not in (MANIFEST, DIGEST):
                out.append(rel)
    return sorted(out)


def _write(path: str, data: bytes) -> None:
    """`path` replaced by `data` whole (a tmp file beside it, flushed to disk, renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def seal(root: str) -> None:
    """Record the size and sha256 of every file under `root` (a checkpoint whose files are final) in
    its manifest, then the manifest's own sha256 beside it."""
    digests = sorted(_digests(root, _files(root)).items())
    files = {rel: {"bytes": size, ALGORITHM: digest} for rel, (size, digest) in digests}
    path = os.path.join(root, *MANIFEST.split("/"))
    with open(path) as f:
        manifest = json.load(f)
    manifest[FILES_KEY] = files
    data = json.dumps(manifest, indent=1).encode()
    _write(path, data)
    _write(os.path.join(root, *DIGEST.split("/")),
           f"{hashlib.new(ALGORITHM, data).hexdigest()}  {os.path.basename(MANIFEST)}\n".encode())


def verify(root: str, skip: Iterable[str] = (), where: Callable[[str], str] | None = None,
           fix: str | None = None) -> bool:
    """Check `root` (a checkpoint directory) against its manifest: True when every file is there with
    the size and sha256 it was written with; False for a checkpoint written before the hashes (its
    manifest lists none and it has no digest). Files under the top-level directories in `skip` (items
    the caller will not read, e.g. opt_state for an export) are checked for presence and size only.
    Anything else: a one-line CheckpointError naming the file (`where(rel)`, default root/rel) and
    ending with `fix`, what to do about it."""
    where = where or (lambda rel: os.path.join(root, *rel.split("/")))
    fix = fix or f"move {root} aside (resume=auto then takes the checkpoint before it) or load another one"
    manifest_file, digest_file = (os.path.join(root, *p.split("/")) for p in (MANIFEST, DIGEST))
    try:
        with open(manifest_file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{where(MANIFEST)} is missing: the checkpoint is incomplete; {fix}") from None
    try:
        with open(digest_file, "rb") as f:
            recorded = f.read().split(maxsplit=1)[:1]
    except FileNotFoundError:
        recorded = None
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    listed = manifest.get(FILES_KEY) if isinstance(manifest, dict) else None
    if recorded is None:
        if listed is None:
            return False  # written before the hashes: the caller says it loads unverified
        raise CheckpointError(f"{where(DIGEST)} is missing (the manifest lists file hashes, so it was written): "
                              f"the checkpoint is incomplete; {fix}")
    if recorded != [hashlib.new(ALGORITHM, data).hexdigest().encode()]:
        raise CheckpointError(f"{where(MANIFEST)} does not match the {ALGORITHM} in {os.path.basename(DIGEST)} beside "
                              f"it: the manifest (or that file) was edited or is corrupt; {fix}")
    if not isinstance(listed, dict) or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int)
                                               and isinstance(e.get(ALGORITHM), str) for e in listed.values()):
        raise CheckpointError(f"{where(MANIFEST)} has no {FILES_KEY!r} entry of sizes and {ALGORITHM} hashes although "
                              f"its digest matches: it was not written by eqtrain's save; {fix}")
    for rel in listed:
        if rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise CheckpointError(f"{where(MANIFEST)} lists {rel!r}, a path outside the checkpoint: {fix}")
    present = set(_files(root))
    missing = sorted(set(listed) - present)
    if missing:
        more = f"; {len(missing) - 1} more listed files are missing too" if len(missing) > 1 else ""
        raise CheckpointError(f"{where(missing[0])} is missing (the manifest lists it, "
                              f"{listed[missing[0]]['bytes']} bytes){more}: the checkpoint is incomplete; {fix}")
    extra = sorted(present - set(listed))
    if extra:
        more = f"; {len(extra) - 1} more unlisted files too" if len(extra) > 1 else ""
        raise CheckpointError(f"{where(extra[0])} is not in the checkpoint's manifest (a file added after the save)"
                              f"{more}: delete it, or {fix}")
    for rel, entry in listed.items():
        size = os.path.getsize(os.path.join(root, *rel.split("/")))
        if size != entry["bytes"]:
            raise CheckpointError(f"{where(rel)} has {size} bytes, the manifest says {entry['bytes']} "
                                  f"(truncated or overwritten): the checkpoint is corrupt; {fix}")
    skipped = tuple(f"{item}/" for item in skip)
    try:
        read = _digests(root, [rel for rel in listed if not rel.startswith(skipped)])
    except OSError as e:  # unreadable (permissions, an I/O error): named, not an "error: cannot write"
        rel = os.path.relpath(e.filename, root).replace(os.sep, "/") if e.filename else MANIFEST
        raise CheckpointError(f"cannot read {where(rel)} ({e.strerror or type(e).__name__}): fix its permissions "
                              f"or {fix}") from None
    for rel, (size, digest) in sorted(read.items()):
        entry = listed[rel]
        if size != entry["bytes"] or digest != entry[ALGORITHM]:
            raise CheckpointError(f"{where(rel)} does not match its {ALGORITHM} in the manifest (its bytes changed "
                                  f"since the save): the checkpoint is corrupt; {fix}")
    return True


class SealingRename(atomicity.AtomicRenameTemporaryPath):
    """orbax's atomic-rename commit, sealed: a step directory (iter_N) is renamed by orbax to
    iter_N{TMP_MARKER}-sealing (its commit files written), hashed there (`seal`), and only then
    renamed to iter_N. Items' directories (model/, ...) commit as orbax commits them."""

    async def finalize(self):
        from utils.checkpoint.storage import parse_step  # here: storage imports this module

        final = self.get_final()
        if parse_step(final.name) is None:
            return await super().finalize()
        sealing = final.parent / (self.get().name + SEALING)
        self._final_path = sealing  # orbax's last step renames tmp to _final_path: here, to `sealing`
        try:
            await super().finalize()
        finally:
            self._final_path = final
        if not os.path.isdir(sealing):  # an orbax whose commit no longer renames to _final_path
            raise RuntimeError(f"orbax did not commit {final} through {sealing}: eqtrain's checkpoint sealing "
                               "(utils/checkpoint/integrity.py) needs updating for this orbax version")
        await asyncio.to_thread(seal, os.fspath(sealing))
        await asyncio.to_thread(os.rename, sealing, final)
