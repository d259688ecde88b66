"""Regression comparison on synthetic runs with known ratios and noise."""

import math

import pandas as pd
import pytest

from moebench.reports.compare import (
    classify, compare_runs, comparison_markdown, parse_threshold, within_threshold_note,
)  # fmt: skip

MANIFEST = {
    "device": {"name": "NVIDIA H200", "sm_count": 132, "driver": "570.1"},
    "reduced": False,
    "warm_l2": False,
    "packages": {"torch": "2.9"},
    "cuda_runtime": "12.8",
    "copy_bw_gbps": 4200.0,
}


def case(rows, backend="moebench", median=10.0, spread=0.02, status="ok", error="", **kw):
    row = dict(
        preset="dsv41-flash",
        hidden=5120,
        intermediate=576,
        experts=384,
        top_k=6,
        tp=4,
        rows=rows,
        scenario="correlated",
        backend=backend,
        tactic="default",
        status=status,
        error=error,
        median_us=median if status == "ok" else math.nan,
        p10_us=median * (1 - spread) if status == "ok" else math.nan,
        p90_us=median * (1 + spread) if status == "ok" else math.nan,
        unique_experts=6 * rows,
        seed=0,
    )
    row.update(kw)
    return row


def runs():
    base = pd.DataFrame([
        case(1, median=10.0), case(2, median=10.0), case(3, median=10.0), case(4, median=10.0),
        case(5, median=10.0), case(6, median=10.0), case(7, median=10.0, status="failed", error="rel. error 0.2"),
        case(8, median=10.0), case(1, backend="torch-bf16", median=50.0), case(2, backend="gone", median=9.0),
        case(3, backend="torch-bf16", median=50.0),
    ])  # fmt: skip
    cur = pd.DataFrame([
        case(1, median=12.0),  # +20 %, tight: slower
        case(2, median=9.0),  # -10 %: faster
        case(3, median=10.05),  # +0.5 % within 2 % noise: same
        case(4, median=10.3, spread=0.3),  # +3 % in 30 % noise: unclear
        case(5, median=10.3),  # +3 %, beyond the 2 % noise but under a 5 % threshold
        case(6, status="failed", error="rel. error 0.5 exceeds 0.01"),
        case(7, median=11.0),  # failed before: fixed
        case(8, median=10.0, unique_experts=99),  # another routing: mismatch
        case(1, backend="torch-bf16", median=50.0, spread=0.0),
        case(1, backend="new-one", median=5.0),
        case(3, backend="torch-bf16", status="skipped", error="no grouped_mm"),
    ])  # fmt: skip
    return cur, base


def test_a_case_without_a_valid_time_says_so():
    """An ok case with a NaN, zero or negative median is unclear for that reason, not for noise."""
    from moebench.reports.compare import NO_VALID_TIME

    base = pd.DataFrame([case(1), case(2), case(3)])
    cur = pd.DataFrame([case(1, median=0.0), case(2, median=math.nan), case(3, median=10.0)])
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=5.0)
    f = comp.frame.set_index("rows")
    assert (f.loc[[1, 2], "verdict"] == "unclear").all() and (f.loc[[1, 2], "note"] == NO_VALID_TIME).all()
    assert "2 without a valid time" in comp.unclear_note and "noise" not in comp.unclear_note
    invalid = compare_runs(cur.iloc[:2], MANIFEST, base, MANIFEST, threshold_pct=5.0)  # every case: the headline
    assert invalid.errors and "all 2 compared cases are unclear (no valid time" in invalid.errors[0]
    assert "noise" not in invalid.errors[0] and "--replays" not in invalid.errors[0]


def test_another_layer_count_is_a_mismatch():
    """--layers changes the L2 working set a replay walks: not the same measurement."""
    base = pd.DataFrame([case(1, layers=9), case(2, layers=9)])
    cur = pd.DataFrame([case(1, layers=3), case(2, layers=9, median=10.1)])
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=5.0)
    f = comp.frame.set_index("rows")
    assert f.loc[1, "verdict"] == "mismatch" and "layers 3 vs 9" in f.loc[1, "note"]
    assert f.loc[2, "verdict"] != "mismatch"


def verdicts(comp):
    return {(r["backend"], r["rows"]): r["verdict"] for r in comp.frame.to_dict("records")}


