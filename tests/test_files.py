"""utils/files.py: a file written through atomic_write is whole or absent, never half, and has
the permissions `open` would give it; user paths become absolute."""

from __future__ import annotations

import os
import stat

import pytest

from utils.files import atomic_write, user_path


class Boom(Exception):
    pass


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_failing_writer_leaves_neither_the_tmp_nor_the_target(tmp_path):
    target = tmp_path / "sub" / "cache.bin"
    with pytest.raises(Boom):
        with atomic_write(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise Boom
    assert os.listdir(tmp_path / "sub") == []


def test_an_existing_target_survives_a_failed_rewrite(tmp_path):
    target = tmp_path / "cache.bin"
    target.write_bytes(b"whole")
    with pytest.raises(Boom):
        with atomic_write(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise Boom
    assert target.read_bytes() == b"whole" and os.listdir(tmp_path) == ["cache.bin"]


def test_success_replaces_the_target_with_umask_normal_permissions(tmp_path, umask_022):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with atomic_write(str(target)) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp != str(target)  # beside it: the rename is atomic
        with open(tmp, "wb") as f:
            f.write(b"new")
        os.chmod(tmp, 0o600)  # what the safetensors writer (and mkstemp) leave
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.bin"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_an_explicit_mode_is_applied(tmp_path, umask_022):
    target = tmp_path / "private"
    with atomic_write(str(target), mode=0o600) as tmp:
        open(tmp, "w").close()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_user_path_is_absolute_and_expands_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_path("ck/run1") == str(tmp_path / "ck" / "run1")
    assert user_path("~/ck") == str(tmp_path / "home" / "ck")
    assert user_path(None) is None
