"""The finalize kernel (moebench/kernels/finalize.py): sm_90a compile checks,
host validation and a CPU model of the kernel's method; on the GPU,
bit-exactness against an fp32 torch loop over k in top-k order and closeness
to moebench.moe_output.finalize, with skipped slots over NaN rows, NaN
poison everywhere the kernel must not read, a poisoned output with guards,
PDL off, CTA sizes, streams and CUDA-graph replay."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_checks import (
    assert_guards_intact,
    assert_pdl_order,
    assert_sass_without_spills,
    compile_sm90a,
    graph_launch_times,
    misaligned,
    sass_instructions,
)

from moebench import moe_output
from moebench.kernels.finalize import finalize, launch_finalize
from moebench.moe_output import UnfinalizedMoEOutput

HIDDEN = (4096, 5120, 7168)
GUARD = 8  # poisoned guard elements (16 bytes) on each side of `out`
NAN_BITS = 0x7FC1  # bf16 NaN, the poison of rows nobody may read and of `out`

# --------------------------------------------------------------------------- CPU: compile


def _compile(has_shared: bool, pdl: bool = True, threads: int = 64) -> tuple[list[str], str]:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_ptr

    from moebench.kernels.finalize import FinalizeKernel

    def fake(dtype, align=16):
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)

    sass, ptx = compile_sm90a(FinalizeKernel(has_shared=has_shared, pdl=pdl, threads=threads),
                              fake(BFloat16), fake(Float32, 4), fake(Int32, 4), fake(BFloat16),
                              fake(BFloat16), Int32(1), Int32(1), Int32(128), Int32(1),
                              Float32(1.0), cuda.CUstream(0), ptx=True)
    return sass_instructions(sass), ptx


@pytest.mark.compile
@pytest.mark.parametrize(
    "has_shared, pdl, threads",
    [(False, True, 64), (True, True, 64), (False, False, 64), (True, False, 64), (True, True, 1024)],
)
def test_compiles_for_sm90a_without_spills(has_shared, pdl, threads):
    instr, ptx = _compile(has_shared, pdl, threads)
    text = assert_sass_without_spills(instr, "finalize")
    # 16-byte row loads (top_k <= 8, + the shared chunk), one 16-byte store; the
    # indices and weights as 8 + 8 scalar loads; nothing narrower
    assert len(re.findall(r"\bLDG\.E\.128\b", text)) == 8 + has_shared
    assert len(re.findall(r"\bSTG\.E\.128\b", text)) == 1
    assert len(re.findall(r"\bLDG\.E\s", text)) == 16
    assert not re.search(r"\b(LDG|STG)\.E\.(U16|S16|U8|S8|64)\b", text), "narrow global accesses"
    assert not re.search(r"\bSTG\.E\s", text)
    # separately rounded fp32 multiplies and adds, no FMA contraction, no flush to zero
    assert not re.search(r"\bFFMA\b|\bHFMA2?\b", text), "a multiply-add was contracted"
    assert len(re.findall(r"\bFMUL\b", text)) == 8 * 8 + 8             # w*x, then the scale
    assert len(re.findall(r"\bFADD\b", text)) == 8 * 8 + 8 * has_shared  # acc+, then shared
    assert not re.search(r"\.FTZ\b", text)
    assert len(re.findall(r"F2FP\.BF16\.F32\.PACK_AB", text)) == 4
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx
    assert not re.search(r"\.ftz\.|\bfma\.", ptx)
    assert "BAR.SYNC" not in text
    # all row loads are issued before the first multiply (they are in flight together)
    row_loads = [i for i, s in enumerate(instr) if "LDG.E.128" in s]
    math = [i for i, s in enumerate(instr) if re.match(r"(@!?P\d+ )?(FMUL|FADD)\b", s)]
    assert max(row_loads) < min(math), (row_loads, min(math))
    assert_pdl_order(instr, pdl)


@pytest.mark.compile
def test_compile_finalize_kernel_is_cached_and_validates():
    from moebench.kernels.finalize import FinalizeKernel, compile_finalize_kernel

    assert compile_finalize_kernel(False) is compile_finalize_kernel(False, True)
    assert compile_finalize_kernel(True) is compile_finalize_kernel(True, pdl=True, threads=64)
    assert compile_finalize_kernel(True) is not compile_finalize_kernel(False)
    assert compile_finalize_kernel(True, False) is not compile_finalize_kernel(True, True)
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="has_shared"):
            compile_finalize_kernel(bad)
        with pytest.raises(TypeError, match="pdl"):
            compile_finalize_kernel(True, bad)
        with pytest.raises(TypeError, match="has_shared"):
            FinalizeKernel(has_shared=bad)
        with pytest.raises(TypeError, match="pdl"):
            FinalizeKernel(has_shared=False, pdl=bad)
    for bad in (0, 16, 48, 2048, True, 64.0):
        with pytest.raises(ValueError, match="threads"):
            compile_finalize_kernel(False, True, bad)
        with pytest.raises(ValueError, match="threads"):
            FinalizeKernel(has_shared=False, threads=bad)


# --------------------------------------------------------------------------- CPU: validation


def _args(tokens=4, top_k=6, h=4096, n_rows=32):
    return dict(rows=torch.zeros(n_rows, h, dtype=torch.bfloat16),
                weights=torch.zeros(tokens, top_k, dtype=torch.float32),
                permuted=torch.zeros(tokens, top_k, dtype=torch.int32),
                out=torch.empty(tokens, h, dtype=torch.bfloat16))


BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "mutate, exc, name",
    [
        (lambda a: a.update(rows=[[0.0]]), TypeError, "rows must be a torch.Tensor"),
        (lambda a: a.update(rows=a["rows"].float()), TypeError, "rows must be torch.bfloat16"),
        (lambda a: a.update(rows=a["rows"].half()), TypeError, "rows must be torch.bfloat16"),
        (lambda a: a.update(rows=a["rows"][None]), ValueError, "rows must be 2-D"),
        (lambda a: a.update(rows=a["rows"][0]), ValueError, "rows must be 2-D"),
        (lambda a: a.update(rows=torch.zeros(32, 4000, dtype=BF16)), ValueError, "rows: H"),
        (lambda a: a.update(rows=torch.zeros(32, 64, dtype=BF16)), ValueError, "rows: H"),
        (lambda a: a.update(rows=torch.zeros(32, 8192, dtype=BF16)[:, ::2]), ValueError,
         "rows must be contiguous"),
        (lambda a: a.update(rows=misaligned((32, 4096), BF16)), ValueError,
         "rows must be 16-byte aligned"),
        (lambda a: a.update(weights=None), TypeError, "weights must be a torch.Tensor"),
        (lambda a: a.update(weights=a["weights"].double()), TypeError, "weights must be torch.float32"),
        (lambda a: a.update(weights=a["weights"].to(BF16)), TypeError, "weights must be torch.float32"),
        (lambda a: a.update(weights=a["weights"].view(-1)), ValueError, "weights must be 2-D"),
        (lambda a: a.update(weights=torch.zeros(9, 6)), ValueError, "tokens"),
        (lambda a: a.update(weights=torch.zeros(0, 6)), ValueError, "tokens"),
        (lambda a: a.update(weights=torch.zeros(4, 9)), ValueError, "top_k"),
        (lambda a: a.update(weights=torch.zeros(4, 0)), ValueError, "top_k"),
        (lambda a: a.update(weights=torch.zeros(6, 4).t()), ValueError, "weights must be contiguous"),
        (lambda a: a.update(permuted=None), TypeError, "permuted must be a torch.Tensor"),
        (lambda a: a.update(permuted=a["permuted"].long()), TypeError, "permuted must be torch.int32"),
        (lambda a: a.update(permuted=a["permuted"].float()), TypeError, "permuted must be torch.int32"),
        (lambda a: a.update(permuted=a["permuted"][:3]), ValueError, "permuted must have shape"),
        (lambda a: a.update(permuted=a["permuted"].view(-1)), ValueError, "permuted must have shape"),
        (lambda a: a.update(permuted=torch.zeros(6, 4, dtype=torch.int32).t()), ValueError,
         "permuted must be contiguous"),
        (lambda a: a.update(out=None), TypeError, "out must be a torch.Tensor"),
        (lambda a: a.update(out=a["out"].float()), TypeError, "out must be torch.bfloat16"),
        (lambda a: a.update(out=a["out"][:3]), ValueError, "out must have shape"),
        (lambda a: a.update(out=torch.empty(4, 5120, dtype=BF16)), ValueError, "out must have shape"),
        (lambda a: a.update(out=torch.empty(4096, 4, dtype=BF16).t()), ValueError,
         "out must be contiguous"),
        (lambda a: a.update(out=misaligned((4, 4096), BF16)), ValueError,
         "out must be 16-byte aligned"),
        (lambda a: a.update(shared=[1.0]), TypeError, "shared must be a torch.Tensor"),
        (lambda a: a.update(shared=torch.zeros(4, 4096)), TypeError, "shared must be torch.bfloat16"),
        (lambda a: a.update(shared=torch.zeros(3, 4096, dtype=BF16)), ValueError,
         "shared must have shape"),
        (lambda a: a.update(shared=torch.zeros(4096, 4, dtype=BF16).t()), ValueError,
         "shared must be contiguous"),
        (lambda a: a.update(shared=misaligned((4, 4096), BF16)), ValueError,
         "shared must be 16-byte aligned"),
        (lambda a: a.update(scale="2"), TypeError, "scale"),
        (lambda a: a.update(scale=None), TypeError, "scale"),
        (lambda a: a.update(scale=True), TypeError, "scale"),
        (lambda a: a.update(scale=torch.tensor(2.0)), TypeError, "scale"),
        (lambda a: a.update(pdl=1), TypeError, "pdl"),
        (lambda a: a.update(threads=48), ValueError, "threads"),
        (lambda a: None, ValueError, "CUDA"),  # everything right, but on the CPU
        (lambda a: a.update(shared=torch.zeros(4, 4096, dtype=BF16), scale=2), ValueError, "CUDA"),
    ],
)
def test_launch_finalize_validates(mutate, exc, name):
    args = _args()
    mutate(args)
    with pytest.raises(exc, match=name):
        launch_finalize(**args)


def test_finalize_validates():
    rows = torch.zeros(16, 4096, dtype=BF16)
    w = torch.zeros(2, 6)
    idx = torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(TypeError, match="unfinalized"):
        finalize(rows)
    with pytest.raises(TypeError, match="rows"):
        finalize(UnfinalizedMoEOutput(rows.float(), w, idx))
    with pytest.raises(TypeError, match="expert_weights"):
        finalize(UnfinalizedMoEOutput(rows, idx, idx))
    with pytest.raises(ValueError, match="H"):
        finalize(UnfinalizedMoEOutput(torch.zeros(16, 96, dtype=BF16), w, idx))
    with pytest.raises(ValueError, match="tokens"):
        finalize(UnfinalizedMoEOutput(rows, torch.zeros(9, 6), torch.zeros(9, 6, dtype=torch.int32)))
    with pytest.raises(ValueError, match="shared"):
        finalize(UnfinalizedMoEOutput(rows, w, idx), shared=torch.zeros(3, 4096, dtype=BF16))
    with pytest.raises(TypeError, match="scale"):
        finalize(UnfinalizedMoEOutput(rows, w, idx), scale="1")
    with pytest.raises(ValueError, match="CUDA"):  # bf16 weights are converted; then the device
        finalize(UnfinalizedMoEOutput(rows, w.to(BF16), idx))


# --------------------------------------------------------------------------- inputs and oracles


def _bf16_from_bits(bits: int, shape, device="cpu") -> torch.Tensor:
    return torch.full(shape, bits, dtype=torch.int16, device=device).view(BF16)


def _make_case(tokens: int, top_k: int, h: int, gen: torch.Generator, *, shared: bool,
               skip: float = 0.25, extra_rows: int = 5):
    """(rows, weights, permuted, shared) on the CPU. The referenced rows hold
    values at random scales (some bf16 subnormals), every other row NaN; the
    map is a random injection into the rows with `skip` of the slots skipped
    (-1, other negatives, indices >= permuted_rows), whose weights are NaN."""
    slots = tokens * top_k
    n_rows = slots + extra_rows
    rows = _bf16_from_bits(NAN_BITS, (n_rows, h))
    perm = torch.randperm(n_rows, generator=gen)[:slots].to(torch.int32).view(tokens, top_k)
    skipped = torch.rand(tokens, top_k, generator=gen) < skip
    if tokens > 1 and top_k > 1:
        skipped[int(torch.randint(0, tokens, (), generator=gen))] = True  # a token with no route
    bad = torch.tensor([-1, -1, -1, -7, n_rows, n_rows + 3, 2**31 - 1, -(2**31)], dtype=torch.int32)
    pick = torch.randint(0, bad.numel(), (tokens, top_k), generator=gen)
    perm = torch.where(skipped, bad[pick], perm).contiguous()
    for t in range(tokens):
        for k in range(top_k):
            p = int(perm[t, k])
            if 0 <= p < n_rows:
                scale = 2.0 ** float(torch.randint(-136, 40, (), generator=gen))
                rows[p] = (torch.randn(h, generator=gen) * scale).to(BF16)
    weights = torch.rand(tokens, top_k, generator=gen) * 2 - 0.5
    weights = torch.where(skipped, torch.full_like(weights, float("nan")), weights)
    sh = (torch.randn(tokens, h, generator=gen) * 4).to(BF16) if shared else None
    return rows, weights.contiguous(), perm, sh


def _loop_reference(rows, weights, permuted, scale: float, shared) -> torch.Tensor:
    """The defined result on the CPU: fp32 acc = +0; for k in top-k order, for
    local slots only, acc = acc + w * row (a multiply, then an add, each
    rounded); acc = acc * fp32(scale); acc = acc + shared; RNE to bf16."""
    rows, weights, permuted = rows.cpu(), weights.cpu(), permuted.cpu()
    tokens, top_k = weights.shape
    n_rows, h = rows.shape
    acc = torch.zeros(tokens, h, dtype=torch.float32)
    for k in range(top_k):
        for t in range(tokens):
            p = int(permuted[t, k])
            if 0 <= p < n_rows:
                prod = weights[t, k] * rows[p].float()
                acc[t] = acc[t] + prod
    acc = acc * torch.tensor(scale, dtype=torch.float32)
    if shared is not None:
        acc = acc + shared.cpu().float()
    return acc.to(BF16)


def _kernel_method_model(rows, weights, permuted, scale: float, shared) -> torch.Tensor:
    """The kernel's method in torch (CPU): every slot of MAX_TOP_K is added,
    a skipped one as +0 weight times +0 (no row read)."""
    tokens, top_k = weights.shape
    n_rows, h = rows.shape
    acc = torch.zeros(tokens, h, dtype=torch.float32)
    for k in range(8):
        kk = min(k, top_k - 1)
        p = permuted[:, kk].long()
        ok = (k < top_k) & (p >= 0) & (p < n_rows)
        w = torch.where(ok, weights[:, kk], torch.zeros(()))
        x = torch.zeros(tokens, h)
        x[ok] = rows[p[ok]].float()
        acc = acc + w[:, None] * x
    acc = acc * torch.tensor(scale, dtype=torch.float32)
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(BF16)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, ctx: str) -> None:
    """Equal bf16 bits, NaN payloads aside (both NaN at the same places)."""
    got, want = got.cpu(), want.cpu()
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn), f"NaN positions differ: {ctx}: {(gn != wn).nonzero()[:4].tolist()}"
    g = torch.where(gn, torch.zeros_like(got), got).view(torch.int16)
    w = torch.where(wn, torch.zeros_like(want), want).view(torch.int16)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:4].tolist()
        detail = [(t, c, got[t, c].item(), want[t, c].item()) for t, c in bad]
        raise AssertionError(f"bits differ: {ctx} (token, col, got, want): {detail}")


def test_kernel_method_model_and_torch_finalize_match_the_loop():
    gen = torch.Generator().manual_seed(1)
    for tokens, top_k, h in ((1, 1, 128), (3, 6, 256), (8, 8, 4096), (5, 2, 128), (8, 1, 256)):
        for shared in (False, True):
            for scale in (1.0, 2.5):
                rows, w, perm, sh = _make_case(tokens, top_k, h, gen, shared=shared)
                want = _loop_reference(rows, w, perm, scale, sh)
                assert not want.isnan().any()  # no poison leaked into the oracle
                _assert_same_bits(_kernel_method_model(rows, w, perm, scale, sh), want, "model")
                # moe_output.finalize checks the range on the CPU: map the
                # out-of-range skips to -1 for it (the kernel skips them itself)
                idx = torch.where((perm >= 0) & (perm < rows.shape[0]), perm, -1)
                ref = moe_output.finalize(UnfinalizedMoEOutput(rows, w, idx), scale=scale, shared=sh)
                _assert_close(ref, want, "torch finalize")


def _assert_close(got: torch.Tensor, want: torch.Tensor, ctx: str, rel: float = 1e-2) -> None:
    got, want = got.cpu().float(), want.cpu().float()
    assert not got.isnan().any(), f"NaN in the output: {ctx}"
    err = (got - want).abs().max().item()
    ref = want.abs().max().item()
    assert err <= rel * ref, f"{ctx}: max abs err {err} > {rel} * max |ref| {ref}"


# --------------------------------------------------------------------------- GPU


def _poisoned_out(tokens: int, h: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned bf16 buffer with GUARD elements before and after a [tokens, h] view."""
    buf = _bf16_from_bits(NAN_BITS, (tokens * h + 2 * GUARD,), device)
    return buf, buf[GUARD : GUARD + tokens * h].view(tokens, h)


