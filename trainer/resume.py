"""Where a run starts from, and which config it trains with when that is a checkpoint.

The policy on top of `utils.checkpoint.storage`'s storage: `resume_source` picks the checkpoint
(resume=auto in this run's save_path, else load=true), `merge_config` decides, knob by knob,
whether the checkpoint's saved config or this command line wins, and `restore_state` reads it
into the run's shards.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax

from models import lora
from optimizer.renames import rename_config
from trainer.step import TrainState
from utils.checkpoint import remote
from utils.checkpoint.frozen import MANIFEST_KEY, FrozenPart
from utils.checkpoint.storage import (
    CheckpointConfig,
    Source,
    complete_steps,
    open_checkpoint,
    remove_incomplete,
    restore,
    with_frozen,
)
from utils.errors import ConfigError
from utils.logging.messages import say

# Top-level config keys that describe this machine or this invocation, not the run being
# trained: a run that starts from a checkpoint always takes them from its own command line
# (parallel.*: a checkpoint saved on 8 devices loads on 4; the global batch stays the run's).
LOCAL_KEYS = ("checkpoint", "cache_dir", "compile_cache", "hydra", "parallel")


def resume_source(cfg: CheckpointConfig, warn: Callable[[str], None]) -> Source | None:
    """Where this run starts from: the newest checkpoint in save_path (resume=auto), else
    load_path/load_file (load=true), else nothing. Raises before anything is compiled when a new
    run would write into an existing save_path. With checkpoint.remote, the remote is checked first,
    and resume=auto pulls its newest checkpoint into save_path when that is newer (remote.prepare)."""
    if cfg.save and cfg.remote:
        remote.prepare(cfg)
    if cfg.save:
        exists = os.path.exists(cfg.save_path)
        if cfg.resume == "auto":
            remove_incomplete(cfg.save_path, warn)
            if complete_steps(cfg.save_path):
                return open_checkpoint(cfg.save_path, "latest", with_opt_state=True, resuming=True)
        elif exists:
            raise ConfigError(f"checkpoint.save_path={cfg.save_path} already exists: pass checkpoint.resume=auto to "
                              "continue that run, or choose a new checkpoint.save_path")
    if cfg.load:
        return open_checkpoint(cfg.load_path, cfg.load_file, with_opt_state=not cfg.overwrite_optimizer,
                               with_data_state=not cfg.overwrite_data)
    return None


# ----------------------------------------------------------------------------- which config wins


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(knob, saved value, current value) for every knob that differs, local keys left out."""
    a = {k: v for k, v in _flatten(saved).items() if k.split(".")[0] not in LOCAL_KEYS}
    b = {k: v for k, v in _flatten(current).items() if k.split(".")[0] not in LOCAL_KEYS}
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def merge_config(source: Source, current: dict, cfg: CheckpointConfig, warn: Callable[[str], None]) -> dict:
    """The config a run that starts from `source` trains with. One rule for a load and for a
    requeued resume alike, so a segment never trains with other hyperparameters than the one
    before it:

    - overwrite_config=false (default): the config saved in the checkpoint; this command line
      only supplies the machine-local keys (checkpoint.*, cache_dir, parallel.*) and, when a load
      sets overwrite_optimizer=true, the optimizer group (overwrite_data=true: the dataset group).
      Other overrides are reported as ignored.
    - overwrite_config=true: this command line's config; the differences are reported (a model
      that no longer fits fails at restore).

    A resumed segment's own checkpoint already holds the config its run settled on at the start
    (the merged one), so a requeue of the same command trains on with exactly that. A saved config
    with old optimizer knob names (optimizer/renames.py) is read under the new ones, one warning each."""
    saved = rename_config(source.config, warn, f" (saved in {source.path})")
    if cfg.overwrite_config:
        diffs = config_differences(saved, current)
        if diffs:
            warn(f"checkpoint.overwrite_config=true: applying this command line over the config saved in "
                 f"{source.path}: " + "; ".join(f"{k}: {a} -> {b}" for k, a, b in diffs))
        return current
    loaded = not source.resuming  # a load's own switches; a requeued segment trains on with what its run settled on
    kept = (set(LOCAL_KEYS) | ({"optimizer"} if cfg.overwrite_optimizer and loaded else set())
            | ({"dataset"} if cfg.overwrite_data and loaded else set()))
    merged = {k: v for k, v in saved.items() if k not in kept}
    merged.update({k: v for k, v in current.items() if k in kept})
    ignored = config_differences(merged, current)  # only what this command line would really change
    if ignored:
        warn(f"checkpoint.overwrite_config=false: training with the config saved in {source.path}; ignoring "
             + ", ".join(f"{k}={b} (saved: {a})" for k, a, b in ignored)
             + " (set checkpoint.overwrite_config=true to apply them)")
    return merged


