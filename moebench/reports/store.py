"""The result store: one directory per run, `results.parquet` + `manifest.json`.

    <root>/<UTC date YYYY-MM-DD>-<label>/results.parquet   one row per case
    <root>/<UTC date YYYY-MM-DD>-<label>/manifest.json     provenance
    <root>/<UTC date YYYY-MM-DD>-<label>/<name>.parquet    optional extra tables
                                                           (e.g. ranks.parquet of a TP step)

Writes are atomic (a hidden temporary directory beside the run, renamed into
place once both files are complete) and never replace an existing run: a
taken name gets -2, -3, ... appended, unless overwrite=True.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from moebench.reports.mismatch import run_mismatches

RESULTS = "results.parquet"
MANIFEST = "manifest.json"
#: Columns every stored run has (docs/design.md "Store").
REQUIRED_COLUMNS = (
    "preset", "hidden", "intermediate", "experts", "top_k", "tp", "rows", "scenario", "backend",
    "tactic", "status", "error", "median_us", "p10_us", "p90_us", "unique_experts", "bytes", "gbps",
    "pct_copy_bw", "pct_size_ceiling", "max_rel_err", "device", "sm_count", "commit",
)  # fmt: skip
#: The error of a case a sweep or step did not reach because it was interrupted (stored skipped).
INTERRUPTED = "not run: interrupted (Ctrl-C or SIGTERM) before this case"
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_TABLE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def interrupted_rows(frame: pd.DataFrame) -> pd.Series:
    """Boolean Series over a results frame's rows: the cases an interrupt left
    unrun (error INTERRUPTED); all False for a frame without an error column."""
    if "error" not in frame.columns:
        return pd.Series(False, index=frame.index)
    return frame["error"].astype(str) == INTERRUPTED


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def _clean(value):
    """NaN/inf -> None so manifest.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_run_root(root: str | Path) -> Path:
    """Make sure runs can be stored under `root` BEFORE anything is measured:
    creates the directory (and its parents) and writes and removes a probe
    file there. Returns the Path. Raises ValueError when `root` exists and is
    not a directory, OSError (naming `root`) when it cannot be created or
    written; nothing is left behind but the directory itself."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moebench-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        raise OSError(f"cannot write runs under {path}: {error.strerror or error}") from error
    return path


def run_dir_name(label: str, when: datetime | None = None) -> str:
    """'<UTC date>-<label>'; raises ValueError for a label that is not
    1-100 characters of ASCII letters, digits, '.', '_' or '-' (starting with a
    letter or digit)."""
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ValueError(
            f"label must be 1-100 characters of ASCII letters, digits, '.', '_' or '-', starting with a letter"
            f" or digit, got {label!r}"
        )
    when = when or datetime.now(timezone.utc)
    return f"{when.astimezone(timezone.utc):%Y-%m-%d}-{label}"


def write_run(
    df: pd.DataFrame,
    manifest: dict,
    root: str | Path = "reports/runs",
    label: str = "sweep",
    *,
    overwrite: bool = False,
    when: datetime | None = None,
    tables: dict[str, pd.DataFrame] | None = None,
) -> Path:
    """Store a run; returns its directory.

    df: one row per case with at least REQUIRED_COLUMNS; manifest: a
    JSON-serializable dict (Paths and numpy scalars are converted, NaN -> null);
    tables: extra DataFrames stored beside the results as <name>.parquet
    (name: lower-case letters, digits and '_', not "results"), written in the
    same atomic move as the rest.
    The directory is <root>/<UTC date>-<label>, or with -2, -3, ... appended
    when taken; overwrite=True replaces the existing run of that exact name
    instead. Raises TypeError/ValueError for a bad frame, manifest or label;
    OSError from the file system (no partial run directory is left behind).
    """
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"df lacks required columns {missing}")
    if not isinstance(manifest, dict):
        raise TypeError(f"manifest must be a dict, got {type(manifest).__name__}")
    try:
        manifest_text = json.dumps(_clean(manifest), indent=2, sort_keys=True, default=_json_default,
                                   allow_nan=False)  # fmt: skip
    except (TypeError, ValueError) as error:
        raise ValueError(f"manifest is not JSON-serializable: {error}") from error
    tables = dict(tables or {})
    for key, table in tables.items():
        if not isinstance(key, str) or not _TABLE.match(key) or key == Path(RESULTS).stem:
            raise ValueError(f"tables: bad table name {key!r} (lower-case letters, digits, '_'; not 'results')")
        if not isinstance(table, pd.DataFrame):
            raise TypeError(f"tables[{key!r}] must be a pandas DataFrame, got {type(table).__name__}")
    name = run_dir_name(label, when)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        # mkdtemp makes it 0700; a run directory gets what mkdir would give (0777 less the umask)
        os.chmod(tmp, 0o777 & ~current_umask())
        df.to_parquet(tmp / RESULTS, index=False)
        for key, table in tables.items():
            table.to_parquet(tmp / f"{key}.parquet", index=False)
        (tmp / MANIFEST).write_text(manifest_text + "\n", encoding="utf-8")
        return _move_into_place(tmp, root, name, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _move_into_place(tmp: Path, root: Path, name: str, overwrite: bool) -> Path:
    target = root / name
    if overwrite and target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
        os.rename(target, old / "run")
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
        return target
    n = 1
    while True:
        candidate = target if n == 1 else root / f"{name}-{n}"
        if not candidate.exists():
            try:
                os.mkdir(candidate)  # claim the name (fails if another writer took it)
            except FileExistsError:
                n += 1
                continue
            os.rmdir(candidate)
            os.rename(tmp, candidate)
            return candidate
        n += 1


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a stored run directory (it holds RESULTS and MANIFEST)."""
    path = Path(path)
    return (path / RESULTS).is_file() and (path / MANIFEST).is_file()


