"""DeepSeek-V4 router reference and routing scenarios (moebench.routing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebench.routing import SCENARIOS, RouterConfig, route, scenario_topk_ids, scenario_weights, sqrtsoftplus

INF = math.inf
NAN = math.nan


def softplus_sqrt_f64(x: float) -> float:
    """sqrt(softplus(x)) in fp64 from the formula in docs/design.md."""
    if math.isnan(x):
        return NAN
    if x == INF:
        return INF
    return math.sqrt(max(x, 0.0) + math.log1p(math.exp(-abs(x))))


# ----------------------------------------------------------------------------- sqrtsoftplus


def test_sqrtsoftplus_values():
    xs = [-87.0, -50.0, -20.5, -20.0, -5.0, -1.0, -1e-3, 0.0, 1e-3, 0.5, 1.0, 5.0, 20.0,
          88.0, 88.8, 89.0, 100.0, 1e4, 3e38]  # fmt: skip
    got = sqrtsoftplus(torch.tensor(xs, dtype=torch.float32))
    assert got.dtype == torch.float32
    for x, g in zip(xs, got.tolist()):
        want = softplus_sqrt_f64(float(np.float32(x)))
        assert math.isfinite(g), x
        assert g == pytest.approx(want, rel=2e-6), x
    assert sqrtsoftplus(torch.tensor([0.0])).item() == pytest.approx(math.sqrt(math.log(2)), rel=1e-7)
    # large logits: sqrt(x) (the naive log1p(exp(x)) would overflow to inf)
    assert sqrtsoftplus(torch.tensor([100.0])).item() == 10.0


def test_sqrtsoftplus_extremes():
    got = sqrtsoftplus(torch.tensor([-100.0, -104.0, -1e30, -INF, INF, NAN]))
    a, b, c, d, e, f = got.tolist()
    # exp(-100) is an fp32 subnormal: only a couple of significant bits, but finite and > 0
    assert a == pytest.approx(math.exp(-50), rel=0.05) and a > 0
    assert 0.0 <= b < 1e-22 and c == 0.0 and d == 0.0
    assert e == INF and math.isnan(f)
    # other input dtypes are evaluated in fp32
    assert sqrtsoftplus(torch.tensor([1.0], dtype=torch.float64)).dtype == torch.float32
    assert sqrtsoftplus(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.float32


# ----------------------------------------------------------------------------- naive router


def naive_route(logits, experts, top_k, scale=1.0, bias=None, bias_vl=None, lo=0, input_ids=None,
                hash_table=None):  # fmt: skip
    """Row-by-row router from docs/design.md "Routing" and the module's non-finite rules."""
    scores = sqrtsoftplus(logits).tolist()  # fp32 scores (checked above)
    ids_out, w_out = [], []
    for r, row in enumerate(scores):
        if hash_table is not None:
            chosen = list(hash_table[int(input_ids[r])])
        else:
            b = bias
            if bias_vl is not None and lo > 0 and lo <= int(input_ids[r]) < lo + 5:
                b = bias_vl
            sel = [np.float32(row[e]) + (np.float32(b[e]) if b is not None else np.float32(0))
                   for e in range(experts)]  # fmt: skip
            key = [(1, 0.0, e) if math.isnan(s) else (0, -float(s), e) for e, s in enumerate(sel)]
            chosen = [k[2] for k in sorted(key)[:top_k]]
        c = [0.0 if math.isnan(row[e]) else row[e] for e in chosen]
        n_inf = sum(1 for v in c if v == INF)
        if n_inf:
            w = [scale / n_inf if v == INF else 0.0 for v in c]
        else:
            total = np.float32(0)
            for v in c:
                total = np.float32(total + np.float32(v))
            total = max(float(total), 1e-20)
            w = [v / total * scale for v in c]
        ids_out.append(chosen)
        w_out.append(w)
    return ids_out, w_out


def check_outputs(weights, ids, rows, top_k, experts):
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == (rows, top_k) and weights.shape == (rows, top_k)
    assert bool(((ids >= 0) & (ids < experts)).all())
    for r in range(rows):
        assert len(set(ids[r].tolist())) == top_k, ids[r]
    assert torch.isfinite(weights).all()
    assert bool((weights >= 0).all())


