"""Tuning tables: schema, names, atomic writes, refusals, runtime loading."""

import json
import logging
import os

import pytest

from moebench.kernels import table as tb
from moebench.kernels.fused_tactic import FusedTactic, LayerChoice, default_fused_tactic
from moebench.kernels.table import (
    ShapeClass, TableConflict, TableEntry, TableError, TuningTable, load_layer_choice, load_tactic,
    normalize_device_name, read_table, table_file_name,
)  # fmt: skip
from moebench.kernels.tactic import GemmTactic, default_fp8_tactic, default_tactic
from moebench.models import get_preset
from moebench.record import max_ctas
from moebench.tuning.table import verify_tables, write_table

SHAPE = ShapeClass.of(get_preset("dsv41-flash").shard(4))  # E 384, H 5120, I 576, top_k 6
NAME = "E=384,H=5120,I=576,top_k=6,device_name=NVIDIA_H200,dtype=mxfp4.json"
T1 = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=2, ctas_per_sm=2)
T2 = GemmTactic(tile_rows=32, warps_m=8, warps_k=1, unroll=4, ctas_per_sm=2)
PROV = {"device": "NVIDIA H200", "driver": "570.1", "commit": "abc", "created_utc": "2026-12-01T00:00:00+00:00"}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(tb.ENV_DIR, raising=False)
    tb.reset_log_once()
    yield
    tb.reset_log_once()


def entry(tactic=T1, us=10.0):
    return TableEntry(tactic, us, us * 0.98, us * 1.03, runner_up=T2, runner_up_us=us * 1.1, margin_pct=10.0,
                      separated=True, candidates=50, rejected=2, provenance=PROV)  # fmt: skip


def make_table(device="NVIDIA H200", rows=range(1, 9), **kw) -> TuningTable:
    entries = {(s, r): entry(T1 if s == 1 else T2, 10.0 + r) for s in (1, 2) for r in rows}
    return TuningTable(SHAPE, {"name": device, "sm_count": 132, "capability": "9.0"}, entries, **kw)


@pytest.mark.parametrize(
    "raw, family",
    [("NVIDIA H200", "NVIDIA_H200"), ("NVIDIA H200 NVL", "NVIDIA_H200"), ("  NVIDIA   H200 ", "NVIDIA_H200"),
     ("NVIDIA H100 80GB HBM3", "NVIDIA_H100"), ("NVIDIA H100 PCIe", "NVIDIA_H100"),
     ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA_H100"), ("NVIDIA GH200 480GB", "NVIDIA_GH200"),
     ("NVIDIA_H200", "NVIDIA_H200")],
)  # fmt: skip
def test_device_names_normalize_to_the_chip(raw, family):
    assert normalize_device_name(raw) == family


def test_bad_device_names():
    with pytest.raises(ValueError, match="device name"):
        normalize_device_name("  ")
    with pytest.raises(TypeError):
        normalize_device_name(None)


def test_file_name_is_vllm_style():
    assert table_file_name(SHAPE, "NVIDIA H200") == NAME
    assert table_file_name(SHAPE, "NVIDIA H200 NVL") == NAME
    assert table_file_name(get_preset("dsv41-flash").shard(4), "NVIDIA H200") == NAME  # from a RankShape
    with pytest.raises(TypeError, match="top_k"):
        table_file_name(SHAPE.gemm_shape, "NVIDIA H200")
    assert table_file_name(SHAPE.gemm_shape, "NVIDIA H200", top_k=6) == NAME


def test_round_trip(tmp_path):
    t = make_table()
    path = write_table(t, tmp_path)
    assert path.name == NAME and path.parent == tmp_path
    back = read_table(path)
    assert back.entries == t.entries and back.shape == SHAPE and back.device == t.device
    data = json.loads(path.read_text())
    assert data["device"]["family"] == "NVIDIA_H200"
    e = data["gemm1"]["6"]
    assert e["tactic"]["name"] == T1.name and e["runner_up"]["name"] == T2.name and e["margin_pct"] == 10.0
    assert e["provenance"]["driver"] == "570.1" and e["median_us"] == 16.0
    assert [p.name for p in tmp_path.iterdir()] == [NAME]  # no temporary left


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    old = write_table(make_table(rows=[1]), tmp_path)
    before = old.read_text()

    def crash(fd):
        raise OSError("disk gone mid-write")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="mid-write"):
        write_table(make_table(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [NAME] and old.read_text() == before

    monkeypatch.undo()
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt()))
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        write_table(make_table(), fresh)
    assert list(fresh.iterdir()) == []


