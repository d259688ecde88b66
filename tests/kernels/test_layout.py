"""The kernel weight layout: round trip, padding checks, decoder bit layout,
and a pure-torch emulation of one warp's MMA data flow over packed weights."""

import pytest
import torch
from layout_inverse import from_kernel_layout, unpack_rows

from moebench.formats import E2M1_VALUES, ExpertWeights, dequantize_mxfp4, generate_expert_weights
from moebench.kernels.layout import (
    BF16_BITS,
    KernelWeights,
    bit_position,
    decode_terms,
    pack_rows,
    to_kernel_layout,
)
from moebench.models import get_preset


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


def _decode_py(word: int) -> list[int]:
    """Python model of fp4.decode_e2m1_word: R0..R3 as bf16x2 bit patterns."""
    rotl = lambda v, d: ((v << d) | (v >> (32 - d))) & 0xFFFFFFFF if d else v  # noqa: E731
    return [sum(rotl(word, d) & mask for d, mask in decode_terms(i)) for i in range(4)]


def test_word_bit_layout_is_a_permutation_and_decodes_every_code():
    positions = sorted(bit_position(i, h, b) for i in range(4) for h in range(2) for b in range(4))
    assert positions == list(range(32))
    for i in range(4):
        for h in range(2):
            for code in range(16):
                word = sum(((code >> b) & 1) << bit_position(i, h, b) for b in range(4))
                bits = (_decode_py(word)[i] >> (16 * h)) & 0xFFFF
                assert _bf16_value(bits) == E2M1_VALUES[code] * 2.0**-126
                # no other register/half picks up these bits
                for i2 in range(4):
                    for h2 in range(2):
                        if (i2, h2) != (i, h):
                            assert (_decode_py(word)[i2] >> (16 * h2)) & 0xFFFF == 0
    assert BF16_BITS == (6, 7, 8, 15)


