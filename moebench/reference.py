"""The numerics oracle: the whole routed-expert MoE in torch (CPU or GPU).

route -> GEMM1 (x . w13^T, SwiGLU with clamp, H quantized MXFP8 per 32 along I)
-> GEMM2 (H . w2^T, unweighted rows) -> UnfinalizedMoEOutput -> finalize.

Products of exactly-dequantized operands, accumulation in `dtype` (fp64 for the
gate of every benchmark case). One oracle per activation format (docs/design.md,
"Numerics"): "mxfp8" (MXFP8 x and H: our kernels), "bf16" (BF16 x, H not
quantized: torch-bf16, FlashInfer W4A16), "fp8_token" (per-token e4m3 x and H:
the W4A8 paths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moebench.formats import ExpertWeights, dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp8
from moebench.moe_output import UnfinalizedMoEOutput, finalize
from moebench.record import TILE, RouteRecord, build_route_record

ACTIVATIONS = ("mxfp8", "bf16", "fp8_token")
#: Relative Frobenius error vs the matching fp64 oracle that a GEMM output may have.
ORACLE_TOLERANCE = 1e-2


@dataclass
class ReferenceResult:
    """What the oracle computed: finalized output [rows, H] (dtype), the
    unfinalized output, H (e4m3 [8*ctas, I] and E8M0 [8*ctas, I/32] for
    "mxfp8", else None), the route record and the exact activations used."""

    output: torch.Tensor
    unfinalized: UnfinalizedMoEOutput
    h_values: torch.Tensor | None
    h_scale: torch.Tensor | None
    route: RouteRecord
    x_values: torch.Tensor


def quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 fake-quantization: s = amax/448 per row (fp32), values
    e4m3(x/s)*s, returned in fp32. Zero rows stay zero."""
    xf = x.to(torch.float32)
    s = xf.abs().amax(dim=-1, keepdim=True) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s