def test_refuses_to_replace_another_devices_table_without_force(tmp_path):
    write_table(make_table("NVIDIA H200 NVL"), tmp_path)
    with pytest.raises(TableConflict, match=r"NVIDIA H200 NVL.*--force") as err:
        write_table(make_table("NVIDIA H200"), tmp_path)
    assert NAME in str(err.value)
    write_table(make_table("NVIDIA H200"), tmp_path, force=True)
    assert read_table(tmp_path / NAME).device["name"] == "NVIDIA H200"


def test_refuses_to_replace_a_newer_version_without_force(tmp_path):
    write_table(make_table(moebench_version="9.1.0"), tmp_path)
    with pytest.raises(TableConflict, match="newer moebench"):
        write_table(make_table(), tmp_path)
    write_table(make_table(), tmp_path, force=True)
    write_table(make_table(), tmp_path)  # same device and version: a re-tune replaces it
    (tmp_path / NAME).write_text("{broken")
    with pytest.raises(TableConflict, match="not a usable table"):
        write_table(make_table(), tmp_path)


def test_newer_tactics_version_is_refused_too(tmp_path):
    write_table(make_table(tactics_version=tb.TACTICS_VERSION + 1), tmp_path)
    with pytest.raises(TableConflict, match="tactics version"):
        write_table(make_table(), tmp_path)


def test_merge_keeps_rows_not_retuned():
    old = make_table()
    new = make_table(rows=[6])
    merged = new.merged_over(old)
    assert len(merged.entries) == 16 and merged.entries[1, 6] is new.entries[1, 6]
    with pytest.raises(TableConflict):
        new.merged_over(make_table("NVIDIA H100"))


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_table(tmp_path / NAME)
    bad = tmp_path / NAME
    bad.write_text("not json")
    with pytest.raises(TableError, match=str(bad)):
        read_table(bad)
    data = make_table().to_dict()
    data["gemm1"]["3"]["p10_us"] = 99.0
    bad.write_text(json.dumps(data))
    with pytest.raises(TableError, match=r"gemm1\[3\].*p10_us <= median_us"):
        read_table(bad)
    data = make_table().to_dict()
    data["gemm1"]["2"]["tactic"]["name"] = "r32_m1_k1_u1_c1"
    bad.write_text(json.dumps(data))
    with pytest.raises(TableError, match="does not match its fields"):
        read_table(bad)
    data = make_table().to_dict()
    data["gemm1"]["2"]["tactic"].update(tile_rows=32, warps_m=8, warps_k=1, name="r32_m8_k1_u2_c2")
    bad.write_text(json.dumps(data))  # 256-row GEMM1 items do not tile 2 x 576
    with pytest.raises(TableError, match="cannot run GEMM1"):
        read_table(bad)
    wrong = tmp_path / NAME.replace("H=5120", "H=4096")
    wrong.write_text(json.dumps(make_table().to_dict()))
    with pytest.raises(TableError, match="file name does not match"):
        read_table(wrong)
    data = make_table().to_dict()
    data["schema"] = tb.SCHEMA + 1
    bad.write_text(json.dumps(data))
    with pytest.raises(TableError, match="newer than this moebench reads"):
        read_table(bad)


def test_entry_validation():
    with pytest.raises(ValueError, match="p10_us <= median_us"):
        TableEntry(T1, 10.0, 11.0, 12.0)
    with pytest.raises(ValueError, match="go together"):
        TableEntry(T1, 10.0, 9.0, 11.0, runner_up=T2)
    with pytest.raises(TypeError, match="GemmTactic"):
        TableEntry("r64", 10.0, 9.0, 11.0)
    with pytest.raises(ValueError, match="entries keys"):
        TuningTable(SHAPE, {"name": "NVIDIA H200"}, {(1, 9): entry()})


# ----------------------------------------------------------------------------- runtime


def default_for(rows, stage, shape=SHAPE):
    return default_tactic(shape.gemm_shape, stage, max_ctas(rows, shape.top_k, shape.experts), 132)


def test_no_table_falls_back_to_the_default_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    for rows in (1, 6):
        for stage in (1, 2):
            tactic, source = load_tactic("NVIDIA H200", SHAPE, rows, stage, search=[tmp_path])
            assert tactic == default_for(rows, stage) and source.startswith("default")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and NAME in warnings[0].getMessage() and str(tmp_path) in warnings[0].getMessage()