logit_values = st.one_of(
    st.floats(-30, 30, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 2.5, INF, -INF, NAN, 100.0, -100.0]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_route_vs_naive_with_nonfinite(data):
    experts = data.draw(st.integers(1, 24))
    top_k = data.draw(st.integers(1, min(8, experts)))
    rows = data.draw(st.integers(0, 8))
    scale = data.draw(st.sampled_from([1.0, 1.5, 2.5]))
    logits = torch.tensor(
        data.draw(st.lists(logit_values, min_size=rows * experts, max_size=rows * experts)),
        dtype=torch.float32,
    ).view(rows, experts)
    bias = None
    if data.draw(st.booleans()):
        values = st.one_of(st.floats(-2, 2, width=32), st.sampled_from([NAN, -INF]))
        bias = torch.tensor(data.draw(st.lists(values, min_size=experts, max_size=experts)), dtype=torch.float32)
    cfg = RouterConfig(experts, top_k, scale, bias=bias)
    weights, ids = route(logits, cfg)
    check_outputs(weights, ids, rows, top_k, experts)
    with np.errstate(invalid="ignore"):  # inf logit + -inf bias = NaN selection score
        want_ids, want_w = naive_route(logits, experts, top_k, scale, bias)
    assert ids.tolist() == want_ids
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float32).view(rows, top_k),
                               rtol=2e-6, atol=1e-30)  # fmt: skip
    assert bool((weights.sum(1) <= scale * (1 + 1e-5)).all())


def test_ties_go_to_lowest_ids():
    cfg = RouterConfig(16, 6)
    w, ids = route(torch.full((3, 16), 0.7), cfg)
    assert ids.tolist() == [list(range(6))] * 3
    torch.testing.assert_close(w, torch.full((3, 6), 1 / 6))
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    _, ids = route(logits, RouterConfig(6, 3))
    assert ids.tolist() == [[1, 2, 3]]
    # order of the output: descending score, lower id first among equals
    _, ids = route(torch.tensor([[0.0, 3.0, 1.0, 3.0]]), RouterConfig(4, 4))
    assert ids.tolist() == [[1, 3, 2, 0]]


def test_nan_row_and_nan_entries():
    cfg = RouterConfig(8, 4, 1.5)
    logits = torch.tensor([[NAN] * 8, [NAN, NAN, 0.0, -INF, 1.0, NAN, -1.0, 2.0]])
    w, ids = route(logits, cfg)
    check_outputs(w, ids, 2, 4, 8)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert w[0].tolist() == [0.0] * 4
    # numbers first (-inf logit = score 0 still beats NaN), NaN last
    assert ids[1].tolist() == [7, 4, 2, 6]
    s = [softplus_sqrt_f64(v) for v in (2.0, 1.0, 0.0, -1.0)]
    torch.testing.assert_close(w[1], torch.tensor([v / sum(s) * 1.5 for v in s]), rtol=1e-6, atol=0)
    _, ids = route(torch.tensor([[NAN, -INF, NAN, -INF]]), RouterConfig(4, 3))
    assert ids.tolist() == [[1, 3, 0]]
    # a -inf selection score (from a -inf bias) still ranks above a NaN one
    bias = torch.tensor([0.0, -INF, 0.0])
    w, ids = route(torch.tensor([[NAN, 0.0, 0.0]]), RouterConfig(3, 3, bias=bias))
    assert ids.tolist() == [[2, 1, 0]]
    assert w[0, 2].item() == 0.0 and w[0, :2].tolist() == [0.5, 0.5]


def test_inf_logits():
    logits = torch.zeros(2, 8)
    logits[0, 3] = INF
    logits[0, 6] = INF
    logits[1, 5] = INF
    logits[1, 0] = -INF
    w, ids = route(logits, RouterConfig(8, 4, 2.5))
    check_outputs(w, ids, 2, 4, 8)
    assert ids[0, :2].tolist() == [3, 6]
    assert w[0].tolist() == [1.25, 1.25, 0.0, 0.0]
    assert int(ids[1, 0]) == 5 and 0 not in ids[1].tolist()
    assert w[1].tolist() == [2.5, 0.0, 0.0, 0.0]
    # all -inf: scores 0, sum floored, weights 0
    w, ids = route(torch.full((1, 8), -INF), RouterConfig(8, 4))
    assert ids.tolist() == [[0, 1, 2, 3]] and w.tolist() == [[0.0] * 4]


