"""The H200 runs committed under reports/runs/ still read and render (no GPU):
CI catches a report or store change that would strand the measurements the
README and perf-notes quote."""

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli import app
from moebench.reports.store import MANIFEST, RESULTS, read_run

RUNS = Path(__file__).resolve().parents[2] / "reports" / "runs"


def _committed(runs: Path) -> list[Path]:
    """The run directories git tracks under `runs` (a user's own sweeps
    stored there by the default --out are not the committed measurements);
    every directory when git cannot say (no git, not a checkout)."""
    if not runs.is_dir():
        return []
    try:
        out = subprocess.run(["git", "ls-files", "--", "."], cwd=runs, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in runs.iterdir() if p.is_dir())
    names = {Path(line).parts[0] for line in out.splitlines() if len(Path(line).parts) > 1}
    return sorted(runs / n for n in names if (runs / n).is_dir())


COMMITTED = _committed(RUNS)


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


#: README's measured table: column -> (backend, run directory[, tactic: "default" if absent]).
README_COLUMNS = {
    "moebench fp8 (ours)": ("moebench", "2026-12-01-h200-dsv41-flash-fp8-s17", "fp8"),
    "moebench (ours)": ("moebench", "2026-11-30-h200-dsv41-flash-v15-retuned"),
    "humming W4A16": ("humming-w4a16", "2026-11-29-h200x4-dsv41-baselines"),
    "humming W4A8": ("humming-w4a8", "2026-11-29-h200x2-dsv41-humming-w4a8"),
    "FlashInfer SM90 W4A16": ("flashinfer-w4a16", "2026-11-29-h200x2-dsv41-flashinfer"),
    "FlashInfer SM90 W4A8": ("flashinfer-w4a8", "2026-11-29-h200x2-dsv41-flashinfer"),
    "torch BF16": ("torch-bf16", "2026-11-29-h200x2-dsv41-flashinfer"),
}


def test_readme_table_quotes_the_committed_runs():
    """Every 'µs / % copy' cell of README's measured table (dsv41-flash TP4,
    correlated, the column's tactic) equals the committed run's ok case, rounded
    as printed: a re-measured run or an edited table cannot drift apart."""
    readme = (RUNS.parents[1] / "README.md").read_text()
    lines = [ln for ln in readme.splitlines() if ln.startswith("| ")]
    header = next(ln for ln in lines if "moebench (ours)" in ln)
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert set(README_COLUMNS) <= set(cols[1:]), cols
    frames = {}
    checked = 0
    for ln in lines[lines.index(header) + 1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if not cells[0].isdigit():
            continue
        rows = int(cells[0])
        for col, cell in zip(cols[1:], cells[1:]):
            backend, run, *tactic = README_COLUMNS[col]
            tactic = tactic[0] if tactic else "default"
            if run not in frames:
                frames[run] = read_run(RUNS / run)[0]
            df = frames[run]
            case = df[(df.backend == backend) & (df.preset == "dsv41-flash") & (df.tp == 4) & (df.rows == rows)
                      & (df.scenario == "correlated") & (df.tactic == tactic)]
            assert len(case) == 1 and case.iloc[0].status == "ok", (col, rows)
            us, pct = (float(v.strip(" %")) for v in cell.split("/"))
            assert round(float(case.iloc[0].median_us), 1) == us, (col, rows, case.iloc[0].median_us)
            assert round(float(case.iloc[0].pct_copy_bw), 1) == pct, (col, rows, case.iloc[0].pct_copy_bw)
            checked += 1
    assert checked == 3 * len(README_COLUMNS)
