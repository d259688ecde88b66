"""The printing of report's and tune's results (moebench/render.py): what
each line says, in order, from the library's records."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from moebench import render
from moebench.reports.report import ReportFiles


@pytest.fixture
def printed(monkeypatch):
    """The text render prints, one string (wide, no colours)."""
    out = Console(width=300, no_color=True, highlight=False, record=True)
    monkeypatch.setattr(render, "console", out)
    monkeypatch.setattr(render, "wide_console", lambda width, *tables: out)
    return lambda: out.export_text()


def test_report_files_are_said_in_the_order_written(printed, tmp_path):
    render.print_report_files(ReportFiles())  # nothing written: nothing said
    assert printed() == ""
    files = ReportFiles(tmp_path / "summary.md", None, [tmp_path / "report.html", tmp_path / "a.png"], ["b.png"])
    render.print_report_files(files)
    lines = printed().splitlines()
    assert lines == [f"wrote {tmp_path / 'summary.md'}", f"wrote {tmp_path / 'report.html'} (1 plots)",
                     f"removed b.png from {tmp_path} (an earlier report's; this one does not write it)"]  # fmt: skip


def test_a_page_left_as_it_was_and_a_page_without_plots(printed, tmp_path):
    render.print_report_files(ReportFiles(tmp_path / "summary.md", "an earlier report's"))
    render.print_report_files(ReportFiles(tmp_path / "summary.md", html=[tmp_path / "report.html"]))
    text = printed()
    assert f"{tmp_path / 'report.html'} is an earlier report's (--no-html leaves it as it is)" in text
    assert "(no plots: no case was timed or failed)" in text


def test_tune_lines_and_tables(printed, tmp_path, monkeypatch):
    monkeypatch.setattr(render.rich_tables, "picks_tables", lambda outcome, label: [f"picks of {label}"])
    from moebench.kernels.fused_tactic import LayerChoice, default_fused_tactic
    from moebench.models import get_preset

    fused = SimpleNamespace(tactic=LayerChoice(default_fused_tactic(get_preset("dsv4-pro").shard(4), 6)))
    table = SimpleNamespace(entries={1: 0, 2: 0}, fp8_entries={}, fused_entries={})
    layer = SimpleNamespace(
        entries={}, fp8_entries={1: 0}, fused_entries={1: fused, 2: SimpleNamespace(tactic=LayerChoice())}
    )
    render.print_tuned(SimpleNamespace(preset="dsv4-pro", family="FP8"), None,
                       [SimpleNamespace(path=Path("t.json"), table=table), SimpleNamespace(path=Path("u.json"), table=layer)])  # fmt: skip
    render.print_tune_run(SimpleNamespace(records=[], families=[], summary_files=(Path("g.md"), Path("g.json")),
                                          seconds=12.34), tmp_path)  # fmt: skip
    assert printed().splitlines() == ["picks of dsv4-pro FP8", "wrote t.json (2 BF16 + 0 FP8 entries)",
                                      "wrote u.json (0 BF16 + 1 FP8 entries, fp8.fused: 1 of 2 rows fused)",
                                      "wrote g.md and g.json", "[  12.3 s] done in 12 s"]  # fmt: skip


def _step_frame():
    """A GPU-like step run: two backends timed at rows 1-8 with many columns, one backend skipped at every
    rows with the same reason."""
    import pandas as pd

    rows = []
    for r in range(1, 9):
        for backend, status in (("moebench", "ok"), ("torch-bf16", "ok"), ("flashinfer-w4a16", "skipped")):
            ok = status == "ok"
            rows.append({
                "preset": "dsv41-flash", "tp": 4, "ranks": 1, "rows": r, "scenario": "correlated",
                "unique_experts": 3 * r, "backend": backend, "tactic": "default", "status": status,
                "median_us": 12345.678 + r if ok else None, "p10_us": 1.0 if ok else None,
                "p90_us": 2.0 if ok else None, "step_with_gate_us": 23456.789 if ok else None,
                "gate_us": 8.5 if ok else None, "allreduce_us": 7.25 if ok else None,
                "allreduce_share_pct": 12.5 if ok else None, "stage_sum_us": 34567.891 if ok else None,
                "kernel_front_us": 2.5 if ok else None, "kernel_gemm1_us": 8.9 if ok else None,
                "gbps": 2019.5 if ok else None, "pct_copy_bw": 47.9 if ok else None,
                "max_rel_err": 3.1e-3 if ok else None, "routing_path": "front", "shared_path": "kernels, side stream",
                "error": None if ok else "package flashinfer-python is not installed (see docs/baselines.md)",
            })  # fmt: skip
    return pd.DataFrame(rows)


def test_step_table_is_never_cut_and_says_a_skip_reason_once(monkeypatch, capsys):
    """In a 100-column terminal the step table's cells were cropped (12346.7 µs showed as "123"), and a
    backend skipped at every rows repeated its reason on each row: every number is printed whole, and the
    skipped backend is one line with its count and reason."""
    from rich.console import Console

    from moebench import cli_support

    monkeypatch.setattr(cli_support, "console", Console(force_terminal=True, width=100))
    render.print_step(_step_frame())
    text = capsys.readouterr().out
    for number in ("12346.7", "12353.7", "23456.8", "34567.9", "2019.5", "3.1e-03"):
        assert number in text, text
    reason = "package flashinfer-python is not installed (see docs/baselines.md)"
    assert text.count(reason) == 1 and f"skipped flashinfer-w4a16 (8 cases): {reason}" in text, text
    assert not [line for line in text.splitlines() if "flashinfer" in line and line.startswith("│")]
