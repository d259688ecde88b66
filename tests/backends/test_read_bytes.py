"""Backend.read_bytes: the bytes each path really reads per layer call in its
own layout (CPU: the counts need no GPU and no package of the peers)."""

import pytest
import torch

from moebench.backends.base import Backend
from moebench.backends.flashinfer import FlashInferW4A8Backend, FlashInferW4A16Backend
from moebench.backends.humming import HummingW4A8Backend, HummingW4A16Backend, humming_expert_bytes
from moebench.backends.moebench import MoebenchBackend
from moebench.backends.reference import ReferenceBackend
from moebench.backends.torch_bf16 import TorchBF16Backend
from moebench.bench.cases import unique_bytes
from moebench.traffic import mxfp4_bytes
from moebench.models import get_preset

#: dsv41-flash TP4 (I 576, padded 640) and TP8 (I 288, padded 384), rows 2 over 7 distinct local experts.
IDS = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 6, 3, 2, 1, -1]], dtype=torch.int32)
ACTS = 2 * 2 * 5120 * 2


@pytest.mark.parametrize("tp, i, ip", [(4, 576, 640), (8, 288, 384)])
def test_each_backend_counts_its_own_layout(tp, i, ip):
    shape = get_preset("dsv41-flash").shard(tp)
    assert (shape.intermediate, shape.padded_intermediate) == (i, ip)
    h, experts = 5120, 7
    logical = unique_bytes(shape, IDS)
    # ours: the kernel layout drops the padding: the logical count
    assert MoebenchBackend().read_bytes(shape, IDS) == logical
    # torch-bf16: BF16 w13 [2I, H] and w2 [H, I]
    assert TorchBF16Backend().read_bytes(shape, IDS) == experts * 3 * i * h * 2 + ACTS
    # FlashInfer: the intermediate padded to 128
    fi = experts * (mxfp4_bytes(2 * ip, h) + mxfp4_bytes(h, ip)) + ACTS
    assert FlashInferW4A16Backend().read_bytes(shape, IDS) == FlashInferW4A8Backend().read_bytes(shape, IDS) == fi
    # humming: N of w13 (2I) padded to 256, K of w2 (I) to 128 (H already is)
    n13 = -(-2 * i // 256) * 256
    k2 = -(-i // 128) * 128
    assert humming_expert_bytes(shape) == mxfp4_bytes(n13, h) + mxfp4_bytes(h, k2)
    hm = experts * humming_expert_bytes(shape) + ACTS
    assert HummingW4A16Backend().read_bytes(shape, IDS) == HummingW4A8Backend().read_bytes(shape, IDS) == hm
    assert logical < fi and logical < hm < TorchBF16Backend().read_bytes(shape, IDS)
    # the reference (no layout of its own) leaves it to the normalized count
    assert ReferenceBackend().read_bytes(shape, IDS) is None


def test_humming_padding_of_a_shape_that_needs_it_everywhere():
    """H not a multiple of 256 for w2's N: humming pads it too."""
    shape = get_preset("dsv4-flash", hidden=384, intermediate=96, experts=8, top_k=2).shard(1)
    assert humming_expert_bytes(shape) == mxfp4_bytes(256, 384) + mxfp4_bytes(512, 128)


def test_ours_and_the_oracle_are_not_peers():
    """`peer` is declared by the class, never derived from a name."""
    assert MoebenchBackend.peer is False and ReferenceBackend.peer is False
    assert Backend.peer is True
    for cls in (
        TorchBF16Backend,
        FlashInferW4A16Backend,
        FlashInferW4A8Backend,
        HummingW4A16Backend,
        HummingW4A8Backend,
    ):
        assert cls.peer is True, cls.name
