"""Every message of a run reaches the user through `say` (and `warn`): stdout, or through the
console's progress bar while one is drawn so lines do not tear it, and the run's log file
({run dir}/train_jax.log under Hydra), from process 0 only. Data loaders, checkpoints and the
loop all talk here; none of them needs to know which sinks a run has."""

from __future__ import annotations

import logging

import jax

# Under Hydra this logger writes {run dir}/train_jax.log (conf/hydra/job_logging/eqtrain.yaml).
file_log = logging.getLogger("eqtrain")

_bar = None  # the progress bar text must pass through while it is drawn (a tqdm), else None


def say(text: str) -> None:
    if jax.process_index() != 0:
        return
    file_log.info(text)
    if _bar is not None:
        _bar.write(text)
    else:
        print(text, flush=True)


def warn(message: str) -> None:
    say(f"warning: {message}")


def announce(run, state, mesh, data, run_dir: str, num_params: int, source=None) -> None:
    """A run's first lines: what trains on what (and how it is laid out, with
    parallel.print_layout), the config's warnings, and where a resumed run picks up."""
    from models import lora
    from utils.parallel import layout
    from utils.parallel import mesh as meshlib

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


def attach_bar(bar) -> None:
    """From now on `say` writes through `bar` (the console sink's tqdm)."""
    global _bar
    _bar = bar


def current_bar():
    return _bar


def detach_bar(bar) -> None:
    """`say` prints plainly again, unless another bar has been attached since."""
    global _bar
    if _bar is bar:
        _bar = None
