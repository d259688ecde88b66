import os
import signal

import pytest

from moebench.bench.interrupt import sigterm_as_interrupt


def test_sigterm_raises_keyboard_interrupt_and_nested_blocks_both_record_it():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt() as outer:
        with pytest.raises(KeyboardInterrupt):
            with sigterm_as_interrupt() as inner:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # let the handler run
        assert inner == [signal.SIGTERM] and outer == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupted_rows_marks_the_cases_an_interrupt_left():
    import pandas as pd

    from moebench.bench.interrupt import INTERRUPTED, interrupted_rows

    frame = pd.DataFrame({"error": ["", INTERRUPTED, None, "out of memory"]})
    assert interrupted_rows(frame).tolist() == [False, True, False, False]
    assert interrupted_rows(pd.DataFrame({"x": [1, 2]})).tolist() == [False, False]
    assert interrupted_rows(pd.DataFrame()).tolist() == []
