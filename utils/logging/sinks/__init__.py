"""Where a run's metrics go: a registry of sinks behind one interface.

A sink is one file here: a frozen config dataclass whose fields are its `logging.*` knobs (plus
`check(prefix)` if it has rules) and whose
`build(run_dir, total_steps, start_step, config, saved)` returns an object with
`log(step, metrics)` and `close()` (and optionally `advance(steps)` for progress, and
`state_dict() -> dict` for what a resumed run needs back), or None when it is switched off.
Register it in SINKS; its key there names it.

Resuming: `Sinks.state_dict()` is `{sink name: that sink's state_dict()}` (JSON: e.g.
`{"wandb": {"id": "abc123"}}`); the checkpoint stores it (manifest "sinks") and the next segment
passes it back as `open_sinks(..., saved=...)`, which hands each sink's `build` its own part as
`saved` (`{}` when none: a fresh run, or a sink with no state). A part whose sink is off in this
segment is carried over unchanged, so switching wandb off for one segment does not lose its run.

Only process 0 builds sinks; the others get an empty `Sinks`. The loop hands over plain floats it
already pulled from the device: no sink touches a device array.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from utils.errors import ConfigError
from utils.logging.aux_flags import AuxConfig
from utils.logging.sinks.console import Console
from utils.logging.sinks.jsonl import Jsonl
from utils.logging.sinks.tensorboard import TensorBoard
from utils.logging.sinks.wandb import Wandb
from utils.sections import build_section

SINKS = {"console": Console, "jsonl": Jsonl, "tensorboard": TensorBoard, "wandb": Wandb}


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 10  # pull metrics from the device every N steps (no host sync in between)
    sample_prompts: tuple[str, ...] = ("def ", "import ")  # sampled from at each evaluation; [] = none
    sample_tokens: int = 32  # tokens per evaluation sample
    activation_norms: bool = False  # per-block activation RMS on logging steps (trainer/activations.py)
    aux: AuxConfig = AuxConfig()  # the aux-state hook's flags (trainer/aux_state.py)
    sinks: tuple = ()  # one built config per entry of SINKS, in its order

    def check(self, prefix: str) -> None:
        if self.log_every <= 0:
            raise ConfigError(f"{prefix}.log_every={self.log_every} must be a positive integer")
        if self.sample_tokens <= 0:
            raise ConfigError(f"{prefix}.sample_tokens={self.sample_tokens} must be a positive integer")


def logging_config(node: dict, prefix: str = "logging") -> LoggingConfig:
    """The flat `logging.*` section -> LoggingConfig: every sink takes the knobs named by its
    fields (knob names are the users'); a knob no sink has is refused."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix} must be a mapping of knobs, got {node!r}")
    own = ("log_every", "sample_prompts", "sample_tokens", "activation_norms")
    aux_knobs = {f.name for f in dataclasses.fields(AuxConfig)}
    owned = set(own) | aux_knobs
    sinks = []
    for cls in SINKS.values():
        knobs = {f.name for f in dataclasses.fields(cls)}
        owned |= knobs
        sinks.append(build_section(cls, {k: v for k, v in node.items() if k in knobs}, prefix))
    unknown = sorted(set(node) - owned)
    if unknown:
        raise ConfigError(f"unknown knob {prefix}.{unknown[0]}: known knobs are {', '.join(sorted(owned))}")
    base = build_section(LoggingConfig, {k: v for k, v in node.items() if k in own}, prefix)
    aux = build_section(AuxConfig, {k: v for k, v in node.items() if k in aux_knobs}, prefix)
    return dataclasses.replace(base, aux=aux, sinks=tuple(sinks))


class Sinks:
    """All of a run's sinks as one: the loop logs once, each sink gets it. `sinks` maps each
    sink's name (its SINKS key) to the built sink; `saved` is the state the run resumed with."""

    def __init__(self, sinks: dict[str, Any] | None = None, saved: dict | None = None):
        self.named = dict(sinks or {})
        self.sinks = list(self.named.values())
        self._saved = dict(saved or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """(prompt, generated text) pairs, to every sink that shows text (`log_samples`)."""
        for sink in self.sinks:
            if hasattr(sink, "log_samples"):
                sink.log_samples(step, samples)

    def advance(self, steps: int = 1) -> None:
        for sink in self.sinks:
            if hasattr(sink, "advance"):
                sink.advance(steps)

    def state_dict(self) -> dict:
        """What a resumed run passes back to `open_sinks(saved=...)`: JSON, for the checkpoint."""
        state = dict(self._saved)
        for name, sink in self.named.items():
            if hasattr(sink, "state_dict"):
                state[name] = sink.state_dict()
        return state

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def sink_name(sink_cfg: Any) -> str:
    """A sink config's name: its key in SINKS."""
    for name, cls in SINKS.items():
        if type(sink_cfg) is cls:
            return name
    return getattr(type(sink_cfg), "name", type(sink_cfg).__name__.lower())


def open_sinks(cfg: LoggingConfig, run_dir: str, total_steps: int, start_step: int, config: dict,
               saved: dict | None = None) -> Sinks:
    """Build the run's sinks. `saved` is what `Sinks.state_dict()` returned in the run's previous
    segment (None or {} for a fresh run)."""
    saved = dict(saved or {})
    if jax.process_index() != 0:
        return Sinks({}, saved)
    built = {}
    for sink_cfg in cfg.sinks:
        name = sink_name(sink_cfg)
        sink = sink_cfg.build(run_dir, total_steps, start_step, config, saved=dict(saved.get(name) or {}))
        if sink is not None:
            built[name] = sink
    return Sinks(built, saved)
