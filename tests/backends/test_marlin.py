"""marlin-w4a16 (vLLM's fused Marlin MoE): availability, tactics, block size,
read bytes and input checks on the CPU; numerics vs the bf16 fp64 oracle on
the H200 (`gpu`; needs only the two vllm bundles, vllm-moe and vllm-c).

Tolerance 1e-2 (oracle "bf16": x BF16, H rounded to BF16 by Marlin, the
router weights applied in GEMM2 before the BF16 top-k sum), each output row
within 2e-2.
"""

import os
import subprocess
import sys

import pytest
import torch
from baseline_checks import (
    EXPERTS,
    HOT,
    TINY,
    baseline_cases,
    hot_tiny_routing,
    tiny_expert_alone_error,
    tiny_weights,
)

from moebench.backends import marlin as mb
from moebench.backends import vllm_ops
from moebench.backends.marlin_layout import marlin_expert_bytes
from moebench.backends.registry import available_backends, backend_names, load_backend
from moebench.bench.cases import unique_bytes
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error

TOL = 1e-2
ROW_TOL = 2 * TOL


# --- CPU -------------------------------------------------------------------------------------


def test_import_never_needs_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import torch\n"
        "import moebench.backends.marlin as m\n"
        "print(m.MarlinW4A16Backend.oracle, m.MarlinW4A16Backend.name)\n"
        "print(hasattr(torch.ops._moe_C, 'moe_sum'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["bf16 marlin-w4a16", "False"]  # nothing loaded at import


def test_registered():
    assert "marlin-w4a16" in backend_names()
    assert isinstance(load_backend("marlin-w4a16"), mb.MarlinW4A16Backend)
    reason = available_backends("cpu")["marlin-w4a16"]
    assert isinstance(reason, str) and "CUDA" in reason


