"""Device mesh, batch sharding and joining a multi-process job.

Three mesh axes: `data` (batch split, parameters replicated), `fsdp` (batch split too, and every
parameter and optimizer-state array split along one of its axes) and `tensor` (the same batch,
attention heads and MLP columns split: see utils/parallel/layout.py, which places the train state). On one
device all are size 1 and every rule degenerates to "replicated". With `parallel.expert` > 1 a
fourth, `expert`, between data and fsdp: Mixture-of-Experts weights split by expert, the batch
split over it too (expert parallelism reuses data-parallel ranks), everything else replicated there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from utils.errors import ConfigError

BATCH_AXES = ("data", "fsdp")
MESH_AXES = ("data", "fsdp", "tensor")
EXPERT_MESH_AXES = ("data", "expert", "fsdp", "tensor")  # parallel.expert > 1


@dataclass(frozen=True)
class ParallelConfig:
    data: int = -1  # devices on the data axis; -1 = all devices not used by fsdp and tensor
    fsdp: int = 1  # devices over which parameters and optimizer state are sharded
    tensor: int = 1  # devices over which attention heads and MLP columns are split
    expert: int = 1  # devices over which MoE experts are split (the batch too); 1 = no expert axis
    shard_optimizer_state: bool = False  # ZeRO-1: optimizer state split over `data` too
    distributed: Any = "auto"  # auto | true | false: join a multi-process job (jax.distributed)
    print_layout: bool = False  # print every parameter's layout and the per-device bytes at start

    def check(self, prefix: str) -> None:
        if self.data == 0 or self.data < -1:
            raise ConfigError(f"{prefix}.data={self.data} must be positive or -1 (all remaining devices)")
        for knob in ("fsdp", "tensor", "expert"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be a positive integer")
        if _yaml_bool_str(self.distributed) not in ("auto", "true", "false"):
            raise ConfigError(f"{prefix}.distributed={self.distributed!r} must be auto, true or false")


def _yaml_bool_str(value) -> str:
    """parallel.distributed=true arrives as a YAML bool; the knob is a three-way string."""
    return {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value


def make_mesh(data: int, fsdp: int, batch_size: int, devices=None, tensor: int = 1, expert: int = 1) -> Mesh:
    """Mesh over `devices` (default: all); checks the batch divides over its data, expert and fsdp
    axes. The `expert` axis exists only when `expert` > 1, so other runs get the mesh they always had."""
    devices = list(jax.devices() if devices is None else devices)
    n, model = len(devices), fsdp * tensor * expert
    x_expert = f" x parallel.expert={expert}" if expert > 1 else ""
    if n % model:
        raise ConfigError(f"parallel.fsdp={fsdp} x parallel.tensor={tensor}{x_expert} does not divide the {n} "
                          f"available devices: choose divisors of {n}")
    if data == -1:
        data = n // model
    if data * model != n:
        raise ConfigError(
            f"parallel.data={data} x parallel.fsdp={fsdp} x parallel.tensor={tensor}{x_expert} = {data * model} "
            f"devices, but {n} are available: make the product equal the device count (parallel.data=-1 fills it)"
        )
    split = data * fsdp * expert
    if batch_size % split:
        axes = "data/expert/fsdp" if expert > 1 else "data/fsdp"
        raise ConfigError(
            f"dataset.batch_size={batch_size} does not divide over the {split} devices of the {axes} axes: "
            f"use a multiple of {split}"
        )
    # Mesh(...) keeps the Auto axis types that with_sharding_constraint and jit shardings expect.
    if expert > 1:
        return Mesh(np.asarray(devices).reshape(data, expert, fsdp, tensor), EXPERT_MESH_AXES)
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def topology(mesh: Mesh) -> str:
    """One line for the run's header: processes, devices, the mesh's axis sizes."""
    axes = " x ".join(f"{name} {size}" for name, size in mesh.shape.items())
    return (f"{jax.process_count()} process(es), {mesh.devices.size} {mesh.devices.flat[0].platform} "
            f"device(s), mesh {axes}")


def batch_sharding(mesh: Mesh, leading_axes: int = 0) -> NamedSharding:
    """Sequences split over every device; `leading_axes` (e.g. micro-batches) stay whole."""
    return NamedSharding(mesh, P(*([None] * leading_axes), batch_axes(mesh), None))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over: data and fsdp, and expert where the mesh has one."""
    return ("data", "expert", "fsdp") if "expert" in mesh.axis_names else BATCH_AXES


def row_sharding(batch: NamedSharding) -> NamedSharding:
    """For per-sequence values (e.g. eval weights_B) of a `batch_sharding` batch: each device gets
    the entries of exactly the rows it holds."""
    return NamedSharding(batch.mesh, P(*batch.spec[:-1]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_batch(batch, sharding: NamedSharding):
    """Host batch (this process's rows; an array or a dict of arrays with the same leading axes)
    -> global arrays on the mesh, without a gather."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


_distributed_ready = False


def init_distributed(mode: str = "auto") -> None:
    """Join a multi-process job (parallel.distributed): `auto` when the environment describes one
    (SLURM with several tasks, or JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and
    JAX_PROCESS_ID), `true` always (jax then reads the cluster from the environment and fails if
    it finds none), `false` never (several SLURM tasks then train independently). A no-op on a
    second call (Hydra multirun jobs share the process)."""
    global _distributed_ready
    mode = _yaml_bool_str(mode)
    if _distributed_ready or mode == "false":
        return
    if mode == "true" and not os.environ.get("JAX_COORDINATOR_ADDRESS") and int(
            os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) <= 1:
        try:
            jax.distributed.initialize()
        except Exception as e:  # noqa: BLE001 - jax raises several kinds when no cluster is found
            raise ConfigError(f"parallel.distributed=true but no multi-process job was found ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]}): run under srun with several tasks, set "
                              "JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or use "
                              "parallel.distributed=auto") from None
        _distributed_ready = True
        return
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: the batch script of an `sbatch --ntasks=2` job has the
    # latter but is one process; only the tasks srun starts form the job.
    slurm_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
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
