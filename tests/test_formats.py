"""MXFP4 / MXFP8 / E8M0 codecs and canonical expert weights (moebench.formats).

The expected bits come from a slow scalar implementation written here from
docs/design.md's text with exact rational arithmetic (fractions.Fraction), not from
the module's helpers.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebench.formats import (
    ExpertWeights,
    dequantize_mxfp4,
    dequantize_mxfp8,
    e8m0_to_float32,
    generate_activations,
    generate_expert_weights,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_e2m1,
)
from moebench.models import get_preset

HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


# ----------------------------------------------------------------------------- scalar model


def floor_log2(v: Fraction) -> int:
    """floor(log2(v)) of a positive rational, exactly."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    assert Fraction(2) ** e <= v < Fraction(2) ** (e + 1)
    return e


def round_binary(v: Fraction, man: int, emin: int) -> Fraction:
    """Round |v| to nearest, ties to even, into a binary format with `man`
    fraction bits and minimum normal exponent `emin` (subnormals below, no max)."""
    v = abs(v)
    if v == 0:
        return Fraction(0)
    e = max(floor_log2(v), emin)
    ulp = Fraction(2) ** (e - man)
    q, r = divmod(v, ulp)
    if 2 * r > ulp or (2 * r == ulp and q % 2 == 1):
        q += 1
    return q * ulp


def encode_magnitude(v: Fraction, man: int, emin: int, bias: int) -> int:
    """Bits (exponent field << man | mantissa) of a representable magnitude v."""
    if v == 0:
        return 0
    e = floor_log2(v)
    if e < emin:  # subnormal
        m = v / Fraction(2) ** (emin - man)
        assert m.denominator == 1 and 0 < m < 2**man
        return int(m)
    m = v / Fraction(2) ** (e - man) - 2**man
    assert m.denominator == 1 and 0 <= m < 2**man
    return ((e + bias) << man) | int(m)


def to_f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def e8m0_code(amax: float, qmax: int) -> int:
    """docs/design.md: s = amax/qmax (fp32, RN); code = biased exponent of s, +1 if
    its mantissa is non-zero, clamped to [0, 254]; amax 0 -> 0; non-finite -> 255."""
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return 0
    s = round_binary(Fraction(amax) / qmax, 23, -126)  # fp32 round-to-nearest
    if s == 0:
        field, mantissa_nonzero = 0, False
    elif floor_log2(s) < -126:
        field, mantissa_nonzero = 0, True  # subnormal fp32
    else:
        e = floor_log2(s)
        field, mantissa_nonzero = e + 127, s != Fraction(2) ** e
    return min(254, max(0, field + int(mantissa_nonzero)))


def quantize_block_scalar(block: list[float], fmt: str) -> tuple[int, list[int]]:
    """(E8M0 code, element codes) of one 32-element block: bytes for e4m3,
    nibbles for e2m1."""
    if fmt == "e4m3":
        qmax, man, emin, bias, nan_code = 448, 3, -6, 7, 0x7F
    else:
        qmax, man, emin, bias, nan_code = 6, 1, 0, 1, 0x7
    amax = max(abs(x) for x in block) if all(not math.isnan(x) for x in block) else math.nan
    code = e8m0_code(amax, qmax)
    if code == 255:
        return code, [nan_code] * 32
    if amax == 0:
        return 0, [0] * 32
    out = []
    for x in block:
        v = Fraction(x) * Fraction(2) ** (127 - code)
        mag = round_binary(min(abs(v), Fraction(qmax)), man, emin)
        mag = min(mag, Fraction(qmax))  # saturate
        bits = encode_magnitude(mag, man, emin, bias)
        if fmt == "e4m3":
            negative = math.copysign(1.0, x) < 0  # IEEE: RNE keeps the sign of zero
        else:
            negative = x < 0  # module docstring: negatives rounding to 0 keep the sign
        sign_bit = 0x80 if fmt == "e4m3" else 0x8
        out.append(bits | (sign_bit if negative else 0))
    return code, out


def decode_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def decode_e2m1(nib: int) -> float:
    sign = -1.0 if nib & 8 else 1.0
    e, m = (nib >> 1) & 3, nib & 1
    if e == 0:
        return sign * m * 0.5
    return sign * (1 + m / 2) * 2.0 ** (e - 1)


