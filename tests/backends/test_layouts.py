"""Layout converters canonical -> FlashInfer / humming (`backends.layouts`) and
the torch model of FlashInfer's SM90 layouts the tests use (`sm90_layouts`;
its comparison with FlashInfer's own kernels is a GPU test in
test_flashinfer.py)."""

import pytest
import torch
import sm90_layouts as L

from moebench.backends.layouts import swap_halves, to_humming_logical
from moebench.formats import ExpertWeights, dequantize_mxfp4, generate_expert_weights
from moebench.models import MoEConfig


def small_weights(intermediate=96, hidden=256, experts=3, seed=0) -> ExpertWeights:
    shape = MoEConfig("tiny", hidden, intermediate, experts, 2).shard(1)
    return generate_expert_weights(shape, seed=seed)


def random_bytes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def test_swap_halves_is_an_involution_and_moves_gate_after_up():
    w = small_weights()
    ip = w.padded_intermediate
    s = swap_halves(w.w13)
    assert torch.equal(s[:, :ip], w.w13[:, ip:]) and torch.equal(s[:, ip:], w.w13[:, :ip])
    assert torch.equal(swap_halves(s), w.w13)
    assert s.is_contiguous()


def test_swap_halves_rejects_odd():
    with pytest.raises(ValueError, match="even"):
        swap_halves(torch.zeros(1, 3, 4, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(1, 64, 4), (2, 128, 8), (3, 640, 160), (1, 5120, 20)])
