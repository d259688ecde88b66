"""OpenAI triton_kernels `matmul_ogs` baseline ("triton-mxfp4"): vLLM 0.26.0's
gpt-oss MoE path on Hopper, run for DeepSeek-V4 as vLLM runs it there
(`--moe-backend triton_unfused`: `UnfusedOAITritonExperts`; the fused
TRITON backend only knows gpt-oss's SwiGLU-OAI, not DeepSeek-V4's
silu(min(g, L)) * clamp(u, -L, L)).

triton_kernels is the copy vLLM vendors (vllm/third_party/triton_kernels, the
v3.5.1 API with `triton_kernels.routing`), imported as the top-level package
`triton_kernels` (the vllm-moe bundle's site/triton_kernels); the activation
is vLLM's compiled `torch.ops._C.silu_and_mul_with_clamp` (vllm_ops "c").

prepare (vLLM's `Mxfp4MoEMethod` + `convert_weight_to_mxfp4_moe_kernel_format`,
TRITON_UNFUSED branch + `_swizzle_mxfp4` on sm_90):
- intermediate padded to a multiple of 64 with zeros
  (`mxfp4_round_up_hidden_size_and_intermediate_size`; H unchanged): [gate; up]
  rows keep their order (no interleave: that is the fused TRITON backend's);
- the opt-flags constraint split_k = 1 (global in triton_kernels, as vLLM sets it);
- scales padded along K to a multiple of 4 groups (vLLM's fix for Triton < 3.8);
- values [E, N, K/2] -> transposed -> `HopperMXValueLayout(mx_axis=1)`,
  scales -> `HopperMXScaleLayout(mx_axis=1, num_warps=8)` (the layouts
  triton_kernels' `make_default_matmul_mxfp4_w*_layout` pick on sm_90);
- `PrecisionConfig(weight_scale=..., flex_ctx=FlexCtx(rhs_data=InFlexData()))`
  per GEMM. The SwiGLU limit is one float of the quant config: prepare
  requires one clamp value for all experts (true for every preset).

forward, per layer call (`UnfusedOAITritonExperts.apply` on vLLM's TP path,
launch for launch: `LAUNCHES`, docs/baselines.md has the table):
  route      make_routing_data (ids int16, weights bf16, bitmatrix zeroed and
             packed, invalid weights set to -1, histogram memset and sum, the
             token sort's memset and compute: 10 small launches, no host sync)
  gemm1      matmul_ogs(x, w13, gather_indx)      -> [M*k, 2I'] expert-sorted
  activation rows back to slot order (index), silu_and_mul_with_clamp(L, 1, 0),
             rows to expert order again (index)   -> [M*k, I']
  gemm2      matmul_ogs(h, w2, scatter_indx, gammas = bf16 top-k weights,
             n_expts_act = 1: no fused top-k sum) -> [M*k, H] slot order, weighted
  reduce     masked top-k sum (skips -1 slots)    -> [M, H] bf16 (fused_out)
  finalize   output.copy_(fused_out): the modular kernel's finalize
             (TopKWeightAndReduceNoOP)
gemm1's output and gemm2's share one workspace (vLLM's workspace2), as in vLLM.
Every id must be local on the TP path. Tactic "ep" (`base.EP_TACTIC`, never
the default) is vLLM's expert-map path: one launch ahead of the route maps
ids outside [0, E) to -1 (`remap_topk_to_local`); such slots are never sorted
in, never written, and skipped by the reduction.

One difference from vLLM, kept visible: for SILU with a clamp limit vLLM's
`UnfusedOAITritonExperts.activation` calls `swiglu_limit_func` without
top-k ids, i.e. the torch.compile'd `_swiglu_limit_torch` (one generated
kernel); this backend runs `silu_and_mul_with_clamp`, the op vLLM documents
as its equivalent (one kernel; same math in fp32, bf16 out).

Oracle "bf16" (x BF16, H not quantized); the top-k weights are bf16-rounded
(2^-9 relative at most). Graph-capturable: no step syncs with the host
(warm up each row count before capture: Triton compiles at first use).

Nothing here imports triton or triton_kernels at module import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moebench.backends import vllm_ops
from moebench.backends.base import DEFAULT_TACTIC, EP_TACTIC, Backend, check_forward_inputs, one_clamp
from moebench.backends.peer import FINALIZE_LAUNCH, package_reason, prepare_prologue, vllm_reason
from moebench.formats import MX_BLOCK, ExpertWeights
from moebench.models import RankShape
from moebench.traffic import touched_bytes

MAX_ROWS = 8
#: One layer call's launches on vLLM's TP path: (stage, launch, where vLLM 0.26.0 runs it, in
#: vllm/model_executor/layers/fused_moe/, "tk/" = vllm/third_party/triton_kernels/); the
#: names are what tests/backends/test_launches.py records (make_routing_data counted inside).
_T = "experts/gpt_oss_triton_kernels_moe.py"
LAUNCHES = (
    ("route", "aten._to_copy (ids int16)", f"{_T}:1179 -> {_T}:748"),
    ("route", "aten._to_copy (weights bf16)", f"{_T}:749"),
    ("route", "aten.zeros (bitmatrix)", f"{_T}:757"),
    ("route", "pack_bitmatrix", f"{_T}:762"),
    ("route", "aten.eq (invalid ids)", f"{_T}:788"),
    ("route", "aten.where (invalid weights)", f"{_T}:788"),
    ("route", "_sum_bitmatrix_memset", f"{_T}:793 -> tk/routing.py:280 -> {_T}:454 -> tk/tensor.py:186"),
    ("route", "_sum_bitmatrix_rows", "tk/tensor.py:189"),
    ("route", "_combined_routing_memset", f"{_T}:454 (sort_tokens)"),
    ("route", "_combined_routing_compute", f"{_T}:454 (sort_tokens)"),
    ("gemm1", "matmul_ogs (w13)", f"{_T}:1214"),
    ("activation", "aten.index (to slot order)", f"{_T}:1230"),
    ("activation", "silu_and_mul_with_clamp", f"{_T}:1256 (see the note on the activation)"),
    ("activation", "aten.index (to expert order)", f"{_T}:1268"),
    ("gemm2", "matmul_ogs (w2)", f"{_T}:1267"),
    ("reduce", "masked_moe_sum", f"{_T}:1298"),
    FINALIZE_LAUNCH,
)
#: Kernels CUDA launches inside one torch op of LAUNCHES besides the op's own
#: (torch's profiler counts them; vLLM's same lines launch them too): the
#: where's Python scalar becomes a bf16 tensor by a fill, and advanced
#: indexing with int32 indices converts them to int64 first.
EXTRA_KERNELS = (
    ("aten.where (invalid weights)", "fill: the scalar -1.0 as a bf16 tensor"),
    ("aten.index (to slot order)", "copy: dst_indx int32 -> int64"),
    ("aten.index (to expert order)", "copy: src_indx int32 -> int64"),
)
#: The "ep" tactic's launches: vLLM's remap ahead of the route.
LAUNCHES_EP = (("route", "remap_topk_to_local", f"{_T}:1173 -> {_T}:892"), *LAUNCHES)
#: vLLM's intermediate alignment for the Triton MXFP4 backends on CUDA.
INTERMEDIATE_ALIGN = 64
#: Scale groups along K padded to this multiple (vLLM's Hopper fix, "#47303").
SCALE_K_ALIGN = 4
#: _swizzle_mxfp4's num_warps for the Hopper scale layout.
SCALE_NUM_WARPS = 8
#: HopperMXValueLayout pads (rows, bytes) of each [N, K/2] matrix to these.
VALUE_PAD = (16, 32)
#: HopperMXScaleLayout pads (rows, groups) to these (rows: 2 * num_warps * 2 * 8).
SCALE_PAD = (2 * SCALE_NUM_WARPS * 2 * 8, 2)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_intermediate(intermediate: int) -> int:
    """vLLM's intermediate for this backend: `intermediate` rounded up to 64."""
    if not isinstance(intermediate, int) or intermediate <= 0 or intermediate % MX_BLOCK:
        raise ValueError(f"intermediate must be a positive multiple of {MX_BLOCK}, got {intermediate!r}")
    return _round_up(intermediate, INTERMEDIATE_ALIGN)


