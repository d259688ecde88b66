"""Each peer runs what vLLM 0.26.0 runs on its TP path, launch for launch
(the backends' LAUNCHES tables; docs/baselines.md prints them).

CPU: a forward of each peer with its libraries replaced by recorders (vLLM's
ops, humming's methods, triton_kernels' matmul, our Triton ports) and every
torch op it dispatches recorded (`_Recorder`: views and allocations are not
launches); the recorded list must be the table's, in order. The "ep" tactic
(vLLM's expert-map path) adds its remap launches ahead. triton_kernels'
routing (make_routing_data's ten launches) runs only on a GPU: on the CPU it
is one recorded call.

GPU (`gpu`): the CUDA kernels (memsets and copies included) one forward
launches, counted by torch's profiler after a warm-up, equal each table's
length (the names printed), at 16 experts: vLLM's align op launches one
kernel up to 64 experts and two above (its own choice, the same op in vLLM),
so the tables count it as one launch.
"""

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moebench.backends import humming as hm
from moebench.backends import marlin as mb
from moebench.backends import triton_mxfp4 as tm
from moebench.backends import vllm_triton

#: torch ops that launch nothing: allocations, and the host tensor a Python scalar argument is
#: wrapped in (scalar_tensor); views are OpOverload.is_view.
NOT_LAUNCHES = {"empty", "empty_strided", "new_empty", "lift_fresh", "detach", "scalar_tensor"}


class _Recorder(TorchDispatchMode):
    """Records "aten.<op>" for every dispatched torch op that launches a kernel,
    into `calls` (shared with the fake libraries' recorders)."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_LAUNCHES:
            self.calls.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _names(table) -> list[str]:
    """A LAUNCHES table's launch names without their "(...)" notes."""
    return [launch.split(" (")[0] for _, launch, _ in table]


def _extras_name_rows(table, extra) -> bool:
    """Each extra kernel (row, what) names a launch of the table, as written
    there (with its "(...)" note)."""
    rows = {launch for _, launch, _ in table}
    return all(row in rows for row, _ in extra)


def test_triton_extra_kernels_name_rows_of_its_table():
    """triton's EXTRA_KERNELS (the kernels three of its torch ops launch
    inside them) each belong to a row of LAUNCHES; a typo or a moved row
    fails here, on the CPU, not only in the GPU kernel count."""
    assert _extras_name_rows(tm.LAUNCHES, tm.EXTRA_KERNELS)
    assert not _extras_name_rows(tm.LAUNCHES, (("aten.index", "no note: not a row as written"),))


def _recorded(call) -> list[str]:
    calls: list[str] = []
    _RECORDS.append(calls)
    try:
        with _Recorder(calls):
            call()
    finally:
        _RECORDS.pop()
    return calls


_RECORDS: list[list[str]] = []


def _record(name: str, result=None):
    """A fake library function: appends `name` to the current recording, returns `result(*args)`."""

    def fn(*args, **kwargs):
        if _RECORDS:
            _RECORDS[-1].append(name)
        return result(*args, **kwargs) if result else None

    return fn


ROWS, TOP_K, H, I, E = 3, 6, 64, 32, 8


def _inputs():
    x = torch.randn(ROWS, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 6, 5, 4, 3, 2], [1, 3, 5, 7, 0, 2]], dtype=torch.int32)
    return x, ids, torch.rand(ROWS, TOP_K)


# --- Marlin ----------------------------------------------------------------------------------


def _marlin(ep: bool):
    moe = types.SimpleNamespace(
        moe_align_block_size=_record("moe_align_block_size"),
        moe_wna16_marlin_gemm=_record("moe_wna16_marlin_gemm"),
        moe_sum=_record("moe_sum"),
    )
    c = types.SimpleNamespace(silu_and_mul_with_clamp=_record("silu_and_mul_with_clamp"))
    w = types.SimpleNamespace(w13=None, w13_scale=None, w2=None, w2_scale=None)
    return mb.MarlinPrepared(
        weights=w, hidden=H, intermediate=I, padded_intermediate=I, experts=E, top_k=TOP_K, clamp_limit=10.0,
        workspace=torch.zeros(8, dtype=torch.int32), expert_map=torch.arange(E + 1, dtype=torch.int32),
        ops_moe=moe, ops_c=c, ep=ep,
    )  # fmt: skip


@pytest.mark.parametrize("ep", [False, True])
def test_marlin_launches_are_vllms(ep):
    backend, prepared, (x, ids, wts) = mb.MarlinW4A16Backend(), _marlin(ep), _inputs()
    backend.forward(prepared, x, ids, wts)  # buffers allocated
    got = _recorded(lambda: backend.forward(prepared, x, ids, wts))
    assert got == _names(mb.LAUNCHES_EP if ep else mb.LAUNCHES)


