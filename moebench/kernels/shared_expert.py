"""The shared expert of a decode step as two weight-streaming kernels (CuTe DSL, sm_90a).

    x BF16 [T, H] ─► GEMM1: gate/up = x·w1ᵀ, x·w3ᵀ (fp32 sums, each rounded to BF16),
                            h = silu(min(gate, L)) · clamp(up, -L, L) in fp32, rounded to BF16
                  ─► h BF16 [8, I] (rows >= T written as zeros)
                  ─► GEMM2: out = h·w2ᵀ (fp32 sums, one rounding) ─► BF16 [T, H]

The numerics are those of `integration.step_layer.StepSharedExpert`'s torch
path (F.linear of BF16 operands with fp32 accumulation, the BF16 gate_up
widened, swiglu_clamped in fp32, h rounded to BF16, F.linear again); only the
fp32 summation order differs. T (token rows) is 1..8.

At T <= 8 both GEMMs stream weights (17.7 MB of BF16 at dsv41-flash TP4,
each weight used by at most 8 rows), so the design follows the routed-expert
GEMMs (`gemm.py`): mma.sync m16n8k16 with the weights as the 16-row A
operand and the token rows as N = 8 ("swap AB"); 16-byte evict-first weight
loads, `unroll` K chunks per register stage, two stages in flight; K split
over the warps of a CTA (partials reduced in shared memory) and, where the
weight rows alone cannot fill the GPU, over the CTAs of a thread-block
cluster (`cluster_k`; partials pushed to CTA rank 0 through distributed
shared memory behind a cluster barrier: no global workspace, no atomics).

Work. A weight matrix [M rows, K] is cut into 16-row m-tiles; a K *chunk* is
32 columns (two k-steps of 16). Warp (wm, wk) of a CTA owns `tile_m` m-tiles
and a contiguous run of its CTA's chunks; a work *item* is the
warps_m * tile_m m-tiles of one CTA (one cluster when cluster_k > 1) over the
whole K. The grid is persistent: min(items, SMs * ctas_per_sm / cluster_k)
clusters, cluster c taking items c, c + clusters, ... (at the shipped
defaults every cluster takes exactly one item: one wave, everything in
flight at once).

Weight layout (`to_shared_layout`): [M/16 m-tiles][K/16 k-steps][32 lanes][8]
BF16, i.e. 512 bytes per (m-tile, k-step) and 16 bytes per lane, which are
exactly that lane's A fragment (R0..R3) of one mma.sync:
    lane L = 4g + c, k-step s = 2q + j (chunk q, half j), k0 = 32q + 8c + 4j:
    R0 = W[16t+g,   k0:k0+2]   R1 = W[16t+g+8, k0:k0+2]
    R2 = W[16t+g,   k0+2:k0+4] R3 = W[16t+g+8, k0+2:k0+4]
(the MMA's 16 k of a step are a permutation of real k; the sum is the same).
So a lane's activations for chunk q are the 8 contiguous elements
[32q + 8c, +8) of token row g: one 16-byte shared-memory load feeds both
k-steps. The activations of a CTA's K range (all 8 rows, zeros for rows >= T)
are staged once in shared memory ([chunk][row][32 k], 512 bytes per chunk).
GEMM1's rows interleave gate and up per 8 intermediate columns: m-tile t holds
w1 rows [8t, 8t+8) then w3 rows [8t, 8t+8), so a lane's accumulator holds
gate (c0, c1) and up (c2, c3) of column 8t + g for tokens 2c, 2c+1.

Programmatic dependent launch (tactic.pdl): the weights never come from an
earlier kernel of the step (they are converted once), so each CTA requests
its first two weight stages BEFORE griddepcontrol.wait; x / h are read and
h / out written only after it. Both kernels release their dependents right
after the wait (GEMM2's CTAs that find room beside GEMM1's then request
their weights while GEMM1 runs).
Launches take a stream and do no host sync or allocation: CUDA-graph
capturable (`SharedExpertKernels` loads the kernels onto the device when it
is built, so even a first call may be captured). The weights must not be
written by a kernel running just before GEMM1 / GEMM2 on the stream (they
are read before the PDL wait).

Shape rules (`shape_refusal`): H a multiple of 128, I a multiple of 32, both
positive; plus each tactic's divisibility (`SharedTactic.valid_for`). The
presets (H 4096 / 5120 / 7168, I/tp for tp 1, 2, 4, 8) all qualify.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from moebench.kernels.host import HAVE_DSL, check_tensor, cu_stream, gmem_ptr, require_dsl
from moebench.kernels.limits import (
    MAX_REGISTERS_PER_THREAD, MAX_THREADS_PER_SM, REGISTERS_PER_SM, SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED_PER_CTA,
)  # fmt: skip
from moebench.record import MAX_ROWS

if HAVE_DSL:
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint32

    from moebench.kernels import fp4
    from moebench.kernels.gemm import warp_mma_fragments
    from moebench.kernels.ptx import st_shared_cluster_f32x4, st_shared_u32x4

__all__ = [
    "SharedExpertKernels", "SharedExpertWeights", "SharedTactic", "compile_shared_gemm",
    "default_shared_tactic", "input_refusal", "kernels_refusal", "pack_weight", "shape_refusal",
    "to_shared_layout",
]  # fmt: skip

#: K elements of one chunk (two mma k-steps; one 16-byte activation load per lane).
CHUNK = 32
#: Weight rows of one mma m-tile.
M_TILE = 16
#: Intermediate columns of one GEMM1 m-tile (8 gate rows + 8 up rows).
COLS_PER_TILE = 8
#: Bytes of one (m-tile, k-step) weight fragment of a warp (32 lanes x 16 bytes).
FRAGMENT_BYTES = 512
#: Bytes of one staged activation chunk (8 rows x 32 BF16).
X_CHUNK_BYTES = MAX_ROWS * CHUNK * 2
#: Registers a thread needs beside its two weight stages (addresses, the
#: accumulators, the activation fragment, the epilogue); a planning bound for
#: `valid_for` (the compile tests check the real allocation for spills).
REGS_BESIDE_STAGES = 48
#: The defaults plan at least FILL * SMs CTAs (>= ~2 per SM on most SMs)
#: so every SM keeps many 16-byte loads in flight.
FILL = 1.75
#: Largest activation slice (bytes) a default stages per CTA.
X_SLICE_MAX = 64 * 1024
#: Largest cluster (the portable limit).
MAX_CLUSTER = 8


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


def _stage_mk(hidden: int, intermediate: int, stage: int) -> tuple[int, int]:
    """(weight rows M, K) of GEMM`stage`: (2I, H) for GEMM1, (H, I) for GEMM2."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    return (2 * intermediate, hidden) if stage == 1 else (hidden, intermediate)


