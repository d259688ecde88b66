"""The route kernel (moebench/kernels/route.py): sm_90a compile checks and
host validation on the CPU; on the GPU, bit-exactness against the torch
builder record.build_route_record over many routings, and CUDA-graph capture."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from kernel_checks import (
    assert_guards_intact,
    assert_pdl_order,
    assert_sass_without_spills,
    compile_sm90a,
    guarded,
    sass_instructions,
)

from moebench.kernels.route import launch_route, route
from moebench.record import build_route_record, max_ctas, route_words

POISON = 0x7FFFFFFF
GUARD = 8  # poisoned guard words on each side of every output buffer

# --------------------------------------------------------------------------- CPU: compile


def _compile_sass(
    pdl: bool, threads: int = 128, keys_per_step: int = 16, quantize=False, deq=False, inputs_ready=False
) -> str:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Uint8
    from cutlass.cute.runtime import make_ptr

    from moebench.kernels.route import RouteKernel

    def fake(dtype=Int32, align=4):
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)

    kernel = RouteKernel(
        pdl=pdl, threads=threads, keys_per_step=keys_per_step, quantize=quantize, deq=deq, inputs_ready=inputs_ready
    )
    sass, _ = compile_sm90a(kernel, fake(), fake(), fake(), Int32(1), Int32(1), Int32(1),
                            fake(BFloat16, 16), fake(Uint8, 16), fake(Uint8, 16), fake(BFloat16, 16), Int32(4),
                            cuda.CUstream(0))  # fmt: skip
    return sass


@pytest.mark.compile
@pytest.mark.parametrize(
    "pdl, threads, keys_per_step, quantize, deq",
    [
        (True, 128, 16, False, False),
        (False, 128, 16, False, False),
        (True, 64, 16, False, False),
        (True, 128, 4, False, False),
        (True, 128, 32, False, False),
        (True, 128, 16, True, False),
        (False, 128, 16, True, False),
        (True, 128, 16, True, True),
    ],
)
def test_compiles_for_sm90a_without_spills(pdl, threads, keys_per_step, quantize, deq):
    sass = _compile_sass(pdl, threads, keys_per_step, quantize, deq)
    instr = sass_instructions(sass)
    text = assert_sass_without_spills(instr, "route")
    assert len(re.findall(r"\bBAR\.SYNC", text)) == 2
    # the fast path: row mask and used-expert bit (shared atomics), then one OR-reducing barrier
    assert len(re.findall(r"\bATOMS\.OR\b", text)) == 2
    assert len(re.findall(r"\bBAR\.RED\.OR\b", text)) == 1
    assert_pdl_order(instr, pdl)
    # the fused quantization: the quantize kernel's 16-byte loads / stores and e4m3 conversions
    assert len(re.findall(r"\bLDG\.E\.128\b", text)) == (4 if quantize else 0)
    assert len(re.findall(r"\bSTG\.E\.128\b", text)) == ((6 if deq else 2) if quantize else 0)
    assert len(re.findall(r"F2FP\.SATFINITE\.E4M3\.F32", text)) == (16 if quantize else 0)


@pytest.mark.compile
def test_inputs_ready_reads_before_the_wait_and_writes_after_it():
    """inputs_ready: the ids and x loads come before griddepcontrol.wait
    (ACQBULK), every global store after it; no spills."""
    instr = sass_instructions(_compile_sass(True, quantize=True, deq=True, inputs_ready=True))
    text = assert_sass_without_spills(instr, "route")
    assert text.count("ACQBULK") == 2 and "PREEXIT" in text  # CTA 0's wait and the quantizers'
    first_wait = instr.index("ACQBULK")
    first_load = min(i for i, s in enumerate(instr) if re.search(r"\bLDG\.", s))
    first_store = min(i for i, s in enumerate(instr) if re.search(r"\bSTG\.", s))
    assert first_load < first_wait < first_store
    assert len(re.findall(r"\bLDG\.E\.128\b", text)) == 4


@pytest.mark.compile
def test_compile_route_kernel_is_cached():
    from moebench.kernels.route import compile_route_kernel

    assert compile_route_kernel(True) is compile_route_kernel(True)
    assert compile_route_kernel(False) is not compile_route_kernel(True)
    assert compile_route_kernel(True, quantize=True) is not compile_route_kernel(True)
    with pytest.raises(TypeError, match="quantize"):
        compile_route_kernel(True, quantize=1)
    with pytest.raises(ValueError, match="deq=True needs quantize"):
        compile_route_kernel(True, deq=True)
    with pytest.raises(TypeError, match="pdl"):
        compile_route_kernel(1)
    with pytest.raises(ValueError, match="keys_per_step"):
        compile_route_kernel(True, 12)


@pytest.mark.compile
def test_route_kernel_config_and_can_implement():
    from moebench.kernels.route import RouteKernel

    for bad in (32, 48, 96 + 1, 2048, True):
        with pytest.raises(ValueError, match="threads"):
            RouteKernel(threads=bad)
    with pytest.raises(TypeError, match="pdl"):
        RouteKernel(pdl="yes")
    for bad in (0, 3, 12, 64, True, 16.0):
        with pytest.raises(ValueError, match="keys_per_step"):
            RouteKernel(keys_per_step=bad)
    assert RouteKernel.can_implement(8, 8, 512) == (True, "")
    assert RouteKernel.can_implement(0, 1, 1) == (True, "")
    for args, name in (
        ((9, 6, 384), "rows"),
        ((6, 0, 384), "top_k"),
        ((6, 9, 384), "top_k"),
        ((6, 6, 0), "experts"),
        ((6, 6, 513), "experts"),
        ((6.0, 6, 384), "rows"),
    ):
        ok, why = RouteKernel.can_implement(*args)
        assert not ok and name in why


# --------------------------------------------------------------------------- CPU: validation


def _bufs(rows, top_k, experts, device="cpu"):
    ids = torch.zeros(rows, top_k, dtype=torch.int32, device=device)
    rec = torch.empty(route_words(max_ctas(rows, top_k, experts)), dtype=torch.int32, device=device)
    perm = torch.empty(rows, top_k, dtype=torch.int32, device=device)
    return ids, rec, perm


@pytest.mark.parametrize(
    "mutate, exc, name",
    [
        (lambda a: a.update(topk_ids=[[0]]), TypeError, "topk_ids"),
        (lambda a: a.update(topk_ids=a["topk_ids"].long()), TypeError, "topk_ids"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "topk_ids"),
        (lambda a: a.update(topk_ids=a["topk_ids"][None]), ValueError, "topk_ids"),
        (lambda a: a.update(topk_ids=torch.zeros(9, 6, dtype=torch.int32)), ValueError, "rows"),
        (lambda a: a.update(topk_ids=torch.zeros(6, 9, dtype=torch.int32)), ValueError, "top_k"),
        (
            lambda a: a.update(topk_ids=torch.zeros(6, 12, dtype=torch.int32)[:, ::2]),
            ValueError,
            "topk_ids must be contiguous",
        ),
        (lambda a: a.update(experts=0), ValueError, "experts"),
        (lambda a: a.update(experts=513), ValueError, "experts"),
        (lambda a: a.update(experts=384.0), TypeError, "experts"),
        (lambda a: a.update(experts=True), TypeError, "experts must be an int"),
        (lambda a: a.update(experts="8"), TypeError, "experts"),
        (lambda a: a.update(record_out=None), TypeError, "record_out"),
        (lambda a: a.update(record_out=a["record_out"].long()), TypeError, "record_out"),
        (lambda a: a.update(record_out=a["record_out"][1:]), ValueError, "record_out"),
        (lambda a: a.update(record_out=a["record_out"].view(2, -1)), ValueError, "record_out"),
        (
            lambda a: a.update(record_out=torch.empty(2 * a["record_out"].numel(), dtype=torch.int32)[::2]),
            ValueError,
            "record_out must be contiguous",
        ),
        (lambda a: a.update(permuted_out=a["permuted_out"].t()), ValueError, "permuted_out"),
        (lambda a: a.update(permuted_out=a["permuted_out"].short()), TypeError, "permuted_out"),
        (lambda a: a.update(permuted_out=a["permuted_out"][:5]), ValueError, "permuted_out"),
        (lambda a: a.update(pdl=1), TypeError, "pdl"),
        (lambda a: a.update(keys_per_step=5), ValueError, "keys_per_step"),
        (lambda a: None, ValueError, "CUDA"),  # everything right, but on the CPU
    ],
)
def test_launch_route_validates(mutate, exc, name):
    ids, rec, perm = _bufs(6, 6, 384)
    args = dict(topk_ids=ids, record_out=rec, permuted_out=perm, experts=384)
    mutate(args)
    with pytest.raises(exc, match=name):
        launch_route(**args)


def test_route_validates():
    with pytest.raises(TypeError, match="topk_ids"):
        route(torch.zeros(2, 2), 8)
    with pytest.raises(ValueError, match="experts"):
        route(torch.zeros(2, 2, dtype=torch.int32), 1000)
    with pytest.raises(ValueError, match="CUDA"):
        route(torch.zeros(2, 2, dtype=torch.int32), 8)


# --------------------------------------------------------------------------- GPU


def _routings(rows, top_k, experts, gen):
    """(name, int32 [rows, top_k]) routings of one shape, on the CPU."""

    def distinct(n):  # n distinct local ids (n <= experts)
        return torch.randperm(experts, generator=gen)[:n]

    def ints(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=gen)

    out = []
    if top_k <= experts:
        out.append(
            (
                "uniform",
                torch.stack([distinct(top_k) for _ in range(rows)])
                if rows
                else torch.empty(0, top_k, dtype=torch.int64),
            )
        )
        hot = ints(0, experts, ()).item()
        rows_h = []
        for _ in range(rows):
            others = [e for e in distinct(min(top_k + 1, experts)).tolist() if e != hot][: top_k - 1]
            row = [hot] + others
            perm = torch.randperm(top_k, generator=gen).tolist()
            rows_h.append([row[p] for p in perm])
        out.append(("hot", torch.tensor(rows_h, dtype=torch.int64).view(rows, top_k)))
    out.append(("one-expert", torch.full((rows, top_k), ints(0, experts, ()).item())))
    out.append(("replacement", ints(0, experts, (rows, top_k))))
    pool = distinct(min(3, experts))
    out.append(("pool-of-3", pool[ints(0, len(pool), (rows, top_k))]))
    # non-local ids mixed in: -1, other negatives, >= experts, int32 extremes
    nonlocal_ids = torch.tensor([-1, -1, -2, experts, experts + 1, 4096, 2**31 - 1, -(2**31)])
    mixed = ints(0, experts, (rows, top_k))
    mask = ints(0, 3, (rows, top_k)) == 0
    mixed[mask] = nonlocal_ids[ints(0, len(nonlocal_ids), (int(mask.sum()),))]
    out.append(("mixed-nonlocal", mixed))
    out.append(("all-nonlocal", torch.full((rows, top_k), -1)))
    # a router's rows (distinct ids: the fast path) with non-local slots mixed in
    if top_k <= experts:
        sparse = torch.stack([distinct(top_k) for _ in range(rows)]) if rows else torch.empty(0, top_k)
        sparse = sparse.to(torch.int64)
        drop = ints(0, 3, (rows, top_k)) == 0
        sparse[drop] = nonlocal_ids[ints(0, len(nonlocal_ids), (int(drop.sum()),))]
        out.append(("distinct-nonlocal", sparse))
    out.append(("edges", torch.tensor([0, experts - 1])[ints(0, 2, (rows, top_k))]))
    return [(n, t.to(torch.int32).view(rows, top_k)) for n, t in out]


def _guarded(n, device):
    """A poisoned int32 buffer with GUARD words before and after a view of n words."""
    return guarded(n, POISON, torch.int32, GUARD, device)


def _check(ids_cpu, experts, *, pdl=True, keys_per_step=16, what=""):
    """Launch on poisoned, guarded buffers and compare every word with the builder."""
    rows, top_k = ids_cpu.shape
    dev = torch.device("cuda")
    want = build_route_record(ids_cpu, experts)
    ids_buf, ids = _guarded(rows * top_k, dev)
    ids.copy_(ids_cpu.flatten())
    rec_buf, rec = _guarded(route_words(want.ctas), dev)
    perm_buf, perm = _guarded(rows * top_k, dev)
    launch_route(ids.view(rows, top_k), rec, perm.view(rows, top_k), experts, pdl=pdl, keys_per_step=keys_per_step)
    torch.cuda.synchronize()
    ctx = f"{what} rows={rows} top_k={top_k} experts={experts} ids={ids_cpu.tolist()}"
    assert torch.equal(rec.cpu(), want.record), (
        f"record differs: {ctx}\n got {rec.cpu().tolist()}\nwant {want.record.tolist()}"
    )
    assert torch.equal(perm.cpu().view(rows, top_k), want.permuted), f"permuted differs: {ctx}"
    for name, buf, n in (("record", rec_buf, rec.numel()), ("permuted", perm_buf, perm.numel())):
        assert_guards_intact(buf, GUARD, n, POISON, f"{name} written out of bounds: {ctx}")
    assert torch.equal(ids.cpu(), ids_cpu.flatten()), f"ids modified: {ctx}"
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [1, 5, 32, 33, 256, 384, 512])
def test_route_bit_exact(experts):
    gen = torch.Generator().manual_seed(1000 + experts)
    checked = 0
    for rows, top_k in itertools.product(range(0, 9), range(1, 9)):
        for seed in range(2):
            for name, ids in _routings(rows, top_k, experts, gen):
                _check(ids, experts, what=f"{name}#{seed}")
                checked += 1
    assert checked > 0


@pytest.mark.gpu
@pytest.mark.parametrize("keys_per_step", [4, 8, 32])
def test_route_bit_exact_other_steps(keys_per_step):
    gen = torch.Generator().manual_seed(2000 + keys_per_step)
    for experts in (33, 384):
        for rows, top_k in itertools.product(range(0, 9), range(1, 9)):
            for name, ids in _routings(rows, top_k, experts, gen):
                _check(ids, experts, keys_per_step=keys_per_step, what=name)


@pytest.mark.gpu
def test_route_tiles_of_one_expert_and_full_table():
    # 64 slots of one expert: 8 full tiles; 64 distinct experts: 64 one-row tiles
    want = _check(torch.full((8, 8), 7, dtype=torch.int32), 384, what="8 tiles of expert 7")
    assert want.tiles_used == 8 and (want.tile_valid_rows[:8] == 8).all()
    want = _check(torch.arange(64, dtype=torch.int32).flip(0).view(8, 8) * 8, 512, what="64 experts")
    assert want.tiles_used == 64 == want.ctas
    # 9 slots of one expert: a full tile and a tile of one row
    ids = torch.full((3, 3), -1, dtype=torch.int32)
    ids.view(-1)[:] = 3
    want = _check(ids, 4, what="9 slots of expert 3")
    assert want.tile_valid_rows[:2].tolist() == [8, 1]


@pytest.mark.gpu
def test_route_without_pdl_and_on_a_stream():
    gen = torch.Generator().manual_seed(7)
    for rows, top_k in ((1, 6), (6, 6), (8, 8)):
        for name, ids in _routings(rows, top_k, 384, gen):
            _check(ids, 384, pdl=False, what=f"no-PDL {name}")
    ids = torch.randint(-1, 256, (6, 6), generator=gen, dtype=torch.int32)
    want = build_route_record(ids, 256)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ids_d = ids.cuda()
        rec = torch.full((route_words(want.ctas),), POISON, dtype=torch.int32, device="cuda")
        perm = torch.full((6, 6), POISON, dtype=torch.int32, device="cuda")
    launch_route(ids_d, rec, perm, 256, stream=s)
    s.synchronize()
    assert torch.equal(rec.cpu(), want.record) and torch.equal(perm.cpu(), want.permuted)
    with pytest.raises(TypeError, match="stream"):
        launch_route(ids_d, rec, perm, 256, stream=0)


@pytest.mark.gpu
def test_route_convenience_int64():
    ids = torch.tensor([[3, 2**40 + 3, -5, 383], [3, 384, -(2**40), 0]], dtype=torch.int64)
    got = route(ids.cuda(), 384)
    torch.cuda.synchronize()
    want = build_route_record(ids, 384)  # 2**40 + 3 is non-local, not expert 3
    assert got.ctas == want.ctas
    assert torch.equal(got.record.cpu(), want.record)
    assert torch.equal(got.permuted.cpu(), want.permuted)


@pytest.mark.gpu
def test_route_cuda_graph_capture_and_replay():
    rows, top_k, experts = 6, 6, 384
    gen = torch.Generator().manual_seed(11)
    first = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    second = torch.full((rows, top_k), 5)
    second[::2, 1] = -1
    first, second = first.to(torch.int32), second.to(torch.int32)
    ctas = max_ctas(rows, top_k, experts)
    src = torch.empty(rows, top_k, dtype=torch.int32, device="cuda")  # graph input
    ids = torch.empty_like(src)
    rec = torch.empty(route_words(ctas), dtype=torch.int32, device="cuda")
    perm = torch.empty(rows, top_k, dtype=torch.int32, device="cuda")

    def step():  # a producer kernel, then the route kernel (PDL) reading its output
        torch.add(src, 0, out=ids)
        launch_route(ids, rec, perm, experts)

    src.copy_(first)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # eager warm-up: loads the kernel before capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    eager_rec, eager_perm = rec.clone(), perm.clone()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for ids_cpu in (first, second, first):
        src.copy_(ids_cpu)
        rec.fill_(POISON)
        perm.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        want = build_route_record(ids_cpu, experts)
        assert torch.equal(rec.cpu(), want.record)
        assert torch.equal(perm.cpu(), want.permuted)
        if ids_cpu is first:
            assert torch.equal(rec, eager_rec) and torch.equal(perm, eager_perm)
        else:
            assert not torch.equal(rec, eager_rec)


# --------------------------------------------------------------------------- route + quantize (one launch)


def _rq_args(rows=6, top_k=6, experts=384, h=256, device="cpu"):
    ids, rec, perm = _bufs(rows, top_k, experts, device)
    return dict(
        x=torch.zeros(rows, h, dtype=torch.bfloat16, device=device),
        x_q_out=torch.empty(rows, h, dtype=torch.uint8, device=device),
        x_scale_out=torch.empty(rows, h // 32, dtype=torch.uint8, device=device),
        topk_ids=ids,
        record_out=rec,
        permuted_out=perm,
        experts=experts,
    )


@pytest.mark.parametrize(
    "mutate, exc, name",
    [
        (lambda a: a.update(x=a["x"].float()), TypeError, "x"),
        (lambda a: a.update(x=torch.zeros(9, 256, dtype=torch.bfloat16)), ValueError, "rows"),
        (lambda a: a.update(x=torch.zeros(6, 200, dtype=torch.bfloat16)), ValueError, "128"),
        (lambda a: a.update(x_q_out=a["x_q_out"][:, :128]), ValueError, "x_q_out"),
        (lambda a: a.update(x_scale_out=a["x_scale_out"].int()), TypeError, "x_scale_out"),
        (lambda a: a.update(x_deq_out=torch.empty(6, 256)), TypeError, "x_deq_out"),
        (lambda a: a.update(topk_ids=torch.zeros(5, 6, dtype=torch.int32)), ValueError, "topk_ids must have x"),
        (lambda a: a.update(topk_ids=a["topk_ids"].long()), TypeError, "topk_ids"),
        (lambda a: a.update(record_out=a["record_out"][1:]), ValueError, "record_out"),
        (lambda a: a.update(permuted_out=a["permuted_out"][:5]), ValueError, "permuted_out"),
        (lambda a: a.update(experts=513), ValueError, "experts"),
        (lambda a: a.update(pdl="no"), TypeError, "pdl"),
        (lambda a: None, ValueError, "CUDA"),  # everything right, but on the CPU
    ],
)
def test_launch_route_quantize_validates(mutate, exc, name):
    from moebench.kernels.route import launch_route_quantize

    args = _rq_args()
    mutate(args)
    with pytest.raises(exc, match=name):
        launch_route_quantize(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [128, 5120, 7168])
def test_route_quantize_bit_exact(h):
    """One launch = the route kernel's record and permute map + the quantize
    kernel's bytes and scales (+ x_deq): every output poisoned and guarded
    first, compared with the torch builder and formats.quantize_mxfp8 over
    the routings of the route tests and random x with every special block
    kind, rows 1-8, PDL on and off, inputs read before the wait or after."""
    from test_quantize import GUARD as QGUARD
    from test_quantize import POISON as QPOISON
    from test_quantize import _check_deq, _make_input, _reference

    from moebench.kernels.route import launch_route_quantize

    gen = torch.Generator().manual_seed(3000 + h)
    dev = torch.device("cuda")
    experts, checked = 384, 0
    for rows in range(1, 9):
        for top_k in (1, 6, 8):
            for i, (name, ids_cpu) in enumerate(_routings(rows, top_k, experts, gen)):
                deq, pdl = i % 2 == 1, i % 3 != 2
                ready = pdl and i % 4 < 2  # inputs_ready: reads and quantizes before the wait
                x_cpu = _make_input(rows, h, gen)
                want = build_route_record(ids_cpu, experts)
                want_q, want_s = _reference(x_cpu)
                ids = ids_cpu.to(dev)
                rec_buf, rec = _guarded(route_words(want.ctas), dev)
                perm_buf, perm = _guarded(rows * top_k, dev)
                q_buf, q = guarded(rows * h, QPOISON, torch.uint8, QGUARD, dev)
                s_buf, s = guarded(rows * h // 32, QPOISON, torch.uint8, QGUARD, dev)
                d_buf = d = None
                if deq:
                    d_buf, d = guarded(rows * h, 0x7FA5, torch.int16, 8, dev)
                    d = d.view(torch.bfloat16).view(rows, h)
                x = x_cpu.to(dev)
                launch_route_quantize(
                    x,
                    q.view(rows, h),
                    s.view(rows, h // 32),
                    ids,
                    rec,
                    perm.view(rows, top_k),
                    experts,
                    pdl=pdl,
                    x_deq_out=d,
                    inputs_ready=ready,
                )
                torch.cuda.synchronize()
                ctx = f"{name} rows={rows} top_k={top_k} H={h} deq={deq} pdl={pdl} inputs_ready={ready}"
                assert torch.equal(rec.cpu(), want.record), f"record differs: {ctx}"
                assert torch.equal(perm.cpu().view(rows, top_k), want.permuted), f"permuted differs: {ctx}"
                assert torch.equal(s.cpu().view(rows, h // 32), want_s), f"scales differ: {ctx}"
                assert torch.equal(q.cpu().view(rows, h), want_q), f"bytes differ: {ctx}"
                for what, buf, n, g, p in (
                    ("record", rec_buf, rec.numel(), GUARD, POISON),
                    ("permuted", perm_buf, perm.numel(), GUARD, POISON),
                    ("x_q", q_buf, q.numel(), QGUARD, QPOISON),
                    ("x_scale", s_buf, s.numel(), QGUARD, QPOISON),
                ):
                    assert_guards_intact(buf, g, n, p, f"{what} written out of bounds: {ctx}")
                if deq:
                    _check_deq(d.cpu(), want_q, want_s, ctx)
                    assert_guards_intact(d_buf, 8, d.numel(), 0x7FA5, f"x_deq written out of bounds: {ctx}")
                assert torch.equal(x.cpu().view(torch.int16), x_cpu.view(torch.int16)), f"x modified: {ctx}"
                checked += 1
    assert checked > 100
