"""The MoE output contract and finalize (moebench.moe_output), against a naive
per-token loop."""

from __future__ import annotations

import pytest
import torch

from moebench.moe_output import (
    DEFAULT_EPS,
    MoEOutput,
    UnfinalizedMoEOutput,
    add_rms_norm,
    convert_flashinfer_moe_output,
    finalize,
    route_major_moe_output,
)


def naive_finalize(rows, weights, idx, scale=1.0, shared=None):
    """out[t] = scale * sum_k w[t,k] * rows[idx[t,k]] (skip -1) + shared[t], in fp64."""
    tokens, top_k = weights.shape
    out = torch.zeros(tokens, rows.shape[1], dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            p = int(idx[t, k])
            if p < 0:
                continue
            out[t] += float(weights[t, k]) * rows[p].double()
    out *= scale
    if shared is not None:
        out += shared.double()
    return out


def make_case(tokens=5, top_k=4, hidden=64, seed=0, dtype=torch.bfloat16, nonlocal_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    permuted_rows = 8 * (tokens * top_k // 8 + 2)
    rows = torch.randn(permuted_rows, hidden, generator=g).to(dtype)
    idx = torch.randperm(permuted_rows, generator=g)[: tokens * top_k].view(tokens, top_k).to(torch.int32)
    drop = torch.rand(tokens, top_k, generator=g) < nonlocal_frac
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    weights = torch.rand(tokens, top_k, generator=g)
    shared = torch.randn(tokens, hidden, generator=g).to(dtype)
    return rows, weights, idx, shared


# ----------------------------------------------------------------------------- UnfinalizedMoEOutput


def test_unfinalized_properties():
    rows, w, idx, _ = make_case()
    u = UnfinalizedMoEOutput(rows, w, idx)
    assert (u.num_tokens, u.top_k, u.hidden) == (5, 4, 64)
    assert u.route_major is False


def test_unfinalized_checks():
    rows, w, idx, _ = make_case()
    with pytest.raises(ValueError, match="int32"):
        UnfinalizedMoEOutput(rows, w, idx.long())
    with pytest.raises(ValueError, match="expert_weights"):
        UnfinalizedMoEOutput(rows, w[:, :3], idx)
    with pytest.raises(ValueError, match="expert_weights"):
        UnfinalizedMoEOutput(rows, w.flatten(), idx.flatten())
    with pytest.raises(ValueError, match="gemm2_permuted"):
        UnfinalizedMoEOutput(rows.flatten(), w, idx)
    wide = torch.zeros(rows.shape[0], 128, dtype=rows.dtype)
    with pytest.raises(ValueError, match="dense"):
        UnfinalizedMoEOutput(wide[:, :64], w, idx)  # row stride 128 != hidden 64
    with pytest.raises(ValueError, match="dense"):
        UnfinalizedMoEOutput(torch.zeros(64, rows.shape[0], dtype=rows.dtype).t(), w, idx)
    with pytest.raises(ValueError, match="device"):
        UnfinalizedMoEOutput(rows.to("meta"), w, idx)
    with pytest.raises(ValueError, match="device"):
        UnfinalizedMoEOutput(rows, w, idx.to("meta"))
    with pytest.raises(TypeError, match="gemm2_permuted"):
        UnfinalizedMoEOutput(rows.tolist(), w, idx)
    with pytest.raises(TypeError, match="expert_weights"):
        UnfinalizedMoEOutput(rows, w.tolist(), idx)


# ----------------------------------------------------------------------------- finalize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finalize_vs_naive(dtype, seed):
    rows, w, idx, shared = make_case(seed=seed, dtype=dtype)
    shared = shared if seed != 2 else None
    u = UnfinalizedMoEOutput(rows, w, idx)
    out = finalize(u, scale=1.5, shared=shared)
    assert out.dtype == dtype and out.shape == (5, 64)
    want = naive_finalize(rows, w, idx, 1.5, shared)
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    # out_dtype
    out32 = finalize(u, scale=1.5, shared=shared, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=1e-6, atol=1e-6)


def test_finalize_skips_nonlocal_and_unreferenced_rows():
    rows, w, idx, _ = make_case(seed=3, dtype=torch.float32, nonlocal_frac=0.4)
    assert bool((idx == -1).any())
    referenced = set(idx[idx >= 0].tolist())
    rows = rows.clone()
    for r in range(rows.shape[0]):
        if r not in referenced:
            rows[r] = float("nan")
    w = torch.where(idx < 0, torch.full_like(w, float("inf")), w)  # never read
    out = finalize(UnfinalizedMoEOutput(rows, w, idx))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_finalize(rows, w, idx), rtol=1e-6, atol=1e-6)
    # row 0 is what a -1 slot would gather if it were read: it must not leak
    rows = torch.randn(16, 8)
    idx = torch.tensor([[1, -1], [-1, -1], [2, 3]], dtype=torch.int32)
    w = torch.rand(3, 2)
    rows[0] = float("nan")
    rows[4:] = float("inf")
    out = finalize(UnfinalizedMoEOutput(rows, w, idx))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_finalize(rows, w, idx), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], torch.zeros(8))
    # a referenced non-finite row stays with its own token
    rows[3] = float("inf")
    out = finalize(UnfinalizedMoEOutput(rows, w, idx))
    assert torch.isfinite(out[:2]).all() and torch.isinf(out[2]).all()
    rows, w, idx, _ = make_case(seed=3, dtype=torch.float32, nonlocal_frac=0.4)
    # a token whose routes are all non-local gets exactly its shared part
    idx2 = idx.clone()
    idx2[1] = -1
    shared = torch.randn(5, 64)
    out = finalize(UnfinalizedMoEOutput(rows, w, idx2), shared=shared, scale=2.0)
    assert torch.equal(out[1], shared[1])


