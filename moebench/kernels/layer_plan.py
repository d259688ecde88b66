"""One MoE layer's plan: which kernels run it, per row count, and why.

A `LayerPlan` says, for one layer (shape class), everything
`RoutedExpertGemm` used to decide in its constructor:

- the kernel family (a `FamilyChoice`: FP8 or BF16, how and why chosen);
- per (stage, rows) the GEMM tactic (`PlannedTactic`: the tactic, where it
  came from and, where it differs from what that source holds, why: the
  `_a16` twin of a BF16 table entry, a fallback to the built-in default);
- per rows the pair-or-fused choice (`PlannedFused`: a FusedTactic or None
  for the pair, with its source).

It is pure and table-driven (tuning tables, built-in defaults; no CuTe DSL,
no torch): `plan_layer` makes one, the binding (`RoutedExpertGemm`)
allocates and compiles what a plan names, and the tuner times a candidate
by binding the plan with that candidate substituted (`with_tactic`,
`with_fused`), so what is tuned is what runs. Every plan is validated when
made: all 16 (stage, rows) tactics of the family and valid for the shape,
fused tactics only in the FP8 family and valid for the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from moebench.kernels.family import FamilyChoice, explicit_tactics
from moebench.kernels.fused_tactic import FusedTactic, default_fused_tactic
from moebench.kernels.table import ShapeClass, load_layer_choice, load_tactic
from moebench.kernels.tactic import GemmTactic, default_tactic
from moebench.record import MAX_ROWS, max_ctas

__all__ = ["EXPLICIT", "LayerPlan", "PlannedFused", "PlannedTactic", "STAGES", "plan_layer"]

#: The GEMM stages a plan holds a tactic for.
STAGES = (1, 2)
#: The source of a tactic the caller passed (`RoutedExpertGemm(tactics=...)`).
EXPLICIT = "explicit"
#: The source of a tactic substituted by `with_tactic` / `with_fused` unless told otherwise.
CANDIDATE = "candidate"
PAIR = "the pair"


def _check_source(owner: str, source, reason) -> None:
    if not isinstance(source, str) or not source:
        raise ValueError(f"{owner}: source must be a non-empty str, got {source!r}")
    if not isinstance(reason, str):
        raise TypeError(f"{owner}: reason must be a str, got {type(reason).__name__}")


@dataclass(frozen=True)
class PlannedTactic:
    """One (stage, rows)'s GEMM tactic. source: where it came from ('table
    <path> gemm1[4]' / '... fp8.gemm1[4]', 'default (...)', 'explicit',
    'candidate'); reason: why the tactic is not the source's as it is ('' when
    it is: e.g. the `_a16` twin of a table entry, the family's default
    instead of a table tactic of the other family)."""

    tactic: GemmTactic
    source: str
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tactic, GemmTactic):
            raise TypeError(f"tactic must be a GemmTactic, got {type(self.tactic).__name__}")
        _check_source("PlannedTactic", self.source, self.reason)


@dataclass(frozen=True)
class PlannedFused:
    """One row count's pair-or-fused choice: `fused` a FusedTactic (one fused
    launch) or None (the pair); source: why ('the pair', 'built-in', 'table
    <path> fp8.fused[1]', 'the pair: ... cannot run: ...')."""

    fused: FusedTactic | None
    source: str

    def __post_init__(self) -> None:
        if self.fused is not None and not isinstance(self.fused, FusedTactic):
            raise TypeError(f"fused must be a FusedTactic or None, got {type(self.fused).__name__}")
        _check_source("PlannedFused", self.source, "")


@dataclass(frozen=True)
class LayerPlan:
    """What one layer runs (module docstring). shape: the layer's ShapeClass;
    family: the FamilyChoice; wide_scales: the weights' compile-time scale
    flag for that family (`KernelWeights.scale_variant(fp8)`; the defaults
    depend on it); gemms: per rows 1..MAX_ROWS the (GEMM1, GEMM2)
    PlannedTactics; fused: per rows the PlannedFused. Raises TypeError /
    ValueError (naming the stage and rows) for anything that could not run."""

    shape: ShapeClass
    family: FamilyChoice
    wide_scales: bool
    gemms: tuple[tuple[PlannedTactic, PlannedTactic], ...]
    fused: tuple[PlannedFused, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ShapeClass):
            raise TypeError(f"shape must be a ShapeClass, got {type(self.shape).__name__}")
        if not isinstance(self.family, FamilyChoice):
            raise TypeError(f"family must be a FamilyChoice, got {type(self.family).__name__}")
        if not isinstance(self.wide_scales, bool):
            raise TypeError(f"wide_scales must be a bool, got {type(self.wide_scales).__name__}")
        if not isinstance(self.gemms, tuple) or len(self.gemms) != MAX_ROWS:
            raise ValueError(f"gemms must be a tuple of {MAX_ROWS} (GEMM1, GEMM2) pairs, one per rows")
        if not isinstance(self.fused, tuple) or len(self.fused) != MAX_ROWS:
            raise ValueError(f"fused must be a tuple of {MAX_ROWS} PlannedFused, one per rows")
        for rows in range(1, MAX_ROWS + 1):
            self._check_rows(rows)

    def _check_rows(self, rows: int) -> None:
        pair = self.gemms[rows - 1]
        if not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(p, PlannedTactic) for p in pair):
            raise TypeError(f"gemms[rows {rows}] must be a (GEMM1, GEMM2) pair of PlannedTactic, got {pair!r:.120}")
        for stage, planned in zip(STAGES, pair):
            t = planned.tactic
            if t.fp8 != self.family.fp8:
                raise ValueError(
                    f"GEMM{stage} rows {rows}: {t.name} is {'an' if t.fp8 else 'not an'} fp8 tactic but the layer"
                    f" runs the {self.family.family} family ({planned.source})"
                )
            reason = t.valid_for(self.shape.gemm_shape, stage)
            if reason:
                raise ValueError(f"tactics[{stage}] ({t.name}) cannot run GEMM{stage} at rows {rows}: {reason}")
        choice = self.fused[rows - 1]
        if not isinstance(choice, PlannedFused):
            raise TypeError(f"fused[rows {rows}] must be a PlannedFused, got {type(choice).__name__}")
        if choice.fused is not None:
            if not self.family.fp8:
                raise ValueError(f"rows {rows}: the fused layer ({choice.fused.name}) needs the FP8 family,"
                                 f" the layer runs {self.family.family}")  # fmt: skip
            reason = choice.fused.why_invalid(self.shape.gemm_shape)
            if reason:
                raise ValueError(f"rows {rows}: fused {choice.fused.name} cannot run: {reason}")

    # ------------------------------------------------------------------ reading
    @property
    def fp8(self) -> bool:
        return self.family.fp8

    def planned(self, stage: int, rows: int) -> PlannedTactic:
        """The PlannedTactic of GEMM`stage` at `rows` (ValueError for others)."""
        _check_key(stage, rows)
        return self.gemms[rows - 1][stage - 1]

    def tactic(self, stage: int, rows: int) -> GemmTactic:
        return self.planned(stage, rows).tactic

    def fused_at(self, rows: int) -> FusedTactic | None:
        """The fused tactic at `rows`, or None (the pair)."""
        _check_key(1, rows)
        return self.fused[rows - 1].fused

    @property
    def tactics(self) -> dict[tuple[int, int], GemmTactic]:
        """{(stage, rows): GemmTactic} (a new dict: the plan is frozen)."""
        return {(s, r): self.gemms[r - 1][s - 1].tactic for r in range(1, MAX_ROWS + 1) for s in STAGES}

    @property
    def tactic_sources(self) -> dict[tuple[int, int], str]:
        return {(s, r): self.gemms[r - 1][s - 1].source for r in range(1, MAX_ROWS + 1) for s in STAGES}

    @property
    def fused_tactics(self) -> dict[int, FusedTactic | None]:
        return {r: self.fused[r - 1].fused for r in range(1, MAX_ROWS + 1)}

    @property
    def fused_sources(self) -> dict[int, str]:
        return {r: self.fused[r - 1].source for r in range(1, MAX_ROWS + 1)}

    def ctas(self, rows: int) -> int:
        """Token tiles the route record allows for at `rows` (ValueError for rows outside 1..MAX_ROWS)."""
        _check_key(1, rows)
        return max_ctas(rows, self.shape.top_k, self.shape.experts)

    # ------------------------------------------------------------------ substituting
    def with_tactic(self, stage: int, rows: int, tactic: GemmTactic, source: str = CANDIDATE) -> LayerPlan:
        """This plan with GEMM`stage` at `rows` running `tactic` (validated
        again: ValueError where it cannot run)."""
        _check_key(stage, rows)
        pair = list(self.gemms[rows - 1])
        pair[stage - 1] = PlannedTactic(tactic, source)
        gemms = (*self.gemms[: rows - 1], tuple(pair), *self.gemms[rows:])
        return replace(self, gemms=gemms)

    def with_fused(self, rows: int, fused: FusedTactic | None, source: str = CANDIDATE) -> LayerPlan:
        """This plan with `rows` running `fused` (None: the pair)."""
        _check_key(1, rows)
        return replace(self, fused=(*self.fused[: rows - 1], PlannedFused(fused, source), *self.fused[rows:]))

    def describe(self, rows: int) -> str:
        """'fp8 family (tables); gemm1 NAME (source); gemm2 NAME (source)' or '...; fused NAME (source)'."""
        _check_key(1, rows)
        parts = [f"{self.family.family} family ({self.family.source})"]
        f = self.fused[rows - 1]
        if f.fused is not None:
            return "; ".join([*parts, f"fused {f.fused.name} ({f.source})"])
        for stage in STAGES:
            p = self.planned(stage, rows)
            parts.append(f"gemm{stage} {p.tactic.name} ({p.source}{'; ' + p.reason if p.reason else ''})")
        return "; ".join(parts)