# ----------------------------------------------------------------------------- strategies

f32_any = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def f32_scaled(draw):
    """fp32 values around a drawn binade, so blocks have realistic dynamic range."""
    return draw(st.floats(-2.0, 2.0, width=32))


@st.composite
def blocks(draw, max_blocks=3):
    nb = draw(st.integers(1, max_blocks))
    out = []
    for _ in range(nb):
        kind = draw(st.sampled_from(["binade", "any", "tiny", "ties"]))
        if kind == "binade":
            base = draw(st.integers(-150, 124))
            vals = [to_f32(draw(f32_scaled()) * 2.0 ** (base + draw(st.integers(-20, 0))))
                    for _ in range(32)]  # fmt: skip
        elif kind == "any":
            vals = draw(st.lists(f32_any, min_size=32, max_size=32))
        elif kind == "tiny":
            vals = [to_f32(draw(st.floats(-1.0, 1.0)) * 2.0 ** draw(st.integers(-149, -120)))
                    for _ in range(32)]  # fmt: skip
        else:
            vals = draw(tie_block())
        out.append(vals)
    return out


@st.composite
def tie_block(draw, fmt="e4m3"):
    """A block whose amax is qmax * 2^(c-127) exactly (so the scale code is c)
    and whose other elements are representable values or exact midpoints."""
    if fmt == "e4m3":
        qmax, grid = 448.0, sorted({abs(decode_e4m3(b)) for b in range(0x7F)})
        c = draw(st.integers(1, 246))
    else:
        qmax, grid = 6.0, sorted({abs(decode_e2m1(n)) for n in range(8)})
        c = draw(st.integers(1, 252))
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    scale = 2.0 ** (c - 127)
    vals = [draw(st.sampled_from([-1.0, 1.0])) * qmax * scale]
    for _ in range(31):
        v = draw(st.sampled_from(grid + mids + mids))
        vals.append(draw(st.sampled_from([-1.0, 1.0])) * v * scale)
    perm = draw(st.permutations(range(32)))
    return [vals[i] for i in perm]


def as_tensor(bl: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for b in bl for x in b], dtype=torch.float32)


# ----------------------------------------------------------------------------- scalar model sanity


def test_scalar_model_sanity():
    # a few hand-checked values, so the model itself is not wrong in the same way
    assert e8m0_code(448.0, 448) == 127
    assert e8m0_code(449.0, 448) == 128
    assert e8m0_code(6.0, 6) == 127 and e8m0_code(3.0, 6) == 126 and e8m0_code(3.1, 6) == 127
    assert round_binary(Fraction(17), 3, -6) == 16 and round_binary(Fraction(19), 3, -6) == 20
    assert round_binary(Fraction(1, 4), 1, 0) == 0 and round_binary(Fraction(3, 4), 1, 0) == 1
    assert round_binary(Fraction(5, 2), 1, 0) == 2 and round_binary(Fraction(7, 2), 1, 0) == 4
    assert encode_magnitude(Fraction(448), 3, -6, 7) == 0x7E
    assert encode_magnitude(Fraction(6), 1, 0, 1) == 7
    assert all(decode_e4m3(encode_magnitude(Fraction(abs(decode_e4m3(b))), 3, -6, 7)) == abs(decode_e4m3(b))
               for b in range(0x7F))  # fmt: skip


# ----------------------------------------------------------------------------- E8M0


def test_e8m0_to_float32_special_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    f = e8m0_to_float32(codes)
    assert f.dtype == torch.float32
    for c in range(255):
        assert f[c].item() == math.ldexp(1.0, c - 127), c
    assert f[0].item() == 2.0**-127 and f[0].item() > 0  # an exact fp32 subnormal
    assert f[254].item() == 2.0**127
    assert math.isnan(f[255].item())
    # float8 input is accepted as raw bytes; other dtypes are not
    assert torch.equal(e8m0_to_float32(codes[:255].view(torch.float8_e4m3fn)), f[:255])
    with pytest.raises(TypeError, match="scale"):
        e8m0_to_float32(torch.zeros(4, dtype=torch.int32))


