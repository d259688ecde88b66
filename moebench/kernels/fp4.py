"""Device helpers of the GEMMs (CuTe DSL, sm_90a): streaming loads, MX decode
to BF16 in registers, and the MXFP8 quantization of H.

All decodes are exact (bit operations and multiplies by powers of two):
  * e2m1 word -> four bf16x2 A registers, value x 2^-126 (`decode_e2m1_word`,
    bit layout in `layout.py`), then x 2^(s-1) per row (E8M0 s) gives
    e2m1 * 2^(s-127). A bf16 2^(s-1) exists for s <= 128; larger codes take
    a second multiply (`wide=True`).
  * four e4m3 bytes -> two bf16x2 B registers, value x 2^-120
    (`e4m3x4_to_bf16x2`), then x 2^(min(s,134)-7) x 2^(max(s,134)-134): both
    multipliers are normal bf16 for every code (255 gives NaN, as E8M0 does).
  * fp8 tactics: e2m1 word (e4m3 layout) -> two e4m3x4 A registers, value
    x 2^-6 (`decode_e2m1_word_e4m3`); the scales become fp32 factors of the
    fp32 MMA result (`weight_scale_f32`, `act_scale_f32`: 2^(s-127) and
    2^(s-121), the latter undoing the 2^-6).
Requires nvidia-cutlass-dsl; import only where it is installed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T, dsl_user_op

from moebench.kernels.layout import E4M3_IN_PLACE, E4M3_LEFT, E4M3_RIGHT, decode_terms


#: fp32 bits of 2^-127 (E8M0 code 0, a subnormal).
F32_2_M127 = 0x00400000


def _asm(ret, args, text: str, constraints: str):
    return llvm.inline_asm(
        ret, args, text, constraints, has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT
    )


@dsl_user_op
def load_u32x4(ptr, priority: str, *, loc=None, ip=None):
    """One 16-byte global load (LDG.E.128 with the L1 `priority`) -> 4 x Uint32."""
    vec = cute.arch.load(
        ptr, ir.VectorType.get([4], Uint32.mlir_type), level1_eviction_priority=priority, loc=loc, ip=ip
    )
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def load_u32x4_shared(ptr, *, loc=None, ip=None):
    """One 16-byte shared-memory load (LDS.128) -> 4 x Uint32."""
    vec = cute.arch.load(ptr, ir.VectorType.get([4], Uint32.mlir_type), loc=loc, ip=ip)
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def load_u32x2_shared(ptr, *, loc=None, ip=None):
    """One 8-byte shared-memory load (LDS.64) -> 2 x Uint32."""
    vec = cute.arch.load(ptr, ir.VectorType.get([2], Uint32.mlir_type), loc=loc, ip=ip)
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def load_u8_shared(ptr, *, loc=None, ip=None) -> Uint32:
    """One shared-memory byte (ld.shared.u8 into a 32-bit register: LDS.U8)
    -> Uint32 0..255, zero-extended by the load itself (a DSL Uint8 load
    widened afterwards costs a mask per use in SASS). Volatile: never moved
    above the barrier wait that makes the byte valid."""
    addr = llvm.ptrtoint(T.i32(), ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Uint32(
        llvm.inline_asm(
            T.i32(), [addr], "ld.shared.u8 $0, [$1];", "=r,r,~{memory}",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


@dsl_user_op
def load_u32x2(ptr, priority: str, *, loc=None, ip=None):
    """One 8-byte global load (LDG.E.64) -> 2 x Uint32."""
    vec = cute.arch.load(
        ptr, ir.VectorType.get([2], Uint32.mlir_type), level1_eviction_priority=priority, loc=loc, ip=ip
    )
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def prmt(a: Uint32, sel: int, *, loc=None, ip=None) -> Uint32:
    """prmt.b32 d, a, 0, sel (byte permute with zero bytes), free of side effects."""
    return Uint32(_asm(T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip)], f"prmt.b32 $0, $1, 0, {sel:#x};", "=r,r"))


@dsl_user_op
def mul_bf16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Packed bf16x2 multiply, round to nearest (exact for our powers of two)."""
    return Uint32(
        _asm(
            T.i32(),
            [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
            "mul.rn.bf16x2 $0, $1, $2;",
            "=r,r,r",
        )
    )


@dsl_user_op
def pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> bf16x2 (round to nearest even); `lo` in bits 15:0."""
    return Uint32(
        _asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """IEEE fp32 division, round to nearest (div.rn.f32)."""
    return Float32(
        _asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            "div.rn.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


@dsl_user_op
def to_e4m3(a: Float32, *, loc=None, ip=None) -> Uint32:
    """fp32 -> e4m3 byte (low 8 bits), round to nearest even, saturating at
    +-448; NaN -> 0x7F."""
    return Uint32(
        _asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip)],
            "{ .reg .b16 t; .reg .f32 z; mov.f32 z, 0f00000000;\n"
            " cvt.rn.satfinite.e4m3x2.f32 t, z, $1; cvt.u32.u16 $0, t; }",
            "=r,f",
        )
    )


@cute.jit
def decode_e2m1_word(q: Uint32):
    """A word of eight e2m1 codes -> A registers R0..R3 (bf16x2), values x 2^-126."""
    out = []
    for i in cutlass.range_constexpr(4):
        r = None
        for d, mask in decode_terms(i):
            v = q if d == 0 else (q << Uint32(d)) | (q >> Uint32(32 - d))
            r = (v & Uint32(mask)) if r is None else r | (v & Uint32(mask))
        out.append(r)
    return out[0], out[1], out[2], out[3]


@cute.jit
def decode_e2m1_word_e4m3(q: Uint32):
    """A word of eight e2m1 codes (e4m3 operand layout, `layout.py`) -> the
    e4m3x4 A registers (row g, row g+8), values x 2^-6, exact: row g's codes
    are in place, row g+8's move by << 2 / >> 2 (5 integer instructions)."""
    ra = q & Uint32(E4M3_IN_PLACE)
    x = q & Uint32(~E4M3_IN_PLACE & 0xFFFFFFFF)
    rb = ((x << Uint32(2)) & Uint32(E4M3_LEFT)) | ((x >> Uint32(2)) & Uint32(E4M3_RIGHT))
    return ra, rb


@cute.jit
def weight_scale_f32(word: Uint32, byte: cutlass.Constexpr[int], special: cutlass.Constexpr[bool]):
    """fp32 2^(s-127) of E8M0 byte `byte` of `word` (exponent field s: exact
    for s in [1, 254]; two instructions). `special`: also s = 0 (2^-127, a
    subnormal) and s = 255 (NaN), at two more selects each."""
    if cutlass.const_expr(byte == 3):
        bits = (word >> Uint32(1)) & Uint32(0x7F800000)
    else:
        bits = (word << Uint32(23 - 8 * byte)) & Uint32(0x7F800000)
    if cutlass.const_expr(special):
        bits = Uint32(cutlass.select_(bits == Uint32(0), Uint32(F32_2_M127), bits))
        bits = Uint32(cutlass.select_(bits == Uint32(0x7F800000), Uint32(0x7FC00000), bits))
    return bits_f32(bits)


@cute.jit
def weight_scale_f32_code(s: Uint32, special: cutlass.Constexpr[bool]):
    """`weight_scale_f32` of an E8M0 code s already alone in its register
    (0..255, as a byte load leaves it): one shift; the same bits for every code."""
    bits = s << Uint32(23)
    if cutlass.const_expr(special):
        bits = Uint32(cutlass.select_(bits == Uint32(0), Uint32(F32_2_M127), bits))
        bits = Uint32(cutlass.select_(bits == Uint32(0x7F800000), Uint32(0x7FC00000), bits))
    return bits_f32(bits)


@cute.jit
def act_scale_f32(s: Uint32):
    """fp32 2^(s-121) of an activation E8M0 code s (the 2^6 that undoes the
    weights' e4m3 placement folded in): exact for s <= 248, +Inf for s >= 249
    (two instructions). No quantizer of ours writes 249..254 (a finite fp32
    amax gives <= 247); 255 (NaN) comes with NaN e4m3 bytes (0x7F), so the
    MMA result, and the output, is NaN; a code 255 over finite bytes gives
    +-Inf, or NaN where the block's dot product is 0."""
    return bits_f32((cutlass.min(s, Uint32(249)) + Uint32(6)) << Uint32(23))


@cute.jit
def e4m3x4_to_bf16x2(q: Uint32):
    """Four e4m3 bytes (k0..k0+3, k0 in the low byte) -> (bf16x2 of k0,k0+1;
    bf16x2 of k0+2,k0+3), values x 2^-120 (e4m3 subnormals land on bf16
    subnormals; the NaN byte decodes to a finite value: its E8M0 scale is 255)."""
    lo = prmt(q, 0x1404)  # bytes k0, k0+1 to bits 15:8, 31:24
    hi = prmt(q, 0x3424)  # bytes k0+2, k0+3
    sign = Uint32(0x80008000)
    body = Uint32(0x07F007F0)
    return ((lo & sign) | ((lo >> Uint32(4)) & body)), ((hi & sign) | ((hi >> Uint32(4)) & body))


@cute.jit
def act_multipliers(s: Uint32):
    """E8M0 activation scale byte s -> bf16x2 multipliers (m1, m2) with
    m1 * m2 = 2^(s-7) (undoes the 2^-120 placement); NaN for s = 255."""
    lo = cutlass.min(s, Uint32(134))
    hi = cutlass.max(s, Uint32(134))
    m1 = (lo + Uint32(120)) << Uint32(7)  # 2^(lo - 7): exponent field lo + 120
    m2 = (hi - Uint32(7)) << Uint32(7)  # 2^(hi - 134): exponent field hi - 7
    m2 = Uint32(cutlass.select_(s == Uint32(255), Uint32(0x7FC0), m2))
    return m1 | (m1 << Uint32(16)), m2 | (m2 << Uint32(16))


@cute.jit
def weight_multiplier(word: Uint32, byte: cutlass.Constexpr[int]):
    """bf16x2 2^(s-1) (both halves) of E8M0 byte `byte` of `word`, for s <= 128."""
    return (prmt(word, 0x4040 | (byte << 8) | byte) << Uint32(7)) + Uint32(0x3F003F00)


@cute.jit
def weight_multipliers_wide(word: Uint32, byte: cutlass.Constexpr[int]):
    """(m1, m2) bf16x2 with m1 * m2 = 2^(s-1) for any E8M0 s in [0, 254]."""
    s = (word >> Uint32(8 * byte)) & Uint32(0xFF)
    lo = cutlass.min(s, Uint32(128))
    hi = cutlass.max(s, Uint32(128))
    m1 = (lo + Uint32(126)) << Uint32(7)  # 2^(lo - 1)
    m2 = (hi - Uint32(1)) << Uint32(7)  # 2^(hi - 128)
    return m1 | (m1 << Uint32(16)), m2 | (m2 << Uint32(16))


@dsl_user_op
def f32_bits(a: Float32, *, loc=None, ip=None) -> Uint32:
    """Bits of an fp32 value."""
    return Uint32(_asm(T.i32(), [Float32(a).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f"))


@dsl_user_op
def bits_f32(a: Uint32, *, loc=None, ip=None) -> Float32:
    """fp32 value of 32 bits."""
    return Float32(_asm(T.f32(), [Uint32(a).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r"))


@cute.jit
def not_finite(a: Float32):
    """Whether `a` is an Inf or NaN (exponent bits all ones)."""
    return (f32_bits(a) & Uint32(0x7F800000)) == Uint32(0x7F800000)


# ---------------------------------------------------------------------- split-K
@dsl_user_op
def arrive_inc(ptr, bound: int, *, loc=None, ip=None) -> Uint32:
    """`atom.acq_rel.gpu.global.inc.u32` on the int32 counter at `ptr` (a gmem
    pointer) with wrap value `bound`: stores (old >= bound ? 0 : old + 1) and
    returns old. With bound = n - 1, the n-th arrival sees old = n - 1 and
    leaves the counter at 0 (self-cleaning). acq_rel at GPU scope: the
    caller's earlier writes (fenced) are visible to whoever sees a later old
    value, and the caller sees the writes of earlier arrivals."""
    addr = Int64(ptr.toint(loc=loc, ip=ip))
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [addr.ir_value(loc=loc, ip=ip), Uint32(bound).ir_value(loc=loc, ip=ip)],
            "atom.acq_rel.gpu.global.inc.u32 $0, [$1], $2;",
            "=r,l,r,~{memory}",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def load_u32x4_coherent(ptr, *, loc=None, ip=None):
    """One 16-byte global load of data another CTA of this grid wrote
    (ld.relaxed.gpu: coherent at GPU scope, never a stale L1 line) -> 4 x Uint32."""
    vec = cute.arch.load(ptr, ir.VectorType.get([4], Uint32.mlir_type), sem="relaxed", scope="gpu", loc=loc, ip=ip)
    return [Uint32(vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def red_add_release(ptr, value: int, *, loc=None, ip=None) -> None:
    """`red.release.gpu.global.add.s32` of `value` to the int32 counter at
    `ptr` (a gmem pointer): the caller's earlier (fenced) writes are visible
    to whoever acquires a later value of the counter."""
    addr = Int64(ptr.toint(loc=loc, ip=ip))
    llvm.inline_asm(
        None,
        [addr.ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def load_partial(ptr) -> Float32:
    """fp32 load of a split-K partial written by another CTA: ld.relaxed.gpu
    (coherent at GPU scope, never a stale L1 line)."""
    return cute.arch.load(ptr, Float32, sem="relaxed", scope="gpu")


# ---------------------------------------------------------------------- two-plane GEMM1
@cute.jit
def byte_max_7f(a: Uint32, b: Uint32) -> Uint32:
    """Byte-wise max of two words whose bytes are all <= 0x7F (4 integer
    instructions): 0x80 + a_i - b_i never borrows across bytes, its top bit
    says a_i >= b_i, and PRMT's sign-replicate selector spreads it to a byte mask."""
    m = prmt((a | Uint32(0x80808080)) - b, 0xBA98)
    return (a & m) | (b & ~m)


@cute.jit
def split_planes(words, shift: cutlass.Constexpr[int]):
    """The 8 words (32 e4m3 bytes) of one token's 32-K block -> (hi, lo), 8
    words each, hi + lo = words byte for byte: hi keeps the bytes whose
    magnitude (byte & 0x7F, monotone in |value|) is >= the block's largest
    - 8 x `shift` (|x| >= block max x 2^-shift: 8 codes per binade in the
    normal range, where an MXFP8 block's largest element always lies), lo
    the others, zeros elsewhere. A NaN byte (0x7F) is the largest: hi."""
    mags = []
    for i in cutlass.range_constexpr(8):
        mags.append(words[i] & Uint32(0x7F7F7F7F))
    m = mags[0]
    for i in cutlass.range_constexpr(1, 8):
        m = byte_max_7f(m, mags[i])
    m = byte_max_7f(m, m >> Uint32(16))
    m = byte_max_7f(m, m >> Uint32(8)) & Uint32(0xFF)
    # byte >= T  <=>  byte + (128 - T) has its top bit (T = max(m - 8 shift, 0), so no carry out)
    bias = (Uint32(128 + 8 * shift) - cutlass.max(m, Uint32(8 * shift))) * Uint32(0x01010101)
    hi, lo = [], []
    for i in cutlass.range_constexpr(8):
        h = words[i] & prmt(mags[i] + bias, 0xBA98)
        hi.append(h)
        lo.append(words[i] ^ h)
    return hi, lo