def _check_key(stage, rows) -> None:
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [1, {MAX_ROWS}], got {rows!r}")


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Where:
    """Where a plan's tactics are looked up: the device, its SMs, the
    tables' search path (None: the runtime's)."""

    device_name: str
    num_sms: int
    tables: list | None


def _gemm_choice(shape: ShapeClass, fp8: bool, wide: bool, where: _Where, stage: int, rows: int,
                 tactics: dict | None, act_bf16: bool) -> PlannedTactic:  # fmt: skip
    """One (stage, rows): the caller's tactic as given, else the table's, else
    the built-in default (also where a table holds a tactic of the other
    family, and for a stage the caller's `tactics` leave out); a table's or
    default BF16 tactic runs as its twin of the layer's operand (`_a16`
    with act_bf16)."""
    ctas = max_ctas(rows, shape.top_k, shape.experts)
    if tactics is not None and tactics.get(stage) is not None:
        return PlannedTactic(tactics[stage], EXPLICIT)
    if tactics is not None:  # explicit tactics without this stage: the built-in default (tables ignored)
        tactic, source = default_tactic(shape.gemm_shape, stage, ctas, where.num_sms, wide, fp8=fp8), "default"
    else:
        tactic, source = load_tactic(where.device_name, shape, rows, stage, num_sms=where.num_sms, wide_scales=wide,
                                     fp8=fp8, search=where.tables)  # fmt: skip
    reason = ""
    if tactic.fp8 != fp8:
        # never from a valid table (each family's part holds its own tactics): this family's default
        family = "fp8" if fp8 else "BF16"
        why = f"; the table's {tactic.name} is not" if source.startswith("table") else ""
        reason = f"the table's {tactic.name} is not of the {family} family" if why else ""
        tactic = default_tactic(shape.gemm_shape, stage, ctas, where.num_sms, wide, fp8=fp8)
        source = f"default ({family}{why})"
    if not fp8 and tactic.act_bf16 != act_bf16:
        # the operand the layer runs: a table tuned with the other one gives its twin
        twin = replace(tactic, act_bf16=act_bf16)
        if not twin.valid_for(shape.gemm_shape, stage):
            reason = f"the {'_a16' if act_bf16 else 'MXFP8-operand'} twin of {tactic.name} (act_bf16={act_bf16})"
            tactic = twin
    return PlannedTactic(tactic, source, reason)