def test_unavailable_reasons(monkeypatch):
    backend = mb.MarlinW4A16Backend()
    assert "CUDA" in backend.unavailable_reason("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    assert "sm_80" in backend.unavailable_reason("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reasons = {"moe": "no moe library here", "c": "no c library here"}
    monkeypatch.setattr(vllm_ops, "reason", lambda which: reasons[which])
    assert backend.unavailable_reason("cuda:0") == "no moe library here"
    reasons["moe"] = None
    assert backend.unavailable_reason("cuda:0") == "no c library here"  # both libraries are needed
    reasons["c"] = None
    assert backend.unavailable_reason("cuda:0") is None


def test_tactics():
    backend = mb.MarlinW4A16Backend()
    shape = get_preset("dsv41-flash").shard(4)
    assert backend.valid_tactics(shape) == ("default", "ep")  # vLLM's TP path, its expert-map path
    with pytest.raises(ValueError, match="tactic 'fast' is not valid for backend 'marlin-w4a16'"):
        backend.prepare(
            generate_expert_weights(get_preset("dsv4-flash", experts=8, hidden=256, intermediate=128).shard(1)),
            get_preset("dsv4-flash", experts=8, hidden=256, intermediate=128).shard(1),
            "fast",
        )


def test_block_size_follows_vllms_rule():
    # M * top_k / E / block < 0.9 picks the first of 8, 16, 32, 48, 64
    assert mb.block_size_m(1, 6, 384) == 8 and mb.block_size_m(8, 6, 384) == 8
    assert mb.block_size_m(8, 6, 16) == 8  # 48 / 16 / 8 = 0.375
    assert mb.block_size_m(8, 6, 4) == 16  # 1.5 at 8, 0.75 at 16
    assert mb.block_size_m(8, 6, 2) == 32  # 3.0, 1.5, 0.75
    assert mb.block_size_m(6, 6, 1) == 48  # 36: 4.5, 2.25, 1.125, then 0.75 at 48
    assert mb.block_size_m(64, 8, 2) == 64  # never below 0.9: the last
    # with global experts: M = ceil(rows * local / global)
    assert mb.block_size_m(8, 6, 4, global_experts=8) == 8  # M = 4: 24 / 4 / 8 = 0.75
    assert mb.block_size_m(8, 6, 16, global_experts=17) == 8
    with pytest.raises(ValueError, match="rows"):
        mb.block_size_m(0, 6, 16)


def test_block_size_hand_check_of_the_48_case():
    # 9 rows, top 6, 2 experts: 27 slots per expert -> 3.375 at 8, 1.69 at 16, 0.84 at 32
    assert 9 * 6 / 2 / 32 < 0.9 and mb.block_size_m(9, 6, 2) == 32


@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv4-flash", 1), ("dsv4-pro", 8)])
def test_read_bytes(preset, tp):
    backend = mb.MarlinW4A16Backend()
    shape = get_preset(preset).shard(tp)
    ids = torch.tensor([[0, 1, 1, -1, 7, shape.experts + 3], [7, 2, 3, 0, 1, 4]], dtype=torch.int32)
    touched = 6  # 0, 1, 2, 3, 4, 7
    h, ip = shape.hidden, shape.padded_intermediate
    per_expert = 2 * ip * h // 2 + 2 * ip * h // 32 + h * ip // 2 + h * ip // 32
    assert backend.read_bytes(shape, ids) == touched * per_expert + 2 * 2 * h * 2
    assert marlin_expert_bytes(h, ip) == per_expert
    logical = unique_bytes(shape, ids)
    assert backend.read_bytes(shape, ids) >= logical
    if shape.intermediate == ip:  # nothing padded: Marlin reads the logical bytes
        assert backend.read_bytes(shape, ids) == logical
    assert backend.prepared_bytes(shape) == shape.experts * per_expert
    with pytest.raises(ValueError, match=r"topk_ids must be a \[rows, 6\] tensor"):
        backend.read_bytes(shape, ids.reshape(-1))


def _small_shape():
    return get_preset("dsv4-flash", experts=8, hidden=256, intermediate=128).shard(1)


def test_prepare_refuses_before_touching_the_gpu(monkeypatch):
    backend = mb.MarlinW4A16Backend()
    monkeypatch.setattr(backend, "unavailable_reason", lambda device: None)
    shape = _small_shape()
    w = generate_expert_weights(shape)
    w.clamp[1] = 7.0
    with pytest.raises(ValueError, match="one SwiGLU limit"):
        backend.prepare(w, shape)
    odd = get_preset("dsv4-flash", experts=8, hidden=384, intermediate=128).shard(1)
    with pytest.raises(ValueError, match="multiple of 256"):
        backend.prepare(generate_expert_weights(odd), odd)
    with pytest.raises(ValueError, match="do not match"):
        backend.prepare(generate_expert_weights(odd), shape)
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        mb.MarlinW4A16Backend().prepare(generate_expert_weights(shape), shape)


def _fake_prepared():
    dev = torch.device("cpu")
    return mb.MarlinPrepared(
        weights=None, hidden=256, intermediate=128, padded_intermediate=128, experts=8, top_k=6, clamp_limit=10.0,
        workspace=torch.zeros(4, dtype=torch.int32, device=dev), expert_map=torch.zeros(9, dtype=torch.int32),
    )  # fmt: skip


def test_forward_checks_inputs_by_name():
    backend = mb.MarlinW4A16Backend()
    p = _fake_prepared()
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, 6, dtype=torch.int32)
    w = torch.zeros(2, 6)
    with pytest.raises(TypeError, match="prepared must come from MarlinW4A16Backend.prepare"):
        backend.forward(object(), x, ids, w)
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        backend.forward(p, x.float(), ids, w)
    with pytest.raises(TypeError, match="topk_ids must be torch.int32"):
        backend.forward(p, x, ids.long(), w)
    with pytest.raises(ValueError, match=r"x must be \[rows, 256\]"):
        backend.forward(p, torch.zeros(2, 128, dtype=torch.bfloat16), ids, w)
    with pytest.raises(ValueError, match="contiguous"):
        backend.forward(p, x, torch.zeros(6, 2, dtype=torch.int32).t(), w)
    with pytest.raises(ValueError, match="at least one row"):
        backend.forward(p, x[:0], ids[:0], w[:0])


def test_kernel_tactics_names_block_and_flags():
    p = _fake_prepared()
    text = mb.MarlinW4A16Backend().kernel_tactics(p, 8)
    assert text.startswith("block_m=8,") and "fp32_reduce=1" in text and text.endswith("path=tp")
    assert mb.MarlinW4A16Backend().kernel_tactics(p, 8, top_k=6) == text
    p.ep = True
    assert mb.MarlinW4A16Backend().kernel_tactics(p, 8).endswith("path=ep (expert_map)")


def test_flat_view_is_vllms_resize_cache():
    buf = torch.arange(24.0)
    v = mb._flat_view(buf, 2, 5)
    assert v.shape == (2, 5) and v.data_ptr() == buf.data_ptr() and v[1, 0] == 5