@dataclass(frozen=True)
class SharedTactic:
    """One configuration of a shared-expert GEMM (every field a compile-time
    kernel parameter, none a code fork).

    tile_m: 16-row m-tiles per warp (1, 2 or 4; rows per warp = 16 * tile_m).
    warps_m: warps of a CTA side by side on different m-tiles.
    warps_k: warps of a CTA splitting K (partials reduced in shared memory).
    cluster_k: CTAs of a thread-block cluster splitting K (1 = no cluster;
      partials pushed to CTA rank 0 through distributed shared memory).
    unroll: 32-K chunks per register stage; a lane keeps up to
      2 * unroll * tile_m 16-byte weight loads in flight (two stages).
    ctas_per_sm: resident CTAs per SM the registers are planned for (the grid
      is persistent over SMs * ctas_per_sm CTAs).
    pdl: programmatic dependent launch.
    """

    tile_m: int = 1
    warps_m: int = 1
    warps_k: int = 4
    cluster_k: int = 1
    unroll: int = 4
    ctas_per_sm: int = 2
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.tile_m not in (1, 2, 4):
            raise ValueError(f"tile_m must be 1, 2 or 4, got {self.tile_m!r}")
        _check_int("warps_m", self.warps_m, 1, 16)
        _check_int("warps_k", self.warps_k, 1, 16)
        _check_int("cluster_k", self.cluster_k, 1, MAX_CLUSTER)
        _check_int("unroll", self.unroll, 1, 8)
        _check_int("ctas_per_sm", self.ctas_per_sm, 1, 8)
        if self.warps_m * self.warps_k > 16:
            raise ValueError(f"warps_m * warps_k must be at most 16, got {self.warps_m * self.warps_k}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"pdl must be a bool, got {type(self.pdl).__name__}")

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_k

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def item_tiles(self) -> int:
        """16-row m-tiles of one work item."""
        return self.warps_m * self.tile_m

    @property
    def name(self) -> str:
        return (
            f"t{self.tile_m}_m{self.warps_m}_k{self.warps_k}_cl{self.cluster_k}_u{self.unroll}"
            f"_c{self.ctas_per_sm}" + ("" if self.pdl else "_nopdl")
        )

    def chunks_per_cta(self, k: int) -> int:
        """32-K chunks of one CTA's K slice (the last CTA of a cluster may hold fewer)."""
        return -(-(k // CHUNK) // self.cluster_k)

    def smem_bytes(self, k: int) -> int:
        """Shared memory of one CTA for K = `k`: the staged activations,
        the warps' fp32 partials (two parities) and, with a cluster, rank 0's
        landing zone of the CTA partials (two parities)."""
        x = self.chunks_per_cta(k) * X_CHUNK_BYTES
        partials = 2 * self.warps * self.tile_m * FRAGMENT_BYTES
        landing = 2 * self.cluster_k * self.item_tiles * FRAGMENT_BYTES if self.cluster_k > 1 else 0
        return x + partials + landing

    def regs_available(self) -> int:
        """Registers per thread at ctas_per_sm resident CTAs (allocation granularity 8)."""
        return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (self.threads * self.ctas_per_sm) // 8 * 8)

    def valid_for(self, hidden: int, intermediate: int, stage: int) -> str | None:
        """None if this tactic can run GEMM`stage` (1 or 2) of a shared expert
        of hidden `hidden` and intermediate `intermediate`, else the reason."""
        reason = shape_refusal(hidden, intermediate)
        if reason:
            return reason
        m, k = _stage_mk(hidden, intermediate, stage)
        if stage == 1:
            cols = COLS_PER_TILE * self.item_tiles
            if intermediate % cols:
                return f"intermediate {intermediate} is not a multiple of the {cols} columns of a GEMM1 item"
        elif m % (M_TILE * self.item_tiles):
            return f"hidden {hidden} is not a multiple of the {M_TILE * self.item_tiles} rows of a GEMM2 item"
        nch = k // CHUNK
        per_cta = self.chunks_per_cta(k)
        if (self.cluster_k - 1) * per_cta >= nch:
            return f"cluster_k {self.cluster_k} leaves a CTA without K chunks (K = {k}: {nch} chunks)"
        if self.warps_k > per_cta:
            return f"warps_k {self.warps_k} exceeds the {per_cta} K chunks of a CTA"
        smem = self.smem_bytes(k)
        if smem > SMEM_PER_CTA or (smem + SMEM_RESERVED_PER_CTA) * self.ctas_per_sm > SMEM_PER_SM:
            return f"{smem} bytes of shared memory per CTA (K {k}) do not fit {self.ctas_per_sm} CTAs per SM"
        if self.threads * self.ctas_per_sm > MAX_THREADS_PER_SM:
            return f"{self.threads} threads x {self.ctas_per_sm} CTAs exceed {MAX_THREADS_PER_SM} threads per SM"
        need = 2 * self.unroll * self.tile_m * 8 + REGS_BESIDE_STAGES
        if self.regs_available() < need:
            return (
                f"two stages of unroll {self.unroll} x tile_m {self.tile_m} need ~{need} registers,"
                f" {self.regs_available()} available at {self.ctas_per_sm} CTAs of {self.threads} threads"
            )
        if m * k * 2 >= 2**33:
            return "weights over 8 GiB (32-bit word offsets)"
        return None


def shape_refusal(hidden, intermediate) -> str | None:
    """None when the kernels support a shared expert of hidden H and
    intermediate I (per rank), else why not: H a positive multiple of 128, I
    a positive multiple of 32 (ints)."""
    for name, v, mult in (("hidden", hidden, 128), ("intermediate", intermediate, 32)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            return f"{name} must be a positive int, got {v!r}"
        if v % mult:
            return f"{name} {v} is not a multiple of {mult}"
    return None


def default_shared_tactic(hidden: int, intermediate: int, stage: int, num_sms: int = 132) -> SharedTactic:
    """The built-in tactic of GEMM`stage` for (hidden, intermediate) on a GPU
    of `num_sms` SMs (one per shape: the weights stream the same way at every
    row count). Not measured yet; the rules (docs/perf-notes.md):

    * GEMM1 (K = H long, I/8 m-tiles): 4 warps splitting K, one item per
      cluster; tile_m 2 where 8-CTA clusters of 2-tile items still give
      >= FILL * SMs CTAs (halves the activation traffic), else 1; the
      smallest cluster_k in 1, 2, 4, 8 giving >= FILL * SMs CTAs with at most
      X_SLICE_MAX bytes of activations per CTA.
    * GEMM2 (K = I short, H/16 m-tiles): one m-tile per CTA, no cluster
      (unless K's activations exceed X_SLICE_MAX per CTA), 4 warps splitting
      K (3 where that divides the chunks and 4 does not).
    * Both: ctas_per_sm = ceil(CTAs / SMs) (one wave, at most 4), unroll so
      that the two register stages cover a warp's chunks when they can (at
      most 6 // tile_m), lowered until the registers fit.
    Raises ValueError when the shape is refused (`shape_refusal`) or no
    tactic fits.
    """
    reason = shape_refusal(hidden, intermediate)
    if reason:
        raise ValueError(f"no shared-expert tactic: {reason}")
    _check_int("num_sms", num_sms, 1, 1024)
    m, k = _stage_mk(hidden, intermediate, stage)
    nch = k // CHUNK
    target = FILL * num_sms
    if stage == 1:
        m_tiles = intermediate // COLS_PER_TILE
        two = m_tiles % 2 == 0 and (m_tiles // 2) * MAX_CLUSTER >= target
        tile_m = 2 if two else 1
        items = m_tiles // tile_m
        warps_k = 4
        cluster = MAX_CLUSTER
        for c in (1, 2, 4, 8):
            if items * c >= target and -(-nch // c) * X_CHUNK_BYTES <= X_SLICE_MAX:
                cluster = c
                break
        while cluster > 1 and (cluster - 1) * -(-nch // cluster) >= nch:
            cluster //= 2
    else:
        tile_m = 1
        items = m // M_TILE
        warps_k = 3 if nch % 3 == 0 and nch % 4 else 4
        # no cluster unless the activation slice would not fit (K > 4096 at X_SLICE_MAX)
        cluster = next((c for c in (1, 2, 4, 8) if -(-nch // c) * X_CHUNK_BYTES <= X_SLICE_MAX), MAX_CLUSTER)
    warps_k = min(warps_k, -(-nch // cluster))
    ctas = items * cluster
    cps = max(1, min(4, -(-ctas // num_sms)))
    per_cta = -(-nch // cluster)  # chunks of one CTA's K slice
    per_warp = -(-per_cta // warps_k)
    unroll = max(1, min(-(-per_warp // 2), 6 // tile_m))
    why = None
    for c in range(cps, 0, -1):  # fewer CTAs per SM only when no unroll fits (shared memory)
        for u in range(unroll, 0, -1):
            tactic = SharedTactic(tile_m, 1, warps_k, cluster, u, c)
            why = tactic.valid_for(hidden, intermediate, stage)
            if why is None:
                return tactic
    raise ValueError(f"no shared-expert GEMM{stage} tactic for H {hidden}, I {intermediate}: {why}")


# ----------------------------------------------------------------------------- weight layout


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A BF16 weight [M, K] (M a multiple of 16, K of 32) -> the kernels'
    fragment order, BF16 [M/16, K/16, 32, 8] (module docstring) on w's device.
    Raises ValueError for a bad dtype / shape."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"w must be a BF16 [M, K] tensor, got {getattr(w, 'dtype', type(w))} "
                         f"{tuple(getattr(w, 'shape', ()))}")  # fmt: skip
    m, k = w.shape
    if m % M_TILE or k % CHUNK:
        raise ValueError(f"w: rows {m} must be a multiple of {M_TILE} and K {k} of {CHUNK}")
    # row = 16t + 8rh + g ; k = 32q + 8c + 4j + 2kh + e  ->  [t][q j][g c][kh rh e]
    v = w.contiguous().view(m // M_TILE, 2, 8, k // CHUNK, 4, 2, 2, 2)  # t rh g q c j kh e
    v = v.permute(0, 3, 5, 2, 4, 6, 1, 7)  # t q j g c kh rh e
    return v.reshape(m // M_TILE, k // M_TILE, 32, 8).contiguous()


def _interleave_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w1, w3 [I, H] -> [2I, H]: per 8 columns, 8 gate rows then 8 up rows."""
    i, h = w1.shape
    return torch.stack((w1.reshape(i // 8, 8, h), w3.reshape(i // 8, 8, h)), dim=1).reshape(2 * i, h)


@dataclass(frozen=True)
class SharedExpertWeights:
    """One rank's shared expert in the kernels' layout (module docstring).

    w13: BF16 [I/8, H/16, 32, 8] (GEMM1 rows = gate/up interleaved per 8
    columns, `pack_weight` order); w2: BF16 [H/16, I/16, 32, 8]; hidden H,
    intermediate I (this rank's). Both tensors contiguous, on one device,
    16-byte aligned. Raises TypeError / ValueError naming the field."""

    w13: torch.Tensor
    w2: torch.Tensor
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        reason = shape_refusal(self.hidden, self.intermediate)
        if reason:
            raise ValueError(reason)
        h, i = self.hidden, self.intermediate
        check_tensor("w13", self.w13, (torch.bfloat16,), (i // 8, h // M_TILE, 32, 8), align=16)
        check_tensor("w2", self.w2, (torch.bfloat16,), (h // M_TILE, i // M_TILE, 32, 8), self.w13.device,
                     device_of="w13", align=16)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def nbytes(self) -> int:
        """Bytes the two GEMMs stream per call (6 * H * I)."""
        return (self.w13.numel() + self.w2.numel()) * 2


def to_shared_layout(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> SharedExpertWeights:
    """Convert the canonical shared expert once: w1 (gate), w3 (up) BF16 [I, H],
    w2 BF16 [H, I], all on one device -> SharedExpertWeights on that device.
    Raises TypeError for a non-tensor or a non-BF16 dtype, ValueError naming
    the argument for a bad shape or device, or a shape the kernels refuse
    (`shape_refusal`)."""
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    i, h = w1.shape
    if tuple(w3.shape) != (i, h):
        raise ValueError(f"w3 must have w1's shape {(i, h)} ([I, H]), got {tuple(w3.shape)}")
    if tuple(w2.shape) != (h, i):
        raise ValueError(f"w2 must be [H, I] = {(h, i)}, got {tuple(w2.shape)}")
    for name, t in (("w3", w3), ("w2", w2)):
        if t.device != w1.device:
            raise ValueError(f"{name} must be on w1's device {w1.device}, got {t.device}")
    reason = shape_refusal(h, i)
    if reason:
        raise ValueError(f"w1: {reason}")
    w13 = pack_weight(_interleave_gate_up(w1.contiguous(), w3.contiguous()))
    return SharedExpertWeights(w13.view(i // 8, h // M_TILE, 32, 8), pack_weight(w2), h, i)


# ----------------------------------------------------------------------------- device side

if HAVE_DSL:

    def _round_bf16(v):
        """fp32 -> BF16 (round to nearest even) -> fp32."""
        return fp4.bits_f32(fp4.pack_bf16x2(v, Float32(0.0)) << Uint32(16))

    class SharedGemmKernel:
        """GEMM1 (`stage=1`: gate/up + SwiGLU -> h BF16 [8, I]) or GEMM2
        (`stage=2`: h . w2^T -> BF16 [T, H]) of one shared-expert shape.

        Constructor (compile-time): tactic (SharedTactic), hidden, intermediate,
        stage. Host side `__call__(w, x, out, rows, limit, grid, stream)`
        launches `grid` CTAs (a multiple of cluster_k; `grid(num_sms)`).
        `can_implement` says whether the tactic fits the shape.
        """

        def __init__(self, tactic: SharedTactic, hidden: int, intermediate: int, stage: int):
            reason = tactic.valid_for(hidden, intermediate, stage)
            if reason:
                raise ValueError(f"tactic {tactic.name} cannot run shared GEMM{stage} (H {hidden}, "
                                 f"I {intermediate}): {reason}")  # fmt: skip
            self.tactic, self.hidden, self.inter, self.stage = tactic, hidden, intermediate, stage
            self._setup_attributes()

        @staticmethod
        def can_implement(tactic: SharedTactic, hidden: int, intermediate: int, stage: int) -> tuple[bool, str]:
            reason = tactic.valid_for(hidden, intermediate, stage)
            return (reason is None, reason or "")

        def _setup_attributes(self) -> None:
            t = self.tactic
            self.tm, self.wm, self.wk, self.cl, self.u = t.tile_m, t.warps_m, t.warps_k, t.cluster_k, t.unroll
            self.nw, self.threads = t.warps, t.threads
            self.m, self.k = _stage_mk(self.hidden, self.inter, self.stage)
            self.nch = self.k // CHUNK  # K chunks
            self.ksteps = self.k // M_TILE  # k-steps (one 512-byte fragment per m-tile each)
            self.per_cta = t.chunks_per_cta(self.k)  # chunks of a CTA's K slice
            self.per_w = -(-self.per_cta // self.wk)  # chunks of one warp
            self.nb = -(-self.per_w // self.u)  # register stages per item
            self.it = t.item_tiles  # m-tiles per item
            self.items = self.m // M_TILE // self.it
            self.elems = self.it * 128  # fp32 sums of one item (16 rows x 8 tokens per m-tile)
            self.x_words = self.per_cta * (X_CHUNK_BYTES // 4)
            self.smem_bytes = t.smem_bytes(self.k)
            per_sm = (self.smem_bytes + SMEM_RESERVED_PER_CTA) * t.ctas_per_sm
            self.smem_carveout = min(100, -(-100 * per_sm // SMEM_PER_SM))
            self.cluster_arg = [self.cl, 1, 1] if self.cl > 1 else None

        def grid(self, num_sms: int) -> int:
            """CTAs of a launch: one cluster per item, at most the clusters
            that fit num_sms * ctas_per_sm CTAs (persistent beyond that)."""
            clusters = max(1, min(self.items, num_sms * self.tactic.ctas_per_sm // self.cl))
            return clusters * self.cl

        @cute.jit
        def __call__(
            self,
            w: cute.Pointer,
            x: cute.Pointer,
            out: cute.Pointer,
            rows: Int32,
            limit: Float32,
            grid: Int32,
            stream: _cuda.CUstream,
        ):
            self.kernel(w, x, out, rows, limit).launch(
                grid=[grid, 1, 1],
                block=[self.threads, 1, 1],
                cluster=self.cluster_arg,
                stream=stream,
                use_pdl=self.tactic.pdl,
                min_blocks_per_mp=self.tactic.ctas_per_sm,
                preferred_smem_carveout=self.smem_carveout,
            )

        # ------------------------------------------------------------------ loads and math
        @cute.jit
        def issue(self, st, p_w, item, b, c_beg, n_mine, wm, lane):
            """Weight loads of stage b of `item` into register stage `st`:
            chunks c_beg + b*unroll + j (j < unroll, within the warp's n_mine),
            both k-steps, each of the warp's tile_m m-tiles (16 bytes a lane)."""
            mt0 = item * self.it + wm * self.tm
            for j in cutlass.range_constexpr(self.u):
                if b * self.u + j < n_mine:
                    ch = c_beg + b * self.u + j
                    for t in cutlass.range_constexpr(self.tm):
                        base = ((mt0 + t) * self.ksteps + 2 * ch) * 128 + lane * 4
                        for ks in cutlass.range_constexpr(2):
                            q = fp4.load_u32x4(p_w + (base + ks * 128), "evict_first")
                            for x in cutlass.range_constexpr(4):
                                st[((j * self.tm + t) * 2 + ks) * 4 + x] = q[x]

        @cute.jit
        def compute(self, tiled_mma, acc, rA, rB, tCrA, tCrB, st, sX, b, w_beg, n_mine, g, c):
            """mma.sync of register stage `st` (stage b of the warp's chunks):
            per chunk one 16-byte shared load of row g's activations feeds both
            k-steps of every m-tile."""
            for j in cutlass.range_constexpr(self.u):
                if b * self.u + j < n_mine:
                    ql = w_beg + b * self.u + j  # chunk within the CTA's K slice
                    xv = fp4.load_u32x4_shared(sX + (ql * (X_CHUNK_BYTES // 4) + g * 16 + c * 4))
                    for ks in cutlass.range_constexpr(2):
                        rB[0] = xv[2 * ks]
                        rB[1] = xv[2 * ks + 1]
                        for t in cutlass.range_constexpr(self.tm):
                            for x in cutlass.range_constexpr(4):
                                rA[x] = st[((j * self.tm + t) * 2 + ks) * 4 + x]
                            cute.gemm(tiled_mma, acc[t], tCrA, tCrB, acc[t])

        @cute.jit
        def fill_x(self, x, sX, rows, cta_beg, tid):
            """Stage the CTA's K slice of the activations (all 8 rows; zeros for
            rows >= `rows` and chunks past K) in shared memory: piece p (16
            bytes) = (chunk q, row n, quarter c4) with p = (8q + n) * 4 + c4, at
            byte 16p of the slice (so lane (g, c) reads row g, quarter c)."""
            p_x = cute.recast_ptr(x, dtype=Uint32)
            pieces = self.per_cta * 32
            R = 4  # loads in flight per thread per round
            span = self.threads * R
            for p0 in cutlass.range(0, pieces, span, unroll=1):
                vals = []
                oks = []
                for r in cutlass.range_constexpr(R):
                    p = p0 + r * self.threads + tid
                    q = p // 32
                    n = (p // 4) % 8
                    c4 = p % 4
                    ok = (p < pieces) & (n < rows) & (cta_beg + q < self.nch)
                    src = (n * self.k + (cta_beg + q) * CHUNK + c4 * 8) // 2
                    v = fp4.load_u32x4(p_x + Int32(cutlass.select_(ok, src, Int32(0))), "evict_last")
                    vals.append([Uint32(cutlass.select_(ok, v[i], Uint32(0))) for i in range(4)])
                    oks.append(p < pieces)
                for r in cutlass.range_constexpr(R):
                    if oks[r]:
                        p = p0 + r * self.threads + tid
                        st_shared_u32x4(sX + p * 4, vals[r][0], vals[r][1], vals[r][2], vals[r][3])

        # ------------------------------------------------------------------ reduction and epilogues
        @cute.jit
        def value(self, sP, sC, parity, r, n):
            """The item's fp32 sum for item row r (0 .. 16 * item_tiles), token n:
            over the warps_k partials in sP (no cluster) or, on cluster rank 0,
            over the cluster_k CTA partials in sC (in rank order)."""
            r16 = r % 16
            ln = (r16 % 8) * 4 + n // 2
            e = (r // 16) * 128 + ln * 4 + (r16 // 8) * 2 + n % 2  # element of the item
            tot = Float32(0.0)
            if cutlass.const_expr(self.cl == 1):
                mtl = r // 16
                wm_ = mtl // self.tm
                t = mtl % self.tm
                src = e % 128
                tot = sP[((parity * self.nw + wm_ * self.wk) * self.tm + t) * 128 + src]
                for k in cutlass.range_constexpr(1, self.wk):
                    tot = tot + sP[((parity * self.nw + wm_ * self.wk + k) * self.tm + t) * 128 + src]
            else:
                tot = sC[(parity * self.cl) * self.elems + e]
                for k in cutlass.range_constexpr(1, self.cl):
                    tot = tot + sC[(parity * self.cl + k) * self.elems + e]
            return tot

        @cute.jit
        def push_partials(self, sP, sC, parity, rank, tid):
            """Cluster: this CTA's sums over its warps_k partials, 4 values a
            thread, to rank 0's landing zone sC[parity][rank] (DSMEM)."""
            for f0 in cutlass.range_constexpr(0, self.elems // 4, self.threads):
                f = tid + f0
                if f < self.elems // 4:
                    mtl = f // 32
                    ln = f % 32
                    wm_ = mtl // self.tm
                    t = mtl % self.tm
                    s = []
                    for x in cutlass.range_constexpr(4):
                        src = ((parity * self.nw + wm_ * self.wk) * self.tm + t) * 128 + ln * 4 + x
                        tot = sP[src]
                        for k in cutlass.range_constexpr(1, self.wk):
                            tot = tot + sP[src + k * self.tm * 128]
                        s.append(tot)
                    dst = sC.iterator + ((parity * self.cl + rank) * self.elems + f * 4)
                    st_shared_cluster_f32x4(dst, Int32(0), s[0], s[1], s[2], s[3])

        @cute.jit
        def epilogue(self, sP, sC, parity, out, item, rows, limit, tid):
            if cutlass.const_expr(self.stage == 1):
                self.epilogue_swiglu(sP, sC, parity, out, item, rows, limit, tid)
            else:
                self.epilogue_out(sP, sC, parity, out, item, rows, tid)

        @cute.jit
        def epilogue_swiglu(self, sP, sC, parity, out, item, rows, limit, tid):
            """h[n, col] for the item's 8 * item_tiles columns and all 8 token
            rows (zeros for n >= rows): gate and up rounded to BF16, SwiGLU with
            clamp in fp32, h rounded to BF16; two adjacent columns per store."""
            cols = self.it * COLS_PER_TILE
            half = cols // 2
            out32 = cute.recast_ptr(out, dtype=Uint32)
            for f0 in cutlass.range_constexpr(0, 8 * half, self.threads):
                f = tid + f0
                if f < 8 * half:
                    n = f // half
                    j = 2 * (f % half)
                    hv = []
                    for d in cutlass.range_constexpr(2):
                        jj = j + d
                        gr = (jj // 8) * 16 + jj % 8  # gate row of column jj; up row = gr + 8
                        gate = _round_bf16(self.value(sP, sC, parity, gr, n))
                        up = _round_bf16(self.value(sP, sC, parity, gr + 8, n))
                        gc = cutlass.min(gate, limit)
                        uc = cutlass.min(cutlass.max(up, -limit), limit)
                        hval = fp4.div_rn(gc, Float32(1.0) + cute.math.exp(-gc, fastmath=True)) * uc
                        hv.append(Float32(cutlass.select_(n < rows, hval, Float32(0.0))))
                    col = item * cols + j
                    cute.arch.store(out32 + ((n * self.inter + col) // 2), fp4.pack_bf16x2(hv[0], hv[1]))

        @cute.jit
        def epilogue_out(self, sP, sC, parity, out, item, rows, tid):
            """out[n, row] for the item's 16 * item_tiles rows and tokens n <
            rows: one rounding to BF16, two adjacent output columns per store."""
            rws = self.it * M_TILE
            half = rws // 2
            out32 = cute.recast_ptr(out, dtype=Uint32)
            for f0 in cutlass.range_constexpr(0, 8 * half, self.threads):
                f = tid + f0
                if f < 8 * half:
                    n = f // half
                    r = 2 * (f % half)
                    if n < rows:
                        v0 = self.value(sP, sC, parity, r, n)
                        v1 = self.value(sP, sC, parity, r + 1, n)
                        cute.arch.store(out32 + ((n * self.hidden + item * rws + r) // 2), fp4.pack_bf16x2(v0, v1))

        # ------------------------------------------------------------------ kernel
        @cute.kernel
        def kernel(self, w: cute.Pointer, x: cute.Pointer, out: cute.Pointer, rows: Int32, limit: Float32):
            U, NB, C = self.u, self.nb, self.cl
            tid, bid, nblk = cute.arch.thread_idx()[0], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            warp, lane = tid // 32, tid % 32
            g, c = lane // 4, lane % 4
            wm, wk = warp // self.wk, warp % self.wk
            rank = Int32(0)
            if cutlass.const_expr(C > 1):
                rank = cute.arch.block_idx_in_cluster()
            cid = bid // C  # cluster (item sequence) of this CTA
            ncl = nblk // C
            cta_beg = rank * self.per_cta  # first chunk of this CTA's K slice
            cta_n = cutlass.min(Int32(self.per_cta), self.nch - cta_beg)
            w_beg = wk * self.per_w  # first chunk of this warp within the slice
            n_mine = cutlass.max(cutlass.min(Int32(self.per_w), cta_n - w_beg), Int32(0))
            c_beg = cta_beg + w_beg
            my_items = (self.items - cid + ncl - 1) // ncl
            n_steps = my_items * NB

            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_array(Uint32, self.x_words, byte_alignment=128)
            sP = smem.allocate_tensor(Float32, cute.make_layout((2 * self.nw * self.tm * 128,)), byte_alignment=16)
            sC = sP
            if cutlass.const_expr(C > 1):
                sC = smem.allocate_tensor(Float32, cute.make_layout((2 * C * self.elems,)), byte_alignment=16)
            p_w = cute.recast_ptr(w, dtype=Uint32)
            tiled_mma, rA, rB, tCrA, tCrB, acc = warp_mma_fragments(self.tm)
            st = [cute.make_rmem_tensor((U * self.tm * 8,), Uint32) for _ in range(2)]

            # ---- prologue: the first two weight stages (static weights) before the PDL wait
            l_item, l_b = cid, Int32(0)
            for s in cutlass.range_constexpr(2):
                if s < n_steps:
                    self.issue(st[s], p_w, l_item, l_b, c_beg, n_mine, wm, lane)
                l_b = l_b + 1
                wrap = Int32(l_b == NB)
                l_b, l_item = l_b - wrap * NB, l_item + wrap * ncl
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_arrive_relaxed()  # every CTA has started before any DSMEM store
            if cutlass.const_expr(self.tactic.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            self.fill_x(x, sX, rows, cta_beg, tid)
            cute.arch.sync_threads()
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_wait()

            c_item, c_b, parity = cid, Int32(0), Int32(0)
            for i in cutlass.range(0, n_steps, 2, unroll=1):
                for s in cutlass.range_constexpr(2):
                    if i + s < n_steps:
                        self.compute(tiled_mma, acc, rA, rB, tCrA, tCrB, st[s], sX, c_b, w_beg, n_mine, g, c)
                        if i + s + 2 < n_steps:  # refill this stage two steps ahead
                            self.issue(st[s], p_w, l_item, l_b, c_beg, n_mine, wm, lane)
                            l_b = l_b + 1
                            wrap = Int32(l_b == NB)
                            l_b, l_item = l_b - wrap * NB, l_item + wrap * ncl
                        if c_b == NB - 1:  # item done: partials to smem, reduce, epilogue
                            for t in cutlass.range_constexpr(self.tm):
                                base = ((parity * self.nw + warp) * self.tm + t) * 128 + lane * 4
                                vals = [fp4.f32_bits(acc[t][x]) for x in range(4)]
                                st_shared_u32x4(sP.iterator + base, vals[0], vals[1], vals[2], vals[3])
                                acc[t].fill(0.0)
                            cute.arch.sync_threads()
                            if cutlass.const_expr(C == 1):
                                self.epilogue(sP, sC, parity, out, c_item, rows, limit, tid)
                            else:
                                self.push_partials(sP, sC, parity, rank, tid)
                                cute.arch.cluster_arrive()  # release: the DSMEM stores
                                cute.arch.cluster_wait()  # acquire
                                if rank == 0:
                                    self.epilogue(sP, sC, parity, out, c_item, rows, limit, tid)
                            parity = parity ^ 1
                        last = Int32(c_b == NB - 1)
                        c_b = c_b + 1 - last * NB
                        c_item = c_item + last * ncl


# ----------------------------------------------------------------------------- host side
_KERNEL = "the shared-expert kernels"


@functools.lru_cache(maxsize=None)
def compile_shared_gemm(
    hidden: int, intermediate: int, tactic: SharedTactic, stage: int, device_index: int | None = None
):
    """Compile shared GEMM`stage` for (hidden, intermediate, tactic) (cached
    per process and `device_index`, the CUDA device it will run on; None for a
    cross-compile with CUTE_DSL_ARCH=sm_90a and no GPU).

    Returns (kernel, compiled): `kernel.grid(num_sms)` sizes the launch;
    `compiled(w, x, out, rows, limit, grid, stream)` takes cute global
    pointers (BF16: weights, x / h, h / out; 16-byte aligned), Int32 rows
    (1..8), Float32 limit (GEMM1's SwiGLU clamp; ignored by GEMM2), Int32
    grid and a CUstream. Raises ValueError when the tactic cannot run the
    shape, RuntimeError without nvidia-cutlass-dsl.
    """
    require_dsl(_KERNEL)
    if not isinstance(tactic, SharedTactic):
        raise TypeError(f"tactic must be a SharedTactic, got {type(tactic).__name__}")
    kernel = SharedGemmKernel(tactic, hidden, intermediate, stage)
    fake = [gmem_ptr(BFloat16, 1 << 20, 16) for _ in range(3)]
    compiled = cute.compile(kernel, *fake, Int32(1), Float32(1.0), Int32(1), _cuda.CUstream(0))
    return kernel, compiled


def kernels_refusal(device) -> str | None:
    """None when the kernels can run on `device` (a torch.device or str): a
    CUDA device of compute capability 9.0 (sm_90a) and nvidia-cutlass-dsl
    installed; else why not."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"the kernels need a CUDA device, got {dev}"
    if not HAVE_DSL:
        return "nvidia-cutlass-dsl is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        return f"the kernels are built for sm_90a; {torch.cuda.get_device_name(dev)} is sm_{cap[0]}{cap[1]}"
    return None


def input_refusal(x, hidden: int, device) -> str | None:
    """None when `x` can take the kernels bound to hidden size `hidden` on
    `device`: a torch.Tensor, BF16, [T, hidden] with 1 <= T <= 8, on `device`,
    contiguous and 16-byte aligned; else why not (one line)."""
    if not isinstance(x, torch.Tensor):
        return f"x must be a torch.Tensor, got {type(x).__name__}"
    if x.dtype != torch.bfloat16:
        return f"x must be torch.bfloat16, got {x.dtype}"
    if x.dim() != 2 or x.shape[1] != hidden:
        return f"x must be [rows, {hidden}], got {tuple(x.shape)}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x has {x.shape[0]} rows; the kernels take 1..{MAX_ROWS}"
    if x.device != torch.device(device):
        return f"x must be on {device}, got {x.device}"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "x must be contiguous and 16-byte aligned"
    return None


class SharedExpertKernels:
    """GEMM1 + GEMM2 of one shared expert, compiled once and launched on
    torch's current stream.

    weights: SharedExpertWeights on an sm_90 CUDA device; limit: the SwiGLU
    clamp L (> 0, fp32); tactics: None (the built-in `default_shared_tactic`
    per stage for this device's SM count) or {1: SharedTactic, 2: SharedTactic}
    (a missing stage takes the default). Compiles both kernels and loads
    them onto the weights' device here (construct outside a CUDA-graph
    capture; calls, the first included, may then be captured; call with that
    device current) and owns the h scratch buffer, BF16 [8, I] (`self.h`:
    rows >= T are zeros after a call), so calls of one instance must not run
    concurrently on different streams.

    `refusal(x)` / `accepts(x)` say whether a call takes x: BF16 [T, H],
    1 <= T <= 8, contiguous, 16-byte aligned, on the weights' device.
    Raises TypeError / ValueError naming the argument, RuntimeError without
    nvidia-cutlass-dsl.
    """

    def __init__(
        self, weights: SharedExpertWeights, limit: float, *, tactics: dict[int, SharedTactic] | None = None
    ) -> None:
        if not isinstance(weights, SharedExpertWeights):
            raise TypeError(f"weights must be a SharedExpertWeights, got {type(weights).__name__}")
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"limit must be a finite number > 0, got {limit!r}")
        reason = kernels_refusal(weights.device)
        if reason:
            raise ValueError(f"weights: {reason}")
        if tactics is not None and not isinstance(tactics, dict):
            raise TypeError(f"tactics must be a dict {{stage: SharedTactic}} or None, got {type(tactics).__name__}")
        self.weights = weights
        self.limit = float(limit)
        self.device = weights.device
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        h, i = weights.hidden, weights.intermediate
        self.tactics: dict[int, SharedTactic] = {}
        self._kernels = {}
        for stage in (1, 2):
            t = (tactics or {}).get(stage)
            if t is None:
                t = default_shared_tactic(h, i, stage, self.num_sms)
            elif not isinstance(t, SharedTactic):
                raise TypeError(f"tactics[{stage}] must be a SharedTactic, got {type(t).__name__}")
            why = t.valid_for(h, i, stage)
            if why:
                raise ValueError(f"tactics[{stage}] ({t.name}) cannot run shared GEMM{stage}: {why}")
            self.tactics[stage] = t
            kernel, compiled = compile_shared_gemm(h, i, t, stage, index)
            # .to(): an executor bound to this device with its module loaded now, so
            # even the first call may be inside a CUDA-graph capture
            self._kernels[stage] = (compiled.to(index), Int32(kernel.grid(self.num_sms)))
        self.h = torch.zeros(MAX_ROWS, i, dtype=torch.bfloat16, device=self.device)
        self._w13 = gmem_ptr(BFloat16, weights.w13, 16)
        self._w2 = gmem_ptr(BFloat16, weights.w2, 16)
        self._h = gmem_ptr(BFloat16, self.h, 16)
        self._limit = Float32(self.limit)

    @property
    def hidden(self) -> int:
        return self.weights.hidden

    @property
    def intermediate(self) -> int:
        return self.weights.intermediate

    def refusal(self, x) -> str | None:
        """None when `x` can take the kernels (`input_refusal`), else why not."""
        return input_refusal(x, self.hidden, self.device)

    def accepts(self, x) -> bool:
        """Whether `refusal(x)` is None."""
        return self.refusal(x) is None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out BF16 [T, H] = the shared expert of x BF16 [T, H] (T in 1..8):
        two launches on torch's current stream, no host sync; `out` (BF16
        [T, H], contiguous, 16-byte aligned, on the weights' device) is
        allocated when None. Raises ValueError / TypeError when `refusal(x)`
        or `out` is bad."""
        why = self.refusal(x)
        if why:
            raise ValueError(why)
        out = self._out(x.shape[0], out)  # checked before anything is launched
        stream = cu_stream(None, self.device)
        self._gemm1(x, stream)
        self._gemm2(x.shape[0], out, stream)
        return out

    def _out(self, rows: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(rows, self.hidden, dtype=torch.bfloat16, device=self.device)
        check_tensor("out", out, (torch.bfloat16,), (rows, self.hidden), self.device, device_of="the weights",
                     align=16)  # fmt: skip
        return out

    def launch_gemm1(self, x: torch.Tensor) -> torch.Tensor:
        """GEMM1 alone: self.h (BF16 [8, I]) = SwiGLU of x's gate / up (rows
        >= T zero); returns self.h. Raises ValueError when `refusal(x)`."""
        why = self.refusal(x)
        if why:
            raise ValueError(why)
        self._gemm1(x, cu_stream(None, self.device))
        return self.h

    def launch_gemm2(self, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """GEMM2 alone: out BF16 [rows, H] = self.h[:rows] . w2^T (rows in
        1..8; `out` allocated when None). Raises ValueError / TypeError for bad
        rows or out."""
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be an int in [1, {MAX_ROWS}], got {rows!r}")
        out = self._out(rows, out)
        self._gemm2(rows, out, cu_stream(None, self.device))
        return out

    def _gemm1(self, x: torch.Tensor, stream) -> None:
        g1, grid1 = self._kernels[1]
        g1(self._w13, gmem_ptr(BFloat16, x, 16), self._h, Int32(x.shape[0]), self._limit, grid1, stream)

    def _gemm2(self, rows: int, out: torch.Tensor, stream) -> None:
        g2, grid2 = self._kernels[2]
        g2(self._w2, self._h, gmem_ptr(BFloat16, out, 16), Int32(rows), self._limit, grid2, stream)
