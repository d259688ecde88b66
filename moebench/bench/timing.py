"""Timing of callables: CUDA-graph replay with device events, or CPU wall clock.

Knows callables, not kernels. On CUDA, `fn` is warmed up eagerly on a side
stream (as torch requires before capture), captured once into a CUDA graph and
the graph is replayed `replays` times, each replay between two device events;
one sample = replay time / calls_per_replay (so a `fn` that runs several
layers' calls reports the time of one call). Without a GPU the eager calls are
timed with the wall clock, and `Timing.method` says so.

`check(replay)`, when given, runs after the timing with what was timed
still alive: `replay()` runs it once more (one more replay of the same
captured graph, or one more eager `fn()`) and waits for it, so a caller can
poison the outputs `fn` wrote, replay, and inspect them; whatever `check`
returns is kept in `Timing.checked`. `less(total, part)` subtracts the
median of a part timed alone (e.g. the kernels written between `fn`'s calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

METHODS = ("cuda-graph", "cuda-events", "cpu-wallclock")
#: torch.cuda.graph capture error modes.
CAPTURE_MODES = ("global", "thread_local", "relaxed")


@dataclass(frozen=True)
class Timing:
    """Per-call latency statistics in µs.

    samples_us: one value per replay (replay time / calls_per_replay);
    method: "cuda-graph" (graph replay, device events), "cuda-events" (eager
    calls between device events) or "cpu-wallclock" (eager calls, host clock);
    checked: what `time_graph`'s `check` returned (None without one).
    """

    median_us: float
    p10_us: float
    p90_us: float
    samples_us: tuple[float, ...]
    method: str
    calls_per_replay: int = 1
    checked: object = field(default=None, compare=False, repr=False)

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


def less(total: Timing, part: Timing) -> Timing:
    """`total` with the median of `part` taken off every sample (so median,
    p10 and p90 each lose part's median): the time of what `total` timed
    beside `part`, per call, when both were timed with the same calls per
    replay. Keeps total's method and `checked`. Raises ValueError unless the
    result's median is positive (the part is not smaller than the whole:
    nothing was measured)."""
    if not isinstance(total, Timing) or not isinstance(part, Timing):
        raise TypeError("total and part must be Timing")
    if total.calls_per_replay != part.calls_per_replay:
        raise ValueError(
            f"total and part were timed with {total.calls_per_replay} and {part.calls_per_replay}"
            " calls per replay; expected the same"
        )
    net = Timing.from_samples([s - part.median_us for s in total.samples_us], total.method, total.calls_per_replay)
    if not net.median_us > 0:
        raise ValueError(
            f"the whole ({total.median_us:.3g} µs per call) is not above its part timed alone"
            f" ({part.median_us:.3g} µs): nothing left to measure"
        )
    return replace(net, checked=total.checked)


def less_us(total: Timing, part_us: float) -> Timing:
    """`total` with `part_us` (µs per call, e.g. a part measured once for
    many totals) taken off every sample; keeps total's method, calls per
    replay and `checked`. Raises ValueError unless the result's median is
    positive (nothing was measured)."""
    if not isinstance(total, Timing):
        raise TypeError("total must be a Timing")
    net = Timing.from_samples([s - part_us for s in total.samples_us], total.method, total.calls_per_replay)
    if not net.median_us > 0:
        raise ValueError(
            f"the whole ({total.median_us:.3g} µs per call) is not above its part timed alone"
            f" ({part_us:.3g} µs): nothing left to measure"
        )
    return replace(net, checked=total.checked)


@dataclass(frozen=True)
class Steady:
    """A timing repeated in `batches` batches of `replays` replays until the
    batches' medians agree within `spread_us` (max - min), or `replays`
    reached its cap (`steady` False): `timing` pools every sample of the
    last round."""

    timing: Timing
    spread_us: float
    replays: int
    batches: int
    steady: bool


def time_steady(
    fn: Callable[[], object], *, spread_us: float = 0.05, batches: int = 5, max_replays: int = 6400, **counts
) -> Steady:
    """`time_graph(fn, **counts)` in `batches` batches, doubling the replays
    (from counts["replays"], at most `max_replays`) until the batch medians
    are within `spread_us` of each other. Raises ValueError for a
    non-positive spread or fewer than 2 batches."""
    if not spread_us > 0:
        raise ValueError(f"spread_us must be positive, got {spread_us!r}")
    _check_count("batches", batches, 2)
    replays = counts.pop("replays", 100)
    while True:
        runs = [time_graph(fn, replays=replays, **counts) for _ in range(batches)]
        medians = [t.median_us for t in runs]
        spread = max(medians) - min(medians)
        if spread < spread_us or replays >= max_replays:
            samples = [v for t in runs for v in t.samples_us]
            pooled = Timing.from_samples(samples, runs[0].method, runs[0].calls_per_replay)
            return Steady(pooled, spread, replays, batches, spread < spread_us)
        replays = min(2 * replays, max_replays)


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
    check: Callable[[Callable[[], None]], object] | None = None,
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
    check: called once after the timing as `check(replay)` (module
    docstring); its result goes to `Timing.checked`, its exceptions propagate.
    Raises ValueError for non-positive counts or an unknown capture mode,
    TypeError if `fn` or `check` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if check is not None and not callable(check):
        raise TypeError(f"check must be callable or None, got {type(check).__name__}")
    _check_count("warmup", warmup, 0)
    _check_count("replays", replays, 1)
    _check_count("calls_per_replay", calls_per_replay, 1)
    if capture_error_mode not in CAPTURE_MODES:
        raise ValueError(f"capture_error_mode must be one of {CAPTURE_MODES}, got {capture_error_mode!r}")
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            if use_graph:
                return _time_cuda_graph(fn, warmup, replays, calls_per_replay, capture_error_mode, check)
            return _checked(_time_cuda_events(fn, warmup, replays, calls_per_replay), check, fn, torch.cuda.synchronize)
    if dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return _checked(_time_wallclock(fn, warmup, replays, calls_per_replay), check, fn, lambda: None)


def _checked(timing: Timing, check, run, wait) -> Timing:
    """`timing` with `check(replay)`'s result (replay = run() then wait()), or as it is without a check."""
    if check is None:
        return timing

    def replay() -> None:
        run()
        wait()

    return replace(timing, checked=check(replay))


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


def _time_cuda_graph(
    fn, warmup: int, replays: int, calls: int, capture_error_mode: str = "global", check=None
) -> Timing:
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
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    timing = _replay_with_events(graph.replay, replays, calls, "cuda-graph")
    timing = _checked(timing, check, graph.replay, torch.cuda.synchronize)  # the graph that was timed
    del graph
    return timing
