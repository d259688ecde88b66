"""The fused front kernel (moebench/kernels/front.py, topk.py): FrontConfig
and host validation, sm_90a compile checks and a CPU model of the warp top-k
against the router reference; on the GPU, bit-exactness against the chain
router reference -> quantize kernel -> route kernel over random and
adversarial logits (NaN / +-inf / ties / extremes, image rows), poisoned
outputs, sqrtsoftplus on every fp32 input, CUDA-graph replay, the binding's
`front`, and (printed) timing against quantize + route."""

import itertools
import re
import struct

import numpy as np
import pytest
import torch
from kernel_checks import (
    assert_guards_intact,
    assert_sass_without_spills,
    compile_sm90a,
    graph_launch_times,
    guarded,
    misaligned,
    sass_instructions,
)

from moebench.kernels.front import FrontConfig, FrontKernel, front, front_reason, launch_front
from moebench.kernels.front import THREADS
from moebench.kernels.topk import FLOOR_BITS, WARP, scores_per_thread, topk_reason
from moebench.record import build_route_record, max_ctas, route_words
from moebench.routing import RouterConfig, route, sqrtsoftplus

POISON = 0x7FBADBAD  # int32 / fp32 outputs (an fp32 NaN pattern)
POISON_U8 = 0xA5
GUARD_WORDS = 4  # 16 bytes: keeps the views 16-byte aligned
GUARD_BYTES = 16
LO = 1000  # image sentinel of the image configs

# --------------------------------------------------------------------------- CPU: config, reasons


