"""The finalize kernel: GEMM2's unweighted rows -> the layer's routed output.

One launch computes, for tokens 1..8 and top_k 1..8 (DESIGN.md, "The
routed-expert path", Finalize; `moebench.moe_output.finalize` is the torch
form of the same contract):

    out[t] = bf16_rne( scale * sum_k w[t, k] * rows[permuted[t, k]]  + shared[t] )

from rows bf16 [permuted_rows, H] (GEMM2's output, densely packed, H a
multiple of 128), weights fp32 [tokens, top_k], the permute map int32
[tokens, top_k] and, optionally, shared bf16 [tokens, H]. A slot whose
permuted index lies outside [0, permuted_rows) (-1: the route is not local)
is skipped: its row is never read and its weight never used, so a NaN in an
unused row or weight cannot leak (no 0 * NaN).

Numerics, defined so that a plain fp32 torch loop gives the same bits:

    acc = +0.0                                   fp32
    for k = 0, 1, ..., top_k - 1 (local k only):
        acc = acc + (w[t, k] * float(rows[p, :]))    mul.rn.f32 then add.rn.f32
    acc = acc * scale                            mul.rn.f32 (scale rounded to fp32)
    acc = acc + float(shared[t])                 add.rn.f32 (with shared only)
    out = bf16(acc)                              cvt.rn.bf16x2.f32 (RNE)

Every step is a separately rounded IEEE operation without flush to zero: the
arithmetic is inline PTX, so the compiler cannot contract a multiply and an
add into an FMA (ptxas keeps .rn multiplies and adds apart). A NaN result
is written as a bf16 NaN whose payload may differ from torch's (0x7FC0).

Method: the grid is (ceil(H/8 / threads), tokens); each thread owns 8
consecutive bf16 (16 bytes) of one token's output. Unrolled over
MAX_TOP_K = 8 slots, it loads the token's permuted indices and weights
(scalar loads, the same addresses for the whole CTA; slot k >= top_k
re-reads slot top_k - 1 and is skipped), then issues the 16-byte loads of
every local row's chunk together (each predicated inside one inline-PTX
group: a skipped slot touches no memory and yields zeros with weight +0,
and acc + (+0 * +0) == acc exactly, see the kernel), accumulates in top-k
order, scales, adds the 16-byte shared chunk, converts and writes one
16-byte store. tokens, top_k, H and permuted_rows are runtime values: one
compiled kernel per (has_shared, pdl, threads) serves every shape (tokens
8, H 7168: 14 x 8 CTAs of 64 threads).

Fused residual add + RMSNorm (`norm=True`, a compile-time variant; the
launch takes residual bf16 [tokens, H], norm_weight bf16 [H] and eps): the
value above, rounded to bf16 as `out` would hold it (moe), then the numerics
of vLLM's fused_add_rms_norm on it, per token row:

    r   = bf16(float(residual) + float(moe))     add.rn.f32, RNE -> residual_out
    ss  = sum of float(r)^2 in the order below   mul.rn.f32 + add.rn.f32 (no FMA)
    inv = 1 / sqrt(ss / float(H) + eps)          div.rn, add.rn, sqrt.rn, rcp.rn
    y   = bf16(float(r) * inv)                   mul.rn.f32, RNE
    out = bf16(float(y) * float(norm_weight))    mul.rn.f32, RNE

(vLLM rounds to bf16 between the normalization and the weight multiply too;
its rsqrtf is approximate where this is correctly rounded, and its sum of
squares has another order.) The grid is (1, tokens) and a CTA of `threads`
>= H/8 threads gives thread i chunk i (elements 8i..8i+7) of the row; the
residual, norm-weight and shared chunks are 16-byte loads like the rows',
predicated off for threads past H/8. The sum of squares: each thread adds
its 8 squares in element order from +0; a butterfly over the warp
(shfl.bfly 16, 8, 4, 2, 1, each lane adding its partner's value); lane 0
of each warp stores its warp's sum to shared memory; one barrier; every
warp reads the 32 warp sums (+0 past the CTA's warps) and butterflies them
the same way, so every thread holds the same total. An idle thread or warp
adds +0, which changes nothing, so the bits do not depend on `threads`
(any CTA with threads >= H/8 gives the same tree over the 32 x 32 padded
chunks). The torch form, `moebench.moe_output.add_rms_norm`, sums with
torch's own reduction: r matches bit for bit and out within 2^-6 of
max(|out|, |ref|) per element, the few elements whose bf16 rounding the
reordered sum moves (the tests state the argument). H <= MAX_NORM_HIDDEN
(8192: 1024 threads of 8). `out` may not be the new residual's buffer.

Programmatic dependent launch (`pdl=True`): the kernel lets its dependents
launch on entry (what follows may start its prologue; it must
griddepcontrol.wait before reading `out`, which waits for this grid to
complete and flush) and waits on griddepcontrol before its first global
access (rows, weights, the permute map, shared and residual come from
earlier kernels, and `out` or the residual may still be read by an earlier
kernel).
"""

