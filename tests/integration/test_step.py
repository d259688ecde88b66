"""MoEStep and its deferral helpers on the reference layer (CPU, with a torch
stand-in for the kernels), plus GPU tests with the real RoutedExpertGemm."""

from __future__ import annotations

import pytest
import torch

from integration_checks import TINY, FakeRoutedExpertGemm, build_reference_layer
from moebench.formats import generate_activations, generate_expert_weights
from moebench.integration.protocol import (
    DeferralConfig, MoERunner, RoutedExperts, Router, is_moe_runner,
)  # fmt: skip
from moebench.integration.reference_layer import ReferenceMoEConfig
from moebench.integration.step import (
    MoEStep, bind_front, build_moe_steps, current_weights, deferred_finalize, defers_finalize, front_applies,
    front_config, front_refusal,
)  # fmt: skip
from moebench.kernels.front import FrontConfig
from moebench.moe_output import MoEOutput, UnfinalizedMoEOutput
from moebench.reference import relative_error


@pytest.fixture()
def layer():
    return build_reference_layer(TINY, seed=11)


def _finalized(out) -> torch.Tensor:
    return out.finalize(torch.bfloat16) if isinstance(out, MoEOutput) else out


# ----------------------------------------------------------------------------- deferral helpers


def test_deferred_finalize_sets_then_restores():
    config = ReferenceMoEConfig(_defer_moe_finalize=False, defer_moe_finalize_max_num_tokens=3)
    with deferred_finalize(config, 64):
        assert config._defer_moe_finalize and config.defer_moe_finalize_max_num_tokens == 64
        assert config.should_defer_moe_finalize(64) and not config.should_defer_moe_finalize(65)
    assert (config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens) == (False, 3)


def test_deferred_finalize_restores_after_an_exception():
    config = ReferenceMoEConfig(_defer_moe_finalize=True, defer_moe_finalize_max_num_tokens=2)
    with pytest.raises(KeyError):
        with deferred_finalize(config, 8):
            raise KeyError("boom")
    assert (config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens) == (True, 2)


def test_defers_finalize(layer):
    assert defers_finalize(layer, 8)
    # The config is left as it was.
    assert (layer.moe_config._defer_moe_finalize, layer.moe_config.defer_moe_finalize_max_num_tokens) == (False, 0)


def test_defers_finalize_false_for_runner_side_scaling(layer):
    layer.routed_scaling_factor = 2.5
    assert not defers_finalize(layer, 8)


def test_defers_finalize_false_for_another_experts_class(layer):
    class OtherExperts:  # e.g. experts that finalize inside their own kernel
        pass

    layer.routed_experts.quant_method.experts_cls = OtherExperts
    assert not defers_finalize(layer, 8)
    # A subclass is another implementation too.
    layer.routed_experts.quant_method.experts_cls = type("Sub", (type(layer.routed_experts),), {})
    assert not defers_finalize(layer, 8)
    # ...unless the caller admits it.
    assert defers_finalize(layer, 8, experts_classes=(layer.routed_experts.quant_method.experts_cls,))


def test_defers_finalize_false_for_a_config_that_cannot_defer(layer):
    layer.moe_config.deferral_supported = False
    assert not defers_finalize(layer, 8)


def _fake(layer):
    return FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)


def test_front_applies_is_false_until_a_front_is_bound(layer):
    gemm = _fake(layer)
    assert front_applies(gemm, layer) is False
    assert "no fused front" in front_refusal(gemm, layer)


def test_bind_front_binds_the_routers_tensors(layer):
    gemm = _fake(layer)
    assert bind_front(gemm, layer) is None
    config = gemm.front_config
    assert config.bias is layer.router.e_score_correction_bias and config.bias_vl is None
    assert config.image_sentinel_lo == 0 and config.scale == TINY.routed_scaling_factor
    assert front_applies(gemm, layer) and front_refusal(gemm, layer) is None


def test_front_applies_false_while_a_capture_hook_is_set(layer):
    gemm = _fake(layer)
    bind_front(gemm, layer)
    layer.router.capture_fn = lambda ids: None
    assert not front_applies(gemm, layer)
    assert "capture" in front_refusal(gemm, layer)
    layer.router.capture_fn = None
    layer.router._routing_replay_out = torch.zeros(1)  # vLLM's routing replay
    assert "replay" in front_refusal(gemm, layer)