def test_finalize_errors():
    rows, w, idx, shared = make_case()
    idx_bad = idx.clone()
    idx_bad[0, 0] = rows.shape[0]
    with pytest.raises(ValueError, match="row"):
        finalize(UnfinalizedMoEOutput(rows, w, idx_bad))
    with pytest.raises(ValueError, match="shared"):
        finalize(UnfinalizedMoEOutput(rows, w, idx), shared=shared[:, :32])
    with pytest.raises(ValueError):
        finalize(torch.zeros(5))


def test_finalize_of_a_finalized_tensor():
    g = torch.Generator().manual_seed(4)
    routed = torch.randn(3, 32, generator=g)
    shared = torch.randn(3, 32, generator=g)
    out = finalize(routed, scale=2.5, shared=shared)
    torch.testing.assert_close(out, routed * 2.5 + shared)
    assert torch.equal(finalize(routed), routed)


# ----------------------------------------------------------------------------- MoEOutput


def test_moe_output_finalize():
    rows, w, idx, shared = make_case(seed=5, dtype=torch.float32)
    u = UnfinalizedMoEOutput(rows, w, idx)
    m = MoEOutput(u, shared, routed_scaling_factor=2.5)
    torch.testing.assert_close(m.finalize().double(), naive_finalize(rows, w, idx, 2.5, shared), rtol=1e-6, atol=1e-6)
    assert m.finalize(torch.bfloat16).dtype == torch.bfloat16
    dense = naive_finalize(rows, w, idx).float()
    m2 = MoEOutput(dense, shared)
    torch.testing.assert_close(m2.finalize(), dense + shared)
    assert torch.equal(MoEOutput(dense).finalize(), dense)


def test_moe_output_checks():
    rows, w, idx, shared = make_case()
    u = UnfinalizedMoEOutput(rows, w, idx)
    with pytest.raises(ValueError, match="shared_output"):
        MoEOutput(u, shared[:4])
    with pytest.raises(ValueError, match="shared_output"):
        MoEOutput(torch.zeros(5, 64), torch.zeros(5, 63))
    with pytest.raises(TypeError, match="routed"):
        MoEOutput([[0.0]])
    with pytest.raises(ValueError):
        MoEOutput(torch.zeros(5, 4, 64), torch.zeros(5, 64))


