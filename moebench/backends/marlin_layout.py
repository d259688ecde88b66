"""The torch half of vLLM's MXFP4 -> Marlin weight preparation (vllm==0.26.0,
`prepare_moe_mxfp4_layer_for_marlin` in quantization/utils/marlin_utils_fp4.py,
written here from its description, not copied).

vLLM pads a DeepSeek-V4 MXFP4 layer for its Marlin backend to I % 128 == 0
and H % 256 == 0 (`mxfp4_round_up_hidden_size_and_intermediate_size`): the
canonical Ip (formats.ExpertWeights) is that padded intermediate, so Marlin
reads exactly our padded tensors. Per expert and per GEMM (w13: N = 2*Ip,
K = H; w2: N = H, K = Ip; weights uint8 [E, N, K/2], scales uint8
[E, N, K/32]):

- weights: the packed bytes of one expert viewed as int32 and transposed,
  `gptq_words` -> int32 [K/8, N] (word [k/8, n] holds the nibbles of
  elements k..k+7 of row n, element k+j in bits 4j..4j+3: the GPTQ packing
  Marlin's repack reads), then vLLM's compiled `gptq_marlin_repack`
  (size_k=K, size_n=N, num_bits=4, no act-order perm) -> int32 [K/16, 2N]
  (`repacked_shape`). The repack is a GPU op: `prepare_marlin` takes it as a
  callable and calls it once per expert, as vLLM does;
- scales: E8M0 codes transposed to [K/32, N], each run of 64 consecutive
  values permuted by Marlin's grouped-scale permutation (an 8 x 8 transpose:
  `marlin_permute_scales` with group_size 32 < K) and then, within every 4,
  the middle two swapped (the "fp8 dequantization layout" step of
  `mxfp4_marlin_process_scales` for 16-bit activations); the result is read
  as float8_e8m0fnu [K/32, N]. vLLM routes the codes through bf16 on the
  way (e8m0 -> bf16 -> permute -> e8m0); every code 0..255 survives that
  round trip unchanged, so permuting the codes is the same bytes.

Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from moebench.formats import ExpertWeights
from moebench.models import MX_BLOCK

#: Marlin's scale permutation works on runs of this many values.
SCALE_RUN = 64
#: vLLM's MXFP4 padding for Marlin (oracle/mxfp4.py): intermediate to 128, hidden to 256.
PAD_INTERMEDIATE, PAD_HIDDEN = 128, 256
#: Marlin's tile: the packed K dimension of a repacked weight is K / TILE.
TILE = 16


def scalar_type_id(
    exponent: int, mantissa: int, signed: bool, bias: int = 0, finite_values_only: bool = False, nan_repr: int = 1
) -> int:
    """vLLM's ScalarType id (scalar_type.py `ScalarType.id`): the fields packed
    little-end first into one int64 - exponent 8 bits, mantissa 8, signed 1,
    bias 32, finite_values_only 1, nan_repr 8 (0 none, 1 IEEE 754, 2 extended
    range). The compiled Marlin op decodes its `b_type_id` argument from it."""
    fields = ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1), (nan_repr, 8))
    value, offset = 0, 0
    for field, bits in fields:
        value |= (int(field) & ((1 << bits) - 1)) << offset
        offset += bits
    return value


#: `scalar_types.float4_e2m1f` = ScalarType.float_(2, 1, finite_values_only=True, NanRepr.NONE).
FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, 0)


def _check_packed(w: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype != torch.uint8 or w.dim() != 3:
        raise ValueError(f"{name} must be uint8 [E, N, K/2], got {w.dtype} {tuple(w.shape)}")
    e, n, kb = w.shape
    if (2 * kb) % 8 or not n or not kb:
        raise ValueError(f"{name}: K = {2 * kb} must be a positive multiple of 8 (8 nibbles per int32 word)")
    return e, n, 2 * kb


def gptq_words(w: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 uint8 [E, N, K/2] (even element in the low nibble) ->
    int32 [E, K/8, N] in GPTQ order: word [e, j, n] = bytes 4j..4j+3 of row n
    little-endian, i.e. element 8j+i of row n in bits 4i..4i+3 (vLLM:
    `weight.view(torch.int32).T.contiguous()` per expert). Raises
    TypeError/ValueError unless K % 8 == 0."""
    e, n, k = _check_packed(w, "w")
    return w.contiguous().view(torch.int32).reshape(e, n, k // 8).transpose(1, 2).contiguous()


def repacked_shape(n: int, k: int) -> tuple[int, int]:
    """Shape of one expert's `gptq_marlin_repack` output for 4-bit weights of
    N output rows and K inputs: (K / 16, N * 16 / 8) int32."""
    return k // TILE, n * TILE // 8


@lru_cache(maxsize=1)
def scale_order() -> torch.Tensor:
    """int64 [64]: out[i] = in[scale_order()[i]] within every run of 64 scale
    values - Marlin's grouped-scale permutation (position 8a+b takes value
    a+8b, an 8 x 8 transpose), then the middle two of every 4 swapped."""
    transposed = torch.arange(SCALE_RUN).reshape(8, 8).t().reshape(SCALE_RUN)
    return transposed.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(SCALE_RUN).contiguous()


def _check_scales(scales: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.uint8 or scales.dim() != 3:
        raise ValueError(f"{name} must be uint8 E8M0 codes [E, N, K/32], got {scales.dtype} {tuple(scales.shape)}")
    e, n, groups = scales.shape
    if n % SCALE_RUN or not n or not groups:
        raise ValueError(f"{name}: N = {n} must be a positive multiple of {SCALE_RUN} (Marlin's scale runs)")
    return e, n, groups


def marlin_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes uint8 [E, N, K/32] -> Marlin's order, uint8 [E, K/32, N]
    (module docstring; `.view(torch.float8_e8m0fnu)` is what the op takes).
    Raises TypeError/ValueError unless N % 64 == 0."""
    e, n, groups = _check_scales(scales, "scales")
    order = scale_order().to(scales.device)
    flat = scales.transpose(1, 2).reshape(e, groups * n // SCALE_RUN, SCALE_RUN)
    return flat[:, :, order].reshape(e, groups, n).contiguous()


def check_marlin_shape(hidden: int, padded_intermediate: int) -> None:
    """Raise ValueError unless H % 256 == 0 and Ip % 128 == 0: the padding
    vLLM gives MXFP4 layers for Marlin, which the canonical layout must
    already have (moebench does not pad H)."""
    if hidden % PAD_HIDDEN:
        raise ValueError(f"hidden {hidden} must be a multiple of {PAD_HIDDEN} (vLLM pads H to {PAD_HIDDEN} for Marlin)")
    if padded_intermediate % PAD_INTERMEDIATE:
        raise ValueError(f"padded intermediate {padded_intermediate} must be a multiple of {PAD_INTERMEDIATE}")


@dataclass
class MarlinWeights:
    """One rank's experts in vLLM's Marlin MXFP4 layout: w13 int32
    [E, H/16, 2*(2*Ip)], w13_scale float8_e8m0fnu [E, H/32, 2*Ip], w2 int32
    [E, Ip/16, 2*H], w2_scale float8_e8m0fnu [E, Ip/32, H]."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[1] * TILE

    @property
    def padded_intermediate(self) -> int:
        return self.w2.shape[1] * TILE

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))


