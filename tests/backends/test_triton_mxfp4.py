"""triton-mxfp4 (vLLM's unfused matmul_ogs path): availability, the weight
conversion, byte counts and the routing glue on the CPU; numerics vs the
"bf16" oracle on the H200 (`gpu`).

The layout tests and the Triton-interpreter tests need triton and vLLM's
vendored triton_kernels importable (locally: PYTHONPATH=...:/root/vllm-src/
vllm/third_party); they skip without them. The GPU tests need the vllm-moe
bundle (triton_kernels) and the vllm-c bundle (silu_and_mul_with_clamp).
"""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch
from baseline_checks import (
    EXPERTS,
    TINY,
    baseline_cases,
    hot_tiny_routing,
    tiny_expert_alone_error,
    tiny_weights,
)

from moebench.backends import triton_mxfp4 as tm
from moebench.backends import vllm_ops
from moebench.backends.registry import backend_names
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import reference_moe, relative_error

TOLERANCE = 1e-2


def _triton_kernels_importable() -> bool:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton_kernels") is None:
        return False
    try:
        import triton_kernels.routing  # noqa: F401
        import triton_kernels.tensor_details.layout  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


needs_triton_kernels = pytest.mark.skipif(not _triton_kernels_importable(), reason="triton_kernels not importable")


# --- CPU: availability, tactics, shapes --------------------------------------------------------


def test_registered():
    assert "triton-mxfp4" in backend_names()


def test_import_never_needs_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton_kernels'] = None\n"
        "import moebench.backends.triton_mxfp4 as m\n"
        "print(m.TritonMxfp4Backend.oracle, m.TritonMxfp4Backend().unavailable_reason('cpu') is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["bf16", "True"]


