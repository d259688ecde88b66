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
interleaved by FlashInfer's own kernel, scales folded (layouts.py holds
tested torch equivalents), clamp passed as `swiglu_limit` [E] fp32; the
intermediate stays padded to a multiple of 128 (the scale fold needs it).
Top-k weights arrive final (routed_scaling_factor folded by the router).

Tactics: FlashInfer's autotuner picks a (GEMM1, GEMM2) tactic pair per row
count, tuned on the first forward of that row count (outside CUDA-graph
capture; `tune()` does it explicitly) under `autotune(True,
tuning_buckets=(rows,))`; the pair is recorded in `prepared.tactics[(rows, top_k)]` and
`backend.last_tactic` ("g1=<i>,g2=<j>") and pinned with `profile_ids`, so
captured graphs replay the tuned kernels.

Nothing here imports flashinfer at module import: `unavailable_reason` says
why the backend cannot run (no CUDA, not sm_90, package or module missing).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from moebench.backends.base import (
    DEFAULT_TACTIC, Backend, check_forward_inputs, check_weights, require_runnable, sm90_reason,
)
from moebench.backends.layouts import swap_halves
from moebench.traffic import mxfp4_bytes, touched_bytes
from moebench.formats import ExpertWeights
from moebench.models import RankShape

#: The FlashInfer release these adapters were written and checked against.
FLASHINFER_VERSION = "0.7.2.post1"
#: Largest row count a prepared layer serves (the workspace is sized for it).
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
    outputs: dict = field(default_factory=dict)   # rows -> bf16 [rows, H]
    tactics: dict = field(default_factory=dict)   # (rows, top_k) -> (gemm1 tactic, gemm2 tactic)

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
        reason = sm90_reason(device)
        if reason:
            return reason
        if importlib.util.find_spec("flashinfer") is None:
            return "package flashinfer-python is not installed (see docs/baselines.md: .bundles/flashinfer.tar.xz)"
        try:
            import flashinfer
            from flashinfer.fused_moe import cutlass_fused_moe
        except Exception as error:  # noqa: BLE001 - any import failure is a reason
            return f"importing flashinfer failed: {type(error).__name__}: {error}"
        version = getattr(flashinfer, "__version__", "?")
        if self.humming and "use_wfp4afp8_humming" not in inspect.signature(cutlass_fused_moe).parameters:
            return f"flashinfer {version} has no humming (W4A8) mode on SM90"
        kind = module_kind()
        if kind is None and os.environ.get(ALLOW_JIT_ENV) != "1":
            return (
                "FlashInfer's SM90 fused-MoE module (fused_moe_90) is not built: install the bundle "
                f"(scripts/build_flashinfer_bundle.sh) or set {ALLOW_JIT_ENV}=1 to JIT-build it (~1 h)"
            )
        if self.humming and kind == "w4a16":
            return "the installed fused_moe_90 module is the reduced W4A16-only build (no humming kernels)"
        return None

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
        self.check_tactic(shape, tactic)
        check_weights(weights, shape)
        dev = weights.w13.device
        require_runnable(self, dev)
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
        size = cutlass_fused_moe_workspace_size(
            MAX_ROWS, shape.hidden, shape.padded_intermediate, shape.experts, shape.top_k,
            x_dtype=torch.bfloat16, weight_dtype=torch.uint8, device=dev, **self._flags(),
        )
        return FlashInferPrepared(
            fc1=fc1, fc2=fc2, quant_scales=quant_scales,
            swiglu_limit=weights.clamp.to(device=dev, dtype=torch.float32).contiguous(),
            workspace=torch.empty(int(size), dtype=torch.uint8, device=dev),
            hidden=shape.hidden, experts=shape.experts, top_k=shape.top_k, humming=self.humming,
        )  # fmt: skip

    # -- per call -------------------------------------------------------------------------
    def _call(self, p: FlashInferPrepared, x, topk_ids, topk_weights, out, profile_ids):
        from flashinfer.fused_moe import cutlass_fused_moe

        cutlass_fused_moe(
            x, topk_ids, topk_weights, p.fc1, p.fc2, torch.bfloat16,
            quant_scales=p.quant_scales, swiglu_limit=p.swiglu_limit, output=out,
            workspace_buffer=p.workspace, tune_max_num_tokens=MAX_ROWS,
            profile_ids=profile_ids, **self._flags(),
        )  # fmt: skip

    def tune(self, prepared: FlashInferPrepared, x, topk_ids, topk_weights) -> tuple[int, int]:
        """Run FlashInfer's autotuner for x's row count (not inside a graph
        capture) and pin the winning (gemm1, gemm2) tactics; returns them."""
        from flashinfer.autotuner import AutoTuner, autotune

        rows = x.shape[0]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name}: rows={rows} is not tuned yet; call forward once outside CUDA-graph capture first"
            )
        out = self._output(prepared, rows)
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

    def _output(self, p: FlashInferPrepared, rows: int) -> torch.Tensor:
        out = p.outputs.get(rows)
        if out is None:
            out = p.outputs[rows] = torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device)
        return out

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] (a buffer owned by `prepared`, reused by the next call
        with the same row count). Raises ValueError for rows > 8."""
        if not isinstance(prepared, FlashInferPrepared) or prepared.humming != self.humming:
            raise TypeError(f"prepared must come from {type(self).__name__}.prepare, got {type(prepared).__name__}")
        p = prepared
        check_forward_inputs(x, topk_ids, topk_weights, p.hidden, p.device)
        rows = x.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"x has {rows} rows; this backend serves 1..{MAX_ROWS}")
        if topk_ids.shape[1] > p.top_k:
            raise ValueError(f"top_k {topk_ids.shape[1]} exceeds the prepared top_k {p.top_k}")
        if (rows, topk_ids.shape[1]) not in p.tactics:
            self.tune(p, x, topk_ids, topk_weights)
        g1, g2 = p.tactics[(rows, topk_ids.shape[1])]
        self.last_tactic = f"g1={g1},g2={g2}"
        out = self._output(p, rows)
        self._call(p, x, topk_ids, topk_weights, out, [g1, g2])
        return out


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
