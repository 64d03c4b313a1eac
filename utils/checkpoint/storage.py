"""Checkpoints that never lose work, on orbax.

Layout of `checkpoint.save_path`:

    iter_{N}/model/        orbax (OCDBT) arrays of the model
    iter_{N}/opt_state/    orbax arrays of the optimizer state
    iter_{N}/progress/     orbax arrays: step (int32) and the training RNG key
    iter_{N}/eval_model/   orbax arrays of the model to evaluate, when the optimizer trains another
                           point (Schedule-Free: the average x; `model` holds the y it trains) or
                           train.weight_average keeps an average (trainer/weight_average.py)
    iter_{N}/loss_scale/   orbax arrays of a float16 run's loss scale and its count of finite steps
    iter_{N}/manifest/manifest.json   step, time, metrics, data-iterator position, resolved model
                                      config, library versions, and `files`: the size and sha256 of
                                      every other file of iter_N (JSON: no pickle anywhere)
    iter_{N}/manifest/manifest.json.sha256   the manifest's own sha256 (`sha256sum -c` format)
    iter_{N}/config/config.yaml       the run's resolved config
    best/iter_{N}/...                 checkpoint.keep_best: the lowest val/loss so far

A LoRA run's `model` and `eval_model` hold only the trained factors: the frozen base is saved by
reference (the manifest's `frozen` entry: its source and a fingerprint), `utils/checkpoint/frozen.py`.

orbax writes `iter_N.orbax-checkpoint-tmp` and renames it to `iter_N` only once every item is
on disk, so a directory named `iter_N` is complete: a `kill -9` mid-save leaves a tmp directory,
which the next run that saves there removes with a warning. Before that rename, once orbax's files
are final, every file is hashed into the manifest (`utils/checkpoint/integrity.py`), and
`open_checkpoint` checks them all before any array is read. Saves are asynchronous: `save`
returns once the arrays are copied off the device, and the files are written (and hashed) while
training goes on.

This module is storage only: which checkpoint a run starts from and which config it then trains
with is `trainer/resume.py`; stopping on a signal (and the exit codes) is `utils/checkpoint/signals.py`;
the copy of every checkpoint on S3-compatible storage (checkpoint.remote) is `utils/checkpoint/remote.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from utils.checkpoint import frozen as frozen_ref
from utils.checkpoint import integrity, memory
from utils.errors import CheckpointError, ConfigError
from utils.files import user_path
from utils.logging.messages import say

STEP_PREFIX = "iter"
TMP_MARKER = ".orbax-checkpoint-tmp"
ARRAY_ITEMS = ("model", "opt_state", "progress")  # every checkpoint has these
# The stateful step metrics' states ({name: state}: the aux-state hook's buffers, ...) when the
# run has any; "aux" is where checkpoints written before metric_states kept the aux hook's alone.
OPTIONAL_ITEMS = ("metric_states", "aux", "eval_model", "loss_scale")
UNREAD_WITHOUT_OPT_STATE = ("opt_state", "metric_states", "aux")  # items a load with a fresh optimizer skips
EVAL_MODEL = "eval_model"  # what export and sampling read when it is there (optimizer.eval_params)
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.yaml"
# 2: the fused attention projection's columns are head-major (models/gpt.py `_head_major`); a
# format-1 checkpoint's weights would load without error and compute something else, so it is refused.
FORMAT_VERSION = 2


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CheckpointConfig:
    save: bool = False
    save_path: str | None = None  # a new directory per run; resume=auto continues an existing one
    save_steps: Any = 1000  # int: every N iterations; list: exactly these iterations
    num_steps: int | None = None  # iterations this invocation runs at most (a segment); null = to train.max_steps
    max_to_keep: int | None = 3  # interval checkpoints kept (newest first); list ones are all kept; null = all
    keep_best: bool = False  # also keep the lowest-val/loss checkpoint under {save_path}/best
    resume: str | None = None  # auto: continue from the newest checkpoint in save_path, if any
    async_save: bool = True  # write files in the background while training goes on
    compress: bool = False  # zstd-compress arrays: ~8% smaller files for 2-3x the writer's CPU time
    save_on_interrupt: bool = True  # Ctrl-C finishes the step and saves (SIGTERM/SIGUSR1 always do)
    save_at_end: bool = True  # save the run's last step; false: save_steps' and a stop signal's saves only
    load: bool = False
    load_path: str | None = None  # a save_path of an earlier run
    load_file: str = "latest"  # iter_N | iter_N.ckpt | latest
    overwrite_config: bool = False  # false: the checkpoint's config wins over this command line
    overwrite_optimizer: bool = False  # true: keep weights and step, fresh optimizer state (any family)
    overwrite_data: bool = False  # true (a load): this command line's dataset, its stream from the start
    remote: str | None = None  # s3://bucket/prefix: mirror every checkpoint there (utils/checkpoint/remote.py)
    remote_bandwidth: float | None = None  # MB/s cap on the upload (one connection); null = as fast as it goes
    # The run's model written at its last step as scripts/export_model.py writes a checkpoint's (trainer/run_export.py):
    export: str | None = None  # null | safetensors | hf | peft (export_model.py's --format)
    export_path: str | None = None  # null: {save_path}/export
    export_dtype: str | None = None  # --dtype; null: the model.init_from base's dtype, else train.param_dtype
    export_max_shard_size: str | int | None = None  # --max-shard-size (export=hf): 5GB, 500MB, or bytes; null: one file
    export_merge_lora: bool = False  # --merge-lora: the merged weights W + (alpha/rank)·A·B

    def check(self, prefix: str) -> None:
        steps = self.save_steps
        if isinstance(steps, bool) or not (isinstance(steps, int) or isinstance(steps, (list, tuple))):
            raise ConfigError(f"{prefix}.save_steps={steps!r} must be an interval (e.g. 500) "
                              "or a list (e.g. [100,1000])")
        if isinstance(steps, int) and steps <= 0:
            raise ConfigError(f"{prefix}.save_steps={steps} must be a positive interval")
        if isinstance(steps, (list, tuple)):
            if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in steps):
                raise ConfigError(f"{prefix}.save_steps={list(steps)} must be a non-empty list of positive iterations")
        if self.save and not self.save_path:
            raise ConfigError(f"{prefix}.save=true needs {prefix}.save_path (a directory that does not exist yet)")
        if self.resume not in (None, "auto"):
            raise ConfigError(f"{prefix}.resume={self.resume!r} must be null or auto")
        if self.resume == "auto" and not self.save:
            raise ConfigError(f"{prefix}.resume=auto continues {prefix}.save_path: set {prefix}.save=true too")
        if self.load and not self.load_path:
            raise ConfigError(f"{prefix}.load=true needs {prefix}.load_path (the save_path of an earlier run)")
        if self.overwrite_data and not self.load:
            raise ConfigError(f"{prefix}.overwrite_data=true starts a loaded checkpoint's run on this command line's "
                              f"dataset: set {prefix}.load=true and {prefix}.load_path too (a resume always "
                              "continues its own data stream)")
        for knob in ("num_steps", "max_to_keep"):
            value = getattr(self, knob)
            if value is not None and value <= 0:
                raise ConfigError(f"{prefix}.{knob}={value} must be a positive integer or null")
        if self.load_file != "latest" and parse_step(self.load_file) is None:
            raise ConfigError(f"{prefix}.load_file={self.load_file!r} must be iter_N, iter_N.ckpt or latest")
        if self.remote is not None:
            from utils.checkpoint.remote import parse_url  # here: remote.py imports this module

            parse_url(self.remote)
            if not self.save:
                raise ConfigError(f"{prefix}.remote mirrors {prefix}.save_path: set {prefix}.save=true too")
        if self.remote_bandwidth is not None:
            if isinstance(self.remote_bandwidth, bool) or not self.remote_bandwidth > 0:
                raise ConfigError(f"{prefix}.remote_bandwidth={self.remote_bandwidth} must be a positive number of "
                                  "MB/s (e.g. 20) or null (no cap)")
            if self.remote is None:
                raise ConfigError(f"{prefix}.remote_bandwidth caps the upload to {prefix}.remote: set "
                                  f"{prefix}.remote=s3://bucket/prefix too, or drop it")

    def resolved(self) -> "CheckpointConfig":
        """save_path and load_path made absolute against this process's working directory, once,
        at the config boundary: orbax's metadata reader finds nothing under a relative path, and
        every example in the docs uses one (`checkpoint.save_path=ckpt/run1`)."""
        return dataclasses.replace(self, save_path=user_path(self.save_path), load_path=user_path(self.load_path),
                                   export_path=user_path(self.export_path))

    @property
    def save_at(self) -> tuple[int, ...] | None:
        """The list of iterations to save at, or None for an interval."""
        return None if isinstance(self.save_steps, int) else tuple(sorted(set(self.save_steps)))


def step_path(directory: str, step: int) -> str:
    """Where the checkpoint of `step` lives under a save_path: `directory/iter_{step}`."""
    return os.path.join(directory, f"{STEP_PREFIX}_{step}")


def parse_step(name: str) -> int | None:
    """iter_N or iter_N.ckpt -> N; anything else -> None."""
    m = re.fullmatch(rf"{STEP_PREFIX}_(\d+)(\.ckpt)?", name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- orbax plumbing


class _YamlHandler(ocp.CheckpointHandler):
    """The resolved run config as a readable config.yaml inside the checkpoint."""

    def save(self, directory: epath.Path, args: "YamlSave") -> None:
        (epath.Path(directory) / CONFIG_FILE).write_text(yaml.safe_dump(args.config, sort_keys=False))

    def restore(self, directory: epath.Path, args: "YamlRestore | None" = None) -> dict:
        return read_yaml(os.fspath(epath.Path(directory) / CONFIG_FILE))


@ocp.args.register_with_handler(_YamlHandler, for_save=True)
@dataclass
class YamlSave(ocp.args.CheckpointArgs):
    config: dict


@ocp.args.register_with_handler(_YamlHandler, for_restore=True)
@dataclass
class YamlRestore(ocp.args.CheckpointArgs):
    pass


def _read_mapping(path: str, parse: Callable, errors: tuple, kind: str) -> dict:
    """A checkpoint's small text file -> dict, or a CheckpointError naming the file."""
    try:
        with open(path) as f:
            out = parse(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; load another one") from None
    except errors as e:
        raise CheckpointError(f"{path} is not valid {kind} ({str(e).splitlines()[0]}): "
                              "the checkpoint is corrupt") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path} does not hold a {kind} mapping: the checkpoint is corrupt")
    return out


