"""Data for a run: tokenizers, sources of documents, tokenizing, windows and batches.

The two config sections this package owns are built here from their plain-dict yaml nodes:
`dataset_config` (a source from `SOURCES` plus the shared batch knobs) and `tokenizer_config`
(one entry of `TOKENIZERS`). A knob the chosen source or tokenizer does not have is a ConfigError
naming it, never silently ignored.
"""

from __future__ import annotations

import dataclasses

from loaders.config import BATCH_KNOBS, DatasetConfig
from loaders.sources import SOURCES
from loaders.tokenizers import TOKENIZERS
from utils.sections import build_registered, build_section


def dataset_config(node: dict, prefix: str = "dataset") -> DatasetConfig:
    """`{name: text_files, paths: [...], batch_size: 32, ...}` -> DatasetConfig whose `source` is the
    built source (here TextFiles(paths=...)) and whose other fields are the batch knobs."""
    name, source = build_registered(SOURCES, node, prefix, common=BATCH_KNOBS)
    batch = build_section(DatasetConfig, {k: node[k] for k in BATCH_KNOBS if k in node}, prefix)
    config = dataclasses.replace(batch, name=name, source=source)
    config.check_source(prefix)
    return config


def tokenizer_config(node: dict, prefix: str = "tokenizer"):
    """`{name: bpe, vocab_size: 4096, ...}` -> the built tokenizer config (here BPE(...)); its
    `build(train_docs, cache_dir)` makes the tokenizer."""
    return build_registered(TOKENIZERS, node, prefix)[1]


__all__ = ["BATCH_KNOBS", "DatasetConfig", "SOURCES", "TOKENIZERS", "dataset_config", "tokenizer_config"]
