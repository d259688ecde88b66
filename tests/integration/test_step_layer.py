"""The decode-step layer pieces (`integration.step_layer`): the scenario gate,
the oracle, TP slicing of a whole layer, and the two step kinds on the CPU
(torch-bf16 backend; our kernels' path with a torch stand-in), plus GPU tests
with the real kernels under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from integration_checks import FakeRoutedExpertGemm
from moebench.backends.torch_bf16 import TorchBF16Backend
from moebench.formats import generate_activations
from moebench.integration.reference_layer import ReferenceSharedExpert
from moebench.integration.step_layer import (
    BackendStep, KernelStep, build_runner, generate_full_layer, generate_shard_layer, scenario_gate_weight,
    slice_layer, step_oracle,
)  # fmt: skip
from moebench.models import MoEConfig
from moebench.moe_output import finalize as torch_finalize
from moebench.reference import ORACLE_TOLERANCE, relative_error, swiglu_clamped
from moebench.routing import scenario_topk_ids

CFG = MoEConfig("tiny", 256, 128, 32, 4, 1, 1.5, 10.0)


def _case(rows=4, scenario="correlated", tp=1, seed=3, device="cpu"):
    weights = generate_shard_layer(CFG, tp, seed, device)
    ids = scenario_topk_ids(scenario, rows, CFG.top_k, CFG.experts, seed)
    x = generate_activations(rows, CFG.hidden, seed)
    gate = scenario_gate_weight(x, ids, CFG.experts, weights.bias, seed)
    return weights, ids, x.to(device), gate.to(device)


def _kw():
    return dict(top_k=CFG.top_k, routed_scaling_factor=CFG.routed_scaling_factor, swiglu_limit=CFG.swiglu_limit)


@pytest.mark.parametrize("scenario", ["uniform", "correlated", "hot", "zipf"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_scenario_gate_reproduces_the_routing(scenario, rows):
    weights, ids, x, gate = _case(rows, scenario)
    assert gate.dtype == torch.bfloat16 and gate.shape == (CFG.experts, CFG.hidden)
    runner = build_runner(weights, gate, **_kw())
    _, got = runner.router.select_experts(x, runner.gate(x)[0], torch.int32)
    for t in range(rows):
        assert set(got[t].tolist()) == set(ids[t].tolist())


def test_scenario_gate_rejects_bad_input():
    x = generate_activations(2, CFG.hidden, 0)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match="x"):
        scenario_gate_weight(x.float(), ids, CFG.experts)
    with pytest.raises(ValueError, match="topk_ids"):
        scenario_gate_weight(x, ids[:1], CFG.experts)
    with pytest.raises(ValueError, match="topk_ids"):
        scenario_gate_weight(x, ids + 40, CFG.experts)
    with pytest.raises(ValueError, match="linearly dependent"):
        scenario_gate_weight(torch.cat([x[:1], x[:1]]), ids, CFG.experts)


@pytest.mark.parametrize("rows", [1, 6])
def test_oracle_is_the_reference_layer_forward(rows):
    weights, ids, x, gate = _case(rows)
    oracle, oracle_ids = step_oracle(weights, gate, x, **_kw())
    assert oracle.dtype == torch.float64 and oracle.shape == x.shape
    layer = build_runner(weights, gate, **_kw(), reference=True)
    # Only BF16 roundings apart (shared output, routed rows, the output: ~2^-9 each).
    assert relative_error(layer.forward(x), oracle) < 5e-3
    for t in range(rows):
        assert set(oracle_ids[t].tolist()) == set(ids[t].tolist())


@pytest.mark.parametrize("tp", [2, 4])
def test_sliced_layer_partials_sum_to_the_full_layer(tp):
    full = generate_full_layer(CFG, seed=5)
    ids = scenario_topk_ids("uniform", 3, CFG.top_k, CFG.experts, 5)
    x = generate_activations(3, CFG.hidden, 5)
    gate = scenario_gate_weight(x, ids, CFG.experts, full.bias, 5)
    ranks = [slice_layer(full, tp, r) for r in range(tp)]
    for r in ranks:
        assert r.shared_w1.shape == (CFG.intermediate // tp, CFG.hidden)
        assert r.experts.intermediate == CFG.intermediate // tp and torch.equal(r.bias, full.bias)
    for activation in ("bf16", "mxfp8"):
        whole, _ = step_oracle(full, gate, x, **_kw(), activation=activation)
        parts = sum(step_oracle(r, gate, x, **_kw(), activation=activation)[0] for r in ranks)
        assert relative_error(parts, whole) < 1e-12
    with pytest.raises(ValueError):
        slice_layer(full, 3, 0)
    with pytest.raises(ValueError):
        slice_layer(full, 2, 2)


def test_shard_layer_uses_the_sweeps_expert_weights():
    from moebench.formats import generate_expert_weights

    w = generate_shard_layer(CFG, 2, seed=9)
    ref = generate_expert_weights(CFG.shard(2), 9)
    assert torch.equal(w.experts.w13, ref.w13) and torch.equal(w.experts.w2_scale, ref.w2_scale)
    assert w.shared_bytes == 3 * (CFG.intermediate // 2) * CFG.hidden * 2


@pytest.mark.parametrize("rows", [1, 4])
def test_backend_step_on_the_cpu(rows):
    weights, ids, x, gate = _case(rows)
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights.experts, CFG.shard(1))
    step = BackendStep(build_runner(weights, gate, **_kw()), backend, prepared, x)
    out = step.run()
    oracle, _ = step_oracle(weights, gate, x, **_kw(), activation=backend.oracle)
    assert out.dtype == torch.bfloat16 and relative_error(out, oracle) < ORACLE_TOLERANCE
    assert torch.equal(step.run(with_gate=True), out)
    calls = step.stage_calls()
    assert [n for n, _ in calls] == list(BackendStep.stages)
    results = [fn() for _, fn in calls]
    assert torch.equal(results[-1]["out"], out)
    assert torch.equal(step.gate(), step.logits)


@pytest.mark.parametrize("rows", [2, 8])
def test_kernel_step_path_with_a_stand_in(rows):
    """KernelStep's wiring (MoEStep -> fused front -> gemm1 -> gemm2 ->
    finalize with the shared add) on the CPU with a torch stand-in for
    RoutedExpertGemm: the front is bound to the layer's router and replaces
    the torch router + route."""
    weights, ids, x, gate = _case(rows)
    runner = build_runner(weights, gate, **_kw())
    gemm = FakeRoutedExpertGemm(weights.experts, CFG.top_k)
    step = KernelStep(runner, gemm, x, finalize_fn=torch_finalize)
    assert step.uses_front and step.front_refusal is None and step.routing_path == "front"
    assert gemm.front_config is not None and gemm.front_config.bias is weights.bias
    out = step.run()
    oracle, _ = step_oracle(weights, gate, x, **_kw())
    assert relative_error(out, oracle) < ORACLE_TOLERANCE
    assert gemm.calls == {"route": 0, "front": 1, "gemms": 1}
    assert torch.equal(step.run(with_gate=True), out)
    calls = step.stage_calls()
    assert [n for n, _ in calls] == list(KernelStep.FRONT_STAGES) == ["front", "shared", "gemm1", "gemm2", "finalize"]
    assert torch.equal([fn() for _, fn in calls][-1]["out"], out)
    assert gemm.calls["route"] == 0
    # The kernels refuse rows beyond 8: the step says so.
    big = generate_activations(9, CFG.hidden, 1)
    with pytest.raises(ValueError, match="kernels do not take"):
        KernelStep(runner, gemm, big, finalize_fn=torch_finalize)


@pytest.mark.parametrize("rows", [1, 6])
def test_kernel_step_router_path_where_the_front_does_not_apply(rows):
    """Without the front (not bound, or refused: here a capture hook) the step
    runs the runner's router then route, with those stages, and says why."""
    weights, ids, x, gate = _case(rows)
    oracle, _ = step_oracle(weights, gate, x, **_kw())
    runner = build_runner(weights, gate, **_kw())
    gemm = FakeRoutedExpertGemm(weights.experts, CFG.top_k)
    step = KernelStep(runner, gemm, x, finalize_fn=torch_finalize, front=False)
    assert not step.uses_front and "no fused front" in step.front_refusal
    assert step.routing_path == "router+route" and gemm.front_config is None
    out = step.run()
    assert relative_error(out, oracle) < ORACLE_TOLERANCE
    assert gemm.calls == {"route": 1, "front": 0, "gemms": 1}
    calls = step.stage_calls()
    assert [n for n, _ in calls] == list(KernelStep.ROUTER_STAGES)
    assert torch.equal([fn() for _, fn in calls][-1]["out"], out)

    hooked = build_runner(weights, gate, **_kw())
    hooked.router.capture_fn = lambda ids: None
    gemm = FakeRoutedExpertGemm(weights.experts, CFG.top_k)
    step = KernelStep(hooked, gemm, x, finalize_fn=torch_finalize)
    assert gemm.front_config is not None  # bound, but refused this call
    assert not step.uses_front and "capture hook" in step.front_refusal
    assert [n for n, _ in step.stage_calls()] == list(KernelStep.ROUTER_STAGES)
    assert torch.equal(step.run(), out) and gemm.calls["front"] == 0


