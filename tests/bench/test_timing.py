import time

import pytest

from moebench.bench.timing import Timing, time_graph


def test_cpu_wallclock_per_call_time():
    def two_calls():
        time.sleep(0.002)
        time.sleep(0.002)

    t = time_graph(two_calls, warmup=1, replays=5, calls_per_replay=2, device="cpu")
    assert t.method == "cpu-wallclock"
    assert t.calls_per_replay == 2
    assert len(t.samples_us) == 5
    # Each replay is >= 4 ms of sleep split over two calls.
    assert 2000 <= t.p10_us <= t.median_us <= t.p90_us < 100_000


def test_warmup_calls_happen_before_timing():
    calls = []
    time_graph(lambda: calls.append(1), warmup=3, replays=4, device="cpu")
    assert len(calls) == 7


def test_from_samples_percentiles():
    t = Timing.from_samples(range(1, 12), "cpu-wallclock")
    assert (t.p10_us, t.median_us, t.p90_us) == (2.0, 6.0, 10.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(replays=0), "replays"),
        (dict(warmup=-1), "warmup"),
        (dict(calls_per_replay=0), "calls_per_replay"),
        (dict(device="meta"), "device"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_graph(lambda: None, **kwargs)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn"):
        time_graph(42, device="cpu")


def test_timing_rejects_unknown_method_and_empty_samples():
    with pytest.raises(ValueError, match="method"):
        Timing(1.0, 1.0, 1.0, (1.0,), "stopwatch")
    with pytest.raises(ValueError, match="samples"):
        Timing.from_samples([], "cpu-wallclock")


@pytest.mark.gpu
def test_cuda_graph_timing_of_a_kernel():
    import torch

    x = torch.ones(1 << 20, device="cuda")
    t = time_graph(lambda: x.mul_(1.0), replays=20, device="cuda")
    assert t.method == "cuda-graph" and 0 < t.median_us < 1000
    e = time_graph(lambda: x.mul_(1.0), replays=20, use_graph=False, device="cuda")
    assert e.method == "cuda-events"


def test_capture_error_mode_is_checked():
    with pytest.raises(ValueError, match="capture_error_mode"):
        time_graph(lambda: None, replays=1, device="cpu", capture_error_mode="loose")
    assert time_graph(lambda: None, replays=2, device="cpu", capture_error_mode="thread_local").method == "cpu-wallclock"