def test_verdicts_from_known_ratios_and_noise():
    cur, base = runs()
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=5.0)
    v = verdicts(comp)
    assert v == {
        ("moebench", 1): "slower", ("moebench", 2): "faster", ("moebench", 3): "same", ("moebench", 4): "unclear",
        ("moebench", 5): "slower", ("moebench", 6): "failed", ("moebench", 7): "fixed",
        ("moebench", 8): "mismatch", ("torch-bf16", 1): "same", ("new-one", 1): "new", ("gone", 2): "lost",
        ("torch-bf16", 3): "lost",
    }  # fmt: skip
    f = comp.frame.set_index(["backend", "rows"])
    assert f.loc[("moebench", 1), "ratio"] == pytest.approx(1.2)
    assert f.loc[("moebench", 1), "delta_pct"] == pytest.approx(20.0)
    assert f.loc[("moebench", 4), "noise_pct"] == pytest.approx(30.0)
    assert "rel. error 0.5" in f.loc[("moebench", 6), "note"]
    assert "unique_experts 99 vs 48" in f.loc[("moebench", 8), "note"]
    # regressions: slower beyond 5 % (rows 1, not rows 5 at +3 %), the failed case and the two lost ones
    assert sorted(comp.regressions["rows"].tolist()) == [1, 2, 3, 6]
    assert comp.mismatches == [] and not comp.device_mismatch
    strict = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=1.0)
    assert sorted(strict.regressions["rows"].tolist()) == [1, 2, 3, 5, 6]
    assert verdicts(strict)[("moebench", 4)] == "unclear"


def test_a_case_ok_in_the_baseline_but_not_timed_now_is_lost_and_a_regression():
    """A backend that stopped running (skipped now, or gone from the run) must not pass the gate unnoticed;
    a case new in the run stays informational, and one not ok in the baseline is no loss."""
    base = pd.DataFrame([
        case(1), case(2), case(3), case(4, status="skipped", error="no kernels"),
        case(5, status="failed", error="rel. error 0.3"), case(6), case(7, status="skipped", error="no kernels"),
    ])  # fmt: skip
    cur = pd.DataFrame([
        case(1),  # same
        case(2, status="skipped", error="flashinfer not installed"),  # lost: skipped now
        # rows 3: gone from the run (--backends changed): lost
        case(4, status="skipped", error="no kernels"),  # skipped in both: skipped
        case(5, status="skipped", error="no kernels"),  # not ok in the baseline: skipped
        case(6, status="failed", error="rel. error 0.5"),  # failed: its own regression, not "lost"
        case(8),  # only in this run: new
    ])  # fmt: skip
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=5.0)
    v = {rows: verdict for (_, rows), verdict in verdicts(comp).items()}
    assert v == {1: "same", 2: "lost", 3: "lost", 4: "skipped", 5: "skipped", 6: "failed", 7: "missing", 8: "new"}
    f = comp.frame.set_index("rows")
    assert f.loc[2, "note"] == "skipped in this run (flashinfer not installed); ok in the baseline"
    assert f.loc[3, "note"] == "not in this run; ok in the baseline"
    assert sorted(comp.regressions["rows"].tolist()) == [2, 3, 6] and comp.errors == []
    assert comp.counts["lost"] == 2
    text = comparison_markdown(comp)
    assert "### Regressions (3)" in text and "2 lost" in text and "lost is a regression" in text


