import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from moebench.bench.launch import MULTICAST_OFF, free_port
from moebench.formats import generate_activations, generate_expert_weights
from moebench.integration.tp_step import partial_sum_check, reference_backend, slice_expert_weights, tp_moe_step
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
    ranks = slice_expert_weights(full, tp)
    assert len(ranks) == tp
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
        parts = [reference_backend(activation)(rw, x, ids, w) for rw in ranks]
        assert relative_error(partial_sum_check(parts), oracle) < 1e-12


def test_slice_rejects_bad_tp():
    _, full, *_ = _problem()
    for bad in (0, 3, 16):
        with pytest.raises(ValueError):
            slice_expert_weights(full, bad)


def test_step_needs_a_process_group():
    _, full, x, ids, w = _problem()
    if dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    with pytest.raises(RuntimeError):
        tp_moe_step(full, x, ids, w)


def _rank_main(rank, world, port, out_dir, activation):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **MULTICAST_OFF)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        _, full, x, ids, w = _problem()
        mine = slice_expert_weights(full, world)[rank]
        shared = torch.ones(x.shape, dtype=torch.float64) * 0.25
        out = tp_moe_step(mine, x, ids, w, activation=activation, shared=shared)
        out_bf16 = tp_moe_step(mine, x, ids, w, activation=activation, reduce_dtype=torch.bfloat16)
        torch.save({"out": out, "out_bf16": out_bf16, "env": os.environ["NCCL_NVLS_ENABLE"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,activation", [(2, "bf16"), (4, "bf16"), (2, "mxfp8")])
def test_gloo_tp_step_matches_unsliced_oracle(tmp_path, world, activation):
    tmp_mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path), activation), nprocs=world, join=True)
    _, full, x, ids, w = _problem()
    oracle = reference_moe(x, ids, w, full, activation=activation).output
    shared = torch.ones(x.shape, dtype=torch.float64) * 0.25
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for res in results:
        assert res["env"] == "0"
        assert torch.equal(res["out"], results[0]["out"])  # identical on every rank
        assert relative_error(res["out"], oracle + shared) < 1e-2
        assert relative_error(res["out"], oracle + shared) < 1e-10  # fp64 partials: rounding-level
        assert relative_error(res["out_bf16"], oracle) < 1e-2
