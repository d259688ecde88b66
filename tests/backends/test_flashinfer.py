"""FlashInfer baselines: availability without the package / a GPU (CPU), and
numerics vs the matching fp64 oracle on the H200 (`gpu`).

W4A16 (oracle "bf16"): relative Frobenius error <= 1e-2 (docs/design.md).
W4A8 / humming mode (oracle "fp8_token"): <= 3e-2. The oracle quantizes x and
H per token to e4m3 exactly as the kernel should, so a faithful kernel differs
from it only by (a) e4m3 roundings that land on the other side of a rounding
boundary (the kernel's H is an fp32 sum in another order, its per-token scale
may be computed as a reciprocal): each such element moves by one e4m3 step
(<= 1/16 of itself) and (b) FlashInfer's clamp of every expert's E8M0 scales to
11 binades below its largest (the payload of blocks below that is rewritten,
their contribution is < 2^-11 of the expert's largest block). Both are well
under 1 %; 3e-2 leaves room for them while staying below the ~4 % that
unquantized (BF16) activations would show against this oracle, so the bound
still tells "quantizes like the oracle" from "does not".
"""

import importlib.util
import subprocess
import sys

import pytest
import torch
from baseline_checks import (
    EXPERTS,
    TINY,
    baseline_cases,
    hot_tiny_routing,
    replay_into_nan,
    tiny_expert_alone_error,
    tiny_weights,
)
import sm90_layouts as L

from moebench.backends import flashinfer as fi_backend
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error

TOLERANCE = {"bf16": 1e-2, "fp8_token": 3e-2}
MODES = [fi_backend.FlashInferW4A16Backend, fi_backend.FlashInferW4A8Backend]


# --- CPU -------------------------------------------------------------------------------------


def test_import_never_needs_flashinfer():
    """Importing the module (and asking for a reason) works when `import flashinfer` fails."""
    code = (
        "import sys; sys.modules['flashinfer'] = None\n"
        "import moebench.backends.flashinfer as m\n"
        "print(m.FlashInferW4A16Backend.oracle, m.FlashInferW4A8Backend.oracle)\n"
        "print(m.FlashInferW4A16Backend().unavailable_reason('cpu'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "bf16 fp8_token"


@pytest.mark.parametrize("cls", MODES)
def test_unavailable_without_gpu_or_package(cls, monkeypatch):
    backend = cls()
    reason = backend.unavailable_reason("cpu")
    assert isinstance(reason, str) and "CUDA" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    reason = backend.unavailable_reason("cuda:0")
    assert isinstance(reason, str) and "flashinfer" in reason


def test_unavailable_on_other_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "B200")
    reason = fi_backend.FlashInferW4A16Backend().unavailable_reason("cuda:0")
    assert "sm_90" in reason and "sm_100" in reason


def test_module_kind_reads_the_marker(tmp_path, monkeypatch):
    d = tmp_path / "aot"
    monkeypatch.setattr(fi_backend, "_aot_module_dir", lambda: d)
    assert fi_backend.module_kind() is None
    d.mkdir()
    (d / "fused_moe_90.so").write_bytes(b"")
    assert fi_backend.module_kind() == "full"
    (d / "MODULE").write_text("fused_moe_90_w4a16only.stripped.so\n")
    assert fi_backend.module_kind() == "w4a16"
    (d / "MODULE").write_text("fused_moe_90_fp4only.stripped.so\n")
    assert fi_backend.module_kind() == "fp4"


def test_scale_fold_matches_flashinfer_when_installed():
    prep = pytest.importorskip("flashinfer.fused_moe")
    s = torch.randint(0, 256, (2, 128, 40), dtype=torch.uint8)
    assert torch.equal(prep.interleave_moe_scales_for_sm90_mixed_gemm(s), L.interleave_scales(s))


# --- GPU -------------------------------------------------------------------------------------

#: every preset at TP 1, 4 and 8; MOEBENCH_BASELINE_CASES="dsv41-flash:4,dsv4-pro:1" narrows it
#: (each case costs FlashInfer's autotuning of 8 row counts on the device).
CASES = baseline_cases((1, 4, 8))
ROWS = tuple(range(1, 9))


def _backend(cls):
    backend = cls()
    reason = backend.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    return backend


def _prepared(cache, cls, preset, tp):
    key = (cls.name, preset, tp)
    if key not in cache:
        cache.clear()
        torch.cuda.empty_cache()
        backend = _backend(cls)
        shape, w = tiny_weights(preset, tp)
        cache[key] = (backend, shape, w, backend.prepare(w, shape))
    return cache[key]


