"""Our Triton ports of vLLM's SwiGLU-with-limit and moe_fused_mul_sum
(backends/vllm_triton.py): the torch fallbacks against the reference math on
the CPU, vLLM's SM90 tile heuristic, and the Triton kernels against the
fallbacks on the GPU (`gpu`)."""

import pytest
import torch

from moebench.backends import vllm_triton as vt
from moebench.reference import swiglu_clamped


def _gate_up(m=5, half=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 2 * half, generator=g) * 8).to(torch.bfloat16)


def test_swiglu_limit_is_deepseek_v4s_clamped_swiglu():
    gu = _gate_up()
    out = torch.empty(5, 96, dtype=torch.bfloat16)
    vt.swiglu_limit(out, gu, 7.0)
    want = swiglu_clamped(gu[:, :96].float(), gu[:, 96:].float(), 7.0).to(torch.bfloat16)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        vt.swiglu_limit(out, gu[:, :100], 7.0)


def test_moe_fused_mul_sum_keeps_fp32_weights_and_masks_remote_experts():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(3, 4, generator=g) * 1.001  # not representable in bf16
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    vt.moe_fused_mul_sum(rows, w, out)
    want = (rows.double() * w.double().unsqueeze(-1)).sum(1)
    assert torch.allclose(out.double(), want, rtol=1e-2, atol=1e-2)
    ids = torch.tensor([[0, 1, 2, 3]] * 3, dtype=torch.int32)
    expert_map = torch.tensor([0, -1, 1, -1], dtype=torch.int32)
    vt.moe_fused_mul_sum(rows, w, out, ids, expert_map)
    kept = (rows[:, [0, 2]].double() * w[:, [0, 2]].double().unsqueeze(-1)).sum(1)
    assert torch.allclose(out.double(), kept, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tokens,size,want", [
    (1, 5120, (1, 512, 4, 4)), (4, 4096, (1, 512, 4, 4)), (6, 7168, (2, 512, 4, 4)),
    (8, 200, (2, 256, 4, 4)), (200, 5120, (4, 512, 8, 4)), (200, 8192, (4, 512, 8, 4)), (300, 64, (4, 256, 4, 4)),
])  # fmt: skip
def test_mul_sum_config_is_vllms_sm90_heuristic(tokens, size, want):
    assert vt.mul_sum_config(tokens, size) == want


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_kernels_equal_the_torch_forms(rows):
    if vt._kernels() is None:
        pytest.skip("Triton is not installed")
    gu = _gate_up(rows * 6, 1152, seed=rows).cuda()
    out = torch.empty(rows * 6, 1152, dtype=torch.bfloat16, device="cuda")
    vt.swiglu_limit(out, gu, 10.0)
    want = swiglu_clamped(gu[:, :1152].float(), gu[:, 1152:].float(), 10.0).to(torch.bfloat16)
    assert (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    parts = torch.randn(rows, 6, 5120, device="cuda").to(torch.bfloat16)
    w = torch.rand(rows, 6, device="cuda")
    got = torch.empty(rows, 5120, dtype=torch.bfloat16, device="cuda")
    vt.moe_fused_mul_sum(parts, w, got)
    exact = (parts.double() * w.double().unsqueeze(-1)).sum(1)
    assert torch.allclose(got.double(), exact, rtol=2**-7, atol=1e-2)
