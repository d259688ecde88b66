"""Device-side inline-PTX helpers shared by the CuTe DSL kernels (quantize,
finalize, the router top-k). Needs nvidia-cutlass-dsl: import it only where
the DSL is present."""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def asm_u32(text: str, constraints: str, *args, loc=None, ip=None) -> Uint32:
    """One pure (side-effect free) inline-PTX instruction group -> Uint32.
    `args` are DSL numerics of the types the constraints name (wrap them,
    e.g. Uint32(a), at the call site)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def asm_f32(text: str, constraints: str, *args, loc=None, ip=None) -> Float32:
    """As `asm_u32`, for an instruction group whose result is an fp32
    register ("=f"); `args` wrapped as Float32 for "f" operands."""
    return Float32(llvm.inline_asm(
        T.f32(), [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
