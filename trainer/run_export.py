"""A run's own export (checkpoint.export): at its last step, the model it evaluates (Schedule-Free's x,
train.weight_average's average, else the trained weights) written as `scripts/export_model.py --format`
writes a checkpoint's, by the same writer (`trainer.inference.write_export`): the same files, and no
checkpoint to read back first.

Several processes: a sharded model's arrays (parallel.fsdp, tensor, expert) are not all held by any
one process (jax: not fully addressable), so process 0 cannot read them as they are, what exports from
other JAX trainers trip on. Each such array is gathered to every process first
(`multihost_utils.process_allgather`: a jitted copy replicated over the mesh, every process taking
part); process 0 then writes, into a scratch directory renamed into place (`utils.files.atomic_dir`),
and every process waits at a collective that carries whether the write succeeded
(`multihost_utils.broadcast_one_to_all`), so none exits before the export is on disk, and all fail
if it failed. Every process holds the whole model on the host for that moment.

When: at train.max_steps, or at the step early stopping ends the run. Not at the end of a shorter
segment (checkpoint.num_steps) and not on preemption: the run is not done, and the segment that
finishes it exports. An export already at the path (an earlier segment's, a run trained further) is
replaced, file by file as `export_model.py --force` does.
"""

from __future__ import annotations

import os
import types
from typing import Any

import equinox as eqx
import jax
import numpy as np

import models
from trainer import export_options
from trainer.hooks import Hook, LoopContext
from utils.errors import CheckpointError, ConfigError
from utils.logging.messages import say

FORMATS = ("safetensors", "hf", "peft")  # scripts/export_model.py's --format
DIRECTORY = "export"  # under checkpoint.save_path, when checkpoint.export_path is null
_KNOBS = ("export_path", "export_dtype", "export_max_shard_size", "export_merge_lora")


def out_dir(ck) -> str:
    """Where the export goes: checkpoint.export_path, else {save_path}/export."""
    return ck.export_path or os.path.join(ck.save_path, DIRECTORY)


def check(run) -> None:
    """checkpoint.export and its knobs, refused at validation (before anything is built or compiled)
    in one ConfigError line naming the knob: the refusals export_model.py makes of its flags."""
    ck, m = run.checkpoint, run.model
    if ck.export is None:
        stray = [k for k in _KNOBS if getattr(ck, k) not in (None, False)]
        if stray:
            raise ConfigError(f"checkpoint.{stray[0]} is set but checkpoint.export=null: set checkpoint.export to "
                              f"{', '.join(FORMATS)}, or drop checkpoint.{stray[0]}")
        return
    if ck.export not in FORMATS:
        raise ConfigError(f"checkpoint.export={ck.export!r} is not an export format: use null, "
                          f"{', '.join(FORMATS)} (scripts/export_model.py's --format)")
    if ck.export_path is None and ck.save_path is None:
        raise ConfigError(f"checkpoint.export={ck.export} writes to checkpoint.export_path, or {{save_path}}/"
                          f"{DIRECTORY}: set checkpoint.export_path or checkpoint.save_path")
    export_options.check(ck.export, ck.export_dtype, ck.export_max_shard_size, export_options.KNOBS)
    lora_on = m.lora.on
    if ck.export_merge_lora and not lora_on:
        raise ConfigError("checkpoint.export_merge_lora=true: this run has no LoRA factors (model.lora.rank=0): "
                          "drop checkpoint.export_merge_lora")
    if ck.export == "peft":
        if ck.export_merge_lora:
            raise ConfigError("checkpoint.export=peft writes the LoRA factors themselves, "
                              "checkpoint.export_merge_lora=true folds them into the base: drop one of the two")
        if not lora_on:
            raise ConfigError("checkpoint.export=peft: this run has no LoRA factors (model.lora.rank=0), so there is "
                              "no adapter to write: use checkpoint.export=hf")
        if not m.init_from:
            raise ConfigError("checkpoint.export=peft: this LoRA run's base is random (no model.init_from), so no "
                              "Hugging Face model holds it for the adapter: use checkpoint.export=hf with "
                              "checkpoint.export_merge_lora=true")
    if ck.export == "hf" and lora_on and not ck.export_merge_lora:
        raise ConfigError("checkpoint.export=hf: this LoRA run's factors have no place in a Hugging Face model: set "
                          "checkpoint.export_merge_lora=true to export the merged weights W + (alpha/rank)·A·B")
    if ck.export in ("hf", "peft") and not run.objective.causal:
        raise ConfigError(f"checkpoint.export={ck.export}: objective={run.objective.name} attends both ways, a "
                          "Hugging Face causal LM would run it causally: use checkpoint.export=safetensors")
    if ck.export == "hf":
        from models import hf

        try:  # the family's own refusals (an MoE of the gpt family, qk_norm with qkv_bias, muP, ...)
            hf.hf_dir_config(types.SimpleNamespace(cfg=m))
        except ConfigError as e:
            raise ConfigError(f"checkpoint.export=hf: {e}") from None


