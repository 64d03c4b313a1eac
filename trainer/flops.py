"""Peak FLOP/s for model-FLOPs utilisation (MFU).

Accelerators: dense peaks from the vendors' data sheets, looked up by device kind. CPUs have
no data sheet figure that XLA reaches, so the peak is a float32 matmul microbenchmark, run
once per machine and cached, which makes CPU MFU mean "fraction of the matmul speed this
machine actually delivers".
"""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from utils.files import atomic_write

# device_kind substring -> {dtype: dense FLOP/s}
ACCELERATOR_PEAKS = {
    "H200": {"bfloat16": 989e12, "float32": 495e12},  # float32 counted as TF32 tensor cores
    "H100": {"bfloat16": 989e12, "float32": 495e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "L40S": {"bfloat16": 362e12, "float32": 183e12},
    "A10G": {"bfloat16": 125e12, "float32": 62.5e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12},
}


def measure_matmul_flops(sizes: tuple[int, ...] = (1024, 2048), repeats: int = 5, device=None) -> float:
    """Best float32 square-matmul FLOP/s over `sizes` and `repeats` on one device."""
    device = device or jax.devices()[0]
    matmul = jax.jit(lambda x, y: x @ y)
    best = 0.0
    for n in sizes:
        a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
        matmul(a, a).block_until_ready()
        for _ in range(repeats):
            t0 = time.perf_counter()
            matmul(a, a).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


# The measurement's version, part of the cache key: raised when cached figures may be wrong, so each
# cache_dir measures once more. 2: the peak is taken before the step variants start compiling. Runs
# from c065576 to 710b2a7 measured it beside them and cached ~209 GFLOP/s for ~507 on the 2-core VM,
# and the cache only ever rises, so every later run from that cache_dir logged MFU twice too high.
PEAK_VERSION = 2


def _cpu_cache_key() -> str:
    # XLA flags can change matmul kernels (e.g. oneDNN): a peak measured under others is not ours.
    return (f"{platform.node()}-{platform.machine()}-{os.cpu_count()}-jax{jax.__version__}"
            f"-{os.environ.get('XLA_FLAGS', '')}-v{PEAK_VERSION}")


def peak_flops(compute_dtype: str, cache_dir: str, fresh: bool = False, device=None) -> float | None:
    """Peak FLOP/s of the whole job, or None for an accelerator we have no figure for.

    Accelerators: per-device peak times device count. CPU: the measured peak of this machine
    times the process count (forced host devices share the same cores, so they add nothing).
    The cached CPU figure only ever rises: on a shared machine a measurement can catch a slow
    moment, and a peak that is too low would flatter MFU. `fresh` measures again (benchmarks do).
    `device`: the job's kind of device (default: JAX's first device).
    """
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        for name, peaks in ACCELERATOR_PEAKS.items():
            if name.lower() in device.device_kind.lower():
                # float16 counted at the bfloat16 peak (NVIDIA's tensor cores run both at one rate)
                per_device = peaks.get("bfloat16" if compute_dtype == "float16" else compute_dtype)
                return None if per_device is None else per_device * jax.device_count()
        return None
    return _cpu_peak(cache_dir, fresh) * jax.process_count()


def _cpu_peak(cache_dir: str, fresh: bool = False) -> float:
    path = os.path.join(os.path.expanduser(cache_dir), "cpu_peak_flops.json")
    key = _cpu_cache_key()
    try:
        with open(path) as f:
            cached = json.load(f)
        if key in cached and not fresh:
            return float(cached[key])
    except (OSError, ValueError):
        cached = {}
    peak = max(measure_matmul_flops(), float(cached.get(key, 0.0)))
    cached[key] = peak
    with atomic_write(path) as tmp:  # several runs starting at once may measure and write together
        with open(tmp, "w") as f:
            json.dump(cached, f)
    return peak
