"""Paths as users type them, and files that are either whole or absent.

Every file eqtrain writes outside orbax (token caches, trained tokenizers, exports, the CPU
peak cache) goes through `atomic_write`: a killed run, or another process writing the same
cache, never leaves half a file under the real name.
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