def test_table_from_the_env_dir_wins_and_nvl_finds_it(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    env_dir, pkg = tmp_path / "env", tmp_path / "pkg"
    write_table(make_table(), env_dir)
    other = make_table()
    other.entries[1, 6] = entry(GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=2, ctas_per_sm=2))
    write_table(other, pkg)
    monkeypatch.setattr(tb, "PACKAGE_TABLES", pkg)
    monkeypatch.setenv(tb.ENV_DIR, str(env_dir))
    tactic, source = load_tactic("NVIDIA H200 NVL", get_preset("dsv41-flash").shard(4), 6, 1)
    assert tactic == T1 and str(env_dir / NAME) in source and "gemm1[6]" in source
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "tuned on NVIDIA H200" in infos[0]
    load_tactic("NVIDIA H200 NVL", SHAPE, 6, 2)
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 1  # logged once
    monkeypatch.delenv(tb.ENV_DIR)
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 1)  # then the package's tables
    assert tactic == other.entries[1, 6].tactic and str(pkg) in source


@pytest.mark.parametrize("damage", ["corrupt", "stale", "invalid-entry"])
def test_unusable_table_warns_naming_the_file_and_falls_back(tmp_path, caplog, damage):
    first, second = tmp_path / "a", tmp_path / "b"
    path = first / NAME
    first.mkdir()
    data = make_table().to_dict()
    if damage == "corrupt":
        path.write_text('{"kind": "moebench-tuning-table", "gemm1": [')
    elif damage == "stale":
        data["tactics_version"] = tb.TACTICS_VERSION - 1
        path.write_text(json.dumps(data))
    else:
        data["gemm2"]["4"]["tactic"].update(tile_rows=128, warps_m=3, name="r128_m3_k1_u4_c2")
        path.write_text(json.dumps(data))
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 4, 2, search=[first])
    assert tactic == default_for(4, 2) and source.startswith("default")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "falling back" in warnings[0]
    if damage == "stale":
        assert "stale" in warnings[0]
    write_table(make_table(), second)  # a usable table further along the search path is used
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 4, 2, search=[first, second])
    assert tactic == T2 and str(second / NAME) in source


def test_missing_entry_and_missing_dir_warn(tmp_path, caplog):
    write_table(make_table(rows=[1, 2]), tmp_path)
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 8, 1, search=[tmp_path / "nope", tmp_path])
    assert tactic == default_for(8, 1) and source.startswith("default")
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "nope does not exist" in text and f"{tmp_path / NAME} has no entry for gemm1 rows=8" in text