# libyaml's parser where PyYAML has it: the same safe loader, ~10x faster than the pure-Python one
# (a checkpoint's config.yaml took ~50 ms to read on the 2-core VM, once per resumed or branched run).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: str) -> dict:
    return _read_mapping(path, lambda f: yaml.load(f, Loader=_YAML_LOADER), (yaml.YAMLError,), "YAML")


def read_json(path: str) -> dict:
    return _read_mapping(path, json.load, (json.JSONDecodeError, UnicodeDecodeError), "JSON")


def _manager(directory: str, cfg: CheckpointConfig, best: bool = False) -> ocp.CheckpointManager:
    if best:
        # keeps the last n sorted: lowest loss
        preserve = policies.BestN(get_metric_fn=lambda m: m["val/loss"], reverse=True, n=1)
    else:
        keep = [policies.LatestN(cfg.max_to_keep)]
        if cfg.save_at is not None:
            keep.append(policies.CustomSteps(cfg.save_at))
        preserve = policies.AnyPreservationPolicy(keep)
    options = ocp.CheckpointManagerOptions(
        step_prefix=STEP_PREFIX,
        preservation_policy=preserve,
        enable_async_checkpointing=cfg.async_save,
        # Each step's files hashed into its manifest before orbax's rename makes it iter_N (integrity.py).
        temporary_path_class=integrity.SealingRename,
    )
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=options,
        item_handlers={**{item: ocp.PyTreeCheckpointHandler(use_compression=cfg.compress)
                          for item in ARRAY_ITEMS + OPTIONAL_ITEMS},
                       "manifest": ocp.JsonCheckpointHandler(filename=MANIFEST_FILE), "config": _YamlHandler()},
    )


