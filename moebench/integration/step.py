"""One MoE layer of a decode step, with the finalize left open where it can be.

A layer whose routed experts can stop after GEMM2 hands its caller a
`MoEOutput` with the routed part unfinalized, so the top-k reduction, the
shared-expert add (and, in a serving stack, the all-reduce and the next
RMSNorm) run as one fused kernel:

- low-batch calls (1-8 rows) that the bound `RoutedExpertGemm` accepts run
  the gate and the shared expert as the runner does, then the low-batch
  routed-expert kernels: the fused front (top-k + MXFP8 x + route record in
  one launch) where `front_applies` (bound by `bind_front`), else the
  runner's router and `route`; then `gemms`;
- other calls run the runner's own `_forward_impl` with the deferral raised
  to the call's rows (`deferred_finalize`); a runner that still finalizes
  gets its two parts added here;
- a layer that cannot defer (`defers_finalize`) runs its own forward.

The runner is anything implementing `protocol.MoERunner` (vLLM's names).
`build_moe_steps` builds the steps of a model's MoE layers at load, as a
serving stack does: one `RoutedExpertGemm` per layer that can take the
kernels, from `kernels.binding.build_routed_expert_gemms`, with the fused
front bound where the router allows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moebench.integration.protocol import is_moe_runner
from moebench.integration.reference_layer import Mxfp4Experts
from moebench.integration.side_stream import on_side_stream
from moebench.kernels.front import FrontConfig, to_fp32
from moebench.moe_output import MoEOutput, UnfinalizedMoEOutput

if TYPE_CHECKING:
    from moebench.kernels.binding import RoutedExpertGemm

__all__ = [
    "DEFERRABLE_EXPERTS", "MoEStep", "bind_front", "build_moe_steps", "deferred_finalize", "defers_finalize",
    "front_applies", "front_config", "front_refusal",
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


def defers_finalize(layer: Any, max_num_tokens: int, experts_classes: tuple[type, ...] = DEFERRABLE_EXPERTS) -> bool:
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


def _router_routing_refusal(router: Any) -> str | None:
    """Why the router's routing is not the plain DeepSeek-V4 top-k the fused
    front computes, or None."""
    if getattr(router, "_hash_indices_table", None) is not None:
        return "hash routing (the experts come from a token table, not a top-k)"
    if getattr(router, "scoring_func", None) != "sqrtsoftplus" or not getattr(router, "renormalize", False):
        return "the routing is not renormalized sqrtsoftplus"
    if getattr(router, "e_score_correction_bias", None) is None:
        return "the router has no score-correction bias"
    return None


def _router_image(router: Any) -> bool:
    """Whether the router applies image routing (bias_vl with a sentinel), as
    `routing.route` decides."""
    return getattr(router, "bias_vl", None) is not None and getattr(router, "image_sentinel_lo", 0) > 0


def front_config(runner: Any) -> FrontConfig | str:
    """The FrontConfig of the runner's router (`protocol.Router`), binding its
    bias tensors (bias_vl only where the router does image routing), or why
    its routing is not the DeepSeek-V4 top-k the fused front computes: hash
    routing, another scoring function or no renormalization, no bias, or
    biases / scale the front cannot take (not fp32 [E] contiguous and
    16-byte aligned, E not a multiple of 32 up to 512)."""
    router = runner.router
    reason = _router_routing_refusal(router)
    if reason:
        return reason
    image = _router_image(router)
    try:
        return FrontConfig(
            bias=router.e_score_correction_bias,
            bias_vl=router.bias_vl if image else None,
            image_sentinel_lo=int(router.image_sentinel_lo) if image else 0,
            scale=float(router.routed_scaling_factor),
        )
    except (TypeError, ValueError) as error:
        return f"the router's parameters do not fit the front: {error}"


def bind_front(gemm: Any, runner: Any) -> str | None:
    """Bind the fused front of `gemm` (a `RoutedExpertGemm`) to the runner's
    router (`gemm.set_front(front_config(runner))`) where the router allows
    it and the geometry matches; returns None when bound, else why not (the
    gemm is left as it was)."""
    config = front_config(runner)
    if isinstance(config, str):
        return config
    router = runner.router
    if router.top_k != gemm.top_k or router.global_num_experts != gemm.experts:
        return (
            f"the router's top-{router.top_k} of {router.global_num_experts} experts is not"
            f" the gemm's top-{gemm.top_k} of {gemm.experts}"
        )
    try:
        gemm.set_front(config)
    except (TypeError, ValueError) as error:
        return f"set_front refused: {error}"
    return None


def front_refusal(gemm: Any, runner: Any) -> str | None:
    """Why the fused front may not replace `router.select_experts` +
    `gemm.route` this call, or None when it may (`front_applies`):

    - no front is bound (`gemm.front_config` None: see `bind_front`);
    - a routed-expert capture hook is set (`router.capture_fn`: only
      `select_experts` feeds it) or routing replay is recording
      (`router._routing_replay_out`, vLLM's);
    - the router's routing is not the front's (hash routing, another scoring
      function, no renormalization, no bias);
    - the router's top_k / experts differ from the gemm's;
    - its biases are not the very tensors the front was bound to (a reload
      replaces them), or image routing / its sentinel / the scale changed.
    """
    config = getattr(gemm, "front_config", None)
    if config is None:
        return "no fused front is bound (bind_front / set_front)"
    router = runner.router
    if getattr(router, "capture_fn", None) is not None:
        return "a routed-expert capture hook is set (only select_experts feeds it)"
    if getattr(router, "_routing_replay_out", None) is not None:
        return "routing replay is recording (only select_experts feeds it)"
    reason = _router_routing_refusal(router)
    if reason:
        return reason
    if router.top_k != gemm.top_k or router.global_num_experts != config.experts:
        return f"the router's top-{router.top_k} of {router.global_num_experts} experts is not the front's"
    if router.e_score_correction_bias.data_ptr() != config.bias.data_ptr():
        return "the router's bias is not the tensor the front was bound to"
    if _router_image(router) != config.image:
        return "the router's image routing does not match the front's"
    if config.image and (
        router.bias_vl.data_ptr() != config.bias_vl.data_ptr()
        or int(router.image_sentinel_lo) != config.image_sentinel_lo
    ):
        return "the router's bias_vl or image sentinel is not the one the front was bound to"
    if to_fp32(router.routed_scaling_factor) != config.scale_f32:
        return "the router's routed_scaling_factor is not the front's"
    return None


def front_applies(gemm: Any, runner: Any) -> bool:
    """Whether the fused front (router top-k + MXFP8 quantize + route record
    in one kernel) may replace `router.select_experts` + `gemm.route` this
    call: `front_refusal(gemm, runner)` is None (it says why not)."""
    return front_refusal(gemm, runner) is None


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
    layer's routed-expert weights, or None (then no low-batch kernels); it
    runs the fused front where `front_applies` (bind it with `bind_front`);
    max_rows: the most rows a call of this step has (the deferral bound).
    `deferrable` = `defers_finalize(layer, max_rows)`; a non-deferrable layer
    never uses `gemm` (its output must be finalized anyway).
    overlap_shared: on the low-batch kernels, run the shared expert on a side
    stream beside the gate and the routed experts (`side_stream.on_side_stream`:
    forked from and joined back into the current stream, so a CUDA graph
    captures both branches); the output is the same bits either way.
    Raises ValueError for a bad max_rows, TypeError for a non-bool
    overlap_shared or a layer that is not a `protocol.MoERunner`
    (`protocol.is_moe_runner`).
    """

    def __init__(
        self,
        layer: Any,
        gemm: RoutedExpertGemm | None,
        max_rows: int,
        experts_classes: tuple[type, ...] = DEFERRABLE_EXPERTS,
        *,
        overlap_shared: bool = True,
    ) -> None:
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows <= 0:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        if not isinstance(overlap_shared, bool):
            raise TypeError(f"overlap_shared must be a bool, got {type(overlap_shared).__name__}")
        if not is_moe_runner(layer):
            raise TypeError(
                f"layer must implement protocol.MoERunner (gate, router, _shared_experts, routed_experts,"
                f" moe_config, routed_scaling_factor, _forward_impl, forward), got {type(layer).__name__}"
            )
        self.layer = layer
        self.max_rows = max_rows
        self.deferrable = defers_finalize(layer, max_rows, experts_classes)
        self.gemm = gemm if self.deferrable else None
        self.overlap_shared = overlap_shared

    def uses_kernels(self, x: torch.Tensor, low_batch: bool) -> bool:
        """Whether `run(x, ..., low_batch)` takes the low-batch kernels: a
        deferrable layer with a gemm that accepts `x` and the runner's current
        weights (a weight reload since binding makes it refuse)."""
        return (
            low_batch and self.gemm is not None and self.gemm.accepts(x, current_weights(self.layer))  # type: ignore[arg-type]
        )

    def run(self, x: torch.Tensor, input_ids: torch.Tensor | None, low_batch: bool) -> torch.Tensor | MoEOutput:
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
        shared expert (on a side stream with `overlap_shared`, else first, in
        order), gate and router as the runner runs them. Returns the
        unfinalized routed output and the shared output."""
        layer, gemm = self.layer, self.gemm
        assert gemm is not None
        with on_side_stream(layer._shared_experts, x, self.overlap_shared) as shared_output:
            router_logits, _ = layer.gate(x)
            if front_applies(gemm, layer):
                routing = gemm.front(x, router_logits, input_ids)
            else:
                topk_weights, topk_ids = layer.router.select_experts(
                    hidden_states=x,
                    router_logits=router_logits,
                    topk_indices_dtype=torch.int32,
                    input_ids=input_ids,
                )
                routing = gemm.route(x, topk_ids.to(torch.int32), topk_weights.to(torch.float32))
            routed = gemm.gemms(routing)
        return routed, shared_output


def build_moe_steps(
    runners: list[Any],
    max_rows: int,
    *,
    tactics: dict | None = None,
    fp8: bool | None = None,
    front: bool = True,
    experts_classes: tuple[type, ...] = DEFERRABLE_EXPERTS,
    overlap_shared: bool = True,
) -> list[MoEStep]:
    """One `MoEStep` per runner (`protocol.MoERunner`), as a serving stack
    builds its decode step at load: the runners that defer
    (`defers_finalize(runner, max_rows, experts_classes)`) and whose routed
    experts give their canonical weights (`expert_weights()`, as
    `reference_layer.Mxfp4Experts`) get a `RoutedExpertGemm` from
    `kernels.binding.build_routed_expert_gemms` (tactics / fp8 as there: None
    lets the tuning tables choose; a layer the kernels refuse gets None, and
    the builder logs why); with `front` its fused front is bound to the
    runner's router where the routing allows it (`bind_front`: a refusal
    leaves the router + route path, `front_refusal` says why). The others
    get a step without kernels. Raises as `MoEStep`."""
    from moebench.kernels.binding import build_routed_expert_gemms

    bindable = [
        defers_finalize(runner, max_rows, experts_classes)
        and callable(getattr(runner.routed_experts, "expert_weights", None))
        for runner in runners
    ]
    layers = [(r.routed_experts.expert_weights(), r.router.top_k) for r, ok in zip(runners, bindable) if ok]
    gemms = iter(build_routed_expert_gemms(layers, tactics, fp8))
    steps = []
    for runner, ok in zip(runners, bindable):
        gemm = next(gemms) if ok else None
        if gemm is not None and front:
            bind_front(gemm, runner)
        steps.append(MoEStep(runner, gemm, max_rows, experts_classes, overlap_shared=overlap_shared))
    return steps
