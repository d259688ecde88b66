"""HTML report and PNG plots (matplotlib Agg)."""

import math

import pandas as pd

from moebench.reports.compare import compare_runs
from moebench.reports.html import (
    is_report_file, kernel_columns, main_scenario, report_files, speedup_frame, tp_plot_frames, write_html_report,
)  # fmt: skip

PNG = b"\x89PNG\r\n\x1a\n"
MANIFEST = {"device": {"name": "NVIDIA H200", "sm_count": 132}, "copy_bw_gbps": 4000.0, "commit": "abc<def>"}


def frame(with_flashinfer=True, with_kernels=True):
    rows = []
    for r in (1, 2, 4, 8):
        nbytes = 4_700_000 * 6 * r
        for backend, us in (("moebench", 20.0 + 3 * r), ("flashinfer-w4a16", 50.0 + 8 * r), ("torch-bf16", 300.0)):
            if backend.startswith("flashinfer") and not with_flashinfer:
                continue
            failed = backend == "torch-bf16" and r == 8
            row = dict(preset="dsv41-flash", tp=4, rows=r, scenario="correlated", backend=backend, tactic="default",
                       status="failed" if failed else "ok", error="rel. error 1 exceeds 0.01" if failed else "",
                       median_us=math.nan if failed else us, p10_us=math.nan if failed else us * 0.97,
                       p90_us=math.nan if failed else us * 1.04, unique_experts=6 * r, bytes=nbytes,
                       gbps=math.nan if failed else nbytes / us / 1e3,
                       pct_copy_bw=math.nan if failed else nbytes / us / 1e3 / 40.0, ceiling_gbps=3500.0,
                       pct_size_ceiling=math.nan, max_rel_err=1e-3)  # fmt: skip
            if with_kernels and backend == "moebench":
                row.update(kernel_route_us=1.5, kernel_gemm1_us=0.6 * us, kernel_gemm2_us=0.35 * us)
            rows.append(row)
    return pd.DataFrame(rows)


def test_report_and_plots_are_written(tmp_path):
    df = frame()
    base = df.assign(median_us=df["median_us"] * 0.9, p10_us=df["p10_us"] * 0.9, p90_us=df["p90_us"] * 0.9)
    comp = compare_runs(df, MANIFEST, base, MANIFEST, threshold_pct=5)
    paths = write_html_report(df, MANIFEST, tmp_path, comparison=comp)
    names = [p.name for p in paths]
    assert names == ["report.html", "latency_tp4.png", "latency.png", "bandwidth.png", "speedup.png", "kernels.png",
                     "compare.png"]  # fmt: skip
    assert report_files(df, comp) == names  # named before writing, so that the CLI can refuse to replace them
    assert all(map(is_report_file, names))  # every name, so that `report --force` can remove an earlier report's
    for p in paths[1:]:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, p
    text = paths[0].read_text()
    for name in names[1:]:
        assert f"src='{name}'" in text
    assert "NVIDIA H200" in text and "abc&lt;def&gt;" in text  # escaped
    assert "Regressions (" in text and 'class="slower"' in text
    assert 'class="failed"' in text and "rel. error 1 exceeds 0.01" in text  # failed shown as failed


def test_optional_plots_are_left_out(tmp_path):
    paths = write_html_report(frame(with_flashinfer=False, with_kernels=False), {}, tmp_path)
    assert [p.name for p in paths] == ["report.html", "latency_tp4.png", "latency.png", "bandwidth.png"]
    assert report_files(frame(with_flashinfer=False, with_kernels=False)) == [p.name for p in paths]
    assert "copy bandwidth: not measured" in paths[0].read_text()


def test_a_run_whose_cases_were_all_skipped_gets_no_empty_plots(tmp_path):
    df = frame(with_kernels=False).assign(
        status="skipped",
        error="needs a CUDA device, got cpu",
        median_us=math.nan,
        p10_us=math.nan,
        p90_us=math.nan,
        gbps=math.nan,
        pct_copy_bw=math.nan,
    )
    paths = write_html_report(df, MANIFEST, tmp_path)
    assert [p.name for p in paths] == report_files(df) == ["report.html"]
    assert not list(tmp_path.glob("*.png"))
    text = paths[0].read_text()
    assert "every case was skipped" in text and "needs a CUDA device, got cpu" in text
    one = df.copy()
    one.loc[0, "status"] = "failed"  # a failed case is drawn (a cross at 0)
    assert report_files(one)[:3] == ["report.html", "latency.png", "bandwidth.png"]  # no ok case: no per-TP plot


