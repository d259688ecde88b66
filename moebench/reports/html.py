"""HTML report of a run (and its comparison with a baseline) with PNG plots.

Plots (matplotlib's Agg canvas, no pyplot, no display):

- latency_tp<N>.png, one per TP degree: the side-by-side comparison, µs per
  layer call vs rows for the run's main scenario (`main_scenario`), one line
  per (backend, tactic), log y axis (torch-bf16 is ~10x slower than the
  rest), a panel per preset; a series' failed rows are named in its legend;

and one figure per (preset, tp, scenario) group:

- latency.png: µs per layer call vs rows, one line per backend[tactic],
  failed cases marked with a red x on the axis, the physical floor (unique
  bytes / measured copy bandwidth) dashed;
- bandwidth.png: achieved GB/s as % of the measured copy bandwidth vs rows,
  100 % and the size-matched ceiling drawn;
- speedup.png: speedup vs the best FlashInfer backend of the same case
  (only when a flashinfer* backend has ok cases);
- kernels.png: per-kernel split (stacked µs of the `kernel_<name>_us`
  columns, each stage timed alone; only when present), with the case's own
  time as a black bar marker (the layer call, or the whole step of a step
  run: PDL overlaps the stages, so the stack may stand above it) and the
  routed path (`routed_us`) as a hollow one where measured;
- compare.png: the per-case ratio vs the baseline with its noise band and
  verdict colours (only with a comparison).

`write_html_report` returns the paths it wrote (`report_files` names them
beforehand); the library never prints.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from moebench.reports.compare import Comparison
from moebench.reports.summary import (
    boundary_text, kernel_columns, shared_stream_text, stage_timing_text, summary_table,
)  # fmt: skip

GROUP_KEYS = ("preset", "tp", "scenario")
KERNEL_COLUMN = re.compile(r"^kernel_(\w+)_us$")
VERDICT_COLORS = {
    "faster": "#2e7d32", "slower": "#c62828", "same": "#757575", "unclear": "#f9a825", "failed": "#6a1b9a",
    "fixed": "#1565c0", "mismatch": "#ef6c00", "lost": "#c62828",
}  # fmt: skip


def _series_label(backend: str, tactic: str) -> str:
    return backend if tactic in ("default", "", None) else f"{backend}[{tactic}]"


def _groups(df: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    keys = [k for k in GROUP_KEYS if k in df.columns]
    return [((g,) if not isinstance(g, tuple) else g, sub) for g, sub in df.groupby(keys, sort=True, dropna=False)]


def _grid(n: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def _title(key: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(GROUP_KEYS, key))


def _rows_axis(ax, rows) -> None:
    """Label the x axis as token rows: whole-number ticks only (rows 1..8,
    never 1.2, 1.4 ...), and one row count drawn in the middle of a span of
    three rows, so that its point or bar (0.8 rows wide) does not fill the
    whole panel."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("token rows")
    values = sorted({int(r) for r in rows})
    if len(values) == 1:
        ax.set_xlim(values[0] - 1.5, values[0] + 1.5)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def plot_latency(df: pd.DataFrame, copy_bw_gbps: float | None, path: Path) -> Path:
    groups = _groups(df)
    fig, axes = _grid(max(1, len(groups)))
    for ax, (key, sub) in zip(axes, groups):
        for (backend, tactic), s in sub.groupby(["backend", "tactic"], sort=True):
            ok = s[s["status"] == "ok"].sort_values("rows")
            if len(ok):
                ax.plot(ok["rows"], ok["median_us"], marker="o", label=_series_label(backend, tactic))
                ax.fill_between(ok["rows"], ok["p10_us"], ok["p90_us"], alpha=0.15)
            bad = s[s["status"] == "failed"]
            if len(bad):
                ax.scatter(bad["rows"], [0] * len(bad), marker="x", color="red", zorder=5,
                           label=f"{_series_label(backend, tactic)} failed")  # fmt: skip
        if copy_bw_gbps and "bytes" in sub.columns:
            floor = sub.groupby("rows")["bytes"].max().sort_index()
            ax.plot(floor.index, floor.values / (copy_bw_gbps * 1e9) * 1e6, "k--", linewidth=1,
                    label="floor (bytes / copy bw)")  # fmt: skip
        ax.set_title(_title(key), fontsize=9)
        _rows_axis(ax, sub["rows"])
        ax.set_ylabel("µs per layer call")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return _save(fig, path)


