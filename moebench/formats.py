"""MXFP4 / MXFP8 codecs with E8M0 block scales, and canonical expert weights.

Formats follow the OCP Microscaling (MX) Formats Specification v1.0: a block of
32 consecutive K elements shares one E8M0 scale byte s, value = elem * 2^(s-127),
s = 255 is NaN. MXFP4 elements are e2m1 nibbles (two per byte, even element in
the low nibble); MXFP8 elements are e4m3 (float8_e4m3fn) bytes.

Quantization uses the round-up scale rule of FlashInfer's / TensorRT-LLM's mxfp8
quantize (not OCP's floor rule), exactly as docs/design.md defines it:
    amax = max |x| over the block (fp32);  s = amax / qmax (fp32, RN)
    code = biased_exponent(s) + (mantissa(s) != 0), clamped to [0, 254]
    elem = round_to_nearest_even(x * 2^(127 - code)) saturated at +-qmax
qmax = 448 (e4m3) or 6 (e2m1); amax = 0 -> code 0 and zero elements;
non-finite amax -> code 255 and element bytes 0x7F (e4m3) / 0x7 (e2m1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.models import MX_BLOCK, RankShape

#: e2m1 code -> value (code bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_NAN = 255


def _check_float_blocks(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % MX_BLOCK:
        raise ValueError(f"{name}: last dim must be a multiple of {MX_BLOCK}, got shape {tuple(x.shape)}")


def _to_fp32_blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as fp32 [..., K/32, 32] (the rule scales in fp32). Raises ValueError
    naming `name` when a finite value lies beyond the fp32 range (a float64
    input): it would become inf and its block NaN, a silent wrong answer."""
    if x.dtype == torch.float64:
        big = x.isfinite() & (x.abs() > torch.finfo(torch.float32).max)
        if bool(big.any()):
            raise ValueError(
                f"{name} holds finite values beyond the fp32 range (max |{name}| ="
                f" {float(x[big].abs().max()):.6g} > 3.4028e38); the MX rule scales in fp32"
            )
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def _check_u8(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.uint8, torch.float8_e4m3fn) or t.element_size() != 1:
        raise TypeError(f"{name} must be a 1-byte tensor (uint8/float8_e4m3fn), got {t.dtype}")


def _check_blocks_u8(t: torch.Tensor, name: str) -> None:
    """A 1-byte tensor with a last (K) dimension."""
    _check_u8(t, name)
    if t.dim() == 0:
        raise ValueError(f"{name} must have a last (K) dimension, got a 0-d tensor")


