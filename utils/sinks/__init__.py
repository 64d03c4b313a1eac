"""Where a run's metrics go: a registry of sinks behind one interface.

A sink is one file here: a frozen config dataclass whose fields are its `logging.*` knobs (plus
`check(prefix)` if it has rules) and whose `build(run_dir, total_steps, start_step, config)`
returns an object with `log(step, metrics)` and `close()` (and optionally `advance(steps)` for
progress), or None when it is switched off. Register it in SINKS. Only process 0 builds sinks;
the others get an empty `Sinks`. The loop hands over plain floats it already pulled from the
device: no sink touches a device array.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from utils.errors import ConfigError
from utils.sections import build_section
from utils.sinks.console import Console
from utils.sinks.jsonl import Jsonl
from utils.sinks.wandb import Wandb

SINKS = {"console": Console, "jsonl": Jsonl, "wandb": Wandb}


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 10  # pull metrics from the device every N steps (no host sync in between)
    sinks: tuple = ()  # one built config per entry of SINKS, in its order

    def check(self, prefix: str) -> None:
        if self.log_every <= 0:
            raise ConfigError(f"{prefix}.log_every={self.log_every} must be a positive integer")


def logging_config(node: dict, prefix: str = "logging") -> LoggingConfig:
    """The flat `logging.*` section -> LoggingConfig: every sink takes the knobs named by its
    fields (knob names are the users'); a knob no sink has is refused."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix} must be a mapping of knobs, got {node!r}")
    owned = {"log_every"}
    sinks = []
    for cls in SINKS.values():
        knobs = {f.name for f in dataclasses.fields(cls)}
        owned |= knobs
        sinks.append(build_section(cls, {k: v for k, v in node.items() if k in knobs}, prefix))
    unknown = sorted(set(node) - owned)
    if unknown:
        raise ConfigError(f"unknown knob {prefix}.{unknown[0]}: known knobs are {', '.join(sorted(owned))}")
    base = build_section(LoggingConfig, {k: v for k, v in node.items() if k == "log_every"}, prefix)
    return dataclasses.replace(base, sinks=tuple(sinks))


class Sinks:
    """All of a run's sinks as one: the loop logs once, each sink gets it."""

    def __init__(self, sinks: list[Any]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def advance(self, steps: int = 1) -> None:
        for sink in self.sinks:
            if hasattr(sink, "advance"):
                sink.advance(steps)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(cfg: LoggingConfig, run_dir: str, total_steps: int, start_step: int, config: dict) -> Sinks:
    if jax.process_index() != 0:
        return Sinks([])
    built = (sink.build(run_dir, total_steps, start_step, config) for sink in cfg.sinks)
    return Sinks([sink for sink in built if sink is not None])
