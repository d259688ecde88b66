"""A reference DeepSeek-V4 MoE layer in torch, shaped like vLLM's runner.

One rank of the layer (`models.RankShape`), implementing `protocol.MoERunner`:

    x BF16 [T, H] ─► gate (BF16 weights, fp32 logits [T, E]) ─► router (sqrtsoftplus top-k)
      ├─► shared expert (BF16 SwiGLU with the clamp)                      ─► shared [T, H]
      └─► routed experts (MXFP4, `reference.reference_moe`, MXFP8 x and H) ─► routed
    forward = shared + finalize(routed)

The routed experts use the numerics of the low-batch kernels (the "mxfp8"
oracle), so the step's two paths agree to the kernels' tolerance. The
reference runs host-side loops (not CUDA-graph capturable); gate, shared
expert and router have no host synchronization unless a hash table is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moebench.formats import ExpertWeights
from moebench.moe_output import UnfinalizedMoEOutput, finalize
from moebench.record import MAX_ROWS
from moebench.reference import reference_moe, swiglu_clamped
from moebench.routing import RouterConfig, route

__all__ = [
    "Mxfp4Experts", "ReferenceGate", "ReferenceMoEConfig", "ReferenceMoELayer",
    "ReferenceRouter", "ReferenceSharedExpert",
]  # fmt: skip


@dataclass
class ReferenceMoEConfig:
    """The deferral fields of vLLM's fused-MoE config (`protocol.DeferralConfig`).

    deferral_supported: False models a deployment whose experts can never
    leave the finalize to the caller (e.g. expert parallel); then
    `should_defer_moe_finalize` is False whatever the other fields say.
    """

    _defer_moe_finalize: bool = False
    defer_moe_finalize_max_num_tokens: int = 0
    deferral_supported: bool = True

    def should_defer_moe_finalize(self, num_tokens: int) -> bool:
        return (
            self.deferral_supported
            and self._defer_moe_finalize
            and num_tokens <= self.defer_moe_finalize_max_num_tokens
        )


class ReferenceGate:
    """BF16 linear H -> E: weight BF16 [E, H]; returns (fp32 logits [T, E], None)
    (fp32 products of the BF16 operands, fp32 accumulation)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x.float(), self.weight.float()), None


class ReferenceRouter:
    """The DeepSeek-V4 router under vLLM's attribute names (`protocol.Router`),
    computed by `routing.route`. `routed_scaling_factor` is folded into the
    weights. `capture_fn`, when set, is called with each call's topk_ids."""

    scoring_func = "sqrtsoftplus"
    renormalize = True

    def __init__(
        self,
        experts: int,
        top_k: int,
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: torch.Tensor | None = None,
        bias_vl: torch.Tensor | None = None,
        image_sentinel_lo: int = 0,
        hash_indices_table: torch.Tensor | None = None,
    ) -> None:
        self.global_num_experts = experts
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias = e_score_correction_bias
        self.bias_vl = bias_vl
        self.image_sentinel_lo = image_sentinel_lo
        self._hash_indices_table = hash_indices_table
        self.capture_fn: Callable[[torch.Tensor], Any] | None = None

    def config(self) -> RouterConfig:
        """The current attributes as a `routing.RouterConfig` (validated)."""
        return RouterConfig(
            experts=self.global_num_experts,
            top_k=self.top_k,
            routed_scaling_factor=self.routed_scaling_factor,
            bias=self.e_score_correction_bias,
            bias_vl=self.bias_vl,
            image_sentinel_lo=self.image_sentinel_lo,
            hash_table=self._hash_indices_table,
        )

    def select_experts(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk_indices_dtype: torch.dtype | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, top_k], topk_ids [T, top_k] in
        `topk_indices_dtype`, default int32); `hidden_states` is unused."""
        weights, ids = route(router_logits, self.config(), input_ids)
        ids = ids.to(topk_indices_dtype or torch.int32)
        if self.capture_fn is not None:
            self.capture_fn(ids)
        return weights, ids


class ReferenceSharedExpert:
    """One shared expert: BF16 weights w1 (gate) [Is, H], w3 (up) [Is, H],
    w2 [H, Is]; out = w2 . swiglu_clamped(w1 x, w3 x, limit), fp32 inside,
    BF16 [T, H] out. The fp32 copies of the weights (exact: BF16 widens
    losslessly) are made once here, not per call; replace the expert to
    change its weights."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> None:
        self.w1, self.w3, self.w2, self.limit = w1, w3, w2, limit
        self.w1_f32, self.w3_f32, self.w2_f32 = w1.float(), w3.float(), w2.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        h = swiglu_clamped(xf @ self.w1_f32.T, xf @ self.w3_f32.T, self.limit)
        return (h @ self.w2_f32.T).to(torch.bfloat16)


