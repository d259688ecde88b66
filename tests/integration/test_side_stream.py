"""integration.side_stream: fork / join of one call beside the current stream."""

from __future__ import annotations

import pytest
import torch

from moebench.integration.side_stream import on_side_stream, side_stream_for


def test_on_the_cpu_it_is_a_plain_call():
    x = torch.arange(4.0)
    with on_side_stream(lambda t: t * 2, x) as out:
        assert torch.equal(out, x * 2)
    with pytest.raises(ValueError, match="body"):
        with on_side_stream(lambda t: t + 1, x):
            raise ValueError("body")


@pytest.mark.gpu
def test_gpu_fork_join_in_a_capture_and_errors_leave_no_unjoined_work():
    x = torch.randn(64, device="cuda")
    # the side stream is never the stream being captured on, however many pool streams were taken before
    pool = [torch.cuda.Stream() for _ in range(40)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert side_stream_for(x.device) != torch.cuda.current_stream()
        with on_side_stream(lambda t: t * 2, x) as doubled:
            plus = x + 1
        out = doubled + plus
    x.copy_(torch.arange(64.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3 + 1)
    del pool

    def boom(t):
        raise RuntimeError("boom in the side branch")

    for fn, body in ((boom, False), (lambda t: t * 2, True)):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="boom") as info, torch.cuda.graph(g):
            with on_side_stream(fn, x):
                if body:
                    raise RuntimeError("boom in the body")
        assert "unjoined" not in str(info.value)
    # eager use still works after the failed captures
    with on_side_stream(lambda t: t * 2, x) as doubled:
        pass
    assert torch.equal(doubled, x * 2)
