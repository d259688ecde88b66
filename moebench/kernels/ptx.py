"""Device-side inline-PTX helper shared by the CuTe DSL kernels (quantize,
finalize). Needs nvidia-cutlass-dsl: import it only where the DSL is present."""

from __future__ import annotations

from cutlass import Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def asm_u32(text: str, constraints: str, *args, loc=None, ip=None) -> Uint32:
    """One pure (side-effect free) inline-PTX instruction group -> Uint32.
    `args` are DSL numerics of the types the constraints name (wrap them,
    e.g. Uint32(a), at the call site)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
