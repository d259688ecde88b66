"""Saving what `moebench tune` found: each tuned table written into the
tables directory, merged over an older table of the same device there (the
other kernel family's entries and the rows not re-tuned stay), and the row
counts no tactic passed for. Returns what was written and the problems;
nothing here prints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from moebench.kernels.table import TableError, TuningTable, read_table
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
    return [f"{prefix}TP{tp} GEMM{stage} rows={rows}" for (tp, stage), result in outcome.results.items()
            for rows, res in result.results.items() if res.entry is None]  # fmt: skip


def save_tables(outcome, target: str | Path, force: bool = False, label: str = "",
                ) -> tuple[list[SavedTable], list[str]]:  # fmt: skip
    """Write each of a TuneOutcome's tables that holds entries into `target`,
    merged over the table of the same name there when it reads (else
    write_table refuses it, or with `force` replaces it, with the reason).
    Returns (the tables written, in order; the problems: one message per
    table that could not be written, then one naming the row counts with no
    correct tactic (untuned_rows, `label` first), when any)."""
    target = Path(target)
    saved, problems = [], []
    for t in outcome.tables:
        if not t.entries and not t.fp8_entries:
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
    failed = untuned_rows(outcome, label)
    if failed:
        problems.append(f"no correct tactic for {', '.join(failed)}")
    return saved, problems


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
        text += (f"\n## What `moebench` runs by default (the tables of {target} first, then"
                 f" $MOEBENCH_TUNING_DIR and the package's)\n\n{family_markdown(families)}")
    summary.write_text(text, encoding="utf-8")
    summary.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return summary, summary.with_suffix(".json")
