"""The export options' refusals (dtype, shard size) written once for their two spellings:
scripts/export_model.py's flags (`--dtype`, `--max-shard-size`, `--format`) and a run's own export
knobs (`checkpoint.export_dtype`, `checkpoint.export_max_shard_size`, `checkpoint.export`;
trainer/run_export.py). Each refusal is one ConfigError line naming the option as the user wrote it.
"""

from __future__ import annotations

from typing import NamedTuple

from models import hf_generation, hf_shards
from utils.errors import ConfigError


class Names(NamedTuple):
    """How one side spells the export options, so a refusal names what the user typed."""

    format: str  # the option that picks the format
    dtype: str
    max_shard_size: str
    assign: str  # between an option and its value: " " for a flag, "=" for a knob
    default_dtype: str  # how to ask for the default dtype
    add: str  # the verb that adds an option: "add" a flag, "set" a knob

    def said(self, option: str, value) -> str:
        return f"{option}{self.assign}{value}"


FLAGS = Names("--format", "--dtype", "--max-shard-size", " ", "leave it out", "add")
KNOBS = Names("checkpoint.export", "checkpoint.export_dtype", "checkpoint.export_max_shard_size", "=", "null", "set")


def check(fmt: str, dtype: str | None, max_shard_size: str | int | None, names: Names) -> int | None:
    """Refuse an unknown dtype, and a shard size that is not a size or not for the hf format, naming
    the options by `names`. Returns the shard size in bytes (None: one file)."""
    if dtype is not None and dtype not in hf_generation.DTYPES:
        raise ConfigError(f"{names.said(names.dtype, dtype)} is not an export dtype: use "
                          f"{', '.join(hf_generation.DTYPES)}, or {names.default_dtype} for the model.init_from "
                          "base's dtype or the run's train.param_dtype")
    if max_shard_size is None:
        return None
    if fmt != "hf":
        raise ConfigError(f"{names.max_shard_size} applies to {names.said(names.format, 'hf')} (transformers' "
                          f"shards), not {names.said(names.format, fmt)}: {names.add} "
                          f"{names.said(names.format, 'hf')} or drop {names.max_shard_size}")
    return hf_shards.parse_size(max_shard_size, names.max_shard_size)
