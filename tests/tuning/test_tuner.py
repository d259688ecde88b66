"""The tuner with synthetic time / check functions (no GPU)."""

from types import SimpleNamespace

import pytest

from moebench.bench.timing import Timing
from moebench.kernels.tactic import GemmTactic
from moebench.models import get_preset
from moebench.kernels.table import ShapeClass, TableEntry, TuningTable, read_table
from moebench.tuning.table import write_table
from moebench.tuning.tuner import tune

SHAPE = get_preset("dsv41-flash").shard(4)
A = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=4, ctas_per_sm=1)
B = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=2, ctas_per_sm=2)
C = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=4, ctas_per_sm=3)
D = GemmTactic(tile_rows=32, warps_m=2, warps_k=4, unroll=2, ctas_per_sm=2)
E = GemmTactic(tile_rows=64, warps_m=2, warps_k=4, unroll=2, ctas_per_sm=2)


def timing(median, spread=0.02):
    return Timing(median, median * (1 - spread), median * (1 + spread), (median,), "cuda-graph")


def fixed(times):
    """time_fn from {tactic: µs or [µs per call]}; records the calls."""
    calls = []

    def time_fn(tactic, rows):
        calls.append((tactic, rows))
        t = times[tactic]
        if isinstance(t, list):
            n = sum(1 for c in calls if c == (tactic, rows))
            t = t[min(n, len(t)) - 1]
        return timing(t * rows if rows > 1 else t)

    time_fn.calls = calls
    return time_fn


def correct(tactic, rows):
    return None


def test_fastest_correct_tactic_wins_and_a_faster_wrong_one_never_does():
    time_fn = fixed({A: 12.0, B: 10.0, C: 11.0, D: 5.0, E: 15.0})
    checked = []

    def check(tactic, rows):
        checked.append(tactic)
        return "relative error 0.3 exceeds 0.01" if tactic == D else None

    res = tune(SHAPE, [1, 6], [A, B, C, D, E], time_fn, check, provenance={"commit": "abc"})
    for rows in (1, 6):
        r = res.results[rows]
        e = r.entry
        assert isinstance(e, TableEntry) and e.tactic == B and e.runner_up == C
        assert e.margin_pct == pytest.approx(10.0) and e.separated
        assert e.candidates == 5 and e.rejected == 1 and e.provenance == {"commit": "abc"}
        assert "0.3" in r.rejected[D.name] and D not in [m.tactic for m in r.first_pass]
        assert [m.tactic for m in r.finalists] == [B, C, A] and all(m.passes == 4 for m in r.finalists)
    assert (D, 1) not in time_fn.calls and (D, 6) not in time_fn.calls  # a wrong tactic is never timed
    # first pass: 4 correct tactics; then 3 repeats of the 3 finalists, interleaved
    per_rows = [t for t, r in time_fn.calls if r == 1]
    assert per_rows[:4] == [A, B, C, E] and per_rows[4:7] == [B, C, A] and len(per_rows) == 4 + 9


def test_a_lucky_first_pass_does_not_win():
    # L looks fastest once (8 µs) and then runs at 12; S is a steady 10
    time_fn = fixed({A: [8.0, 12.0, 12.0, 12.0], B: 10.0, C: 11.0})
    e = tune(SHAPE, [1], [A, B, C], time_fn, correct, repeats=3).entries[1]
    assert e.tactic == B and e.median_us == 10.0


def test_noise_within_the_spread_is_not_separated_and_prefer_keeps_the_default():
    def time_fn(tactic, rows):
        return timing({A: 10.0, B: 10.2, C: 14.0}[tactic], spread=0.05)

    plain = tune(SHAPE, [2], [A, B, C], time_fn, correct).entries[2]
    assert plain.tactic == A and plain.runner_up == B and not plain.separated
    kept = tune(SHAPE, [2], [A, B, C], time_fn, correct, prefer=lambda rows: B).results[2]
    assert kept.entry.tactic == B and "within noise" in kept.note
    clear = tune(SHAPE, [2], [A, B, C], time_fn, correct, prefer=C).entries[2]
    assert clear.tactic == A  # C is clearly slower: not kept


def test_failures_of_a_tactic_reject_it_and_never_raise():
    def time_fn(tactic, rows):
        if tactic == B:
            raise RuntimeError("launch failed\nstack")
        return timing({A: 10.0, C: 9.0, E: 11.0}[tactic])

    def check(tactic, rows):
        if tactic == E:
            raise ValueError("compile error")
        return None

    r = tune(SHAPE, [1], [A, B, C, E], time_fn, check).results[1]
    assert r.entry.tactic == C and r.entry.runner_up == A
    assert r.rejected[B.name] == "timing failed: RuntimeError: launch failed"
    assert "compile error" in r.rejected[E.name]


