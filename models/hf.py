"""The Hugging Face round trip at the directory level: a model written as a `transformers` directory
(`save_hf`: `AutoModelForCausalLM.from_pretrained(dir)` loads it offline) and read back
(`load_hf`), and a run started from one (`model.init_from`, through `build_from_hf`).

Which family a directory holds is its config.json's `model_type`, matched against each family
module's `HF_MODEL_TYPES`; the family converts config and tensors both ways:

    HF_MODEL_TYPES                     e.g. ("gpt2",)
    hf_config(cfg) -> dict             config.json's model fields (model_type, architectures, ...)
    HF_KEYS                            the config.json keys it reads: kind, required or default
                                       (models/hf_keys.py checks them before a Config is built)
    config_from_hf(hf, base, where)    -> Config shape knobs from config.json, execution knobs from
                                       `base`; one-line ConfigError naming `where` (the file) and the
                                       key that is missing, mistyped or that it cannot represent
    hf_tensors(model) -> {name: array} Hugging Face key names and layouts
    from_hf_tensors(cfg, tensors)      -> Model; CheckpointError naming a missing/misshapen tensor
    HF_MOE (optional, default False)   whether hf_config writes MoE blocks (the llama family: mixtral,
                                       qwen2_moe, qwen3_moe, olmoe; models/hf_moe.py); else they are refused

(models/contract.py: OPTIONAL holds these members' defaults, HF_HOOKS the ones HF_MODEL_TYPES requires.)

This module owns only the files: JSON, safetensors (one file or a sharded index), the tokenizer
files, atomic writes. Torch is never imported: safetensors' numpy reader and writer suffice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import models
from models import hf_generation, hf_shards, hf_tokenizer
from models.contract import hf_support, optional
from models.hf_keys import json_text
from models.hf_moe import MOE_MODEL_TYPES
from models.hf_tokenizer import hf_tokenizer_object
from utils import files
from utils.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE, INDEX_FILE = hf_shards.WEIGHTS_FILE, hf_shards.INDEX_FILE
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # either marks a directory that has a tokenizer
# The knobs a run keeps from its own yaml when it starts from a directory: how the model executes, not its shape.
EXECUTION_KNOBS = ("dropout", "scan_blocks", "remat", "scan_unroll", "attn_block_size", "vocab_multiple",
                   "init_from", "name")


# ----------------------------------------------------------------------------- which family


def hf_families() -> dict[str, ModuleType]:
    """model_type -> family module, for every registered family that has a Hugging Face form."""
    return {t: m for m in models.MODELS.values() for t in optional(m, "HF_MODEL_TYPES")}


def read_hf_config(path: str) -> dict:
    """PATH/config.json as a dict; one-line errors for a missing directory or file or bad JSON."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory: point it at a local Hugging Face model directory "
                          "(one holding config.json and model.safetensors)")
    where = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(where):
        raise ConfigError(f"{where} is missing: a Hugging Face model directory holds config.json "
                          "(save one with save_pretrained or scripts/export_model.py --format hf)")
    if not os.path.isfile(where):
        raise ConfigError(f"{where} is not a file (a directory, or a link to nothing): a Hugging Face model "
                          "directory holds config.json as a JSON file; copy the directory again")
    try:
        with open(where, encoding="utf-8") as f:
            hf = json.load(f)
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror or type(e).__name__}): make it readable") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{where} is not valid JSON ({reason}): save the model again") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{where} holds {type(hf).__name__}, not a JSON object: save the model again")
    return hf


def family_of(path: str, hf: dict) -> ModuleType:
    """The family module of a directory's config.json, or one line naming the supported types."""
    supported = hf_families()
    model_type = hf.get("model_type")
    where = os.path.join(path, CONFIG_FILE)
    if "model_type" not in hf:
        raise ConfigError(f"{where} model_type is missing: it names the architecture; eqtrain loads "
                          f"{', '.join(sorted(supported))}; save the directory again with save_pretrained")
    if not isinstance(model_type, str) or model_type not in supported:
        raise ConfigError(f"{where} has model_type={json_text(model_type)}, which eqtrain cannot "
                          f"load: supported model types are {', '.join(sorted(supported))}")
    return supported[model_type]


