"""Two small kernels vLLM 0.26.0 runs around humming's GEMMs, as our own
Triton kernels (read from vLLM's source for what they do; written here):

- `swiglu_limit`: `fused_moe/utils.py:_swiglu_limit_torch`, the SwiGLU with
  DeepSeek-V4's clamp that `HummingExpertsBase.apply_activation` runs
  (`swiglu_limit_func` without top-k ids). vLLM compiles it with
  torch.compile into one generated kernel: silu(min(gate, L)) * clamp(up, -L,
  L) in fp32 from the BF16 [gate; up] rows, BF16 out. One launch here too.
- `moe_fused_mul_sum`: `fused_moe/moe_fused_mul_sum.py`, the top-k weighted
  sum `HummingIndexedExperts.apply` ends with: fp32 accumulation of the
  [rows, top_k, H] GEMM2 rows times the fp32 top-k weights (never rounded to
  BF16), with vLLM's SM90 tile heuristic; an `expert_map` masks other ranks'
  experts (the EP path). One launch.

Without Triton (the CPU) both fall back to torch ops computing the same
values (more launches: only the CPU tests run them). Nothing here imports
triton at module import.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernels():
    """(swiglu kernel, fused mul-sum kernel), or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: the torch fallbacks run
        return None

    @triton.jit
    def swiglu_kernel(in_ptr, out_ptr, half, limit, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < half
        gate = tl.load(in_ptr + row * 2 * half + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(in_ptr + row * 2 * half + half + cols, mask=inside, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * half + cols, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def mul_sum_kernel(in_ptr, w_ptr, out_ptr, ids_ptr, map_ptr, tokens, stride_m, HAS_MAP: tl.constexpr,
                       TOP_K: tl.constexpr, SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        m_mask = offs_m < tokens
        mask = m_mask[:, None] & (offs_k < SIZE)[None, :]
        base = in_ptr + (offs_m * stride_m)[:, None] + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n in tl.static_range(TOP_K):
            w = tl.load(w_ptr + offs_m * TOP_K + n, mask=m_mask, other=0.0).to(tl.float32)
            if HAS_MAP:
                e = tl.load(ids_ptr + offs_m * TOP_K + n, mask=m_mask, other=0)
                local = tl.load(map_ptr + e) >= 0
                a = tl.load(base + n * SIZE, mask=mask & local[:, None], other=0.0).to(tl.float32)
            else:
                a = tl.load(base + n * SIZE, mask=mask, other=0.0).to(tl.float32)
            acc += a * w[:, None]
        out = out_ptr + (offs_m * SIZE)[:, None] + offs_k[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return swiglu_kernel, mul_sum_kernel


SWIGLU_BLOCK = 1024


def swiglu_limit(out: torch.Tensor, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """out [M, I] = silu(min(gate, L)) * clamp(up, -L, L) of gate_up [M, 2I]
    ([gate | up] per row, contiguous), in fp32, stored in out's dtype."""
    m, half = out.shape
    if tuple(gate_up.shape) != (m, 2 * half) or not gate_up.is_contiguous() or not out.is_contiguous():
        raise ValueError(f"gate_up must be contiguous [{m}, {2 * half}] and out contiguous, got {tuple(gate_up.shape)}")
    kernels = _kernels() if out.is_cuda else None
    if kernels is None:
        gate, up = gate_up.float().chunk(2, dim=1)
        gate = gate.clamp(max=limit)
        out.copy_(torch.nn.functional.silu(gate) * up.clamp(-limit, limit))
        return out
    import triton

    kernels[0][(m, triton.cdiv(half, SWIGLU_BLOCK))](gate_up, out, half, float(limit), BLOCK=SWIGLU_BLOCK)
    return out


def mul_sum_config(tokens: int, size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages): vLLM's `_heuristic_config`
    on SM90 for 2-byte (BF16) rows."""
    block_m = 1 if tokens <= 4 else 2 if tokens <= 128 else 4
    block_k = max(min(1 << (size - 1).bit_length(), 512), 256)
    total = block_m * block_k
    return block_m, block_k, min(max(4, min(16, total // 256)), 8), 4 if total <= 2048 else 2


def moe_fused_mul_sum(
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H] = sum over k of topk_weights[t, k] * rows[t, k] (fp32 sum;
    rows [T, top_k, H] contiguous, weights fp32 [T, top_k]); with `expert_map`
    a slot whose expert maps to -1 adds nothing."""
    t, top_k, size = rows.shape
    if tuple(topk_weights.shape) != (t, top_k) or tuple(out.shape) != (t, size):
        raise ValueError(f"topk_weights must be [{t}, {top_k}] and out [{t}, {size}]")
    kernels = _kernels() if out.is_cuda else None
    if kernels is None:
        w = topk_weights.float()
        if expert_map is not None:
            w = torch.where(expert_map[topk_ids.long()] >= 0, w, 0.0)
        out.copy_((rows.float() * w.unsqueeze(-1)).sum(1))
        return out
    import triton

    block_m, block_k, warps, stages = mul_sum_config(t, size)
    kernels[1][(triton.cdiv(size, block_k), triton.cdiv(t, block_m))](
        rows, topk_weights, out, topk_ids, expert_map, t, top_k * size, expert_map is not None, top_k, size,
        block_m, block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