def _mirror(cfg: CheckpointConfig, manager: ocp.CheckpointManager, best: bool):
    """checkpoint.remote's uploader of `manager`'s checkpoints on process 0, else None."""
    if not cfg.remote:
        return None
    from utils.checkpoint.remote import Mirror  # here: remote.py imports this module, and boto3 is slow to import

    return Mirror.of(cfg, manager.is_saving_in_progress, best)


def _quiet_orbax() -> None:
    """orbax logs every save and policy decision through absl, and warns about benign things
    (a read-only manager, a missing optional metadata file); its failures reach us as exceptions."""
    for name in ("absl", "orbax"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _arrays(tree: Any) -> Any:
    """The array leaves of a pytree that hold data, concrete or abstract (eqx.is_array is False for
    ShapeDtypeStruct): what is saved and what a restore fills must be the same tree. Zero-size
    arrays (placeholders, e.g. Shampoo's (0,) for a field a parameter does not use) are left out:
    orbax refuses to save them, and they carry nothing; `_with_empty` puts them back."""
    return eqx.filter(tree, lambda x: _is_array(x) and x.size > 0)


def _with_empty(restored: Any, abstract: Any) -> Any:
    """`restored` (an `_arrays` tree read back) with the zero-size leaves of `abstract` made anew,
    each in its abstract leaf's sharding when it has one."""
    if abstract is None:
        return restored

    def empty(x):
        if not (_is_array(x) and x.size == 0):
            return None
        sharding = getattr(x, "sharding", None)
        return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=sharding)()

    return eqx.combine(restored, jax.tree.map(empty, abstract))