def _fused_choice(shape: ShapeClass, fp8: bool, where: _Where, rows: int, fused: bool | None,
                  explicit: bool) -> PlannedFused:  # fmt: skip
    """One row count's pair-or-fused choice (`plan_layer`'s `fused`)."""
    if fused:
        ft = default_fused_tactic(shape.gemm_shape, max_ctas(rows, shape.top_k, shape.experts), where.num_sms)
        return PlannedFused(ft, "built-in" if ft is not None else f"{PAIR}: no built-in fused tactic fits")
    if fused is None and fp8 and not explicit:
        choice, source = load_layer_choice(where.device_name, shape, rows, search=where.tables)
        ft = choice.fused
        reason = ft.why_invalid(shape.gemm_shape) if ft is not None else None
        if reason:
            return PlannedFused(None, f"{PAIR}: {choice.name} ({source}) cannot run: {reason}")
        return PlannedFused(ft, source)
    return PlannedFused(None, PAIR)


def plan_layer(
    shape: ShapeClass,
    family: FamilyChoice,
    *,
    device_name: str,
    num_sms: int,
    wide_scales: bool = False,
    tactics: dict[int, GemmTactic] | None = None,
    act_bf16: bool = True,
    fused: bool | None = None,
    tables: list | None = None,
) -> LayerPlan:
    """The LayerPlan of a layer of `shape` running `family` (from
    `family.resolve_family`) on `device_name` with `num_sms` SMs.

    Per (stage, rows): with `tactics` None the entry of the first tuning
    table along `tables` (None: $MOEBENCH_TUNING_DIR, then the package's)
    that holds it, else the built-in default (`load_tactic`; never raises
    for a table); a BF16 table entry of the other activation operand gives
    its twin (`act_bf16`, default True: the `_a16` twins); with `tactics`
    ({stage: GemmTactic}) the caller's per stage as given, else the built-in
    default. Per rows, `fused`: None: the tables' "fp8.fused" choice (FP8
    family, no explicit `tactics`; else the pair); True: the built-in fused
    tactic where one fits (the FP8 family only: ValueError otherwise);
    False: the pair. `wide_scales`: the weights' scale flag for the family.
    Raises TypeError / ValueError for bad arguments (tactics not such a dict,
    num_sms not a positive int, tables not a list of directories) or a tactic that cannot
    run the shape (naming the stage)."""
    if not isinstance(shape, ShapeClass):
        raise TypeError(f"shape must be a ShapeClass, got {type(shape).__name__}")
    if not isinstance(family, FamilyChoice):
        raise TypeError(f"family must be a FamilyChoice, got {type(family).__name__}")
    for name, v in (("act_bf16", act_bf16), ("wide_scales", wide_scales)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be None or a bool, got {type(fused).__name__}")
    # a list, a stage key 3 or '1', a name instead of a GemmTactic: an error, not the defaults
    explicit_tactics(tactics)
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int (the device's SMs), got {num_sms!r}")
    if tables is not None and (
        not isinstance(tables, (list, tuple)) or not all(isinstance(d, (str, Path)) for d in tables)
    ):
        raise TypeError(f"tables must be None or a list of directories (str or Path), got {tables!r:.120}")
    if fused and not family.fp8:
        raise ValueError(f"fused=True needs the FP8 family; this layer runs {family.family} ({family.source}):"
                         " pass fp8=True")  # fmt: skip
    where = _Where(device_name, num_sms, tables)
    gemms = tuple(
        tuple(_gemm_choice(shape, family.fp8, wide_scales, where, stage, rows, tactics, act_bf16) for stage in STAGES)
        for rows in range(1, MAX_ROWS + 1)
    )
    fused_plan = tuple(_fused_choice(shape, family.fp8, where, rows, fused, tactics is not None)
                       for rows in range(1, MAX_ROWS + 1))  # fmt: skip
    return LayerPlan(shape, family, wide_scales, gemms, fused_plan)
