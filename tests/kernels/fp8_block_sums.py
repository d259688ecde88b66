"""A CPU model of the FP8 family's 32-K block sums, for the numerics tests
(issue 36 item 4; not a kernel).

Hopper's FP8 tensor cores do not sum a wgmma m64n8k32 block in fp32: the
products are aligned to the largest one and kept to about 13 fraction bits,
truncated (DeepSeek-V3 report 3.3.2; Khattak & Mikaitis 2025, "Accurate
Models of NVIDIA Tensor Cores"). `block_sums` models that: each product
truncated toward zero to a multiple of 2^(emax - bits), emax the exponent of
the block's largest product, and the sum truncated to `bits` fraction bits.
With bits=13 the model moves 0.2-0.4 % of GEMM1's H bytes one e4m3 code
against the fp64 oracle, as the H200 does (99.67 % equal: docs/perf-notes.md,
v7 "Numerics").

`two_planes` is the candidate fix: x split per 32-block into a high plane
(elements within 2^-shift of the block's largest) and the rest, one wgmma
each into its own fresh result, the two results added in fp32. The high
plane's products then lie within 8 binades of their maximum (e2m1 weights
span 2^3.6, x 2^shift), so its truncation drops nothing, and the low
plane's largest product is 2^shift smaller, so is its truncation.
"""

from __future__ import annotations

import torch

MX_BLOCK = 32


def block_sums(a: torch.Tensor, b: torch.Tensor, bits: int | None = 13) -> torch.Tensor:
    """Per-32-block dot products of a [R, K] with b [K] (float64 element
    values, unscaled), [R, K/32]: exact with bits=None, else the truncating
    tensor-core model above."""
    p = (a * b).unflatten(-1, (-1, MX_BLOCK))
    if bits is None:
        return p.sum(-1)
    top = p.abs().amax(-1, keepdim=True)
    quantum = torch.exp2(torch.floor(torch.log2(torch.where(top > 0, top, 1.0))) - bits)
    s = (torch.trunc(p / quantum) * quantum).sum(-1)
    mag = s.abs()
    q2 = torch.exp2(torch.floor(torch.log2(torch.where(mag > 0, mag, 1.0))) - bits)
    return torch.trunc(s / q2) * q2


def two_planes(b: torch.Tensor, shift: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) with hi + lo == b: hi holds the elements of each 32-block with
    |b| >= block max x 2^-shift, lo the others (zeros elsewhere)."""
    blocks = b.unflatten(-1, (-1, MX_BLOCK))
    top = blocks.abs().amax(-1, keepdim=True)
    hi = torch.where(blocks.abs() >= top * 2.0**-shift, blocks, torch.zeros_like(blocks)).flatten(-2)
    return hi, b - hi


def two_plane_block_sums(a: torch.Tensor, b: torch.Tensor, bits: int = 13, shift: int = 4) -> torch.Tensor:
    """The candidate fix: one modelled wgmma per plane, the results added in fp32."""
    hi, lo = two_planes(b, shift)
    return (block_sums(a, hi, bits).float() + block_sums(a, lo, bits).float()).double()


def accumulate_fp32(parts: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 accumulator over K blocks in order: acc += part x scale ([R, nb] -> [R])."""
    terms = (parts * scales).float()
    acc = torch.zeros(terms.shape[0], dtype=torch.float32)
    for blk in range(terms.shape[1]):
        acc = acc + terms[:, blk]
    return acc


def two_planes_bytes(q: torch.Tensor, shift: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's split (`fp4.split_planes`) on e4m3 bytes (uint8 [..., K]):
    (hi, lo) bytes, hi keeping each 32-block's bytes whose magnitude byte
    (& 0x7F) is >= the block's largest - 8 x shift, lo the others, 0 elsewhere."""
    blocks = q.unflatten(-1, (-1, MX_BLOCK))
    mag = (blocks & 0x7F).to(torch.int32)
    keep = mag >= (mag.amax(-1, keepdim=True) - 8 * shift).clamp_min(0)
    hi = torch.where(keep, blocks, torch.zeros_like(blocks))
    return hi.flatten(-2), torch.where(keep, torch.zeros_like(blocks), blocks).flatten(-2)
