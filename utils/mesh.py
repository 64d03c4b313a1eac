"""Device mesh and sharding rules.

Two mesh axes: `data` (batch split, parameters replicated) and `fsdp` (batch split too, and
every parameter and optimizer-state array split along one of its axes). On one device both
are size 1 and every rule below degenerates to "replicated".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from utils.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


@dataclass(frozen=True)
class ParallelConfig:
    data: int = -1  # devices on the data axis; -1 = all devices not used by fsdp
    fsdp: int = 1  # devices over which parameters and optimizer state are sharded

    def check(self, prefix: str) -> None:
        if self.data == 0 or self.data < -1:
            raise ConfigError(f"{prefix}.data={self.data} must be positive or -1 (all remaining devices)")
        if self.fsdp <= 0:
            raise ConfigError(f"{prefix}.fsdp={self.fsdp} must be a positive integer")


def make_mesh(data: int, fsdp: int, batch_size: int, devices=None) -> Mesh:
    """Mesh over `devices` (default: all); checks the batch divides over it."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n % fsdp:
        raise ConfigError(f"parallel.fsdp={fsdp} does not divide the {n} available devices: choose a divisor of {n}")
    if data == -1:
        data = n // fsdp
    if data * fsdp != n:
        raise ConfigError(
            f"parallel.data={data} x parallel.fsdp={fsdp} = {data * fsdp} devices, but {n} are available: "
            "make the product equal the device count (parallel.data=-1 fills it)"
        )
    if batch_size % n:
        raise ConfigError(
            f"dataset.batch_size={batch_size} does not divide over the {n} devices of the data/fsdp axes: "
            f"use a multiple of {n}"
        )
    # Mesh(...) keeps the Auto axis types that with_sharding_constraint and jit shardings expect.
    return Mesh(np.asarray(devices).reshape(data, fsdp), BATCH_AXES)


def batch_sharding(mesh: Mesh, leading_axes: int = 0) -> NamedSharding:
    """Sequences split over every device; `leading_axes` (e.g. micro-batches) stay whole."""
    return NamedSharding(mesh, P(*([None] * leading_axes), BATCH_AXES, None))


def row_sharding(batch: NamedSharding) -> NamedSharding:
    """For per-sequence values (e.g. eval weights_B) of a `batch_sharding` batch: each device gets
    the entries of exactly the rows it holds."""
    return NamedSharding(batch.mesh, P(*batch.spec[:-1]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
    """Split the largest axis that `fsdp_size` divides; replicate small or indivisible arrays."""
    if fsdp_size == 1 or not shape:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % fsdp_size == 0 and shape[axis] >= fsdp_size:
            spec = [None] * len(shape)
            spec[axis] = "fsdp"
            return P(*spec)
    return P()


def tree_shardings(mesh: Mesh, abstract_tree):
    """A NamedSharding for every array leaf of a (shape-only) pytree, by the FSDP rule."""
    fsdp_size = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, fsdp_size)), abstract_tree)


def put_batch(batch, sharding: NamedSharding):
    """Host batch (this process's rows; an array or a dict of arrays with the same leading axes)
    -> global arrays on the mesh, without a gather."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


_distributed_ready = False


def init_distributed() -> None:
    """Join a multi-process job when the environment describes one (SLURM with several tasks, or
    JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and JAX_PROCESS_ID); a no-op on one process
    and on a second call (Hydra multirun jobs share the process)."""
    global _distributed_ready
    if _distributed_ready:
        return
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:  # jax reads the address itself but not the other two
        try:
            count, index = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise ConfigError("JAX_COORDINATOR_ADDRESS is set: set JAX_NUM_PROCESSES and JAX_PROCESS_ID "
                              "(integers) for every process too") from None
        jax.distributed.initialize(address, count, index)
    elif slurm_tasks > 1:
        jax.distributed.initialize()  # jax's SLURM detection reads SLURM_* from the environment
    _distributed_ready = True