def _environment() -> str:
    """What the smoke test prints first: the package, the module in the AOT slot, the env."""
    import os

    try:
        import flashinfer

        version = getattr(flashinfer, "__version__", "?")
    except Exception as error:  # noqa: BLE001 - printed, not raised
        version = f"import failed: {type(error).__name__}: {error}"
    return (
        f"flashinfer {version}; module {fi_backend.module_kind()} in {fi_backend._aot_module_dir()};"
        f" FLASHINFER_DISABLE_JIT={os.environ.get('FLASHINFER_DISABLE_JIT')!r}"
        f" LD_BIND_NOW={os.environ.get('LD_BIND_NOW')!r}; torch {torch.__version__} CUDA {torch.version.cuda}"
    )


def _smoke_one(cls) -> str | None:
    """One small prepare + forward of `cls` (dsv41-flash TP8 at 16 experts,
    rows 2) against its oracle; prints each step and returns what failed
    (with the traceback's last lines), or None."""
    import traceback

    backend = cls()
    reason = backend.unavailable_reason("cuda")
    print(f"{backend.name}: unavailable_reason = {reason!r}")
    if reason is not None:
        return f"{backend.name} unavailable: {reason}"
    try:
        shape, w = tiny_weights("dsv41-flash", 8)
        prepared = backend.prepare(w, shape)
        print(f"{backend.name}: prepared {shape.describe()}")
        x = generate_activations(2, shape.hidden, seed=2, device="cuda")
        ids, wts = hot_tiny_routing(2, shape.top_k, shape.routed_scaling_factor, seed=2)
        out = backend.forward(prepared, x, ids, wts).clone()
        torch.cuda.synchronize()
        err = relative_error(out, reference_moe(x, ids, wts, w, activation=backend.oracle).output)
        print(f"{backend.name}: rows 2 rel err {err:.3e} vs the {backend.oracle} oracle ({backend.last_tactic})")
        if not err <= TOLERANCE[backend.oracle]:
            return f"{backend.name}: rel err {err:.3e} > {TOLERANCE[backend.oracle]}"
    except Exception as error:  # noqa: BLE001 - the smoke test reports every mode
        text = "".join(traceback.format_exception(error)[-6:])
        print(f"{backend.name} FAILED:\n{text}")
        return f"{backend.name}: {type(error).__name__}: {error}"
    return None


@pytest.mark.gpu
def test_smoke_both_modes_load_and_run():
    """The first call with a new bundle: the environment, each mode's
    availability, one small forward against its oracle; every mode is tried
    and every failure printed before the test fails (run with -s)."""
    print(_environment())
    failures = [f for f in (_smoke_one(cls) for cls in MODES) if f]
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_weight_interleave_matches_flashinfer_kernel():
    _backend(fi_backend.FlashInferW4A16Backend)
    from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm as ilw

    w = torch.randint(0, 256, (3, 1280, 2560), dtype=torch.uint8, device="cuda")
    assert torch.equal(ilw(w, "fp4"), L.interleave_fp4_weights(w))
    if fi_backend.module_kind() != "w4a16":
        assert torch.equal(ilw(w, "fp4_fp8"), L.interleave_fp4_fp8_weights(w))


def _graph_equals_eager(backend, prepared, x, ids, wts) -> None:
    """A CUDA graph of forward (rows already tuned) replays the eager result
    into its output, poisoned with NaN first."""
    eager = backend.forward(prepared, x, ids, wts).clone()
    out = replay_into_nan(lambda: backend.forward(prepared, x, ids, wts))
    assert torch.equal(out, eager), f"{backend.name}: the graph replay differs from the eager call"


