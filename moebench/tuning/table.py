"""Writing tuning tables (`moebench tune`) and checking the shipped ones.

The schema, reading and the runtime lookup are `moebench.kernels.table`
(beside the kernels, which ask it for their tactics); this is the offline
half: atomic writes that refuse to replace a table of another device or a
newer version unless forced, and `verify_tables` for the tables the package
ships (moebench/kernels/tables/).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from moebench.kernels.table import (
    LAYER, TableConflict, TableError, TuningTable, entry_path, load_layer_choice, load_tactic, read_table,
    stale_reason, version_tuple,
)  # fmt: skip


def write_table(table: TuningTable, directory: str | Path, *, force: bool = False) -> Path:
    """Write `table` atomically to directory/table.file_name; returns the path.

    An existing table there is replaced only when it is of the same device
    (raw name and SM count), not of a newer moebench / tactics / schema
    version and holds no kernel family's entries that `table` lacks (merge
    first: `table.merged_over(read_table(path))`), or with force=True; else TableConflict (naming the file and
    why). A corrupt existing file is not replaced without force either.
    Raises OSError from the file system; the target is never left partial.
    """
    if not isinstance(table, TuningTable):
        raise TypeError(f"table must be a TuningTable, got {type(table).__name__}")
    directory = Path(directory)
    target = directory / table.file_name
    if target.exists() and not force:
        conflict = _conflict(target, table)
        if conflict:
            raise TableConflict(f"{target}: {conflict}; pass --force to replace it")
    text = json.dumps(table.to_dict(), indent=2, sort_keys=False, allow_nan=False) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{table.file_name}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp makes it 0600; a table is for every user of the GPU: 0666 less the umask
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the OS allows
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return target


def _conflict(target: Path, new: TuningTable) -> str | None:
    try:
        old = read_table(target)
    except (TableError, OSError) as error:
        return f"the existing file is not a usable table ({error})"
    if old.device.get("name") != new.device.get("name") or (
        old.device.get("sm_count") not in (None, new.device.get("sm_count"))
    ):
        return (f"it was tuned on {old.device.get('name')} ({old.device.get('sm_count')} SMs), this is"
                f" {new.device.get('name')} ({new.device.get('sm_count')} SMs)")  # fmt: skip
    if version_tuple(old.moebench_version) > version_tuple(new.moebench_version):
        return f"it was written by a newer moebench ({old.moebench_version} > {new.moebench_version})"
    if old.tactics_version > new.tactics_version or old.schema > new.schema:
        return (f"it has a newer tactics version / schema ({old.tactics_version}/{old.schema} >"
                f" {new.tactics_version}/{new.schema})")  # fmt: skip
    for fp8, family in ((False, "BF16"), (True, "FP8")):
        if old.entries_of(fp8) and not new.entries_of(fp8):
            return (f"it holds {len(old.entries_of(fp8))} {family}-family entries this table lacks (writing would"
                    " drop them; merge with merged_over first, as `moebench tune` does)")  # fmt: skip
    if old.fused_entries and not new.fused_entries:
        return (f"it holds {len(old.fused_entries)} fp8.fused entries this table lacks (writing would drop them;"
                " merge with merged_over first, as `moebench tune` does)")  # fmt: skip
    return None


def verify_tables(directory: str | Path) -> list[str]:
    """Problems with the tables in `directory` (e.g. the package's shipped
    ones), one line each naming the file; [] when every file there is a
    usable, current table (or the directory does not exist: nothing
    shipped). Checks: each *.json reads (schema, name matches content), is
    not stale, has entries, and the runtime (`load_tactic`, searching only
    `directory`) returns each entry's tactic from it; no other files but
    hidden ones and no leftover temporary files."""
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    problems = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            if path.name.endswith(".tmp"):
                problems.append(f"{path}: a temporary file left by an interrupted write")
            continue
        if path.suffix != ".json":
            problems.append(f"{path}: not a tuning table (*.json)")
            continue
        try:
            table = read_table(path)
        except (TableError, OSError) as error:
            problems.append(str(error))
            continue
        stale = stale_reason(table)
        if stale:
            problems.append(f"{path}: stale: {stale}")
            continue
        if not table.has_entries:
            problems.append(f"{path}: holds no entries")
        for fp8 in (False, True):
            for (stage, rows), entry in sorted(table.entries_of(fp8).items()):
                tactic, source = load_tactic(table.device["name"], table.shape, rows, stage, search=[directory],
                                             fp8=fp8)  # fmt: skip
                if tactic != entry.tactic or not source.startswith(f"table {path}"):
                    problems.append(f"{path}: the runtime does not take {entry_path(stage, rows, fp8)} from it"
                                    f" ({source})")  # fmt: skip
        for rows, entry in sorted(table.fused_entries.items()):
            choice, source = load_layer_choice(table.device["name"], table.shape, rows, search=[directory])
            if choice != entry.tactic or not source.startswith(f"table {path}"):
                problems.append(f"{path}: the runtime does not take {entry_path(LAYER, rows, True)} from it"
                                f" ({source})")  # fmt: skip
    return problems
