"""Which kernel family a layer runs by default: FP8 or BF16.

Two families compute our routed-expert GEMMs: the FP8 one (e4m3 weights
for wgmma, the MXFP8 x / H as they are; `_f8` tactics) and the BF16 one
(weights decoded to BF16 for mma.sync). Each needs the weights in its own
kernel layout, a copy as large as the canonical MXFP4 weights, so a layer
(`RoutedExpertGemm`) holds one family for all row counts: holding both
would take every layer's experts from two copies (canonical + kernel
layout) to three, to save at best the few µs where the families' order
flips between row counts. The choice is per layer (shape class), made from
the tuning tables' measured µs:

- per rows 1-8, each family's time is the routed-path time (route + GEMM1
  + GEMM2, what `moebench tune` times) of its entries the runtime would take
  (`table.lookup_entry`: the first table along the search path holding
  the (family, stage, rows) entry), the lower of its GEMM1 and GEMM2
  entries' medians (each entry times the whole path with that stage tuned;
  the one timed beside the other stage's tuned tactic is the table's pair,
  and the lower); the faster family at that row count is the one with the
  lower time, or the only one with a time;
- the layer runs the family every row count prefers; where row counts
  disagree, the family with the lower sum of times over the row counts both
  families time (if there is none, the family preferred at more row
  counts); ties go to FP8;
- with no entry of either family, the FP8 family where its built-in
  tactics fit the shape (`default_fp8_tactic` for both GEMMs at every row
  count), else BF16;
- a family whose built-in tactics do not fit the shape is never chosen
  when the other's do (its row counts without a table entry could not run).

`resolve_family` is what `RoutedExpertGemm` asks: an explicit `fp8` flag
or explicit tactics decide first, then the tables (above).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moebench.kernels.table import ShapeClass, _log_once, lookup_entry, lookup_layer_entry
from moebench.kernels.tactic import GemmTactic, default_fp8_tactic, default_tactic
from moebench.record import MAX_ROWS, max_ctas

__all__ = ["BF16", "FP8", "FamilyChoice", "RowsTimes", "builtin_refusal", "choose_family", "explicit_tactics",
           "resolve_family", "rows_text", "rows_times"]  # fmt: skip

FP8 = "fp8"
BF16 = "bf16"


@dataclass(frozen=True)
class RowsTimes:
    """One row count's routed-path µs of each family in the tables (None:
    no entry of that family at these rows)."""

    rows: int
    bf16_us: float | None
    fp8_us: float | None

    @property
    def faster(self) -> str | None:
        """FP8 / BF16: the family with the lower time, or the only one with a
        time (a tie goes to FP8); None when neither has one."""
        if self.fp8_us is None:
            return None if self.bf16_us is None else BF16
        if self.bf16_us is None:
            return FP8
        return FP8 if self.fp8_us <= self.bf16_us else BF16


@dataclass(frozen=True)
class FamilyChoice:
    """The family a layer runs: fp8 (True: FP8, False: BF16); source: how it
    was chosen ("asked": an explicit fp8 flag, "tactics": the explicit
    tactics' family, "tables": the tuning tables' µs, "built-in": no table
    entry, the built-in rule); reason: one line saying why; times: the
    tables' per-rows µs the choice read (empty unless source is "tables"
    or "built-in")."""

    fp8: bool
    source: str
    reason: str
    times: tuple[RowsTimes, ...] = ()

    @property
    def family(self) -> str:
        return FP8 if self.fp8 else BF16

    def describe(self) -> str:
        """'fp8 (tables: ...)': the family and why, for logs and reports."""
        return f"{self.family} ({self.source}: {self.reason})"


def rows_text(rows) -> str:
    """'1-3, 5, 7-8' for rows [1, 2, 3, 5, 7, 8]."""
    rows = sorted(set(rows))
    parts, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _family_us(device_name: str, shape: ShapeClass, rows: int, fp8: bool, search) -> float | None:
    """The lower median µs of the family's GEMM1 / GEMM2 entries at `rows`
    that the runtime takes, or None when the tables hold neither; for FP8,
    where the runtime's fp8.fused entry names a fused tactic, that entry's
    µs (the fused layer's, route included, as the GEMM entries' are)."""
    if fp8:
        hit = lookup_layer_entry(device_name, shape, rows, search=search)
        if hit is not None and hit[0] is not None and hit[0].tactic.fused is not None:
            return hit[0].median_us
    times = [
        hit[0].median_us
        for stage in (1, 2)
        if (hit := lookup_entry(device_name, shape, rows, stage, search=search, fp8=fp8)) is not None
    ]
    return min(times) if times else None


def rows_times(device_name: str, shape, *, top_k: int | None = None, search: list | None = None
               ) -> tuple[RowsTimes, ...]:  # fmt: skip
    """Per rows 1-8, each family's routed-path µs in the tuning tables of
    `device_name` and `shape` along `search` (default: $MOEBENCH_TUNING_DIR,
    then the package's tables): the lower of the GEMM1 / GEMM2 entries' medians the runtime would
    take (module docstring). Raises TypeError / ValueError for a bad shape, never for a table."""
    s = ShapeClass.of(shape, top_k)
    return tuple(RowsTimes(r, _family_us(device_name, s, r, False, search), _family_us(device_name, s, r, True, search))
                 for r in range(1, MAX_ROWS + 1))  # fmt: skip


def builtin_refusal(shape, top_k: int, fp8: bool, num_sms: int = 132) -> str | None:
    """Why the family's built-in tactics (`default_fp8_tactic` for FP8,
    `default_tactic` for BF16, plain scales) cannot run GEMM1 or GEMM2 of
    `shape` at some row count 1-8, or None when they fit everywhere."""
    s = ShapeClass.of(shape, top_k)
    for rows in range(1, MAX_ROWS + 1):
        ctas = max_ctas(rows, s.top_k, s.experts)
        for stage in (1, 2):
            try:
                if fp8:
                    default_fp8_tactic(s.gemm_shape, stage, ctas, num_sms)
                else:
                    default_tactic(s.gemm_shape, stage, ctas, num_sms)
            except ValueError as error:
                return str(error)
    return None


def _builtin_choice(refusals: dict[bool, str | None], times: tuple[RowsTimes, ...]) -> FamilyChoice:
    """The rule without table entries: FP8 where its built-ins fit, else BF16."""
    if refusals[True] is None:
        return FamilyChoice(True, "built-in", "no tuning-table entry; the fp8 built-in tactics fit", times)
    return FamilyChoice(False, "built-in", f"no tuning-table entry; {refusals[True]}", times)


def _sum(times, fp8: bool) -> float:
    return sum(t.fp8_us if fp8 else t.bf16_us for t in times)


def choose_family(
    device_name: str,
    shape,
    *,
    top_k: int | None = None,
    search: list | None = None,
    num_sms: int = 132,
) -> FamilyChoice:
    """The family a layer of `shape` (anything `ShapeClass.of` takes, with
    `top_k`) runs by default on `device_name` with `num_sms` SMs, from the
    tuning tables along `search` (default: $MOEBENCH_TUNING_DIR, then the
    package's): the rule in the module docstring. Logs the choice once per
    shape class (INFO). Raises TypeError / ValueError for a bad shape, never for a table."""
    s = ShapeClass.of(shape, top_k)
    times = rows_times(device_name, s, search=search)
    refusals = {fp8: builtin_refusal(s, s.top_k, fp8, num_sms) for fp8 in (False, True)}
    prefs = {t.rows: t.faster for t in times if t.faster is not None}
    if not prefs:
        choice = _builtin_choice(refusals, times)
    elif refusals[True] is not None and refusals[False] is None:
        choice = FamilyChoice(False, "tables", f"the fp8 family cannot run every row count: {refusals[True]}", times)
    elif refusals[False] is not None and refusals[True] is None:
        choice = FamilyChoice(True, "tables", f"the BF16 family cannot run every row count: {refusals[False]}",
                              times)  # fmt: skip
    else:
        choice = _from_times(times, prefs)
    _log_once(logging.INFO, f"moebench kernel family for {s.describe()} on {device_name}: {choice.describe()}")
    return choice


def _from_times(times: tuple[RowsTimes, ...], prefs: dict[int, str]) -> FamilyChoice:
    """The tables' choice from the per-rows preferences (at least one)."""
    by = {fam: [r for r, f in prefs.items() if f == fam] for fam in (FP8, BF16)}
    said = "; ".join(f"{fam} faster at rows {rows_text(rows)}" for fam, rows in by.items() if rows)
    if not by[BF16] or not by[FP8]:
        fp8 = bool(by[FP8])
        return FamilyChoice(fp8, "tables", said, times)
    both = [t for t in times if t.fp8_us is not None and t.bf16_us is not None]
    if both:
        f8, b16 = _sum(both, True), _sum(both, False)
        fp8 = f8 <= b16
        why = (f"{said}; one family per layer: {FP8 if fp8 else BF16}, {abs(b16 - f8):.1f} µs less summed over"
               f" rows {rows_text(t.rows for t in both)}")  # fmt: skip
    else:
        fp8 = len(by[FP8]) >= len(by[BF16])
        why = f"{said}; one family per layer: {FP8 if fp8 else BF16}, faster at more row counts"
    return FamilyChoice(fp8, "tables", why, times)


def resolve_family(
    fp8: bool | None,
    tactics: dict | None,
    device_name: str,
    shape,
    *,
    top_k: int | None = None,
    num_sms: int = 132,
    search: list | None = None,
) -> FamilyChoice:
    """The family a `RoutedExpertGemm(weights, top_k, tactics, fp8=fp8)`
    runs: `fp8` True / False when given ("asked"); else the family of the
    explicit tactics in `tactics` ({stage: GemmTactic | None}; all of one
    family, "tactics"); else, with `tactics` naming none (e.g. `{}`: the
    built-in tactics, tables ignored), the built-in rule (FP8 where its
    built-in tactics fit, "built-in"); else (`tactics` None) the tables'
    choice (`choose_family`). Raises TypeError for an fp8 that is not a
    bool or None, or tactics that are not such a dict; ValueError for
    tactics of both families, or tactics of the family `fp8` does not ask for."""
    if fp8 is not None and not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool or None (None: the family the tuning tables choose), got"
                        f" {type(fp8).__name__}")  # fmt: skip
    given = explicit_tactics(tactics)
    families = {t.fp8 for t in given.values()}
    if len(families) > 1:
        names = ", ".join(f"tactics[{st}] {t.name}" for st, t in sorted(given.items()))
        raise ValueError(f"tactics mix the fp8 and BF16 families ({names}): the weights are laid out for one")
    if fp8 is not None:
        for stage, t in sorted(given.items()):
            if t.fp8 != fp8:
                raise ValueError(f"tactics[{stage}] ({t.name}) is {'an' if t.fp8 else 'not an'} fp8 tactic"
                                 f" but fp8={fp8}: the weights are laid out for one operand")  # fmt: skip
        return FamilyChoice(fp8, "asked", f"fp8={fp8}")
    if given:
        (f,) = families
        return FamilyChoice(f, "tactics", f"the explicit tactics are {'fp8' if f else 'BF16'} ones")
    s = ShapeClass.of(shape, top_k)
    if tactics is not None:
        return _builtin_choice({f: builtin_refusal(s, s.top_k, f, num_sms) for f in (False, True)}, ())
    return choose_family(device_name, s, search=search, num_sms=num_sms)


def explicit_tactics(tactics) -> dict[int, GemmTactic]:
    """The GemmTactics of `tactics` (None, or a dict {1|2: GemmTactic | None});
    TypeError / ValueError for anything else."""
    if tactics is None:
        return {}
    if not isinstance(tactics, dict):
        raise TypeError(f"tactics must be None or a dict {{stage: GemmTactic}}, got {type(tactics).__name__}")
    out = {}
    for stage, t in tactics.items():
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ValueError(f"tactics keys must be the stages 1 and 2, got {stage!r}")
        if t is not None and not isinstance(t, GemmTactic):
            raise TypeError(f"tactics[{stage}] must be a GemmTactic or None, got {type(t).__name__}")
        if t is not None:
            out[stage] = t
    return out