def _bias(e=384, device="cpu", seed=0):
    return (0.1 * torch.randn(e, generator=torch.Generator().manual_seed(seed))).to(device)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(bias=[0.0] * 32), TypeError, "bias must be a torch.Tensor"),
        (dict(bias=torch.zeros(32, dtype=torch.float64)), TypeError, "bias must be torch.float32"),
        (dict(bias=torch.zeros(2, 32)), ValueError, "bias must be 1-D"),
        (dict(bias=torch.zeros(48)), ValueError, "bias: experts must be a multiple of 32"),
        (dict(bias=torch.zeros(544)), ValueError, "bias: experts must be a multiple of 32"),
        (dict(bias=torch.zeros(0)), ValueError, "bias: experts"),
        (dict(bias=torch.zeros(64)[::2]), ValueError, "bias must have shape|bias must be contiguous"),
        (dict(bias=misaligned((32,), torch.float32)), ValueError, "bias must be 16-byte aligned"),
        (dict(bias=torch.zeros(32), bias_vl=torch.zeros(64)), ValueError, "bias_vl must have shape"),
        (dict(bias=torch.zeros(32), bias_vl=torch.zeros(32, dtype=torch.bfloat16)), TypeError, "bias_vl"),
        (dict(bias=torch.zeros(32), bias_vl=torch.zeros(32)), ValueError, "image_sentinel_lo must be in"),
        (
            dict(bias=torch.zeros(32), bias_vl=torch.zeros(32), image_sentinel_lo=2**31 - 5),
            ValueError,
            "image_sentinel_lo must be in",
        ),
        (dict(bias=torch.zeros(32), image_sentinel_lo=7), ValueError, "image_sentinel_lo must be 0"),
        (
            dict(bias=torch.zeros(32), bias_vl=torch.zeros(32), image_sentinel_lo=7.0),
            TypeError,
            "image_sentinel_lo must be an int",
        ),
        (dict(bias=torch.zeros(32), scale=0.0), ValueError, "scale"),
        (dict(bias=torch.zeros(32), scale=-1.5), ValueError, "scale"),
        (dict(bias=torch.zeros(32), scale=float("inf")), ValueError, "scale"),
        (dict(bias=torch.zeros(32), scale=float("nan")), ValueError, "scale"),
        (dict(bias=torch.zeros(32), scale=1e39), ValueError, "scale"),  # inf in fp32
        (dict(bias=torch.zeros(32), scale=1e-50), ValueError, "scale"),  # 0 in fp32
        (dict(bias=torch.zeros(32), scale=True), ValueError, "scale"),
        (dict(bias=torch.zeros(32), scale="1.5"), ValueError, "scale"),
    ],
)
def test_front_config_validates(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FrontConfig(**kwargs)


def test_front_config_properties():
    c = FrontConfig(torch.zeros(384), torch.zeros(384), image_sentinel_lo=LO, scale=1.1)
    assert c.experts == 384 and c.image and c.image_sentinel_lo == LO
    assert c.scale_f32 == struct.unpack("<f", struct.pack("<f", 1.1))[0] != 1.1
    c = FrontConfig(torch.zeros(32), scale=2)
    assert not c.image and c.scale_f32 == 2.0


def test_reasons_say_why_a_geometry_does_not_fit():
    assert topk_reason(384, 6) is None and front_reason(512, 8, 8, 7168) is None
    assert front_reason(32, 1, 1, 128) is None
    for args, words in (
        ((48, 6), "multiple of 32"), ((544, 6), "multiple of 32"), ((0, 6), "multiple of 32"),
        ((384, 0), "top_k"), ((384, 9), "top_k"), ((384.0, 6), "experts must be an int"),
        ((384, True), "top_k must be an int"), ((384, 6, 9), "rows"), ((384, 6, 0), "rows"),
        ((384, 6, 1, 5000), "hidden"), ((384, 6, 1, 0), "hidden"),
    ):  # fmt: skip
        reason = front_reason(*args)
        assert reason and words in reason, (args, reason)
    ok, why = FrontKernel.can_implement(384, 6, 8, 5120)
    assert ok and why == ""
    ok, why = FrontKernel.can_implement(100, 6)
    assert not ok and "lane" in why


# --------------------------------------------------------------------------- CPU: compile


def _compile(experts, top_k, image, pdl=True, deq=False):
    import cuda.bindings.driver as cuda

    from moebench.kernels.front import stand_in_args

    return compile_sm90a(FrontKernel(experts, top_k, image, pdl, deq), stand_in_args(), cuda.CUstream(0), ptx=True)


@pytest.mark.compile
@pytest.mark.parametrize(
    "experts, top_k, image, pdl, deq",
    [(384, 6, False, True, False), (384, 6, True, True, False), (384, 6, False, False, False),
     (256, 6, False, True, False), (512, 8, True, True, False), (32, 1, False, True, False),
     (64, 8, True, True, False), (96, 3, False, True, False), (384, 6, False, True, True)],
)  # fmt: skip
def test_compiles_for_sm90a_without_spills(experts, top_k, image, pdl, deq):
    sass, ptx = _compile(experts, top_k, image, pdl, deq)
    instr = sass_instructions(sass)
    text = assert_sass_without_spills(instr, "front")
    # one barrier after the scores, two in the record builder (and the cluster
    # wait's fallback when not launched as a cluster: one more); the cluster
    # handoff (v3): one cluster barrier (arrive relaxed on entry, wait before
    # the ids go out), the ids by st.async completing bytes on CTA 0's
    # mbarrier (init, expect_tx and the init fence before the arrive), CTA 0
    # waits on it with a cluster-scope acquire: no release arrive, no
    # GPU-scope fence
    assert 3 <= len(re.findall(r"\bBAR\.SYNC", text)) <= 4
    assert len(re.findall(r"barrier\.cluster\.arrive\.relaxed(?:\.aligned)?;", ptx)) == 1
    assert not re.search(r"barrier\.cluster\.arrive(?:\.release)?(?:\.aligned)?;", ptx)
    assert len(re.findall(r"barrier\.cluster\.wait(?:\.acquire)?(?:\.aligned)?;", ptx)) == 1
    order = [
        r"mbarrier\.init\.",
        r"mbarrier\.arrive\.expect_tx\.",
        r"fence\.mbarrier_init\.release\.cluster",
        r"barrier\.cluster\.arrive\.relaxed",
        r"barrier\.cluster\.wait",
        r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.u32",
        r"mbarrier\.try_wait\.parity\.acquire\.cluster\.shared::cta\.b64",
    ]
    at = [next((m.start() for m in re.finditer(pat, ptx)), -1) for pat in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))
    assert len(re.findall(order[-2], ptx)) == 1
    assert not re.search(r"MEMBAR\.[A-Z.]*GPU", text)
    per = scores_per_thread(experts, THREADS)
    arrays = 3 if image else 2
    _assert_pdl_order_after_bias_loads(instr, pdl, bias_loads=(arrays - 1) * per)
    assert len(re.findall(r"\bLDG\.E\.128\b", text)) == 4  # the quantize part's x loads
    # the quantize part: 16 hardware e4m3 conversions, 16-byte stores
    assert len(re.findall(r"F2FP\.SATFINITE\.E4M3\.F32", text)) == 16
    # a warp max and a warp min per top-k round; IEEE arithmetic: correctly
    # rounded sqrt (ptxas's fast path written out, sqrt.rn behind one branch)
    # and division, inline .rn adds / multiplies, no fast-math approximations;
    # the only flush-to-zero is in libdevice expf's ex2 on its reduced
    # argument and in the sqrt fast path (on normal values only)
    assert len(re.findall(r"redux\.sync\.max\.u32", ptx)) == top_k
    assert len(re.findall(r"redux\.sync\.min\.u32", ptx)) == top_k
    assert len(re.findall(r"sqrt\.rn\.f32", ptx)) == per
    assert len(re.findall(r"rsqrt\.approx\.ftz\.f32", ptx)) == per
    assert "div.rn.f32" in ptx and "add.rn.f32" in ptx and "mul.rn.f32" in ptx
    assert not re.search(r"\b(div|sqrt|lg2|rcp)\.approx", ptx)
    ftz = set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx))
    assert ftz <= {"ex2.approx.ftz.f32", "rsqrt.approx.ftz.f32", "mul.rn.ftz.f32"}, ftz
    assert len(re.findall(r"ex2\.approx\.ftz\.f32", ptx)) == per  # one libdevice expf per score
    assert len(re.findall(r"mul\.rn\.ftz\.f32", ptx)) == 2 * per


_GLOBAL = re.compile(r"(@!?U?P\d+ )?(LDG|STG|ATOM|RED)\b")


def _assert_pdl_order_after_bias_loads(instr: list[str], pdl: bool, bias_loads: int) -> None:
    """PDL: trigger dependents (PREEXIT) and wait (ACQBULK: the score
    threads of the top-k CTAs, the quantize CTAs) exactly when pdl; the only
    global accesses ahead of the first wait are the score threads' bias loads."""
    text = "\n".join(instr)
    assert ("PREEXIT" in text) == pdl
    assert text.count("ACQBULK") == (2 if pdl else 0)
    if pdl:
        before = [s for s in instr[: instr.index("ACQBULK")] if _GLOBAL.match(s)]
        assert len(before) == bias_loads and all("LDG" in s for s in before), before


