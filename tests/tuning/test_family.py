"""The default kernel family per layer: from both families' µs in the tuning
tables (the faster per rows, one family per layer), else the built-in rule
(FP8 where its built-in tactics fit); resolve_family's arguments and errors."""

import logging

import pytest

from moebench.kernels import table as tb
from moebench.kernels.family import (
    BF16, FP8, RowsTimes, builtin_refusal, choose_family, resolve_family, rows_text, rows_times,
)  # fmt: skip
from moebench.kernels.table import ShapeClass, TableEntry, TuningTable
from moebench.kernels.tactic import default_fp8_tactic, default_tactic
from moebench.models import get_preset
from moebench.tuning.family import family_markdown
from moebench.tuning.table import write_table

SHAPE = ShapeClass.of(get_preset("dsv41-flash").shard(4))  # E 384, H 5120, I 576, top_k 6
DEVICE = "NVIDIA H200"
T1, T2 = (default_tactic(SHAPE.gemm_shape, s, 6) for s in (1, 2))
F1, F2 = (default_fp8_tactic(SHAPE.gemm_shape, s, 6) for s in (1, 2))
#: dsv41-flash at H 32768 (TP1): the staged fp8 activation tile outgrows shared memory; BF16 fits.
WIDE = ShapeClass.of(get_preset("dsv41-flash", hidden=32768).shard(1))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """No $MOEBENCH_TUNING_DIR and an empty package table directory: each test's tables only."""
    monkeypatch.delenv(tb.ENV_DIR, raising=False)
    empty = tmp_path / "package-tables"
    empty.mkdir()
    monkeypatch.setattr(tb, "PACKAGE_TABLES", empty)
    tb.reset_log_once()
    yield
    tb.reset_log_once()


def _entry(tactic, us):
    return TableEntry(tactic, us, us * 0.98, us * 1.02)


def make(bf16=None, fp8=None, shape=SHAPE, device=DEVICE) -> TuningTable:
    """A table with {rows: (GEMM1 µs, GEMM2 µs)} per family (a None µs: no entry)."""

    def part(times, t1, t2):
        out = {}
        for rows, (g1, g2) in (times or {}).items():
            if g1 is not None:
                out[1, rows] = _entry(t1, g1)
            if g2 is not None:
                out[2, rows] = _entry(t2, g2)
        return out

    t1, t2 = (default_tactic(shape.gemm_shape, s, 6) for s in (1, 2))
    f = {}
    if fp8:
        f1, f2 = (default_fp8_tactic(shape.gemm_shape, s, 6) for s in (1, 2))
        f = part(fp8, f1, f2)
    return TuningTable(shape, {"name": device, "sm_count": 132}, part(bf16, t1, t2), fp8_entries=f)


def every(g1, g2=None):
    """The same (GEMM1, GEMM2) µs at rows 1-8."""
    return {r: (g1, g1 if g2 is None else g2) for r in range(1, 9)}


def test_both_families_in_the_table_the_faster_one_runs(tmp_path):
    write_table(make(bf16=every(20.0), fp8=every(15.0)), tmp_path)
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert c.fp8 and c.family == FP8 and c.source == "tables" and c.reason == "fp8 faster at rows 1-8"
    assert [(t.rows, t.bf16_us, t.fp8_us, t.faster) for t in c.times] == [(r, 20.0, 15.0, FP8) for r in range(1, 9)]
    write_table(make(bf16=every(14.0), fp8=every(15.0)), tmp_path / "b")
    c = choose_family(DEVICE, SHAPE, search=[tmp_path / "b"])
    assert not c.fp8 and c.family == BF16 and c.reason == "bf16 faster at rows 1-8"
    assert c.describe() == "bf16 (tables: bf16 faster at rows 1-8)"


def test_a_family_time_is_the_lower_of_its_gemm1_and_gemm2_entries(tmp_path):
    """Each entry times the whole routed path; the one timed beside the other
    stage's tuned tactic is the table's pair and the lower: BF16 12 beats
    FP8 14 although FP8's GEMM1 entry (15) beats BF16's (20)."""
    write_table(make(bf16=every(20.0, 12.0), fp8=every(15.0, 14.0)), tmp_path)
    times = rows_times(DEVICE, SHAPE, search=[tmp_path])
    assert all(t.bf16_us == 12.0 and t.fp8_us == 14.0 for t in times)
    assert choose_family(DEVICE, SHAPE, search=[tmp_path]).family == BF16


