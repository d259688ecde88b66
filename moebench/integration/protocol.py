"""What `moebench.integration.step.MoEStep` needs of a MoE layer's runner.

The attribute names are vLLM's (its fused-MoE runner of a DeepSeek-V4 MoE
layer), so that layer can be handed to the step as it is; the torch reference
(`reference_layer.ReferenceMoELayer`) implements the same names. Only what the
step reads is listed. Shapes are per tensor-parallel rank: rows T (1..8 in the
low-batch path), hidden H, routed experts E, experts per row top_k, padded
intermediate Ip.

The classes are `typing.Protocol`s marked runtime-checkable: `isinstance`
checks that the attributes and methods exist (not their signatures or types),
which is what a test double shaped like vLLM's layer can be held to.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = [
    "DeferralConfig", "Gate", "MoERunner", "RoutedExperts", "Router", "SharedExperts",
    "is_moe_runner",
]  # fmt: skip


@runtime_checkable
class DeferralConfig(Protocol):
    """The runner's `moe_config`: whether its experts may leave the top-k
    reduction (the finalize) to the caller.

    _defer_moe_finalize: bool, the deferral switch the stock forward reads.
    defer_moe_finalize_max_num_tokens: int, calls of at most this many rows defer.
    should_defer_moe_finalize(num_tokens) -> bool: whether a call of
    `num_tokens` rows returns an `UnfinalizedMoEOutput` (False where the
    deployment cannot defer at all, whatever the two fields say).
    """

    _defer_moe_finalize: bool
    defer_moe_finalize_max_num_tokens: int

    def should_defer_moe_finalize(self, num_tokens: int) -> bool: ...


@runtime_checkable
class Router(Protocol):
    """The runner's `router` (DeepSeek-V4 `sqrtsoftplus` top-k, docs/design.md "Routing").

    e_score_correction_bias: fp32 [E] or None, the selection bias of text rows.
    bias_vl: fp32 [E] or None, the selection bias of image rows.
    image_sentinel_lo: int, first of the five image sentinel token ids (0 = none).
    top_k: int; global_num_experts: int (E).
    scoring_func: str ("sqrtsoftplus"); renormalize: bool (True).
    routed_scaling_factor: float, folded into the weights by the router.
    _hash_indices_table: int [vocab, top_k] or None (hash-routed layers).
    capture_fn: callable(topk_ids) or None, a routed-expert capture hook that
        only `select_experts` feeds (a fused front must not bypass it).
    select_experts(hidden_states=, router_logits=, topk_indices_dtype=,
        input_ids=) -> (topk_weights fp32 [T, top_k], topk_ids int [T, top_k]).
    """

    e_score_correction_bias: torch.Tensor | None
    bias_vl: torch.Tensor | None
    image_sentinel_lo: int
    top_k: int
    global_num_experts: int
    scoring_func: str
    renormalize: bool
    routed_scaling_factor: float
    _hash_indices_table: torch.Tensor | None
    capture_fn: Callable[[torch.Tensor], Any] | None

    def select_experts(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk_indices_dtype: torch.dtype | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class Gate(Protocol):
    """The runner's `gate`: x BF16 [T, H] -> (router_logits fp32 [T, E], bias or None)."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]: ...


@runtime_checkable
class SharedExperts(Protocol):
    """The runner's `_shared_experts`: x BF16 [T, H] -> shared output BF16 [T, H]
    (TP-partial, not all-reduced). vLLM's wrapper also runs it asynchronously
    (`maybe_forward_async` / `wait` / `output`); the step calls it directly."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class RoutedExperts(Protocol):
    """The runner's `routed_experts`: the rank's canonical MXFP4 expert weights
    (`formats.ExpertWeights` layout) under vLLM's parameter names.

    w13_weight uint8 [E, 2*Ip, H/2]; w13_weight_scale uint8 [E, 2*Ip, H/32];
    w2_weight uint8 [E, H, Ip/2]; w2_weight_scale uint8 [E, H, Ip/32].
    quant_method: its `experts_cls` names the experts implementation
    (`step.defers_finalize` admits only the MXFP4 experts the kernels replace)
    and `topk_indices_dtype` the dtype `select_experts` is asked for.
    A weight reload assigns new tensors to these attributes.
    """

    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    quant_method: Any


@runtime_checkable
class MoERunner(Protocol):
    """A MoE layer's runner as the step drives it.

    gate: `Gate`; router: `Router`; _shared_experts: `SharedExperts` (one
    shared expert; the step needs it); routed_experts: `RoutedExperts`;
    routed_scaling_factor: float applied by the runner to the routed sum
    (1.0 where the router folds it, as for DeepSeek-V4); moe_config:
    `DeferralConfig`.
    _forward_impl(hidden_states, router_input, shared_input, input_ids) ->
        (shared_output BF16 [T, H], routed): the body of the runner's forward
        (vLLM's custom op around it returns tensors only). The step passes x
        for the first three. routed is an `UnfinalizedMoEOutput` when
        `moe_config.should_defer_moe_finalize(T)`, else BF16 [T, H] finalized
        (routed scale applied); the caller adds the two.
    forward(hidden_states, input_ids) -> BF16 [T, H]: the layer's own,
        finalized output (what the step returns for a layer that cannot defer).
    """

    gate: Any
    router: Any
    _shared_experts: Any
    routed_experts: Any
    routed_scaling_factor: float
    moe_config: Any

    def _forward_impl(
        self,
        hidden_states: torch.Tensor,
        router_input: torch.Tensor,
        shared_input: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, Any]: ...

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor: ...


def is_moe_runner(runner: object) -> bool:
    """Whether `runner` and its parts have every attribute and method the step
    reads (`MoERunner` and the protocols of its attributes). Checks presence,
    not signatures or tensor shapes."""
    return (
        isinstance(runner, MoERunner)
        and isinstance(runner.gate, Gate)
        and isinstance(runner.router, Router)
        and isinstance(runner._shared_experts, SharedExperts)
        and isinstance(runner.routed_experts, RoutedExperts)
        and isinstance(runner.moe_config, DeferralConfig)
    )
