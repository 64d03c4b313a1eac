"""Transparent huge pages for the host allocator: why a CPU train step pays ~20% of its time in the kernel.

XLA:CPU packs a step's temporaries (the activations the backward pass reads, ~1.4 GB for
`gpt_bench` at batch 16) into one buffer that it allocates at every execution and frees at the end.
glibc serves an allocation that large with a fresh `mmap` and returns it with `munmap`, so every step
touches ~360,000 new 4 KiB pages: each a page fault and a zeroed page, ~20% of the step's CPU time
(`perf`: `exc_page_fault`, `clear_page_erms`; bench/step_profile.py counts the faults per step).
glibc >= 2.35 can back such mappings with 2 MiB pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`,
which `madvise`s them when the kernel's transparent huge pages are in `madvise` mode): 512x fewer
faults, ~900 per step.

The tunable is read once, when the process starts, so `use_huge_pages()` sets it and re-executes
the same command line (`os.execv`: same PID, same arguments) before anything else runs. It does
nothing where it cannot help (not Linux/glibc >= 2.35, huge pages `never`), when the tunable is
already set, or with `EQTRAIN_HUGE_PAGES=0`; and nothing when the script runs inside another
program (IPython's `%run`, `runpy` from a wrapper): re-executing that program's command line would
restart it, a notebook kernel with all its state.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "EQTRAIN_HUGE_PAGES"  # =0: leave the allocator alone (and never re-execute)
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), None where unknown."""
    try:
        text = open(path).read()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else None


def glibc_version() -> tuple[int, int] | None:
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    major, minor, *_ = (int(p) for p in version.split(".") if p.isdigit())
    return major, minor


def wanted(env: dict | None = None, libc: tuple[int, int] | None = None, mode: str | None = None) -> bool:
    """Whether the tunable would help and is not set yet (pure given its inputs: tests pass them)."""
    env = os.environ if env is None else env
    if env.get(OPT_OUT, "1") == "0" or TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    return libc is not None and libc >= (2, 35) and mode in ("always", "madvise")


def tunables_with_huge_pages(current: str) -> str:
    """GLIBC_TUNABLES with ours added to the user's own (colon-separated)."""
    return f"{current}:{TUNABLE}" if current else TUNABLE


def started_as(script: str, argv: list[str], orig_argv: list[str]) -> bool:
    """Whether the interpreter's command line (`orig_argv`) ran `script` itself, as `python script ...`
    or `python -m module ...`, with the arguments the script sees (`argv`): re-executing it then runs
    the script again, and nothing else."""
    n = len(argv) - 1
    if len(orig_argv) < n + 2 or (n and orig_argv[-n:] != argv[1:]):
        return False
    head = orig_argv[: len(orig_argv) - n]
    module = os.path.splitext(os.path.basename(script))[0]
    if len(head) >= 3 and head[-2] == "-m":
        return head[-1] == module
    return os.path.exists(head[-1]) and os.path.samefile(head[-1], script)


def use_huge_pages(script: str) -> None:
    """Re-execute this process with glibc's huge-page tunable, where it helps (module docstring).
    Call it first thing in a script's main, with the script's `__file__`: whatever ran before is run again."""
    if sys.platform != "linux" or not wanted(libc=glibc_version(), mode=thp_mode()):
        return
    if not started_as(script, sys.argv, getattr(sys, "orig_argv", [])):
        return
    os.environ["GLIBC_TUNABLES"] = tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