def _sqrt_sass(fast: bool) -> list[str]:
    """SASS of a one-value kernel taking sqrt.rn or `sqrt_fast_path`, registers renamed."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_ptr

    from moebench.kernels.topk import sqrt_fast_path, sqrt_rn

    class Probe:
        @cute.jit
        def __call__(self, a: cute.Pointer, b: cute.Pointer, stream: cuda.CUstream):
            self.kernel(a, b).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, a: cute.Pointer, b: cute.Pointer):
            tid = cute.arch.thread_idx()[0]
            x = cute.make_tensor(a, cute.make_layout(32))[tid]
            y = sqrt_rn(x)
            if cutlass.const_expr(fast):
                y = sqrt_fast_path(x)
            cute.make_tensor(b, cute.make_layout(32))[tid] = y

    def fake():
        return make_ptr(Float32, 16, cute.AddressSpace.gmem, assumed_align=16)

    sass, _ = compile_sm90a(Probe(), fake(), fake(), cuda.CUstream(0))
    return sass_instructions(sass)


def _expression(instr: list[str]) -> str:
    """The value the last of `instr` (a MUFU.RSQ, then FMUL / FFMA) computes,
    as an expression of the MUFU.RSQ's operand x (commutative factors sorted)."""
    env: dict[str, str] = {}

    def val(tok: str) -> str:
        neg, reg = tok.startswith("-"), tok.lstrip("-")
        v = env.get(reg, reg)
        return f"-({v})" if neg else v

    dest = ""
    for s in instr:
        op, args = s.split(" ", 1)
        ops = [a.strip() for a in args.replace(".reuse", "").split(",")]
        if op == "MUFU.RSQ":
            env = {ops[1]: "x"}
            expr = "rsq(x)"
        elif op.startswith("FMUL"):
            expr = f"{op}({', '.join(sorted((val(ops[1]), val(ops[2]))))})"
        elif op == "FFMA":
            expr = f"FFMA({', '.join(sorted((val(ops[1]), val(ops[2]))))}; {val(ops[3])})"
        else:
            raise AssertionError(s)
        dest = ops[0]
        env[dest] = expr
    return env[dest]


@pytest.mark.compile
def test_sqrt_fast_path_is_ptxas_own_fast_path():
    """`sqrt_fast_path` compiles to the very computation of the fast path of
    ptxas's sqrt.rn.f32 expansion (MUFU.RSQ, FMUL.FTZ x2, FFMA x2), and that
    path is taken for the bits range `sqrt_fast_path_applies` tests."""
    from moebench.kernels.topk import SQRT_FAST_LO, SQRT_FAST_SPAN

    ieee, fast = _sqrt_sass(False), _sqrt_sass(True)
    rsq = next(i for i, s in enumerate(ieee) if s.startswith("MUFU.RSQ"))
    # the range check right around the expansion's MUFU.RSQ
    window = "\n".join(ieee[max(0, rsq - 3) : rsq + 3])
    assert f"-{SQRT_FAST_LO:#x}" in window and f"{SQRT_FAST_SPAN:#x}" in window, window
    assert "ISETP.GT.U32.AND" in window
    block = next(i for i, s in enumerate(ieee) if s.startswith("FMUL.FTZ"))
    want = _expression([ieee[rsq]] + ieee[block : block + 4])
    start = next(i for i, s in enumerate(fast) if s.startswith("MUFU.RSQ"))
    got = _expression(fast[start : start + 5])
    assert got == want, (fast[start : start + 5], ieee[block : block + 4])
    assert want == (
        "FFMA(FFMA(-(FMUL.FTZ(rsq(x), x)), FMUL.FTZ(rsq(x), x); x), FMUL.FTZ(0.5, rsq(x)); FMUL.FTZ(rsq(x), x))"
    )  # s = x*r, h = r/2: fma(fma(-s, s, x), h, s)


@pytest.mark.compile
def test_compile_front_kernel_is_cached_and_validates():
    from moebench.kernels.front import compile_front_kernel

    assert compile_front_kernel(32, 4) is compile_front_kernel(32, 4, False, True)
    assert compile_front_kernel(32, 4, True) is not compile_front_kernel(32, 4)
    with pytest.raises(TypeError, match="pdl"):
        compile_front_kernel(32, 4, False, 1)
    with pytest.raises(TypeError, match="image"):
        compile_front_kernel(32, 4, "no")
    with pytest.raises(ValueError, match="experts"):
        compile_front_kernel(40, 4)
    with pytest.raises(ValueError, match="top_k"):
        FrontKernel(32, 9)


# --------------------------------------------------------------------------- CPU: validation