# ----------------------------------------------------------------------------- finding a checkpoint


@dataclass(frozen=True)
class Source:
    """A complete checkpoint to start from."""

    path: str  # .../iter_N
    step: int
    manifest: dict
    config: dict  # the config.yaml saved with it
    with_opt_state: bool  # false: checkpoint.overwrite_optimizer (a fresh optimizer state)
    resuming: bool = False  # true: found by resume=auto in this run's own save_path
    with_data_state: bool = True  # false: checkpoint.overwrite_data (the dataset's stream from its start)

    @property
    def data_state(self) -> dict | None:
        """Where the data stream goes on from (the manifest's), or None: from the start."""
        return self.manifest["data"] if self.with_data_state else None


def complete_steps(directory: str) -> list[int]:
    """Iterations with a complete checkpoint (`iter_N` directories; tmp ones are ignored)."""
    if not os.path.isdir(directory):
        return []
    return sorted(s for name in os.listdir(directory)
                  if os.path.isdir(os.path.join(directory, name)) and (s := parse_step(name)) is not None)


def remove_incomplete(directory: str, warn: Callable[[str], None]) -> None:
    """Delete the tmp directories a killed save leaves behind (process 0 only)."""
    if jax.process_index() != 0:
        return
    for sub in (directory, os.path.join(directory, "best")):
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            if TMP_MARKER in name:
                warn(f"removing the incomplete checkpoint {os.path.join(sub, name)} (a save was interrupted)")
                shutil.rmtree(os.path.join(sub, name), ignore_errors=True)


def open_checkpoint(directory: str, load_file: str, with_opt_state: bool, resuming: bool = False,
                    names: tuple[str, str] = ("checkpoint.load_path=", "checkpoint.load_file="),
                    with_data_state: bool = True) -> Source:
    """`directory/load_file` (iter_N, iter_N.ckpt or latest) -> a Source with its manifest and
    config read and checked; CheckpointError naming the file for anything missing or corrupt.
    `names` are how errors spell the two arguments (a script passes its own flags)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{names[0]}{directory} does not exist: give the checkpoint.save_path of an earlier run")
    steps = complete_steps(directory)
    if load_file == "latest":
        if not steps:
            raise CheckpointError(f"{directory} holds no complete checkpoint (iter_N directory): check {names[0]}")
        step = steps[-1]
    else:
        step = parse_step(load_file)
        if step is None:
            raise CheckpointError(f"{names[1]}{load_file!r} must be iter_N, iter_N.ckpt or latest")
        if step not in steps:
            have = ", ".join(f"{STEP_PREFIX}_{s}" for s in steps) or "none"
            raise CheckpointError(f"{names[1]}{load_file}: no {STEP_PREFIX}_{step} in {directory} "
                                  f"(complete checkpoints: {have})")
    path = step_path(directory, step)
    manifest = read_json(os.path.join(path, "manifest", MANIFEST_FILE))
    for key in ("step", "data", "model"):
        if key not in manifest:
            raise CheckpointError(f"{os.path.join(path, 'manifest', MANIFEST_FILE)} lacks {key!r}: "
                                  "the checkpoint is corrupt")
    if manifest["step"] != step:
        raise CheckpointError(f"{os.path.join(path, 'manifest', MANIFEST_FILE)} says step {manifest['step']} "
                              f"but the directory is {STEP_PREFIX}_{step}: the checkpoint is corrupt")
    config = read_yaml(os.path.join(path, "config", CONFIG_FILE))
    # Every file against the size and sha256 it was saved with, before any array is read; the items
    # this load never reads (a fresh optimizer state, or arrays this process holds: memory.py) are
    # checked for presence and size only.
    unread = ARRAY_ITEMS + OPTIONAL_ITEMS if memory.held(path) is not None else (
        () if with_opt_state else UNREAD_WITHOUT_OPT_STATE)
    if not integrity.verify(path, skip=unread):
        say(f"note: {path} was written without file hashes (before eqtrain recorded them): it loads unverified")
    for item in ARRAY_ITEMS if with_opt_state else ("model", "progress"):
        if not os.path.isdir(os.path.join(path, item)):
            raise CheckpointError(f"{os.path.join(path, item)} is missing: "
                                  "the checkpoint is incomplete; load another one")
    return Source(path, step, manifest, config, with_opt_state, resuming, with_data_state)


# ----------------------------------------------------------------------------- restore


def leaf_name(path) -> str:
    """A pytree path as orbax names the array (`blocks.attn_qkv.weight_IxO`); also the tensor
    names of an export."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _check_model_fits(source: Source, abstract_model: Any, model_config: dict) -> None:
    """Fail with the differing model knobs (or array) before orbax meets a shape it cannot fill."""
    if source.manifest.get("format", 1) != FORMAT_VERSION:
        raise CheckpointError(f"{source.path} was written in checkpoint format {source.manifest.get('format', 1)}, "
                              f"this eqtrain reads format {FORMAT_VERSION} (the attention weights' layout changed): "
                              "continue it with the eqtrain version that wrote it, or start a fresh run")
    saved = source.manifest.get("model", {})
    knobs = [f"model.{k}: {saved.get(k)} in the checkpoint, {v} now" for k, v in model_config.items()
             if k in saved and saved[k] != v and k in ("name", "dim", "num_heads", "num_blocks", "vocab_size",
                                                        "mlp_ratio", "tie_embeddings", "bias", "context_length")]
    if knobs:
        raise CheckpointError(f"{source.path} holds another model ({'; '.join(knobs)}): "
                              "restore with the checkpoint's model config or start a fresh run")
    if _data_files_missing(os.path.join(source.path, "model")):
        raise CheckpointError(f"{os.path.join(source.path, 'model')} has none of its array files (its d/ directories "
                              "are empty): the checkpoint is incomplete; load another one")
    try:
        saved_leaves = _saved_shapes(os.path.join(source.path, "model"))
    except Exception as e:  # noqa: BLE001 - any orbax failure here means unreadable metadata
        raise CheckpointError(f"{os.path.join(source.path, 'model')} has unreadable array metadata "
                              f"({type(e).__name__}): the checkpoint is corrupt") from None
    if not saved_leaves:  # orbax reads no array at all: deleted or truncated files, not another model
        raise CheckpointError(f"{os.path.join(source.path, 'model')} holds no readable array (its files are missing "
                              "or corrupt): the checkpoint is incomplete; load another one")
    # Shapes only: orbax casts on restore, so a float32 checkpoint loads into a bfloat16 run. A checkpoint
    # holding its frozen base by reference lacks those arrays (frozen.complete checks them), never others.
    needed = _shapes(abstract_model)
    if frozen_ref.MANIFEST_KEY in source.manifest:
        stray = sorted(set(saved_leaves) - set(needed))
        if stray:
            raise CheckpointError(f"{os.path.join(source.path, 'model')} holds {stray[0]}, which this model lacks: "
                                  "it is another model's checkpoint; match the model config or start fresh")
        needed = {name: shape for name, shape in needed.items() if name in saved_leaves}
    for name, shape in needed.items():
        if saved_leaves.get(name) != shape:
            got = f"shape {saved_leaves[name]}" if name in saved_leaves else "nothing"
            raise CheckpointError(f"{os.path.join(source.path, 'model')} holds {got} for {name}, this model needs "
                                  f"shape {shape}: it is another model's checkpoint; match the model config or "
                                  "start fresh")


