"""scripts/table_variant.py: tuning-table copies with one tactic field changed."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from moebench.kernels.table import PACKAGE_TABLES, read_table

_SPEC = importlib.util.spec_from_file_location(
    "table_variant", Path(__file__).resolve().parents[1] / "scripts" / "table_variant.py"
)
table_variant = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(table_variant)

_NAME = "E=384,H=5120,I=576,top_k=6,device_name=NVIDIA_H200"  # one table: the H100 has its own


def test_variant_changes_only_fp8_gemm1(tmp_path):
    assert table_variant.main([str(tmp_path), "--set", "stages=2", "--match", _NAME]) == 0
    (path,) = tmp_path.glob("*.json")
    new, old = read_table(path), read_table(PACKAGE_TABLES / path.name)
    assert new.entries == old.entries  # the BF16 family untouched
    for key, entry in old.fp8_entries.items():
        got = new.fp8_entries[key].tactic
        if key[0] == 1:
            assert got.stages == 2 and got == dataclasses.replace(entry.tactic, stages=2)
        else:
            assert got == entry.tactic


def test_refusals(tmp_path, capsys):
    for bad in (
        ["--set", "pdl=maybe"],
        ["--set", "nonsense=1"],
        ["--set", "stages"],
        ["--set", "stages=2", "--match", "no-such-table"],
    ):
        with pytest.raises(SystemExit) as ex:
            table_variant.main([str(tmp_path / "a"), *bad])
        assert ex.value.code == 2
    assert "pdl takes true or false" in capsys.readouterr().err
    table_variant.main([str(tmp_path), "--set", "stages=2", "--match", _NAME])
    with pytest.raises(SystemExit):  # nothing written over
        table_variant.main([str(tmp_path), "--set", "stages=3", "--match", _NAME])
    # a change a tactic refuses is kept out, not written: a bulk ring of one stage
    out = tmp_path / "g2"
    with pytest.raises(SystemExit):  # no entry takes it: nothing written
        table_variant.main([str(out), "--set", "stages=1", "--stage", "2", "--match", _NAME])
    assert "kept" in capsys.readouterr().out and not out.exists()
    with pytest.raises(SystemExit):
        table_variant.main([str(tmp_path / "b"), "--set", "stages=2", "--stage", "3"])
    capsys.readouterr()
    for bad, says in ((["--only", ","], "--only: expected tactic names"),
                      (["--tables", str(tmp_path / "none")], "--tables: ")):  # fmt: skip
        with pytest.raises(SystemExit) as ex:
            table_variant.main([str(tmp_path / "c"), "--set", "stages=2", *bad])
        assert ex.value.code == 2 and says in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_only_the_named_tactics_of_both_stages(tmp_path):
    old = read_table(PACKAGE_TABLES / f"{_NAME},dtype=mxfp4.json")
    name1, name2 = old.fp8_entries[1, 6].tactic.name, old.fp8_entries[2, 6].tactic.name
    table_variant.main([str(tmp_path), "--set", "stages=2", "--stage", "1,2", "--only", f"{name1},{name2}",
                        "--match", _NAME])  # fmt: skip
    (path,) = tmp_path.glob("*.json")
    new = read_table(path)
    for key, entry in old.fp8_entries.items():
        changed = entry.tactic.name in (name1, name2)
        assert (new.fp8_entries[key].tactic.stages == 2) if changed else new.fp8_entries[key].tactic == entry.tactic


def test_changes_that_do_nothing_or_break_a_table_write_nothing(tmp_path, capsys):
    out = tmp_path / "o"
    # (GEMM2's entries: the shipped GEMM1 ones are mostly spec, which refuses fp8=false by itself)
    for bad, needle in (
        (["--set", "fp8=false", "--stage", "2"], "not an fp8 tactic"),  # BF16 tactics in the fp8 part
        (["--set", "stages=-3"], "no entry changed"),
        (["--set", "stages=2", "--only", "r1_nosuch"], "--only: no fp8 entry"),
    ):
        with pytest.raises(SystemExit) as ex:
            table_variant.main([str(out), *bad, "--match", _NAME])
        assert ex.value.code == 2 and needle in capsys.readouterr().err, bad
        assert not out.exists() or not any(out.iterdir())
    afile = tmp_path / "file"
    afile.write_text("mine")
    with pytest.raises(SystemExit):
        table_variant.main([str(afile), "--set", "stages=2", "--match", _NAME])
    assert afile.read_text() == "mine" and "not a directory" in capsys.readouterr().err
