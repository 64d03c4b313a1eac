"""Whether a training step can fit in a device's memory, estimated before anything is read or compiled.

The estimate is a lower bound, so that a refusal is certain and a run that might fit is never
refused: what no layout, remat policy or kernel can avoid holding at the backward pass's peak,
spread evenly over every device of the mesh (the best any sharding can do):

    state        the weights and optimizer state (their exact shapes, `jax.eval_shape`), plus a
                 gradient for every trained weight, in train.param_dtype
    activations  per window of T tokens, in train.compute_dtype (c bytes):
                   the residual stream at every block's input, L·T·D·c (model.remat=full saves
                   these and nothing else; the other policies save more)
                   the logits, T·V·c (the loss reads them whole)
                   one block's attention scores, H·T·S·c with S = T for XLA's attention,
                   model.attn_block_size for blocked attention, 0 for cuDNN's flash attention
                 times dataset.batch_size windows (one micro-batch: accumulation adds none)

against the memory of one device: a GPU's `bytes_limit` (XLA's allocator's share of it), or on the
CPU backend the host's physical memory shared by its devices. `check_window` refuses, in one line
naming dataset.context_length and the largest window that would fit, a window whose estimate
exceeds it. Not counted (so real use is higher): XLA's temporaries, the MLP's hidden activations,
optimizer scratch, fragmentation. A run that passes may still run out of memory; one refused
cannot fit.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from utils.errors import ConfigError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Estimate:
    state: float  # bytes per device
    activations: float  # bytes per device

    @property
    def total(self) -> float:
        return self.state + self.activations


def state_bytes(params, opt_state, trained) -> int:
    """Weights + optimizer state (abstract pytrees: ShapeDtypeStructs or arrays) + one gradient per
    trained weight (`trained`: the weight leaves that receive gradients)."""
    nbytes = lambda tree: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                              for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
    return nbytes(params) + nbytes(opt_state) + nbytes(trained)


def activation_bytes_per_window(cfg, window: int, compute_dtype: str) -> int:
    """The module docstring's per-window lower bound for a model config `cfg` (vocab_size resolved,
    `attention` resolved to the kernel this machine runs)."""
    c = np.dtype(jax.numpy.dtype(compute_dtype)).itemsize
    T, D, L, V, H = window, cfg.dim, cfg.num_blocks, cfg.vocab_size, cfg.num_heads
    scores = {"xla": T, "blocked": cfg.attn_block_size or T, "cudnn": 0}.get(cfg.attention, T)
    return (L * T * D + T * V + H * T * scores) * c


def estimate(run, state: int, window: int, devices: int) -> Estimate:
    acts = run.dataset.batch_size * activation_bytes_per_window(run.model, window, run.train.compute_dtype)
    return Estimate(state / devices, acts / devices)


def device_memory(device=None) -> tuple[int, str]:
    """(bytes one device may use, what they are): a GPU's allocator limit, or for the CPU backend
    the host's physical memory divided among its devices."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform.upper()} {device.device_kind}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, jax.local_device_count()), "host memory (CPU backend)"


def largest_window(run, state: int, devices: int, capacity: int, window: int) -> int:
    """The largest power of two below `window` whose estimate fits `capacity`; 0 when none does."""
    w = 1 << (max(1, window - 1)).bit_length() - 1
    while w >= 1 and estimate(run, state, w, devices).total > capacity:
        w //= 2
    return w if w >= 1 else 0


def check_window(run, state: int, devices: int, capacity: int, where: str) -> None:
    """ConfigError naming dataset.context_length when the estimate at the run's window exceeds
    `capacity` bytes per device (`where`: what the capacity is, for the message)."""
    window = run.context_length
    est = estimate(run, state, window, devices)
    if est.total <= capacity:
        return
    knob = (f"dataset.context_length={window}" if run.dataset.context_length is not None
            else f"dataset.context_length=null (model.context_length={window})")
    fits = largest_window(run, state, devices, capacity, window)
    fix = (f"set dataset.context_length={fits} or less, or lower dataset.batch_size={run.dataset.batch_size}" if fits
           else "the weights and optimizer state alone do not fit: add devices (parallel.fsdp) or pick a smaller model")
    raise ConfigError(f"{knob}: a training step needs at least {est.total / GiB:.1f} GiB per device by the memory "
                      f"estimate (state {est.state / GiB:.1f} GiB, activations of {run.dataset.batch_size} windows "
                      f"{est.activations / GiB:.1f} GiB; trainer/memory.py), more than the {capacity / GiB:.1f} "
                      f"GiB of {where}: {fix}")
