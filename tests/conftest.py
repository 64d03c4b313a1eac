"""Shared fixtures: an offline, sandboxed environment and tiny validated run configs."""

import os

# NumPy references in tests call BLAS; on a 2-core machine its threads fight XLA's for cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from utils.config import RunConfig, validate  # noqa: E402

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

# A model small enough to compile and step in well under a second on a CPU core.
TINY_OVERRIDES = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=16",
    "model.vocab_size=64",
    "dataset.batch_size=8",
    "train.max_steps=20",
    "train.sample_tokens=0",
    "logging.sample_prompts=[]",
    "logging.progress_bar=false",
)

# The model of end-to-end runs through `python train_jax.py` (byte tokens: vocab 257 -> 320).
CLI_TINY = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=32",
    "dataset.batch_size=8",
    "train.max_val_steps=2",
)


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("eqtrain_cache")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One XLA compilation cache for the session, in-process and for every subprocess run of
    train_jax.py: the tiny test runs compile the same programs again and again, and a cache hit
    halves the suite's time. It starts empty, so no test depends on an earlier session."""
    import jax

    path = str(tmp_path_factory.mktemp("xla_cache"))
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


def compose_config(*overrides: str):
    """conf/config.yaml composed with TINY_OVERRIDES then `overrides` (later ones win)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*TINY_OVERRIDES, *overrides])


@pytest.fixture
def tiny_run():
    """Factory: `tiny_run("optimizer=sgdm", "train.gradient_clip_val=null")` -> validated RunConfig
    of a tiny GPT (dim 32, 2 blocks, context 16, vocab 64, batch 8) plus the given overrides."""

    def make(*overrides: str) -> RunConfig:
        return validate(compose_config(*overrides))

    return make
