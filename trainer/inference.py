"""A run's checkpoint opened for inference, as scripts/export_model.py and scripts/sample.py do:
their shared command line, the checkpoint with its saved run config validated on this machine, and
the model restored alone (never the optimizer state).

The export format itself (model.safetensors + config.json) is `models.export`'s; this module is the
glue between a checkpoint directory and that format. Like `utils.config`, it is a validation
boundary (a saved run's config becomes a RunConfig), so it may import upward into `models`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import equinox as eqx
from omegaconf import OmegaConf

import models
from models import attention, export, objectives
from models.export import abstract_model
from trainer.step import initial_keys
from utils import files
from utils.checkpoint import storage as ckptlib
from utils.config import RunConfig, validate
from utils.errors import CheckpointError

_ROOT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "config.yaml")


def local_cache_dir() -> str:
    """This machine's cache_dir, resolved exactly as conf/config.yaml does (EQTRAIN_CACHE or its
    default): the one saved in a checkpoint may name a directory on another machine."""
    return str(OmegaConf.load(_ROOT_CONFIG).cache_dir)


def checkpoint_parser(doc: str) -> argparse.ArgumentParser:
    """The command line both scripts start with: CHECKPOINT_DIR and --load-file."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # type=user_path: resolved once here, like checkpoint.save_path in a run (orbax needs absolute paths).
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=files.user_path,
                   help="a run's checkpoint.save_path (the directory holding iter_N/ checkpoints)")
    p.add_argument("--load-file", default="latest",
                   help="which checkpoint: iter_N, iter_N.ckpt or latest (the newest complete one; default)")
    return p


def open_for_inference(directory: str, load_file: str) -> tuple[ckptlib.Source, RunConfig]:
    """The checkpoint and its run config, validated, with this machine's cache_dir and the
    checkpoint's resolved model config (vocab_size filled in)."""
    source = ckptlib.open_checkpoint(files.user_path(directory), load_file, with_opt_state=False,
                                     names=("CHECKPOINT_DIR ", "--load-file "))
    config = dict(source.config)
    config["cache_dir"] = local_cache_dir()
    config["checkpoint"] = {}  # that run's save/resume settings; they say nothing about the model
    run = validate(config)
    model_cfg = attention.portable(models.config_from_dict(source.manifest["model"], "model"))  # cudnn: GPU only
    return source, dataclasses.replace(run, model=model_cfg)


def restore_for_inference(directory: str, load_file: str) -> tuple[ckptlib.Source, RunConfig, Any]:
    """`open_for_inference` plus the model's arrays (the optimizer state is never read); a LoRA
    checkpoint's frozen base, which it holds by reference, rebuilt as its run built it."""
    source, run = open_for_inference(directory, load_file)
    rebuild = lambda: eqx.filter_jit(models.build)(run.model, initial_keys(run.random_seed)[0],
                                                   run.train.param_dtype)
    model = ckptlib.restore_model(source, abstract_model(run.model, run.train.param_dtype), rebuild)
    return source, run, model


