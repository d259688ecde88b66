"""Rich tables of what the CLI shows: a run's summary, a decode step's
tables, a comparison, a tune's picks, gains and kernel families, the
presets. Each function builds `rich.table.Table` objects (cells as rich
markup, user text escaped) and returns them; nothing here prints, the CLI
does.
"""

from __future__ import annotations

import math

from rich.markup import escape
from rich.table import Table

from moebench.kernels.table import STAGE_LABELS


def escape_markup(text) -> str:
    """`text` with rich markup escaped (error messages quote [shapes])."""
    return escape(str(text))


STATUS_COLORS = {"ok": "green", "failed": "red", "skipped": "yellow"}


def cell(col: str, v) -> str:
    """One result-table cell as rich markup (errors, ratios, status colors,
    notes escaped and cut at 80 characters)."""
    if col == "max_rel_err":
        return "-" if v is None or v != v else f"{v:.1e}"
    if col == "vs_torch_bf16":
        return fmt(v, 2)
    if col == "status":
        return f"[{STATUS_COLORS.get(v, 'white')}]{v}[/]"
    if col == "note":
        return escape_markup(str(v)[:80])
    return fmt(v)


def fmt(value, digits: int = 1) -> str:
    """`value` with `digits` decimals; a nonzero value below 10^(1-digits)
    keeps two significant digits instead (a CPU run's 0.024 GB/s, not 0.0;
    0.06 and 0.13 alike, not 0.1; below 1e-3 as 1.2e-05)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10.0 ** (1 - digits):
            if abs(value) < 1e-3:
                return f"{value:.1e}"
            short = f"{value:.2g}"
            if abs(float(short)) < 10.0 ** (1 - digits):  # 0.999 rounds to 1: the usual format then
                return short
        return f"{value:.{digits}f}"
    return str(value)


def summary_table(table_df) -> tuple[Table, str | None]:
    """The table of summary.summary_table(df)'s rows that were not skipped
    (columns holding one value in every row go to the title, empty ones go)
    and the line to print below it (None when no routed column is shown)."""
    columns = {"preset": "preset", "tp": "tp", "rows": "rows", "scenario": "scenario",
              "backend": "backend", "tactic": "tactic", "status": "status", "median_us": "µs",
              "gbps": "GB/s", "read_gbps": "read GB/s", "pct_copy_bw": "%copy", "pct_size_ceiling": "%ceil",
              "routed_us": "routed µs", "routed_pct_copy_bw": "routed %copy",
              "vs_torch_bf16": "×torch", "max_rel_err": "err", "note": "note"}  # fmt: skip
    constant = [c for c in ("preset", "tp", "scenario", "tactic")
                if len(table_df) and table_df[c].nunique(dropna=False) == 1]  # fmt: skip
    title = ", ".join(f"{c} {table_df[c].iloc[0]}" for c in constant) or None
    table = Table(title=title)
    empty = [c for c in ("pct_size_ceiling", "vs_torch_bf16", "note")
             if not table_df[c].replace("", None).notna().any()]  # fmt: skip
    shown = [c for c in columns if c in table_df.columns and c not in constant and c not in empty]
    for col in shown:
        table.add_column(
            columns[col], overflow="fold", no_wrap=col != "note", min_width=None if col == "note" else len(columns[col])
        )
    for rec in table_df.to_dict("records"):
        table.add_row(*(cell(col, rec[col]) for col in shown))
    note = None
    if "routed_us" in shown:
        note = (
            "routed = route + GEMM1 + GEMM2 without the finalize; each stage's time alone"
            " (kernel_<stage>_us) is in the report's summary.md"
        )
    return table, note


STEP_HEADS = {"preset": "preset", "tp": "tp", "ranks": "ranks", "rows": "rows", "scenario": "scenario",
              "unique_experts": "experts", "backend": "backend", "tactic": "tactic", "routing_path": "routing",
              "shared_path": "shared", "status": "status",
              "median_us": "step µs",
              "p10_us": "p10", "p90_us": "p90", "step_with_gate_us": "+gate µs", "gate_us": "gate",
              "allreduce_us": "all-red.", "allreduce_share_pct": "AR %", "stage_sum_us": "Σ stages",
              "gbps": "GB/s", "pct_copy_bw": "%copy", "vs_torch_bf16": "×torch", "max_rel_err": "err",
              "note": "note", "rank": "rank", "gpu_index": "GPU"}  # fmt: skip


#: Text columns of the step tables that, holding one message for every row, are said once below the table.
SAID_ONCE = {"shared_path": "shared expert", "note": "note"}


def frame_table(frame, title: str | None,
                constant_keys=("preset", "tp", "ranks", "scenario", "tactic", "routing_path"),
                ) -> tuple[Table, list[str]]:  # fmt: skip
    """A table of `frame` (columns named by STEP_HEADS or kernel_<s>_us ->
    <s>) and the lines to print below it: columns with one value everywhere
    move to the title (a SAID_ONCE message below the table), empty ones go."""

    def single(c):
        return c in frame.columns and len(frame) and frame[c].nunique(dropna=False) == 1

    constant = [c for c in constant_keys if single(c)]
    once = [c for c in SAID_ONCE if single(c) and str(frame[c].iloc[0])]
    head = ", ".join(f"{STEP_HEADS.get(c, c)} {frame[c].iloc[0]}" for c in constant)
    table = Table(title=", ".join(p for p in (title, head) if p) or None)
    shown = [c for c in frame.columns
             if c not in constant and c not in once and frame[c].replace("", None).notna().any()]  # fmt: skip
    for col in shown:
        name = STEP_HEADS.get(col) or str(col).removeprefix("kernel_").removesuffix("_us")
        table.add_column(name, overflow="fold", no_wrap=col != "note")
    for rec in frame.to_dict("records"):
        table.add_row(*(cell(col, rec[col]) for col in shown))
    return table, [f"{SAID_ONCE[c]} (every row): {escape_markup(frame[c].iloc[0])}" for c in once]


#: Columns that say which case (and rank) a row of a step table is: repeated in its stage-split table.
STEP_KEYS = ("preset", "tp", "ranks", "rows", "scenario", "backend", "tactic", "rank", "gpu_index")


def split_tables(frame, title: str, constant_keys=("preset", "tp", "ranks", "scenario", "tactic", "routing_path"),
                 ) -> list[tuple[Table, list[str]]]:  # fmt: skip
    """`frame` as two tables that each fit a normal terminal: the whole step
    (times, bandwidth, error), then its split into stages (Σ stages and
    kernel_<stage>_us, each stage timed alone) keyed by the same case
    columns; the columns the first table's title names are left out of the
    second. Returns frame_table's (table, lines below) of each."""
    stages = [c for c in frame.columns
              if c == "stage_sum_us" or (str(c).startswith("kernel_") and str(c).endswith("_us"))]  # fmt: skip
    tables = [frame_table(frame.drop(columns=stages), title, constant_keys)]
    if not any(frame[c].replace("", None).notna().any() for c in stages):
        return tables
    said = [c for c in constant_keys if c in frame.columns and len(frame) and frame[c].nunique(dropna=False) == 1]
    keys = [c for c in STEP_KEYS if c in frame.columns and c not in said]
    return [*tables, frame_table(frame[keys + stages], "stage split (µs, each stage timed alone)", constant_keys=())]


