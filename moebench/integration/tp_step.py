"""A real TP-N decode-step MoE layer: per-rank I/tp slices + all-reduce.

Every rank holds all E experts at intermediate I/tp (models.MoEConfig.shard):
rank r owns gate/up rows [r*I/tp, (r+1)*I/tp) of w13 and the same columns of
w2, zero-padded to a multiple of 128. Each rank runs the routed-expert path
on its slice (the reference path, or any backend callable), finalizes its
partial (top-k weighting and routed scale are linear, so they commute with
the sum), and the layer output is the all-reduce(sum) of the partials
through torch.distributed.

Numerics vs the single-GPU oracle of the full, unsliced layer:
- "bf16" oracle (H not quantized): the slices partition the GEMM1 rows and
  the GEMM2 K dimension exactly (the MXFP4 blocks of w13 run along H and are
  untouched; those of w2 run along I and I/tp is a multiple of 32, so no w2
  block is cut), so the sum of partials equals the oracle up to the order of
  the fp accumulation.
- "mxfp8" oracle: H is quantized per 32-element block along I. With I/tp a
  multiple of 32 every block of a slice is a block of the unsliced H, so the
  scales coincide too; what differs is the rounding of each rank's partial
  before the all-reduce (a real NCCL step reduces BF16 partials, N roundings
  instead of one) and the accumulation order. A kernel whose H blocks did
  not align with the slice (I/tp not a multiple of 32, or a different block
  origin) would see different E8M0 scales per slice and differ by up to the
  MXFP8 quantization error of H (~2^-4 relative per element).
- "fp8_token": H is scaled by its per-row amax, which per slice is the amax
  of the slice only, so each rank quantizes H differently from the unsliced
  oracle (small, but not rounding-level, differences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moebench.formats import ExpertWeights
from moebench.models import INTERMEDIATE_ALIGN, MX_BLOCK
from moebench.moe_output import UnfinalizedMoEOutput, finalize
from moebench.reference import reference_moe

#: backend(rank_weights, x, topk_ids, topk_weights) -> finalized partial [rows, H]
#: (or an UnfinalizedMoEOutput, finalized here).
RankBackend = Callable[[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor], object]


def slice_expert_weights(full: ExpertWeights, tp: int) -> list[ExpertWeights]:
    """The `tp` ranks' ExpertWeights of the unsliced `full` (its logical
    intermediate I, any padding ignored): rank r gets gate rows, up rows and
    w2 columns [r*I/tp, (r+1)*I/tp) (values and E8M0 scales, bytes copied
    as-is), padded with zeros to a multiple of 128. Raises ValueError unless
    I/tp is a positive multiple of 32 (as MoEConfig.shard requires)."""
    _check_split(full, tp)
    return [_slice_rank(full, tp, r) for r in range(tp)]


def _check_split(full: ExpertWeights, tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    i = full.intermediate
    if i % tp or (i // tp) % MX_BLOCK:
        raise ValueError(f"tp={tp}: intermediate {i} does not split into multiples of {MX_BLOCK}")


def _slice_rank(full: ExpertWeights, tp: int, r: int) -> ExpertWeights:
    i, ip = full.intermediate, full.padded_intermediate
    s = i // tp
    sp = -(-s // INTERMEDIATE_ALIGN) * INTERMEDIATE_ALIGN
    e, h = full.experts, full.hidden
    lo, hi = r * s, (r + 1) * s
    w13 = full.w13.new_zeros(e, 2 * sp, h // 2)
    w13s = full.w13_scale.new_zeros(e, 2 * sp, h // MX_BLOCK)
    w13[:, :s], w13[:, sp : sp + s] = full.w13[:, lo:hi], full.w13[:, ip + lo : ip + hi]
    w13s[:, :s], w13s[:, sp : sp + s] = full.w13_scale[:, lo:hi], full.w13_scale[:, ip + lo : ip + hi]
    w2 = full.w2.new_zeros(e, h, sp // 2)
    w2s = full.w2_scale.new_zeros(e, h, sp // MX_BLOCK)
    w2[:, :, : s // 2] = full.w2[:, :, lo // 2 : hi // 2]
    w2s[:, :, : s // MX_BLOCK] = full.w2_scale[:, :, lo // MX_BLOCK : hi // MX_BLOCK]
    return ExpertWeights(w13, w13s, w2, w2s, full.clamp.clone(), intermediate=s)


def reference_backend(activation: str = "bf16", dtype: torch.dtype = torch.float64) -> RankBackend:
    """The oracle's path as a rank backend (finalized partial in `dtype`)."""

    def run(weights, x, topk_ids, topk_weights):
        return reference_moe(x, topk_ids, topk_weights, weights, activation=activation, dtype=dtype).output

    return run


def tp_moe_step(
    rank_weights: ExpertWeights,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    backend: RankBackend | None = None,
    activation: str = "bf16",
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One decode step of the MoE layer on this rank: the routed path on this
    rank's slice (`backend`, default the reference path with `activation` in
    fp64), finalize, x `scale`, + `shared` on group rank 0 only (the shared
    expert's output, counted once), then all_reduce(SUM) over `group` (the
    default group when None). The partial is cast to `reduce_dtype` (default:
    its own dtype) for the reduction, as a real step reduces BF16. Returns the
    full layer output [rows, H], identical on every rank. Needs an initialized
    torch.distributed; raises RuntimeError otherwise."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_moe_step needs torch.distributed initialized (init_process_group)")
    run = backend or reference_backend(activation)
    part = run(rank_weights, x, topk_ids, topk_weights)
    if isinstance(part, UnfinalizedMoEOutput):
        part = finalize(part)
    if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(x.shape):
        raise ValueError(f"backend returned {getattr(part, 'shape', type(part).__name__)}, expected {tuple(x.shape)}")
    part = part * scale if scale != 1.0 else part.clone()
    if shared is not None and dist.get_rank(group) == 0:
        part = part + shared.to(part.dtype)
    if reduce_dtype is not None:
        part = part.to(reduce_dtype)
    part = part.contiguous()
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return part


def rank_slice(full: ExpertWeights, tp: int, rank: int) -> ExpertWeights:
    """Just rank `rank`'s slice (see slice_expert_weights), without copying
    the other ranks' slices. Raises ValueError for a bad tp or rank."""
    _check_split(full, tp)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must lie in [0, {tp}), got {rank!r}")
    return _slice_rank(full, tp, rank)


def partial_sum_check(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of partial outputs without a process group (a single-process
    check of the slicing: equals what the all-reduce returns)."""
    return torch.stack([p.to(torch.float64) for p in parts]).sum(0)