def test_renormalization_floor():
    cfg = RouterConfig(8, 4)
    # scores ~ e^-50 ~ 1.9e-22 each: the sum (~8e-22) is below the 1e-20 floor
    logits = torch.full((1, 8), -100.0)
    w, ids = route(logits, cfg)
    s = sqrtsoftplus(logits)[0, :4].double()
    assert bool((s > 0).all())
    torch.testing.assert_close(w[0].double(), s / 1e-20, rtol=1e-6, atol=0)
    assert float(w.sum()) < 0.2  # not renormalized to 1
    # above the floor: plain renormalization
    w, _ = route(torch.full((1, 8), -40.0), cfg)
    torch.testing.assert_close(w, torch.full((1, 4), 0.25))


@pytest.mark.parametrize("scale", [1.0, 1.5, 2.5])
def test_routed_scaling_factor_applied(scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=g) * 3
    w, ids = route(logits, RouterConfig(64, 6, scale))
    torch.testing.assert_close(w.sum(1), torch.full((8,), scale), rtol=1e-6, atol=0)
    w1, ids1 = route(logits, RouterConfig(64, 6, 1.0))
    assert torch.equal(ids, ids1)
    torch.testing.assert_close(w, w1 * scale, rtol=1e-6, atol=0)


def test_bias_selects_but_does_not_weigh():
    logits = torch.zeros(1, 8)
    logits[0, 5] = 2.0
    bias = torch.zeros(8)
    bias[1] = 10.0
    w, ids = route(logits, RouterConfig(8, 2, bias=bias))
    assert ids.tolist() == [[1, 5]]
    s1, s5 = softplus_sqrt_f64(0.0), softplus_sqrt_f64(2.0)
    torch.testing.assert_close(w[0], torch.tensor([s1 / (s1 + s5), s5 / (s1 + s5)]), rtol=1e-6, atol=0)
    # without the bias, 5 and then 0 (lowest id among the equal rest)
    _, ids = route(logits, RouterConfig(8, 2))
    assert ids.tolist() == [[5, 0]]


def test_bias_vl_for_image_rows_only():
    lo = 1000
    logits = torch.zeros(7, 8)
    bias = torch.zeros(8)
    bias[0] = 10.0
    bias_vl = torch.zeros(8)
    bias_vl[7] = 5.0  # image rows use bias_vl *instead of* bias: 7 wins there
    cfg = RouterConfig(8, 1, bias=bias, bias_vl=bias_vl, image_sentinel_lo=lo)
    input_ids = torch.tensor([lo - 1, lo, lo + 1, lo + 4, lo + 5, 3, lo + 2])
    w, ids = route(logits, cfg, input_ids)
    assert ids.view(-1).tolist() == [0, 7, 7, 7, 0, 0, 7]
    assert w.view(-1).tolist() == [1.0] * 7  # one expert: its unbiased score / itself
    want_ids, _ = naive_route(logits, 8, 1, bias=bias, bias_vl=bias_vl, lo=lo, input_ids=input_ids)
    assert ids.tolist() == want_ids
    with pytest.raises(ValueError, match="input_ids"):
        route(logits, cfg)
    with pytest.raises(ValueError, match="input_ids"):
        route(logits, cfg, input_ids[:3])
    with pytest.raises(TypeError, match="input_ids"):
        route(logits, cfg, input_ids.float())
    # image_sentinel_lo = 0: no image routing, bias_vl unused
    _, ids = route(logits, RouterConfig(8, 1, bias=bias, bias_vl=bias_vl))
    assert ids.view(-1).tolist() == [0] * 7