# ----------------------------------------------------------------------------- bit-exactness


@HYP
@given(blocks())
def test_mxfp8_bit_exact_vs_scalar(bl):
    q, s = quantize_mxfp8(as_tensor(bl).view(1, -1))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert q.shape == (1, 32 * len(bl)) and s.shape == (1, len(bl))
    qb = q.view(torch.uint8).view(len(bl), 32).tolist()
    for j, b in enumerate(bl):
        code, elems = quantize_block_scalar(b, "e4m3")
        assert int(s[0, j]) == code, (j, b)
        assert qb[j] == elems, (j, b)


@HYP
@given(blocks())
def test_mxfp4_bit_exact_vs_scalar(bl):
    p, s = quantize_mxfp4(as_tensor(bl))
    assert p.dtype == torch.uint8 and p.shape == (16 * len(bl),) and s.shape == (len(bl),)
    nibs = unpack_e2m1(p).view(len(bl), 32).tolist()
    for j, b in enumerate(bl):
        code, elems = quantize_block_scalar(b, "e2m1")
        assert int(s[j]) == code, (j, b)
        assert nibs[j] == elems, (j, b)


@HYP
@given(st.lists(tie_block("e2m1"), min_size=1, max_size=3))
def test_mxfp4_ties_bit_exact_vs_scalar(bl):
    p, s = quantize_mxfp4(as_tensor(bl))
    nibs = unpack_e2m1(p).view(len(bl), 32).tolist()
    for j, b in enumerate(bl):
        code, elems = quantize_block_scalar(b, "e2m1")
        assert int(s[j]) == code and nibs[j] == elems


def test_ties_round_to_even_examples():
    # e4m3 at code 127: 17 is between 16 (0x58) and 18 (0x59): even -> 16; 19 -> 20 (0x5A)
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 448.0, 17.0, 19.0, -0.5 * 2.0**-9  # last: half the min subnormal
    q, s = quantize_mxfp8(x)
    assert int(s[0]) == 127
    assert q.view(torch.uint8)[:4].tolist() == [0x7E, 0x58, 0x5A, 0x80]
    # e2m1 at code 127: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0
    w = torch.zeros(32)
    w[:8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    p, s = quantize_mxfp4(w)
    assert int(s[0]) == 127
    assert unpack_e2m1(p)[:8].tolist() == [7, 0, 2, 2, 4, 4, 6, 6]


# ----------------------------------------------------------------------------- layout


def test_nibble_order_even_element_low():
    w = torch.zeros(64)
    w[0], w[1] = 6.0, 0.5  # codes 7 and 1 at scale 2^0
    w[32], w[33] = -1.0, -6.0  # codes 0xA and 0xF at scale 2^0
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [127, 127]
    assert int(p[0]) == 0x17
    assert int(p[16]) == 0xFA
    assert unpack_e2m1(p)[:2].tolist() == [7, 1]


def test_leading_dims_and_dtypes():
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    q, s = quantize_mxfp8(x)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3, 2)
    # the same values in bf16 / fp16 / fp64 give the same bits (after an exact cast)
    xb = x.to(torch.bfloat16)
    ref = quantize_mxfp8(xb.float())
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        xs = xb.to(dt)
        assert torch.equal(xs.float(), xb.float())
        got = quantize_mxfp8(xs)
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
    p, s4 = quantize_mxfp4(x)
    assert p.shape == (2, 3, 32) and s4.shape == (2, 3, 2)


# ----------------------------------------------------------------------------- round trips


@HYP
@given(blocks())
def test_mxfp8_dequant_quant_within_step(bl):
    x = as_tensor(bl).view(len(bl), 32).double()
    q, s = quantize_mxfp8(x)
    back = dequantize_mxfp8(q, s, dtype=torch.float64)
    scale = 2.0 ** (s.double() - 127)  # [blocks, 1]
    # e4m3: half an ulp is <= 2^-4 |x| for normals and 2^-10 * scale in the subnormal range
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool(((back - x).abs() <= bound).all())


