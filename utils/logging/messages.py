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