def gathered(model: Any) -> tuple[Any, int]:
    """(`model` with every array this process does not wholly hold replaced by its whole value as
    host numpy, how many there were). A collective: every process must call it, in the same order."""
    from jax.experimental import multihost_utils

    apart = lambda x: isinstance(x, jax.Array) and not x.is_fully_addressable
    sharded, held = eqx.partition(model, apart)
    count = len(jax.tree.leaves(sharded))
    if count:
        sharded = multihost_utils.process_allgather(sharded, tiled=True)
    return eqx.combine(sharded, held), count


def export_run(run, model, step: int, tokenizer, generation: dict | None) -> str:
    """Write the run's export of `model` (checkpoint.export*) from process 0, the others waiting for
    it; returns where. Every process calls it (the gather and the wait are collectives)."""
    from jax.experimental import multihost_utils

    from trainer import inference  # here: it imports the config boundary, which imports this module

    ck, where = run.checkpoint, out_dir(run.checkpoint)
    model, count = gathered(model)
    error = None
    if jax.process_index() == 0:
        try:
            shard_size = export_options.check(ck.export, ck.export_dtype, ck.export_max_shard_size,
                                              export_options.KNOBS)  # validated: here the size in bytes
            model = models.for_export(model, ck.export_merge_lora, ck.export)
            dtype, why = inference.export_dtype(ck.export_dtype, run, generation)
            wrote = inference.write_export(where, ck.export, run, model, step, run.config_dict.get("tokenizer", {}),
                                           generation, dtype, shard_size, tokenizer)
            say(f"export: {ck.export} of step {step} to {where} (dtype {dtype}: {why}; {count} arrays gathered "
                f"from other processes){f'; {wrote}' if wrote else ''}")
        except Exception as e:  # noqa: BLE001 - re-raised below, once the other processes know
            error = e
    # Every process waits here until process 0 has written (or failed): none exits before the export lands.
    ok = bool(multihost_utils.broadcast_one_to_all(np.asarray(error is None, np.int32)))
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"checkpoint.export: process 0 failed to write {where} (its log says why)")
    return where


class Export(Hook):
    """checkpoint.export at the run's last step (train.max_steps, or early stopping's), after the
    checkpoint of that step: an export that fails leaves the checkpoint saved."""

    at_end = True
    off_the_clock = True  # gathering and writing are not training

    def __init__(self, run, tokenizer, generation: dict | None):
        self.run, self.tokenizer, self.generation = run, tokenizer, generation

    def due(self, ctx: LoopContext) -> bool:
        return ctx.step > ctx.start and (ctx.step == self.run.train.max_steps or ctx.finished is not None)

    def __call__(self, ctx: LoopContext) -> None:
        export_run(self.run, ctx.eval_model(), ctx.step, self.tokenizer, self.generation)
