"""The MXFP8 quantization kernel (moebench/kernels/quantize.py): sm_90a
compile checks, host validation and a CPU model of the kernel's method; on
the GPU, bit-exactness against moebench.formats.quantize_mxfp8 (inputs with
zero, -0.0, subnormal, huge, NaN, Inf and RNE-tie blocks), guards, PDL off,
streams, and CUDA-graph replay."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_checks import (
    assert_guards_intact,
    assert_pdl_order,
    assert_sass_without_spills,
    compile_sm90a,
    graph_launch_times,
    guarded,
    misaligned,
    sass_instructions,
)

from moebench import formats
from moebench.kernels.quantize import launch_quantize_mxfp8, quantize_mxfp8

POISON = 0xA5
GUARD = 16  # poisoned guard bytes on each side of every output (keeps 16-byte alignment)
HIDDEN = (4096, 5120, 7168)

# --------------------------------------------------------------------------- CPU: compile


def _compile_sass(pdl: bool, threads: int = 64, deq: bool = False) -> tuple[str, str]:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Uint8
    from cutlass.cute.runtime import make_ptr

    from moebench.kernels.quantize import QuantizeKernel

    def fake(dtype):
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=16)

    return compile_sm90a(
        QuantizeKernel(pdl=pdl, threads=threads, deq=deq),
        fake(BFloat16),
        fake(Uint8),
        fake(Uint8),
        fake(BFloat16),
        Int32(32),
        cuda.CUstream(0),
        ptx=True,
    )


@pytest.mark.compile
@pytest.mark.parametrize(
    "pdl, threads, deq",
    [(True, 64, False), (False, 64, False), (True, 32, False), (True, 1024, False), (True, 64, True)],
)
def test_compiles_for_sm90a_without_spills(pdl, threads, deq):
    sass, ptx = _compile_sass(pdl, threads, deq)
    instr = sass_instructions(sass)
    text = assert_sass_without_spills(instr, "quantize")
    # 16-byte loads and stores (+ four for x_deq), one scale byte, hardware e4m3 conversions
    assert len(re.findall(r"\bLDG\.E\.128\b", text)) == 4
    assert len(re.findall(r"\bSTG\.E\.128\b", text)) == (6 if deq else 2)
    assert len(re.findall(r"\bSTG\.E\.U8\b", text)) == 1
    assert not re.search(r"\bLDG\.E(\.U16|\.U8|\.64)?\s", text), "narrow global loads"
    assert len(re.findall(r"F2FP\.SATFINITE\.E4M3\.F32", text)) == 16
    # IEEE division and multiplies: no flush-to-zero, no approximate reciprocal on the main path
    assert "div.rn.f32" in ptx and "mul.rn.f32" in ptx
    assert not re.search(r"\b(div|mul)\.(rn\.)?ftz\.f32|div\.approx", ptx)
    assert not re.search(r"\bFMUL\.FTZ\b", text)
    assert "BAR.SYNC" not in text
    assert_pdl_order(instr, pdl)


@pytest.mark.compile
def test_compile_quantize_kernel_is_cached_and_validates():
    from moebench.kernels.quantize import QuantizeKernel, compile_quantize_kernel

    assert compile_quantize_kernel(True) is compile_quantize_kernel(True)
    assert compile_quantize_kernel() is compile_quantize_kernel(True)
    assert compile_quantize_kernel(False) is not compile_quantize_kernel(True)
    with pytest.raises(TypeError, match="pdl"):
        compile_quantize_kernel(1)
    for bad in (0, 16, 48, 2048, True, 64.0):
        with pytest.raises(ValueError, match="threads"):
            compile_quantize_kernel(True, bad)
        with pytest.raises(ValueError, match="threads"):
            QuantizeKernel(threads=bad)
    with pytest.raises(TypeError, match="pdl"):
        QuantizeKernel(pdl="yes")


# --------------------------------------------------------------------------- CPU: validation


def _args(rows=4, h=4096):
    return dict(
        x=torch.zeros(rows, h, dtype=torch.bfloat16),
        x_q_out=torch.empty(rows, h, dtype=torch.uint8),
        x_scale_out=torch.empty(rows, h // 32, dtype=torch.uint8),
    )


@pytest.mark.parametrize(
    "mutate, exc, name",
    [
        (lambda a: a.update(x=[[0.0]]), TypeError, "x must be a torch.Tensor"),
        (lambda a: a.update(x=a["x"].float()), TypeError, "x must be bfloat16"),
        (lambda a: a.update(x=a["x"].half()), TypeError, "x must be bfloat16"),
        (lambda a: a.update(x=a["x"][None]), ValueError, "x must be 2-D"),
        (lambda a: a.update(x=a["x"][0]), ValueError, "x must be 2-D"),
        (lambda a: a.update(x=torch.zeros(0, 4096, dtype=torch.bfloat16)), ValueError, "rows"),
        (lambda a: a.update(x=torch.zeros(9, 4096, dtype=torch.bfloat16)), ValueError, "rows"),
        (lambda a: a.update(x=torch.zeros(4, 4000, dtype=torch.bfloat16)), ValueError, "H"),
        (lambda a: a.update(x=torch.zeros(4, 96, dtype=torch.bfloat16)), ValueError, "H"),
        (lambda a: a.update(x=torch.zeros(4, 8192, dtype=torch.bfloat16)[:, ::2]), ValueError, "x must be contiguous"),
        (lambda a: a.update(x=misaligned((4, 4096), torch.bfloat16)), ValueError, "x must be 16-byte aligned"),
        (lambda a: a.update(x_q_out=None), TypeError, "x_q_out"),
        (lambda a: a.update(x_q_out=a["x_q_out"].to(torch.int8)), TypeError, "x_q_out"),
        (lambda a: a.update(x_q_out=a["x_q_out"].to(torch.bfloat16)), TypeError, "x_q_out"),
        (lambda a: a.update(x_q_out=a["x_q_out"][:3]), ValueError, "x_q_out"),
        (lambda a: a.update(x_q_out=a["x_q_out"].view(-1)), ValueError, "x_q_out"),
        (
            lambda a: a.update(x_q_out=torch.empty(4096, 4, dtype=torch.uint8).t()),
            ValueError,
            "x_q_out must be contiguous",
        ),
        (lambda a: a.update(x_q_out=misaligned((4, 4096), torch.uint8)), ValueError, "x_q_out must be 16-byte aligned"),
        (lambda a: a.update(x_scale_out=a["x_scale_out"].view(torch.int8)), TypeError, "x_scale_out"),
        (lambda a: a.update(x_scale_out=a["x_scale_out"].float()), TypeError, "x_scale_out"),
        (lambda a: a.update(x_scale_out=torch.empty(4, 4096 // 16, dtype=torch.uint8)), ValueError, "x_scale_out"),
        (
            lambda a: a.update(x_scale_out=misaligned((4, 128), torch.uint8)),
            ValueError,
            "x_scale_out must be 16-byte aligned",
        ),
        (lambda a: a.update(pdl=1), TypeError, "pdl"),
        (lambda a: a.update(threads=48), ValueError, "threads"),
        (lambda a: None, ValueError, "CUDA"),  # everything right, but on the CPU
    ],
)
def test_launch_quantize_validates(mutate, exc, name):
    args = _args()
    mutate(args)
    with pytest.raises(exc, match=name):
        launch_quantize_mxfp8(**args)


def test_launch_accepts_float8_output_dtype_before_device_check():
    args = _args(8, 7168)
    args["x_q_out"] = args["x_q_out"].view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="CUDA"):  # passes every check but the device
        launch_quantize_mxfp8(**args)


def test_quantize_validates():
    with pytest.raises(TypeError, match="x"):
        quantize_mxfp8(torch.zeros(2, 128))
    with pytest.raises(ValueError, match="rows"):
        quantize_mxfp8(torch.zeros(10, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        quantize_mxfp8(torch.zeros(2, 128, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- inputs


def _e4m3_values() -> torch.Tensor:
    """Finite non-negative e4m3 values, codes 0x00..0x7E (fp32)."""
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


SPECIAL_KINDS = (
    "zeros", "neg-zeros", "mixed-zeros", "subnormals", "one-subnormal", "neg-min-subnormal",
    "bf16-max", "max-and-small", "nan", "neg-nan", "snan", "inf", "neg-inf", "nan-and-inf",
    "ties", "ties-subnormal-e4m3", "ties-scaled", "power-of-two-amax", "near-448-boundary",
)  # fmt: skip


def _special_block(kind: str, gen: torch.Generator) -> torch.Tensor:
    """One bf16 [32] block of the named kind."""

    def randn(n=32):
        return torch.randn(n, generator=gen)

    def pos():
        return int(torch.randint(0, 32, (), generator=gen))

    def signs(n=32):
        return torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)

    def ties(k: int, subnormal: bool) -> torch.Tensor:
        # amax 448 * 2^k: s = 2^k exactly, code 127 + k, multiplier 2^-k; the other
        # elements sit exactly halfway between consecutive e4m3 values (times 2^k)
        v = _e4m3_values()
        lo = torch.randint(0, 8 if subnormal else 0x7E, (31,), generator=gen)
        mid = (v[lo] + v[lo + 1]) / 2
        out = torch.cat([torch.tensor([448.0]), mid * signs(31)]) * 2.0**k
        return out[torch.randperm(32, generator=gen)]

    if kind == "zeros":
        x = torch.zeros(32)
    elif kind == "neg-zeros":
        x = torch.full((32,), -0.0)
    elif kind == "mixed-zeros":
        x = 0.0 * signs()
    elif kind in ("subnormals", "one-subnormal", "neg-min-subnormal"):
        if kind == "subnormals":
            bits = torch.randint(1, 0x80, (32,), generator=gen)
            bits = bits | torch.where(torch.rand(32, generator=gen) < 0.5, 0x8000, 0)
        else:
            bits = torch.zeros(32, dtype=torch.int64)
            if kind == "neg-min-subnormal":
                bits[:] = 0x8000
            bits[pos()] = 0x8001 if kind == "neg-min-subnormal" else int(torch.randint(1, 0x80, (), generator=gen))
        return _bits_to_bf16(bits)
    elif kind == "bf16-max":
        x = torch.finfo(torch.bfloat16).max * signs()
    elif kind == "max-and-small":
        x = randn() * 1e-30
        x[pos()] = -torch.finfo(torch.bfloat16).max
    elif kind in ("nan", "neg-nan", "snan", "inf", "neg-inf", "nan-and-inf"):
        b = randn().bfloat16()
        bits = b.view(torch.int16).to(torch.int64) & 0xFFFF
        special = {
            "nan": [0x7FC0],
            "neg-nan": [0xFFC1],
            "snan": [0x7F81],
            "inf": [0x7F80],
            "neg-inf": [0xFF80],
            "nan-and-inf": [0x7FC0, 0xFF80],
        }[kind]
        for s in special:
            bits[pos()] = s
        return _bits_to_bf16(bits)
    elif kind == "ties":
        x = ties(0, False)
    elif kind == "ties-subnormal-e4m3":
        x = ties(int(torch.randint(-20, 20, (), generator=gen)), True)
    elif kind == "ties-scaled":
        x = ties(int(torch.randint(-120, 110, (), generator=gen)), False)
    elif kind == "power-of-two-amax":
        x = randn() * 2.0**-20
        x[pos()] = 2.0 ** int(torch.randint(-126, 127, (), generator=gen))
    elif kind == "near-448-boundary":
        # amax = 448 * 2^k * (1 +- a few bf16 ulps): s rounds around a power of two
        k = int(torch.randint(-100, 100, (), generator=gen))
        ulp = int(torch.randint(-3, 4, (), generator=gen))
        x = randn() * 2.0 ** (k + 4)
        x[pos()] = 448.0 * 2.0**k * (1 + ulp / 128)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return x.bfloat16()


def _make_input(rows: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [rows, H]: random blocks at scales 2^-140..2^115 (some subnormal),
    with every special kind at random block positions."""
    nb = rows * h // 32
    scale = torch.pow(2.0, torch.randint(-140, 116, (nb, 1), generator=gen).double()).float()
    x = (torch.randn(nb, 32, generator=gen) * scale).bfloat16()
    x = torch.where(x.isinf(), torch.zeros_like(x), x)  # keep the random blocks finite
    kinds = list(SPECIAL_KINDS) * 2
    where = torch.randperm(nb, generator=gen)[: len(kinds)]
    for kind, b in zip(kinds, where.tolist(), strict=False):
        x[b] = _special_block(kind, gen)
    return x.view(rows, h)


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = formats.quantize_mxfp8(x.cpu())
    return q.view(torch.uint8), s


