"""traffic: the byte counts backends and the bench share."""

import pytest
import torch

from moebench.bench.cases import unique_bytes
from moebench.models import get_preset
from moebench.traffic import mxfp4_bytes, touched_bytes, unique_experts


def test_touched_bytes_takes_any_layout_and_unique_bytes_is_its_mxfp4_case():
    """touched_bytes: distinct local experts x the given per-expert bytes +
    BF16 x in and out; unique_bytes is it at the logical MXFP4 size;
    mxfp4_bytes counts nibbles and one scale per 32 along K."""
    assert mxfp4_bytes(64, 128) == 64 * 64 + 64 * 4 and mxfp4_bytes(0, 32) == 0
    shape = get_preset("dsv41-flash").shard(4)
    assert shape.expert_bytes() == mxfp4_bytes(2 * 576, 5120) + mxfp4_bytes(5120, 576)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, -1]], dtype=torch.int32)  # 6 local, one non-local
    acts = 2 * 2 * 5120 * 2
    assert touched_bytes(shape, ids, 1000) == 6 * 1000 + acts
    assert touched_bytes(shape, ids, shape.expert_bytes()) == unique_bytes(shape, ids)
    with pytest.raises(ValueError, match="expert_bytes"):
        touched_bytes(shape, ids, -1)
    with pytest.raises(ValueError, match="topk_ids"):
        touched_bytes(shape, ids[:, :5], 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_bytes(4, 48)
    with pytest.raises(ValueError, match="rows"):
        mxfp4_bytes(-1, 32)


def test_unique_experts_counts_each_local_id_once():
    ids = torch.tensor([[0, 1, 1, -1, 7, 384], [7, 2, 3, 0, 1, 4]], dtype=torch.int32)
    assert unique_experts(ids, 384) == 6
