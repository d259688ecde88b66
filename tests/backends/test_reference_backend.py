import torch

from moebench.backends.reference import ReferenceBackend
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights


def test_reference_backend_matches_the_fp64_mxfp8_oracle():
    shape = get_preset("dsv4-flash", hidden=128, intermediate=64, experts=8, top_k=2).shard(1)
    weights = generate_expert_weights(shape, seed=4)
    backend = ReferenceBackend()
    prepared = backend.prepare(weights, shape)
    x = generate_activations(4, shape.hidden, seed=4)
    ids = scenario_topk_ids("correlated", 4, shape.top_k, shape.experts, seed=4)
    w = scenario_weights(4, shape.top_k, seed=4)
    out = backend.forward(prepared, x, ids, w)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference_moe(x, ids, w, weights).output) <= 1e-2
