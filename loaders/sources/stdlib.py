"""The offline default corpus: one document per .py file of the Python standard library, split on
its path relative to the stdlib root."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import ClassVar

from loaders import corpus
from utils.errors import DataError

_ALWAYS_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})  # idle_test lives at idlelib/idle_test


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(include_tests: bool = False) -> list[str]:
    """Absolute paths of the stdlib's .py files, sorted by relative path: a few MB of real code on every machine."""
    root = stdlib_root()
    skipped = _ALWAYS_SKIPPED_DIRS if include_tests else _ALWAYS_SKIPPED_DIRS | _TEST_DIRS
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped]  # prune: test/ alone is a third of the stdlib
        rel_dir = os.path.relpath(dirpath, root)
        for fname in filenames:
            if fname.endswith(".py"):
                relpaths.append(os.path.normpath(os.path.join(rel_dir, fname)).replace(os.sep, "/"))
    return [os.path.join(root, rel) for rel in sorted(relpaths)]


def _stdlib_keyed(files: list[str]) -> list[tuple[str, str]]:
    root = stdlib_root()
    if not files:
        raise DataError(
            f"no .py files under the Python standard library at {root}: this Python ships without sources; "
            "use dataset=text_files and set dataset.paths to your own text files"
        )
    keyed = [(os.path.relpath(path, root).replace(os.sep, "/"), corpus.read_text(path)) for path in files]
    return [(key, text) for key, text in keyed if text]  # empty __init__.py files would be lone eots


@dataclass(frozen=True)
class Stdlib:
    name: ClassVar[str] = "stdlib"

    val_fraction: float = 0.05  # share of files held out for validation
    include_tests: bool = False  # also the stdlib's test suites (about twice the text)

    def check(self, prefix: str) -> None:
        corpus.check_val_fraction(prefix, self.val_fraction)

    def documents(self) -> tuple[corpus.Documents, corpus.Documents]:
        """(train, val): the files are listed and stat-fingerprinted now, read on first access."""
        files = stdlib_files(self.include_tests)
        return corpus.lazy_splits(
            files,
            (self.name, self.val_fraction, self.include_tests),  # the fingerprint's knobs: keep them as they are
            lambda: _stdlib_keyed(files),
            self.val_fraction,
            f"the standard library at {stdlib_root()}",
        )
