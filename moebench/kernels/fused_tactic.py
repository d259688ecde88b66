"""The fused layer's tactics, apart from its kernel (pure Python: the tuning
tables read them without the CuTe DSL).

`FusedTactic`: the GEMM1 / GEMM2 tactics one fused CTA runs, its resident
GEMM2 units and when they load; `default_fused_tactic` and
`fused_candidates` (what `moebench tune` times against the pair);
`LayerChoice`: a tuning table's answer per row count, the pair or a fused
tactic; `fused_smem_bytes`: one CTA's shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.kernels.limits import SMEM_PER_CTA
from moebench.kernels.tactic import GemmShape, GemmTactic, bulk_stage_bytes, partial_smem_bytes

#: Most GEMM2 units a CTA may hold resident (compile-time size of the region).
MAX_RESIDENT = 16
#: Most GEMM1 ring steps a `lead` may name.
MAX_LEAD = 1 << 12


@dataclass(frozen=True)
class FusedTactic:
    """The fused layer's parameters: GEMM1's and GEMM2's tactics (fp8 on the
    bulk ring, one CTA per SM, the same number of warps, PDL; the ring has
    gemm1.stages stages), `resident`, the GEMM2 units per CTA whose
    weights are loaded into their own shared memory (0: all of GEMM2
    streams through the ring after GEMM1, v13's order), and `lead`, when the
    producer issues those loads: with `lead` of the CTA's GEMM1 ring steps
    still to issue (0: after GEMM1's last; None: right after the ring's
    first fill, v24's order)."""

    gemm1: GemmTactic
    gemm2: GemmTactic
    resident: int = 2
    lead: int | None = None

    def __post_init__(self) -> None:
        for name in ("gemm1", "gemm2"):
            if not isinstance(getattr(self, name), GemmTactic):
                raise TypeError(f"{name} must be a GemmTactic, got {type(getattr(self, name)).__name__}")
        r, ld = self.resident, self.lead
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"resident must be an int in [0, {MAX_RESIDENT}], got {type(r).__name__} {r!r}")
        if not 0 <= r <= MAX_RESIDENT:
            raise ValueError(f"resident must be an int in [0, {MAX_RESIDENT}], got {r!r}")
        if ld is not None and (not isinstance(ld, int) or isinstance(ld, bool)):
            raise TypeError(f"lead must be None or an int in [0, {MAX_LEAD}], got {type(ld).__name__} {ld!r}")
        if ld is not None and not 0 <= ld <= MAX_LEAD:
            raise ValueError(f"lead must be None or an int in [0, {MAX_LEAD}], got {ld!r}")

    @property
    def name(self) -> str:
        lead = "" if self.lead is None else f"_ld{self.lead}"
        return f"{self.gemm1.name}+{self.gemm2.name}_res{self.resident}{lead}"

    def to_fields(self) -> dict:
        """The fused tactic as a tuning table stores it: {"name", "gemm1",
        "gemm2" (each GemmTactic.to_fields), "resident", "lead"}."""
        return {"name": self.name, "gemm1": self.gemm1.to_fields(), "gemm2": self.gemm2.to_fields(),
                "resident": self.resident, "lead": self.lead}  # fmt: skip

    @classmethod
    def from_fields(cls, data) -> FusedTactic:
        """The FusedTactic `to_fields` wrote. Raises TypeError for a non-dict,
        ValueError for a missing or unknown field, an invalid tactic or a
        "name" that does not match the fields."""
        if not isinstance(data, dict):
            raise TypeError(f"a fused tactic must be an object, got {type(data).__name__}")
        missing = [f for f in ("gemm1", "gemm2", "resident", "lead") if f not in data]
        if missing:
            raise ValueError(f"fused tactic lacks {missing}")
        unknown = sorted(set(data) - {"name", "gemm1", "gemm2", "resident", "lead"})
        if unknown:
            raise ValueError(f"fused tactic holds unknown fields {unknown}")
        try:
            ft = cls(GemmTactic.from_fields(data["gemm1"]), GemmTactic.from_fields(data["gemm2"]),
                     data["resident"], data["lead"])  # fmt: skip
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid fused tactic: {error}") from error
        if "name" in data and data["name"] != ft.name:
            raise ValueError(f"fused tactic name {data['name']!r} does not match its fields ({ft.name})")
        return ft

    def why_invalid(self, shape) -> str | None:
        """None if this fused tactic can run `shape`, else the reason."""
        s = GemmShape.of(shape)
        for stage, t in ((1, self.gemm1), (2, self.gemm2)):
            if not (t.fp8 and t.bulk and t.pdl and t.persistent):
                return f"GEMM{stage} tactic {t.name} must be fp8 on the bulk ring, persistent, with PDL"
            if t.ctas_per_sm != 1 or t.split_k != 1 or t.cluster_k != 1 or t.spec or t.mma_depth:
                return (
                    f"GEMM{stage} tactic {t.name} must run one CTA per SM without split_k, cluster_k, spec or"
                    " mma_depth (the fused grid is one CTA per SM; its consumers do not pipeline)"
                )
            if t.planes != 1:
                return (
                    f"GEMM{stage} tactic {t.name}: the fused layer stages one activation plane (planes 2, the"
                    " two-plane GEMM1, runs in the pair only)"
                )
            reason = t.valid_for(s, stage)
            if reason:
                return f"GEMM{stage} tactic {t.name}: {reason}"
        if self.gemm1.warps != self.gemm2.warps:
            return f"the tactics' warps differ ({self.gemm1.warps} and {self.gemm2.warps}): one CTA runs both"
        need = fused_smem_bytes(self, s)
        if need > SMEM_PER_CTA:
            return f"needs {need} bytes of shared memory per CTA, more than {SMEM_PER_CTA}"
        return None


#: The built-in fused tactics' candidates, 16 warps each (one CTA per SM): GEMM1 64-row items of
#: four warpgroups splitting K (unroll 4, then 2 where K's chunks ask for it); GEMM2 128-row items
#: (K split in two) else 256-row items, unroll 4 down to 1 (the first whose steps divide I / 32).
_FUSED_GEMM1 = tuple(GemmTactic(16, 4, 4, u, 1, stages=4, fp8=True) for u in (4, 2, 1))
_FUSED_GEMM2 = tuple(GemmTactic(16, m, 16 // m, u, 1, stages=4, fp8=True) for m in (8, 16) for u in (4, 3, 2, 1))


def default_fused_tactic(shape, ctas: int, num_sms: int = 132) -> FusedTactic | None:
    """The built-in fused tactic for `ctas` token tiles (the most a row count
    can need) on `num_sms` SMs, or None when no candidate runs the shape: the
    first valid GEMM1 / GEMM2 of `_FUSED_GEMM1` / `_FUSED_GEMM2`, with as many
    resident GEMM2 units as the busiest CTA takes at `ctas` tiles, or as fit,
    loaded after GEMM1's last issue (lead 0: the fastest order in the
    2026-12-01 trace, perf-notes v24b; loading them early only delayed GEMM1)."""
    s = GemmShape.of(shape)
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1:
        raise ValueError(f"ctas must be a positive int, got {ctas!r}")
    g1 = next((t for t in _FUSED_GEMM1 if t.valid_for(s, 1) is None), None)
    g2 = next((t for t in _FUSED_GEMM2 if t.valid_for(s, 2) is None), None)
    if g1 is None or g2 is None:
        return None
    units1 = ctas * (2 * s.intermediate // g1.item_rows)
    units2 = ctas * (s.hidden // g2.item_rows)
    grid = max(1, min(max(units1, units2), num_sms))
    for resident in range(min(-(-units2 // grid), MAX_RESIDENT), -1, -1):
        ft = FusedTactic(g1, g2, resident, lead=0)
        if ft.why_invalid(s) is None:
            return ft
    return None


def fused_candidates(shape, ctas: int, num_sms: int = 132, limit: int = 8) -> tuple[FusedTactic, ...]:
    """The fused tactics `moebench tune` times against the pair for `ctas`
    token tiles: the built-in one first, then its variants (the other GEMM2
    item size, no resident units, the resident loads issued right after the
    ring's first fill, GEMM1's next unroll), valid ones only, at most `limit`;
    () when none runs the shape."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    base = default_fused_tactic(shape, ctas, num_sms)
    if base is None:
        return ()
    s = GemmShape.of(shape)
    g1s = [t for t in _FUSED_GEMM1 if t.valid_for(s, 1) is None][:2]
    g2s = [next((t for t in _FUSED_GEMM2 if t.warps_m == m and t.valid_for(s, 2) is None), None) for m in (8, 16)]
    res, early = base.resident, None  # early: the resident loads right after the ring's first fill
    variants = [(base.gemm1, base.gemm2, res, 0), (base.gemm1, base.gemm2, 0, 0), (base.gemm1, base.gemm2, res, early)]
    variants += [(base.gemm1, g2, min(res, 1), 0) for g2 in g2s if g2 is not None]
    variants += [(g1, base.gemm2, res, 0) for g1 in g1s]
    out: list[FusedTactic] = []
    for g1, g2, r, lead in variants:
        ft = FusedTactic(g1, g2, r, lead if r else 0)  # without resident units the lead means nothing
        if ft not in out and ft.why_invalid(s) is None:
            out.append(ft)
    return tuple(out[:limit])


@dataclass(frozen=True)
class LayerChoice:
    """What runs a layer's two GEMMs at one row count, as a tuning table's
    "fp8.fused" entry says: the pair (`fused` None) or the fused launch with
    the FusedTactic `fused`. Its name: "pair" or the fused tactic's."""

    fused: FusedTactic | None = None

    PAIR = "pair"

    def __post_init__(self) -> None:
        if self.fused is not None and not isinstance(self.fused, FusedTactic):
            raise TypeError(f"fused must be a FusedTactic or None, got {type(self.fused).__name__}")

    @property
    def name(self) -> str:
        return self.PAIR if self.fused is None else self.fused.name

    def to_fields(self) -> dict:
        """{"name": "pair"} or the fused tactic's fields."""
        return {"name": self.PAIR} if self.fused is None else self.fused.to_fields()

    @classmethod
    def from_fields(cls, data) -> LayerChoice:
        """The LayerChoice `to_fields` wrote (TypeError / ValueError as
        `FusedTactic.from_fields`)."""
        if isinstance(data, dict) and data.get("name") == cls.PAIR:
            if set(data) != {"name"}:
                raise ValueError(f"a 'pair' choice holds only its name, got {sorted(data)}")
            return cls(None)
        return cls(FusedTactic.from_fields(data))


def fused_smem_bytes(ft: FusedTactic, shape) -> int:
    """Shared memory of one fused CTA: partials (the larger of the two
    tactics', the same warps), the ring (the larger stage of the two), both
    B operands and activation scales, the resident region and the mbarriers."""
    s = GemmShape.of(shape)
    t1, t2 = ft.gemm1, ft.gemm2
    nb2 = -(-(s.intermediate // 32) // (t2.warps_k * t2.unroll))  # GEMM2's stages per item
    partials = max(partial_smem_bytes(t1), partial_smem_bytes(t2))
    ring = t1.stages * (max(bulk_stage_bytes(t1), bulk_stage_bytes(t2)) + 16)
    acts = 8 * s.hidden + 8 * (s.hidden // 32) * 4 + 8 * s.intermediate + 8 * (s.intermediate // 32) * 4 + 512
    resident = ft.resident * nb2 * (bulk_stage_bytes(t2) + 8)  # none allocated when resident is 0
    return partials + ring + acts + resident + 1024  # + alignment slack of the allocations