def comparison_table(comp) -> Table:
    """One row per case of a Comparison (reports.compare), its verdict colored."""
    colors = {"faster": "green", "slower": "red", "failed": "red", "lost": "red", "same": "white",
              "unclear": "yellow", "mismatch": "yellow", "fixed": "cyan"}  # fmt: skip
    table = Table(title=f"vs baseline (threshold {comp.threshold_pct:g} %)")
    for head in ("preset", "tp", "rows", "scenario", "backend", "tactic", "base µs", "µs", "ratio", "Δ%",
                 "noise%", "verdict", "note"):  # fmt: skip
        table.add_column(head, overflow="fold", no_wrap=head != "note")
    for r in comp.frame.to_dict("records"):
        color = colors.get(r["verdict"], "dim")
        table.add_row(
            str(r["preset"]), str(r["tp"]), str(r["rows"]), str(r["scenario"]), str(r["backend"]), str(r["tactic"]),
            fmt(r["base_median_us"]), fmt(r["median_us"]), fmt(r["ratio"], 3), fmt(r["delta_pct"]),
            fmt(r["noise_pct"]), f"[{color}]{r['verdict']}[/]", str(r["note"])[:80],
        )  # fmt: skip
    return table


def gains_table(records) -> Table:
    """Tuned vs built-in µs per (preset, family, TP, rows) of tuning_runner.gains records."""
    table = Table(
        title="tuned vs built-in default (µs per routed path: route + GEMM1 + GEMM2, timed side by side;"
        " GEMM1's candidates beside GEMM2's default, GEMM2's beside the tuned GEMM1; both: both defaults"
        " (GEMM1's pass) vs both tuned (GEMM2's pass), est.: estimated from the two ratios; gain > 0: tuned"
        " is faster)"
    )
    for head in ("preset", "family", "TP", "rows", "GEMM1 default", "GEMM1 tuned", "gain", "GEMM2 default", "GEMM2 tuned",
                 "gain", "both default", "both tuned", "gain µs", "gain %"):  # fmt: skip
        table.add_column(head)

    def pct(g) -> str:
        return "-" if g.get("gain_pct") is None else f"{g['gain_pct']:+.1f}%"

    for r in records:
        g1, g2, b = r["gemm1"], r["gemm2"], r["both"]
        table.add_row(
            r["preset"], r.get("family", "BF16"), str(r["tp"]), str(r["rows"]), fmt(g1["default_us"], 2), fmt(g1["tuned_us"], 2), pct(g1),
            fmt(g2["default_us"], 2), fmt(g2["tuned_us"], 2), pct(g2), fmt(b["default_us"], 2),
            fmt(b["tuned_us"], 2) + (" (est.)" if b.get("estimated") and b["tuned_us"] is not None else ""),
            "-" if b["gain_us"] is None else f"{b['gain_us']:+.2f}", pct(b),
        )  # fmt: skip
    return table