# --- humming ---------------------------------------------------------------------------------


def _fake_humming(monkeypatch):
    class HummingMethod:
        @staticmethod
        def may_quant_input(layer, inputs, quanted_input=None, sublayer_name=None):
            if layer.a8:  # W4A16's hands the input back: no kernel
                _record("humming.may_quant_input")()
            return inputs, None

        forward_layer = staticmethod(_record("humming.forward_layer"))

    layer = types.ModuleType("humming.layer")
    layer.HummingMethod = HummingMethod
    package = types.ModuleType("humming")
    package.layer = layer
    monkeypatch.setitem(sys.modules, "humming", package)
    monkeypatch.setitem(sys.modules, "humming.layer", layer)
    aligned = (torch.zeros(64, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(hm, "_aligner", lambda device: (_record("moe_align_block_size", lambda *a: aligned), "vllm"))
    monkeypatch.setattr(vllm_triton, "swiglu_limit", _record("swiglu_limit"))
    monkeypatch.setattr(vllm_triton, "moe_fused_mul_sum", _record("moe_fused_mul_sum"))


@pytest.mark.parametrize("mode", ["w4a16", "w4a8"])
@pytest.mark.parametrize("ep", [False, True])
def test_humming_launches_are_vllms(monkeypatch, mode, ep):
    _fake_humming(monkeypatch)
    backend = hm.HummingW4A8Backend() if mode == "w4a8" else hm.HummingW4A16Backend()
    configs = [[0, 48, {"block_shape": [16, 256, 64]}]]
    prepared = hm.HummingPrepared(
        layer=types.SimpleNamespace(locks=torch.zeros(1), a8=mode == "w4a8"),
        tuning={"w13": (configs, "w13"), "w2": (configs, "w2")}, limit=10.0, hidden=H, intermediate=I,
        experts=E, top_k=TOP_K, mode=mode, ep=ep,
    )  # fmt: skip
    x, ids, wts = _inputs()
    backend.forward(prepared, x, ids, wts)
    got = _recorded(lambda: backend.forward(prepared, x, ids, wts))
    assert got == _names((hm.EP_REMAP if ep else ()) + hm.LAUNCHES[mode])


def _humming_prepared(mode: str, w2_block: list[int]) -> hm.HummingPrepared:
    """A HummingPrepared over _fake_humming's layer (`mode` "w4a16" or
    "w4a8"): w13 tuned to block [16, 256, 64] for up to 48 rows, w2 to `w2_block`."""
    return hm.HummingPrepared(
        layer=types.SimpleNamespace(locks=torch.zeros(1), a8=mode == "w4a8"),
        tuning={"w13": ([[0, 48, {"block_shape": [16, 256, 64]}]], ""),
                "w2": ([[0, 48, {"block_shape": w2_block}]], "")},
        limit=10.0, hidden=H, intermediate=I, experts=E, top_k=TOP_K, mode=mode,
    )  # fmt: skip


def test_humming_aligns_once_for_both_gemms(monkeypatch):
    """vLLM aligns at w13's block_m and hands the same sorted ids to GEMM2,
    whatever w2's own tuning config says."""
    _fake_humming(monkeypatch)
    seen = []
    monkeypatch.setattr(sys.modules["humming.layer"].HummingMethod, "forward_layer",
                        staticmethod(lambda layer, a, **kw: seen.append((kw["sublayer_name"], kw["sorted_ids"]))))  # fmt: skip
    prepared = _humming_prepared("w4a16", w2_block=[64, 128, 64])
    hm.HummingW4A16Backend().forward(prepared, *_inputs())
    assert [s for s, _ in seen] == ["w13", "w2"] and seen[0][1] is seen[1][1]


def test_humming_reduce_keeps_the_weights_fp32(monkeypatch):
    _fake_humming(monkeypatch)
    got = []
    monkeypatch.setattr(vllm_triton, "moe_fused_mul_sum", lambda rows, w, out, *a: got.append(w))
    prepared = _humming_prepared("w4a8", w2_block=[16, 256, 64])
    x, ids, wts = _inputs()
    hm.HummingW4A8Backend().forward(prepared, x, ids, wts)
    assert got[0] is wts and got[0].dtype == torch.float32


# --- triton_kernels --------------------------------------------------------------------------


def _fake_triton(monkeypatch, ep: bool):
    gather = types.SimpleNamespace(dst_indx=torch.arange(ROWS * TOP_K), src_indx=torch.arange(ROWS * TOP_K))
    routing = types.SimpleNamespace(gate_scal=None, n_expts_act=TOP_K)
    glue = types.ModuleType("moebench.backends.triton_mxfp4_glue")
    glue.local_ids = _record("remap_topk_to_local", lambda ids, e: ids)
    glue.make_routing_data = _record("make_routing_data", lambda *a: (routing, gather, gather))
    glue.masked_topk_sum = _record("masked_moe_sum")
    matmul = types.ModuleType("triton_kernels.matmul_ogs")
    matmul.matmul_ogs = _record("matmul_ogs")
    monkeypatch.setitem(sys.modules, "moebench.backends.triton_mxfp4_glue", glue)
    monkeypatch.setitem(sys.modules, "triton_kernels", types.ModuleType("triton_kernels"))
    monkeypatch.setitem(sys.modules, "triton_kernels.matmul_ogs", matmul)
    monkeypatch.setattr(torch.ops._C, "silu_and_mul_with_clamp", _record("silu_and_mul_with_clamp"), raising=False)
    return tm.TritonMxfp4Prepared(
        w13=None, w2=None, w13_precision=None, w2_precision=None, limit=10.0, hidden=H, intermediate=I,
        experts=E, top_k=TOP_K, device=torch.device("cpu"), ep=ep,
    )  # fmt: skip


@pytest.mark.parametrize("ep", [False, True])
def test_triton_launches_are_vllms(monkeypatch, ep):
    prepared = _fake_triton(monkeypatch, ep)
    backend = tm.TritonMxfp4Backend()
    x, ids, wts = _inputs()
    backend.forward(prepared, x, ids, wts)
    got = _recorded(lambda: backend.forward(prepared, x, ids, wts))
    table = tm.LAUNCHES_EP if ep else tm.LAUNCHES
    # make_routing_data's launches are Triton's (GPU only): one recorded call here
    routed = [n for (stage, _, _), n in zip(table, _names(table)) if stage != "route" or n == "remap_topk_to_local"]
    want = routed[:1] + ["make_routing_data"] + routed[1:] if ep else ["make_routing_data", *routed]
    assert got == want


def test_tables_cite_the_wheel_and_the_docs_print_them():
    """Every launch names where vLLM runs it (or says it is ours), and
    docs/baselines.md has a row per launch of every table."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "baselines.md").read_text()
    tables = {"marlin-w4a16": mb.LAUNCHES, "humming-w4a16": hm.LAUNCHES["w4a16"],
              "humming-w4a8": hm.LAUNCHES["w4a8"], "triton-mxfp4": tm.LAUNCHES}  # fmt: skip
    for name, table in tables.items():
        for stage, launch, where in table:
            assert ".py:" in where, f"{name}: {launch} cites no file:line"
            assert f"| {stage} | `{launch}` | {where} |" in doc, f"docs/baselines.md lacks {name}'s row {launch}"


# --- GPU: the kernels one forward launches ---------------------------------------------------


def _kernels_of(call) -> list[str]:
    """CUDA kernel (and memcpy/memset) names one `call` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("name,table,extra", [("marlin-w4a16", mb.LAUNCHES, ()), ("humming-w4a16", hm.LAUNCHES["w4a16"], ()),
                                              ("humming-w4a8", hm.LAUNCHES["w4a8"], ()),
                                              ("triton-mxfp4", tm.LAUNCHES, tm.EXTRA_KERNELS)])  # fmt: skip
def test_gpu_kernel_count_is_the_tables(name, table, extra):
    """The kernels one forward launches: one per table row, plus the kernels
    a row's torch op launches inside it (`extra`, e.g. triton's
    EXTRA_KERNELS), each named for the row it belongs to."""
    from baseline_checks import hot_tiny_routing, tiny_weights

    from moebench.backends.registry import load_backend
    from moebench.formats import generate_activations

    backend = load_backend(name)
    reason = backend.unavailable_reason("cuda")
    if reason is None and name.startswith("humming"):  # the table's align is vLLM's op, not our fallbacks
        from moebench.backends import vllm_ops

        reason = vllm_ops.reason("moe")
    if reason is not None:
        pytest.skip(reason)
    shape, w = tiny_weights("dsv41-flash", 4)
    prepared = backend.prepare(w, shape)
    x = generate_activations(4, shape.hidden, seed=1, device="cuda")
    ids, wts = hot_tiny_routing(4, shape.top_k, 1.5, seed=1)
    for _ in range(2):  # compiles (NVRTC, Triton) and buffers
        backend.forward(prepared, x, ids, wts)
    kernels = _kernels_of(lambda: backend.forward(prepared, x, ids, wts))
    print(f"{name}: {len(kernels)} launches, table {len(table)} + {len(extra)}:\n  " + "\n  ".join(kernels))
    assert _extras_name_rows(table, extra), f"{name}: an extra kernel names no table row: {extra}"
    want = len(table) + len(extra)
    assert len(kernels) == want, f"{name}: {len(kernels)} launches {kernels}, the table has {len(table)} + {len(extra)}"
