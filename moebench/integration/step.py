"""One MoE layer of a decode step, with the finalize left open where it can be.

A layer whose routed experts can stop after GEMM2 hands its caller a
`MoEOutput` with the routed part unfinalized, so the top-k reduction, the
shared-expert add (and, in a serving stack, the all-reduce and the next
RMSNorm) run as one fused kernel:

- low-batch calls (1-8 rows) that the bound `RoutedExpertGemm` accepts run
  the gate, the shared expert and the router as the runner does, then the
  low-batch routed-expert kernels (`route` + `gemms`);
- other calls run the runner's own `_forward_impl` with the deferral raised
  to the call's rows (`deferred_finalize`); a runner that still finalizes
  gets its two parts added here;
- a layer that cannot defer (`defers_finalize`) runs its own forward.

The runner is anything implementing `protocol.MoERunner` (vLLM's names).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moebench.integration.reference_layer import Mxfp4Experts
from moebench.moe_output import MoEOutput, UnfinalizedMoEOutput

if TYPE_CHECKING:
    from moebench.kernels.binding import RoutedExpertGemm

__all__ = [
    "DEFERRABLE_EXPERTS", "MoEStep", "deferred_finalize", "defers_finalize", "front_applies",
]  # fmt: skip

#: Experts classes (`routed_experts.quant_method.experts_cls`) whose calls the
#: low-batch kernels may replace and whose output may stay unfinalized: the
#: canonical-MXFP4 experts. A serving integration appends its own (e.g. vLLM's
#: TRT-LLM MXFP4 experts) to the tuple it passes to `defers_finalize`.
DEFERRABLE_EXPERTS: tuple[type, ...] = (Mxfp4Experts,)


@contextmanager
def deferred_finalize(config: Any, max_num_tokens: int) -> Iterator[None]:
    """Within the block, `config` (a `protocol.DeferralConfig`) lets calls of
    up to `max_num_tokens` rows leave the top-k reduction to the caller; on
    leaving (also by an exception) the layer's own two fields are restored,
    since the layer's stock forward reads them."""
    saved = config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens
    config._defer_moe_finalize = True
    config.defer_moe_finalize_max_num_tokens = max_num_tokens
    try:
        yield
    finally:
        config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens = saved


def experts_class(runner: Any) -> type | None:
    """`runner.routed_experts.quant_method.experts_cls`, or None where absent."""
    method = getattr(getattr(runner, "routed_experts", None), "quant_method", None)
    return getattr(method, "experts_cls", None)


def defers_finalize(
    layer: Any, max_num_tokens: int, experts_classes: tuple[type, ...] = DEFERRABLE_EXPERTS
) -> bool:
    """Whether `layer` (a `protocol.MoERunner`) can leave the top-k reduction
    of calls of up to `max_num_tokens` rows to its caller. All three must hold:

    - its experts class (`experts_class`) is one of `experts_classes` (by
      identity, not subclass: another implementation may finalize inside);
    - its runner-side `routed_scaling_factor` is 1.0 (an unfinalized output
      does not carry it; DeepSeek-V4's router folds it into the weights);
    - its `moe_config` defers such calls once asked (`deferred_finalize`);
      the config is left as it was.
    """
    if experts_class(layer) not in experts_classes or layer.routed_scaling_factor != 1.0:
        return False
    config = layer.moe_config
    with deferred_finalize(config, max_num_tokens):
        return bool(config.should_defer_moe_finalize(max_num_tokens))


def front_applies(gemm: Any, runner: Any) -> bool:
    """Whether a fused front (router top-k + MXFP8 quantize + route record in
    one kernel) may replace `router.select_experts` + `gemm.route` this call.

    Always False for now: the fused front is issue 5 item 1 and is not built.
    When it is, this must also refuse while `runner.router.capture_fn` is set
    (only `select_experts` feeds that hook) and unless the router's bias
    tensors (`e_score_correction_bias`, `bias_vl`) are the very tensors the
    front was bound to (a reload replaces them).
    """
    return False