def test_kernel_step_without_a_gemm_binds_through_build_routed_expert_gemms(monkeypatch):
    """gemm=None: the step builds its gemm as a serving stack does at load
    (step.build_moe_steps -> binding.build_routed_expert_gemms, the front
    bound); here the builder hands back the torch stand-in. On the CPU the
    real builder refuses (CUDA tensors needed): the step says so."""
    from moebench.kernels import binding

    weights, ids, x, gate = _case(4)
    oracle, _ = step_oracle(weights, gate, x, **_kw())
    with pytest.raises(ValueError, match="refused this layer"):
        KernelStep(build_runner(weights, gate, **_kw()), None, x, finalize_fn=torch_finalize)
    asked = []

    def build(layers, tactics=None, fp8=None):
        asked.append((layers, tactics, fp8))
        return [FakeRoutedExpertGemm(w, k) for w, k in layers]

    monkeypatch.setattr(binding, "build_routed_expert_gemms", build)
    for front in (True, False):
        step = KernelStep(build_runner(weights, gate, **_kw()), None, x, finalize_fn=torch_finalize, front=front)
        assert isinstance(step.gemm, FakeRoutedExpertGemm) and step.step.gemm is step.gemm is step.step_no_gate.gemm
        assert step.uses_front is front
        assert relative_error(step.run(), oracle) < ORACLE_TOLERANCE
    ((w, k),) = asked[-1][0]
    assert k == CFG.top_k and w.w13 is weights.experts.w13 and asked[-1][1:] == (None, None)


