import contextlib
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


#: A process that stands for a rank: "imports" for a while (where a Ctrl-C printed a traceback per rank),
#: then takes any held interrupt as rank_main does and says how it ended.
_CHILD = """
import pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / "importing").write_text("")
time.sleep(3)  # the start-up: a Ctrl-C now must wait
from moebench.bench.interrupt import take_held_interrupts
try:
    take_held_interrupts()
    time.sleep(30)
    (out / "ended").write_text("not interrupted")
except KeyboardInterrupt:
    (out / "ended").write_text("interrupted")
"""


@pytest.mark.parametrize("held", [True, False])
def test_a_ctrl_c_during_a_childs_start_up_waits_until_it_can_take_it(tmp_path, held):
    """`step --tp 2` interrupted while its ranks imported printed two tracebacks (KeyboardInterrupt inside
    `import pandas`): a process started under interrupts_held_for_children holds the Ctrl-C through its
    start-up and takes it, quietly, where it handles it. Without the hold (held=False) the child dies in its
    start-up with a traceback: the test can tell."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from moebench.bench.interrupt import interrupts_held_for_children

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    hold = interrupts_held_for_children() if held else contextlib.nullcontext()
    with hold:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], env=env, stderr=subprocess.PIPE,
                                 text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (tmp_path / "importing").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    if held:
        assert child.returncode == 0 and "Traceback" not in err, err
        assert (tmp_path / "ended").read_text() == "interrupted"
    else:
        assert child.returncode != 0 and "KeyboardInterrupt" in err and not (tmp_path / "ended").exists()


def test_this_process_still_takes_its_ctrl_c_while_interrupts_are_held():
    """The hold blocks SIGINT in the main thread only: the launcher itself must still stop on a Ctrl-C."""
    import time

    from moebench.bench.interrupt import interrupts_held_for_children

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held_for_children():
            assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # the launcher's monitor loop sleeps in short steps as well
                time.sleep(0.05)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
