"""The export format: a model written as `model.safetensors` + `config.json` for tools that do not
speak orbax, and read back (`load_export`). Opening a run's checkpoint for export or sampling (the
scripts' command line, the saved run config) is `trainer.inference`'s.

Export layout of an OUT_DIR:

    model.safetensors   one tensor per model array, named by its pytree path
                        (`wte_VxD`, `blocks.attn_qkv.weight_IxO`, ...), dtype as trained
    config.json         the model config's fields (`name` = its family) (vocab_size resolved), plus `step`, the run's
                        `tokenizer` section, `trained_context_length` (the window it was
                        trained on) and `objective` (`{name: ar}`, or mdlm's knobs: its
                        attention is bidirectional and its mask id the vocabulary's last):
                        enough to rebuild the model, its tokenizer and how to run it

Both files are written to a scratch directory beside OUT_DIR and renamed into place
(`utils.files.atomic_dir`), so a crash never leaves half an export.
"""

from __future__ import annotations

import dataclasses
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import models
from utils import files
from utils.checkpoint import storage as ckptlib
from utils.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def model_tensors(model: eqx.Module) -> dict[str, np.ndarray]:
    """Every array of `model` as host numpy, keyed by `ckptlib.leaf_name` (None leaves, e.g. a tied
    head or absent biases, have no path and so no tensor)."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    return {ckptlib.leaf_name(p): np.asarray(x) for p, x in leaves}


def abstract_model(model_cfg, param_dtype: str) -> eqx.Module:
    """The shapes and dtypes a checkpoint's model holds: the model's float arrays cast to
    `train.param_dtype`, as `train_jax.init_model` does (the manifest's model section alone
    does not say the dtype)."""
    dtype = jnp.dtype(param_dtype)
    shapes = models.abstract(model_cfg)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x, shapes)



def save_export(out_dir: str, model: eqx.Module, step: int, tokenizer: dict, trained_context_length: int,
                objective: dict | None = None, dtype: str | None = None) -> None:
    """Write OUT_DIR/model.safetensors and OUT_DIR/config.json (see the module docstring).
    `trained_context_length` (dataset.context_length, or the model's) tells a consumer which
    positions were trained: a shorter training window leaves the later position embeddings random.
    `dtype` (export --dtype): every float array cast to it; None keeps each array's own."""
    from safetensors.numpy import save_file

    tensors = model_tensors(model)
    if dtype is not None:
        tensors = {k: x.astype(jnp.dtype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x
                   for k, x in tensors.items()}
    config = {**dataclasses.asdict(model.cfg), "step": step, "tokenizer": tokenizer,
              "trained_context_length": trained_context_length, "objective": objective or {"name": "ar"},
              "format": ckptlib.FORMAT_VERSION}
    # atomic_dir gives the files what `open` gives: the safetensors writer alone makes private 0600 files.
    with files.atomic_dir(out_dir) as scratch:
        save_file(tensors, os.path.join(scratch, WEIGHTS_FILE), metadata={"format": "np"})
        _write_json(os.path.join(scratch, CONFIG_FILE), config)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def read_export_config(out_dir: str) -> tuple[object, dict]:
    """OUT_DIR/config.json -> (its model config, the whole JSON object)."""
    config = ckptlib.read_json(os.path.join(out_dir, CONFIG_FILE))
    if config.get("format", 1) != ckptlib.FORMAT_VERSION:
        raise CheckpointError(f"{os.path.join(out_dir, CONFIG_FILE)} is export format {config.get('format', 1)}, this "
                              f"eqtrain reads format {ckptlib.FORMAT_VERSION} (the attention weights' layout changed): "
                              "export the checkpoint again with the eqtrain version that trained it")
    family = models.MODELS.get(config.get("name", "gpt"))
    if family is None:
        raise CheckpointError(f"{os.path.join(out_dir, CONFIG_FILE)} names model {config.get('name')!r}, which this "
                              f"eqtrain lacks (it has {', '.join(models.MODELS)})")
    fields = {f.name for f in dataclasses.fields(family.Config)}
    return models.config_from_dict({k: v for k, v in config.items() if k in fields}), config


def load_export(out_dir: str) -> eqx.Module:
    """A model rebuilt from an export: config.json gives the shapes, model.safetensors every array
    (in its stored dtype). CheckpointError if a tensor is missing, extra or misshapen."""
    from safetensors.flax import load_file  # the numpy reader has no bfloat16

    model_cfg, _ = read_export_config(out_dir)
    path = os.path.join(out_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: export the checkpoint again")
    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}): export the checkpoint again") from None
    shapes = models.abstract(model_cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    extra = sorted(set(tensors) - {ckptlib.leaf_name(p) for p, _ in leaves})
    if extra:
        raise CheckpointError(f"{path} holds {extra[0]}, which this config.json's model lacks: "
                              "the two files come from different exports")
    filled = []
    for p, x in leaves:
        name = ckptlib.leaf_name(p)
        if name not in tensors or tensors[name].shape != x.shape:
            got = tensors[name].shape if name in tensors else "nothing"
            raise CheckpointError(f"{path} holds {got} for {name}, config.json's model needs {x.shape}: "
                                  "the two files come from different exports")
        filled.append(tensors[name])
    return jax.tree_util.tree_unflatten(treedef, filled)
