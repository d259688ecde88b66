"""The plan of `moebench report`: the run (and a baseline) read and
checked, the comparison made, the tables computed and the report's files
named, all before anything is printed or written; then what goes into
summary.md and report.html, and the writing of them (write_report).
Raises ValueError / FileNotFoundError naming the argument, ReportNotWritten
when the files cannot be written; prints nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moebench.reports import outdir


@dataclass(frozen=True)
class ReportPlan:
    """A checked report: the run (df, manifest, ranks table or None) and its
    tables (summary; step_table of a step run, else None); the comparison
    with the baseline (else None) at `threshold` percent, `gated` when
    --fail-above was given; `out` and how to name it (`where`); the files
    it writes (`written`, summary.md first) and those already there
    (`taken`, replaced only with --force)."""

    run_dir: Path
    df: object
    manifest: dict
    ranks: object
    step_run: bool
    summary: object
    step_table: object
    comparison: object
    threshold: float
    gated: bool
    out: Path
    where: str
    written: list[Path]
    taken: list[Path]

    @property
    def target(self) -> Path:
        """summary.md's path."""
        return self.written[0]


def plan_report(run_dir: Path, *, baseline: Path | None = None, fail_above: str | None = None,
                out: Path | None = None, html: bool = True, force: bool = False) -> ReportPlan:  # fmt: skip
    """Check and read everything `report` needs (its errors first for
    --fail-above, --out, RUN_DIR, then --baseline), compare with `baseline`
    and name the files to write (by default in RUN_DIR's sibling
    <run>-report/). Raises FileNotFoundError / ValueError naming the
    argument, also when report files are there already and not `force`."""
    from moebench.reports.compare import DEFAULT_THRESHOLD_PCT, compare_runs, parse_threshold
    from moebench.reports.html import report_files
    from moebench.reports.store import read_table
    from moebench.reports.summary import is_step_run, step_summary_table, summary_table

    threshold = parse_threshold(fail_above) if fail_above is not None else DEFAULT_THRESHOLD_PCT
    if fail_above is not None and baseline is None:
        raise ValueError("--fail-above needs --baseline RUN")
    where = "--out" if out is not None else "the default report directory (RUN_DIR's sibling)"
    if out is not None:
        outdir.check_out_dir(out, run_dir)
    df, manifest = outdir.read_report_run(run_dir, "RUN_DIR")
    if out is None:  # only once RUN_DIR is known to be a run: its errors come first
        out = outdir.default_report_dir(run_dir)
        outdir.check_out_dir(out, run_dir, where)
    ranks = read_table(run_dir, "ranks")
    if ranks is not None and "rank" not in ranks.columns:
        raise ValueError(f"RUN_DIR: {run_dir / 'ranks.parquet'} lacks the 'rank' column")
    step_run = is_step_run(df, manifest)
    try:  # the tables printed below: a run lacking their columns fails here, before any output
        summary = summary_table(df)
        step_table = step_summary_table(df) if step_run else None
    except ValueError as error:
        raise ValueError(f"RUN_DIR: {run_dir}: {error}") from None
    base = outdir.read_report_run(baseline, "--baseline") if baseline is not None else None
    comparison = None
    if base is not None:
        comparison = compare_runs(df, manifest, base[0], base[1], threshold_pct=threshold,
                                  current_label=str(run_dir), baseline_label=str(baseline))  # fmt: skip
    target = out / "summary.md"
    written = [target, *(target.parent / n for n in report_files(df, comparison))] if html else [target]
    taken = [p for p in written if p.exists() or p.is_symlink()]
    if taken and not force:
        raise ValueError(f"{where}: {', '.join(map(str, taken))} exist{'s' if len(taken) == 1 else ''}; pass --force"
                         " to replace the report files, or give another --out directory")  # fmt: skip
    return ReportPlan(run_dir, df, manifest, ranks, step_run, summary, step_table, comparison, threshold,
                      fail_above is not None, out, where, written, taken)  # fmt: skip


def report_markdown(plan: ReportPlan) -> str:
    """summary.md's text: the run's summary, then the comparison's."""
    from moebench.reports.compare import comparison_markdown
    from moebench.reports.summary import to_markdown

    text = to_markdown(plan.df, plan.manifest, plan.ranks)
    if plan.comparison is not None:
        text += "\n" + comparison_markdown(plan.comparison)
    return text


def write_report_html(plan: ReportPlan, into: Path | None = None) -> list[Path]:
    """Write report.html and its plots into `into` (default: summary.md's
    directory), with the step, per-rank and kernel-tactics tables that
    apply; returns the paths written, report.html first. Raises OSError."""
    from moebench.reports.html import write_html_report
    from moebench.reports.summary import KERNEL_TACTICS_TITLE, kernel_tactics_table, rank_table

    tables = {}
    if plan.step_run:
        tables["Decode step (µs; the step excludes the gate)"] = plan.step_table
        if plan.ranks is not None and len(plan.ranks):
            tables["Per rank (µs)"] = rank_table(plan.ranks)
    kt = kernel_tactics_table(plan.df)
    if len(kt):
        tables[KERNEL_TACTICS_TITLE] = kt
    return write_html_report(plan.df, plan.manifest, plan.target.parent if into is None else into,
                             comparison=plan.comparison, title=f"moebench run {plan.run_dir.name}",
                             tables=tables)  # fmt: skip