# --- GPU -------------------------------------------------------------------------------------

#: every preset at TP 1, 4 and 8; MOEBENCH_BASELINE_CASES="dsv41-flash:4,dsv4-pro:1" narrows it.
CASES = baseline_cases((1, 4, 8))


def _backend():
    backend = mb.MarlinW4A16Backend()
    reason = backend.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    return backend


def _prepared(cache, preset, tp, experts=EXPERTS, tactic="default"):
    key = (preset, tp, experts, tactic)
    if key not in cache:
        cache.clear()
        torch.cuda.empty_cache()
        backend = _backend()
        shape, w = tiny_weights(preset, tp, experts)
        cache[key] = (backend, shape, w, backend.prepare(w, shape, tactic))
    return cache[key]


def _poison(prepared):
    """NaN into every per-call buffer (outputs and intermediate caches), -7 into the align buffers."""
    for buf in prepared.buffers.values():
        for name in ("cache1", "cache2", "cache3", "fused", "out"):
            buf[name].fill_(float("nan"))
        for t in buf["align"].as_tuple():
            t.fill_(-7)


def _check_rows(out, ref, label):
    err = relative_error(out, ref)
    rows = [relative_error(out[r], ref[r]) for r in range(out.shape[0])]
    print(f"{label}: rel err {err:.3e}, worst row {max(rows):.3e}")
    assert err <= TOL, f"{label}: rel err {err:.3e} > {TOL}"
    assert max(rows) <= ROW_TOL, f"{label}: row errors {[f'{e:.2e}' for e in rows]} (> {ROW_TOL})"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", CASES)
def test_matches_oracle(prepared_cache, preset, tp):
    backend, shape, w, prepared = _prepared(prepared_cache, preset, tp)
    for rows in range(1, 9):
        x = generate_activations(rows, shape.hidden, seed=100 + rows, device="cuda")
        ids, wts = hot_tiny_routing(rows, shape.top_k, shape.routed_scaling_factor, seed=rows)
        backend.forward(prepared, x, ids, wts)  # buffers exist: poison them, then the measured call
        _poison(prepared)
        out = backend.forward(prepared, x, ids, wts).clone()
        ref = reference_moe(x, ids, wts, w, activation="bf16").output
        _check_rows(out, ref, f"{shape.describe()} rows={rows} ({backend.last_tactic})")
        assert backend.last_tactic.startswith("block_m=")


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 8), ("dsv4-flash", 4)])
def test_matches_oracle_with_all_experts(prepared_cache, preset, tp):
    """The real expert count (256 / 384): vLLM's align op takes its two-kernel
    path (E > 64), not the small-batch kernel the 16-expert cases use."""
    backend, shape, w, prepared = _prepared(prepared_cache, preset, tp, experts=None)
    g = torch.Generator().manual_seed(tp)
    for rows in (1, 5, 8):
        x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
        ids = torch.stack([torch.randperm(shape.experts, generator=g)[: shape.top_k] for _ in range(rows)])
        ids = ids.to(torch.int32).cuda()
        wts = (torch.rand(rows, shape.top_k, generator=g) + 0.1).cuda()
        backend.forward(prepared, x, ids, wts)
        _poison(prepared)
        out = backend.forward(prepared, x, ids, wts).clone()
        ref = reference_moe(x, ids, wts, w, activation="bf16").output
        _check_rows(out, ref, f"{shape.describe()} rows={rows} all experts")


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", CASES)
def test_tiny_scale_expert_alone(prepared_cache, preset, tp):
    """The expert whose scales are 2^-20 of the others (small E8M0 codes through
    Marlin's scale path), alone at rows 4; relative error is scale-free."""
    backend, shape, w, prepared = _prepared(prepared_cache, preset, tp)
    x = generate_activations(4, shape.hidden, seed=4, device="cuda")
    assert tiny_expert_alone_error(backend, prepared, shape, w, x, TINY) <= TOL


@pytest.mark.gpu
def test_one_expert_in_every_row(prepared_cache):
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", 4)
    for rows in (1, 8):
        x = generate_activations(rows, shape.hidden, seed=9, device="cuda")
        ids = torch.full((rows, shape.top_k), HOT, dtype=torch.int32)
        ids[:, 1:] = torch.arange(1, shape.top_k, dtype=torch.int32) + 6  # HOT plus the same five others
        ids = ids.cuda()
        wts = torch.full((rows, shape.top_k), 1.5 / shape.top_k, device="cuda")
        backend.forward(prepared, x, ids, wts)
        _poison(prepared)
        out = backend.forward(prepared, x, ids, wts).clone()
        _check_rows(out, reference_moe(x, ids, wts, w, activation="bf16").output, f"hot rows={rows}")


