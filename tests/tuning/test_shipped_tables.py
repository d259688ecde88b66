"""The tuning tables shipped in the package (moebench/kernels/tables/) load:
every file there is a usable, current table that the runtime picks up.
Until tables are shipped (the directory does not exist) there is nothing to
check; once it exists, a table that does not load fails CI."""

import json
from pathlib import Path

from moebench.kernels import table as tb
from moebench.kernels.tactic import GemmTactic, default_tactic
from moebench.models import get_preset
from moebench.tuning.table import verify_tables, write_table

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_tables_load():
    assert tb.PACKAGE_TABLES == ROOT / "moebench" / "kernels" / "tables"
    problems = verify_tables(tb.PACKAGE_TABLES)
    assert not problems, "shipped tuning tables that do not load:\n" + "\n".join(problems)


def test_the_wheel_takes_the_tables():
    """pyproject's package-data puts moebench/kernels/tables/*.json into the package."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"kernels/tables/*.json"' in block


def _with_defaults(data):
    """`data` (a table file's JSON) with every tactic's omitted fields (tables
    written before the field existed) filled in as `to_fields` writes them."""
    if isinstance(data, dict):
        if "tile_rows" in data and "name" in data:
            return GemmTactic.from_fields(data).to_fields()
        return {k: _with_defaults(v) for k, v in data.items()}
    return data


def test_every_shipped_table_round_trips_unchanged(tmp_path):
    """Reading a shipped table and writing it back keeps every byte (names,
    fields, entries, key order); a table written before the newest tactic
    field existed gains only that field, at its default."""
    paths = sorted(tb.PACKAGE_TABLES.glob("*.json"))
    assert len(paths) == 14  # 12 of the H200, dsv41-flash TP4 / TP8 of the H100
    current = 0
    for path in paths:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
        written = write_table(tb.read_table(path), tmp_path).read_text(encoding="utf-8")
        assert written == json.dumps(_with_defaults(data), indent=2) + "\n", path.name
        if _with_defaults(data) == data:
            current += 1
            assert written == text, path.name
    assert current >= 6  # the tables re-tuned since the last tactic field came


def _table(device="NVIDIA H200"):
    shape = tb.ShapeClass.of(get_preset("dsv41-flash").shard(4))
    t = default_tactic(shape.gemm_shape, 1, 6)
    return tb.TuningTable(shape, {"name": device, "sm_count": 132}, {(1, 1): tb.TableEntry(t, 10.0, 9.5, 10.5)})


def test_verify_tables_passes_good_tables_and_no_directory(tmp_path):
    assert verify_tables(tmp_path / "none") == []  # nothing shipped yet
    assert verify_tables(tmp_path) == []  # an empty directory
    write_table(_table(), tmp_path)
    write_table(_table("NVIDIA H100 80GB HBM3"), tmp_path)
    assert verify_tables(tmp_path) == []


def test_verify_tables_names_each_broken_file(tmp_path):
    good = write_table(_table(), tmp_path)
    data = json.loads(good.read_text())
    (tmp_path / "E=1,H=128,I=32,top_k=6,device_name=NVIDIA_H200,dtype=mxfp4.json").write_text("{ not json")
    stale = dict(data, tactics_version=data["tactics_version"] + 1)
    stale["shape"] = dict(data["shape"], experts=256)
    (tmp_path / "E=256,H=5120,I=576,top_k=6,device_name=NVIDIA_H200,dtype=mxfp4.json").write_text(json.dumps(stale))
    misnamed = tmp_path / "E=384,H=5120,I=576,top_k=8,device_name=NVIDIA_H200,dtype=mxfp4.json"
    misnamed.write_text(good.read_text())
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / f".{good.name}.abc.tmp").write_text("")
    problems = "\n".join(verify_tables(tmp_path))
    assert "E=1,H=128" in problems and "not readable JSON" in problems
    assert "E=256" in problems and "stale" in problems
    assert "top_k=8" in problems and "does not match" in problems
    assert "notes.txt" in problems and ".tmp" in problems
    assert problems.count("\n") == 4  # five problems; the good table is not one of them
