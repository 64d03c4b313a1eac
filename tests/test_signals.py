"""utils/checkpoint/signals.py in-process: what a signal does while StopSignals is active, what is left
installed afterwards, and the exit codes. The real thing (a training process stopped by SLURM's
signals, then resumed) is in test_preemption.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from utils.checkpoint.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted, StopSignals, agree

CAUGHT = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture(autouse=True)
def _restore_handlers():
    """Whatever a test leaves installed (SIG_IGN after a stop) is undone for the rest of pytest."""
    before = {s: signal.getsignal(s) for s in CAUGHT}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_only_records_the_request(sig):
    with StopSignals(catch_interrupt=True) as stop:
        assert stop.requested is None
        os.kill(os.getpid(), sig)  # delivered to the main thread before kill returns to Python code
        assert stop.requested == sig.name


def test_without_save_on_interrupt_ctrl_c_interrupts_at_once():
    # Python's own Ctrl-C handler, whatever earlier tests of the session left installed (in the full
    # suite something leaves another one; the autouse fixture puts it back afterwards).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(catch_interrupt=False) as stop:
            assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is left to Python
            # To this thread: os.kill lets the kernel pick any thread (XLA's, the prefetcher's), and on
            # a loaded machine that one may run the C handler after this block has already exited.
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    assert stop.requested is None


def test_a_second_ctrl_c_interrupts_at_once():
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(catch_interrupt=True) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested == "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)


def test_handlers_are_restored_after_a_normal_exit():
    before = {s: signal.getsignal(s) for s in CAUGHT}
    with StopSignals(catch_interrupt=True):
        assert all(signal.getsignal(s) != before[s] for s in CAUGHT)
    assert {s: signal.getsignal(s) for s in CAUGHT} == before


def test_after_a_stop_repeated_term_and_usr1_are_ignored_but_ctrl_c_is_not():
    before_int = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted):
        with StopSignals(catch_interrupt=True):
            raise Preempted("SIGTERM", 5, "/ck/iter_5")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == before_int


def test_preempted_exit_codes_and_message():
    assert Preempted("SIGTERM", 5, "/ck/iter_5").exit_code == EXIT_PREEMPTED == 3
    assert Preempted("SIGUSR1", 5, "/ck/iter_5").exit_code == EXIT_PREEMPTED
    assert Preempted("SIGINT", 5, None).exit_code == EXIT_INTERRUPTED == 130
    message = str(Preempted("SIGUSR1", 5, "/ck/iter_5"))
    assert "SIGUSR1 after step 5" in message and "/ck/iter_5" in message and "resume=auto" in message
    assert "nothing saved" in str(Preempted("SIGINT", 5, None))


def test_one_process_acts_on_its_own_request_at_once():
    assert agree("SIGTERM", sync_point=False) == "SIGTERM"
    assert agree(None, sync_point=True) is None
