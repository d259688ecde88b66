"""The numerics oracle (moebench.reference) against a naive per-token loop
written here, on tiny shapes with intermediate padding."""

from __future__ import annotations

import math

import pytest
import torch

from moebench.formats import (
    ExpertWeights,
    dequantize_mxfp4,
    dequantize_mxfp8,
    generate_activations,
    generate_expert_weights,
    quantize_mxfp8,
)
from moebench.models import get_preset
from moebench.record import build_route_record
from moebench.reference import reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights

E, TOP_K, H = 16, 4, 256


@pytest.fixture(scope="module")
def weights() -> ExpertWeights:
    # I = 192 at TP2: 96 per rank, padded to 128
    shape = get_preset("dsv4-flash", hidden=H, intermediate=192, experts=E, top_k=TOP_K).shard(2)
    w = generate_expert_weights(shape, seed=11)
    assert (w.intermediate, w.padded_intermediate) == (96, 128)
    # alternate a loose and a tight SwiGLU limit, so that the clamp really acts
    clamp = torch.tensor([10.0 if e % 2 == 0 else 0.05 for e in range(E)], dtype=torch.float32)
    return ExpertWeights(w.w13, w.w13_scale, w.w2, w.w2_scale, clamp, intermediate=w.intermediate)


@pytest.fixture(scope="module")
def dequantized(weights):
    # the whole padded weights, dequantized independently of the oracle's slicing
    return (
        dequantize_mxfp4(weights.w13, weights.w13_scale, torch.float64),
        dequantize_mxfp4(weights.w2, weights.w2_scale, torch.float64),
    )