def _launch_args(rows=4, h=512, e=64, k=6, image=False, device="cpu"):
    config = FrontConfig(torch.zeros(e, device=device), torch.zeros(e, device=device) if image else None,
                         image_sentinel_lo=LO if image else 0, scale=1.5)  # fmt: skip

    def empty(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device=device)

    return dict(
        x=torch.zeros(rows, h, dtype=torch.bfloat16, device=device), logits=empty(rows, e, dtype=torch.float32),
        config=config, top_k=k, input_ids=empty(rows) if image else None, topk_ids_out=empty(rows, k),
        topk_weights_out=empty(rows, k, dtype=torch.float32), x_q_out=empty(rows, h, dtype=torch.uint8),
        x_scale_out=empty(rows, h // 32, dtype=torch.uint8),
        record_out=empty(route_words(max_ctas(rows, k, e))), permuted_out=empty(rows, k),
    )  # fmt: skip


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(config=None), TypeError, "config must be a FrontConfig"),
        (lambda a: a.update(x=a["x"].float()), TypeError, "x must be torch.bfloat16"),
        (lambda a: a.update(x=a["x"][0]), ValueError, "x must be 2-D"),
        (lambda a: a.update(x=torch.zeros(9, 512, dtype=torch.bfloat16)), ValueError, "x: rows"),
        (lambda a: a.update(x=torch.zeros(4, 200, dtype=torch.bfloat16)), ValueError, "x: hidden"),
        (lambda a: a.update(top_k=9), ValueError, "top_k"),
        (lambda a: a.update(top_k=0), ValueError, "top_k"),
        (lambda a: a.update(x=misaligned((4, 512), torch.bfloat16)), ValueError, "x must be 16-byte"),
        (lambda a: a.update(logits=a["logits"].double()), TypeError, "logits must be torch.float32"),
        (lambda a: a.update(logits=a["logits"][:, :32]), ValueError, "logits must have shape"),
        (lambda a: a.update(logits=torch.zeros(64, 4).t()), ValueError, "logits must be contiguous"),
        (lambda a: a.update(logits=misaligned((4, 64), torch.float32)), ValueError, "logits must be 16"),
        (lambda a: a.update(topk_ids_out=a["topk_ids_out"].long()), TypeError, "topk_ids_out"),
        (lambda a: a.update(topk_weights_out=a["topk_weights_out"][:2]), ValueError, "topk_weights_out"),
        (lambda a: a.update(x_q_out=a["x_q_out"].view(torch.int8)), TypeError, "x_q_out"),
        (lambda a: a.update(x_scale_out=a["x_scale_out"][:, :8]), ValueError, "x_scale_out"),
        (lambda a: a.update(record_out=a["record_out"][1:]), ValueError, "record_out"),
        (lambda a: a.update(permuted_out=a["permuted_out"].t()), ValueError, "permuted_out"),
        (lambda a: a.update(pdl=1), TypeError, "pdl"),
        (lambda a: None, ValueError, "CUDA"),  # everything right, but on the CPU
    ],
)
def test_launch_front_validates(mutate, exc, match):
    args = _launch_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        launch_front(**args)


def test_launch_front_validates_image_inputs():
    args = _launch_args(image=True)
    for ids, exc, match in ((None, ValueError, "input_ids is required"),
                            (torch.zeros(4, dtype=torch.int16), TypeError, "input_ids"),
                            (torch.zeros(5, dtype=torch.int32), ValueError, "input_ids must have shape"),
                            (torch.zeros(4, dtype=torch.int64), ValueError, "CUDA")):  # fmt: skip
        with pytest.raises(exc, match=match):
            launch_front(**{**args, "input_ids": ids})
    # without image routing, input ids are not read (None is fine)
    with pytest.raises(ValueError, match="CUDA"):
        launch_front(**_launch_args(image=False))
    with pytest.raises(ValueError, match="CUDA"):
        front(args["x"], args["logits"], args["config"], 6, args["input_ids"])


# --------------------------------------------------------------------------- CPU: the method


SPECIAL_LOGITS = (
    "normal", "wide", "all-nan-row", "some-nan", "pos-inf", "many-pos-inf", "neg-inf",
    "all-neg-inf-row", "all-equal", "ties", "big", "tiny", "huge", "mixed",
)  # fmt: skip


