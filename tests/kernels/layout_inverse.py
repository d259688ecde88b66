"""Inverses of the kernels' weight layouts (`kernels.layout.to_kernel_layout`,
`kernels.shared_expert.to_shared_layout`), the tests' proof that the packing
loses nothing and puts every code where the decoder reads it. Imported by
name (tests/ has no __init__.py)."""

from __future__ import annotations

import torch

from moebench.formats import ExpertWeights
from moebench.kernels.layout import OPERANDS, KernelWeights, code_bit_position
from moebench.kernels.shared_expert import M_TILE, SharedExpertWeights
from moebench.models import MX_BLOCK


def unpack_rows(packed: torch.Tensor, scales: torch.Tensor, operand: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_rows` (the same `operand`): (uint8 [E, M, K/2], uint8
    [E, M, K/32]). Raises ValueError for an unknown operand."""
    if operand not in OPERANDS:
        raise ValueError(f"operand must be one of {OPERANDS}, got {operand!r}")
    e, p, ch = packed.shape[:3]
    m, k = 32 * p, 32 * ch
    w = packed.to(torch.int64).view(e, p, ch, 32, 4, 4)
    word = sum(w[..., i] << (8 * i) for i in range(4))  # [e, p, ch, 32 lanes, 4 words]
    word = word.view(e, p, ch, 8, 4, 2, 2)  # e p ch g c t j
    codes = torch.zeros(e, p, ch, 8, 4, 2, 2, 2, 2, 2, dtype=torch.int64, device=packed.device)
    for rh in range(2):
        for hh in range(2):
            for h in range(2):
                val = torch.zeros_like(word)
                for b in range(4):
                    val |= ((word >> code_bit_position(operand, rh, hh, h, b)) & 1) << b
                codes[..., rh, hh, h] = val
    # e p ch g c t j rh hh e_  ->  e p t rh g ch c j hh e_
    codes = codes.permute(0, 1, 5, 7, 3, 2, 4, 6, 8, 9).reshape(e, m, k // 2, 2)
    out = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    s = scales.view(e, p, ch, 8, 2, 2).permute(0, 1, 4, 5, 3, 2).reshape(e, m, ch)
    return out, s.contiguous()


def deinterleave_w13(t: torch.Tensor, i: int, ip: int) -> torch.Tensor:
    """Inverse of layout._interleave_w13: [E, 2I, X] -> [E, 2Ip, X] gate|up, padding zero."""
    e, x = t.shape[0], t.shape[2]
    v = t.view(e, i // 32, 2, 32, x)
    out = torch.zeros(e, 2 * ip, x, dtype=t.dtype, device=t.device)
    out[:, :i] = v[:, :, 0].reshape(e, i, x)
    out[:, ip : ip + i] = v[:, :, 1].reshape(e, i, x)
    return out


def from_kernel_layout(kw: KernelWeights) -> ExpertWeights:
    """Inverse of `to_kernel_layout` (padding restored as zeros). Raises
    TypeError for a non-KernelWeights, ValueError when its tensors' shapes do
    not match its hidden / intermediate."""
    if not isinstance(kw, KernelWeights):
        raise TypeError(f"kw must be a KernelWeights, got {type(kw).__name__}")
    i, ip, h = kw.intermediate, kw.padded_intermediate, kw.hidden
    e = kw.experts
    want = {
        "w13": (e, 2 * i // 32, h // 32, 32, 16), "w13_scale": (e, 2 * i // 32, h // 32, 8, 4),
        "w2": (e, h // 32, i // 32, 32, 16), "w2_scale": (e, h // 32, i // 32, 8, 4),
    }  # fmt: skip
    for name, shape in want.items():
        got = tuple(getattr(kw, name).shape)
        if got != shape:
            raise ValueError(
                f"kw.{name} is {got}, but hidden={h} / intermediate={i} need {shape}"
                " (KernelWeights fields edited apart?)"
            )
    w13, w13_s = unpack_rows(kw.w13, kw.w13_scale, kw.operand)
    w2, w2_s = unpack_rows(kw.w2, kw.w2_scale, kw.operand)
    w2_full = torch.zeros(e, h, ip // 2, dtype=torch.uint8, device=kw.device)
    w2s_full = torch.zeros(e, h, ip // MX_BLOCK, dtype=torch.uint8, device=kw.device)
    w2_full[:, :, : i // 2], w2s_full[:, :, : i // MX_BLOCK] = w2, w2_s
    return ExpertWeights(
        deinterleave_w13(w13, i, ip), deinterleave_w13(w13_s, i, ip), w2_full, w2s_full,
        kw.clamp.clone(), intermediate=i,
    )  # fmt: skip


def unpack_weight(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_weight`: BF16 [M/16, K/16, 32, 8] -> [M, K]."""
    if not isinstance(p, torch.Tensor) or p.dim() != 4 or tuple(p.shape[2:]) != (32, 8) or p.shape[1] % 2:
        raise ValueError(f"p must be [M/16, K/16 (even), 32, 8], got {tuple(getattr(p, 'shape', ()))}")
    mt, ks = p.shape[:2]
    v = p.contiguous().view(mt, ks // 2, 2, 8, 4, 2, 2, 2)  # t q j g c kh rh e
    v = v.permute(0, 6, 3, 1, 4, 2, 5, 7)  # t rh g q c j kh e
    return v.reshape(mt * M_TILE, ks * M_TILE).contiguous()


def from_shared_layout(sw: SharedExpertWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `to_shared_layout`: (w1, w3, w2) BF16 on sw's device."""
    if not isinstance(sw, SharedExpertWeights):
        raise TypeError(f"sw must be a SharedExpertWeights, got {type(sw).__name__}")
    h, i = sw.hidden, sw.intermediate
    w13 = unpack_weight(sw.w13).view(i // 8, 2, 8, h)
    return w13[:, 0].reshape(i, h).contiguous(), w13[:, 1].reshape(i, h).contiguous(), unpack_weight(sw.w2)