def _expert_w13(weights: ExpertWeights, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    i, ip = weights.intermediate, weights.padded_intermediate
    gate = dequantize_mxfp4(weights.w13[e, :i], weights.w13_scale[e, :i], dtype)
    up = dequantize_mxfp4(weights.w13[e, ip : ip + i], weights.w13_scale[e, ip : ip + i], dtype)
    return gate, up


def _tiles(route: RouteRecord):
    """(tile index, expert, slots [8] with -1 padding) of each used tile."""
    experts = route.tile_expert.tolist()
    slots = route.tile_slots.tolist()
    for tile in range(route.tiles_used):
        yield tile, experts[tile], slots[tile]


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4 SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    g = torch.clamp_max(gate, limit)
    return g * torch.sigmoid(g) * torch.clamp(up, -limit, limit)


def reference_gemm1(
    x_values: torch.Tensor,
    weights: ExpertWeights,
    route: RouteRecord,
    *,
    quantize_h: bool = True,
    dtype: torch.dtype = torch.float64,
):
    """GEMM1 + SwiGLU (+ MXFP8 H) of every used token tile.

    x_values: [rows, H] float, the exact activations (e.g. dequantized MXFP8 x).
    Returns (h_values float8_e4m3fn [8*ctas, I], h_scale uint8 [8*ctas, I/32])
    when `quantize_h`, else h [8*ctas, I] in `dtype`. Rows of padding slots and
    unused tiles are zero. The token row of slot s is s // top_k.
    """
    top_k = int(route.record[3])
    i = weights.intermediate
    h = torch.zeros(route.permuted_rows, i, dtype=dtype, device=x_values.device)
    x = x_values.to(dtype)
    clamp = weights.clamp.tolist()
    cache: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    for tile, e, slots in _tiles(route):
        if cache is None or cache[0] != e:
            cache = (e, _expert_w13(weights, e, dtype))
        gate_w, up_w = cache[1]
        for pos, slot in enumerate(slots):
            if slot < 0:
                continue
            xt = x[slot // top_k]
            h[tile * TILE + pos] = swiglu_clamped(gate_w @ xt, up_w @ xt, clamp[e])
    if not quantize_h:
        return h
    return quantize_mxfp8(h)


def reference_gemm2(
    h_values: torch.Tensor, weights: ExpertWeights, route: RouteRecord, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Unweighted GEMM2 rows [8*ctas, H] in `dtype` = h [8*ctas, I] . w2[e, :, :I]^T
    per used tile; rows of unused tiles are zero."""
    i = weights.intermediate
    out = torch.zeros(route.permuted_rows, weights.hidden, dtype=dtype, device=h_values.device)
    hv = h_values.to(dtype)
    cache: tuple[int, torch.Tensor] | None = None
    for tile, e, _ in _tiles(route):
        if cache is None or cache[0] != e:  # an expert's tiles are consecutive
            cache = (e, dequantize_mxfp4(weights.w2[e, :, : i // 2], weights.w2_scale[e, :, : i // 32], dtype))
        rows = slice(tile * TILE, (tile + 1) * TILE)
        out[rows] = hv[rows] @ cache[1].T
    return out


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    *,
    activation: str = "mxfp8",
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> ReferenceResult:
    """The whole routed-expert MoE of `x` (BF16 [rows, H]) with the routing
    given (`topk_ids` int [rows, top_k], `topk_weights` fp32 [rows, top_k]).

    activation picks the oracle family (module docstring). Runs on x's device.
    Raises TypeError/ValueError naming the argument for a bad dtype, shape or
    device.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shared is not None and not isinstance(shared, torch.Tensor):
        raise TypeError(f"shared must be a torch.Tensor or None, got {type(shared).__name__}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating tensor (fp32), got {topk_weights.dtype}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize == 1:
        raise TypeError(f"dtype must be a floating torch.dtype (float64 for the gate), got {dtype!r}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2 or x.shape[1] != weights.hidden:
        raise ValueError(f"x must be [rows, {weights.hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, top_k], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must match topk_ids {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if weights.w13.device != x.device:
        raise ValueError(f"weights are on {weights.w13.device}, x on {x.device}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    route = build_route_record(topk_ids, weights.experts)
    h_values = h_scale = None
    if activation == "mxfp8":
        x_values = dequantize_mxfp8(*quantize_mxfp8(x), dtype=dtype)
        h_values, h_scale = reference_gemm1(x_values, weights, route, dtype=dtype)
        h = dequantize_mxfp8(h_values, h_scale, dtype=dtype)
    elif activation == "bf16":
        x_values = x.to(dtype)
        h = reference_gemm1(x_values, weights, route, quantize_h=False, dtype=dtype)
    else:
        x_values = quantize_fp8_per_token(x).to(dtype)
        h = reference_gemm1(x_values, weights, route, quantize_h=False, dtype=dtype)
        h = quantize_fp8_per_token(h).to(dtype)
    rows = reference_gemm2(h, weights, route, dtype)
    unfinalized = UnfinalizedMoEOutput(rows, topk_weights.to(x.device), route.permuted.to(x.device))
    output = finalize(unfinalized, scale=scale, shared=None if shared is None else shared.to(dtype))
    return ReferenceResult(output, unfinalized, h_values, h_scale, route, x_values)


def relative_error(out: torch.Tensor, oracle: torch.Tensor) -> float:
    """Relative Frobenius error ||out - oracle|| / ||oracle|| in fp64 (absolute
    when the oracle is all zero); inf when `out` has a NaN/Inf where the oracle
    is finite. Raises ValueError on a shape mismatch, TypeError for a non-tensor."""
    for name, t in (("out", out), ("oracle", oracle)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != oracle.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != oracle shape {tuple(oracle.shape)}")
    o = out.detach().to(torch.float64).to(oracle.device)
    r = oracle.detach().to(torch.float64)
    finite = torch.isfinite(r)
    if bool((~torch.isfinite(o) & finite).any()):
        return float("inf")
    diff = torch.linalg.vector_norm(torch.where(finite, o - r, 0.0))
    norm = torch.linalg.vector_norm(torch.where(finite, r, 0.0))
    return float(diff / norm) if norm > 0 else float(diff)


#: A row's relative error may be this many times the backend's whole-output tolerance.
ROW_TOLERANCE_FACTOR = 2.0


def row_relative_errors(out: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    """Relative error of each output row, fp64 [rows] (on the oracle's device):
    ||out[r] - oracle[r]|| / ||oracle[r]|| over the oracle's finite entries.

    A row whose oracle is all zero must itself be ~zero: its error is
    ||out[r]|| over the RMS row norm of the whole oracle (absolute when the
    whole oracle is zero), so a stray value there counts as much as in a
    typical row. A row with a NaN/Inf where the oracle is finite gets inf.
    The rows are the last dimension's slices (out and oracle [..., H]; a
    1-D tensor is one row). Raises ValueError on a shape mismatch or a 0-d
    tensor, TypeError for a non-tensor."""
    for name, t in (("out", out), ("oracle", oracle)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != oracle.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != oracle shape {tuple(oracle.shape)}")
    if out.dim() == 0:
        raise ValueError("out and oracle must have at least one dimension (rows of the last one)")
    width = out.shape[-1]
    o = out.detach().to(torch.float64).to(oracle.device).reshape(-1, width)
    r = oracle.detach().to(torch.float64).reshape(-1, width)
    finite = torch.isfinite(r)
    broken = (~torch.isfinite(o) & finite).any(dim=1)
    diff = torch.linalg.vector_norm(torch.where(finite, o - r, 0.0), dim=1)
    norm = torch.linalg.vector_norm(torch.where(finite, r, 0.0), dim=1)
    rows = norm.numel()
    total = torch.linalg.vector_norm(norm)
    typical = (
        total / math.sqrt(rows)
        if rows and float(total) > 0
        else torch.ones((), dtype=torch.float64, device=norm.device)
    )
    err = torch.where(norm > 0, diff / torch.where(norm > 0, norm, 1.0), diff / typical)
    return torch.where(broken, torch.full_like(err, math.inf), err)


def max_row_relative_error(out: torch.Tensor, oracle: torch.Tensor) -> float:
    """The largest of `row_relative_errors(out, oracle)` (0.0 for no rows; NaN
    stays NaN, so that a gate `err <= tol` never passes it). Raises as
    row_relative_errors."""
    errs = row_relative_errors(out, oracle)
    if errs.numel() == 0:
        return 0.0
    if bool(torch.isnan(errs).any()):
        return math.nan
    return float(errs.max())


def oracle_gate(out: torch.Tensor, oracle: torch.Tensor, tolerance: float) -> tuple[float, float, str | None]:
    """The correctness gate of a measured output: (relative Frobenius error,
    largest row error, None when both pass else why not). It passes when the
    whole output's `relative_error` is <= `tolerance` and every row's
    (`row_relative_errors`) is <= ROW_TOLERANCE_FACTOR x `tolerance`, so a
    few wrong or zeroed rows cannot hide in the norm; NaN never passes.
    Raises ValueError for a tolerance that is not a positive finite number,
    else as relative_error."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < math.inf:
        raise ValueError(f"tolerance must be a positive finite number, got {tolerance!r}")
    err = relative_error(out, oracle)
    row_err = max_row_relative_error(out, oracle)
    row_tol = ROW_TOLERANCE_FACTOR * tolerance
    if not err <= tolerance:
        return err, row_err, f"rel. error {err:.3g} exceeds {tolerance:g}"
    if not row_err <= row_tol:
        bad = int((~(row_relative_errors(out, oracle) <= row_tol)).sum())
        return (
            err,
            row_err,
            (
                f"{bad} row(s) off: worst row rel. error {row_err:.3g} exceeds {row_tol:g}"
                f" ({ROW_TOLERANCE_FACTOR:g} x {tolerance:g}; whole output {err:.3g})"
            ),
        )
    return err, row_err, None