@pytest.mark.gpu
def test_non_local_ids_contribute_nothing(prepared_cache):
    """Tactic "ep" (vLLM's expert-map path): ids of other ranks' experts add nothing."""
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", 4, tactic="ep")
    x = generate_activations(5, shape.hidden, seed=3, device="cuda")
    ids, wts = hot_tiny_routing(5, shape.top_k, 1.5, seed=3)
    masked = ids.clone()
    masked[:, -2:] = torch.tensor([-1, EXPERTS + 3], dtype=torch.int32)
    masked[3, :] = torch.tensor([-1, -5, EXPERTS, EXPERTS + 1, 1 << 20, -(1 << 20)], dtype=torch.int32)
    backend.forward(prepared, x, masked, wts)
    _poison(prepared)
    out = backend.forward(prepared, x, masked, wts).clone()
    kept = torch.where((masked >= 0) & (masked < EXPERTS), wts, torch.zeros_like(wts))
    ref = reference_moe(x, ids, kept, w, activation="bf16").output
    assert bool((out[3] == 0).all()), "a row with no local expert must be exactly zero"
    keep = [0, 1, 2, 4]
    _check_rows(out[keep], ref[keep], "non-local ids")


@pytest.mark.gpu
def test_graph_capture_replays_the_eager_result(prepared_cache):
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", 4)
    x = generate_activations(6, shape.hidden, seed=5, device="cuda")
    ids, wts = hot_tiny_routing(6, shape.top_k, 1.5, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [backend.forward(prepared, x, ids, wts).clone() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(prepared, x, ids, wts)
    _poison(prepared)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_moe(x, ids, wts, w, activation="bf16").output
    deterministic = torch.equal(eager[1], eager[2])
    print(
        f"replay rel err {relative_error(out, ref):.3e}, eager calls bit-identical: {deterministic},"
        f" replay == eager: {torch.equal(out, eager[-1])}"
    )
    if deterministic:
        assert torch.equal(out, eager[-1])
    _check_rows(out, ref, "graph replay")
    # new routing into the same captured buffers: the replay follows the device-side ids
    ids2, wts2 = hot_tiny_routing(6, shape.top_k, 1.5, seed=55)
    ids.copy_(ids2)
    wts.copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    _check_rows(out, reference_moe(x, ids2, wts2, w, activation="bf16").output, "graph replay, new routing")


@pytest.mark.gpu
def test_stage_calls_rerun_the_forward(prepared_cache):
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", 4)
    x = generate_activations(3, shape.hidden, seed=8, device="cuda")
    ids, wts = hot_tiny_routing(3, shape.top_k, 1.5, seed=8)
    want = backend.forward(prepared, x, ids, wts).clone()
    deterministic = torch.equal(backend.forward(prepared, x, ids, wts), want)
    stages = backend.stage_calls(prepared, x, ids, wts)
    assert [name for name, _ in stages] == ["align", "gemm1", "activation", "gemm2", "reduce", "finalize"]
    _poison(prepared)
    for _, call in stages:
        call()
    torch.cuda.synchronize()
    got = prepared.buffers[(3, shape.top_k)]["out"]
    if deterministic:
        assert torch.equal(got, want)
    assert relative_error(got, want) <= 1e-3


@pytest.mark.gpu
def test_read_bytes_of_device_ids(prepared_cache):
    backend, shape, _, _ = _prepared(prepared_cache, "dsv41-flash", 4)
    ids, _ = hot_tiny_routing(4, shape.top_k, 1.5, seed=1)
    touched = len(set(ids.flatten().tolist()))
    assert backend.read_bytes(shape, ids) == (
        touched * marlin_expert_bytes(shape.hidden, shape.padded_intermediate) + 2 * 4 * shape.hidden * 2
    )


def test_gpu_tests_need_only_the_vllm_bundles():
    """What this module and the backend import pulls in: neither the CuTe DSL
    nor humming / FlashInfer (the GPU run carries only the vllm bundles)."""
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests/backends')\n"
        "import tests.backends.test_marlin\n"
        "print(sorted(m for m in ('cutlass', 'humming', 'flashinfer', 'vllm') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