def test_rows_that_disagree_one_family_per_layer_by_the_summed_time(tmp_path):
    """FP8 1 µs faster at rows 1-4, BF16 3 µs faster at rows 5-8: a layer holds
    one family, the one with less time summed over the rows both time."""
    times = {r: ((20.0, 20.0) if r <= 4 else (30.0, 30.0)) for r in range(1, 9)}
    fp8 = {r: ((19.0, 19.0) if r <= 4 else (33.0, 33.0)) for r in range(1, 9)}
    write_table(make(bf16=times, fp8=fp8), tmp_path)
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert c.family == BF16 and c.source == "tables"
    assert c.reason == ("fp8 faster at rows 1-4; bf16 faster at rows 5-8; one family per layer: bf16, 8.0 µs less"
                        " summed over rows 1-8")  # fmt: skip
    fp8 = {r: ((15.0, 15.0) if r <= 4 else (31.0, 31.0)) for r in range(1, 9)}  # now FP8 saves 20, loses 4
    write_table(make(bf16=times, fp8=fp8), tmp_path / "b")
    c = choose_family(DEVICE, SHAPE, search=[tmp_path / "b"])
    assert c.family == FP8 and "fp8, 16.0 µs less summed over rows 1-8" in c.reason


def test_a_table_with_one_family_takes_it(tmp_path):
    """BF16 entries only (a schema-1 table, e.g. on a GPU where only `moebench
    tune` ran): BF16, though the built-in rule would take FP8; FP8 entries
    only at two row counts: FP8."""
    write_table(make(bf16=every(30.0)), tmp_path)
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert c.family == BF16 and c.source == "tables" and c.reason == "bf16 faster at rows 1-8"
    assert all(t.fp8_us is None for t in c.times)
    write_table(make(fp8={1: (10.0, None), 2: (None, 11.0)}), tmp_path / "b")
    c = choose_family(DEVICE, SHAPE, search=[tmp_path / "b"])
    assert c.family == FP8 and c.reason == "fp8 faster at rows 1-2"
    assert [t.faster for t in c.times] == [FP8, FP8, *[None] * 6]


def test_rows_only_one_family_times_do_not_outvote_the_rows_both_time(tmp_path):
    """BF16 at rows 1-8, FP8 only at rows 1-2 (faster there): the rows both
    families time decide (FP8); with no such row (FP8 at 6-8 only, BF16 at
    1-5) the family faster at more row counts."""
    write_table(make(bf16=every(30.0), fp8={1: (25.0, 25.0), 2: (26.0, 26.0)}), tmp_path)
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert c.family == FP8 and "bf16 faster at rows 3-8" in c.reason and "summed over rows 1-2" in c.reason
    write_table(make(bf16={r: (30.0, 30.0) for r in range(1, 6)}, fp8={r: (20.0, 20.0) for r in (6, 7, 8)}),
                tmp_path / "b")  # fmt: skip
    c = choose_family(DEVICE, SHAPE, search=[tmp_path / "b"])
    assert c.family == BF16 and c.reason.endswith("one family per layer: bf16, faster at more row counts")


def test_no_table_the_fp8_family_where_its_built_ins_fit(tmp_path):
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert c.family == FP8 and c.source == "built-in" and "fp8 built-in tactics fit" in c.reason
    assert len(c.times) == 8 and all(t.faster is None for t in c.times)


def test_where_the_fp8_built_ins_do_not_fit_bf16(tmp_path):
    assert builtin_refusal(WIDE, WIDE.top_k, True) is not None and builtin_refusal(WIDE, WIDE.top_k, False) is None
    c = choose_family(DEVICE, WIDE, search=[tmp_path])
    assert c.family == BF16 and c.source == "built-in" and "no fp8 GEMM1 tactic" in c.reason
    assert "shared memory" in c.reason


