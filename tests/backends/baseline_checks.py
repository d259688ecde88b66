"""What the baseline backends' GPU tests share (not a test module): the
reduced expert count, the hot and tiny-scale experts, the cases run, the
weights and routing they draw, and checks (the prepared-layer cache is
conftest.py's fixture)."""

import os

import torch

from moebench.backends.vllm_align import AlignBuffers
from moebench.formats import generate_expert_weights
from moebench.models import PRESETS, get_preset
from moebench.reference import reference_moe, relative_error

EXPERTS = 16  # reduced from 256/384 to keep memory and time sane; H and I stay real
HOT, TINY = 0, 5  # expert in every row; expert with scales 2^-20 of the others
TINY_SHIFT = 20


def baseline_cases(tps) -> list[tuple[str, int]]:
    """(preset, tp) for every preset at each of `tps`, or the list in
    $MOEBENCH_BASELINE_CASES ("dsv41-flash:4,dsv4-pro:1") when it is set."""
    if os.environ.get("MOEBENCH_BASELINE_CASES"):
        return [(c.split(":")[0], int(c.split(":")[1])) for c in os.environ["MOEBENCH_BASELINE_CASES"].split(",")]
    return [(p, tp) for p in PRESETS for tp in tps]


def tiny_weights(preset: str, tp: int, experts: int | None = EXPERTS, tiny: bool = True):
    """(shape, weights) on the GPU, seed 11; with `tiny`, expert TINY's scales
    are 2^-TINY_SHIFT of what was drawn (padding, code 0, stays zero)."""
    shape = get_preset(preset, experts=experts).shard(tp)
    w = generate_expert_weights(shape, seed=11, device="cuda")
    if tiny:
        for scale in (w.w13_scale, w.w2_scale):
            t = scale[TINY].to(torch.int32)
            scale[TINY] = torch.where(t > 0, (t - TINY_SHIFT).clamp_min(1), t).to(torch.uint8)
    return shape, w


def hot_tiny_routing(rows: int, top_k: int, scale: float, seed: int, experts: int = EXPERTS):
    """Fresh (ids, weights) on the GPU: HOT in every row, TINY in row 0, the
    rest distinct random experts; weights summing to `scale` per row."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for r in range(rows):
        others = [e for e in torch.randperm(experts, generator=g).tolist() if e not in (HOT, TINY)]
        ids.append(([HOT] + ([TINY] if r == 0 else []) + others)[:top_k])
    w = torch.rand(rows, top_k, generator=g) + 0.1
    w = w / w.sum(1, keepdim=True) * scale
    return torch.tensor(ids, dtype=torch.int32).cuda(), w.to(torch.float32).cuda()


def replay_into_nan(forward) -> torch.Tensor:
    """`forward()` (its first calls, which compile or tune, already made)
    captured in a CUDA graph; the output tensor it returns is filled with
    NaN, the graph replayed and waited on: that output, as the replay wrote it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def tiny_expert_alone_error(backend, prepared, shape, weights, x: torch.Tensor, expert: int) -> float:
    """Relative error (scale-free) of `backend` vs its oracle when every row
    of `x` (bf16 [rows, H]) goes to `expert` alone with weight 1; prints it.
    Raises AssertionError if the oracle's output is all zero (no signal)."""
    rows = x.shape[0]
    only = torch.full((rows, 1), expert, dtype=torch.int32, device=x.device)
    ones = torch.ones(rows, 1, dtype=torch.float32, device=x.device)
    out = backend.forward(prepared, x, only, ones).clone()
    ref = reference_moe(x, only, ones, weights, activation=backend.oracle).output
    assert ref.abs().max() > 0
    err = relative_error(out, ref)
    print(f"{backend.name} {shape.describe()} rows={rows} tiny expert alone: rel err {err:.3e}")
    return err


# --- vLLM's moe_align_block_size, as a host loop (tests of vllm_align and humming) -----------


def align_reference(
    topk_ids: torch.Tensor, experts: int, block: int, expert_map: torch.Tensor | None = None
) -> tuple[list[tuple[int, tuple[int, ...]]], int]:
    """The op's meaning, as a host loop: ([(expert, sorted slots of the block)
    for each used block, in order], num_tokens_post_pad). Slots whose id maps
    to -1 (through `expert_map`) are left out; padding slots are not listed.
    For comparing outputs whose order within an expert may differ."""
    flat = [int(v) for v in topk_ids.reshape(-1).tolist()]
    local = [(expert_map[v].item() if expert_map is not None else v) for v in flat]
    blocks, total = [], 0
    for e in range(experts):
        slots = [s for s, v in enumerate(local) if v == e]
        for start in range(0, len(slots), block):
            blocks.append((e, tuple(sorted(slots[start : start + block]))))
        total += -(-len(slots) // block) * block
    return blocks, total


def blocks_of(buffers: AlignBuffers, numel: int) -> tuple[list[tuple[int, tuple[int, ...]]], int]:
    """`align_reference`'s form of real outputs (host copies; syncs): the used
    blocks as (expert, sorted slots other than the padding `numel`), and the
    padded total."""
    total = int(buffers.num_tokens_post_pad[0])
    ids = buffers.sorted_ids[:total].tolist()
    experts = buffers.expert_ids[: total // buffers.block].tolist()
    blocks = [
        (experts[b], tuple(sorted(s for s in ids[b * buffers.block : (b + 1) * buffers.block] if s != numel)))
        for b in range(total // buffers.block)
    ]
    return blocks, total