def _check(rows, weights, permuted, shared, *, scale=1.0, pdl=True, threads=64, what=""):
    """Launch on poisoned output buffers; compare bit for bit with the loop
    and within 1e-2 with moe_output.finalize; check guards and inputs."""
    tokens, top_k = weights.shape
    h = rows.shape[1]
    ctx = (f"{what} tokens={tokens} top_k={top_k} H={h} scale={scale} "
           f"shared={shared is not None} pdl={pdl} threads={threads}")
    want = _loop_reference(rows, weights, permuted, scale, shared)
    dev = torch.device("cuda")
    r, w, p = rows.to(dev), weights.to(dev), permuted.to(dev)
    s = shared.to(dev) if shared is not None else None
    buf, out = _poisoned_out(tokens, h, dev)
    launch_finalize(r, w, p, out, scale=scale, shared=s, pdl=pdl, threads=threads)
    torch.cuda.synchronize()
    _assert_same_bits(out, want, ctx)
    assert_guards_intact(buf.view(torch.int16), GUARD, tokens * h, NAN_BITS,
                         f"out written out of bounds: {ctx}")
    assert torch.equal(r.cpu().view(torch.int16), rows.view(torch.int16)), f"rows modified: {ctx}"
    if s is not None:
        assert torch.equal(s.cpu().view(torch.int16), shared.view(torch.int16)), f"shared modified: {ctx}"
    if not (want.isnan().any() or want.isinf().any()):
        idx = torch.where((p >= 0) & (p < r.shape[0]), p, -1)
        ref = moe_output.finalize(UnfinalizedMoEOutput(r, w, idx), scale=scale, shared=s)
        _assert_close(out, ref, ctx)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("shared", [False, True])