def test_front_applies_false_once_the_bias_is_replaced(layer):
    gemm = _fake(layer)
    bind_front(gemm, layer)
    layer.router.e_score_correction_bias = layer.router.e_score_correction_bias.clone()  # a reload
    assert not front_applies(gemm, layer)
    assert "bias is not the tensor" in front_refusal(gemm, layer)
    layer.router.e_score_correction_bias = None
    assert "no score-correction bias" in front_refusal(gemm, layer)


def test_hash_layers_are_not_front_eligible():
    layer = build_reference_layer(TINY, seed=12, hash_vocab=20)
    gemm = _fake(layer)
    assert "hash routing" in front_config(layer)
    assert "hash routing" in bind_front(gemm, layer) and gemm.front_config is None
    # A front bound before the router became hash-routed is refused too.
    gemm.set_front(FrontConfig(layer.router.e_score_correction_bias, scale=TINY.routed_scaling_factor))
    assert not front_applies(gemm, layer) and "hash routing" in front_refusal(gemm, layer)


def test_image_routing_binds_bias_vl_and_follows_its_tensors():
    layer = build_reference_layer(TINY, seed=12, image_sentinel_lo=500)
    gemm = _fake(layer)
    assert bind_front(gemm, layer) is None
    assert gemm.front_config.bias_vl is layer.router.bias_vl
    assert gemm.front_config.image_sentinel_lo == 500 and front_applies(gemm, layer)
    layer.router.image_sentinel_lo = 600
    assert "sentinel" in front_refusal(gemm, layer)
    layer.router.image_sentinel_lo = 500
    layer.router.bias_vl = layer.router.bias_vl.clone()
    assert "bias_vl" in front_refusal(gemm, layer)
    layer.router.bias_vl = None  # the router stopped image routing
    assert "image routing" in front_refusal(gemm, layer)


def test_front_refuses_other_routing_and_geometry(layer):
    gemm = _fake(layer)
    bind_front(gemm, layer)
    layer.router.routed_scaling_factor = 2.5
    assert "routed_scaling_factor" in front_refusal(gemm, layer)
    layer.router.routed_scaling_factor = TINY.routed_scaling_factor
    layer.router.top_k = 2
    assert "top-2" in front_refusal(gemm, layer)
    assert "top-2" in bind_front(_fake(layer), layer)
    layer.router.top_k = TINY.top_k
    layer.router.scoring_func = "softmax"
    assert "sqrtsoftplus" in front_refusal(gemm, layer) and "sqrtsoftplus" in front_config(layer)
    layer.router.scoring_func = "sqrtsoftplus"
    assert front_applies(gemm, layer)


def test_front_config_reports_biases_the_front_cannot_take(layer):
    layer.router.e_score_correction_bias = layer.router.e_score_correction_bias.double()
    assert "do not fit the front" in front_config(layer)


def test_vllm_shaped_router_gets_a_front_config():
    config = front_config(VllmLikeRunner())
    assert isinstance(config, FrontConfig) and config.experts == 32 and config.scale == 1.5


# ----------------------------------------------------------------------------- MoEStep paths


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_low_batch_path_uses_the_gemm(layer, rows):
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    step = MoEStep(layer, gemm, max_rows=64)
    x = generate_activations(rows, TINY.hidden, seed=rows)
    out = step.run(x, None, low_batch=True)
    assert isinstance(out, MoEOutput) and isinstance(out.routed, UnfinalizedMoEOutput)
    assert gemm.calls == {"route": 1, "front": 0, "gemms": 1}
    assert relative_error(out.finalize(torch.bfloat16), layer.forward(x)) < 1e-2


@pytest.mark.parametrize("overlap", [True, False])
def test_low_batch_path_with_and_without_the_side_stream(layer, overlap):
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    x = generate_activations(4, TINY.hidden, seed=1)
    out = MoEStep(layer, gemm, 8, overlap_shared=overlap).run(x, None, low_batch=True)
    assert torch.equal(out.shared_output, layer._shared_experts(x))
    with pytest.raises(TypeError, match="overlap_shared must be a bool"):
        MoEStep(layer, gemm, 8, overlap_shared=1)


