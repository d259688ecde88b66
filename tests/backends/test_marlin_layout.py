"""marlin_layout: the torch half of vLLM's MXFP4 -> Marlin preparation (CPU)."""

import pytest
import torch

from moebench.backends import marlin_layout as ml
from moebench.formats import generate_expert_weights
from moebench.models import get_preset


def from_gptq_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `gptq_words`: int32 [E, K/8, N] -> uint8 [E, N, K/2]."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 3:
        raise ValueError(
            f"words must be int32 [E, K/8, N], got {getattr(words, 'dtype', type(words))} "
            f"{tuple(getattr(words, 'shape', ()))}"
        )
    e, k8, n = words.shape
    return words.transpose(1, 2).contiguous().view(torch.uint8).reshape(e, n, k8 * 4)


def from_marlin_scales(scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `marlin_scales`: uint8 [E, K/32, N] -> [E, N, K/32]."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() != 3:
        raise ValueError(f"scales must be uint8 [E, K/32, N], got {getattr(scales, 'dtype', type(scales))}")
    e, groups, n = scales.shape
    if n % ml.SCALE_RUN:
        raise ValueError(f"scales: N = {n} must be a multiple of {ml.SCALE_RUN}")
    inverse = torch.argsort(ml.scale_order()).to(scales.device)
    flat = scales.reshape(e, groups * n // ml.SCALE_RUN, ml.SCALE_RUN)[:, :, inverse]
    return flat.reshape(e, groups, n).transpose(1, 2).contiguous()


def test_float4_e2m1f_id_is_vllms():
    # vllm==0.26.0: scalar_types.float4_e2m1f.id, evaluated with vLLM's own scalar_type.py
    assert ml.FLOAT4_E2M1F_ID == 562949953487106
    # the packing, field by field: exponent 2, mantissa 1 << 8, signed << 16, finite-only << 49
    assert ml.FLOAT4_E2M1F_ID == 2 | 1 << 8 | 1 << 16 | 1 << 49
    assert ml.scalar_type_id(4, 3, True, 0, True, 2) == 4 | 3 << 8 | 1 << 16 | 1 << 49 | 2 << 50


def test_gptq_words_hand_case():
    # row 0 of expert 0 holds elements 0..7 = 0, 1, ..., 7 (even element in the low nibble)
    w = torch.zeros(1, 64, 4, dtype=torch.uint8)
    w[0, 0] = torch.tensor([0x10, 0x32, 0x54, 0x76], dtype=torch.uint8)
    w[0, 5] = torch.tensor([0xF0, 0, 0, 0x0A], dtype=torch.uint8)
    words = ml.gptq_words(w)
    assert words.shape == (1, 1, 64) and words.dtype == torch.int32
    assert int(words[0, 0, 0]) == 0x76543210
    assert int(words[0, 0, 5]) & 0xFFFFFFFF == 0x0A0000F0
    assert int(words[0, 0, 1]) == 0


def test_gptq_words_elementwise_and_round_trip():
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (3, 64, 32), dtype=torch.uint8, generator=g)
    words = ml.gptq_words(w)
    assert words.shape == (3, 8, 64)
    nibbles = torch.stack([(w & 0xF), (w >> 4)], -1).reshape(3, 64, 64).to(torch.int64)  # [E, N, K]
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    for i in range(8):  # element 8j + i of row n sits in bits 4i..4i+3 of word [j, n]
        got = (unsigned >> (4 * i)) & 0xF
        assert torch.equal(got, nibbles[:, :, i::8].transpose(1, 2))
    assert torch.equal(from_gptq_words(words), w)


def test_gptq_words_rejects_bad_input():
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        ml.gptq_words([1, 2])
    with pytest.raises(ValueError, match="uint8"):
        ml.gptq_words(torch.zeros(2, 64, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        ml.gptq_words(torch.zeros(2, 64, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int32"):
        from_gptq_words(torch.zeros(2, 3, 4, dtype=torch.int64))


def test_scale_order_hand_values():
    order = ml.scale_order()
    # 8 x 8 transpose (position 8a+b takes a+8b), then the middle two of each 4 swapped
    assert order[:8].tolist() == [0, 16, 8, 24, 32, 48, 40, 56]
    assert order[8:12].tolist() == [1, 17, 9, 25]
    assert order[60:].tolist() == [39, 55, 47, 63]
    assert sorted(order.tolist()) == list(range(64))


def test_marlin_scales_hand_case():
    s = torch.arange(64, dtype=torch.uint8).reshape(1, 64, 1)  # N = 64 rows, one K group: value n
    out = ml.marlin_scales(s)
    assert out.shape == (1, 1, 64)
    assert out[0, 0, :8].tolist() == [0, 16, 8, 24, 32, 48, 40, 56]


def _vllm_scale_path(codes: torch.Tensor) -> torch.Tensor:
    """The steps vLLM applies (per expert): E8M0 -> bf16, transpose, the
    grouped-scale permutation by runs of 64, the [0, 2, 1, 3] swap by runs
    of 4, back to E8M0. Written from the description, step by step."""
    e, n, groups = codes.shape
    out = []
    for i in range(e):
        s = codes[i].view(torch.float8_e8m0fnu).to(torch.bfloat16).t().contiguous()  # [K/32, N]
        perm = [a + 8 * b for a in range(8) for b in range(8)]
        s = s.reshape(-1, 64)[:, perm].reshape(-1, n)
        s = s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(groups, n)
        out.append(s.to(torch.float8_e8m0fnu).view(torch.uint8))
    return torch.stack(out)


def test_marlin_scales_equal_vllms_bf16_route_for_every_code():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (2, 128, 8), dtype=torch.uint8, generator=g)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every E8M0 code, 0 and 255 (NaN) included
    assert torch.equal(ml.marlin_scales(codes), _vllm_scale_path(codes))


def test_marlin_scales_round_trip_and_errors():
    codes = torch.randint(0, 256, (3, 192, 5), dtype=torch.uint8)
    assert torch.equal(from_marlin_scales(ml.marlin_scales(codes)), codes)
    with pytest.raises(ValueError, match="multiple of 64"):
        ml.marlin_scales(torch.zeros(1, 96, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        ml.marlin_scales(torch.zeros(1, 64, 4, dtype=torch.float32))
    with pytest.raises(TypeError):
        ml.marlin_scales(None)


def test_repacked_shape():
    assert ml.repacked_shape(n=2 * 640, k=5120) == (320, 2560)
    assert ml.repacked_shape(n=5120, k=640) == (40, 10240)


def test_check_marlin_shape():
    ml.check_marlin_shape(5120, 640)
    with pytest.raises(ValueError, match="hidden 4224 must be a multiple of 256"):
        ml.check_marlin_shape(4224, 640)
    with pytest.raises(ValueError, match="multiple of 128"):
        ml.check_marlin_shape(4096, 576)


def test_prepare_marlin_with_a_stand_in_repack():
    """Everything but the GPU repack: the per-expert calls get the GPTQ words
    and (size_k, size_n) vLLM passes; scales land in Marlin's order as
    float8_e8m0fnu; shapes match what the Marlin op checks."""
    shape = get_preset("dsv4-flash", experts=6, hidden=512, intermediate=192).shard(1)  # Ip = 256
    w = generate_expert_weights(shape, seed=2)
    calls = []

    def repack(words, size_k, size_n):
        calls.append((tuple(words.shape), size_k, size_n))
        return words.reshape(size_k // 16, size_n * 2)  # the right shape; not Marlin's permutation

    m = ml.prepare_marlin(w, repack)
    h, ip = 512, 256
    assert calls == [((h // 8, 2 * ip), h, 2 * ip)] * 6 + [((ip // 8, h), ip, h)] * 6
    assert m.w13.shape == (6, h // 16, 2 * 2 * ip) and m.w13.dtype == torch.int32
    assert m.w2.shape == (6, ip // 16, 2 * h)
    assert m.w13_scale.dtype == torch.float8_e8m0fnu and m.w13_scale.shape == (6, h // 32, 2 * ip)
    assert m.w2_scale.shape == (6, ip // 32, h)
    assert torch.equal(m.w13[1], ml.gptq_words(w.w13)[1].reshape(h // 16, 4 * ip))
    assert torch.equal(from_marlin_scales(m.w2_scale.view(torch.uint8)), w.w2_scale)
    assert (m.hidden, m.padded_intermediate, m.experts) == (h, ip, 6)
    # the intermediate padding stays zero: scale columns of the padded gate/up rows and w2's padded K groups
    s13 = from_marlin_scales(m.w13_scale.view(torch.uint8))
    assert int(s13[:, 192:256].count_nonzero()) == 0 and int(s13[:, 256 + 192 :].count_nonzero()) == 0
    assert int(m.w2_scale.view(torch.uint8)[:, 192 // 32 :].count_nonzero()) == 0
    assert m.nbytes() == 6 * ml.marlin_expert_bytes(h, ip)


def test_prepare_marlin_rejects_a_wrong_repack_and_bad_weights():
    shape = get_preset("dsv4-flash", experts=6, hidden=256, intermediate=128).shard(1)
    w = generate_expert_weights(shape)
    with pytest.raises(RuntimeError, match="repack returned"):
        ml.prepare_marlin(w, lambda words, k, n: torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="ExpertWeights"):
        ml.prepare_marlin({"w13": w.w13}, lambda *a: None)


def test_marlin_expert_bytes():
    # dsv41-flash TP4: H 5120, Ip 640: w13 2*640*5120/2 + /32, w2 5120*640/2 + /32
    h, ip = 5120, 640
    assert ml.marlin_expert_bytes(h, ip) == 2 * ip * h // 2 + 2 * ip * h // 32 + h * ip // 2 + h * ip // 32
