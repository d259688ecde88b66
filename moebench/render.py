"""The printing of what the library returns to the command line, for the
verbs that take more than a line or two to render it (sweep's and step's
tables, report's comparison and files, tune's tables and gains): the tables come from
reports/rich_tables.py, the consoles from cli_support.py. Only the CLI
calls this module.
"""

from __future__ import annotations

from pathlib import Path

from moebench.cli_support import console, wide_console
from moebench.reports import rich_tables
from moebench.reports.rich_tables import escape_markup


def print_comparison(comp) -> None:
    """Render a reports.compare.Comparison: mismatches / notes, then one row
    per case and the verdict counts (its errors are the report's exit
    message, printed once, last)."""
    from moebench.reports.compare import within_threshold_note

    for m in comp.mismatches:
        console.print(f"[yellow]mismatch: {m}[/yellow]", soft_wrap=True)
    for n in comp.notes:
        console.print(f"[dim]note: {n}[/dim]", soft_wrap=True)
    table = rich_tables.comparison_table(comp)
    wide_console(150, table).print(table)
    console.print("verdicts: " + (", ".join(f"{n} {v}" for v, n in comp.counts.items()) or "none"))
    within = within_threshold_note(comp)
    if within and not comp.errors:
        console.print("no regression:" + within, soft_wrap=True)
    if comp.unclear_note and not len(comp.regressions) and not comp.errors:  # an all-unclear error says it already
        console.print(f"[yellow]{comp.unclear_note}[/yellow]", soft_wrap=True)


def print_report_files(files) -> None:
    """Say what reports.report.write_report wrote (a ReportFiles, whole or
    up to a failure): summary.md, a report.html left as it was, report.html
    with its plots, the earlier report's files removed."""
    if files.target is None:
        return
    console.print(f"wrote [bold]{files.target}[/bold]")
    where = files.target.parent
    if files.stale_html is not None:
        console.print(f"[yellow]{where / 'report.html'} is {files.stale_html} (--no-html leaves it as it is)[/yellow]")
    if files.html:
        plots = f"{len(files.html) - 1} plots" if len(files.html) > 1 else "no plots: no case was timed or failed"
        console.print(f"wrote [bold]{files.html[0]}[/bold] ({plots})")
    if files.removed:
        console.print(f"removed {', '.join(files.removed)} from {where} (an earlier report's; this one"
                      f" does not write {'it' if len(files.removed) == 1 else 'them'})")  # fmt: skip


def print_tune_log(seconds: float, text: str) -> None:
    """One log line of a tune, after the seconds since its start."""
    console.print(f"[dim][{seconds:6.1f} s][/dim] {text}", soft_wrap=True)


def print_tuned(config, outcome, saved) -> None:
    """One tuned config (tuning.save.tune_and_save's on_saved): each table's
    picks, then each table written and what it holds."""
    for table in rich_tables.picks_tables(outcome, f"{config.preset} {config.family}"):
        wide_console(150, table).print(table)
    for s in saved:
        fused = sum(e.tactic.fused is not None for e in s.table.fused_entries.values())
        layer = f", fp8.fused: {fused} of {len(s.table.fused_entries)} rows fused" if s.table.fused_entries else ""
        console.print(f"wrote [bold]{s.path}[/bold] ({len(s.table.entries)} BF16 + {len(s.table.fp8_entries)} FP8"
                      f" entries{layer})")  # fmt: skip


def print_tune_run(run, target: Path) -> None:
    """The end of a tune (a tuning.save.TuneRun): what tuning buys over the
    built-in tactics, the kernel family each shape class tuned now runs
    (from the tables in `target` first), the summary files, the time taken;
    on a torchrun rank other than 0, one line saying rank 0 writes them."""
    if getattr(run, "rank", 0) > 0:
        console.print(f"rank {run.rank} of {run.world}: tuned its share; rank 0 writes the tables")
        return
    for table in ([rich_tables.gains_table(run.records)] if run.records else []) + (
        [rich_tables.families_table(run.families, target)] if run.families else []
    ):
        wide_console(150, table).print(table)
    if run.summary_files is not None:
        md, js = run.summary_files
        console.print(f"wrote [bold]{md}[/bold] and [bold]{js}[/bold]")
    print_tune_log(run.seconds, f"done in {run.seconds:.0f} s")


