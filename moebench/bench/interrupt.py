"""Interrupted runs: SIGTERM (a cancelled CI job, `timeout`) handled as
Ctrl-C, so that a sweep or step keeps the cases it measured. Free of torch:
the CLI imports it at start-up."""

from __future__ import annotations

import contextlib
import signal
import threading

#: The note of a case a sweep or step did not reach because it was interrupted.
INTERRUPTED = "not run: interrupted (Ctrl-C or SIGTERM) before this case"


def interrupted_rows(frame):
    """Boolean Series over a results frame's rows: the cases an interrupt left
    unrun (error INTERRUPTED); all False for a frame without an error column."""
    import pandas as pd

    if "error" not in frame.columns:
        return pd.Series(False, index=frame.index)
    return frame["error"].astype(str) == INTERRUPTED


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