@HYP
@given(blocks())
def test_mxfp4_dequant_quant_within_step(bl):
    x = as_tensor(bl).view(len(bl), 32).double()
    p, s = quantize_mxfp4(x)
    back = dequantize_mxfp4(p, s, dtype=torch.float64)
    scale = 2.0 ** (s.double() - 127)  # [blocks, 1]
    # e2m1 half-steps: 0.25 on [0, 2], 0.5 on [2, 4], 1 on [4, 6]: <= max(|x|/4, scale/4)
    bound = torch.maximum(x.abs() / 4, scale / 4)
    assert bool(((back - x).abs() <= bound).all())


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_mxfp8_quant_dequant_identity_for_representable(data):
    nb = data.draw(st.integers(1, 4))
    codes = data.draw(st.lists(st.integers(1, 246), min_size=nb, max_size=nb))
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    vals = data.draw(st.lists(st.sampled_from(finite), min_size=32 * nb, max_size=32 * nb))
    for j in range(nb):  # every block holds a +-448 so that its scale is its own
        pos = data.draw(st.integers(0, 31))
        vals[32 * j + pos] = data.draw(st.sampled_from([0x7E, 0xFE]))
    q = torch.tensor(vals, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.tensor(codes, dtype=torch.uint8)
    x = dequantize_mxfp8(q, s)  # exact in fp32 for these codes
    assert torch.isfinite(x).all()
    q2, s2 = quantize_mxfp8(x)
    assert torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_mxfp4_quant_dequant_identity_for_representable(data):
    nb = data.draw(st.integers(1, 4))
    codes = data.draw(st.lists(st.integers(1, 252), min_size=nb, max_size=nb))
    nibs = data.draw(st.lists(st.sampled_from([n for n in range(16) if n != 8]),
                              min_size=32 * nb, max_size=32 * nb))  # fmt: skip
    for j in range(nb):  # every block holds a +-6
        nibs[32 * j + data.draw(st.integers(0, 31))] = data.draw(st.sampled_from([0x7, 0xF]))
    packed = torch.tensor([nibs[i] | (nibs[i + 1] << 4) for i in range(0, len(nibs), 2)], dtype=torch.uint8)
    s = torch.tensor(codes, dtype=torch.uint8)
    w = dequantize_mxfp4(packed, s)
    assert torch.isfinite(w).all()
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(s2, s)
    assert torch.equal(p2, packed)


def test_dequantize_mxfp8_all_bytes():
    codes = [0, 1, 100, 127, 200, 246]
    q = torch.arange(256, dtype=torch.uint8).repeat(len(codes), 1)  # [6, 256] = 8 blocks each
    s = torch.tensor(codes, dtype=torch.uint8).unsqueeze(1).repeat(1, 8)
    got = dequantize_mxfp8(q.view(torch.float8_e4m3fn), s)
    for r, c in enumerate(codes):
        for b in range(256):
            want = decode_e4m3(b) * 2.0 ** (c - 127)
            g = got[r, b].item()
            assert (math.isnan(g) and math.isnan(want)) or g == want, (c, b, g, want)
    nan_scale = dequantize_mxfp8(q[:1].view(torch.float8_e4m3fn), torch.full((1, 8), 255, dtype=torch.uint8))
    assert torch.isnan(nan_scale).all()


def test_dequantize_mxfp4_all_nibbles():
    packed = torch.tensor([lo | (hi << 4) for hi in range(16) for lo in range(16)], dtype=torch.uint8)
    packed = packed.view(16, 16)  # 16 rows x one block of 32 elements
    for c in (0, 1, 127, 252):
        s = torch.full((16, 1), c, dtype=torch.uint8)
        got = dequantize_mxfp4(packed, s, dtype=torch.float64).view(-1).tolist()
        want = []
        for byte in packed.view(-1).tolist():
            want += [decode_e2m1(byte & 0xF) * 2.0 ** (c - 127), decode_e2m1(byte >> 4) * 2.0 ** (c - 127)]
        assert got == want
    assert torch.isnan(dequantize_mxfp4(packed, torch.full((16, 1), 255, dtype=torch.uint8))).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_to_narrow_dtypes_rounds_the_exact_product_once(dtype):
    # Scales beyond float16's range (2^16 and up, 2^-25 and below) must not turn zero elements
    # into NaN (0 x inf) nor finite products into inf / 0: the result is the exact product
    # (a Python double here) rounded once to `dtype`, inf where it overflows as `dtype` would.
    codes = torch.arange(255, dtype=torch.uint8)  # every finite scale
    q8 = torch.arange(256, dtype=torch.uint8).repeat(255, 1)  # 8 blocks per row
    got8 = dequantize_mxfp8(q8.view(torch.float8_e4m3fn), codes.unsqueeze(1).repeat(1, 8), dtype)
    want8 = [[decode_e4m3(b) * 2.0 ** (c - 127) for b in range(256)] for c in range(255)]
    packed = torch.tensor([lo | (hi << 4) for hi in range(16) for lo in range(16)], dtype=torch.uint8)
    got4 = dequantize_mxfp4(packed.view(1, 8, 32).repeat(255, 1, 1), codes.view(255, 1, 1).repeat(1, 8, 2), dtype)
    want4 = []
    for c in range(255):
        row = []
        for byte in packed.tolist():
            row += [decode_e2m1(byte & 0xF) * 2.0 ** (c - 127), decode_e2m1(byte >> 4) * 2.0 ** (c - 127)]
        want4.append(row)
    for got, want in ((got8, want8), (got4.view(255, -1), want4)):
        want = torch.tensor(want, dtype=torch.float64)
        nan = torch.isnan(want)  # only e4m3's NaN bytes: the scales are finite
        assert got.dtype == dtype and torch.equal(torch.isnan(got), nan)
        zero = want == 0
        assert torch.equal(got[zero], torch.zeros_like(got[zero]))
        assert torch.equal(torch.signbit(got[zero]), torch.signbit(want[zero]))
        assert torch.equal(got[~nan], want[~nan].to(dtype))


# ----------------------------------------------------------------------------- special blocks


def test_zero_block():
    x = torch.zeros(3, 32)
    x[1] = -0.0
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[0], [0], [0]]
    assert int(q.view(torch.uint8).count_nonzero()) == 0
    p, s4 = quantize_mxfp4(x)
    assert s4.tolist() == [[0], [0], [0]] and int(p.count_nonzero()) == 0
    assert torch.equal(dequantize_mxfp8(q, s), torch.zeros(3, 32))