@pytest.mark.gpu
@pytest.mark.parametrize("cls", MODES)
@pytest.mark.parametrize("preset,tp", CASES)
def test_matches_oracle(prepared_cache, cls, preset, tp):
    """Rows 1-8 against the oracle (every row's error printed before any
    assertion), the tiny-scale expert alone, and a CUDA graph at rows 8."""
    backend, shape, w, prepared = _prepared(prepared_cache, cls, preset, tp)
    tol = TOLERANCE[backend.oracle]
    errors, inputs = {}, {}
    for rows in ROWS:
        x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
        ids, wts = hot_tiny_routing(rows, shape.top_k, shape.routed_scaling_factor, seed=rows)
        out = backend.forward(prepared, x, ids, wts).clone()
        ref = reference_moe(x, ids, wts, w, activation=backend.oracle).output
        errors[rows] = relative_error(out, ref)
        inputs[rows] = (x, ids, wts)
        print(f"{backend.name} {shape.describe()} rows={rows}: rel err {errors[rows]:.3e} ({backend.last_tactic})")
        assert (rows, shape.top_k) in prepared.tactics and backend.last_tactic.startswith("g1=")
    bad = {rows: f"{err:.3e}" for rows, err in errors.items() if not err <= tol}
    assert not bad, f"{backend.name} {shape.describe()}: rel err above {tol} at rows {bad}"
    # the tiny-scale expert alone (relative error is scale-free), once per case
    err = tiny_expert_alone_error(backend, prepared, shape, w, inputs[4][0], TINY)
    assert err <= tol, f"{backend.name} {shape.describe()} rows=4 tiny expert: rel err {err:.3e}"
    _graph_equals_eager(backend, prepared, *inputs[8])


@pytest.mark.gpu
@pytest.mark.parametrize("cls", MODES)
def test_non_local_ids_contribute_nothing(prepared_cache, cls):
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
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
@pytest.mark.parametrize("cls", MODES)
def test_unfinalized_output_finalizes_to_the_oracle(prepared_cache, cls):
    """forward_unfinalized (one route per row, route_major_moe_output) finalized
    by moe_output.finalize meets the oracle like forward; non-local ids give zero rows."""
    from moebench.moe_output import finalize

    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
    x = generate_activations(4, shape.hidden, seed=3, device="cuda")
    ids, wts = hot_tiny_routing(4, shape.top_k, 1.5, seed=3)
    masked = ids.clone()
    masked[:, -1] = -1
    u = backend.forward_unfinalized(prepared, x, masked, wts)
    assert u.route_major and u.gemm2_permuted.shape == (4 * shape.top_k, shape.hidden)
    assert not u.gemm2_permuted.view(4, shape.top_k, -1)[:, -1].any()
    kept = wts.clone()
    kept[:, -1] = 0
    ref = reference_moe(x, ids, kept, w, activation=backend.oracle).output
    assert relative_error(finalize(u), ref) <= TOLERANCE[backend.oracle]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", MODES)
def test_graph_capture_of_a_fresh_row_count(prepared_cache, cls):
    """forward at a row count not yet tuned (rows 6) tunes it eagerly, then a graph replays it."""
    backend, shape, w, prepared = _prepared(prepared_cache, cls, "dsv41-flash", 4)
    x = generate_activations(6, shape.hidden, seed=5, device="cuda")
    ids, wts = hot_tiny_routing(6, shape.top_k, 1.5, seed=5)
    _graph_equals_eager(backend, prepared, x, ids, wts)


# --- CPU: the adapter's wiring against a fake flashinfer (real signatures, torch math) ------