def _logits(kind: str, rows: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [rows, E] logits of the named kind (CPU)."""

    def randn(*s):
        return torch.randn(*s, generator=gen)

    def mask(p):
        return torch.rand(rows, e, generator=gen) < p

    x = randn(rows, e) * 2
    if kind == "wide":
        x = randn(rows, e) * 60
    elif kind == "all-nan-row":
        x[int(torch.randint(rows, (), generator=gen))] = float("nan")
    elif kind == "some-nan":
        x[mask(0.3)] = float("nan")
    elif kind == "pos-inf":
        x[mask(2.0 / e)] = float("inf")
    elif kind == "many-pos-inf":
        x[mask(0.05)] = float("inf")
        x[mask(0.05)] = float("nan")
    elif kind == "neg-inf":
        x[mask(0.8)] = float("-inf")
    elif kind == "all-neg-inf-row":
        x[int(torch.randint(rows, (), generator=gen))] = float("-inf")
    elif kind == "all-equal":
        x[:] = torch.tensor([0.0, 1.25, -3.0, 90.0])[torch.randint(4, (rows, 1), generator=gen)]
    elif kind == "ties":
        x = torch.tensor([-1.0, 0.0, 0.5, 2.0])[torch.randint(4, (rows, e), generator=gen)]
    elif kind == "big":  # > 88: softplus(x) = x, exp(-x) subnormal or 0
        x = 88 + torch.rand(rows, e, generator=gen) * 40
        x[mask(0.2)] = 1e30
    elif kind == "tiny":  # < -20: score sqrt(log1p(exp(x))), subnormal exp below -87.3
        x = -20 - torch.rand(rows, e, generator=gen) * 90
    elif kind == "huge":
        x = torch.where(mask(0.5), 3.4e38, -3.4e38) * torch.rand(rows, e, generator=gen)
    elif kind == "mixed":
        pool = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 88.7, -87.5, -104.0,
                             1e-40, -1e-40, 3.4e38, -3.4e38, 2.0, 2.0, 2.0])  # fmt: skip
        x = torch.where(mask(0.5), pool[torch.randint(len(pool), (rows, e), generator=gen)], x)
    return x.contiguous()


BIAS_KINDS = ("random", "zero", "ties", "special")


def _bias_of(kind: str, e: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "zero":
        return torch.zeros(e)
    if kind == "ties":
        return torch.randint(-2, 3, (e,), generator=gen).float() * 0.25
    b = 0.1 * torch.randn(e, generator=gen)
    if kind == "special":
        b[torch.randperm(e, generator=gen)[:4]] = torch.tensor([float("nan"), float("inf"),
                                                                 float("-inf"), -0.0])  # fmt: skip
    return b


def _order_key(sel: np.ndarray) -> np.ndarray:
    bits = sel.view(np.uint32)
    key = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(sel), np.uint32(1), key).astype(np.uint32)


def _kernel_method_model(logits, bias, bias_vl, image_rows, top_k, scale):
    """The warp top-k's method in numpy (CPU): strided lanes, keys, rounds of
    (lane best, warp max, lowest id holding it), the renormalization in fp32
    top-k order. Scores come from the reference's sqrtsoftplus (the
    transcendentals are checked on the GPU)."""
    f32 = np.float32
    scores = sqrtsoftplus(logits).numpy()
    rows, e = scores.shape
    n = e // WARP
    ids = np.zeros((rows, top_k), np.int32)
    weights = np.zeros((rows, top_k), f32)
    floor = np.array([FLOOR_BITS], np.uint32).view(f32)[0]
    scale32 = f32(scale)
    for t in range(rows):
        b = (bias_vl if image_rows[t] else bias).numpy()
        with np.errstate(invalid="ignore", over="ignore"):
            # lane l holds experts l, l + 32, ... (keys[l, j] is expert l + 32 j)
            keys = _order_key((scores[t] + b).astype(f32)).reshape(n, WARP).T.copy()
        chosen = []
        for r in range(top_k):
            best_j = keys.argmax(axis=1)  # first of equals: lower id
            best = keys[np.arange(WARP), best_j]
            lane_ids = np.arange(WARP) + WARP * best_j
            src = int(lane_ids[best == best.max()].min()) % WARP  # the lowest id holding it
            ids[t, r] = src + WARP * best_j[src]
            chosen.append(scores[t, ids[t, r]])
            keys[src, best_j[src]] = 0
        c = [f32(0) if np.isnan(s) else s for s in chosen]
        total = f32(0)
        for v in c:
            total = f32(total + v)
        if total < floor:
            total = floor
        n_inf = sum(np.isinf(v) for v in c)
        with np.errstate(invalid="ignore"):
            w = [f32(v / total) if not n_inf else f32(f32(1.0 if np.isinf(v) else 0.0) / f32(n_inf))
                 for v in c]  # fmt: skip
        weights[t] = [f32(x * scale32) for x in w]
    return torch.from_numpy(weights), torch.from_numpy(ids)


def test_kernel_method_model_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for e, k in ((32, 1), (32, 8), (96, 3), (384, 6), (512, 8)):
        for kind, bias_kind in zip(SPECIAL_LOGITS, itertools.cycle(BIAS_KINDS)):
            for image in (False, True):
                rows = int(torch.randint(1, 9, (), generator=gen))
                logits = _logits(kind, rows, e, gen)
                bias, bias_vl = _bias_of(bias_kind, e, gen), _bias_of("random", e, gen)
                ids_in = torch.randint(LO - 2, LO + 7, (rows,), generator=gen)
                config = RouterConfig(e, k, 1.5, bias, bias_vl if image else None, LO if image else 0)
                want_w, want_ids = route(logits, config, ids_in)
                image_rows = ((ids_in >= LO) & (ids_in < LO + 5) & image).tolist()
                got_w, got_ids = _kernel_method_model(logits, bias, bias_vl, image_rows, k, 1.5)
                ctx = f"{kind}/{bias_kind} E={e} k={k} image={image}"
                assert torch.equal(got_ids, want_ids), ctx
                assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32)), ctx
                checked += 1
    assert checked == 5 * len(SPECIAL_LOGITS) * 2


# --------------------------------------------------------------------------- GPU


def _x(rows: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [rows, H]: blocks at random scales, with a zero, a NaN and an inf block."""
    nb = rows * h // 32
    scale = torch.pow(2.0, torch.randint(-30, 30, (nb, 1), generator=gen).float())
    x = (torch.randn(nb, 32, generator=gen) * scale).bfloat16()
    where = torch.randperm(nb, generator=gen)[:3]
    x[where[0]] = 0.0
    x[where[1], 5] = float("nan")
    x[where[2], 31] = float("-inf")
    return x.view(rows, h)