def check_out_dir(out_dir: str, force: bool) -> None:
    """Refuse, before anything is restored, to write into a non-empty directory without --force."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"--out {out_dir} is a file: give a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise CheckpointError(f"--out {out_dir} exists and is not empty: choose a new directory or pass --force")


def run_tokenizer(run: RunConfig):
    """The tokenizer the run trained with, rebuilt as the run built it (a BPE from its cache: the corpus
    is listed, not read, on a hit). (tokenizer, None) or (None, why not) when it cannot be rebuilt here."""
    from loaders.pipeline import source_documents
    from utils.errors import EqtrainError

    try:
        docs = source_documents(run.dataset.source, run.tokenizer.needs_documents, run.tokenizer.name)
        return run.tokenizer.build(docs[0] if docs else None, run.cache_dir), None
    except (EqtrainError, OSError) as e:
        return None, str(e)


def export_dtype(requested: str | None, run: RunConfig, generation: dict | None) -> tuple[str, str]:
    """(the dtype an export writes, why): `--dtype` if given; else the dtype of the Hugging Face base
    the run started from (`model.init_from`: the one its checkpoint's manifest recorded, or, for a
    checkpoint from before that record, the directory's as it is now); else train.param_dtype."""
    from models import hf_generation
    from models.hf import read_hf_config

    if requested is not None:
        return requested, "--dtype"
    if generation is not None and generation.get("dtype") is not None:
        return generation["dtype"], f"the dtype of the model.init_from base {run.model.init_from}"
    if run.model.init_from and os.path.isdir(run.model.init_from):
        base = hf_generation.base_dtype(run.model.init_from, read_hf_config(run.model.init_from))
        if base is not None:
            return base, f"the dtype of the model.init_from base {run.model.init_from}"
    return run.train.param_dtype, "train.param_dtype"


def refuse_non_causal(run: RunConfig, flag: str) -> None:
    """A masked-diffusion model has no Hugging Face form: transformers' causal LM would run it causally."""
    if run.objective.name != "ar":
        raise CheckpointError(f"{flag}: this model was trained with objective={run.objective.name} (bidirectional "
                              "attention); a Hugging Face causal LM would run it causally: use --format safetensors")


def write_export(out_dir: str, fmt: str, run: RunConfig, model, step: int, tokenizer_section: dict,
                 generation: dict | None, dtype: str, max_shard_size: int | None = None, tokenizer=None) -> str | None:
    """The one export writer, behind scripts/export_model.py and a run's own export (checkpoint.export,
    trainer/run_export.py), so the two write the same files: `fmt` safetensors (models.export), hf or peft
    (below). `model` is what models.for_export made of the one the run evaluates; `tokenizer_section` the
    run's saved `tokenizer` config; `tokenizer` the run's built tokenizer (None: rebuilt here, for hf).
    Returns a line saying what hf/peft wrote (None for safetensors)."""
    if fmt == "hf":
        return export_hf(out_dir, run, model, generation, dtype, max_shard_size, tokenizer)
    if fmt == "peft":
        return export_peft(out_dir, run, model, dtype)
    export.save_export(out_dir, model, step, tokenizer_section, run.context_length, objectives.as_dict(run.objective),
                       dtype)
    return None


def export_hf(out_dir: str, run: RunConfig, model, generation: dict | None = None, dtype: str = "float32",
              max_shard_size: int | None = None, tokenizer=None) -> str:
    """A run's model as a transformers directory (models.hf.save_hf), its tokenizer included where it
    can be rebuilt here (AutoTokenizer then encodes as the run did). Refuses a masked-diffusion model:
    transformers' causal LM would run it causally, not as trained. Returns a line saying which
    tokenizer files were (not) written. `generation`: the checkpoint manifest's entry (models/hf_generation.py),
    None for a checkpoint from before it (the tokenizer's ids then). `dtype`, `max_shard_size`: models.hf.save_hf's.
    `tokenizer`: the run's, built (None: rebuilt from the run's config)."""
    from models import hf

    refuse_non_causal(run, "--format hf")
    tokenizer, why = (tokenizer, None) if tokenizer is not None else run_tokenizer(run)
    names = hf.save_hf(out_dir, model, tokenizer, generation, dtype, max_shard_size)
    if hf.hf_tokenizer_object(tokenizer) is not None:
        return f"tokenizer files: {', '.join(n for n in names if n.startswith(('tokenizer', 'special')))}"
    return f"no tokenizer files: the run's tokenizer cannot be rebuilt here ({why})"


def export_peft(out_dir: str, run: RunConfig, model, dtype: str) -> str:
    """A LoRA run's factors as a PEFT adapter (models.hf_peft.save_peft) for its `model.init_from`
    base. Refused for a run from a random base: no Hugging Face directory holds it to load onto."""
    from models import hf_peft

    refuse_non_causal(run, "--format peft")
    if not run.model.init_from:
        raise CheckpointError("--format peft: this LoRA run's base is random (no model.init_from), so no Hugging Face "
                              "model holds it for the adapter: export --merge-lora --format hf instead")
    hf_peft.save_peft(out_dir, model, run.model.init_from, dtype)
    return f"a PEFT adapter for the base {run.model.init_from}"