#: The per-TP comparison plots' file names.
TP_PLOT = re.compile(r"^latency_tp([1-9][0-9]*)\.png$")


def tp_plot_name(tp: int) -> str:
    return f"latency_tp{int(tp)}.png"


def main_scenario(df: pd.DataFrame) -> str | None:
    """The scenario a run is mostly about: the one with the most ok cases
    ("correlated", the sweep's default, wins a tie, then the first by name);
    None when no case is ok."""
    if not {"status", "scenario"} <= set(df.columns):
        return None
    counts = df[df["status"] == "ok"]["scenario"].astype(str).value_counts()
    if counts.empty:
        return None
    best = counts[counts == counts.max()].index
    return "correlated" if "correlated" in best else sorted(best)[0]


def tp_plot_frames(df: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """{tp: the main scenario's rows at that TP degree} for every TP degree
    with an ok case there (what `plot_tp_latency` draws)."""
    scenario = main_scenario(df)
    if scenario is None or "tp" not in df.columns:
        return {}
    sub = df[df["scenario"].astype(str) == scenario]
    return {int(tp): s for tp, s in sorted(sub.groupby("tp")) if (s["status"] == "ok").any()}


def plot_tp_latency(sub: pd.DataFrame, tp: int, note: str | None, path: Path) -> Path:
    """µs per layer call vs rows at one TP degree (module docstring)."""
    presets = sorted(sub["preset"].astype(str).unique())
    fig, axes = _grid(len(presets), width=6.4, height=4.4)
    scenario = str(sub["scenario"].iloc[0])
    for ax, preset in zip(axes, presets):
        part = sub[sub["preset"].astype(str) == preset]
        for (backend, tactic), s in part.groupby(["backend", "tactic"], sort=True):
            ok = s[(s["status"] == "ok") & (s["median_us"] > 0)].sort_values("rows")
            failed = sorted(int(r) for r in s.loc[s["status"] == "failed", "rows"])
            label = _series_label(backend, tactic) + (f" (failed: rows {', '.join(map(str, failed))})"
                                                      if failed else "")  # fmt: skip
            if len(ok):
                ax.plot(ok["rows"], ok["median_us"], marker="o", label=label)
            elif failed:
                ax.plot([], [], linestyle="none", marker="x", color="red", label=label)
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, 30, 300 rather than 2 x 10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"{preset} TP{tp}, {scenario}" + (f"\n{note}" if note else ""), fontsize=9)
        _rows_axis(ax, part["rows"])
        ax.set_ylabel("µs per layer call (log)")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_bandwidth(df: pd.DataFrame, copy_bw_gbps: float | None, path: Path) -> Path:
    groups = _groups(df)
    fig, axes = _grid(max(1, len(groups)))
    for ax, (key, sub) in zip(axes, groups):
        for (backend, tactic), s in sub.groupby(["backend", "tactic"], sort=True):
            ok = s[(s["status"] == "ok") & s["pct_copy_bw"].notna()].sort_values("rows")
            if len(ok):
                ax.plot(ok["rows"], ok["pct_copy_bw"], marker="o", label=_series_label(backend, tactic))
        ax.axhline(100.0, color="k", linestyle="--", linewidth=1, label="floor: copy bandwidth")
        if copy_bw_gbps and "ceiling_gbps" in sub.columns:
            ceil = sub.groupby("rows")["ceiling_gbps"].max().dropna().sort_index()
            if len(ceil):
                ax.plot(ceil.index, 100.0 * ceil.values / copy_bw_gbps, "k:", linewidth=1,
                        label="size-matched ceiling")  # fmt: skip
        ax.set_title(_title(key), fontsize=9)
        _rows_axis(ax, sub["rows"])
        ax.set_ylabel("% of copy bandwidth")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return _save(fig, path)