def restore_model(source: Source, abstract_model: Any, rebuild: Callable[[], Any] | None = None) -> Any:
    """Only the model of `source`, into the shapes (and shardings, if any) of `abstract_model`
    (e.g. `models.abstract(models.config_from_dict(source.manifest["model"]))`): for export
    and sampling, which need no optimizer state. The model to evaluate (`eval_model`) where the
    checkpoint has one, else the trained one. `rebuild()` makes the model as the run started it;
    it is called only for a checkpoint that holds its frozen base by reference."""
    _quiet_orbax()
    _check_model_fits(source, _arrays(abstract_model), {})
    item = EVAL_MODEL if os.path.isdir(os.path.join(source.path, EVAL_MODEL)) else "model"
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                source.path, args=ocp.args.Composite(**{item: _restore_args(saved_part(source, abstract_model))}))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; the user needs the file
        raise _restore_error(source, e) from None
    return eqx.combine(with_frozen(source, restored[item], rebuild), abstract_model)


def saved_part(source: Source, abstract_model: Any) -> Any:
    """The arrays of `abstract_model` that `source`'s model item holds: all, or without the frozen
    ones a LoRA checkpoint keeps by reference."""
    arrays = _arrays(abstract_model)
    if frozen_ref.MANIFEST_KEY not in source.manifest:
        return arrays
    saved = _saved_shapes(os.path.join(source.path, "model"))
    return jax.tree_util.tree_map_with_path(lambda p, x: x if leaf_name(p) in saved else None, arrays)


def with_frozen(source: Source, model: Any, rebuild: Callable[[], Any] | None) -> Any:
    """A restored model, completed with its frozen arrays rebuilt by `rebuild()` (checked against the
    manifest's fingerprint) when `source` holds them by reference; else `model` as it is."""
    record = source.manifest.get(frozen_ref.MANIFEST_KEY)
    if record is None:
        return model
    if rebuild is None:
        raise CheckpointError(f"{source.path} holds LoRA factors without their base: restore it with "
                              "trainer.inference.restore_for_inference, which reads the base")
    return frozen_ref.complete(model, rebuild(), record, source.path)