class _Mxfp4QuantMethod:
    """The `quant_method` of `Mxfp4Experts`: names the experts class and the
    top-k index dtype (vLLM's attribute names)."""

    def __init__(self, experts_cls: type) -> None:
        self.experts_cls = experts_cls
        self.topk_indices_dtype = torch.int32


class Mxfp4Experts:
    """The rank's routed experts with canonical MXFP4 weights under vLLM's
    names (`protocol.RoutedExperts`); `clamp` fp32 [E] and `intermediate` (the
    logical per-rank I) complete `formats.ExpertWeights`. This is the experts
    class the low-batch kernels replace (`step.DEFERRABLE_EXPERTS`)."""

    def __init__(self, weights: ExpertWeights) -> None:
        self.load(weights)
        self.quant_method = _Mxfp4QuantMethod(type(self))

    def load(self, weights: ExpertWeights) -> None:
        """(Re)load: take `weights`' tensors as the current ones (a reload
        replaces the tensors, as a vLLM weight reload does)."""
        self.w13_weight = weights.w13
        self.w13_weight_scale = weights.w13_scale
        self.w2_weight = weights.w2
        self.w2_weight_scale = weights.w2_scale
        self.clamp = weights.clamp
        self.intermediate = weights.intermediate

    def expert_weights(self) -> ExpertWeights:
        """The current tensors as `formats.ExpertWeights` (no copies)."""
        return ExpertWeights(
            self.w13_weight, self.w13_weight_scale, self.w2_weight, self.w2_weight_scale,
            self.clamp, intermediate=self.intermediate,
        )  # fmt: skip

    def forward_unfinalized(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> UnfinalizedMoEOutput:
        """Unweighted BF16 GEMM2 rows with the routing (`reference_moe`, MXFP8 x
        and H), for any number of rows: the route record takes `MAX_ROWS` rows,
        so longer calls run in chunks whose rows and permute maps are joined."""
        weights = self.expert_weights()
        rows, maps, offset = [], [], 0
        for start in range(0, x.shape[0], MAX_ROWS):
            part = slice(start, start + MAX_ROWS)
            u = reference_moe(x[part], topk_ids[part], topk_weights[part], weights).unfinalized
            idx = u.expanded_idx_to_permuted_idx
            maps.append(torch.where(idx >= 0, idx + offset, idx))
            rows.append(u.gemm2_permuted.to(torch.bfloat16))
            offset += u.gemm2_permuted.shape[0]
        return UnfinalizedMoEOutput(torch.cat(rows).contiguous(), topk_weights.float(), torch.cat(maps).to(torch.int32))


class ReferenceMoELayer:
    """A DeepSeek-V4 MoE layer (one rank) implementing `protocol.MoERunner`.

    `_forward_impl` returns (shared_output, routed): routed unfinalized when
    `moe_config.should_defer_moe_finalize(T)` (then without the runner-side
    `routed_scaling_factor`, which the caller must apply), else finalized BF16
    [T, H] with it applied. `forward(x, input_ids)` is the finalized output.
    """

    def __init__(
        self,
        gate: ReferenceGate,
        router: ReferenceRouter,
        shared: ReferenceSharedExpert,
        experts: Any,
        moe_config: ReferenceMoEConfig | None = None,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        self.gate = gate
        self.router = router
        self._shared_experts = shared
        self.routed_experts = experts
        self.moe_config = moe_config or ReferenceMoEConfig()
        self.routed_scaling_factor = routed_scaling_factor

    def _forward_impl(
        self,
        hidden_states: torch.Tensor,
        router_input: torch.Tensor | None = None,
        shared_input: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | UnfinalizedMoEOutput]:
        """The layer's body; router_input / shared_input default to hidden_states."""
        router_input = hidden_states if router_input is None else router_input
        shared_input = hidden_states if shared_input is None else shared_input
        shared_output = self._shared_experts(shared_input)
        logits, _ = self.gate(router_input)
        weights, ids = self.router.select_experts(
            hidden_states=router_input, router_logits=logits,
            topk_indices_dtype=self.routed_experts.quant_method.topk_indices_dtype,
            input_ids=input_ids,
        )  # fmt: skip
        routed = self.routed_experts.forward_unfinalized(hidden_states, ids, weights)
        if self.moe_config.should_defer_moe_finalize(hidden_states.shape[0]):
            return shared_output, routed
        return shared_output, finalize(routed, scale=self.routed_scaling_factor, out_dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The finalized layer output BF16 [T, H] = shared + routed (fp32 sum)."""
        shared_output, routed = self._forward_impl(x, x, x, input_ids)
        return finalize(routed, scale=self._scale_left(routed), shared=shared_output, out_dtype=torch.bfloat16)

    __call__ = forward

    def _scale_left(self, routed: torch.Tensor | UnfinalizedMoEOutput) -> float:
        return self.routed_scaling_factor if isinstance(routed, UnfinalizedMoEOutput) else 1.0