def test_bad_arguments_raise_but_tables_never_do(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        load_tactic("NVIDIA H200", SHAPE, 9, 1)
    with pytest.raises(ValueError, match="stage"):
        load_tactic("NVIDIA H200", SHAPE, 1, 3)
    (tmp_path / NAME).mkdir()  # a directory where the file should be
    tactic, _ = load_tactic("NVIDIA H200", SHAPE, 1, 1, search=[tmp_path])
    assert tactic == default_for(1, 1)


def test_written_tables_are_readable_by_others_under_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = write_table(make_table(), tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600


def test_read_table_on_a_directory_says_so(tmp_path):
    d = tmp_path / "a.json"
    d.mkdir()
    with pytest.raises(TableError, match="not a regular file"):
        read_table(d)
    with pytest.raises(FileNotFoundError):
        read_table(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- the FP8 family's part

F1 = default_fp8_tactic(SHAPE.gemm_shape, 1)  # r32_m4_k4_u4_c1_b4_f8 at dsv41 TP4
F2 = default_fp8_tactic(SHAPE.gemm_shape, 2)


def fp8_entry(tactic=F1, us=8.0, runner_up=None):
    return TableEntry(tactic, us, us * 0.98, us * 1.03, runner_up=runner_up,
                      runner_up_us=None if runner_up is None else us * 1.1, provenance=PROV)  # fmt: skip


def make_fp8_table(rows=range(1, 9), bf16_rows=(), **kw) -> TuningTable:
    """A table of FP8 entries (and BF16 ones at `bf16_rows`)."""
    fp8 = {(s, r): fp8_entry(F1 if s == 1 else F2, 8.0 + r) for s in (1, 2) for r in rows}
    bf16 = {(s, r): entry(T1 if s == 1 else T2, 10.0 + r) for s in (1, 2) for r in bf16_rows}
    return TuningTable(SHAPE, {"name": "NVIDIA H200", "sm_count": 132, "capability": "9.0"}, bf16,
                       fp8_entries=fp8, **kw)  # fmt: skip


def test_both_families_round_trip(tmp_path):
    t = make_fp8_table(bf16_rows=range(1, 9))
    path = write_table(t, tmp_path)
    data = json.loads(path.read_text())
    assert data["schema"] == tb.FP8_SCHEMA == 2 and set(data["fp8"]) == {"gemm1", "gemm2"}
    assert data["fp8"]["gemm2"]["6"]["tactic"]["name"] == F2.name and data["fp8"]["gemm2"]["6"]["tactic"]["fp8"]
    assert data["gemm1"]["6"]["tactic"]["name"] == T1.name
    back = read_table(path)
    assert back.entries == t.entries and back.fp8_entries == t.fp8_entries and back.schema == 2
    assert back.entry(1, 6, fp8=True).tactic == F1 and back.entry(1, 6).tactic == T1
    assert verify_tables(tmp_path) == []


def test_a_table_without_fp8_entries_stays_schema_1_and_old_tables_read(tmp_path):
    path = write_table(make_table(), tmp_path)
    data = json.loads(path.read_text())
    assert data["schema"] == 1 and "fp8" not in data  # what a moebench from before the fp8 part reads
    back = read_table(path)
    assert back.schema == 1 and back.fp8_entries == {} and len(back.entries) == 16
    data["fp8"] = {"gemm1": {}}
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match=r"schema 1 has no 'fp8' part"):
        read_table(path)


def test_every_shipped_table_holds_both_families_each_in_its_part():
    """The shipped H200 tables (tune_all.sh, then FP8=1): BF16 entries for rows
    1-8 of both stages, FP8 entries likewise (the H100's: FP8 only, two-plane GEMM1s), each part only its family's
    tactics (schema 2); dsv41-flash TP4 / TP8 (`tune --fp8 --stages fused`)
    also the pair-or-fused choice at rows 1-8 (schema 3)."""
    paths = sorted(tb.PACKAGE_TABLES.glob("*.json"))
    assert paths
    layer_choice = {"E=384,H=5120,I=576", "E=384,H=5120,I=288"}
    for path in paths:
        t = read_table(path)
        chooses = path.name.startswith(tuple(f"{s},top_k" for s in layer_choice))
        assert t.schema == (3 if chooses else 2), path
        if "device_name=NVIDIA_H200" not in path.name:  # the H100's: dsv41-flash TP4 / TP8, `tune --fp8` alone
            tuned = set(range(1, 9))
            assert chooses and not t.entries and set(t.fused_entries) == tuned, path
            assert set(t.fp8_entries) == {(st, r) for st in (1, 2) for r in tuned}, path
            # re-tuned after the FP8 GEMM1 went two-plane (issue 36 item 4)
            assert all(e.tactic.planes == 2 for (st, _), e in t.fp8_entries.items() if st == 1), path
            continue
        assert len(t.entries) == 16 and all(not e.tactic.fp8 for e in t.entries.values()), path
        assert len(t.fp8_entries) == 16 and all(e.tactic.fp8 for e in t.fp8_entries.values()), path
        assert set(t.fused_entries) == (set(range(1, 9)) if chooses else set()), path


def test_merge_keeps_the_other_family():
    bf16, fp8 = make_table(), make_fp8_table()
    merged = fp8.merged_over(bf16)  # tuning the FP8 family over a BF16-only table
    assert merged.entries == bf16.entries and merged.fp8_entries == fp8.fp8_entries
    again = make_table(rows=[6]).merged_over(merged)  # re-tuning BF16 rows 6 keeps the FP8 part
    assert again.fp8_entries == fp8.fp8_entries and again.entries[1, 6] is not bf16.entries[1, 6]
    assert len(again.entries) == 16
    partial = make_fp8_table(rows=[3]).merged_over(merged)
    assert len(partial.fp8_entries) == 16 and partial.fp8_entries[1, 3].median_us == 11.0


def test_write_refuses_to_drop_the_other_familys_entries(tmp_path):
    write_table(make_table(), tmp_path)
    with pytest.raises(TableConflict, match=r"16 BF16-family entries this table lacks.*--force"):
        write_table(make_fp8_table(), tmp_path)
    write_table(make_fp8_table().merged_over(read_table(tmp_path / NAME)), tmp_path)  # as moebench tune does
    with pytest.raises(TableConflict, match="FP8-family entries"):
        write_table(make_table(), tmp_path)
    back = read_table(tmp_path / NAME)
    assert len(back.entries) == 16 and len(back.fp8_entries) == 16
    write_table(make_table(), tmp_path, force=True)
    assert read_table(tmp_path / NAME).fp8_entries == {}


def test_each_family_holds_only_its_tactics(tmp_path):
    with pytest.raises(ValueError, match=r"^gemm1\[4\]\.tactic: .*_f8 is an fp8 tactic"):
        TuningTable(SHAPE, {"name": "NVIDIA H200"}, {(1, 4): fp8_entry()})
    with pytest.raises(ValueError, match=r"^fp8\.gemm2\[2\]\.tactic: r32_m8_k1_u4_c2 is not an fp8 tactic"):
        TuningTable(SHAPE, {"name": "NVIDIA H200"}, fp8_entries={(2, 2): entry(T2)})
    with pytest.raises(ValueError, match=r"^fp8\.gemm1\[1\]\.runner_up: .* is not an fp8 tactic"):
        TuningTable(SHAPE, {"name": "NVIDIA H200"}, fp8_entries={(1, 1): fp8_entry(runner_up=T1)})
    with pytest.raises(ValueError, match="fp8_entries keys"):
        TuningTable(SHAPE, {"name": "NVIDIA H200"}, fp8_entries={(3, 1): fp8_entry()})
    bad = tmp_path / NAME
    for mutate, needle in [
        (lambda d: d["fp8"]["gemm1"]["2"].update(tactic=T1.to_fields()),
         r"fp8\.gemm1\[2\]\.tactic: r64_m1_k4_u2_c2 is not an fp8 tactic"),
        (lambda d: d["gemm2"].update({"5": d["fp8"]["gemm2"]["5"]}), r"gemm2\[5\]\.tactic: .*_f8 is an fp8 tactic"),
        (lambda d: d.update(fp8=[]), "fp8 must be an object"),
        (lambda d: d["fp8"].update(gemm3={}), r"fp8 holds \['gemm3'\]"),
        (lambda d: d["fp8"]["gemm1"].update({"9": {}}), r"fp8\.gemm1 has rows '9'"),
        (lambda d: d["fp8"]["gemm2"]["1"].pop("median_us"), r"fp8\.gemm2\[1\]: entry lacks 'median_us'"),
    ]:  # fmt: skip
        data = make_fp8_table(bf16_rows=[5]).to_dict()
        mutate(data)
        bad.write_text(json.dumps(data))
        with pytest.raises(TableError, match=needle) as err:
            read_table(bad)
        assert str(err.value).startswith(str(bad))


def test_load_tactic_takes_the_fp8_part_for_fp8(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    write_table(make_fp8_table(rows=[1, 6], bf16_rows=range(1, 9)), tmp_path)
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 2, search=[tmp_path], fp8=True)
    assert tactic == F2 and source == f"table {tmp_path / NAME} fp8.gemm2[6]"
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 2, search=[tmp_path])  # the BF16 family: its own
    assert tactic == T2 and source == f"table {tmp_path / NAME} gemm2[6]"
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 4, 1, search=[tmp_path], fp8=True)
    ctas = max_ctas(4, SHAPE.top_k, SHAPE.experts)
    assert tactic == default_fp8_tactic(SHAPE.gemm_shape, 1, ctas) and source.startswith("default (fp8 gemm1")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"tuning table {tmp_path / NAME} has no fp8 entry for gemm1 rows=4; using the built-in"
                        " fp8 default"]  # fmt: skip
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        load_tactic("NVIDIA H200", SHAPE, 4, 1, search=[tmp_path], fp8=1)