def _check_out_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize == 1:
        raise TypeError(f"dtype must be a floating torch.dtype (float16/bfloat16/float32/float64), got {dtype!r}")


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8, any shape) -> fp32 2^(s-127); 255 -> NaN; 0 -> 2^-127
    (an fp32 subnormal, exact)."""
    _check_u8(scale, "scale")
    s = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _block_scale_codes(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
    """E8M0 codes (int32) of fp32 `blocks` [..., nb, 32] by the round-up rule."""
    amax = blocks.abs().amax(dim=-1)
    s = amax / torch.tensor(qmax, dtype=torch.float32, device=blocks.device)
    bits = s.contiguous().view(torch.int32)
    code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    code = code.clamp(0, 254)
    code = torch.where(amax == 0, torch.zeros_like(code), code)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN))


def _scaled(blocks: torch.Tensor, code: torch.Tensor, qmax: float) -> torch.Tensor:
    """x * 2^(127 - code) in fp32, saturated at +-qmax (finite blocks only)."""
    # 2^(127-code) for code in [0, 254]: exponent field 254 - code (code 254 -> 2^-127, subnormal).
    e = (254 - code.clamp(0, 254)).to(torch.int32)
    mult = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23).view(torch.float32)
    return (blocks * mult.unsqueeze(-1)).clamp(-qmax, qmax)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize `x` [..., K] (any float dtype, K % 32 == 0).

    Returns (values float8_e4m3fn [..., K], scales uint8 [..., K/32]), bit-exact
    with the rule in this module's docstring. Raises TypeError / ValueError
    naming `x` on a bad dtype or shape, or on finite float64 values beyond the
    fp32 range (the rule scales in fp32: they would become NaN blocks).
    """
    _check_float_blocks(x, "x")
    shape = x.shape
    blocks = _to_fp32_blocks(x, "x")
    code = _block_scale_codes(blocks, E4M3_MAX)
    q = _scaled(blocks, code, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (code == E8M0_NAN).unsqueeze(-1)
    q = torch.where(bad, torch.full_like(q, 0x7F), q)
    zero = (code == 0).unsqueeze(-1) & (blocks.abs().amax(-1, keepdim=True) == 0)
    q = torch.where(zero, torch.zeros_like(q), q)
    return q.reshape(shape).view(torch.float8_e4m3fn), code.to(torch.uint8)


def _exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantizing product is computed in: float64 for float64,
    else float32, where element x 2^(s-127) is exact for every e4m3 / e2m1
    element and code 0..254 (at most 4 significant bits, exponents within
    [-136, 135]; only products beyond the fp32 range become inf)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _apply_scales(v: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elements `v` [..., K] (in `_exact_dtype(dtype)`) times their E8M0 block
    scales [..., K/32], rounded once to `dtype`. The product is formed before
    narrowing: a scale beyond float16's range (2^16 and up, or below 2^-24)
    would otherwise become inf / 0 first, turning zero elements into NaN
    (0 x inf) and finite products into inf / 0."""
    s = e8m0_to_float32(scales).to(v.dtype)
    return (v.unflatten(-1, (-1, MX_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values e4m3 [..., K] with scales uint8 [..., K/32] -> `dtype` [..., K]:
    the exact product rounded once to `dtype` (a zero element stays zero for
    every scale but NaN's 255; a product beyond `dtype`'s range is inf). Raises ValueError on
    mismatched shapes, TypeError on a non-1-byte input or a non-floating `dtype`."""
    _check_blocks_u8(values, "values")
    _check_blocks_u8(scales, "scales")
    _check_out_dtype(dtype)
    if values.shape[:-1] != scales.shape[:-1] or values.shape[-1] != scales.shape[-1] * MX_BLOCK:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match values {tuple(values.shape)}"
            f" (expected [..., K/{MX_BLOCK}])"
        )
    v = values.view(torch.float8_e4m3fn).to(_exact_dtype(dtype))
    return _apply_scales(v, scales, dtype)


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """|a| (fp32, <= 6) -> e2m1 magnitude code 0..7, round to nearest, ties to even code."""
    # Midpoints between consecutive e2m1 magnitudes; at a tie the even code wins.
    mids = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    code = torch.zeros_like(a, dtype=torch.int32)
    for i, m in enumerate(mids):
        upper_is_even = (i + 1) % 2 == 0
        code += ((a > m) | ((a == m) & upper_is_even)).to(torch.int32)
    return code


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize `w` [..., K] (K % 32 == 0) by the same round-up scale rule
    with 6.0 in place of 448. Returns (packed uint8 [..., K/2] with the even
    element in the low nibble, scales uint8 [..., K/32]). Negative values that
    round to zero keep their sign (code 8). Raises TypeError / ValueError
    naming `w` as quantize_mxfp8 does."""
    _check_float_blocks(w, "w")
    shape = w.shape
    blocks = _to_fp32_blocks(w, "w")
    code = _block_scale_codes(blocks, E2M1_MAX)
    scaled = _scaled(blocks, code, E2M1_MAX)
    nib = _round_e2m1(scaled.abs()) | ((blocks < 0).to(torch.int32) << 3)
    nib = torch.where((code == E8M0_NAN).unsqueeze(-1), torch.full_like(nib, 0x7), nib)
    zero = blocks.abs().amax(-1, keepdim=True) == 0
    nib = torch.where(zero, torch.zeros_like(nib), nib)
    nib = nib.reshape(*shape[:-1], shape[-1] // 2, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)
    return packed, code.to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> e2m1 codes int64 [..., K] (even element = low nibble)."""
    _check_u8(packed, "packed")
    p = packed.view(torch.uint8).to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2] with scales uint8 [..., K/32] -> `dtype` [..., K],
    exact in fp32 / fp64, else the exact product rounded once to `dtype` (a zero
    element stays zero for every scale but NaN's 255).
    Raises ValueError on mismatched shapes, TypeError on a non-1-byte input or
    a non-floating `dtype`."""
    _check_blocks_u8(packed, "packed")
    _check_blocks_u8(scales, "scales")
    _check_out_dtype(dtype)
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * MX_BLOCK:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)}"
            f" (expected [..., K/{MX_BLOCK}] for [..., K/2])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device).to(_exact_dtype(dtype))
    return _apply_scales(table[unpack_e2m1(packed)], scales, dtype)


@dataclass
class ExpertWeights:
    """Canonical (checkpoint) MXFP4 weights of one rank's routed experts.

    w13 uint8 [E, 2*Ip, H/2] (gate rows [0, Ip), up rows [Ip, 2*Ip)),
    w13_scale uint8 [E, 2*Ip, H/32], w2 uint8 [E, H, Ip/2], w2_scale uint8
    [E, H, Ip/32], clamp fp32 [E] (SwiGLU limit, > 0, not NaN, checked for
    CPU tensors; +inf = no clamp). Ip is the padded intermediate;
    rows / columns at and beyond `intermediate` are zero (values and scales).
    H and Ip are multiples of 32, all tensors share one device. Raises
    TypeError / ValueError naming the field otherwise.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    clamp: torch.Tensor
    intermediate: int

    def __post_init__(self) -> None:
        e, two_ip, h2 = _shape3(self.w13, "w13")
        ip, h = two_ip // 2, h2 * 2
        if two_ip % 2 or ip % MX_BLOCK or h % MX_BLOCK or not ip or not h:
            raise ValueError(
                f"w13 must be [E, 2*Ip, H/2] with Ip and H positive multiples of {MX_BLOCK},"
                f" got {tuple(self.w13.shape)}"
            )
        expected = {
            "w13": (e, 2 * ip, h // 2),
            "w13_scale": (e, 2 * ip, h // MX_BLOCK),
            "w2": (e, h, ip // 2),
            "w2_scale": (e, h, ip // MX_BLOCK),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            _check_u8(t, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
            if t.device != self.w13.device:
                raise ValueError(f"{name} is on {t.device}, w13 on {self.w13.device}")
        if not isinstance(self.clamp, torch.Tensor):
            raise TypeError(f"clamp must be a float32 torch.Tensor [{e}], got {type(self.clamp).__name__}")
        if self.clamp.dtype != torch.float32 or tuple(self.clamp.shape) != (e,):
            raise ValueError(f"clamp: expected float32 [{e}], got {self.clamp.dtype} {tuple(self.clamp.shape)}")
        if self.clamp.device != self.w13.device:
            raise ValueError(f"clamp is on {self.clamp.device}, w13 on {self.w13.device}")
        if self.clamp.device.type == "cpu" and bool((~(self.clamp > 0)).any()):
            # NaN or a non-positive limit: SwiGLU would silently produce NaN / zeros. Checked on
            # CPU tensors only: reading a GPU tensor's values would sync the host (and break a
            # CUDA-graph capture that builds ExpertWeights views)
            raise ValueError("clamp (the SwiGLU limit) must be > 0 and not NaN for every expert")
        if not isinstance(self.intermediate, int) or isinstance(self.intermediate, bool):
            raise TypeError(f"intermediate must be an int, got {type(self.intermediate).__name__}")
        if not 0 < self.intermediate <= ip or self.intermediate % MX_BLOCK:
            raise ValueError(f"intermediate must be a multiple of {MX_BLOCK} in (0, {ip}], got {self.intermediate}")

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def padded_intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def to(self, device: torch.device | str) -> ExpertWeights:
        return ExpertWeights(
            *(t.to(device) for t in (self.w13, self.w13_scale, self.w2, self.w2_scale, self.clamp)),
            intermediate=self.intermediate,
        )

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2*Ip, H], w2 [E, H, Ip]) in `dtype`, exact for fp32/fp64."""
        return (
            dequantize_mxfp4(self.w13, self.w13_scale, dtype),
            dequantize_mxfp4(self.w2, self.w2_scale, dtype),
        )

    def padding_is_zero(self) -> bool:
        """Whether every byte of the intermediate padding (values and scales) is zero."""
        i, ip = self.intermediate, self.padded_intermediate
        if i == ip:
            return True
        pads = (
            self.w13[:, i:ip], self.w13[:, ip + i:], self.w13_scale[:, i:ip],
            self.w13_scale[:, ip + i:], self.w2[:, :, i // 2:], self.w2_scale[:, :, i // MX_BLOCK:],
        )  # fmt: skip
        return all(int(torch.count_nonzero(p)) == 0 for p in pads)


def _shape3(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"{name} must be a 3-D tensor [E, rows, K/2]")
    return tuple(t.shape)  # type: ignore[return-value]


def generate_expert_weights(shape: RankShape, seed: int = 0, device: torch.device | str = "cpu") -> ExpertWeights:
    """Seeded, realistic canonical MXFP4 weights for one rank of `shape`.

    Values are heavy-tailed (a log-normal scale mixture of normals) with a log-normal spread of magnitude per
    expert (sigma 0.25 in log2) and per output row (sigma 0.5), scaled like a
    trained projection (std ~ 1/sqrt(K)), then quantized with `quantize_mxfp4`:
    E8M0 codes spread over ~8 binades as in trained checkpoints. Padding is zero.
    Generated one expert at a time on `device` (bounded temporary memory).
    """
    if not isinstance(shape, RankShape):
        raise TypeError(f"shape must be a RankShape (e.g. get_preset(...).shard(tp)), got {type(shape).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    h, i, ip, e = shape.hidden, shape.intermediate, shape.padded_intermediate, shape.experts
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.zeros(e, 2 * ip, h // 2, dtype=torch.uint8, device=dev)
    w13_s = torch.zeros(e, 2 * ip, h // MX_BLOCK, dtype=torch.uint8, device=dev)
    w2 = torch.zeros(e, h, ip // 2, dtype=torch.uint8, device=dev)
    w2_s = torch.zeros(e, h, ip // MX_BLOCK, dtype=torch.uint8, device=dev)

    def draw(rows: int, k: int) -> torch.Tensor:
        # A log-normal scale mixture of normals: heavy tails like trained weights.
        z = torch.randn(rows, k, generator=gen, device=dev)
        studt = z * torch.exp2(0.35 * torch.randn(rows, k, generator=gen, device=dev))
        row = torch.exp2(0.5 * torch.randn(rows, 1, generator=gen, device=dev))
        expert = float(torch.exp2(0.25 * torch.randn((), generator=gen, device=dev)))
        return studt * row * (expert / k**0.5)

    for x in range(e):
        g, s = quantize_mxfp4(draw(2 * i, h))
        w13[x, :i], w13[x, ip : ip + i] = g[:i], g[i:]
        w13_s[x, :i], w13_s[x, ip : ip + i] = s[:i], s[i:]
        g, s = quantize_mxfp4(draw(h, i))
        w2[x, :, : i // 2], w2_s[x, :, : i // MX_BLOCK] = g, s
    clamp = torch.full((e,), shape.swiglu_limit, dtype=torch.float32, device=dev)
    return ExpertWeights(w13, w13_s, w2, w2_s, clamp, intermediate=i)


def generate_activations(rows: int, hidden: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Seeded BF16 router inputs [rows, hidden]: N(0, 1) with a few outlier
    channels (x8), as post-norm hidden states have."""
    for name, v in (("rows", rows), ("hidden", hidden), ("seed", seed)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if rows < 0 or hidden <= 0:
        raise ValueError(f"rows must be >= 0 and hidden > 0, got rows={rows}, hidden={hidden}")
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 7919)
    x = torch.randn(rows, hidden, generator=gen, device=device)
    outliers = torch.randperm(hidden, generator=gen, device=device)[: max(1, hidden // 256)]
    x[:, outliers] *= 8.0
    return x.to(torch.bfloat16)
