"""The config.json keys a family reads, declared once, and the one reader that checks them.

A family with a Hugging Face form (models/hf.py) declares `HF_KEYS = {name: Key(...)}`: each key's
JSON kind, whether the family needs it, its default, and what it means. Its `config_from_hf` reads
config.json only through `read(hf, HF_KEYS, where)`, which hands back a dict of exactly the declared
keys, so a key the table lacks cannot be read by accident, and every key the table has is checked
before a Config is built: a missing required key, a null one, or a value of the wrong kind or
range is one line naming the file, the key and what is expected (never a KeyError or TypeError).

A null optional key takes its default, as transformers reads it (GPT-2's `n_inner: null`).
Cross-key checks (heads dividing the hidden size, ...) stay with the family, after `read`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from utils.errors import ConfigError


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is a Python int: not a count


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# kind -> (test, an example of a good JSON value for the fix)
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "a positive integer": (lambda v: _is_int(v) and v > 0, "32"),
    "a positive number": (lambda v: _is_number(v) and v > 0, "1e-05"),
    "a boolean": (lambda v: isinstance(v, bool), "true"),
    "a string": (lambda v: isinstance(v, str), '"silu"'),
    "an object": (lambda v: isinstance(v, dict), '{"rope_type": "default"}'),
    "a number >= 0": (lambda v: _is_number(v) and v >= 0, "0.001"),
    "a list": (lambda v: isinstance(v, list), "[]"),
}


@dataclasses.dataclass(frozen=True)
class Key:
    """One config.json key: `kind` (a key of KINDS), `means` (for the message), and either
    `required=True` or the `default` a missing or null value takes."""

    kind: str
    means: str
    required: bool = False
    default: Any = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Key kind {self.kind!r} is not one of {', '.join(KINDS)}")


def json_text(value: Any) -> str:
    """`value` as it is written in config.json (null, true, "4"), for messages about the file."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def read(hf: dict, keys: dict[str, Key], where: str, prefix: str = "") -> dict[str, Any]:
    """{name: value} for every declared key of `hf` (config.json, or an object inside it: `prefix`
    names it, e.g. "rope_parameters."), defaults filled in; a ConfigError naming `where` and the key
    for the first key that is missing, null or of the wrong kind."""
    out = {}
    for name, key in keys.items():
        test, example = KINDS[key.kind]
        value = hf.get(name)
        if value is None:
            if key.required:
                how = "is null" if name in hf else "is missing"
                raise ConfigError(f"{where} {prefix}{name} {how}: eqtrain needs it ({key.means}) as {key.kind}, "
                                  f"e.g. {prefix}{name}: {example}; save the directory again with transformers' "
                                  "save_pretrained, or add the key")
            out[name] = key.default
        elif not test(value):
            raise ConfigError(f"{where} {prefix}{name}={json_text(value)}: expected {key.kind} ({key.means}), "
                              f"e.g. {prefix}{name}: {example}; correct config.json")
        else:
            out[name] = value
    return out
