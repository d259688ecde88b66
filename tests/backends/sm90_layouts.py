"""The FlashInfer SM90 layouts, modelled bit for bit in torch, and the inverse
of `layouts.to_humming_logical`: the tests' oracle of what FlashInfer's own
kernels (`backends.flashinfer`'s prepare) and humming's padding do.

FlashInfer 0.7.2.post1, SM90 mixed-input MoE (`cutlass_fused_moe` with
`use_w4_group_scaling=True`):
- fc1 rows in [up; gate] order: `swap_halves` (an involution);
- packed weights interleaved per 16-row x 64-column block for the mixed-input
  GEMM (`interleave_fp4_weights` = FlashInfer's kernel for quant_type "fp4",
  `interleave_fp4_fp8_weights` = quant_type "fp4_fp8" of the humming mode,
  re-implemented here bit for bit; both are bit permutations, inverted by
  `deinterleave_*`). Rules: rows % 16 == 0, K % 64 == 0;
- E8M0 scales folded per 64 rows x 128 K (`interleave_scales`, FlashInfer's
  `interleave_moe_scales_for_sm90_mixed_gemm`): [E, R, K/32] ->
  [E, R/64, K/128, 16, 16]. Rules: R % 64 == 0, K % 128 == 0 - why the
  intermediate stays padded to 128 for FlashInfer (576 = 4.5 x 128 fails);
- the humming (W4A8) mode also clamps each expert's E8M0 range to 11 binades
  and rewrites the FP4 payload of the clamped blocks: lossy, no way back; that
  step is FlashInfer's own torch code (`preprocess_moe_weights_for_sm90_mixed_gemm_humming`).

Everything here runs on any device (CPU included) with torch ops only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from moebench.backends.layouts import HummingLogical, swap_halves
from moebench.formats import ExpertWeights
from moebench.models import MX_BLOCK

# --- scale fold (FlashInfer interleave_moe_scales_for_sm90_mixed_gemm) --------------------

SCALE_ROWS = 64
SCALE_K = 128


def _scale_geometry(scales: torch.Tensor) -> tuple[int, int, int, int, int]:
    if not isinstance(scales, torch.Tensor) or scales.dim() != 3:
        raise ValueError(f"scales must be a 3-D tensor [E, rows, K/{MX_BLOCK}], got {getattr(scales, 'shape', scales)}")
    if scales.element_size() != 1:
        raise TypeError(f"scales must be 1-byte E8M0 codes, got {scales.dtype}")
    e, rows, kgs = scales.shape
    groups = SCALE_K // MX_BLOCK  # 4 scale groups per 128 K
    cols = 16  # 16 one-byte scales per 16 B
    slices = cols // groups  # 4 row slices per 64-row block
    folded = SCALE_ROWS // slices  # 16 folded rows
    if rows % SCALE_ROWS:
        raise ValueError(f"scale rows {rows} must be a multiple of {SCALE_ROWS}")
    if kgs % groups:
        raise ValueError(f"K = {kgs * MX_BLOCK} must be a multiple of {SCALE_K} (K/32 = {kgs} groups)")
    return e, rows, kgs, slices, folded


def interleave_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales uint8 [E, R, K/32] -> FlashInfer's SM90 folded layout
    [E, R/64, K/128, 16, 16] (each 64-row x 128-K block stored as 16 rows of
    16 bytes). Same bytes as `interleave_moe_scales_for_sm90_mixed_gemm(s)`.
    Raises ValueError unless R % 64 == 0 and K % 128 == 0."""
    e, rows, kgs, slices, folded = _scale_geometry(scales)
    groups = SCALE_K // MX_BLOCK
    k128 = kgs // groups
    return (
        scales.reshape(e, rows // SCALE_ROWS, slices, folded, k128, groups)
        .permute(0, 1, 4, 3, 2, 5)
        .contiguous()
        .reshape(e, rows // SCALE_ROWS, k128, folded, slices * groups)
    )


def deinterleave_scales(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_scales`: [E, R/64, K/128, 16, 16] -> [E, R, K/32]."""
    if not isinstance(folded, torch.Tensor) or folded.dim() != 5 or tuple(folded.shape[3:]) != (16, 16):
        raise ValueError(f"folded scales must be [E, R/64, K/128, 16, 16], got {getattr(folded, 'shape', folded)}")
    e, rb, k128, fm, cols = folded.shape
    groups = SCALE_K // MX_BLOCK
    slices = cols // groups
    return (
        folded.reshape(e, rb, k128, fm, slices, groups)
        .permute(0, 1, 4, 3, 2, 5)
        .contiguous()
        .reshape(e, rb * SCALE_ROWS, k128 * groups)
    )


# --- weight interleave (FlashInfer moe_gemm_mixed_utils.cu, bit for bit) ------------------

#: (mask, shift) pairs of interleave_fp4_weights_for_sm90_mixed_gemm_kernel: a permutation
#: of the 32 bits of the 4-byte word [r, c], [r+8, c], [r, c+4], [r+8, c+4].
_FP4_BIT_MOVES = (
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
)  # fmt: skip
#: preprocess_fp4x8_signs_for_fp8 of the fp4_fp8 kernel: exponent/mantissa bits stay, the
#: eight sign bits are permuted.
_FP4_FP8_BIT_MOVES = (
    (0x77777777, 0),
    (0x00000008, 4), (0x00000080, 8), (0x00000800, 12), (0x00008000, 16),
    (0x00080000, -16), (0x00800000, -12), (0x08000000, -8), (0x80000000, -4),
)  # fmt: skip


@lru_cache(maxsize=None)
def _bit_permutation(moves: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """dst bit of each src bit 0..31 under `moves`; checks it is a permutation."""
    dst = [-1] * 32
    for mask, shift in moves:
        for b in range(32):
            if mask >> b & 1:
                if dst[b] != -1:
                    raise AssertionError(f"bit {b} moved twice")
                dst[b] = b + shift
    if sorted(dst) != list(range(32)):
        raise AssertionError(f"bit moves are not a permutation: {dst}")
    return tuple(dst)


def _permute_bits(words: torch.Tensor, moves: tuple[tuple[int, int], ...], inverse: bool) -> torch.Tensor:
    """Apply the bit permutation of `moves` (or its inverse) to int64 words holding uint32."""
    perm = _bit_permutation(moves)
    out = torch.zeros_like(words)
    for src, dst in enumerate(perm):
        a, b = (dst, src) if inverse else (src, dst)
        out |= ((words >> a) & 1) << b
    return out


def _check_packed(w: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.uint8:
        raise ValueError(
            f"{name} must be a uint8 tensor [E, n, K/2], got {getattr(w, 'dtype', type(w))} "
            f"{tuple(getattr(w, 'shape', ()))}"
        )
    e, n, kb = w.shape
    if n % 16:
        raise ValueError(f"{name}: n = {n} rows must be a multiple of 16")
    if (2 * kb) % 64:
        raise ValueError(f"{name}: K = {2 * kb} must be a multiple of 64")
    return e, n, kb


@dataclass(frozen=True)
class _WordMap:
    """Source byte offsets (4 per output word) and output byte offsets of one expert."""

    src: torch.Tensor  # int64 [words, 4]: bytes forming each uint32 (little endian)
    dst: torch.Tensor  # int64 [words]: first output byte of each word (4 consecutive)


@lru_cache(maxsize=32)
def _fp4_word_map(n: int, kb: int) -> _WordMap:
    """interleave_fp4_weights_for_sm90_mixed_gemm_kernel, for all (block, partition, lane):
    block_id < n/2, partition < K/64, lane < 16 (blockDim.x = 16)."""
    block = torch.arange(n // 2).view(-1, 1, 1)
    part = torch.arange(kb // 32).view(1, -1, 1)
    lane = torch.arange(16).view(1, 1, -1)
    row = block // 8 * 16 + block % 8
    mma = lane // 4
    dst_row = row + (mma % 2) * 8
    col = part * 32 + mma * 8 + lane % 4
    dst_col = part * 32 + lane // 8 * 16 + lane % 4 * 4
    first = row * kb + col
    second = (row + 8) * kb + col
    src = torch.stack(torch.broadcast_tensors(first, second, first + 4, second + 4), -1).reshape(-1, 4)
    dst = (dst_row * kb + dst_col).expand(n // 2, kb // 32, 16).reshape(-1)
    return _WordMap(src, dst)


@lru_cache(maxsize=32)
def _fp4_fp8_word_map(n: int, kb: int) -> _WordMap:
    """interleave_fp4_fp8_weights_for_sm90_mixed_gemm_kernel in uint16 units: lane < 16
    reads u16 [row, p*16+lane] and [row+8, p*16+lane], writes them to dst_col, dst_col+1."""
    cols16 = kb // 2
    block = torch.arange(n // 2).view(-1, 1, 1)
    part = torch.arange(kb // 32).view(1, -1, 1)
    lane = torch.arange(16).view(1, 1, -1)
    row = block // 8 * 16 + block % 8
    dst_row = row + (lane % 8) // 4 * 8
    dst_col = part * 16 + (lane // 8) * 8 + lane % 4 * 2
    col = part * 16 + lane
    a = (row * cols16 + col) * 2
    b = ((row + 8) * cols16 + col) * 2
    src = torch.stack(torch.broadcast_tensors(a, a + 1, b, b + 1), -1).reshape(-1, 4)
    dst = ((dst_row * cols16 + dst_col) * 2).reshape(-1)
    return _WordMap(src, dst)


def _interleave(w: torch.Tensor, wmap: _WordMap, moves, inverse: bool) -> torch.Tensor:
    e = w.shape[0]
    flat = w.reshape(e, -1)
    src, dst = wmap.src.to(w.device), wmap.dst.to(w.device)
    shifts = torch.tensor([0, 8, 16, 24], device=w.device)
    offsets = torch.arange(4, device=w.device)
    out = torch.empty_like(flat)
    if not inverse:
        words = (flat[:, src].to(torch.int64) << shifts).sum(-1)
        words = _permute_bits(words, moves, inverse=False)
        out[:, (dst.unsqueeze(-1) + offsets)] = ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)
    else:
        words = (flat[:, dst.unsqueeze(-1) + offsets].to(torch.int64) << shifts).sum(-1)
        words = _permute_bits(words, moves, inverse=True)
        out[:, src] = ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)
    return out.reshape(w.shape)


def interleave_fp4_weights(w: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 uint8 [E, n, K/2] -> FlashInfer's SM90 mixed-GEMM layout for
    BF16 activations (= `interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`),
    same shape. Raises ValueError unless n % 16 == 0 and K % 64 == 0."""
    _, n, kb = _check_packed(w, "w")
    return _interleave(w, _fp4_word_map(n, kb), _FP4_BIT_MOVES, inverse=False)


def deinterleave_fp4_weights(w: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_fp4_weights`."""
    _, n, kb = _check_packed(w, "w")
    return _interleave(w, _fp4_word_map(n, kb), _FP4_BIT_MOVES, inverse=True)


def interleave_fp4_fp8_weights(w: torch.Tensor) -> torch.Tensor:
    """Packed (humming-rewritten) MXFP4 uint8 [E, n, K/2] -> FlashInfer's layout
    for the FP8-activation (humming) mode (= quant_type "fp4_fp8"), same shape."""
    _, n, kb = _check_packed(w, "w")
    return _interleave(w, _fp4_fp8_word_map(n, kb), _FP4_FP8_BIT_MOVES, inverse=False)


def deinterleave_fp4_fp8_weights(w: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_fp4_fp8_weights`."""
    _, n, kb = _check_packed(w, "w")
    return _interleave(w, _fp4_fp8_word_map(n, kb), _FP4_FP8_BIT_MOVES, inverse=True)


# --- whole-layer conversions ----------------------------------------------------------------


@dataclass
class FlashInferW4A16Layout:
    """FlashInfer W4A16 tensors of one rank: fc1 uint8 [E, 2*Ip, H/2] ([up; gate],
    interleaved), fc1_scale uint8 [E, 2*Ip/64, H/128, 16, 16], fc2 uint8 [E, H, Ip/2]
    (interleaved), fc2_scale uint8 [E, H/64, Ip/128, 16, 16], swiglu_limit fp32 [E]."""

    fc1: torch.Tensor
    fc1_scale: torch.Tensor
    fc2: torch.Tensor
    fc2_scale: torch.Tensor
    swiglu_limit: torch.Tensor


def to_flashinfer_w4a16(weights: ExpertWeights, interleave_weights=interleave_fp4_weights) -> FlashInferW4A16Layout:
    """Canonical -> FlashInfer W4A16 (padded intermediate kept: the scale fold needs
    K % 128 == 0 for fc2). `interleave_weights` may be FlashInfer's own kernel
    (`lambda w: interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`) on the GPU."""
    return FlashInferW4A16Layout(
        fc1=interleave_weights(swap_halves(weights.w13)),
        fc1_scale=interleave_scales(swap_halves(weights.w13_scale)),
        fc2=interleave_weights(weights.w2.contiguous()),
        fc2_scale=interleave_scales(weights.w2_scale.contiguous()),
        swiglu_limit=weights.clamp.to(torch.float32).contiguous(),
    )


def from_flashinfer_w4a16(layout: FlashInferW4A16Layout, intermediate: int) -> ExpertWeights:
    """Inverse of `to_flashinfer_w4a16` (exact)."""
    return ExpertWeights(
        w13=swap_halves(deinterleave_fp4_weights(layout.fc1)),
        w13_scale=swap_halves(deinterleave_scales(layout.fc1_scale)),
        w2=deinterleave_fp4_weights(layout.fc2),
        w2_scale=deinterleave_scales(layout.fc2_scale),
        clamp=layout.swiglu_limit.clone(),
        intermediate=intermediate,
    )


def from_humming_logical(logical: HummingLogical, padded_intermediate: int) -> ExpertWeights:
    """Inverse of `to_humming_logical`: re-pads with zeros to `padded_intermediate`."""
    e, two_i, h2 = logical.w13.shape
    i, ip = two_i // 2, padded_intermediate
    if ip < i:
        raise ValueError(f"padded_intermediate {ip} is below the intermediate {i}")
    dev = logical.w13.device
    w13 = torch.zeros(e, 2 * ip, h2, dtype=torch.uint8, device=dev)
    w13s = torch.zeros(e, 2 * ip, h2 * 2 // MX_BLOCK, dtype=torch.uint8, device=dev)
    w13[:, :i], w13[:, ip : ip + i] = logical.w13[:, :i], logical.w13[:, i:]
    w13s[:, :i], w13s[:, ip : ip + i] = logical.w13_scale[:, :i], logical.w13_scale[:, i:]
    h = h2 * 2
    w2 = torch.zeros(e, h, ip // 2, dtype=torch.uint8, device=dev)
    w2s = torch.zeros(e, h, ip // MX_BLOCK, dtype=torch.uint8, device=dev)
    w2[:, :, : i // 2], w2s[:, :, : i // MX_BLOCK] = logical.w2, logical.w2_scale
    return ExpertWeights(w13, w13s, w2, w2s, logical.clamp.clone(), intermediate=i)
