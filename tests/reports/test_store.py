import json
from datetime import datetime, timezone

import pandas as pd
import pytest

from moebench.reports.store import REQUIRED_COLUMNS, read_run, run_dir_name, write_run

WHEN = datetime(2026, 11, 29, 23, 30, tzinfo=timezone.utc)


def frame(n=2):
    rows = []
    for i in range(n):
        row = dict.fromkeys(REQUIRED_COLUMNS, None)
        row.update(
            preset="dsv41-flash",
            hidden=5120,
            intermediate=288,
            experts=384,
            top_k=6,
            tp=8,
            rows=i + 1,
            scenario="uniform",
            backend="torch-bf16",
            tactic="default",
            status="ok",
            error="",
            median_us=10.0 + i,
            p10_us=9.0,
            p90_us=12.0,
            unique_experts=6,
            bytes=1000,
            gbps=1.5,
            pct_copy_bw=30.0,
            pct_size_ceiling=float("nan"),
            max_rel_err=1e-3,
            device="cpu",
            sm_count=2,
            commit="abc",
        )
        rows.append(row)
    return pd.DataFrame(rows)


def test_round_trip(tmp_path):
    manifest = {"seed": 0, "copy_bw_gbps": 4215.0, "nan": float("nan"), "path": tmp_path}
    path = write_run(frame(), manifest, root=tmp_path, label="smoke", when=WHEN)
    assert path == tmp_path / "2026-11-29-smoke"
    df, m = read_run(path)
    pd.testing.assert_frame_equal(df, frame())
    assert m["seed"] == 0 and m["copy_bw_gbps"] == 4215.0 and m["nan"] is None and m["path"] == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-29-smoke"]


