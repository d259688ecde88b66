"""humming-kernels baselines: availability and the routing alignment on the
CPU; numerics vs the matching fp64 oracle on the H200 (`gpu`).

Tolerances as in test_flashinfer.py: 1e-2 for w4a16 (oracle "bf16"); 3e-2
for w4a8 (oracle "fp8_token": per-token e4m3 x and H; humming also clamps each
expert's E8M0 range to 11 binades - the scheme FlashInfer ported - and its
finalize multiplies by BF16-rounded top-k weights, 2^-9 relative at most).
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from baseline_checks import (
    EXPERTS,
    TINY,
    baseline_cases,
    blocks_of,
    hot_tiny_routing,
    replay_into_nan,
    tiny_expert_alone_error,
    tiny_weights,
)

from moebench.backends import humming as hm
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error

#: The gate's tolerances (docs/baselines.md, Tolerances). W4A8 stays at 3e-2, which separates "quantizes
#: like the oracle" from BF16 activations (~4 %), though humming's W4A8 output is not bit-repeatable and
#: one case sits on the line: dsv4-flash TP4 rows 1 gave 3.006e-2, then 2.733e-2 on the same inputs
#: (2026-12-01, *-gpu-suite-rest.log, *-humming-w4a8-rerun.log).
TOLERANCE = {"bf16": 1e-2, "fp8_token": 3e-2}


# --- CPU -------------------------------------------------------------------------------------


def test_import_never_needs_humming():
    code = (
        "import sys; sys.modules['humming'] = None\n"
        "import moebench.backends.humming as m\n"
        "print(m.HummingW4A16Backend.oracle, m.HummingW4A8Backend.oracle)\n"
        "print(m.HummingW4A16Backend().unavailable_reason('cpu'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "bf16 fp8_token"


def align_block_size_reference(expert_of_slot: torch.Tensor, experts: int, block: int):
    """humming.testing.data.generate_moe_tensors' loop (host syncs): the
    unpadded-capacity reference for `align_block_size`."""
    flat = expert_of_slot.reshape(-1)
    s = flat.numel()
    ids, eids = [], []
    for e in range(experts):
        part = torch.where(flat == e)[0]
        n = -(-part.numel() // block)
        ids += part.tolist() + [s] * (n * block - part.numel())
        eids += [e] * n
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(eids, dtype=torch.int32),
            torch.tensor([len(ids)], dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
def test_unavailable_without_gpu_or_package(cls, monkeypatch):
    backend = cls()
    assert "CUDA" in backend.unavailable_reason("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "humming-kernels" in backend.unavailable_reason("cuda:0")


def test_unavailable_on_other_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    assert "sm_80" in hm.HummingW4A16Backend().unavailable_reason("cuda:0")


@pytest.mark.parametrize("block", [8, 16, 32, 64])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_align_matches_humming_reference(block, rows):
    g = torch.Generator().manual_seed(rows * 100 + block)
    for experts in (6, 17, 384):
        ids = torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(rows)]).to(torch.int32)
        ids[0, 1] = ids[-1, 0] if rows > 1 else ids[0, 1]  # a shared expert across rows
        sorted_ids, expert_ids, padded = hm.align_block_size(ids, experts, block)
        ref_ids, ref_experts, ref_padded = align_block_size_reference(ids, experts, block)
        n = int(padded)
        assert n == int(ref_padded) and n % block == 0
        assert torch.equal(sorted_ids[:n], ref_ids)
        assert torch.equal(expert_ids[: n // block], ref_experts)
        assert sorted_ids.numel() == hm.align_capacity(ids.numel(), experts, block)
        assert bool((sorted_ids[n:] == ids.numel()).all())
        assert expert_ids.numel() == sorted_ids.numel() // block


def test_align_hot_expert_spans_blocks():
    ids = torch.zeros(8, 1, dtype=torch.int32)  # 8 slots on expert 0, block 4 -> 2 full blocks
    s, e, n = hm.align_block_size(ids, 4, 4)
    assert int(n) == 8 and s[:8].tolist() == list(range(8)) and e[:2].tolist() == [0, 0]


def test_triton_align_in_the_interpreter():
    """The single-kernel align equals the torch ops (Triton's CPU interpreter,
    in a fresh process: TRITON_INTERPRET must be set before triton is imported)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    code = (
        "import torch\n"
        "from moebench.backends import humming as hm\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for rows, experts, block in ((1, 6, 16), (3, 40, 8), (8, 384, 16), (8, 16, 64)):\n"
        "    ids = torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(rows)]).to(torch.int32)\n"
        "    a = hm.align_block_size(ids, experts, block)\n"
        "    b = hm.align_block_size_triton(ids, experts, block)\n"
        "    assert all(torch.equal(x, y) for x, y in zip(a, b)), (rows, experts, block)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_aligner_prefers_vllm_then_triton_then_torch(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(hm.ALIGN_ENV, raising=False)
    monkeypatch.setattr(hm.vllm_ops, "reason", lambda which: None)
    assert hm._aligner(cuda) == (hm.align_block_size_vllm, "vllm")
    monkeypatch.setattr(hm.vllm_ops, "reason", lambda which: "vLLM's library not found")
    monkeypatch.setattr(hm, "_triton_align_kernel", lambda: object())
    assert hm._aligner(cuda) == (hm.align_block_size_triton, "triton")  # vLLM unavailable: falls back
    monkeypatch.setattr(hm, "_triton_align_kernel", lambda: None)
    assert hm._aligner(cuda) == (hm.align_block_size, "torch")
    assert hm._aligner(torch.device("cpu")) == (hm.align_block_size, "torch")


def test_aligner_env_override(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(hm.vllm_ops, "reason", lambda which: None)
    monkeypatch.setattr(hm, "_triton_align_kernel", lambda: object())
    monkeypatch.setenv(hm.ALIGN_ENV, "triton")
    assert hm._aligner(cuda)[1] == "triton"
    monkeypatch.setenv(hm.ALIGN_ENV, "torch")
    assert hm._aligner(cuda)[1] == "torch"
    monkeypatch.setenv(hm.ALIGN_ENV, "cuda")
    with pytest.raises(ValueError, match="MOEBENCH_HUMMING_ALIGN must be one of"):
        hm._aligner(cuda)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-machine path")
def test_cpu_machine_aligns_with_torch():
    # vllm_ops reports the library unavailable on a CPU-only machine: the choice falls through
    assert hm.vllm_ops.reason("moe") is not None
    assert hm._aligner(torch.device("cpu"))[1] == "torch"


def test_prepare_rejects_per_expert_clamps(monkeypatch):
    backend = hm.HummingW4A16Backend()
    shape = get_preset("dsv4-flash", experts=8, hidden=256, intermediate=128).shard(1)
    w = generate_expert_weights(shape)
    w.clamp[1] = 7.0
    monkeypatch.setattr(backend, "unavailable_reason", lambda device: None)
    with pytest.raises(ValueError, match="clamp"):
        backend.prepare(w, shape)


# --- GPU -------------------------------------------------------------------------------------

#: every preset at TP 1 and 4; MOEBENCH_BASELINE_CASES="dsv41-flash:4,dsv4-pro:1" narrows it
#: (each case costs tuning / NVRTC compiles on the device).
CASES = baseline_cases((1, 4))


def _backend(cls):
    backend = cls()
    reason = backend.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    return backend


def _prepared(cache, cls, preset, tp, tactic="default"):
    key = (cls.name, preset, tp, tactic)
    if key not in cache:
        cache.clear()
        torch.cuda.empty_cache()
        backend = _backend(cls)
        shape, w = tiny_weights(preset, tp)
        cache[key] = (backend, shape, w, backend.prepare(w, shape, tactic))
    return cache[key]


@pytest.mark.gpu
def test_align_on_the_device_matches_reference():
    ids = torch.stack([torch.randperm(384)[:6] for _ in range(8)]).to(torch.int32).cuda()
    s, e, n = hm.align_block_size(ids, 384, 16)
    rs, re, rn = align_block_size_reference(ids.cpu(), 384, 16)
    k = int(n)
    assert k == int(rn) and torch.equal(s[:k].cpu(), rs) and torch.equal(e[: k // 16].cpu(), re)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [8, 16, 64])
def test_triton_align_matches_torch_on_the_device(block):
    if hm._triton_align_kernel() is None:
        pytest.skip("Triton is not installed")
    for rows, experts in ((1, 384), (5, 16), (8, 384), (8, 256)):
        ids = torch.stack([torch.randperm(experts)[:6] for _ in range(rows)]).to(torch.int32).cuda()
        a = hm.align_block_size(ids, experts, block)
        b = hm.align_block_size_triton(ids, experts, block)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
@pytest.mark.parametrize("preset,tp", CASES)
def test_matches_oracle(prepared_cache, cls, preset, tp):
    backend, shape, w, prepared = _prepared(prepared_cache, cls, preset, tp)
    tol = TOLERANCE[backend.oracle]
    for rows in (1, 4, 8):
        x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
        ids, wts = hot_tiny_routing(rows, shape.top_k, shape.routed_scaling_factor, seed=rows)
        out = backend.forward(prepared, x, ids, wts).clone()
        ref = reference_moe(x, ids, wts, w, activation=backend.oracle).output
        err = relative_error(out, ref)
        print(f"{backend.name} {shape.describe()} rows={rows}: rel err {err:.3e} ({backend.last_tactic})")
        assert err <= tol, f"{backend.name} {shape.describe()} rows={rows}: rel err {err:.3e} > {tol}"
        assert backend.last_tactic.startswith("w13=")


#: humming-kernels 0.1.19's W4A8 path returns all zeros for the expert whose
#: scales are 2^-20 of the others at dsv41-flash TP4 and TP8 (relative error 1.0
#: on the H200, reports/device-runs/2026-11-29-69166e1-gpu-tests-baselines.log and,
#: for TP8, 2026-12-01-0b51d10-gpu-tests-peers-after-review.log; the other presets
#: at TP 1 / 4 and humming W4A16 pass): a defect of the baseline, kept
#: visible as a strict xfail (an XPASS, once humming handles it, fails the run).
_HUMMING_TINY_DEFECT = pytest.mark.xfail(
    strict=True, reason="humming-kernels 0.1.19 W4A8: zeros for a 2^-20-scale expert at dsv41-flash TP4/TP8"
)


def _tiny_cases():
    out = []
    for cls in (hm.HummingW4A16Backend, hm.HummingW4A8Backend):
        for preset, tp in CASES:
            known = cls is hm.HummingW4A8Backend and (preset, tp) in (("dsv41-flash", 4), ("dsv41-flash", 8))
            marks = [_HUMMING_TINY_DEFECT] if known else []
            out.append(pytest.param(cls, preset, tp, marks=marks, id=f"{preset}-{tp}-{cls.__name__}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cls,preset,tp", _tiny_cases())
def test_tiny_scale_expert_alone(prepared_cache, cls, preset, tp):
    """The expert whose weight scales are 2^-20 of the others, alone at rows 4
    (relative error is scale-free)."""
    backend, shape, w, prepared = _prepared(prepared_cache, cls, preset, tp)
    x = generate_activations(4, shape.hidden, seed=4, device="cuda")
    err = tiny_expert_alone_error(backend, prepared, shape, w, x, TINY)
    assert err <= TOLERANCE[backend.oracle], f"{backend.name} {shape.describe()} tiny expert: rel err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
def test_non_local_ids_contribute_nothing(prepared_cache, cls):
    """Tactic "ep": ids of other ranks' experts add nothing."""
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4, tactic="ep")
    x = generate_activations(4, shape.hidden, seed=3, device="cuda")
    ids, wts = hot_tiny_routing(4, shape.top_k, 1.5, seed=3)
    masked = ids.clone()
    masked[:, -2:] = torch.tensor([-1, EXPERTS + 3], dtype=torch.int32)
    out = backend.forward(prepared, x, masked, wts).clone()
    kept = wts.clone()
    kept[:, -2:] = 0
    ref = reference_moe(x, ids, kept, w, activation=backend.oracle).output
    assert relative_error(out, ref) <= TOLERANCE[backend.oracle]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
def test_graph_capture_replays_the_eager_result(prepared_cache, cls):
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
    x = generate_activations(6, shape.hidden, seed=5, device="cuda")
    ids, wts = hot_tiny_routing(6, shape.top_k, 1.5, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls compile humming's kernels: before capture
        eager = [backend.forward(prepared, x, ids, wts).clone() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    out = replay_into_nan(lambda: backend.forward(prepared, x, ids, wts))
    ref = reference_moe(x, ids, wts, w, activation=backend.oracle).output
    err, eager_err = relative_error(out, ref), relative_error(eager[-1], ref)
    deterministic = torch.equal(eager[1], eager[2])
    print(
        f"{backend.name}: replay rel err {err:.3e}, eager {eager_err:.3e}, eager calls bit-identical:"
        f" {deterministic}, replay == eager: {torch.equal(out, eager[-1])}"
    )
    # A deterministic backend must replay the eager bits; one whose eager calls
    # already differ (a reduction order that varies) must still meet the oracle.
    if deterministic:
        assert torch.equal(out, eager[-1])
    assert err <= TOLERANCE[backend.oracle]


def test_tuning_config_lookup():
    configs = [[0, 16, {"block_shape": [16, 256, 64], "mma_type": "wgmma"}],
               [16, 48, {"block_shape": [32, 128, 64]}]]  # fmt: skip
    prepared = hm.HummingPrepared(layer=None, tuning={"w13": (configs, "")}, limit=10.0, hidden=0,
                                  intermediate=0, experts=0, top_k=6, mode="w4a16")  # fmt: skip
    assert prepared.block_m("w13", 6) == 16 and prepared.block_m("w13", 16) == 16
    assert prepared.block_m("w13", 17) == 32 and prepared.config_name("w13", 48) == "? [32, 128, 64]"
    assert prepared.config_name("w13", 1) == "wgmma [16, 256, 64]"
    with pytest.raises(ValueError, match="M=49"):
        prepared.block_m("w13", 49)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [8, 16, 32, 64])
def test_vllm_align_matches_triton_align(block):
    """vLLM's op and our Triton aligner give humming the same blocks: the
    same experts and slot sets per used block, the same padded total (the
    op may order slots within an expert differently, and sizes its buffers
    and fills its tail its own way: sentinel S, expert -1)."""
    from moebench.backends import vllm_align

    if hm.vllm_ops.reason("moe") is not None or hm._triton_align_kernel() is None:
        pytest.skip("needs vLLM's library and Triton")
    for rows, experts in ((1, 384), (5, 16), (8, 384), (8, 256)):
        ids = torch.stack([torch.randperm(experts)[:6] for _ in range(rows)]).to(torch.int32).cuda()
        s = ids.numel()
        v = vllm_align.AlignBuffers(*hm.align_block_size_vllm(ids, experts, block), block)
        t = vllm_align.AlignBuffers(*hm.align_block_size_triton(ids, experts, block), block)
        assert blocks_of(v, s) == blocks_of(t, s)
        assert v.sorted_ids.numel() == vllm_align.max_num_tokens_padded(s, experts, block)
        total = int(v.num_tokens_post_pad)
        assert bool((v.sorted_ids[total:] == s).all()) and bool((t.sorted_ids[total:] == s).all())


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
def test_vllm_aligner_gives_the_triton_aligners_output(prepared_cache, cls, monkeypatch):
    if hm.vllm_ops.reason("moe") is not None or hm._triton_align_kernel() is None:
        pytest.skip("needs vLLM's library and Triton")
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
    for rows in (1, 8):
        x = generate_activations(rows, shape.hidden, seed=21, device="cuda")
        ids, wts = hot_tiny_routing(rows, shape.top_k, 1.5, seed=21)
        outs = {}
        for how in ("vllm", "triton"):
            monkeypatch.setenv(hm.ALIGN_ENV, how)
            outs[how] = backend.forward(prepared, x, ids, wts).clone()
            assert backend.last_tactic.endswith(f"align={how}")
        err = relative_error(outs["vllm"], outs["triton"])
        print(
            f"{backend.name} rows={rows}: vllm vs triton aligner rel diff {err:.3e},"
            f" bit-identical: {torch.equal(outs['vllm'], outs['triton'])}"
        )
        _assert_same_function(backend, prepared, x, ids, wts, w, outs["vllm"], outs["triton"], err)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [hm.HummingW4A16Backend, hm.HummingW4A8Backend])
def test_stage_calls_rerun_the_forward(prepared_cache, cls):
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
    x = generate_activations(3, shape.hidden, seed=8, device="cuda")
    ids, wts = hot_tiny_routing(3, shape.top_k, 1.5, seed=8)
    want = backend.forward(prepared, x, ids, wts).clone()
    stages = backend.stage_calls(prepared, x, ids, wts)
    names = ["align", "quantize", "gemm1", "activation", "gemm2", "reduce", "finalize"]
    if cls is hm.HummingW4A16Backend:
        names.remove("quantize")
    assert [name for name, _ in stages] == names
    out = prepared.buffers[(3, shape.top_k)]["out"]
    out.fill_(float("nan"))
    for _, call in stages:
        call()
    torch.cuda.synchronize()
    _assert_same_function(backend, prepared, x, ids, wts, w, out.clone(), want, relative_error(out, want))


def _assert_same_function(backend, prepared, x, ids, wts, w, a, b, diff):
    """a and b (two runs of humming on the same inputs) compute the same
    function: within 1e-3 of each other where humming repeats itself bit for
    bit (W4A8), else (W4A16 on the H200: two eager calls on the same inputs
    differed by 5-8e-3, 2026-12-01 log 92cfcd5-gpu-tests-humming-align) each
    within the backend's gate of the fp64 oracle, whole output and per row."""
    again = backend.forward(prepared, x, ids, wts).clone()
    if torch.equal(again, backend.forward(prepared, x, ids, wts)):
        assert diff <= 1e-3
        return
    from moebench.reference import oracle_gate

    ref = reference_moe(x, ids, wts, w, activation=backend.oracle, dtype=torch.float64).output
    for out in (a, b):
        assert oracle_gate(out, ref, backend.tolerance)[2] is None