def enclosing_run(path: str | Path) -> Path | None:
    """The stored run directory that `path` is or lies inside (links and '..'
    resolved; `path` need not exist), else None. Never raises for a path that
    cannot be read: an unreadable directory is not taken for a run."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):  # a link loop: judge the path as written
        resolved = Path(path).absolute()
    for candidate in (resolved, *resolved.parents):
        try:
            if is_run_dir(candidate):
                return candidate
        except OSError:
            continue
    return None


def read_run(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """(results, manifest) of the run directory `path`.

    Raises FileNotFoundError naming the missing directory or file (or a path
    that is not a directory); ValueError naming the file when it is corrupt
    or lacks REQUIRED_COLUMNS, and naming the file and the field when a
    manifest field the reports rely on is of the wrong type or value
    (`check_manifest`), and naming the file and a case when a case is stored
    twice or an ok case lacks a finite positive median_us.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"run directory {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {path} is not a directory (a run directory holds {RESULTS} and"
                                f" {MANIFEST})")  # fmt: skip
    results, manifest_path = path / RESULTS, path / MANIFEST
    for f in (results, manifest_path):
        if f.exists() and not f.is_file():
            raise FileNotFoundError(f"{f} is not a file (a run directory holds the files {RESULTS} and {MANIFEST})")
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (not a moebench run directory?)")
    try:
        df = pd.read_parquet(results)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several kinds
        raise ValueError(f"{results} is not a readable parquet file: {error}") from error
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{manifest_path} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path} must hold a JSON object, got {type(manifest).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{results} lacks required columns {missing}")
    check_manifest(manifest, manifest_path)
    for col in _NUMERIC_COLUMNS:
        if col in df.columns and not (pd.api.types.is_numeric_dtype(df[col]) or df[col].isna().all()):
            raise ValueError(f"{results}: column {col!r} must be numeric, got {df[col].dtype}")
    unknown = sorted(set(df["status"].astype(str)) - set(STATUSES))
    if unknown:
        raise ValueError(f"{results}: column 'status' holds {unknown}; expected one of {list(STATUSES)}")
    _check_cases(df, results)
    return df, manifest


#: The columns that name one case of a run (with `rank` where a run has it);
#: `report --baseline` matches cases across runs by them.
CASE_COLUMNS = ("preset", "tp", "rows", "scenario", "backend", "tactic")


def _check_cases(df: pd.DataFrame, results: Path) -> None:
    """A run holds each case once, and an ok case has a finite positive
    median_us (what every report reads): raises ValueError naming the file
    and the first offending case otherwise (a hand-edited or damaged file)."""
    keys = [c for c in (*CASE_COLUMNS, "rank") if c in df.columns]
    dup = df[df.duplicated(subset=keys, keep=False)]
    if len(dup):
        case = _case_text(dup.iloc[0], keys)
        raise ValueError(f"{results}: {len(dup)} rows share a case, e.g. {case}; a run holds each case once")
    median = pd.to_numeric(df["median_us"], errors="coerce")
    bad = df[(df["status"].astype(str) == "ok") & ~(median.notna() & (median > 0) & (median < float("inf")))]
    if len(bad):
        case = _case_text(bad.iloc[0], keys)
        raise ValueError(
            f"{results}: {len(bad)} ok row(s) without a finite positive median_us, e.g. {case}"
            f" (median_us {bad.iloc[0]['median_us']})"
        )


def _case_text(rec, keys) -> str:
    """'preset=..., tp=4, ...' of one results row (plain values, no numpy reprs)."""
    return ", ".join(f"{k}={rec[k].item() if hasattr(rec[k], 'item') else rec[k]}" for k in keys)


#: A case's status in a stored run.
STATUSES = ("ok", "failed", "skipped")


#: Manifest entries the reports read as objects, and results columns they compute with.
_MANIFEST_OBJECTS = ("device", "packages", "config")
_NUMERIC_COLUMNS = ("median_us", "p10_us", "p90_us", "max_rel_err", "gbps", "pct_copy_bw", "rows", "tp")
#: The manifest schemas this moebench reads (every run it stores says 1) and the run
#: kinds it knows (a sweep run stored before "kind" existed lacks the key).
SCHEMAS = (1,)
KINDS = ("sweep", "step")
#: Manifest flags the reports read as booleans (null or absent: not recorded, false),
#: at the top level and in "config".
_MANIFEST_FLAGS = ("reduced", "warm_l2", "sharded")
_CONFIG_FLAGS = ("overlap_shared",)


def check_manifest(manifest: dict, path: str | Path = MANIFEST) -> None:
    """Check the manifest fields the reports rely on, where present: "schema"
    one of SCHEMAS, "kind" one of KINDS, "device" / "packages" / "config" JSON
    objects, the flags (reduced, warm_l2, sharded, config.overlap_shared)
    true, false or null (never a truthy string such as "no"), "ranks" an
    integer >= 1 or null, "copy_bw_gbps" a positive number or null. Raises
    ValueError naming `path` and the field."""

    def bad(field: str, expected: str, value) -> ValueError:
        return ValueError(f"{path}: {field!r} must be {expected}, got {json.dumps(value, default=str)}")

    if "schema" in manifest and not (type(manifest["schema"]) is int and manifest["schema"] in SCHEMAS):
        raise bad("schema", f"one of the supported schemas {list(SCHEMAS)}", manifest["schema"])
    if "kind" in manifest and manifest["kind"] not in KINDS:
        raise bad("kind", f"one of {list(KINDS)}", manifest["kind"])
    for key in _MANIFEST_OBJECTS:
        if key in manifest and manifest[key] is not None and not isinstance(manifest[key], dict):
            raise ValueError(f"{path}: {key!r} must be a JSON object, got {type(manifest[key]).__name__}")
    config = manifest.get("config") or {}
    flags = [(key, manifest[key]) for key in _MANIFEST_FLAGS if key in manifest]
    flags += [(f"config.{key}", config[key]) for key in _CONFIG_FLAGS if key in config]
    for field, value in flags:
        if value is not None and not isinstance(value, bool):
            raise bad(field, "true or false", value)
    ranks = manifest.get("ranks")
    if ranks is not None and not (type(ranks) is int and ranks >= 1):
        raise bad("ranks", "an integer >= 1", ranks)
    bw = manifest.get("copy_bw_gbps")
    if bw is not None and not (type(bw) in (int, float) and math.isfinite(bw) and bw > 0):
        raise bad("copy_bw_gbps", "a positive number of GB/s or null", bw)


def read_table(path: str | Path, name: str) -> pd.DataFrame | None:
    """The extra table `name` (<name>.parquet) of the run directory `path`,
    or None when the run has none. Raises ValueError naming the file when it
    is not readable parquet, or for a bad table name."""
    if not isinstance(name, str) or not _TABLE.match(name):
        raise ValueError(f"name: bad table name {name!r}")
    f = Path(path) / f"{name}.parquet"
    if not f.is_file():
        return None
    try:
        return pd.read_parquet(f)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several kinds
        raise ValueError(f"{f} is not a readable parquet file: {error}") from error


def merged_tables(paths) -> dict[str, pd.DataFrame]:
    """The extra tables (<name>.parquet beside the results, e.g. a TP step's
    ranks.parquet) of the runs `paths`, each name's parts concatenated in
    order, for the run merge_runs makes of them. Raises ValueError naming a
    file that is not readable parquet."""
    tables: dict[str, list[pd.DataFrame]] = {}
    for path in (Path(p) for p in paths):
        for f in sorted(path.glob("*.parquet")):
            name = f.stem
            if f.name != RESULTS and _TABLE.match(name):
                table = read_table(path, name)
                if table is not None:
                    tables.setdefault(name, []).append(table)
    return {name: pd.concat(parts, ignore_index=True) for name, parts in tables.items()}


def merge_runs(paths) -> tuple[pd.DataFrame, dict]:
    """(results, manifest) of one run holding every case of the stored runs
    `paths` (two or more), for a comparison measured in several device calls
    (bundles that cannot travel together, a grid too long for one call).

    The runs must be of one kind, device and commit, measured the same way
    (none of the run-level mismatches `report --baseline` refuses to compare:
    L2 mode, rank count, layer boundary, shared-expert stream, reduced CPU
    geometry), and hold distinct cases (`CASE_COLUMNS`): the merged run is what one sweep of that code on that
    device would have stored, each row with the copy bandwidth its own run
    measured (`pct_copy_bw` was computed against it). The manifest is the
    first run's, with "merged_from" listing each part (path, created_utc,
    command, copy_bw_gbps; a merged run's own parts in its place),
    "copy_bw_gbps" the parts' median and "groups" every part's groups
    (rotation, x writes), each with "part": its index in "merged_from". Raises
    ValueError naming the runs that disagree or the case stored twice, and
    what read_run raises for a run that cannot be read."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"merge needs two or more runs, got {len(paths)}")
    if len(set(p.resolve() for p in paths)) != len(paths):
        raise ValueError("the same run is named twice")
    parts = [(p, *read_run(p)) for p in paths]
    first_path, _, first = parts[0]
    for key in ("kind", "commit"):
        for path, _, manifest in parts[1:]:
            if manifest.get(key) != first.get(key):
                raise ValueError(
                    f"runs differ in {key!r}: {first_path} has {first.get(key)!r}, {path} has"
                    f" {manifest.get(key)!r}; merge only runs of one {key}"
                )
    for path, _, manifest in parts[1:]:  # one manifest speaks for the merged run: what `report --baseline` tells apart
        mismatches, _ = run_mismatches(manifest, first)
        if mismatches:
            text = "; ".join(m.replace(" vs baseline ", " vs ") for m in mismatches)
            raise ValueError(f"runs were measured differently, {path} vs {first_path}: {text}; merge only runs"
                             " measured the same way")  # fmt: skip
    devices = {str(v) for _, frame, _ in parts for v in frame["device"].dropna().unique()}
    if len(devices) > 1:
        raise ValueError(f"runs were measured on different devices {sorted(devices)}; merge only one device's runs")
    frame = pd.concat([frame for _, frame, _ in parts], ignore_index=True)
    keys = [c for c in (*CASE_COLUMNS, "rank") if c in frame.columns]
    dup = frame[frame.duplicated(subset=keys, keep=False)]
    if len(dup):
        raise ValueError(f"a case is stored in more than one of the runs: {_case_text(dup.iloc[0], keys)}")
    merged_from, groups = _merged_parts(parts)
    bws = sorted(e["copy_bw_gbps"] for e in merged_from if isinstance(e.get("copy_bw_gbps"), (int, float)))
    manifest = dict(first)
    manifest["copy_bw_gbps"] = bws[len(bws) // 2] if bws else None
    manifest["merged_from"] = merged_from
    if groups:
        manifest["groups"] = groups
    return frame, manifest


def _merged_parts(parts) -> tuple[list[dict], list[dict]]:
    """(merged_from, groups) of the merged run of `parts` ((path, frame,
    manifest) each): one entry per measured part (path, created_utc, command,
    copy_bw_gbps) and every part's groups (layers, x writes), each with
    "part", its entry's index. A part that is itself a merged run gives its
    own parts and groups (indices shifted), so merging merged runs keeps
    every sweep's command and x writes."""
    merged_from: list[dict] = []
    groups: list[dict] = []
    for path, _, m in parts:
        base = len(merged_from)
        inner = m.get("merged_from")
        if isinstance(inner, list) and inner and all(isinstance(e, dict) for e in inner):
            merged_from += inner
            groups += [{**g, "part": base + (g.get("part") if type(g.get("part")) is int else 0)}
                       for g in m.get("groups") or []]  # fmt: skip
        else:
            merged_from.append({"path": str(path), **{k: m.get(k) for k in ("created_utc", "command", "copy_bw_gbps")}})
            groups += [{**g, "part": base} for g in m.get("groups") or []]
    return merged_from, groups
