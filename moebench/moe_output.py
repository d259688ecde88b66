"""The MoE output contract: a layer's routed output with its reductions open.

A producer that stops after GEMM2 hands back `UnfinalizedMoEOutput`: the
permuted, unweighted BF16 rows, the routing weights and the permute map, so the
top-k reduction can be fused with what follows (the shared-expert add, the
tensor-parallel all-reduce, the next RMSNorm). `MoEOutput` carries the routed
part (finalized or not) together with the shared-expert output and the
runner-side routed scale. `finalize` is the plain torch consumer:

    out[t] = scale * sum_k w[t, k] * rows[permuted[t, k]]  (k with permuted -1 skipped)
             + shared[t]

and, given the residual stream and an RMSNorm weight, it also applies the
next layer's residual add and RMSNorm to that output (`add_rms_norm`, the
numerics of vLLM's fused_add_rms_norm):

    new_residual = round(residual + out)
    normed       = round(round(new_residual / sqrt(mean(new_residual^2) + eps)) * weight)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

#: Default RMSNorm epsilon (DeepSeek-V4's rms_norm_eps).
DEFAULT_EPS = 1e-6


@dataclass
class UnfinalizedMoEOutput:
    """Routed output before the top-k reduction.

    gemm2_permuted: [permuted_rows, hidden], densely packed (row stride = hidden);
        its row count is never relied on beyond the rows the map points to.
    expert_weights: [tokens, top_k] routing weights (routed scale folded in where
        the router folds it).
    expanded_idx_to_permuted_idx: int32 [tokens, top_k]; -1 = route not local.
    route_major: row t*top_k+k holds route (t, k) (the map is the identity but for -1).
    """

    gemm2_permuted: torch.Tensor
    expert_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    route_major: bool = False

    def __post_init__(self) -> None:
        rows, w, idx = self.gemm2_permuted, self.expert_weights, self.expanded_idx_to_permuted_idx
        for name, t in (("gemm2_permuted", rows), ("expert_weights", w),
                        ("expanded_idx_to_permuted_idx", idx)):  # fmt: skip
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if rows.dim() != 2:
            raise ValueError(f"gemm2_permuted must be [permuted_rows, hidden], got {tuple(rows.shape)}")
        if rows.stride() != (rows.shape[1], 1) and rows.numel():
            raise ValueError("gemm2_permuted must be densely packed at hidden (row-major contiguous)")
        if idx.dtype != torch.int32:
            raise ValueError(f"expanded_idx_to_permuted_idx must be int32, got {idx.dtype}")
        if w.dim() != 2 or idx.shape != w.shape:
            raise ValueError(
                f"expert_weights {tuple(w.shape)} and expanded_idx_to_permuted_idx "
                f"{tuple(idx.shape)} must both be [tokens, top_k]"
            )
        if not (rows.device == w.device == idx.device):
            raise ValueError("gemm2_permuted, expert_weights and the permute map must share a device")

    @property
    def num_tokens(self) -> int:
        return self.expert_weights.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_weights.shape[1]

    @property
    def hidden(self) -> int:
        return self.gemm2_permuted.shape[1]


@dataclass
class MoEOutput:
    """A MoE layer's un-reduced output: routed part (finalized [tokens, hidden]
    or unfinalized), the shared-expert output to add, and the runner-side scale
    applied to the routed sum (1.0 when the router folded it into the weights)."""

    routed: torch.Tensor | UnfinalizedMoEOutput
    shared_output: torch.Tensor | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.routed, (torch.Tensor, UnfinalizedMoEOutput)):
            raise TypeError(f"routed must be a Tensor or UnfinalizedMoEOutput, got {type(self.routed).__name__}")
        if self.shared_output is not None:
            _check_shared(self.shared_output, "shared_output")
            tokens, hidden = _routed_shape(self.routed)
            if tuple(self.shared_output.shape) != (tokens, hidden):
                raise ValueError(f"shared_output must be [{tokens}, {hidden}], got {tuple(self.shared_output.shape)}")

    def finalize(
        self,
        out_dtype: torch.dtype | None = None,
        *,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = DEFAULT_EPS,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The finalized [tokens, hidden] output (see module docstring); with
        `residual` [tokens, hidden] and `norm_weight` [hidden], the fused
        residual add + RMSNorm of it: (normed, new_residual), both in
        residual's dtype. Raises as `finalize`."""
        return finalize(
            self.routed, scale=self.routed_scaling_factor, shared=self.shared_output,
            out_dtype=out_dtype, residual=residual, norm_weight=norm_weight, eps=eps,
        )  # fmt: skip


