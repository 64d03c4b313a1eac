"""Shared fixtures: an offline, sandboxed environment and tiny validated run configs. Helpers and
constants live in tests/helpers.py; the background runs in the plugin tests/background.py."""

import importlib.util
import os

import pytest
from helpers import compose_config  # before utils: importing helpers sets XLA_FLAGS and OPENBLAS_NUM_THREADS

from utils.config import RunConfig, validate
from utils.versions import describe


def pytest_report_header(config):
    """The versions a run of the suite tested (pyproject.toml's ranges; README "Tested versions")."""
    return f"eqtrain core: {describe()}"


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("eqtrain_cache")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One XLA compilation cache for the session, in-process and for every subprocess run of
    train_jax.py: the tiny test runs compile the same programs again and again, and a cache hit
    halves the suite's time. It starts empty, so no test depends on an earlier session."""
    import jax

    if any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        # A GPU's default float32 matmul rounds its inputs to TF32 (10 bits; 3e-4 relative measured on an
        # H100): the suite's float32 tolerances mean float32, and the GPU tier states its own bf16 bounds.
        jax.config.update("jax_default_matmul_precision", "highest")
    path = str(tmp_path_factory.mktemp("xla_cache"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under xdist (the README's `-n 2`) the workers share one cache: a program one compiled, the
        # other loads. Each worker's base temp is a folder of the session's (popen-gw0, ...), so the cache
        # is still new each session. JAX writes an entry in one call and treats an unreadable one as a
        # miss (a warning, then it compiles), as it already does for the background runs sharing it.
        path = str(tmp_path_factory.getbasetemp().parent / "xla_cache_shared")
        os.makedirs(path, exist_ok=True)
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.items():
            mp.setenv(name.upper(), str(value))
            jax.config.update(name, value)
        yield


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, _cache_dir):
    """No network, no W&B, and a throwaway cache (shared by the session so tokenized corpora are
    reused; a test that needs an empty cache can set EQTRAIN_CACHE to its own tmp_path)."""
    monkeypatch.setenv("EQTRAIN_CACHE", str(_cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def background_session(_cache_dir, _compilation_cache) -> dict:
    """What the background set-ups' ctx carries (tests/background.py): the session's tokenized-corpus
    cache as ctx.cache_dir. Requesting the compilation cache makes the runner start once that cache
    is in os.environ, which the background runs inherit."""
    return {"cache_dir": _cache_dir}


@pytest.fixture
def tiny_run():
    """Factory: `tiny_run("optimizer=sgdm", "train.gradient_clip_val=null")` -> validated RunConfig
    of a tiny GPT (dim 32, 2 blocks, context 16, vocab 64, batch 8) plus the given overrides."""

    def make(*overrides: str) -> RunConfig:
        return validate(compose_config(*overrides))

    return make
