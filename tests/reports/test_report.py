"""The plan of `moebench report` (moebench/reports/report.py): checks and
reads before anything is written, the files named, what summary.md holds;
then the writing of them (write_report)."""

import math

import pandas as pd
import pytest

from moebench.reports.outdir import REPORT_RECORD
from moebench.reports.report import ReportNotWritten, plan_report, report_markdown, write_report, write_report_html
from moebench.reports.store import REQUIRED_COLUMNS, write_run


def _run(root, label, medians):
    rows = []
    for r, us in medians.items():
        row = dict.fromkeys(REQUIRED_COLUMNS)
        row.update(preset="dsv41-flash", hidden=5120, intermediate=576, experts=384, top_k=6, tp=4, rows=r,
                   scenario="correlated", backend="moebench", tactic="default", status="ok", error="",
                   median_us=us, p10_us=us * 0.99, p90_us=us * 1.01, unique_experts=6 * r, bytes=28_000_000 * r,
                   gbps=1000.0, pct_copy_bw=25.0, pct_size_ceiling=math.nan, max_rel_err=1e-3,
                   device="NVIDIA H200", sm_count=132, commit="abc")  # fmt: skip
        rows.append(row)
    manifest = {"device": {"name": "NVIDIA H200", "sm_count": 132}, "copy_bw_gbps": 4000.0, "reduced": False,
                "timing_counts": {"replays": 100}}  # fmt: skip
    return write_run(pd.DataFrame(rows), manifest, root=root, label=label)


def test_a_plan_names_the_default_directory_and_its_files(tmp_path):
    run = _run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0})
    plan = plan_report(run, html=False)
    assert plan.out == run.with_name(run.name + "-report") and plan.target == plan.out / "summary.md"
    assert plan.written == [plan.target] and plan.taken == [] and plan.comparison is None and not plan.gated
    assert not plan.out.exists()  # nothing is created by the plan
    assert "dsv41-flash" in report_markdown(plan)
    assert plan_report(run).written[1:] and all(p.parent == plan.out for p in plan_report(run).written)


def test_a_comparison_is_planned_and_gated_only_with_fail_above(tmp_path):
    base = _run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _run(tmp_path / "runs", "cur", {1: 20.1, 6: 39.0})
    plan = plan_report(cur, baseline=base, fail_above="3%", out=tmp_path / "r")
    assert plan.comparison is not None and plan.gated and plan.threshold == 3.0
    from moebench.reports.compare import comparison_markdown

    assert report_markdown(plan).endswith("\n" + comparison_markdown(plan.comparison))
    tmp_path.joinpath("r").mkdir()
    paths = write_report_html(plan)
    assert paths[0] == tmp_path / "r" / "report.html" and all(p.is_file() for p in paths)


def test_errors_name_the_argument_and_come_before_any_file(tmp_path):
    run = _run(tmp_path / "runs", "cur", {1: 20.0})
    with pytest.raises(ValueError, match="^--fail-above needs --baseline RUN"):
        plan_report(run, fail_above="5")
    with pytest.raises(FileNotFoundError, match="^RUN_DIR: "):
        plan_report(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="^--baseline: "):
        plan_report(run, baseline=tmp_path / "none")
    other = _run(tmp_path / "runs", "other", {1: 1.0})
    with pytest.raises(ValueError, match="^--out: .* is inside a stored run directory"):
        plan_report(run, out=other / "x")
    out = tmp_path / "r"
    out.mkdir()
    (out / "summary.md").write_text("mine")
    with pytest.raises(ValueError, match=r"^--out: .*summary.md exists; pass --force"):
        plan_report(run, out=out, html=False)
    assert plan_report(run, out=out, html=False, force=True).taken == [out / "summary.md"]


def test_write_report_writes_after_the_callback_and_records_its_files(tmp_path):
    run = _run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0})
    plan = plan_report(run)
    seen = []
    files = write_report(plan, before_writing=lambda: seen.append(sorted(p.name for p in plan.out.iterdir())))
    assert seen == [[]]  # the directory is made, no file written yet
    assert files.target == plan.target and plan.target.read_text(encoding="utf-8") == report_markdown(plan)
    assert files.html == plan.written[1:] and files.html[0].name == "report.html"
    assert all(p.is_file() for p in plan.written) and files.stale_html is None and files.removed == []
    import json

    record = json.loads((plan.out / REPORT_RECORD).read_text(encoding="utf-8"))["files"]
    assert record == sorted(p.name for p in plan.written)


def test_write_report_no_html_names_an_old_page_and_force_removes_what_it_does_not_write(tmp_path):
    run = _run(tmp_path / "runs", "cur", {1: 20.0})
    write_report(plan_report(run))
    files = write_report(plan_report(run, html=False, force=True), html=False, force=True)
    assert files.html == [] and "report.html" in files.removed and files.stale_html is None
    assert not (files.target.parent / "report.html").exists()
    (files.target.parent / "report.html").write_text("the user's", encoding="utf-8")
    files = write_report(plan_report(run, html=False, force=True), html=False)
    assert files.stale_html == "not this report's" and files.removed == []


def test_write_report_failures_carry_their_exit_code_and_what_was_written(tmp_path):
    run = _run(tmp_path / "runs", "cur", {1: 20.0})
    plan = plan_report(run, out=tmp_path / "gone" / "r", html=False)
    (tmp_path / "gone").write_text("a file since the plan")
    with pytest.raises(ReportNotWritten, match="^--out: cannot create") as error:
        write_report(plan, html=False)
    assert error.value.code == 2 and error.value.done.target is None
    out = tmp_path / "r"
    (out / "report.html").mkdir(parents=True)  # summary.md is written, report.html cannot be
    called = []
    with pytest.raises(ReportNotWritten, match="^cannot write the report under") as error:
        write_report(plan_report(run, out=out, force=True), force=True, before_writing=lambda: called.append(1))
    assert error.value.code == 1 and error.value.done.target == out / "summary.md" and called == [1]
    assert (out / "summary.md").is_file()


def test_an_interrupted_report_leaves_nothing_half_written(tmp_path, monkeypatch):
    """Ctrl-C while the plots were drawn left a partial <run>-report/ that the rerun refused without --force:
    the files are staged and moved into place at the end, so an interrupt leaves the directory as it was (a
    default directory it made is removed again; an earlier report's files stay untouched) and a rerun works."""
    from moebench.reports import report

    run = _run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0})

    def stopped(plan, into=None):
        (into / "report.html").write_text("half", encoding="utf-8")
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(report, "write_report_html", stopped)
        plan = plan_report(run)
        with pytest.raises(report.ReportInterrupted) as error:
            write_report(plan)
    assert error.value.done.target is None and not plan.out.exists()
    assert write_report(plan_report(run)).target == plan.target  # the rerun is not refused
    earlier = {p.name: p.read_bytes() for p in plan.out.iterdir()}
    with monkeypatch.context() as mp:
        mp.setattr(report, "write_report_html", stopped)
        with pytest.raises(KeyboardInterrupt):
            write_report(plan_report(run, force=True), force=True)
    assert {p.name: p.read_bytes() for p in plan.out.iterdir()} == earlier  # no staging folder left either
