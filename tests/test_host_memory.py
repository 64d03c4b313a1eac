"""utils/host_memory.py: when glibc's huge-page tunable is set, and that `python train_jax.py` re-executes
itself with it, once, in the same process, before its other work (the flag is read only at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils import host_memory as hm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env, libc, mode, expected", [
    ({}, (2, 35), "madvise", True),
    ({}, (2, 39), "always", True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 36), "madvise", True),  # the user's own tunables kept
    ({}, (2, 34), "madvise", False),  # glibc before the tunable existed
    ({}, None, "madvise", False),  # musl, macOS: not glibc
    ({}, (2, 36), "never", False),  # the kernel's transparent huge pages off
    ({}, (2, 36), None, False),  # no /sys to read
    ({hm.OPT_OUT: "0"}, (2, 36), "madvise", False),  # the user's opt-out
    ({hm.OPT_OUT: "1"}, (2, 36), "madvise", True),
    ({"GLIBC_TUNABLES": f"x=1:{hm.TUNABLE}"}, (2, 36), "madvise", False),  # already set: never loop
])
def test_wanted(env, libc, mode, expected):
    assert hm.wanted(env, libc, mode) is expected


def test_tunables_keep_the_users_own():
    assert hm.tunables_with_huge_pages("") == hm.TUNABLE
    assert hm.tunables_with_huge_pages("glibc.malloc.arena_max=2") == f"glibc.malloc.arena_max=2:{hm.TUNABLE}"


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hm.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hm.thp_mode(str(f)) == "always"
    assert hm.thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["train_jax.py", "a=1"], ["python", "train_jax.py", "a=1"], True),
    (["train_jax.py"], ["python", "train_jax.py"], True),
    (["train_jax.py", "a=1"], ["python", "-X", "importtime", "train_jax.py", "a=1"], True),  # interpreter options
    ([str(ROOT / "train_jax.py"), "a=1"], ["python", "-m", "train_jax", "a=1"], True),
    (["train_jax.py", "a=1"], ["python", "-m", "ipykernel_launcher", "-f", "k.json"], False),  # IPython's %run
    (["wrapper.py", "a=1"], ["python", "wrapper.py", "a=1"], False),  # runpy.run_path from a wrapper
    (["train_jax.py", "a=1"], ["python", "train_jax.py", "a=2"], False),  # arguments changed since the start
    ([str(ROOT / "train_jax.py")], ["python", "-m", "other"], False),
])
def test_started_as(monkeypatch, argv, orig_argv, expected):
    monkeypatch.chdir(ROOT)
    assert hm.started_as(str(ROOT / "train_jax.py"), argv, orig_argv) is expected


def _starts(tmp_path, env_extra: dict, command: tuple[str, ...] = ("train_jax.py", "--help")) -> list[tuple[str, str]]:
    """`python train_jax.py --help` (or `command`) with a sitecustomize that records (pid,
    GLIBC_TUNABLES) at each interpreter start: a re-execution shows as a second start with the same pid."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    log = tmp_path / "starts.txt"
    log.unlink(missing_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(f\"{os.getpid()} {os.environ.get('GLIBC_TUNABLES', '-')}\\n\")\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hm.OPT_OUT)}
    env.update(env_extra, PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    out = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train_jax" in out.stdout  # Hydra's help ran, once, in the re-executed process
    assert out.stdout.count("== Config ==") <= 1
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()]


CAN_USE = pytest.mark.skipif(not hm.wanted({}, hm.glibc_version(), hm.thp_mode()),
                             reason="this machine's glibc (< 2.35 or not glibc) or kernel (huge pages `never`) cannot")


@CAN_USE
@pytest.mark.parametrize("command", [("train_jax.py", "--help"), ("-m", "train_jax", "--help")])
def test_train_jax_reexecutes_once_with_the_tunable(tmp_path, command):
    starts = _starts(tmp_path, {}, command)
    assert len(starts) == 2, starts
    (pid1, tunables1), (pid2, tunables2) = starts
    assert pid1 == pid2  # os.execv: the same process (SLURM and signals see one PID)
    assert hm.TUNABLE not in tunables1 and hm.TUNABLE in tunables2.split(":")


def test_opt_out_never_reexecutes(tmp_path):
    starts = _starts(tmp_path, {hm.OPT_OUT: "0"})
    assert len(starts) == 1 and hm.TUNABLE not in starts[0][1]


@CAN_USE
def test_run_inside_another_program_never_reexecutes(tmp_path):
    """runpy (as IPython's %run does) runs train_jax.py as __main__ inside a program of its own:
    re-executing that program's command line would restart it (a notebook kernel, with its state)."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(f"import runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                       f"runpy.run_path({str(ROOT / 'train_jax.py')!r}, run_name='__main__')\n")
    starts = _starts(tmp_path, {}, (str(wrapper), "--help"))
    assert len(starts) == 1 and hm.TUNABLE not in starts[0][1], starts
