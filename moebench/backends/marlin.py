"""vLLM's Marlin MoE: "marlin-w4a16", vLLM 0.26's default DeepSeek-V4 MXFP4
MoE path on SM90 (`select_deepseek_v4_mxfp4_moe_backend` -> MarlinExperts ->
`fused_marlin_moe`), run with vLLM's own compiled kernels (the vllm==0.26.0
wheel's libraries, `vllm_ops`) and vLLM's call sequence, written here from
its Python source (experts/marlin_moe.py, fused_moe/activation.py).

prepare (once): `marlin_layout.prepare_marlin` - vLLM's
`prepare_moe_mxfp4_layer_for_marlin` with the real `gptq_marlin_repack` op
(one call per expert) and the scale permutation in torch; the intermediate is
the canonical Ip (vLLM pads it to 128 for Marlin, H to 256); a workspace of
4 x SM-count int32 (`marlin_make_workspace_new(device, 4)`).

forward (per layer call; buffers per row count live in the prepared object,
no host sync, graph-capturable), launch for launch as vLLM 0.26.0 runs
`MarlinExperts` on its TP path (`LAUNCHES`; docs/baselines.md has the table):

  align       moe_align_block_size(ids, E, block_m) (block_m: vLLM's choice for
              M rows, `block_size_m`), no expert map
  gemm1       workspace zeroed (vLLM allocates it with torch.zeros per call),
              moe_wna16_marlin_gemm(x, w13): top_k, mul_topk_weights=False
  activation  silu_and_mul_with_clamp(limit, alpha=1, beta=0):
              silu(min(gate, L)) * clamp(up, -L, L), gate = first half
  gemm2       moe_wna16_marlin_gemm(H, w2): top_k=1, mul_topk_weights=True
              (the router weights are applied here, per row)
  reduce      moe_sum(rows [M, top_k, H], fused_out)
  finalize    output.copy_(fused_out): the modular kernel's finalize
              (TopKWeightAndReduceNoOP copies the experts' output, a workspace
              view, into the layer's output tensor)

Both GEMMs: b_type float4_e2m1f with float8_e8m0fnu scales, is_k_full=True,
use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False,
thread_k = thread_n = blocks_per_sm = -1 (Marlin picks), no bias / zeros /
act-order, the output written into vLLM's intermediate caches (GEMM2's
output aliases GEMM1's, as `_resize_cache` makes them).

Every id must be local (in [0, E)) on the TP path, as in vLLM's TP
deployment. Tactic "ep" (`base.EP_TACTIC`, never the default) is vLLM's
expert-map path instead: vLLM's kernels express an expert of another rank as
a valid *global* id that `expert_map` maps to -1 (what its DeepEP prepare does
with DeepEP's -1 ids); here E + 1 global experts, expert E standing for every
remote one (ids clamped to [-1, E], then taken mod E + 1: two small
elementwise launches ahead of the align, our stand-in for a dispatcher's
global ids), expert_map = [0 .. E-1, -1] passed to the align and moe_sum:
the align skips such slots, the GEMMs never touch their rows, and moe_sum
leaves them out. (vLLM's EP path runs a Triton activation that skips remote
rows; this backend runs vLLM's TP activation op on all rows: the remote rows'
values are never read.)

Oracle "bf16" (x stays BF16 in the GEMMs; H is BF16). The SwiGLU limit is one
float per layer in vLLM (`gemm1_clamp_limit`): prepare requires one clamp
value for all experts (true for every preset).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moebench.backends import vllm_ops
from moebench.backends.base import DEFAULT_TACTIC, EP_TACTIC, Backend, check_forward_inputs, one_clamp, sm90_reason
from moebench.backends.peer import FINALIZE_LAUNCH, prepare_prologue, vllm_reason
from moebench.backends.marlin_layout import (
    FLOAT4_E2M1F_ID, MarlinWeights, check_marlin_shape, marlin_expert_bytes, prepare_marlin,
)  # fmt: skip
from moebench.backends.vllm_align import MAX_EXPERTS, AlignBuffers
from moebench.formats import ExpertWeights
from moebench.models import RankShape
from moebench.traffic import touched_bytes

#: One layer call's launches on vLLM's TP path: (stage, launch, where vLLM 0.26.0 runs it);
#: the launch names are what tests/backends/test_launches.py records.
LAUNCHES = (
    ("align", "moe_align_block_size", "experts/marlin_moe.py:331 -> moe_align_block_size.py:90"),
    ("gemm1", "aten.zero_ (workspace)", "experts/marlin_moe.py:102 -> quantization/utils/marlin_utils.py:405"),
    ("gemm1", "moe_wna16_marlin_gemm", "experts/marlin_moe.py:135"),
    ("activation", "silu_and_mul_with_clamp", "experts/marlin_moe.py:165 -> activation.py:123"),
    ("gemm2", "moe_wna16_marlin_gemm", "experts/marlin_moe.py:191"),
    ("reduce", "moe_sum", "experts/marlin_moe.py:390 -> experts/marlin_moe.py:947"),
    FINALIZE_LAUNCH,
)
#: The "ep" tactic's launches: two remap launches ahead, the expert map passed to the align and moe_sum.
LAUNCHES_EP = (
    ("align", "aten.clamp (global ids)", "- (our stand-in for a dispatcher's global ids)"),
    ("align", "aten.remainder_ (global ids)", "- (our stand-in for a dispatcher's global ids)"),
    *LAUNCHES,
)
#: fused_marlin_moe's block_m candidates, in the order it tries them.
BLOCK_SIZES = (8, 16, 32, 48, 64)
#: marlin_make_workspace_new(device, max_blocks_per_sm=4): SM count x 4 int32 locks.
WORKSPACE_BLOCKS_PER_SM = 4
#: The flags vLLM's _fused_marlin_moe passes to both GEMMs.
GEMM_FLAGS = dict(is_k_full=True, use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False,
                  thread_k=-1, thread_n=-1, blocks_per_sm=-1)  # fmt: skip


def block_size_m(rows: int, top_k: int, experts: int, global_experts: int | None = None) -> int:
    """vLLM's block_m for `rows` token rows (fused_marlin_moe): with E global
    experts of which `experts` are local, M = ceil(rows * experts / E); the
    first of 8, 16, 32, 48, 64 with M * top_k / experts / block < 0.9, else 64."""
    for name, v in (("rows", rows), ("top_k", top_k), ("experts", experts)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    m = rows if global_experts is None else -(-rows * experts // global_experts)
    for block in BLOCK_SIZES:
        if m * top_k / experts / block < 0.9:
            return block
    return BLOCK_SIZES[-1]


def _flat_view(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """vLLM's `_resize_cache`: the first prod(shape) elements of a flat buffer, viewed as `shape`."""
    n = 1
    for s in shape:
        n *= s
    return buffer.flatten()[:n].view(*shape)


