"""Pure-torch weight-layout converters the baselines' prepare uses.

Canonical (formats.ExpertWeights): w13 uint8 [E, 2*Ip, H/2] with gate rows
[0, Ip) then up rows [Ip, 2*Ip), w13_scale uint8 [E, 2*Ip, H/32], w2 uint8
[E, H, Ip/2], w2_scale uint8 [E, H, Ip/32]; Ip = the intermediate padded to a
multiple of 128 with zero values and zero scales.

- FlashInfer's SM90 mixed-input MoE wants fc1 rows in [up; gate] order:
  `swap_halves` (an involution); FlashInfer's own kernels then interleave the
  weights and fold the scales (`backends.flashinfer`; the bit-exact torch
  model of those layouts the tests check them against is
  tests/backends/sm90_layouts.py).
- humming-kernels (vLLM's humming MoE backend) takes checkpoint tensors of
  the logical (unpadded) intermediate I, [gate; up] order, and pads them
  itself (N to 256, K to 128), as vLLM gives it the real I/tp:
  `to_humming_logical`.

Everything here runs on any device (CPU included) with torch ops only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.formats import ExpertWeights
from moebench.models import MX_BLOCK

# --- [gate; up] <-> [up; gate] ---------------------------------------------------------


def swap_halves(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """[A; B] -> [B; A] along `dim` (contiguous copy). Its own inverse: the
    canonical [gate; up] rows become FlashInfer's [up; gate] and back.
    Raises ValueError when that dim has an odd size."""
    n = t.shape[dim]
    if n % 2:
        raise ValueError(f"dim {dim} of shape {tuple(t.shape)} must be even to swap halves")
    a, b = t.split(n // 2, dim=dim)
    return torch.cat((b, a), dim=dim).contiguous()


@dataclass
class HummingLogical:
    """Checkpoint tensors of the logical intermediate I, as vLLM hands them to
    humming: w13 uint8 [E, 2I, H/2] ([gate; up]), w13_scale [E, 2I, H/32],
    w2 uint8 [E, H, I/2], w2_scale [E, H, I/32], clamp fp32 [E]."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    clamp: torch.Tensor


def to_humming_logical(weights: ExpertWeights) -> HummingLogical:
    """Canonical -> the unpadded [gate; up] tensors humming pads itself."""
    i, ip = weights.intermediate, weights.padded_intermediate

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[:, :i], t[:, ip : ip + i]), dim=1).contiguous()

    return HummingLogical(
        w13=rows(weights.w13),
        w13_scale=rows(weights.w13_scale),
        w2=weights.w2[:, :, : i // 2].contiguous(),
        w2_scale=weights.w2_scale[:, :, : i // MX_BLOCK].contiguous(),
        clamp=weights.clamp.to(torch.float32).contiguous(),
    )