def _fake_flashinfer(monkeypatch, calls, returns=lambda output: [output]):
    """Install a fake `flashinfer` whose cutlass_fused_moe undoes the SM90 layout
    with layouts.py's inverses and computes the W4A16 MoE in fp32; `returns`
    makes its return value from the `output=` it wrote."""
    import contextlib
    import types

    from moebench.formats import dequantize_mxfp4
    from moebench.reference import swiglu_clamped

    class Tuner:
        instance = None

        @classmethod
        def get(cls):
            cls.instance = cls.instance or cls()
            return cls.instance

        def choose_one(self, custom_op, runners, *args, **kwargs):
            calls.append(("choose_one", custom_op))
            return None, {"trtllm::fused_moe::gemm1": 3, "trtllm::fused_moe::gemm2": 7}[custom_op]

    @contextlib.contextmanager
    def autotune(tune_mode=True, cache=None, tuning_buckets=None, round_up=None, skip_ops=None,
                 cuda_graph_profile_replays=None):  # fmt: skip
        calls.append(("autotune", tuning_buckets))
        yield

    def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights,
                          fc2_expert_weights, output_dtype, quant_scales, fc1_expert_biases=None,
                          fc2_expert_biases=None, input_sf=None, swiglu_alpha=None, swiglu_beta=None,
                          swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, cluster_size=1,
                          cluster_rank=0, output=None, enable_alltoall=False, use_deepseek_fp8_block_scale=False,
                          use_w4_group_scaling=False, use_mxfp8_act_scaling=False, min_latency_mode=False,
                          use_packed_weights=False, use_wfp4afp8_humming=False, tune_max_num_tokens=8192,
                          enable_pdl=None, activation_type=None, swizzled_input_sf=True, use_fused_finalize=True,
                          profile_ids=None, workspace_buffer=None):  # fmt: skip
        assert use_w4_group_scaling and not use_wfp4afp8_humming and len(quant_scales) == 2
        assert workspace_buffer is not None and output is not None
        # the route-major call of forward_unfinalized: one expert per row, 8 * top_k rows at most
        assert tune_max_num_tokens == (48 if token_selected_experts.shape[1] == 1 else 8)
        if profile_ids is None:
            tuner = Tuner.get()
            tuner.choose_one("trtllm::fused_moe::gemm1", [])
            tuner.choose_one("trtllm::fused_moe::gemm2", [])
        calls.append(("run", None if profile_ids is None else tuple(profile_ids)))
        e = fc1_expert_weights.shape[0]
        s1 = L.deinterleave_scales(quant_scales[0].view(torch.uint8).reshape(e, -1, quant_scales[0].shape[2], 16, 16))
        s2 = L.deinterleave_scales(quant_scales[1].view(torch.uint8).reshape(e, -1, quant_scales[1].shape[2], 16, 16))
        w1 = dequantize_mxfp4(L.deinterleave_fp4_weights(fc1_expert_weights), s1)  # [E, 2Ip, H]: up; gate
        w2 = dequantize_mxfp4(L.deinterleave_fp4_weights(fc2_expert_weights), s2)  # [E, H, Ip]
        ip = w1.shape[1] // 2
        out = torch.zeros(input.shape[0], w2.shape[1])
        for t in range(input.shape[0]):
            for k in range(token_selected_experts.shape[1]):
                x = int(token_selected_experts[t, k])
                if not 0 <= x < e:
                    continue
                h13 = w1[x] @ input[t].float()
                h = swiglu_clamped(h13[ip:], h13[:ip], float(swiglu_limit[x])).to(torch.bfloat16).float()
                out[t] += float(token_final_scales[t, k]) * (w2[x] @ h)
        output.copy_(out.to(output_dtype))
        return returns(output)

    fused_moe = types.ModuleType("flashinfer.fused_moe")
    fused_moe.cutlass_fused_moe = cutlass_fused_moe
    fused_moe.cutlass_fused_moe_workspace_size = lambda *a, **k: 1024
    fused_moe.interleave_moe_weights_for_sm90_mixed_gemm = lambda w, q="fp4": L.interleave_fp4_weights(w)
    fused_moe.interleave_moe_scales_for_sm90_mixed_gemm = lambda s, group_size=32: L.interleave_scales(s)
    fused_moe.preprocess_moe_weights_for_sm90_mixed_gemm_humming = None
    autotuner = types.ModuleType("flashinfer.autotuner")
    autotuner.AutoTuner, autotuner.autotune = Tuner, autotune
    package = types.ModuleType("flashinfer")
    package.fused_moe, package.autotuner, package.__version__ = fused_moe, autotuner, "fake"
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setitem(sys.modules, "flashinfer.autotuner", autotuner)
    return Tuner


def test_w4a16_wiring_against_a_fake_flashinfer(monkeypatch):
    calls = []
    tuner = _fake_flashinfer(monkeypatch, calls)
    backend = fi_backend.FlashInferW4A16Backend()
    monkeypatch.setattr(backend, "unavailable_reason", lambda device: None)
    shape = get_preset("dsv4-flash", hidden=256, intermediate=96, experts=8).shard(1)
    w = generate_expert_weights(shape, seed=2)
    prepared = backend.prepare(w, shape)
    assert prepared.workspace.numel() == 1024 and prepared.fc1.shape == w.w13.shape
    x = generate_activations(3, shape.hidden, seed=1)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 7, 6, 5, 4, 3], [0, 2, 4, 6, -1, 9]], dtype=torch.int32)
    wts = torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    out = backend.forward(prepared, x, ids, wts)
    assert [c for c in calls if c[0] != "choose_one"] == [("autotune", (3,)), ("run", None), ("run", (3, 7))]
    assert prepared.tactics == {(3, 6): (3, 7)} and backend.last_tactic == "g1=3,g2=7"
    assert "choose_one" not in vars(tuner.get())  # the recorder was removed
    kept = torch.where((ids >= 0) & (ids < 8), wts, 0.0)
    ref = reference_moe(x, ids.clamp(0, 7), kept, w, activation="bf16").output
    assert relative_error(out, ref) <= 1e-2
    calls.clear()
    backend.forward(prepared, x, ids, wts)
    assert calls == [("run", (3, 7))]  # tuned once per row count, then pinned
    with pytest.raises(ValueError, match="rows"):
        backend.forward(prepared, generate_activations(9, shape.hidden), ids.repeat(3, 1)[:9], wts.repeat(3, 1)[:9])