# ----------------------------------------------------------------------------- residual add + RMSNorm


def naive_add_rms_norm(x, residual, weight, eps):
    """Per token and element, in Python floats (fp64): new = round(x + res)
    to residual's dtype; inv = 1 / sqrt(sum(new^2) / H + eps); normed =
    round(round(new * inv) * w), each rounding through fp32 to the dtype."""
    dtype = residual.dtype
    tokens, h = x.shape

    def rnd(v: float) -> float:
        return float(torch.tensor(v, dtype=torch.float64).to(torch.float32).to(dtype))

    normed = torch.empty(tokens, h, dtype=dtype)
    new = torch.empty(tokens, h, dtype=dtype)
    for t in range(tokens):
        r = [rnd(float(x[t, j]) + float(residual[t, j])) for j in range(h)]
        inv = 1.0 / (sum(v * v for v in r) / h + eps) ** 0.5
        for j in range(h):
            new[t, j] = r[j]
            normed[t, j] = rnd(rnd(r[j] * inv) * float(weight[j]))
    return normed, new


def norm_case(tokens=3, hidden=256, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to(dtype)
    scales = 2.0 ** torch.randint(-6, 6, (tokens, 1), generator=g)
    residual = (torch.randn(tokens, hidden, generator=g) * scales).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.3 + 1).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps", [1e-6, 1e-3, 0.0])
def test_add_rms_norm_vs_naive(seed, eps):
    x, residual, weight = norm_case(seed=seed)
    normed, new = add_rms_norm(x, residual, weight, eps)
    assert normed.dtype == new.dtype == torch.bfloat16 and normed.shape == new.shape == (3, 256)
    want_normed, want_new = naive_add_rms_norm(x, residual, weight, eps)
    # the new residual is one rounding of an exact sum: the same bits
    assert torch.equal(new.view(torch.int16), want_new.view(torch.int16))
    # fp32 vs fp64 sum of squares: equal but for the rare element whose bf16
    # rounding moves, and then by at most 2^-6 relative (1 ulp of y times w)
    got, want = normed.double(), want_normed.double()
    diff = got != want
    assert int(diff.sum()) <= 4
    assert ((got - want).abs() <= 2.0**-6 * torch.maximum(got.abs(), want.abs())).all()
    # the inputs are not modified (out of place)
    assert torch.equal(residual, norm_case(seed=seed)[1])


