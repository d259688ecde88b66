"""Interrupted runs: SIGTERM (a cancelled CI job, `timeout`) handled as
Ctrl-C, so that a sweep or step keeps the cases it measured. Free of torch:
the CLI imports it at start-up."""

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