def _restore_args(target: Any) -> ocp.args.PyTreeRestore:
    """Fill `target`'s structure, shapes, dtypes (cast if they differ) and shardings."""
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _restore_error(source: Source, e: Exception) -> CheckpointError:
    where = re.search(r"(/[^\s'\"]+)", str(e))
    detail = where.group(1) if where and source.path in where.group(1) else source.path
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    # A tree that does not match is the optimizer state's (the model's shapes were checked first): another
    # optimizer, or train.skip_nonfinite switched off, which unwraps the state (switching it on, as
    # compute_dtype=float16 does, loads the state into the wrapper: `_unwrapped_opt_state`).
    hint = (" (a different optimizer's state, or a checkpoint saved with train.skip_nonfinite on (or "
            "compute_dtype=float16) loaded without it? set checkpoint.overwrite_optimizer=true)"
            if "opt_state" in str(e) or "tree structures do not match" in str(e) else "")
    return CheckpointError(f"cannot restore {detail}: {first}{hint}: the checkpoint is corrupt or incomplete; "
                           "load another one")


def restore(source: Source, abstract_state: Any, model_config: dict) -> dict[str, Any]:
    """Arrays of `source` placed straight into the shardings of `abstract_state` (a TrainState of
    ShapeDtypeStructs): {"model", "progress"}, "opt_state" unless overwrite_optimizer, and
    "metric_states" when the run keeps some, the checkpoint has them in the same layout, and it
    continues the optimizer state (a fresh optimizer starts fresh diagnostics). A checkpoint from
    before metric_states gives its "aux" item, the aux hook's state alone, when that is all the
    run keeps. "loss_scale" (float16 runs) whenever the run scales and the checkpoint has one. A
    checkpoint holding its frozen base by reference gives "model" without it (`with_frozen` completes it)."""
    _quiet_orbax()
    abstract_model = _arrays(abstract_state.model)
    # The arrays this process saved there and still holds (memory.py), unless the model is kept by reference.
    held = memory.held(source.path) if frozen_ref.MANIFEST_KEY not in source.manifest else None
    if held is None:
        _check_model_fits(source, abstract_model, model_config)
        same_layout = lambda item, tree: _same_layout(os.path.join(source.path, item), tree)
        saved = lambda item: os.path.isdir(os.path.join(source.path, item))
    else:  # the held trees are those the files hold: their layouts answer without reading orbax's metadata
        same_layout = lambda item, tree: item in held and _shapes(held[item]) == _shapes(tree)
        saved = lambda item: item in held
    items = {"model": _restore_args(saved_part(source, abstract_state.model)),
             "progress": _restore_args({"step": abstract_state.step, "key": abstract_state.key})}
    wrap = source.with_opt_state and _unwrapped_opt_state(abstract_state.opt_state, same_layout)
    if source.with_opt_state:
        items["opt_state"] = _restore_args(_arrays(abstract_state.opt_state.inner_state if wrap
                                                   else abstract_state.opt_state))
        abstract_metrics = _arrays(abstract_state.metric_states)
        if abstract_metrics and same_layout("metric_states", abstract_metrics):
            items["metric_states"] = _restore_args(abstract_metrics)
        elif set(abstract_metrics) == {"aux"} and same_layout("aux", abstract_metrics["aux"]):
            items["aux"] = _restore_args(abstract_metrics["aux"])
    loss_scale = getattr(abstract_state, "loss_scale", None)
    if loss_scale is not None and saved("loss_scale"):
        items["loss_scale"] = _restore_args(_arrays(loss_scale))
    restored = memory.restore(held, {name: args.item for name, args in items.items()}) if held else None
    if restored is None:
        if held is not None:  # another dtype or tree than the save's: the files, which orbax casts and checks
            _check_model_fits(source, abstract_model, model_config)
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
                restored = checkpointer.restore(source.path, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; the user needs the file
            raise _restore_error(source, e) from None
    abstract = {"model": abstract_state.model, "progress": None, "opt_state": abstract_state.opt_state,
                "metric_states": abstract_state.metric_states,
                "aux": abstract_state.metric_states.get("aux") if abstract_state.metric_states else None,
                "loss_scale": loss_scale}
    out = {name: restored[name] for name in items}
    if wrap:  # the run's skip-non-finite wrapper around the checkpoint's optimizer state, its counts at 0
        out["opt_state"] = _fresh_wrapper(abstract_state.opt_state, out["opt_state"])
    return {name: _with_empty(value, abstract[name]) for name, value in out.items()}


def _unwrapped_opt_state(abstract_opt_state: Any, same_layout: Callable[[str, Any], bool]) -> bool:
    """Whether the run wraps its optimizer state in train.skip_nonfinite's optax.ApplyIfFiniteState
    (compute_dtype=float16 switches it on) and the checkpoint holds that state without the wrapper
    (a float32 or bfloat16 run's): the optimizer state then loads into the wrapper. `same_layout(item,
    tree)`: whether the checkpoint's item holds exactly the arrays of `tree`."""
    if not isinstance(abstract_opt_state, optax.ApplyIfFiniteState):
        return False
    return (not same_layout("opt_state", _arrays(abstract_opt_state))
            and same_layout("opt_state", _arrays(abstract_opt_state.inner_state)))


def _fresh_wrapper(abstract: Any, inner: Any) -> Any:
    """optax.ApplyIfFiniteState around `inner`, its counters as apply_if_finite's init leaves them
    (no non-finite step yet, the last one finite), each in its abstract leaf's sharding."""
    def init(x, value):
        return jax.jit(lambda: jnp.full(x.shape, value, x.dtype), out_shardings=getattr(x, "sharding", None))()

    return optax.ApplyIfFiniteState(notfinite_count=init(abstract.notfinite_count, 0),
                                    last_finite=init(abstract.last_finite, True),
                                    total_notfinite=init(abstract.total_notfinite, 0), inner_state=inner)


def _data_files_missing(item_dir: str) -> bool:
    """An OCDBT item whose data directories (`d/`, `ocdbt.process_N/d/`) hold no file: its arrays were
    deleted. Checked before orbax reads it: orbax would find no metadata and return, leaving tensorstore
    reads that call back into its closed event loop and print a traceback after the one-line error."""
    dirs = [d for d in [os.path.join(item_dir, "d"), *glob.glob(os.path.join(item_dir, "ocdbt.process_*", "d"))]
            if os.path.isdir(d)]
    return bool(dirs) and not any(os.listdir(d) for d in dirs)


def _saved_shapes(item_dir: str) -> dict[str, tuple[int, ...]]:
    """{array name: shape} of the pytree saved in `item_dir` (from orbax's metadata, no arrays read)."""
    with ocp.StandardCheckpointer() as checkpointer:  # closed here, not whenever the collector gets to it
        metadata = checkpointer.metadata(os.path.abspath(item_dir)).item_metadata  # orbax: absolute paths only
    return {m.name: tuple(m.shape) for m in jax.tree.leaves(metadata)}


def _shapes(abstract_tree: Any) -> dict[str, tuple[int, ...]]:
    return {leaf_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract_tree)[0]}


