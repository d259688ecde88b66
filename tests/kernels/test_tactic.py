from types import SimpleNamespace

import numpy as np
import pytest

from moebench.kernels.tactic import GemmShape
from moebench.models import get_preset


def test_gemm_shape_of_takes_integers_and_refuses_floats():
    """GemmShape.of keeps int-like values (numpy integers too) and refuses a
    float naming the field rather than truncating it to another shape."""
    shape = get_preset("dsv41-flash").shard(4)
    assert GemmShape.of(shape) == GemmShape(5120, 576, 384)
    assert GemmShape.of(SimpleNamespace(hidden=np.int64(4096), intermediate=512, experts=32)) == GemmShape(4096, 512, 32)
    with pytest.raises(ValueError, match="hidden must be a positive int, got 4096.7"):
        GemmShape.of(SimpleNamespace(hidden=4096.7, intermediate=512, experts=32))
    with pytest.raises(ValueError, match="experts"):
        GemmShape.of(SimpleNamespace(hidden=4096, intermediate=512, experts=True))
    with pytest.raises(TypeError, match="hidden, intermediate and experts"):
        GemmShape.of(SimpleNamespace(hidden=4096))