def test_tiny_amax_subnormal_scale():
    # amax normal but amax/448 an fp32 subnormal: code = exponent field 0 + 1 (mantissa != 0)
    x = torch.zeros(4, 32)
    x[0, 3] = 1e-37
    x[1, 5] = -(2.0**-126)  # smallest normal
    x[2, 0] = 2.0**-149  # smallest subnormal: amax/448 rounds to 0 -> code 0, elements 0
    x[3, 7] = 448.0 * 2.0**-126  # s = 2^-126 exactly, normal -> code 1, element 448
    q, s = quantize_mxfp8(x)
    assert s.view(-1).tolist() == [1, 1, 0, 1]
    qb = q.view(torch.uint8)
    assert int(qb[3, 7]) == 0x7E
    assert int(qb[2].count_nonzero()) == 0
    for r in range(4):
        code, elems = quantize_block_scalar(x[r].tolist(), "e4m3")
        assert code == int(s[r, 0]) and elems == qb[r].tolist()
    back = dequantize_mxfp8(q, s, dtype=torch.float64)
    assert back[0, 3].item() == pytest.approx(1e-37, rel=2**-4)
    assert back[1, 5].item() == -(2.0**-126)
    p, s4 = quantize_mxfp4(x)
    for r in range(4):
        code, elems = quantize_block_scalar(x[r].tolist(), "e2m1")
        assert code == int(s4[r, 0]) and elems == unpack_e2m1(p[r]).tolist()