def test_too_few_replays_are_unclear_not_a_false_alarm():
    """With --replays 1, p10 = p90 = median: a noise of 0 % would make any change "slower" / "faster".
    Fewer than MIN_REPLAYS replays on either side (manifest timing_counts of the row's timing_method;
    older runs: config.replays; neither recorded: judged as before) make the case unclear, with the reason."""

    def counts(replays, method="cuda-events"):  # eager (--no-graph) GPU timing: CPU runs never gate
        return {**MANIFEST, "timing_methods": [method], "timing_counts": {method: {"warmup": 0, "replays": replays}}}

    base = pd.DataFrame([case(1, spread=0.0, timing_method="cuda-events"),
                         case(2, spread=0.0, timing_method="cuda-events")])  # fmt: skip
    cur = base.assign(median_us=[12.8, 10.0], p10_us=[12.8, 10.0], p90_us=[12.8, 10.0])  # +28 %, +0 %
    one = compare_runs(cur, counts(1), base, counts(1), threshold_pct=5.0)
    f = one.frame.set_index("rows")
    assert (f["verdict"] == "unclear").all() and len(one.regressions) == 0
    assert f.loc[1, "note"].startswith("too few replays to judge (fewer than 10")
    assert "replays 1 in this run, 1 in the baseline" in f.loc[1, "note"]
    assert f.loc[1, "delta_pct"] == pytest.approx(28.0)  # still shown, just not judged
    assert "all 2 compared cases are unclear (2 timed with fewer than 10 replays)" in one.errors[0]
    assert "--replays 10 or more" in one.errors[0]
    # one side is enough; MIN_REPLAYS on both is judged
    assert set(compare_runs(cur, counts(100), base, counts(9)).frame["verdict"]) == {"unclear"}
    assert verdicts(compare_runs(cur, counts(10), base, counts(100)))[("moebench", 1)] == "slower"
    # the count of the row's own timing method; mixed with a judged case: a note, not an error
    eager = pd.concat([base.iloc[:1].assign(timing_method="cuda-graph"), base.iloc[1:]])
    two = {**MANIFEST, "timing_counts": {"cuda-graph": {"replays": 100}, "cuda-events": {"replays": 3}}}
    mixed = compare_runs(cur.assign(timing_method=eager["timing_method"].tolist()),
                         {**two, "timing_counts": {"cuda-graph": {"replays": 100}, "cuda-events": {"replays": 100}}},
                         eager, two)  # fmt: skip
    assert verdicts(mixed) == {("moebench", 1): "slower", ("moebench", 2): "unclear"} and not mixed.errors
    assert "1 case unclear (1 timed with fewer than 10 replays)" in mixed.unclear_note
    assert one.notes == [] and mixed.notes == []  # the run-level notes (driver, versions) stay a list
    # runs stored before timing_counts: the config's replays; a run that records neither is judged as before
    old, old_ok = {**MANIFEST, "config": {"replays": 1, "warmup": 0}}, {**MANIFEST, "config": {"replays": 100}}
    assert set(compare_runs(cur.drop(columns="timing_method"), old, base, MANIFEST).frame["verdict"]) == {"unclear"}
    assert verdicts(compare_runs(cur, old_ok, base, MANIFEST))[("moebench", 1)] == "slower"
    assert verdicts(compare_runs(cur, MANIFEST, base, MANIFEST))[("moebench", 1)] == "slower"

    from moebench.bench import EAGER_REPLAYS_CAP
    from moebench.reports.compare import MIN_REPLAYS

    assert MIN_REPLAYS == 10 and MIN_REPLAYS <= EAGER_REPLAYS_CAP  # --no-graph runs stay judged


def test_a_case_timed_another_way_is_a_mismatch_not_slower_or_faster():
    """A --no-graph (cuda-events) row against a CUDA-graph one measures launch overhead too: the rows'
    timing_method (or the run's only timing_methods entry, for runs stored before the column) must match."""
    graph = pd.DataFrame([case(1, timing_method="cuda-graph"), case(2, timing_method="cuda-graph")])
    eager = pd.DataFrame([case(1, median=14.0, timing_method="cuda-events"), case(2, timing_method="cuda-graph")])
    comp = compare_runs(eager, MANIFEST, graph, MANIFEST, threshold_pct=5.0)
    f = comp.frame.set_index("rows")
    assert f.loc[1, "verdict"] == "mismatch" and "timed with cuda-events vs cuda-graph" in f.loc[1, "note"]
    assert f.loc[2, "verdict"] == "same" and len(comp.regressions) == 0 and comp.errors == []
    # rows without the column: the manifest's timing_methods
    bare = eager.drop(columns="timing_method").assign(median_us=14.0, p10_us=13.9, p90_us=14.1)
    whole = compare_runs(bare, {**MANIFEST, "timing_methods": ["cuda-events"]}, graph, MANIFEST, threshold_pct=5.0)
    assert set(whole.frame["verdict"]) == {"mismatch"} and len(whole.regressions) == 0
    assert "no case could be compared" in whole.errors[0] and "timed with cuda-events vs cuda-graph" in whole.errors[0]
    # unknown on either side: compared as before
    unknown = compare_runs(bare, MANIFEST, graph, MANIFEST, threshold_pct=5.0)
    assert set(unknown.frame["verdict"]) == {"slower"}


def test_mismatched_devices_are_reported_not_compared():
    cur, base = runs()
    other = {**MANIFEST, "device": {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "driver": "570.1"}}
    comp = compare_runs(cur, other, base, MANIFEST)
    assert comp.device_mismatch and "H100" in comp.mismatches[0]
    v = verdicts(comp)
    assert v[("moebench", 1)] == "mismatch" and v[("moebench", 2)] == "mismatch"
    assert v[("moebench", 6)] == "failed"  # a failed case is still shown as failed
    reduced = compare_runs(cur, {**MANIFEST, "reduced": True}, base, MANIFEST)
    assert any("geometry" in m for m in reduced.mismatches)


