"""vLLM's routing alignment for block-M MoE GEMMs: the compiled
`moe_align_block_size` op of vllm==0.26.0 (`torch.ops._moe_C`, loaded by
`vllm_ops`) with the buffers vLLM's Python wrapper
(fused_moe/moe_align_block_size.py) gives it.

Semantics (vLLM's kernel, read from its source; the tests' `align_reference` loop
(tests/backends/baseline_checks.py) restates them): the top-k slots (t * top_k + k, flattened) are grouped
by expert in ascending expert order, each expert's group padded to a multiple
of `block`; sorted_ids[i] is a slot, or `numel` (= rows * top_k) for padding
and for the unused tail of the buffer; expert_ids[b] is the expert of block b
for b < num_tokens_post_pad / block and -1 after it; num_tokens_post_pad[0] is
the padded total. Within an expert the slot order is the kernel's (atomics:
not necessarily ascending). Ids must lie in [0, experts): vLLM's kernels assume
valid ids ("all entries of topk_ids are valid", deepep_ht.py) and express a
non-local expert as a valid global id that `expert_map` (int32 [experts],
global -> local id or -1) maps to -1; such slots are skipped. Buffer sizes:
`max_num_tokens_padded` and its block count.

Nothing is loaded at import; the op needs a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.backends import vllm_ops

#: The op's limit: one thread per expert in a 1024-thread scan (padded to warps).
MAX_EXPERTS = 991


def max_num_tokens_padded(numel: int, experts: int, block: int) -> int:
    """Length of vLLM's sorted_ids buffer for `numel` slots: numel + experts *
    (block - 1), capped at numel * block when there are fewer slots than
    experts (at most numel experts can be touched)."""
    if numel <= 0 or experts <= 0 or block <= 0:
        raise ValueError(f"numel, experts and block must be positive, got {numel}, {experts}, {block}")
    cap = numel + experts * (block - 1)
    if numel < experts:
        cap = min(numel * block, cap)
    return cap


def max_num_blocks(numel: int, experts: int, block: int) -> int:
    """Length of vLLM's expert_ids buffer: ceil(max_num_tokens_padded / block)."""
    return -(-max_num_tokens_padded(numel, experts, block) // block)


@dataclass
class AlignBuffers:
    """vLLM's three outputs: sorted_ids int32 [max_num_tokens_padded],
    expert_ids int32 [max_num_blocks], num_tokens_post_pad int32 [1]."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_pad: torch.Tensor
    block: int

    @classmethod
    def alloc(cls, numel: int, experts: int, block: int, device: torch.device | str) -> AlignBuffers:
        return cls(
            torch.empty(max_num_tokens_padded(numel, experts, block), dtype=torch.int32, device=device),
            torch.empty(max_num_blocks(numel, experts, block), dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
            block,
        )

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sorted_ids, self.expert_ids, self.num_tokens_post_pad


def _check(topk_ids: torch.Tensor, experts: int, block: int, expert_map: torch.Tensor | None) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [rows, top_k], got {getattr(topk_ids, 'shape', topk_ids)!r}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_ids.is_contiguous():
        raise TypeError(f"topk_ids must be contiguous int32 or int64, got {topk_ids.dtype}")
    if not isinstance(experts, int) or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be an int in [1, {MAX_EXPERTS}], got {experts!r}")
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if expert_map is not None:
        if expert_map.dtype != torch.int32 or tuple(expert_map.shape) != (experts,):
            raise ValueError(f"expert_map must be int32 [{experts}], got {expert_map.dtype} {tuple(expert_map.shape)}")
        if expert_map.device != topk_ids.device:
            raise ValueError(f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}")


def moe_align_block_size(
    topk_ids: torch.Tensor,
    experts: int,
    block: int,
    expert_map: torch.Tensor | None = None,
    out: AlignBuffers | None = None,
) -> AlignBuffers:
    """Run vLLM's op on `topk_ids` (contiguous int32/int64 [rows, top_k] on a
    CUDA device, every id in [0, experts)) into `out` (allocated when None,
    as vLLM's wrapper does per call) and return it. `expert_map` as vLLM's
    `ignore_invalid_experts=True` path passes it. No host sync. Raises
    TypeError/ValueError for bad arguments, RuntimeError when the library is
    unavailable."""
    _check(topk_ids, experts, block, expert_map)
    numel = topk_ids.numel()
    if out is None:
        out = AlignBuffers.alloc(numel, experts, block, topk_ids.device)
    elif (out.block != block or out.sorted_ids.numel() != max_num_tokens_padded(numel, experts, block)
          or out.expert_ids.numel() != max_num_blocks(numel, experts, block)):  # fmt: skip
        raise ValueError(f"out buffers do not fit {numel} slots, {experts} experts, block {block}")
    ops = vllm_ops.load("moe")
    ops.moe_align_block_size(
        topk_ids, experts, block, out.sorted_ids, out.expert_ids, out.num_tokens_post_pad, expert_map
    )
    return out