@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 8), ("dsv4-flash", 4), ("dsv41-flash", 4)])
def test_round_trip_is_bit_exact(preset, tp):
    # the real H and I; experts are only a batch dimension here: two (top_k 2) prove as much as six
    shape = get_preset(preset, experts=2, top_k=2).shard(tp)
    weights = generate_expert_weights(shape, seed=3)
    kw = to_kernel_layout(weights)
    h, i = shape.hidden, shape.intermediate
    assert isinstance(kw, KernelWeights)
    assert tuple(kw.w13.shape) == (2, 2 * i // 32, h // 32, 32, 16)
    assert tuple(kw.w13_scale.shape) == (2, 2 * i // 32, h // 32, 8, 4)
    assert tuple(kw.w2.shape) == (2, h // 32, i // 32, 32, 16)
    assert tuple(kw.w2_scale.shape) == (2, h // 32, i // 32, 8, 4)
    assert kw.max_scale_code == max(int(weights.w13_scale.max()), int(weights.w2_scale.max()))
    assert not kw.wide_scales
    back = from_kernel_layout(kw)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        assert torch.equal(getattr(back, name), getattr(weights, name)), name
    assert back.intermediate == weights.intermediate
    # the kernels stream exactly the logical bytes
    assert kw.expert_bytes() == shape.expert_bytes()


def test_random_bytes_round_trip():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (3, 64, 48), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 255, (3, 64, 3), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed, s = pack_rows(codes, scales)
    c2, s2 = unpack_rows(packed, s)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)


@pytest.mark.parametrize(
    "tensor,index",
    [("w13", (1, 100, 3)), ("w13", (0, 240, 0)), ("w13_scale", (2, 110, 1)), ("w2", (0, 5, 50)),
     ("w2_scale", (3, 7, 3))],
)  # fmt: skip
def test_nonzero_padding_is_rejected_naming_the_tensor(tensor, index):
    shape = get_preset("dsv41-flash", hidden=256, intermediate=288, experts=8).shard(3)
    weights = generate_expert_weights(shape, seed=1)
    # I = 96 (3 blocks), padded to 128: gate rows 96..127 and up rows 224..255 are padding
    assert (weights.intermediate, weights.padded_intermediate) == (96, 128)
    getattr(weights, tensor)[index] = 1
    with pytest.raises(ValueError, match=tensor):
        to_kernel_layout(weights)


def test_bad_argument_type():
    with pytest.raises(TypeError, match="weights"):
        to_kernel_layout("not weights")


def test_mma_data_flow_emulation_matches_dense_product():
    """Emulate one warp over the packed layout: per lane decode A registers
    (x 2^(s-127)), B registers from 8 contiguous activations, the PTX
    m16n8k16 fragment maps, and read C with the epilogue's index formula."""
    gen = torch.Generator().manual_seed(11)
    m, k = 64, 96
    codes = torch.randint(0, 256, (1, m, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (1, m, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    x = torch.randint(-4, 5, (8, k), generator=gen).to(torch.float64)
    dense = dequantize_mxfp4(codes[0], scales[0], torch.float64)  # [m, k]
    packed, sp = pack_rows(codes, scales)
    words = packed.to(torch.int64).view(1, m // 32, k // 32, 32, 4, 4)
    words = sum(words[..., b] << (8 * b) for b in range(4))[0]  # [pairs, chunks, lanes, 4]
    sp = sp[0]  # [pairs, chunks, 8 g, 4]
    y = torch.zeros(m, 8, dtype=torch.float64)
    for pair in range(m // 32):
        for t in range(2):
            C = torch.zeros(16, 8, dtype=torch.float64)
            for ch in range(k // 32):
                for j in range(2):
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    B = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        regs = _decode_py(int(words[pair, ch, lane, 2 * t + j]))
                        s_lo = int(sp[pair, ch, g, 2 * t]) - 127
                        s_hi = int(sp[pair, ch, g, 2 * t + 1]) - 127
                        a = [
                            _bf16_value(regs[i] >> (16 * h)) * 2.0**126 * 2.0 ** (s_lo if i % 2 == 0 else s_hi)
                            for i in range(4)
                            for h in range(2)
                        ]
                        k0 = 32 * ch + 8 * c + 4 * j
                        b = x[g, k0 : k0 + 4].tolist()
                        for v in range(8):  # PTX A fragment map
                            A[g + 8 * ((v >> 1) & 1), 2 * c + (v & 1) + 8 * (v >> 2)] = a[v]
                        for v in range(4):  # PTX B fragment map
                            B[2 * c + (v & 1) + 8 * (v >> 1), g] = b[v]
                    C += A @ B
            regs = [[C[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] for i in range(4)] for lane in range(32)]
            for row in range(16):
                for n in range(8):  # the epilogue's formula (gemm.StreamingGemmKernel.partial)
                    flat = ((row % 8) * 4 + n // 2) * 4 + (row // 8) * 2 + n % 2
                    y[32 * pair + 16 * t + row, n] = regs[flat // 4][flat % 4]
    assert torch.equal(y, dense @ x.T)


def test_expert_weights_type_is_canonical():
    w = generate_expert_weights(get_preset("dsv4-flash", hidden=256, intermediate=64, experts=8).shard(1))
    assert isinstance(w, ExpertWeights)


# ----------------------------------------------------------------------------- e4m3 operand (fp8 tactics)
def _e4m3_value(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).item()


def _decode_e4m3_py(word: int) -> tuple[int, int]:
    """Python model of fp4.decode_e2m1_word_e4m3: (row g register, row g+8 register)."""
    from moebench.kernels.layout import E4M3_IN_PLACE, E4M3_LEFT, E4M3_RIGHT

    x = word & ~E4M3_IN_PLACE & 0xFFFFFFFF
    return word & E4M3_IN_PLACE, (((x << 2) & E4M3_LEFT) | ((x >> 2) & E4M3_RIGHT)) & 0xFFFFFFFF


def test_e4m3_word_layout_decodes_every_code_exactly():
    """Each code of either row half in any byte decodes to e2m1 x 2^-6 in its
    register byte, and to nothing anywhere else."""
    from moebench.kernels.layout import code_bit_position

    for rh in range(2):
        for byte in range(4):
            for code in range(16):
                word = sum(((code >> b) & 1) << code_bit_position("e4m3", rh, byte // 2, byte % 2, b) for b in range(4))
                regs = _decode_e4m3_py(word)
                got = (regs[rh] >> (8 * byte)) & 0xFF
                assert _e4m3_value(got) * 2.0**6 == E2M1_VALUES[code], (rh, byte, code)
                assert regs[rh] & ~(0xFF << (8 * byte)) == 0 and regs[1 - rh] == 0, (rh, byte, code)


@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv4-pro", 8)])
def test_e4m3_round_trip_is_bit_exact_and_differs_from_bf16(preset, tp):
    # the real H and I; experts are only a batch dimension here: two (top_k 2) prove as much as six
    shape = get_preset(preset, experts=2, top_k=2).shard(tp)
    weights = generate_expert_weights(shape, seed=4)
    kw = to_kernel_layout(weights, operand="e4m3")
    # (the intermediate padding, zero, is dropped: its scales do not count)
    assert kw.operand == "e4m3" and kw.min_scale_code == min(int(kw.w13_scale.min()), int(kw.w2_scale.min()))
    assert kw.min_scale_code > 0 and not kw.special_scales
    back = from_kernel_layout(kw)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        assert torch.equal(getattr(back, name), getattr(weights, name)), name
    kb = to_kernel_layout(weights)
    assert torch.equal(kb.w13_scale, kw.w13_scale) and not torch.equal(kb.w13, kw.w13)


def test_unknown_operand_is_rejected():
    w = generate_expert_weights(get_preset("dsv4-flash", hidden=256, intermediate=64, experts=8).shard(1))
    with pytest.raises(ValueError, match="operand"):
        to_kernel_layout(w, operand="fp16")
    kw = to_kernel_layout(w)
    import dataclasses

    with pytest.raises(ValueError, match="operand"):
        dataclasses.replace(kw, operand="e5m2")
    assert not kw.special_scales or kw.min_scale_code == 0


def test_fp8_mma_data_flow_emulation_matches_dense_product():
    """Emulate one warp of the fp8 tactics over the e4m3 layout: per lane the
    decoded e4m3 A registers, the B registers = 8 contiguous e4m3 bytes of
    token g, the PTX m16n8k32 fragment maps, one MMA per 32-K chunk scaled by
    weight scale x activation scale x 2^6 on the fp32 result (tokens 2c,
    2c+1 of the C fragment), read back with the epilogue's index formula."""
    from moebench.formats import dequantize_mxfp8, quantize_mxfp8

    gen = torch.Generator().manual_seed(12)
    m, k = 64, 96
    codes = torch.randint(0, 256, (1, m, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (1, m, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    x_q, x_s = quantize_mxfp8(torch.randn(8, k, generator=gen).to(torch.bfloat16))
    xb = x_q.view(torch.uint8)
    dense = dequantize_mxfp4(codes[0], scales[0], torch.float64)
    packed, sp = pack_rows(codes, scales, "e4m3")
    words = packed.to(torch.int64).view(1, m // 32, k // 32, 32, 4, 4)
    words = sum(words[..., b] << (8 * b) for b in range(4))[0]
    sp = sp[0]
    y = torch.zeros(m, 8, dtype=torch.float64)
    for pair in range(m // 32):
        for t in range(2):
            C = torch.zeros(16, 8, dtype=torch.float64)
            for ch in range(k // 32):
                A = torch.zeros(16, 32, dtype=torch.float64)
                B = torch.zeros(32, 8, dtype=torch.float64)
                wsc = torch.zeros(16, dtype=torch.float64)
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    ra0, ra1 = _decode_e4m3_py(int(words[pair, ch, lane, 2 * t]))
                    ra2, ra3 = _decode_e4m3_py(int(words[pair, ch, lane, 2 * t + 1]))
                    for r, reg in enumerate((ra0, ra1, ra2, ra3)):  # PTX A map: a_r byte v
                        for v in range(4):
                            A[g + 8 * (r & 1), 4 * c + v + 16 * (r >> 1)] = _e4m3_value((reg >> (8 * v)) & 0xFF)
                    for r in range(2):  # PTX B map: b_r byte v = token g, k 4c + v + 16 r
                        for v in range(4):
                            B[4 * c + v + 16 * r, g] = _e4m3_value(int(xb[g, 32 * ch + 8 * c + 4 * r + v]))
                    wsc[g] = 2.0 ** (int(sp[pair, ch, g, 2 * t]) - 127)
                    wsc[g + 8] = 2.0 ** (int(sp[pair, ch, g, 2 * t + 1]) - 127)
                xsc = torch.tensor([2.0 ** (int(x_s[n, ch]) - 121) for n in range(8)], dtype=torch.float64)
                C += (A @ B) * wsc[:, None] * xsc[None, :]
            regs = [[C[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] for i in range(4)] for lane in range(32)]
            for row in range(16):
                for n in range(8):
                    flat = ((row % 8) * 4 + n // 2) * 4 + (row // 8) * 2 + n % 2
                    y[32 * pair + 16 * t + row, n] = regs[flat // 4][flat % 4]
    want = dense @ dequantize_mxfp8(x_q, x_s, torch.float64).T
    assert torch.allclose(y, want, rtol=1e-12, atol=1e-12)