def print_summary(table_df) -> None:
    """Render summary_table(df) with rich; columns that hold one value for
    every row (preset, tp, scenario, tactic) move into the title; skipped
    rows are said below it, one line per backend and reason."""
    skipped = table_df[table_df["status"] == "skipped"]
    table_df = table_df[table_df["status"] != "skipped"]
    if len(table_df):
        table, note = rich_tables.summary_table(table_df)
        out = wide_console(150, table)  # wide enough for the table even when stdout is not a terminal (logs, CI)
        out.print(table)
        if note:
            out.print(note)
    print_skipped(skipped)


def print_skipped(skipped) -> None:
    """The skipped rows of a summary or step table (a frame with backend,
    note and status columns), one line per backend and reason, not a row
    per case each repeating the reason."""
    for (backend, reason), group in skipped.groupby(["backend", "note"], sort=False, dropna=False):
        n = len(group)
        console.print(f"[yellow]skipped[/yellow] {escape_markup(backend)} ({n} case{'s' if n != 1 else ''}):"
                      f" {escape_markup(reason)}", soft_wrap=True)  # fmt: skip


STEP_TABLE_WIDTH = 160


def print_tables(tables, width: int = STEP_TABLE_WIDTH) -> None:
    """Print rich_tables' (table, lines below) pairs, wide enough that no
    number is cut when stdout is not a terminal (a terminal folds at its width)."""
    for table, lines in tables:
        out = wide_console(width, table)  # as wide as the table: no cell cut
        out.print(table)
        for line in lines:
            out.print(line, soft_wrap=True)


def print_step(frame, ranks=None, table=None) -> None:
    """The step table (whole step, gate, all-reduce; then the per-stage
    split; `table`: step_summary_table(frame) when the caller has it) and,
    for a TP step, the per-rank tables."""
    from moebench.reports.summary import rank_table, step_summary_table

    table = step_summary_table(frame) if table is None else table
    table = table.drop(columns=["p10_us", "p90_us"])  # in summary.md / report.html
    skipped = table[table["status"] == "skipped"]  # said once per backend and reason below, not a row per case
    table = table[table["status"] != "skipped"].reset_index(drop=True)
    title = "decode step (µs; the step excludes the gate)"
    if ranks is not None and len(ranks) and ranks["rank"].nunique() > 1:
        title = "decode step (µs, rank 0's timings: every rank below; the step excludes the gate)"
    if len(table):
        print_tables(rich_tables.split_tables(table, title))
    print_skipped(skipped)
    if ranks is not None and len(ranks):
        print_tables(
            rich_tables.split_tables(rank_table(ranks), "per rank (µs)", constant_keys=("preset", "scenario", "tactic"))
        )
    if "timing_method" in frame.columns and (frame["timing_method"].astype(str) == "cpu-wallclock").any():
        console.print(
            "[yellow]CPU wall-clock timings: each column is timed on its own and they are noisy, so they"
            " need not add up (step vs +gate, Σ stages vs step).[/yellow]",
            soft_wrap=True,
        )


def print_stored(manifest: dict, path) -> None:
    """After a run is stored at `path`: each launched worker's line (GPU or
    rank, rows, its error, interrupted), then where the run is."""
    for w in manifest.get("workers") or [] if manifest.get("sharded") else ():
        where = (f"GPU {w['gpu_index']} ({w.get('gpu_serial') or 'serial unknown'})" if w.get("gpu_index") is not None
                 else f"rank {w['rank']} ({w.get('host') or 'host unknown'})")  # fmt: skip
        console.print(
            f"  {where}: {w['rows']} rows"
            + (f" [red]{escape_markup(w['error'])}[/red]" if w.get("error") else "")
            + ("; [yellow]interrupted[/yellow]" if w.get("status") == "interrupted" else "")
        )
    console.print(f"run stored in [bold]{path}[/bold]")


def print_peer_failures(verdict, path, strict: bool) -> None:
    """The peers' failed cases of a `reports.gate.RunVerdict` (none: nothing)."""
    if not verdict.peers:
        return
    console.print(f"[yellow]{verdict.peers} peer case(s) failed (stored as failed in {escape_markup(path)}; not"
                  f" ours: {'--strict fails the command on them' if strict else 'pass --strict to fail on them'}"
                  "):[/yellow]")  # fmt: skip
    for line in verdict.peer_lines:
        console.print(f"  {escape_markup(line)}", soft_wrap=True)
