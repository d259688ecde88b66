"""Timing of callables: CUDA-graph replay with device events, or CPU wall clock.

Knows callables, not kernels. On CUDA, `fn` is warmed up eagerly on a side
stream (as torch requires before capture), captured once into a CUDA graph,
the graph is replayed back to back for `warmup_ms` of GPU time, then replayed
`replays` times, each replay between two device events; one sample = replay
time / calls_per_replay (so a `fn` that runs several layers' calls reports the
time of one call). Without a GPU the eager calls are timed with the wall
clock, and `Timing.method` says so.

Why a warm-up by time (as `triton.testing.do_bench` does): an idle GPU clocks
down (the H200 reads 345 MHz idle, 1980 MHz under load), and the host work
before a case (compiling kernels, building weights) leaves it idle. A count of
warm-up replays is microseconds for a small graph, too short for the clocks to
come back, so the first case a process timed read high (TP4 rows 4: 25.6 µs
alone against 24.2 behind rows 1-2, docs/perf-notes.md, session 16).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moebench.bench import WARMUP_MS, check_warmup_ms

METHODS = ("cuda-graph", "cuda-events", "cpu-wallclock")
#: torch.cuda.graph capture error modes.
CAPTURE_MODES = ("global", "thread_local", "relaxed")
#: Most warm-up replays whatever their length (a graph of a few µs would
#: otherwise queue tens of thousands).
MAX_WARMUP_REPLAYS = 5000


@dataclass(frozen=True)
class Timing:
    """Per-call latency statistics in µs.

    samples_us: one value per replay (replay time / calls_per_replay);
    method: "cuda-graph" (graph replay, device events), "cuda-events" (eager
    calls between device events) or "cpu-wallclock" (eager calls, host clock).
    """

    median_us: float
    p10_us: float
    p90_us: float
    samples_us: tuple[float, ...]
    method: str
    calls_per_replay: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not self.samples_us:
            raise ValueError("samples_us must not be empty")

    @classmethod
    def from_samples(cls, samples_us, method: str, calls_per_replay: int = 1) -> Timing:
        """Median, p10 and p90 (linear interpolation) of `samples_us` (µs)."""
        s = np.asarray(list(samples_us), dtype=np.float64)
        if s.size == 0:
            raise ValueError("samples_us must not be empty")
        p10, med, p90 = np.percentile(s, [10, 50, 90])
        return cls(float(med), float(p10), float(p90), tuple(float(v) for v in s), method, calls_per_replay)


def _check_count(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def time_graph(
    fn: Callable[[], object],
    *,
    warmup: int = 10,
    replays: int = 100,
    calls_per_replay: int = 1,
    use_graph: bool = True,
    device: torch.device | str | None = None,
    capture_error_mode: str = "global",
    warmup_ms: float | None = None,
) -> Timing:
    """Time `fn` (no arguments; it may launch many calls) and return per-call µs.

    device: where `fn` runs; None = the current CUDA device if there is one,
    else the CPU. On CUDA with `use_graph`, `fn` must be capturable (no host
    sync, static buffers); a capture failure raises RuntimeError naming the
    cause rather than silently timing something else. With use_graph=False
    each replay is one eager `fn()` between device events ("cuda-events").
    capture_error_mode: torch.cuda.graph's mode; "thread_local" when other
    threads may touch CUDA during the capture (e.g. the NCCL watchdog of a
    process group whose collectives `fn` captures).
    warmup_ms: GPU time (ms) the captured graph replays back to back before
    the timed replays (module docstring); None = WARMUP_MS, 0 = none beyond
    three replays. Eager timing ("cuda-events", "cpu-wallclock") warms up by
    `warmup` calls only.
    Raises ValueError for non-positive counts, a negative or non-finite
    warmup_ms or an unknown capture mode, TypeError if `fn` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _check_count("warmup", warmup, 0)
    _check_count("replays", replays, 1)
    _check_count("calls_per_replay", calls_per_replay, 1)
    warmup_ms = WARMUP_MS if warmup_ms is None else warmup_ms
    check_warmup_ms(warmup_ms)
    if capture_error_mode not in CAPTURE_MODES:
        raise ValueError(f"capture_error_mode must be one of {CAPTURE_MODES}, got {capture_error_mode!r}")
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            if use_graph:
                return _time_cuda_graph(fn, warmup, replays, calls_per_replay, capture_error_mode, warmup_ms)
            return _time_cuda_events(fn, warmup, replays, calls_per_replay)
    if dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return _time_wallclock(fn, warmup, replays, calls_per_replay)


def _time_wallclock(fn, warmup: int, replays: int, calls: int) -> Timing:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(replays):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3 / calls)
    return Timing.from_samples(samples, "cpu-wallclock", calls)


def _replay_with_events(launch, replays: int, calls: int, method: str) -> Timing:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]
    return Timing.from_samples(samples, method, calls)


def _time_cuda_events(fn, warmup: int, replays: int, calls: int) -> Timing:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _replay_with_events(fn, replays, calls, "cuda-events")


def _warm_graph(replay, warmup_ms: float) -> None:
    """Replay (a graph's `replay`) three times, timed, then back to back
    until about `warmup_ms` of GPU time has passed (at most
    MAX_WARMUP_REPLAYS more); returns without synchronizing, so the timed
    replays queue right behind."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        replay()
    end.record()
    end.synchronize()
    per_ms = max(start.elapsed_time(end) / 3, 1e-4)
    for _ in range(min(MAX_WARMUP_REPLAYS, math.ceil(max(0.0, warmup_ms - 3 * per_ms) / per_ms))):
        replay()


def _time_cuda_graph(fn, warmup: int, replays: int, calls: int, capture_error_mode: str = "global",
                     warmup_ms: float = WARMUP_MS) -> Timing:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
            fn()
    except Exception as error:  # noqa: BLE001 - re-raised with the cause attached
        torch.cuda.synchronize()
        raise RuntimeError(f"fn is not CUDA-graph capturable: {type(error).__name__}: {error}") from error
    _warm_graph(graph.replay, warmup_ms)
    timing = _replay_with_events(graph.replay, replays, calls, "cuda-graph")
    del graph
    return timing
