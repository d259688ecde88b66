"""Device-side inline-PTX and vector-memory helpers shared by the CuTe DSL
kernels (quantize, finalize, the router top-k, the shared expert, the
GEMMs). Needs nvidia-cutlass-dsl: import it only where the DSL is present."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result, text: str, constraints: str, args, *, side_effects: bool = False, loc=None, ip=None):
    """One inline-PTX instruction group with an LLVM `result` type (T.i32(),
    T.f32(), T.i64()); `args` are DSL numerics. The raw value: callers wrap it."""
    return llvm.inline_asm(
        result,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def asm_u32(text: str, constraints: str, *args, loc=None, ip=None) -> Uint32:
    """One pure (side-effect free) inline-PTX instruction group -> Uint32.
    `args` are DSL numerics of the types the constraints name (wrap them,
    e.g. Uint32(a), at the call site)."""
    return Uint32(_asm(T.i32(), text, constraints, args, loc=loc, ip=ip))


def asm_f32(text: str, constraints: str, *args, loc=None, ip=None) -> Float32:
    """As `asm_u32`, for an instruction group whose result is an fp32
    register ("=f"); `args` wrapped as Float32 for "f" operands."""
    return Float32(_asm(T.f32(), text, constraints, args, loc=loc, ip=ip))


@dsl_user_op
def ld_global_u32x4(ptr, *, loc=None, ip=None) -> list:
    """One 128-bit global load (LDG.E.128) at the (16-byte aligned) global
    pointer `ptr` (a cute gmem Pointer of Uint32) -> 4 x Uint32."""
    import cutlass.cute as cute

    vec = cute.arch.load(ptr, ir.VectorType.get([4], Uint32.mlir_type), loc=loc, ip=ip)
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_global_u32x4(ptr, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None) -> None:
    """One 128-bit global store (STG.E.128) of four words at the (16-byte
    aligned) global pointer `ptr` (a cute gmem Pointer of Uint32)."""
    import cutlass.cute as cute

    words = [Uint32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)]
    vec = vector.from_elements(ir.VectorType.get([4], Uint32.mlir_type), words, loc=loc, ip=ip)
    cute.arch.store(ptr, vec, loc=loc, ip=ip)


@dsl_user_op
def st_shared_u32x4(ptr, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """st.shared.v4.u32 of four words at the (16-byte aligned) shared-memory
    pointer `ptr` (a cute smem Pointer)."""
    addr = llvm.ptrtoint(T.i32(), ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [addr] + [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
        "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def st_shared_cluster_f32x4(ptr, rank, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """st.shared::cluster.v4.f32 of four fp32 values at the (16-byte aligned)
    shared-memory pointer `ptr` of this CTA mapped (mapa) to CTA `rank` of the
    cluster (distributed shared memory)."""
    import cutlass.cute as cute

    remote = cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip)
    addr = llvm.ptrtoint(T.i32(), remote.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [addr] + [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
        "st.shared::cluster.v4.f32 [$0], {$1, $2, $3, $4};",
        "r,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def sync_threads_or(flag, *, loc=None, ip=None):
    """Barrier 0 over the whole CTA (as `__syncthreads`) that also ORs `flag`
    (Int32, nonzero = true) over every thread: returns Int32 1 if any thread's
    flag was nonzero, else 0, in every thread (`bar.red.or.pred`). Orders
    shared-memory accesses as a plain barrier does."""
    from cutlass import Int32

    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(flag).ir_value(loc=loc, ip=ip)],
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r,~{memory}",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The SM's %globaltimer (ns, one clock for the whole GPU): the fused
    layer's trace stamps (`fused.py`, trace=True)."""
    return Int64(_asm(T.i64(), "mov.u64 $0, %globaltimer;", "=l", (), side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """`trap;`: abort the kernel (the launch fails with an illegal-instruction
    error), for a state the kernel must never compute on."""
    llvm.inline_asm(
        None, [], "trap;", "", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT
    )


@dsl_user_op
def mbarrier_try_wait_cluster(mbar, phase: Int32, *, loc=None, ip=None) -> Uint32:
    """One `mbarrier.try_wait.parity.acquire.cluster` on the CTA-local
    mbarrier `mbar` for `phase` parity: 1 once the phase completed (with
    acquire at cluster scope, which pairs with st.async's cluster-scope
    release of its complete-tx), else 0 (after the hardware's time limit)."""
    addr = llvm.ptrtoint(T.i32(), mbar.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [addr, Int32(phase).ir_value(loc=loc, ip=ip)],
            "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2;"
            " selp.u32 $0, 1, 0, p; }",
            "=r,r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def st_async_cluster(ptr, mbar, rank: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """st.async of the Int32 `value` at the shared-memory pointer `ptr`
    of CTA `rank` of the cluster, completing 4 bytes on that CTA's
    mbarrier `mbar` (both mapped with mapa)."""
    import cutlass.cute as cute

    remote = cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip)
    addr = llvm.ptrtoint(T.i32(), remote.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    rbar = cute.arch.map_dsmem_ptr(mbar, rank, loc=loc, ip=ip)
    baddr = llvm.ptrtoint(T.i32(), rbar.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [addr, Int32(value).ir_value(loc=loc, ip=ip), baddr],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [$0], $1, [$2];",
        "r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mbarrier_arrive_cluster(mbar, rank: Int32, *, loc=None, ip=None) -> None:
    """One arrive with release at cluster scope on the mbarrier at the
    shared-memory pointer `mbar` of this CTA mapped (mapa) to CTA `rank` of
    the cluster: what this thread (and, through a CTA barrier before it, its
    CTA) did before is visible to a thread that acquires the phase there."""
    import cutlass.cute as cute

    rbar = cute.arch.map_dsmem_ptr(mbar, rank, loc=loc, ip=ip)
    baddr = llvm.ptrtoint(T.i32(), rbar.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [baddr],
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];",
        "r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
