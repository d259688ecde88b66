"""merge_runs and `moebench merge`: one run from the parts of a comparison."""

import pandas as pd
import pytest
from typer.testing import CliRunner

from moebench.cli import app
from moebench.reports.store import merge_runs, read_run, read_table, write_run

from test_store import WHEN, frame


def _part(tmp_path, label, backend, rows=(1, 2), copy_bw=4200.0, commit="abc", groups=None):
    df = frame(len(rows)).assign(backend=backend, rows=list(rows), commit=commit)
    manifest = {"schema": 1, "kind": "sweep", "commit": commit, "copy_bw_gbps": copy_bw, "command": label}
    if groups is not None:
        manifest["groups"] = groups
    return write_run(df, manifest, root=tmp_path / "parts", label=label, when=WHEN)


def test_merge_keeps_every_case_and_names_the_parts(tmp_path):
    a = _part(tmp_path, "ours", "moebench", copy_bw=4200.0)
    b = _part(tmp_path, "peers", "marlin-w4a16", copy_bw=4240.0)
    c = _part(tmp_path, "more", "torch-bf16", rows=(6,), copy_bw=4210.0)
    df, manifest = merge_runs([a, b, c])
    assert sorted(zip(df["backend"], df["rows"])) == [
        ("marlin-w4a16", 1),
        ("marlin-w4a16", 2),
        ("moebench", 1),
        ("moebench", 2),
        ("torch-bf16", 6),
    ]
    assert manifest["copy_bw_gbps"] == 4210.0  # the parts' median
    assert [m["path"] for m in manifest["merged_from"]] == [str(a), str(b), str(c)]
    assert manifest["merged_from"][1]["copy_bw_gbps"] == 4240.0


def test_merge_keeps_every_parts_groups(tmp_path):
    """Each part's rotation and x-write measurements (its groups) stay in the
    merged manifest, naming their part: a TP8 part's are not dropped for the
    first part's TP4 ones."""
    a = _part(
        tmp_path, "tp4", "moebench", groups=[{"preset": "p", "tp": 4, "layers": 8, "x_writes": {"1": {"us": 2.4}}}]
    )
    b = _part(tmp_path, "tp8", "marlin-w4a16", groups=[{"preset": "p", "tp": 8, "layers": 15, "x_writes": {}}])
    _, manifest = merge_runs([a, b])
    assert [(g["tp"], g["layers"], g["part"]) for g in manifest["groups"]] == [(4, 8, 0), (8, 15, 1)]
    assert manifest["groups"][0]["x_writes"] == {"1": {"us": 2.4}}


def test_merging_a_merged_run_keeps_its_parts_and_their_groups(tmp_path):
    """A merged run merged again (a third call's cases added later) named only the merged run in
    merged_from, losing its sweeps' commands, and renumbered its groups' parts so that two groups of one
    (preset, TP) from different sweeps read as one part's: its own parts and groups stay, indices shifted."""
    a = _part(tmp_path, "tp4", "moebench", copy_bw=4200.0, groups=[{"preset": "p", "tp": 4, "layers": 8}])
    b = _part(tmp_path, "tp8", "marlin-w4a16", copy_bw=4240.0, groups=[{"preset": "p", "tp": 8, "layers": 15}])
    df, manifest = merge_runs([a, b])
    ab = write_run(df, manifest, root=tmp_path / "merged", label="ab", when=WHEN)
    c = _part(tmp_path, "uniform", "torch-bf16", rows=(6,), copy_bw=4210.0,
              groups=[{"preset": "p", "tp": 4, "layers": 8}])  # fmt: skip
    _, manifest = merge_runs([ab, c])
    assert [e["command"] for e in manifest["merged_from"]] == ["tp4", "tp8", "uniform"]
    assert [(g["tp"], g["part"]) for g in manifest["groups"]] == [(4, 0), (8, 1), (4, 2)]
    assert manifest["copy_bw_gbps"] == 4210.0  # the median of the three sweeps


def test_merge_refuses_a_case_twice_other_commits_and_one_run(tmp_path):
    a = _part(tmp_path, "a", "moebench")
    with pytest.raises(ValueError, match="stored in more than one.*backend=moebench"):
        merge_runs([a, _part(tmp_path, "b", "moebench", rows=(2, 3))])
    with pytest.raises(ValueError, match="differ in 'commit'"):
        merge_runs([a, _part(tmp_path, "c", "torch-bf16", commit="def")])
    with pytest.raises(ValueError, match="two or more"):
        merge_runs([a])
    with pytest.raises(ValueError, match="named twice"):
        merge_runs([a, a])


def test_cli_merge_stores_one_run_and_leaves_the_parts(tmp_path):
    a = _part(tmp_path, "ours", "moebench")
    b = _part(tmp_path, "peers", "marlin-w4a16")
    result = CliRunner().invoke(app, ["merge", str(a), str(b), "--label", "all", "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    [merged] = list((tmp_path / "runs").iterdir())
    assert len(read_run(merged)[0]) == 4 and len(read_run(a)[0]) == 2 and len(read_run(b)[0]) == 2
    bad = CliRunner().invoke(app, ["merge", str(a), str(a), "--label", "x", "--out", str(tmp_path / "runs")])
    assert bad.exit_code == 2 and "named twice" in bad.output


def test_merge_refuses_runs_measured_differently(tmp_path):
    # one manifest speaks for the merged run: warm-L2 and cold-L2 cases (or 1 and 2 ranks) under one would be
    # compared by `report --baseline` as if measured one way
    a = _part(tmp_path, "cold", "moebench")
    warm = write_run(frame(1).assign(backend="torch-bf16", commit="abc"),
                     {"schema": 1, "kind": "sweep", "commit": "abc", "warm_l2": True}, root=tmp_path / "parts",
                     label="warm", when=WHEN)  # fmt: skip
    with pytest.raises(ValueError, match=r"measured differently, .*warm vs .*cold: L2 mode: warm_l2=True vs False"):
        merge_runs([a, warm])


def test_cli_merge_keeps_the_ranks_table_of_step_runs(tmp_path):
    # a TP step run stores every rank's rows in ranks.parquet; the merged run keeps both parts' rows
    parts = []
    for label, rows in (("r1", (1,)), ("r2", (2,))):
        df = frame(1).assign(backend="torch-bf16", rows=list(rows), commit="abc")
        ranks = pd.concat([df.assign(rank=0), df.assign(rank=1)], ignore_index=True)
        manifest = {"schema": 1, "kind": "step", "commit": "abc", "ranks": 2}
        parts.append(write_run(df, manifest, root=tmp_path / "parts", label=label, when=WHEN, tables={"ranks": ranks}))
    result = CliRunner().invoke(app, ["merge", *map(str, parts), "--label", "m", "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    [merged] = list((tmp_path / "runs").iterdir())
    ranks = read_table(merged, "ranks")
    assert ranks is not None and sorted(zip(ranks["rows"], ranks["rank"])) == [(1, 0), (1, 1), (2, 0), (2, 1)]
