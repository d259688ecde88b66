"""The tactic space of the routed-expert GEMMs, as data.

A `TacticSpace` lists the values each `GemmTactic` field may take; its
product, filtered by the validity rules below, is what the tuner tries for
one shape class and stage. The rules:

1. `GemmTactic.valid_for(shape, stage)`: the kernel's own shape rules (GEMM1
   items cover whole 64-row gate/up blocks and divide 2*I; GEMM2 items divide
   H; no more K-splitting warps than 32-K chunks).
2. Occupancy: `ctas_per_sm` CTAs of `warps` warps must fit one SM (at most
   MAX_WARPS_PER_SM resident warps).
3. Shared memory: the fp32 partial sums of a CTA (`partial_smem_bytes`,
   plus SMEM_RESERVED_PER_CTA) times `ctas_per_sm` fit SMEM_PER_SM; one CTA
   at most SMEM_PER_CTA (`kernels.limits`).
4. Registers (pruning, not a hard limit: the compiler spills instead of
   failing): `estimated_registers` must fit the per-thread share of the
   register file at `ctas_per_sm` CTAs (min_blocks_per_mp), capped at 255.
5. With `ctas` token tiles known (rows fixed), a non-persistent tactic whose
   grid equals its persistent twin's (every item fits the persistent grid)
   is dropped as a duplicate.

`NeighbourSpace` (`SPACES["ship"]`) is the other kind: the built-in defaults
of a shape and their nearest neighbours, at most 10 per shape and stage,
what the shipped tables are tuned over (its docstring says why those).

`Fp8Space` (`FP8_SPACES`, `moebench tune --fp8`) is the FP8 (wgmma)
family's: its defaults (`default_fp8_tactic`), the warp-specialized variants
measured in perf-notes v11 (F8_BULK_1 / F8_BULK_2) and their neighbours; the
rules are `GemmTactic.valid_for` (shape, K chunks, shared memory) and rule 2
(the BF16 kernels' register estimate and partial-sum model do not apply).

A tactic's name is `GemmTactic.to_name` / `GemmTactic.from_name`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace

from moebench.kernels.limits import (
    MAX_REGISTERS_PER_THREAD, MAX_WARPS_PER_SM, REGISTERS_PER_SM, SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA,
)  # fmt: skip
from moebench.kernels.tactic import (
    MAX_STAGES, MAX_WARPS, GemmShape, GemmTactic, default_fp8_tactic, default_tactic, partial_smem_bytes,
    two_plane_twin,
)  # fmt: skip
from moebench.record import MAX_ROWS, MAX_TOP_K, max_ctas

#: Registers a lane needs besides its load buffers and accumulators
#: (addresses, loop state, the decode and the activation fragments).
REGISTER_OVERHEAD = 40


@dataclass(frozen=True)
class TacticSpace:
    """The values each GemmTactic field may take (the product is filtered by
    the module's rules). `warps` lists (warps_m, warps_k) pairs."""

    tile_rows: tuple[int, ...] = (32, 64, 128)
    warps: tuple[tuple[int, int], ...] = (
        (1, 4), (2, 2), (4, 1),
        (1, 8), (2, 4), (4, 2), (8, 1),
        (1, 16), (2, 8), (4, 4), (8, 2), (16, 1),
    )  # fmt: skip
    unroll: tuple[int, ...] = (2, 3, 4)
    ctas_per_sm: tuple[int, ...] = (1, 2, 3, 4)
    persistent: tuple[bool, ...] = (True, False)
    pdl: tuple[bool, ...] = (True,)

    def __post_init__(self) -> None:
        for f in fields(self):
            values = getattr(self, f.name)
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{f.name} must be a non-empty tuple, got {values!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{f.name} has duplicates: {values}")
        for pair in self.warps:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"warps must hold (warps_m, warps_k) pairs, got {pair!r}")
        # Every value must make a GemmTactic (raises ValueError/TypeError naming the field).
        self.tactics()

    def size(self) -> int:
        """Points of the product before the validity rules."""
        return (len(self.tile_rows) * len(self.warps) * len(self.unroll) * len(self.ctas_per_sm)
                * len(self.persistent) * len(self.pdl))  # fmt: skip

    def tactics(self) -> list[GemmTactic]:
        """Every GemmTactic of the product that the dataclass accepts
        (warps_m * warps_k <= MAX_WARPS), in product order."""
        out = []
        for t, (wm, wk), u, c, p, d in itertools.product(
            self.tile_rows, self.warps, self.unroll, self.ctas_per_sm, self.persistent, self.pdl
        ):
            if wm * wk > MAX_WARPS:
                continue
            out.append(GemmTactic(tile_rows=t, warps_m=wm, warps_k=wk, unroll=u, ctas_per_sm=c,
                                  persistent=p, pdl=d))  # fmt: skip
        return out


#: Every combination worth trying (~200-400 valid per shape class and stage).
FULL_SPACE = TacticSpace()
#: What `moebench tune` tries by default (~30-90 valid per stage: the
#: compile time of each candidate dominates a tuning run).
QUICK_SPACE = TacticSpace(
    tile_rows=(32, 64),
    warps=((1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1)),
    unroll=(2, 4),
    ctas_per_sm=(1, 2, 3, 4),
    persistent=(True,),
)
DEFAULT_SPACE = QUICK_SPACE


def _distinct_defaults(s: GemmShape, pick) -> list[GemmTactic]:
    """The distinct tactics `pick(ctas)` returns over every token-tile count
    rows 1..8 at any top_k can need for `s`, then ctas unknown (None), in the
    order met; a ctas for which `pick` raises ValueError is left out."""
    counts = sorted({max_ctas(r, k, s.experts) for r in range(1, MAX_ROWS + 1)
                     for k in range(1, MAX_TOP_K + 1)})  # fmt: skip
    out: list[GemmTactic] = []
    for ctas in [*counts, None]:
        try:
            t = pick(ctas)
        except ValueError:
            continue
        if t not in out:
            out.append(t)
    return out


def _round_robin(rings: list[list[GemmTactic]]):
    """Step 0 of every ring, then step 1 of every ring, ... (rings of unequal length)."""
    for step in range(max((len(r) for r in rings), default=0)):
        for ring in rings:
            if step < len(ring):
                yield ring[step]


@dataclass(frozen=True)
class NeighbourSpace:
    """The built-in defaults of a shape and their nearest neighbours: the
    small space the shipped tables are tuned over (`moebench tune --space
    ship`), where the quick space (~1950 compiles and ~15600 timed
    candidates for the 3 presets x TP 1/2/4/8 x rows 1-8 x both GEMMs) does
    not fit a few minutes of GPU time.

    Per (shape, stage) one set of at most `limit` tactics, the same for every
    row count (so a tuning run compiles at most `limit` kernels per shape and
    stage), built in this order:

    1. every tactic `default_tactic` picks for this shape at any token-tile
       count (GEMM1: 8 warps x unroll 4 at 1 CTA/SM, 8 x 2 at 2, 4 x 4 at 3;
       GEMM2: 512-row items of 8 warps, or 128-row items at 4 CTAs/SM). The
       defaults guess the touched tiles (EXPECTED_TILE_FRACTION of the
       possible ones); the ladder lets the measured routing pick its rung.
    2. one-field changes of each default, round-robin over the defaults, in
       the order docs/perf-notes.md ranks the levers:
       a. `ctas_per_sm` +-1: how many items one persistent pass holds is what
          separated good from bad tactics in v1 -> v2 (rows 6: a second wave
          of items on a third of the CTAs nearly doubled GEMM1's time;
          "ctas-aware grid matters");
       b. `unroll` +-1 (2..4): bytes in flight per warp, the lever for the
          latency-bound small rows (open item 3);
       c. `warps_k` x2 / /2: more or fewer warps streaming the same item;
       d. `tile_rows` 32 <-> 64 at the same item rows (warps_m x2 / /2);
       e. `persistent` flipped (v2: no better when the grid holds every
          item, so last).
    Every change must pass the space's rules (`why_invalid` with register
    pruning), and `split_k` stays 1: cross-CTA split-K was measured slower
    on its own at every row count (perf-notes v3).

    `valid_tactics(space=SHIP_SPACE)` returns this set (the default for the
    row count first) less the non-persistent duplicates of rule 5.
    """

    limit: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.limit, int) or isinstance(self.limit, bool) or self.limit < 1:
            raise ValueError(f"limit must be a positive int, got {self.limit!r}")

    @staticmethod
    def defaults(shape, stage: int, num_sms: int = 132, wide_scales: bool = False) -> list[GemmTactic]:
        """The distinct default tactics of `shape` over every token-tile count
        rows 1..8 at any top_k can need (and ctas unknown), in the order met."""
        s = GemmShape.of(shape)
        return _distinct_defaults(s, lambda ctas: default_tactic(s, stage, ctas, num_sms, wide_scales))

    @staticmethod
    def changes(t: GemmTactic) -> list[GemmTactic]:
        """One-field changes of `t` in the class docstring's order (a-e);
        not yet checked against any rule."""
        out = []
        for c in (t.ctas_per_sm + 1, t.ctas_per_sm - 1):
            if 1 <= c <= 4:
                out.append(replace(t, ctas_per_sm=c))
        for u in (t.unroll + 1, t.unroll - 1):
            if 2 <= u <= 4:
                out.append(replace(t, unroll=u))
        for wk in (t.warps_k * 2, t.warps_k // 2):
            if 1 <= wk and t.warps_m * wk <= MAX_WARPS:
                out.append(replace(t, warps_k=wk))
        if t.tile_rows == 64 and t.warps_m * 2 * t.warps_k <= MAX_WARPS:
            out.append(replace(t, tile_rows=32, warps_m=t.warps_m * 2))
        if t.tile_rows == 32 and t.warps_m % 2 == 0:
            out.append(replace(t, tile_rows=64, warps_m=t.warps_m // 2))
        out.append(replace(t, persistent=not t.persistent))
        return out

    def tactics_for(self, shape, stage: int, num_sms: int = 132, wide_scales: bool = False) -> tuple[GemmTactic, ...]:
        """The set for GEMM`stage` of `shape` (class docstring), at most
        `limit` tactics, the defaults first."""
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        s = GemmShape.of(shape)
        defaults = [d for d in self.defaults(s, stage, num_sms, wide_scales)
                    if why_invalid(d, s, stage, None, num_sms, prune=False) is None]  # fmt: skip
        out = list(defaults[: self.limit])
        for t in _round_robin([self.changes(d) for d in defaults]):
            if len(out) >= self.limit:
                break
            if t not in out and why_invalid(t, s, stage, None, num_sms, prune=True) is None:
                out.append(t)
        return tuple(out)


#: What the shipped tables are tuned over (`moebench tune --space ship`,
#: scripts/tune_all.sh): the defaults and their neighbours, <= 10 per stage.
SHIP_SPACE = NeighbourSpace()
SPACES = {"quick": QUICK_SPACE, "full": FULL_SPACE, "ship": SHIP_SPACE}

#: The warp-specialized fp8 tactics (bulk ring, `stages` >= 2) timed in
#: docs/perf-notes.md v11 (scripts/time_gemms.py --fp8-bulk), per stage, and
#: the pair the full space found for dsv41-flash TP4 rows 4-5 in session 15
#: (r16_m4_k2_u8_c1_b4 / r32_m4_k1_u6_c4_b2: 1.6 µs the ship space missed).
F8_BULK_1 = (GemmTactic(32, 4, 4, 2, 1, stages=6, fp8=True), GemmTactic(32, 4, 4, 4, 1, stages=4, fp8=True),
             GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True), GemmTactic(16, 4, 4, 4, 1, stages=6, fp8=True),
             GemmTactic(16, 4, 4, 8, 1, stages=4, fp8=True), GemmTactic(16, 4, 2, 4, 2, stages=4, fp8=True),
             GemmTactic(16, 4, 2, 8, 2, stages=2, fp8=True), GemmTactic(16, 4, 2, 8, 1, stages=4, fp8=True))  # fmt: skip
F8_BULK_2 = (GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True), GemmTactic(32, 8, 2, 3, 1, stages=4, fp8=True),
             GemmTactic(32, 4, 1, 3, 4, stages=6, fp8=True),
             GemmTactic(32, 4, 1, 3, 3, stages=6, fp8=True), GemmTactic(32, 4, 3, 3, 2, stages=4, fp8=True),
             GemmTactic(32, 4, 1, 6, 4, stages=3, fp8=True), GemmTactic(32, 8, 1, 3, 2, stages=4, fp8=True),
             GemmTactic(32, 4, 1, 6, 4, stages=2, fp8=True))  # fmt: skip


@dataclass(frozen=True)
class Fp8Space:
    """The FP8 (wgmma) family's candidates: per (shape, stage) one set of at
    most `limit` fp8 tactics, the same for every row count, in this order:

    1. every tactic `default_fp8_tactic` picks for this shape at any
       token-tile count (GEMM1: 128- or 64-row items of four warpgroups, K
       split four ways, on the bulk ring; GEMM2: one warpgroup at 4 CTAs/SM);
    2. the warp-specialized variants measured in perf-notes v11 and v13
       (F8_BULK_1 / F8_BULK_2: deeper or shallower rings, unroll 2-8, K
       split 2; GEMM2 as one CTA of four warpgroups, r32_m8_k2_u3_c1_b4,
       1-2.5 µs faster per pair than the fp8 default GEMM2 at dsv41-flash
       TP4 rows 1-6, v13's log; session 15's rows-4 pair: two warpgroups
       of unroll 8 for GEMM1, two stages of unroll 6 for GEMM2);
    3. one-field changes of each default, round-robin: `stages` +-1 (2..6:
       the ring depth that hides the weight stream), `unroll` to its
       neighbours in (2, 3, 4, 6, 8), `ctas_per_sm` +-1, `warps_k` x2 / /2,
       `tile_rows` 16 <-> 32 (item rows halved / doubled);
    4. the warps per SM moved by less than a factor of two, or kept while
       the CTA size changes: `warps_k` +-1 (5 / 3 warpgroups), 5-6 CTAs
       per SM, (2 x CTAs, warps_k / 2) and (CTAs / 2, 2 x warps_k);
    5. while the limit leaves room (the 'full' space), the changes of steps
       3-4 applied to every non-default tactic so far (second neighbours).
    Every tactic must pass `fp8_why_invalid` (valid_for and the warps per
    SM); split_k stays 1 (the bulk ring needs it). GEMM1's set then gets
    the `spec` twin of each of its bulk-ring tactics with PDL (the first
    stages before griddepcontrol.wait: measurable only behind the route
    kernel, which the tuner's routed-path timing has), after the first
    max(2, `limit` / 4) 2-CTA cluster twins (`cluster_twins`) of its tactics
    at one CTA per SM (the defaults' first) joined it. Last, each stage's
    set gets the pipelined twin (`mma_depth` 1) of each default on the bulk
    ring. Finally, GEMM1's set becomes the two-plane twins of its tactics
    (`two_plane_twin`: `planes` 2, fewer stages where it must; a tactic
    without one is dropped, and only a shape no twin runs keeps the
    one-plane set): the one-plane GEMM1s pass the tuner's H check on its inputs
    (`runner.FP8_H_MARGIN`) yet miss the 25 % numerics margin at the
    committed TP4 points (perf-notes session 24), so they are not tuned.
    """

    limit: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.limit, int) or isinstance(self.limit, bool) or self.limit < 1:
            raise ValueError(f"limit must be a positive int, got {self.limit!r}")

    @staticmethod
    def defaults(shape, stage: int, num_sms: int = 132) -> list[GemmTactic]:
        """The distinct fp8 defaults of `shape` over every token-tile count
        rows 1..8 at any top_k can need (and ctas unknown), in the order met."""
        s = GemmShape.of(shape)
        return _distinct_defaults(s, lambda ctas: default_fp8_tactic(s, stage, ctas, num_sms))

    @staticmethod
    def changes(t: GemmTactic) -> list[GemmTactic]:
        """One-field changes of fp8 tactic `t` in the class docstring's order
        (step 3); not yet checked against any rule."""
        out = []
        if t.bulk:
            out += [replace(t, stages=st) for st in (t.stages + 1, t.stages - 1) if 2 <= st <= min(6, MAX_STAGES)]
        unrolls = (2, 3, 4, 6, 8)
        i = unrolls.index(t.unroll) if t.unroll in unrolls else None
        if i is not None:
            out += [replace(t, unroll=unrolls[j]) for j in (i + 1, i - 1) if 0 <= j < len(unrolls)]
        out += [replace(t, ctas_per_sm=c) for c in (t.ctas_per_sm + 1, t.ctas_per_sm - 1) if 1 <= c <= 4]
        out += [replace(t, warps_k=wk) for wk in (t.warps_k * 2, t.warps_k // 2)
                if wk >= 1 and t.warps_m * wk <= MAX_WARPS]  # fmt: skip
        out.append(replace(t, tile_rows=16 if t.tile_rows == 32 else 32))
        # step 4: the warps per SM moved without doubling: warps_k +-1 (5 or 3
        # warpgroups where the K chunks divide), 5-6 CTAs per SM, and the
        # same warps per SM as more, smaller CTAs or fewer, larger ones.
        out += [replace(t, warps_k=wk) for wk in (t.warps_k + 1, t.warps_k - 1)
                if wk >= 1 and wk & (wk - 1) and t.warps_m * wk <= MAX_WARPS]  # fmt: skip
        out += [replace(t, ctas_per_sm=c) for c in (t.ctas_per_sm + 1,) if 5 <= c <= 6]
        if t.warps_k % 2 == 0:
            out.append(replace(t, ctas_per_sm=t.ctas_per_sm * 2, warps_k=t.warps_k // 2))
        if t.ctas_per_sm % 2 == 0 and t.warps_m * t.warps_k * 2 <= MAX_WARPS:
            out.append(replace(t, ctas_per_sm=t.ctas_per_sm // 2, warps_k=t.warps_k * 2))
        return out

    def tactics_for(self, shape, stage: int, num_sms: int = 132) -> tuple[GemmTactic, ...]:
        """The set for GEMM`stage` of `shape` (class docstring), at most
        `limit` fp8 tactics (GEMM1: plus their spec twins, up to 2 x
        `limit`), the defaults first."""
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        s = GemmShape.of(shape)
        out: list[GemmTactic] = []

        def add(t: GemmTactic) -> None:
            if len(out) < self.limit and t not in out and fp8_why_invalid(t, s, stage) is None:
                out.append(t)

        defaults = self.defaults(s, stage, num_sms)
        for t in [*defaults, *(F8_BULK_1 if stage == 1 else F8_BULK_2)]:
            add(t)
        for t in _round_robin([self.changes(d) for d in defaults]):
            add(t)
        for t in _round_robin([self.changes(v) for v in out if v not in defaults]):  # step 5
            add(t)
        if stage == 1:  # spec needs 4 * SPEC_WORDS more bytes of shared memory: checked like the rest
            clusters = [t for t in self.cluster_twins(out, s)[: max(2, self.limit // 4)] if t not in out]
            out += clusters
            twins = [replace(t, spec=True) for t in out if t.bulk and t.pdl and not t.spec]
            out += [t for t in twins if fp8_why_invalid(t, s, stage) is None]
        # the pipelined consumer (mma_depth 1, perf-notes session 23) of each default on the bulk ring
        piped = [replace(d, mma_depth=1) for d in defaults if d.bulk and d.unroll > 1]
        out += [t for t in piped if t not in out and fp8_why_invalid(t, s, stage) is None]
        if stage == 1:  # each as its two-plane twin where one runs (issue 36 item 4): one-plane GEMM1s miss the margin
            twins = [two_plane_twin(t, s) for t in out]
            twins = [w for w in twins if w is not None and fp8_why_invalid(w, s, 1) is None]
            out = list(dict.fromkeys(twins)) or out  # one-plane only where no two-plane GEMM1 runs the shape
        return tuple(out)

    @staticmethod
    def cluster_twins(tactics, shape) -> list[GemmTactic]:
        """GEMM1's 2-CTA cluster twin (`cluster_k` 2: K split over a cluster,
        perf-notes session 20) of each bulk tactic at one CTA per SM, with
        half the unroll where the full one leaves the two K slices uneven;
        those that run GEMM1 of `shape`, in the order of `tactics`."""
        out: list[GemmTactic] = []
        for t in tactics:
            if not (t.bulk and t.ctas_per_sm == 1 and t.cluster_k == 1):
                continue
            for u in (t.unroll, t.unroll // 2):
                twin = replace(t, cluster_k=2, unroll=u) if u >= 1 else None
                if twin is not None and fp8_why_invalid(twin, shape, 1) is None:
                    if twin not in out:
                        out.append(twin)
                    break
        return out


def fp8_why_invalid(tactic: GemmTactic, shape, stage: int) -> str | None:
    """None when fp8 `tactic` can run GEMM`stage` of `shape` and its CTAs
    fit one SM's warps (module rules 1-2), else the reason."""
    if not tactic.fp8:
        return f"{tactic.name} is not an fp8 tactic"
    reason = tactic.valid_for(shape, stage)
    if reason:
        return reason
    if tactic.warps * tactic.ctas_per_sm > MAX_WARPS_PER_SM:
        return f"{tactic.ctas_per_sm} CTAs of {tactic.warps} warps exceed {MAX_WARPS_PER_SM} resident warps per SM"
    return None


#: The FP8 family's spaces by `--space` name (`moebench tune --fp8`): the
#: same construction, at most 10 / 16 / 48 tactics per shape and stage (GEMM1
#: twice that with the spec twins, plus its first 2-CTA cluster twins).
FP8_SPACES = {"ship": Fp8Space(10), "quick": Fp8Space(16), "full": Fp8Space(48)}
DEFAULT_FP8_SPACE = FP8_SPACES["quick"]


def estimated_registers(tactic: GemmTactic) -> int:
    """Registers a lane needs, estimated: two stages of unroll * tile_rows/32
    16-byte weight loads (4 registers each), tile_rows/16 m-tiles of fp32
    accumulators (4 each), plus REGISTER_OVERHEAD."""
    loads = 2 * tactic.unroll * (tactic.tile_rows // 32) * 4
    return loads + 4 * (tactic.tile_rows // 16) + REGISTER_OVERHEAD


def register_budget(tactic: GemmTactic) -> int:
    """Registers per thread when `ctas_per_sm` CTAs share an SM (8-register
    allocation granularity), at most 255."""
    per_thread = REGISTERS_PER_SM // (32 * tactic.warps * tactic.ctas_per_sm)
    return min(MAX_REGISTERS_PER_THREAD, per_thread // 8 * 8)


def items_per_tile(shape, stage: int, tactic: GemmTactic) -> int:
    """Work items of one token tile: GEMM1 2*I / item rows, GEMM2 H / item rows."""
    s = GemmShape.of(shape)
    rows = 2 * s.intermediate if stage == 1 else s.hidden
    return rows // tactic.item_rows


def why_invalid(
    tactic: GemmTactic, shape, stage: int, ctas: int | None = None, num_sms: int = 132, prune: bool = True
) -> str | None:
    """None when `tactic` belongs to the space for GEMM`stage` of `shape`
    (rules 1-5 of the module docstring; rules 4-5 only with `prune`), else
    the reason. Raises ValueError for a bad stage, ctas or num_sms."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1):
        raise ValueError(f"ctas must be a positive int or None, got {ctas!r}")
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    reason = tactic.valid_for(shape, stage)
    if reason:
        return reason
    if tactic.warps * tactic.ctas_per_sm > MAX_WARPS_PER_SM:
        return (f"{tactic.ctas_per_sm} CTAs of {tactic.warps} warps exceed {MAX_WARPS_PER_SM}"
                " resident warps per SM")  # fmt: skip
    smem = partial_smem_bytes(tactic)
    if smem > SMEM_PER_CTA:
        return f"{smem} bytes of shared memory per CTA exceed {SMEM_PER_CTA}"
    if (smem + SMEM_RESERVED_PER_CTA) * tactic.ctas_per_sm > SMEM_PER_SM:
        per_cta = smem + SMEM_RESERVED_PER_CTA
        return f"{tactic.ctas_per_sm} CTAs of {per_cta} shared-memory bytes exceed {SMEM_PER_SM} per SM"
    if not prune:
        return None
    need, have = estimated_registers(tactic), register_budget(tactic)
    if need > have:
        return f"needs ~{need} registers per thread, {have} fit at {tactic.ctas_per_sm} CTAs/SM (would spill)"
    if ctas is not None and not tactic.persistent:
        items = ctas * items_per_tile(shape, stage, tactic)
        if items <= num_sms * tactic.ctas_per_sm:
            return f"same grid as the persistent tactic ({items} items fit {num_sms} x {tactic.ctas_per_sm} CTAs)"
    return None


def valid_tactics(
    shape,
    stage: int,
    ctas: int | None = None,
    *,
    num_sms: int = 132,
    space: TacticSpace | NeighbourSpace | Fp8Space = DEFAULT_SPACE,
    wide_scales: bool = False,
    prune: bool = True,
) -> tuple[GemmTactic, ...]:
    """The tactics of `space` that can run GEMM`stage` (1 or 2) of `shape`
    (GemmShape or anything with hidden / intermediate / experts) when `ctas`
    token tiles are allowed for (None: any), on `num_sms` SMs. The built-in
    `default_tactic` for the same arguments is always included, first (for
    an `Fp8Space`: `default_fp8_tactic`, and only fp8 tactics).
    Raises ValueError for a bad stage / ctas / num_sms, TypeError for a bad
    shape or space."""
    if not isinstance(space, (TacticSpace, NeighbourSpace, Fp8Space)):
        raise TypeError(f"space must be a TacticSpace, NeighbourSpace or Fp8Space, got {type(space).__name__}")
    s = GemmShape.of(shape)
    out: list[GemmTactic] = []
    if isinstance(space, Fp8Space):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        why_invalid(GemmTactic(), s, stage, ctas, num_sms)  # argument checks (ctas, num_sms)
        try:
            out.append(default_fp8_tactic(s, stage, ctas, num_sms))
        except ValueError:
            pass
        out += [t for t in space.tactics_for(s, stage, num_sms) if t not in out]
        return tuple(out)
    try:
        default = default_tactic(s, stage, ctas, num_sms, wide_scales)
    except ValueError:
        default = None
    if default is not None and why_invalid(default, s, stage, ctas, num_sms, prune=False) is None:
        out.append(default)
    if isinstance(space, NeighbourSpace):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        why_invalid(GemmTactic(), s, stage, ctas, num_sms)  # argument checks (ctas, num_sms)
        for tactic in space.tactics_for(s, stage, num_sms, wide_scales):
            if tactic != default and why_invalid(tactic, s, stage, ctas, num_sms, prune) is None:
                out.append(tactic)
        return tuple(out)
    for tactic in space.tactics():
        if tactic != default and why_invalid(tactic, s, stage, ctas, num_sms, prune) is None:
            out.append(tactic)
    return tuple(out)


def rejected_tactics(
    shape,
    stage: int,
    ctas: int | None = None,
    *,
    num_sms: int = 132,
    space: TacticSpace = DEFAULT_SPACE,
    prune: bool = True,
) -> dict[str, str]:
    """Tactic name -> why it is not in `valid_tactics` (for reports)."""
    s = GemmShape.of(shape)
    out = {}
    for tactic in space.tactics():
        reason = why_invalid(tactic, s, stage, ctas, num_sms, prune)
        if reason:
            out[tactic.name] = reason
    return out