def test_a_family_whose_built_ins_do_not_fit_is_not_chosen_from_the_tables(tmp_path, monkeypatch):
    """A row count without a table entry runs the built-in tactics: where one
    family's do not fit the shape, the other runs whatever the µs say."""
    from moebench.kernels import family

    write_table(make(bf16=every(20.0), fp8={1: (15.0, 15.0)}), tmp_path)
    real = family.builtin_refusal
    monkeypatch.setattr(
        family,
        "builtin_refusal",
        lambda shape, top_k, fp8, num_sms=132: "no fp8 GEMM2 tactic (stand-in)" if fp8 else None,
    )
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    assert (
        c.family == BF16
        and c.source == "tables"
        and c.reason == ("the fp8 family cannot run every row count: no fp8 GEMM2 tactic (stand-in)")
    )
    monkeypatch.setattr(
        family,
        "builtin_refusal",
        lambda shape, top_k, fp8, num_sms=132: None if fp8 else "no default GEMM1 tactic (stand-in)",
    )
    write_table(make(bf16=every(10.0), fp8={1: (15.0, 15.0)}), tmp_path / "b")
    c = choose_family(DEVICE, SHAPE, search=[tmp_path / "b"])
    assert c.family == FP8 and "the BF16 family cannot run every row count" in c.reason
    monkeypatch.setattr(family, "builtin_refusal", real)
    assert choose_family(DEVICE, SHAPE, search=[tmp_path / "b"]).family == BF16


def test_each_entry_comes_from_the_first_table_holding_it(tmp_path, monkeypatch):
    """A BF16-only override in $MOEBENCH_TUNING_DIR (faster than the package's
    FP8 entries) and the package table's FP8 entries: compared entry by entry."""
    env, pkg = tmp_path / "env", tmp_path / "pkg"
    write_table(make(bf16=every(12.0)), env)
    write_table(make(bf16=every(30.0), fp8=every(15.0)), pkg)
    monkeypatch.setattr(tb, "PACKAGE_TABLES", pkg)
    monkeypatch.setenv(tb.ENV_DIR, str(env))
    c = choose_family(DEVICE, SHAPE)
    assert all(t.bf16_us == 12.0 and t.fp8_us == 15.0 for t in c.times) and c.family == BF16
    monkeypatch.delenv(tb.ENV_DIR)
    assert choose_family(DEVICE, SHAPE).family == FP8


def test_a_corrupt_table_warns_once_and_the_built_in_rule_serves(tmp_path, caplog):
    (tmp_path / tb.table_file_name(SHAPE, DEVICE)).write_text("{not json")
    for _ in range(2):
        c = choose_family(DEVICE, SHAPE, search=[tmp_path])
        assert c.family == FP8 and c.source == "built-in"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not readable JSON" in warnings[0]


