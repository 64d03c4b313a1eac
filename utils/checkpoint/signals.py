"""Stopping a run on a signal without losing work.

SIGTERM and SIGUSR1 (what SLURM sends before a time limit) and, with
`checkpoint.save_on_interrupt`, Ctrl-C only ask the loop to stop: it finishes its step, saves,
and the process exits with `EXIT_PREEMPTED` (or `EXIT_INTERRUPTED` for Ctrl-C), so a requeue of
the same command with `checkpoint.resume=auto` continues where it left off (docs/checkpoints.md).
"""

from __future__ import annotations

import os
import signal

import jax
import numpy as np

# Exit codes of a run stopped by a signal after saving (docs/checkpoints.md): resume with
# checkpoint.resume=auto. 130 is the shell's own code for Ctrl-C.
EXIT_PREEMPTED = 3
EXIT_INTERRUPTED = 130


class Preempted(Exception):
    """The run stopped on a signal after saving; `exit_code` is what the process should return."""

    def __init__(self, signame: str, step: int, path: str | None):
        self.exit_code = EXIT_INTERRUPTED if signame == "SIGINT" else EXIT_PREEMPTED
        where = f"saved {path}" if path else "nothing saved (checkpoint.save=false)"
        super().__init__(f"stopped by {signame} after step {step}: {where}; "
                         "run the same command with checkpoint.resume=auto to continue")


def agree(requested: str | None, sync_point: bool) -> str | None:
    """The stop request every process acts on. One process: its own, at once. Several: a signal
    reaches each at a slightly different step, and a save is collective, so they agree (an
    all-gather of one flag) only at sync points, the logging steps the host loop already waits on."""
    if jax.process_count() == 1:
        return requested
    if not sync_point:
        return None
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.int32(requested is not None))
    return (requested or "SIGTERM") if np.any(flags) else None


class StopSignals:
    """While active, SIGTERM and SIGUSR1 (what SLURM sends before a time limit) and, with
    save_on_interrupt, SIGINT only set `requested`: the loop finishes its step, saves and stops.
    A second SIGINT interrupts at once. Handlers are restored on exit; outside the main thread
    (where Python cannot install handlers) this does nothing."""

    def __init__(self, catch_interrupt: bool):
        self.requested: str | None = None
        self._signals = [signal.SIGTERM, signal.SIGUSR1] + ([signal.SIGINT] if catch_interrupt else [])
        self._previous: dict = {}
        # In a submitit job (hydra/launcher=slurm|local) SLURM sends submitit's signal (USR2) before
        # the time limit; submitit's handler requeues the job and exits at once. Catch it too: save
        # first, then hand the signal to submitit's handler (see __exit__).
        self._submitit = submitit_signal()
        if self._submitit is not None and self._submitit not in self._signals:
            self._signals.append(self._submitit)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.requested == "SIGINT":
            raise KeyboardInterrupt
        self.requested = name

    def __enter__(self) -> "StopSignals":
        try:
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for s, handler in self._previous.items():
            # After a stop the checkpoint is on disk and the process is about to exit with
            # EXIT_PREEMPTED: a repeated SIGTERM/SIGUSR1 must not turn that into a kill.
            stopping = exc_type is Preempted and s != signal.SIGINT
            signal.signal(s, signal.SIG_IGN if stopping else handler)
        previous = self._previous.get(self._submitit)
        if exc_type is Preempted and self._submitit is not None and callable(previous) and \
                self.requested == signal.Signals(self._submitit).name:
            previous(self._submitit, None)  # submitit: requeue this job (same overrides and run dir) and exit


def submitit_signal() -> signal.Signals | None:
    """The signal submitit sends before a time limit when this process runs a submitit job, else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