def _routed_shape(routed: torch.Tensor | UnfinalizedMoEOutput) -> tuple[int, int]:
    if not isinstance(routed, (torch.Tensor, UnfinalizedMoEOutput)):
        raise TypeError(f"routed must be a Tensor or UnfinalizedMoEOutput, got {type(routed).__name__}")
    if isinstance(routed, UnfinalizedMoEOutput):
        return routed.num_tokens, routed.hidden
    if routed.dim() != 2:
        raise ValueError(f"a finalized routed output must be [tokens, hidden], got {tuple(routed.shape)}")
    return tuple(routed.shape)  # type: ignore[return-value]


def _check_shared(shared, name: str) -> None:
    if not isinstance(shared, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(shared).__name__}")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be None or a floating torch.dtype, got {out_dtype!r}")


def check_norm_pair(residual, norm_weight) -> bool:
    """Whether the residual add + RMSNorm is asked for: True when both
    `residual` and `norm_weight` are given, False when neither is. Raises
    ValueError naming the missing one when only one is given."""
    if residual is None and norm_weight is None:
        return False
    if norm_weight is None:
        raise ValueError("norm_weight is required with residual (the residual add comes with the RMSNorm)")
    if residual is None:
        raise ValueError("residual is required with norm_weight (the RMSNorm comes with the residual add)")
    return True


