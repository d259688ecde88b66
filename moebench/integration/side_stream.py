"""Run one part of a layer (the shared expert) on a side CUDA stream, beside
the routed experts on the current stream.

At 1-8 rows both parts are far from the copy bandwidth (the shared expert's
two launches are mostly latency), so running them side by side overlaps
their time; serving stacks do the same (vLLM's shared-experts stream). The
side stream is forked from the current stream (it starts after everything
queued there) and joined back into it, so a CUDA graph captures both
branches and what the caller queues after `join` sees the side output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SideStream"]


class SideStream:
    """One side stream per device, made on first use (do that first call
    outside a graph capture, as the kernels' first calls must be anyway).

    out = side.fork(fn, x): queue fn(x) on the side stream after the work
    queued so far on x's current stream; side.join(out): make that current
    stream wait for it. Between the two, the current stream is free for the
    other branch. Both only queue work (no host sync). On a CPU tensor fork
    simply calls fn(x) and join does nothing.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def fork(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn(x) queued on the side stream of x's device (x: a tensor; fn
        returns a tensor)."""
        if not x.is_cuda:
            return fn(x)
        side = self._stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            out = fn(x)
        x.record_stream(side)  # x's memory is not reused before the side stream is done with it
        return out

    def join(self, out: torch.Tensor) -> None:
        """The current stream of out's device waits for its side stream."""
        if not out.is_cuda:
            return
        torch.cuda.current_stream(out.device).wait_stream(self._stream(out.device))
        out.record_stream(torch.cuda.current_stream(out.device))