def test_no_correct_tactic_leaves_the_row_out():
    res = tune(SHAPE, [1, 2], [A, B], fixed({A: 1.0, B: 2.0}), lambda t, rows: "wrong" if rows == 2 else None)
    assert res.failed_rows == [2] and list(res.entries) == [1]
    assert res.results[2].entry is None and set(res.results[2].rejected) == {A.name, B.name}


def test_single_candidate_has_no_runner_up():
    e = tune(SHAPE, [1], [A], fixed({A: 3.0}), correct).entries[1]
    assert e.tactic == A and e.runner_up is None and e.margin_pct is None and not e.separated


def test_candidates_per_rows_and_unusable_timings():
    seen = []

    def cands(shape, rows):
        seen.append((shape, rows))
        return [A, B] if rows == 1 else [B, C]

    def time_fn(tactic, rows):
        if tactic == C:
            return SimpleNamespace(median_us=float("nan"), p10_us=1.0, p90_us=2.0)
        return timing(5.0)

    res = tune(SHAPE, [1, 3], cands, time_fn, correct)
    assert seen == [(SHAPE, 1), (SHAPE, 3)]
    assert res.entries[3].tactic == B and "unusable timing" in res.results[3].rejected[C.name]


def test_bad_arguments():
    with pytest.raises(ValueError, match="rows_list"):
        tune(SHAPE, [], [A], fixed({A: 1.0}), correct)
    with pytest.raises(ValueError, match="duplicates"):
        tune(SHAPE, [1], [A, A], fixed({A: 1.0}), correct)
    with pytest.raises(ValueError, match="repeats"):
        tune(SHAPE, [1], [A], fixed({A: 1.0}), correct, repeats=0)
    with pytest.raises(ValueError, match="top"):
        tune(SHAPE, [1], [A], fixed({A: 1.0}), correct, top=1)
    with pytest.raises(TypeError, match="callable"):
        tune(SHAPE, [1], [A], None, correct)
    with pytest.raises(ValueError, match="no candidate"):
        tune(SHAPE, [1], [], fixed({}), correct)


def test_entries_make_a_table_that_round_trips(tmp_path):
    res = tune(SHAPE, list(range(1, 9)), [A, B, C], fixed({A: 3.0, B: 2.0, C: 4.0}), correct,
               provenance={"device": "NVIDIA H200"})  # fmt: skip
    table = TuningTable(ShapeClass.of(SHAPE), {"name": "NVIDIA H200", "sm_count": 132},
                        {(1, r): e for r, e in res.entries.items()})  # fmt: skip
    back = read_table(write_table(table, tmp_path))
    assert back.entries == table.entries and back.entry(1, 8).tactic == B


def test_the_preferred_tactic_is_re_timed_with_the_finalists_as_the_baseline():
    # E (the default) is 4th fastest: it joins the three finalists, re-timed side by side
    time_fn = fixed({A: 12.0, B: 10.0, C: 11.0, D: 13.0, E: 15.0})
    r = tune(SHAPE, [1], [E, A, B, C, D], time_fn, correct, prefer=E).results[1]
    assert [m.tactic for m in r.finalists] == [B, C, A, E] and all(m.passes == 4 for m in r.finalists)
    assert r.entry.tactic == B and r.baseline.tactic == E and r.baseline.median_us == 15.0
    assert sum(1 for t, _ in time_fn.calls if t == E) == 4 and sum(1 for t, _ in time_fn.calls if t == D) == 1
    # the preferred tactic wins: the baseline is the entry's own measurement
    kept = tune(SHAPE, [1], [B, C], fixed({B: 10.0, C: 11.0}), correct, prefer=B).results[1]
    assert kept.baseline.median_us == kept.entry.median_us == 10.0
    # a wrong preferred tactic has no baseline; without prefer there is none either
    wrong = tune(SHAPE, [1], [A, B], fixed({A: 1.0, B: 2.0}), lambda t, rows: "bad" if t == A else None, prefer=A)
    assert wrong.results[1].baseline is None and wrong.entries[1].tactic == B
    assert tune(SHAPE, [1], [A, B], fixed({A: 1.0, B: 2.0}), correct).results[1].baseline is None


def test_should_stop_leaves_the_remaining_rows_out():
    asked = []

    def stop():
        asked.append(len(asked))
        return len(asked) > 2

    res = tune(SHAPE, [1, 2, 3, 4], [A, B], fixed({A: 1.0, B: 2.0}), correct, should_stop=stop)
    assert list(res.entries) == [1, 2] and res.stopped == [3, 4] and len(asked) == 3