def test_shape_mismatch_per_case():
    cur, base = runs()
    cur.loc[0, "hidden"] = 4096
    comp = compare_runs(cur, MANIFEST, base, MANIFEST)
    row = comp.frame.iloc[0]
    assert row["verdict"] == "mismatch" and "hidden 4096 vs 5120" in row["note"]


def test_notes_for_driver_and_versions():
    cur, base = runs()
    m2 = {**MANIFEST, "device": {**MANIFEST["device"], "driver": "575.0"}, "packages": {"torch": "2.10"}}
    comp = compare_runs(cur, m2, base, MANIFEST)
    assert any("driver 575.0" in n for n in comp.notes) and any("torch 2.10" in n for n in comp.notes)
    assert comp.mismatches == []


def test_classify_edges():
    assert classify(10, 9.9, 10.1, 10, 9.9, 10.1)[0] == "same"
    assert classify(10, 10, 10, 10, 10, 10)[0] == "same"
    assert classify(10.01, 10.01, 10.01, 10, 10, 10)[0] == "slower"  # zero noise: any change shows
    assert classify(math.nan, 1, 1, 10, 9, 11)[0] == "unclear"
    verdict, ratio, delta, noise = classify(20, 18, 22, 10, 9.5, 10.5, threshold_pct=5)
    assert verdict == "slower" and ratio == 2 and delta == pytest.approx(100) and noise == pytest.approx(10)


def test_parse_threshold():
    assert (
        parse_threshold("5%") == 5.0
        and parse_threshold("0.5 %") == 0.5
        and parse_threshold(3) == 3.0
        and parse_threshold("0") == 0.0
    )
    for bad in ("x", "-1%", "-0", "-0.0%", "nan", "inf", "", True):
        with pytest.raises(ValueError, match="threshold"):
            parse_threshold(bad)


def test_bad_inputs():
    cur, base = runs()
    with pytest.raises(ValueError, match="baseline run lacks columns"):
        compare_runs(cur, MANIFEST, base.drop(columns=["p10_us"]), MANIFEST)
    with pytest.raises(ValueError, match="two rows"):
        compare_runs(pd.concat([cur, cur.iloc[:1]]), MANIFEST, base, MANIFEST)
    with pytest.raises(ValueError, match="threshold"):
        compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=-1)


def test_markdown_lists_regressions_and_mismatches():
    cur, base = runs()
    text = comparison_markdown(compare_runs(cur, MANIFEST, base, MANIFEST, baseline_label="runs/base"))
    assert "vs runs/base" in text and "### Regressions (4)" in text and "1 failed" in text
    assert "slower" in text and "unclear" in text


def test_an_empty_baseline_or_nothing_in_common_is_an_error_not_a_pass():
    cur = pd.DataFrame([case(1, median=10.0), case(2, median=11.0)])
    empty = cur.iloc[0:0]
    comp = compare_runs(cur, MANIFEST, empty, MANIFEST, current_label="cur", baseline_label="base")
    assert any("baseline run base holds no cases" in e for e in comp.errors) and len(comp.regressions) == 0
    assert "not a pass" in comparison_markdown(comp) and "No regressions" not in comparison_markdown(comp)
    assert compare_runs(empty, MANIFEST, cur, MANIFEST).errors[0].startswith("the run current holds no cases")
    apart = compare_runs(cur[cur["rows"] == 1], MANIFEST, cur[cur["rows"] == 2], MANIFEST)
    assert "no case could be compared" in apart.errors[0] and "1 new, 1 lost" in apart.errors[0]
    cur, base = runs()
    assert compare_runs(cur, MANIFEST, base, MANIFEST).errors == []


