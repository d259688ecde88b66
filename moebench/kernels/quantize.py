"""The MXFP8 activation quantization kernel: bf16 x -> e4m3 bytes + E8M0 scales.

One launch quantizes x bf16 [rows, H] (1 <= rows <= 8, H % 128 == 0) into
x_q uint8 [rows, H] (e4m3 bytes) and x_scale uint8 [rows, H/32] (E8M0 codes),
bit-exact with `moebench.formats.quantize_mxfp8` (DESIGN.md, "Formats"):

    amax = max |x| over a 32-element block (exact: a bf16 value)
    s    = amax / 448                      fp32, IEEE round-to-nearest (div.rn.f32)
    code = biased_exponent(s) + (mantissa(s) != 0), clamped to [0, 254]
    elem = e4m3 RNE of x * 2^(127 - code)  fp32 multiply (mul.rn.f32, no flush),
           saturated at +-448              (cvt.rn.satfinite.e4m3x2.f32)
    amax == 0 (all +-0.0)  -> code 0, bytes 0x00 (also for -0.0: the
                              reference zeroes such a block)
    amax non-finite (a NaN or an Inf in the block; the reference's amax
    propagates NaN)         -> code 255, bytes 0x7F; other blocks unaffected.

Method: x and x_scale are contiguous, so block b of the flattened input sits
at bytes [64 b, 64 b + 64) of x, [32 b, 32 b + 32) of x_q and byte b of
x_scale, whatever the row. One thread per block: four 16-byte loads, the
amax as an integer max over the magnitude bits (|x| bits = bits & 0x7FFF
order like the values; NaN and Inf are the patterns >= 0x7F80, so the
integer max also detects a non-finite block, where a float max would drop a
NaN), one IEEE division, 32 fp32 multiplies by 2^(127 - code) built from
bits (code 254 -> the subnormal 2^-127), 16 paired conversions, two 16-byte
stores and one scale byte (the device function `quantize_block`, which the
fused front, `front.py`, and the route kernel's fused quantization, `route.py`,
share). The block count rows*H/32 is a runtime value:
one compiled kernel serves every shape; the grid is ceil(blocks / threads)
CTAs (rows 8, H 7168: 1792 blocks, 28 CTAs of 64 threads).

Programmatic dependent launch (`pdl=True`): the kernel lets its dependents
launch on entry (the kernels that follow may start their
prologue; they must griddepcontrol.wait before reading x_q / x_scale, which
waits for this grid to complete and flush) and waits on griddepcontrol
before its first global access (x comes from the previous kernel, and the
output buffers may still be read by an earlier kernel).
"""

from __future__ import annotations

import functools

import torch

from moebench.kernels.host import (
    HAVE_DSL, check_bool, check_tensor, check_threads, cu_stream, gmem_ptr, require_dsl,
)  # fmt: skip
from moebench.models import MX_BLOCK

#: Most token rows the kernel takes, and the granularity of H.
MAX_ROWS = 8
H_MULTIPLE = 128
#: Default CTA size (threads = 32-element blocks per CTA).
DEFAULT_THREADS = 64
#: Constants of the rule.
_E4M3_MAX_BITS = 0x43E00000  # 448.0f
_ONE_NAN_WORD = 0x7F7F7F7F  # four e4m3 NaN bytes
_E8M0_NAN = 255