def test_never_overwrites_unless_asked(tmp_path):
    first = write_run(frame(1), {"n": 1}, root=tmp_path, label="x", when=WHEN)
    second = write_run(frame(2), {"n": 2}, root=tmp_path, label="x", when=WHEN)
    third = write_run(frame(2), {"n": 3}, root=tmp_path, label="x", when=WHEN)
    assert (second.name, third.name) == ("2026-11-29-x-2", "2026-11-29-x-3")
    assert read_run(first)[1] == {"n": 1} and len(read_run(first)[0]) == 1
    replaced = write_run(frame(2), {"n": 4}, root=tmp_path, label="x", overwrite=True, when=WHEN)
    assert replaced == first and read_run(first)[1] == {"n": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-29-x", "2026-11-29-x-2", "2026-11-29-x-3"]


def test_failure_mid_write_leaves_no_run_dir(tmp_path, monkeypatch):
    def explode(self, path, *args, **kwargs):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", explode)
    with pytest.raises(OSError, match="disk full"):
        write_run(frame(), {}, root=tmp_path, label="broken", when=WHEN)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="label"):
        write_run(frame(), {}, root=tmp_path, label="../escape")
    with pytest.raises(ValueError, match="columns"):
        write_run(frame().drop(columns=["gbps"]), {}, root=tmp_path)
    with pytest.raises(TypeError, match="manifest"):
        write_run(frame(), [], root=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert run_dir_name("a.b_c-1", WHEN) == "2026-11-29-a.b_c-1"


def test_read_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        read_run(missing)
    path = write_run(frame(), {}, root=tmp_path, label="r", when=WHEN)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json"):
        read_run(path)
    (path / "manifest.json").write_text(json.dumps({}))
    (path / "results.parquet").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="results.parquet"):
        read_run(path)
    (path / "results.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="results.parquet"):
        read_run(path)
    (path / "results.parquet").mkdir()  # said "is missing"
    with pytest.raises(FileNotFoundError, match="results.parquet is not a file"):
        read_run(path)
    (path / "results.parquet").rmdir()
    frame().assign(status=["ok", "weird"]).to_parquet(path / "results.parquet")  # a hand edit
    with pytest.raises(ValueError, match=r"'status' holds \['weird'\]"):
        read_run(path)


@pytest.mark.parametrize("median", [float("nan"), 0.0, -1.0, float("inf"), None])
def test_read_run_refuses_an_ok_case_without_a_time(tmp_path, median):
    """A hand-edited ok row with no usable median would read as 'unclear' or '-'
    in every report; the file is refused instead, naming the case."""
    path = write_run(frame(), {}, root=tmp_path, label="r", when=WHEN)
    frame().assign(median_us=[10.0, median]).to_parquet(path / "results.parquet")
    with pytest.raises(ValueError, match=r"1 ok row\(s\) without a finite positive median_us, e.g. .*rows=2"):
        read_run(path)
    # the same row skipped (no time expected) is fine
    frame().assign(median_us=[10.0, median], status=["ok", "skipped"]).to_parquet(path / "results.parquet")
    assert read_run(path)[0]["status"].tolist() == ["ok", "skipped"]


def test_read_run_refuses_a_case_stored_twice(tmp_path):
    path = write_run(frame(), {}, root=tmp_path, label="r", when=WHEN)
    df = frame()
    pd.concat([df, df.iloc[[1]]]).to_parquet(path / "results.parquet")
    with pytest.raises(ValueError, match=r"2 rows share a case, e.g. preset=dsv41-flash, tp=8, rows=2"):
        read_run(path)
    # two ranks of one case are two cases
    pd.concat([df.assign(rank=0), df.assign(rank=1)]).to_parquet(path / "results.parquet")
    assert len(read_run(path)[0]) == 4


def test_run_directories_get_the_usual_permissions_not_0700(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = write_run(frame(), {"n": 1}, root=tmp_path, label="perm", when=WHEN)
        again = write_run(frame(), {"n": 2}, root=tmp_path, label="perm", overwrite=True, when=WHEN)
        os.umask(0o027)
        group = write_run(frame(), {"n": 3}, root=tmp_path, label="group", when=WHEN)
    finally:
        os.umask(old)
    assert again == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # 0777 less the umask, as mkdir makes it
    assert stat.S_IMODE((path / "manifest.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(group.stat().st_mode) == 0o750


def test_extra_tables_travel_with_the_run(tmp_path):
    from moebench.reports.store import read_table

    ranks = pd.DataFrame({"rank": [0, 1], "median_us": [20.0, 21.0]})
    path = write_run(frame(), {"kind": "step"}, root=tmp_path, label="t", when=WHEN, tables={"ranks": ranks})
    pd.testing.assert_frame_equal(read_table(path, "ranks"), ranks)
    assert read_table(path, "other") is None
    for bad in ({"results": ranks}, {"../x": ranks}, {"Ranks": ranks}):
        with pytest.raises(ValueError, match="tables"):
            write_run(frame(), {}, root=tmp_path, label="u", when=WHEN, tables=bad)
    with pytest.raises(TypeError, match="tables"):
        write_run(frame(), {}, root=tmp_path, label="u", when=WHEN, tables={"ranks": [1, 2]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-29-t"]  # refused runs leave nothing
    (path / "ranks.parquet").write_bytes(b"junk")
    with pytest.raises(ValueError, match="ranks.parquet"):
        read_table(path, "ranks")


@pytest.mark.parametrize("manifest, field", [
    ({"reduced": "no"}, "reduced"),  # a truthy string is not true
    ({"warm_l2": 1}, "warm_l2"),
    ({"sharded": "false"}, "sharded"),
    ({"kind": "sweeps"}, "kind"),
    ({"kind": None}, "kind"),
    ({"schema": 2}, "schema"),
    ({"schema": "1"}, "schema"),
    ({"schema": True}, "schema"),
    ({"ranks": "2"}, "ranks"),
    ({"ranks": 0}, "ranks"),
    ({"copy_bw_gbps": -1.0}, "copy_bw_gbps"),
    ({"copy_bw_gbps": 0}, "copy_bw_gbps"),
    ({"copy_bw_gbps": "4215"}, "copy_bw_gbps"),
    ({"config": {"overlap_shared": "no"}}, "config.overlap_shared"),
])  # fmt: skip
def test_read_run_refuses_a_manifest_field_of_the_wrong_type_or_value(tmp_path, manifest, field):
    path = write_run(frame(), {"schema": 1, "kind": "sweep", **manifest}, root=tmp_path, label="m", when=WHEN)
    with pytest.raises(ValueError) as info:
        read_run(path)
    assert str(path / "manifest.json") in str(info.value) and f"{field!r}" in str(info.value), info.value


@pytest.mark.parametrize("manifest", [
    {},  # a run stored before the fields existed (or a hand-made one): defaults
    {"schema": 1, "kind": "sweep", "reduced": False, "warm_l2": False, "sharded": True},
    {"schema": 1, "kind": "step", "reduced": None, "warm_l2": True, "ranks": 2, "config": {"overlap_shared": True}},
    {"copy_bw_gbps": 4215.0}, {"copy_bw_gbps": None},
])  # fmt: skip
def test_read_run_takes_the_manifests_moebench_writes(tmp_path, manifest):
    path = write_run(frame(), manifest, root=tmp_path, label="m", when=WHEN)
    assert read_run(path)[1] == manifest


def test_enclosing_run_finds_the_run_a_path_is_or_lies_in(tmp_path):
    from moebench.reports.store import enclosing_run, is_run_dir

    run = write_run(frame(), {}, root=tmp_path / "runs", label="r", when=WHEN)
    (tmp_path / "link").symlink_to(run)
    assert is_run_dir(run) and not is_run_dir(tmp_path / "runs")
    for path in (run, run / "a" / "b", tmp_path / "runs" / "x" / ".." / run.name, tmp_path / "link" / "c"):
        assert enclosing_run(path) == run.resolve(), path
    for path in (tmp_path / "runs", tmp_path / "runs" / "other", tmp_path / "nope"):
        assert enclosing_run(path) is None, path
    (run / "results.parquet").unlink()  # half a run is not a run
    assert enclosing_run(run / "a") is None