def _fake_hopper(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")


def _fake_triton_kernels(monkeypatch, sparse_matrix=False):
    """sys.modules entries standing for triton and vLLM's vendored triton_kernels."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(name=name))
    pkg = types.ModuleType("triton_kernels")
    routing = types.ModuleType("triton_kernels.routing")
    routing.routing_from_bitmatrix = lambda *a: None
    tensor = types.ModuleType("triton_kernels.tensor")
    if sparse_matrix:
        tensor.SparseMatrix = object
    for name, mod in (("triton_kernels", pkg), ("triton_kernels.routing", routing), ("triton_kernels.tensor", tensor),
                      ("triton_kernels.matmul_ogs", types.ModuleType("triton_kernels.matmul_ogs"))):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    pkg.routing, pkg.tensor, pkg.matmul_ogs = routing, tensor, sys.modules["triton_kernels.matmul_ogs"]


def test_unavailable_without_gpu():
    assert "CUDA" in tm.TritonMxfp4Backend().unavailable_reason("cpu")


def test_unavailable_on_other_gpus(monkeypatch):
    _fake_hopper(monkeypatch, (8, 0))
    assert "sm_80" in tm.TritonMxfp4Backend().unavailable_reason("cuda:0")


def test_unavailable_without_triton_kernels(monkeypatch):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton_kernels" else types.SimpleNamespace(name=name),
    )
    reason = tm.TritonMxfp4Backend().unavailable_reason("cuda:0")
    assert "triton_kernels" in reason and "vllm-moe" in reason


def test_unavailable_with_another_triton_kernels_api(monkeypatch):
    _fake_hopper(monkeypatch)
    _fake_triton_kernels(monkeypatch, sparse_matrix=True)
    assert "v3.5.1" in tm.TritonMxfp4Backend().unavailable_reason("cuda:0")


def test_unavailable_without_vllm_c(monkeypatch):
    _fake_hopper(monkeypatch)
    _fake_triton_kernels(monkeypatch)
    monkeypatch.setattr(vllm_ops, "reason", lambda which: f"no library {which}")
    assert tm.TritonMxfp4Backend().unavailable_reason("cuda:0") == (
        "vLLM's silu_and_mul_with_clamp is unavailable: no library c"
    )
    monkeypatch.setattr(vllm_ops, "reason", lambda which: None)
    assert tm.TritonMxfp4Backend().unavailable_reason("cuda:0") is None


def _shape(preset="dsv41-flash", tp=8, **kw):
    return get_preset(preset, **kw).shard(tp)


def test_tactics():
    backend, shape = tm.TritonMxfp4Backend(), _shape()
    assert backend.valid_tactics(shape) == ("default", "ep")  # vLLM's TP path, its expert-map path
    with pytest.raises(ValueError, match="tactic 'fast'"):
        backend.prepare(generate_expert_weights(_shape(experts=8, hidden=256)), _shape(experts=8, hidden=256), "fast")


def test_prepare_rejects_per_expert_clamps(monkeypatch):
    backend = tm.TritonMxfp4Backend()
    shape = _shape("dsv4-flash", 1, experts=8, hidden=256, intermediate=128)
    w = generate_expert_weights(shape)
    w.clamp[1] = 7.0
    monkeypatch.setattr(backend, "unavailable_reason", lambda device: None)
    with pytest.raises(ValueError, match="clamp"):
        backend.prepare(w, shape)


@pytest.mark.parametrize("i,want", [(288, 320), (576, 576), (256, 256), (2304, 2304), (32, 64), (384, 384)])
def test_padded_intermediate(i, want):
    assert tm.padded_intermediate(i) == want


@pytest.mark.parametrize("bad", [0, -64, 100, 64.0, "64"])
def test_padded_intermediate_rejects(bad):
    with pytest.raises(ValueError, match="intermediate"):
        tm.padded_intermediate(bad)


def test_expert_bytes_dsv41_tp8():
    # I' = 320: w13 [640, 5120] values 640*2560, scales 768 rows * 160 groups;
    #           w2 [5120, 320] values 5120*160, scales 5120 rows * 12 groups (10 padded to 4).
    assert tm.expert_bytes(_shape()) == 640 * 2560 + 768 * 160 + 5120 * 160 + 5120 * 12


def test_read_bytes_counts_touched_local_experts_and_activations():
    backend, shape = tm.TritonMxfp4Backend(), _shape()
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, -1, 500, 384, 7]], dtype=torch.int32)
    assert backend.read_bytes(shape, ids) == 7 * tm.expert_bytes(shape) + 2 * 2 * shape.hidden * 2
    assert backend.prepared_bytes(shape) == shape.experts * tm.expert_bytes(shape)
    with pytest.raises(ValueError, match=r"topk_ids must be a \[rows, 6\] tensor"):
        backend.read_bytes(shape, ids.reshape(-1))


def test_unswizzled_weights_pad_to_64_and_keep_gate_up_order():
    shape = _shape()  # I = 288, canonical 384, triton 320
    w = generate_expert_weights(get_preset("dsv41-flash", experts=8, hidden=256).shard(8), seed=3)
    raw = tm.unswizzled_weights(w)
    assert raw["w13"].shape == (8, 640, 128) and raw["w13_scale"].shape == (8, 640, 8)
    assert raw["w2"].shape == (8, 256, 160) and raw["w2_scale"].shape == (8, 256, 12)
    i, ip, cp = 288, 320, w.padded_intermediate
    assert torch.equal(raw["w13"][:, :i], w.w13[:, :i])
    assert torch.equal(raw["w13"][:, ip : ip + i], w.w13[:, cp : cp + i])
    assert torch.equal(raw["w13_scale"][:, ip : ip + i], w.w13_scale[:, cp : cp + i])
    assert not raw["w13"][:, i:ip].any() and not raw["w13"][:, ip + i :].any()
    assert torch.equal(raw["w2"][..., : i // 2], w.w2[..., : i // 2]) and not raw["w2"][..., i // 2 :].any()
    assert torch.equal(raw["w2_scale"][..., :9], w.w2_scale[..., :9]) and not raw["w2_scale"][..., 9:].any()
    assert shape.intermediate == i


# --- CPU: the Hopper MX layouts, decoded from their definition ---------------------------------


def _decode_hopper_values(data: torch.Tensor, n: int, kb: int) -> torch.Tensor:
    """uint8 [E, N, K/2] back from HopperMXValueLayout storage (mma v3), read
    straight from the layout's definition: the storage is [E, 4Kp, Np/4], the
    transpose of a row-major [E, Np/4, 4Kp] whose 32-bit words each hold 8
    nibbles: of source bytes q = 0..3, the low nibbles in bits 0-15 and the
    high ones in bits 16-31, at (sign, 3 value bits) = (15; 8-6), (12; 5-3),
    (9; 2-0), (14; 11-10, 13). Source row m = 16 r0 + 8 b0 + 2 c0 + s0 and
    byte k = 32 r1 + 8 a1 + 4 b1 + c1 sit in word row 4 r0 + c0, word
    ((2 r1 + s0) 4 + c1) 4 + a1, byte slot q = 2 b1 + b0."""
    rows = data.mT
    assert rows.is_contiguous()
    e, mp4, k4 = rows.shape
    mp, kp = mp4 * 4, k4 // 4
    words = rows.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [E, Mp/4, Kp] little-endian
    m = torch.arange(mp).view(-1, 1)
    k = torch.arange(kp).view(1, -1)
    r0, b0, c0, s0 = m // 16, (m // 8) % 2, (m // 2) % 4, m % 2
    r1, a1, b1, c1 = k // 32, (k // 8) % 4, (k // 4) % 2, k % 4
    word = words[:, (r0 * 4 + c0).expand(mp, kp), (((r1 * 2 + s0) * 4 + c1) * 4 + a1).expand(mp, kp)]
    q = (b1 * 2 + b0).expand(mp, kp)

    def nibble(v):  # v: a 16-bit half, per q
        sign = torch.stack([(v >> 15) & 1, (v >> 12) & 1, (v >> 9) & 1, (v >> 14) & 1], -1)
        val = torch.stack([(v >> 6) & 7, (v >> 3) & 7, v & 7, (((v >> 10) & 3) << 1) | ((v >> 13) & 1)], -1)
        pick = q.expand_as(v).unsqueeze(-1)
        return (sign.gather(-1, pick) << 3 | val.gather(-1, pick)).squeeze(-1)

    out = nibble(word & 0xFFFF) | (nibble(word >> 16) << 4)
    assert not out[:, n:].any() and not out[:, :, kb:].any(), "layout padding must be zero"
    return out[:, :n, :kb].to(torch.uint8)


def _decode_hopper_scales(data: torch.Tensor, n: int, groups: int, num_warps: int = 8) -> torch.Tensor:
    """uint8 [E, N, groups] back from HopperMXScaleLayout storage: the transpose
    of a row-major [E, Np/32, 32 Gp]; row m = 16 nw m0 + 16 a nw / 2 ... i.e.
    m = m0 (32 nw) + a (16 nw) + 16 w + 8 b + c and group g = 2 k0 + kk sit at
    row m0 nw + w, column (((2 k0 + a) 8 + c) 2 + kk) 2 + b."""
    rows = data.mT
    assert rows.is_contiguous()
    e, r, cols = rows.shape
    mp, gp = r * 32, cols // 32
    m = torch.arange(mp).view(-1, 1)
    g = torch.arange(gp).view(1, -1)
    span = 32 * num_warps
    m0, a, w, b, c = m // span, (m % span) // (16 * num_warps), (m % (16 * num_warps)) // 16, (m % 16) // 8, m % 8
    k0, kk = g // 2, g % 2
    out = rows[:, (m0 * num_warps + w).expand(mp, gp), ((((k0 * 2 + a) * 8 + c) * 2 + kk) * 2 + b).expand(mp, gp)]
    assert not out[:, n:].any() and not out[:, :, groups:].any(), "layout padding must be zero"
    return out[:, :n, :groups]


def _cpu_layouts():
    from triton_kernels.tensor_details import layout

    return layout.HopperMXValueLayout, {"mx_axis": 1}, layout.HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8}


@needs_triton_kernels
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 8), ("dsv41-flash", 4), ("dsv4-flash", 8)])
def test_swizzle_matches_the_hopper_layouts(preset, tp):
    """prepare's conversion (with the H of each preset reduced to 256 for speed,
    I real) decodes back to the unswizzled weights, and its storage is the
    size `expert_bytes` counts."""
    shape = get_preset(preset, experts=6, hidden=256).shard(tp)
    raw = tm.unswizzled_weights(generate_expert_weights(shape, seed=tp))
    total = 0
    for name, n, k in (("w13", 2 * tm.padded_intermediate(shape.intermediate), 256),
                       ("w2", 256, tm.padded_intermediate(shape.intermediate))):  # fmt: skip
        w, s = tm.swizzle(raw[name], raw[f"{name}_scale"], *_cpu_layouts())
        assert list(w.shape) == [6, k, n] and w.storage.layout.name == "HOPPER_VALUE"
        assert s.storage.layout.name == "HOPPER_SCALE"
        assert torch.equal(_decode_hopper_values(w.storage.data, n, k // 2), raw[name])
        groups = raw[f"{name}_scale"].shape[-1]
        assert torch.equal(_decode_hopper_scales(s.storage.data, n, groups), raw[f"{name}_scale"])
        total += w.storage.data.numel() + s.storage.data.numel()
    assert total == 6 * tm.expert_bytes(shape)


@needs_triton_kernels
def test_layout_decoders_agree_with_triton_kernels_inverse():
    """The decoders above and triton_kernels' own unswizzle_data read the same
    layout (a guard on the decoders themselves)."""
    g = torch.Generator().manual_seed(5)
    values = torch.randint(0, 256, (2, 48, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (2, 48, 4), dtype=torch.uint8, generator=g)
    w, s = tm.swizzle(values, scales, *_cpu_layouts())
    assert torch.equal(_decode_hopper_values(w.storage.data, 48, 64), values)
    assert torch.equal(_decode_hopper_scales(s.storage.data, 48, 4), scales)
    assert torch.equal(s.storage.layout.unswizzle_data(s.storage.data)[:, :4, :48], scales.transpose(-2, -1))
    assert torch.equal(w.storage.layout.unswizzle_data(w.storage.data)[:, :64, :48], values.transpose(-2, -1))


# --- CPU: the routing glue in Triton's interpreter ---------------------------------------------

#: Triton 3.6's interpreter turns a scalar kernel argument into a 1-element
#: array that NumPy 2 refuses to index with; the test process patches that.
_INTERPRETER_SHIM = """
import numpy as np
from triton.runtime import interpreter as _it
_orig = _it._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
_it._patch_lang_tensor = _patched
"""

_GLUE_CHECK = """
import torch
from moebench.backends import triton_mxfp4_glue as g
gen = torch.Generator().manual_seed(7)
for rows, k, experts in ((1, 6, 16), (5, 6, 16), (8, 6, 384), (3, 4, 40), (8, 6, 256)):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)]).to(torch.int32)
    if rows > 2:
        ids[1, 2], ids[1, 3], ids[2, :] = -1, experts + 3, -1    # non-local slots and a row with none local
    weights = torch.rand(rows, k, generator=gen)
    loc = g.local_ids(ids, experts)
    assert loc.dtype == torch.int64 and torch.equal(loc, torch.where((ids >= 0) & (ids < experts), ids, -1).long())
    bits = g.pack_bitmatrix(loc.to(torch.int16), experts)
    for r in range(rows):
        want = {int(e) for e in loc[r] if e >= 0}
        got = {32 * w + b for w in range(bits.shape[1]) for b in range(32) if (int(bits[r, w]) >> b) & 1}
        assert got == want, (r, got, want)
    routing, gather, scatter = g.make_routing_data(loc, weights, experts)
    flat = loc.reshape(-1)
    valid = flat >= 0
    n = int(valid.sum())
    order = torch.argsort(torch.where(valid, flat, 1 << 20), stable=True)[:n]   # slots by expert, stable
    assert torch.equal(gather.src_indx[:n].long(), order) and bool((gather.src_indx[n:] == -1).all())
    position = torch.full_like(flat, -1)
    position[order] = torch.arange(n)
    assert torch.equal(gather.dst_indx.long(), position)
    assert scatter.src_indx is gather.dst_indx and scatter.dst_indx is gather.src_indx
    assert torch.equal(routing.gate_scal[:n], weights.reshape(-1)[order].bfloat16())
    hist = torch.bincount(flat[valid], minlength=experts).int()
    assert torch.equal(routing.expt_hist, hist) and routing.n_expts_tot == experts and routing.n_expts_act == k
    starts = torch.cat((torch.zeros(1, dtype=torch.int32), torch.cumsum(hist, 0).int()))
    assert torch.equal(routing.expt_data.token_offs_raw, starts)
    for block in (16, 32, 64, 128):
        tiles = (hist + block - 1) // block
        pid_map = routing.expt_data.block_pid_map[block]
        want = [(b << 16) + e for e in range(experts) for b in range(int(tiles[e]))]
        assert pid_map[: len(want)].tolist() == want and bool((pid_map[len(want):] == -1).all()), block
        assert torch.equal(routing.expt_data.token_offs_pad[block],
                           torch.cat((torch.zeros(1, dtype=torch.int32), torch.cumsum(tiles, 0).int())))
    rows_in = torch.randn(rows, k, 96, generator=gen).bfloat16()
    rows_in[loc < 0] = float("nan")                          # never-written rows must not be read
    out = torch.full((rows, 96), float("nan"), dtype=torch.bfloat16)
    g.masked_topk_sum(rows_in, loc, out)
    acc = torch.zeros(rows, 96)
    for j in range(k):
        acc += torch.where(loc[:, j:j + 1] >= 0, rows_in[:, j].float(), 0.0)
    # the interpreter's fp32 -> bf16 store may truncate: one bf16 step
    assert bool(((out.float() - acc).abs() <= acc.abs() * 2 ** -7 + 1e-30).all())
    if rows > 2:
        assert bool((out[2] == 0).all())