def fp8_per_token(v: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 fake quantization with s = amax/448 (fp32), zero rows stay zero."""
    v = v.to(torch.float32)
    s = v.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return ((v / s).to(torch.float8_e4m3fn).to(torch.float32) * s).double()


def naive_moe(x, topk_ids, topk_w, weights, dequantized, activation, scale=1.0, shared=None):
    """Per token, per k: SwiGLU with clamp, H in the activation's format, GEMM2,
    weighted sum. Returns (output fp64, {(t, k): h before H quantization [I]}, clamp hits)."""
    w13, w2 = dequantized
    ip, i = weights.padded_intermediate, weights.intermediate
    if activation == "mxfp8":
        xv = dequantize_mxfp8(*quantize_mxfp8(x), dtype=torch.float64)
    elif activation == "bf16":
        xv = x.double()
    else:
        xv = fp8_per_token(x)
    rows = x.shape[0]
    out = torch.zeros(rows, x.shape[1], dtype=torch.float64)
    hs, clamp_hits = {}, 0
    for t in range(rows):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if not 0 <= e < weights.experts:
                continue
            gate = (w13[e, :ip] * xv[t]).sum(-1)
            up = (w13[e, ip:] * xv[t]).sum(-1)
            lim = float(weights.clamp[e])
            clamp_hits += int((gate > lim).sum()) + int((up.abs() > lim).sum())
            g = torch.where(gate > lim, torch.full_like(gate, lim), gate)
            u = torch.where(up > lim, torch.full_like(up, lim), torch.where(up < -lim, torch.full_like(up, -lim), up))
            h = g / (1 + torch.exp(-g)) * u  # silu(g) * u over the padded I (padding stays 0)
            assert int(h[i:].count_nonzero()) == 0
            hs[(t, k)] = h[:i]
            if activation == "mxfp8":
                h = dequantize_mxfp8(*quantize_mxfp8(h), dtype=torch.float64)
            elif activation == "fp8_token":
                h = fp8_per_token(h.unsqueeze(0))[0]
            y = (w2[e] * h).sum(-1)
            out[t] += float(topk_w[t, k]) * y
    out *= scale
    if shared is not None:
        out += shared.double()
    return out, hs, clamp_hits


def make_inputs(rows: int, seed: int, nonlocal_ids: bool = True):
    x = generate_activations(rows, H, seed=seed)
    ids = scenario_topk_ids("uniform", rows, TOP_K, E, seed=seed).to(torch.int64)
    if nonlocal_ids and rows:
        ids[0, -1] = -1  # an expert on another rank
        if rows > 2:
            ids[2, 1] = E + 3  # outside [0, E): also non-local
    w = scenario_weights(rows, TOP_K, seed=seed, scale=1.5)
    return x, ids, w


@pytest.mark.parametrize("activation", ["mxfp8", "bf16", "fp8_token"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_reference_vs_naive(weights, dequantized, activation, rows):
    x, ids, w = make_inputs(rows, seed=rows)
    shared = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    res = reference_moe(x, ids, w, weights, activation=activation, scale=1.25, shared=shared)
    want, hs, clamp_hits = naive_moe(x, ids, w, weights, dequantized, activation, 1.25, shared)
    assert res.output.dtype == torch.float64 and res.output.shape == (rows, H)
    assert clamp_hits > 0  # the clamp path is exercised
    assert relative_error(res.output, want) < 1e-9
    # structure of the result
    route = build_route_record(ids, E)
    assert torch.equal(res.route.record, route.record) and torch.equal(res.route.permuted, route.permuted)
    assert torch.equal(res.unfinalized.expanded_idx_to_permuted_idx, route.permuted)
    assert res.unfinalized.gemm2_permuted.shape == (8 * route.ctas, H)
    if activation == "mxfp8":
        assert torch.equal(res.x_values, dequantize_mxfp8(*quantize_mxfp8(x), dtype=torch.float64))
        assert res.h_values.dtype == torch.float8_e4m3fn and res.h_values.shape == (8 * route.ctas, 96)
        assert res.h_scale.dtype == torch.uint8 and res.h_scale.shape == (8 * route.ctas, 3)
        # H bytes of each local route equal the MXFP8 quantization of the naive h
        for (t, k), h in hs.items():
            p = int(route.permuted[t, k])
            hv, hsc = quantize_mxfp8(h)
            assert torch.equal(res.h_values[p].view(torch.uint8), hv.view(torch.uint8)), (t, k)
            assert torch.equal(res.h_scale[p], hsc), (t, k)
        # padding rows and unused tiles hold zeros
        used = {int(p) for p in route.permuted.flatten() if p >= 0}
        for r in range(8 * route.ctas):
            if r not in used:
                assert int(res.h_values[r].view(torch.uint8).count_nonzero()) == 0
                assert int(res.unfinalized.gemm2_permuted[r].count_nonzero()) == 0
    else:
        assert res.h_values is None and res.h_scale is None


def test_reference_all_nonlocal_and_zero_rows(weights):
    x, ids, w = make_inputs(2, seed=5, nonlocal_ids=False)
    ids[:] = -1
    shared = torch.randn(2, H).to(torch.bfloat16)
    res = reference_moe(x, ids, w, weights, shared=shared)
    assert torch.equal(res.output, shared.double())
    res = reference_moe(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, TOP_K, dtype=torch.int32),
                        torch.zeros(0, TOP_K), weights)  # fmt: skip
    assert res.output.shape == (0, H)


@pytest.mark.parametrize("activation", ["bf16", "mxfp8", "fp8_token"])
def test_fp32_vs_fp64_oracle(weights, activation):
    x, ids, w = make_inputs(8, seed=21)
    r64 = reference_moe(x, ids, w, weights, activation=activation)
    r32 = reference_moe(x, ids, w, weights, activation=activation, dtype=torch.float32)
    assert r32.output.dtype == torch.float32
    assert relative_error(r32.output, r64.output) < 1e-5


def test_activation_families_differ_plausibly(weights):
    x, ids, w = make_inputs(8, seed=31)
    out = {a: reference_moe(x, ids, w, weights, activation=a).output for a in ("mxfp8", "bf16", "fp8_token")}
    for a, b in (("mxfp8", "bf16"), ("fp8_token", "bf16"), ("mxfp8", "fp8_token")):
        err = relative_error(out[a], out[b])
        assert 1e-3 < err < 0.1, (a, b, err)


def test_relative_error_semantics():
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    assert relative_error(o, o) == 0.0
    assert relative_error(o * (1 + 1e-3), o) == pytest.approx(1e-3, rel=1e-9)
    assert relative_error((o * 1.01).float(), o) == pytest.approx(1e-2, rel=1e-6)
    nan = o.clone()
    nan[0, 1] = math.nan
    assert relative_error(nan, o) == math.inf
    inf = o.clone()
    inf[1, 0] = -math.inf
    assert relative_error(inf, o) == math.inf
    # a NaN in the oracle is not held against the output at that position
    assert relative_error(o, nan) == 0.0
    assert relative_error(nan, nan) == 0.0
    # all-zero oracle: the absolute norm
    assert relative_error(torch.tensor([3.0, 4.0]), torch.zeros(2)) == pytest.approx(5.0)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    with pytest.raises(ValueError, match="shape"):
        relative_error(o, o[:1])


def test_reference_bad_input(weights):
    x, ids, w = make_inputs(3, seed=1)
    with pytest.raises(TypeError, match="x"):
        reference_moe(x.float(), ids, w, weights)
    with pytest.raises(ValueError, match="x"):
        reference_moe(x[:, :128], ids, w, weights)
    with pytest.raises(ValueError, match="x"):
        reference_moe(x[0], ids, w, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        reference_moe(x, ids[:2], w[:2], weights)
    with pytest.raises(ValueError, match="topk_weights"):
        reference_moe(x, ids, w[:, :2], weights)
    with pytest.raises(TypeError, match="topk_ids"):
        reference_moe(x, ids.float(), w, weights)
    with pytest.raises(ValueError, match="activation"):
        reference_moe(x, ids, w, weights, activation="fp4")
    with pytest.raises(ValueError, match="on"):
        reference_moe(x, ids, w, weights.to("meta"))


def test_reference_moe_names_bad_arguments():
    shape = get_preset("dsv4-flash", hidden=256, intermediate=256, experts=8).shard(2)
    w = generate_expert_weights(shape, seed=1)
    x = generate_activations(2, 256)
    ids = scenario_topk_ids("uniform", 2, 6, 8)
    tw = scenario_weights(2, 6)
    with pytest.raises(TypeError, match="weights must be an ExpertWeights"):
        reference_moe(x, ids, tw, None)
    with pytest.raises(TypeError, match="topk_ids"):
        reference_moe(x, ids.tolist(), tw, w)
    with pytest.raises(TypeError, match="topk_weights must be a floating"):
        reference_moe(x, ids, tw.to(torch.int32), w)  # would truncate every weight to 0
    with pytest.raises(TypeError, match="shared"):
        reference_moe(x, ids, tw, w, shared=[0.0])
    with pytest.raises(TypeError, match="dtype"):
        reference_moe(x, ids, tw, w, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_weights is on meta"):
        reference_moe(x, ids, tw.to("meta"), w)
    with pytest.raises(TypeError, match="out"):
        relative_error([1.0], torch.zeros(1))


def test_row_relative_errors_semantics():
    """Per row ||out - oracle|| / ||oracle||; a zero oracle row is judged
    against the RMS row norm of the whole oracle (it must be ~zero); NaN or
    Inf where the oracle is finite is inf; the oracle's own NaNs are not
    held against the output."""
    from moebench.reference import max_row_relative_error, row_relative_errors

    o = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 0.0]], dtype=torch.float64)
    assert row_relative_errors(o, o).tolist() == [0.0, 0.0, 0.0]
    off = o.clone()
    off[0] *= 1.1
    off[2] = torch.tensor([0.3, 0.4])  # norm 0.5 where the oracle row is zero
    rms = math.sqrt((25.0 + 100.0 + 0.0) / 3)
    got = row_relative_errors(off, o)
    assert got[0].item() == pytest.approx(0.1) and got[1].item() == 0.0
    assert got[2].item() == pytest.approx(0.5 / rms)
    assert max_row_relative_error(off, o) == pytest.approx(0.1)
    nan = o.clone()
    nan[1, 0] = math.nan
    assert row_relative_errors(nan, o)[1].item() == math.inf and max_row_relative_error(nan, o) == math.inf
    assert row_relative_errors(o, nan)[1].item() == 0.0  # the oracle's NaN position is skipped
    # an all-zero oracle: absolute norms; a 1-D tensor is one row; rows of [..., H]
    assert row_relative_errors(torch.tensor([3.0, 4.0]), torch.zeros(2)).tolist() == [5.0]
    assert tuple(row_relative_errors(torch.ones(2, 3, 4), torch.ones(2, 3, 4)).shape) == (6,)
    with pytest.raises(ValueError, match="shape"):
        row_relative_errors(o, o[:1])
    with pytest.raises(ValueError, match="dimension"):
        row_relative_errors(torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(TypeError, match="oracle"):
        row_relative_errors(o, o.tolist())


def test_the_gate_catches_a_few_zeroed_rows_the_norm_hides(weights):
    """A real output with two of its rows zeroed: the whole-output error
    stays within the 1e-2 tolerance (those rows are small), each of them is
    off by 100 %: the gate fails naming the rows. The BF16-rounded output of
    the same oracle passes."""
    from moebench.reference import ROW_TOLERANCE_FACTOR, oracle_gate

    x, ids, w = make_inputs(8, seed=41)
    w = w.clone()
    w[:2] *= 1e-3  # two rows carry a thousandth of the others' routed weight
    oracle = reference_moe(x, ids, w, weights, activation="bf16").output
    rounded = oracle.to(torch.bfloat16)
    err, row_err, why = oracle_gate(rounded, oracle, 1e-2)
    assert why is None and 0 < err < 1e-2 and 0 < row_err < 1e-2
    broken = rounded.clone()
    broken[:2] = 0
    assert relative_error(broken, oracle) < 1e-2  # the whole-output norm alone would pass it
    err, row_err, why = oracle_gate(broken, oracle, 1e-2)
    assert row_err == pytest.approx(1.0) and why is not None
    assert "2 row(s) off" in why and f"{ROW_TOLERANCE_FACTOR * 1e-2:g}" in why
    nan = rounded.clone()
    nan[5, 7] = math.nan
    assert oracle_gate(nan, oracle, 1e-2)[2] is not None  # NaN never passes
    with pytest.raises(ValueError, match="tolerance"):
        oracle_gate(rounded, oracle, 0.0)


def test_the_gate_passes_a_real_backends_rounding():
    """torch-bf16 (dequantized BF16 weights, BF16 H) and the fp32 reference
    backend pass the stricter gate against their oracles at every row."""
    from moebench.backends.reference import ReferenceBackend
    from moebench.backends.torch_bf16 import TorchBF16Backend
    from moebench.reference import oracle_gate

    shape = get_preset("dsv4-flash", hidden=256, intermediate=256, experts=8, top_k=4).shard(2)
    w = generate_expert_weights(shape, seed=5)
    for rows in (1, 5, 8):
        x = generate_activations(rows, 256, seed=rows)
        ids = scenario_topk_ids("uniform", rows, 4, 8, seed=rows).to(torch.int32)
        tw = scenario_weights(rows, 4, seed=rows)
        for backend in (TorchBF16Backend(), ReferenceBackend()):
            out = backend.forward(backend.prepare(w, shape), x, ids, tw)
            oracle = reference_moe(x, ids, tw, w, activation=backend.oracle).output
            err, row_err, why = oracle_gate(out, oracle, backend.tolerance)
            assert why is None, (backend.name, rows, why)
            assert row_err < backend.tolerance, (backend.name, rows, row_err)
