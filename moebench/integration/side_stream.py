"""Run one part of a layer (the shared expert) on a side CUDA stream, beside
the gate and the routed experts on the current stream.

At 1-8 rows both parts are far from the copy bandwidth (the shared expert's
two launches are mostly latency), so running them side by side overlaps
their time; serving stacks do the same (vLLM's shared-experts stream). The
side stream is forked from the current stream (it starts after everything
queued there) and joined back into it, so a CUDA graph captures both
branches and what the caller queues after the join sees the side output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["on_side_stream", "side_stream_for"]

#: Side streams per device, made on first use: two of torch's pooled
#: default-priority streams. The pool hands its 32 streams out in turn, and
#: graph capture and warm-up take theirs from it too, so one of ours can be
#: the very stream being captured on: `side_stream_for` never returns the
#: current stream. (High-priority streams were measured: the shared
#: expert's blocks then go first and the rows-6 step took 48.8 µs instead
#: of 39.6; docs/perf-notes.md.)
_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def side_stream_for(device: torch.device) -> torch.cuda.Stream:
    """A side stream of CUDA `device` that is not its current stream (made
    on first use: do that first call outside a graph capture, as the
    kernels' first calls must be anyway)."""
    streams = _STREAMS.get(device)
    if streams is None:
        streams = _STREAMS[device] = [torch.cuda.Stream(device) for _ in range(2)]
    current = torch.cuda.current_stream(device)
    return streams[0] if streams[0] != current else streams[1]


@contextmanager
def on_side_stream(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, side: bool = True
) -> Iterator[torch.Tensor]:
    """with on_side_stream(fn, x) as out: ... — queue out = fn(x) on a side
    stream of x's device (`side_stream_for`), after the work queued so far
    on x's current stream; the body queues the other branch on the current
    stream; leaving the block, also by an exception (a graph capture is
    never left with unjoined work), makes the current stream wait for the
    side one. x: a tensor (fn's input; kept for the side stream with
    record_stream); fn returns a tensor (out, recorded on the current
    stream). Queues work only (no host sync). With side=False, or on a CPU
    tensor, fn(x) is a plain call on the current stream, before the body
    (in order). Raises what fn or the body raises, after the join."""
    if not (side and x.is_cuda):
        yield fn(x)
        return
    current = torch.cuda.current_stream(x.device)
    stream = side_stream_for(x.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            out = fn(x)
        x.record_stream(stream)  # x's memory is not reused before the side stream is done with it
        yield out
        out.record_stream(current)
    finally:
        current.wait_stream(stream)