def _fake_setup(monkeypatch, **fake):
    calls = []
    _fake_flashinfer(monkeypatch, calls, **fake)
    backend = fi_backend.FlashInferW4A16Backend()
    monkeypatch.setattr(backend, "unavailable_reason", lambda device: None)
    shape = get_preset("dsv4-flash", hidden=256, intermediate=96, experts=8).shard(1)
    w = generate_expert_weights(shape, seed=2)
    x = generate_activations(3, shape.hidden, seed=1)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 7, 6, 5, 4, 3], [0, 2, 4, 6, -1, 9]], dtype=torch.int32)
    wts = torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    return backend, backend.prepare(w, shape), x, ids, wts, calls


def test_unfinalized_route_major_rows_finalize_to_forward(monkeypatch):
    """forward_unfinalized: the op over one row per route, wrapped by
    route_major_moe_output; finalize gives forward's output (BF16 rows)."""
    from moebench.moe_output import finalize

    backend, prepared, x, ids, wts, calls = _fake_setup(monkeypatch)
    u = backend.forward_unfinalized(prepared, x, ids, wts)
    assert u.route_major and u.gemm2_permuted.shape == (18, x.shape[1])
    assert torch.equal(u.expanded_idx_to_permuted_idx, torch.arange(18, dtype=torch.int32).view(3, 6))
    assert torch.equal(u.gemm2_permuted[16:], torch.zeros(2, x.shape[1], dtype=torch.bfloat16))  # ids -1, 9
    assert (18, 1) in prepared.tactics and u.gemm2_permuted.data_ptr() == prepared.route_outputs[18].data_ptr()
    out = backend.forward(prepared, x, ids, wts)
    assert relative_error(finalize(u).float(), out.float()) <= 1e-2
    assert finalize(u).abs().sum() > 0
    with pytest.raises(ValueError, match="rows"):
        backend.forward_unfinalized(prepared, generate_activations(9, x.shape[1]), ids.repeat(3, 1)[:9],
                                    wts.repeat(3, 1)[:9])  # fmt: skip


@pytest.mark.parametrize("returns", [lambda o: o, lambda o: [o, torch.zeros(1)], lambda o: [], lambda o: None])
def test_forward_takes_each_return_form_of_the_op(monkeypatch, returns):
    """The op's return (its output, a list starting with it, nothing) goes
    through convert_flashinfer_moe_output: forward returns the buffer written."""
    backend, prepared, x, ids, wts, _ = _fake_setup(monkeypatch, returns=returns)
    out = backend.forward(prepared, x, ids, wts)
    assert out.data_ptr() == prepared.outputs[3].data_ptr() and out.abs().sum() > 0


def test_forward_refuses_an_output_that_is_not_the_buffer(monkeypatch):
    backend, prepared, x, ids, wts, _ = _fake_setup(monkeypatch, returns=lambda o: [o.clone()])
    with pytest.raises(ValueError, match="does not alias finalized_output"):
        backend.forward(prepared, x, ids, wts)


def test_a_module_that_fails_to_load_is_a_reason_naming_it(monkeypatch):
    """module_load_error: FlashInfer's module loader raising (a missing
    symbol, say) becomes the backend's unavailable reason, library and error named."""
    import types

    core = types.ModuleType("flashinfer.fused_moe.core")

    def get_cutlass_fused_moe_module(backend="100", use_fast_build=False):
        assert backend == "90"
        raise OSError("fused_moe_90.so: undefined symbol: _ZN7tkernel\nmore lines")

    core.get_cutlass_fused_moe_module = get_cutlass_fused_moe_module
    _fake_flashinfer(monkeypatch, [])
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe.core", core)
    monkeypatch.setattr(fi_backend, "module_kind", lambda: "fp4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    fi_backend.module_load_error.cache_clear()
    try:
        reason = fi_backend.FlashInferW4A16Backend().unavailable_reason("cuda:0")
        assert reason == (
            "loading FlashInfer's fused_moe_90 module (fp4) failed: OSError: fused_moe_90.so: undefined symbol:"
            " _ZN7tkernel"
        )
        monkeypatch.setenv("LD_BIND_NOW", "1")
        assert "LD_BIND_NOW" in fi_backend.FlashInferW4A8Backend().unavailable_reason("cuda:0")
    finally:
        fi_backend.module_load_error.cache_clear()
