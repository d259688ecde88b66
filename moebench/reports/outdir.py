"""Where a command's files go: the root of stored runs (never inside a run),
and a report's output directory (by default `<run>-report/` beside the run)
with the record of the files a report wrote there, so that `report --force`
removes an earlier report's stale plots and nothing else.

Errors are ValueError naming the option (`option`: --out, --summary, ...);
file-system failures while writing are OSError. Nothing here prints.
Torch- and pandas-free at import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# moebench.reports.store (pandas) is imported where it is used: the CLI reads this module at start-up.


def check_out(out, option: str = "--out", *, runs: bool = False) -> None:
    """Make `out` a directory that takes files before anything is measured (a
    long run is never measured and then lost); raise ValueError naming
    `option` when it cannot be one. `runs`: `out` is where runs are stored,
    so it must not be a stored run or lie inside one (checked first, before
    anything is created)."""
    from moebench.reports.store import check_run_root

    run, itself = run_at(out) if runs else (None, False)
    if run is not None:  # a new run would be stored among another run's files
        where = "a stored run directory" if itself else f"inside the stored run {run}"
        raise ValueError(f"{option}: {out} is {where}; give a directory outside any run")
    try:
        check_run_root(out)
    except (OSError, ValueError) as error:
        raise ValueError(f"{option}: {error}") from None


#: Where `report` records the files it wrote in its output directory.
REPORT_RECORD = ".moebench-report.json"


def report_record(out: Path) -> set[str]:
    """The file names an earlier `report` wrote in `out`: those its
    REPORT_RECORD lists (only the report's own names, HTML_FILES, the
    per-TP plots and summary.md; a record that is a link or not a list of names counts as
    none). A directory from before the record existed, whose report.html is
    one of ours (its title says "moebench run"), counts as holding a whole
    earlier report (every HTML_FILES name); else empty."""
    from moebench.reports.html import HTML_FILES, is_report_file

    ours = (*HTML_FILES, "summary.md")
    record = out / REPORT_RECORD
    if record.is_symlink():
        return set()
    try:
        names = json.loads(record.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return set(HTML_FILES) if is_our_page(out / "report.html") else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    if not isinstance(names, list):
        return set()
    return {n for n in names if isinstance(n, str) and (n in ours or is_report_file(n))}


def is_our_page(page: Path) -> bool:
    """Whether `page` is a plain file written by `report` (its <title> says "moebench run")."""
    try:
        return (
            not page.is_symlink()
            and page.is_file()
            and "<title>moebench run" in page.read_text(encoding="utf-8", errors="replace")[:4096]
        )
    except OSError:
        return False


def write_report_record(out: Path, written: list[Path]) -> None:
    """Record the names of the files this report wrote in `out` (REPORT_RECORD),
    so that a later `report --force` removes only those. A link in its place
    is replaced, never written through. Raises OSError."""
    record = out / REPORT_RECORD
    if record.is_symlink():
        record.unlink()
    record.write_text(json.dumps({"files": sorted(p.name for p in written)}) + "\n", encoding="utf-8")


def remove_stale_report_files(out: Path, written: list[Path], earlier: set[str]) -> list[str]:
    """`report --force`: remove the files an earlier report recorded writing
    in `out` (`earlier`, from its REPORT_RECORD, read before this report was
    written) that this report did not write (`written`), so that none of its
    plots stands beside the new report (compare.png after a report without
    --baseline, report.html after --no-html). Only files or links, and only
    names the earlier report wrote: a same-named file without that record is
    the user's and stays, as does everything else in `out`. Returns the
    names removed. Raises OSError from the file system."""
    names = {p.name for p in written}
    removed = []
    for name in sorted(earlier - names):
        path = out / name
        if path.is_symlink() or path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def run_at(path) -> tuple[Path | None, bool]:
    """(the stored run directory `path` is or lies inside, else None;
    whether it is that run itself rather than a folder inside it)."""
    from moebench.reports.store import enclosing_run

    run = enclosing_run(path)
    # absolute first: Path(".").parent is "." itself, so `--out .` inside a run read as inside it
    return run, run is not None and enclosing_run(Path(path).absolute().parent) != run


#: The name of a report's default directory, beside its run: `<run>` + this.
REPORT_DIR_SUFFIX = "-report"


def default_report_dir(run_dir: Path) -> Path:
    """Where `report RUN_DIR` writes without --out: RUN_DIR's sibling
    `<run>-report` (a run directory spelled '.' or '..' is named by its
    absolute path), so a committed run directory is never written into."""
    run = run_dir if run_dir.name not in ("", ".", "..") else Path(os.path.abspath(run_dir))
    return run.with_name(run.name + REPORT_DIR_SUFFIX)


def check_out_dir(out: Path, run_dir: Path, option: str = "--out") -> None:
    """Raise ValueError naming `option` (--out, or the default directory)
    unless `out` is a directory or can be made one, outside every stored run
    directory: RUN_DIR itself or a folder inside it (a report never writes
    into the run it reports), the baseline's or any other run's (the report
    files would be mixed into that run's files). Creates nothing: `report`
    creates the directory once every check passed."""
    from moebench.reports.store import MANIFEST, RESULTS, enclosing_run

    run, itself = run_at(out)
    if run is not None:
        if run == enclosing_run(run_dir):
            where = "RUN_DIR itself" if itself else f"inside RUN_DIR ({run})"
            raise ValueError(f"{option}: {out} is {where}; a report never writes into the run it reports; give a"
                             f" directory outside it (without --out the report goes beside RUN_DIR, in"
                             f" <run>{REPORT_DIR_SUFFIX})")  # fmt: skip
        where = "a stored run directory" if itself else f"inside a stored run directory, {run}"
        raise ValueError(f"{option}: {out} is {where} (it holds {RESULTS} and {MANIFEST}); give a directory"
                         f" outside any run for the report files (without --out the report goes beside RUN_DIR,"
                         f" in <run>{REPORT_DIR_SUFFIX})")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option}: {out} exists and is not a directory; give a directory for the report files"
                         " (created when missing)")  # fmt: skip
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option}: {parent} (a parent of {out}) is not a directory; give a directory"
                                 " for the report files")  # fmt: skip
            break


def read_report_run(path: Path, what: str):
    """read_run(path) with errors naming the argument `what`."""
    from moebench.reports.store import read_run

    try:
        return read_run(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{what}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