def test_hash_routing():
    g = torch.Generator().manual_seed(2)
    table = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(10)]).to(torch.int32)
    cfg = RouterConfig(16, 4, 1.5, hash_table=table)
    logits = torch.randn(5, 16, generator=g)
    input_ids = torch.tensor([3, 0, 9, 3, 7])
    w, ids = route(logits, cfg, input_ids)
    check_outputs(w, ids, 5, 4, 16)
    assert torch.equal(ids, table[input_ids])
    want_ids, want_w = naive_route(logits, 16, 4, 1.5, input_ids=input_ids, hash_table=table.tolist())
    assert ids.tolist() == want_ids
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float32), rtol=2e-6, atol=0)
    for bad in ([10], [-1], [3, 4, 100]):
        with pytest.raises(ValueError, match="hash table"):
            route(logits[: len(bad)], cfg, torch.tensor(bad))
    with pytest.raises(ValueError, match="input_ids"):
        route(logits, cfg)
    w, ids = route(torch.zeros(0, 16), cfg, torch.zeros(0, dtype=torch.int64))
    assert ids.shape == (0, 4) and w.shape == (0, 4) and ids.dtype == torch.int32


def test_zero_rows():
    w, ids = route(torch.zeros(0, 32), RouterConfig(32, 6, 1.5, bias=torch.zeros(32)))
    assert ids.shape == (0, 6) and ids.dtype == torch.int32
    assert w.shape == (0, 6) and w.dtype == torch.float32