@dataclass(frozen=True)
class _CurrentWeights:
    """The runner's current w13 / w2 tensors, which is all
    `RoutedExpertGemm.accepts` compares (by data_ptr) with the bound ones."""

    w13: torch.Tensor
    w2: torch.Tensor


def current_weights(runner: Any) -> _CurrentWeights:
    """The tensors the runner holds now (`routed_experts.w13_weight` / `w2_weight`)."""
    experts = runner.routed_experts
    return _CurrentWeights(experts.w13_weight, experts.w2_weight)


class MoEStep:
    """One MoE layer of the decode step.

    layer: a `protocol.MoERunner`; gemm: the `RoutedExpertGemm` bound to the
    layer's routed-expert weights, or None (then no low-batch kernels);
    max_rows: the most rows a call of this step has (the deferral bound).
    `deferrable` = `defers_finalize(layer, max_rows)`; a non-deferrable layer
    never uses `gemm` (its output must be finalized anyway).
    """

    def __init__(
        self,
        layer: Any,
        gemm: RoutedExpertGemm | None,
        max_rows: int,
        experts_classes: tuple[type, ...] = DEFERRABLE_EXPERTS,
    ) -> None:
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows <= 0:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        self.layer = layer
        self.max_rows = max_rows
        self.deferrable = defers_finalize(layer, max_rows, experts_classes)
        self.gemm = gemm if self.deferrable else None

    def uses_kernels(self, x: torch.Tensor, low_batch: bool) -> bool:
        """Whether `run(x, ..., low_batch)` takes the low-batch kernels: a
        deferrable layer with a gemm that accepts `x` and the runner's current
        weights (a weight reload since binding makes it refuse)."""
        return (
            low_batch
            and self.gemm is not None
            and self.gemm.accepts(x, current_weights(self.layer))  # type: ignore[arg-type]
        )

    def run(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, low_batch: bool
    ) -> torch.Tensor | MoEOutput:
        """The layer's TP-partial output of `x` BF16 [T, H]: a `MoEOutput`
        (routed part unfinalized) where the layer defers, else the finalized
        BF16 [T, H] tensor. `input_ids` [T] int feeds image / hash routing."""
        if not self.deferrable:
            return self.layer.forward(x, input_ids)
        if self.uses_kernels(x, low_batch):
            routed, shared_output = self._forward_low_batch(x, input_ids)
            return MoEOutput(routed=routed, shared_output=shared_output)
        with deferred_finalize(self.layer.moe_config, x.shape[0]):
            shared_output, routed = self.layer._forward_impl(x, x, x, input_ids)
        if shared_output is None:
            raise RuntimeError("the runner returned no shared-expert output")
        if isinstance(routed, UnfinalizedMoEOutput):
            return MoEOutput(routed=routed, shared_output=shared_output)
        # A runner may still finalize (e.g. one that splits a call across launches).
        return shared_output + routed

    def _forward_low_batch(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[UnfinalizedMoEOutput, torch.Tensor]:
        """The runner's body with the routed experts on the low-batch kernels:
        gate, shared expert and router as the runner runs them. Returns the
        unfinalized routed output and the shared output."""
        layer, gemm = self.layer, self.gemm
        assert gemm is not None
        router_logits, _ = layer.gate(x)
        shared_output = layer._shared_experts(x)
        if front_applies(gemm, layer):  # pragma: no cover - not built yet (issue 5 item 1)
            routing = gemm.front(x, router_logits, input_ids)
        else:
            topk_weights, topk_ids = layer.router.select_experts(
                hidden_states=x,
                router_logits=router_logits,
                topk_indices_dtype=torch.int32,
                input_ids=input_ids,
            )
            routing = gemm.route(x, topk_ids.to(torch.int32), topk_weights.to(torch.float32))
        return gemm.gemms(routing), shared_output