from __future__ import annotations

import functools
import numbers

import torch

from moebench.kernels.host import (
    HAVE_DSL, check_bool, check_tensor, check_threads, cu_stream, gmem_ptr, require_dsl,
)  # fmt: skip
from moebench.moe_output import DEFAULT_EPS, UnfinalizedMoEOutput, check_eps, check_norm_pair

#: Most token rows and routes per token the kernel takes, and the granularity of H.
MAX_TOKENS = 8
MAX_TOP_K = 8
H_MULTIPLE = 128
#: bf16 elements per thread (one 16-byte load / store).
_CHUNK = 8
#: Default CTA size (threads = 8-element chunks of one token per CTA).
DEFAULT_THREADS = 64
#: Largest H of the norm variant (one CTA of at most 1024 threads per row, 8 elements a thread).
MAX_NORM_HIDDEN = 8192

if HAVE_DSL:  # the kernel class needs the DSL's decorators at definition time
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from moebench.kernels.ptx import asm_u32 as _asm
    from moebench.kernels.ptx import ld_global_u32x4 as _ld_v4
    from moebench.kernels.ptx import st_global_u32x4 as _st_v4

    @dsl_user_op
    def _mul_add_rn(acc: Uint32, w: Uint32, x: Uint32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of acc + (w * x) (fp32 bits in): two IEEE round-to-nearest
        operations, no FMA contraction, no flush to zero."""
        return _asm(
            "{ .reg .f32 p;\n mul.rn.f32 p, $2, $3;\n add.rn.f32 $0, $1, p; }",
            "=r,r,r,r",
            Uint32(acc),
            Uint32(w),
            Uint32(x),
            loc=loc,
            ip=ip,
        )

    @dsl_user_op
    def _mul_rn(a: Uint32, s: Float32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of a * s (a: fp32 bits), round-to-nearest, no flush to zero."""
        return _asm("mul.rn.f32 $0, $1, $2;", "=r,r,f", Uint32(a), Float32(s), loc=loc, ip=ip)

    @dsl_user_op
    def _mul_rn_bits(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of a * b (fp32 bits in), round-to-nearest, no flush to zero."""
        return _asm("mul.rn.f32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b), loc=loc, ip=ip)

    @dsl_user_op
    def _add_rn(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of a + b (fp32 bits in), round-to-nearest, no flush to zero."""
        return _asm("add.rn.f32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b), loc=loc, ip=ip)

    @dsl_user_op
    def _inv_rms(ss: Uint32, hidden: Int32, eps: Float32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of 1 / sqrt(ss / float(hidden) + eps) (ss: fp32 bits): a
        division, an add, a square root and a reciprocal, each IEEE
        round-to-nearest (no rsqrt.approx, no flush to zero)."""
        return _asm(
            "{ .reg .f32 h, m, v, s;\n cvt.rn.f32.s32 h, $2;\n div.rn.f32 m, $1, h;\n"
            " add.rn.f32 v, m, $3;\n sqrt.rn.f32 s, v;\n rcp.rn.f32 $0, s; }",
            "=r,r,r,f",
            Uint32(ss),
            Int32(hidden),
            Float32(eps),
            loc=loc,
            ip=ip,
        )

    @dsl_user_op
    def _cvt_bf16x2(lo: Uint32, hi: Uint32, *, loc=None, ip=None) -> Uint32:
        """Two fp32 values (bits) -> a bf16x2 word (RNE), `lo` in the low half."""
        return _asm("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", Uint32(lo), Uint32(hi), loc=loc, ip=ip)

    @dsl_user_op
    def _ld_v4_if(ptr, flag: Int32, *, loc=None, ip=None):
        """One 128-bit global load (LDG.E.128) of 4 x Uint32 when `flag` != 0,
        four zeros (and no memory access) otherwise. The predicate lives inside
        the asm (sm_90 has 7 predicate registers: predicates held across eight
        loads would serialize them); volatile, so it stays after
        griddepcontrol.wait."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.i32()] * 4),
            [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(flag).ir_value(loc=loc, ip=ip)],
            "{ .reg .pred q;\n"
            " setp.ne.b32 q, $5, 0;\n"
            " mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
            " @q ld.global.v4.b32 {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
        return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]

    def _unpack(word: Uint32, i: int) -> Uint32:
        """fp32 bits of bf16 element i (0: low half, 1: high half) of a bf16x2 word."""
        return word << Uint32(16) if i % 2 == 0 else word & Uint32(0xFFFF0000)

    class FinalizeKernel:
        """Top-k weighted sum (+ shared add) of GEMM2's rows, one thread per
        8 bf16 of one token's output (CuTe DSL, sm_90a); with `norm`, also
        the residual add and the RMSNorm of each token row.

        Static configuration: `has_shared` (bool, add the bf16 shared-expert
        output), `pdl` (bool, launch with programmatic dependent launch:
        trigger dependents on entry, griddepcontrol.wait before the first
        global access), `threads` (CTA size, a multiple of 32 in
        [32, 1024]) and `norm` (bool, default False: the fused residual add
        + RMSNorm variant, one CTA per token row, which needs
        hidden <= 8 * threads; see the module docstring). Runtime: rows
        (bf16), weights (fp32), permuted (int32), shared (bf16; unused
        without has_shared) and out (bf16) global pointers, rows / shared /
        out 16-byte aligned; tokens, top_k, hidden and permuted_rows (Int32)
        and scale (Float32); then residual, residual_out and norm_weight
        (bf16, 16-byte aligned) and eps (Float32), all unused without `norm`.
        """

        def __init__(self, has_shared: bool, pdl: bool = True, threads: int = DEFAULT_THREADS, norm: bool = False):
            check_bool("has_shared", has_shared)
            check_bool("pdl", pdl)
            check_threads(threads)
            check_bool("norm", norm)
            self.has_shared = has_shared
            self.pdl = pdl
            self.threads = threads
            self.norm = norm

        @cute.jit
        def __call__(
            self,
            rows: cute.Pointer,
            weights: cute.Pointer,
            permuted: cute.Pointer,
            shared: cute.Pointer,
            out: cute.Pointer,
            tokens: Int32,
            top_k: Int32,
            hidden: Int32,
            permuted_rows: Int32,
            scale: Float32,
            residual: cute.Pointer,
            residual_out: cute.Pointer,
            norm_weight: cute.Pointer,
            eps: Float32,
            stream: _cuda.CUstream,
        ):
            """Launch (ceil(hidden/8 / threads), tokens) CTAs of `threads`
            threads on `stream`; with `norm`, (1, tokens) CTAs."""
            chunks = hidden // _CHUNK
            ctas = (chunks + (self.threads - 1)) // self.threads
            if cutlass.const_expr(self.norm):
                ctas = 1  # one CTA per token row (the host checks chunks <= threads)
            # min_blocks_per_mp=1 (.minnctapersm 1): without it ptxas schedules for
            # occupancy and sinks the row loads between the adds (serial L2 trips)
            self.kernel(
                rows,
                weights,
                permuted,
                shared,
                out,
                top_k,
                hidden,
                permuted_rows,
                scale,
                residual,
                residual_out,
                norm_weight,
                eps,
            ).launch(
                grid=[ctas, tokens, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1
            )

        @cute.jit
        def routed_sum(self, p_rows, p_w, permuted, t, top_k, permuted_rows, words, col, active):
            """The token's MAX_TOP_K slot weights (fp32 bits, +0 for a skipped
            slot) and this thread's chunk of each slot's row (4 x Uint32,
            zeros for a skipped slot): (ws, xs). `active` (an Int32 flag, or
            None for always) gates every row load: an inactive thread reads
            no row."""
            base = t * top_k
            # the token's permuted indices and weights: unconditional loads
            # (slot k >= top_k re-reads slot top_k - 1, inside the tensors)
            flags, ws, offs = [], [], []
            for k in cutlass.range_constexpr(MAX_TOP_K):
                kk = cutlass.min(Int32(k), top_k - 1)
                p = cute.arch.load(permuted + (base + kk), Int32)
                w = cute.arch.load(p_w + (base + kk), Uint32)
                ok = k < top_k and p >= 0 and p < permuted_rows
                if cutlass.const_expr(active is not None):
                    ok = ok and active != 0
                flags.append(Int32(ok))
                # a skipped slot adds w * x = +0 * +0 (acc + +0 == acc: see below)
                ws.append(w if ok else Uint32(0))
                offs.append((p if ok else Int32(0)) * words + col)
            # every local row's chunk, all loads issued before the first add;
            # a skipped slot reads nothing (its predicated load gives zeros)
            xs = [_ld_v4_if(p_rows + offs[k], flags[k]) for k in range(MAX_TOP_K)]
            return ws, xs

        @cute.jit
        def accumulate(self, ws, xs):
            """fp32 accumulation in top-k order (acc + w*x, two roundings). acc
            starts at +0.0 and an RN sum is -0.0 only when both addends are,
            so acc is never -0.0 and adding a skipped slot's +0.0 leaves it
            unchanged, bit for bit (NaN and Inf included): the same as
            skipping the slot."""
            acc = [Uint32(0)] * _CHUNK
            for k in cutlass.range_constexpr(MAX_TOP_K):
                for i in cutlass.range_constexpr(_CHUNK):
                    acc[i] = _mul_add_rn(acc[i], ws[k], _unpack(xs[k][i // 2], i))
            return acc

        @cute.kernel
        def kernel(
            self,
            rows: cute.Pointer,
            weights: cute.Pointer,
            permuted: cute.Pointer,
            shared: cute.Pointer,
            out: cute.Pointer,
            top_k: Int32,
            hidden: Int32,
            permuted_rows: Int32,
            scale: Float32,
            residual: cute.Pointer,
            residual_out: cute.Pointer,
            norm_weight: cute.Pointer,
            eps: Float32,
        ):
            tid = cute.arch.thread_idx()[0]
            cx, t, _ = cute.arch.block_idx()
            c = cx * self.threads + tid  # this thread's 8-element chunk
            words = hidden // 2  # 32-bit words per row
            col = c * 4  # word offset of the chunk
            p_rows = cute.recast_ptr(rows, dtype=Uint32)
            p_w = cute.recast_ptr(weights, dtype=Uint32)  # fp32 bits
            p_out = cute.recast_ptr(out, dtype=Uint32)
            s_part = None
            if cutlass.const_expr(self.norm):
                smem = cutlass.memory.SmemAllocator()
                s_part = smem.allocate_tensor(Uint32, cute.make_layout((32,)), byte_alignment=16)

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()

            if cutlass.const_expr(not self.norm):
                if c < hidden // _CHUNK:
                    ws, xs = self.routed_sum(p_rows, p_w, permuted, t, top_k, permuted_rows, words, col, None)
                    sh = []
                    if cutlass.const_expr(self.has_shared):
                        p_sh = cute.recast_ptr(shared, dtype=Uint32)
                        sh = _ld_v4(p_sh + (t * words + col))
                    acc = self.accumulate(ws, xs)
                    res = []
                    for i in cutlass.range_constexpr(_CHUNK):
                        a = _mul_rn(acc[i], scale)
                        if cutlass.const_expr(self.has_shared):
                            a = _add_rn(a, _unpack(sh[i // 2], i))
                        res.append(a)
                    _st_v4(
                        p_out + (t * words + col),
                        _cvt_bf16x2(res[0], res[1]),
                        _cvt_bf16x2(res[2], res[3]),
                        _cvt_bf16x2(res[4], res[5]),
                        _cvt_bf16x2(res[6], res[7]),
                    )
            else:
                self.norm_body(
                    p_rows,
                    p_w,
                    permuted,
                    shared,
                    p_out,
                    residual,
                    residual_out,
                    norm_weight,
                    s_part,
                    t,
                    tid,
                    top_k,
                    hidden,
                    permuted_rows,
                    scale,
                    eps,
                )

        @cute.jit
        def norm_body(
            self,
            p_rows,
            p_w,
            permuted,
            shared,
            p_out,
            residual,
            residual_out,
            norm_weight,
            s_part,
            t,
            tid,
            top_k,
            hidden,
            permuted_rows,
            scale,
            eps,
        ):
            """The `norm` variant (one CTA per token row t, thread tid owns chunk
            tid): moe = bf16(routed sum * scale [+ shared]); r = bf16(residual
            + moe), stored to residual_out; the block's sum of r^2 (see the
            module docstring for its order); out = bf16(bf16(r * inv) * w)."""
            words = hidden // 2
            col = tid * 4
            active = Int32(tid < hidden // _CHUNK)
            ws, xs = self.routed_sum(p_rows, p_w, permuted, t, top_k, permuted_rows, words, col, active)
            sh = []
            if cutlass.const_expr(self.has_shared):
                sh = _ld_v4_if(cute.recast_ptr(shared, dtype=Uint32) + (t * words + col), active)
            p_res = cute.recast_ptr(residual, dtype=Uint32)
            p_res_out = cute.recast_ptr(residual_out, dtype=Uint32)
            p_nw = cute.recast_ptr(norm_weight, dtype=Uint32)
            rs = _ld_v4_if(p_res + (t * words + col), active)
            nw = _ld_v4_if(p_nw + col, active)
            acc = self.accumulate(ws, xs)
            # moe_out (bf16, as finalize writes it), then r = bf16(moe + residual)
            moe = []
            for i in cutlass.range_constexpr(_CHUNK):
                a = _mul_rn(acc[i], scale)
                if cutlass.const_expr(self.has_shared):
                    a = _add_rn(a, _unpack(sh[i // 2], i))
                moe.append(a)
            moe_w = [_cvt_bf16x2(moe[2 * j], moe[2 * j + 1]) for j in range(4)]
            rsum = [_add_rn(_unpack(moe_w[i // 2], i), _unpack(rs[i // 2], i)) for i in range(_CHUNK)]
            r_w = [_cvt_bf16x2(rsum[2 * j], rsum[2 * j + 1]) for j in range(4)]
            x = [_unpack(r_w[i // 2], i) for i in range(_CHUNK)]
            # sum of squares: the thread's 8 in order, a butterfly over the warp,
            # the warps' partials through shared memory, a butterfly over them
            # (an idle thread and the padding add +0: no change; the idle thread's
            # sum is forced to +0, as its zeros times a non-finite scale are NaN)
            ss = Uint32(0)
            for i in cutlass.range_constexpr(_CHUNK):
                ss = _mul_add_rn(ss, x[i], x[i])
            ss = ss if active != 0 else Uint32(0)
            for sh_i in cutlass.range_constexpr(5):
                ss = _add_rn(ss, cute.arch.shuffle_sync_bfly(ss, 16 >> sh_i))
            warp = tid // 32
            lane = tid % 32
            if lane == 0:
                s_part[warp] = ss
            cute.arch.sync_threads()
            nwarps = self.threads // 32
            tot = s_part[cutlass.min(lane, Int32(nwarps - 1))]
            tot = tot if lane < nwarps else Uint32(0)
            for sh_i in cutlass.range_constexpr(5):
                tot = _add_rn(tot, cute.arch.shuffle_sync_bfly(tot, 16 >> sh_i))
            inv = _inv_rms(tot, hidden, eps)
            # out = bf16(bf16(x * inv) * w): two roundings, as vLLM's kernel
            yn = [_mul_rn_bits(x[i], inv) for i in range(_CHUNK)]
            y_w = [_cvt_bf16x2(yn[2 * j], yn[2 * j + 1]) for j in range(4)]
            o = [_mul_rn_bits(_unpack(y_w[i // 2], i), _unpack(nw[i // 2], i)) for i in range(_CHUNK)]
            if active != 0:
                _st_v4(p_res_out + (t * words + col), r_w[0], r_w[1], r_w[2], r_w[3])
                _st_v4(
                    p_out + (t * words + col),
                    _cvt_bf16x2(o[0], o[1]),
                    _cvt_bf16x2(o[2], o[3]),
                    _cvt_bf16x2(o[4], o[5]),
                    _cvt_bf16x2(o[6], o[7]),
                )


_KERNEL = "the finalize kernel"


def compile_finalize_kernel(has_shared: bool, pdl: bool = True, threads: int = DEFAULT_THREADS, *, norm: bool = False):
    """Compile the finalize kernel once per process, shared variant, PDL
    setting, CTA size and norm variant (cached; see FinalizeKernel).

    Without a GPU set CUTE_DSL_ARCH=sm_90a to cross-compile for the H200.
    Returns the compiled function, called as
    `f(rows_ptr, weights_ptr, permuted_ptr, shared_ptr, out_ptr, tokens,
    top_k, hidden, permuted_rows, scale, residual_ptr, residual_out_ptr,
    norm_weight_ptr, eps, stream)` with global pointers (bf16 / fp32 /
    int32 / bf16 / bf16, then bf16 x 3; cutlass.cute.runtime.make_ptr;
    every bf16 pointer 16-byte aligned; shared is not read without
    `has_shared`, the last three not without `norm`), Int32 counts, Float32
    scale and eps and a cuda.bindings CUstream; `launch_finalize` does this
    for torch tensors. With `norm`, hidden must be <= 8 * threads (not
    checked on the device). Raises RuntimeError without nvidia-cutlass-dsl,
    TypeError for a non-bool `has_shared`, `pdl` or `norm`, ValueError for a
    bad `threads`."""
    check_bool("has_shared", has_shared)
    check_bool("pdl", pdl)
    check_threads(threads)
    check_bool("norm", norm)
    return _compile(has_shared, pdl, threads, norm)


@functools.lru_cache(maxsize=None)
def _compile(has_shared: bool, pdl: bool, threads: int, norm: bool):
    require_dsl(_KERNEL)

    def fake(dtype, align=16):
        return gmem_ptr(dtype, 16, align)

    kernel = FinalizeKernel(has_shared=has_shared, pdl=pdl, threads=threads, norm=norm)
    return cute.compile(
        kernel,
        fake(BFloat16),
        fake(Float32, 4),
        fake(Int32, 4),
        fake(BFloat16),
        fake(BFloat16),
        Int32(1),
        Int32(1),
        Int32(H_MULTIPLE),
        Int32(1),
        Float32(1.0),
        fake(BFloat16),
        fake(BFloat16),
        fake(BFloat16),
        Float32(1e-6),
        _cuda.CUstream(0),
    )


def norm_threads(hidden: int) -> int:
    """The default CTA size of the norm variant for hidden size `hidden`:
    one thread per 8-element chunk, rounded up to a warp (512 / 640 / 896
    for H 4096 / 5120 / 7168). Raises ValueError for a hidden size that is
    not a positive multiple of 128 or above MAX_NORM_HIDDEN."""
    if (
        not isinstance(hidden, int)
        or isinstance(hidden, bool)
        or hidden <= 0
        or hidden % H_MULTIPLE
        or hidden > MAX_NORM_HIDDEN
    ):
        raise ValueError(f"hidden must be a positive multiple of {H_MULTIPLE} <= {MAX_NORM_HIDDEN}, got {hidden!r}")
    return -(-hidden // (_CHUNK * 32)) * 32


def _check_rows(rows) -> tuple[int, int]:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype != torch.bfloat16:
        raise TypeError(f"rows must be torch.bfloat16, got {rows.dtype}")
    if rows.dim() != 2:
        raise ValueError(f"rows must be 2-D [permuted_rows, H], got shape {tuple(rows.shape)}")
    n, h = rows.shape
    if h <= 0 or h % H_MULTIPLE:
        raise ValueError(f"rows: H must be a positive multiple of {H_MULTIPLE}, got {h}")
    check_tensor("rows", rows, torch.bfloat16, (n, h), align=16)
    return n, h


def _check_top_k_tensor(name: str, t, dtype: torch.dtype) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, top_k], got shape {tuple(t.shape)}")
    tokens, top_k = t.shape
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"{name}: tokens must be in [1, {MAX_TOKENS}], got {tokens}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"{name}: top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    return tokens, top_k


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale)


def _check_norm_args(residual, norm_weight, eps, residual_out, out, tokens: int, h: int, device: torch.device) -> float:
    """Validate the norm arguments (all present: residual and norm_weight given)."""
    check_tensor("residual", residual, torch.bfloat16, (tokens, h), device, device_of="rows", align=16)
    check_tensor("norm_weight", norm_weight, torch.bfloat16, (h,), device, device_of="rows", align=16)
    if residual_out is not None:
        check_tensor("residual_out", residual_out, torch.bfloat16, (tokens, h), device, device_of="rows", align=16)
    if h > MAX_NORM_HIDDEN:
        raise ValueError(
            f"rows: H must be <= {MAX_NORM_HIDDEN} with residual / norm_weight (one CTA per token row), got {h}"
        )
    target = residual if residual_out is None else residual_out
    if out.data_ptr() == target.data_ptr():
        raise ValueError(
            "out must not be the buffer the new residual is written to "
            "(residual_out, or residual when residual_out is None)"
        )
    return check_eps(eps)


def launch_finalize(
    rows: torch.Tensor,
    weights: torch.Tensor,
    permuted: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    residual_out: torch.Tensor | None = None,
    stream=None,
    pdl: bool = True,
    threads: int | None = None,
) -> None:
    """Launch the finalize kernel: write
    out[t] = bf16(scale * sum_k weights[t, k] * rows[permuted[t, k]] + shared[t])
    (fp32, top-k order, see the module docstring) on `stream` (torch's
    current stream when None); with `residual` and `norm_weight`, fuse the
    residual add and the RMSNorm instead (vLLM's fused_add_rms_norm applied
    to that bf16 result):

        r = bf16(residual + out_as_above)   -> residual_out (default: residual, in place)
        out = bf16(bf16(r * 1/sqrt(mean(r^2) + eps)) * norm_weight)

    No host sync, no allocation: CUDA-graph capturable (call it once before
    capture: the first call loads the kernel).

    rows: bfloat16 [permuted_rows, H], contiguous, CUDA, 16-byte aligned; H a
      positive multiple of 128 (<= 8192 with the norm). Only the rows the
      map points to are read.
    weights: float32 [tokens, top_k], contiguous, on rows' device;
      1 <= tokens <= 8, 1 <= top_k <= 8.
    permuted: int32 [tokens, top_k], contiguous, same device; an entry
      outside [0, permuted_rows) (-1: not local) skips its slot (never read;
      the GPU cannot check the range without a host sync, so an index past
      the rows is skipped rather than raised).
    out: bfloat16 [tokens, H], contiguous, 16-byte aligned, same device;
      every element is written. It may be `shared` itself (in place), and
      `residual` when `residual_out` is another buffer, but not the buffer
      the new residual goes to.
    scale: the runner-side routed factor (a real number, rounded to fp32).
    shared: None or bfloat16 [tokens, H], contiguous, 16-byte aligned, same
      device: the shared-expert output, added after the scale.
    residual: None or bfloat16 [tokens, H], contiguous, 16-byte aligned, same
      device: the residual stream; given together with norm_weight.
    norm_weight: None or bfloat16 [H], contiguous, 16-byte aligned, same
      device: the RMSNorm weight; given together with residual.
    eps: the RMSNorm epsilon, a finite real >= 0 (rounded to fp32).
    residual_out: None (write the new residual over `residual`) or bfloat16
      [tokens, H], contiguous, 16-byte aligned, same device.
    stream: None, a torch.cuda.Stream or a cuda.bindings CUstream.
    pdl: launch with programmatic dependent launch (see the module docstring).
    threads: CTA size, a multiple of 32 in [32, 1024]: a tactic; every value
      gives the same bits. None: 64 without the norm, `norm_threads(H)` with
      it (which needs threads >= H / 8).

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape,
    range, layout, alignment or device, for residual without norm_weight or
    the reverse, or for out aliasing the new residual (each naming the
    argument), RuntimeError without nvidia-cutlass-dsl.
    """
    n_rows, h = _check_rows(rows)
    device = rows.device
    tokens, top_k = _check_top_k_tensor("weights", weights, torch.float32)
    check_tensor("weights", weights, torch.float32, (tokens, top_k), device, device_of="rows")
    check_tensor("permuted", permuted, torch.int32, (tokens, top_k), device, device_of="rows")
    check_tensor("out", out, torch.bfloat16, (tokens, h), device, device_of="rows", align=16)
    if shared is not None:
        check_tensor("shared", shared, torch.bfloat16, (tokens, h), device, device_of="rows", align=16)
    scale = _check_scale(scale)
    norm = check_norm_pair(residual, norm_weight)
    if not norm and residual_out is not None:
        raise ValueError("residual_out needs residual and norm_weight")
    if norm:
        eps = _check_norm_args(residual, norm_weight, eps, residual_out, out, tokens, h, device)
    else:
        eps = check_eps(eps)
    check_bool("pdl", pdl)
    if threads is None:
        threads = norm_threads(h) if norm else DEFAULT_THREADS
    check_threads(threads)
    if norm and h > _CHUNK * threads:
        raise ValueError(
            f"threads must be >= H / 8 = {h // _CHUNK} with residual / norm_weight "
            f"(one thread per 8 elements of a row), got {threads}"
        )
    if device.type != "cuda":
        raise ValueError(f"rows, weights, permuted and out must be CUDA tensors, got {device}")
    if n_rows >= 2**31 // max(h, 1):
        raise ValueError(f"rows: {n_rows} rows of {h} exceed the kernel's int32 indexing")
    require_dsl(_KERNEL)
    compiled = compile_finalize_kernel(shared is not None, pdl, threads, norm=norm)
    if norm:
        res_ptr = gmem_ptr(BFloat16, residual, 16)
        res_out_ptr = gmem_ptr(BFloat16, residual if residual_out is None else residual_out, 16)
        nw_ptr = gmem_ptr(BFloat16, norm_weight, 16)
    else:  # never read: any valid pointer
        res_ptr = res_out_ptr = nw_ptr = gmem_ptr(BFloat16, out, 16)
    compiled(
        gmem_ptr(BFloat16, rows, 16),
        gmem_ptr(Float32, weights, 4),
        gmem_ptr(Int32, permuted, 4),
        gmem_ptr(BFloat16, shared if shared is not None else out, 16),
        gmem_ptr(BFloat16, out, 16),
        Int32(tokens),
        Int32(top_k),
        Int32(h),
        Int32(n_rows),
        Float32(scale),
        res_ptr,
        res_out_ptr,
        nw_ptr,
        Float32(eps),
        cu_stream(stream, device),
    )


def finalize(
    unfinalized: UnfinalizedMoEOutput,
    *,
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    stream=None,
    pdl: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs on the rows' device and launch the kernel (see
    `launch_finalize`): the GPU form of
    `moebench.moe_output.finalize(unfinalized, scale=scale, shared=shared,
    residual=residual, norm_weight=norm_weight, eps=eps)` with bf16 rows and
    outputs, the sum in top-k order.

    unfinalized: an UnfinalizedMoEOutput with gemm2_permuted bfloat16
      [permuted_rows, H] (H % 128 == 0, CUDA, 16-byte aligned),
      expert_weights [tokens, top_k] of a floating dtype (converted to
      float32 / made contiguous when it is not already: a small copy) and an
      int32 permute map (made contiguous). shared: None or bfloat16
      [tokens, H] on the same device. residual and norm_weight: None, or
      bfloat16 [tokens, H] and [H] on the same device (H <= 8192); eps the
      RMSNorm epsilon (finite, >= 0).

    Returns out bfloat16 [tokens, H] once launched (ready when the stream has
    run the kernel); with residual and norm_weight, (normed, new_residual),
    both bfloat16 [tokens, H] and newly allocated (`residual` is not
    modified; `launch_finalize` updates it in place). Raises TypeError for a
    wrong type, otherwise as `launch_finalize`.
    """
    if not isinstance(unfinalized, UnfinalizedMoEOutput):
        raise TypeError(f"unfinalized must be an UnfinalizedMoEOutput, got {type(unfinalized).__name__}")
    rows = unfinalized.gemm2_permuted
    weights = unfinalized.expert_weights
    permuted = unfinalized.expanded_idx_to_permuted_idx.contiguous()
    if not weights.is_floating_point():
        raise TypeError(f"expert_weights must be a floating dtype, got {weights.dtype}")
    weights = weights.to(torch.float32).contiguous()
    _, h = _check_rows(rows)
    tokens, _ = _check_top_k_tensor("weights", weights, torch.float32)
    out = torch.empty(tokens, h, dtype=torch.bfloat16, device=rows.device)
    if not check_norm_pair(residual, norm_weight):
        launch_finalize(rows, weights, permuted, out, scale=scale, shared=shared, eps=eps, stream=stream, pdl=pdl)
        return out
    new_residual = torch.empty(tokens, h, dtype=torch.bfloat16, device=rows.device)
    launch_finalize(
        rows,
        weights,
        permuted,
        out,
        scale=scale,
        shared=shared,
        residual=residual,
        norm_weight=norm_weight,
        eps=eps,
        residual_out=new_residual,
        stream=stream,
        pdl=pdl,
    )
    return out, new_residual


__all__ = [
    "DEFAULT_EPS", "DEFAULT_THREADS", "H_MULTIPLE", "MAX_NORM_HIDDEN", "MAX_TOKENS", "MAX_TOP_K",
    "compile_finalize_kernel", "finalize", "launch_finalize", "norm_threads",
]  # fmt: skip
if HAVE_DSL:
    __all__.append("FinalizeKernel")
