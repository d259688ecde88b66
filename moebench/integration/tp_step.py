"""One rank's slice of a layer's routed experts for a real TP-N decode step.

Every rank holds all E experts at intermediate I/tp (models.MoEConfig.shard):
rank r owns gate/up rows [r*I/tp, (r+1)*I/tp) of w13 and the same columns of
w2, zero-padded to a multiple of 128 (`rank_slice`). Each rank runs the
routed-expert path on its slice and finalizes its partial (top-k weighting
and routed scale are linear, so they commute with the sum); the layer output
is the all-reduce(sum) of the partials (`step_layer.DecodeStep.run`).

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

from moebench.formats import ExpertWeights
from moebench.models import INTERMEDIATE_ALIGN, MX_BLOCK


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


def rank_slice(full: ExpertWeights, tp: int, rank: int) -> ExpertWeights:
    """Rank `rank`'s ExpertWeights of the unsliced `full` (its logical
    intermediate I, any padding ignored): gate rows, up rows and w2 columns
    [rank*I/tp, (rank+1)*I/tp) (values and E8M0 scales, bytes copied as-is),
    padded with zeros to a multiple of 128. Raises ValueError unless I/tp is
    a positive multiple of 32 (as MoEConfig.shard requires) and rank lies in
    [0, tp)."""
    _check_split(full, tp)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must lie in [0, {tp}), got {rank!r}")
    return _slice_rank(full, tp, rank)