def _same_layout(item_dir: str, abstract_tree: Any) -> bool:
    """Whether `item_dir` holds exactly the arrays (names, shapes) of `abstract_tree`."""
    try:
        return os.path.isdir(item_dir) and _saved_shapes(item_dir) == _shapes(abstract_tree)
    except Exception:  # noqa: BLE001 - unreadable metadata: start fresh diagnostics, never fail the resume
        return False


# ----------------------------------------------------------------------------- saving


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("eqtrain", "jax", "jaxlib", "equinox", "optax", "orbax-checkpoint"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class Checkpointer:
    """Saves a run's state at the configured iterations, on demand (preemption, end of a
    segment) and at new best val/loss, asynchronously; `close` waits for pending writes (and, with
    checkpoint.remote, for their uploads)."""

    def __init__(self, cfg: CheckpointConfig, config_dict: dict, model_config: dict, warn: Callable[[str], None],
                 eval_view: Callable[[Any], Any] | None = None, frozen: frozen_ref.FrozenPart | None = None):
        _quiet_orbax()
        self.cfg = cfg
        self._warn = warn
        self._frozen = frozen  # LoRA's base: saved by reference while it is what the run started from
        self._eval_view = eval_view  # state -> the model to evaluate, saved as `eval_model` (optimizer.eval_view)
        self._config = {k: v for k, v in config_dict.items() if k != "hydra"}
        self._model = model_config
        remove_incomplete(cfg.save_path, warn)
        self._manager = _manager(cfg.save_path, cfg)
        self._best = _manager(os.path.join(cfg.save_path, "best"), cfg, best=True) if cfg.keep_best else None
        # checkpoint.remote: uploaders of each completed checkpoint (process 0; boto3 is imported only then)
        self._mirror = _mirror(cfg, self._manager, best=False)
        self._best_mirror = _mirror(cfg, self._best, best=True) if self._best is not None else None
        self.best_val = math.inf  # carried over from best/ when a run resumes
        self._extra: dict[str, Callable[[], Any]] = {}  # more manifest entries, e.g. the sinks' state
        if self._best is not None and self._best.latest_step() is not None:
            best_dir = step_path(os.path.join(cfg.save_path, "best"), self._best.latest_step())
            self.best_val = read_json(os.path.join(best_dir, "manifest", MANIFEST_FILE)).get("metrics", {}).get(
                "val/loss", math.inf)

    def add_to_manifest(self, name: str, value: Callable[[], Any]) -> None:
        """Every later manifest gets `name: value()` (JSON), read back from Source.manifest on resume."""
        self._extra[name] = value

    def due(self, step: int) -> bool:
        at = self.cfg.save_at
        return step in at if at is not None else step % self.cfg.save_steps == 0

    def _args(self, step: int, state, data_state: dict, metrics: dict, reason: str) -> ocp.args.Composite:
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "reason": reason,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "unix_time": time.time(),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)},
            "data": data_state,
            "model": self._model,
            "devices": jax.device_count(),
            "versions": _versions(),
            **{name: value() for name, value in self._extra.items()},
        }
        to_save = {"model": state.model, **({EVAL_MODEL: self._eval_view(state)} if self._eval_view else {})}
        if self._by_reference(to_save.values()):
            to_save = {name: self._frozen.trained(m) for name, m in to_save.items()}
            manifest[frozen_ref.MANIFEST_KEY] = self._frozen.manifest()
        # The step metrics' states (the diagnostics' buffers) when the run keeps some: they resume exactly too.
        metric_states = _arrays(state.metric_states)
        extra = {"metric_states": ocp.args.PyTreeSave(metric_states)} if metric_states else {}
        if EVAL_MODEL in to_save:
            extra[EVAL_MODEL] = ocp.args.PyTreeSave(_arrays(to_save[EVAL_MODEL]))
        if getattr(state, "loss_scale", None) is not None:  # float16 runs: the scale resumes exactly too
            extra["loss_scale"] = ocp.args.PyTreeSave(_arrays(state.loss_scale))
        return ocp.args.Composite(
            model=ocp.args.PyTreeSave(_arrays(to_save["model"])),
            opt_state=ocp.args.PyTreeSave(_arrays(state.opt_state)),
            progress=ocp.args.PyTreeSave({"step": state.step, "key": state.key}),
            manifest=ocp.args.JsonSave(manifest),
            config=YamlSave(self._config),
            **extra,
        )

    def _by_reference(self, models) -> bool:
        """Whether this save leaves the frozen arrays out: the run has some, and each model to save
        still holds them as the run started (else, once, a warning and full checkpoints from here on)."""
        if self._frozen is None:
            return False
        if all(self._frozen.unchanged(m) for m in models):
            return True
        self._warn("the frozen LoRA base changed during training (it should not: please report it); "
                   "checkpoints from here on hold the whole model, not only the factors")
        self._frozen = None
        return False

    def save(self, step: int, state, data_state: dict, metrics: dict, reason: str) -> bool:
        """Start writing iter_{step} (returns once the arrays are off the device); False if a
        checkpoint of that step already exists."""
        if step in self._manager.all_steps():
            return False
        args = self._args(step, state, data_state, metrics, reason)
        # Inside a comparison process (memory.holding()), also kept in memory for the runs that restore it next.
        memory.keep(step_path(self.cfg.save_path, step),
                    {name: a.item for name, a in args.items() if isinstance(a, ocp.args.PyTreeSave)})
        self._manager.save(step, args=args, force=True)
        if self._mirror is not None:
            self._mirror.submit(step)
        return True

    def maybe_save_best(self, step: int, state, data_state: dict, metrics: dict) -> bool:
        val = metrics.get("val/loss")
        if self._best is None or val is None or not val < self.best_val or step in self._best.all_steps():
            return False
        self.best_val = val
        self._best.save(step, args=self._args(step, state, data_state, metrics, "best"),
                        metrics={"val/loss": val}, force=True)
        if self._best_mirror is not None:
            self._best_mirror.submit(step)
        return True

    def writing(self) -> bool:
        """True while an asynchronous save is still writing files (or, with checkpoint.remote, uploading them)."""
        return self._manager.is_saving_in_progress() or (self._mirror is not None and self._mirror.busy())

    def wait(self) -> None:
        self._manager.wait_until_finished()
        if self._best is not None:
            self._best.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()
        if self._best is not None:
            self._best.close()
        for mirror in (self._mirror, self._best_mirror):  # the last checkpoints reach the remote before the run ends
            if mirror is not None:
                mirror.close()