def test_a_table_without_fp8_entries_gives_the_fp8_defaults_with_one_warning(tmp_path, caplog):
    write_table(make_table(), tmp_path)
    for rows in range(1, 9):
        for stage in (1, 2):
            tactic, source = load_tactic("NVIDIA H200", SHAPE, rows, stage, search=[tmp_path], fp8=True)
            ctas = max_ctas(rows, SHAPE.top_k, SHAPE.experts)
            assert tactic == default_fp8_tactic(SHAPE.gemm_shape, stage, ctas) and source.startswith("default")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "holds no FP8-family entries" in warnings[0] and "tune --fp8" in warnings[0]
    tb.reset_log_once()
    (tmp_path / "empty").mkdir()
    load_tactic("NVIDIA H200", SHAPE, 1, 1, search=[tmp_path / "empty"], fp8=True)
    assert "run `moebench tune --fp8`" in caplog.records[-1].getMessage()


# ----------------------------------------------------------------------------- per-entry lookup along the path

T3 = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=2, ctas_per_sm=2)  # a GEMM1 tactic T1 is not


def test_a_bf16_only_override_leaves_the_fp8_entries_to_the_package_table(tmp_path, monkeypatch, caplog):
    """A table in $MOEBENCH_TUNING_DIR without an "fp8" part overrides the
    BF16 family only: FP8 lookups take the package table's entries."""
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    env_dir, pkg = tmp_path / "env", tmp_path / "pkg"
    write_table(make_table(), env_dir)  # BF16 entries only (schema 1)
    package = make_fp8_table(bf16_rows=range(1, 9))
    package.entries[1, 6] = entry(T3)
    write_table(package, pkg)
    monkeypatch.setattr(tb, "PACKAGE_TABLES", pkg)
    monkeypatch.setenv(tb.ENV_DIR, str(env_dir))
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 1, fp8=True)
    assert tactic == F1 and source == f"table {pkg / NAME} fp8.gemm1[6]"  # not the fp8 default (r16 at rows 6)
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 1)  # the override's BF16 entry still wins
    assert tactic == T1 and source == f"table {env_dir / NAME} gemm1[6]"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert infos == sorted(f"moebench tuning: {NAME} from {d / NAME}" for d in (env_dir, pkg))
    table, path, problems = tb.find_table("NVIDIA H200", SHAPE)  # the first table is still the override
    assert path == env_dir / NAME and table.fp8_entries == {} and problems == []


