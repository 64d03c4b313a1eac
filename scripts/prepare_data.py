"""Tokenize a corpus once into memory-mappable token files, for `dataset=memmap` (nanoGPT's prepare.py).

    python scripts/prepare_data.py dataset=hf dataset.path=openwebtext tokenizer=hf tokenizer.name_or_path=gpt2 \\
        out=data/owt
    python scripts/prepare_data.py dataset=text_files 'dataset.paths=[data/*.txt]' out=data/mine
    python train_jax.py dataset=memmap dataset.path=data/owt tokenizer=hf tokenizer.name_or_path=gpt2

Every argument is a Hydra override exactly as for `train_jax.py` (the same conf/, the same checks):
`dataset=...` picks the text source and its split, `tokenizer=...` the tokenizer. Three knobs are
this script's own, taken out before the config is composed:

    out=DIR        (required) the directory to write, relative to the working directory
    workers=N      processes that tokenize (default: every CPU core)
    force=false    true replaces an existing DIR written by an earlier prepare_data

DIR gets train.bin and val.bin (each document's ids followed by the eot id; raw little-endian
uint16 when the vocabulary fits, else uint32) and meta.json (tokenizer name and fingerprint,
vocab_size, eot_id, dtype, tokens and documents per split, the dataset section). It is written
into a temporary directory beside DIR and renamed at the end: a killed run leaves no half dataset.

Train with the same tokenizer knobs: the memmap source compares the tokenizer's fingerprint with
meta.json's and refuses another. tokenizer=bpe is refused here: it is trained on text, which a run
on token files does not have; use tokenizer=byte or any Hugging Face tokenizer (tokenizer=hf,
also a local directory). dataset=chat is refused too: its loss mask (the assistant's turns only)
does not fit token files; train on it with dataset=chat, which caches its tokens and masks itself.
A bad knob exits 2 with one line, before any document is read.
"""

from __future__ import annotations

import os
import sys

# Run as `python scripts/prepare_data.py`, Python puts scripts/ on sys.path, not the repo root;
# the editable install would find the packages, but only those of the checkout it was made from.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import time
from dataclasses import dataclass

from utils.cli import script_argv
from utils.errors import ConfigError, EqtrainError

KNOBS = ("out", "workers", "force")


@dataclass(frozen=True)
class PrepareConfig:
    out: str  # as typed (shown in messages); `path` is the resolved one
    path: str
    workers: int
    force: bool = False


def split_argv(argv: list[str]) -> tuple[PrepareConfig, list[str]]:
    """(this script's knobs, Hydra's overrides). Ours are read as typed, not by Hydra's override
    grammar, which refuses paths such as out=~/data/owt."""
    from utils.files import user_path

    ours = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in KNOBS and "=" in a)
    theirs = [a for a in argv if not ("=" in a and a.split("=", 1)[0] in KNOBS)]
    for a in theirs:
        if a.startswith("-"):
            raise ConfigError(f"{a}: prepare_data.py takes Hydra overrides and out=/workers=/force= only (no flags, "
                              "no multirun); see `python scripts/prepare_data.py --help`")
    out = ours.get("out", "")
    if not out:
        raise ConfigError("out is missing: give the directory to write, e.g. out=data/owt")
    workers = ours.get("workers", str(os.cpu_count() or 1))
    if not workers.isdigit() or int(workers) < 1:
        raise ConfigError(f"workers={workers} must be a positive integer (processes that tokenize)")
    force = ours.get("force", "false").lower()
    if force not in ("true", "false"):
        raise ConfigError(f"force={ours['force']} must be true or false")
    return PrepareConfig(out, user_path(out), int(workers), force == "true"), theirs


def compose_run(overrides: list[str]):
    """conf/ composed with the overrides and validated, as train_jax.py does it."""

    from utils.config import compose_overrides, validate

    cfg = compose_overrides(overrides, "prepare_data")
    return validate(cfg)


def prepare(run, knobs: PrepareConfig, progress_stream=None) -> dict:
    """Tokenize the run's dataset into knobs.path; returns meta.json's contents plus `seconds`."""
    from loaders.sources.memmap import check_out, write_dataset

    check_out(knobs.path, knobs.force, knobs.out)  # before reading anything
    if run.tokenizer.needs_documents:
        raise ConfigError(f"tokenizer={type(run.tokenizer).name} is trained on the corpus, and a run on token files "
                          "(dataset=memmap) cannot rebuild it: use tokenizer=byte or tokenizer=hf "
                          "(any Hugging Face tokenizer, a local directory too)")
    source = run.dataset.source
    if getattr(source, "loss_masked", False):
        raise ConfigError(f"dataset={run.dataset.name} trains on part of each record only (its loss mask), which token "
                          f"files cannot hold: dataset=memmap would train on every token; train it with "
                          f"dataset={run.dataset.name} directly (its tokens are cached after the first run)")
    if not hasattr(source, "documents"):
        raise ConfigError(f"dataset={run.dataset.name} has no text documents to tokenize: choose a text source, "
                          "e.g. dataset=text_files 'dataset.paths=[data/*.txt]'")
    train_docs, val_docs = source.documents()
    tok = run.tokenizer.build(train_docs, run.cache_dir)
    cfg = run.config_dict or {}
    start = time.monotonic()
    meta = write_dataset(knobs.path, {"train": train_docs, "val": val_docs}, tok, knobs.workers, force=knobs.force,
                         shown=knobs.out, progress_stream=progress_stream,
                         extra_meta={"tokenizer_config": cfg.get("tokenizer"), "dataset": cfg.get("dataset")})
    return {**meta, "seconds": time.monotonic() - start}


def summary(meta: dict, knobs: PrepareConfig) -> str:
    from loaders.sources.memmap import tokenizer_overrides

    total = meta["train_tokens"] + meta["val_tokens"]
    splits = ", ".join(f"{s} {meta[f'{s}_tokens']:,} tokens ({meta[f'{s}_documents']:,} documents)"
                       for s in ("train", "val"))
    return (f"wrote {knobs.out}: {splits}; {meta['dtype']}, tokenizer {meta['tokenizer']}; "
            f"{total / max(meta['seconds'], 1e-9):,.0f} tokens/s with {knobs.workers} workers "
            f"({meta['seconds']:.1f} s)\n"
            f"train with: python train_jax.py dataset=memmap dataset.path={knobs.out} "
            f"{tokenizer_overrides(meta['tokenizer_config'])}")


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv, __doc__)
    if argv is None:
        return 0
    knobs = None
    try:
        knobs, overrides = split_argv(argv)
        run = compose_run(overrides)
        meta = prepare(run, knobs)
    except (EqtrainError, OSError) as e:
        from utils.script_errors import script_error

        return script_error(e, where=knobs.out if knobs else "out", hint="check out= and the disk")
    print(summary(meta, knobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
