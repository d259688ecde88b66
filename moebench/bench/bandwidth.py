"""Bandwidth references a run is measured against (GB/s = 1e9 bytes/s).

- `copy_bandwidth_gbps`: a large device-to-device copy, bytes read + written,
  median over repeats: the device's practical peak (docs/design.md "Measuring").
- `size_matched_ceiling_gbps`: a plain Triton read-streaming kernel
  (evict-first loads, grid 4 x SMs, per-program sums into a tiny output)
  reading exactly `nbytes` in one launch under a CUDA graph, cold in L2: what
  a single launch of that size can physically reach. Triton lives on the GPU
  host only; it is imported lazily and the ceiling is None without it.

Both are cached per (device, nbytes) for the life of the process.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch

from moebench.bench import L2_MULTIPLE

#: Most memory the ceiling's rotation buffers may take (bytes).
CEILING_MEMORY_CAP = 4 << 30  # also keeps int32 word offsets in range

_copy_cache: dict[tuple[str, int, int], float] = {}
_ceiling_cache: dict[tuple[str, int], float | None] = {}


def _check_bytes(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int (bytes), got {value!r}")


def copy_bandwidth_gbps(device: torch.device | str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Median copy bandwidth of `device` in GB/s, counting bytes read + written
    (2 * nbytes per copy).

    CUDA: device-to-device `copy_` between two `nbytes` buffers, each copy
    between device events. CPU: the same with the host clock (a rough figure).
    Raises ValueError for non-positive sizes; torch's OutOfMemoryError when two
    buffers of `nbytes` do not fit.
    """
    _check_bytes("nbytes", nbytes)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    dev = torch.device(device)
    key = (str(dev), nbytes, repeats)
    if key in _copy_cache:
        return _copy_cache[key]
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]  # fmt: skip
            for start, end in events:
                start.record()
                dst.copy_(src)
                end.record()
            torch.cuda.synchronize()
            seconds = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    del src, dst
    gbps = 2 * nbytes / float(np.median(seconds)) / 1e9
    _copy_cache[key] = gbps
    return gbps


@functools.cache
def _stream_kernel():
    """The Triton read-streaming kernel, or None when Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def stream_read(src, out, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        tl.store(out + pid, tl.sum(acc, axis=0))

    return stream_read


def triton_available() -> bool:
    """Whether the size-matched ceiling can be measured (Triton importable)."""
    return _stream_kernel() is not None


def size_matched_ceiling_gbps(nbytes: int, device: torch.device | str, repeats: int = 30) -> float | None:
    """GB/s a plain read-streaming kernel reaches over `nbytes` in one launch.

    The kernel reads int32 words (nbytes rounded up to 16 bytes), grid = 4 x
    SM count, evict-first loads; one CUDA graph launches it once per buffer of
    a rotation spanning >= 4 x L2 (so every launch starts cold), and a sample
    is that graph's replay time / the buffer count, the way the sweep times
    several layers' calls per replay. Median over `repeats` replays. Returns
    None when Triton is missing or `device` is not CUDA. Raises ValueError for a non-positive size or one
    larger than the rotation's memory cap (4 GiB).
    """
    _check_bytes("nbytes", nbytes)
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    kernel = _stream_kernel()
    if kernel is None:
        return None
    if nbytes > CEILING_MEMORY_CAP:
        raise ValueError(f"nbytes must be <= {CEILING_MEMORY_CAP} for the ceiling, got {nbytes}")
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    key = (str(dev), nbytes)
    if key in _ceiling_cache:
        return _ceiling_cache[key]
    with torch.cuda.device(dev):
        props = torch.cuda.get_device_properties(dev)
        l2 = int(getattr(props, "L2_cache_size", 0)) or (50 << 20)
        words = -(-nbytes // 16) * 4
        count = max(2, math.ceil(L2_MULTIPLE * l2 / (words * 4)) + 1)
        count = max(1, min(count, CEILING_MEMORY_CAP // (words * 4)))
        grid = (4 * props.multi_processor_count,)
        bufs = [torch.ones(words, dtype=torch.int32, device=dev) for _ in range(count)]
        out = torch.zeros(grid[0], dtype=torch.int32, device=dev)
        for b in bufs:  # compile and warm
            kernel[grid](b, out, words, BLOCK=4096, num_warps=8)
        torch.cuda.synchronize()
        # One graph reads every buffer in turn, and a sample is its replay time
        # / count: per-replay events around a single short launch would add
        # the host's graph-submission gap and understate the ceiling.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for b in bufs:
                kernel[grid](b, out, words, BLOCK=4096, num_warps=8)
        torch.cuda.synchronize()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]  # fmt: skip
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        seconds = float(np.median([s.elapsed_time(e) / 1e3 / len(bufs) for s, e in events]))
        del graph, bufs, out
    gbps = words * 4 / seconds / 1e9
    _ceiling_cache[key] = gbps
    return gbps
