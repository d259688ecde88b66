"""vllm_align: vLLM's moe_align_block_size op, its buffer sizes and meaning
(CPU), and the op itself against that meaning on the H200 (`gpu`; needs only
the vllm-moe bundle)."""

import pytest
import torch
from baseline_checks import align_reference, blocks_of

from moebench.backends import vllm_align as va
from moebench.backends import vllm_ops


def test_buffer_sizes_follow_vllms_wrapper():
    assert va.max_num_tokens_padded(12, 4, 4) == 12 + 4 * 3
    assert va.max_num_tokens_padded(6, 384, 8) == 48  # fewer slots than experts: numel * block
    assert va.max_num_tokens_padded(48, 16, 8) == 48 + 16 * 7
    assert va.max_num_tokens_padded(10, 12, 64) == min(640, 10 + 12 * 63)
    assert va.max_num_blocks(12, 4, 4) == 6 and va.max_num_blocks(49, 3, 8) == -(-(49 + 21) // 8)
    with pytest.raises(ValueError, match="positive"):
        va.max_num_tokens_padded(0, 4, 4)


def test_reference_hand_case():
    ids = torch.tensor([[2, 0], [2, 2]], dtype=torch.int32)  # slots 0..3
    blocks, total = align_reference(ids, 3, 2)
    assert blocks == [(0, (1,)), (2, (0, 2)), (2, (3,))] and total == 2 + 4
    expert_map = torch.tensor([-1, 0, 1], dtype=torch.int32)  # expert 0 remote, 1 -> 0, 2 -> 1
    blocks, total = align_reference(ids, 3, 2, expert_map)
    assert blocks == [(1, (0, 2)), (1, (3,))] and total == 4


def test_blocks_of_reads_real_buffers():
    # what the op writes for the hand case (block 2, numel 4): expert 0 [1, pad], expert 2 [2, 0, 3, pad]
    buf = va.AlignBuffers(
        torch.tensor([1, 4, 2, 0, 3, 4, 4, 4, 4, 4], dtype=torch.int32),
        torch.tensor([0, 2, 2, -1, -1], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        2,
    )
    ids = torch.tensor([[2, 0], [2, 2]], dtype=torch.int32)
    assert blocks_of(buf, 4) == align_reference(ids, 3, 2)


def test_bad_arguments_are_refused_before_the_op():
    ids = torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="2-D"):
        va.moe_align_block_size(ids.reshape(-1), 16, 8)
    with pytest.raises(TypeError, match="int32 or int64"):
        va.moe_align_block_size(ids.float(), 16, 8)
    with pytest.raises(ValueError, match="experts must be an int"):
        va.moe_align_block_size(ids, 0, 8)
    with pytest.raises(ValueError, match="experts must be an int"):
        va.moe_align_block_size(ids, 2000, 8)
    with pytest.raises(ValueError, match="block"):
        va.moe_align_block_size(ids, 16, 0)
    with pytest.raises(ValueError, match="expert_map must be int32"):
        va.moe_align_block_size(ids, 16, 8, expert_map=torch.zeros(15, dtype=torch.int32))
    with pytest.raises(ValueError, match="out buffers"):
        va.moe_align_block_size(ids, 16, 8, out=va.AlignBuffers.alloc(12, 16, 16, "cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-machine reason")
def test_cpu_machine_gets_the_loader_reason():
    with pytest.raises(RuntimeError, match="CUDA"):
        va.moe_align_block_size(torch.zeros(2, 6, dtype=torch.int32), 16, 8)


# --- GPU -------------------------------------------------------------------------------------


def _need_op():
    reason = vllm_ops.reason("moe")
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [16, 17, 64, 257, 385])  # <= 64: the op's small-batch kernel; else two kernels
@pytest.mark.parametrize("block", [8, 16, 32, 64])
def test_op_matches_the_reference_and_fills_the_tail(experts, block):
    _need_op()
    g = torch.Generator().manual_seed(experts * 100 + block)
    for rows in (1, 3, 8):
        top_k = 6 if experts >= 6 else experts
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)]).to(torch.int32)
        ids[-1, 0] = ids[0, 0]  # a shared expert across rows
        numel = ids.numel()
        out = va.AlignBuffers.alloc(numel, experts, block, "cuda")
        for t in out.as_tuple():
            t.fill_(12345)  # poison: every element must be written
        va.moe_align_block_size(ids.cuda(), experts, block, out=out)
        got, total = blocks_of(out, numel)
        ref, ref_total = align_reference(ids, experts, block)
        assert (got, total) == (ref, ref_total), (experts, block, rows)
        assert bool((out.sorted_ids[total:] == numel).all()), "sorted_ids tail must hold the sentinel numel"
        tail = out.expert_ids[total // block :].unique().tolist()
        assert tail in ([], [-1]), f"expert_ids past the used blocks hold {tail} (vLLM 0.26 writes -1)"


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [16, 384])
def test_op_skips_ids_the_expert_map_marks_remote(experts):
    """The remote-expert form Marlin's backend uses: E + 1 global experts,
    expert E mapped to -1."""
    _need_op()
    g = torch.Generator().manual_seed(experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(5)]).to(torch.int32)
    ids[:, -2:] = experts  # remote slots
    ids[2, :] = experts  # a row with no local expert at all
    expert_map = torch.cat((torch.arange(experts, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)))
    out = va.moe_align_block_size(ids.cuda(), experts + 1, 8, expert_map=expert_map.cuda())
    assert blocks_of(out, ids.numel()) == align_reference(ids, experts + 1, 8, expert_map)
