"""The H200 runs committed under reports/runs/ still read and render (no GPU):
CI catches a report or store change that would strand the measurements the
README and perf-notes quote."""

import importlib.util
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli import app
from moebench.reports.store import MANIFEST, RESULTS, read_run

RUNS = Path(__file__).resolve().parents[2] / "reports" / "runs"
_SPEC = importlib.util.spec_from_file_location("readme_tables", RUNS.parents[1] / "scripts" / "readme_tables.py")
_readme_tables = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_readme_tables)


def _committed(runs: Path) -> list[Path]:
    """The run directories git tracks under `runs` (a user's own sweeps
    stored there by the default --out are not the committed measurements);
    every directory when git cannot say (no git, not a checkout)."""
    if not runs.is_dir():
        return []
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", "."], cwd=runs, capture_output=True, text=True, check=True, timeout=60
        ).stdout
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


#: README's measured tables (one per TP degree) and its error table, all from one run.
README_RUN = "2026-12-06-h100-dsv41-flash-compare"
README_COLUMNS = _readme_tables.COLUMNS  # README column -> backend (the script that prints the tables)


def test_readme_tables_quote_the_committed_run():
    """Every 'µs / % copy' cell of README's measured tables (dsv41-flash,
    correlated, TP4 then TP8; ours without PDL, the peers' defaults) equals
    the committed run's ok case, rounded as printed, and each row's fastest
    peer and speed-up are that run's: a re-measured run or an edited table
    cannot drift apart, and a ratio is never quoted across runs. The error
    table's cells are each backend's worst err / err_bf16 over rows 1-8."""
    readme = (RUNS.parents[1] / "README.md").read_text()
    df = read_run(RUNS / README_RUN)[0]
    assert f"reports/runs/{README_RUN}" in readme
    lines = readme.splitlines()
    headers = [i for i, ln in enumerate(lines) if ln.startswith("| rows |") and "moebench (ours)" in ln]
    assert len(headers) == 2, "README holds one measured table per TP degree (4, 8)"
    checked = 0
    for tp, at in zip((4, 8), headers):
        cols = [c.strip() for c in lines[at].strip("|").split("|")]
        assert cols[-2:] == ["fastest peer", "speed-up"] and set(cols[1:-2]) == set(README_COLUMNS), cols
        sel = _readme_tables.cases(df, tp)
        for ln in lines[at + 2 :]:
            if not ln.startswith("| "):
                break
            cells = [c.strip() for c in ln.strip("|").split("|")]
            case = sel[sel.rows == int(cells[0])].set_index("backend")
            for col, cell in zip(cols[1:-2], cells[1:-2]):
                rec = case.loc[README_COLUMNS[col]]
                us, pct = (float(v.strip(" %")) for v in cell.split("/"))
                assert (round(float(rec.median_us), 1), round(float(rec.pct_copy_bw), 1)) == (us, pct), (tp, col)
                checked += 1
            peers = case.drop("moebench")["median_us"]
            assert cells[-2] == peers.idxmin(), (tp, cells[0])
            assert cells[-1] == f"{peers.min() / case.loc['moebench', 'median_us']:.2f}x", (tp, cells[0])
    assert checked == 2 * 5 * len(README_COLUMNS)
    errors = [i for i, ln in enumerate(lines) if ln.startswith("| backend | TP4 err / err_bf16")]
    assert len(errors) == 1, "README holds one error table"
    for ln in lines[errors[0] + 2 : errors[0] + 2 + len(README_COLUMNS)]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for tp, cell in zip((4, 8), cells[1:]):
            sel = _readme_tables.cases(df, tp)
            sel = sel[sel.backend == README_COLUMNS[cells[0]]]
            assert cell == f"{sel.max_rel_err.max():.1e} / {sel.err_bf16.max():.1e}", (cells[0], tp)


def test_measuring_names_the_merged_run_readme_quotes():
    """measuring.md's "Merged runs" called the 2026-12-01 H200 run "the README's peers comparison" after
    README moved to the merged H100 run: it names the run README quotes, and that run is a merge."""
    text = (RUNS.parents[1] / "docs" / "measuring.md").read_text()
    section = text.split("## Merged runs", 1)[1].split("\n## ", 1)[0]
    said = " ".join(section.split())
    assert f"The README's peers comparison, `reports/runs/{README_RUN}`" in said
    assert len(read_run(RUNS / README_RUN)[1]["merged_from"]) >= 2


def test_baselines_details_name_the_run_readme_quotes():
    """README sends readers to baselines.md's "Read with the README's table" for what each peer reads, and
    that section still named the 2026-12-01 H200 run as the README's: it names the run README quotes, and
    the triton route range it states is that run's."""
    import re

    text = (RUNS.parents[1] / "docs" / "baselines.md").read_text()
    section = " ".join(text.split("## Read with the README's table", 1)[1].split("\n## ", 1)[0].split())
    assert f"The README's peer tables (run `reports/runs/{README_RUN}`" in section
    df = read_run(RUNS / README_RUN)[0]
    triton = df[(df.backend == "triton-mxfp4") & (df.status == "ok")]
    lo, hi, call_lo, call_hi = map(int, re.search(r"(\d+)-(\d+) µs of its (\d+)-(\d+) µs", section).groups())
    assert (lo, hi) == (round(triton.kernel_route_us.min()), round(triton.kernel_route_us.max()))
    assert (call_lo, call_hi) == (round(triton.median_us.min()), round(triton.median_us.max()))