def test_rows_an_override_lacks_come_from_the_next_table(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moebench.tuning")
    first, second = tmp_path / "a", tmp_path / "b"
    write_table(make_table(rows=range(1, 5)), first)
    full = make_table()
    for rows in range(1, 9):
        full.entries[1, rows] = entry(T3, 10.0 + rows)
    write_table(full, second)
    for rows in range(1, 9):
        tactic, source = load_tactic("NVIDIA H200", SHAPE, rows, 1, search=[first, second])
        where = first if rows <= 4 else second
        assert (tactic, source) == (T1 if rows <= 4 else T3, f"table {where / NAME} gemm1[{rows}]"), rows
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 8, 2, search=[first, second])
    assert tactic == T2 and source == f"table {second / NAME} gemm2[8]"
    assert tactic != default_for(8, 2) and T3 != default_for(5, 1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 2  # each table logged once


def test_a_stale_override_is_skipped_and_the_next_table_serves(tmp_path, caplog):
    first, second = tmp_path / "a", tmp_path / "b"
    write_table(make_table(rows=[1]), second)
    write_table(make_table(tactics_version=tb.TACTICS_VERSION + 1), first, force=True)
    for rows in (1, 2):
        tactic, source = load_tactic("NVIDIA H200", SHAPE, rows, 1, search=[first, second])
        assert source.startswith(f"table {second / NAME}" if rows == 1 else "default")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "stale" in warnings[0] and str(first / NAME) in warnings[0]
    assert warnings[1] == f"tuning table {second / NAME} has no entry for gemm1 rows=2; using the built-in default"


def test_an_entry_no_table_holds_gets_the_default_with_one_warning_naming_the_tables(tmp_path, caplog):
    first, second = tmp_path / "a", tmp_path / "b"
    write_table(make_table(rows=range(1, 5)), first)
    write_table(make_table(rows=range(1, 4)), second)
    for _ in range(2):
        tactic, source = load_tactic("NVIDIA H200", SHAPE, 6, 1, search=[first, second])
        assert tactic == default_for(6, 1) and source.startswith("default (gemm1 rows=6")
    tactic, source = load_tactic("NVIDIA H200", SHAPE, 2, 1, search=[first, second], fp8=True)
    assert tactic == default_fp8_tactic(SHAPE.gemm_shape, 1, max_ctas(2, SHAPE.top_k, SHAPE.experts))
    assert source.startswith("default (fp8 gemm1 rows=2")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"tuning tables {first / NAME}, {second / NAME} have no entry for gemm1 rows=6; using the built-in default",
        f"tuning tables {first / NAME}, {second / NAME} hold no FP8-family entries; using the built-in fp8"
        " default tactics (run `moebench tune --fp8` on this GPU)",
    ]  # fmt: skip


# ----------------------------------------------------------------------------- the FP8 family's pair-or-fused part

FT = default_fused_tactic(SHAPE.gemm_shape, max_ctas(1, 6, 384))  # the built-in fused tactic at rows 1