def _outputs(rows, h, e, k, device):
    """Poisoned guarded buffers for every output: {name: (buffer, view, guard, poison)}."""
    out = {}
    for name, n, dtype, guard, poison, shape in (
        ("topk_ids", rows * k, torch.int32, GUARD_WORDS, POISON, (rows, k)),
        ("topk_weights", rows * k, torch.int32, GUARD_WORDS, POISON, (rows, k)),
        ("x_q", rows * h, torch.uint8, GUARD_BYTES, POISON_U8, (rows, h)),
        ("x_scale", rows * h // 32, torch.uint8, GUARD_BYTES, POISON_U8, (rows, h // 32)),
        ("record", route_words(max_ctas(rows, k, e)), torch.int32, GUARD_WORDS, POISON, None),
        ("permuted", rows * k, torch.int32, GUARD_WORDS, POISON, (rows, k)),
    ):  # fmt: skip
        buf, view = guarded(n, poison, dtype, guard, device)
        out[name] = (buf, view if shape is None else view.view(shape), guard, poison)
    return out


def _chain(x, logits, config: FrontConfig, top_k, input_ids):
    """The separate chain on x's device: router reference -> quantize kernel -> route kernel."""
    from moebench.kernels.quantize import quantize_mxfp8
    from moebench.kernels.route import route as route_kernel

    router = RouterConfig(config.experts, top_k, config.scale, config.bias, config.bias_vl,
                          config.image_sentinel_lo)  # fmt: skip
    weights, ids = route(logits, router, input_ids)
    x_q, x_scale = quantize_mxfp8(x)
    rec = route_kernel(ids, config.experts)
    torch.cuda.synchronize()
    return dict(topk_ids=ids, topk_weights=weights.view(torch.int32), x_q=x_q, x_scale=x_scale,
                record=rec.record, permuted=rec.permuted)  # fmt: skip


def _check_front(x, logits, config, top_k, input_ids, *, pdl=True, stream=None, what="", deq=False):
    rows, h = x.shape
    want = _chain(x, logits, config, top_k, input_ids)
    out = _outputs(rows, h, config.experts, top_k, x.device)
    x_deq = None
    if deq:  # poisoned (bf16 NaN 0x7FA5), guarded; want: act_to_bf16 of the chain's bytes
        from moebench.kernels.gemm import act_to_bf16

        buf, view = guarded(rows * h, 0x7FA5, torch.int16, 8, x.device)
        out["x_deq"] = (buf, view.view(rows, h), 8, 0x7FA5)
        x_deq = view.view(torch.bfloat16).view(rows, h)
        want["x_deq"] = act_to_bf16(want["x_q"], want["x_scale"]).view(torch.int16)
    if stream is not None:  # the outputs were poisoned on the current stream: order the launch after that
        stream.wait_stream(torch.cuda.current_stream())
    launch_front(x, logits, config, top_k, input_ids, out["topk_ids"][1],
                 out["topk_weights"][1].view(torch.float32), out["x_q"][1], out["x_scale"][1],
                 out["record"][1], out["permuted"][1], pdl=pdl, stream=stream, x_deq_out=x_deq)  # fmt: skip
    torch.cuda.synchronize()
    ctx = f"{what} rows={rows} E={config.experts} k={top_k} image={config.image}"
    for name, (buf, view, guard, poison) in out.items():
        got, exp = view.cpu(), want[name].cpu()
        if not torch.equal(got, exp):
            extra = f"\nlogits={logits.cpu().tolist()}" if name.startswith("topk") else ""
            raise AssertionError(f"{name} differs from the chain: {ctx}\n got {got.tolist()}\n"
                                 f"want {exp.tolist()}{extra}")  # fmt: skip
        assert_guards_intact(buf, guard, view.numel(), poison, f"{name} written out of bounds: {ctx}")
    return want


GEOMETRIES = [(32, 1), (32, 8), (64, 8), (96, 3), (256, 6), (384, 6), (384, 8), (512, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("experts, top_k", GEOMETRIES)
@pytest.mark.parametrize("image", [False, True])
def test_front_bit_exact_vs_chain(experts, top_k, image):
    gen = torch.Generator().manual_seed(experts * 10 + top_k + 1000 * image)
    dev = torch.device("cuda")
    h = 512
    for rows in range(1, 9):
        for kind, bias_kind in zip(SPECIAL_LOGITS, itertools.cycle(BIAS_KINDS)):
            bias = _bias_of(bias_kind, experts, gen).to(dev)
            bias_vl = _bias_of(BIAS_KINDS[rows % 4], experts, gen).to(dev) if image else None
            config = FrontConfig(bias, bias_vl, LO if image else 0, scale=1.5)
            logits = _logits(kind, rows, experts, gen).to(dev)
            ids = None
            if image:
                dtype = (torch.int32, torch.int64)[rows % 2]
                ids = torch.randint(LO - 2, LO + 7, (rows,), generator=gen).to(dev, dtype)
            x = _x(rows, h, gen).to(dev)
            x_before, logits_before = x.clone(), logits.clone()
            _check_front(x, logits, config, top_k, ids, what=f"{kind}/{bias_kind}")
            # the front only reads its inputs
            assert torch.equal(x.view(torch.int16), x_before.view(torch.int16))
            assert torch.equal(logits.view(torch.int32), logits_before.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [128, 5120, 7168])
def test_front_writes_x_deq_bit_exact(h):
    """With x_deq_out the front also writes the act_bf16 GEMM operand: the
    bits act_to_bf16 gives for the chain's bytes (every other output as before)."""
    gen = torch.Generator().manual_seed(h + 5)
    dev = torch.device("cuda")
    for rows in (1, 6, 8):
        config = FrontConfig(_bias(384, dev, seed=rows), scale=1.5)
        _check_front(
            _x(rows, h, gen).to(dev), _logits("normal", rows, 384, gen).to(dev), config, 6, None, what="deq", deq=True
        )


@pytest.mark.gpu
@pytest.mark.parametrize("h", [128, 4096, 5120, 7168])
def test_front_dsv4_shapes_other_hidden_and_scales(h):
    gen = torch.Generator().manual_seed(h)
    dev = torch.device("cuda")
    for rows, scale in itertools.product((1, 6, 8), (1.0, 1.5, 2.5, 1.1)):
        config = FrontConfig(_bias(384, dev, seed=rows), scale=scale)
        _check_front(
            _x(rows, h, gen).to(dev), _logits("normal", rows, 384, gen).to(dev), config, 6, None, what=f"scale={scale}"
        )


@pytest.mark.gpu
def test_front_image_ids_int64_high_word_and_int32():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    e, k = 384, 6
    # bias_vl far from bias, so image rows pick other experts
    config = FrontConfig(torch.zeros(e, device=dev), torch.linspace(5, -5, e).to(dev), LO, 1.5)
    ids64 = torch.tensor([LO, LO + 4, LO + 5, LO - 1, 2**32 + LO, -(2**32) + LO, LO + 2, 7],
                         dtype=torch.int64)  # fmt: skip
    logits = _logits("normal", 8, e, gen).to(dev)
    x = _x(8, 256, gen).to(dev)
    want = _check_front(x, logits, config, k, ids64.to(dev), what="int64 ids")
    image = [True, True, False, False, False, False, True, False]
    plain = _chain(x, logits, FrontConfig(config.bias, scale=1.5), k, None)
    for t, is_image in enumerate(image):
        same = torch.equal(want["topk_ids"][t].cpu(), plain["topk_ids"][t].cpu())
        assert same != is_image, f"row {t} image={is_image}"
    _check_front(x, logits, config, k, ids64.clamp(-5, 2**31 - 1).to(dev, torch.int32), what="int32 ids")


@pytest.mark.gpu
def test_front_without_pdl_and_on_a_stream():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(4)
    config = FrontConfig(_bias(384, dev), scale=1.5)
    for rows in (1, 6, 8):
        _check_front(_x(rows, 5120, gen).to(dev), _logits("mixed", rows, 384, gen).to(dev), config, 6, None,
                     pdl=False, what="no PDL")  # fmt: skip
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x, logits = _x(6, 5120, gen).to(dev), _logits("wide", 6, 384, gen).to(dev)
    s.synchronize()
    _check_front(x, logits, config, 6, None, stream=s, what="side stream")
    with pytest.raises(TypeError, match="stream"):
        front(x, logits, config, 6, stream=0)


@pytest.mark.gpu
def test_front_convenience_returns_the_chains_values():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    config = FrontConfig(_bias(256, dev), scale=2.5)
    x, logits = _x(5, 4096, gen).to(dev), _logits("normal", 5, 256, gen).to(dev)
    got = front(x, logits, config, 6)
    torch.cuda.synchronize()
    want = _chain(x, logits, config, 6, None)
    assert torch.equal(got.topk_ids, want["topk_ids"])
    assert torch.equal(got.topk_weights.view(torch.int32), want["topk_weights"])
    assert torch.equal(got.x_q, want["x_q"]) and torch.equal(got.x_scale, want["x_scale"])
    assert got.route.ctas == max_ctas(5, 6, 256)
    assert torch.equal(got.route.record, want["record"])
    assert torch.equal(got.route.permuted, want["permuted"])
    assert torch.equal(got.route.record.cpu(), build_route_record(got.topk_ids.cpu(), 256).record)


def _score_probe(force_sqrt_rn: bool):
    """A one-thread-per-value kernel applying the front's sqrtsoftplus to the
    fp32 values with bits base + i, i < n: alone (the sqrt fast path where it
    applies) or paired with -inf (whose square root forces sqrt.rn for both)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32

    from moebench.kernels.host import gmem_ptr
    from moebench.kernels.topk import sqrtsoftplus as device_sqrtsoftplus

    class ScoreProbe:
        @cute.jit
        def __call__(self, out: cute.Pointer, base: Uint32, n: Int32, stream: cuda.CUstream):
            self.kernel(out, base, n).launch(grid=[(n + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, out: cute.Pointer, base: Uint32, n: Int32):
            i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
            if i < n:
                xs = [(base + Uint32(i)).bitcast(Float32)]
                if cutlass.const_expr(force_sqrt_rn):
                    xs.append(Uint32(0xFF800000).bitcast(Float32))
                cute.arch.store(out + i, device_sqrtsoftplus(xs)[0].bitcast(Uint32))

    compiled = cute.compile(ScoreProbe(), gmem_ptr(Uint32, 16, 16), Uint32(0), Int32(1), cuda.CUstream(0))

    def run(out: torch.Tensor, base: int) -> None:
        compiled(
            gmem_ptr(Uint32, out, 16),
            Uint32(base),
            Int32(out.numel()),
            cuda.CUstream(torch.cuda.current_stream().cuda_stream),
        )

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("force_sqrt_rn", [False, True])
def test_sqrtsoftplus_matches_torch_on_every_fp32_value(force_sqrt_rn):
    """The front's score (libdevice expf / log1pf, .rn add, the sqrt fast
    path or sqrt.rn) against routing.sqrtsoftplus on the GPU (torch's CUDA
    kernels) for all 2^32 inputs: equal bits, or NaN for both."""
    run = _score_probe(force_sqrt_rn)
    chunk = 1 << 28
    got = torch.empty(chunk, dtype=torch.int32, device="cuda")
    bad, examples = 0, []
    for base in range(0, 1 << 32, chunk):
        run(got, base)
        bits = torch.arange(base, base + chunk, dtype=torch.int64, device="cuda")
        x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        want = sqrtsoftplus(x)
        diff = (got != want.view(torch.int32)) & ~(got.view(torch.float32).isnan() & want.isnan())
        count = int(diff.sum())
        if count:
            bad += count
            idx = diff.nonzero()[:5, 0]
            examples += [(hex(int(bits[i])), float(x[i]), float(got.view(torch.float32)[i]), float(want[i]))
                         for i in idx]  # fmt: skip
        del bits, x, want, diff
    assert bad == 0, f"{bad} inputs differ, e.g. (bits, x, front, torch): {examples[:10]}"


@pytest.mark.gpu
def test_front_cuda_graph_capture_and_replay():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(12)
    rows, h, e, k = 6, 5120, 384, 6
    config = FrontConfig(_bias(e, dev), torch.linspace(1, -1, e).to(dev), LO, 1.5)
    inputs = [(_x(rows, h, gen), _logits(kind, rows, e, gen), torch.tensor([LO, 3, LO + 1, LO, 9, LO + 4]))
              for kind in ("normal", "mixed", "all-nan-row")]  # fmt: skip
    src_x = torch.empty(rows, h, dtype=torch.bfloat16, device=dev)  # graph inputs
    src_l = torch.empty(rows, e, dtype=torch.float32, device=dev)
    src_ids = torch.empty(rows, dtype=torch.int64, device=dev)
    x, logits, ids = torch.empty_like(src_x), torch.empty_like(src_l), torch.empty_like(src_ids)
    out = _outputs(rows, h, e, k, dev)
    views = [out[n][1] for n in ("topk_ids", "topk_weights", "x_q", "x_scale", "record", "permuted")]

    def step():  # producers, the last a kernel, then the front (PDL) reading their outputs
        x.copy_(src_x)
        ids.copy_(src_ids)
        torch.add(src_l, 0, out=logits)
        launch_front(x, logits, config, k, ids, views[0], views[1].view(torch.float32), *views[2:])

    def load(i):
        src_x.copy_(inputs[i][0])
        src_l.copy_(inputs[i][1])
        src_ids.copy_(inputs[i][2])

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up: loads the kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = [v.clone() for v in views]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in (0, 1, 2, 0):
        load(i)
        for buf, _, _, poison in out.values():
            buf.fill_(poison)
        graph.replay()
        torch.cuda.synchronize()
        want = _chain(inputs[i][0].to(dev), inputs[i][1].to(dev), config, k, inputs[i][2].to(dev))
        for name, (buf, view, guard, poison) in out.items():
            assert torch.equal(view, want[name]), f"replay {i}: {name}"
            assert_guards_intact(buf, guard, view.numel(), poison, f"replay {i}: {name} out of bounds")
        if i == 0:
            assert all(torch.equal(v, w) for v, w in zip(views, eager, strict=True))


@pytest.mark.gpu
def test_routed_expert_gemm_front_equals_route():
    from moebench.formats import generate_activations, generate_expert_weights
    from moebench.kernels.binding import RoutedExpertGemm
    from moebench.models import get_preset

    shape = get_preset("dsv41-flash", experts=64).shard(4)
    w = generate_expert_weights(shape, seed=11, device="cuda")
    # the default binding (the tables' family: FP8 for this shape, no x_deq) and the BF16 family (a16: x_deq)
    for fp8 in (None, False):
        gemm = RoutedExpertGemm(w, shape.top_k, fp8=fp8)
        with pytest.raises(RuntimeError, match="set_front"):
            gemm.front(torch.zeros(1, shape.hidden, dtype=torch.bfloat16, device="cuda"), None)
        with pytest.raises(ValueError, match="experts"):
            gemm.set_front(FrontConfig(torch.zeros(32, device="cuda")))
        config = FrontConfig(_bias(64, "cuda"), scale=shape.routed_scaling_factor)
        gemm.set_front(config)
        gen = torch.Generator().manual_seed(2)
        router = RouterConfig(64, shape.top_k, config.scale, config.bias)
        for rows in (1, 3, 6, 8):
            x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
            logits = _logits("wide", rows, 64, gen).cuda()
            via_front = gemm.front(x, logits[:, :].t().contiguous().t())  # a non-contiguous view is copied
            tw, ids = route(logits, router)
            via_route = gemm.route(x, ids, tw)
            a16 = gemm.tactics[1, rows].act_bf16
            assert a16 == (fp8 is False), (fp8, rows)
            assert (via_front.x_deq is not None) == a16 and (via_route.x_deq is not None) == a16, (fp8, rows)
            names = ("x_quant", "x_scale", "topk_ids", "permuted", "record") + (("x_deq",) if a16 else ())
            for name in names:
                a, b = getattr(via_front, name), getattr(via_route, name)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (fp8, rows, name)
            assert torch.equal(via_front.topk_weights.view(torch.int32), via_route.topk_weights.view(torch.int32))
            assert via_front.ctas == via_route.ctas
            a, b = gemm.gemms(via_front), gemm.gemms(via_route)
            idx = b.expanded_idx_to_permuted_idx.flatten()
            idx = idx[idx >= 0].long()  # rows of unused tiles are never written (contract)
            assert torch.equal(a.gemm2_permuted[idx], b.gemm2_permuted[idx]), (fp8, rows)


@pytest.mark.gpu
def test_front_graph_timing(capsys):
    """Per-launch times in a CUDA graph (printed, not asserted): the front vs
    quantize + route and the route kernel alone (target: front <= route + 1 us)."""
    from moebench.kernels.quantize import launch_quantize_mxfp8
    from moebench.kernels.route import launch_route

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    e, k, h = 384, 6, 5120
    config = FrontConfig(_bias(e, dev), scale=1.5)
    lines = []
    for rows in (1, 2, 4, 6, 8):
        x, logits = _x(rows, h, gen).to(dev), _logits("normal", rows, e, gen).to(dev)
        out = _outputs(rows, h, e, k, dev)
        v = {n: t[1] for n, t in out.items()}
        ids = _chain(x, logits, config, k, None)["topk_ids"]

        def fused():
            launch_front(x, logits, config, k, None, v["topk_ids"], v["topk_weights"].view(torch.float32),
                         v["x_q"], v["x_scale"], v["record"], v["permuted"])  # fmt: skip

        def route_only():
            launch_route(ids, v["record"], v["permuted"], e)

        def quantize_route():
            launch_quantize_mxfp8(x, v["x_q"], v["x_scale"])
            route_only()

        t_front, _ = graph_launch_times(fused)
        t_route, _ = graph_launch_times(route_only)
        t_both, _ = graph_launch_times(quantize_route)
        lines.append(f"rows {rows}: front {t_front:.2f} us, route {t_route:.2f} us, "
                     f"quantize+route {t_both:.2f} us")  # fmt: skip
    with capsys.disabled():
        print("\n" + "\n".join(lines))
