"""traffic: the byte counts backends and the bench share."""

import pytest
import torch

from moebench.models import get_preset
from moebench.traffic import mxfp4_bytes, touched_bytes, unique_experts


def test_mxfp4_bytes_are_nibbles_plus_one_scale_per_32():
    assert mxfp4_bytes(4, 64) == 4 * 32 + 4 * 2
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_bytes(4, 48)


def test_touched_bytes_count_each_local_expert_once_plus_activations():
    shape = get_preset("dsv41-flash").shard(4)
    ids = torch.tensor([[0, 1, 1, -1, 7, shape.experts], [7, 2, 3, 0, 1, 4]], dtype=torch.int32)
    assert unique_experts(ids, shape.experts) == 6
    assert touched_bytes(shape, ids, 100) == 6 * 100 + 2 * 2 * shape.hidden * 2
    with pytest.raises(ValueError, match="expert_bytes"):
        touched_bytes(shape, ids, -1)