def test_other_run_kind_or_rank_count_is_a_mismatch_not_compared():
    cur, base = runs()
    sweep = {**MANIFEST}  # sweep runs lack "kind" and "ranks"
    step_tp2 = {**MANIFEST, "kind": "step", "ranks": 2}
    step_one_rank = {**MANIFEST, "kind": "step", "ranks": 1}
    for current, baseline, needle in ((step_tp2, sweep, "run kind: step vs baseline sweep"),
                                      (sweep, step_one_rank, "run kind: sweep vs baseline step"),
                                      (step_tp2, step_one_rank, "ranks: 2 vs baseline 1")):  # fmt: skip
        comp = compare_runs(cur, current, base, baseline, threshold_pct=5.0)
        assert any(needle in m for m in comp.mismatches), comp.mismatches
        v = verdicts(comp)
        assert v[("moebench", 1)] == "mismatch" and v[("moebench", 2)] == "mismatch"
        assert len(comp.regressions[comp.regressions["verdict"] == "slower"]) == 0
    assert compare_runs(cur, step_tp2, base, step_tp2).mismatches == []
    assert compare_runs(cur, {**MANIFEST, "kind": "sweep", "ranks": 1}, base, sweep).mismatches == []
    warm = compare_runs(cur, {**MANIFEST, "warm_l2": True}, base, MANIFEST)
    assert verdicts(warm)[("moebench", 1)] == "mismatch"


def test_a_step_with_the_shared_expert_on_another_stream_is_a_mismatch():
    cur, base = runs()
    side = {**MANIFEST, "kind": "step", "ranks": 1, "config": {"overlap_shared": True}}
    serial = {**MANIFEST, "kind": "step", "ranks": 1, "config": {"overlap_shared": False}}
    old = {**MANIFEST, "kind": "step", "ranks": 1, "config": {}}  # stored before the option: in order
    for current, baseline in ((side, serial), (serial, side), (side, old)):
        comp = compare_runs(cur, current, base, baseline, threshold_pct=5.0)
        assert any(m.startswith("shared expert:") for m in comp.mismatches), comp.mismatches
        assert verdicts(comp)[("moebench", 1)] == "mismatch"
    assert compare_runs(cur, serial, base, old).mismatches == []
    assert compare_runs(cur, side, base, side).mismatches == []


def test_a_layer_boundary_run_is_not_compared_with_a_back_to_back_one():
    """A sweep timed at the layer boundary (the default) against one timed
    back to back (--back-to-back, or any sweep stored before the field) is a
    run-level mismatch; the same boundary compares; a step has no such
    field. A row-level boundary that differs is a case mismatch too."""
    cur, base = runs()
    layer = {**MANIFEST, "boundary": "layer"}
    b2b = {**MANIFEST, "boundary": "back-to-back"}
    for current, baseline, needle in ((layer, b2b, "layer boundary: layer vs baseline back-to-back"),
                                      (layer, MANIFEST, "layer boundary: layer vs baseline back-to-back"),
                                      (b2b, layer, "layer boundary: back-to-back vs baseline layer")):  # fmt: skip
        comp = compare_runs(cur, current, base, baseline, threshold_pct=5.0)
        assert any(needle in m for m in comp.mismatches), comp.mismatches
        assert verdicts(comp)[("moebench", 1)] == "mismatch"
    assert compare_runs(cur, layer, base, layer).mismatches == []
    assert compare_runs(cur, b2b, base, MANIFEST).mismatches == []  # stored before the field: back to back
    step = {**MANIFEST, "kind": "step", "ranks": 1}
    assert compare_runs(cur, step, base, step).mismatches == []
    rows_cur = pd.DataFrame([case(1, boundary="layer"), case(2, boundary="layer")])
    rows_base = pd.DataFrame([case(1, boundary="back-to-back"), case(2, boundary="layer")])
    comp = compare_runs(rows_cur, layer, rows_base, layer, threshold_pct=5.0)
    f = comp.frame.set_index("rows")
    assert f.loc[1, "verdict"] == "mismatch" and "layer boundary vs back-to-back" in f.loc[1, "note"]
    assert f.loc[2, "verdict"] == "same"


def test_nothing_compared_for_a_run_level_mismatch_says_so():
    cur = pd.DataFrame([case(1, median=12.0), case(2, median=12.0)])
    comp = compare_runs(cur, {**MANIFEST, "kind": "step", "ranks": 2}, cur, MANIFEST)
    assert "the runs differ in run kind, ranks" in comp.errors[0] and "tactic" not in comp.errors[0]


def test_tactic_hint_only_when_the_tactic_is_the_only_differing_key():
    base = pd.DataFrame([case(1), case(2)])
    tuned = base.assign(tactic="tuned")
    only_tactic = compare_runs(tuned, MANIFEST, base, MANIFEST)
    assert "only the tactic differs (tuned vs default)" in only_tactic.errors[0]
    tp_too = compare_runs(tuned.assign(tp=8), MANIFEST, base, MANIFEST)
    assert "no case could be compared" in tp_too.errors[0] and "tactic" not in tp_too.errors[0]
    only_tp = compare_runs(base.assign(tp=8), MANIFEST, base, MANIFEST)
    assert "only the tp differs (8 vs 4)" in only_tp.errors[0]


