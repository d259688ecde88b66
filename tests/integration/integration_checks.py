"""Shared pieces of the integration tests (imported by name: tests/ has no
__init__.py): the tiny shape, a seeded reference layer (`build_reference_layer`)
and a CPU stand-in for `RoutedExpertGemm` (the real kernels need an H200)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.formats import ExpertWeights, generate_expert_weights
from moebench.integration.reference_layer import (
    Mxfp4Experts, ReferenceGate, ReferenceMoELayer, ReferenceRouter, ReferenceSharedExpert,
)  # fmt: skip
from moebench.kernels.front import FrontConfig
from moebench.kernels.tactic import GemmShape, default_tactic
from moebench.models import MoEConfig, RankShape
from moebench.moe_output import UnfinalizedMoEOutput
from moebench.record import max_ctas
from moebench.reference import reference_moe
from moebench.routing import RouterConfig, route
from moebench.kernels.family import FamilyChoice

#: hidden 256, per-rank intermediate 64 (TP2 of 128), padded to 128; 32 experts, top-4;
#: the router folds 1.5.
TINY = MoEConfig("tiny", 256, 128, 32, 4, 1, 1.5, 10.0).shard(2)


def build_reference_layer(
    shape: RankShape,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    image_sentinel_lo: int = 0,
    hash_vocab: int = 0,
    routed_scaling_factor: float = 1.0,
) -> ReferenceMoELayer:
    """A seeded reference layer of one rank of `shape` on `device`.

    Gate weights BF16 [E, H] ~ N(0, 1/H); bias fp32 [E] ~ 0.1 N(0, 1); with
    `image_sentinel_lo` > 0 also bias_vl; with `hash_vocab` > 0 a hash table
    int32 [hash_vocab, top_k] of distinct experts per token. The shared
    expert's intermediate is the rank's routed one (BF16 weights with std
    1/sqrt(K)); routed experts from `generate_expert_weights(shape, seed)`.
    The router folds `shape.routed_scaling_factor`; `routed_scaling_factor`
    is the runner-side factor (1.0 for DeepSeek-V4).
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed + 104729)
    h, e, k, i = shape.hidden, shape.experts, shape.top_k, shape.intermediate

    def randn(*size: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std

    gate = ReferenceGate(randn(e, h, std=h**-0.5).to(torch.bfloat16).to(dev))
    bias = (0.1 * randn(e)).to(dev)
    bias_vl = (0.1 * randn(e)).to(dev) if image_sentinel_lo > 0 else None
    table = None
    if hash_vocab > 0:
        table = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(hash_vocab)])
        table = table.to(torch.int32).to(dev)
    router = ReferenceRouter(e, k, shape.routed_scaling_factor, bias, bias_vl, image_sentinel_lo, table)
    shared = ReferenceSharedExpert(
        randn(i, h, std=h**-0.5).to(torch.bfloat16).to(dev),
        randn(i, h, std=h**-0.5).to(torch.bfloat16).to(dev),
        randn(h, i, std=i**-0.5).to(torch.bfloat16).to(dev),
        shape.swiglu_limit,
    )
    experts = Mxfp4Experts(generate_expert_weights(shape, seed, dev))
    return ReferenceMoELayer(gate, router, shared, experts, routed_scaling_factor=routed_scaling_factor)


@dataclass
class FakeRouting:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class FakeRoutedExpertGemm:
    """`RoutedExpertGemm`'s interface (accepts / route / set_front / front /
    gemms) in torch, from `reference.reference_moe` ("mxfp8", the kernels'
    numerics); `front` is the router reference on the bound FrontConfig.
    `accepts` mirrors the real rule, including the data_ptr check of the
    weights; `calls` counts route / front / gemms calls. Like the real one it
    says which kernel family it stands for (`fp8`, `family`,
    `family_choice`: by default the FP8 family, as with no tuning table) and
    holds that family's built-in tactics (`tactics`, `tactic_sources`)."""

    def __init__(self, weights: ExpertWeights, top_k: int, fp8: bool = True) -> None:
        self.source = weights
        self.top_k = top_k
        self.fp8 = fp8
        self.family = "fp8" if fp8 else "bf16"
        self.family_choice = FamilyChoice(fp8, "built-in", "a stand-in")
        shape = GemmShape.of(weights)
        self.tactics = {(stage, rows): default_tactic(shape, stage, max_ctas(rows, top_k, weights.experts), fp8=fp8)
                        for stage in (1, 2) for rows in range(1, 9)}  # fmt: skip
        self.tactic_sources = {key: "default (stand-in)" for key in self.tactics}
        self.front_config: FrontConfig | None = None
        self.calls = {"route": 0, "front": 0, "gemms": 0}

    @property
    def hidden(self) -> int:
        return self.source.hidden

    @property
    def experts(self) -> int:
        return self.source.experts

    def set_front(self, config: FrontConfig) -> None:
        assert isinstance(config, FrontConfig) and config.experts == self.experts
        self.front_config = config

    def front(self, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None) -> FakeRouting:
        config = self.front_config
        assert config is not None and self.accepts(x)
        self.calls["front"] += 1
        router = RouterConfig(
            self.experts, self.top_k, config.scale, config.bias, config.bias_vl, config.image_sentinel_lo
        )
        weights, ids = route(router_logits, router, input_ids)
        return FakeRouting(x, ids, weights)

    def accepts(self, x: torch.Tensor, weights=None) -> bool:
        ok = (
            isinstance(x, torch.Tensor)
            and x.dim() == 2
            and 1 <= x.shape[0] <= 8
            and x.shape[1] == self.hidden
            and x.dtype == torch.bfloat16
            and x.device == self.source.w13.device
            and x.is_contiguous()
        )
        if ok and weights is not None:
            ok = weights.w13.data_ptr() == self.source.w13.data_ptr() and (
                weights.w2.data_ptr() == self.source.w2.data_ptr()
            )
        return bool(ok)

    def route(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> FakeRouting:
        assert self.accepts(x)
        assert topk_ids.dtype == torch.int32 and tuple(topk_ids.shape) == (x.shape[0], self.top_k)
        assert topk_weights.dtype == torch.float32 and topk_weights.shape == topk_ids.shape
        self.calls["route"] += 1
        return FakeRouting(x, topk_ids, topk_weights)

    def gemms(self, routing: FakeRouting) -> UnfinalizedMoEOutput:
        self.calls["gemms"] += 1
        return self.gemm2(routing, *self.gemm1(routing))

    def gemm1(self, routing: FakeRouting) -> tuple[FakeRouting, None]:
        """Stands in for GEMM1's (H, H scales): GEMM2 below computes both."""
        return routing, None

    def gemm2(self, routing: FakeRouting, h: FakeRouting, h_scale: None) -> UnfinalizedMoEOutput:
        u = reference_moe(routing.x, routing.topk_ids, routing.topk_weights, self.source).unfinalized
        return UnfinalizedMoEOutput(
            u.gemm2_permuted.to(torch.bfloat16).contiguous(), u.expert_weights,
            u.expanded_idx_to_permuted_idx,
        )  # fmt: skip