#: repack(words int32 [K/8, N], size_k, size_n) -> int32 [K/16, 2N] (vLLM's gptq_marlin_repack).
Repack = Callable[[torch.Tensor, int, int], torch.Tensor]


def _repack_experts(words: torch.Tensor, size_k: int, size_n: int, repack: Repack) -> torch.Tensor:
    """One `repack` call per expert into a preallocated [E, K/16, 2N] (vLLM's loop)."""
    out = torch.empty((words.shape[0], *repacked_shape(size_n, size_k)), dtype=torch.int32, device=words.device)
    for e in range(words.shape[0]):
        packed = repack(words[e], size_k, size_n)
        if tuple(packed.shape) != tuple(out.shape[1:]) or packed.dtype != torch.int32:
            raise RuntimeError(
                f"repack returned {packed.dtype} {tuple(packed.shape)}, expected int32 {tuple(out.shape[1:])}"
            )
        out[e] = packed
    return out


def prepare_marlin(weights: ExpertWeights, repack: Repack) -> MarlinWeights:
    """Canonical `weights` -> `MarlinWeights` on the same device, with
    `repack` standing for vLLM's `gptq_marlin_repack` (module docstring).
    Raises TypeError/ValueError for weights that are not ExpertWeights or a
    shape Marlin's padding rules reject."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be ExpertWeights, got {type(weights).__name__}")
    h, ip = weights.hidden, weights.padded_intermediate
    check_marlin_shape(h, ip)
    w13 = _repack_experts(gptq_words(weights.w13), h, 2 * ip, repack)
    w2 = _repack_experts(gptq_words(weights.w2), ip, h, repack)
    return MarlinWeights(
        w13=w13,
        w13_scale=marlin_scales(weights.w13_scale).view(torch.float8_e8m0fnu),
        w2=w2,
        w2_scale=marlin_scales(weights.w2_scale).view(torch.float8_e8m0fnu),
    )


def marlin_expert_bytes(hidden: int, padded_intermediate: int) -> int:
    """Bytes Marlin reads for one touched expert: packed w13 and w2 of the
    padded intermediate (4 bits per weight) and their E8M0 scales."""
    weights = 3 * hidden * padded_intermediate
    return weights // 2 + weights // MX_BLOCK
