"""Interrupted runs: SIGTERM (a cancelled CI job, `timeout`) handled as
Ctrl-C, so that a sweep or step keeps the cases it measured; a Ctrl-C that
reaches the ranks of a launch while they start (their imports take seconds)
held until each rank can take it quietly. Free of torch: the CLI imports it
at start-up."""

from __future__ import annotations

import contextlib
import signal
import threading

# The note of a case an interrupt left unrun is a stored run's word (reports/store.py), which the
# exit policy reads too (reports/gate.py); the bench writes it.
from moebench.reports.store import INTERRUPTED, interrupted_rows  # noqa: F401 - re-exported for the bench


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within: SIGTERM raises KeyboardInterrupt, as Ctrl-C does (in the main
    thread; elsewhere nothing changes). Yields the list of SIGTERMs received
    (empty after a Ctrl-C, which is seen only as the interrupt). Nests: an
    outer handler installed this way records the signal too. The previous
    handler is restored on exit."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGTERM)

    def terminate(signum, frame):
        seen.append(signum)
        if getattr(previous, "records_sigterm", False):  # an outer block of this kind: let it record it too
            with contextlib.suppress(KeyboardInterrupt):
                previous(signum, frame)
        raise KeyboardInterrupt

    terminate.records_sigterm = True
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_held_for_children():
    """Within (in the main thread; elsewhere nothing changes): SIGINT is
    blocked in this thread, so that the processes it starts (spawned ranks)
    begin with SIGINT blocked, and a Ctrl-C of the terminal, which reaches
    every process of its group, waits in a rank still importing (`import
    pandas` took it as a KeyboardInterrupt and printed a traceback per rank)
    until the rank takes it (take_held_interrupts). This process still gets
    its Ctrl-C: a thread started here, which does not block SIGINT, receives
    it, and its handler runs in the main thread as ever (at the main
    thread's next Python instruction, not inside a blocking call). The mask
    is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    # multiprocessing starts its resource tracker with the first spawned process, SIGINT blocked around it
    # and then *unblocked*, which would undo the mask set below: started first, it is not started again
    resource_tracker.ensure_running()
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="moebench-sigint", daemon=True)
    receiver.start()  # before the mask: it keeps SIGINT unblocked
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        done.set()


def take_held_interrupts() -> None:
    """In a process started under interrupts_held_for_children: unblock
    SIGINT, so that a Ctrl-C held since its start raises KeyboardInterrupt
    here (call it where that is handled) and later ones as usual. A no-op
    where SIGINT is not blocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
