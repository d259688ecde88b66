"""GEMM1 and GEMM2 of the routed experts in one persistent launch whose
weight stream never waits for H (v24, perf-notes session 20).

The pair (`gemm.py`) streams GEMM2's weights only once GEMM1's CTAs have
left the SMs or, with PDL, under GEMM1's tail; v13 fused the two into one
launch but put GEMM2's weights behind GEMM1's in one ring, so they still
arrived when GEMM1 ended. Here each CTA (one per SM) holds a *resident*
region for its first `resident` GEMM2 units: the producer warp streams
GEMM1 through the ring and, when the tactic's `lead` GEMM1 steps are left
to issue (at least after the ring's first fill), issues every resident
GEMM2 stage at once (each on its own mbarrier, never recycled within a
launch), then any GEMM2 units beyond the resident ones through the same
ring. Measured (perf-notes session 21): GEMM2 after H is bound by its
multiplies, not its bytes, so the resident loads remove nothing from the
critical path, and issued early they take GEMM1's bandwidth; the built-in
tactic issues them after GEMM1's last (lead 0), and the launch is slower
than the pair at every point measured.

Dependencies are counters in global memory, never a grid barrier (v13's
scheme): a GEMM1 unit's H stores, a CTA barrier, one thread's gpu fence
and `red.release.gpu.add` on its token tile's counter; a GEMM2 unit of
that tile, before staging the tile's H rows, spins (one thread,
`ld.acquire.gpu`) until the counter holds all the tile's GEMM1 units, then
reads H with `ld.relaxed.gpu` (the spin is relaxed too, then one
`fence.acq_rel.gpu`); after each GEMM2 unit one thread arrives on
the tile's second counter (wrapping at the tile's GEMM2 unit count), and
the last one resets the first: both are zero again for the next launch or
graph replay. Deadlock-free because every CTA finishes its GEMM1 units
before it waits, the grid is at most one CTA per SM, and the kernel lets
its dependents launch only at its end; this assumes every SM can take one
of its CTAs eventually (the whole device: no MPS thread-percentage limit or
green context smaller than the GPU, no kernel on another stream that holds
an SM until something after this one runs).

The arithmetic of every unit is the pair's with the same two tactics (the
same kernels' decode, wgmma, scaling and epilogues, `StreamingGemmKernel`
methods), so H and the output rows equal `gemm1` then `gemm2` bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from moebench.kernels.gemm import _check_common, _num_sms, check_gemm1_io
from moebench.kernels.host import HAVE_DSL, check_tensor, cu_stream, kernel_args, require_dsl
from moebench.kernels.layout import KernelWeights
from moebench.kernels.limits import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from moebench.kernels.fused_tactic import (  # noqa: F401 - the tactic's names, also for fused's callers
    MAX_LEAD,
    MAX_RESIDENT,
    FusedTactic,
    LayerChoice,
    default_fused_tactic,
    fused_candidates,
    fused_smem_bytes,
)
from moebench.kernels.tactic import GemmShape
from moebench.record import TILE

if HAVE_DSL:
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32
    from cutlass.cute.nvgpu import warpgroup

    from moebench.kernels import fp4, ptx
    from moebench.kernels.gemm import StreamingGemmKernel

#: int64 stamps per CTA of a traced launch (`fused_layer(..., trace=)`), %globaltimer ns:
#: start (after the dependency wait), GEMM1 consumed, first H ready, first resident stage in
#: shared memory (as the consumer sees it, so >= H ready), last resident stage in, GEMM2
#: done, the producer's last GEMM1 issue, its last resident issue; -1 where a CTA had none.
TRACE_STAMPS = ("start", "gemm1_done", "h_ready", "res_first", "res_last", "gemm2_done", "g1_issued", "res_issued")


if HAVE_DSL:

    class FusedArgs(NamedTuple):
        """FusedLayerKernel's run-time arguments, one struct (`host.kernel_args`
        builds it from `FUSED_ARG_SPECS`; each pointer's element type and alignment are
        `FUSED_ARG_SPECS`'): w13 / w2 and their scales, x and its scales, the
        route record, the clamp, H and its scales, the output rows, the
        counters, the trace stamps and the token tiles the record allows for."""

        w1: cute.Pointer
        ws1: cute.Pointer
        w2: cute.Pointer
        ws2: cute.Pointer
        x: cute.Pointer
        x_s: cute.Pointer
        record: cute.Pointer
        clamp: cute.Pointer
        h: cute.Pointer
        h_s: cute.Pointer
        out: cute.Pointer
        cnt: cute.Pointer
        trace: cute.Pointer
        ctas: Int32

    #: {FusedArgs field: spec} in field order (`host.kernel_args`): a pointer's (element type, alignment).
    FUSED_ARG_SPECS = {
        "w1": (Uint8, 16), "ws1": (Uint8, 16), "w2": (Uint8, 16), "ws2": (Uint8, 16), "x": (Uint8, 16),
        "x_s": (Uint8, 4), "record": (Int32, 16), "clamp": (Float32, 4), "h": (Uint8, 16), "h_s": (Uint8, 4),
        "out": (BFloat16, 16), "cnt": (Int32, 16), "trace": (Int64, 8), "ctas": Int32,
    }  # fmt: skip

    class FusedLayerKernel:
        """One persistent launch of GEMM1 then GEMM2 (module docstring)."""

        def __init__(self, ft: FusedTactic, shape: GemmShape, wide_scales: bool = False, trace: bool = False):
            reason = ft.why_invalid(shape)
            if reason:
                raise ValueError(f"fused tactic {ft.name} cannot run {shape}: {reason}")
            self.ft = ft
            self.trace = trace
            self.k1 = StreamingGemmKernel(ft.gemm1, shape, 1, wide_scales)
            self.k2 = StreamingGemmKernel(ft.gemm2, shape, 2, wide_scales)
            self.nw, self.threads = self.k1.nw, self.k1.threads
            self.S = ft.gemm1.stages
            self.R = ft.resident
            self.ring_words = max(self.k1.stage_words, self.k2.stage_words)
            self.tm = max(self.k1.tm, self.k2.tm)
            self.smem_bytes = fused_smem_bytes(ft, shape)
            self.smem_carveout = min(100, -(-100 * (self.smem_bytes + SMEM_RESERVED_PER_CTA) // SMEM_PER_SM))

        def grid(self, ctas: int, num_sms: int) -> int:
            """One CTA per SM, at most one per unit of the larger GEMM."""
            return max(1, min(ctas * max(self.k1.blocks, self.k2.blocks), num_sms))

        @cute.jit
        def __call__(self, args: FusedArgs, grid: Int32, stream: _cuda.CUstream):
            self.kernel(args).launch(
                grid=[grid, 1, 1],
                block=[self.threads + 32, 1, 1],
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=1,
                preferred_smem_carveout=self.smem_carveout,
            )

        def smem_b(self, smem, k: int):
            """The wgmma B operand of 8 activation rows of K = k (K-major
            interleave layout, e4m3) in new shared memory (trace-time Python)."""
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_INTER, Float8E4M3FN)
            layout_b = cute.tile_to_shape(atom, (8, k), order=(0, 1))
            return smem.allocate_tensor(Float8E4M3FN, layout_b.outer, byte_alignment=128, swizzle=layout_b.inner)

        @cute.kernel
        def kernel(self, kargs: FusedArgs):
            w1, ws1, w2, ws2, x, x_s, record, clamp, h, h_s, out, cnt, trace, ctas = kargs
            S, R = self.S, self.R
            NR = R * self.k2.nb  # resident stages
            tid, bid, nblk = cute.arch.thread_idx()[0], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            warp, lane = tid // 32, tid % 32
            smem = cutlass.memory.SmemAllocator()
            sP = smem.allocate_tensor(Float32, cute.make_layout((self.tm * 128, self.nw, 2)), byte_alignment=16)
            ring = smem.allocate_array(Uint32, S * self.ring_words, byte_alignment=128)
            bars = smem.allocate_array(Int64, 2 * S, byte_alignment=8)  # full[0, S), empty[S, 2S)
            res = rbars = None
            if cutlass.const_expr(R > 0):
                res = smem.allocate_array(Uint32, NR * self.k2.stage_words, byte_alignment=128)
                rbars = smem.allocate_array(Int64, NR, byte_alignment=8)  # full of each resident stage
            sB1 = self.smem_b(smem, self.k1.k)
            sB2 = self.smem_b(smem, self.k2.k)
            sXs1 = smem.allocate_tensor(Float32, cute.make_layout((8 * self.k1.nch,)), byte_alignment=16)
            sXs2 = smem.allocate_tensor(Float32, cute.make_layout((8 * self.k2.nch,)), byte_alignment=16)
            if tid == 0:
                for s in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(bars + s, 1)
                    cute.arch.mbarrier_init(bars + (S + s), self.nw)
                for q in cutlass.range_constexpr(NR):
                    cute.arch.mbarrier_init(rbars + q, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            cute.arch.griddepcontrol_wait()  # the record and x come from the previous kernel
            stamps = trace + bid * len(TRACE_STAMPS)
            if tid == 0:
                self.stamp(stamps, "start")
            tiles = cute.arch.load(record, Int32)
            u1, n1, st1 = self.k1.unit_span(tiles * self.k1.blocks, bid, nblk)
            u2, n2, st2 = self.k2.unit_span(tiles * self.k2.blocks, bid, nblk)
            n_res = cutlass.min(n2, Int32(R))
            if warp == self.nw:
                self.produce(
                    w1, ws1, w2, ws2, record, ring, bars, res, rbars, u1, n1, st1, u2, n2, st2, n_res, lane, stamps
                )  # fmt: skip
            else:
                i = self.consume(
                    1,
                    x,
                    x_s,
                    record,
                    clamp,
                    h,
                    h_s,
                    ctas,
                    sP,
                    ring,
                    bars,
                    res,
                    rbars,
                    sB1,
                    sXs1,
                    tid,
                    warp,
                    lane,
                    u1,
                    n1,
                    st1,
                    Int32(0),
                    Int32(0),
                    cnt,
                    stamps,
                    "signal",
                )
                if tid == 0:
                    self.stamp(stamps, "gemm1_done")
                self.consume(
                    2,
                    h,
                    h_s,
                    record,
                    clamp,
                    out,
                    h_s,
                    ctas,
                    sP,
                    ring,
                    bars,
                    res,
                    rbars,
                    sB2,
                    sXs2,
                    tid,
                    warp,
                    lane,
                    u2,
                    n2,
                    st2,
                    i,
                    n_res,
                    cnt,
                    stamps,
                    "wait",
                )
                if tid == 0:
                    self.stamp(stamps, "gemm2_done")
            cute.arch.griddepcontrol_launch_dependents()  # only now: every CTA of this grid is running

        @cute.jit
        def stamp(self, stamps, what: cutlass.Constexpr[str]):
            """A traced launch's stamp `what` (TRACE_STAMPS) of this CTA; nothing otherwise."""
            if cutlass.const_expr(self.trace):
                cute.arch.store(stamps + TRACE_STAMPS.index(what), ptx.globaltimer())

        @cute.jit
        def gemm(self, stage: int):
            """The StreamingGemmKernel of GEMM`stage` (trace-time Python)."""
            return self.k1 if stage == 1 else self.k2

        @cute.jit
        def ring_step(self, stage: cutlass.Constexpr[int], p_w, p_s, record, ring, bars, i, unit, b, stride, lane):
            """Ring step i (stage i % S) <- step b of `unit` of GEMM`stage`, once its ring stage is free;
            returns the next (unit, b) (units `stride` apart)."""
            S, nb = self.S, self.gemm(stage).nb
            s = i % S
            if i >= S:
                cute.arch.mbarrier_wait(bars + (S + s), (i // S - 1) % 2)
            e = cute.arch.load(record + (4 + unit // self.gemm(stage).blocks), Int32)
            self.gemm(stage).issue_stage(
                p_w, p_s, ring, bars, s, e, unit % self.gemm(stage).blocks, b, lane, self.ring_words
            )
            wrap = Int32(b + 1 == nb)
            return unit + wrap * stride, b + 1 - wrap * nb

        @cute.jit
        def produce(
            self, w1, ws1, w2, ws2, record, ring, bars, res, rbars, u1, n1, st1, u2, n2, st2, n_res, lane, stamps
        ):
            """The producer warp: GEMM1's ring steps up to the tactic's `lead`
            (at least the ring's first fill), then every resident GEMM2 stage
            (own region, own mbarriers), then the rest of GEMM1 and the
            non-resident GEMM2 units through the ring."""
            S = self.S
            p_w1, p_s1 = cute.recast_ptr(w1, dtype=Uint32), cute.recast_ptr(ws1, dtype=Uint32)
            p_w2, p_s2 = cute.recast_ptr(w2, dtype=Uint32), cute.recast_ptr(ws2, dtype=Uint32)
            steps1 = n1 * self.k1.nb
            first = cutlass.min(steps1, Int32(S))
            if cutlass.const_expr(self.ft.lead is not None):
                first = cutlass.max(first, steps1 - self.ft.lead)
            unit, b = u1, Int32(0)
            for i in cutlass.range(0, first, 1, unroll=1):
                unit, b = self.ring_step(1, p_w1, p_s1, record, ring, bars, i, unit, b, st1, lane)
            unit2 = u2
            if cutlass.const_expr(self.R > 0):
                for r in cutlass.range(0, n_res, 1, unroll=1):
                    e = cute.arch.load(record + (4 + unit2 // self.k2.blocks), Int32)
                    for b2 in cutlass.range_constexpr(self.k2.nb):
                        self.k2.issue_stage(
                            p_w2, p_s2, res, rbars, r * self.k2.nb + b2, e, unit2 % self.k2.blocks, b2, lane
                        )
                    unit2 = unit2 + st2
                if lane == 0:
                    self.stamp(stamps, "res_issued")
            for i in cutlass.range(first, steps1, 1, unroll=1):
                unit, b = self.ring_step(1, p_w1, p_s1, record, ring, bars, i, unit, b, st1, lane)
            if lane == 0:
                self.stamp(stamps, "g1_issued")
            b = Int32(0)
            for i in cutlass.range(steps1, steps1 + (n2 - n_res) * self.k2.nb, 1, unroll=1):
                unit2, b = self.ring_step(2, p_w2, p_s2, record, ring, bars, i, unit2, b, st2, lane)

        @cute.jit
        def ring_words_to_registers(
            self, stage: cutlass.Constexpr[int], ring, bars, i, st_w, st_s, pair, t16, wk, lane
        ):
            """Ring step i's words of GEMM`stage` into registers, then its stage freed; returns i + 1."""
            S = self.S
            s = i % S
            cute.arch.mbarrier_wait(bars + s, (i // S) % 2)
            self.gemm(stage).stage_words_to_registers(ring + s * self.ring_words, st_w, st_s, pair, t16, wk, lane)
            cute.arch.sync_warp()
            if lane == 0:  # the words are in registers: the stage may be refilled
                cute.arch.mbarrier_arrive(bars + (S + s))
            return i + 1

        @cute.jit
        def consume(
            self,
            stage: cutlass.Constexpr[int],
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
            res,
            rbars,
            sB,
            sXs,
            tid,
            warp,
            lane,
            unit,
            count,
            stride,
            i,
            n_res,
            cnt,
            stamps,
            role: cutlass.Constexpr[str],
        ):
            """The consumer warps over `count` units of GEMM`stage` from `unit`
            (step `stride`): GEMM1 (`role` "signal") from the ring, releasing
            each unit on its tile's counter; GEMM2 ("wait") waiting for its
            tile's H, the first `n_res` units from the resident region, the
            rest from the ring; ring steps counted on from `i`. Returns the
            ring position after the last step."""
            NB, KS, U = self.gemm(stage).nb, self.gemm(stage).ks, self.gemm(stage).u
            (wk, valid_at, slots_at, p_a, p_as, sB32, tiled_mma, rA, tCrA, acc, tmp, tCrB, st_w, st_s, pair,
             t16) = self.gemm(stage).wgmma_consumer(act, act_s, sB, ctas, tid, warp)  # fmt: skip
            top_k = cute.arch.load(record + 3, Int32)
            parity, staged = Int32(0), Int32(-1)
            for n in cutlass.range(0, count, 1, unroll=1):
                tile = unit // self.gemm(stage).blocks
                if tile != staged:  # a unit of a new tile: its activation rows into shared memory
                    staged = tile
                    if cutlass.const_expr(role == "wait"):
                        if tid == 0:  # every GEMM1 unit of this tile has written its H: spin relaxed (an
                            # acquire load would invalidate L1 on every try), then one acquire fence
                            ready = cute.arch.load(cnt + tile, Int32, sem="relaxed", scope="gpu")
                            while ready < self.k1.blocks:
                                ready = cute.arch.load(cnt + tile, Int32, sem="relaxed", scope="gpu")
                            cute.arch.fence_acq_rel_gpu()
                            if n == 0:
                                self.stamp(stamps, "h_ready")
                        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                    self.gemm(stage).stage_acts(
                        sB32, sXs, p_a, p_as, record, slots_at, top_k, unit, tid, 0, coherent=(role == "wait")
                    )
                    cute.arch.fence_proxy("async.shared", space="cta")  # generic -> wgmma reads
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                for b in cutlass.range(0, NB, 1, unroll=1):
                    if cutlass.const_expr(role == "signal" or self.R == 0):
                        i = self.ring_words_to_registers(stage, ring, bars, i, st_w, st_s, pair, t16, wk, lane)
                    else:
                        if n >= n_res:
                            i = self.ring_words_to_registers(stage, ring, bars, i, st_w, st_s, pair, t16, wk, lane)
                        else:  # resident: loaded at the start, never refilled in this launch
                            q = n * NB + b
                            cute.arch.mbarrier_wait(rbars + q, 0)
                            if tid == 0:
                                if q == 0:
                                    self.stamp(stamps, "res_first")
                                if q == n_res * NB - 1:
                                    self.stamp(stamps, "res_last")
                            self.gemm(stage).stage_words_to_registers(
                                res + q * self.gemm(stage).stage_words, st_w, st_s, pair, t16, wk, lane
                            )
                    self.gemm(stage).compute_wgmma(
                        tiled_mma, acc, tmp, rA, tCrA, tCrB, sXs, st_w, st_s, b * KS + wk * U, lane
                    )
                self.gemm(stage).stash_partials(sP, acc, parity, warp, lane)
                cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                self.gemm(stage).epilogue(
                    sP, parity, sP, record, clamp, out, out_s, out, unit, valid_at, warp, lane, tid
                )
                parity = parity ^ 1
                if cutlass.const_expr(role == "signal"):
                    # the unit's H stores, a barrier, then one thread's gpu fence (cumulative over
                    # the CTA's stores) and release add on the tile's counter
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                    if tid == 0:
                        cute.arch.fence_acq_rel_gpu()
                        fp4.red_add_release(cnt + tile, 1)
                else:
                    if tid == 0:  # the tile's last GEMM2 unit resets GEMM1's counter
                        old = fp4.arrive_inc(cnt + (ctas + tile), self.gemm(stage).blocks - 1)
                        if old == Uint32(self.gemm(stage).blocks - 1):
                            cute.arch.store(cnt + tile, Int32(0))
                unit = unit + stride
            return i


# ---------------------------------------------------------------------- host side
_KERNEL = "the fused layer kernel"


@functools.lru_cache(maxsize=None)
def compile_fused(shape: GemmShape, ft: FusedTactic, wide_scales: bool = False, trace: bool = False):
    """Compile the fused layer (`FusedLayerKernel`) for one shape class and
    fused tactic (cached per process; cross-compiles without a GPU when
    CUTE_DSL_ARCH=sm_90a is set). Returns (kernel, compiled): `kernel.grid(
    ctas, num_sms)` sizes the launch; `compiled(args, grid, stream)` takes
    the launch's `FusedArgs` (`host.kernel_args`; `fused_layer` takes torch
    tensors); `trace` compiles
    the stamps of `TRACE_STAMPS` in. Raises ValueError when the
    tactic cannot run the shape, RuntimeError without the DSL."""
    require_dsl(_KERNEL)
    kernel = FusedLayerKernel(ft, shape, wide_scales, trace)

    fake = kernel_args(FusedArgs, FUSED_ARG_SPECS, {**dict.fromkeys(FUSED_ARG_SPECS, 1 << 20), "ctas": 1})
    compiled = cute.compile(kernel, fake, Int32(1), _cuda.CUstream(0))
    return kernel, compiled


def fused_workspace_bytes(ctas: int) -> int:
    """Bytes of the fused layer's counters for `ctas` token tiles (int32
    [2 * ctas]: GEMM1 units done per tile, GEMM2 arrivals per tile), rounded
    up to 16; zero at allocation (`gemm.alloc_workspace`) and after every launch."""
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 0:
        raise ValueError(f"ctas must be a non-negative int, got {ctas!r}")
    return max(16, -(-8 * ctas // 16) * 16)


def fused_layer(
    kw: KernelWeights,
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    record: torch.Tensor,
    ctas: int,
    h_q_out: torch.Tensor,
    h_scale_out: torch.Tensor,
    out: torch.Tensor,
    *,
    tactic: FusedTactic,
    workspace: torch.Tensor,
    trace: torch.Tensor | None = None,
    stream=None,
) -> None:
    """GEMM1 and GEMM2 in one launch (`FusedLayerKernel`): the outputs of
    `gemm1` then `gemm2` with tactic.gemm1 / tactic.gemm2, bit for bit (H
    into h_q_out / h_scale_out, the unweighted BF16 rows into out), on
    `stream`; no host sync, no allocation, CUDA-graph capturable.

    kw: KernelWeights in the e4m3 layout; x_q, x_scale, record, ctas,
    h_q_out, h_scale_out, out: as `gemm1` / `gemm2`; workspace: zeroed uint8
    / int32 of >= `fused_workspace_bytes(ctas)` bytes (`alloc_workspace`),
    allocated once (the launch leaves its counters at zero; launches sharing
    it run one after the other); trace: None, or an int64 tensor of
    [SMs of the device, len(TRACE_STAMPS)] that a traced build of the kernel
    fills with each CTA's %globaltimer stamps (row = CTA). Raises TypeError / ValueError naming the
    argument, RuntimeError without nvidia-cutlass-dsl."""
    device = _check_common(kw, record, ctas)
    if not isinstance(tactic, FusedTactic):
        raise TypeError(f"tactic must be a FusedTactic, got {type(tactic).__name__}")
    check_gemm1_io(kw, device, ctas, x_q, x_scale, h_q_out, h_scale_out)
    check_tensor("out", out, (torch.bfloat16,), (TILE * ctas, kw.hidden), device, align=16)
    if kw.operand != "e4m3":
        raise ValueError("kw must be in the e4m3 layout (to_kernel_layout(..., operand='e4m3')) for the fused layer")
    shape = GemmShape.of(kw)
    reason = tactic.why_invalid(shape)
    if reason:
        raise ValueError(f"tactic {tactic.name}: {reason}")
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
    need = fused_workspace_bytes(ctas)
    if (
        workspace.dtype not in (torch.uint8, torch.int32)
        or workspace.dim() != 1
        or workspace.device != device
        or not workspace.is_contiguous()
        or workspace.data_ptr() % 16
        or workspace.numel() * workspace.element_size() < need
    ):
        raise ValueError(
            f"workspace must be a contiguous, 16-byte aligned 1-D uint8 / int32 tensor of >= {need}"
            f" bytes on {device} (alloc_workspace(fused_workspace_bytes({ctas})))"
        )
    require_dsl(_KERNEL)
    sms = _num_sms(device.index if device.index is not None else 0)
    if trace is not None:
        check_tensor("trace", trace, (torch.int64,), (sms, len(TRACE_STAMPS)), device, align=8)
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"with trace, stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            trace.fill_(-1)  # on the launch's stream: rows of CTAs beyond the grid, and stamps a CTA has none of
    if ctas == 0:
        return
    kernel, compiled = compile_fused(shape, tactic, kw.scale_variant(True), trace is not None)
    grid = kernel.grid(ctas, sms)
    sources = dict(w1=kw.w13, ws1=kw.w13_scale, w2=kw.w2, ws2=kw.w2_scale, x=x_q, x_s=x_scale, record=record,
                   clamp=kw.clamp, h=h_q_out, h_s=h_scale_out, out=out, cnt=workspace,
                   trace=trace if trace is not None else workspace)  # fmt: skip
    args = kernel_args(FusedArgs, FUSED_ARG_SPECS, {**sources, "ctas": ctas})
    compiled(args, Int32(grid), cu_stream(stream, device))