# ----------------------------------------------------------------------------- the state


def restore_state(source: Source, abstract, shardings, model_config: dict, build: Callable, keys,
                  fresh_opt_state: Callable, init_metrics: Callable):
    """The TrainState saved in `source`, read straight into `shardings` (no host copy of the whole
    state; any mesh shape, any process count). `abstract`: the state's shapes. What the checkpoint
    lacks is made anew: the frozen LoRA base it holds by reference (the model of `build(keys)`,
    the run's initial state, compiled for the model alone, the keys its argument as in the run),
    the optimizer state (`fresh_opt_state(model, step)`, for overwrite_optimizer), the step
    metrics' states (`init_metrics(model)`, when a run switches them on or changes them) and a
    float16 run's loss scale (at its init)."""
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    restored = restore(source, target, model_config)
    rebuild = jax.jit(lambda keys: build(keys).model, out_shardings=shardings.model)
    model = with_frozen(source, restored["model"], functools.partial(rebuild, keys))
    progress = restored["progress"]
    opt_state = restored["opt_state"] if "opt_state" in restored else fresh_opt_state(model, progress["step"])
    metric_states = restored["metric_states"] if "metric_states" in restored else (
        {"aux": restored["aux"]} if "aux" in restored else None)
    if metric_states is None:
        if abstract.metric_states and source.with_opt_state:  # a run that switched a stateful metric on or off
            say(f"{source.path} holds no step-metric states in this run's layout ({', '.join(abstract.metric_states)}):"
                " they start afresh (train.weight_average's average at the restored weights)")
        metric_states = init_metrics(model) if abstract.metric_states else {}
    loss_scale = restored.get("loss_scale")  # a float16 run from a checkpoint without one starts its scale afresh
    if loss_scale is None and abstract.loss_scale is not None:
        say(f"{source.path} has no loss scale (not a float16 run's): the loss scale starts fresh, at "
            "train.loss_scale.init")
        loss_scale = jax.jit(abstract.loss_scale.fresh, out_shardings=shardings.loss_scale)()
    return TrainState(model, opt_state, progress["step"], progress["key"], metric_states, loss_scale)


def frozen_base(trainer, source: Source | None) -> FrozenPart | None:
    """A LoRA run's base from model.init_from, which its checkpoints then hold by reference
    (utils/checkpoint/frozen.py), when the trainer's base is the directory's: a fresh run's, or one
    rebuilt from a checkpoint that held it by reference (and checked). A random base is saved whole:
    XLA's random draws are not bit-reproducible across backends, versions and programs (an eager and a
    jitted draw of the same key differ in the last bit), so a seed is no reference to rebuild it
    from. A run continued from a checkpoint holding the whole model keeps saving it whole too."""
    model, run = trainer.state.model, trainer.run
    if not (lora.has_factors(model) and run.model.init_from) or (
            source is not None and MANIFEST_KEY not in source.manifest):
        return None
    return FrozenPart.of(model, lambda path: not lora.is_factor(path),
                         {"model.init_from": run.model.init_from, "train.param_dtype": run.train.param_dtype})