def test_low_batch_path_with_image_and_hash_routing():
    for kwargs, ids in (
        ({"image_sentinel_lo": 500}, torch.tensor([3, 500, 504, 9])),
        ({"hash_vocab": 20}, torch.tensor([0, 19, 5, 5])),
    ):
        layer = build_reference_layer(TINY, seed=12, **kwargs)
        gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
        x = generate_activations(4, TINY.hidden, seed=5)
        out = MoEStep(layer, gemm, 8).run(x, ids, low_batch=True)
        assert gemm.calls["gemms"] == 1
        assert relative_error(out.finalize(torch.bfloat16), layer.forward(x, ids)) < 1e-2


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_low_batch_path_uses_the_bound_front(layer, rows):
    x = generate_activations(rows, TINY.hidden, seed=rows)
    plain = _fake(layer)
    want = MoEStep(layer, plain, 8).run(x, None, low_batch=True)
    gemm = _fake(layer)
    assert bind_front(gemm, layer) is None
    out = MoEStep(layer, gemm, 8).run(x, None, low_batch=True)
    assert gemm.calls == {"route": 0, "front": 1, "gemms": 1}
    assert plain.calls == {"route": 1, "front": 0, "gemms": 1}
    # The same routing either way: the same bits.
    assert torch.equal(out.finalize(torch.bfloat16), want.finalize(torch.bfloat16))


def test_front_path_with_image_routing_and_the_capture_hook_fallback():
    layer = build_reference_layer(TINY, seed=12, image_sentinel_lo=500)
    ids = torch.tensor([3, 500, 504, 9])
    x = generate_activations(4, TINY.hidden, seed=5)
    gemm = _fake(layer)
    bind_front(gemm, layer)
    out = MoEStep(layer, gemm, 8).run(x, ids, low_batch=True)
    assert gemm.calls["front"] == 1
    assert relative_error(out.finalize(torch.bfloat16), layer.forward(x, ids)) < 1e-2
    # With a capture hook the router runs (and feeds it), not the front.
    seen = []
    layer.router.capture_fn = seen.append
    MoEStep(layer, gemm, 8).run(x, ids, low_batch=True)
    assert gemm.calls == {"route": 1, "front": 1, "gemms": 2} and len(seen) == 1


@pytest.mark.parametrize("rows", [2, 12])
def test_runner_path_defers(layer, rows):
    """Not low batch (or too many rows for the kernels): the runner's own
    _forward_impl under the deferral, which hands back an unfinalized output."""
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    step = MoEStep(layer, gemm, max_rows=64)
    x = generate_activations(rows, TINY.hidden, seed=rows)
    out = step.run(x, None, low_batch=False)
    assert isinstance(out, MoEOutput) and isinstance(out.routed, UnfinalizedMoEOutput)
    assert gemm.calls["gemms"] == 0
    assert relative_error(out.finalize(torch.bfloat16), layer.forward(x)) < 1e-2
    # The layer's own settings are back.
    assert layer.moe_config._defer_moe_finalize is False


def test_rows_beyond_the_kernels_take_the_runner(layer):
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    x = generate_activations(9, TINY.hidden, seed=9)
    out = MoEStep(layer, gemm, 64).run(x, None, low_batch=True)
    assert isinstance(out, MoEOutput) and gemm.calls["gemms"] == 0
    assert relative_error(out.finalize(torch.bfloat16), layer.forward(x)) < 1e-2


def test_runner_that_still_finalizes(layer):
    """A runner whose _forward_impl finalizes anyway: the step adds the parts."""
    inner = layer._forward_impl

    def finalizing(*args):
        saved = layer.moe_config._defer_moe_finalize
        layer.moe_config._defer_moe_finalize = False
        try:
            return inner(*args)
        finally:
            layer.moe_config._defer_moe_finalize = saved

    layer._forward_impl = finalizing
    x = generate_activations(5, TINY.hidden, seed=3)
    out = MoEStep(layer, None, 8).run(x, None, low_batch=False)
    assert isinstance(out, torch.Tensor)
    assert relative_error(out, layer.forward(x)) < 1e-2


def test_non_deferrable_layer_runs_its_own_forward(layer):
    layer.routed_scaling_factor = 2.0
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    step = MoEStep(layer, gemm, 8)
    assert not step.deferrable and step.gemm is None
    x = generate_activations(4, TINY.hidden, seed=4)
    out = step.run(x, None, low_batch=True)
    assert isinstance(out, torch.Tensor) and gemm.calls["gemms"] == 0
    assert torch.equal(out, layer.forward(x))


