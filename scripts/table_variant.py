"""Write copies of tuning tables with one tactic field changed, for an A/B of
that field in one device call (point MOEBENCH_TUNING_DIR at the output).

    python3 scripts/table_variant.py OUT_DIR --set stages=4 [--family fp8] [--stage 1[,2]]
        [--only NAME[,NAME...]] [--tables DIR] [--match I=576]

Every entry of the chosen family (`fp8` or `bf16`) and stages (and, with
--only, whose tactic is one of those named) whose tactic
accepts the change (GemmTactic's validation and `valid_for` the
table's shape and stage) is rewritten; the others
are kept as they are and listed; every table is checked whole before any
is written. Tables are read from DIR (default: the package's tables) and
only those whose file name contains every --match string are written.
OUT_DIR must not hold tables already (nothing is overwritten). Exits 2 with
a message naming the argument (nothing written) on bad arguments, on a
change no entry takes, on --only names no chosen entry has, or on a change
that would make a table unreadable (e.g. --set fp8=false).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from moebench.kernels.tactic import GemmTactic
from moebench.kernels.table import PACKAGE_TABLES, TableError, TuningTable, read_table
from moebench.tuning.table import write_table

_FIELDS = {f.name: f.type for f in dataclasses.fields(GemmTactic)}


def parse_setting(text: str) -> tuple[str, object]:
    """'field=value' -> (field, typed value); raises ValueError naming what
    is wrong."""
    name, sep, raw = text.partition("=")
    if not sep or name not in _FIELDS:
        raise ValueError(f"--set must be FIELD=VALUE with FIELD one of {sorted(_FIELDS)}, got {text!r}")
    if _FIELDS[name] in ("bool", bool):
        if raw.lower() not in ("true", "false"):
            raise ValueError(f"--set {name} takes true or false, got {raw!r}")
        return name, raw.lower() == "true"
    try:
        return name, int(raw)
    except ValueError:
        raise ValueError(f"--set {name} takes an int, got {raw!r}") from None


def family_entries(table: TuningTable, family: str) -> dict:
    """The table's {(stage, rows): TableEntry} of `family` ("fp8" or "bf16"), itself (not a copy)."""
    return table.fp8_entries if family == "fp8" else table.entries


def variants(
    tables: list[TuningTable], field: str, value, family: str, stages: set[int], only: set[str] | None
) -> tuple[list[TuningTable], list[str], int]:
    """(the tables with `field` = value in every entry of `family` and
    `stages` (and, with `only`, whose tactic is named there) that accepts it,
    each checked as a whole table; one line per entry changed or kept; the
    number changed). Raises TableError for a table the change makes
    unreadable (e.g. a non-fp8 tactic in the fp8 part)."""
    out, lines, changed = [], [], 0
    for table in tables:
        new = TuningTable.from_dict(table.to_dict(), table.file_name)  # a copy
        entries = family_entries(new, family)
        for (stage, rows), entry in sorted(entries.items()):
            if stage not in stages or (only is not None and entry.tactic.name not in only):
                continue
            try:
                tactic = dataclasses.replace(entry.tactic, **{field: value})
                reason = tactic.valid_for(new.shape, stage)
            except (TypeError, ValueError) as error:
                reason = str(error)
            if reason or tactic == entry.tactic:
                lines.append(
                    f"{new.file_name} gemm{stage} rows {rows}: kept {entry.tactic.name}"
                    f" ({reason or 'already ' + field + '=' + str(value)})"
                )
                continue
            entries[stage, rows] = dataclasses.replace(entry, tactic=tactic)
            lines.append(f"{new.file_name} gemm{stage} rows {rows}: {entry.tactic.name} -> {tactic.name}")
            changed += 1
        out.append(TuningTable.from_dict(new.to_dict(), new.file_name))  # the whole table checked again
    return out, lines, changed


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns 0, or exits 2 naming the
    argument at fault (nothing written then)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--set", dest="setting", required=True, help="FIELD=VALUE, e.g. stages=4")
    ap.add_argument("--family", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--stage", default="1", help="1, 2 or 1,2")
    ap.add_argument("--only", default=None, help="change only entries with these tactic names (comma-separated)")
    ap.add_argument("--tables", type=Path, default=PACKAGE_TABLES)
    ap.add_argument("--match", action="append", default=[], help="substring of the table file names to take")
    args = ap.parse_args(argv)
    try:
        field, value = parse_setting(args.setting)
    except ValueError as error:
        ap.error(str(error))
    stages = {x.strip() for x in args.stage.split(",")}
    if not stages or not stages <= {"1", "2"}:
        ap.error(f"--stage takes 1, 2 or 1,2, got {args.stage!r}")
    stages = {int(x) for x in stages}
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    if only is not None and not only:
        ap.error(f"--only: expected tactic names (comma-separated), got {args.only!r}")
    if not args.tables.is_dir():
        ap.error(f"--tables: {args.tables} is not a directory of tuning tables")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        ap.error(f"out_dir {args.out_dir} exists and is not a directory")
    if args.out_dir.exists() and any(args.out_dir.glob("*.json")):
        ap.error(f"out_dir {args.out_dir} already holds tables; give an empty or new directory")
    paths = sorted(p for p in args.tables.glob("*.json") if all(m in p.name for m in args.match))
    if not paths:
        ap.error(f"no table in {args.tables} matches {args.match}")
    try:
        originals = [read_table(p) for p in paths]
        tables, lines, changed = variants(originals, field, value, args.family, stages, only)
    except (OSError, TableError) as error:
        ap.error(f"--set {args.setting}: {error}")
    if only is not None:
        names = {
            e.tactic.name
            for t in originals
            for (stage, _), e in family_entries(t, args.family).items()
            if stage in stages
        }
        if only - names:
            ap.error(f"--only: no {args.family} entry of stage(s) {sorted(stages)} has {sorted(only - names)}")
    print("\n".join(lines))
    if not changed:
        ap.error(f"--set {args.setting}: no entry changed (see the lines above); nothing written")
    try:
        for table in tables:
            write_table(table, args.out_dir)
    except OSError as error:
        ap.error(f"out_dir {args.out_dir}: {error}")
    print(f"{changed} entries changed in {len(tables)} tables written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