def layer_entry(fused=True, us=12.0):
    """An fp8.fused entry: the fused layer won (runner-up the pair), or the pair did."""
    win, other = (LayerChoice(FT), LayerChoice(None)) if fused else (LayerChoice(None), LayerChoice(FT))
    return TableEntry(win, us, us * 0.98, us * 1.03, runner_up=other, runner_up_us=us * 1.1, margin_pct=10.0,
                      separated=True, candidates=5, rejected=0, provenance=PROV)  # fmt: skip


def test_fused_choices_round_trip_as_schema_3(tmp_path):
    t = make_fp8_table(fused_entries={1: layer_entry(True), 2: layer_entry(False)})
    path = write_table(t, tmp_path)
    data = json.loads(path.read_text())
    assert data["schema"] == tb.FUSED_SCHEMA == tb.SCHEMA == 3 and set(data["fp8"]) == {"gemm1", "gemm2", "fused"}
    assert data["fp8"]["fused"]["1"]["tactic"]["name"] == FT.name and data["fp8"]["fused"]["1"]["tactic"]["resident"]
    assert data["fp8"]["fused"]["2"]["tactic"] == {"name": "pair"}
    back = read_table(path)
    assert back.fused_entries == t.fused_entries and back.fp8_entries == t.fp8_entries
    assert back.fused_entries[1].tactic.fused == FT and back.entry(1, 1, fp8=True).tactic == F1
    assert verify_tables(tmp_path) == []
    # the runtime's lookup: the table's choice per rows, the pair where it has none
    assert load_layer_choice("NVIDIA H200", SHAPE, 1, search=[tmp_path]) == (
        LayerChoice(FT), f"table {path} fp8.fused[1]")  # fmt: skip
    assert load_layer_choice("NVIDIA H200", SHAPE, 2, search=[tmp_path])[0] == LayerChoice(None)
    assert load_layer_choice("NVIDIA H200", SHAPE, 3, search=[tmp_path]) == (
        LayerChoice(None), f"the pair (table {path} has no fp8.fused[3])")  # fmt: skip
    assert load_layer_choice("NVIDIA H200", SHAPE, 1, search=[tmp_path / "b"]) == (
        LayerChoice(None),
        "default (the pair)",
    )
    # a table without the part stays schema 2 (what a moebench from before it reads), and refuses it
    data["schema"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match=r"schema 2 has no fp8.fused"):
        read_table(path)
    assert json.loads(write_table(make_fp8_table(), tmp_path / "b").read_text())["schema"] == 2


@pytest.mark.parametrize(
    "damage, match",
    [(lambda d: d.update(tactic={"name": "pair", "resident": 1}), "holds only its name"),
     (lambda d: d["tactic"].update(name="other"), "does not match its fields"),
     (lambda d: d["tactic"].update(resident=-1), "resident must be"),
     (lambda d: d["tactic"].pop("gemm2"), "lacks"),
     (lambda d: d["tactic"]["gemm1"].update(unroll=3), "name"),
     (lambda d: d.update(tactic=[1]), "must be an object")],
)  # fmt: skip
def test_a_bad_fused_entry_is_refused_naming_it(tmp_path, damage, match):
    path = write_table(make_fp8_table(fused_entries={1: layer_entry(True)}), tmp_path)
    data = json.loads(path.read_text())
    damage(data["fp8"]["fused"]["1"])
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match=rf"{NAME}: fp8.fused\[1\].*{match}"):
        read_table(path)


def test_fused_entries_are_validated_against_the_shape():
    bad = FusedTactic(FT.gemm1, FT.gemm2, 16, 0)  # 16 resident units do not fit in shared memory
    e = TableEntry(LayerChoice(bad), 10.0, 9.0, 11.0)
    with pytest.raises(ValueError, match=r"fp8.fused\[1\].tactic.*cannot run.*shared memory"):
        make_fp8_table(fused_entries={1: e})
    with pytest.raises(TypeError, match="a TableEntry of a LayerChoice"):
        make_fp8_table(fused_entries={1: fp8_entry()})
    with pytest.raises(ValueError, match="rows 1..8"):
        make_fp8_table(fused_entries={9: layer_entry()})
    with pytest.raises(TypeError, match="must be a GemmTactic"):
        make_fp8_table(rows=()).__class__(SHAPE, {"name": "NVIDIA H200"}, {(1, 1): layer_entry()})
    with pytest.raises(TypeError, match="runner_up must be a LayerChoice"):
        TableEntry(LayerChoice(None), 10.0, 9.0, 11.0, runner_up=F1, runner_up_us=12.0)