def test_weight_reload_makes_the_stale_binding_refuse(layer):
    gemm = FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), TINY.top_k)
    step = MoEStep(layer, gemm, 8)
    x = generate_activations(4, TINY.hidden, seed=6)
    assert step.uses_kernels(x, low_batch=True)
    # Reload: same values, new tensors.
    layer.routed_experts.load(generate_expert_weights(TINY, seed=11))
    assert not gemm.accepts(x, current_weights(layer))
    assert not step.uses_kernels(x, low_batch=True)
    out = step.run(x, None, low_batch=True)
    assert gemm.calls["gemms"] == 0
    assert relative_error(_finalized(out), layer.forward(x)) < 1e-2
    # A gemm bound to the reloaded tensors is accepted again.
    fresh = MoEStep(layer, FakeRoutedExpertGemm(layer.routed_experts.expert_weights(), 4), 8)
    assert fresh.uses_kernels(x, low_batch=True)


def test_step_rejects_bad_max_rows(layer):
    with pytest.raises(ValueError, match="max_rows"):
        MoEStep(layer, None, 0)


# ----------------------------------------------------------------------------- the protocol


class _VllmLikeConfig:
    def __init__(self):
        self._defer_moe_finalize = False
        self.defer_moe_finalize_max_num_tokens = 0

    def should_defer_moe_finalize(self, num_tokens):
        return self._defer_moe_finalize and num_tokens <= self.defer_moe_finalize_max_num_tokens


class _VllmLikeRouter:
    def __init__(self):
        self.e_score_correction_bias = torch.zeros(32)
        self.bias_vl = None
        self.image_sentinel_lo = 0
        self.top_k = 4
        self.global_num_experts = 32
        self.scoring_func = "sqrtsoftplus"
        self.renormalize = True
        self.routed_scaling_factor = 1.5
        self._hash_indices_table = None
        self.capture_fn = None

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, input_ids=None):
        raise NotImplementedError


class _VllmLikeExperts:
    def __init__(self):
        self.w13_weight = self.w13_weight_scale = self.w2_weight = self.w2_weight_scale = torch.zeros(1)
        self.quant_method = None


class _VllmLikeGate(torch.nn.Module):
    def forward(self, x):
        return x, None


class _VllmLikeShared(torch.nn.Module):
    def forward(self, x):
        return x


class VllmLikeRunner:
    """A plain class with the attribute names of vLLM's DeepSeek-V4 MoE runner."""

    def __init__(self):
        self.gate = _VllmLikeGate()
        self.router = _VllmLikeRouter()
        self._shared_experts = _VllmLikeShared()
        self.routed_experts = _VllmLikeExperts()
        self.routed_scaling_factor = 1.0
        self.moe_config = _VllmLikeConfig()

    def _forward_impl(self, hidden_states, router_input, shared_input, input_ids):
        raise NotImplementedError

    def forward(self, hidden_states, input_ids):
        raise NotImplementedError


def test_vllm_shaped_double_satisfies_the_protocol():
    runner = VllmLikeRunner()
    assert isinstance(runner, MoERunner) and is_moe_runner(runner)
    assert isinstance(runner.router, Router) and isinstance(runner.routed_experts, RoutedExperts)
    assert isinstance(runner.moe_config, DeferralConfig)
    # Its experts class is not one the kernels take: never deferred.
    assert not defers_finalize(runner, 8)


@pytest.mark.parametrize("missing", [
    ("router", "capture_fn"), ("router", "_hash_indices_table"), ("moe_config", "_defer_moe_finalize"),
    ("routed_experts", "w2_weight"), (None, "_forward_impl"), (None, "moe_config"),
])  # fmt: skip
def test_protocol_notices_a_missing_attribute(missing):
    runner = VllmLikeRunner()
    owner, name = missing
    target = runner if owner is None else getattr(runner, owner)
    if name in vars(target):
        delattr(target, name)
    else:  # a method: the same attributes on a class without it
        bare = type("Bare", (), {"forward": VllmLikeRunner.forward})()
        vars(bare).update(vars(runner))
        runner = bare
    assert not is_moe_runner(runner)


def test_step_refuses_a_layer_that_is_not_a_runner(layer):
    with pytest.raises(TypeError, match="protocol.MoERunner"):
        MoEStep(object(), None, max_rows=8)
    bare = VllmLikeRunner()
    del bare.moe_config
    with pytest.raises(TypeError, match="VllmLikeRunner"):
        MoEStep(bare, None, max_rows=8)