def test_router_bad_input():
    cfg = RouterConfig(8, 2)
    with pytest.raises(TypeError, match="logits"):
        route(torch.zeros(2, 8, dtype=torch.float64), cfg)
    with pytest.raises(TypeError, match="logits"):
        route([[0.0] * 8], cfg)
    with pytest.raises(ValueError, match="logits"):
        route(torch.zeros(2, 7), cfg)
    with pytest.raises(ValueError, match="logits"):
        route(torch.zeros(8), cfg)
    with pytest.raises(ValueError, match="experts"):
        RouterConfig(0, 1)
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 0)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        RouterConfig(4, 2, 0.0)
    with pytest.raises(ValueError, match="bias"):
        RouterConfig(4, 2, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="bias_vl"):
        RouterConfig(4, 2, bias_vl=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="hash_table"):
        RouterConfig(4, 2, hash_table=torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="hash_table"):
        RouterConfig(4, 2, hash_table=torch.full((3, 2), 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="image_sentinel_lo"):
        RouterConfig(4, 2, image_sentinel_lo=-1)


def test_hash_table_rows_must_name_distinct_experts():
    # The trace loader refuses a row that repeats an expert; a hash table must too, naming the row and expert.
    table = torch.tensor([[0, 1, 2], [3, 1, 3], [2, 2, 0]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"hash_table row 1 .*repeats expert 3"):
        RouterConfig(4, 3, hash_table=table)
    table[1] = torch.tensor([3, 1, 0])
    with pytest.raises(ValueError, match=r"hash_table row 2 .*repeats expert 2"):
        RouterConfig(4, 3, hash_table=table.to(torch.int32))
    table[2] = torch.tensor([2, 1, 0])
    assert RouterConfig(4, 3, hash_table=table).hash_table is table


# ----------------------------------------------------------------------------- scenarios

GENERATED = [s for s in SCENARIOS if s != "replay"]


def check_ids(ids, rows, top_k, experts):
    assert ids.dtype == torch.int32 and ids.shape == (rows, top_k) and ids.device.type == "cpu"
    assert bool(((ids >= 0) & (ids < experts)).all())
    for r in range(rows):
        assert len(set(ids[r].tolist())) == top_k


@pytest.mark.parametrize("scenario", GENERATED)
@pytest.mark.parametrize("rows, top_k, experts", [(0, 6, 384), (1, 6, 384), (6, 6, 384), (8, 8, 16),
                                                   (8, 1, 1), (3, 4, 4), (8, 6, 256)])  # fmt: skip
def test_scenarios_shape_distinct_in_range(scenario, rows, top_k, experts):
    ids = scenario_topk_ids(scenario, rows, top_k, experts, seed=5)
    check_ids(ids, rows, top_k, experts)
    assert torch.equal(ids, scenario_topk_ids(scenario, rows, top_k, experts, seed=5))


@pytest.mark.parametrize("scenario", GENERATED)
def test_scenarios_seeded(scenario):
    a = scenario_topk_ids(scenario, 8, 6, 384, seed=0)
    b = scenario_topk_ids(scenario, 8, 6, 384, seed=1)
    assert not torch.equal(a, b)


def test_correlated_pool():
    distinct = []
    for seed in range(60):
        ids = scenario_topk_ids("correlated", 6, 6, 384, seed=seed)
        check_ids(ids, 6, 6, 384)
        distinct.append(len(set(ids.flatten().tolist())))
    assert max(distinct) <= 22
    assert sum(distinct) / len(distinct) >= 12
    # uniform routing of the same shape spreads much wider
    uni = [len(set(scenario_topk_ids("uniform", 6, 6, 384, seed=s).flatten().tolist())) for s in range(20)]
    assert min(uni) > 22
    # the pool never exceeds the experts, and a single row is just top_k distinct ids
    check_ids(scenario_topk_ids("correlated", 8, 8, 10, seed=1), 8, 8, 10)
    assert len(set(scenario_topk_ids("correlated", 8, 8, 10, seed=1).flatten().tolist())) <= 10


def test_hot_expert_in_every_row():
    for seed in range(20):
        ids = scenario_topk_ids("hot", 8, 6, 384, seed=seed)
        common = set(ids[0].tolist())
        for r in range(1, 8):
            common &= set(ids[r].tolist())
        assert len(common) >= 1


def test_zipf_is_skewed():
    counts = torch.zeros(384)
    for seed in range(40):
        ids = scenario_topk_ids("zipf", 8, 6, 384, seed=seed)
        # per-seed expert order is random; count the popularity ranks within the call
        c = torch.bincount(ids.flatten().long(), minlength=384)
        counts += c.sort(descending=True).values
    # the most popular expert of a step appears in most rows; uniform would give ~1
    assert counts[0] / 40 >= 4


def test_replay(tmp_path):
    rng = np.random.default_rng(0)
    trace = np.stack([np.stack([rng.permutation(384)[:6] for _ in range(8)]) for _ in range(3)])
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=trace.astype(np.int64))
    ids = scenario_topk_ids("replay", 5, 6, 384, seed=4, trace=path)
    assert ids.dtype == torch.int32 and ids.shape == (5, 6)
    assert ids.tolist() == trace[1, :5].tolist()
    assert scenario_topk_ids("replay", 8, 6, 384, seed=2, trace=str(path)).tolist() == trace[2].tolist()
    assert scenario_topk_ids("replay", 0, 6, 384, trace=path).shape == (0, 6)
    with pytest.raises(ValueError, match="trace"):
        scenario_topk_ids("replay", 9, 6, 384, trace=path)  # more rows than recorded
    with pytest.raises(ValueError, match="trace"):
        scenario_topk_ids("replay", 4, 8, 384, trace=path)  # top_k mismatch
    with pytest.raises(ValueError, match="trace"):
        scenario_topk_ids("replay", 4, 6, 384)


def test_replay_bad_files_name_the_path(tmp_path):
    missing = tmp_path / "missing.npz"
    with pytest.raises(ValueError, match=str(missing)):
        scenario_topk_ids("replay", 1, 6, 384, trace=missing)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not an npz file at all" * 10)
    with pytest.raises(ValueError, match=str(garbage)):
        scenario_topk_ids("replay", 1, 6, 384, trace=garbage)
    good = tmp_path / "good.npz"
    np.savez(good, topk_ids=np.zeros((2, 8, 6), dtype=np.int32))
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match=str(truncated)):
        scenario_topk_ids("replay", 1, 6, 384, trace=truncated)
    flipped = tmp_path / "flipped.npz"  # a damaged member: bad CRC
    data = bytearray(good.read_bytes())
    data[len(data) // 3] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=str(flipped)):
        scenario_topk_ids("replay", 1, 6, 384, trace=flipped)
    wrong_key = tmp_path / "wrong_key.npz"
    np.savez(wrong_key, ids=np.zeros((2, 8, 6), dtype=np.int32))
    with pytest.raises(ValueError, match=str(wrong_key)):
        scenario_topk_ids("replay", 1, 6, 384, trace=wrong_key)
    wrong_shape = tmp_path / "wrong_shape.npz"
    np.savez(wrong_shape, topk_ids=np.zeros((8, 6), dtype=np.int32))
    with pytest.raises(ValueError, match=str(wrong_shape)):
        scenario_topk_ids("replay", 1, 6, 384, trace=wrong_shape)
    floats = tmp_path / "floats.npz"
    np.savez(floats, topk_ids=np.zeros((2, 8, 6), dtype=np.float32))
    with pytest.raises(ValueError, match=str(floats)):
        scenario_topk_ids("replay", 1, 6, 384, trace=floats)
    empty = tmp_path / "empty.npz"
    np.savez(empty, topk_ids=np.zeros((0, 8, 6), dtype=np.int32))
    with pytest.raises(ValueError, match=str(empty)):
        scenario_topk_ids("replay", 1, 6, 384, trace=empty)
    plain = tmp_path / "plain.npy"  # numpy.save: one bare array, not an archive (was a TypeError)
    np.save(plain, np.zeros((2, 8, 6), dtype=np.int64))
    with pytest.raises(ValueError, match="not an .npz archive"):
        scenario_topk_ids("replay", 1, 6, 384, trace=plain)


def test_scenario_bad_input():
    with pytest.raises(ValueError, match="scenario"):
        scenario_topk_ids("bursty", 4, 6, 384)
    with pytest.raises(ValueError, match="rows"):
        scenario_topk_ids("uniform", -1, 6, 384)
    with pytest.raises(ValueError, match="top_k"):
        scenario_topk_ids("uniform", 4, 0, 384)
    with pytest.raises(ValueError, match="top_k"):
        scenario_topk_ids("uniform", 4, 9, 8)


def test_scenario_weights():
    w = scenario_weights(8, 6, seed=3, scale=1.5)
    assert w.dtype == torch.float32 and w.shape == (8, 6)
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(1), torch.full((8,), 1.5), rtol=1e-6, atol=0)
    assert torch.equal(w, scenario_weights(8, 6, seed=3, scale=1.5))
    assert not torch.equal(w, scenario_weights(8, 6, seed=4, scale=1.5))


