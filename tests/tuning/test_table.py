"""Tuning tables: schema, names, atomic writes, refusals, runtime loading."""

import json
import logging

import pytest

from moebench.kernels.tactic import GemmTactic, default_tactic
from moebench.models import get_preset
from moebench.record import max_ctas
from moebench.tuning import table as tb
from moebench.tuning.table import (
    ShapeClass, TableConflict, TableEntry, TableError, TuningTable, load_tactic, normalize_device_name,
    read_table, table_file_name, write_table,
)  # fmt: skip

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

    monkeypatch.setattr(tb.os, "fsync", crash)
    with pytest.raises(OSError, match="mid-write"):
        write_table(make_table(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [NAME] and old.read_text() == before

    monkeypatch.undo()
    monkeypatch.setattr(tb.os, "replace", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt()))
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