def test_build_moe_steps_binds_through_the_seeds_entry_point(caplog):
    """build_moe_steps hands the deferrable layers (only them) to
    build_routed_expert_gemms; on the CPU the kernels refuse (CUDA tensors
    needed), so that layer's step runs the runner's deferred path, and the
    builder's log says why."""
    deferring = build_reference_layer(TINY, seed=11)
    finalizing = build_reference_layer(TINY, seed=12)
    finalizing.moe_config.deferral_supported = False
    with caplog.at_level("INFO", logger="moebench.kernels.binding"):
        steps = build_moe_steps([deferring, VllmLikeRunner(), finalizing], max_rows=8, overlap_shared=False)
    assert [s.deferrable for s in steps] == [True, False, False]
    assert all(s.gemm is None and s.max_rows == 8 and not s.overlap_shared for s in steps)
    assert "on 0 of 1 MoE layers" in caplog.text and "CUDA" in caplog.text
    x = generate_activations(3, TINY.hidden, seed=4)
    got = steps[0].run(x, None, low_batch=True)
    assert isinstance(got.routed, UnfinalizedMoEOutput)
    assert torch.equal(_finalized(got), _finalized(MoEStep(deferring, None, 8).run(x, None, low_batch=True)))
    with pytest.raises(ValueError, match="max_rows"):
        build_moe_steps([deferring], max_rows=0)


# ----------------------------------------------------------------------------- GPU


def _gpu_setup(rows: int):
    from moebench.kernels.binding import RoutedExpertGemm

    shape = TINY
    layer = build_reference_layer(shape, seed=21, device="cuda")
    gemm = RoutedExpertGemm(layer.routed_experts.expert_weights(), shape.top_k)
    x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
    return layer, gemm, x


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_step_with_the_kernels_matches_the_reference_layer(rows):
    layer, gemm, x = _gpu_setup(rows)
    step = MoEStep(layer, gemm, max_rows=8)
    assert step.uses_kernels(x, low_batch=True)
    out = step.run(x, None, low_batch=True)
    assert isinstance(out, MoEOutput) and isinstance(out.routed, UnfinalizedMoEOutput)
    assert relative_error(out.finalize(torch.bfloat16), layer.forward(x)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("front", [True, False])
def test_gpu_build_moe_steps_binds_the_kernels_and_the_front(front):
    """The load-time path (build_moe_steps -> build_routed_expert_gemms ->
    bind_front) gives steps on the kernels, the fused front bound when asked,
    that match the reference layer."""
    layers = [build_reference_layer(TINY, seed=s, device="cuda") for s in (31, 32)]
    steps = build_moe_steps(layers, max_rows=8, front=front)
    x = generate_activations(5, TINY.hidden, seed=5, device="cuda")
    for layer, step in zip(layers, steps):
        assert step.gemm is not None and step.uses_kernels(x, low_batch=True)
        assert front_applies(step.gemm, layer) is front
        out = step.run(x, None, low_batch=True)
        assert relative_error(out.finalize(torch.bfloat16), layer.forward(x)) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_captures_a_whole_step():
    layer, gemm, x = _gpu_setup(6)
    step = MoEStep(layer, gemm, max_rows=8)
    static_x = x.clone()
    # Warm up on a side stream (compiles are done at binding), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run(static_x, None, low_batch=True).finalize(torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step.run(static_x, None, low_batch=True).finalize(torch.bfloat16)
    for seed in (1, 2):
        new_x = generate_activations(6, TINY.hidden, seed=100 + seed, device="cuda")
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(static_out, layer.forward(new_x)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 6, 8])
def test_gpu_step_with_the_fused_front_gives_the_same_bits(rows):
    layer, gemm, x = _gpu_setup(rows)
    want = MoEStep(layer, gemm, max_rows=8).run(x, None, low_batch=True)
    assert bind_front(gemm, layer) is None and front_applies(gemm, layer)
    got = MoEStep(layer, gemm, max_rows=8).run(x, None, low_batch=True)
    for name in ("expert_weights", "expanded_idx_to_permuted_idx"):
        assert torch.equal(getattr(got.routed, name), getattr(want.routed, name)), name
    # rows the permute map reads (rows of unused tiles are never written: their bytes are whatever was there)
    idx = want.routed.expanded_idx_to_permuted_idx.flatten()
    idx = idx[idx >= 0].long()
    assert torch.equal(got.routed.gemm2_permuted[idx], want.routed.gemm2_permuted[idx])
    assert torch.equal(got.finalize(torch.bfloat16), want.finalize(torch.bfloat16))