def test_replay_rejects_ids_outside_the_experts_and_repeats(tmp_path):
    import numpy as np

    far = tmp_path / "far.npz"
    np.savez(far, topk_ids=np.arange(2 * 3 * 2).reshape(2, 3, 2) + 380)
    with pytest.raises(ValueError, match="far.npz.*outside \\[0, 32\\)"):
        scenario_topk_ids("replay", 3, 2, 32, trace=far)
    dup = tmp_path / "dup.npz"
    np.savez(dup, topk_ids=np.zeros((1, 2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="dup.npz.*repeats an expert"):
        scenario_topk_ids("replay", 2, 2, 32, trace=dup)


# ----------------------------------------------------------------------------- misuse at the boundary


def test_router_config_rejects_wrong_field_types():
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        RouterConfig(64, 6, bias=[0.0] * 64)
    with pytest.raises(TypeError, match="hash_table must be a torch.Tensor"):
        RouterConfig(64, 6, hash_table=[[0] * 6])
    with pytest.raises(ValueError, match="experts"):
        RouterConfig(True, 1)
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
        RouterConfig(64, 6, routed_scaling_factor=float("inf"))
    with pytest.raises(ValueError, match="image_sentinel_lo"):
        RouterConfig(64, 6, image_sentinel_lo=1.5)


def test_route_rejects_non_tensor_input_ids():
    config = RouterConfig(64, 6, hash_table=torch.rand(100, 64).argsort(dim=1)[:, :6])  # distinct per row
    with pytest.raises(TypeError, match="input_ids"):
        route(torch.zeros(2, 64), config, [1, 2])


def test_scenarios_reject_bad_sizes_seed_and_scale():
    with pytest.raises(TypeError, match="seed"):
        scenario_topk_ids("uniform", 2, 6, 64, seed=None)
    with pytest.raises(ValueError, match="experts"):
        scenario_topk_ids("uniform", 2, 6, 64.0)
    with pytest.raises(ValueError, match="rows"):
        scenario_weights(-1, 6)
    with pytest.raises(ValueError, match="top_k"):
        scenario_weights(2, 0)
    for scale in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="scale"):
            scenario_weights(2, 6, scale=scale)
