"""merge_runs and `moebench merge`: one run from the parts of a comparison."""

import pytest
from typer.testing import CliRunner

from moebench.cli import app
from moebench.reports.store import merge_runs, read_run, write_run

from test_store import WHEN, frame


def _part(tmp_path, label, backend, rows=(1, 2), copy_bw=4200.0, commit="abc"):
    df = frame(len(rows)).assign(backend=backend, rows=list(rows), commit=commit)
    manifest = {"schema": 1, "kind": "sweep", "commit": commit, "copy_bw_gbps": copy_bw, "command": label}
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
