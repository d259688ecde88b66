"""The H200 runs committed under reports/runs/ still read and render (no GPU):
CI catches a report or store change that would strand the measurements the
README and perf-notes quote."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli import app
from moebench.reports.store import MANIFEST, RESULTS, read_run

RUNS = Path(__file__).resolve().parents[2] / "reports" / "runs"
COMMITTED = sorted(p for p in RUNS.iterdir() if p.is_dir()) if RUNS.is_dir() else []


def test_the_committed_runs_are_there():
    assert COMMITTED, f"no run directories under {RUNS}"
    for run in COMMITTED:
        assert (run / RESULTS).is_file() and (run / MANIFEST).is_file(), f"{run} is not a complete run"


@pytest.mark.parametrize("run", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_run_reads_and_renders(run, tmp_path):
    before = sorted(p.name for p in run.iterdir())
    df, manifest = read_run(run)
    assert len(df) > 0 and manifest.get("device", {}).get("name")
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert manifest["device"]["name"] in summary
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<html" in html.lower()
    plots = sorted(tmp_path.glob("*.png"))
    assert plots and all(p.read_bytes().startswith(b"\x89PNG") for p in plots)
    assert sorted(p.name for p in run.iterdir()) == before  # the committed run is left as it is
