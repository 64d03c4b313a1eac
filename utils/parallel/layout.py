"""Where every array of the train state lives on the Mesh.

Parameters are laid out by the logical axis names the model gives each of their dimensions
(`models.param_axes`, e.g. models/gpt.py PARAM_AXES): `heads` and `mlp` go to the `tensor` mesh
axis (attention split by heads, the MLP column- then row-parallel, Megatron style), `expert` (a
Mixture-of-Experts weight's expert axis) to the `expert` mesh axis, and the largest remaining dimension
that divides goes to `fsdp`. Everything shaped like a parameter (optimizer moments, Muon's
momentum, the aux-state buffers) is found by its tree path ending in that parameter's path and
gets the parameter's layout. Arrays derived from a parameter under its path follow it too:
factored statistics (Adafactor's rows and columns: the parameter less one dimension) keep the
split of the dimensions they keep, and blocked statistics (Shampoo's (*stack, R, C, b, b) for a
(*stack, m, n) parameter) split their grid of R x C blocks as the parameter splits m and n. Model
axes (fsdp, tensor) such an array has not used yet, and every axis of anything else, go to its
largest free dimension that divides, as FSDP does. With `shard_optimizer_state` (ZeRO-1) the
optimizer state is also split over `data`, while the parameters stay replicated there.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Logical dimension name -> the mesh axis that splits it (when that axis has more than one device).
TENSOR_AXES = {"heads": "tensor", "mlp": "tensor"}


def _names(path) -> tuple[str, ...]:
    out = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
    return tuple(out)


def _free_axis(shape: tuple[int, ...], spec: list, size: int, skip: tuple[int, ...] = ()) -> int | None:
    """The largest dimension not yet split (nor in `skip`) that `size` divides."""
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if axis not in skip and spec[axis] is None and shape[axis] % size == 0 and shape[axis] >= size:
            return axis
    return None


def _add(spec: list, axis: int, mesh_axis: str) -> None:
    spec[axis] = mesh_axis if spec[axis] is None else (*np.atleast_1d(spec[axis]).tolist(), mesh_axis)


def param_spec(shape: tuple[int, ...], axes: tuple[str | None, ...] | None, mesh: Mesh) -> P:
    """Tensor-parallel dimensions by name, then FSDP on the largest free dimension that divides."""
    spec: list = [None] * len(shape)
    tensor = mesh.shape.get("tensor", 1)
    if tensor > 1 and axes is not None:
        for i, name in enumerate(axes):
            if TENSOR_AXES.get(name) == "tensor" and shape[i] % tensor == 0:
                spec[i] = "tensor"
    expert = mesh.shape.get("expert", 1)
    if expert > 1 and axes is not None:  # MoE: each device holds whole experts (models/moe.py)
        for i, name in enumerate(axes):
            if name == "expert" and shape[i] % expert == 0:
                spec[i] = "expert"
    fsdp = mesh.shape.get("fsdp", 1)
    if fsdp > 1:
        # Not the stacked-blocks axis: the scan over blocks would gather a whole layer per step.
        stacked = tuple(i for i, name in enumerate(axes or ()) if name == "layers")
        axis = _free_axis(shape, spec, fsdp, stacked)
        if axis is not None:
            spec[axis] = "fsdp"
    return P(*spec)


def derived_spec(shape: tuple[int, ...], param_shape: tuple[int, ...], spec: P, mesh: Mesh,
                 stacked: tuple[int, ...] = ()) -> P:
    """The layout of an array derived from a parameter of `param_shape` laid out as `spec` (see the
    module's docstring); `stacked`: the parameter's stacked-blocks dimensions, never split."""
    k, parts = len(param_shape), list(spec) + [None] * (len(param_shape) - len(spec))
    out: list = [None] * len(shape)
    skip = stacked
    if len(shape) == k - 1:  # factored: the parameter with one dimension reduced away
        for i in range(k):
            if param_shape[:i] + param_shape[i + 1:] == shape:
                out = parts[:i] + parts[i + 1:]
                skip = tuple(a - (a > i) for a in stacked if a != i)
                break
    elif k >= 2 and len(shape) == k + 2 and shape[:k - 2] == param_shape[:k - 2] and shape[-1] == shape[-2]:
        # blocked: (*stack, R, C, b, b); a grid dimension takes its matrix side's split if it divides
        grid = shape[k - 2:k]
        out = parts[:k - 2] + [a if a is not None and grid[i] % _size(mesh, a) == 0 else None
                               for i, a in enumerate(parts[k - 2:])] + [None, None]
    for axis in ("fsdp", "tensor"):
        used = {name for a in out if a is not None for name in np.atleast_1d(a).tolist()}
        if mesh.shape.get(axis, 1) > 1 and axis not in used:
            free = _free_axis(shape, out, mesh.shape[axis], skip)
            if free is not None:
                out[free] = axis
    return P(*out)


def _size(mesh: Mesh, axes) -> int:
    return int(np.prod([mesh.shape[a] for a in np.atleast_1d(axes).tolist()]))


def with_data_split(shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    """ZeRO-1: the same layout, also split over `data` on a free dimension that divides (or on an
    already split one, if the product divides); left as is when nothing divides."""
    data = mesh.shape.get("data", 1)
    if data == 1 or not shape:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    axis = _free_axis(shape, parts, data)
    if axis is None:
        for i in sorted(range(len(shape)), key=lambda a: -shape[a]):
            current = np.atleast_1d(parts[i]).tolist() if parts[i] is not None else []
            if current and shape[i] % (data * _size(mesh, current)) == 0:
                axis = i
                break
    if axis is None:
        return spec
    _add(parts, axis, "data")
    return P(*parts)


def state_shardings(mesh: Mesh, abstract_state, abstract_params, param_axes, zero1: bool = False,
                    optimizer_field: str = "opt_state"):
    """A NamedSharding for every array leaf of `abstract_state` (a TrainState of shapes).

    `abstract_params`/`param_axes`: the model's arrays and the logical names of their dimensions
    (same tree). A state leaf whose path ends with a parameter's path and has its shape gets that
    parameter's layout; with `zero1`, leaves under `optimizer_field` are also split over `data`.
    """
    params = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        params[_names(path)] = leaf.shape
    axes_of = {_names(path): axes for path, axes in
               jax.tree_util.tree_leaves_with_path(param_axes, is_leaf=lambda x: isinstance(x, tuple))}

    def sharding(path, leaf) -> NamedSharding:
        names = _names(path)
        shape = tuple(leaf.shape)
        # The longest parameter path that ends this leaf's path: its own layout for the same shape,
        # else a layout derived from it.
        match = next((names[i:] for i in range(len(names)) if names[i:] in params), None)
        if match is None:
            spec = derived_spec(shape, (), P(), mesh)
        elif params[match] == shape:
            spec = param_spec(shape, axes_of.get(match), mesh)
        else:
            axes = axes_of.get(match) or ()
            own = param_spec(params[match], axes or None, mesh)
            spec = derived_spec(shape, params[match], own, mesh, tuple(i for i, a in enumerate(axes) if a == "layers"))
        if zero1 and names and names[0] == optimizer_field:
            spec = with_data_split(shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays held by one device (the first): what each device pays."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def describe(state, mesh: Mesh) -> str:
    """A table of each parameter's shape and layout (mesh axis per dimension), plus per-device
    bytes of parameters and optimizer state (`parallel.print_layout=true`)."""
    lines = [f"{'parameter':<32} {'shape':<18} layout (mesh {dict(mesh.shape)})"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.model):
        if not hasattr(leaf, "sharding"):
            continue
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        shown = ", ".join("-" if a is None else "+".join(np.atleast_1d(a).tolist()) for a in spec)
        lines.append(f"{'.'.join(_names(path)):<32} {str(tuple(leaf.shape)):<18} ({shown})")
    lines.append(f"per device: parameters {device_bytes(state.model) / 2**20:.1f} MiB, optimizer state "
                 f"{device_bytes(state.opt_state) / 2**20:.1f} MiB")
    return "\n".join(lines)
