"""XLA's persistent compilation cache for real runs (`compile_cache: true`, in `cache_dir`).

A second run of the same programs loads them from disk instead of compiling them (seconds per
step variant). Why an entry can never be the wrong program: JAX keys each one on a hash of the
program's HLO (so two checkouts whose code differs get different keys, and programs with host
callbacks are never written), the XLA flags and compile options, the backend and its version,
the device topology and the jaxlib version (jax/_src/cache_key.py). One thing that key leaves
out: which CPU compiled it. XLA's CPU code is built for the host's instruction set, so a cache_dir
shared over NFS between an AVX-512 node and one without could hand the second an executable it
cannot run; entries therefore go into a folder per jax version and CPU (`folder`).

Set once per process, before the first compilation (utils/cli.py `run_job`, the entry point of
every train_jax.py run). A cache the environment or the caller already configured
(JAX_COMPILATION_CACHE_DIR, e.g. the test suite's session cache) is left as it is.
"""

from __future__ import annotations

import hashlib
import os
import platform

import jax

from utils.files import user_path
from utils.sections import _coerce

_enabled: str | None = None  # the folder this process caches into, once set


def cpu_signature() -> str:
    """A short hash of what XLA's CPU code generation depends on: the architecture, the CPU model and
    its feature flags (Linux's /proc/cpuinfo; elsewhere the architecture and processor name only)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def folder(cache_dir: str) -> str:
    """Where this jax and this CPU keep their entries: {cache_dir}/xla/jax-<version>-cpu-<signature>."""
    return os.path.join(cache_dir, "xla", f"jax-{jax.__version__}-cpu-{cpu_signature()}")


def already_configured() -> bool:
    return bool(jax.config.jax_compilation_cache_dir)


def enable(config: dict) -> str | None:
    """Turn the cache on for this process from a run's raw config (`compile_cache`, `cache_dir`);
    the folder it writes to, or None (off, or configured elsewhere). Idempotent."""
    global _enabled
    on = _coerce(config.get("compile_cache", True), bool, "compile_cache")
    if not on or _enabled is not None or already_configured():
        return _enabled
    path = folder(user_path(str(config["cache_dir"])))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile: a run's dozens of small ones (evaluation, metrics,
    # sampling) add up to seconds, and reading an entry back takes milliseconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:  # JAX settles on "no cache" at its first compilation: after one (a test, a notebook), look again
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
    _enabled = path
    return path