def _matrix_bytes(rows: int, k: int) -> int:
    """Bytes of one expert's [rows, k] MXFP4 matrix in the Hopper layouts
    (values and scales, with the layouts' and vLLM's padding)."""
    values = _round_up(rows, VALUE_PAD[0]) * _round_up(k // 2, VALUE_PAD[1])
    groups = _round_up(_round_up(k // MX_BLOCK, SCALE_K_ALIGN), SCALE_PAD[1])
    return values + _round_up(rows, SCALE_PAD[0]) * groups


def expert_bytes(shape: RankShape) -> int:
    """Bytes of one expert (w13 and w2, values and scales) as this backend stores them."""
    ip, h = padded_intermediate(shape.intermediate), shape.hidden
    return _matrix_bytes(2 * ip, h) + _matrix_bytes(h, ip)


# --- weight conversion ------------------------------------------------------------------------


def unswizzled_weights(weights: ExpertWeights) -> dict[str, torch.Tensor]:
    """Canonical -> the tensors vLLM holds before `_swizzle_mxfp4`: I padded
    to 64 (`padded_intermediate`), [gate; up] order kept; scales padded with
    zero groups along K to a multiple of 4. Returns w13 [E, 2I', H/2],
    w13_scale [E, 2I', ceil4(H/32)], w2 [E, H, I'/2], w2_scale [E, H, ceil4(I'/32)]."""
    ip, cp = padded_intermediate(weights.intermediate), weights.padded_intermediate

    def rows(t: torch.Tensor) -> torch.Tensor:  # canonical rows >= I are zero, so slicing pads
        return torch.cat((t[:, :ip], t[:, cp : cp + ip]), dim=1)

    def pad_groups(s: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(s, (0, -s.shape[-1] % SCALE_K_ALIGN)).contiguous()

    return {
        "w13": rows(weights.w13).contiguous(),
        "w13_scale": pad_groups(rows(weights.w13_scale)),
        "w2": weights.w2[:, :, : ip // 2].contiguous(),
        "w2_scale": pad_groups(weights.w2_scale[:, :, : ip // MX_BLOCK]),
    }


def swizzle(values: torch.Tensor, scales: torch.Tensor, value_layout, value_opts: dict, scale_layout, scale_opts: dict):
    """`_swizzle_mxfp4`'s conversion of one weight ([E, N, K/2] u8 values,
    [E, N, groups] u8 scales) into triton_kernels Tensors of the given layout
    classes: transposed so K is dim 1, wrapped (values as FP4), converted.
    Returns (values Tensor [E, K, N], scales Tensor)."""
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor

    for name, t in (("values", values), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 3:
            raise TypeError(f"{name} must be a 3-D uint8 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if values.shape[:2] != scales.shape[:2]:
        raise ValueError(f"values {tuple(values.shape)} and scales {tuple(scales.shape)} must share [E, N]")
    w = convert_layout(wrap_torch_tensor(values.transpose(-2, -1), dtype=FP4), value_layout, **value_opts)
    s = convert_layout(wrap_torch_tensor(scales.transpose(-2, -1)), scale_layout, **scale_opts)
    return w, s


def hopper_layouts():
    """(value layout, opts, scale layout, opts) that triton_kernels picks for
    MXFP4 weights on this GPU (`make_default_matmul_mxfp4_w*_layout(mx_axis=1)`,
    num_warps 8); RuntimeError unless they are the Hopper ones."""
    from triton_kernels.tensor_details import layout

    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=SCALE_NUM_WARPS)
    if value_layout is not layout.HopperMXValueLayout or scale_layout is not layout.HopperMXScaleLayout:
        raise RuntimeError(f"triton_kernels picked {value_layout.__name__} / {scale_layout.__name__}, not the"
                           " Hopper MX layouts: this backend reproduces vLLM on sm_90 only")  # fmt: skip
    return value_layout, value_opts, scale_layout, scale_opts


# --- prepared state ---------------------------------------------------------------------------


@dataclass
class TritonMxfp4Prepared:
    """The swizzled weights (triton_kernels Tensors), their precision configs,
    the SwiGLU limit, geometry (intermediate = I' padded to 64) and the
    workspaces per row count."""

    w13: object
    w2: object
    w13_precision: object
    w2_precision: object
    limit: float
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    device: torch.device
    buffers: dict = field(default_factory=dict)
    ep: bool = False  # tactic "ep": vLLM's expert-map path (module docstring)


class TritonMxfp4Backend(Backend):
    """vLLM's UnfusedOAITritonExperts (triton_kernels matmul_ogs, MXFP4 x BF16)."""

    name = "triton-mxfp4"
    oracle = "bf16"
    capturable: ClassVar[bool] = True

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        """The default (vLLM's TP path) and "ep" (its expert-map path)."""
        return (DEFAULT_TACTIC, EP_TACTIC)

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        reason = package_reason(device, "triton", missing="package triton is not installed") or package_reason(
            device, "triton_kernels", imports=lambda: [importlib.import_module(f"triton_kernels.{m}")
                                                       for m in ("matmul_ogs", "routing", "tensor")],
            missing="package triton_kernels (vLLM's vendored copy) is not importable: unpack the vllm-moe bundle"
                    " (scripts/build_vllm_bundle.sh moe) onto PYTHONPATH",
        )  # fmt: skip
        if reason:
            return reason
        import triton_kernels.routing as routing
        import triton_kernels.tensor as tensor

        if not hasattr(routing, "routing_from_bitmatrix") or hasattr(tensor, "SparseMatrix"):
            where = getattr(routing, "__file__", "?")
            return (f"triton_kernels at {where} is not the v3.5.1 API vLLM {vllm_ops.VLLM_VERSION} vendors"
                    " (routing_from_bitmatrix, no SparseMatrix)")  # fmt: skip
        return vllm_reason("c", what="vLLM's silu_and_mul_with_clamp")

    def prepared_bytes(self, shape: RankShape) -> int:
        return shape.experts * expert_bytes(shape)

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """The touched experts in the Hopper layouts (I padded to 64, the
        layouts' row/byte padding, scale groups padded to 4) + x + output."""
        return touched_bytes(shape, topk_ids, expert_bytes(shape))

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> TritonMxfp4Prepared:
        """Swizzled weights of `shape` on the weights' (CUDA) device. Raises
        ValueError for a bad tactic/shape or per-expert clamps that differ,
        RuntimeError when unavailable there."""
        dev = prepare_prologue(self, weights, shape, tactic)
        limit = one_clamp(weights, "vLLM's SwiGLU limit is one float of the quant config")
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
        from triton_kernels.numerics import InFlexData

        opt_flags.update_opt_flags_constraints({"split_k": 1})
        layouts = hopper_layouts()
        raw = unswizzled_weights(weights)
        w13, w13_scale = swizzle(raw["w13"], raw["w13_scale"], *layouts)
        w2, w2_scale = swizzle(raw["w2"], raw["w2_scale"], *layouts)
        del raw
        return TritonMxfp4Prepared(
            w13=w13, w2=w2,
            w13_precision=PrecisionConfig(weight_scale=w13_scale, flex_ctx=FlexCtx(rhs_data=InFlexData())),
            w2_precision=PrecisionConfig(weight_scale=w2_scale, flex_ctx=FlexCtx(rhs_data=InFlexData())),
            limit=limit, hidden=shape.hidden, intermediate=padded_intermediate(shape.intermediate),
            experts=shape.experts, top_k=shape.top_k, device=dev, ep=tactic == EP_TACTIC,
        )  # fmt: skip

    # --- per call ------------------------------------------------------------------------------

    def _check(self, prepared, x, topk_ids, topk_weights) -> tuple[int, int]:
        if not isinstance(prepared, TritonMxfp4Prepared):
            raise TypeError(f"prepared must come from {type(self).__name__}.prepare, got {type(prepared).__name__}")
        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.device)
        rows, top_k = topk_ids.shape
        if not 1 <= rows <= MAX_ROWS or top_k > prepared.top_k:
            raise ValueError(
                f"rows must be in 1..{MAX_ROWS} and top_k <= {prepared.top_k}, got {tuple(topk_ids.shape)}"
            )
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        return rows, top_k

    def _buffers(self, p: TritonMxfp4Prepared, rows: int, top_k: int) -> dict:
        """vLLM's workspaces at `rows`: workspace2 [M*k * max(2I', H)] (GEMM1's
        output, then GEMM2's: they alias), workspace13 [M*k, I'] (the activation's
        output), and the output [M, H]."""
        key = (rows, top_k)
        buf = p.buffers.get(key)
        if buf is None:
            m, n = rows * top_k, 2 * p.intermediate
            ws2 = torch.empty(m * max(n, p.hidden), dtype=torch.bfloat16, device=p.device)
            buf = p.buffers[key] = dict(
                workspace2=ws2,
                gemm1_out=ws2[: m * n].view(1, m, n),
                gemm2_out=ws2[: m * p.hidden].view(1, m, p.hidden),
                act_out=torch.empty(m, p.intermediate, dtype=torch.bfloat16, device=p.device),
                fused=torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device),
                out=torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device),
            )
        return buf

    def _route(self, p: TritonMxfp4Prepared, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        from moebench.backends import triton_mxfp4_glue as glue

        ids = glue.local_ids(topk_ids, p.experts) if p.ep else topk_ids  # the TP path: ids as they come
        routing, gather, scatter = glue.make_routing_data(ids, topk_weights, p.experts)
        return ids, routing, gather, scatter

    @staticmethod
    def _gemm1(p, buf, x, routing, gather):
        from triton_kernels.matmul_ogs import matmul_ogs

        return matmul_ogs(x, p.w13, None, routing, gather_indx=gather, precision_config=p.w13_precision,
                          gammas=None, fused_activation=None, y=buf["gemm1_out"])  # fmt: skip

    @staticmethod
    def _activation(p, buf, gather):
        act_in = buf["gemm1_out"].view(-1, 2 * p.intermediate)[gather.dst_indx]  # slot order
        torch.ops._C.silu_and_mul_with_clamp(buf["act_out"], act_in, p.limit, 1.0, 0.0)
        return buf["act_out"][gather.src_indx]  # expert-sorted again, GEMM2's input

    @staticmethod
    def _gemm2(p, buf, h, routing, scatter):
        from triton_kernels.matmul_ogs import matmul_ogs

        return matmul_ogs(h, p.w2, None, routing, scatter_indx=scatter, precision_config=p.w2_precision,
                          gammas=routing.gate_scal, y=buf["gemm2_out"])  # fmt: skip

    @staticmethod
    def _reduce(p, buf, ids, rows, top_k):
        from moebench.backends import triton_mxfp4_glue as glue

        return glue.masked_topk_sum(buf["gemm2_out"].view(rows, top_k, p.hidden), ids, buf["fused"])

    @staticmethod
    def _finalize(buf):
        return buf["out"].copy_(buf["fused"])

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] (a buffer owned by `prepared`, reused by the next call
        with the same row count). Raises ValueError for rows > 8."""
        rows, top_k = self._check(prepared, x, topk_ids, topk_weights)
        p, buf = prepared, self._buffers(prepared, rows, top_k)
        ids, routing, gather, scatter = self._route(p, topk_ids, topk_weights)
        self._gemm1(p, buf, x, routing, gather)
        h = self._activation(p, buf, gather)
        routing.n_expts_act = 1  # vLLM: GEMM2 without matmul_ogs' fused top-k sum
        self._gemm2(p, buf, h, routing, scatter)
        self._reduce(p, buf, ids, rows, top_k)
        return self._finalize(buf)

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        """route, gemm1, activation (index, silu_and_mul_with_clamp, index),
        gemm2, reduce, finalize; each bound to an eager run of the stages before it."""
        import dataclasses

        rows, top_k = self._check(prepared, x, topk_ids, topk_weights)
        p, buf = prepared, self._buffers(prepared, rows, top_k)
        ids, routing, gather, scatter = self._route(p, topk_ids, topk_weights)
        routing2 = dataclasses.replace(routing, n_expts_act=1)
        self._gemm1(p, buf, x, routing, gather)
        h = self._activation(p, buf, gather)
        self._gemm2(p, buf, h, routing2, scatter)
        self._reduce(p, buf, ids, rows, top_k)
        return [
            ("route", lambda: self._route(p, topk_ids, topk_weights)),
            ("gemm1", lambda: self._gemm1(p, buf, x, routing, gather)),
            ("activation", lambda: self._activation(p, buf, gather)),
            ("gemm2", lambda: self._gemm2(p, buf, h, routing2, scatter)),
            ("reduce", lambda: self._reduce(p, buf, ids, rows, top_k)),
            ("finalize", lambda: self._finalize(buf)),
        ]

    def kernel_tactics(self, prepared, rows: int) -> str:
        """The path in words; matmul_ogs picks its tiles itself (opt_flags
        heuristics, split_k pinned to 1 as vLLM pins it)."""
        path = "ep (remap)" if prepared.ep else "tp"
        return (
            f"unfused matmul_ogs (triton_kernels of vLLM {vllm_ops.VLLM_VERSION}), split_k=1, Hopper MX layouts,"
            f" path={path}"
        )
