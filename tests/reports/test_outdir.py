"""Where a command's files go (moebench/reports/outdir.py): the runs root,
a report's directory and the record of the files a report wrote."""

import json
from pathlib import Path

import pytest

from moebench.reports import outdir
from moebench.reports.html import HTML_FILES
from moebench.reports.store import MANIFEST, RESULTS


def _fake_run(path: Path) -> Path:
    """A directory that reads as a stored run (it holds RESULTS and MANIFEST)."""
    path.mkdir(parents=True)
    (path / RESULTS).write_bytes(b"")
    (path / MANIFEST).write_text("{}")
    return path


def test_check_out_makes_the_root_and_refuses_a_run_or_a_folder_in_one(tmp_path):
    outdir.check_out(tmp_path / "a" / "b", runs=True)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    run = _fake_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^--out: .* is a stored run directory; give a directory outside any run"):
        outdir.check_out(run, runs=True)
    with pytest.raises(ValueError, match=r"^--out: .* is inside the stored run "):
        outdir.check_out(run / "sub", runs=True)
    assert not (run / "sub").exists()
    outdir.check_out(run / "sub2", "--summary")  # not a runs root: a folder inside a run is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^--summary: .*file exists and is not a directory"):
        outdir.check_out(tmp_path / "file", "--summary")


def test_run_at_tells_the_run_itself_from_a_folder_inside_it(tmp_path):
    run = _fake_run(tmp_path / "run")
    assert outdir.run_at(tmp_path) == (None, False)
    assert outdir.run_at(run) == (run.resolve(), True)
    assert outdir.run_at(run / "x" / "y") == (run.resolve(), False)


def test_default_report_dir_is_the_runs_sibling(tmp_path, monkeypatch):
    assert outdir.default_report_dir(Path("runs/2026-01-01-x")) == Path("runs/2026-01-01-x-report")
    monkeypatch.chdir(_fake_run(tmp_path / "r1"))
    assert outdir.default_report_dir(Path(".")) == tmp_path / ("r1" + outdir.REPORT_DIR_SUFFIX)


def test_check_out_dir_refuses_other_runs_files_and_non_directories(tmp_path):
    run, other = _fake_run(tmp_path / "run"), _fake_run(tmp_path / "other")
    for inside, said in ((run, "RUN_DIR itself"), (run / "sub" / "dir", "inside RUN_DIR")):  # never into the run
        with pytest.raises(ValueError, match=rf"^--out: .* is {said}.*never writes into the run it reports"):
            outdir.check_out_dir(inside, run)
    outdir.check_out_dir(tmp_path / "new" / "dir", run)
    assert not (tmp_path / "new").exists()  # creates nothing
    with pytest.raises(ValueError, match=r"^--out: .* is a stored run directory \(it holds results.parquet"):
        outdir.check_out_dir(other, run)
    with pytest.raises(ValueError, match=r"^the default: .* is inside a stored run directory"):
        outdir.check_out_dir(other / "inner", run, "the default")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        outdir.check_out_dir(tmp_path / "f", run)
    with pytest.raises(ValueError, match=r"\(a parent of .*\) is not a directory"):
        outdir.check_out_dir(tmp_path / "f" / "g", run)


def test_report_record_round_trip_and_junk(tmp_path):
    assert outdir.report_record(tmp_path) == set()
    written = [tmp_path / "summary.md", tmp_path / "report.html", tmp_path / "latency_tp4.png"]
    outdir.write_report_record(tmp_path, written)
    assert json.loads((tmp_path / outdir.REPORT_RECORD).read_text()) == {"files": sorted(p.name for p in written)}
    assert outdir.report_record(tmp_path) == {p.name for p in written}
    (tmp_path / outdir.REPORT_RECORD).write_text('{"files": ["summary.md", "../etc/passwd", "mine.txt", 3]}')
    assert outdir.report_record(tmp_path) == {"summary.md"}  # only the report's own names
    for junk in ('{"files": 5}', "[1]", "not json"):
        (tmp_path / outdir.REPORT_RECORD).write_text(junk)
        assert outdir.report_record(tmp_path) == set()


def test_a_record_that_is_a_link_is_neither_trusted_nor_written_through(tmp_path):
    precious = tmp_path / "precious"
    precious.write_text('{"files": ["report.html"]}')
    out = tmp_path / "out"
    out.mkdir()
    (out / outdir.REPORT_RECORD).symlink_to(precious)
    assert outdir.report_record(out) == set()
    outdir.write_report_record(out, [out / "summary.md"])
    assert precious.read_text() == '{"files": ["report.html"]}' and not (out / outdir.REPORT_RECORD).is_symlink()


def test_a_page_from_before_the_record_counts_as_a_whole_report(tmp_path):
    (tmp_path / "report.html").write_text("<html><title>moebench run x</title></html>")
    assert outdir.is_our_page(tmp_path / "report.html")
    assert outdir.report_record(tmp_path) == set(HTML_FILES)
    (tmp_path / "report.html").write_text("<html><title>my page</title></html>")
    assert not outdir.is_our_page(tmp_path / "report.html") and outdir.report_record(tmp_path) == set()


def test_remove_stale_report_files_removes_only_recorded_names_not_rewritten(tmp_path):
    for name in ("summary.md", "report.html", "compare.png", "mine.png"):
        (tmp_path / name).write_text(name)
    removed = outdir.remove_stale_report_files(tmp_path, [tmp_path / "summary.md"],
                                               {"summary.md", "report.html", "compare.png", "gone.png"})  # fmt: skip
    assert removed == ["compare.png", "report.html"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "summary.md"]
    assert outdir.remove_stale_report_files(tmp_path, [], set()) == []


def test_read_report_run_names_the_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match="^--baseline: "):
        outdir.read_report_run(tmp_path / "none", "--baseline")