def test_unclear_cases_never_read_as_no_regressions():
    base = pd.DataFrame([case(1), case(2)])
    noisy = pd.DataFrame([case(1, median=10.3, spread=0.3), case(2, median=10.3, spread=0.3)])
    comp = compare_runs(noisy, MANIFEST, base, MANIFEST, threshold_pct=5.0)
    assert set(comp.frame["verdict"]) == {"unclear"} and len(comp.regressions) == 0
    assert "no case could be judged: all 2 compared cases are unclear" in comp.errors[0]
    text = comparison_markdown(comp)
    assert "No regressions" not in text and "not a pass" in text
    mixed = compare_runs(pd.concat([noisy.iloc[:1], base.iloc[1:]]), MANIFEST, base, MANIFEST, threshold_pct=5.0)
    assert mixed.errors == [] and mixed.unclear_note.startswith("1 case unclear")
    text = comparison_markdown(mixed)
    assert "No regressions." not in text and "regressions not ruled out" in text
    assert compare_runs(base, MANIFEST, base, MANIFEST).unclear_note is None
    assert "re-run with more --replays on a quiet GPU" in comp.errors[0]
    # CPU runs: more replays cannot steady wall-clock times (and eager timing caps them at 20)
    cpu = {**MANIFEST, "timing_methods": ["cpu-wallclock"]}
    on_cpu = compare_runs(noisy, cpu, base, cpu, threshold_pct=5.0)
    assert on_cpu.errors[0].startswith("CPU timings cannot gate") and "--replays" not in on_cpu.errors[0]
    assert "No regressions." in comparison_markdown(compare_runs(base, MANIFEST, base, MANIFEST))


def test_cpu_runs_cannot_gate_even_where_some_cases_read_same_or_slower():
    """Two CPU sweeps of the same code called most cases unclear and the rest same / slower, and passed
    (exit 0): 20 eager replays of torch on a shared CPU are no noise estimate for a gate. One error line
    says so; the verdicts stay in the frame, shown."""
    from moebench.reports.compare import CPU_CANNOT_GATE

    cpu = {**MANIFEST, "timing_methods": ["cpu-wallclock"], "timing_counts": {"cpu-wallclock": {"replays": 20}}}
    base = pd.DataFrame([case(r, timing_method="cpu-wallclock") for r in (1, 2, 3)])
    cur = pd.DataFrame([case(1, median=10.05, timing_method="cpu-wallclock"),  # same
                        case(2, median=12.0, timing_method="cpu-wallclock"),  # slower
                        case(3, median=10.3, spread=0.3, timing_method="cpu-wallclock")])  # unclear  # fmt: skip
    comp = compare_runs(cur, cpu, base, cpu, threshold_pct=5.0)
    assert comp.errors == [CPU_CANNOT_GATE] and "CPU timings cannot gate" in CPU_CANNOT_GATE
    assert verdicts(comp) == {("moebench", 1): "same", ("moebench", 2): "slower", ("moebench", 3): "unclear"}
    text = comparison_markdown(comp)
    assert "not a pass" in text and "No regression" not in text
    gpu = compare_runs(cur.assign(timing_method="cuda-graph"), MANIFEST, base.assign(timing_method="cuda-graph"),
                       MANIFEST, threshold_pct=5.0)  # fmt: skip
    assert gpu.errors == [] and len(gpu.regressions) == 1  # the same times from a GPU gate


def test_slower_cases_within_the_threshold_are_explained_not_a_contradiction():
    """'slower' is beyond the noise; a regression also needs the threshold:
    'No regressions' beside slower verdicts says why."""
    base = pd.DataFrame([case(1, median=10.0), case(2, median=10.0)])
    cur = pd.DataFrame([case(1, median=12.0), case(2, median=10.0)])  # +20 % in 2 % noise
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=100.0)
    assert verdicts(comp)[("moebench", 1)] == "slower" and not len(comp.regressions)
    assert within_threshold_note(comp) == (
        " 1 case(s) read slower (beyond the noise) but by no more than the 100 % threshold."
    )
    assert "No regressions. 1 case(s) read slower" in comparison_markdown(comp)
    comp = compare_runs(cur, MANIFEST, base, MANIFEST, threshold_pct=5.0)  # now a regression: no such note
    assert len(comp.regressions) == 1 and within_threshold_note(comp) == ""
