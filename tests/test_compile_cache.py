"""`compile_cache` (utils/compile_cache.py): a real run (python train_jax.py, a fresh process each)
caches its programs in {cache_dir}/xla; a second identical run loads every one of them from there;
`compile_cache=false` writes nothing. The session's own cache (tests/conftest.py) is kept out: these
runs get a cache_dir of their own and no JAX_COMPILATION_CACHE_DIR. Hits and misses are JAX's
monitoring events, counted inside the run's process; no timings are asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLI_TINY, offline_env

from utils import compile_cache

REPO = Path(__file__).resolve().parent.parent
# Runs train_jax.py's Hydra entry point with JAX's cache events counted, written at exit to $COUNTS.
COUNTING = """
import atexit, collections, json, os, runpy, sys
import jax.monitoring
counts = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: counts.update([event.rsplit("/", 1)[-1]]))
atexit.register(lambda: open(os.environ["COUNTS"], "w").write(json.dumps(counts)))
sys.argv = ["train_jax.py", *sys.argv[1:]]
runpy.run_path("train_jax.py", run_name="__main__")
"""


def run(tmp_path: Path, name: str, cache: Path, *overrides: str) -> dict:
    env = {k: v for k, v in offline_env(cache).items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    env["COUNTS"] = str(tmp_path / f"{name}.json")
    proc = subprocess.run([sys.executable, "-c", COUNTING, *CLI_TINY, "train.max_steps=2", "train.val_freq=1",
                           "train.sample_tokens=0", f"hydra.run.dir={tmp_path / name}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert any("time/compile_sec" in r for r in metrics)  # recorded whether compiled or loaded
    return json.loads((tmp_path / f"{name}.json").read_text())


def entries(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in (cache / "xla").rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_second_run_loads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = run(tmp_path, "first", cache)
    written = entries(cache)
    assert first.get("cache_misses", 0) > 0 and first.get("cache_hits", 0) == 0
    assert written and all(w.startswith(os.path.join("xla", "jax-")) for w in written)
    second = run(tmp_path, "second", cache)
    # Every program the second run needed came from the cache: hits, no miss, nothing new written. (Fewer
    # programs than the first run's: that one also measured the CPU's peak FLOP/s, cached in cache_dir.)
    assert second.get("cache_misses", 0) == 0 and 0 < second.get("cache_hits", 0) <= first["cache_misses"], second
    assert entries(cache) == written


@pytest.mark.slow
def test_compile_cache_false_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    counts = run(tmp_path, "off", cache, "compile_cache=false")
    assert not (cache / "xla").exists() and counts.get("cache_hits", 0) == 0


def test_the_folder_is_per_jax_version_and_cpu(tmp_path):
    import jax

    path = compile_cache.folder(str(tmp_path))
    assert path == os.path.join(str(tmp_path), "xla", f"jax-{jax.__version__}-cpu-{compile_cache.cpu_signature()}")
    assert compile_cache.cpu_signature() == compile_cache.cpu_signature() and len(compile_cache.cpu_signature()) == 12


def test_a_cache_configured_elsewhere_is_left_alone(tmp_path):
    """The test session's cache (conftest) is already set: enable() must not move it to cache_dir."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    assert before and compile_cache.enable({"cache_dir": str(tmp_path), "compile_cache": True}) is None
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "xla").exists()
