import pytest
import torch

from moebench.backends.torch_bf16 import TorchBF16Backend, dequantize_bf16
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights


@pytest.fixture(scope="module")
def setup():
    # TP2 of a tiny config: I = 64 padded to 128, so the padding is exercised.
    shape = get_preset("dsv41-flash", hidden=256, intermediate=128, experts=8, top_k=3).shard(2)
    weights = generate_expert_weights(shape, seed=3)
    return shape, weights


@pytest.mark.parametrize("tactic", ["default", "grouped", "gather"])
@pytest.mark.parametrize("rows, scenario", [(1, "uniform"), (5, "hot"), (8, "correlated")])
def test_matches_the_bf16_oracle(setup, tactic, rows, scenario):
    shape, weights = setup
    backend = TorchBF16Backend()
    if tactic not in backend.valid_tactics(shape):
        pytest.skip(f"{tactic} needs torch._grouped_mm")
    prepared = backend.prepare(weights, shape, tactic)
    x = generate_activations(rows, shape.hidden, seed=rows)
    ids = scenario_topk_ids(scenario, rows, shape.top_k, shape.experts, seed=rows)
    w = scenario_weights(rows, shape.top_k, seed=rows, scale=shape.routed_scaling_factor)
    out = backend.forward(prepared, x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    oracle = reference_moe(x, ids, w, weights, activation="bf16").output
    assert relative_error(out, oracle) <= 1e-2


def test_non_local_ids_contribute_nothing(setup):
    shape, weights = setup
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights, shape)
    x = generate_activations(3, shape.hidden, seed=9)
    ids = torch.tensor([[0, -1, 5], [-1, -1, -1], [2, 8, 7]], dtype=torch.int32)
    w = torch.rand(3, 3, generator=torch.Generator().manual_seed(0))
    out = backend.forward(prepared, x, ids, w)
    assert torch.all(out[1] == 0)
    oracle = reference_moe(x, ids, w, weights, activation="bf16").output
    assert relative_error(out, oracle) <= 1e-2


def test_dequantized_weights_are_exact_and_drop_padding(setup):
    shape, weights = setup
    w13, w2 = dequantize_bf16(weights)
    i, ip = shape.intermediate, shape.padded_intermediate
    assert w13.shape == (shape.experts, 2 * i, shape.hidden) and w2.shape == (shape.experts, shape.hidden, i)
    full13, full2 = weights.dequantized(torch.float64)
    assert torch.equal(w13[:, :i].double(), full13[:, :i])
    assert torch.equal(w13[:, i:].double(), full13[:, ip : ip + i])
    assert torch.equal(w2.double(), full2[:, :, :i])


def test_bad_inputs_name_the_argument(setup):
    shape, weights = setup
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights, shape)
    x = generate_activations(2, shape.hidden)
    ids = torch.zeros(2, shape.top_k, dtype=torch.int32)
    w = torch.ones(2, shape.top_k)
    with pytest.raises(TypeError, match="x must be"):
        backend.forward(prepared, x.float(), ids, w)
    with pytest.raises(TypeError, match="topk_ids"):
        backend.forward(prepared, x, ids.long(), w)
    with pytest.raises(ValueError, match="topk_weights"):
        backend.forward(prepared, x, ids, w[:, :1])
    with pytest.raises(ValueError, match="tactic"):
        backend.prepare(weights, shape, "fastest")
    other = get_preset("dsv41-flash", hidden=256, intermediate=128, experts=8, top_k=3).shard(1)
    with pytest.raises(ValueError, match="do not match"):
        backend.prepare(weights, other)


@pytest.mark.gpu
def test_graph_capturable_on_gpu(setup):
    from moebench.bench.timing import time_graph

    shape, weights = setup
    backend = TorchBF16Backend()
    prepared = backend.prepare(weights.to("cuda"), shape)
    x = generate_activations(4, shape.hidden, device="cuda")
    ids = scenario_topk_ids("uniform", 4, shape.top_k, shape.experts).cuda()
    w = scenario_weights(4, shape.top_k).cuda()
    t = time_graph(lambda: backend.forward(prepared, x, ids, w), replays=5, device="cuda")
    assert t.method == "cuda-graph"


@pytest.mark.parametrize("tactic", ["default", "grouped", "gather"])
def test_zero_rows_give_an_empty_output(setup, tactic):
    # The oracle and the router return empty results for an empty step; so must this backend.
    shape, weights = setup
    backend = TorchBF16Backend()
    if tactic not in backend.valid_tactics(shape):
        pytest.skip(f"{tactic} needs torch._grouped_mm")
    prepared = backend.prepare(weights, shape, tactic)
    x = torch.zeros(0, shape.hidden, dtype=torch.bfloat16)
    ids = torch.zeros(0, shape.top_k, dtype=torch.int32)
    w = torch.zeros(0, shape.top_k)
    out = backend.forward(prepared, x, ids, w)
    oracle = reference_moe(x, ids, w, weights, activation="bf16").output
    assert out.dtype == torch.bfloat16 and out.shape == (0, shape.hidden) == oracle.shape