@dataclass
class ReportFiles:
    """What write_report wrote: summary.md (None until written); with
    --no-html and no --force, whose the report.html left in its directory is
    (`stale_html`: "an earlier report's" / "not this report's", else None);
    report.html and its plots (report.html first); the names of an earlier
    report's files removed (--force)."""

    target: Path | None = None
    stale_html: str | None = None
    html: list[Path] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class ReportNotWritten(Exception):
    """A report that could not be (wholly) written: the message, the exit
    code (2, a usage error, when its directory cannot be created; 1 when a
    file cannot be written or replaced) and the files written before it
    (`done`, a ReportFiles)."""

    def __init__(self, message: str, code: int, done: ReportFiles) -> None:
        super().__init__(message)
        self.code, self.done = code, done


class ReportInterrupted(KeyboardInterrupt):
    """write_report stopped by Ctrl-C (or SIGTERM taken as one): the files
    that had landed in the report's directory before it (`done`, a
    ReportFiles; none unless the interrupt came while they were moved)."""

    def __init__(self, done: ReportFiles) -> None:
        super().__init__()
        self.done = done


#: The prefix of the folder, inside the report's directory, that a report is written into before its files
#: are moved into place (removed at the end, also after a failure or an interrupt).
STAGING_PREFIX = ".moebench-report-"


def write_report(plan: ReportPlan, *, html: bool = True, force: bool = False,
                 before_writing: Callable[[], None] | None = None) -> ReportFiles:  # fmt: skip
    """Write the planned report: make its directory, replace the links among
    the files it replaces (--force; never the files they point to), call
    `before_writing()` (every check passed, no file written yet), then write
    summary.md, report.html and its plots when `html` and the record of the
    files (outdir.REPORT_RECORD) into a staging folder inside it, move them
    into place (summary.md first) and remove what an earlier report wrote
    there and this one does not (`force`). An interrupt (KeyboardInterrupt)
    or failure before the move leaves the directory as it was: the staging
    folder is removed, and so are the directories this call created, so
    that a rerun is not refused for a partial report. Raises
    ReportNotWritten, or ReportInterrupted on a KeyboardInterrupt."""
    done = ReportFiles()
    out, target = plan.out, plan.target
    created = [d for d in (out, *out.parents) if not d.exists() and not d.is_symlink()]
    try:  # a report that cannot be written is not a verdict: before any output
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ReportNotWritten(f"{plan.where}: cannot create {out}: {error.strerror or error}", 2, done) from None
    stage = None
    try:
        earlier = outdir.report_record(out)  # the files an earlier report wrote there (read before this one)
        _unlink_links(plan.taken, done)
        if before_writing is not None:
            before_writing()
        stale = out / "report.html"
        if not html and not force and stale.exists():
            done.stale_html = "an earlier report's" if "report.html" in earlier else "not this report's"
        stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        _write_staged(plan, stage, html, done)
        if force:
            done.removed = outdir.remove_stale_report_files(out, [target, *done.html], earlier)
    except OSError as error:  # exit 1, as docs/ci.md says: not a usage error
        _remove_staging(stage, created if done.target is None else [])
        raise ReportNotWritten(f"cannot write the report under {out}: {error}", 1, done) from None
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: nothing half-written stays behind
        _remove_staging(stage, created if done.target is None else [])
        raise ReportInterrupted(done) from None
    _remove_staging(stage, [])
    return done


def _unlink_links(taken: list[Path], done: ReportFiles) -> None:
    """Unlink the links among the files a --force report replaces (never the files they point to)."""
    for path in taken:
        try:
            if path.is_symlink():
                path.unlink()
        except OSError as error:
            raise ReportNotWritten(f"cannot replace the link {path}: {error}", 1, done) from None


def _write_staged(plan: ReportPlan, stage: Path, html: bool, done: ReportFiles) -> None:
    """Write the report's files into `stage`, then move them into plan.out
    (summary.md first, the record last), filling in `done` as each lands.
    Raises OSError."""
    (stage / plan.target.name).write_text(report_markdown(plan), encoding="utf-8")
    pages = write_report_html(plan, stage) if html else []
    outdir.write_report_record(stage, [plan.target, *pages])
    os.replace(stage / plan.target.name, plan.target)
    done.target = plan.target
    for page in pages:
        os.replace(page, plan.out / page.name)
        done.html.append(plan.out / page.name)
    os.replace(stage / outdir.REPORT_RECORD, plan.out / outdir.REPORT_RECORD)


def _remove_staging(stage: Path | None, created: list[Path]) -> None:
    """Remove the staging folder, then the directories in `created` (deepest
    first) where they are empty. Never raises."""
    if stage is not None:
        shutil.rmtree(stage, ignore_errors=True)
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()
