"""The printing of what the library returns to the command line, for the
verbs that take more than a line or two to render it (report's comparison
and files, tune's tables and gains): the tables come from
reports/rich_tables.py, the consoles from cli_support.py. Only the CLI
calls this module.
"""

from __future__ import annotations

from pathlib import Path

from moebench.cli_support import console, wide_console
from moebench.reports import rich_tables


def print_comparison(comp) -> None:
    """Render a reports.compare.Comparison: mismatches / notes, then one row
    per case and the verdict counts (its errors are the report's exit
    message, printed once, last)."""
    from moebench.reports.compare import within_threshold_note

    for m in comp.mismatches:
        console.print(f"[yellow]mismatch: {m}[/yellow]", soft_wrap=True)
    for n in comp.notes:
        console.print(f"[dim]note: {n}[/dim]", soft_wrap=True)
    wide_console(150).print(rich_tables.comparison_table(comp))
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
        wide_console(150).print(table)
    for s in saved:
        console.print(f"wrote [bold]{s.path}[/bold] ({len(s.table.entries)} BF16 + {len(s.table.fp8_entries)} FP8"
                      " entries)")  # fmt: skip


def print_tune_run(run, target: Path) -> None:
    """The end of a tune (a tuning.save.TuneRun): what tuning buys over the
    built-in tactics, the kernel family each shape class tuned now runs
    (from the tables in `target` first), the summary files, the time taken."""
    if run.records:
        wide_console(150).print(rich_tables.gains_table(run.records))
    if run.families:
        wide_console(150).print(rich_tables.families_table(run.families, target))
    if run.summary_files is not None:
        md, js = run.summary_files
        console.print(f"wrote [bold]{md}[/bold] and [bold]{js}[/bold]")
    print_tune_log(run.seconds, f"done in {run.seconds:.0f} s")