@dataclass
class MarlinPrepared:
    """Marlin weights, the layer's geometry and clamp, the workspace, the
    expert map, and per-(rows, top_k) buffers."""

    weights: MarlinWeights
    hidden: int
    intermediate: int
    padded_intermediate: int
    experts: int
    top_k: int
    clamp_limit: float
    workspace: torch.Tensor
    expert_map: torch.Tensor
    ops_moe: object = None  # torch.ops._moe_C (vllm_ops.load("moe"))
    ops_c: object = None  # torch.ops._C (vllm_ops.load("c"))
    buffers: dict = field(default_factory=dict)
    ep: bool = False  # tactic "ep": vLLM's expert-map path (module docstring)

    @property
    def device(self) -> torch.device:
        return self.workspace.device

    @property
    def global_experts(self) -> int:
        """The align's expert count: E on the TP path, E + 1 with the "ep" tactic."""
        return self.experts + 1 if self.ep else self.experts


class MarlinW4A16Backend(Backend):
    """vLLM's fused Marlin MoE, MXFP4 weights x BF16 activations (module docstring)."""

    name = "marlin-w4a16"
    oracle = "bf16"
    capturable = True

    def __init__(self) -> None:
        self.last_tactic: str | None = None

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        return sm90_reason(device) or vllm_reason("moe", "c")

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        """The default (vLLM's TP path) and "ep" (its expert-map path)."""
        return (DEFAULT_TACTIC, EP_TACTIC)

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """Marlin's reads of one call: the padded-intermediate weights and
        scales of each touched local expert, x in and the output (bf16)."""
        return touched_bytes(shape, topk_ids, marlin_expert_bytes(shape.hidden, shape.padded_intermediate))

    def prepared_bytes(self, shape: RankShape) -> int:
        return shape.experts * marlin_expert_bytes(shape.hidden, shape.padded_intermediate)

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> MarlinPrepared:
        """Marlin layout of `weights` on their (CUDA) device. Raises ValueError
        for a bad tactic, weights that do not match `shape`, a shape Marlin's
        padding rules reject, per-expert clamps that differ or too many
        experts; RuntimeError when the backend cannot run there."""
        self.check_tactic(shape, tactic)
        check_marlin_shape(shape.hidden, shape.padded_intermediate)
        if shape.experts + 1 > MAX_EXPERTS:
            raise ValueError(f"at most {MAX_EXPERTS - 1} experts (vLLM's align op), got {shape.experts}")
        dev = prepare_prologue(self, weights, shape, tactic)
        limit = one_clamp(weights, "vLLM's Marlin path takes one SwiGLU limit per layer")
        ops_c, ops_moe = vllm_ops.load("c"), vllm_ops.load("moe")
        no_perm = torch.empty(0, dtype=torch.int32, device=dev)

        def repack(words: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
            return ops_c.gptq_marlin_repack(words, no_perm, size_k, size_n, 4, False)

        marlin = prepare_marlin(weights, repack)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        e = shape.experts
        expert_map = torch.cat((torch.arange(e, dtype=torch.int32, device=dev),
                                torch.full((1,), -1, dtype=torch.int32, device=dev)))  # fmt: skip
        return MarlinPrepared(
            weights=marlin, hidden=shape.hidden, intermediate=shape.intermediate,
            padded_intermediate=shape.padded_intermediate, experts=e, top_k=shape.top_k,
            clamp_limit=limit, workspace=torch.zeros(sms * WORKSPACE_BLOCKS_PER_SM, dtype=torch.int32,
                                                                device=dev),
            expert_map=expert_map, ops_moe=ops_moe, ops_c=ops_c, ep=tactic == EP_TACTIC,
        )  # fmt: skip

    # --- per call ---------------------------------------------------------------------------

    def _buffers(self, p: MarlinPrepared, rows: int, top_k: int) -> dict:
        key = (rows, top_k)
        buf = p.buffers.get(key)
        if buf is None:
            m, n, k = rows * top_k, p.padded_intermediate, p.hidden
            block = block_size_m(rows, top_k, p.experts, p.global_experts)
            cache13 = torch.empty(m * max(2 * n, k), dtype=torch.bfloat16, device=p.device)
            buf = p.buffers[key] = dict(
                block=block,
                ids=torch.empty(rows, top_k, dtype=torch.int32, device=p.device),
                align=AlignBuffers.alloc(m, p.global_experts, block, p.device),
                cache1=_flat_view(cache13, m, 2 * n),
                cache3=_flat_view(cache13, m, k),
                cache2=torch.empty(m, n, dtype=torch.bfloat16, device=p.device),
                fused=torch.empty(rows, k, dtype=torch.bfloat16, device=p.device),
                out=torch.empty(rows, k, dtype=torch.bfloat16, device=p.device),
            )
        return buf

    def _check(self, prepared, x, topk_ids, topk_weights) -> tuple[int, int]:
        if not isinstance(prepared, MarlinPrepared):
            raise TypeError(f"prepared must come from {type(self).__name__}.prepare, got {type(prepared).__name__}")
        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.device)
        rows, top_k = topk_ids.shape
        if rows < 1 or top_k < 1:
            raise ValueError(f"topk_ids must have at least one row and one column, got {tuple(topk_ids.shape)}")
        if not x.is_contiguous() or not topk_ids.is_contiguous() or not topk_weights.is_contiguous():
            raise ValueError("x, topk_ids and topk_weights must be contiguous (Marlin reads them by row)")
        return rows, top_k

    def _stages(self, p: MarlinPrepared, x, topk_ids, topk_weights) -> list:
        """[(stage name, call)] of one layer call, in launch order (module docstring)."""
        moe, c = p.ops_moe, p.ops_c
        rows, top_k = topk_ids.shape
        buf = self._buffers(p, rows, top_k)
        ids, al, block = buf["ids"], buf["align"], buf["block"]
        w = p.weights
        m, n, k = rows * top_k, p.padded_intermediate, p.hidden
        self.last_tactic = self.kernel_tactics(p, rows, top_k)

        expert_map = p.expert_map if p.ep else None
        ids = ids if p.ep else topk_ids  # the TP path reads the ids as they come

        def align():
            if p.ep:  # global ids: every non-local id -> expert E, which the map sends to -1
                torch.clamp(topk_ids, -1, p.experts, out=ids)
                ids.remainder_(p.global_experts)
            moe.moe_align_block_size(
                ids, p.global_experts, block, al.sorted_ids, al.expert_ids, al.num_tokens_post_pad, expert_map
            )

        def gemm(a, out, b, scales, top, mul, size_m, size_n, size_k):
            moe.moe_wna16_marlin_gemm(
                a, out, b, None, scales, None, None, None, None, None, p.workspace, al.sorted_ids,
                al.expert_ids, al.num_tokens_post_pad, topk_weights, block, top, mul, FLOAT4_E2M1F_ID,
                size_m, size_n, size_k, GEMM_FLAGS["is_k_full"], GEMM_FLAGS["use_atomic_add"],
                GEMM_FLAGS["use_fp32_reduce"], GEMM_FLAGS["is_zp_float"], GEMM_FLAGS["thread_k"],
                GEMM_FLAGS["thread_n"], GEMM_FLAGS["blocks_per_sm"],
            )  # fmt: skip

        def gemm1():
            p.workspace.zero_()
            gemm(x, buf["cache1"], w.w13, w.w13_scale, top_k, False, rows, 2 * n, k)

        def activation():
            c.silu_and_mul_with_clamp(buf["cache2"], buf["cache1"], p.clamp_limit, 1.0, 0.0)

        def gemm2():
            gemm(buf["cache2"], buf["cache3"], w.w2, w.w2_scale, 1, True, m, k, n)

        def reduce():
            if p.ep:
                moe.moe_sum(buf["cache3"].view(rows, top_k, k), buf["fused"], ids, expert_map)
            else:  # vLLM's ops.moe_sum(input, output): the op's two optional arguments as None
                moe.moe_sum(buf["cache3"].view(rows, top_k, k), buf["fused"], None, None)

        def finalize():
            buf["out"].copy_(buf["fused"])

        return [("align", align), ("gemm1", gemm1), ("activation", activation), ("gemm2", gemm2),
                ("reduce", reduce), ("finalize", finalize)]  # fmt: skip

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] (a buffer owned by `prepared`, overwritten by the next
        call with the same row count)."""
        rows, top_k = self._check(prepared, x, topk_ids, topk_weights)
        for _, call in self._stages(prepared, x, topk_ids, topk_weights):
            call()
        return prepared.buffers[(rows, top_k)]["out"]

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        """align, gemm1, activation, gemm2, reduce, finalize: run once eagerly, then each
        callable re-runs its stage on the buffers the eager run filled."""
        self._check(prepared, x, topk_ids, topk_weights)
        stages = self._stages(prepared, x, topk_ids, topk_weights)
        for _, call in stages:
            call()
        return stages

    def kernel_tactics(self, prepared, rows: int, top_k: int | None = None) -> str:
        """What a call at `rows` runs: vLLM's block_m, Marlin's own thread
        config (-1: its heuristic), the reduction flags, the aligner."""
        top_k = prepared.top_k if top_k is None else top_k
        block = block_size_m(rows, top_k, prepared.experts, prepared.global_experts)
        path = "ep (expert_map)" if prepared.ep else "tp"
        return f"block_m={block},thread_k/n=auto,blocks_per_sm=auto,fp32_reduce=1,atomic_add=0,path={path}"
