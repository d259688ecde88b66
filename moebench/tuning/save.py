"""Saving what `moebench tune` found: each tuned table written into the
tables directory, merged over an older table of the same device there (the
other kernel family's entries and the rows not re-tuned stay), and the row
counts no tactic passed for. Returns what was written and the problems;
nothing here prints. Also the whole of `moebench tune` after its options are
checked: check_tune_targets (the GPU and the directories, before minutes of
tuning) and tune_and_save (tune, save each table as it is tuned, the gains).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moebench.kernels.table import STAGE_LABELS, TableError, TuningTable, read_table
from moebench.tuning.table import write_table


@dataclass(frozen=True)
class SavedTable:
    """A table written: where, and what it holds after the merge."""

    path: Path
    table: TuningTable

    def key(self) -> tuple:
        """(device name, shape class, SMs): what family.default_families takes."""
        return self.table.device["name"], self.table.shape, int(self.table.device.get("sm_count") or 132)


def untuned_rows(outcome, label: str = "") -> list[str]:
    """'<label> TP<tp> GEMM<stage> rows=<rows>' of each row count of a
    TuneOutcome for which no tactic was correct."""
    prefix = f"{label} " if label else ""
    return [f"{prefix}TP{tp} {STAGE_LABELS[stage]} rows={rows}" for (tp, stage), result in outcome.results.items()
            for rows, res in result.results.items() if res.entry is None]  # fmt: skip


def save_tables(outcome, target: str | Path, force: bool = False, label: str = "",
                ) -> tuple[list[SavedTable], list[str]]:  # fmt: skip
    """Write each of a TuneOutcome's tables that holds entries into `target`,
    merged over the table of the same name there when it reads (else
    write_table refuses it, or with `force` replaces it, with the reason).
    Returns (the tables written, in order; the problems: one message per
    table that could not be written, then one naming the row counts with no
    correct tactic (untuned_rows, `label` first), when any)."""
    saved, problems = write_tables(outcome.tables, target, force)
    failed = untuned_rows(outcome, label)
    if failed:
        problems.append(f"no correct tactic for {', '.join(failed)}")
    return saved, problems


def write_tables(tables, target: str | Path, force: bool = False) -> tuple[list[SavedTable], list[str]]:
    """Write each of `tables` (TuningTables) that holds entries into `target`
    as save_tables does; (the tables written, one problem per table not)."""
    target = Path(target)
    saved, problems = [], []
    for t in tables:
        if not t.has_entries:
            continue
        path = target / t.file_name
        try:
            if path.exists():
                try:
                    t = t.merged_over(read_table(path))
                except (TableError, OSError):
                    pass  # write_table refuses (or force replaces) it with the reason
            saved.append(SavedTable(write_table(t, target, force=force), t))
        except (TableError, OSError) as error:
            problems.append(str(error))
    return saved, problems


def merge_tables(tables) -> tuple[list[TuningTable], list[str]]:
    """One table per file name of `tables` (TuningTables in tuning order): a
    later table merged over the earlier ones of its name (merged_over: its
    entries win, as when one process writes them in turn). A table of
    another device (raw name or SM count) than the first of its name is
    refused as write_table refuses it: left out, one problem line each.
    Returns (the merged tables, in first-seen order; the problems)."""
    merged: dict[str, TuningTable] = {}
    problems = []
    for t in tables:
        old = merged.get(t.file_name)
        if old is None:
            merged[t.file_name] = t
            continue
        if old.device.get("sm_count") != t.device.get("sm_count"):
            problems.append(
                f"{t.file_name}: tuned on {old.device.get('name')} ({old.device.get('sm_count')} SMs)"
                f" and on {t.device.get('name')} ({t.device.get('sm_count')} SMs); the second left out"
            )
            continue
        try:
            merged[t.file_name] = t.merged_over(old)
        except TableError as error:
            problems.append(f"{t.file_name}: {error}; the second left out")
    return list(merged.values()), problems


def tables_dir(out: str | Path | None) -> Path:
    """Where `moebench tune` writes its tables: `out` (--out), else the first
    directory of $MOEBENCH_TUNING_DIR, else ./tuning-tables."""
    if out is not None:
        return Path(out)
    return Path(os.environ.get("MOEBENCH_TUNING_DIR", "").split(os.pathsep)[0] or "tuning-tables")


def write_gains_summary(summary: str | Path, records: list[dict], families: list, target: str | Path,
                        ) -> tuple[Path, Path]:  # fmt: skip
    """Write the tuned-vs-default gains (runner.gains records) to `summary`
    as markdown, with the kernel family each tuned shape class now runs
    (family.default_families over the tables of `target`), and the records
    beside it as .json. Returns both paths; raises OSError."""
    from moebench.tuning.family import family_markdown
    from moebench.tuning.runner import gains_markdown

    summary = Path(summary)
    summary.parent.mkdir(parents=True, exist_ok=True)
    text = gains_markdown(records)
    if families:
        text += (
            f"\n## What `moebench` runs by default (the tables of {target} first, then"
            f" $MOEBENCH_TUNING_DIR and the package's)\n\n{family_markdown(families)}"
        )
    summary.write_text(text, encoding="utf-8")
    summary.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return summary, summary.with_suffix(".json")


def check_tune_targets(plan, out: str | Path | None = None, summary: str | Path | None = None, *,
                       force: bool = False) -> Path:  # fmt: skip
    """Before minutes of tuning: the GPU (runner.require_tuning_device of the
    plan's device: RuntimeError saying what is missing), then the tables
    directory (tables_dir(out)) and --summary's directory, which must take
    files and lie outside every stored run, and the summary's files (the markdown and the .json beside it),
    which must not exist unless `force` (an earlier tune's gains are not
    replaced without a word) (ValueError naming --out / --summary; on a
    torchrun rank other than 0, which writes nothing, not checked). Returns
    the tables directory."""
    from moebench.reports.outdir import check_out
    from moebench.tuning import runner

    from moebench.bench.launch import under_torchrun

    runner.require_tuning_device(plan.settings.get("device"))
    target = tables_dir(out)
    if under_torchrun() and int(os.environ["RANK"]) > 0:
        return target  # only rank 0 writes: another host's --out need not exist
    check_out(target, runs=True)  # never among a stored run's files, as report's --out
    if summary is not None:
        check_out(Path(summary).parent, "--summary", runs=True)
        there = [str(p) for p in (Path(summary), Path(summary).with_suffix(".json")) if p.exists() or p.is_symlink()]
        if there and not force:
            raise ValueError(f"--summary: {' and '.join(there)} exist (an earlier tune's gains?); give another"
                             " --summary, or pass --force to replace them")  # fmt: skip
    return target


def is_log_line(text: str) -> bool:
    """Whether a run_tune progress line is worth a log line: one per stage
    and shape (weights, compiling), not one per tactic."""
    return text.endswith("preparing weights") or text.startswith("compiling") or "kernels submitted" in text


@dataclass(frozen=True)
class TuneRun:
    """What tune_and_save did: the tuned-vs-default gains (runner.gains
    records at runner.GAIN_ROWS); the kernel family each shape class tuned
    now runs by default (family.default_families); the summary files
    written (markdown, .json) or None; the problems (a table not written, a
    row with no correct tactic, the summary not written, what the budget
    left out, a torchrun rank's config not tuned: the command fails on any);
    the seconds it took; on a torchrun rank other than 0 (which tunes its
    share and writes nothing: the rest empty) `rank` and `world` say which."""

    records: list[dict]
    families: list
    summary_files: tuple[Path, Path] | None
    problems: list[str]
    seconds: float
    rank: int = 0
    world: int = 1


def tune_and_save(plan, target: str | Path, *, force: bool = False, summary: str | Path | None = None,
                  budget: float | None = None, jobs: int | None = None,
                  progress: Callable[[float, str], None] | None = None,
                  on_saved: Callable[[object, object, list[SavedTable]], None] | None = None,
                  ) -> TuneRun:  # fmt: skip
    """Tune every config of `plan` (a plan.TunePlan; `target` from
    check_tune_targets) under one wall-time `budget` with `jobs` compiling
    workers (default: precompile.default_jobs()), and save each config's
    tables into `target` as soon as it is tuned (save_tables, merged over
    the older ones; `force` replaces another device's). `progress(seconds,
    text)` gets the log lines (seconds since the start), `on_saved(config,
    outcome, saved tables)` each config once its tables are written. Then
    the gains, the default families and, with `summary`, the gains summary
    (write_gains_summary).

    Under torchrun (one rank of several) every rank tunes its share of the
    configs on its GPU, each under its own `budget` (tuning/share.py), and
    rank 0 gathers them, merges the tables of one shape class
    (merge_tables), writes each once, then the gains of every config as one
    process gives them; a config a rank did not deliver (it died, or was
    interrupted) is a problem naming it and why. Another rank returns a
    TuneRun saying which it is."""
    from moebench.bench.launch import under_torchrun
    from moebench.tuning import runner
    from moebench.tuning.family import default_families
    from moebench.tuning.precompile import default_jobs

    target = Path(target)
    plan = plan.writing_to(target)  # the pair-or-fused step decides against the pair the tables will hold
    clock = runner.Budget(budget)
    say = (lambda text: progress(clock.elapsed(), text)) if progress is not None else (lambda text: None)
    log = lambda text: say(text) if is_log_line(text) else None  # noqa: E731
    problems: list[str] = []
    written: list = []  # (device name, shape class, SMs) of each table written

    def finished(config, outcome, saved, table_problems) -> None:
        for (t, stage), secs in outcome.seconds.items():
            tuned = len(outcome.results[t, stage].entries)
            say(f"{config.preset} TP{t} {config.family} {STAGE_LABELS[stage]}: {tuned} rows tuned in {secs:.1f} s"
                f" ({outcome.layers[t, stage]} weight sets)")  # fmt: skip
        written.extend(s.key() for s in saved)
        if on_saved is not None:
            on_saved(config, outcome, saved)
        problems.extend(table_problems)

    if under_torchrun():
        done = _tune_ranks(plan, target, force, budget, jobs, log, finished, problems)
        if done is None:
            return TuneRun([], [], None, [], clock.elapsed(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:

        def save(config, outcome) -> None:
            finished(config, outcome, *save_tables(outcome, target, force, f"{config.preset} {config.family}"))

        done = runner.tune_many(plan.configs(), budget=clock, jobs=default_jobs() if jobs is None else jobs,
                                progress=log, on_outcome=save)  # fmt: skip
    records = runner.gains(done, runner.GAIN_ROWS)
    families = default_families(written, target)
    files = None
    if summary is not None:
        try:
            files = write_gains_summary(summary, records, families, target)
        except OSError as error:
            problems.append(f"cannot write {summary}: {error}")
    stopped = [line for _, o in done for line in o.stopped]
    if stopped:
        problems.append(f"the --budget of {budget:g} s left out: " + "; ".join(stopped))
    return TuneRun(records, families, files, problems, clock.elapsed(), 0, int(os.environ.get("WORLD_SIZE", "1")))


def _tune_ranks(plan, target: Path, force: bool, budget, jobs, log, finished, problems) -> list | None:
    """tune_and_save's part under torchrun: this rank's share, then on rank 0
    the tables of every rank merged and written once, finished(config,
    outcome, its tables written, its problems) per config in the plan's
    order, and the configs not delivered added to `problems`. Returns the
    (config, outcome) of every config delivered (rank 0), else None."""
    from moebench.bench.launch import rank_main
    from moebench.tuning.share import tune_job

    gathered = rank_main(tune_job(plan, budget, jobs, log))
    if gathered is None:
        return None
    tables, conflicts = merge_tables([t for _, outcome in gathered.done for t in outcome.tables])
    saved, write_problems = write_tables(tables, target, force)
    problems.extend(conflicts + write_problems)
    for config, outcome in gathered.done:
        names = {t.file_name for t in outcome.tables}
        failed = untuned_rows(outcome, f"{config.preset} {config.family}")
        finished(config, outcome, [s for s in saved if s.table.file_name in names],
                 [f"no correct tactic for {', '.join(failed)}"] if failed else [])  # fmt: skip
    problems.extend(gathered.problems)
    return gathered.done