def families_table(families, target) -> Table:
    """The kernel family each tuned shape class runs by default (family.default_families)."""
    table = Table(title=f"what `moebench` runs by default now (one kernel family per layer; the tables of {target}"
                        " first, then $MOEBENCH_TUNING_DIR and the package's): per rows the faster family by the"
                        " tables' routed-path µs")  # fmt: skip
    for head in ("shape", "runs", "rows: faster family (BF16 / FP8 µs)", "why"):
        table.add_column(head)
    for label, choice in families:
        per_rows = ", ".join(f"{t.rows}: {t.faster} ({fmt(t.bf16_us)} / {fmt(t.fp8_us)})"
                             for t in choice.times if t.faster)  # fmt: skip
        table.add_row(label, choice.family, per_rows or "-", f"{choice.source}: {choice.reason}")
    return table


def picks_tables(outcome, label: str = "") -> list[Table]:
    """One table per (TP, GEMM stage) of a TuneOutcome: each row count's pick,
    its timing, the built-in default's, the runner-up and the rejected count."""
    prefix = f"{label} " if label else ""
    tables = []
    for (tp, stage), result in outcome.results.items():
        table = Table(
            title=f"{prefix}TP{tp} {STAGE_LABELS[stage]} ({outcome.layers.get((tp, stage), '?')} weight sets)"
        )
        for head in ("rows", "tactic", "µs", "p10-p90", "default µs", "runner-up", "margin", "separated", "rejected",
                     "note"):  # fmt: skip
            table.add_column(head)
        for rows, res in result.results.items():
            e = res.entry
            if e is None:
                table.add_row(str(rows), "[red]none correct[/red]", "", "", "", "", "", "", str(len(res.rejected)),
                              "")  # fmt: skip
                continue
            base = res.baseline
            table.add_row(
                str(rows), e.tactic.name, fmt(e.median_us, 2), f"{e.p10_us:.2f}-{e.p90_us:.2f}",
                "-" if base is None else fmt(base.median_us, 2),
                e.runner_up.name if e.runner_up else "-", fmt(e.margin_pct) + "%" if e.margin_pct is not None else "-",
                "yes" if e.separated else "[yellow]no[/yellow]", str(len(res.rejected)), res.note,
            )  # fmt: skip
        tables.append(table)
    return tables