def _kernel_method_model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch (CPU): integer amax over magnitude bits,
    non-finite detection from those bits, IEEE division, code from bits,
    multiplier from bits, e4m3 RNE with saturation."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    blocks = bits.view(-1, 32)
    amax_bits = (blocks & 0x7FFF).amax(-1)
    finite = amax_bits < 0x7F80
    s = ((amax_bits << 16).view(torch.float32) / torch.tensor(448.0)).view(torch.int32)
    code = ((s >> 23) + ((s & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=254)
    e = 254 - code
    mult = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23).view(torch.float32)
    vals = (blocks << 16).view(torch.float32) * mult[:, None]
    q = vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where((amax_bits == 0)[:, None], torch.zeros_like(q), q)
    q = torch.where(finite[:, None], q, torch.full_like(q, 0x7F))
    code = torch.where(finite, code, torch.full_like(code, 255))
    return q.view(x.shape), code.to(torch.uint8).view(x.shape[0], -1)


def test_special_blocks_and_kernel_method_model_match_the_reference():
    gen = torch.Generator().manual_seed(5)
    for rows, h in ((1, 4096), (3, 5120), (8, 7168)):
        x = _make_input(rows, h, gen)
        want_q, want_s = _reference(x)
        got_q, got_s = _kernel_method_model(x)
        assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    # the special blocks do what their names say, per the reference
    for kind in SPECIAL_KINDS:
        blk = _special_block(kind, gen)
        q, s = _reference(blk.view(1, 32))
        if kind in ("zeros", "neg-zeros", "mixed-zeros"):
            assert s.item() == 0 and (q == 0).all(), kind
        if kind in ("nan", "neg-nan", "snan", "inf", "neg-inf", "nan-and-inf"):
            assert s.item() == 255 and (q == 0x7F).all(), kind
        if kind == "bf16-max":
            # s = bf16 max / 448 = 1.14 * 2^119 -> code 247 (the clamp at 254 is out of
            # bf16's reach); bf16 max * 2^-120 = 255 -> e4m3 256 (0x78)
            assert s.item() == 247 and ((q & 0x7F) == 0x78).all(), kind
        if kind == "one-subnormal":
            assert s.item() in (1, 2, 3), kind  # s = amax/448 is an fp32 subnormal
        if kind.startswith("ties"):
            xs = blk.float()
            amax = xs.abs().max()
            scaled = (xs / amax * 448).abs()
            v = _e4m3_values()
            # every element is a tie; RNE picks the even code
            idx = torch.searchsorted(v, scaled)
            is_tie = v[idx] != scaled
            got = (q & 0x7F).long()
            assert ((got[0][is_tie] % 2) == 0).all(), kind
            assert s.item() == 127 + int(torch.log2(amax / 448).item()), kind


def _all_bf16(gen: torch.Generator, order: str) -> torch.Tensor:
    """All 65536 bf16 bit patterns as bf16 [8, 8192] (2048 blocks): in bit order
    (a block = 32 neighbouring patterns), or shuffled (every block mixes scales)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int64)
    if order == "shuffled":
        bits = bits[torch.randperm(bits.numel(), generator=gen)]
    return _bits_to_bf16(bits).view(8, 8192)


def test_kernel_method_model_on_every_bf16_pattern():
    gen = torch.Generator().manual_seed(6)
    # every pattern as the amax of a block (the other 31 elements +-0 / a small value)
    bits = torch.arange(0, 1 << 16, dtype=torch.int64)
    blocks = torch.zeros(bits.numel(), 32, dtype=torch.int64)
    blocks[:, 0] = bits
    blocks[:, 1] = 0x8000
    blocks[:, 2] = 0x0001
    every = _bits_to_bf16(blocks).view(-1, 4096)
    for x in (every, _all_bf16(gen, "sorted"), _all_bf16(gen, "shuffled")):
        want_q, want_s = _reference(x)
        got_q, got_s = _kernel_method_model(x)
        assert torch.equal(got_s, want_s) and torch.equal(got_q, want_q)


# --------------------------------------------------------------------------- GPU


def _guarded(shape, device):
    """A poisoned uint8 buffer with GUARD bytes before and after a [shape] view."""
    buf, view = guarded(shape[0] * shape[1], POISON, torch.uint8, GUARD, device)
    return buf, view.view(shape)


def _check_deq(got_d: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor, ctx: str) -> None:
    """x_deq bits == gemm.act_to_bf16 of the reference bytes (NaN: any payload)."""
    from moebench.kernels.gemm import act_to_bf16

    want = act_to_bf16(want_q, want_s)
    g, w = got_d.view(torch.int16), want.view(torch.int16)
    same = (g == w) | (torch.isnan(got_d) & torch.isnan(want))
    if not bool(same.all()):
        bad = (~same).nonzero()[:4].tolist()
        raise AssertionError(
            f"x_deq differs: {ctx} (row, col, got, want): "
            f"{[(r, c, got_d[r, c].item(), want[r, c].item()) for r, c in bad]}"
        )


def _check(x_cpu: torch.Tensor, *, pdl=True, threads=64, what="", deq=False):
    rows, h = x_cpu.shape
    dev = torch.device("cuda")
    want_q, want_s = _reference(x_cpu)
    x = x_cpu.to(dev)
    q_buf, q = _guarded((rows, h), dev)
    s_buf, s = _guarded((rows, h // 32), dev)
    d_buf = d = None
    if deq:  # poisoned bf16 (NaN pattern 0x7FA5), 16-byte guards
        d_buf, d = guarded(rows * h, 0x7FA5, torch.int16, 8, dev)
        d = d.view(torch.bfloat16).view(rows, h)
    launch_quantize_mxfp8(x, q, s, pdl=pdl, threads=threads, x_deq_out=d)
    torch.cuda.synchronize()
    ctx = f"{what} rows={rows} H={h} pdl={pdl} threads={threads}"
    got_q, got_s = q.cpu(), s.cpu()
    if not torch.equal(got_s, want_s):
        bad = (got_s != want_s).nonzero()[:4].tolist()
        raise AssertionError(
            f"scales differ: {ctx} at {bad}: {[(got_s[r, c].item(), want_s[r, c].item()) for r, c in bad]}"
        )
    if not torch.equal(got_q, want_q):
        bad = (got_q != want_q).nonzero()[:4].tolist()
        detail = [
            (r, c, x_cpu[r, c].item(), got_q[r, c].item(), want_q[r, c].item(), want_s[r, c // 32].item())
            for r, c in bad
        ]
        raise AssertionError(f"bytes differ: {ctx} (row, col, x, got, want, code): {detail}")
    for name, buf, n in (("x_q", q_buf, q.numel()), ("x_scale", s_buf, s.numel())):
        assert_guards_intact(buf, GUARD, n, POISON, f"{name} written out of bounds: {ctx}")
    assert torch.equal(x.cpu().view(torch.int16), x_cpu.view(torch.int16)), f"x modified: {ctx}"
    if deq:
        _check_deq(d.cpu(), want_q, want_s, ctx)
        assert_guards_intact(d_buf, 8, d.numel(), 0x7FA5, f"x_deq written out of bounds: {ctx}")


@pytest.mark.gpu
def test_quantize_writes_x_deq_bit_exact():
    """x_deq (the act_bf16 GEMM operand) equals act_to_bf16 of the bytes, on
    random inputs, every special block kind and every bf16 pattern."""
    gen = torch.Generator().manual_seed(77)
    for rows in (1, 3, 8):
        _check(_make_input(rows, 7168, gen), what="random", deq=True)
    x = _make_input(8, 7168, gen).view(-1, 32)
    kinds = SPECIAL_KINDS * (x.shape[0] // len(SPECIAL_KINDS))
    for b, kind in enumerate(kinds):
        if b % 2:
            x[b] = _special_block(kind, gen)
    _check(x.view(8, 7168), what="specials", deq=True)
    _check(_all_bf16(gen, "shuffled"), what="all bf16 patterns", deq=True)


@pytest.mark.gpu
@pytest.mark.parametrize("h", HIDDEN)
def test_quantize_bit_exact(h):
    gen = torch.Generator().manual_seed(100 + h)
    for rows in range(1, 9):
        for seed in range(2):
            _check(_make_input(rows, h, gen), what=f"seed#{seed}")


@pytest.mark.gpu
def test_quantize_every_bf16_pattern():
    gen = torch.Generator().manual_seed(4)
    for order in ("sorted", "shuffled", "shuffled"):
        _check(_all_bf16(gen, order), what=f"all bf16 patterns, {order}")


@pytest.mark.gpu
def test_quantize_every_special_kind_in_every_position():
    # 8 rows x 7168: every special kind at many block positions of one input
    gen = torch.Generator().manual_seed(3)
    rows, h = 8, 7168
    x = _make_input(rows, h, gen).view(-1, 32)
    kinds = SPECIAL_KINDS * (x.shape[0] // len(SPECIAL_KINDS))
    for b, kind in enumerate(kinds):
        if b % 2 == 0:
            x[b] = _special_block(kind, gen)
    _check(x.view(rows, h), what="dense specials")


@pytest.mark.gpu
def test_quantize_other_configs_and_stream():
    gen = torch.Generator().manual_seed(9)
    for pdl, threads in ((False, 64), (True, 32), (True, 128), (False, 1024)):
        for rows, h in ((1, 4096), (5, 5120), (8, 7168), (2, 128)):
            _check(_make_input(rows, h, gen), pdl=pdl, threads=threads)
    x_cpu = _make_input(6, 5120, gen)
    want_q, want_s = _reference(x_cpu)
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        x = x_cpu.cuda()
        q = torch.full((6, 5120), POISON, dtype=torch.uint8, device="cuda")
        s = torch.full((6, 160), POISON, dtype=torch.uint8, device="cuda")
    launch_quantize_mxfp8(x, q.view(torch.float8_e4m3fn), s, stream=st)
    st.synchronize()
    assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s)
    with pytest.raises(TypeError, match="stream"):
        launch_quantize_mxfp8(x, q, s, stream=0)
    # the allocating convenience, also for a non-contiguous input
    xt = x_cpu.cuda().t().contiguous().t()
    got_q, got_s = quantize_mxfp8(xt)
    torch.cuda.synchronize()
    assert got_q.dtype == torch.uint8 and got_s.dtype == torch.uint8
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s)


@pytest.mark.gpu
def test_quantize_cuda_graph_capture_and_replay():
    rows, h = 6, 7168
    gen = torch.Generator().manual_seed(11)
    first, second = _make_input(rows, h, gen), _make_input(rows, h, gen)
    src = torch.empty(rows, h, dtype=torch.bfloat16, device="cuda")  # graph input
    x = torch.empty_like(src)
    q = torch.empty(rows, h, dtype=torch.uint8, device="cuda")
    s = torch.empty(rows, h // 32, dtype=torch.uint8, device="cuda")

    def step():  # a producer kernel, then the quantize kernel (PDL) reading its output
        x.copy_(src)
        launch_quantize_mxfp8(x, q, s)

    src.copy_(first)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        step()  # eager warm-up: loads the kernel before capture
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    eager_q, eager_s = q.clone(), s.clone()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for x_cpu in (first, second, first):
        src.copy_(x_cpu)
        q.fill_(POISON)
        s.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        want_q, want_s = _reference(x_cpu)
        assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s)
        if x_cpu is first:
            assert torch.equal(q, eager_q) and torch.equal(s, eager_s)
        else:
            assert not torch.equal(q, eager_q)


@pytest.mark.gpu
def test_quantize_graph_timing(capsys):
    """Per-launch time in a CUDA graph of 100 back-to-back PDL launches (printed;
    the bound only catches a gross regression)."""
    rows, h, n = 8, 7168, 100
    gen = torch.Generator().manual_seed(12)
    x = _make_input(rows, h, gen).cuda()
    q = torch.empty(rows, h, dtype=torch.uint8, device="cuda")
    s = torch.empty(rows, h // 32, dtype=torch.uint8, device="cuda")
    med, times = graph_launch_times(lambda: launch_quantize_mxfp8(x, q, s), n=n, replays=20)
    with capsys.disabled():
        print(
            f"\n[quantize] rows={rows} H={h}: {med:.2f} us per launch in a graph "
            f"(median of 20 replays of {n}; min {min(times):.2f}, max {max(times):.2f})"
        )
    assert torch.equal(q.cpu(), _reference(x.cpu())[0])
    assert med < 50