def test_speedup_and_kernel_columns():
    df = frame()
    sp = speedup_frame(df)
    assert set(sp["backend"]) == {"moebench", "torch-bf16"}
    one = sp[(sp["backend"] == "moebench") & (sp["rows"] == 1)]["speedup"].iloc[0]
    assert one == (50.0 + 8) / (20.0 + 3)
    assert speedup_frame(frame(with_flashinfer=False)).empty
    assert kernel_columns(df) == ["kernel_route_us", "kernel_gemm1_us", "kernel_gemm2_us"]


def test_one_comparison_plot_per_tp_of_the_main_scenario(tmp_path):
    """latency_tp<N>.png per TP degree with an ok case of the run's main
    scenario (most ok cases; 'correlated' wins a tie): µs per layer call vs
    rows, one line per (backend, tactic), log y."""
    df = frame(with_kernels=False)
    tp8 = df.assign(tp=8, median_us=df["median_us"] / 2)
    other = df.assign(scenario="uniform")
    hot_only = df.assign(scenario="hot", tp=2)  # another scenario at a TP of its own: no plot for it
    run = pd.concat([df, tp8, other, hot_only], ignore_index=True)
    assert main_scenario(run) == "correlated"
    assert main_scenario(pd.concat([other, other.assign(rows=other["rows"] + 10)])) == "uniform"
    assert main_scenario(run.assign(status="failed")) is None
    frames = tp_plot_frames(run)
    assert sorted(frames) == [4, 8] and set(frames[4]["scenario"]) == {"correlated"}
    paths = write_html_report(run, {**MANIFEST, "boundary": "layer"}, tmp_path)
    names = [p.name for p in paths]
    assert names[:3] == ["report.html", "latency_tp4.png", "latency_tp8.png"] and "latency_tp2.png" not in names
    assert names == report_files(run)
    for name in names[1:3]:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    text = paths[0].read_text()
    assert "TP4: µs per layer call vs rows, every backend and tactic side by side" in text
    assert "layer boundary: layer" in text
    assert is_report_file("latency_tp16.png") and not is_report_file("latency_tp0.png")
    assert not is_report_file("latency_tpx.png")


def _figures(monkeypatch, df, tmp_path):
    """{file name: the matplotlib Figure} of every plot write_html_report draws of `df`."""
    from moebench.reports import html

    drawn = {}

    def keep(fig, path):
        drawn[path.name] = fig
        return path

    monkeypatch.setattr(html, "_save", keep)
    write_html_report(df, MANIFEST, tmp_path)
    return drawn


def test_plots_tick_whole_rows_and_give_one_row_a_sane_width(tmp_path, monkeypatch):
    """The row axes ticked 1.2, 1.4 ... and a one-row panel drew its bar across the whole axis: every rows
    axis ticks whole numbers only, and one row count sits in a span of three rows."""
    for rows in ((1, 2), (4,)):
        df = frame()
        df = df[df["rows"].isin(rows)]
        drawn = _figures(monkeypatch, df, tmp_path)
        assert {"latency_tp4.png", "latency.png", "bandwidth.png", "speedup.png", "kernels.png"} <= set(drawn)
        for name, fig in drawn.items():
            for ax in fig.axes:
                fig.canvas.draw()
                lo, hi = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert ticks and all(float(t).is_integer() for t in ticks), (name, rows, ticks)
                if len(rows) == 1:
                    assert hi - lo >= 3.0 and lo < rows[0] < hi, (name, lo, hi)
                    for bar in ax.patches:  # the kernels' stacked bars
                        assert bar.get_width() / (hi - lo) <= 0.3, (name, bar.get_width(), hi - lo)