def check_eps(eps) -> float:
    """The RMSNorm epsilon as a float: a real number (TypeError otherwise:
    not a bool or a tensor), finite and >= 0 (ValueError otherwise)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or isinstance(eps, torch.Tensor):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm of vLLM's fused_add_rms_norm, in torch
    (out of place): returns (normed, new_residual), both [tokens, hidden] in
    residual's dtype, with, per token row and in fp32 (fp64 when residual is
    fp64):

        new_residual = round(x + residual)          the sum rounded to residual's dtype
        r            = float(new_residual)
        inv          = 1 / sqrt(sum(r * r) / hidden + eps)
        normed       = round(float(round(r * inv)) * float(norm_weight))

    Each step is one IEEE round-to-nearest operation (the square is exact
    for bf16 r barring under/overflow; 1/sqrt is a correctly rounded sqrt
    then a correctly rounded reciprocal, where vLLM's kernel uses rsqrtf,
    ~2 ulp). The normalized value is rounded to residual's dtype before the
    weight multiply, as vLLM does. The sum of squares is torch's reduction
    (its order unspecified): a kernel that sums in another order gets the
    same new_residual bits and a normed within the tolerance its tests
    state.

    x: [tokens, hidden] floating tensor (the finalized MoE output);
    residual: [tokens, hidden] floating tensor; norm_weight: [hidden]
    floating tensor; all on one device; eps: a finite real >= 0.
    Raises TypeError for a non-tensor, a non-floating dtype or a non-real
    eps, ValueError for a wrong shape, a device mismatch or a negative /
    non-finite eps (each naming the argument).
    """
    for name, t in (("x", x), ("residual", residual), ("norm_weight", norm_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    if tuple(residual.shape) != (tokens, hidden):
        raise ValueError(f"residual must be [{tokens}, {hidden}], got {tuple(residual.shape)}")
    if tuple(norm_weight.shape) != (hidden,):
        raise ValueError(f"norm_weight must be [{hidden}], got {tuple(norm_weight.shape)}")
    if not (x.device == residual.device == norm_weight.device):
        raise ValueError(
            f"x, residual and norm_weight must share a device, got {x.device}, {residual.device}, {norm_weight.device}"
        )
    eps = check_eps(eps)
    dtype = residual.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    new_residual = (x.to(acc) + residual.to(acc)).to(dtype)
    r = new_residual.to(acc)
    sum_sq = (r * r).sum(dim=-1, keepdim=True)
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal
    mean_sq = sum_sq / torch.full_like(sum_sq, hidden)
    inv = torch.reciprocal(torch.sqrt(mean_sq + eps))
    normed = ((r * inv).to(dtype).to(acc) * norm_weight.to(acc)).to(dtype)
    return normed, new_residual


def finalize(
    routed: torch.Tensor | UnfinalizedMoEOutput,
    *,
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out = scale * sum_k w[t,k] * rows[permuted[t,k]] (-1 skipped) + shared.

    Accumulates in fp32 (fp64 when the rows are fp64) and returns `out_dtype`
    (default: the rows' dtype). A finalized tensor is just scaled and added
    to. With `residual` ([tokens, hidden]) and `norm_weight` ([hidden]),
    given together, returns `add_rms_norm(out, residual, norm_weight, eps)`
    instead: (normed, new_residual) in residual's dtype, `out` rounded to
    `out_dtype` first (what a separate finalize would hand the norm).
    Raises ValueError when a permute index lies outside the rows or below -1
    (checked for CPU tensors), `shared` has the wrong shape, or only one of
    residual / norm_weight is given; TypeError for a non-tensor routed /
    shared or a non-floating out_dtype; otherwise as `add_rms_norm`.
    """
    tokens, hidden = _routed_shape(routed)
    if shared is not None:
        _check_shared(shared, "shared")
    _check_out_dtype(out_dtype)
    if shared is not None and tuple(shared.shape) != (tokens, hidden):
        raise ValueError(f"shared must be [{tokens}, {hidden}], got {tuple(shared.shape)}")
    if check_norm_pair(residual, norm_weight):
        check_eps(eps)
        out = finalize(routed, scale=scale, shared=shared, out_dtype=out_dtype)
        return add_rms_norm(out, residual, norm_weight, eps)
    if isinstance(routed, torch.Tensor):
        acc_dtype = torch.float64 if routed.dtype == torch.float64 else torch.float32
        acc = routed.to(acc_dtype) * scale
        dtype = out_dtype or routed.dtype
    else:
        rows = routed.gemm2_permuted
        idx = routed.expanded_idx_to_permuted_idx.to(torch.int64)
        # Checked on the CPU only: on a GPU it would cost a host sync (graph capture).
        if rows.device.type == "cpu" and idx.numel() and int(idx.max()) >= rows.shape[0]:
            raise ValueError(f"permute map points at row {int(idx.max())}, gemm2_permuted has {rows.shape[0]} rows")
        if rows.device.type == "cpu" and idx.numel() and int(idx.min()) < -1:
            raise ValueError(f"permute map holds {int(idx.min())}; only -1 marks a non-local route")
        acc_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
        # Vectorized over k (a handful of launches, graph-friendly, no host sync).
        local = idx >= 0
        w = torch.where(local, routed.expert_weights.to(acc_dtype), 0.0)
        # -1 slots are never read: mask the gathered row too (0 * NaN would leak).
        gathered = torch.where(
            local.unsqueeze(-1), rows[idx.clamp_min(0)].to(acc_dtype), 0.0
        )  # [tokens, top_k, hidden]
        acc = torch.bmm(w.unsqueeze(1), gathered).squeeze(1) * scale
        dtype = out_dtype or rows.dtype
    if shared is not None:
        acc = acc + shared.to(acc.dtype)
    return acc.to(dtype)


def convert_flashinfer_moe_output(
    flashinfer_output: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    do_finalize: bool,
    num_tokens: int,
    top_k: int,
    finalized_output: torch.Tensor | None = None,
) -> torch.Tensor | UnfinalizedMoEOutput:
    """Normalize FlashInfer's MoE return layouts.

    Finalized (`do_finalize`): a tensor or a one-tensor list, which must alias
    `finalized_output` when one was passed. Deferred: a list (gemm2 rows
    [permuted, hidden], weights [num_tokens*top_k], int32 permute map
    [num_tokens*top_k]) -> UnfinalizedMoEOutput. Raises ValueError for any
    other layout, naming what is wrong.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if top_k <= 0:
        raise ValueError(f"top_k must be > 0, got {top_k}")
    if do_finalize:
        if isinstance(flashinfer_output, torch.Tensor):
            out = flashinfer_output
        elif len(flashinfer_output) == 1 and isinstance(flashinfer_output[0], torch.Tensor):
            out = flashinfer_output[0]
        else:
            raise ValueError("a finalized FlashInfer output must be one tensor")
        if finalized_output is not None and (
            out.shape != finalized_output.shape
            or out.dtype != finalized_output.dtype
            or out.device != finalized_output.device
            or out.data_ptr() != finalized_output.data_ptr()
        ):
            raise ValueError("the finalized FlashInfer output does not alias finalized_output")
        return out
    if finalized_output is not None:
        raise ValueError("a deferred FlashInfer output cannot take finalized_output")
    if isinstance(flashinfer_output, torch.Tensor) or len(flashinfer_output) != 3:
        raise ValueError("a deferred FlashInfer output must be [gemm2 rows, weights, permute map]")
    rows, weights, idx = flashinfer_output
    for name, t in (("gemm2 rows", rows), ("routing weights", weights), ("permute map", idx)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"deferred FlashInfer output: {name} must be a tensor, got {type(t).__name__}")
    routes = num_tokens * top_k
    if rows.dim() != 2:
        raise ValueError(f"deferred gemm2 rows must be 2-D, got {tuple(rows.shape)}")
    if idx.dtype != torch.int32:
        raise ValueError(f"the permute map must be int32, got {idx.dtype}")
    for name, t in (("routing weights", weights), ("permute map", idx)):
        if t.numel() != routes:
            raise ValueError(f"{name} must hold num_tokens*top_k = {routes} elements, got {t.numel()}")
    if not (rows.device == weights.device == idx.device):
        raise ValueError("deferred FlashInfer outputs must share a device")
    if not all(t.is_contiguous() for t in (rows, weights, idx)):
        raise ValueError("deferred FlashInfer outputs must be contiguous")
    return UnfinalizedMoEOutput(rows, weights.view(num_tokens, top_k), idx.view(num_tokens, top_k))


def route_major_moe_output(
    routes: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> UnfinalizedMoEOutput:
    """Wrap GEMM2 output with one row per route (row t*top_k+k = route (t, k)).

    routes: [tokens, top_k, hidden] or [tokens*top_k, hidden]; expert_map: int
    [global experts] -> local id or -1; routes to experts mapped to -1 get
    permute index -1. Raises TypeError for a non-tensor argument or
    non-integer ids, ValueError on mismatched shapes (and, for CPU tensors,
    ids outside expert_map).
    """
    for name, t in (("routes", routes), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("expert_map", expert_map)):  # fmt: skip
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("topk_ids", topk_ids), ("expert_map", expert_map)):
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}"
            " must both be [tokens, top_k]"
        )
    tokens, top_k = topk_ids.shape
    if not (
        (routes.dim() == 3 and tuple(routes.shape[:2]) == (tokens, top_k))
        or (routes.dim() == 2 and routes.shape[0] == tokens * top_k)
    ):
        raise ValueError(f"routes must hold tokens*top_k = {tokens * top_k} rows, got {tuple(routes.shape)}")
    idx = torch.arange(tokens * top_k, dtype=torch.int32, device=routes.device).view(tokens, top_k)
    if expert_map is not None:
        if (
            topk_ids.device.type == "cpu"
            and topk_ids.numel()
            and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= expert_map.shape[0])
        ):
            raise ValueError(
                f"topk_ids hold ids in [{int(topk_ids.min())}, {int(topk_ids.max())}],"
                f" outside expert_map's [0, {expert_map.shape[0]})"
            )
        idx = idx.masked_fill(expert_map[topk_ids.long()] < 0, -1)
    return UnfinalizedMoEOutput(routes.reshape(tokens * top_k, routes.shape[-1]), topk_weights, idx, route_major=True)