def test_the_choice_is_logged_once_per_shape_class(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    write_table(make(bf16=every(20.0), fp8=every(15.0)), tmp_path)
    for _ in range(3):
        choose_family(DEVICE, SHAPE, search=[tmp_path])
    infos = [r.getMessage() for r in caplog.records if "kernel family" in r.getMessage()]
    assert infos == [f"moebench kernel family for {SHAPE.describe()} on {DEVICE}: fp8 (tables: fp8 faster at rows"
                     " 1-8)"]  # fmt: skip


def test_other_devices_tables_are_not_read(tmp_path):
    write_table(make(bf16=every(10.0), fp8=every(15.0), device="NVIDIA H100 80GB HBM3"), tmp_path)
    assert choose_family("NVIDIA H100 PCIe", SHAPE, search=[tmp_path]).family == BF16  # the same chip
    assert choose_family(DEVICE, SHAPE, search=[tmp_path]).source == "built-in"


# ----------------------------------------------------------------------------- resolve_family


def test_resolve_an_explicit_flag_wins_over_the_tables(tmp_path):
    write_table(make(bf16=every(10.0), fp8=every(15.0)), tmp_path)
    for fp8 in (True, False):
        c = resolve_family(fp8, None, DEVICE, SHAPE, search=[tmp_path])
        assert c.fp8 is fp8 and c.source == "asked" and c.reason == f"fp8={fp8}"
    assert resolve_family(None, None, DEVICE, SHAPE, search=[tmp_path]).family == BF16


def test_resolve_explicit_tactics_decide_by_their_family(tmp_path):
    write_table(make(bf16=every(10.0), fp8=every(15.0)), tmp_path)
    c = resolve_family(None, {1: F1}, DEVICE, SHAPE, search=[tmp_path])
    assert c.family == FP8 and c.source == "tactics"
    c = resolve_family(None, {2: T2, 1: None}, DEVICE, SHAPE, search=[tmp_path])
    assert c.family == BF16 and c.source == "tactics"


def test_resolve_empty_tactics_take_the_built_in_rule_tables_ignored(tmp_path):
    write_table(make(bf16=every(10.0), fp8=every(15.0)), tmp_path)  # the tables would say BF16
    for given in ({}, {1: None, 2: None}):
        c = resolve_family(None, given, DEVICE, SHAPE, search=[tmp_path])
        assert c.family == FP8 and c.source == "built-in"
    assert resolve_family(None, {}, DEVICE, WIDE, search=[tmp_path]).family == BF16


def test_resolve_errors_name_the_argument():
    with pytest.raises(TypeError, match="fp8 must be a bool or None"):
        resolve_family("yes", None, DEVICE, SHAPE)
    with pytest.raises(TypeError, match="fp8 must be a bool or None"):
        resolve_family(1, None, DEVICE, SHAPE)
    with pytest.raises(ValueError, match=r"tactics mix the fp8 and BF16 families \(tactics\[1\] .*_f8, tactics\[2\]"):
        resolve_family(None, {1: F1, 2: T2}, DEVICE, SHAPE)
    with pytest.raises(ValueError, match=r"tactics\[2\] \(.*\) is not an fp8 tactic but fp8=True"):
        resolve_family(True, {2: T2}, DEVICE, SHAPE)
    with pytest.raises(ValueError, match=r"tactics\[1\] \(.*_f8\) is an fp8 tactic but fp8=False"):
        resolve_family(False, {1: F1}, DEVICE, SHAPE)
    with pytest.raises(TypeError, match="tactics must be None or a dict"):
        resolve_family(None, [T1], DEVICE, SHAPE)
    with pytest.raises(ValueError, match="tactics keys must be the stages 1 and 2, got 3"):
        resolve_family(None, {3: T1}, DEVICE, SHAPE)
    with pytest.raises(TypeError, match=r"tactics\[1\] must be a GemmTactic or None, got str"):
        resolve_family(None, {1: "r64_m1_k8_u4_c1"}, DEVICE, SHAPE)
    with pytest.raises(TypeError, match="top_k"):
        resolve_family(None, None, DEVICE, SHAPE.gemm_shape)  # a GemmShape has no top_k


# ----------------------------------------------------------------------------- text


def test_rows_text_and_faster():
    assert rows_text([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8" and rows_text([4]) == "4" and rows_text([]) == ""
    assert RowsTimes(1, None, None).faster is None and RowsTimes(1, 5.0, None).faster == BF16
    assert RowsTimes(1, None, 5.0).faster == FP8 and RowsTimes(1, 5.0, 5.0).faster == FP8  # a tie: FP8
    assert RowsTimes(1, 4.9, 5.0).faster == BF16


def test_family_markdown_lists_each_rows_times_and_the_layer_family(tmp_path):
    write_table(make(bf16=every(20.0), fp8={1: (15.0, 15.5)}), tmp_path)
    c = choose_family(DEVICE, SHAPE, search=[tmp_path])
    text = family_markdown([("E=384 TP4", c)])
    assert "| E=384 TP4 | 1 | 20.0 | 15.0 | fp8 | fp8 |" in text and "| E=384 TP4 | 8 | 20.0 | - | bf16 | fp8 |" in text
    assert f"- E=384 TP4: {c.describe()}" in text and "| E=384 TP4 | 8 |" in text
    text = family_markdown([("none", choose_family(DEVICE, SHAPE, search=[tmp_path / "none"]))])
    assert "| none | - | - | - | - | fp8 |" in text and "- none: fp8 (built-in: " in text


def test_default_families_reads_the_tables_just_written_first(tmp_path):
    from moebench.tuning.family import default_families

    write_table(make(bf16=every(10.0), fp8=every(5.0)), tmp_path / "new")
    write_table(make(bf16=every(1.0), fp8=every(5.0)), tmp_path / "env")
    assert default_families([], tmp_path / "new") == []
    chosen = default_families([(DEVICE, SHAPE, 132)] * 2, tmp_path / "new")  # one row per distinct table
    assert [label for label, _ in chosen] == [f"{SHAPE.describe()} on {DEVICE}"] and chosen[0][1].family == FP8
    assert default_families([(DEVICE, SHAPE, 132)], tmp_path / "env")[0][1].family == BF16