def speedup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per ok case of a non-FlashInfer backend: speedup = best ok flashinfer*
    median of the same (preset, tp, rows, scenario) / its median. Empty
    without FlashInfer results."""
    keys = ["preset", "tp", "rows", "scenario"]
    ok = df[df["status"] == "ok"]
    fi = ok[ok["backend"].astype(str).str.startswith("flashinfer")]
    if fi.empty:
        return pd.DataFrame(columns=[*keys, "backend", "tactic", "speedup"])
    best = fi.groupby(keys, dropna=False)["median_us"].min().rename("_fi")
    other = ok[~ok["backend"].astype(str).str.startswith("flashinfer")].merge(
        best, how="inner", left_on=keys, right_index=True)  # fmt: skip
    other = other.assign(speedup=other["_fi"] / other["median_us"])
    return other[[*keys, "backend", "tactic", "speedup"]].reset_index(drop=True)


def plot_speedup(df: pd.DataFrame, path: Path) -> Path | None:
    sp = speedup_frame(df)
    if sp.empty:
        return None
    groups = _groups(sp)
    fig, axes = _grid(len(groups))
    for ax, (key, sub) in zip(axes, groups):
        for (backend, tactic), s in sub.groupby(["backend", "tactic"], sort=True):
            s = s.sort_values("rows")
            ax.plot(s["rows"], s["speedup"], marker="o", label=_series_label(backend, tactic))
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_title(_title(key), fontsize=9)
        _rows_axis(ax, sub["rows"])
        ax.set_ylabel("speedup vs FlashInfer (x)")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _kernel_panels(df: pd.DataFrame, cols: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    if not cols:
        return []
    have = df[(df["status"] == "ok") & df[cols].notna().any(axis=1)]
    return [(key + (label,), s) for key, sub in _groups(have)
            for label, s in sub.groupby(sub["backend"] + "/" + sub["tactic"].astype(str))]  # fmt: skip


def plot_kernels(df: pd.DataFrame, path: Path) -> Path | None:
    cols = kernel_columns(df)
    panels = _kernel_panels(df, cols)
    if not panels:
        return None
    fig, axes = _grid(len(panels))
    for ax, (key, sub) in zip(axes, panels):
        sub = sub.sort_values("rows")
        bottom = [0.0] * len(sub)
        for col in cols:
            vals = sub[col].fillna(0.0).tolist()
            ax.bar(sub["rows"], vals, bottom=bottom, label=KERNEL_COLUMN.match(col)[1])
            bottom = [b + v for b, v in zip(bottom, vals)]
        step = "kind" in sub.columns and (sub["kind"] == "step").all()
        ax.plot(
            sub["rows"],
            sub["median_us"],
            linestyle="none",
            marker="_",
            markersize=16,
            markeredgewidth=2.5,
            color="k",
            label="whole step" if step else "layer call",
        )
        if "routed_us" in sub.columns and sub["routed_us"].notna().any():
            ax.plot(
                sub["rows"],
                sub["routed_us"],
                linestyle="none",
                marker="o",
                markersize=5,
                markerfacecolor="none",
                color="k",
                label="routed path",
            )
        ax.set_title(_title(key[:-1]) + f" {key[-1]}", fontsize=9)
        _rows_axis(ax, sub["rows"])
        ax.set_ylabel("µs")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _compared_frame(comp: Comparison) -> pd.DataFrame:
    return comp.frame[comp.frame["ratio"].notna()].reset_index(drop=True)


def plot_comparison(comp: Comparison, path: Path) -> Path | None:
    f = _compared_frame(comp)
    if f.empty:
        return None
    labels = [f"{r.backend} {r.preset} tp{r.tp} r{r.rows} {r.scenario}" for r in f.itertuples()]
    fig = Figure(figsize=(max(6.0, 0.35 * len(f) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = list(range(len(f)))
    colors = [VERDICT_COLORS.get(v, "#9e9e9e") for v in f["verdict"]]
    ax.bar(x, f["ratio"] - 1.0, bottom=1.0, color=colors)
    noise = (f["noise_pct"] / 100.0).tolist()
    ax.errorbar(x, f["ratio"], yerr=noise, fmt="none", ecolor="k", capsize=2, linewidth=0.8)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1.0 + comp.threshold_pct / 100.0, color="#c62828", linestyle="--", linewidth=0.8,
               label=f"threshold +{comp.threshold_pct:g} %")  # fmt: skip
    ax.set_xticks(x, labels, rotation=75, fontsize=6)
    ax.set_ylabel("median / baseline median")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _table_html(frame: pd.DataFrame, digits: int = 2) -> str:
    def cell(v) -> str:
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, float):
            return f"{v:.3g}" if v != 0 and (abs(v) < 10**-digits or abs(v) >= 1e7) else f"{v:.{digits}f}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = []
    for rec in frame.itertuples(index=False):
        cls = ""
        d = dict(zip(frame.columns, rec))
        mark = d.get("verdict") or d.get("status")
        if isinstance(mark, str):
            cls = f' class="{html.escape(mark)}"'
        body.append(f"<tr{cls}>" + "".join(f"<td>{cell(v)}</td>" for v in rec) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; }
tr.failed td, tr.slower td, tr.lost td { background: #fde0e0; }
tr.faster td { background: #e3f5e3; }
tr.unclear td, tr.mismatch td { background: #fff6d5; }
tr.skipped td { color: #888; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
.warn { color: #b00; font-weight: bold; }
"""


