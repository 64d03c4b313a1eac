"""Paths as users type them, and files that are either whole or absent.

Every file eqtrain writes outside orbax (token caches, trained tokenizers, the CPU peak cache)
goes through `atomic_write`: a killed run, or another process writing the same cache, never
leaves half a file under the real name. A directory of files that belong together (an export)
goes through `atomic_dir`: written beside, then renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


def user_path(path: str | None) -> str | None:
    """A path as the user typed it (relative to the working directory, `~` allowed) -> absolute.
    Applied once, at the config boundary: orbax's metadata reader finds nothing under a relative
    path, and every example in the docs uses one (`checkpoint.save_path=ckpt/run1`)."""
    return None if path is None else os.path.abspath(os.path.expanduser(str(path)))


@contextlib.contextmanager
def atomic_write(path: str, mode: int | None = None) -> Iterator[str]:
    """Yields a temporary path beside `path`; when the block ends without an exception the file
    written there is renamed to `path` (atomic on POSIX), otherwise removed.

        with atomic_write(cache) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, tokens)

    The tmp file gets `mode` (default: 0o666 minus the umask, what `open` would give): some
    writers (safetensors) create private 0600 files."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _default_mode(base: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


@contextlib.contextmanager
def atomic_dir(out_dir: str, replaces=lambda name: False) -> Iterator[str]:
    """Yields a scratch directory beside `out_dir`; when the block ends without an exception its
    files become OUT_DIR's, otherwise it is removed and OUT_DIR is as it was: an export never leaves
    half a directory. A missing or empty OUT_DIR is replaced by the scratch directory in one rename;
    into a non-empty one (an export's --force) each file is renamed, and the files already there
    that `replaces(name)` marks (another layout of the same weights) and the new files lack are
    removed first, others kept. Files and the directory get what `open`/`mkdir` would give (some
    writers, and mkdtemp, make private ones)."""
    import shutil

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp")
    try:
        yield scratch
        names = sorted(os.listdir(scratch))
        for name in names:
            if os.path.isfile(os.path.join(scratch, name)):
                os.chmod(os.path.join(scratch, name), _default_mode(0o666))
        os.chmod(scratch, _default_mode(0o777))
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        if not os.path.exists(out_dir):
            os.rename(scratch, out_dir)
            return
        for name in os.listdir(out_dir):
            if replaces(name) and name not in names and os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        for name in names:
            os.replace(os.path.join(scratch, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
