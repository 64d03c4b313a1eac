"""The weights of a Hugging Face export as transformers' `save_pretrained` lays them out: one
`model.safetensors`, or, above `--max-shard-size`, shards `model-00001-of-0000N.safetensors` and
`model.safetensors.index.json` (`{"metadata": {"total_parameters", "total_size"}, "weight_map":
{tensor: shard}}`, keys sorted, indent 2). The split is huggingface_hub's
`split_state_dict_into_shards_factory`, the one `save_pretrained` calls: tensors in order, a new
shard when the next would pass the limit, a tensor larger than the limit alone in its own shard.

A size is transformers' notation (`5GB`, `500MB`, `1.5GB`: units of 1000; `5GiB`: of 1024) or
a number of bytes (`2000000`).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from utils.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # transformers' shard names (save_pretrained)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, knob: str = "--max-shard-size") -> int:
    """A shard size in bytes from `5GB` / `500MB` / `5GiB` / `2000000`; one-line ConfigError naming `knob`."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"{knob}={text!s} is not a size: write a number of bytes or one with a unit "
                              "(KB, MB, GB, TB of 1000; KiB, MiB, GiB of 1024), e.g. 5GB or 500MB")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise ConfigError(f"{knob}={text!s} must be positive: e.g. 5GB (transformers' default is 50GB)")
    return size


def split(tensors: dict[str, np.ndarray], max_shard_size: int | None) -> dict[str, list[str]]:
    """file name -> the tensor names it holds: {model.safetensors: all} when everything fits (or no limit)."""
    if max_shard_size is None:
        return {WEIGHTS_FILE: list(tensors)}
    from huggingface_hub import split_state_dict_into_shards_factory

    # in module order, as a state dict is: block 2 before block 10, each block's tensors together
    ordered = {k: tensors[k] for k in sorted(tensors, key=_natural)}
    plan = split_state_dict_into_shards_factory(ordered, get_storage_size=lambda x: x.nbytes,
                                                filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_shard_size)
    return plan.filename_to_tensors


def _natural(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def write(out_dir: str, tensors: dict[str, np.ndarray], max_shard_size: int | None = None) -> list[str]:
    """The weights in OUT_DIR (a scratch directory that is renamed whole: models/hf.py): one file, or
    shards and their index. Returns the file names written."""
    from safetensors.numpy import save_file

    plan = split(tensors, max_shard_size)
    for name, keys in plan.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(out_dir, name), metadata={"format": "pt"})  # "pt":
        # transformers refuses other formats
    if len(plan) == 1:
        return list(plan)
    index = {"metadata": {"total_parameters": int(sum(x.size for x in tensors.values())),
                          "total_size": int(sum(x.nbytes for x in tensors.values()))},
             "weight_map": {k: name for name, keys in plan.items() for k in keys}}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as save_pretrained writes it
    return [*plan, INDEX_FILE]


def is_weights_file(name: str) -> bool:
    """A file name of an export's weights, in either layout (what a --force export replaces)."""
    return name in (WEIGHTS_FILE, INDEX_FILE) or SHARD.fullmatch(name) is not None