if HAVE_DSL:  # the kernel class needs the DSL's decorators at definition time
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Uint8, Uint32
    from cutlass.cutlass_dsl import dsl_user_op

    from moebench.kernels import fp4
    from moebench.kernels.ptx import asm_u32 as _asm
    from moebench.kernels.ptx import ld_global_u32x4 as _ld_v4
    from moebench.kernels.ptx import st_global_u32x4 as _st_v4

    @dsl_user_op
    def _max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
        """Per-halfword unsigned max (sm_90: VIMNMX.U16x2)."""
        return _asm("max.u16x2 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b), loc=loc, ip=ip)

    @dsl_user_op
    def _div_rn_448(a: Uint32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of a / 448 (a: fp32 bits), IEEE round-to-nearest, subnormals kept."""
        return _asm(f"div.rn.f32 $0, $1, 0f{_E4M3_MAX_BITS:08X};", "=r,r", Uint32(a), loc=loc, ip=ip)

    @dsl_user_op
    def _mul_rn(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
        """fp32 bits of a * b (fp32 bits in), round-to-nearest, no flush to zero."""
        return _asm("mul.rn.f32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b), loc=loc, ip=ip)

    @dsl_user_op
    def _cvt_e4m3x4(f0: Uint32, f1: Uint32, f2: Uint32, f3: Uint32, *, loc=None, ip=None) -> Uint32:
        """Four fp32 values (bits) -> e4m3 bytes (RNE, saturated at +-448), f0 in byte 0."""
        return _asm(
            "{ .reg .b16 lo, hi;\n"
            " cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"  # first source -> upper byte
            " cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            " mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            Uint32(f0),
            Uint32(f1),
            Uint32(f2),
            Uint32(f3),
            loc=loc,
            ip=ip,
        )

    @cute.jit
    def quantize_words(w):
        """The rule (module docstring) on one 32-element block in registers:
        `w`, its 16 words of bf16 pairs (element 2i in the low half of w[i])
        -> (8 words of e4m3 bytes in element order, the E8M0 code as
        Uint32). Device code of `quantize_block`; the route kernel calls
        it between `load_block` and `store_block` when it quantizes before
        its griddepcontrol.wait."""
        # amax bits (bf16 magnitude): integer max over both halves of every word
        m = w[0] & Uint32(0x7FFF7FFF)
        for i in cutlass.range_constexpr(1, 16):
            m = _max_u16x2(m, w[i] & Uint32(0x7FFF7FFF))
        amax = cutlass.max(m & Uint32(0xFFFF), m >> Uint32(16))
        finite = amax < Uint32(0x7F80)
        # code = biased exponent of s = amax/448 (+1 if its mantissa is non-zero)
        s = _div_rn_448(amax << Uint32(16))
        code = (s >> Uint32(23)) + Uint32((s & Uint32(0x7FFFFF)) != Uint32(0))
        code = cutlass.min(code, Uint32(254))
        # 2^(127 - code) from bits: exponent field 254 - code; 0 -> 2^-127 (subnormal)
        e = Uint32(254) - code
        mult = Uint32(fp4.F32_2_M127) if e == Uint32(0) else e << Uint32(23)
        out = []
        for i in cutlass.range_constexpr(8):
            a, c = w[2 * i], w[2 * i + 1]
            q = _cvt_e4m3x4(
                _mul_rn(a << Uint32(16), mult),
                _mul_rn(a & Uint32(0xFFFF0000), mult),
                _mul_rn(c << Uint32(16), mult),
                _mul_rn(c & Uint32(0xFFFF0000), mult),
            )
            if amax == Uint32(0):  # all +-0.0: zero bytes (no -0 0x80)
                q = Uint32(0)
            if not finite:
                q = Uint32(_ONE_NAN_WORD)
            out.append(q)
        if not finite:
            code = Uint32(_E8M0_NAN)
        return out, code

    @cute.jit
    def quantize_block(
        px: cute.Pointer,
        pq: cute.Pointer,
        x_scale: cute.Pointer,
        b: Int32,
        pd: cute.Pointer,
        deq: cutlass.Constexpr[bool],
    ):
        """Quantize 32-element block `b` of the flattened input (device code,
        shared by QuantizeKernel, the fused front and the route kernel): px / pq are Uint32
        views of x (16 words a block) and x_q (8 words a block), x_scale the
        Uint8 scale pointer. Four 16-byte loads, two 16-byte stores and one
        scale byte; the rule and its method are in the module docstring.
        With `deq`, also the BF16 value the GEMMs decode from these bytes
        (`fp4.e4m3x4_to_bf16x2`, then x m1 x m2 of `fp4.act_multipliers`,
        exactly as their MXFP8 operand path does) into pd, a Uint32 view of
        x_deq (16 words a block): four more 16-byte stores."""
        out, code = quantize_words(load_block(px, b))
        store_block(pq, x_scale, b, out, code, pd, deq)

    @cute.jit
    def load_block(px: cute.Pointer, b: Int32):
        """The 16 words (bf16 pairs) of 32-element block `b` of x (px: a
        Uint32 view): four 16-byte loads."""
        w = []
        for j in cutlass.range_constexpr(4):
            w.extend(_ld_v4(px + (b * 16 + j * 4)))
        return w

    @cute.jit
    def store_block(
        pq: cute.Pointer, x_scale: cute.Pointer, b: Int32, out, code, pd: cute.Pointer, deq: cutlass.Constexpr[bool]
    ):
        """Block `b`'s bytes and scale (from `quantize_words`) to x_q / x_scale
        (and with `deq` its BF16 value to x_deq), as `quantize_block` writes them."""
        _st_v4(pq + b * 8, out[0], out[1], out[2], out[3])
        _st_v4(pq + (b * 8 + 4), out[4], out[5], out[6], out[7])
        cute.arch.store(x_scale + b, Uint8(code))
        if cutlass.const_expr(deq):
            m1, m2 = fp4.act_multipliers(code)
            d = []
            for i in cutlass.range_constexpr(8):
                lo, hi = fp4.e4m3x4_to_bf16x2(out[i])
                d.append(fp4.mul_bf16x2(fp4.mul_bf16x2(lo, m1), m2))
                d.append(fp4.mul_bf16x2(fp4.mul_bf16x2(hi, m1), m2))
            for j in cutlass.range_constexpr(4):
                _st_v4(pd + (b * 16 + 4 * j), d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3])

    class QuantizeKernel:
        """MXFP8 quantization of bf16 rows, one thread per 32-element block
        (CuTe DSL, sm_90a).

        Static configuration: `pdl` (bool, launch with programmatic dependent
        launch: trigger dependents on entry, griddepcontrol.wait before the
        first global access), `threads` (CTA size = blocks per CTA, a
        multiple of 32 in [32, 1024]) and `deq` (bool: also write x_deq, the
        BF16 operand of act_bf16 GEMM tactics). Runtime: x (bf16), x_q and
        x_scale (uint8), x_deq (bf16; unused without `deq`) global pointers,
        16-byte aligned, and the number of 32-element blocks rows*H/32 (Int32).
        """

        def __init__(self, pdl: bool = True, threads: int = DEFAULT_THREADS, deq: bool = False):
            check_bool("pdl", pdl)
            check_bool("deq", deq)
            check_threads(threads)
            self.pdl = pdl
            self.threads = threads
            self.deq = deq

        @cute.jit
        def __call__(
            self,
            x: cute.Pointer,
            x_q: cute.Pointer,
            x_scale: cute.Pointer,
            x_deq: cute.Pointer,
            blocks: Int32,
            stream: _cuda.CUstream,
        ):
            """Launch ceil(blocks / threads) CTAs of `threads` threads on `stream`."""
            ctas = (blocks + (self.threads - 1)) // self.threads
            self.kernel(x, x_q, x_scale, x_deq, blocks).launch(
                grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl
            )

        @cute.kernel
        def kernel(self, x: cute.Pointer, x_q: cute.Pointer, x_scale: cute.Pointer, x_deq: cute.Pointer, blocks: Int32):
            tid = cute.arch.thread_idx()[0]
            cta = cute.arch.block_idx()[0]
            b = cta * self.threads + tid
            px = cute.recast_ptr(x, dtype=Uint32)  # 16 words (32 bf16) per block
            pq = cute.recast_ptr(x_q, dtype=Uint32)  # 8 words (32 e4m3) per block

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()

            if b < blocks:
                quantize_block(px, pq, x_scale, b, cute.recast_ptr(x_deq, dtype=Uint32), self.deq)


_KERNEL = "the quantize kernel"


def compile_quantize_kernel(pdl: bool = True, threads: int = DEFAULT_THREADS, deq: bool = False):
    """Compile the MXFP8 quantization kernel once per process, PDL setting
    and CTA size (cached; see QuantizeKernel).

    Without a GPU set CUTE_DSL_ARCH=sm_90a to cross-compile for the H200.
    Returns the compiled function, called as
    `f(x_ptr, x_q_ptr, x_scale_ptr, x_deq_ptr, blocks, stream)` with 16-byte
    aligned global pointers (bf16 / uint8 / uint8 / bf16, cutlass.cute.runtime.make_ptr;
    x_deq is written only when `deq`),
    blocks = rows*H/32 (Int32) and a cuda.bindings CUstream;
    `launch_quantize_mxfp8` does this for torch tensors. Raises RuntimeError
    without nvidia-cutlass-dsl, TypeError for a non-bool `pdl`, ValueError
    for a bad `threads`."""
    check_bool("pdl", pdl)
    check_bool("deq", deq)
    check_threads(threads)
    return _compile(pdl, threads, deq)


@functools.lru_cache(maxsize=None)
def _compile(pdl: bool, threads: int, deq: bool = False):
    require_dsl(_KERNEL)

    def fake(dtype):
        return gmem_ptr(dtype, 16, 16)

    return cute.compile(
        QuantizeKernel(pdl=pdl, threads=threads, deq=deq),
        fake(BFloat16),
        fake(Uint8),
        fake(Uint8),
        fake(BFloat16),
        Int32(MX_BLOCK),
        _cuda.CUstream(0),
    )


def _check_x(x) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, H], got shape {tuple(x.shape)}")
    rows, h = x.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x: rows must be in [1, {MAX_ROWS}], got {rows} (shape {tuple(x.shape)})")
    if h <= 0 or h % H_MULTIPLE:
        raise ValueError(f"x: H must be a positive multiple of {H_MULTIPLE}, got {h}")
    check_tensor("x", x, torch.bfloat16, (rows, h), align=16)
    return rows, h


def check_quantize_args(
    x: torch.Tensor, x_q_out: torch.Tensor, x_scale_out: torch.Tensor, x_deq_out: torch.Tensor | None
) -> tuple[int, int]:
    """Check a quantization's tensors as `launch_quantize_mxfp8` documents
    them (also for the route kernel's fused quantization), all but x being
    on a CUDA device (the caller checks that last); returns (rows, H).
    Raises TypeError / ValueError naming the argument."""
    rows, h = _check_x(x)
    device = x.device
    check_tensor("x_q_out", x_q_out, (torch.uint8, torch.float8_e4m3fn), (rows, h), device, device_of="x", align=16)
    check_tensor("x_scale_out", x_scale_out, torch.uint8, (rows, h // MX_BLOCK), device, device_of="x", align=16)
    if x_deq_out is not None:
        check_tensor("x_deq_out", x_deq_out, torch.bfloat16, (rows, h), device, device_of="x", align=16)
    return rows, h


def launch_quantize_mxfp8(
    x: torch.Tensor,
    x_q_out: torch.Tensor,
    x_scale_out: torch.Tensor,
    *,
    stream=None,
    pdl: bool = True,
    threads: int = DEFAULT_THREADS,
    x_deq_out: torch.Tensor | None = None,
) -> None:
    """Launch the MXFP8 quantization kernel: write the e4m3 bytes and E8M0
    scales of `x` into the given buffers, on `stream` (torch's current stream
    when None). No host sync, no allocation: CUDA-graph capturable (call it
    once before capture: the first call loads the kernel). The bytes equal
    `moebench.formats.quantize_mxfp8(x)` bit for bit.

    x: bfloat16 [rows, H], contiguous, CUDA, 16-byte aligned; 1 <= rows <= 8,
      H a positive multiple of 128.
    x_q_out: uint8 (or float8_e4m3fn) [rows, H], contiguous, 16-byte aligned,
      on x's device; every byte is written.
    x_scale_out: uint8 [rows, H/32], contiguous, 16-byte aligned, on x's
      device; every byte is written.
    stream: None, a torch.cuda.Stream or a cuda.bindings CUstream.
    pdl: launch with programmatic dependent launch (see the module docstring).
    threads: CTA size, a multiple of 32 in [32, 1024] (a tactic; every value
      gives the same bits).
    x_deq_out: None, or bfloat16 [rows, H] (contiguous, 16-byte aligned, on
      x's device) for the BF16 operand of act_bf16 GEMM tactics: the very bits
      `gemm.act_to_bf16(x_q, x_scale)` gives, written in the same launch.

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape,
    range, layout, alignment or device (each naming the argument),
    RuntimeError without nvidia-cutlass-dsl.
    """
    rows, h = check_quantize_args(x, x_q_out, x_scale_out, x_deq_out)
    device = x.device
    check_bool("pdl", pdl)
    check_threads(threads)
    if device.type != "cuda":
        raise ValueError(f"x, x_q_out and x_scale_out must be CUDA tensors, got {device}")
    require_dsl(_KERNEL)
    deq = x_deq_out is not None
    compiled = compile_quantize_kernel(pdl, threads, deq)
    compiled(
        gmem_ptr(BFloat16, x, 16),
        gmem_ptr(Uint8, x_q_out, 16),
        gmem_ptr(Uint8, x_scale_out, 16),
        gmem_ptr(BFloat16, x_deq_out if deq else x, 16),
        Int32(rows * h // MX_BLOCK),
        cu_stream(stream, device),
    )


def quantize_mxfp8(x: torch.Tensor, *, stream=None, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs on x's device and launch the kernel (see
    `launch_quantize_mxfp8`). x: bfloat16 [rows, H] CUDA (copied if it is
    not contiguous or not 16-byte aligned; 1 <= rows <= 8, H % 128 == 0). Returns (x_q uint8 [rows, H]
    e4m3 bytes, x_scale uint8 [rows, H/32] E8M0 codes), equal bit for bit to
    `moebench.formats.quantize_mxfp8(x)` (viewed as uint8) once the stream
    has run the kernel. Raises as `launch_quantize_mxfp8`."""
    if isinstance(x, torch.Tensor) and (not x.is_contiguous() or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)  # fresh allocations are aligned
    _check_x(x)
    rows, h = x.shape
    x_q = torch.empty(rows, h, dtype=torch.uint8, device=x.device)
    x_scale = torch.empty(rows, h // MX_BLOCK, dtype=torch.uint8, device=x.device)
    launch_quantize_mxfp8(x, x_q, x_scale, stream=stream, pdl=pdl)
    return x_q, x_scale