def presets_tables() -> tuple[Table, Table]:
    """The geometry presets, and one rank's shape per TP degree of each."""
    from moebench.models import PRESETS

    table = Table(title="presets")
    for head in ("preset", "H", "I", "E", "top_k", "shared", "scale", "swiglu limit"):
        table.add_column(head)
    for cfg in PRESETS.values():
        table.add_row(
            cfg.name, str(cfg.hidden), str(cfg.intermediate), str(cfg.experts), str(cfg.top_k),
            str(cfg.shared_experts), f"{cfg.routed_scaling_factor:g}", f"{cfg.swiglu_limit:g}",
        )  # fmt: skip
    shapes = Table(title="one rank's shape (MXFP4 weights + scales, logical bytes)")
    for head in ("preset", "TP", "I/tp", "padded", "MB / expert", "MB / top_k experts", "GB / rank"):
        shapes.add_column(head)
    for cfg in PRESETS.values():
        for t in (1, 2, 4, 8):
            try:
                s = cfg.shard(t)
            except ValueError as error:
                shapes.add_row(cfg.name, str(t), "-", "-", str(error), "", "")
                continue
            eb = s.expert_bytes()
            shapes.add_row(
                cfg.name, str(t), str(s.intermediate), str(s.padded_intermediate), f"{eb / 1e6:.2f}",
                f"{eb * s.top_k / 1e6:.1f}", f"{eb * s.experts / 1e9:.2f}",
            )  # fmt: skip
    return table, shapes


def environment_tables(info: dict, bandwidth_gbps: float | None, backends: dict) -> tuple[Table, Table]:
    """env.environment(dev)'s device, versions and commit (and the copy
    bandwidth measured, when given), then each backend's availability
    ({name: None or the reason it is not available})."""
    d = info["device"]
    table = Table(show_header=False, title="environment")
    table.add_column("key", style="bold")
    table.add_column("value")
    table.add_row("device", f"{d['name']} ({d['kind']})")
    if d["kind"] == "cuda":
        table.add_row("compute capability", str(d["capability"]))
        table.add_row("SMs", str(d["sm_count"]))
        table.add_row("L2", f"{(d['l2_bytes'] or 0) / 2**20:.0f} MiB")
        table.add_row("memory", f"{(d['memory_bytes'] or 0) / 2**30:.1f} GiB")
        table.add_row("driver", str(d["driver"] or "-"))
        table.add_row("CUDA runtime (torch)", str(info["cuda_runtime"] or "-"))
    else:
        table.add_row("cores", str(d["sm_count"]))
    table.add_row("python", info["python"])
    for name, version in info["packages"].items():
        table.add_row(name, version or "[dim]not installed[/dim]")
    table.add_row("commit", info["commit"] or "-")
    if bandwidth_gbps is not None:
        table.add_row("copy bandwidth", f"{bandwidth_gbps:.1f} GB/s (1 GiB D2D, read + write)")
    status = Table(title="backends")
    status.add_column("backend")
    status.add_column("status")
    for name, reason in backends.items():
        status.add_row(name, "[green]available[/green]" if reason is None else f"[yellow]{reason}[/yellow]")
    return table, status


def check_table(device, results, skipped: dict) -> Table:
    """selfcheck.run_checks' results (pass / FAIL and the detail) and the
    backends skipped on `device` ({name: reason})."""
    table = Table(title=f"moebench check ({device})")
    table.add_column("item")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for r in results:
        table.add_row(r.name, "[green]pass[/green]" if r.ok else "[red]FAIL[/red]", r.detail)
    for name, reason in skipped.items():
        table.add_row(f"backend {name}", "[yellow]skipped[/yellow]", reason)
    return table
