"""The generation metadata of a Hugging Face export: the special ids config.json carries (bos, eos,
pad; eos may be a list, as Llama-3-Instruct's [<|end_of_text|>, <|eot_id|>]) and generation_config.json
(the ids again, and sampling settings such as temperature and top_p).

A run started from a directory (`model.init_from`) carries its base's: config.json's ids (a key the
base lacks comes from the run's tokenizer) and its generation_config.json verbatim. A run from
scratch derives the ids from its tokenizer (bos and eos the end of text for the byte and BPE
tokenizers; a Hugging Face tokenizer's own bos, eos and pad) and gets a generation_config.json of
those ids. The run records them in every checkpoint's manifest (`generation`), so the export writes
what the run started with even where the base directory has changed since; a checkpoint from
before the key gets its tokenizer's.

The entry also records the base's `dtype` (its config.json's `dtype` or `torch_dtype`, else the one
float dtype of its safetensors; None for a run from scratch or a base of mixed dtypes): an export's
default `--dtype`, so a bfloat16 base fine-tuned in float32 is exported as bfloat16 again.
"""

from __future__ import annotations

import json
import os

from models.hf_keys import json_text
from utils.errors import CheckpointError, ConfigError

MANIFEST_KEY = "generation"
FILE = "generation_config.json"
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPES = ("float32", "bfloat16", "float16")  # what an export writes (--dtype)
_HEADER_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' names


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ids(ids: dict, where: str, error=ConfigError) -> None:
    """Each of bos/eos/pad in `ids` is an integer or null (eos also a non-empty list of integers)."""
    for key in ID_KEYS:
        value = ids.get(key)
        ok = value is None or _is_id(value) or (
            key == "eos_token_id" and isinstance(value, list) and value and all(_is_id(v) for v in value))
        if not ok:
            kinds = "an integer, a list of integers or null" if key == "eos_token_id" else "an integer or null"
            raise error(f"{where} has {key}={json_text(value)}: a token id is {kinds}; fix the file")


def read_base(path: str, hf: dict | None = None) -> dict:
    """PATH's generation metadata: {"ids": the bos/eos/pad keys its config.json has, "generation_config":
    its generation_config.json or None}. `hf` is config.json already read; one-line ConfigErrors name
    the file and the key."""
    if hf is None:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    ids = {k: hf[k] for k in ID_KEYS if k in hf}
    check_ids(ids, os.path.join(path, "config.json"))
    where = os.path.join(path, FILE)
    generation_config = None
    if os.path.lexists(where):
        try:
            with open(where, encoding="utf-8") as f:
                generation_config = json.load(f)
        except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"{where} cannot be read as JSON ({reason}): save the model again or delete it") \
                from None
        if not isinstance(generation_config, dict):
            raise ConfigError(f"{where} holds {type(generation_config).__name__}, not a JSON object: save the model "
                              "again or delete it")
        check_ids(generation_config, where)
    return {"ids": ids, "generation_config": generation_config}


def base_dtype(path: str, hf: dict) -> str | None:
    """The dtype PATH's weights are stored in: config.json's `dtype` (transformers 5) or `torch_dtype`,
    else the one float dtype of its safetensors headers; None if neither says one of DTYPES."""
    from models.hf import tensor_dtypes  # here: models.hf imports this module

    for key in ("dtype", "torch_dtype"):
        if hf.get(key) in DTYPES:
            return hf[key]
    floats = {_HEADER_DTYPES.get(d, d) for d in tensor_dtypes(path) if d.startswith(("F", "BF"))}
    return floats.pop() if len(floats) == 1 and floats <= set(DTYPES) else None


def from_tokenizer(tokenizer) -> dict:
    """bos/eos/pad of a run's tokenizer (loaders.tokenizers)."""
    from loaders.tokenizers import TransformersTokenizer

    if isinstance(tokenizer, TransformersTokenizer):
        tok = tokenizer._tok
        return {"bos_token_id": tok.bos_token_id, "eos_token_id": tokenizer.eot_id, "pad_token_id": tok.pad_token_id}
    return {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "pad_token_id": None}


def for_run(init_from: str | None, tokenizer) -> dict:
    """What a run's checkpoints record under MANIFEST_KEY: the ids and the generation_config.json to export."""
    meta = {**from_tokenizer(tokenizer), "generation_config": None, "dtype": None}
    if init_from:
        with open(os.path.join(init_from, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        base = read_base(init_from, hf)
        meta.update(base["ids"], generation_config=base["generation_config"], dtype=base_dtype(init_from, hf))
    return meta


def checked(meta, where: str) -> dict:
    """A manifest's MANIFEST_KEY entry, its shape checked (CheckpointError naming `where`)."""
    gen = meta.get("generation_config") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not (gen is None or isinstance(gen, dict)):
        raise CheckpointError(f"{where} {MANIFEST_KEY} is {json_text(meta)}, not the object a run writes: "
                              "restore the checkpoint's manifest")
    check_ids(meta, f"{where} {MANIFEST_KEY}", CheckpointError)
    if meta.get("dtype") not in (None, *DTYPES):
        raise CheckpointError(f"{where} {MANIFEST_KEY} has dtype={json_text(meta['dtype'])}, not one of "
                              f"{', '.join(DTYPES)}: restore the checkpoint's manifest, or pass --dtype")
    return meta


def config_ids(meta: dict) -> dict:
    """config.json's bos/eos/pad: null ones written too (GPT2Config alone would default them to 50256)."""
    return {k: meta.get(k) for k in ID_KEYS}


def generation_config(meta: dict) -> dict:
    """generation_config.json: the base's as it was, else the ids."""
    if meta.get("generation_config") is not None:
        return meta["generation_config"]
    return {k: meta[k] for k in ID_KEYS if meta.get(k) is not None}