def config_from_dir(path: str, base) -> tuple[Any, dict]:
    """(the family's Config from PATH/config.json, execution knobs from `base`; the raw config.json)."""
    hf = read_hf_config(path)
    try:
        if hf.get("model_type") not in MOE_MODEL_TYPES:  # an MoE directory sets model.moe itself
            refuse_moe(base, "a Hugging Face directory of dense blocks cannot be loaded into MoE blocks")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg = family_of(path, hf).config_from_hf(hf, base, os.path.join(path, CONFIG_FILE))  # its errors name the file
    return cfg, hf


def refuse_moe(cfg, what: str) -> None:
    """Mixture-of-Experts blocks where the Hugging Face side has dense MLPs (a dense directory, a
    family with no MoE model type, a PEFT adapter): one line."""
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.on:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts}: {what} (gpt2, llama, mistral, qwen2 and "
                          f"qwen3 have dense MLPs; {', '.join(MOE_MODEL_TYPES)} are a llama's MoE forms): set "
                          "model.moe.num_experts=0, or use eqtrain's own export format")


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


_MODEL_YAMLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model")


def family_yamls(name: str) -> list[str]:
    """The conf/model/*.yaml that name `name` as their family (for the fix in a mismatch error)."""
    from omegaconf import OmegaConf

    if not os.path.isdir(_MODEL_YAMLS):
        return []
    return sorted(f[:-5] for f in os.listdir(_MODEL_YAMLS)
                  if f.endswith(".yaml") and OmegaConf.load(os.path.join(_MODEL_YAMLS, f)).get("name") == name)


def resolve_init_from(cfg, prefix: str = "model") -> tuple[Any, tuple[str, ...], str | None]:
    """The config boundary's part of `model.init_from` (utils/config.py): the path made absolute and
    checked (directory, config.json, a supported family matching the run's model yaml, shapes), the
    shape knobs replaced by the directory's. Returns (config, notes for the run header, the directory
    when it holds a tokenizer, which then becomes the run's)."""
    path = files.user_path(cfg.init_from)
    knob = f"{prefix}.init_from={cfg.init_from}"
    try:
        hf = read_hf_config(path)
        fam = family_of(path, hf)
    except ConfigError as e:
        raise ConfigError(f"{knob}: {e}") from None
    if fam is not models.family(cfg):
        name = next(k for k, m in models.MODELS.items() if m is fam)
        right = family_yamls(name) or [f"<a conf/model yaml with name: {name}>"]
        raise ConfigError(f"{knob} holds a {name} model (model_type {hf.get('model_type')!r}) but model= picks "
                          f"a {cfg.name} config: use model={' or model='.join(right)}")
    try:
        if hf.get("model_type") not in MOE_MODEL_TYPES:  # an MoE directory sets model.moe itself
            refuse_moe(cfg, "a run cannot start its MoE blocks from a Hugging Face directory of dense blocks")
        new = fam.config_from_hf(hf, dataclasses.replace(cfg, init_from=path), os.path.join(path, CONFIG_FILE))
        new.check(prefix)
        hf_generation.read_base(path, hf)  # bos/eos/pad and generation_config.json, carried to the export
    except ConfigError as e:
        raise ConfigError(f"{knob}: {e}") from None
    try:
        check_shapes(new, path)
    except CheckpointError as e:
        raise CheckpointError(f"{knob}: {e}") from None
    # A null knob the directory resolves (vocab_size, num_kv_heads) is no change; a null section it
    # fills (model.rope_scaling: the directory's scaling where the yaml has none) is one.
    changed = [f"{prefix}.{f.name} {getattr(cfg, f.name)} -> {getattr(new, f.name)}"
               for f in dataclasses.fields(cfg) if f.name != "init_from"
               and (getattr(cfg, f.name) is not None or dataclasses.is_dataclass(getattr(new, f.name)))
               and getattr(cfg, f.name) != getattr(new, f.name)]
    notes = (f"{knob}: the model's shape comes from {os.path.join(path, CONFIG_FILE)}, replacing the yaml's "
             + ", ".join(changed),) if changed else ()
    return new, notes, path if has_tokenizer(path) else None


