"""FlashInfer 0.7.2.post1 SM90 MXFP4 MoE baselines: "flashinfer-w4a16" and
"flashinfer-w4a8".

Both run `flashinfer.fused_moe.cutlass_fused_moe` (the CUTLASS fused MoE that
vLLM/SGLang call on Hopper for MXFP4 experts) with the routing given, exactly
as a serving engine does per layer call: one op that permutes the token rows,
runs the two grouped mixed-input GEMMs (SwiGLU with the per-expert clamp in
between) and finalizes the top-k weighted sum into a preallocated `output=`,
with a preallocated workspace.

- "flashinfer-w4a16" (`use_w4_group_scaling=True`): BF16 activations x MXFP4
  weights, H in BF16. Oracle "bf16".
- "flashinfer-w4a8" (`use_wfp4afp8_humming=True` as well, FlashInfer's port of
  humming's W4A8): x and H quantized per token to e4m3 inside the op; the
  weights' E8M0 range is clamped to 11 binades per expert at prepare (lossy).
  Oracle "fp8_token". Needs a fused_moe_90 module with the humming kernels
  (`flashinfer/data/aot/fused_moe_90/MODULE` names the reduced build).

prepare (one time, on the GPU): fc1 halves swapped to [up; gate], weights
interleaved by FlashInfer's own kernel, scales folded (the tests check them
against a bit-exact torch model, tests/backends/sm90_layouts.py), clamp passed as `swiglu_limit` [E] fp32; the
intermediate stays padded to a multiple of 128 (the scale fold needs it).
Top-k weights arrive final (routed_scaling_factor folded by the router).

Output contract (`moe_output`): `forward` hands back FlashInfer's finalized
output through `convert_flashinfer_moe_output` (which checks that the op
wrote the preallocated buffer); `forward_unfinalized` leaves the top-k
reduction open: it runs the same op over one row per route (each route
routed alone to its expert with weight 1), so the op's output is the
unweighted route-major GEMM2 rows, and wraps them with
`route_major_moe_output` for `moe_output.finalize` (or a fused consumer).

Tactics: FlashInfer's autotuner picks a (GEMM1, GEMM2) tactic pair per row
count, tuned on the first forward of that row count (outside CUDA-graph
capture; `tune()` does it explicitly) under `autotune(True,
tuning_buckets=(rows,))`; the pair is recorded in `prepared.tactics[(rows, top_k)]` and
`backend.last_tactic` ("g1=<i>,g2=<j>") and pinned with `profile_ids`, so
captured graphs replay the tuned kernels.

Nothing here imports flashinfer at module import: `unavailable_reason` says
why the backend cannot run (no CUDA, not sm_90, package or module missing,
or the module failing to load: `module_load_error`, with the error).
The shared bundle (docs/baselines.md, "FlashInfer from the shared bundle")
holds both modes; run it with FLASHINFER_DISABLE_JIT=1 and never with
LD_BIND_NOW (the reduced module relies on lazy binding).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from moebench.backends.base import DEFAULT_TACTIC, Backend, check_forward_inputs
from moebench.backends.peer import first_line, package_reason, prepare_prologue
from moebench.backends.layouts import swap_halves
from moebench.formats import ExpertWeights
from moebench.models import RankShape
from moebench.moe_output import UnfinalizedMoEOutput, convert_flashinfer_moe_output, route_major_moe_output
from moebench.traffic import mxfp4_bytes, touched_bytes

#: Largest row count a prepared layer serves (the workspace is sized for it,
#: and for the MAX_ROWS * top_k route rows of `forward_unfinalized`).
MAX_ROWS = 8
#: Set to 1 to let FlashInfer JIT-build fused_moe_90 when no AOT module is
#: installed (~1 h on 16 cores for the full module): off by default.
ALLOW_JIT_ENV = "MOEBENCH_FLASHINFER_ALLOW_JIT"
#: Humming's fixed 2^6 compensation of the W4A8 residual scale.
HUMMING_RESIDUAL_FACTOR = 64.0


def _aot_module_dir() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "aot" / "fused_moe_90"


def module_kind() -> str | None:
    """Which fused_moe_90 module is installed in FlashInfer's AOT slot:
    "w4a16" (reduced, W4A16 kernels only), "fp4" (reduced, W4A16 + humming),
    "full" (an .so without our MODULE marker), or None (none installed)."""
    d = _aot_module_dir()
    if d is None or not (d / "fused_moe_90.so").is_file():
        return None
    marker = d / "MODULE"
    name = marker.read_text().strip() if marker.is_file() else ""
    if "w4a16only" in name:
        return "w4a16"
    if "fp4only" in name:
        return "fp4"
    return "full"


@functools.cache
def module_load_error() -> str | None:
    """Why FlashInfer's SM90 fused-MoE module does not load (the library
    named, the error's type and first line), or None once it has loaded
    (once per process: FlashInfer caches the module). Loading is what a
    missing symbol, a wrong CUDA runtime or a JIT attempt under
    FLASHINFER_DISABLE_JIT=1 fails at, so the sweep's skip reason shows it
    instead of every case failing with it."""
    try:
        from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

        get_cutlass_fused_moe_module("90")
    except Exception as error:  # noqa: BLE001 - any load failure is a reason
        return (
            f"loading FlashInfer's fused_moe_90 module ({module_kind() or 'JIT'}) failed: {type(error).__name__}:"
            f" {first_line(error)}"
        )
    return None


#: Elements (weights x K) per chunk of the humming preprocessing: its torch code
#: materializes int64 index tensors of the whole input (~24 B per element).
HUMMING_PREP_CHUNK_ELEMENTS = 1 << 28


def _by_expert_chunks(fn, weight: torch.Tensor, scale: torch.Tensor):
    """fn(weight, scale) -> (w, s, residual) applied to chunks of experts and
    concatenated: exact, since the preprocessing is per expert."""
    per_expert = weight.shape[1] * weight.shape[2] * 2
    step = max(1, HUMMING_PREP_CHUNK_ELEMENTS // per_expert)
    parts = [fn(weight[e : e + step], scale[e : e + step]) for e in range(0, weight.shape[0], step)]
    return tuple(torch.cat([part[i] for part in parts]) for i in range(3))


@dataclass
class FlashInferPrepared:
    """What `forward` reads: FlashInfer-layout weights, quant_scales, clamp,
    workspace, per-row-count outputs and tactics."""

    fc1: torch.Tensor
    fc2: torch.Tensor
    quant_scales: list
    swiglu_limit: torch.Tensor
    workspace: torch.Tensor
    hidden: int
    experts: int
    top_k: int
    humming: bool
    outputs: dict = field(default_factory=dict)  # rows -> bf16 [rows, H]
    route_outputs: dict = field(default_factory=dict)  # routes -> bf16 [routes, H] (forward_unfinalized)
    tactics: dict = field(default_factory=dict)  # (rows, top_k) -> (gemm1 tactic, gemm2 tactic)

    @property
    def device(self) -> torch.device:
        return self.fc1.device


class _FlashInferBackend(Backend):
    humming: ClassVar[bool]
    capturable = True

    def __init__(self) -> None:
        #: Tactic pair of the latest tuned/used row count, "g1=<i>,g2=<j>" (for the sweep's record).
        self.last_tactic: str | None = None

    # -- availability ---------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device | str) -> str | None:
        reason = package_reason(
            device, "flashinfer", imports=lambda: importlib.import_module("flashinfer.fused_moe"),
            missing="package flashinfer-python is not installed (see docs/baselines.md: .bundles/flashinfer.tar.xz)",
        )  # fmt: skip
        if reason:
            return reason
        import flashinfer
        from flashinfer.fused_moe import cutlass_fused_moe

        version = getattr(flashinfer, "__version__", "?")
        if self.humming and "use_wfp4afp8_humming" not in inspect.signature(cutlass_fused_moe).parameters:
            return f"flashinfer {version} has no humming (W4A8) mode on SM90"
        kind = module_kind()
        if kind is None and os.environ.get(ALLOW_JIT_ENV) != "1":
            return (
                "FlashInfer's SM90 fused-MoE module (fused_moe_90) is not built: install the bundle "
                f"(scripts/build_flashinfer_bundle.sh) or set {ALLOW_JIT_ENV}=1 to JIT-build it (~1 h)"
            )
        if kind in ("w4a16", "fp4") and os.environ.get("LD_BIND_NOW"):
            return "LD_BIND_NOW is set: the reduced fused_moe_90 module needs lazy binding (unset it)"
        if self.humming and kind == "w4a16":
            return "the installed fused_moe_90 module is the reduced W4A16-only build (no humming kernels)"
        return module_load_error()

    def prepared_bytes(self, shape: RankShape) -> int:
        return shape.experts * shape.expert_bytes() * shape.padded_intermediate // shape.intermediate

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """The touched experts at the padded intermediate (fc1 [2 Ip, H], fc2
        [H, Ip], MXFP4 values and E8M0 scales: the grouped GEMMs stream the
        zero padding too) + x in and the output."""
        ip = shape.padded_intermediate
        return touched_bytes(shape, topk_ids, mxfp4_bytes(2 * ip, shape.hidden) + mxfp4_bytes(shape.hidden, ip))

    # -- prepare --------------------------------------------------------------------------
    def _flags(self) -> dict:
        return {"use_w4_group_scaling": True, "use_wfp4afp8_humming": self.humming}

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> FlashInferPrepared:
        """FlashInfer-layout weights of `shape` on the weights' (CUDA) device.
        Raises ValueError for a bad tactic/shape or a non-CUDA device,
        RuntimeError when the backend is unavailable there."""
        dev = prepare_prologue(self, weights, shape, tactic)
        from flashinfer.fused_moe import (
            cutlass_fused_moe_workspace_size,
            interleave_moe_scales_for_sm90_mixed_gemm,
            interleave_moe_weights_for_sm90_mixed_gemm,
            preprocess_moe_weights_for_sm90_mixed_gemm_humming,
        )

        w13 = swap_halves(weights.w13)
        s13 = swap_halves(weights.w13_scale)
        w2, s2 = weights.w2.contiguous(), weights.w2_scale.contiguous()
        if self.humming:
            fc1, fc1_s, r1 = _by_expert_chunks(preprocess_moe_weights_for_sm90_mixed_gemm_humming, w13, s13)
            fc2, fc2_s, r2 = _by_expert_chunks(preprocess_moe_weights_for_sm90_mixed_gemm_humming, w2, s2)
            quant_scales = [
                fc1_s.view(torch.int32),
                (r1 * HUMMING_RESIDUAL_FACTOR).to(torch.float32).contiguous(),
                torch.ones((), dtype=torch.float32, device=dev),
                fc2_s.view(torch.int32),
                (r2 * HUMMING_RESIDUAL_FACTOR).to(torch.float32).contiguous(),
            ]
        else:
            fc1 = interleave_moe_weights_for_sm90_mixed_gemm(w13, "fp4")
            fc2 = interleave_moe_weights_for_sm90_mixed_gemm(w2, "fp4")
            quant_scales = [
                interleave_moe_scales_for_sm90_mixed_gemm(s13).view(torch.int32),
                interleave_moe_scales_for_sm90_mixed_gemm(s2).view(torch.int32),
            ]
        del w13, s13
        size = max(  # the finalized call (MAX_ROWS tokens, top_k) and the route-major one (one expert per row)
            cutlass_fused_moe_workspace_size(
                tokens, shape.hidden, shape.padded_intermediate, shape.experts, top_k,
                x_dtype=torch.bfloat16, weight_dtype=torch.uint8, device=dev, **self._flags(),
            )
            for tokens, top_k in ((MAX_ROWS, shape.top_k), (MAX_ROWS * shape.top_k, 1))
        )  # fmt: skip
        return FlashInferPrepared(
            fc1=fc1, fc2=fc2, quant_scales=quant_scales,
            swiglu_limit=weights.clamp.to(device=dev, dtype=torch.float32).contiguous(),
            workspace=torch.empty(int(size), dtype=torch.uint8, device=dev),
            hidden=shape.hidden, experts=shape.experts, top_k=shape.top_k, humming=self.humming,
        )  # fmt: skip

    # -- per call -------------------------------------------------------------------------
    def _call(self, p: FlashInferPrepared, x, topk_ids, topk_weights, out, profile_ids) -> torch.Tensor:
        """One cutlass_fused_moe into `out`; returns its finalized output
        (`convert_flashinfer_moe_output`: FlashInfer returns `out` itself, or
        a list that starts with it and may carry the op's side outputs). A
        call with one expert per row is `forward_unfinalized`'s route-major
        call: its row bound is MAX_ROWS * top_k."""
        from flashinfer.fused_moe import cutlass_fused_moe

        route_major = topk_ids.shape[1] == 1 < p.top_k
        result = cutlass_fused_moe(
            x, topk_ids, topk_weights, p.fc1, p.fc2, torch.bfloat16,
            quant_scales=p.quant_scales, swiglu_limit=p.swiglu_limit, output=out,
            workspace_buffer=p.workspace, tune_max_num_tokens=MAX_ROWS * p.top_k if route_major else MAX_ROWS,
            profile_ids=profile_ids, **self._flags(),
        )  # fmt: skip
        if isinstance(result, (list, tuple)):
            result = result[:1] or [out]  # a release that returns nothing wrote `output=` only
        return convert_flashinfer_moe_output(
            out if result is None else result, do_finalize=True, num_tokens=x.shape[0],
            top_k=topk_ids.shape[1], finalized_output=out,
        )  # fmt: skip

    def tune(self, prepared: FlashInferPrepared, x, topk_ids, topk_weights, out=None) -> tuple[int, int]:
        """Run FlashInfer's autotuner for x's row count (not inside a graph
        capture) and pin the winning (gemm1, gemm2) tactics; returns them.
        out: the output buffer of the call (default `prepared`'s for x's rows)."""
        from flashinfer.autotuner import AutoTuner, autotune

        rows = x.shape[0]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name}: rows={rows} is not tuned yet; call forward once outside CUDA-graph capture first"
            )
        out = self._output(prepared, rows) if out is None else out
        tuner = AutoTuner.get()
        chosen: dict[str, object] = {}
        original = tuner.choose_one

        def record(custom_op, runners, *args, **kwargs):
            runner, tactic = original(custom_op, runners, *args, **kwargs)
            chosen[custom_op] = tactic
            return runner, tactic

        tuner.choose_one = record  # instance attribute shadows the method while tuning
        try:
            with autotune(True, tuning_buckets=(rows,)):
                self._call(prepared, x, topk_ids, topk_weights, out, None)
        finally:
            tuner.__dict__.pop("choose_one", None)
        g1 = chosen.get("trtllm::fused_moe::gemm1", -1)
        g2 = chosen.get("trtllm::fused_moe::gemm2", -1)
        pair = (int(g1) if isinstance(g1, int) else -1, int(g2) if isinstance(g2, int) else -1)
        prepared.tactics[(rows, topk_ids.shape[1])] = pair
        return pair

    @staticmethod
    def _output(p: FlashInferPrepared, rows: int, buffers: dict | None = None) -> torch.Tensor:
        buffers = p.outputs if buffers is None else buffers
        out = buffers.get(rows)
        if out is None:
            out = buffers[rows] = torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device)
        return out

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] (a buffer owned by `prepared`, reused by the next call
        with the same row count). Raises ValueError for rows > 8."""
        self._check_call(prepared, x, topk_ids, topk_weights)
        return self._run(prepared, x, topk_ids, topk_weights, self._output(prepared, x.shape[0]))

    def forward_unfinalized(self, prepared, x, topk_ids, topk_weights) -> UnfinalizedMoEOutput:
        """The routed output with its top-k reduction left open: the op runs
        over rows*top_k route rows (row t*top_k+k = x[t], routed to expert
        topk_ids[t, k] alone with weight 1), so its output is the unweighted
        GEMM2 row of each route; `route_major_moe_output` wraps them with
        `topk_weights` (`moe_output.finalize` gives `forward`'s sum, up to
        BF16 rounding of the rows). A non-local id leaves its row zero. The
        rows are a buffer owned by `prepared`, reused by the next call with
        the same route count. Raises as `forward`."""
        self._check_call(prepared, x, topk_ids, topk_weights)
        rows, top_k = topk_ids.shape
        routes = rows * top_k
        out = self._output(prepared, routes, prepared.route_outputs)
        ones = torch.ones(routes, 1, dtype=topk_weights.dtype, device=x.device)
        route_x = x.repeat_interleave(top_k, dim=0)
        self._run(prepared, route_x, topk_ids.reshape(routes, 1), ones, out)
        return route_major_moe_output(out, topk_weights, topk_ids)

    def _check_call(self, prepared, x, topk_ids, topk_weights) -> None:
        if not isinstance(prepared, FlashInferPrepared) or prepared.humming != self.humming:
            raise TypeError(f"prepared must come from {type(self).__name__}.prepare, got {type(prepared).__name__}")
        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.device)
        rows = x.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"x has {rows} rows; this backend serves 1..{MAX_ROWS}")
        if topk_ids.shape[1] > prepared.top_k:
            raise ValueError(f"top_k {topk_ids.shape[1]} exceeds the prepared top_k {prepared.top_k}")

    def _run(self, p: FlashInferPrepared, x, topk_ids, topk_weights, out) -> torch.Tensor:
        """The op into `out` with the tactics tuned for x's rows and top_k
        (tuned on the first call of that pair)."""
        key = (x.shape[0], topk_ids.shape[1])
        if key not in p.tactics:
            self.tune(p, x, topk_ids, topk_weights, out)
        g1, g2 = p.tactics[key]
        self.last_tactic = f"g1={g1},g2={g2}"
        return self._call(p, x, topk_ids, topk_weights, out, [g1, g2])


class FlashInferW4A16Backend(_FlashInferBackend):
    """FlashInfer SM90 CUTLASS fused MoE, MXFP4 weights x BF16 activations."""

    name = "flashinfer-w4a16"
    oracle = "bf16"
    humming = False


class FlashInferW4A8Backend(_FlashInferBackend):
    """FlashInfer SM90 CUTLASS fused MoE, humming mode: MXFP4 weights (11-binade
    clamped) x per-token e4m3 activations."""

    name = "flashinfer-w4a8"
    oracle = "fp8_token"
    humming = True