def test_add_rms_norm_dtypes_and_special_values():
    x, residual, weight = norm_case(seed=4, dtype=torch.float64)
    normed, new = add_rms_norm(x, residual, weight)
    assert normed.dtype == new.dtype == torch.float64
    torch.testing.assert_close(new, x + residual, rtol=0, atol=0)
    rms = (new.pow(2).mean(-1, keepdim=True) + DEFAULT_EPS).sqrt()
    torch.testing.assert_close(normed, new / rms * weight, rtol=1e-14, atol=1e-14)
    # fp32 residual with bf16 x and weight: fp32 results
    x, residual, weight = norm_case(seed=5)
    normed, new = add_rms_norm(x, residual.float(), weight)
    assert normed.dtype == new.dtype == torch.float32
    # an all-zero row: zeros with eps > 0, NaN with eps 0 (0 * 1/sqrt(0))
    z = torch.zeros(2, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    assert (add_rms_norm(z, z, w, 1e-6)[0] == 0).all()
    assert add_rms_norm(z, z, w, 0.0)[0].isnan().all()


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (dict(x=[[0.0]]), TypeError, "x must be a torch.Tensor"),
        (dict(residual=None), TypeError, "residual must be a torch.Tensor"),
        (dict(norm_weight=(1.0,)), TypeError, "norm_weight must be a torch.Tensor"),
        (dict(x=torch.zeros(3, 256, dtype=torch.int32)), TypeError, "x must be a floating"),
        (dict(residual=torch.zeros(3, 256, dtype=torch.int16)), TypeError, "residual must be a floating"),
        (dict(x=torch.zeros(3, 1, 256)), ValueError, "x must be"),
        (dict(residual=torch.zeros(2, 256)), ValueError, "residual must be"),
        (dict(residual=torch.zeros(256, 3).t()[:, :255]), ValueError, "residual must be"),
        (dict(norm_weight=torch.zeros(255)), ValueError, "norm_weight must be"),
        (dict(norm_weight=torch.zeros(1, 256)), ValueError, "norm_weight must be"),
        (dict(norm_weight=torch.zeros(256, device="meta")), ValueError, "device"),
        (dict(eps="1e-6"), TypeError, "eps"),
        (dict(eps=True), TypeError, "eps"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(eps=float("inf")), ValueError, "eps"),
    ],
)
def test_add_rms_norm_errors(args, exc, match):
    x, residual, weight = norm_case()
    kw = dict(x=x, residual=residual, norm_weight=weight, eps=1e-6)
    kw.update(args)
    with pytest.raises(exc, match=match):
        add_rms_norm(**kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finalize_with_residual_and_norm(dtype):
    rows, w, idx, shared = make_case(seed=6, dtype=dtype)
    _, residual, weight = norm_case(tokens=5, hidden=64, seed=6, dtype=dtype)
    u = UnfinalizedMoEOutput(rows, w, idx)
    normed, new = finalize(u, scale=1.5, shared=shared, residual=residual, norm_weight=weight, eps=1e-5)
    # exactly the composition: finalize (rounded to its dtype), then add_rms_norm
    want = add_rms_norm(finalize(u, scale=1.5, shared=shared), residual, weight, 1e-5)
    assert torch.equal(normed, want[0]) and torch.equal(new, want[1])
    # out_dtype rounds the MoE output before the residual add
    n32, r32 = finalize(u, shared=shared, out_dtype=torch.bfloat16, residual=residual.float(), norm_weight=weight)
    assert n32.dtype == r32.dtype == torch.float32
    moe16 = finalize(u, shared=shared, out_dtype=torch.bfloat16)
    assert torch.equal(r32, moe16.float() + residual.float())
    # MoEOutput.finalize takes the same optional arguments
    m = MoEOutput(u, shared, routed_scaling_factor=1.5)
    mn, mr = m.finalize(residual=residual, norm_weight=weight, eps=1e-5)
    assert torch.equal(mn, normed) and torch.equal(mr, new)
    assert isinstance(m.finalize(), torch.Tensor)
    # a finalized routed tensor takes it too
    dense = finalize(u, scale=1.5)
    dn, dr = MoEOutput(dense, shared).finalize(residual=residual, norm_weight=weight, eps=1e-5)
    dwant = add_rms_norm(finalize(dense, shared=shared), residual, weight, 1e-5)
    assert torch.equal(dn, dwant[0]) and torch.equal(dr, dwant[1])


def test_finalize_norm_argument_errors():
    rows, w, idx, shared = make_case()
    _, residual, weight = norm_case(tokens=5, hidden=64)
    u = UnfinalizedMoEOutput(rows, w, idx)
    m = MoEOutput(u, shared)
    for f in (lambda **kw: finalize(u, **kw), m.finalize):
        with pytest.raises(ValueError, match="norm_weight is required"):
            f(residual=residual)
        with pytest.raises(ValueError, match="residual is required"):
            f(norm_weight=weight)
        with pytest.raises(ValueError, match="residual must be"):
            f(residual=residual[:4], norm_weight=weight)
        with pytest.raises(ValueError, match="norm_weight must be"):
            f(residual=residual, norm_weight=weight[:32])
        with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
            f(residual=residual.tolist(), norm_weight=weight)
        with pytest.raises(ValueError, match="eps"):
            f(residual=residual, norm_weight=weight, eps=-1e-6)
        with pytest.raises(TypeError, match="eps"):
            f(residual=residual, norm_weight=weight, eps=None)


# ----------------------------------------------------------------------------- FlashInfer outputs


def test_convert_flashinfer_finalized():
    out = torch.randn(4, 64)
    assert convert_flashinfer_moe_output(out, do_finalize=True, num_tokens=4, top_k=6) is out
    assert convert_flashinfer_moe_output([out], do_finalize=True, num_tokens=4, top_k=6) is out
    assert convert_flashinfer_moe_output((out,), do_finalize=True, num_tokens=4, top_k=6) is out
    got = convert_flashinfer_moe_output([out], do_finalize=True, num_tokens=4, top_k=6, finalized_output=out)
    assert got is out
    with pytest.raises(ValueError, match="one tensor"):
        convert_flashinfer_moe_output([out, out], do_finalize=True, num_tokens=4, top_k=6)
    with pytest.raises(ValueError, match="one tensor"):
        convert_flashinfer_moe_output([], do_finalize=True, num_tokens=4, top_k=6)
    with pytest.raises(ValueError, match="alias"):
        convert_flashinfer_moe_output(out, do_finalize=True, num_tokens=4, top_k=6,
                                      finalized_output=out.clone())  # fmt: skip
    with pytest.raises(ValueError, match="alias"):
        convert_flashinfer_moe_output(out, do_finalize=True, num_tokens=4, top_k=6,
                                      finalized_output=out.view(8, 32))  # fmt: skip
    with pytest.raises(ValueError, match="alias"):
        convert_flashinfer_moe_output(out, do_finalize=True, num_tokens=4, top_k=6,
                                      finalized_output=out.view(torch.int32))  # fmt: skip


def test_convert_flashinfer_deferred():
    rows, w, idx, shared = make_case(seed=6, dtype=torch.float32)
    u = convert_flashinfer_moe_output([rows, w.flatten(), idx.flatten()], do_finalize=False,
                                      num_tokens=5, top_k=4)  # fmt: skip
    assert isinstance(u, UnfinalizedMoEOutput)
    assert u.expert_weights.shape == (5, 4) and u.expanded_idx_to_permuted_idx.shape == (5, 4)
    assert u.gemm2_permuted is rows
    torch.testing.assert_close(finalize(u, shared=shared).double(), naive_finalize(rows, w, idx, 1.0, shared),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "mutate, kwargs, match",
    [
        (lambda r, w, i: r, {}, "deferred"),  # a bare tensor
        (lambda r, w, i: [r, w], {}, "deferred"),
        (lambda r, w, i: [r, w, i], dict(finalized_output=torch.zeros(5, 64)), "finalized_output"),
        (lambda r, w, i: [r.view(-1, 8, 8), w, i], {}, "2-D"),
        (lambda r, w, i: [r, w, i.long()], {}, "int32"),
        (lambda r, w, i: [r, w[:-1], i], {}, "routing weights"),
        (lambda r, w, i: [r, w, i[:-1]], {}, "permute map"),
        (lambda r, w, i: [r, w.to("meta"), i], {}, "device"),
        (lambda r, w, i: [r, torch.stack([w, w], 1)[:, 0], i], {}, "contiguous"),
        (lambda r, w, i: [r, w, i], dict(num_tokens=-1), "num_tokens"),
        (lambda r, w, i: [r, w, i], dict(top_k=0), "top_k"),
    ],
)
def test_convert_flashinfer_deferred_errors(mutate, kwargs, match):
    rows, w, idx, _ = make_case(seed=7)
    args = dict(do_finalize=False, num_tokens=5, top_k=4) | kwargs
    with pytest.raises(ValueError, match=match):
        convert_flashinfer_moe_output(mutate(rows, w.flatten(), idx.flatten()), **args)


# ----------------------------------------------------------------------------- route-major


@pytest.mark.parametrize("three_d", [True, False])
def test_route_major_with_expert_map(three_d):
    g = torch.Generator().manual_seed(8)
    tokens, top_k, hidden, experts = 4, 3, 32, 16
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    topk_w = torch.rand(tokens, top_k, generator=g)
    routes = torch.randn(tokens, top_k, hidden, generator=g)
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[::2] = torch.arange(experts // 2, dtype=torch.int32)  # even experts are local
    u = route_major_moe_output(routes if three_d else routes.view(-1, hidden), topk_w, topk_ids, expert_map)
    assert u.route_major and u.gemm2_permuted.shape == (tokens * top_k, hidden)
    want_idx = [[t * top_k + k if int(topk_ids[t, k]) % 2 == 0 else -1 for k in range(top_k)]
                for t in range(tokens)]  # fmt: skip
    assert u.expanded_idx_to_permuted_idx.tolist() == want_idx
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            if int(topk_ids[t, k]) % 2 == 0:
                want[t] += float(topk_w[t, k]) * routes[t, k].double()
    torch.testing.assert_close(finalize(u, scale=1.0).double(), want, rtol=1e-6, atol=1e-6)
    # without a map every route is local
    u = route_major_moe_output(routes, topk_w, topk_ids)
    assert u.expanded_idx_to_permuted_idx.view(-1).tolist() == list(range(tokens * top_k))


def test_route_major_errors():
    routes = torch.zeros(4, 3, 32)
    ids = torch.zeros(4, 3, dtype=torch.int32)
    w = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="topk"):
        route_major_moe_output(routes, w[:, :2], ids)
    with pytest.raises(ValueError, match="topk"):
        route_major_moe_output(routes, w.flatten(), ids.flatten())
    with pytest.raises(ValueError, match="routes"):
        route_major_moe_output(torch.zeros(11, 32), w, ids)
    with pytest.raises(ValueError, match="routes"):
        route_major_moe_output(torch.zeros(4, 2, 32), w, ids)
    # [tokens, hidden]: tokens rows only, not tokens*top_k
    with pytest.raises(ValueError, match="routes"):
        route_major_moe_output(torch.zeros(4, 96), w, ids)


# ----------------------------------------------------------------------------- misuse at the boundary


def test_finalize_names_non_tensor_arguments_and_bad_out_dtype():
    from moebench.moe_output import MoEOutput

    rows = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="routed"):
        finalize([1.0])
    with pytest.raises(TypeError, match="shared"):
        finalize(rows, shared=[1.0])
    with pytest.raises(TypeError, match="shared_output"):
        MoEOutput(rows, shared_output=[1.0])
    with pytest.raises(TypeError, match="out_dtype"):
        finalize(rows, out_dtype="float32")
    with pytest.raises(TypeError, match="out_dtype"):
        finalize(rows, out_dtype=torch.int32)


def test_finalize_rejects_permute_indices_below_minus_one():
    rows = torch.randn(16, 64)
    idx = torch.arange(12, dtype=torch.int32).view(2, 6)
    idx[0, 0] = -3
    with pytest.raises(ValueError, match="only -1"):
        finalize(UnfinalizedMoEOutput(rows, torch.rand(2, 6), idx))


def test_route_major_checks_ids_against_the_expert_map():
    from moebench.moe_output import route_major_moe_output

    w = torch.rand(2, 6)
    with pytest.raises(TypeError, match="topk_ids"):
        route_major_moe_output(torch.zeros(12, 64), w, [[0] * 6] * 2)
    with pytest.raises(TypeError, match="integer"):
        route_major_moe_output(torch.zeros(12, 64), w, torch.zeros(2, 6))
    with pytest.raises(ValueError, match="expert_map"):
        route_major_moe_output(torch.zeros(12, 64), w, torch.full((2, 6), 100), torch.arange(64))


def test_convert_deferred_rejects_non_tensors():
    from moebench.moe_output import convert_flashinfer_moe_output

    with pytest.raises(ValueError, match="must be a tensor"):
        convert_flashinfer_moe_output([1, 2, 3], do_finalize=False, num_tokens=2, top_k=6)