def test_finalize_bit_exact(h, shared):
    gen = torch.Generator().manual_seed(h + shared)
    for tokens in range(1, 9):
        for top_k in range(1, 9):
            for scale in (1.0, 2.5):
                rows, w, perm, sh = _make_case(tokens, top_k, h, gen, shared=shared)
                _check(rows, w, perm, sh, scale=scale)


@pytest.mark.gpu
def test_finalize_all_local_all_skipped_and_duplicates():
    gen = torch.Generator().manual_seed(2)
    h = 5120
    for shared in (False, True):
        # every slot local, in route-major order (the identity map)
        rows, w, perm, sh = _make_case(8, 8, h, gen, shared=shared, skip=0.0)
        perm = torch.arange(64, dtype=torch.int32).view(8, 8)
        rows[:64] = (torch.randn(64, h, generator=gen)).to(BF16)
        w = torch.rand(8, 8, generator=gen)
        _check(rows, w, perm, sh, scale=1.5, what="identity map")
        # every slot skipped: out = bf16(+0 * scale + shared) (zeros without shared)
        perm = torch.full((8, 8), -1, dtype=torch.int32)
        out = _check(rows, w * float("nan"), perm, sh, scale=2.5, what="all skipped")
        if sh is None:
            assert (out.cpu().view(torch.int16) == 0).all()
        else:
            assert torch.equal(out.cpu().view(torch.int16), sh.view(torch.int16))
        # two slots of one token on the same row (the kernel does not need an injection)
        perm = torch.arange(64, dtype=torch.int32).view(8, 8)
        perm[:, 1] = perm[:, 0]
        _check(rows, w, perm, sh, scale=1.0, what="duplicates")