def test_huge_amax_and_saturation():
    x = torch.zeros(3, 32)
    x[0, 0] = FLT_MAX
    x[0, 1] = -FLT_MAX
    x[1, 2] = 448.0 * 2.0**100  # s a power of two: max elements land exactly on +-448
    x[1, 3] = -448.0 * 2.0**100
    x[2, 4] = 6.0 * 2.0**100
    q, s = quantize_mxfp8(x)
    qb = q.view(torch.uint8)
    # FLT_MAX/448 ~ 1.14 * 2^119 -> code 127 + 120 = 247; never NaN bytes
    assert int(s[0, 0]) == 247
    assert int(s[1, 0]) == 227 and qb[1, 2:4].tolist() == [0x7E, 0xFE]
    assert not bool(((qb & 0x7F) == 0x7F).any())
    assert (dequantize_mxfp8(q, s, dtype=torch.float64)[1, 2:4] == torch.tensor([1, -1.0]) * 448 * 2.0**100).all()
    p, s4 = quantize_mxfp4(x)
    nib = unpack_e2m1(p)
    # FLT_MAX/6 ~ 1.42 * 2^125 -> code 253 (the largest an fp32 input can reach)
    assert int(s4[0, 0]) == 253
    assert int(s4[2, 0]) == 227 and int(nib[2, 4]) == 7
    for r in range(3):
        assert quantize_block_scalar(x[r].tolist(), "e4m3") == (int(s[r, 0]), qb[r].tolist())
        assert quantize_block_scalar(x[r].tolist(), "e2m1") == (int(s4[r, 0]), nib[r].tolist())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_block(bad):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 96, generator=g)
    x[0, 40] = bad  # block 1 of row 0
    q, s = quantize_mxfp8(x)
    q_ok, s_ok = quantize_mxfp8(torch.cat([x[0, :32], x[0, 64:]]).view(1, 64))
    assert s[0].tolist() == [int(s_ok[0, 0]), 255, int(s_ok[0, 1])]
    qb = q.view(torch.uint8)
    assert (qb[0, 32:64] == 0x7F).all()
    assert torch.equal(qb[0, :32], q_ok.view(torch.uint8)[0, :32])
    assert torch.equal(qb[0, 64:], q_ok.view(torch.uint8)[0, 32:])
    assert torch.equal(s[1], quantize_mxfp8(x[1])[1])  # other rows unaffected
    back = dequantize_mxfp8(q, s)
    assert torch.isnan(back[0, 32:64]).all() and torch.isfinite(back[0, :32]).all()
    p, s4 = quantize_mxfp4(x)
    assert s4[0, 1].item() == 255 and s4[0, 0].item() != 255 and s4[0, 2].item() != 255
    assert (p[0, 16:32] == 0x77).all()
    assert torch.equal(p[0, :16], quantize_mxfp4(x[0, :32])[0])
    assert torch.isnan(dequantize_mxfp4(p, s4)[0, 32:64]).all()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn, arg", [(quantize_mxfp8, "x"), (quantize_mxfp4, "w")])
