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


def test_less_us_subtracts_one_value_from_every_sample():
    from moebench.bench.timing import less_us

    total = Timing.from_samples([10.0, 11.0, 12.0], "cuda-graph", 4)
    net = less_us(total, 2.5)
    assert net.samples_us == (7.5, 8.5, 9.5) and net.calls_per_replay == 4 and net.method == "cuda-graph"
    with pytest.raises(ValueError, match="not above its part"):
        less_us(total, 11.0)


def test_time_steady_doubles_the_replays_until_the_batches_agree(monkeypatch):
    """Batches whose medians spread 0.3 µs, then (twice the replays) 0.02 µs:
    steady at the second round, every sample of it pooled; a cap ends it unsteady."""
    from moebench.bench import timing

    rounds = {100: [5.0, 5.3, 5.1], 200: [5.10, 5.12, 5.11], 400: [9.0, 5.0, 7.0]}
    asked = []

    def fake(fn, *, replays, **kw):
        asked.append(replays)
        median = rounds[replays][sum(1 for r in asked if r == replays) - 1]
        return Timing.from_samples([median] * 3, "cuda-graph", kw["calls_per_replay"])

    monkeypatch.setattr(timing, "time_graph", fake)
    got = timing.time_steady(lambda: None, spread_us=0.05, batches=3, replays=100, calls_per_replay=4)
    assert asked == [100] * 3 + [200] * 3 and got.steady and got.replays == 200 and got.batches == 3
    assert got.spread_us == pytest.approx(0.02) and got.timing.median_us == pytest.approx(5.11)
    assert len(got.timing.samples_us) == 9 and got.timing.calls_per_replay == 4
    asked.clear()
    capped = timing.time_steady(lambda: None, batches=3, replays=400, max_replays=400, calls_per_replay=4)
    assert not capped.steady and capped.spread_us == pytest.approx(4.0) and asked == [400] * 3
    with pytest.raises(ValueError, match="batches"):
        timing.time_steady(lambda: None, batches=1)


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
    assert (
        time_graph(lambda: None, replays=2, device="cpu", capture_error_mode="thread_local").method == "cpu-wallclock"
    )


def test_check_sees_one_more_run_of_what_was_timed_and_its_result_is_kept():
    """check(replay) runs once, after the timing; replay runs fn once more
    (on the CPU an eager call: the CPU stand-in for a graph replay); what
    check returns is Timing.checked; its errors propagate."""
    calls, seen = [], []

    def check(replay):
        seen.append(len(calls))
        replay()
        return ("after", len(calls))

    t = time_graph(lambda: calls.append(1), warmup=2, replays=3, device="cpu", check=check)
    assert seen == [5] and t.checked == ("after", 6) and len(calls) == 6
    assert time_graph(lambda: None, replays=1, device="cpu").checked is None

    def bad(replay):
        raise RuntimeError("output off")

    with pytest.raises(RuntimeError, match="output off"):
        time_graph(lambda: None, replays=1, device="cpu", check=bad)
    with pytest.raises(TypeError, match="check"):
        time_graph(lambda: None, replays=1, device="cpu", check=42)


def test_less_subtracts_the_parts_median_from_every_sample():
    from moebench.bench.timing import less

    total = Timing.from_samples([10.0, 11.0, 12.0, 13.0, 14.0], "cpu-wallclock", 4)
    part = Timing.from_samples([2.0, 3.0, 4.0], "cpu-wallclock", 4)
    net = less(total, part)
    assert (net.median_us, net.samples_us, net.calls_per_replay) == (9.0, (7.0, 8.0, 9.0, 10.0, 11.0), 4)
    assert net.p10_us == pytest.approx(total.p10_us - 3.0) and net.method == "cpu-wallclock"
    with pytest.raises(ValueError, match="calls per replay"):
        less(total, Timing.from_samples([1.0], "cpu-wallclock", 2))
    with pytest.raises(ValueError, match="not above its part"):
        less(part, total)


@pytest.mark.gpu
def test_cuda_graph_check_replays_the_timed_graph():
    """On CUDA the check's replay is the captured graph itself: a buffer the
    graph writes, poisoned after the timing, holds the graph's value again."""
    import torch

    src = torch.full((1024,), 3.0, device="cuda")
    dst = torch.empty(1024, device="cuda")

    def check(replay):
        dst.fill_(float("nan"))
        replay()
        return dst.clone()

    t = time_graph(lambda: dst.copy_(src * 2), replays=5, device="cuda", check=check)
    assert t.method == "cuda-graph" and bool((t.checked == 6.0).all())
    e = time_graph(lambda: dst.copy_(src * 2), replays=5, use_graph=False, device="cuda", check=check)
    assert e.method == "cuda-events" and bool((e.checked == 6.0).all())