def test_readme_prose_around_the_tables_states_the_runs_numbers():
    """The numbers README's prose states about the run it quotes are that run's (rows 1, 2, 4, 6, 8;
    ours at nopdl=default): the PDL A/B per TP (it said 0.1-0.3 µs at both, yet at TP4 rows 6 / 8 the
    route without PDL was the faster), triton's call and route-stage ranges (it called the ~220 µs call
    the route stage), the W4A16 paths' err_bf16 range (it said near 5e-3: humming W4A16 is 9.8e-3) and
    the uniform point."""
    import re

    said = " ".join((RUNS.parents[1] / "README.md").read_text().split())
    df = read_run(RUNS / README_RUN)[0]
    ok = df[(df.status == "ok") & (df.preset == "dsv41-flash")]
    cor = ok[(ok.scenario == "correlated") & ok.rows.isin([1, 2, 4, 6, 8])]
    ours = cor[cor.backend == "moebench"].pivot_table(index=["tp", "rows"], columns="tactic", values="median_us")
    gain = (ours["nopdl=default"] - ours["default"]).round(1)
    m = re.search(r"PDL worth (\S+)-(\S+) µs at TP8, .* and (\S+) to (\S+) µs at TP4, within the noise", said)
    assert m, "README states the PDL A/B per TP"
    assert (float(m[1]), float(m[2])) == (gain[8].min(), gain[8].max())
    assert (float(m[3]), float(m[4])) == (gain[4].min(), gain[4].max())
    triton = ok[ok.backend == "triton-mxfp4"]
    m = re.search(r"triton_kernels' (\d+)-(\d+) µs is mostly its route stage, .*? \((\d+)-(\d+) µs alone", said)
    assert m and tuple(map(int, m.groups())) == tuple(
        round(v) for v in (triton.median_us.min(), triton.median_us.max(), triton.kernel_route_us.min(),
                           triton.kernel_route_us.max())
    )  # fmt: skip
    a16 = ok[(ok.scenario == "correlated") & (ok.tactic == "default")]  # the error table: rows 1-8
    a16 = a16[a16.backend.isin(["flashinfer-w4a16", "marlin-w4a16", "humming-w4a16", "triton-mxfp4", "torch-bf16"])]
    worst = a16.groupby(["backend", "tp"]).err_bf16.max()  # each cell of README's error table
    m = re.search(r"the W4A16 paths stay below 1e-2 \((\S+) to (\S+)\)", said)
    assert m and (m[1], m[2]) == (f"{worst.min():.1e}", f"{worst.max():.1e}") and worst.max() < 1e-2
    uni = ok[(ok.scenario == "uniform") & (ok.tp == 4) & (ok.rows == 6)]
    us = float(uni[(uni.backend == "moebench") & (uni.tactic == "nopdl=default")].median_us.iloc[0])
    peers = uni[(uni.backend != "moebench") & (uni.tactic == "default")].set_index("backend").median_us
    assert f"ours ({us:.1f} µs) is {peers.min() / us:.2f}x faster" in said
    assert f"(humming W4A8, {peers.min():.1f} µs) at TP4, 6 rows" in said and peers.idxmin() == "humming-w4a8"


def test_readme_states_the_retune_ab_and_the_later_tp8_uniform_run():
    """README's paragraph on the re-tuned tables and its TP8 uniform sentence
    state their runs' numbers: the worst-row errors per TP, the µs the new
    tables cost at the rows both tables tuned, what rows 3 / 5 / 7 gain, and
    ours (nopdl=default) against the fastest peer at TP8 uniform rows 6."""
    import re

    said = " ".join((RUNS.parents[1] / "README.md").read_text().split())
    df = read_run(RUNS / "2026-12-06-h100-dsv41-flash-retune-ab")[0]
    ok = df[df.status == "ok"]
    old = "tables=reports/tables/h100-2aabf3b"
    us = ok.pivot_table(index=["tp", "rows"], columns="tactic", values="median_us")
    d = (us["default"] - us[old]).round(1)
    both, new_rows = [1, 2, 4, 6, 8], [3, 5, 7]
    m = re.search(r"\+(\S+) to \+(\S+) µs at TP4 and \+(\S+) to \+(\S+) µs at TP8", said)
    assert m, "README states what the re-tuned tables cost per TP"
    for tp, (lo, hi) in ((4, m.group(1, 2)), (8, m.group(3, 4))):
        at = d.loc[tp].loc[both]
        assert (float(lo), float(hi)) == (at.min(), at.max()), tp
    gain = -d.loc[(slice(None), new_rows),]
    m = re.search(r"rows 3, 5 and 7, tuned now, (\S+) to (\S+) µs faster", said)
    assert m and (float(m[1]), float(m[2])) == (gain.min(), gain.max()) and gain.min() > 0
    row = ok.groupby(["tactic", "tp"]).max_row_rel_err.max()
    m = re.search(r"worst row error (\S+) / (\S+) \(TP4 / TP8\) against (\S+) / (\S+);", said)
    assert m and m.groups() == tuple(f"{row[t, tp]:.1e}" for t in ("default", old) for tp in (4, 8))
    uni = read_run(RUNS / "2026-12-06-h100-compare-uniform6-tp8")[0]
    uni = uni[uni.status == "ok"]
    ours = float(uni[(uni.backend == "moebench") & (uni.tactic == "nopdl=default")].median_us.iloc[0])
    peers = uni[(uni.backend != "moebench") & (uni.tactic == "default")].set_index("backend").median_us
    assert peers.idxmin() == "humming-w4a16"
    assert f"ours ({ours:.1f} µs) is {peers.min() / ours:.2f}x faster than the fastest peer (humming W4A16, " \
           f"{peers.min():.1f} µs)" in said  # fmt: skip