def test_quantize_bad_input(fn, arg):
    with pytest.raises(TypeError, match=arg):
        fn(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(TypeError, match=arg):
        fn(torch.zeros(32, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match=arg):
        fn([0.0] * 32)
    with pytest.raises(ValueError, match=arg):
        fn(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=arg):
        fn(torch.tensor(1.0))


def test_dequantize_bad_input():
    q, s = quantize_mxfp8(torch.ones(2, 64))
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp8(q, s[:, :1])
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp8(q, s[:1])
    with pytest.raises(TypeError, match="values"):
        dequantize_mxfp8(q.float(), s)
    with pytest.raises(TypeError, match="scales"):
        dequantize_mxfp8(q, s.to(torch.int32))
    p, s4 = quantize_mxfp4(torch.ones(2, 64))
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(p, s4[:, :1])
    with pytest.raises(TypeError, match="packed"):
        dequantize_mxfp4(p.to(torch.int16), s4)
    with pytest.raises(TypeError, match="packed"):
        unpack_e2m1(p.float())


# ----------------------------------------------------------------------------- expert weights


@pytest.fixture(scope="module")
def small_shape():
    # I = 192 at TP2 -> 96 per rank, padded to 128
    return get_preset("dsv4-flash", hidden=256, intermediate=192, experts=4, top_k=2).shard(2)


@pytest.fixture(scope="module")
def small_weights(small_shape):
    return generate_expert_weights(small_shape, seed=3)


def test_generate_expert_weights_shapes_and_padding(small_shape, small_weights):
    w = small_weights
    e, h, i, ip = 4, 256, 96, 128
    assert (w.experts, w.hidden, w.intermediate, w.padded_intermediate) == (e, h, i, ip)
    assert w.w13.shape == (e, 2 * ip, h // 2) and w.w13_scale.shape == (e, 2 * ip, h // 32)
    assert w.w2.shape == (e, h, ip // 2) and w.w2_scale.shape == (e, h, ip // 32)
    assert w.clamp.tolist() == [10.0] * e
    assert w.padding_is_zero()
    w13, w2 = w.dequantized(torch.float64)
    assert w13.shape == (e, 2 * ip, h) and w2.shape == (e, h, ip)
    assert int(w13[:, i:ip].count_nonzero()) == 0 and int(w13[:, ip + i :].count_nonzero()) == 0
    assert int(w2[:, :, i:].count_nonzero()) == 0
    # the real rows are not zero and are finite
    assert torch.isfinite(w13).all() and torch.isfinite(w2).all()
    assert int((w13[:, :i].abs().sum(-1) == 0).sum()) == 0
    assert int((w13[:, ip : ip + i].abs().sum(-1) == 0).sum()) == 0


def test_padding_is_zero_detects_nonzero_padding(small_weights):
    for name, index in (("w13", (0, 100, 0)), ("w13", (1, 250, 3)), ("w13_scale", (2, 127, 1)),
                        ("w2", (3, 5, 60)), ("w2_scale", (0, 0, 3))):  # fmt: skip
        w = ExpertWeights(*(t.clone() for t in (small_weights.w13, small_weights.w13_scale,
                                                small_weights.w2, small_weights.w2_scale,
                                                small_weights.clamp)), intermediate=96)  # fmt: skip
        assert w.padding_is_zero()
        getattr(w, name)[index] = 1
        assert not w.padding_is_zero(), name


def test_generate_expert_weights_seeded(small_shape, small_weights):
    again = generate_expert_weights(small_shape, seed=3)
    other = generate_expert_weights(small_shape, seed=4)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(again, name), getattr(small_weights, name))
    assert not torch.equal(other.w13, small_weights.w13)
    assert not torch.equal(other.w2_scale, small_weights.w2_scale)


def test_generate_expert_weights_scale_spread(small_weights):
    w = small_weights
    real = torch.cat([w.w13_scale[:, :96].flatten(), w.w13_scale[:, 128:224].flatten(),
                      w.w2_scale[:, :, :3].flatten()]).long()  # fmt: skip
    assert int(real.min()) > 0 and int(real.max()) < 255
    assert len(set(real.tolist())) >= 5  # several binades, not all equal
    assert int(real.max() - real.min()) >= 4
    # and all 16 e2m1 codes occur (heavy tails, signed)
    assert set(unpack_e2m1(w.w13[:, :96]).unique().tolist()) >= set(range(16)) - {8}


def test_generate_activations():
    a = generate_activations(3, 256, seed=1)
    assert a.dtype == torch.bfloat16 and a.shape == (3, 256)
    assert torch.equal(a, generate_activations(3, 256, seed=1))
    assert not torch.equal(a, generate_activations(3, 256, seed=2))
    assert generate_activations(0, 256).shape == (0, 256)
    with pytest.raises(ValueError, match="rows"):
        generate_activations(-1, 256)
    with pytest.raises(ValueError, match="hidden"):
        generate_activations(1, 0)


def _fields(w):
    return dict(w13=w.w13, w13_scale=w.w13_scale, w2=w.w2, w2_scale=w.w2_scale, clamp=w.clamp,
                intermediate=w.intermediate)  # fmt: skip


@pytest.mark.parametrize(
    "field, make, exc",
    [
        ("w13", lambda w: w.w13[0], ValueError),
        ("w13_scale", lambda w: w.w13_scale[:, :, :4], ValueError),
        ("w13_scale", lambda w: w.w13_scale.to(torch.int16), TypeError),
        ("w2", lambda w: w.w2[:, :, :32], ValueError),
        ("w2", lambda w: w.w2.float(), TypeError),
        ("w2_scale", lambda w: w.w2_scale[:3], ValueError),
        ("w2_scale", lambda w: w.w2_scale.to("meta"), ValueError),
        ("clamp", lambda w: w.clamp.double(), ValueError),
        ("clamp", lambda w: w.clamp[:2], ValueError),
        ("intermediate", lambda w: 0, ValueError),
        ("intermediate", lambda w: 160, ValueError),
        ("intermediate", lambda w: 80, ValueError),
    ],
)
def test_expert_weights_validation(small_weights, field, make, exc):
    kw = _fields(small_weights)
    kw[field] = make(small_weights)
    with pytest.raises(exc, match=field):
        ExpertWeights(**kw)


# ----------------------------------------------------------------------------- misuse at the boundary


def test_dequantize_rejects_0d_inputs_and_non_floating_dtypes():
    from moebench.formats import dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp4, quantize_mxfp8

    one = torch.tensor(1, dtype=torch.uint8)
    for fn in (dequantize_mxfp8, dequantize_mxfp4):
        with pytest.raises(ValueError, match="0-d"):
            fn(one, one)
    v, s = quantize_mxfp8(torch.ones(2, 32))
    p, s4 = quantize_mxfp4(torch.ones(2, 32))
    for bad in (torch.int32, "float32", torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype"):
            dequantize_mxfp8(v, s, dtype=bad)
        with pytest.raises(TypeError, match="dtype"):
            dequantize_mxfp4(p, s4, dtype=bad)


def _tiny_weights():
    from moebench.formats import generate_expert_weights
    from moebench.models import get_preset

    return generate_expert_weights(get_preset("dsv4-flash", hidden=256, intermediate=256, experts=4, top_k=2).shard(2))


def test_expert_weights_rejects_bad_clamp_and_intermediate():
    from moebench.formats import ExpertWeights

    w = _tiny_weights()
    parts = (w.w13, w.w13_scale, w.w2, w.w2_scale)
    with pytest.raises(TypeError, match="clamp"):
        ExpertWeights(*parts, [10.0] * 4, w.intermediate)
    for bad in (float("nan"), 0.0, -1.0):
        clamp = w.clamp.clone()
        clamp[1] = bad
        with pytest.raises(ValueError, match="clamp"):
            ExpertWeights(*parts, clamp, w.intermediate)
    ExpertWeights(*parts, torch.full((4,), float("inf")), w.intermediate)  # no clamp: allowed
    with pytest.raises(ValueError, match="clamp is on meta"):
        ExpertWeights(*parts, w.clamp.to("meta"), w.intermediate)
    with pytest.raises(TypeError, match="intermediate must be an int"):
        ExpertWeights(*parts, w.clamp, float(w.intermediate))


def test_expert_weights_rejects_sizes_not_multiples_of_the_mx_block():
    from moebench.formats import ExpertWeights

    u8 = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    with pytest.raises(ValueError, match="multiples of 32"):  # Ip = 48
        ExpertWeights(u8(2, 96, 128), u8(2, 96, 8), u8(2, 256, 24), u8(2, 256, 1), torch.ones(2), 32)


def test_generators_reject_wrong_argument_types():
    from moebench.formats import generate_activations, generate_expert_weights
    from moebench.models import get_preset

    shape = get_preset("dsv4-flash", hidden=256, intermediate=256, experts=4, top_k=2).shard(2)
    with pytest.raises(TypeError, match="RankShape"):
        generate_expert_weights(shape.config)
    with pytest.raises(TypeError, match="seed"):
        generate_expert_weights(shape, seed=None)
    with pytest.raises(TypeError, match="rows"):
        generate_activations(2.5, 256)


@pytest.mark.parametrize("quantize, name", [(quantize_mxfp8, "x"), (quantize_mxfp4, "w")])
def test_quantizers_refuse_finite_values_beyond_fp32(quantize, name):
    """A finite float64 value beyond the fp32 range would become inf in the
    fp32 rule and its block NaN: refused, naming the argument. inf itself
    keeps its defined NaN block, and fp64 values in range quantize as fp32."""
    x = torch.ones(1, 32, dtype=torch.float64)
    x[0, 3] = 1e39
    with pytest.raises(ValueError, match=f"{name} holds finite values beyond the fp32 range"):
        quantize(x)
    x[0, 3] = float("inf")
    assert int(quantize(x)[1][0, 0]) == 255
    y = torch.randn(2, 64, dtype=torch.float64)
    for a, b in zip(quantize(y), quantize(y.float())):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
