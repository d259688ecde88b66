"""The bytes a layer call moves: distinct local experts of a routing, the
size of an MXFP4 matrix, and the touched experts' bytes in some layout plus
the activations. Backends (`Backend.read_bytes`) and the bench
(`bench.cases.unique_bytes`, the normalized count) both count with these,
so it sits below both."""

from __future__ import annotations

import torch

from moebench.models import MX_BLOCK, RankShape


def unique_experts(topk_ids: torch.Tensor, experts: int) -> int:
    """Distinct ids of `topk_ids` (any int tensor) that lie in [0, experts)."""
    ids = topk_ids.detach().reshape(-1).to("cpu", torch.int64)
    ids = ids[(ids >= 0) & (ids < experts)]
    return int(torch.unique(ids).numel())


def mxfp4_bytes(rows: int, k: int) -> int:
    """Bytes of an MXFP4 matrix [rows, k]: e2m1 nibbles (k/2 per row) and one
    E8M0 scale per 32 along k. Raises ValueError unless rows >= 0 and k is a
    non-negative multiple of 32."""
    for name, v in (("rows", rows), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if k % MX_BLOCK:
        raise ValueError(f"k must be a multiple of {MX_BLOCK}, got {k}")
    return rows * k // 2 + rows * k // MX_BLOCK


def touched_bytes(shape: RankShape, topk_ids: torch.Tensor, expert_bytes: int) -> int:
    """Bytes one layer call moves when each distinct local expert of
    `topk_ids` [rows, top_k] (ids in [0, E)) costs `expert_bytes` (weights and
    scales in some layout), plus x in (bf16 rows*H*2) and the output
    (rows*H*2). Raises ValueError unless topk_ids is 2-D with top_k columns
    and expert_bytes an int >= 0."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[1] != shape.top_k:
        raise ValueError(
            f"topk_ids must be a [rows, {shape.top_k}] tensor, got {getattr(topk_ids, 'shape', topk_ids)!r}"
        )
    if not isinstance(expert_bytes, int) or isinstance(expert_bytes, bool) or expert_bytes < 0:
        raise ValueError(f"expert_bytes must be an int >= 0, got {expert_bytes!r}")
    rows = topk_ids.shape[0]
    return unique_experts(topk_ids, shape.experts) * expert_bytes + 2 * rows * shape.hidden * 2