def test_front_and_router_paths_agree():
    weights, ids, x, gate = _case(5)
    outs = []
    for front in (True, False):
        gemm = FakeRoutedExpertGemm(weights.experts, CFG.top_k)
        step = KernelStep(build_runner(weights, gate, **_kw()), gemm, x, finalize_fn=torch_finalize, front=front)
        assert step.uses_front is front
        outs.append(step.run())
    assert torch.equal(outs[0], outs[1])


def test_reference_shared_expert_converts_its_weights_once():
    """fp32 copies made at construction: the same bits as converting per call,
    and no weight conversion inside a call."""
    weights, ids, x, gate = _case(3)
    shared = ReferenceSharedExpert(weights.shared_w1, weights.shared_w3, weights.shared_w2, CFG.swiglu_limit)
    assert all(w.dtype == torch.float32 for w in (shared.w1_f32, shared.w3_f32, shared.w2_f32))
    xf = x.float()
    h = swiglu_clamped(xf @ weights.shared_w1.float().T, xf @ weights.shared_w3.float().T, CFG.swiglu_limit)
    expected = (h @ weights.shared_w2.float().T).to(torch.bfloat16)
    assert torch.equal(shared(x), expected)
    # A call reads the cached copies only: its BF16 weights may be gone.
    shared.w1 = shared.w3 = shared.w2 = None
    assert torch.equal(shared(x), expected)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("front", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_kernel_step_matches_the_oracle_and_captures(rows, front):
    from moebench.bench.timing import time_graph

    weights, ids, x, gate = _case(rows, device="cuda")
    runner = build_runner(weights, gate, **_kw())
    step = KernelStep(runner, None, x, front=front)  # built by build_moe_steps, as at load
    assert step.uses_front is front
    assert [n for n, _ in step.stage_calls()] == list(KernelStep.FRONT_STAGES if front else KernelStep.ROUTER_STAGES)
    oracle, _ = step_oracle(weights, gate, x, **_kw())
    out = step.run()
    assert relative_error(out, oracle) < ORACLE_TOLERANCE
    assert torch.equal(step.run(with_gate=True), out)
    # The whole step and every stage capture into CUDA graphs.
    timing = time_graph(lambda: step.run(), warmup=2, replays=5, device="cuda")
    assert timing.method == "cuda-graph" and timing.median_us > 0
    for name, fn in step.stage_calls():
        assert time_graph(fn, warmup=1, replays=3, device="cuda").median_us > 0, name
    # Replays recompute: a graph of the step reads the static x.
    static = step.x
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run(with_gate=True)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static_out = step.run(with_gate=True)
    static.copy_(generate_activations(rows, CFG.hidden, 77, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    fresh, _ = step_oracle(weights, gate, static, **_kw())
    assert relative_error(static_out, fresh) < ORACLE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 6])
def test_gpu_shared_expert_on_a_side_stream_gives_the_same_bits(rows):
    """overlap_shared (the shared expert forked onto a side stream beside the
    gate and the routed experts, joined before the finalize) changes no bit
    of the step, eagerly and in a captured graph replayed on new x, for our
    kernels and for a backend step."""
    from moebench.kernels.binding import RoutedExpertGemm

    weights, ids, x, gate = _case(rows, device="cuda")
    runner = build_runner(weights, gate, **_kw())
    gemm = RoutedExpertGemm(weights.experts, CFG.top_k)
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights.experts, CFG.shard(1))
    pairs = [
        (KernelStep(runner, gemm, x, overlap_shared=True), KernelStep(runner, gemm, x, overlap_shared=False)),
        (BackendStep(runner, backend, prepared, x, overlap_shared=True),
         BackendStep(runner, backend, prepared, x, overlap_shared=False)),
    ]  # fmt: skip
    for side, serial in pairs:
        assert side.step.overlap_shared if isinstance(side, KernelStep) else side.overlap_shared
        want = serial.run(with_gate=True)
        assert torch.equal(side.run(with_gate=True), want) and torch.equal(side.run(), serial.run())
        side.run(with_gate=True)  # warm, then capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = side.run(with_gate=True)
        for seed in (5, 6):
            x.copy_(generate_activations(rows, CFG.hidden, seed, "cuda"))
            static_out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, serial.run(with_gate=True)), (type(side).__name__, seed)
        x.copy_(generate_activations(rows, CFG.hidden, 3, "cuda"))


def test_overlap_shared_must_be_a_bool():
    weights, ids, x, gate = _case(2)
    runner = build_runner(weights, gate, **_kw())
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights.experts, CFG.shard(1))
    with pytest.raises(TypeError, match="overlap_shared must be a bool"):
        BackendStep(runner, backend, prepared, x, overlap_shared="yes")
    # on the CPU the side stream is a plain call: same output either way
    a = BackendStep(runner, backend, prepared, x, overlap_shared=True).run()
    assert torch.equal(a, BackendStep(runner, backend, prepared, x, overlap_shared=False).run())
