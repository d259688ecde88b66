"""The exit policy of a stored run and of a comparison (moebench/reports/gate.py)."""

import signal
from types import SimpleNamespace

import pandas as pd

from moebench.bench.interrupt import INTERRUPTED
from moebench.reports.gate import FAILED, UNJUDGED, case_list, interrupted_exit, judge_comparison, judge_run


def _frame(*statuses, peer=None):
    df = pd.DataFrame(
        {
            "status": list(statuses),
            "error": ["" if s == "ok" else f"why {s} {i}" for i, s in enumerate(statuses)],
            "backend": "b",
            "preset": "p",
            "tp": 1,
            "rows": 1,
            "scenario": "s",
            "tactic": "default",
        }
    )
    if peer is not None:
        df["peer"] = peer
    return df


def test_ok_beside_skipped_passes_and_no_case_ran_fails():
    assert judge_run(_frame("ok", "skipped"), "RUN").failure is None
    verdict = judge_run(_frame("skipped", "skipped"), "RUN")
    assert verdict.failure == "no case ran (every case was skipped): why skipped 0; why skipped 1"


def test_a_failed_case_of_ours_fails_with_its_reasons():
    verdict = judge_run(_frame("ok", "failed", "failed", "failed", "failed"), "RUN")
    assert verdict.failure.startswith(
        "4 case(s) failed: an error, or an output off the oracle (stored as failed in"
        " RUN): why failed 1; why failed 2; why failed 3"
    )  # at most three reasons
    assert "why failed 4" not in verdict.failure and verdict.peers == 0


def test_a_peers_failed_case_fails_only_when_strict():
    frame = _frame("ok", "failed", peer=[False, True])
    verdict = judge_run(frame, "RUN")
    assert verdict.failure is None and verdict.peers == 1 and verdict.peer_lines == ["b p TP1 rows 1 s: why failed 1"]
    strict = judge_run(frame, "RUN", strict=True)
    assert strict.failure.startswith("1 peer case(s) failed (--strict)") and "why failed 1" in strict.failure
    # a run stored before the peer column: every failure counts as ours
    assert judge_run(_frame("ok", "failed"), "RUN").failure.startswith("1 case(s) failed")


def test_interrupted_exit_is_128_plus_the_signal():
    frame = _frame("ok", "skipped")
    frame.loc[1, "error"] = INTERRUPTED
    assert interrupted_exit(frame, {}, "RUN", []) is None
    message, code = interrupted_exit(frame, {"interrupted": True}, "RUN", [])
    assert code == 128 + signal.SIGINT and message.startswith("interrupted (SIGINT): 1 of 2 cases ran")
    _, code = interrupted_exit(frame, {"interrupted": True, "interrupt_signal": int(signal.SIGTERM)}, "RUN", [])
    assert code == 143
    _, code = interrupted_exit(frame, {"interrupted": True, "interrupt_signal": 15}, "RUN", [int(signal.SIGINT)])
    assert code == 130  # this process's own signal first


def _comparison(verdicts=(), mismatches=(), errors=()):
    reg = pd.DataFrame(
        {
            "verdict": list(verdicts),
            "backend": "b",
            "preset": "p",
            "tp": 1,
            "rows": 1,
            "scenario": "s",
            "tactic": "t",
            "note": "n",
        }
    )
    return SimpleNamespace(regressions=reg, mismatches=list(mismatches), errors=list(errors), differs_in="device")


def test_judge_comparison():
    assert judge_comparison(_comparison(), 5.0, gated=True) is None
    assert judge_comparison(_comparison(["slower"]), 5.0, gated=False) is None  # shown, not gated
    message, code = judge_comparison(_comparison(["slower", "slower", "failed", "lost"]), 5.0, gated=True)
    assert code == FAILED and message == (
        "2 case(s) slower than the baseline by more than 5 %; 1 case(s) failed their correctness gate in this run;"
        " 1 case(s) ok in the baseline were not timed in this run (lost): b p TP1 rows 1 s t (n)"
    )
    message, code = judge_comparison(_comparison(mismatches=["device: a vs b"]), 5.0, gated=False)
    assert code == UNJUDGED and message.startswith("--baseline: the baseline is of another device / geometry")
    message, code = judge_comparison(_comparison(mismatches=["mode: x"]), 5.0, gated=False)
    assert "of a different kind of run" in message
    assert judge_comparison(_comparison(errors=["no case in common", "x"]), 5.0, gated=True) == (
        "no case in common; x",
        UNJUDGED,
    )


def test_case_list_says_how_many_more():
    lost = _comparison(["lost"] * 7).regressions
    assert case_list(lost).endswith("; and 2 more (see the report)") and case_list(lost).count("TP1") == 5