def test_scale_interleave_round_trip_and_shape(shape):
    s = random_bytes(*shape)
    f = L.interleave_scales(s)
    e, r, kg = shape
    assert tuple(f.shape) == (e, r // 64, kg // 4, 16, 16)
    assert torch.equal(L.deinterleave_scales(f), s)


def test_scale_interleave_block_content():
    """Each folded [16, 16] block holds the 64 rows x 4 scale groups of one
    64 x 128 block: folded row f, column 4*j + g = scale[row 16*j + f, group g]."""
    s = random_bytes(1, 128, 8)
    f = L.interleave_scales(s)
    for rb in range(2):
        for kb in range(2):
            for fr in (0, 7, 15):
                for j in range(4):
                    for g in range(4):
                        assert f[0, rb, kb, fr, 4 * j + g] == s[0, 64 * rb + 16 * j + fr, 4 * kb + g]


@pytest.mark.parametrize("shape,match", [((1, 96, 4), "multiple of 64"), ((1, 64, 6), "multiple of 128"),
                                         ((64, 4), "3-D")])  # fmt: skip
def test_scale_interleave_shape_rules(shape, match):
    with pytest.raises(ValueError, match=match):
        L.interleave_scales(torch.zeros(shape, dtype=torch.uint8))


def test_scale_interleave_needs_padded_intermediate():
    """dsv41-flash TP4: I = 576 is not a multiple of 128 (w2 K = 576) - the
    reason FlashInfer gets the padded 640."""
    with pytest.raises(ValueError, match="multiple of 128"):
        L.interleave_scales(torch.zeros(1, 128, 576 // 32, dtype=torch.uint8))
    assert tuple(L.interleave_scales(torch.zeros(1, 128, 640 // 32, dtype=torch.uint8)).shape) == (1, 2, 5, 16, 16)


@pytest.mark.parametrize("fwd,inv", [(L.interleave_fp4_weights, L.deinterleave_fp4_weights),
                                     (L.interleave_fp4_fp8_weights, L.deinterleave_fp4_fp8_weights)])  # fmt: skip
@pytest.mark.parametrize("shape", [(1, 16, 32), (2, 32, 64), (2, 48, 320)])
def test_weight_interleave_round_trip(fwd, inv, shape):
    w = random_bytes(*shape, seed=shape[1])
    y = fwd(w)
    assert y.shape == w.shape and y.dtype == torch.uint8
    assert not torch.equal(y, w)
    assert torch.equal(inv(y), w)


def test_weight_interleave_is_a_bit_permutation_per_block():
    """Bits move only inside one 16-row x 64-element block: popcount per block is kept."""
    w = random_bytes(1, 32, 64)
    y = L.interleave_fp4_weights(w)

    def popcounts(t):
        bits = ((t.to(torch.int32).unsqueeze(-1) >> torch.arange(8)) & 1).sum(-1)
        return bits.reshape(2, 16, 2, 32).sum((1, 3))

    assert torch.equal(popcounts(w), popcounts(y))


def test_weight_interleave_known_word():
    """Spot check of the kernel's first word: lane 0 of block 0 reads bytes
    [0,0], [8,0], [0,4], [8,4] and writes the permuted word at [0, 0..3]."""
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)
    w[0, 0, 0] = 0x01  # bit 0 of the word -> bit 6 (byte 0)
    w[0, 8, 0] = 0x80  # bit 15 -> bit 28 (byte 3)
    y = L.interleave_fp4_weights(w)
    assert y[0, 0, 0] == 0x40 and y[0, 0, 3] == 0x10
    assert int(y.to(torch.int32).sum()) == 0x40 + 0x10


def test_fp4_fp8_interleave_keeps_magnitudes_moves_signs():
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)
    w[0, 0, 0] = 0x77  # two magnitudes, no sign
    y = L.interleave_fp4_fp8_weights(w)
    assert y[0, 0, 0] == 0x77
    w[0, 0, 0] = 0x08  # the low nibble's sign (word bit 3) -> word bit 7
    y = L.interleave_fp4_fp8_weights(w)
    assert y[0, 0, 0] == 0x80


@pytest.mark.parametrize("shape,match", [((1, 24, 32), "multiple of 16"), ((1, 16, 16), "multiple of 64")])
def test_weight_interleave_shape_rules(shape, match):
    with pytest.raises(ValueError, match=match):
        L.interleave_fp4_weights(torch.zeros(shape, dtype=torch.uint8))


def test_flashinfer_w4a16_round_trip_keeps_padding():
    w = small_weights(intermediate=96)  # padded to 128
    assert w.padded_intermediate == 128 and w.padding_is_zero()
    fi = L.to_flashinfer_w4a16(w)
    assert tuple(fi.fc1.shape) == (3, 256, 128) and tuple(fi.fc2.shape) == (3, 256, 64)
    assert tuple(fi.fc1_scale.shape) == (3, 4, 2, 16, 16) and tuple(fi.fc2_scale.shape) == (3, 4, 1, 16, 16)
    back = L.from_flashinfer_w4a16(fi, w.intermediate)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        assert torch.equal(getattr(back, name), getattr(w, name)), name
    assert back.padding_is_zero()


def test_flashinfer_fc1_is_up_then_gate():
    """De-interleaving fc1 gives [up; gate]: its first half dequantizes to the up rows."""
    w = small_weights(intermediate=128)
    fi = L.to_flashinfer_w4a16(w)
    fc1 = L.deinterleave_fp4_weights(fi.fc1)
    s1 = L.deinterleave_scales(fi.fc1_scale)
    ip = w.padded_intermediate
    up = dequantize_mxfp4(w.w13[:, ip:], w.w13_scale[:, ip:])
    assert torch.equal(dequantize_mxfp4(fc1[:, :ip], s1[:, :ip]), up)


def test_humming_logical_drops_and_restores_padding():
    w = small_weights(intermediate=96)
    lg = to_humming_logical(w)
    i, ip = 96, 128
    assert tuple(lg.w13.shape) == (3, 2 * i, 128) and tuple(lg.w2.shape) == (3, 256, i // 2)
    assert tuple(lg.w13_scale.shape) == (3, 2 * i, 8) and tuple(lg.w2_scale.shape) == (3, 256, i // 32)
    assert torch.equal(lg.w13[:, :i], w.w13[:, :i]) and torch.equal(lg.w13[:, i:], w.w13[:, ip : ip + i])
    back = L.from_humming_logical(lg, ip)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        assert torch.equal(getattr(back, name), getattr(w, name)), name


def test_humming_logical_unpadded_is_identity():
    w = small_weights(intermediate=128)
    lg = to_humming_logical(w)
    assert torch.equal(lg.w13, w.w13) and torch.equal(lg.w2_scale, w.w2_scale)
    with pytest.raises(ValueError, match="below"):
        L.from_humming_logical(lg, 96)
