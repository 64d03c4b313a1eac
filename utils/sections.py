"""Config sections: one mapping of knobs -> one frozen dataclass, type-checked, with unknown
knobs refused. Shared by the run's config boundary (`utils.config`) and by every registry
(optimizers, data sources, tokenizers, sinks), so a knob is checked the same way wherever it
lives.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from utils.errors import ConfigError


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _is_exactly(value: Any, tp: Any) -> bool:
    """`value` is already of kind `tp`, with no conversion (a bool is not an int, an int not a float)."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return isinstance(value, (list, tuple))
    if dataclasses.is_dataclass(tp):
        return isinstance(value, (tp, dict))
    if tp in (int, float):
        return type(value) is tp
    return isinstance(tp, type) and isinstance(value, tp)


def _coerce_union(value: Any, args: tuple, knob: str) -> Any:
    """A union (`str | int | None`): the member `value` already is, else the first member that takes
    it as a plain annotation would (an integral float for an int, an int for a float)."""
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    for tp in inner:  # a member of the value's own kind checks it, its errors (a nested section's) stand
        if _is_exactly(value, tp):
            return _coerce(value, tp, knob)
    for tp in inner:
        try:
            return _coerce(value, tp, knob)
        except ConfigError:
            continue
    names = " or ".join(_type_name(a) if typing.get_origin(a) is not tuple else "list" for a in inner)
    raise ConfigError(f"{knob}={value!r} must be {'null or ' if type(None) in args else ''}a {names}")


def _coerce(value: Any, tp: Any, knob: str) -> Any:
    """Check one value against its annotation, converting only where YAML is ambiguous
    (an int where a float is expected, an integral float where an int is). A union tries each
    member (`_coerce_union`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, knob)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{knob}={value!r} must be a list")
        return tuple(_coerce(v, args[0], f"{knob}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(tp):  # a nested section (model.lora, model.moe): its knobs checked the same way
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return build_section(tp, value, knob)
        raise ConfigError(f"{knob} must be a mapping of knobs (e.g. {knob}.<knob>=...), got {value!r}")
    else:
        return value
    raise ConfigError(f"{knob}={value!r} must be {'null or ' if value is None else ''}a {_type_name(tp)}")


def build_section(cls: type, node: dict, prefix: str, owner: str | None = None):
    """One config section -> `cls`, rejecting unknown knobs and calling `cls.check(prefix)`.
    `owner` names the registry choice the knobs belong to (e.g. "dataset.name=text_files"), so an
    unknown knob says whose knobs it was checked against."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix} must be a mapping of knobs, got {node!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(node) - set(fields))
    if unknown:
        whose = f" for {owner}" if owner else ""
        known = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"unknown knob {prefix}.{unknown[0]}{whose}: known knobs are {known}")
    kwargs = {}
    for name, field in fields.items():
        if name in node:
            kwargs[name] = _coerce(node[name], hints[name], f"{prefix}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}.{name} is missing: set it in the yaml or on the command line")
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check(prefix)
    return obj


def build_registered(registry: dict[str, type], node: dict, prefix: str, common: tuple[str, ...] = ()):
    """A section that names its implementation (`name: text_files`) -> (name, that class built from
    the section's other knobs), leaving out the `common` knobs the caller builds itself (e.g. the
    batch-shape knobs every data source shares). A knob the chosen implementation lacks is a
    ConfigError naming it: no source, tokenizer or sink silently ignores a setting."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix} must be a mapping of knobs, got {node!r}")
    name = node.get("name")
    if name not in registry:
        raise ConfigError(f"{prefix}.name={name!r} is unknown: choose one of {', '.join(sorted(registry))}")
    own = {k: v for k, v in node.items() if k != "name" and k not in common}
    return name, build_section(registry[name], own, prefix, owner=f"{prefix}.name={name}")
