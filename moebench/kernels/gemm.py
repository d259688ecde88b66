"""GEMM1 and GEMM2 of the routed experts (CuTe DSL, sm_90a): one
weight-streaming core, two epilogues.

At <= 8 token rows both GEMMs stream weights: each weight byte meets at most
8 rows. The core (`StreamingGemmKernel`) is ONE persistent grid over the work
items of all used token tiles: item = (token tile, block of
warps_m * tile_rows weight rows of the tile's expert), items ascending by
tile then block, CTA b taking items b, b + grid, ... Inside a CTA, warp
(wm, wk) owns tile_rows rows and 1/warps_k of K; each lane keeps
unroll * tile_rows/32 16-byte evict-first weight loads in flight
(double-buffered register stages, the next item's loads issued before the
current one's reduction). Weights are decoded to BF16 in registers (exact,
E8M0 folded in), activations (MXFP8: e4m3 + E8M0) likewise, and fed to
mma.sync m16n8k16 (weights = the 16-row A operand, the <= 8 token rows = N).
fp8 tactics (`tactic.fp8`: the FP8 family, the binding's default where the
tuning tables time it faster) instead decode the weights to e4m3 (the
e4m3 weight layout) for wgmma m64n8k32 with A from registers: a warpgroup of
four warps shares a K part, the unit's 8 MXFP8 activation rows are staged in
shared memory as B, and each 32-K block's fp32 result is scaled by weight x
activation scale into the accumulator (`compute_wgmma`, `stage_acts`).
fp8 tactics with `stages` run warp-specialized (`bulk_consume_wgmma`): the
producer warp streams the weights into the shared-memory ring, the
warpgroups copy their words to registers, free the stage and only decode and
multiply; their CTAs take contiguous unit ranges (`unit_span`) and stage a
tile's activation rows once.
Partial sums of the warps_k warps meet in shared memory; then
  * stage 1 (GEMM1, K = H): h = silu(min(gate, L)) * clamp(up, -L, L) per
    column, L = clamp[e], quantized MXFP8 per 32 columns by formats'
    round-up rule (one warp per (token, 32-column block)); output h_q
    uint8 [8*ctas, I], h_scale uint8 [8*ctas, I/32] indexed by permuted row;
  * stage 2 (GEMM2, K = I): BF16 rows [8*ctas, H], one per permuted row,
    unweighted.
Padding rows of used tiles are written as zeros (h scale 0); rows of unused
tiles are not written.

Split-K across CTAs (tactic.split_k = S > 1): each item becomes S units
(unit = item * S + slice, slice s covering K chunks [s, s+1) * nch/S); the
grid loops over units instead of items, the warps_k warps splitting the
slice's chunks. A finished unit writes its fp32 sums [8 tokens][item rows]
to the caller's workspace (`workspace_parts`: counters at the front,
partials at the back), then thread 0 fences (gpu scope) and arrives on the
item's int32 counter with `atom.acq_rel.gpu.inc` (wrap S - 1). The unit that
sees S - 1 is the last: it sums the S partials in slice order (ld.relaxed.gpu,
deterministic: the same bits whatever the arrival order) and runs the
epilogue; its arrival has wrapped the counter back to 0, so the workspace is
clean for the next launch or CUDA-graph replay with no memset. Every
workspace access follows griddepcontrol.wait, so GEMM1 and GEMM2 (and
successive calls) may share one workspace on one stream.

Programmatic dependent launch (tactic.pdl): GEMM2 reads the route record and
requests its first weights BEFORE griddepcontrol.wait; this needs the record
to be complete before the previous kernel released its dependents, which
holds for route -> GEMM1 -> GEMM2 because GEMM1 releases them only after its
own wait. GEMM1 reads everything after its wait (the route kernel runs just
before it). Both release their dependents right after the wait. Launches
take a stream and do no host sync or allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moebench.kernels.host import HAVE_DSL, check_tensor, cu_stream, kernel_args, require_dsl
from moebench.kernels.layout import KernelWeights
from moebench.kernels.limits import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from moebench.kernels.tactic import (
    PLANE_SHIFT, SPEC_WORDS, GemmShape, GemmTactic, cluster_landing_bytes, default_tactic, smem_bytes,
    workspace_parts,
)  # fmt: skip
from moebench.record import TILE, route_words

if HAVE_DSL:
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint16, Uint32

    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.experimental import primitives as prims

    from moebench.kernels import fp4
    from moebench.kernels.ptx import (
        mbarrier_arrive_cluster,
        mbarrier_try_wait_cluster,
        st_async_cluster,
        st_shared_u32x4,
        trap,
    )

#: L2 cache policy "evict first" (CUTLASS CacheHintSm90::EVICT_FIRST) for the bulk copies.
_EVICT_FIRST = 0x12F0000000000000


if HAVE_DSL:

    def warp_mma_fragments(m_tiles: int):
        """(tiled_mma, rA, rB, tCrA, tCrB, acc): the m16n8k16 BF16 MMA (fp32
        accumulation), its A / B fragments and their Uint32 views (rA[0..3] =
        A registers R0..R3, rB[0..1] = B registers), and `m_tiles` zeroed fp32
        accumulators of 4 values per lane (trace-time Python: call it inside a
        kernel body). Shared by the routed-expert GEMMs and the shared expert."""
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        tCrA = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((16, 16)))
        tCrB = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((8, 16)))
        rA, rB = cute.recast_tensor(tCrA, Uint32), cute.recast_tensor(tCrB, Uint32)
        acc = [tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16, 8))) for _ in range(m_tiles)]
        for a in acc:
            a.fill(0.0)
        return tiled_mma, rA, rB, tCrA, tCrB, acc

    def wgmma_fp8_fragments(n_mma: int, m_tiles: int, planes: int = 1):
        """(tiled_mma, rA, tCrA, acc, tmp) of the fp8 tactics: wgmma
        m64n8k32 e4m3 x e4m3 (fp32) with A from registers, B (the 8 token
        rows) from shared memory. Per thread: `n_mma` A fragments (16 e4m3:
        rA[i][0..3] = row g k 4c.., row g+8, row g k 16+4c.., row g+8, for
        the warp's 16 rows of the 64: the per-warp order of mma.sync
        m16n8k32) and `planes` x as many fp32 result fragments `tmp` (one per
        MMA in flight: tmp[p * n_mma + i] is fragment i's MMA on B plane p),
        and `m_tiles` accumulators `acc` (zeroed; one per 16-row m-tile of
        the warp), each (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN,
            Float8E4M3FN,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            tiler_mn=(64, 8),
            a_source=warpgroup.OperandSource.RMEM,
        )
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)  # every MMA writes a fresh result (one MX block)
        shape_c = tiled_mma.partition_shape_C((64, 8))
        tCrA = [tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((64, 32))) for _ in range(n_mma)]
        rA = [cute.recast_tensor(t, Uint32) for t in tCrA]
        tmp = [cute.make_rmem_tensor(shape_c, Float32) for _ in range(planes * n_mma)]
        acc = [cute.make_rmem_tensor(shape_c, Float32) for _ in range(m_tiles)]
        for a in acc:
            a.fill(0.0)
        return tiled_mma, rA, tCrA, acc, tmp

    class GemmArgs(NamedTuple):
        """StreamingGemmKernel's run-time arguments, one struct (`gemm_args`
        builds it; the element type and alignment of each pointer are
        `gemm_arg_specs`'): the weights and their scales, the activation
        operand (e4m3 bytes, or BF16 with act_bf16) and its scales, the route
        record, the SwiGLU clamp, the outputs (GEMM1: H, its scales and its
        BF16 copy; GEMM2: the rows, placeholders), the split-K counters and
        partials, a `spec` tactic's top-k ids and rows << 8 | top_k (meta),
        and the token tiles the record allows for."""

        w: cute.Pointer
        ws: cute.Pointer
        act: cute.Pointer
        act_s: cute.Pointer
        record: cute.Pointer
        clamp: cute.Pointer
        out: cute.Pointer
        out_s: cute.Pointer
        out_deq: cute.Pointer
        cnt: cute.Pointer
        part: cute.Pointer
        ids: cute.Pointer
        meta: Int32
        ctas: Int32

    def gemm_arg_specs(stage: int) -> dict:
        """{GemmArgs field: spec} in field order (`host.kernel_args`): a
        pointer's (element type, assumed alignment), a scalar's type; the
        compile-time stand-ins and every launch take them from here."""
        return {
            "w": (Uint8, 16), "ws": (Uint8, 16), "act": (Uint8, 16), "act_s": (Uint8, 4),
            "record": (Int32, 16), "clamp": (Float32, 4), "out": (Uint8 if stage == 1 else BFloat16, 16),
            "out_s": (Uint8, 4), "out_deq": (BFloat16, 16), "cnt": (Int32, 16), "part": (Float32, 16),
            "ids": (Int32, 4), "meta": Int32, "ctas": Int32,
        }  # fmt: skip

    def gemm_args(stage: int, sources: dict) -> GemmArgs:
        """The GemmArgs of one launch (or compile) of GEMM`stage` from
        `sources` ({field: tensor, address or number})."""
        return kernel_args(GemmArgs, gemm_arg_specs(stage), sources)

    class StreamingGemmKernel:
        """The weight-streaming core with the GEMM1 (`stage=1`) or GEMM2
        (`stage=2`) epilogue for one shape class.

        Constructor (all compile-time): tactic (GemmTactic), shape
        (GemmShape), stage, wide_scales (BF16 tactics: two multiplies per
        weight decode, needed when a weight E8M0 code exceeds 128; fp8
        tactics: the weight scale handles codes 0 and 255,
        `KernelWeights.scale_variant`), resident (a measurement, never a
        result: `compile_gemm`). Host side `__call__`
        launches `grid` CTAs on `stream`; `can_implement` says whether the
        tactic fits the shape.
        """

        def __init__(self, tactic: GemmTactic, shape: GemmShape, stage: int, wide_scales: bool = False, resident=False):
            reason = tactic.valid_for(shape, stage)
            if reason:
                raise ValueError(f"tactic {tactic.name} cannot run GEMM{stage} of {shape}: {reason}")
            check_resident(resident, tactic)
            self.tactic, self.shape, self.stage, self.wide = tactic, shape, stage, bool(wide_scales)
            self.resident = bool(resident)
            self.probe = resident if isinstance(resident, str) else ""  # "mma" / "math": half a consumer
            self._setup_attributes()

        @staticmethod
        def can_implement(tactic: GemmTactic, shape: GemmShape, stage: int) -> tuple[bool, str]:
            reason = tactic.valid_for(shape, stage)
            return (reason is None, reason or "")

        def _setup_attributes(self) -> None:
            t, s = self.tactic, self.shape
            self.tm = t.tile_rows // 16  # m-tiles per warp
            self.pairs = t.tile_rows // 32  # 32-row pairs per warp (one 16-byte load each)
            self.wm, self.wk, self.u = t.warps_m, t.warps_k, t.unroll
            self.nw = t.warps
            self.threads = 32 * self.nw
            self.rm = t.item_rows
            if self.stage == 1:
                self.k, self.m = s.hidden, 2 * s.intermediate
            else:
                self.k, self.m = s.intermediate, s.hidden
            self.nch = self.k // 32  # 32-K chunks (MX blocks)
            self.sk = t.split_k  # K slices (units) per item
            self.nch_s = self.nch // self.sk  # chunks per slice
            self.cl = t.cluster_k  # CTAs of a cluster splitting an item's K (bulk fp8 only)
            self.nch_c = self.nch_s // self.cl  # chunks of one cluster rank's slice
            self.blocks = self.m // self.rm  # items per token tile
            self.per = -(-self.nch_s // self.wk)  # chunks per warp (of one slice)
            self.nb = -(-self.per // self.u)  # load batches per item
            npairs = self.m // 32
            self.w_expert = npairs * self.nch * 128  # u32 words of one expert's weights
            self.s_expert = npairs * self.nch * 8  # u32 words of its scales
            # shared memory: fp32 partials [tm*128][warps][2 parities] (+ the bulk ring); the rest stays L1
            self.smem_bytes = smem_bytes(t, s, self.stage)  # the one formula (tactic.smem_parts)
            self.bulk = t.bulk
            self.a16 = t.act_bf16
            self.fp8 = t.fp8
            self.planes = t.planes  # B planes of the fp8 activation tile (two-plane GEMM1: 2)
            # fp8 on the bulk ring, one m-tile per warp, unroll <= 4: its 2 E8M0 codes of a chunk
            # loaded as bytes (`stage_words_to_registers`), each 2^(s-127) one shift (no byte select,
            # no mask); otherwise the scale word, one register a chunk (two registers a chunk spill
            # r16 unroll 8 at 2 CTAs/SM, four registers r32 unroll 4)
            self.byte_scales = t.fp8 and t.bulk and self.tm == 1 and self.u <= 4
            self.aw = 4 if self.a16 else 2  # activation words per lane and chunk
            # fp8: the unit's 8 activation rows (e4m3, wgmma K-major "interleave" layout: 16-byte
            # units q = 8 * (k slot // 16) + n at byte 16 q; one tile per plane) and their fp32 scales
            # [chunk][token]
            self.block_threads = self.threads
            if self.bulk:
                self.ks = self.u * self.wk  # K chunks per bulk stage
                self.nb = -(-self.nch // self.ks)  # stages (steps) per item
                self.nb_c = self.nb // self.cl  # steps of one cluster rank's K slice of an item
                self.np = self.rm // 32  # 32-row pairs per item
                self.sw_words = self.np * self.ks * 128  # weight words of one stage
                self.stage_words = self.sw_words + self.np * self.ks * 8  # + scale words
                self.block_threads = self.threads + 32  # + the producer warp
            per_sm = (self.smem_bytes + SMEM_RESERVED_PER_CTA) * t.ctas_per_sm
            self.smem_carveout = min(100, -(-100 * per_sm // SMEM_PER_SM))

        def warp_of(self, wm, wk):
            """Warp index of (wm, wk): wm-major, except fp8 tactics (wgmma),
            whose warpgroups (4 consecutive warps) share wk: wk-major."""
            if cutlass.const_expr(self.fp8):
                return wk * self.wm + wm
            return wm * self.wk + wk

        def grid(self, ctas: int, num_sms: int) -> int:
            """Grid for `ctas` token tiles: one CTA per possible unit (item x
            K slice), at most SMs * ctas_per_sm when persistent."""
            units = ctas * self.blocks * self.sk
            if not self.tactic.persistent:
                return max(1, units) * self.cl
            return max(1, min(units, num_sms * self.tactic.ctas_per_sm // self.cl)) * self.cl

        @cute.jit
        def __call__(
            self,
            w: cute.Pointer,
            ws: cute.Pointer,
            act: cute.Pointer,
            act_s: cute.Pointer,
            record: cute.Pointer,
            clamp: cute.Pointer,
            out: cute.Pointer,
            out_s: cute.Pointer,
            out_deq: cute.Pointer,
            cnt: cute.Pointer,
            part: cute.Pointer,
            ids: cute.Pointer,
            meta: Int32,
            ctas: Int32,
            grid: Int32,
            stream: _cuda.CUstream,
        ):
            # flat here, not one GemmArgs: DSL 4.8.1's export_to_c (tuning.precompile) takes no
            # NamedTuple argument; callers pass `*gemm_args(...)`, the kernel takes the struct
            args = GemmArgs(w, ws, act, act_s, record, clamp, out, out_s, out_deq, cnt, part, ids, meta, ctas)
            self.kernel(args).launch(
                grid=[grid, 1, 1],
                block=[self.block_threads, 1, 1],
                stream=stream,
                cluster=[self.cl, 1, 1] if self.cl > 1 else None,
                use_pdl=self.tactic.pdl,
                min_blocks_per_mp=self.tactic.ctas_per_sm,
                preferred_smem_carveout=self.smem_carveout,
            )

        # ------------------------------------------------------------------ loads
        @cute.jit
        def unit_item(self, unit, ch):
            """(item, first K chunk) of `unit` whose chunk offset within its
            slice is `ch`: units are item * split_k + slice."""
            item = unit
            ch0 = ch
            if cutlass.const_expr(self.sk > 1):
                item = unit // self.sk
                ch0 = ch + (unit % self.sk) * self.nch_s
            return item, ch0

        @cute.jit
        def issue_weights(self, st_w, st_s, p_w, p_s, rec, unit, batch, n_mine, c_beg, wm, lane, g):
            """Weight + weight-scale loads of (unit, batch) into a register stage."""
            item, ch0 = self.unit_item(unit, c_beg + batch * self.u)
            tile = item // self.blocks
            blk = item % self.blocks
            e = cute.arch.load(rec + (4 + tile), Int32)
            if cutlass.const_expr(self.tm == 1):
                # fp8 tile_rows 16: warp wm takes m-tile t = mt % 2 of pair mt // 2 (mt = its 16-row
                # tile in the expert): words 2t, 2t+1 of its lane (8 bytes) and the scale word
                # shifted so that bytes 0, 1 are rows g, g+8
                mt = blk * self.wm + wm
                pair = mt // 2
                t = mt % 2
                pw = p_w + Int64(e) * self.w_expert + ((pair * self.nch + ch0) * 128 + lane * 4 + 2 * t)
                ps = p_s + Int64(e) * self.s_expert + ((pair * self.nch + ch0) * 8 + g)
                for j in cutlass.range_constexpr(self.u):
                    q = fp4.load_u32x2(pw + j * 128, "evict_first")
                    st_w[2 * j] = q[0]
                    st_w[2 * j + 1] = q[1]
                    sv = cute.arch.load(ps + j * 8, Uint32, level1_eviction_priority="evict_first")
                    st_s[j] = sv >> Uint32(16 * t)
            else:
                pair0 = blk * (self.wm * self.pairs) + wm * self.pairs
                pw = p_w + Int64(e) * self.w_expert + ((pair0 * self.nch + ch0) * 128 + lane * 4)
                ps = p_s + Int64(e) * self.s_expert + ((pair0 * self.nch + ch0) * 8 + g)
                for j in cutlass.range_constexpr(self.u):
                    if batch * self.u + j < n_mine:
                        for t2 in cutlass.range_constexpr(self.pairs):
                            q = fp4.load_u32x4(pw + (t2 * self.nch + j) * 128, "evict_first")
                            for x in cutlass.range_constexpr(4):
                                st_w[(j * self.pairs + t2) * 4 + x] = q[x]
                            st_s[j * self.pairs + t2] = cute.arch.load(
                                ps + (t2 * self.nch + j) * 8, Uint32, level1_eviction_priority="evict_first"
                            )

        @cute.jit
        def issue_acts(self, st_a, st_as, p_a, p_as, rec, slots_at, top_k, unit, ch, n_valid, g, c):
            """Activation (e4m3 bytes + E8M0 byte) loads of `unit`'s chunks
            ch + j (j < min(unroll, n_valid); ch counts within the unit's K
            slice): token row of lane group g, its 8 K elements
            [32*chunk + 8c, +8) per chunk."""
            item, ch0 = self.unit_item(unit, ch)
            tile = item // self.blocks
            row = TILE * tile + g
            if cutlass.const_expr(self.stage == 1):
                slot = cute.arch.load(rec + (slots_at + row), Int32)
                row = cutlass.max(slot, Int32(0)) // top_k  # padding slots read token row 0
            if cutlass.const_expr(self.a16):
                # BF16 [rows, K]: 16 bytes = K elements [32*chunk + 8c, +8) = b[0..3] in memory order
                pa = p_a + (row * (self.k // 2) + ch0 * 16 + c * 4)
                for j in cutlass.range_constexpr(self.u):
                    if j < n_valid:
                        v = fp4.load_u32x4(pa + j * 16, "evict_last")
                        for x in cutlass.range_constexpr(4):
                            st_a[4 * j + x] = v[x]
            else:
                pa = p_a + (row * (self.k // 4) + ch0 * 8 + c * 2)
                pas = p_as + (row * self.nch + ch0)
                for j in cutlass.range_constexpr(self.u):
                    if j < n_valid:
                        v = fp4.load_u32x2(pa + j * 8, "evict_last")
                        st_a[2 * j] = v[0]
                        st_a[2 * j + 1] = v[1]
                        st_as[j] = Uint32(cute.arch.load(pas + j, Uint8)) & Uint32(0xFF)

        # ------------------------------------------------------------------ math
        @cute.jit
        def stage_acts(
            self, sB32, sXs, p_a, p_as, rec, slots_at, top_k, unit, tid, rank, coherent: cutlass.Constexpr[bool] = False
        ):
            """fp8 tactics, at the start of a unit: its tile's 8 activation rows
            (e4m3, K bytes each; GEMM1: token rows through the slots) into the
            shared-memory B operand (16-byte unit q = 8 * (k slot // 16) + n at
            byte 16 q: wgmma's K-major interleave layout; k slots permuted to the
            A registers' order) and their E8M0 scales as
            fp32 2^(s-121) [chunk][token]; thread tid serves token tid % 8.
            Split-K or a cluster: only this unit's / this rank's K slice.
            `coherent`: the rows were written by other CTAs of this grid (the
            fused layer's H): ld.relaxed.gpu, never a stale L1 line.
            `sB32`: the B tile's address, or one per plane (a tuple): with two
            (two-plane GEMM1) each 32-K block is split (`fp4.split_planes`)
            into the hi plane (tile 0) and the lo plane (tile 1)."""
            planes = tuple(sB32) if isinstance(sB32, (tuple, list)) else (sB32,)
            item, ch_lo = self.unit_item(unit, 0)
            ch_lo = ch_lo + rank * self.nch_c
            tile = item // self.blocks
            n = tid % 8
            row = TILE * tile + n
            if cutlass.const_expr(self.stage == 1):
                slot = cute.arch.load(rec + (slots_at + row), Int32)
                row = cutlass.max(slot, Int32(0)) // top_k  # padding slots read token row 0
            # The A registers hold k 8c .. 8c+7 of each chunk in k slots (4c .. 4c+3, 16+4c .. 16+4c+3)
            # (the weight layout's order): B's slots get the same real k. Slot group G (4 k) holds
            # real group 2 (G % 4) + G // 4: 16-byte unit 0 of a chunk = words 0, 2, 4, 6 of the
            # row's 32 bytes, unit 1 = words 1, 3, 5, 7.
            src = p_a + row * (self.k // 4)
            for q in cutlass.range_constexpr(0, 8 * self.nch_c, self.threads):
                if tid + q < 8 * self.nch_c:
                    ch = ch_lo + (tid + q) // 8
                    if cutlass.const_expr(coherent):
                        lo = fp4.load_u32x4_coherent(src + ch * 8)
                        hi = fp4.load_u32x4_coherent(src + ch * 8 + 4)
                    else:
                        lo = fp4.load_u32x4(src + ch * 8, "evict_last")
                        hi = fp4.load_u32x4(src + ch * 8 + 4, "evict_last")
                    if cutlass.const_expr(len(planes) == 2):
                        p_hi, p_lo = fp4.split_planes([*lo, *hi], PLANE_SHIFT)  # words 0..7 of the block
                        self.store_block(planes[0], ch, n, p_hi)
                        self.store_block(planes[1], ch, n, p_lo)
                    else:
                        self.store_block(planes[0], ch, n, [*lo, *hi])
            srcs = p_as + row * self.nch + ch_lo
            for q in cutlass.range_constexpr(0, 8 * self.nch_c, self.threads):
                if tid + q < 8 * self.nch_c:
                    if cutlass.const_expr(coherent):
                        code = Uint32(cute.arch.load(srcs + (tid + q) // 8, Uint8, sem="relaxed", scope="gpu"))
                    else:
                        code = Uint32(cute.arch.load(srcs + (tid + q) // 8, Uint8))
                    code = code & Uint32(0xFF)
                    sXs[ch_lo * 8 + tid + q] = fp4.act_scale_f32(code)

        @cute.jit
        def store_block(self, sB32, ch, n, words):
            """Token n's 32-K block `ch` (its 8 words in k order) into the B
            tile at sB32: 16-byte unit q = 8 * (2 ch) + n holds words 0, 2, 4, 6,
            unit q + 8 words 1, 3, 5, 7 (`stage_acts`)."""
            unit0 = sB32 + (16 * ch + n) * 4
            st_shared_u32x4(unit0, words[0], words[2], words[4], words[6])
            st_shared_u32x4(unit0 + 32, words[1], words[3], words[5], words[7])

        @cute.jit
        def decode_chunk(self, rA, st_w, j: cutlass.Constexpr[int]):
            """fp8 tactics: chunk j's weight words of a register stage decoded to
            e4m3 into its tm A fragments rA[tm * j + tt] (not in the "mma" probe)."""
            tm = self.tm
            for tt in cutlass.range_constexpr(tm if self.probe != "mma" else 0):
                r0, r1 = fp4.decode_e2m1_word_e4m3(st_w[j * 2 * tm + 2 * tt])
                r2, r3 = fp4.decode_e2m1_word_e4m3(st_w[j * 2 * tm + 2 * tt + 1])
                ra = rA[tm * j + tt]
                ra[0] = r0  # row g,   k 8c .. 8c+3
                ra[1] = r1  # row g+8, k 8c .. 8c+3
                ra[2] = r2  # row g,   k 8c+4 .. 8c+7
                ra[3] = r3  # row g+8, k 8c+4 .. 8c+7

        @cute.jit
        def retire_chunk(self, acc, tmp, sXs, st_s, j: cutlass.Constexpr[int], ch, c):
            """fp8 tactics: acc += the finished results tmp[tm * j + tt] of
            global K chunk `ch` x weight scale (scale word st_s[j]: rows g / g+8
            of m-tile tt; with byte_scales the codes st_s[2j], st_s[2j + 1]) x
            activation scale (tokens 2c / 2c+1, fp32 from shared memory); not
            in the "mma" probe. Two planes: the result is the sum of the
            two planes' results (fp32 adds), then scaled alike."""
            tm = self.tm if self.probe != "mma" else 0
            n_mma = self.tm * self.u  # tmp[n_mma + i]: fragment i's lo-plane result
            if cutlass.const_expr(tm > 0):
                xs0 = sXs[ch * 8 + 2 * c]
                xs1 = sXs[ch * 8 + 2 * c + 1]
            for tt in cutlass.range_constexpr(tm):
                if cutlass.const_expr(self.byte_scales):
                    wg = fp4.weight_scale_f32_code(st_s[2 * j], self.wide)
                    w8 = fp4.weight_scale_f32_code(st_s[2 * j + 1], self.wide)
                else:
                    wg = fp4.weight_scale_f32(st_s[j], 2 * tt, self.wide)
                    w8 = fp4.weight_scale_f32(st_s[j], 2 * tt + 1, self.wide)
                t, a = tmp[tm * j + tt], acc[tt]
                if cutlass.const_expr(self.planes == 2):
                    u = tmp[n_mma + tm * j + tt]  # the lo plane's result: hi + lo in fp32
                    t = [t[0] + u[0], t[1] + u[1], t[2] + u[2], t[3] + u[3]]
                if cutlass.const_expr(self.wide):
                    # special codes: the scale product first (a weight scale near 2^-127
                    # times a small MMA sum would go subnormal and lose bits)
                    a[0] = t[0] * (wg * xs0) + a[0]
                    a[1] = t[1] * (wg * xs1) + a[1]
                    a[2] = t[2] * (w8 * xs0) + a[2]
                    a[3] = t[3] * (w8 * xs1) + a[3]
                else:
                    a[0] = (t[0] * wg) * xs0 + a[0]
                    a[1] = (t[1] * wg) * xs1 + a[1]
                    a[2] = (t[2] * w8) * xs0 + a[2]
                    a[3] = (t[3] * w8) * xs1 + a[3]

        @cute.jit
        def issue_chunk(self, tiled_mma, acc, tmp, rA, tCrA, tCrB, ch, j: cutlass.Constexpr[int]):
            """fp8 tactics: the wgmma(s) of chunk j (global K chunk ch + j) into
            tmp[tm * j + tt]; in the "math" probe a register copy of its A
            fragments instead (the decode stays live, no MMA); in the "mma"
            probe into the accumulator acc[tt] (nothing else reads the results).
            `tCrB`: the B fragment, or one per plane (a tuple): plane p's
            wgmma, sharing the A fragment, into tmp[p * tm * unroll + tm * j + tt]."""
            planes = tuple(tCrB) if isinstance(tCrB, (tuple, list)) else (tCrB,)
            for p in cutlass.range_constexpr(len(planes)):
                b = planes[p]
                for tt in cutlass.range_constexpr(self.tm):
                    i = self.tm * j + tt
                    r = tmp[p * self.tm * self.u + i]
                    if cutlass.const_expr(self.probe == "math"):
                        for x in cutlass.range_constexpr(4):
                            r[x] = fp4.bits_f32(rA[i][x])
                    elif cutlass.const_expr(self.probe == "mma"):  # into acc: the results stay live, unscaled
                        cute.gemm(tiled_mma, acc[tt], tCrA[i][None, None, 0], b[None, None, ch + j], acc[tt])
                    else:
                        cute.gemm(tiled_mma, r, tCrA[i][None, None, 0], b[None, None, ch + j], r)

        def mma_sync_op(self, op: str, n: int = 0) -> None:
            """warpgroup fence / commit_group / wait_group(n) (trace-time
            Python); nothing in the "math" probe, which issues no wgmma."""
            if self.probe == "math":
                return
            if op == "fence":
                warpgroup.fence()
            elif op == "commit":
                warpgroup.commit_group()
            else:
                warpgroup.wait_group(n)

        @cute.jit
        def compute_wgmma(self, tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w, st_s, ch, lane):
            """fp8 tactics: the unroll chunks from `ch` (global K chunk index)
            of a register stage. Weights decoded to e4m3 into tm * unroll A
            fragments (the warp's tm = tile_rows / 16 m-tiles per chunk), one wgmma
            m64n8k32 per (chunk, m-tile) into its own zeroed result (one MX
            block each), one commit / wait, then acc += result x weight scale
            (row g / g+8) x activation scale (token 2c / 2c+1, fp32 from
            shared memory)."""
            for j in cutlass.range_constexpr(self.u):
                self.decode_chunk(rA, st_w, j)
            self.mma_sync_op("fence")
            for j in cutlass.range_constexpr(self.u):
                self.issue_chunk(tiled_mma, acc, tmp, rA, tCrA, tCrB, ch, j)
            self.mma_sync_op("commit")
            self.mma_sync_op("wait", 0)
            for j in cutlass.range_constexpr(self.u):
                self.retire_chunk(acc, tmp, sXs, st_s, j, ch + j, lane % 4)

        @cute.jit
        def pipelined_step(self, tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w, st_s, ch, lane):
            """fp8 tactics with mma_depth D >= 1: `compute_wgmma` with the
            decode and the scaling overlapped. Chunk by chunk: decoded (while
            the chunks before it multiply), fenced, its wgmma(s) committed as
            its own group; once D more groups are in flight (wait_group D) the
            oldest chunk is scaled into the accumulator while the wgmmas
            behind it run; the last D after wait_group 0. Same operations in
            the same order per accumulator as compute_wgmma: the same bits."""
            D, U = self.tactic.mma_depth, self.u
            c = lane % 4
            for j in cutlass.range_constexpr(U):
                # chunk j is decoded while chunk j - 1's wgmmas run (its A registers are its own)
                self.decode_chunk(rA, st_w, j)
                self.mma_sync_op("fence")
                self.issue_chunk(tiled_mma, acc, tmp, rA, tCrA, tCrB, ch, j)
                self.mma_sync_op("commit")
                if cutlass.const_expr(j >= D):
                    self.mma_sync_op("wait", D)
                    self.retire_chunk(acc, tmp, sXs, st_s, j - D, ch + (j - D), c)
            self.mma_sync_op("wait", 0)
            for q in cutlass.range_constexpr(U - D, U):
                self.retire_chunk(acc, tmp, sXs, st_s, q, ch + q, c)

        @cute.jit
        def compute(self, tiled_mma, acc, rA, rB, tCrA, tCrB, st_w, st_s, st_a, st_as, n_valid):
            """mma.sync (BF16 tactics) of the first min(unroll, n_valid) chunks of a register stage."""
            for j in cutlass.range_constexpr(self.u):
                if j < n_valid:
                    b = []
                    if cutlass.const_expr(self.a16):
                        for x in cutlass.range_constexpr(4):  # already BF16: (k0,k1) (k2,k3) (k4,k5) (k6,k7)
                            b.append(st_a[4 * j + x])
                    else:
                        m1, m2 = fp4.act_multipliers(st_as[j])
                        for kk in cutlass.range_constexpr(2):
                            lo, hi = fp4.e4m3x4_to_bf16x2(st_a[2 * j + kk])
                            b.append(fp4.mul_bf16x2(fp4.mul_bf16x2(lo, m1), m2))
                            b.append(fp4.mul_bf16x2(fp4.mul_bf16x2(hi, m1), m2))
                    for t2 in cutlass.range_constexpr(self.pairs):
                        sv = st_s[j * self.pairs + t2]
                        for tt in cutlass.range_constexpr(2):
                            if cutlass.const_expr(self.wide):
                                a1, a2 = fp4.weight_multipliers_wide(sv, 2 * tt)
                                c1, c2 = fp4.weight_multipliers_wide(sv, 2 * tt + 1)
                            else:
                                a1 = fp4.weight_multiplier(sv, 2 * tt)
                                c1 = fp4.weight_multiplier(sv, 2 * tt + 1)
                            for kk in cutlass.range_constexpr(2):
                                r0, r1, r2, r3 = fp4.decode_e2m1_word(st_w[(j * self.pairs + t2) * 4 + 2 * tt + kk])
                                if cutlass.const_expr(self.wide):
                                    rA[0] = fp4.mul_bf16x2(fp4.mul_bf16x2(r0, a1), a2)
                                    rA[1] = fp4.mul_bf16x2(fp4.mul_bf16x2(r1, c1), c2)
                                    rA[2] = fp4.mul_bf16x2(fp4.mul_bf16x2(r2, a1), a2)
                                    rA[3] = fp4.mul_bf16x2(fp4.mul_bf16x2(r3, c1), c2)
                                else:
                                    rA[0] = fp4.mul_bf16x2(r0, a1)  # row g
                                    rA[1] = fp4.mul_bf16x2(r1, c1)  # row g + 8
                                    rA[2] = fp4.mul_bf16x2(r2, a1)
                                    rA[3] = fp4.mul_bf16x2(r3, c1)
                                rB[0] = b[2 * kk]
                                rB[1] = b[2 * kk + 1]
                                cute.gemm(tiled_mma, acc[2 * t2 + tt], tCrA, tCrB, acc[2 * t2 + tt])

        def mma_fragments(self):
            """`warp_mma_fragments` with tile_rows/16 accumulators."""
            return warp_mma_fragments(self.tm)

        def stash_partials(self, sP, acc, parity, warp, lane):
            """This warp's accumulators to its shared-memory partials (`parity`
            half), then zeroed for the next unit (trace-time Python)."""
            for t in range(self.tm):  # a plain Python loop: unrolled while tracing, as range_constexpr
                for x in range(4):
                    sP[t * 128 + lane * 4 + x, warp, parity] = acc[t][x]
                acc[t].fill(0.0)

        @cute.jit
        def partial(self, sP, parity, r, n):
            """Sum over the warps_k partials of item row r (0..rm), token n."""
            rr = r % self.tactic.tile_rows
            r16 = rr % 16
            src = (rr // 16) * 128 + ((r16 % 8) * 4 + n // 2) * 4 + (r16 // 8) * 2 + n % 2
            wm = r // self.tactic.tile_rows
            tot = sP[src, self.warp_of(wm, 0), parity]
            for k in cutlass.range_constexpr(1, self.wk):
                tot = tot + sP[src, self.warp_of(wm, k), parity]
            return tot

        @cute.jit
        def value(self, sP, parity, part, item, r, n):
            """The item's fp32 sum for item row r, token n: from the warps_k
            partials in shared memory, or (split-K) the sum of the split_k slice
            partials in the workspace, in slice order (deterministic). With a
            cluster (rank 0 only) `part` is the landing zone: rank 0's own sum,
            then ranks 1.. in order."""
            if cutlass.const_expr(self.sk == 1):
                tot = self.partial(sP, parity, r, n)
                if cutlass.const_expr(self.cl > 1):
                    for k in cutlass.range_constexpr(1, self.cl):
                        tot = tot + part[(parity * (self.cl - 1) + k - 1) * (TILE * self.rm) + n * self.rm + r]
            else:
                base = part + (item * (self.sk * TILE * self.rm) + n * self.rm + r)
                tot = fp4.load_partial(base)
                for k in cutlass.range_constexpr(1, self.sk):
                    tot = tot + fp4.load_partial(base + k * (TILE * self.rm))
            return tot

        @cute.jit
        def store_partials(self, sP, parity, part, unit, tid):
            """Split-K: this unit's [8 tokens][item_rows] fp32 sums (over its
            warps_k partials) to the workspace at unit * 8 * item_rows."""
            n_vals = TILE * self.rm
            base = part + unit * n_vals
            for p in cutlass.range_constexpr(0, n_vals, self.threads):
                f = tid + p
                if f < n_vals:
                    cute.arch.store(base + f, self.partial(sP, parity, f % self.rm, f // self.rm))

        @cute.jit
        def push_partials(self, sP, sL, cbars, parity, rank, tid):
            """Cluster rank >= 1: this CTA's [8 tokens][item rows] fp32 sums
            (over its warps_k partials) into rank 0's landing zone (`parity`
            half, slot rank - 1) with st.async, each store completing its 4
            bytes on rank 0's land[parity] mbarrier."""
            n_vals = TILE * self.rm
            base = (parity * (self.cl - 1) + rank - 1) * n_vals
            for p in cutlass.range_constexpr(0, n_vals, self.threads):
                f = tid + p
                if f < n_vals:
                    v = self.partial(sP, parity, f % self.rm, f // self.rm)
                    st_async_cluster(sL.iterator + (base + f), cbars + parity, Int32(0), fp4.f32_bits(v))

        @cute.jit
        def cluster_epilogue(
            self, sP, sL, cbars, parity, n, count, rank, rec, clamp, out, out_s, unit, valid_at, warp, lane, tid
        ):
            """The end of the cluster's n-th unit (of `count`), after this CTA's
            partials are in sP. Rank 0: arm land[parity] for the other ranks'
            bytes, wait for them (acquire at cluster scope), run the epilogue;
            unless this was one of the last two units, tell each rank that
            land[parity] may be written again (free[parity] there). Ranks >= 1:
            from the third unit on, wait until rank 0 freed the half, then push."""
            if rank == 0:
                if tid == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(cbars + parity, (self.cl - 1) * TILE * self.rm * 4)
                while mbarrier_try_wait_cluster(cbars + parity, (n // 2) % 2) == Uint32(0):
                    pass
                self.epilogue(sP, parity, sL, rec, clamp, out, out_s, out, unit, valid_at, warp, lane, tid)
                if n + 2 < count:
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)  # landing half read
                    if tid == 0:
                        for r in cutlass.range_constexpr(1, self.cl):
                            mbarrier_arrive_cluster(cbars + (2 + parity), Int32(r))
            else:
                if n >= 2:
                    while mbarrier_try_wait_cluster(cbars + (2 + parity), (n // 2 - 1) % 2) == Uint32(0):
                        pass
                self.push_partials(sP, sL, cbars, parity, rank, tid)

        # ------------------------------------------------------------------ epilogues
        @cute.jit
        def epilogue(self, sP, parity, part, rec, clamp, out, out_s, out_deq, item, valid_at, warp, lane, tid):
            if cutlass.const_expr(self.stage == 1):
                self.epilogue_gemm1(sP, parity, part, rec, clamp, out, out_s, out_deq, item, valid_at, warp, lane)
            else:
                self.epilogue_gemm2(sP, parity, part, rec, out, item, valid_at, tid)

        @cute.jit
        def epilogue_gemm1(self, sP, parity, part, rec, clamp, out, out_s, out_deq, item, valid_at, warp, lane):
            """SwiGLU + MXFP8 quantization of one item: one warp per (token, 32 columns).
            With tactic.act_bf16 also the BF16 value of each (q, code) to
            out_deq, made by the very instructions GEMM2's e4m3 decode runs
            (`fp4.e4m3x4_to_bf16x2`, `fp4.act_multipliers`, two HMUL2): the
            same bits by construction, NaN for code 255."""
            tile = item // self.blocks
            blk = item % self.blocks
            valid = cute.arch.load(rec + (valid_at + tile), Int32)
            e = cute.arch.load(rec + (4 + tile), Int32)
            lim = cute.arch.load(clamp + e, Float32)
            qblocks = self.rm // 64
            i_cols = self.shape.intermediate
            for sl in cutlass.range_constexpr(0, 8 * qblocks, self.nw):
                slot = warp + sl
                if slot < 8 * qblocks:
                    n = slot % 8
                    qb = slot // 8
                    gate = self.value(sP, parity, part, item, qb * 64 + lane, n)
                    up = self.value(sP, parity, part, item, qb * 64 + 32 + lane, n)
                    gc = cutlass.min(gate, lim)
                    uc = cutlass.min(cutlass.max(up, -lim), lim)
                    h = fp4.div_rn(gc, Float32(1.0) + cute.math.exp(-gc, fastmath=True)) * uc
                    # E8M0 scale by the round-up rule: s = amax/448 (RN), +1 binade if inexact
                    amax = cute.math.absf(h)
                    for sh in cutlass.range_constexpr(5):
                        amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 1 << sh))
                    bad = cute.arch.vote_any_sync(fp4.not_finite(h))
                    s = fp4.div_rn(amax, Float32(448.0))
                    sb = fp4.f32_bits(s)
                    code = ((sb >> Uint32(23)) & Uint32(0xFF)) + Uint32((sb & Uint32(0x7FFFFF)) != Uint32(0))
                    code = cutlass.min(code, Uint32(254))
                    ex = Uint32(254) - code
                    mb = Uint32(cutlass.select_(ex == Uint32(0), Uint32(fp4.F32_2_M127), ex << Uint32(23)))
                    q = fp4.to_e4m3(h * fp4.bits_f32(mb))
                    zero = amax == Float32(0.0)
                    q = Uint32(cutlass.select_(zero, Uint32(0), q))
                    code = Uint32(cutlass.select_(zero, Uint32(0), code))
                    q = Uint32(cutlass.select_(bad, Uint32(0x7F), q))
                    code = Uint32(cutlass.select_(bad, Uint32(255), code))
                    pad = n >= valid
                    q = Uint32(cutlass.select_(pad, Uint32(0), q))
                    code = Uint32(cutlass.select_(pad, Uint32(0), code))
                    row = TILE * tile + n
                    col = blk * (self.rm // 2) + qb * 32 + lane
                    cute.arch.store(out + (row * i_cols + col), Uint8(q))
                    if cutlass.const_expr(self.a16):
                        m1, m2 = fp4.act_multipliers(code)
                        dlo, _dhi = fp4.e4m3x4_to_bf16x2(q)
                        d = fp4.mul_bf16x2(fp4.mul_bf16x2(dlo, m1), m2)
                        p16 = cute.recast_ptr(out_deq, dtype=Uint16)
                        cute.arch.store(p16 + (row * i_cols + col), Uint16(d & Uint32(0xFFFF)))
                    if lane == 0:
                        cute.arch.store(out_s + (row * (i_cols // 32) + blk * qblocks + qb), Uint8(code))

        @cute.jit
        def epilogue_gemm2(self, sP, parity, part, rec, out, item, valid_at, tid):
            """BF16 rows of one item: pairs of adjacent output columns per thread."""
            tile = item // self.blocks
            blk = item % self.blocks
            valid = cute.arch.load(rec + (valid_at + tile), Int32)
            half = self.rm // 2
            out32 = cute.recast_ptr(out, dtype=Uint32)
            for p in cutlass.range_constexpr(0, 8 * half, self.threads):
                f = tid + p
                if f < 8 * half:
                    n = f // half
                    r = 2 * (f % half)
                    v0 = self.value(sP, parity, part, item, r, n)
                    v1 = self.value(sP, parity, part, item, r + 1, n)
                    word = fp4.pack_bf16x2(v0, v1)
                    word = Uint32(cutlass.select_(n >= valid, Uint32(0), word))
                    row = TILE * tile + n
                    cute.arch.store(out32 + ((row * self.shape.hidden + blk * self.rm + r) // 2), word)

        # ------------------------------------------------------------------ kernel
        @cute.kernel
        def kernel(self, kargs: GemmArgs):
            if cutlass.const_expr(self.bulk):
                self.bulk_body(kargs.w, kargs.ws, kargs.act, kargs.act_s, kargs.record, kargs.clamp, kargs.out,
                               kargs.out_s, kargs.out_deq, kargs.ids, kargs.meta, kargs.ctas)  # fmt: skip
            else:
                self.register_body(kargs.w, kargs.ws, kargs.act, kargs.act_s, kargs.record, kargs.clamp, kargs.out,
                                   kargs.out_s, kargs.out_deq, kargs.cnt, kargs.part, kargs.ctas)  # fmt: skip

        @cute.jit
        def register_body(self, w, ws, act, act_s, record, clamp, out, out_s, out_deq, cnt, part, ctas):
            """Register load path (tactic.stages == 0): every lane streams its own words."""
            U, NB, SK = self.u, self.nb, self.sk
            tid, bid, nblk = cute.arch.thread_idx()[0], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            warp, lane = tid // 32, tid % 32
            g, c = lane // 4, lane % 4
            wm, wk = warp // self.wk, warp % self.wk
            if cutlass.const_expr(self.fp8):
                wm, wk = warp % self.wm, warp // self.wm  # a warpgroup shares wk (warp_of)
            c_beg = wk * self.per  # first chunk of this warp within a K slice
            n_mine = cutlass.min(Int32(self.per), self.nch_s - c_beg)  # chunks of this warp per unit
            words = (ctas + 3) // 4 * 4
            valid_at = 4 + words
            slots_at = 4 + 2 * words

            p_w = cute.recast_ptr(w, dtype=Uint32)
            p_s = cute.recast_ptr(ws, dtype=Uint32)
            p_a = cute.recast_ptr(act, dtype=Uint32)
            p_as = cute.recast_ptr(act_s, dtype=Uint8)

            pw_n, ps_n = max(self.pairs * U * 4, 2 * U), max(self.pairs * U, U)
            st_w = [cute.make_rmem_tensor((pw_n,), Uint32) for _ in range(2)]
            st_s = [cute.make_rmem_tensor((ps_n,), Uint32) for _ in range(2)]
            smem = cutlass.memory.SmemAllocator()
            sP = smem.allocate_tensor(Float32, cute.make_layout((self.tm * 128, self.nw, 2)), byte_alignment=16)
            if cutlass.const_expr(self.fp8):
                tiled_mma, rA, tCrA, acc, tmp = wgmma_fp8_fragments(self.tm * U, self.tm, self.planes)
                sB = self.alloc_b_tile(smem)
                sXs = smem.allocate_tensor(Float32, cute.make_layout((8 * self.nch,)), byte_alignment=16)
                sB32, tCrB = self.b_views(tiled_mma, sB, tid)
            else:
                tiled_mma, rA, rB, tCrA, tCrB, acc = self.mma_fragments()
                st_a = [cute.make_rmem_tensor((self.aw * U,), Uint32) for _ in range(2)]
                st_as = [cute.make_rmem_tensor((U,), Uint32) for _ in range(2)]
            sLast = None
            if cutlass.const_expr(SK > 1):
                sLast = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=4)

            # ---- prologue
            n_units = Int32(0)
            if cutlass.const_expr(self.stage == 2 and self.tactic.pdl):
                # the record predates the previous kernel (module docstring): weights first
                n_units = cute.arch.load(record, Int32) * (self.blocks * SK)  # units
                if bid < n_units:
                    self.issue_weights(st_w[0], st_s[0], p_w, p_s, record, bid, Int32(0), n_mine, c_beg, wm, lane, g)
            if cutlass.const_expr(self.tactic.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(not (self.stage == 2 and self.tactic.pdl)):
                n_units = cute.arch.load(record, Int32) * (self.blocks * SK)  # units
                if bid < n_units:
                    self.issue_weights(st_w[0], st_s[0], p_w, p_s, record, bid, Int32(0), n_mine, c_beg, wm, lane, g)
            top_k = cute.arch.load(record + 3, Int32)
            my_units = (n_units + nblk - 1 - bid) // nblk
            n_steps = my_units * NB
            if cutlass.const_expr(not self.fp8):
                if n_steps > 0:
                    self.issue_acts(st_a[0], st_as[0], p_a, p_as, record, slots_at, top_k, bid, c_beg, n_mine, g, c)

            l_unit, l_b = bid, Int32(1)  # load cursor: step 1
            wrap = Int32(l_b == NB)
            l_b, l_unit = l_b - wrap * NB, l_unit + wrap * nblk
            c_unit, c_b, parity = bid, Int32(0), Int32(0)  # compute cursor
            for i in cutlass.range(0, n_steps, 2, unroll=1):
                for s in cutlass.range_constexpr(2):
                    if i + s < n_steps:
                        if i + s + 1 < n_steps:  # next step's loads go out first
                            self.issue_weights(
                                st_w[1 - s], st_s[1 - s], p_w, p_s, record, l_unit, l_b, n_mine, c_beg, wm, lane, g
                            )
                            if cutlass.const_expr(not self.fp8):
                                self.issue_acts(
                                    st_a[1 - s],
                                    st_as[1 - s],
                                    p_a,
                                    p_as,
                                    record,
                                    slots_at,
                                    top_k,
                                    l_unit,
                                    c_beg + l_b * U,
                                    n_mine - l_b * U,
                                    g,
                                    c,
                                )
                            l_b = l_b + 1
                            wrap = Int32(l_b == NB)
                            l_b, l_unit = l_b - wrap * NB, l_unit + wrap * nblk
                        if cutlass.const_expr(self.fp8):
                            if c_b == 0:  # a new unit: its activation rows into shared memory
                                self.stage_acts(sB32, sXs, p_a, p_as, record, slots_at, top_k, c_unit, tid, 0)
                                cute.arch.fence_proxy("async.shared", space="cta")  # generic -> wgmma reads
                                cute.arch.sync_threads()
                            _, ch = self.unit_item(c_unit, c_beg + c_b * U)
                            self.compute_wgmma(tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w[s], st_s[s], ch, lane)
                        else:
                            self.compute(
                                tiled_mma,
                                acc,
                                rA,
                                rB,
                                tCrA,
                                tCrB,
                                st_w[s],
                                st_s[s],
                                st_a[s],
                                st_as[s],
                                n_mine - c_b * U,
                            )
                        if c_b == NB - 1:  # unit done: partials to smem, one barrier, epilogue
                            self.stash_partials(sP, acc, parity, warp, lane)
                            cute.arch.sync_threads()
                            self.finish_unit(
                                sP, sLast, parity, part, cnt, record, clamp, out, out_s, out_deq, c_unit, valid_at,
                                warp, lane, tid
                            )  # fmt: skip
                        last = Int32(c_b == NB - 1)
                        parity = parity ^ last
                        c_b = c_b + 1 - last * NB
                        c_unit = c_unit + last * nblk

        @cute.jit
        def finish_unit(
            self, sP, sLast, parity, part, cnt, record, clamp, out, out_s, out_deq, unit, valid_at, warp, lane, tid
        ):
            """Register load path, after a unit's partials are in sP: the
            epilogue, or (split-K) the unit's sums to the workspace and an
            arrival on its item's counter, the last of the item's SK units
            reducing the partials and running the epilogue. The counter wraps
            to 0 on the last arrival (self-cleaning). Ordering (CUTLASS's
            barrier pattern): the CTA's stores, bar.sync, thread 0's gpu-scope
            fence (cumulative: releases every thread's stores) and acq_rel
            atomic; bar.sync; the readers use ld.relaxed.gpu (L2, never a stale
            L1 line). Only warp 0 waits on the fence, the other warps' next
            loads stay in flight."""
            SK = self.sk
            if cutlass.const_expr(SK == 1):
                self.epilogue(sP, parity, part, record, clamp, out, out_s, out_deq, unit, valid_at, warp, lane, tid)
            else:
                item = unit // SK
                self.store_partials(sP, parity, part, unit, tid)
                cute.arch.sync_threads()
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                    old = fp4.arrive_inc(cnt + item, SK - 1)
                    sLast[0] = Int32(old == Uint32(SK - 1))
                cute.arch.sync_threads()
                if sLast[0] != 0:  # uniform over the CTA: the last unit of the item
                    self.epilogue(
                        sP, parity, part, record, clamp, out, out_s, out_deq, item, valid_at, warp, lane, tid
                    )  # fmt: skip

        # ------------------------------------------------------------------ bulk-copy load path
        @cute.jit
        def bulk_body(self, w, ws, act, act_s, record, clamp, out, out_s, out_deq, ids, meta, ctas):
            """Bulk load path (tactic.stages = S >= 2). Warps 0..nw-1 compute as in
            the register path; warp nw is the producer. Step i of a CTA (item
            i // NB, K chunks [b*KS, (b+1)*KS), b = i % NB, KS = warps_k*unroll)
            lives in ring stage i % S: per pair of the item one contiguous copy
            of its KS chunks (512 B each) and one of their scales (32 B each),
            completing full[s]; the nw compute warps arrive on empty[s] when done
            with it. Warp (wm, wk) takes chunks b*KS + wk*unroll + j, so one
            stage holds the whole CTA's next K slab (K interleaved over warps)."""
            S = self.tactic.stages
            tid, bid, nblk = cute.arch.thread_idx()[0], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            warp, lane = tid // 32, tid % 32
            # a cluster (cluster_k > 1) takes the units a CTA would; its rank r streams K slice r
            rank = Int32(0)
            if cutlass.const_expr(self.cl > 1):
                rank = cute.arch.block_idx_in_cluster()
            cid, ncl = bid // self.cl, nblk // self.cl
            smem = cutlass.memory.SmemAllocator()
            sP = smem.allocate_tensor(Float32, cute.make_layout((self.tm * 128, self.nw, 2)), byte_alignment=16)
            ring = smem.allocate_array(Uint32, S * self.stage_words, byte_alignment=128)
            bars = smem.allocate_array(Int64, 2 * S, byte_alignment=8)  # full[0, S), empty[S, 2S)
            scratch = None
            if cutlass.const_expr(self.tactic.spec):  # the producer's own: no other warp touches it
                scratch = smem.allocate_array(Uint32, SPEC_WORDS, byte_alignment=16)
            sB = sXs = None
            if cutlass.const_expr(self.fp8):
                sB = self.alloc_b_tile(smem)
                sXs = smem.allocate_tensor(Float32, cute.make_layout((8 * self.nch,)), byte_alignment=16)
            sL = cbars = None
            if cutlass.const_expr(self.cl > 1):
                sL = smem.allocate_tensor(
                    Float32, cute.make_layout((cluster_landing_bytes(self.tactic) // 4,)), byte_alignment=16
                )
                cbars = smem.allocate_array(Int64, 4, byte_alignment=8)  # land[0, 2) (rank 0), free[2, 4)
            if tid == 0:
                for s in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(bars + s, 1)
                    cute.arch.mbarrier_init(bars + (S + s), self.nw)
                if cutlass.const_expr(self.cl > 1):
                    for q in cutlass.range_constexpr(4):
                        cute.arch.mbarrier_init(cbars + q, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if cutlass.const_expr(self.cl > 1):  # every CTA's mbarriers exist before any remote arrive
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
            if warp == self.nw:
                self.bulk_produce(w, ws, record, ring, bars, cid, ncl, lane, ids, meta, scratch, rank)
            elif cutlass.const_expr(self.fp8):
                self.bulk_consume_wgmma(
                    act,
                    act_s,
                    record,
                    clamp,
                    out,
                    out_s,
                    ctas,
                    sP,
                    ring,
                    bars,
                    sB,
                    sXs,
                    tid,
                    cid,
                    ncl,
                    warp,
                    lane,
                    rank,
                    sL,
                    cbars,
                )
            else:
                self.bulk_consume(
                    act, act_s, record, clamp, out, out_s, out_deq, ctas, sP, ring, bars, tid, bid, nblk, warp, lane
                )

        @cute.jit
        def bulk_produce(self, w, ws, record, ring, bars, bid, nblk, lane, ids, meta, scratch, rank):
            """The producer warp: for each step, wait until its stage is free,
            arm full[s] with the step's bytes (lane 0), then lanes issue one
            weight and one scale bulk copy per pair (L2 evict-first). A `spec`
            tactic first predicts the record's tiles from the top-k ids
            (`predict_tiles`) and issues its first min(stages, steps) stages
            before griddepcontrol.wait; after the wait it checks the record's
            tile count against the prediction (a mismatch traps). With a
            cluster, `bid` / `nblk` are the cluster's index and count and the
            steps are those of K slice `rank` (nb_c per unit)."""
            S, NB = self.tactic.stages, self.nb_c
            b0 = rank * NB  # the slice's first step
            p_w = cute.recast_ptr(w, dtype=Uint32)
            p_s = cute.recast_ptr(ws, dtype=Uint32)
            start, predicted = Int32(0), Int32(-1)
            if cutlass.const_expr(self.tactic.spec):
                tiles, ok = self.predict_tiles(ids, meta, scratch, lane)
                if ok != Int32(0):
                    predicted = tiles
                    unit, count, stride = self.unit_span(tiles * self.blocks, bid, nblk)
                    start = cutlass.min(Int32(S), count * NB)
                    b = Int32(0)
                    for i in cutlass.range(0, start, 1, unroll=1):
                        e = self.nth_expert(scratch, unit // self.blocks)
                        self.issue_stage(p_w, p_s, ring, bars, i % S, e, unit % self.blocks, b0 + b, lane)
                        b = b + 1
                        wrap = Int32(b == NB)
                        b, unit = b - wrap * NB, unit + wrap * stride
            if cutlass.const_expr(self.tactic.pdl and self.stage == 1):
                cute.arch.griddepcontrol_wait()  # GEMM1's record comes from the previous kernel
            tiles_rec = cute.arch.load(record, Int32)
            if cutlass.const_expr(self.tactic.spec):
                if predicted >= Int32(0):
                    if predicted != tiles_rec:
                        trap()  # the stages issued above hold the wrong experts' weights
            n_units = tiles_rec * self.blocks
            unit, count, stride = self.unit_span(n_units, bid, nblk)
            n_steps = count * NB
            if cutlass.const_expr(self.resident):  # compute only: the first S steps, loaded once
                n_steps = cutlass.min(n_steps, Int32(S))
            b = start % NB
            unit = unit + (start // NB) * stride
            for i in cutlass.range(start, n_steps, 1, unroll=1):
                s = i % S
                if i >= S:
                    cute.arch.mbarrier_wait(bars + (S + s), (i // S - 1) % 2)
                e = cute.arch.load(record + (4 + unit // self.blocks), Int32)
                self.issue_stage(p_w, p_s, ring, bars, s, e, unit % self.blocks, b0 + b, lane)
                b = b + 1
                wrap = Int32(b == NB)
                b, unit = b - wrap * NB, unit + wrap * stride

        @cute.jit
        def issue_stage(self, p_w, p_s, ring, bars, s, e, blk, b, lane, stride_words: cutlass.Constexpr[int] = 0):
            """Ring stage `s` <- step b of item block `blk` of expert `e`: lane 0
            arms full[s] with the step's bytes, then one weight and one scale
            bulk copy per 32-row pair of the item (lanes over pairs). Stages
            are `stride_words` apart (0: this kernel's own stage size)."""
            KS, NP = self.ks, self.np
            ch0 = b * KS
            nck = cutlass.min(Int32(KS), self.nch - ch0)
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bars + s, nck * (NP * 544))
            cute.arch.sync_warp()
            stage = ring + s * (stride_words if stride_words else self.stage_words)
            for q in cutlass.range_constexpr(0, NP, 32):
                p = lane + q
                if p < NP:
                    pair = blk * NP + p
                    src_w = p_w + (Int64(e) * self.w_expert + (pair * self.nch + ch0) * 128)
                    src_s = p_s + (Int64(e) * self.s_expert + (pair * self.nch + ch0) * 8)
                    prims.cp_async_bulk_shared_cluster_global(
                        stage + p * (KS * 128), src_w, bars + s, nck * 512, l2_cache_hint=_EVICT_FIRST
                    )
                    prims.cp_async_bulk_shared_cluster_global(
                        stage + (self.sw_words + p * (KS * 8)), src_s, bars + s, nck * 32, l2_cache_hint=_EVICT_FIRST
                    )

        @cute.jit
        def predict_tiles(self, ids, meta, scratch, lane):
            """(tiles, ok) of the route record the top-k ids will make, by the
            producer warp alone (the route kernel's fast path, `route.py`):
            `scratch` (shared, SPEC_WORDS words) gets the used-expert bitmap
            (words 0..15), the experts' 8-bit row masks (16..143) and each
            bitmap word's exclusive prefix count (144..159). ids: int32
            [rows, top_k] with meta = rows << 8 | top_k, read with
            ld.relaxed.gpu. ok = 0 when a row repeats an expert (then an expert
            may own two tiles and the prediction is not made)."""
            rows, top_k = meta >> 8, meta & 0xFF
            slots = rows * top_k
            for q in cutlass.range_constexpr(0, SPEC_WORDS, 32):
                scratch[lane + q] = Uint32(0)
            cute.arch.sync_warp()
            repeated = Int32(0)
            for h in cutlass.range_constexpr(2):
                slot = lane + 32 * h
                if slot < slots:
                    e = cute.arch.load(ids + slot, Int32, sem="relaxed", scope="gpu")
                    if e >= 0 and e < self.shape.experts:
                        row = Int32(0)
                        for j in cutlass.range_constexpr(1, 8):
                            row = row + Int32(slot >= j * top_k)
                        bit = Uint32(1) << Uint32(row)
                        shift = Uint32((e & 3) * 8)
                        old = cute.arch.atomic_or(scratch + (16 + (e >> 2)), bit << shift, scope="cta")
                        repeated = repeated | Int32(((old >> shift) & bit) != Uint32(0))
                        cute.arch.atomic_or(scratch + (e >> 5), Uint32(1) << Uint32(e & 31), scope="cta")
            cute.arch.sync_warp()
            n = Int32(0)
            if lane < 16:
                n = Int32(cute.arch.popc(scratch[lane]))
            incl = n
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                incl = incl + (up if lane >= (1 << d) else Int32(0))
            if lane < 16:
                scratch[144 + lane] = Uint32(incl - n)
            cute.arch.sync_warp()
            ok = Int32(cute.arch.vote_ballot_sync(repeated != Int32(0)) == Uint32(0))
            return cute.arch.shuffle_sync(incl, 15), ok

        @cute.jit
        def nth_expert(self, scratch, tile):
            """Expert of tile `tile` (the tile-th set bit of the bitmap that
            `predict_tiles` left in `scratch`); the same in every lane."""
            word = Int32(0)
            for j in cutlass.range_constexpr(1, 16):
                word = word + Int32(Int32(scratch[144 + j]) <= tile)
            k = tile - Int32(scratch[144 + word])
            bits = scratch[word]
            base = Int32(0)
            for width in cutlass.range_constexpr(5):
                wd = 16 >> width
                c = Int32(cute.arch.popc((bits >> Uint32(base)) & Uint32((1 << wd) - 1)))
                step = Int32(k >= c)
                k = k - step * c
                base = base + step * wd
            return word * 32 + base

        @cute.jit
        def unit_span(self, n_units, bid, nblk):
            """(first unit, units, stride) of CTA `bid` of `nblk` over `n_units`:
            round-robin (bid, bid + nblk, ...), or for fp8 tactics on the bulk
            ring a contiguous range (equal sizes within one), so that a CTA's
            consecutive units mostly share a token tile and its staged
            activation rows (`bulk_consume_wgmma` stages them once per tile)."""
            first, count, stride = bid, (n_units + nblk - 1 - bid) // nblk, Int32(nblk)
            if cutlass.const_expr(self.fp8):
                q = n_units // nblk
                r = n_units % nblk
                first = bid * q + cutlass.min(bid, r)
                count = q + Int32(bid < r)
                stride = Int32(1)
            return first, count, stride

        @cute.jit
        def ring_wait(self, bars, s, ph):
            """A consumer warp waits until ring stage s holds its words: phase
            ph of full[s]; in resident mode (the compute-only measurement) the
            stage's one and only fill, whatever the step."""
            if cutlass.const_expr(self.resident):
                cute.arch.mbarrier_wait(bars + s, 0)
            else:
                cute.arch.mbarrier_wait(bars + s, ph)

        @cute.jit
        def ring_release(self, bars, S: cutlass.Constexpr[int], s, lane):
            """A consumer warp is done with ring stage s: lane 0 arrives on
            empty[s] (after the warp's reads); nothing in resident mode, where
            the stage is never refilled."""
            if cutlass.const_expr(not self.resident):
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(bars + (S + s))

        @cute.jit
        def bulk_consume(
            self, act, act_s, record, clamp, out, out_s, out_deq, ctas, sP, ring, bars, tid, bid, nblk, warp, lane
        ):
            """The compute warps: per step, activation loads (global, L1), wait
            full[s], weight words and scales from the stage into registers,
            mma.sync, release the stage; per item the partials meet in shared
            memory (named barrier 1 over the compute warps) and the epilogue runs."""
            S, NB, KS, U = self.tactic.stages, self.nb, self.ks, self.u
            g, c = lane // 4, lane % 4
            wm, wk = warp // self.wk, warp % self.wk
            words = (ctas + 3) // 4 * 4
            valid_at = 4 + words
            slots_at = 4 + 2 * words
            p_a = cute.recast_ptr(act, dtype=Uint32)
            p_as = cute.recast_ptr(act_s, dtype=Uint8)
            tiled_mma, rA, rB, tCrA, tCrB, acc = self.mma_fragments()
            st_w = cute.make_rmem_tensor((self.pairs * U * 4,), Uint32)
            st_s = cute.make_rmem_tensor((self.pairs * U,), Uint32)
            st_a = cute.make_rmem_tensor((self.aw * U,), Uint32)
            st_as = cute.make_rmem_tensor((U,), Uint32)
            if cutlass.const_expr(self.tactic.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            n_units = cute.arch.load(record, Int32) * self.blocks
            top_k = cute.arch.load(record + 3, Int32)
            n_steps = (n_units + nblk - 1 - bid) // nblk * NB
            unit, b, parity = bid, Int32(0), Int32(0)
            for i in cutlass.range(0, n_steps, 1, unroll=1):
                s = i % S
                ch = b * KS + wk * U
                n_valid = self.nch - ch
                self.issue_acts(st_a, st_as, p_a, p_as, record, slots_at, top_k, unit, ch, n_valid, g, c)
                self.ring_wait(bars, s, (i // S) % 2)
                stage = ring + s * self.stage_words
                for j in cutlass.range_constexpr(U):
                    if j < n_valid:
                        for t2 in cutlass.range_constexpr(self.pairs):
                            entry = (wm * self.pairs + t2) * KS + wk * U + j
                            q = fp4.load_u32x4_shared(stage + (entry * 128 + lane * 4))
                            for x in cutlass.range_constexpr(4):
                                st_w[(j * self.pairs + t2) * 4 + x] = q[x]
                            st_s[j * self.pairs + t2] = cute.arch.load(stage + (self.sw_words + entry * 8 + g), Uint32)
                self.compute(tiled_mma, acc, rA, rB, tCrA, tCrB, st_w, st_s, st_a, st_as, n_valid)
                self.ring_release(bars, S, s, lane)
                if b == NB - 1:  # item done: partials to smem, one barrier, epilogue
                    self.stash_partials(sP, acc, parity, warp, lane)
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                    self.epilogue(sP, parity, sP, record, clamp, out, out_s, out_deq, unit, valid_at, warp, lane, tid)
                    parity = parity ^ 1
                b = b + 1
                wrap = Int32(b == NB)
                b, unit = b - wrap * NB, unit + wrap * nblk

        def alloc_b_tile(self, smem):
            """fp8 tactics: the B tile of the unit's 8 activation rows in shared
            memory (e4m3 [8, K], wgmma's K-major interleave layout), or with
            two planes a tuple (hi, lo) of two (trace-time Python)."""
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_INTER, Float8E4M3FN)
            layout_b = cute.tile_to_shape(atom, (8, self.k), order=(0, 1))
            tiles = tuple(
                smem.allocate_tensor(Float8E4M3FN, layout_b.outer, byte_alignment=128, swizzle=layout_b.inner)
                for _ in range(self.planes)
            )
            return tiles[0] if self.planes == 1 else tiles

        def b_views(self, tiled_mma, sB, tid) -> tuple:
            """(sB32, tCrB) of the B tile `sB` (`alloc_b_tile`): its Uint32
            address (`stage_acts`) and this thread's wgmma B fragment
            (`issue_chunk`); a tuple of each for a tuple of planes."""
            if isinstance(sB, tuple):
                views = [self.b_views(tiled_mma, b, tid) for b in sB]
                return tuple(v[0] for v in views), tuple(v[1] for v in views)
            tCrB = tiled_mma.make_fragment_B(tiled_mma.get_slice(tid % 128).partition_B(sB))
            return cute.recast_ptr(sB.iterator, dtype=Uint32), tCrB

        def wgmma_consumer(self, act, act_s, sB, ctas: Int32, tid, warp) -> tuple:
            """The per-thread state of an fp8 consumer warp on the bulk ring
            (trace-time Python, before its loops): (wk, valid_at, slots_at,
            p_a, p_as, sB32, tiled_mma, rA, tCrA, acc, tmp, tCrB, st_w, st_s,
            pair, t16): its K part, the record's valid-rows and slots offsets
            for `ctas` tiles, the activation and B-operand views, the wgmma
            fragments (`wgmma_fp8_fragments`), one stage's word and scale
            registers, and where warp wm's words sit in a stage (tile_rows 32:
            pair wm, 16 bytes per lane; 16: m-tile t16 = wm % 2 of pair wm // 2,
            8 bytes per lane). Shared by `bulk_consume_wgmma` and the fused
            layer's consumers."""
            U, tm = self.u, self.tm
            wm, wk = warp % self.wm, warp // self.wm
            words = (ctas + 3) // 4 * 4
            tiled_mma, rA, tCrA, acc, tmp = wgmma_fp8_fragments(tm * U, tm, self.planes)
            if self.probe == "mma":  # no decode: the A fragments hold zeros throughout
                for r in rA:
                    r.fill(0)
            sB32, tCrB = self.b_views(tiled_mma, sB, tid)
            return (wk, 4 + words, 4 + 2 * words, cute.recast_ptr(act, dtype=Uint32),
                    cute.recast_ptr(act_s, dtype=Uint8), sB32, tiled_mma,
                    rA, tCrA, acc, tmp, tCrB, cute.make_rmem_tensor((4 * U,), Uint32),
                    cute.make_rmem_tensor((U * (2 if self.byte_scales else 1),), Uint32), wm if tm == 2 else wm // 2,
                    0 if tm == 2 else wm % 2)  # fmt: skip

        @cute.jit
        def stage_words_to_registers(self, stage, st_w, st_s, pair, t16, wk, lane):
            """fp8 consumers: warp (pair, t16, wk)'s weight words and E8M0 scale
            codes of one bulk stage (shared memory at `stage`) into registers: tile_rows
            32 = pair wm (16 bytes per lane and chunk; st_s[j]: scale word g),
            16 = m-tile t16 of pair wm // 2 (8 bytes per lane and chunk; with
            `byte_scales` st_s[2 j], st_s[2 j + 1]: codes 2 t16, 2 t16 + 1 of scale
            word g, one byte load each, 2^(s-127) in one shift; else st_s[j]: the
            word's half t16)."""
            KS, U, g = self.ks, self.u, lane // 4
            for j in cutlass.range_constexpr(U):
                entry = pair * KS + wk * U + j
                if cutlass.const_expr(self.tm == 2):
                    q = fp4.load_u32x4_shared(stage + (entry * 128 + lane * 4))
                    for x in cutlass.range_constexpr(4):
                        st_w[4 * j + x] = q[x]
                    st_s[j] = cute.arch.load(stage + (self.sw_words + entry * 8 + g), Uint32)
                else:
                    q = fp4.load_u32x2_shared(stage + (entry * 128 + lane * 4 + 2 * t16))
                    st_w[2 * j] = q[0]
                    st_w[2 * j + 1] = q[1]
                    if cutlass.const_expr(self.byte_scales):  # codes 2 t16 (row g), 2 t16 + 1 (row g + 8)
                        p_s = cute.recast_ptr(stage + (self.sw_words + entry * 8 + g), dtype=Uint8) + 2 * t16
                        st_s[2 * j] = fp4.load_u8_shared(p_s)
                        st_s[2 * j + 1] = fp4.load_u8_shared(p_s + 1)
                    else:
                        sv = cute.arch.load(stage + (self.sw_words + entry * 8 + g), Uint32)
                        st_s[j] = sv >> Uint32(16 * t16)

        @cute.jit
        def bulk_consume_wgmma(
            self,
            act,
            act_s,
            record,
            clamp,
            out,
            out_s,
            ctas,
            sP,
            ring,
            bars,
            sB,
            sXs,
            tid,
            bid,
            nblk,
            warp,
            lane,
            rank,
            sL,
            cbars,
        ):
            """fp8 tactics on the bulk ring (warp-specialized: the producer warp
            streams the weights, these warpgroups only decode and multiply). Per
            unit of a new token tile: its 8 activation rows into shared memory
            (`stage_acts`, named barrier 1 over the compute warps). Units run
            in an outer loop, their steps in an inner one, the ring stage and
            phase carried across units as the producer counts them. Per step: wait full[s], the
            warp's words and scales from the stage into registers, release the
            stage at once (empty[s]), then `compute_wgmma` on the registers.
            Warp (wm, wk) (wk-major: a warpgroup shares wk) takes chunks
            b*KS + wk*unroll + j of m-tile(s) wm of the item. With a cluster
            (`bid` / `nblk`: the cluster's index and count) steps b of K slice
            `rank` only, and the sums meet on rank 0 (`cluster_epilogue`)."""
            S, NB, KS, U, D = self.tactic.stages, self.nb_c, self.ks, self.u, self.tactic.mma_depth
            b0 = rank * NB  # the slice's first step
            (wk, valid_at, slots_at, p_a, p_as, sB32, tiled_mma, rA, tCrA, acc, tmp, tCrB, st_w, st_s, pair,
             t16) = self.wgmma_consumer(act, act_s, sB, ctas, tid, warp)  # fmt: skip
            if cutlass.const_expr(self.tactic.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            n_units = cute.arch.load(record, Int32) * self.blocks
            top_k = cute.arch.load(record + 3, Int32)
            unit, count, stride = self.unit_span(n_units, bid, nblk)
            # the ring position runs on across units: stage s, phase ph (no division per step)
            s, ph, parity, staged = Int32(0), Int32(0), Int32(0), Int32(-1)  # staged: the tile in sB
            for n in cutlass.range(0, count, 1, unroll=1):
                tile = unit // self.blocks
                if tile != staged:  # a unit of a new tile: its activation rows into shared memory
                    # (the previous unit's wgmmas all completed before the barrier that closed it)
                    staged = tile
                    self.stage_acts(sB32, sXs, p_a, p_as, record, slots_at, top_k, unit, tid, rank)
                    cute.arch.fence_proxy("async.shared", space="cta")  # generic -> wgmma reads
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                for b in cutlass.range(0, NB, 1, unroll=1):
                    self.ring_wait(bars, s, ph)
                    self.stage_words_to_registers(ring + s * self.stage_words, st_w, st_s, pair, t16, wk, lane)
                    self.ring_release(bars, S, s, lane)  # the words are in registers: the stage may be refilled
                    if cutlass.const_expr(D > 0):
                        self.pipelined_step(
                            tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w, st_s, (b0 + b) * KS + wk * U, lane
                        )
                    else:
                        self.compute_wgmma(
                            tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w, st_s, (b0 + b) * KS + wk * U, lane
                        )
                    wrap = Int32(s == S - 1)
                    s, ph = s + 1 - wrap * S, ph ^ wrap
                # unit done: partials to smem, one barrier, epilogue
                self.stash_partials(sP, acc, parity, warp, lane)
                cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                if cutlass.const_expr(self.cl == 1):
                    self.epilogue(sP, parity, sP, record, clamp, out, out_s, out, unit, valid_at, warp, lane, tid)
                else:
                    self.cluster_epilogue(
                        sP,
                        sL,
                        cbars,
                        parity,
                        n,
                        count,
                        rank,
                        record,
                        clamp,
                        out,
                        out_s,
                        unit,
                        valid_at,
                        warp,
                        lane,
                        tid,
                    )
                parity = parity ^ 1
                unit = unit + stride


# ---------------------------------------------------------------------- host side
_KERNEL = "the GEMM kernels"


#: Where compile_gemm takes kernels compiled elsewhere (see set_compiled_provider).
_provider = None


def set_compiled_provider(provider) -> None:
    """Install `provider(shape, tactic, stage, wide_scales) -> compiled | None`
    (None: uninstall). compile_gemm asks it before compiling (kernels already
    cached are not asked again); a None answer compiles in-process. Used by
    `moebench.tuning.precompile` to load kernels compiled by worker processes."""
    global _provider
    if provider is not None and not callable(provider):
        raise TypeError(f"provider must be callable or None, got {type(provider).__name__}")
    _provider = provider


def get_compiled_provider():
    return _provider


#: compile_gemm's `resident` probes of an fp8 consumer: only its wgmmas, or only its decode and scaling.
RESIDENT_PROBES = ("mma", "math")


def check_resident(resident, tactic: GemmTactic) -> None:
    """`resident` (compile_gemm's compute-only measurement mode) must be a
    bool or one of RESIDENT_PROBES; anything but False needs a tactic on the
    bulk ring, a probe an fp8 one."""
    if not isinstance(resident, (bool, str)) or (isinstance(resident, str) and resident not in RESIDENT_PROBES):
        raise TypeError(f"resident must be a bool or one of {RESIDENT_PROBES}, got {resident!r}")
    if resident is not False and not tactic.bulk:
        raise ValueError(
            f"resident (compute only: the ring's stages loaded once) needs a tactic on the bulk ring (stages >= 2),"
            f" got {tactic.name}"
        )
    if isinstance(resident, str) and not tactic.fp8:
        raise ValueError(f"resident probe {resident!r} splits the fp8 (wgmma) consumer; {tactic.name} is not fp8")


@functools.lru_cache(maxsize=None)
def compile_gemm(shape: GemmShape, tactic: GemmTactic, stage: int, wide_scales: bool = False, resident=False):
    """Compile GEMM`stage` for one shape class and tactic (cached per process).
    `wide_scales`: the weights' compile-time scale variant
    (`KernelWeights.scale_variant(tactic.fp8)`: codes > 128 for BF16 tactics,
    codes 0 / 255 for fp8 tactics).

    Works without a GPU when CUTE_DSL_ARCH=sm_90a is set (cross-compile).
    Returns (kernel, compiled): `kernel.grid(ctas, num_sms)` sizes the
    launch; `compiled(*args, grid, stream)` takes the launch's `GemmArgs`
    flat (`gemm_args`: ids / meta: the top-k ids and rows << 8 | top_k of a
    `spec` tactic, else ignored; out_deq: GEMM1's BF16 H with
    tactic.act_bf16, else ignored; act: BF16 [rows, K] with act_bf16; cnt /
    part: the split-K counters and partials, see `workspace_parts`), Int32
    and a CUstream (use `gemm1` / `gemm2` for torch tensors). Raises ValueError
    when the tactic cannot run the shape, RuntimeError without the DSL. A
    provider installed with `set_compiled_provider` may supply the compiled
    kernel instead (e.g. loaded from a worker process's export).

    resident=True (a tactic on the bulk ring) compiles the compute-only
    measurement of the same kernel (`scripts/consumer.py`): the producer
    loads each CTA's first `stages` ring steps once and the consumers run
    every step on those stages (never released, never refilled), so the
    consumer's whole arithmetic runs with no HBM weight traffic. Its outputs
    are meaningless (the wrong weights for every later step). resident="mma"
    / "math" (fp8 tactics): the same with half the consumer, to say which
    half bounds it: only the wgmmas (A fragments zero, no decode, no
    scaling) or only the decode and scaling (a register copy of the A
    fragments stands in for each wgmma's result).
    """
    require_dsl(_KERNEL)
    kernel = StreamingGemmKernel(tactic, shape, stage, wide_scales, resident)
    if _provider is not None and not resident:
        compiled = _provider(shape, tactic, stage, wide_scales)
        if compiled is not None:
            return kernel, compiled

    fake = gemm_args(stage, {**dict.fromkeys(gemm_arg_specs(stage), 1 << 20), "meta": 0, "ctas": 1})  # stand-ins
    compiled = cute.compile(kernel, *fake, Int32(1), _cuda.CUstream(0))
    return kernel, compiled


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_common(kw, record, ctas: int):
    if not isinstance(kw, KernelWeights):
        raise TypeError(f"kw must be a KernelWeights, got {type(kw).__name__}")
    device = kw.device
    if device.type != "cuda":
        raise ValueError(f"kw must be on a CUDA device, got {device}")
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 0:
        raise ValueError(f"ctas must be a non-negative int, got {ctas!r}")
    check_tensor("record", record, (torch.int32,), (route_words(ctas),), device, align=16)
    return device


def alloc_workspace(nbytes: int, device) -> torch.Tensor:
    """A zeroed split-K workspace of at least `nbytes` (uint8, a multiple of
    16 bytes, at least 16). Allocate it ONCE (never per launch, never inside a
    CUDA-graph capture) with `workspace_bytes` / `workspace_bytes_for`; the
    kernels keep its counters at zero from then on."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    return torch.zeros(max(16, -(-nbytes // 16) * 16), dtype=torch.uint8, device=device)


def _split_k_sources(workspace, shape: GemmShape, tactic: GemmTactic, stage: int, ctas: int, device, record):
    """{"cnt": ..., "part": ...}: the addresses of the split-K workspace's
    counters and partials for this launch (workspace_parts: counters at the
    front, partials at the back), or placeholders (never read) when the
    tactic does not split K."""
    if tactic.split_k == 1:
        # the kernel ignores them; any 16-byte aligned device pointer will do
        return {"cnt": record, "part": record}
    if workspace is None:
        raise ValueError(
            f"workspace is required: tactic {tactic.name} splits K {tactic.split_k} ways; allocate one"
            f" once with alloc_workspace(workspace_bytes(shape, tactic, ctas, {stage})) and pass it"
        )
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
    if workspace.dtype not in (torch.uint8, torch.int32) or workspace.dim() != 1:
        raise TypeError(
            f"workspace must be a 1-D uint8 or int32 tensor, got {workspace.dtype} {tuple(workspace.shape)}"
        )
    if workspace.device != device:
        raise ValueError(f"workspace must be on {device}, got {workspace.device}")
    if not workspace.is_contiguous() or workspace.data_ptr() % 16:
        raise ValueError("workspace must be contiguous and 16-byte aligned")
    nbytes = workspace.numel() * workspace.element_size()
    counters, partials = workspace_parts(shape, tactic, ctas, stage)
    if nbytes % 16 or nbytes < counters + partials:
        raise ValueError(
            f"workspace must hold a multiple of 16 bytes and at least {counters + partials}"
            f" (workspace_bytes for {tactic.name}, GEMM{stage}, ctas {ctas}), got {nbytes}"
        )
    base = workspace.data_ptr()
    return {"cnt": base, "part": base + nbytes - partials}


def _resolve(kw: KernelWeights, stage: int, tactic, ctas: int, device) -> tuple[GemmTactic, int]:
    """(tactic, SMs): the caller's tactic, checked, or the default for `ctas`."""
    shape = GemmShape.of(kw)
    sms = _num_sms(device.index if device.index is not None else 0)
    if tactic is None:
        fp8 = kw.operand == "e4m3"
        tactic = default_tactic(shape, stage, ctas, sms, kw.scale_variant(fp8), fp8=fp8)
    if not isinstance(tactic, GemmTactic):
        raise TypeError(f"tactic must be a GemmTactic or None, got {type(tactic).__name__}")
    if tactic.fp8 != (kw.operand == "e4m3"):
        want = "an fp8 tactic (suffix _f8)" if kw.operand == "e4m3" else "a BF16 tactic (no _f8)"
        raise ValueError(
            f"tactic {tactic.name} does not match the weights: kw is laid out for the"
            f" {kw.operand} operand and needs {want}; convert with"
            f" to_kernel_layout(weights, operand={'e4m3' if tactic.fp8 else 'bf16'!r})"
            f" for this tactic"
        )
    reason = tactic.valid_for(shape, stage)
    if reason:
        raise ValueError(f"tactic {tactic.name} cannot run GEMM{stage}: {reason}")
    return tactic, sms


def _bf16_act(name: str, t, tactic: GemmTactic, shape: tuple[int, int], device, what: str):
    """Check the BF16 activation-side tensor `name` (required exactly when
    tactic.act_bf16): None when the tactic does not use it."""
    if not tactic.act_bf16:
        if t is not None:
            raise ValueError(
                f"{name} was given but tactic {tactic.name} does not use BF16 activations"
                f" (act_bf16, name suffix _a16); pass {name}=None"
            )
        return None
    if t is None:
        raise ValueError(
            f"{name} is required: tactic {tactic.name} (act_bf16) {what}; allocate bfloat16 {list(shape)} once"
        )
    check_tensor(name, t, (torch.bfloat16,), shape, device, align=16)
    return t


def _launch(
    kw: KernelWeights,
    stage: int,
    tactic: GemmTactic,
    sms: int,
    sources: dict,
    ctas: int,
    device,
    stream,
    record,
    workspace,
    topk_ids=None,
    resident: bool | str = False,
) -> None:
    """Launch GEMM`stage` with the tensors of `sources` (GemmArgs' fields
    up to out_deq), the split-K workspace and the spec ids filled in."""
    shape = GemmShape.of(kw)
    check_resident(resident, tactic)
    split = _split_k_sources(workspace, shape, tactic, stage, ctas, device, record)
    if ctas == 0:
        return
    kernel, compiled = compile_gemm(shape, tactic, stage, kw.scale_variant(tactic.fp8), resident)
    grid = kernel.grid(ctas, sms)
    if topk_ids is None:  # the kernel never reads them
        ids, meta = record, 0
    else:
        ids, meta = topk_ids, topk_ids.shape[0] << 8 | topk_ids.shape[1]
    args = gemm_args(stage, {**sources, **split, "ids": ids, "meta": meta, "ctas": ctas})
    compiled(*args, Int32(grid), cu_stream(stream, device))


def act_to_bf16(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP8 (e4m3 bytes [..., K], E8M0 [..., K/32]) -> BF16 [..., K] with
    the very bits the GEMMs' e4m3 decode (`fp4.e4m3x4_to_bf16x2`, then x m1 x
    m2 of `fp4.act_multipliers`, each a round-to-nearest bf16x2 multiply)
    feeds the mma: the BF16 activation operand of an act_bf16 tactic.

    Exactly e4m3 * 2^(s-127) rounded once to BF16 (torch ops: the fp32
    product is exact, its cast rounds to nearest even with BF16 subnormals),
    which equals dequantize_mxfp8 except at the extremes, where it follows
    the kernel: products under 2^-133 round to BF16 subnormals / zero (for
    s < 134 the decode's first multiply is the only inexact one), above the
    BF16 range they become +-Inf; the e4m3 NaN bytes 0x7F / 0xFF decode as
    +-480 * 2^(s-127) (the decode moves bits, it has no NaN case); E8M0 255
    gives NaN, written as 0x7FFF (the canonical NaN HMUL2 produces; the
    payload is hardware-defined and not compared by the tests). Pure torch
    (a few elementwise launches; capturable). `out`: bfloat16 of q's shape."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.uint8, torch.float8_e4m3fn) or q.dim() < 1:
        raise TypeError(f"q must be uint8 / float8_e4m3fn [..., K], got {getattr(q, 'dtype', type(q).__name__)}")
    k = q.shape[-1]
    if (
        k % 32
        or not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.uint8
        or (tuple(scale.shape) != (*q.shape[:-1], k // 32))
    ):
        raise ValueError(
            f"scale must be uint8 {[*q.shape[:-1], k // 32]} for q {list(q.shape)},"
            f" got {getattr(scale, 'dtype', None)} {list(getattr(scale, 'shape', []))}"
        )
    qu = q.view(torch.uint8)
    v = qu.view(torch.float8_e4m3fn).to(torch.float32)
    nan_code = (qu & 0x7F) == 0x7F
    v = torch.where(nan_code, torch.where(qu >= 128, -480.0, 480.0), v)
    si = scale.to(torch.int32)
    bits = torch.where(si == 0, torch.full_like(si, 0x00400000), si << 23)  # 2^(s-127); 255: Inf (fixed below)
    mult = bits.view(torch.float32)
    y = (v.unflatten(-1, (-1, 32)) * mult.unsqueeze(-1)).to(torch.bfloat16)
    nan = torch.full((), 0x7FFF, dtype=torch.int16, device=q.device).view(torch.bfloat16)  # no host copy
    y = torch.where((si == 255).unsqueeze(-1), nan, y).flatten(-2)
    if out is None:
        return y
    if out.dtype != torch.bfloat16 or out.shape != q.shape or out.device != q.device:
        raise ValueError(
            f"out must be bfloat16 {list(q.shape)} on {q.device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    out.copy_(y)
    return out


def check_gemm1_io(kw: KernelWeights, device, ctas: int, x_q, x_scale, h_q_out, h_scale_out) -> int:
    """Check GEMM1's activation inputs and H outputs (as `gemm1` documents
    them: x_q [rows, H] e4m3 / uint8 with 1 <= rows <= 8, x_scale uint8
    [rows, H/32], h_q_out [8*ctas, I], h_scale_out uint8 [8*ctas, I/32] on
    `device`); returns rows. Raises ValueError / TypeError naming the argument."""
    h, i = kw.hidden, kw.intermediate
    if not isinstance(x_q, torch.Tensor) or x_q.dim() != 2 or not 1 <= x_q.shape[0] <= 8:
        raise ValueError(f"x_q must be [rows, {h}] with 1 <= rows <= 8, got {getattr(x_q, 'shape', x_q)}")
    rows = x_q.shape[0]
    u8 = (torch.uint8, torch.float8_e4m3fn)
    check_tensor("x_q", x_q, u8, (rows, h), device, align=16)
    check_tensor("x_scale", x_scale, (torch.uint8,), (rows, h // 32), device, align=4)
    check_tensor("h_q_out", h_q_out, u8, (TILE * ctas, i), device, align=16)
    check_tensor("h_scale_out", h_scale_out, (torch.uint8,), (TILE * ctas, i // 32), device, align=4)
    return rows


def gemm1(
    kw: KernelWeights,
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    record: torch.Tensor,
    ctas: int,
    h_q_out: torch.Tensor,
    h_scale_out: torch.Tensor,
    *,
    tactic: GemmTactic | None = None,
    stream=None,
    workspace: torch.Tensor | None = None,
    x_deq: torch.Tensor | None = None,
    h_deq_out: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    resident: bool | str = False,
) -> None:
    """Launch GEMM1 (x . w13^T, SwiGLU with clamp, MXFP8 H) on `stream`
    (torch's current stream when None); no host sync, no allocation.

    kw: KernelWeights on a CUDA device (H, I, E). x_q: float8_e4m3fn/uint8
    [rows, H] (1 <= rows <= 8), x_scale: uint8 [rows, H/32] (E8M0);
    record: int32 [route_words(ctas)] (moebench.record), ctas: token tiles it
    allows for. h_q_out: float8_e4m3fn/uint8 [8*ctas, I] and h_scale_out:
    uint8 [8*ctas, I/32], by permuted row: rows of used tiles are all written
    (padding rows zero), rows of unused tiles untouched. tactic: GemmTactic
    (default_tactic(shape, 1, ctas, SMs) when None). stream: None, torch.cuda.Stream or
    CUstream. workspace: required when tactic.split_k > 1 (ignored otherwise):
    a zeroed buffer of >= workspace_bytes(shape, tactic, ctas, 1) bytes from
    `alloc_workspace`, allocated once and reused (the kernel leaves its
    counters at zero); launches sharing one must run one after the other.
    x_deq, h_deq_out: required exactly when tactic.act_bf16 (ValueError
    otherwise): x_deq bfloat16 [rows, H], x dequantized (`act_to_bf16(x_q,
    x_scale)`: the kernel reads it instead of x_q / x_scale, which are still
    checked); h_deq_out bfloat16 [8*ctas, I]: the kernel also writes the BF16
    value of H there (bit-identical to act_to_bf16(h_q_out, h_scale_out) on
    the written rows), for an act_bf16 GEMM2.
    For weights in the e4m3 layout (`to_kernel_layout(..., operand="e4m3")`)
    `tactic` must be an fp8 tactic (None: `default_fp8_tactic`), for the bf16
    layout a BF16 one; a mismatch raises ValueError.
    topk_ids: int32 [rows, top_k] (top_k <= 8), contiguous, the ids the
    record was built from; required exactly when tactic.spec (its producer
    predicts the record from them before griddepcontrol.wait, so they must
    be complete before the kernel before GEMM1 releases its dependents: the
    route kernel with `release_after_wait`).
    resident: the compute-only measurement (`compile_gemm`; outputs
    meaningless), never for results.
    Raises TypeError / ValueError naming the argument; RuntimeError without
    nvidia-cutlass-dsl.
    """
    device = _check_common(kw, record, ctas)
    h, i = kw.hidden, kw.intermediate
    rows = check_gemm1_io(kw, device, ctas, x_q, x_scale, h_q_out, h_scale_out)
    tactic, sms = _resolve(kw, 1, tactic, ctas, device)
    x_deq = _bf16_act("x_deq", x_deq, tactic, (rows, h), device, "reads x as BF16")
    h_deq_out = _bf16_act("h_deq_out", h_deq_out, tactic, (TILE * ctas, i), device, "writes H as BF16 too")
    if tactic.spec != (topk_ids is not None):
        raise ValueError(
            f"topk_ids is required exactly with a spec tactic (_sp); tactic {tactic.name}"
            f" {'is' if tactic.spec else 'is not'} one, topk_ids {'missing' if topk_ids is None else 'given'}"
        )
    if topk_ids is not None:
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or not 1 <= topk_ids.shape[1] <= 8:
            raise ValueError(f"topk_ids must be int32 [{rows}, top_k <= 8], got {getattr(topk_ids, 'shape', topk_ids)}")
        check_tensor("topk_ids", topk_ids, (torch.int32,), (rows, topk_ids.shape[1]), device, align=4)
    require_dsl(_KERNEL)
    sources = dict(w=kw.w13, ws=kw.w13_scale, act=x_q if x_deq is None else x_deq, act_s=x_scale, record=record,
                   clamp=kw.clamp, out=h_q_out, out_s=h_scale_out,
                   out_deq=h_q_out if h_deq_out is None else h_deq_out)  # (a placeholder, never written)  # fmt: skip
    _launch(kw, 1, tactic, sms, sources, ctas, device, stream, record, workspace, topk_ids, resident)


def gemm2(
    kw: KernelWeights,
    h_q: torch.Tensor,
    h_scale: torch.Tensor,
    record: torch.Tensor,
    ctas: int,
    out: torch.Tensor,
    *,
    tactic: GemmTactic | None = None,
    stream=None,
    workspace: torch.Tensor | None = None,
    h_deq: torch.Tensor | None = None,
    resident: bool | str = False,
) -> None:
    """Launch GEMM2 (dequant(H) . w2^T -> BF16 rows, unweighted) on `stream`.

    h_q: float8_e4m3fn/uint8 [8*ctas, I], h_scale: uint8 [8*ctas, I/32]
    (GEMM1's outputs, by permuted row); out: bfloat16 [8*ctas, H]: rows of
    used tiles all written (padding rows zero), unused tiles untouched. Other
    arguments as `gemm1` (workspace: >= workspace_bytes(shape, tactic, ctas, 2)
    when tactic.split_k > 1). With tactic.pdl the record is read before
    griddepcontrol.wait (see the module docstring). h_deq: required exactly
    when tactic.act_bf16 (ValueError otherwise): bfloat16 [8*ctas, I], H
    dequantized (an act_bf16 GEMM1's h_deq_out, or act_to_bf16(h_q, h_scale));
    the kernel reads it instead of h_q / h_scale (still checked). resident:
    as `gemm1`.
    """
    device = _check_common(kw, record, ctas)
    h, i = kw.hidden, kw.intermediate
    u8 = (torch.uint8, torch.float8_e4m3fn)
    check_tensor("h_q", h_q, u8, (TILE * ctas, i), device, align=16)
    check_tensor("h_scale", h_scale, (torch.uint8,), (TILE * ctas, i // 32), device, align=4)
    check_tensor("out", out, (torch.bfloat16,), (TILE * ctas, h), device, align=16)
    tactic, sms = _resolve(kw, 2, tactic, ctas, device)
    h_deq = _bf16_act("h_deq", h_deq, tactic, (TILE * ctas, i), device, "reads H as BF16")
    require_dsl(_KERNEL)
    sources = dict(w=kw.w2, ws=kw.w2_scale, act=h_q if h_deq is None else h_deq, act_s=h_scale, record=record,
                   clamp=kw.clamp, out=out, out_s=h_scale, out_deq=out)  # (out_s / out_deq: placeholders)  # fmt: skip
    _launch(kw, 2, tactic, sms, sources, ctas, device, stream, record, workspace, resident=resident)
