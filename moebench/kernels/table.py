"""Tuning tables: which GEMM tactic to run per (stage, rows), per device and
shape class, and how the runtime finds them.

One JSON file per (device, shape class), named like vLLM's tuned MoE configs:

    E=384,H=5120,I=576,top_k=6,device_name=NVIDIA_H200,dtype=mxfp4.json

(I is one rank's logical intermediate size, what the kernels stream.) The
file holds, per stage ("gemm1", "gemm2") and rows ("1".."8"), the winning
tactic, its measured µs (median, p10, p90), the runner-up and the margin,
and the provenance of the measurement (device, driver, versions, commit,
date). Schema (SCHEMA = 3; schema 2 is schema 3 without "fp8.fused", schema 1
schema 2 without the "fp8" part):

    {"kind": "moebench-tuning-table", "schema": 3, "moebench_version": "0.1.0",
     "tactics_version": 1,
     "shape": {"experts": 384, "hidden": 5120, "intermediate": 576, "top_k": 6, "dtype": "mxfp4"},
     "device": {"name": "NVIDIA H200", "family": "NVIDIA_H200", "sm_count": 132, "capability": "9.0"},
     "gemm1": {"1": ENTRY, ...}, "gemm2": {"1": ENTRY, ...},
     "fp8": {"gemm1": {"1": ENTRY, ...}, "gemm2": {"1": ENTRY, ...}, "fused": {"1": LAYER_ENTRY, ...}}}
    ENTRY = {"tactic": TACTIC, "median_us": 11.3, "p10_us": 11.1, "p90_us": 11.6,
             "runner_up": TACTIC | null, "runner_up_us": 11.9 | null, "margin_pct": 5.3 | null,
             "separated": true, "candidates": 77, "rejected": 2, "provenance": {...}}
    TACTIC = {"name": "r64_m1_k8_u4_c1", "tile_rows": 64, "warps_m": 1, "warps_k": 8,
              "unroll": 4, "ctas_per_sm": 1, "persistent": true, "pdl": true}
    LAYER_ENTRY = ENTRY with "tactic" / "runner_up" a CHOICE: {"name": "pair"} or
              {"name": ..., "gemm1": TACTIC, "gemm2": TACTIC, "resident": 2, "lead": 0}

"fp8.fused" says per rows whether the FP8 family runs its two GEMMs as the
pair or as the fused layer (`kernels.fused`, a `LayerChoice`): `moebench
tune --fp8` times route + pair against route + each fused candidate side by
side and keeps the pair unless a fused tactic is faster beyond the noise.
The choice at a row count is read from the table that serves the FP8
family there (the first holding any FP8 entry at those rows: its
fp8.fused entry, else the pair; `load_layer_choice`), and a re-tune of the
pair that does not decide again drops the older choice (`merged_over`), so
a choice is never applied to a pair it was not timed against. A row count
no table decides runs the pair.

Two kernel families, one layout of the weights each (a layer runs one):
"gemm1" / "gemm2" hold the BF16 family's tactics (no `_f8`; `_a16` or the
MXFP8 operand), the optional "fp8" object the FP8 family's (`_f8` only,
`moebench tune --fp8`, what an FP8-family `RoutedExpertGemm` runs). Which
family a layer runs by default is chosen from both families' µs
(`kernels.family`: the faster per rows, one family per layer). Each
family is tuned and merged on its own: re-tuning one keeps the other's
entries. A table written with fp8.fused entries says schema 3, else one
with FP8 entries schema 2, else schema 1 (so an older moebench reads what
it can); an older moebench refuses to replace a file of a newer schema (it
would drop the part it does not know) unless forced, and refuses to read a
schema newer than its own.

Device names are normalized to a family ("NVIDIA H200 NVL", "NVIDIA H200"
and "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> NVIDIA_H200 / NVIDIA_H100): a
table serves every board of its chip. Writing tables (atomic, refusing to
replace another device's or a newer version's) is the tuner's:
`moebench.tuning.table`; this module is what the kernels' runtime reads.

The runtime (`load_tactic`) looks each entry (family, stage, rows) up on its
own along the search path: $MOEBENCH_TUNING_DIR (one or more directories,
os.pathsep-separated, in order), then the tables shipped in the package
(moebench/kernels/tables/). The first usable table that holds the entry
serves it, so a table there that holds only some rows, or only one kernel
family, overrides just those and leaves the rest to the tables after it;
an entry no table holds gets the built-in `default_tactic`. A corrupt or
stale table is skipped with one warning naming the file; an entry no table
holds warns once naming the tables looked in (no table at all: the
directories); nothing here raises for a table. Each table used is logged once per process (INFO), and the source
`load_tactic` returns names the file and entry.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moebench import __version__
from moebench.kernels.fused_tactic import LayerChoice
from moebench.kernels.tactic import TACTICS_VERSION, GemmShape, GemmTactic, default_tactic
from moebench.record import MAX_ROWS, MAX_TOP_K, max_ctas

logger = logging.getLogger("moebench.tuning")

KIND = "moebench-tuning-table"
SCHEMA = 3
#: The first schema with the "fp8" part (a table without FP8 entries is written as schema 1).
FP8_SCHEMA = 2
#: The first schema with "fp8.fused" (a table without it is written as schema 2 or 1).
FUSED_SCHEMA = 3
DTYPE = "mxfp4"
ENV_DIR = "MOEBENCH_TUNING_DIR"
PACKAGE_TABLES = Path(__file__).resolve().parent / "tables"
STAGES = {1: "gemm1", 2: "gemm2"}
#: The "stage" of the fp8 part's per-rows choice between the pair and the fused layer.
LAYER = 3
FUSED_KEY = "fused"
#: How logs and tables name each stage a tune times.
STAGE_LABELS = {1: "GEMM1", 2: "GEMM2", LAYER: "pair or fused"}
#: The key of the FP8 family's entries in a table file.
FP8_KEY = "fp8"
#: Tokens of a device name that name a board, memory size or slice, not the chip.
_BOARD_TOKEN = re.compile(r"^(NVL|SXM\d*|PCIE|HBM\d*E?|\d+GB|NVLINK)$", re.IGNORECASE)


class TableError(ValueError):
    """A tuning table that cannot be used; the message names the file."""


class TableConflict(TableError):
    """Writing would replace a table of another device or a newer version."""


# ----------------------------------------------------------------------------- names


def normalize_device_name(name: str) -> str:
    """The device family used in table names: spaces -> '_', board / memory
    tokens (NVL, SXM5, PCIe, HBM3, 80GB) and a MIG suffix dropped.
    'NVIDIA H200 NVL' -> 'NVIDIA_H200'; 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100'.
    Raises ValueError for an empty name, TypeError for a non-str."""
    if not isinstance(name, str):
        raise TypeError(f"device name must be a str, got {type(name).__name__}")
    tokens = re.split(r"[\s_]+", name.strip())
    if "MIG" in (t.upper() for t in tokens):
        tokens = tokens[: [t.upper() for t in tokens].index("MIG")]
    kept = [re.sub(r"[^A-Za-z0-9.-]", "", t) for t in tokens if t and not _BOARD_TOKEN.match(t)]
    kept = [t for t in kept if t]
    if not kept:
        raise ValueError(f"device name {name!r} has nothing to name a table by")
    return "_".join(kept)


@dataclass(frozen=True)
class ShapeClass:
    """What one table serves: local experts E, hidden H, one rank's logical
    intermediate I, top_k and the weight dtype."""

    experts: int
    hidden: int
    intermediate: int
    top_k: int
    dtype: str = DTYPE

    def __post_init__(self) -> None:
        for name in ("experts", "hidden", "intermediate", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {self.top_k}")
        if self.dtype != DTYPE:
            raise ValueError(f"dtype must be {DTYPE!r}, got {self.dtype!r}")

    @classmethod
    def of(cls, obj, top_k: int | None = None) -> ShapeClass:
        """From a ShapeClass, or anything with hidden / intermediate / experts
        (RankShape, ExpertWeights, GemmShape) plus top_k (its own attribute,
        or the argument, which wins). Raises TypeError/ValueError."""
        if isinstance(obj, ShapeClass):
            return obj if top_k is None or top_k == obj.top_k else cls(obj.experts, obj.hidden,
                                                                         obj.intermediate, top_k)  # fmt: skip
        g = GemmShape.of(obj)
        k = top_k if top_k is not None else getattr(obj, "top_k", None)
        if k is None:
            raise TypeError(f"top_k is needed for a {type(obj).__name__} (it has none)")
        return cls(g.experts, g.hidden, g.intermediate, int(k))

    @property
    def gemm_shape(self) -> GemmShape:
        return GemmShape(self.hidden, self.intermediate, self.experts)

    def describe(self) -> str:
        return f"E={self.experts},H={self.hidden},I={self.intermediate},top_k={self.top_k}"


def table_file_name(shape, device_name: str, top_k: int | None = None) -> str:
    """'E=384,H=5120,I=576,top_k=6,device_name=NVIDIA_H200,dtype=mxfp4.json'."""
    s = ShapeClass.of(shape, top_k)
    return f"{s.describe()},device_name={normalize_device_name(device_name)},dtype={s.dtype}.json"


# ----------------------------------------------------------------------------- schema


def _tactic(data, where: str) -> GemmTactic:
    """`GemmTactic.from_fields(data)`; raises TableError naming `where`."""
    try:
        return GemmTactic.from_fields(data)
    except (TypeError, ValueError) as error:
        raise TableError(f"{where}: {error}") from error


def _choice(data, where: str) -> LayerChoice:
    """`LayerChoice.from_fields(data)`; raises TableError naming `where`."""
    try:
        return LayerChoice.from_fields(data)
    except (TypeError, ValueError) as error:
        raise TableError(f"{where}: {error}") from error


def _finite(where: str, name: str, value, *, positive: bool = True, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TableError(f"{where}: {name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise TableError(f"{where}: {name} must be positive, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TableEntry:
    """The tactic chosen for one (stage, rows), and why.

    tactic: a GemmTactic (the "gemm1" / "gemm2" maps) or a LayerChoice (the
    "fp8.fused" map; runner_up then too); median_us / p10_us / p90_us: the winner's time (µs, one GEMM launch);
    runner_up: the second-fastest correct tactic (None when it was the only
    one), runner_up_us its median, margin_pct = 100 * (runner_up_us /
    median_us - 1); separated: whether the two were told apart beyond the
    noise (winner p90 < runner-up p10); candidates: tactics timed; rejected:
    tactics that failed the correctness gate or did not run; provenance:
    device, driver, versions, commit, date of the measurement.
    """

    tactic: GemmTactic | LayerChoice
    median_us: float
    p10_us: float
    p90_us: float
    runner_up: GemmTactic | LayerChoice | None = None
    runner_up_us: float | None = None
    margin_pct: float | None = None
    separated: bool = False
    candidates: int = 1
    rejected: int = 0
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "TableEntry"
        if not isinstance(self.tactic, (GemmTactic, LayerChoice)):
            raise TypeError(f"tactic must be a GemmTactic or a LayerChoice, got {type(self.tactic).__name__}")
        for name in ("median_us", "p10_us", "p90_us"):
            _finite(where, name, getattr(self, name))
        if not self.p10_us <= self.median_us <= self.p90_us:
            raise ValueError(f"need p10_us <= median_us <= p90_us, got {self.p10_us}, {self.median_us}, {self.p90_us}")
        if self.runner_up is not None and type(self.runner_up) is not type(self.tactic):
            raise TypeError(f"runner_up must be a {type(self.tactic).__name__} (as the tactic) or None,"
                            f" got {type(self.runner_up).__name__}")  # fmt: skip
        if (self.runner_up is None) != (self.runner_up_us is None):
            raise ValueError("runner_up and runner_up_us go together")
        _finite(where, "runner_up_us", self.runner_up_us, optional=True)
        _finite(where, "margin_pct", self.margin_pct, positive=False, optional=True)
        for name in ("candidates", "rejected"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.separated, bool):
            raise TypeError(f"separated must be a bool, got {type(self.separated).__name__}")
        if not isinstance(self.provenance, dict):
            raise TypeError(f"provenance must be a dict, got {type(self.provenance).__name__}")

    def to_dict(self) -> dict:
        return {
            "tactic": self.tactic.to_fields(), "median_us": self.median_us, "p10_us": self.p10_us,
            "p90_us": self.p90_us,
            "runner_up": None if self.runner_up is None else self.runner_up.to_fields(),
            "runner_up_us": self.runner_up_us, "margin_pct": self.margin_pct, "separated": self.separated,
            "candidates": self.candidates, "rejected": self.rejected, "provenance": self.provenance,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data, where: str, parse=_tactic) -> TableEntry:
        """The entry `to_dict` wrote; `parse(fields, where)` reads its tactic
        and runner-up (`_tactic`, or `_choice` for "fp8.fused"). Raises
        TableError naming `where`."""
        if not isinstance(data, dict):
            raise TableError(f"{where}: an entry must be an object, got {type(data).__name__}")
        for key in ("tactic", "median_us", "p10_us", "p90_us"):
            if key not in data:
                raise TableError(f"{where}: entry lacks {key!r}")
        runner = data.get("runner_up")
        try:
            return cls(
                tactic=parse(data["tactic"], f"{where}.tactic"),
                median_us=_finite(where, "median_us", data["median_us"]),
                p10_us=_finite(where, "p10_us", data["p10_us"]),
                p90_us=_finite(where, "p90_us", data["p90_us"]),
                runner_up=None if runner is None else parse(runner, f"{where}.runner_up"),
                runner_up_us=_finite(where, "runner_up_us", data.get("runner_up_us"), optional=True),
                margin_pct=_finite(where, "margin_pct", data.get("margin_pct"), positive=False, optional=True),
                separated=data.get("separated", False),
                candidates=data.get("candidates", 1),
                rejected=data.get("rejected", 0),
                provenance=data.get("provenance", {}),
            )  # fmt: skip
        except (TypeError, ValueError) as error:
            if isinstance(error, TableError):
                raise
            raise TableError(f"{where}: {error}") from error


@dataclass
class TuningTable:
    """One device's tactics for one shape class.

    device: {"name": raw device name, "sm_count": int, "capability": "9.0"}
    (the device family is derived); entries: {(stage, rows): TableEntry} of
    the BF16 kernel family (tactics without `_f8`); fp8_entries: the same for
    the FP8 family (`_f8` tactics only; the file's "fp8" part);
    fused_entries: {rows: TableEntry of a LayerChoice}, the FP8 family's pair
    or fused layer per row count ("fp8.fused"). schema: the schema the table
    was read as (`written_schema` is what `to_dict` writes).
    """

    shape: ShapeClass
    device: dict
    entries: dict[tuple[int, int], TableEntry] = field(default_factory=dict)
    moebench_version: str = __version__
    tactics_version: int = TACTICS_VERSION
    schema: int = SCHEMA
    fp8_entries: dict[tuple[int, int], TableEntry] = field(default_factory=dict)
    fused_entries: dict[int, TableEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ShapeClass):
            raise TypeError(f"shape must be a ShapeClass, got {type(self.shape).__name__}")
        if not isinstance(self.device, dict) or not isinstance(self.device.get("name"), str):
            raise ValueError(f"device must be a dict with a 'name' string, got {self.device!r}")
        normalize_device_name(self.device["name"])
        for fp8 in (False, True):
            name = "fp8_entries" if fp8 else "entries"
            entries = self.entries_of(fp8)
            if not isinstance(entries, dict):
                raise TypeError(f"{name} must be a dict, got {type(entries).__name__}")
            for key, entry in entries.items():
                if not (isinstance(key, tuple) and len(key) == 2 and key[0] in STAGES
                        and isinstance(key[1], int) and 1 <= key[1] <= MAX_ROWS):  # fmt: skip
                    raise ValueError(f"{name} keys must be (stage 1|2, rows 1..{MAX_ROWS}), got {key!r}")
                if not isinstance(entry, TableEntry):
                    raise TypeError(f"{name}[{key}] must be a TableEntry, got {type(entry).__name__}")
                where = entry_path(key[0], key[1], fp8)
                if not isinstance(entry.tactic, GemmTactic):
                    raise TypeError(f"{where}: the tactic must be a GemmTactic, got {type(entry.tactic).__name__}")
                for what, t in (("tactic", entry.tactic), ("runner_up", entry.runner_up)):
                    if t is not None and t.fp8 != fp8:
                        family = (
                            "the FP8 family's part holds fp8 (_f8) tactics only"
                            if fp8
                            else f"the BF16 family's entries hold no fp8 (_f8) tactics; those go in {FP8_KEY!r}"
                        )
                        raise ValueError(f"{where}.{what}: {t.name} is {'not ' if fp8 else ''}an fp8 tactic"
                                         f" ({family})")  # fmt: skip
                reason = entry.tactic.valid_for(self.shape.gemm_shape, key[0])
                if reason:
                    raise ValueError(f"{where}: {entry.tactic.name} cannot run GEMM{key[0]}: {reason}")
        if not isinstance(self.fused_entries, dict):
            raise TypeError(f"fused_entries must be a dict, got {type(self.fused_entries).__name__}")
        for rows, entry in self.fused_entries.items():
            if not (isinstance(rows, int) and not isinstance(rows, bool) and 1 <= rows <= MAX_ROWS):
                raise ValueError(f"fused_entries keys must be rows 1..{MAX_ROWS}, got {rows!r}")
            if not isinstance(entry, TableEntry) or not isinstance(entry.tactic, LayerChoice):
                raise TypeError(f"fused_entries[{rows}] must be a TableEntry of a LayerChoice, got {entry!r:.80}")
            for what, choice in (("tactic", entry.tactic), ("runner_up", entry.runner_up)):
                reason = choice.fused.why_invalid(self.shape.gemm_shape) if choice and choice.fused else None
                if reason:
                    raise ValueError(f"{entry_path(LAYER, rows, True)}.{what}: {choice.name} cannot run: {reason}")

    @property
    def family(self) -> str:
        return normalize_device_name(self.device["name"])

    @property
    def file_name(self) -> str:
        return table_file_name(self.shape, self.device["name"])

    @property
    def has_entries(self) -> bool:
        """Whether the table holds any entry: BF16, FP8 or fp8.fused."""
        return bool(self.entries or self.fp8_entries or self.fused_entries)

    def entries_of(self, fp8: bool) -> dict[tuple[int, int], TableEntry]:
        """The entries of one kernel family: `fp8_entries` or `entries`."""
        return self.fp8_entries if fp8 else self.entries

    def entry(self, stage: int, rows: int, fp8: bool = False) -> TableEntry | None:
        """The entry of GEMM`stage` at `rows` of the FP8 (`fp8`) or BF16 family, or None
        (the pair-or-fused choice at `rows`: `fused_entries.get(rows)`)."""
        return self.entries_of(fp8).get((stage, rows))

    @property
    def written_schema(self) -> int:
        """The schema `to_dict` writes: FUSED_SCHEMA with "fp8.fused" entries,
        else FP8_SCHEMA with FP8 entries, else 1 (each readable by a moebench
        from before the part it lacks)."""
        return FUSED_SCHEMA if self.fused_entries else FP8_SCHEMA if self.fp8_entries else 1

    def merged_over(self, older: TuningTable) -> TuningTable:
        """This table with `older`'s entries for the (family, stage, rows) it
        lacks (a re-tune of some rows, or of the other kernel family, keeps
        the others); `older`'s fp8.fused choice at a row count whose FP8
        GEMM entries this table holds is dropped unless this table decides
        it too (it was decided against the pair being replaced). Raises TableConflict when `older` is of another shape
        class or device."""
        if older.shape != self.shape:
            raise TableConflict(f"cannot merge tables of {older.shape.describe()} and {self.shape.describe()}")
        if older.device.get("name") != self.device.get("name"):
            raise TableConflict(f"cannot merge tables of {older.device.get('name')} and {self.device.get('name')}")
        entries = {**older.entries, **self.entries}
        fp8_entries = {**older.fp8_entries, **self.fp8_entries}
        # an older pair-or-fused choice was decided against the older pair: a row count whose FP8
        # GEMMs this table re-tunes without deciding again falls back to the pair
        retuned = {rows for _, rows in self.fp8_entries}
        kept = {rows: e for rows, e in older.fused_entries.items() if rows not in retuned}
        fused_entries = {**kept, **self.fused_entries}
        return TuningTable(self.shape, dict(self.device), entries, self.moebench_version,
                           self.tactics_version, self.schema, fp8_entries, fused_entries)  # fmt: skip

    def to_dict(self) -> dict:
        out = {
            "kind": KIND, "schema": self.written_schema, "moebench_version": self.moebench_version,
            "tactics_version": self.tactics_version,
            "shape": {"experts": self.shape.experts, "hidden": self.shape.hidden,
                      "intermediate": self.shape.intermediate, "top_k": self.shape.top_k,
                      "dtype": self.shape.dtype},
            "device": {**self.device, "family": self.family},
        }  # fmt: skip
        out.update(_stage_maps(self.entries))
        if self.fp8_entries or self.fused_entries:
            out[FP8_KEY] = _stage_maps(self.fp8_entries)
        if self.fused_entries:
            out[FP8_KEY][FUSED_KEY] = {str(r): self.fused_entries[r].to_dict() for r in sorted(self.fused_entries)}
        return out

    @classmethod
    def from_dict(cls, data, where: str = "<table>") -> TuningTable:
        """Parse and validate; raises TableError naming `where` (the path)."""
        if not isinstance(data, dict):
            raise TableError(f"{where}: must hold a JSON object, got {type(data).__name__}")
        if data.get("kind") != KIND:
            raise TableError(f"{where}: not a moebench tuning table (kind {data.get('kind')!r}, expected {KIND!r})")
        schema = data.get("schema")
        if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
            raise TableError(f"{where}: schema must be a positive int, got {schema!r}")
        if schema > SCHEMA:
            raise TableError(f"{where}: schema {schema} is newer than this moebench reads ({SCHEMA}); upgrade moebench")
        for key in ("moebench_version", "tactics_version", "shape", "device"):
            if key not in data:
                raise TableError(f"{where}: lacks {key!r}")
        version, tv = data["moebench_version"], data["tactics_version"]
        if not isinstance(version, str) or not isinstance(tv, int) or isinstance(tv, bool):
            raise TableError(f"{where}: moebench_version must be a str and tactics_version an int")
        shape_d = data["shape"]
        try:
            shape = ShapeClass(**{k: shape_d[k] for k in ("experts", "hidden", "intermediate", "top_k", "dtype")})
        except (KeyError, TypeError, ValueError) as error:
            raise TableError(f"{where}: bad shape {shape_d!r}: {error}") from error
        device = data["device"]
        if not isinstance(device, dict) or not isinstance(device.get("name"), str):
            raise TableError(f"{where}: device must be an object with a 'name' string")
        device = {k: v for k, v in device.items() if k != "family"}
        entries = _parse_stage_maps(data, where, "")
        fp8_part = data.get(FP8_KEY)
        if fp8_part is not None and schema < FP8_SCHEMA:
            raise TableError(f"{where}: schema {schema} has no {FP8_KEY!r} part (it came with schema {FP8_SCHEMA})")
        if fp8_part is not None and not isinstance(fp8_part, dict):
            raise TableError(f"{where}: {FP8_KEY} must be an object with 'gemm1' / 'gemm2' / 'fused' maps,"
                             f" got {type(fp8_part).__name__}")  # fmt: skip
        unknown = sorted(set(fp8_part or {}) - {*STAGES.values(), FUSED_KEY})
        if unknown:
            raise TableError(f"{where}: {FP8_KEY} holds {unknown}; expected only 'gemm1' / 'gemm2' / 'fused'")
        fp8_entries = _parse_stage_maps(fp8_part or {}, where, f"{FP8_KEY}.")
        fused_part = (fp8_part or {}).get(FUSED_KEY)
        if fused_part is not None and schema < FUSED_SCHEMA:
            raise TableError(
                f"{where}: schema {schema} has no {FP8_KEY}.{FUSED_KEY} (it came with schema {FUSED_SCHEMA})"
            )
        fused_entries = _parse_rows_map(fused_part or {}, where, f"{FP8_KEY}.{FUSED_KEY}", _choice)
        try:
            return cls(shape, device, entries, version, tv, schema, fp8_entries, fused_entries)
        except (TypeError, ValueError) as error:
            raise TableError(f"{where}: {error}") from error


def entry_path(stage: int, rows: int, fp8: bool = False) -> str:
    """Where an entry lives in a table file: 'gemm1[6]', 'fp8.gemm1[6]' or (stage LAYER) 'fp8.fused[6]'."""
    return f"{FP8_KEY + '.' if fp8 else ''}{FUSED_KEY if stage == LAYER else STAGES[stage]}[{rows}]"


def _stage_maps(entries: dict[tuple[int, int], TableEntry]) -> dict:
    """{"gemm1": {"1": ENTRY, ...}, "gemm2": {...}} of one family's entries."""
    out = {}
    for stage, key in STAGES.items():
        rows = sorted(r for s, r in entries if s == stage)
        out[key] = {str(r): entries[stage, r].to_dict() for r in rows}
    return out


def _parse_stage_maps(data: dict, where: str, prefix: str) -> dict[tuple[int, int], TableEntry]:
    """The entries of one family's "gemm1" / "gemm2" maps in `data`
    (`prefix`: "" or "fp8.", for the messages); raises TableError."""
    entries: dict[tuple[int, int], TableEntry] = {}
    for stage, key in STAGES.items():
        for rows, entry in _parse_rows_map(data.get(key, {}), where, f"{prefix}{key}", _tactic).items():
            entries[stage, rows] = entry
    return entries


_ROWS_KEYS = {str(r): r for r in range(1, MAX_ROWS + 1)}


def _parse_rows_map(block, where: str, path: str, parse) -> dict[int, TableEntry]:
    """{rows: entry} of one map keyed by rows ("1".."8") at `path` in the
    file `where`, each tactic read by `parse`; raises TableError."""
    if not isinstance(block, dict):
        raise TableError(f"{where}: {path} must be an object keyed by rows")
    out: dict[int, TableEntry] = {}
    for rows_text, entry in block.items():
        if rows_text not in _ROWS_KEYS:  # exactly "1".."8": no "01", no other digits
            raise TableError(f"{where}: {path} has rows {rows_text!r}; expected one of '1'..'{MAX_ROWS}'")
        out[_ROWS_KEYS[rows_text]] = TableEntry.from_dict(entry, f"{where}: {path}[{rows_text}]", parse)
    return out


def version_tuple(text: str) -> tuple[int, ...]:
    """Leading numeric release components: '0.1.0' -> (0, 1, 0), '1.2.dev3' -> (1, 2)."""
    out = []
    for part in str(text).split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.group() != part:
            break
    return tuple(out)


def stale_reason(table: TuningTable) -> str | None:
    """Why `table` must not be used by this moebench (its tactics mean
    something else), or None."""
    if table.tactics_version != TACTICS_VERSION:
        return (f"tactics version {table.tactics_version} (moebench {table.moebench_version}) differs from"
                f" this moebench's {TACTICS_VERSION}; re-run `moebench tune`")  # fmt: skip
    return None


# ----------------------------------------------------------------------------- files


def read_table(path: str | Path) -> TuningTable:
    """The table in `path`. Raises FileNotFoundError naming a missing file,
    TableError (a ValueError) naming a corrupt or unreadable one, or one
    whose name does not match its content."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tuning table {path} does not exist")
    if not path.is_file():
        raise TableError(f"{path}: a tuning table must be a JSON file, this is not a regular file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TableError(f"{path}: not readable JSON: {error}") from error
    table = TuningTable.from_dict(data, str(path))
    if path.name != table.file_name:
        raise TableError(f"{path}: its content is the table {table.file_name}; the file name does not match")
    return table


# ----------------------------------------------------------------------------- runtime


_logged: set[str] = set()
_cache: dict[tuple[str, int, int], TuningTable | Exception] = {}


def reset_log_once() -> None:
    """Forget what was logged and the parsed-table cache (tests, long-lived
    processes after a re-tune)."""
    _logged.clear()
    _cache.clear()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def default_search_dirs() -> list[Path]:
    """$MOEBENCH_TUNING_DIR (os.pathsep-separated, in order) then the
    package's tables directory."""
    dirs = [Path(p) for p in os.environ.get(ENV_DIR, "").split(os.pathsep) if p.strip()]
    return [*dirs, PACKAGE_TABLES]


def _read_cached(path: Path) -> TuningTable:
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _cache:
        try:
            _cache[key] = read_table(path)
        except (TableError, OSError) as error:
            _cache[key] = error
    hit = _cache[key]
    if isinstance(hit, Exception):
        raise hit
    return hit


def _walk(name: str, search: list | None) -> Iterator[tuple[Path, TuningTable | str]]:
    """The table file `name` along `search` (default: default_search_dirs()),
    in order, read as the walk reaches it: (path, the usable table) or (path,
    the problem: one line naming the file, or a directory that does not
    exist). A directory without the file yields nothing. Never raises for a
    file."""
    for directory in default_search_dirs() if search is None else search:
        directory = Path(directory)
        path = directory / name
        if not path.exists():
            if directory != PACKAGE_TABLES and not directory.is_dir():
                yield directory, f"tuning directory {directory} does not exist (${ENV_DIR} or the search path)"
            continue
        try:
            table = _read_cached(path)
        except (TableError, OSError) as error:
            yield path, f"tuning table {path} is unusable: {error}"
            continue
        stale = stale_reason(table)
        if stale:
            yield path, f"tuning table {path} is stale: {stale}"
            continue
        yield path, table


def find_table(
    device_name: str, shape, *, top_k: int | None = None, search: list | None = None
) -> tuple[TuningTable | None, Path | None, list[str]]:
    """(the first usable table for `device_name` and `shape` along `search`
    (default: default_search_dirs()) or None, its path or None, the problems
    met on the way: one line each naming the file). The whole first table,
    e.g. to say whether any table covers the shape; which table serves one
    entry is `load_tactic`'s per-entry lookup. Never raises for a file;
    TypeError / ValueError for a bad shape."""
    problems: list[str] = []
    for path, hit in _walk(table_file_name(shape, device_name, top_k), search):
        if isinstance(hit, str):
            problems.append(hit)
        else:
            return hit, path, problems
    return None, None, problems


def _tables_phrase(paths: list[Path], singular: str, plural: str) -> str:
    """'tuning table A <singular>' or 'tuning tables A, B <plural>'."""
    listed = ", ".join(str(p) for p in paths)
    return f"tuning table {listed} {singular}" if len(paths) == 1 else f"tuning tables {listed} {plural}"


def _check_lookup(rows, stage, fp8) -> None:
    """The arguments of one entry lookup (ValueError / TypeError naming them)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 1 or 2, got {stage!r} (the pair-or-fused choice: load_layer_choice)")
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [1, {MAX_ROWS}], got {rows!r}")


def _first_holding(
    name: str, stage: int, rows: int, fp8: bool, search: list | None
) -> tuple[tuple[Path, TuningTable] | None, list[tuple[Path, TuningTable]], list[str]]:
    """(path and table of the first usable table `name` along `search` that
    holds the (family, stage, rows) entry, or None; the usable tables before
    it that lack it, in search order; the problems met on the way). Never raises."""
    found: tuple[Path, TuningTable] | None = None
    lacking: list[tuple[Path, TuningTable]] = []
    problems: list[str] = []
    try:
        for path, hit in _walk(name, search):
            if isinstance(hit, str):
                problems.append(hit)
            elif hit.entry(stage, rows, fp8) is None:
                lacking.append((path, hit))
            else:
                found = path, hit
                break
    except Exception as error:  # noqa: BLE001 - a table must never break the runtime
        problems.append(f"tuning table lookup for {name} failed: {type(error).__name__}: {error}")
    return found, lacking, problems


def lookup_entry(
    device_name: str,
    shape,
    rows: int,
    stage: int,
    *,
    top_k: int | None = None,
    search: list | None = None,
    fp8: bool = False,
) -> tuple[TableEntry, Path] | None:
    """(the entry, its file) that `load_tactic` takes for GEMM`stage` at
    `rows` of the FP8 (`fp8`) or BF16 family: the first usable table along
    `search` (default: default_search_dirs()) that holds it; None when no
    table does. A corrupt or stale table met on the way warns once (as
    `load_tactic`); a missing entry is not warned about (this only asks).
    Raises ValueError / TypeError only for bad arguments."""
    _check_lookup(rows, stage, fp8)
    name = table_file_name(ShapeClass.of(shape, top_k), device_name)
    found, _, problems = _first_holding(name, stage, rows, fp8, search)
    for line in problems:
        _log_once(logging.WARNING, line + "; falling back")
    if found is None:
        return None
    path, table = found
    return table.entry(stage, rows, fp8), path


def load_tactic(
    device_name: str,
    shape,
    rows: int,
    stage: int,
    *,
    top_k: int | None = None,
    search: list | None = None,
    num_sms: int = 132,
    wide_scales: bool = False,
    fp8: bool = False,
) -> tuple[GemmTactic, str]:
    """(tactic, source) for GEMM`stage` at `rows` token rows of `shape` on
    `device_name`: the entry of the first usable table along `search`
    (default: $MOEBENCH_TUNING_DIR, then the package's tables) that holds
    it, else the built-in default_tactic for the token tiles `rows` allows
    for. `fp8`: the FP8 kernel family's entry (the table's "fp8" part) and
    default (`default_fp8_tactic`; `wide_scales` is then the weights'
    special-scales flag, as `KernelWeights.scale_variant(True)`); else the
    BF16 family's.

    source: 'table <path> gemm<stage>[rows]' ('... fp8.gemm<stage>[rows]'
    for the FP8 family), <path> the file the entry came from, or 'default
    (...)'. A corrupt or stale table met on the way is skipped with one
    warning naming the file; an entry no table holds warns once naming the
    tables looked in; each table used is logged once (INFO). Raises
    ValueError / TypeError only for bad arguments (rows, stage, shape),
    never for a table.
    """
    _check_lookup(rows, stage, fp8)
    s = ShapeClass.of(shape, top_k)
    name = table_file_name(s, device_name)
    found, lacking, problems = _first_holding(name, stage, rows, fp8, search)
    for line in problems:
        _log_once(logging.WARNING, line + "; falling back")
    family = "fp8 " if fp8 else ""
    if found is not None:
        path, table = found
        note = "" if table.device.get("name") == device_name else f" (tuned on {table.device.get('name')})"
        _log_once(logging.INFO, f"moebench tuning: {name} from {path}{note}")
        return table.entry(stage, rows, fp8).tactic, f"table {path} {entry_path(stage, rows, fp8)}"
    paths = [path for path, _ in lacking]
    if fp8 and lacking and not any(table.fp8_entries for _, table in lacking):
        _log_once(logging.WARNING, _tables_phrase(paths, "holds", "hold") + " no FP8-family entries; using the"
                                   " built-in fp8 default tactics (run `moebench tune --fp8` on this GPU)")  # fmt: skip
    elif lacking:
        _log_once(logging.WARNING, _tables_phrase(paths, "has", "have") + f" no {family}entry for {STAGES[stage]}"
                                   f" rows={rows}; using the built-in {family}default")  # fmt: skip
    elif not problems:
        dirs = ", ".join(str(d) for d in (default_search_dirs() if search is None else search))
        _log_once(logging.WARNING, f"no tuning table {name} in {dirs}; using the built-in {family}default tactics"
                                   f" (run `moebench tune{' --fp8' if fp8 else ''}` on this GPU)")  # fmt: skip
    ctas = max_ctas(rows, s.top_k, s.experts)
    tactic = default_tactic(s.gemm_shape, stage, ctas, num_sms, wide_scales, fp8=fp8)
    return tactic, f"default ({family}{STAGES[stage]} rows={rows}, {ctas} token tiles)"


def lookup_layer_entry(
    device_name: str, shape, rows: int, *, top_k: int | None = None, search: list | None = None
) -> tuple[TableEntry | None, Path] | None:
    """(the fp8.fused entry or None, its file) of the table that serves the
    FP8 family at `rows`: the first usable table along `search` (default:
    default_search_dirs()) holding any FP8 entry at `rows` (GEMM1, GEMM2 or
    fp8.fused), so a pair-or-fused choice is never taken from a table behind
    one that re-tuned the pair without deciding again; None when no table
    holds one. A corrupt or stale table met on the way warns once. Raises
    ValueError / TypeError only for bad arguments."""
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [1, {MAX_ROWS}], got {rows!r}")
    name = table_file_name(ShapeClass.of(shape, top_k), device_name)
    found, problems = None, []
    try:
        for path, hit in _walk(name, search):
            if isinstance(hit, str):
                problems.append(hit)
            elif rows in hit.fused_entries or hit.entry(1, rows, True) or hit.entry(2, rows, True):
                found = hit.fused_entries.get(rows), path
                break
    except Exception as error:  # noqa: BLE001 - a table must never break the runtime
        problems.append(f"tuning table lookup for {name} failed: {type(error).__name__}: {error}")
    for line in problems:
        _log_once(logging.WARNING, line + "; falling back")
    return found


def load_layer_choice(
    device_name: str, shape, rows: int, *, top_k: int | None = None, search: list | None = None
) -> tuple[LayerChoice, str]:
    """(choice, source): whether the FP8 family runs its two GEMMs at `rows`
    as the pair or as the fused layer: the "fp8.fused" entry of the table
    `lookup_layer_entry` finds; the pair when that table has none, or no
    table holds FP8 entries at `rows` (no warning: the pair is the default,
    and a table tuned before the fused layer existed has no such entry).
    source: 'table <path> fp8.fused[rows]', 'the pair (table <path> has no
    fp8.fused[rows])' or 'default (the pair)'. Raises ValueError /
    TypeError only for bad arguments."""
    hit = lookup_layer_entry(device_name, shape, rows, top_k=top_k, search=search)
    if hit is None:
        return LayerChoice(None), "default (the pair)"
    entry, path = hit
    if entry is None:
        return LayerChoice(None), f"the pair (table {path} has no {entry_path(LAYER, rows, True)})"
    return entry.tactic, f"table {path} {entry_path(LAYER, rows, True)}"