@pytest.mark.gpu
def test_finalize_nonfinite_and_tiny_values_follow_the_loop():
    # Inf / NaN in referenced rows propagate as in the loop; bf16 subnormal rows
    # times tiny weights give fp32 subnormal products (no flush to zero)
    gen = torch.Generator().manual_seed(3)
    h = 4096
    rows, w, perm, sh = _make_case(4, 6, h, gen, shared=True, skip=0.2)
    live = perm[(perm >= 0) & (perm < rows.shape[0])].tolist()
    rows[live[0], 5] = float("inf")
    rows[live[1], 9] = float("nan")
    rows[live[2]] = _bf16_from_bits(0x0001, (h,)) * torch.randint(1, 100, (h,), generator=gen).to(BF16)
    w = torch.where(w.isnan(), w, w * 2.0**-30)
    _check(rows, w, perm, sh, scale=1.0, what="non-finite / tiny")
    big = torch.full_like(w, 3.0e38)
    _check(rows, torch.where(w.isnan(), w, big), perm, None, scale=2.5, what="overflow")


@pytest.mark.gpu
def test_finalize_other_configs_and_stream():
    gen = torch.Generator().manual_seed(4)
    for pdl, threads in ((False, 64), (True, 32), (True, 128), (False, 1024)):
        for tokens, top_k, h in ((1, 6, 4096), (5, 3, 5120), (8, 8, 7168), (2, 6, 128)):
            for shared in (False, True):
                rows, w, perm, sh = _make_case(tokens, top_k, h, gen, shared=shared)
                _check(rows, w, perm, sh, scale=2.5, pdl=pdl, threads=threads)
    rows, w, perm, sh = _make_case(6, 6, 5120, gen, shared=True)
    want = _loop_reference(rows, w, perm, 1.5, sh)
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        r, wd, p, s = rows.cuda(), w.cuda(), perm.cuda(), sh.cuda()
        out = _bf16_from_bits(NAN_BITS, (6, 5120), "cuda")
    launch_finalize(r, wd, p, out, scale=1.5, shared=s, stream=st)
    st.synchronize()
    _assert_same_bits(out, want, "stream")
    with pytest.raises(TypeError, match="stream"):
        launch_finalize(r, wd, p, out, stream=0)
    # in place: out is shared itself
    s2 = s.clone()
    launch_finalize(r, wd, p, s2, scale=1.5, shared=s2)
    torch.cuda.synchronize()
    _assert_same_bits(s2, want, "in place")
    # the allocating convenience (bf16 weights are converted to fp32 first)
    got = finalize(UnfinalizedMoEOutput(r, wd, p), scale=1.5, shared=s)
    torch.cuda.synchronize()
    assert got.dtype == BF16 and got.shape == (6, 5120)
    _assert_same_bits(got, want, "finalize()")
    wb = wd.to(BF16)
    got = finalize(UnfinalizedMoEOutput(r, wb, p), scale=1.5, shared=s)
    _assert_same_bits(got, _loop_reference(rows, wb.float().cpu(), perm, 1.5, sh), "bf16 weights")
    with pytest.raises(ValueError, match="device|cuda"):
        launch_finalize(r, wd.cpu(), p, out)


