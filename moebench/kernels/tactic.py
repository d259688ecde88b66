"""Tactics (the tuning space) of the routed-expert GEMMs, and the shape class
a compiled kernel serves.

A tactic is a frozen dataclass handed to the kernel's constructor; every field
is a compile-time parameter, none a code fork. `valid_for` says whether a
tactic can run a shape and why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from moebench.kernels.limits import SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from moebench.record import TILE

#: Most compute warps of one CTA (768 threads; the bulk ring adds a producer warp).
MAX_WARPS = 24
#: Most K slices of one item (split-K across CTAs).
MAX_SPLIT_K = 16
#: Shared words of a `spec` producer's prediction (bitmap 16, row masks 128, prefixes 16).
SPEC_WORDS = 160
#: Most shared-memory stages of the bulk-copy load path.
MAX_STAGES = 8
#: Largest cluster of CTAs that split an item's K (the portable cluster size limit).
MAX_CLUSTER_K = 8
#: Most wgmma chunks in flight behind the one being issued (`mma_depth`).
MAX_MMA_DEPTH = 3
#: Binades below its 32-block's largest element down to which an activation
#: element stays in a two-plane GEMM1's "hi" plane (`planes` 2): hi holds
#: |x| >= block max x 2^-PLANE_SHIFT, i.e. (e4m3 byte & 0x7F) >= the
#: block's largest such byte - 8 x PLANE_SHIFT (one binade = 8 codes).
PLANE_SHIFT = 4
#: Version of the tactic fields' meaning (tuning tables record it): bump it
#: when the kernel changes what a field does, so tables written before are stale.
TACTICS_VERSION = 1


@dataclass(frozen=True)
class GemmShape:
    """The shape class one compiled GEMM serves: hidden H, logical
    intermediate I (both per rank) and local experts E. Rows and token tiles
    are launch arguments."""

    hidden: int
    intermediate: int
    experts: int

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @classmethod
    def of(cls, obj) -> GemmShape:
        """From anything with hidden / intermediate / experts attributes
        (RankShape, ExpertWeights, KernelWeights)."""
        if isinstance(obj, GemmShape):
            return obj
        try:
            values = {name: getattr(obj, name) for name in ("hidden", "intermediate", "experts")}
        except AttributeError as err:
            raise TypeError(f"shape must have hidden, intermediate and experts, got {type(obj).__name__}") from err
        # ints as they are (numpy / torch integers too); a float is refused by __post_init__, not truncated
        return cls(
            **{k: int(v) if hasattr(v, "__index__") and not isinstance(v, bool) else v for k, v in values.items()}
        )


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


@dataclass(frozen=True)
class GemmTactic:
    """One configuration of the weight-streaming GEMM core.

    tile_rows: weight rows per warp (multiple of 32: 32, 64 or 128; two
      16-row m-tiles per 16-byte load).
    warps_m: warps of a CTA side by side on different rows (a CTA work item
      covers warps_m * tile_rows weight rows of one token tile).
    warps_k: warps of a CTA splitting K of the same rows (partial sums reduced
      through shared memory).
    unroll: 32-K chunks per load batch; each lane keeps
      unroll * tile_rows / 32 16-byte weight loads in flight, double-buffered.
    ctas_per_sm: resident CTAs per SM the registers are allocated for.
    persistent: grid of SMs * ctas_per_sm CTAs looping over the items (the
      next item's loads overlap the current reduction); else one CTA per
      possible item (the hardware balances; CTAs of unused tiles exit).
    pdl: programmatic dependent launch.
    split_k: K slices per item across CTAs (1 = off). Each item becomes
      split_k units over equal K slices (the K chunks must divide evenly);
      a unit stores its fp32 partial sums in a caller-owned workspace and the
      last unit of an item to arrive (per-item arrival counter) sums the
      partials in slice order and runs the epilogue (deterministic).
    stages: load path. 0 = registers (each lane's own 16-byte evict-first
      loads, double-buffered); >= 2 = bulk copies: one extra producer warp
      streams each item's weights and scales with cp.async.bulk (L2
      evict-first) into a ring of `stages` shared-memory stages completed on
      mbarriers, one stage = warps_k * unroll K chunks of all the item's rows;
      the warps read their words from shared memory (split_k must be 1).
      With fp8 this is the warp-specialized kernel: the producer streams,
      the warpgroups copy their words to registers, free the stage at once
      and only decode + wgmma.
    act_bf16: the activation operand arrives already dequantized to BF16
      (plain row-major [rows, K] bf16; GEMM1: x_deq [rows, H], GEMM2: h_deq
      [8*ctas, I]) instead of e4m3 + E8M0: lane (g, c) loads the 16 bytes of
      K elements [32*chunk + 8c, +8) of its token row and uses the four words
      as its B fragment with no decode and no scale multiplies. A GEMM1
      kernel with act_bf16 also writes h_deq (the exact BF16 value of every
      (h_q, h_scale) it writes, what GEMM2's e4m3 decode would make of it),
      besides h_q / h_scale. Name suffix `_a16`.
    fp8: Hopper's FP8 tensor cores: wgmma m64n8k32 e4m3 x e4m3 (fp32) with
      A from registers. The MXFP4 weights are decoded to e4m3 (value x 2^-6,
      exact; the e4m3 weight layout, `to_kernel_layout(..., operand="e4m3")`),
      the unit's 8 MXFP8 activation rows (x_q / h_q, as they are) are staged
      in shared memory as B; every 32-K block (one MX block) is one wgmma
      into a zeroed result, added to the fp32 accumulator times weight scale
      x activation scale x 2^6. A warpgroup (4 warps sharing a K part) covers
      4 x tile_rows rows, so fp8 tactics need tile_rows 32 (or 16: one m-tile
      per warp, 8-byte loads, 64-row items), warps_m a multiple of 4,
      and warps_k * unroll dividing the K chunks of a slice; either load
      path (stages). Excludes act_bf16. Name suffix `_f8`.
    spec: GEMM1 on the bulk ring with fp8 and PDL only: the producer warp
      predicts the route record's tiles from the top-k ids (which must be
      complete before the previous kernel released its dependents: the route
      kernel with `release_after_wait`) and issues the first ring stages
      before griddepcontrol.wait; the launch passes the ids (`gemm1(...,
      topk_ids=)`). Rows that repeat an expert switch the prediction off; a
      record that disagrees with it traps. Name suffix `_sp`.
    cluster_k: CTAs of a thread-block cluster splitting each item's K (1 =
      off; fp8 tactics on the bulk ring with split_k 1 only). CTA rank r of
      the cluster streams and multiplies K slice r (equal slices of whole
      ring steps); ranks >= 1 hand their fp32 sums to rank 0 through
      distributed shared memory (st.async completing bytes on rank 0's
      mbarrier: no global workspace, no L2 round trip, no grid barrier) and
      rank 0 sums them in rank order (deterministic) and runs the epilogue.
      For launches with fewer items than SMs (rows 1-2 at TP8: 54 GEMM1
      items for 132 SMs), where one item per SM is the critical path. Name
      suffix `_cl<n>`.
    mma_depth: fp8 tactics on the bulk ring only: the consumer's software
      pipeline (0 = off: each ring step's wgmmas are issued together, waited
      for with wgmma.wait_group 0, then scaled). d >= 1: chunk by chunk, the
      warpgroup decodes chunk n and issues its wgmma(s) while the previous d
      chunks' wgmmas are still in flight (wait_group d), and scales chunk
      n - d into the fp32 accumulator as it retires; the pipeline runs on
      across ring steps and drains at the end of a unit. Needs d < unroll
      (the unroll fragment slots of a step hold the chunks in flight). Same
      arithmetic in the same order as d = 0: the same bits. Name suffix
      `_d<d>`.
    planes: fp8 GEMM1 only: 1 = one wgmma per 32-K block (the FP8 tensor
      cores sum a block keeping ~13 bits below its largest product,
      truncated, which moves ~0.3 % of H's bytes one e4m3 code: issue 36
      item 4); 2 = two-plane GEMM1: each token's 32-element block of x is
      staged twice in shared memory, a "hi" plane (elements >= 2^-4 of the
      block's largest, `PLANE_SHIFT`) and a "lo" plane (the rest), zeros
      elsewhere; per block two wgmmas share the A (weight) fragment, each into
      its own fresh result, and the two results are added in fp32 before the
      scaling. Both planes commit in the chunk's group, so any mma_depth
      works. The bulk ring only (the register load path's two register
      stages leave no room for the second plane's results: ptxas spills;
      128-row items at unroll 4 keep 16 results in flight, which ptxas
      serializes: correct, slower);
      GEMM2 refuses it (`valid_for`: its output is not requantized), so do
      the fused tactics. Name suffix `_p<planes>`.
    """

    tile_rows: int = 64
    warps_m: int = 1
    warps_k: int = 8
    unroll: int = 2
    ctas_per_sm: int = 2
    persistent: bool = True
    pdl: bool = True
    split_k: int = 1
    stages: int = 0
    act_bf16: bool = False
    fp8: bool = False
    spec: bool = False
    cluster_k: int = 1
    mma_depth: int = 0
    planes: int = 1

    def __post_init__(self) -> None:
        for flag in ("persistent", "pdl", "act_bf16", "fp8", "spec"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")
        if not isinstance(self.tile_rows, int) or isinstance(self.tile_rows, bool):
            raise TypeError(f"tile_rows must be an int, got {type(self.tile_rows).__name__}")
        if self.tile_rows not in (16, 32, 64, 128) or (self.tile_rows == 16 and not self.fp8):
            raise ValueError(f"tile_rows must be 32, 64 or 128 (16 for fp8 tactics), got {self.tile_rows!r}")
        _check_int("warps_m", self.warps_m, 1, MAX_WARPS)
        _check_int("warps_k", self.warps_k, 1, MAX_WARPS)
        _check_int("unroll", self.unroll, 1, 8)
        _check_int("ctas_per_sm", self.ctas_per_sm, 1, 8)
        _check_int("split_k", self.split_k, 1, MAX_SPLIT_K)
        _check_int("stages", self.stages, 0, MAX_STAGES)
        _check_int("cluster_k", self.cluster_k, 1, MAX_CLUSTER_K)
        _check_int("mma_depth", self.mma_depth, 0, MAX_MMA_DEPTH)
        _check_int("planes", self.planes, 1, 2)
        if self.stages == 1:
            raise ValueError("stages must be 0 (register loads) or >= 2 (bulk-copy ring), got 1")
        if self.stages and self.split_k != 1:
            raise ValueError(f"the bulk-copy load path (stages {self.stages}) needs split_k 1, got {self.split_k}")
        if self.warps_m * self.warps_k > MAX_WARPS:
            raise ValueError(f"warps_m * warps_k must be at most {MAX_WARPS}, got {self.warps_m * self.warps_k}")
        if self.fp8 and self.act_bf16:
            raise ValueError("fp8 (e4m3 x e4m3 MMA on the MXFP8 activations) excludes act_bf16 (BF16 activations)")
        if self.cluster_k > 1 and not (self.fp8 and self.stages and self.split_k == 1):
            raise ValueError(
                f"cluster_k {self.cluster_k} needs an fp8 tactic on the bulk ring with split_k 1, got"
                f" fp8={self.fp8}, stages={self.stages}, split_k={self.split_k}"
            )
        if self.mma_depth and not (self.fp8 and self.stages):
            raise ValueError(
                f"mma_depth {self.mma_depth} (the pipelined wgmma consumer) needs an fp8 tactic on the bulk"
                f" ring, got fp8={self.fp8}, stages={self.stages}"
            )
        if self.mma_depth >= self.unroll:
            raise ValueError(
                f"mma_depth {self.mma_depth} must be less than unroll {self.unroll} (the fragment slots of a step)"
            )
        if self.planes != 1 and not (self.fp8 and self.stages):
            raise ValueError(
                f"planes {self.planes} (two-plane GEMM1: x split per 32-K block for the FP8 tensor cores' block"
                f" sums) needs an fp8 tactic on the bulk ring, got fp8={self.fp8}, stages={self.stages} (the BF16"
                " family's mma.sync sums are exact; the register load path has no registers for a second plane)"
            )
        if self.spec and not (self.fp8 and self.stages and self.pdl):
            raise ValueError(
                "spec (GEMM1's first stages before griddepcontrol.wait) needs an fp8 tactic on the"
                f" bulk ring with PDL, got fp8={self.fp8}, stages={self.stages}, pdl={self.pdl}"
            )

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_k

    @property
    def item_rows(self) -> int:
        """Weight rows of one CTA work item."""
        return self.warps_m * self.tile_rows

    @property
    def bulk(self) -> bool:
        """Whether weights stream through the bulk-copy shared-memory ring."""
        return self.stages > 0

    @property
    def name(self) -> str:
        """The tactic's one spelling, e.g. 'r64_m1_k8_u4_c1' (`to_name`)."""
        return self.to_name()

    def to_name(self) -> str:
        """The name `from_name` reads back: each field in `NAME_PARTS` order,
        the first five always (token + value), the others only where they
        differ from the default (an int as token + value, a bool as the token)."""
        out = []
        for f, token, always in NAME_PARTS:
            v = getattr(self, f)
            if always or v != _DEFAULTS[f]:
                out.append(token if isinstance(v, bool) else f"{token}{v}")
        return "".join(out)

    @classmethod
    def from_name(cls, name: str) -> GemmTactic:
        """The GemmTactic whose `to_name()` is `name` (e.g. 'r64_m1_k8_u4_c1',
        'r32_m4_k1_u4_c4_np', '..._nopdl'; surrounding blanks ignored).
        Raises TypeError for a non-str; ValueError naming the text when it
        does not parse, makes an invalid tactic or is not the canonical
        spelling (tables and reports compare names)."""
        if not isinstance(name, str):
            raise TypeError(f"tactic name must be a str, got {type(name).__name__}")
        match = _NAME.match(name.strip())
        if not match:
            raise ValueError(f"cannot parse tactic name {name!r} (expected {NAME_FORMAT}, e.g. r64_m1_k8_u4_c1)")
        values = {}
        for (f, _, always), text in zip(NAME_PARTS, match.groups()):
            if isinstance(_DEFAULTS[f], bool):
                values[f] = _DEFAULTS[f] != bool(text)
            elif always or text is not None:
                values[f] = int(text)
        try:
            tactic = cls(**values)
        except (ValueError, TypeError) as error:
            raise ValueError(f"tactic {name!r}: {error}") from error
        if tactic.to_name() != name.strip():
            raise ValueError(f"tactic name {name!r} is not in canonical form: write {tactic.to_name()!r}")
        return tactic

    def to_fields(self) -> dict:
        """The tactic as a tuning table stores it: {"name": ..., then every
        field in declaration order}; a field of TABLE_SPARSE only where it
        differs from its default (newer than the shipped tables, which stay
        byte for byte)."""
        return {
            "name": self.to_name(),
            **{
                f.name: getattr(self, f.name)
                for f in fields(self)
                if f.name not in TABLE_SPARSE or getattr(self, f.name) != f.default
            },
        }

    @classmethod
    def from_fields(cls, data) -> GemmTactic:
        """The GemmTactic `to_fields` wrote: TABLE_REQUIRED must be there, the
        other fields default (tables written before they existed), a "name"
        must match the fields. Raises TypeError for a non-dict, ValueError
        for a missing field, an invalid tactic or a mismatched name."""
        if not isinstance(data, dict):
            raise TypeError(f"a tactic must be an object, got {type(data).__name__}")
        missing = [f for f in TABLE_REQUIRED if f not in data]
        if missing:
            raise ValueError(f"tactic lacks {missing}")
        try:
            tactic = cls(**{f: data[f] if f in TABLE_REQUIRED else data.get(f, d) for f, d in _DEFAULTS.items()})
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid tactic: {error}") from error
        if "name" in data and data["name"] != tactic.to_name():
            raise ValueError(f"tactic name {data['name']!r} does not match its fields ({tactic.to_name()})")
        return tactic

    def valid_for(self, shape, stage: int) -> str | None:
        """None if this tactic can run GEMM`stage` (1 or 2) of `shape`
        (GemmShape or anything with hidden / intermediate / experts), else the
        reason."""
        _check_stage(stage)
        s = GemmShape.of(shape)
        if s.hidden % 128:
            return f"hidden {s.hidden} is not a multiple of 128"
        if s.intermediate % 32:
            return f"intermediate {s.intermediate} is not a multiple of 32"
        if self.spec and stage != 1:
            return "spec predicts GEMM1's first stages only (GEMM2 already streams before its wait)"
        if self.planes != 1 and stage != 1:
            return f"planes {self.planes} is GEMM1's fix only (GEMM2's output is not requantized to e4m3)"
        if stage == 1:
            if self.item_rows % 64:
                return f"GEMM1 work items must cover whole 64-row gate/up blocks, got {self.item_rows} rows"
            if (2 * s.intermediate) % self.item_rows:
                return f"2*intermediate {2 * s.intermediate} is not a multiple of {self.item_rows} rows"
            k = s.hidden
        else:
            if s.hidden % self.item_rows:
                return f"hidden {s.hidden} is not a multiple of {self.item_rows} rows"
            k = s.intermediate
        nch = k // 32
        if nch % self.split_k:
            return f"split_k {self.split_k} does not divide the {nch} K chunks (K = {k}) evenly"
        per_slice = nch // self.split_k
        if self.warps_k > per_slice:
            what = f"the {nch} K chunks" if self.split_k == 1 else f"the {per_slice} K chunks of a slice"
            return f"warps_k {self.warps_k} exceeds {what}"
        if self.fp8:
            if self.tile_rows not in (16, 32):
                return f"fp8 (wgmma) tactics need tile_rows 16 or 32, got {self.tile_rows}"
            if self.warps_m % 4:
                return f"fp8 (wgmma) tactics need warps_m a multiple of 4 (whole warpgroups), got {self.warps_m}"
            if per_slice % (self.warps_k * self.unroll):
                return (
                    f"fp8 (wgmma) tactics need warps_k * unroll ({self.warps_k * self.unroll}) to divide"
                    f" the {per_slice} K chunks of a slice"
                )
            if nch % (self.cluster_k * self.warps_k * self.unroll):
                return (
                    f"cluster_k {self.cluster_k} needs cluster_k * warps_k * unroll"
                    f" ({self.cluster_k * self.warps_k * self.unroll}) to divide the {nch} K chunks"
                    " (equal slices of whole ring steps)"
                )
        parts = smem_parts(self, s, stage)
        need, what = sum(parts.values()), list(parts)
        limit = min(SMEM_PER_CTA, SMEM_PER_SM // self.ctas_per_sm - SMEM_RESERVED_PER_CTA)
        if need > limit:
            ctas = f"{self.ctas_per_sm} CTA{'s' if self.ctas_per_sm > 1 else ''} per SM"
            return f"{', '.join(what)} need {need} bytes of shared memory per CTA, more than {limit} at {ctas}"
        return None


#: A tactic's name, part by part in name order: (field, token, always).
#: Fields marked always show as token + value; the others only where they
#: differ from the default: an int as token + value, a bool as the token.
NAME_PARTS = (
    ("tile_rows", "r", True), ("warps_m", "_m", True), ("warps_k", "_k", True), ("unroll", "_u", True),
    ("ctas_per_sm", "_c", True), ("persistent", "_np", False), ("pdl", "_nopdl", False),
    ("split_k", "_s", False), ("stages", "_b", False), ("cluster_k", "_cl", False), ("mma_depth", "_d", False),
    ("planes", "_p", False), ("spec", "_sp", False),
    ("act_bf16", "_a16", False),
    ("fp8", "_f8", False),
)  # fmt: skip
#: What a name looks like (for messages).
NAME_FORMAT = ("r<tile_rows>_m<warps_m>_k<warps_k>_u<unroll>_c<ctas_per_sm>[_np][_nopdl][_s<split_k>][_b<stages>]"
               "[_cl<cluster_k>][_d<mma_depth>][_p<planes>][_sp][_a16|_f8]")  # fmt: skip
#: Fields every table tactic holds (schema 1's); the later ones default when absent.
TABLE_REQUIRED = ("tile_rows", "warps_m", "warps_k", "unroll", "ctas_per_sm", "persistent", "pdl")
#: Fields a table holds only where they differ from the default.
TABLE_SPARSE = ("cluster_k", "mma_depth", "planes")
_DEFAULTS = {f.name: f.default for f in fields(GemmTactic)}
if sorted(f for f, _, _ in NAME_PARTS) != sorted(_DEFAULTS) or not set(TABLE_REQUIRED) <= set(_DEFAULTS):
    raise ImportError("NAME_PARTS / TABLE_REQUIRED must name GemmTactic's fields")  # a field added without its token
_NAME = re.compile("^" + "".join(
    f"{token}(\\d+)" if always else f"({token})?" if isinstance(_DEFAULTS[f], bool) else f"(?:{token}(\\d+))?"
    for f, token, always in NAME_PARTS) + "$")  # fmt: skip


def smem_parts(tactic: GemmTactic, shape, stage: int) -> dict[str, int]:
    """Shared memory of one CTA of GEMM`stage` of `shape` with `tactic`, part
    by part ({what: bytes}, in allocation order): the fp32 partial sums; with
    fp8 the unit's 8 e4m3 activation rows (K bytes each, + 128 alignment),
    their fp32 scales [chunk][token] and an mbarrier; with the bulk ring its
    stages (each + its mbarriers) and a `spec` producer's prediction; with a
    cluster rank 0's landing zone and its mbarriers. The one formula: the
    kernel allocates by it (`gemm.StreamingGemmKernel`) and `valid_for`
    checks it against the limits."""
    _check_stage(stage)
    k = GemmShape.of(shape).hidden if stage == 1 else GemmShape.of(shape).intermediate
    parts = {"the fp32 partial sums": partial_smem_bytes(tactic)}
    if tactic.fp8:  # one activation tile per plane (two-plane GEMM1: 2), one set of scales
        tile = "the fp8 activation tile" + (f" ({tactic.planes} planes)" if tactic.planes > 1 else "")
        parts[tile] = tactic.planes * (8 * k + 128) + 8 * (k // 32) * 4 + 16
    if tactic.bulk:
        spec = 4 * SPEC_WORDS if tactic.spec else 0
        parts[f"{tactic.stages} bulk stages"] = tactic.stages * (bulk_stage_bytes(tactic) + 16) + spec
    if tactic.cluster_k > 1:
        parts["the cluster's landing zone"] = cluster_landing_bytes(tactic) + 32
    return parts


def smem_bytes(tactic: GemmTactic, shape, stage: int) -> int:
    """Shared memory of one CTA of GEMM`stage` (`smem_parts`, summed)."""
    return sum(smem_parts(tactic, shape, stage).values())


def partial_smem_bytes(tactic: GemmTactic) -> int:
    """Shared memory of the fp32 partial sums (two parities) of one CTA."""
    return (tactic.tile_rows // 16) * 128 * tactic.warps * 2 * 4


def cluster_landing_bytes(tactic: GemmTactic) -> int:
    """Shared memory where a cluster_k tactic's rank 0 receives the other
    ranks' fp32 sums: two parities x (cluster_k - 1) ranks x 8 tokens x the
    item's rows; 0 without a cluster."""
    if tactic.cluster_k == 1:
        return 0
    return 2 * (tactic.cluster_k - 1) * 8 * tactic.item_rows * 4


def bulk_stage_bytes(tactic: GemmTactic) -> int:
    """Bytes of one bulk-copy stage: warps_k * unroll K chunks (512 bytes of
    e2m1 words + 32 bytes of E8M0 scales per 32-row pair and chunk) of the
    item's warps_m * tile_rows / 32 pairs; 0 for the register load path."""
    if not tactic.bulk:
        return 0
    pairs = tactic.warps_m * tactic.tile_rows // 32
    return pairs * tactic.warps_k * tactic.unroll * (512 + 32)


def two_plane_twin(tactic: GemmTactic, shape) -> GemmTactic | None:
    """The two-plane GEMM1 twin (`planes` 2) of `tactic` for `shape`: the
    same tactic with planes 2, with fewer ring stages (down to 2) where the
    second activation plane leaves no shared memory for all of them; None
    where none runs GEMM1 of `shape` (not fp8 on the bulk ring, or it does
    not fit at 2 stages either). A tactic with planes 2 already is its own twin."""
    if not isinstance(tactic, GemmTactic):
        raise TypeError(f"tactic must be a GemmTactic, got {type(tactic).__name__}")
    s = GemmShape.of(shape)
    if not (tactic.fp8 and tactic.bulk):
        return None
    for stages in range(tactic.stages, 1, -1):
        twin = replace(tactic, planes=2, stages=stages)
        if twin.valid_for(s, 1) is None:
            return twin
    return None


def _check_stage(stage) -> None:
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")


def _check_default_args(stage, ctas, num_sms) -> None:
    """The arguments of default_tactic / default_fp8_tactic (ValueError naming them)."""
    _check_stage(stage)
    if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 0):
        raise ValueError(f"ctas must be a non-negative int or None, got {ctas!r}")
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")


def _stage_rows(shape: GemmShape, stage: int) -> int:
    """Weight rows M of GEMM`stage` (2I for GEMM1, H for GEMM2)."""
    _check_stage(stage)
    return 2 * shape.intermediate if stage == 1 else shape.hidden


def workspace_parts(shape, tactic: GemmTactic, ctas: int, stage: int) -> tuple[int, int]:
    """(counter bytes, partial bytes) of the split-K workspace GEMM`stage`
    with `tactic` needs for `ctas` token tiles; (0, 0) when
    tactic.split_k == 1.

    Layout (one caller-owned buffer of >= sum bytes, 16-byte aligned, size a
    multiple of 16, ZEROED ONCE at allocation): int32 arrival counters, one
    per item (ctas * M / item_rows of them), at the FRONT; fp32 partials
    [items][split_k][8 tokens][item_rows] at the BACK (ending at the end of
    the buffer). Every launch returns its counters to zero (the last unit of
    an item resets its counter), so the buffer needs no memset between
    launches or CUDA-graph replays. Because counters sit at the front and
    partials at the back, ONE buffer serves launches of several (stage,
    tactic, ctas) if its size is at least the largest counter bytes plus the
    largest partial bytes among them (`workspace_bytes_for`), as long as
    those launches run one after the other (same stream; with PDL every
    workspace access follows griddepcontrol.wait)."""
    if not isinstance(tactic, GemmTactic):
        raise TypeError(f"tactic must be a GemmTactic, got {type(tactic).__name__}")
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 0:
        raise ValueError(f"ctas must be a non-negative int, got {ctas!r}")
    s = GemmShape.of(shape)
    m = _stage_rows(s, stage)
    if tactic.split_k == 1:
        return 0, 0
    reason = tactic.valid_for(s, stage)
    if reason:
        raise ValueError(f"tactic {tactic.name} cannot run GEMM{stage} of {s}: {reason}")
    items = ctas * (m // tactic.item_rows)
    counters = -(-4 * items // 16) * 16
    partials = items * tactic.split_k * TILE * tactic.item_rows * 4
    return counters, partials


def workspace_bytes(shape, tactic: GemmTactic, ctas: int, stage: int) -> int:
    """Bytes of the split-K workspace of one GEMM`stage` launch with
    `tactic` for `ctas` token tiles (0 when tactic.split_k == 1); see
    `workspace_parts` for the layout."""
    return sum(workspace_parts(shape, tactic, ctas, stage))


def workspace_bytes_for(shape, launches) -> int:
    """Bytes of one workspace shared by `launches`, an iterable of
    (stage, tactic, ctas) run one after the other: the largest counter bytes
    plus the largest partial bytes (0 when none splits K)."""
    c = p = 0
    for stage, tactic, ctas in launches:
        ci, pi = workspace_parts(shape, tactic, ctas, stage)
        c, p = max(c, ci), max(p, pi)
    return c + p


#: Distinct experts per routed slot the defaults plan for (correlated draft
#: rows: ~22 experts for 36 slots at rows 6, top-6).
EXPECTED_TILE_FRACTION = 0.55


def default_tactic(
    shape,
    stage: int,
    ctas: int | None = None,
    num_sms: int = 132,
    wide_scales: bool = False,
    fp8: bool = False,
) -> GemmTactic:
    """A sensible tactic for GEMM`stage` of `shape` when `ctas` token tiles
    are allowed for (the tuner may do better; measured on the H200 at
    dsv41-flash TP4/TP8, docs/perf-notes.md).

    The work items are expected tiles (EXPECTED_TILE_FRACTION * ctas, all of
    them when ctas is None) times the weight blocks of a tile. GEMM1 (K = H):
    one 64-row gate/up block per item, the persistent grid with the fewest
    CTAs per SM that still holds every item (8 warps x unroll 4 at 1 CTA/SM,
    8 x 2 at 2, 4 x 4 at 3) but, for 3-4 CTAs' worth of items per SM, the
    bulk-copy ring (4 x 4 at 2, 4 stages: measured faster with GEMM2 after it). GEMM2 (K = I/tp): for K <= 576, 256-row items of
    4 x 2 warps through the bulk ring when they fit one pass at 2 CTAs/SM,
    else 64-row warps side by side (512-row items, no K split); for longer K, 32-row
    warps with K split over 2 or 4 warps. `wide_scales` (the two-multiply
    decode) takes unroll 3 at 3 CTAs/SM (unroll 4 spills there). `fp8`: the
    wgmma tactics (`_f8`, `default_fp8_tactic`). Raises ValueError if none fits.
    """
    s = GemmShape.of(shape)
    _check_default_args(stage, ctas, num_sms)
    if fp8:
        return default_fp8_tactic(s, stage, ctas, num_sms)
    tiles = 10**6 if ctas is None else max(1, round(EXPECTED_TILE_FRACTION * ctas))
    if stage == 1:
        items = tiles * (2 * s.intermediate // 64)
        if items <= num_sms:
            tactic = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=4, ctas_per_sm=1)
        elif items <= 2 * num_sms:
            tactic = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=2, ctas_per_sm=2)
        elif items <= 3 * num_sms or items > 4 * num_sms or wide_scales:
            tactic = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=3 if wide_scales else 4, ctas_per_sm=3)
        else:  # just past one pass at 3 CTAs/SM: the bulk ring overlaps GEMM2's start better (v4)
            tactic = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=4, ctas_per_sm=2, stages=4)
    else:
        nch = s.intermediate // 32
        if nch <= 18 and s.hidden % 512 == 0:
            if tiles * (s.hidden // 256) <= 2 * num_sms:
                # one pass of 256-row items through the bulk ring: its producer prefetches
                # weights before griddepcontrol.wait, so GEMM2 starts while GEMM1 drains (v4)
                tactic = GemmTactic(tile_rows=64, warps_m=4, warps_k=2, unroll=2, ctas_per_sm=2, stages=4)
            elif tiles * (s.hidden // 512) < num_sms // 2:
                tactic = GemmTactic(tile_rows=32, warps_m=4, warps_k=1, unroll=4, ctas_per_sm=4, persistent=False)
            else:
                tactic = GemmTactic(tile_rows=64, warps_m=8, warps_k=1, unroll=2, ctas_per_sm=2)
        else:
            wk = 1 if nch <= 12 else 2 if nch <= 36 else 4
            tactic = GemmTactic(tile_rows=32, warps_m=8 // wk, warps_k=wk, unroll=2, ctas_per_sm=2)
    reason = tactic.valid_for(s, stage)
    if reason:
        raise ValueError(f"no default GEMM{stage} tactic for {s}: {reason}")
    return tactic


def default_fp8_tactic(shape, stage: int, ctas: int | None = None, num_sms: int = 132) -> GemmTactic:
    """The fp8 (wgmma) tactic `default_tactic(..., fp8=True)` picks (measured
    on the H200, dsv41-flash TP4/TP8, docs/perf-notes.md v11): the
    warp-specialized kernels on the bulk ring, one CTA of four warpgroups per
    SM for GEMM1 (K split four ways, unroll 4, 4 stages), with 128-row items
    (r32_m4_k4_u4_c1_b4) unless 64-row items (r16_m4_k4_u4_c1_b4) take fewer
    rows x passes over the SMs (expected items, `EXPECTED_TILE_FRACTION`);
    GEMM2: one warpgroup per CTA, 4 CTAs/SM, unroll 3 (r32_m4_k1_u3_c4_b4).
    GEMM1's pick runs as its two-plane twin (`two_plane_twin`, `_p2`) where
    one fits: the one-plane GEMM1 flips H bytes against the oracle and
    misses the 25 % numerics margin at dsv41-flash TP4 (issue 36 item 4).
    Where a shape rejects those (shared memory, K chunks not divisible by
    warps_k x unroll, rows): 3 / 2 stages, unroll 4 / 2, then the register
    load path (v7: r32_m4_k4_u4_c1, r32_m4_k2_u4_c2, r32_m4_k1_u3_c4 and
    the first valid of 32- then 16-row warps, K split 2 / 1, unroll 4 / 3 / 2,
    2 / 3 / 1 CTAs per SM). `ctas`: token tiles the record allows for (None:
    many), `num_sms`: the GPU's SMs. Raises ValueError for a bad stage / ctas
    or if none fits."""
    _check_default_args(stage, ctas, num_sms)
    s = GemmShape.of(shape)
    tiles = 10**6 if ctas is None else max(1, round(EXPECTED_TILE_FRACTION * ctas))
    if stage == 1:

        def cost(rows: int) -> int:  # weight rows one SM streams: passes x item rows
            return -(-tiles * (2 * s.intermediate // rows) // num_sms) * rows

        warps = sorted((32, 16), key=lambda r: cost(4 * r) if (2 * s.intermediate) % (4 * r) == 0 else 1 << 62)
        first = [GemmTactic(r, 4, 4, u, 1, stages=st, fp8=True) for r in warps for u in (4, 2) for st in (4, 3, 2)]
        few = tiles * (2 * s.intermediate // 128) <= num_sms
        first += [GemmTactic(32, 4, 4, 4, 1, fp8=True)] if few else []
        first.append(GemmTactic(32, 4, 2, 4, 2, fp8=True))
    else:
        first = [GemmTactic(32, 4, 1, u, 4, stages=st, fp8=True) for u in (3, 4, 2) for st in (4, 3, 2)]
        first.append(GemmTactic(32, 4, 1, 3, 4, fp8=True))
    candidates = first + [
        GemmTactic(tile_rows=r, warps_m=4, warps_k=wk, unroll=u, ctas_per_sm=c, fp8=True)
        for r in (32, 16)
        for wk in (2, 1)
        for u in (4, 3, 2)
        for c in (2, 3, 1)
    ]
    last = None
    for t in candidates:
        last = t.valid_for(s, stage)
        if last is None:  # GEMM1: its two-plane twin where one runs (the numerics margin, issue 36 item 4)
            return (two_plane_twin(t, s) or t) if stage == 1 else t
    raise ValueError(f"no fp8 GEMM{stage} tactic for {s}: {last}")