def test_merge_and_write_keep_the_fused_choices(tmp_path):
    write_table(make_fp8_table(fused_entries={1: layer_entry(True), 8: layer_entry(False)}), tmp_path)
    with pytest.raises(TableConflict, match=r"2 fp8.fused entries this table lacks.*--force"):
        write_table(make_fp8_table(), tmp_path)
    retuned = make_fp8_table(rows=(1,), fused_entries={1: layer_entry(False)}).merged_over(read_table(tmp_path / NAME))
    assert retuned.fused_entries == {1: layer_entry(False), 8: layer_entry(False)}
    write_table(retuned, tmp_path)
    assert read_table(tmp_path / NAME).fused_entries == retuned.fused_entries


def test_the_layer_lookup_checks_its_arguments():
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        tb.lookup_entry("NVIDIA H200", SHAPE, 1, tb.LAYER, fp8=True)
    with pytest.raises(ValueError, match="rows"):
        load_layer_choice("NVIDIA H200", SHAPE, 9)


def test_a_repaired_pair_drops_the_older_fused_choice_unless_it_decides_again():
    older = make_fp8_table(
        rows=(1, 2), fused_entries={1: layer_entry(True), 2: layer_entry(True), 5: layer_entry(True)}
    )
    pair_only = make_fp8_table(rows=(1,))  # re-tunes the pair at rows 1, no fused step
    assert set(pair_only.merged_over(older).fused_entries) == {2, 5}
    decided = make_fp8_table(rows=(1,), fused_entries={1: layer_entry(False)})
    assert decided.merged_over(older).fused_entries[1] == layer_entry(False)
    bf16 = make_table(rows=(1, 2))  # the other family's re-tune keeps every FP8 choice
    assert set(bf16.merged_over(older).fused_entries) == {1, 2, 5}


def test_the_fused_choice_comes_from_the_table_that_serves_the_fp8_pair(tmp_path, monkeypatch, caplog):
    shipped, override = tmp_path / "shipped", tmp_path / "override"
    write_table(make_fp8_table(fused_entries={1: layer_entry(True), 2: layer_entry(True)}), shipped)
    write_table(make_fp8_table(rows=(1,)), override)  # re-tuned pair at rows 1, decided nothing
    search = [override, shipped]
    choice, source = load_layer_choice("NVIDIA H200", SHAPE, 1, search=search)
    assert choice == LayerChoice(None) and source == f"the pair (table {override / NAME} has no fp8.fused[1])"
    assert load_layer_choice("NVIDIA H200", SHAPE, 2, search=search)[0] == LayerChoice(FT)  # override lacks rows 2
    write_table(make_table(rows=(1,)), tmp_path / "bf16")  # a BF16-only table does not serve the FP8 family
    assert load_layer_choice("NVIDIA H200", SHAPE, 1, search=[tmp_path / "bf16", shipped])[0] == LayerChoice(FT)
    with pytest.raises(ValueError, match=r"stage must be 1 or 2.*load_layer_choice"):
        load_tactic("NVIDIA H200", SHAPE, 1, tb.LAYER, fp8=True, search=[shipped])


def test_the_fp8_familys_time_is_the_fused_layers_where_the_table_runs_it(tmp_path):
    from moebench.kernels.family import rows_times

    t = make_fp8_table(fused_entries={1: layer_entry(True, us=5.0), 2: layer_entry(False, us=5.0)})
    write_table(t, tmp_path)
    times = {r.rows: r.fp8_us for r in rows_times("NVIDIA H200", SHAPE, search=[tmp_path])}
    assert times[1] == 5.0  # the fused layer runs at rows 1: its time
    assert times[2] == min(t.fp8_entries[1, 2].median_us, t.fp8_entries[2, 2].median_us)  # the pair runs


@pytest.mark.parametrize("key", ["01", "\u00b2", " 1", "1.0"])
@pytest.mark.parametrize("part", ["fp8.fused", "gemm1", "fp8.gemm2"])
def test_rows_keys_are_exactly_1_to_8(tmp_path, key, part):
    path = write_table(make_fp8_table(bf16_rows=(1,), fused_entries={1: layer_entry(True)}), tmp_path)
    data = json.loads(path.read_text())
    block = data
    for k in part.split("."):
        block = block[k]
    block[key] = block["1"]
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match=rf"{NAME}: {part} has rows {key!r}; expected one of"):
        read_table(path)
    assert verify_tables(tmp_path) and load_layer_choice("NVIDIA H200", SHAPE, 1, search=[tmp_path])[0] == LayerChoice()