def _drawn(df: pd.DataFrame) -> bool:
    """Whether the latency / bandwidth plots have anything to show: an ok case
    with a time or a failed case (drawn as a cross). A run whose cases were
    all skipped gets no empty axes."""
    if "status" not in df.columns:
        return False
    timed = (df["status"] == "ok") & df["median_us"].notna() if "median_us" in df.columns else False
    return bool((timed | (df["status"] == "failed")).any())


#: Every plot `write_html_report` may draw, with its caption.
PLOT_CAPTIONS = {
    "latency.png": "Latency per layer call vs rows (median, p10-p90 band; floor = unique bytes / copy bandwidth)",
    "bandwidth.png": "Achieved bandwidth over the unique bytes, % of the measured copy bandwidth",
    "speedup.png": "Speedup vs the best FlashInfer backend of the same case",
    "kernels.png": "Per-kernel split (µs)",
    "compare.png": "Median vs the baseline (bar: ratio - 1; whisker: noise; colour: verdict)",
}  # fmt: skip
#: Every file `write_html_report` may write but the per-TP plots (`is_report_file` knows those too).
HTML_FILES = ("report.html", *PLOT_CAPTIONS)


def is_report_file(name: str) -> bool:
    """Whether `write_html_report` may write a file of this name (HTML_FILES
    or a per-TP plot, latency_tp<N>.png)."""
    return name in HTML_FILES or bool(TP_PLOT.match(name))


def _caption(name: str) -> str:
    m = TP_PLOT.match(name)
    if m:
        return (
            f"TP{m[1]}: µs per layer call vs rows, every backend and tactic side by side (the run's main"
            " scenario; log scale)"
        )
    return PLOT_CAPTIONS.get(name, name)


def report_files(df: pd.DataFrame, comparison: Comparison | None = None) -> list[str]:
    """Names of the files `write_html_report` writes for this run
    (report.html first), so that a caller can refuse to replace them all
    before writing any."""
    names = ["report.html", *(tp_plot_name(tp) for tp in tp_plot_frames(df))]
    if _drawn(df):
        names += ["latency.png", "bandwidth.png"]
    if not speedup_frame(df).empty:
        names.append("speedup.png")
    if _kernel_panels(df, kernel_columns(df)):
        names.append("kernels.png")
    if comparison is not None and not _compared_frame(comparison).empty:
        names.append("compare.png")
    return names