print("ok")
"""


@needs_triton_kernels
def test_routing_glue_in_the_interpreter():
    """local_ids, pack_bitmatrix, make_routing_data (incl. the padded slot sort
    for top_k 6) and masked_topk_sum vs straightforward torch, in Triton's CPU
    interpreter (a fresh process: TRITON_INTERPRET is read at triton import)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_SHIM + _GLUE_CHECK], capture_output=True, text=True,
                          timeout=900, env=env)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _vllm_pack_source() -> str | None:
    """vLLM's gpt_oss_triton_kernels_moe.py beside the triton_kernels it
    vendors (a vLLM source tree on PYTHONPATH), or None."""
    spec = importlib.util.find_spec("triton_kernels")
    if spec is None or spec.origin is None:
        return None
    vllm_dir = os.path.dirname(os.path.dirname(os.path.dirname(spec.origin)))
    path = os.path.join(vllm_dir, "model_executor", "layers", "fused_moe", "experts", "gpt_oss_triton_kernels_moe.py")
    return path if os.path.isfile(path) else None


def _sm90_resources(fn, pointers: dict, constexprs: dict, tmp_path) -> tuple[int, str]:
    """(SASS instruction count, cuobjdump's resource line) of `fn` compiled
    for sm_90 on this machine (Triton's bundled ptxas; no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})  # fmt: skip
    cubin = tmp_path / f"{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    count = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line)
    return count, " ".join(res.split("Function")[-1].split()[1:4])  # REG, STACK, SHARED


@needs_triton_kernels
@pytest.mark.parametrize("rows", [1, 4])
def test_pack_bitmatrix_compiles_like_vllms(rows, tmp_path):
    """Our bitmatrix pack compiles for sm_90 to the same code size and
    registers/stack as vLLM's `pack_bitmatrix` (E=384, top_k 6; rows 1 is
    Triton's constant-1 specialization). An earlier 2-D form of ours spilled
    3 KB per thread into ~17.6k instructions at rows > 1: the route stage
    must time vLLM's kernel, not a slower copy of it."""
    import ast
    import importlib.machinery

    path = _vllm_pack_source()
    if path is None:
        pytest.skip("vLLM's gpt_oss_triton_kernels_moe.py is not beside triton_kernels")
    from moebench.backends import triton_mxfp4_glue as g

    source = open(path).read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "pack_bitmatrix")
    module_file = tmp_path / "vllm_pack.py"
    module_file.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                           + ast.get_source_segment(source, node) + "\n")  # fmt: skip
    module = types.ModuleType("vllm_pack")
    module.__file__ = str(module_file)
    importlib.machinery.SourceFileLoader("vllm_pack", str(module_file)).exec_module(module)
    rows_const = {"rows": 1} if rows == 1 else {}
    ours = _sm90_resources(
        g._pack_bitmatrix_kernel,
        {"bits_ptr": "*u32", "ids_ptr": "*i16"},
        dict(WORDS=12, BLOCK_M=g.PACK_BLOCK_M, BLOCK_K=g.PACK_BLOCK_K, **rows_const),
        tmp_path,
    )
    theirs = _sm90_resources(module.pack_bitmatrix, {"bitmatrix": "*u32", "topk_ids": "*i16"},
                             dict(bm_cols=12, BLOCK_SIZE_M=512, BLOCK_SIZE_K=32,
                                  **({"n_rows": 1} if rows == 1 else {})), tmp_path)  # fmt: skip
    assert ours == theirs


