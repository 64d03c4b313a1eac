"""A run's header: the first lines it prints (what trains on what, how it is laid out, the
config's warnings, where a resumed run picks up). It reads the model (LoRA's trained share), so it
sits with the trainer, above `models`; every line goes out through utils.logging.messages."""

from __future__ import annotations

from models import lora
from utils.logging.messages import say, warn
from utils.parallel import layout
from utils.parallel import mesh as meshlib


def announce(run, state, mesh, data, run_dir: str, num_params: int, source=None) -> None:
    """A run's first lines: what trains on what (and how it is laid out, with
    parallel.print_layout), the config's warnings, and where a resumed run picks up."""
    factors = lora.factor_count(state.model) if state is not None else 0  # LoRA: the trained share
    trained = f" ({factors:,} trained: LoRA factors)" if factors else ""
    say(f"eqtrain: {num_params / 1e6:.2f}M params{trained} | {run.optimizer.name} + {run.optimizer.schedule_name} | "
        f"{data.tokens_per_step:,} tokens/step | {meshlib.topology(mesh)} | data {data.fingerprint} | "
        f"run dir {run_dir}")
    for note in getattr(run, "notes", ()):  # choices made for this machine, e.g. model.attention=auto's
        say(note)
    if run.parallel.print_layout:
        say(layout.describe(state, mesh))
    for warning in run.warnings:
        warn(warning)
    if source is not None:
        say(f"resumed from {source.path} at step {int(state.step)}" + ("" if source.with_opt_state else
            " with a fresh optimizer state (checkpoint.overwrite_optimizer)") + ("" if source.with_data_state else
            ", the dataset's stream from its start (checkpoint.overwrite_data)"))