@pytest.mark.gpu
def test_finalize_cuda_graph_capture_and_replay():
    tokens, top_k, h = 6, 6, 7168
    gen = torch.Generator().manual_seed(5)
    first = _make_case(tokens, top_k, h, gen, shared=True)
    second = _make_case(tokens, top_k, h, gen, shared=True)
    n_rows = first[0].shape[0]
    assert second[0].shape[0] == n_rows
    dev = "cuda"
    src = torch.empty(n_rows, h, dtype=BF16, device=dev)   # graph inputs
    rows = torch.empty_like(src)
    w = torch.empty(tokens, top_k, device=dev)
    perm = torch.empty(tokens, top_k, dtype=torch.int32, device=dev)
    sh = torch.empty(tokens, h, dtype=BF16, device=dev)
    out = torch.empty(tokens, h, dtype=BF16, device=dev)

    def load(case):
        src.copy_(case[0])
        w.copy_(case[1])
        perm.copy_(case[2])
        sh.copy_(case[3])

    def step():  # a producer kernel, then finalize (PDL) reading its output
        rows.copy_(src)
        launch_finalize(rows, w, perm, out, scale=2.5, shared=sh)

    load(first)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        step()  # eager warm-up: loads the kernel before capture
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    eager = out.clone()
    _assert_same_bits(eager, _loop_reference(*first[:3], 2.5, first[3]), "eager")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in (first, second, first):
        load(case)
        out.copy_(_bf16_from_bits(NAN_BITS, (tokens, h), dev))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bits(out, _loop_reference(*case[:3], 2.5, case[3]), "replay")
        if case is first:
            assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
        else:
            assert not torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.gpu
def test_finalize_graph_timing(capsys):
    """Per-launch time in a CUDA graph of 100 back-to-back PDL launches (printed;
    the bound only catches a gross regression)."""
    tokens, top_k, h, n = 8, 6, 7168, 100
    gen = torch.Generator().manual_seed(6)
    rows, w, perm, sh = (t.cuda() for t in _make_case(tokens, top_k, h, gen, shared=True))
    out = torch.empty(tokens, h, dtype=BF16, device="cuda")
    med, times = graph_launch_times(lambda: launch_finalize(rows, w, perm, out, shared=sh),
                                    n=n, replays=20)
    with capsys.disabled():
        print(f"\n[finalize] tokens={tokens} top_k={top_k} H={h} +shared: {med:.2f} us per launch "
              f"in a graph (median of 20 replays of {n}; min {min(times):.2f}, max {max(times):.2f})")
    _assert_same_bits(out, _loop_reference(rows, w, perm, 1.0, sh), "timing run")
    assert med < 50