def write_html_report(
    df: pd.DataFrame,
    manifest: dict,
    out_dir: str | Path,
    *,
    comparison: Comparison | None = None,
    title: str = "moebench run",
    tables: dict[str, pd.DataFrame] | None = None,
) -> list[Path]:
    """Write out_dir/report.html and its PNG plots; returns the paths written
    (report.html first). `tables`: extra titled tables shown before the
    cases (e.g. a step run's split and its per-rank rows). Raises ValueError
    for a frame without the run columns, OSError from the file system."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copy_bw = manifest.get("copy_bw_gbps")
    copy_bw = float(copy_bw) if isinstance(copy_bw, (int, float)) and copy_bw > 0 else None
    table = summary_table(df)
    note = (
        "layer calls back to back"
        if manifest.get("boundary") == "back-to-back"
        else ("at a layer boundary (x written before each call)" if manifest.get("boundary") == "layer" else None)
    )
    pngs = [plot_tp_latency(sub, tp, note, out / tp_plot_name(tp)) for tp, sub in tp_plot_frames(df).items()]
    if _drawn(df):
        pngs += [plot_latency(df, copy_bw, out / "latency.png"), plot_bandwidth(df, copy_bw, out / "bandwidth.png")]
    for extra in (plot_speedup(df, out / "speedup.png"), plot_kernels(df, out / "kernels.png"),
                  plot_comparison(comparison, out / "compare.png") if comparison is not None else None):  # fmt: skip
        if extra is not None:
            pngs.append(extra)

    dev = manifest.get("device") or {}
    pk = manifest.get("packages") or {}
    facts = [
        f"device: {dev.get('name', '?')} ({dev.get('sm_count', '?')} SMs), driver {dev.get('driver') or '-'}",
        f"torch {pk.get('torch') or '-'}, cutlass-dsl {pk.get('nvidia-cutlass-dsl') or '-'}, "
        f"flashinfer {pk.get('flashinfer-python') or '-'}",
        f"commit {manifest.get('commit') or '-'}, created {manifest.get('created_utc') or '-'} UTC, "
        f"seed {manifest.get('seed', '-')}",
        f"copy bandwidth {copy_bw:.1f} GB/s" if copy_bw else "copy bandwidth: not measured",
    ]  # fmt: skip
    timing = stage_timing_text(manifest)
    if timing:
        facts.append(f"stage timing: {timing}")
    boundary = boundary_text(manifest)
    if boundary:
        facts.append(f"layer boundary: {boundary}")
    if manifest.get("kind") == "step":
        facts.append(f"shared expert: {shared_stream_text(manifest)}")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><ul>"]  # fmt: skip
    parts += [f"<li>{html.escape(f)}</li>" for f in facts]
    if manifest.get("reduced"):
        parts.append("<li class='warn'>reduced geometry on the CPU: latencies say nothing about a GPU</li>")
    parts.append("</ul>")
    if comparison is not None:
        parts.append(f"<h2>Comparison with {html.escape(comparison.baseline_label)}</h2><ul>")
        parts.append(
            f"<li>threshold {comparison.threshold_pct:g} %; verdicts: "
            + html.escape(", ".join(f"{n} {v}" for v, n in comparison.counts.items()) or "none")
            + "</li>"
        )
        for e in comparison.errors:
            parts.append(f"<li class='warn'>error: {html.escape(e)}</li>")
        for m in comparison.mismatches:
            parts.append(f"<li class='warn'>mismatch: {html.escape(m)}</li>")
        for n in comparison.notes:
            parts.append(f"<li>note: {html.escape(n)}</li>")
        parts.append("</ul>")
        reg = comparison.regressions
        none = ("<p>none found, but nothing was compared and judged (see the errors): not a pass</p>"
                if comparison.errors else f"<p>none found, but {html.escape(comparison.unclear_note)}</p>"
                if comparison.unclear_note else "<p>none</p>")  # fmt: skip
        parts.append(f"<h3>Regressions ({len(reg)})</h3>" + (_table_html(reg) if len(reg) else none))
        parts.append("<h3>All cases</h3>" + _table_html(comparison.frame))
    parts.append("<h2>Plots</h2>")
    if not pngs:
        parts.append("<p>none: no case was timed or failed (every case was skipped; the table below says why)</p>")
    for p in pngs:
        parts.append(f"<figure><img src='{html.escape(p.name)}' alt='{html.escape(p.stem)}'>"
                     f"<figcaption>{html.escape(_caption(p.name))}</figcaption></figure>")  # fmt: skip
    for heading, frame in (tables or {}).items():
        parts.append(f"<h2>{html.escape(heading)}</h2>" + _table_html(frame))
    parts.append("<h2>Cases</h2>" + _table_html(table))
    parts.append("</body></html>\n")
    report = out / "report.html"
    report.write_text("\n".join(parts), encoding="utf-8")
    return [report, *pngs]


__all__ = [
    "HTML_FILES",
    "is_report_file",
    "report_files",
    "write_html_report",
    "speedup_frame",
    "kernel_columns",
    "main_scenario",
    "tp_plot_frames",
]