# ----------------------------------------------------------------------------- tensors


class Tensors(Mapping):
    """PATH's safetensors (one file, or the shards model.safetensors.index.json lists) as a mapping of
    name -> numpy array that reads one tensor per lookup, its floats cast to `dtype` (the run's
    train.param_dtype, float32 by default): the directory is never held whole, in float32 or at all.
    Each read opens its shard anew (safe_open reads the header; the file's mapped pages are given
    back when it closes). numpy, not flax: this runs inside the init program's pure_callbacks, where
    a JAX array (a device_put needing XLA's threads, all waiting on _READ_LOCK) deadlocks a model of
    some MB. bfloat16 reads as ml_dtypes' (safetensors >= 0.8)."""

    def __init__(self, path: str, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._shard: dict[str, str] = {}  # tensor name -> its file, from the headers alone
        for shard in _shards(path):
            with _reading(shard) as f:
                self._shard.update(dict.fromkeys(f.keys(), shard))

    def __getitem__(self, name: str) -> np.ndarray:
        shard = self._shard[name]  # KeyError for a name the directory lacks, as a dict's
        with _reading(shard) as f:
            x = np.asarray(f.get_tensor(name))
        return x.astype(self.dtype, copy=False) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def __iter__(self):
        return iter(self._shard)

    def __len__(self) -> int:
        return len(self._shard)


@contextlib.contextmanager
def _reading(shard: str):
    """safe_open(shard) with its errors (a bad header, a truncated file) as one CheckpointError line."""
    from safetensors import safe_open

    try:
        with safe_open(shard, framework="numpy") as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise CheckpointError(f"{shard} cannot be read ({type(e).__name__}: {e}): save the model again") from None


def read_tensors(path: str, dtype=np.float32) -> Tensors:
    """Every tensor of PATH's safetensors, read when looked up, floats as `dtype` (a bfloat16 or
    float16 directory becomes the float32, or the train.param_dtype, the run uses)."""
    return Tensors(path, dtype)


def _shards(path: str) -> list[str]:
    """PATH's safetensors files: model.safetensors, or the shards its index lists (each checked to exist)."""
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        shards = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} has no readable weight_map ({type(e).__name__}): save the model again") \
                from None
        shards = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    else:
        raise CheckpointError(f"{path} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}: save the model with "
                              "safe_serialization (transformers' default) or export it again")
    for shard in shards:
        if not os.path.isfile(shard):
            raise CheckpointError(f"{shard} is missing (listed in {INDEX_FILE}): copy the whole directory")
    return shards


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in PATH's safetensors, from the headers alone (no weights read)."""
    shapes = {}
    for shard in _shards(path):
        with _reading(shard) as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def tensor_dtypes(path: str) -> set[str]:
    """The dtypes (safetensors' names: F32, BF16, F16, I64, ...) of PATH's tensors, from the headers alone."""
    found = set()
    for shard in _shards(path):
        with _reading(shard) as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    return found


def check_shapes(cfg, path: str) -> None:
    """The family's tensor checks (names, shapes) run on zero-stride stand-ins of the headers' shapes:
    a misfit directory fails at the config boundary, before any weight is read or anything compiles."""
    stand_ins = {k: np.broadcast_to(np.zeros((), np.float32), s) for k, s in tensor_shapes(path).items()}
    models.family(cfg).from_hf_tensors(cfg, stand_ins)


