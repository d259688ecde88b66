"""One rank's slice of the routed experts (`tp_step.rank_slice`): the
slices partition the layer, so the partials of the ranks sum to the
unsliced oracle (the all-reduce of a real TP step: tests/bench's ranks=2
step)."""

import pytest
import torch

from moebench.formats import generate_activations, generate_expert_weights
from moebench.integration.tp_step import rank_slice
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights

SMALL = dict(hidden=256, intermediate=256, experts=16, top_k=4)
ROWS = 4


def _problem(seed=0):
    cfg = get_preset("dsv4-flash", **SMALL)
    full = generate_expert_weights(cfg.shard(1), seed)
    ids = scenario_topk_ids("uniform", ROWS, cfg.top_k, cfg.experts, seed)
    w = scenario_weights(ROWS, cfg.top_k, seed, scale=cfg.routed_scaling_factor)
    x = generate_activations(ROWS, cfg.hidden, seed)
    return cfg, full, x, ids, w


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slices_partition_the_layer(tp):
    cfg, full, x, ids, w = _problem()
    ranks = [rank_slice(full, tp, r) for r in range(tp)]
    for rw in ranks:
        assert rw.intermediate == cfg.intermediate // tp
        assert rw.padded_intermediate % 128 == 0 and rw.padding_is_zero()
    # The dequantized slices are exactly the full layer's rows / columns.
    g_full, w2_full = full.dequantized(torch.float64)
    s, ip = cfg.intermediate // tp, full.padded_intermediate
    for r, rw in enumerate(ranks):
        g, w2 = rw.dequantized(torch.float64)
        sp = rw.padded_intermediate
        assert torch.equal(g[:, :s], g_full[:, r * s : (r + 1) * s])
        assert torch.equal(g[:, sp : sp + s], g_full[:, ip + r * s : ip + (r + 1) * s])
        assert torch.equal(w2[:, :, :s], w2_full[:, :, r * s : (r + 1) * s])
    for activation in ("bf16", "mxfp8"):
        oracle = reference_moe(x, ids, w, full, activation=activation).output
        parts = [reference_moe(x, ids, w, rw, activation=activation, dtype=torch.float64).output for rw in ranks]
        assert relative_error(torch.stack(parts).sum(0), oracle) < 1e-12


def test_slice_rejects_bad_tp_or_rank():
    _, full, *_ = _problem()
    for bad in (0, 3, 16, True):
        with pytest.raises(ValueError, match="tp"):
            rank_slice(full, bad, 0)
    for bad in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="rank must lie in"):
            rank_slice(full, 2, bad)