def test_forward_rejects_foreign_prepared_and_bad_rows():
    backend = tm.TritonMxfp4Backend()
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    ids, wts = torch.zeros(1, 6, dtype=torch.int32), torch.ones(1, 6)
    with pytest.raises(TypeError, match="prepared"):
        backend.forward(object(), x, ids, wts)
    p = tm.TritonMxfp4Prepared(w13=None, w2=None, w13_precision=None, w2_precision=None, limit=10.0, hidden=256,
                               intermediate=64, experts=4, top_k=6, device=torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        backend.forward(p, torch.zeros(9, 256, dtype=torch.bfloat16), torch.zeros(9, 6, dtype=torch.int32),
                        torch.ones(9, 6))  # fmt: skip
    with pytest.raises(TypeError, match="topk_ids"):
        backend.forward(p, x, ids.long(), wts)


# --- GPU -------------------------------------------------------------------------------------

#: every preset at TP 1, 4 and 8; MOEBENCH_BASELINE_CASES="dsv41-flash:4,dsv4-pro:1" narrows it.
CASES = baseline_cases((1, 4, 8))


def _prepared(cache, preset, tp, tactic="default"):
    key = (preset, tp, tactic)
    if key not in cache:
        cache.clear()
        torch.cuda.empty_cache()
        backend = tm.TritonMxfp4Backend()
        reason = backend.unavailable_reason("cuda")
        if reason is not None:
            pytest.skip(reason)
        shape, w = tiny_weights(preset, tp)
        cache[key] = (backend, shape, w, backend.prepare(w, shape, tactic))
    return cache[key]


def _poison(prepared, rows, top_k):
    for t in prepared.buffers.get((rows, top_k), {}).values():
        t.fill_(float("nan"))


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    d = (out.double() - ref.double()).norm(dim=1)
    return (d / ref.double().norm(dim=1)).tolist()


def _checked_forward(backend, prepared, x, ids, wts):
    backend.forward(prepared, x, ids, wts)  # allocates this row count's buffers
    _poison(prepared, *ids.shape)
    return backend.forward(prepared, x, ids, wts).clone()


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", CASES)
def test_matches_oracle(prepared_cache, preset, tp):
    backend, shape, w, prepared = _prepared(prepared_cache, preset, tp)
    for rows in range(1, 9):
        x = generate_activations(rows, shape.hidden, seed=100 + rows, device="cuda")
        ids, wts = hot_tiny_routing(rows, shape.top_k, shape.routed_scaling_factor, seed=rows)
        out = _checked_forward(backend, prepared, x, ids, wts)
        ref = reference_moe(x, ids, wts, w, activation=backend.oracle).output
        err, per_row = relative_error(out, ref), _row_errors(out, ref)
        print(f"{shape.describe()} rows={rows}: rel err {err:.3e}, worst row {max(per_row):.3e}")
        assert torch.isfinite(out).all()
        assert err <= TOLERANCE, f"{shape.describe()} rows={rows}: rel err {err:.3e}"
        assert max(per_row) <= 2 * TOLERANCE, f"{shape.describe()} rows={rows}: row errors {per_row}"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", CASES)
def test_tiny_scale_expert_alone(prepared_cache, preset, tp):
    backend, shape, w, prepared = _prepared(prepared_cache, preset, tp)
    x = generate_activations(4, shape.hidden, seed=4, device="cuda")
    err = tiny_expert_alone_error(backend, prepared, shape, w, x, TINY)
    assert err <= TOLERANCE, f"{shape.describe()} tiny expert: rel err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [4, 8])
def test_non_local_ids_contribute_nothing(prepared_cache, tp):
    """Tactic "ep" (vLLM's expert-map path): ids of other ranks' experts add nothing."""
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", tp, tactic="ep")
    x = generate_activations(5, shape.hidden, seed=3, device="cuda")
    ids, wts = hot_tiny_routing(5, shape.top_k, 1.5, seed=3)
    masked = ids.clone()
    masked[:, -2:] = torch.tensor([-1, EXPERTS + 3], dtype=torch.int32)
    masked[3, :] = -1  # a row with no local expert: exactly zero
    masked[4, :] = torch.tensor([EXPERTS, -7, 1 << 20, -1, EXPERTS + 1, -(1 << 20)], dtype=torch.int32)
    out = _checked_forward(backend, prepared, x, masked, wts)
    kept = wts.clone()
    kept[masked < 0] = 0
    kept[masked >= EXPERTS] = 0
    ref = reference_moe(x, ids, kept, w, activation=backend.oracle).output
    assert bool((out[3:] == 0).all()), "rows without a local expert must be zero"
    assert relative_error(out[:3], ref[:3]) <= TOLERANCE
    assert max(_row_errors(out[:3], ref[:3])) <= 2 * TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_graph_capture_replays_the_eager_result(prepared_cache, tp):
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv41-flash", tp)
    x = generate_activations(6, shape.hidden, seed=5, device="cuda")
    ids, wts = hot_tiny_routing(6, shape.top_k, 1.5, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls compile the Triton kernels: before capture
        eager = [backend.forward(prepared, x, ids, wts).clone() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(prepared, x, ids, wts)
    _poison(prepared, *ids.shape)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager[1], eager[2]), "eager calls differ: the path is not deterministic"
    assert torch.equal(out, eager[-1])
    ref = reference_moe(x, ids, wts, w, activation=backend.oracle).output
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.gpu
def test_stage_calls_compose_to_forward(prepared_cache):
    """The stages, run in order, give forward's bits; each stage alone replays
    (captured) without error."""
    backend, shape, w, prepared = _prepared(prepared_cache, "dsv4-flash", 4)
    x = generate_activations(3, shape.hidden, seed=8, device="cuda")
    ids, wts = hot_tiny_routing(3, shape.top_k, 1.5, seed=8)
    want = backend.forward(prepared, x, ids, wts).clone()
    stages = backend.stage_calls(prepared, x, ids, wts)
    assert [name for name, _ in stages] == ["route", "gemm1", "activation", "gemm2", "reduce", "finalize"]
    from moebench.bench.sweep import SWEEP_STAGES

    assert all(name in SWEEP_STAGES for name, _ in stages)
    _poison(prepared, 3, shape.top_k)
    stages[-1][1]()  # finalize copies the reduce's output, which the poison just wiped
    assert torch.isnan(prepared.buffers[(3, shape.top_k)]["out"]).any()
    stages = backend.stage_calls(prepared, x, ids, wts)  # eager run of route..reduce again
    assert torch.equal(stages[-1][1](), want)
    for _name, call in stages:
        call()  # warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