def fill(cfg, named: dict[str, np.ndarray], where: str, dtype=None):
    """A `cfg` model whose arrays are `named` (keyed by our pytree paths, `blocks.ln1.gain_D`), shapes
    checked against the model `cfg` describes; `where` names the file in errors. For the families'
    `from_hf_tensors`, after they have mapped Hugging Face names and layouts to ours. Float arrays
    become `dtype` (the reader's: `Tensors.dtype`), or the model's own (float32) when None."""
    from utils.checkpoint.storage import leaf_name

    # the key made under the trace: a concrete one would be a device transfer (see _READ_LOCK)
    shapes = eqx.filter_eval_shape(lambda: models.family(cfg).Model(cfg, jax.random.PRNGKey(0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    filled = []
    for p, x in leaves:
        name = leaf_name(p)
        if name not in named:
            raise CheckpointError(f"{where} lacks the tensor for {name}: the directory is incomplete, save it again")
        if tuple(named[name].shape) != tuple(x.shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(named[name].shape)}, config.json's model needs "
                                  f"{tuple(x.shape)}: config.json and the weights come from different models")
        floating = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        filled.append(np.asarray(named.pop(name), dtype=dtype if floating else x.dtype))  # popped: no second copy
    return jax.tree_util.tree_unflatten(treedef, filled)


def expect(tensors: Mapping[str, np.ndarray], name: str, shape: tuple, where: str) -> np.ndarray:
    """tensors[name] (read once), or a CheckpointError naming the missing or misshapen Hugging Face tensor."""
    if name not in tensors:
        raise CheckpointError(f"{where} lacks {name}: the directory is incomplete or of another architecture")
    x = tensors[name]
    if tuple(x.shape) != tuple(shape):
        raise CheckpointError(f"{where}: {name} has shape {tuple(x.shape)}, config.json says "
                              f"{tuple(shape)}: config.json and the weights come from different models")
    return x


# ----------------------------------------------------------------------------- load


def load_hf(path: str, base_cfg) -> tuple[Any, eqx.Module]:
    """(config, model) of a local Hugging Face directory: config.json's model_type picks the family,
    its shape knobs replace `base_cfg`'s (execution knobs kept), the safetensors fill the arrays (float32)."""
    cfg, _ = config_from_dir(path, base_cfg)
    return cfg, _host_model(cfg, path, np.float32)


def _host_model(cfg, path: str, dtype) -> eqx.Module:
    """The directory's model as host numpy, float arrays in `dtype`, read one tensor at a time."""
    return models.family(cfg).from_hf_tensors(cfg, read_tensors(path, dtype))


def _host_leaves(cfg, path: str, dtype) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(_host_model(cfg, path, dtype))]


# XLA may run the per-leaf callbacks on several threads at once. Everything under the lock is numpy:
# a JAX computation there would wait for XLA threads that are waiting for the lock.
_READ_LOCK = threading.Lock()


class _Handover:
    """One build's host arrays, each given to its leaf's callback once and then dropped, so no copy
    of the weights outlives the init program's run (the arrays live on as the program's results).
    A leaf asked for again (the same program run a second time) reads the directory again."""

    def __init__(self, cfg, path: str, dtype):
        self.cfg, self.path, self.dtype = cfg, path, dtype
        self.held: list[np.ndarray | None] | None = None

    def take(self, i: int) -> np.ndarray:
        with _READ_LOCK:
            if self.held is None or self.held[i] is None:
                self.held = list(_host_leaves(self.cfg, self.path, self.dtype))
            x, self.held[i] = self.held[i], None
            if all(h is None for h in self.held):
                self.held = None
            return x


def build_from_hf(cfg, key: jax.Array, param_dtype=None) -> eqx.Module:
    """The model of `cfg` with its arrays read from cfg.init_from (`models.build`'s branch), float
    arrays in `param_dtype` (train.param_dtype; float32 when None) as they are read.

    Each array is a `jax.pure_callback`, so under `eval_shape` (the abstract model, a resumed run's
    restore target) nothing is read, and under `jit` (the run's sharded init) the arrays arrive as
    the program's results rather than as constants baked into it. The directory is read once per
    run of that program, one tensor at a time in the target dtype, and nothing is cached after it
    (`_Handover`): host memory peaks at about one host copy of the model in its training dtype."""
    del key  # the directory's weights, not a random draw
    shapes = eqx.filter_eval_shape(models.family(cfg).Model, dataclasses.replace(cfg, init_from=None),
                                   jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(shapes)
    dtype = jnp.dtype(param_dtype or jnp.float32)
    out = [jax.ShapeDtypeStruct(x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype) for x in leaves]
    handover = _Handover(cfg, cfg.init_from, dtype)

    def leaf(i: int):
        read = lambda: np.asarray(handover.take(i), dtype=out[i].dtype)
        return jax.pure_callback(read, out[i])

    return jax.tree.unflatten(treedef, [leaf(i) for i in range(len(leaves))])


# ----------------------------------------------------------------------------- save


def hf_dir_config(model: eqx.Module, tokenizer=None, generation: dict | None = None, dtype: str = "float32") -> dict:
    """config.json: the family's model fields plus what transformers reads to load it offline (the
    weights' `dtype`, which `from_pretrained`'s default dtype="auto" loads them in), and the special
    ids of `generation` (models/hf_generation.py; None: the tokenizer's, if any)."""
    if not hf_support(models.family(model)):
        raise ConfigError(f"the {model.cfg.name} family has no Hugging Face layout (models/contract.py: it declares no "
                          "HF_MODEL_TYPES): export with --format safetensors")
    if not optional(models.family(model), "HF_MOE"):  # the llama family writes its MoE types (models/hf_moe.py)
        refuse_moe(model.cfg, "this family's MoE blocks cannot be exported as a Hugging Face directory")
    hf = {**models.family(model).hf_config(model.cfg), "torch_dtype": dtype, "dtype": dtype}
    if generation is None and tokenizer is not None:
        generation = hf_generation.from_tokenizer(tokenizer)
    if generation is not None:
        hf.update(hf_generation.config_ids(generation))
    return hf


def as_dtype(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float tensors cast to `dtype` (float32, bfloat16, float16: round to nearest even, as torch's
    .to()), C-contiguous for the safetensors writer; integer ones as they are."""
    target = jnp.dtype(dtype)  # ml_dtypes' bfloat16, which numpy and safetensors' numpy writer take
    return {k: np.ascontiguousarray(np.asarray(v).astype(target) if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)
                                    else np.asarray(v)) for k, v in tensors.items()}


def save_hf(out_dir: str, model: eqx.Module, tokenizer=None, generation: dict | None = None, dtype: str = "float32",
            max_shard_size: int | None = None) -> list[str]:
    """Write OUT_DIR as a transformers directory (config.json, the weights in `dtype` as one
    model.safetensors or, above `max_shard_size` bytes, transformers' shards (models/hf_shards.py)
    and, with a tokenizer, its files), all in a scratch directory renamed into place
    (utils.files.atomic_dir: a failure leaves OUT_DIR as it was). Returns the file names. `tokenizer`
    is the run's built tokenizer (loaders.tokenizers; None: no tokenizer files): AutoTokenizer then
    encodes as it does (models/hf_tokenizer.py, which may add tokenization_eqtrain.py). `generation`
    (a run's manifest entry, models/hf_generation.py; None: the tokenizer's ids) gives config.json's
    special ids and generation_config.json (written when there are ids: a tokenizer or `generation`)."""
    if generation is None and tokenizer is not None:
        generation = hf_generation.from_tokenizer(tokenizer)
    config = hf_dir_config(model, tokenizer, generation, dtype)  # first: its refusals come before any file is written
    tensors = as_dtype(models.family(model).hf_tensors(model), dtype)
    with files.atomic_dir(out_dir, replaces=hf_shards.is_weights_file) as scratch:
        written = hf_shards.write(scratch, tensors, max_shard_size)
        _write_json(os.path.join(scratch, CONFIG_FILE), config)
        written.append(CONFIG_FILE)
        if generation is not None:
            _write_json(os.path.join(scratch, hf_generation.FILE), hf_generation.generation_config(generation))
            written.append(hf_generation.FILE)
        written += save_tokenizer(scratch, tokenizer)
        written += hf_tokenizer.keep_run_ids(scratch, tokenizer)  # AutoTokenizer's ids = the run's
    return written


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_tokenizer(out_dir: str, tokenizer) -> list[str]:
    """The tokenizer's files in OUT_DIR (saved to a scratch directory, then each renamed into place)."""
    hf_tok = hf_tokenizer_object(tokenizer)
    if hf_tok is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=out_dir, prefix=".tokenizer.")
    try:
        hf_tok.save_pretrained(scratch)
        names = sorted(os.listdir(scratch))
        for name in names:
            os.replace(os.path.join(scratch, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return names
