"""Shared pieces of the integration tests (imported by name: tests/ has no
__init__.py), the tiny shape and a CPU stand-in
for `RoutedExpertGemm` (the real kernels need an H200)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.formats import ExpertWeights
from moebench.kernels.front import FrontConfig
from moebench.kernels.tactic import GemmShape, default_tactic
from moebench.models import MoEConfig
from moebench.moe_output import UnfinalizedMoEOutput
from moebench.record import max_ctas
from moebench.reference import reference_moe
from moebench.routing import RouterConfig, route
from moebench.kernels.family import FamilyChoice

#: hidden 256, per-rank intermediate 64 (TP2 of 128), padded to 128; 32 experts, top-4;
#: the router folds 1.5.
TINY = MoEConfig("tiny", 256, 128, 32, 4, 1, 1.5, 10.0).shard(2)


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
