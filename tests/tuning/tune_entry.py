"""`python -m tune_entry ARGS`: the moebench command line with the tuner's
stand-in kernels on the CPU (test_runner._stand_in_kernels: GEMMs that copy
the oracle's output, a CPU 'tuning device') and a stand-in timing that is a
fixed function of (stage, rows, tactic, partner), so that any two runs pick
the same tactics; for the torchrun tests (test_tune_torchrun.py). With
$MOEBENCH_TEST_DIE_TP set, the rank that starts tuning that TP degree
SIGKILLs itself (as an OOM kill would); with $MOEBENCH_TEST_SLOW_TP, it
writes the marker file $MOEBENCH_TEST_MARKERS/rank-<RANK> and sleeps a
minute first (a test interrupts it); with $MOEBENCH_TEST_MARKERS, a rank
that tuned a config writes tuned-<RANK>."""

import os
import signal
import time as clock
import zlib
from pathlib import Path

import pytest

from moebench.bench.timing import Timing


def install(monkeypatch) -> None:
    """The stand-in kernels and timing (and the dying TP degree) into this process."""
    from test_runner import _stand_in_kernels

    from moebench.tuning import runner as rn

    _stand_in_kernels(monkeypatch, wrong=lambda t: t.ctas_per_sm == 4)
    original_time, original_run = rn.GemmStageRunner.time, rn.run_tune

    def time(self, tactic, rows):
        original_time(self, tactic, rows)  # the plumbing runs; its wall clock is noise
        us = 1.0 + zlib.crc32(f"{self.stage} {rows} {tactic.name} {self.partner(rows).name}".encode()) % 1000 / 100
        return Timing.from_samples([us] * 3, "cpu-wallclock", 1)

    def run_tune(config, *args, **kwargs):
        if str(config.tp[0]) == os.environ.get("MOEBENCH_TEST_DIE_TP"):
            os.kill(os.getpid(), signal.SIGKILL)
        if str(config.tp[0]) == os.environ.get("MOEBENCH_TEST_SLOW_TP"):
            Path(os.environ["MOEBENCH_TEST_MARKERS"], f"rank-{os.environ.get('RANK', '0')}").touch()
            clock.sleep(60)
        outcome = original_run(config, *args, **kwargs)
        if os.environ.get("MOEBENCH_TEST_MARKERS"):
            Path(os.environ["MOEBENCH_TEST_MARKERS"], f"tuned-{os.environ.get('RANK', '0')}").touch()
        return outcome

    monkeypatch.setattr(rn.GemmStageRunner, "time", time)
    monkeypatch.setattr(rn, "run_tune", run_tune)


if __name__ == "__main__":
    from moebench.cli import main

    install(pytest.MonkeyPatch())
    main()
