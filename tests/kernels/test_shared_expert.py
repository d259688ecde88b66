"""The fused shared-expert kernels (kernels/shared_expert.py): the weight
layout and its converter, shape and input rules, default tactics, sm_90a
cross-compiles (CPU); numerics vs fp64, CUDA-graph replay and the
StepSharedExpert integration (GPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import compile_reports, misaligned, sass_count, sass_first
from layout_inverse import from_shared_layout, unpack_weight

from moebench.integration.step_layer import StepSharedExpert
from moebench.kernels.shared_expert import (
    FILL, SharedExpertWeights, SharedTactic, default_shared_tactic, input_refusal, kernels_refusal,
    pack_weight, shape_refusal, to_shared_layout,
)  # fmt: skip
from moebench.models import PRESETS
from moebench.reference import ORACLE_TOLERANCE, relative_error, swiglu_clamped

TPS = (1, 2, 4, 8)
#: (preset, tp, H, I/tp) of every preset shape class.
SHAPES = [(p, tp, PRESETS[p].hidden, PRESETS[p].intermediate // tp) for p in sorted(PRESETS) for tp in TPS]
SHAPE_IDS = [f"{p}-tp{tp}" for p, tp, _, _ in SHAPES]
H200_SMS = 132


def _bf16(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


# ---------------------------------------------------------------------- layout (CPU)
def _emulate_mma(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fp64 [M, 8]: the sum over k-steps of mma.sync m16n8k16 products built
    by the PTX fragment tables from the packed weights (A) and x [8, K] (B) as
    the kernels feed them: lane (g, c), k-step s = 2q + j, B registers
    x[g, k0:k0+2], x[g, k0+2:k0+4] with k0 = 32q + 8c + 4j."""
    mt, steps = packed.shape[:2]
    out = torch.zeros(mt, 16, 8, dtype=torch.float64)
    xd = x.double()
    for s in range(steps):
        q, j = divmod(s, 2)
        a = torch.zeros(mt, 16, 16, dtype=torch.float64)
        b = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            g, c = divmod(lane, 4)
            v = packed[:, s, lane].double()
            for i in range(8):  # A element a_i: register i // 2 (R0..R3), half i % 2
                row = g + 8 * ((i // 2) % 2)
                col = 2 * c + i % 2 + 8 * (i // 4)
                a[:, row, col] = v[:, i]
            k0 = 32 * q + 8 * c + 4 * j
            for i in range(4):  # B element b_i: register i // 2, half i % 2
                b[2 * c + i % 2 + 8 * (i // 2), g] = xd[g, k0 + i]
        out += a @ b
    return out.reshape(mt * 16, 8)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 4), k=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pack_weight_round_trips(m, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = _bf16(16 * m, 32 * k, gen=gen)
    p = pack_weight(w)
    assert p.shape == (m, 2 * k, 32, 8) and p.dtype == torch.bfloat16
    assert torch.equal(unpack_weight(p), w)


def test_packed_fragments_feed_mma_sync():
    """One 16-byte lane word is that lane's A fragment: the emulated mma.sync
    of the packed weights with x equals W x^T (fp64, same products)."""
    gen = torch.Generator().manual_seed(3)
    w = _bf16(48, 96, gen=gen)
    x = _bf16(8, 96, gen=gen)
    got = _emulate_mma(pack_weight(w), x)
    torch.testing.assert_close(got, w.double() @ x.double().T, rtol=1e-12, atol=1e-12)


def test_gemm1_rows_interleave_gate_and_up_per_8_columns():
    gen = torch.Generator().manual_seed(5)
    i, h = 32, 128
    w1, w3, w2 = _bf16(i, h, gen=gen), _bf16(i, h, gen=gen), _bf16(h, i, gen=gen)
    sw = to_shared_layout(w1, w3, w2)
    assert sw.w13.shape == (i // 8, h // 16, 32, 8) and sw.w2.shape == (h // 16, i // 16, 32, 8)
    assert sw.nbytes == 3 * i * h * 2
    rows = unpack_weight(sw.w13)
    for t in range(i // 8):
        assert torch.equal(rows[16 * t : 16 * t + 8], w1[8 * t : 8 * t + 8])
        assert torch.equal(rows[16 * t + 8 : 16 * t + 16], w3[8 * t : 8 * t + 8])
    # the accumulator of m-tile t, row g holds gate of column 8t + g, row g + 8 its up
    x = _bf16(8, h, gen=gen)
    acc = _emulate_mma(sw.w13, x).view(i // 8, 2, 8, 8)
    torch.testing.assert_close(acc[:, 0].reshape(i, 8), w1.double() @ x.double().T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc[:, 1].reshape(i, 8), w3.double() @ x.double().T, rtol=1e-12, atol=1e-12)
    back = from_shared_layout(sw)
    assert all(torch.equal(a, b) for a, b in zip(back, (w1, w3, w2)))


def test_converter_rejects_bad_weights():
    i, h = 32, 128
    w1, w3, w2 = _bf16(i, h), _bf16(i, h), _bf16(h, i)
    with pytest.raises(TypeError, match="w1 must be torch.bfloat16"):
        to_shared_layout(w1.float(), w3, w2)
    with pytest.raises(TypeError, match="w3 must be a torch.Tensor"):
        to_shared_layout(w1, None, w2)
    with pytest.raises(ValueError, match="w3 must have w1's shape"):
        to_shared_layout(w1, w3[:16], w2)
    with pytest.raises(ValueError, match=r"w2 must be \[H, I\]"):
        to_shared_layout(w1, w3, w2.T.contiguous())
    with pytest.raises(ValueError, match="w2 must be 2-D"):
        to_shared_layout(w1, w3, w2[None])
    with pytest.raises(ValueError, match="w2 must be on w1's device"):
        to_shared_layout(w1, w3, w2.to("meta"))
    with pytest.raises(ValueError, match="w1: hidden 96 is not a multiple of 128"):
        to_shared_layout(_bf16(i, 96), _bf16(i, 96), _bf16(96, i))
    with pytest.raises(ValueError, match="intermediate 48 is not a multiple of 32"):
        to_shared_layout(_bf16(48, h), _bf16(48, h), _bf16(h, 48))
    sw = to_shared_layout(w1, w3, w2)
    with pytest.raises(TypeError, match="w13 must be torch.bfloat16"):
        SharedExpertWeights(sw.w13.float(), sw.w2, h, i)
    with pytest.raises(ValueError, match="w2 must have shape"):
        SharedExpertWeights(sw.w13, sw.w2[:-1], h, i)
    with pytest.raises(ValueError, match="w13 must have shape"):
        SharedExpertWeights(sw.w13, sw.w2, h, 2 * i)
    with pytest.raises(ValueError, match="hidden"):
        SharedExpertWeights(sw.w13, sw.w2, 130, i)
    with pytest.raises(ValueError, match="w2 must be on cpu"):
        SharedExpertWeights(sw.w13, sw.w2.to("meta"), h, i)
    with pytest.raises(ValueError, match="w13 must be contiguous"):
        SharedExpertWeights(sw.w13.transpose(0, 1).contiguous().transpose(0, 1), sw.w2, h, i)
    with pytest.raises(ValueError, match="w must be a BF16"):
        pack_weight(w1.float())
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_weight(_bf16(24, 64))


# ---------------------------------------------------------------------- rules and tactics (CPU)
def test_shape_rules():
    for _, _, h, i in SHAPES:
        assert shape_refusal(h, i) is None
    assert "hidden 5000 is not a multiple of 128" in shape_refusal(5000, 576)
    assert "intermediate 100 is not a multiple of 32" in shape_refusal(5120, 100)
    assert "hidden must be a positive int" in shape_refusal(0, 576)
    assert "intermediate must be a positive int" in shape_refusal(5120, 576.0)


def test_input_rules():
    h = 256
    ok = torch.zeros(6, h, dtype=torch.bfloat16)
    assert input_refusal(ok, h, "cpu") is None
    for rows in (1, 8):
        assert input_refusal(torch.zeros(rows, h, dtype=torch.bfloat16), h, "cpu") is None
    assert "9 rows; the kernels take 1..8" in input_refusal(torch.zeros(9, h, dtype=torch.bfloat16), h, "cpu")
    assert "0 rows" in input_refusal(torch.zeros(0, h, dtype=torch.bfloat16), h, "cpu")
    assert "torch.bfloat16" in input_refusal(ok.float(), h, "cpu")
    assert "[rows, 256]" in input_refusal(torch.zeros(6, 128, dtype=torch.bfloat16), h, "cpu")
    assert "[rows, 256]" in input_refusal(ok[None], h, "cpu")
    assert "must be on cuda" in input_refusal(ok, h, "cuda")
    assert "contiguous" in input_refusal(torch.zeros(h, 6, dtype=torch.bfloat16).T, h, "cpu")
    assert "16-byte aligned" in input_refusal(misaligned((6, h), torch.bfloat16), h, "cpu")
    assert "torch.Tensor" in input_refusal([[0.0] * h], h, "cpu")


def test_kernels_refusal_off_the_gpu():
    assert "need a CUDA device" in kernels_refusal("cpu")
    if not torch.cuda.is_available():
        assert kernels_refusal("cuda") is not None


def test_step_shared_expert_takes_the_torch_path_on_the_cpu():
    i, h = 64, 256
    gen = torch.Generator().manual_seed(1)
    w1, w3, w2 = _bf16(i, h, scale=h**-0.5, gen=gen), _bf16(i, h, scale=h**-0.5, gen=gen), _bf16(h, i, gen=gen)
    shared = StepSharedExpert(w1, w3, w2, 10.0)
    assert shared.path == "torch" and shared.kernels is None and shared.last_path is None
    assert "need a CUDA device" in shared.kernel_refusal
    x = _bf16(3, h, gen=gen)
    out = shared(x)
    assert shared.last_path == "torch" and out.shape == (3, h) and out.dtype == torch.bfloat16
    off = StepSharedExpert(w1, w3, w2, 10.0, kernels=False)
    assert off.path == "torch" and off.kernel_refusal == "kernels=False"
    assert torch.equal(off(x), out)


def test_tactic_validation():
    with pytest.raises(ValueError, match="tile_m"):
        SharedTactic(tile_m=3)
    with pytest.raises(ValueError, match="cluster_k"):
        SharedTactic(cluster_k=9)
    with pytest.raises(ValueError, match="warps_m \\* warps_k"):
        SharedTactic(warps_m=4, warps_k=8)
    with pytest.raises(TypeError, match="unroll"):
        SharedTactic(unroll=2.0)
    with pytest.raises(TypeError, match="pdl"):
        SharedTactic(pdl=1)
    assert SharedTactic().name == "t1_m1_k4_cl1_u4_c2"
    assert SharedTactic(tile_m=2, cluster_k=8, pdl=False).name == "t2_m1_k4_cl8_u4_c2_nopdl"
    # GEMM1 items cover 8 columns per m-tile; GEMM2 items 16 rows per m-tile
    why = SharedTactic(tile_m=4, warps_m=4, warps_k=2).valid_for(5120, 288, 1)
    assert why is not None and "multiple of the 128 columns" in why
    why = SharedTactic(tile_m=4, warps_m=4, warps_k=2).valid_for(5120 + 128, 288, 2)
    assert why is not None and "multiple of the 256 rows" in why
    # TP8 GEMM2: 9 K chunks; a 2-CTA cluster gives 5 + 4, a 8-CTA one leaves CTAs empty
    assert SharedTactic(cluster_k=2, warps_k=4).valid_for(5120, 288, 2) is None
    why = SharedTactic(cluster_k=8, warps_k=1).valid_for(5120, 288, 2)
    assert why is not None and "leaves a CTA without K chunks" in why
    why = SharedTactic(warps_k=12).valid_for(5120, 288, 2)
    assert why is not None and "warps_k 12 exceeds the 9 K chunks" in why
    # the whole K = 7168 of activations (112 KB) per CTA does not fit 3 CTAs per SM
    why = SharedTactic(ctas_per_sm=3).valid_for(7168, 3072, 1)
    assert why is not None and "shared memory" in why
    why = SharedTactic(tile_m=4, unroll=8, warps_k=8, ctas_per_sm=2, cluster_k=8).valid_for(5120, 576, 1)
    assert why is not None and "registers" in why
    assert "hidden 5000" in SharedTactic().valid_for(5000, 576, 1)
    with pytest.raises(ValueError, match="stage"):
        SharedTactic().valid_for(5120, 576, 3)


@pytest.mark.parametrize("preset,tp,h,i", SHAPES, ids=SHAPE_IDS)
def test_default_tactics_fill_the_h200_in_one_wave(preset, tp, h, i):
    for stage in (1, 2):
        t = default_shared_tactic(h, i, stage, H200_SMS)
        assert t.valid_for(h, i, stage) is None, (stage, t.name)
        m_tiles = i // 8 if stage == 1 else h // 16
        ctas = m_tiles // t.item_tiles * t.cluster_k
        assert FILL * H200_SMS <= ctas <= H200_SMS * t.ctas_per_sm, (stage, t.name, ctas)
        assert t.pdl and t.warps_m == 1
        if stage == 2:
            assert t.cluster_k == 1
        # the two register stages hold every chunk of a warp when unroll allows it
        k = h if stage == 1 else i
        per_warp = -(-t.chunks_per_cta(k) // t.warps_k)
        assert 2 * t.unroll >= per_warp or t.unroll * t.tile_m >= 4, (stage, t.name, per_warp)
    with pytest.raises(ValueError, match="hidden 100"):
        default_shared_tactic(100, 576, 1)


# ---------------------------------------------------------------------- compile (CPU, sm_90a)
# A spec is [H, I, stage] (the default tactic for 132 SMs) or
# [H, I, stage, {tactic fields}].
_COMPILE_SPEC = """
from moebench.kernels.shared_expert import SharedTactic, compile_shared_gemm, default_shared_tactic

def compile_spec(spec):
    h, i, stage, *fields = spec
    tactic = SharedTactic(**fields[0]) if fields else default_shared_tactic(h, i, stage, 132)
    compile_shared_gemm(h, i, tactic, stage)
    return dict(tactic=tactic.name, pdl=tactic.pdl, cluster=tactic.cluster_k)
"""


def _compile_reports(specs):
    reports = compile_reports(_COMPILE_SPEC, specs)
    for rep in reports:
        rep.update(
            n_instr=len(rep["instr"]), hmma=sass_count(rep, r"HMMA\.16816\.F32\.BF16"),
            ldg_ef128=sass_count(rep, r"LDG\.E\.EF\.128"), local=sass_count(rep, r"\b(?:LDL|STL)\b"),
            acqbulk=sass_first(rep, r"^ACQBULK"), preexit=sass_first(rep, r"^PREEXIT"),
            first_weight=sass_first(rep, r"LDG\.E\.EF\.128"), first_x=sass_first(rep, r"LDG\.E\.EL\.128"),
            first_store=sass_first(rep, r"\bSTG\b"), cga_arrive=sass_first(rep, r"UCGABAR_ARV"),
            cga_wait=sass_first(rep, r"UCGABAR_WAIT"), dsmem_store=sass_first(rep, r"\bST\.E\.128\b"),
        )  # fmt: skip
    return reports


def _fields(t: SharedTactic) -> dict:
    return {f: getattr(t, f) for f in t.__dataclass_fields__}


#: Non-default tactics the GPU tests and scripts/time_shared.py --variants run
#: (dsv41-flash TP4 / TP8): 4-tile warps, 2 warps side by side, a persistent
#: grid with several items per cluster (ctas_per_sm 1), no PDL.
VARIANTS = [
    (5120, 576, 1, SharedTactic(tile_m=1, warps_k=4, cluster_k=4, unroll=5, ctas_per_sm=3)),
    (5120, 576, 1, SharedTactic(tile_m=4, warps_k=4, cluster_k=8, unroll=1, ctas_per_sm=2)),
    (5120, 576, 1, SharedTactic(tile_m=1, warps_k=4, cluster_k=4, unroll=2, ctas_per_sm=1)),
    (5120, 288, 1, SharedTactic(tile_m=1, warps_m=2, warps_k=2, cluster_k=8, unroll=3, ctas_per_sm=3, pdl=False)),
    (5120, 576, 2, SharedTactic(tile_m=2, warps_k=4, unroll=3, ctas_per_sm=2)),
    (5120, 576, 2, SharedTactic(tile_m=1, warps_m=2, warps_k=2, unroll=3, ctas_per_sm=3)),
    (5120, 576, 2, SharedTactic(tile_m=1, warps_k=3, unroll=2, ctas_per_sm=1)),
    (5120, 288, 2, SharedTactic(tile_m=1, warps_k=4, cluster_k=2, unroll=2, ctas_per_sm=3, pdl=False)),
]


#: The tactics of test_the_first_call_may_be_captured (H 4096, I 512; launched by no other test).
FIRST_CALL_TACTICS = {1: SharedTactic(tile_m=1, warps_k=2, cluster_k=2, unroll=4, ctas_per_sm=2, pdl=False),
                      2: SharedTactic(tile_m=2, warps_k=2, unroll=2, ctas_per_sm=1, pdl=False)}  # fmt: skip


def _check_report(rep):
    what = f"{rep['spec'][:3]} {rep['tactic']}"
    assert rep["regs"], f"{what}: no ptxas report"
    assert all(s == 0 for s in rep["spills"]), f"{what}: spills {rep['spills']}"
    if rep["n_instr"] == 0:
        pytest.skip("nvdisasm not available: SASS not checked")
    assert rep["local"] == 0, f"{what}: local memory traffic in SASS"
    assert rep["hmma"] > 0, f"{what}: no HMMA.16816.F32.BF16"
    assert rep["ldg_ef128"] > 0, f"{what}: no 16-byte evict-first weight loads"
    assert rep["first_x"] >= 0 and rep["first_store"] >= 0, f"{what}: no activation loads / output stores"
    if rep["pdl"]:
        # weights requested before the PDL wait; activations read and outputs written after it
        assert rep["acqbulk"] >= 0 and rep["preexit"] >= 0, f"{what}: no griddepcontrol"
        assert rep["first_weight"] < rep["acqbulk"] < rep["first_x"], f"{what}: load order around the PDL wait"
        assert rep["acqbulk"] < rep["first_store"], f"{what}: a store before the PDL wait"
    else:
        assert rep["acqbulk"] < 0 and rep["preexit"] < 0, f"{what}: griddepcontrol without pdl"
    if rep["cluster"] > 1:
        assert 0 <= rep["cga_arrive"] < rep["cga_wait"], f"{what}: no cluster barrier"
        assert rep["dsmem_store"] >= 0, f"{what}: no distributed shared memory store"
    else:
        assert rep["cga_arrive"] < 0 and rep["dsmem_store"] < 0, f"{what}: cluster code without a cluster"


@pytest.mark.compile
@pytest.mark.parametrize("stage", (1, 2))  # two tests, which pytest-xdist's workers can take side by side
def test_default_tactics_compile_for_sm90a_without_spills(stage):
    specs = [[h, i, stage] for _, _, h, i in SHAPES]
    reports = _compile_reports(specs)
    assert len(reports) == len(specs)
    for rep in reports:
        _check_report(rep)


@pytest.mark.compile
def test_variant_tactics_compile_for_sm90a_without_spills():
    specs = []
    for h, i, stage, t in VARIANTS + [(4096, 512, g, t) for g, t in FIRST_CALL_TACTICS.items()]:
        assert t.valid_for(h, i, stage) is None, (t.name, stage)
        specs.append([h, i, stage, _fields(t)])
    reports = _compile_reports(specs)
    assert len(reports) == len(specs)
    for rep in reports:
        _check_report(rep)


# ---------------------------------------------------------------------- GPU
def _gpu_weights(h, i, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(rows, cols, k):
        return (torch.randn(rows, cols, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)

    return draw(i, h, h), draw(i, h, h), draw(h, i, i)


def _gpu_x(rows, h, seed, big_rows=()):
    """BF16 [rows, h] ~ N(0, 1); rows in `big_rows` x 40 (their gate / up
    reach past the clamp limit 10)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, h, generator=gen, device="cuda")
    for r in big_rows:
        if r < rows:
            x[r] *= 40.0
    return x.to(torch.bfloat16)


def _oracle(x, w1, w3, w2, limit):
    """fp64 of the shared expert's math (no intermediate roundings)."""
    xd = x.double()
    h = swiglu_clamped(xd @ w1.double().T, xd @ w3.double().T, limit)
    return h @ w2.double().T


def _run(kernels, x):
    """The kernels on NaN-poisoned h and out buffers; returns out."""
    kernels.h.fill_(float("nan"))
    out = torch.full((x.shape[0], kernels.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = kernels(x, out)
    assert got is out
    torch.cuda.synchronize()
    return out


def _check(out, x, w1, w3, w2, limit, label, torch_out=None):
    assert not torch.isnan(out).any() and not torch.isinf(out).any(), f"{label}: NaN / Inf (not written?)"
    err = relative_error(out.double(), _oracle(x, w1, w3, w2, limit))
    assert err <= ORACLE_TOLERANCE, f"{label}: relative error {err:.3e} vs fp64"
    if torch_out is not None:  # the torch path's numerics (same roundings, other summation order)
        diff = relative_error(out.double(), torch_out.double())
        assert diff <= ORACLE_TOLERANCE, f"{label}: {diff:.3e} from the torch path"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,h,i", SHAPES, ids=SHAPE_IDS)
def test_kernels_match_fp64_at_every_row_count(preset, tp, h, i):
    from moebench.kernels.shared_expert import SharedExpertKernels

    limit = PRESETS[preset].swiglu_limit
    w1, w3, w2 = _gpu_weights(h, i, seed=tp)
    kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), limit)
    torch_path = StepSharedExpert(w1, w3, w2, limit, kernels=False)
    worst = 0.0
    for rows in range(1, 9):
        x = _gpu_x(rows, h, seed=100 * tp + rows, big_rows=(1, 5))
        out = _run(kernels, x)
        worst = max(worst, _check(out, x, w1, w3, w2, limit, f"{preset} TP{tp} rows {rows}", torch_path(x)))
        # h rows >= T are written as zeros; rows < T hold the BF16 SwiGLU output
        assert torch.all(kernels.h[rows:] == 0), f"rows {rows}: h padding rows not zero"
        assert not torch.isnan(kernels.h[:rows]).any()
    print(f"{preset} TP{tp}: worst relative error {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("h,i,stage,tactic", VARIANTS, ids=[f"{v[0]}x{v[1]}-g{v[2]}-{v[3].name}" for v in VARIANTS])
def test_variant_tactics_match_fp64(h, i, stage, tactic):
    """Other tactics (several items per cluster, 4-tile warps, 2 warps side by
    side, 2-CTA clusters on GEMM2, no PDL) against the same oracle."""
    from moebench.kernels.shared_expert import SharedExpertKernels

    w1, w3, w2 = _gpu_weights(h, i, seed=9)
    kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), 10.0, tactics={stage: tactic})
    assert kernels.tactics[stage] == tactic
    for rows in (1, 6, 8):
        x = _gpu_x(rows, h, seed=rows, big_rows=(0,))
        _check(_run(kernels, x), x, w1, w3, w2, 10.0, f"{tactic.name} rows {rows}")


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_and_follows_inputs():
    from moebench.kernels.shared_expert import SharedExpertKernels

    h, i, rows = 5120, 576, 6
    w1, w3, w2 = _gpu_weights(h, i, seed=21)
    kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), 10.0)
    x = _gpu_x(rows, h, seed=1)
    out = torch.empty(rows, h, dtype=torch.bfloat16, device="cuda")
    kernels(x, out)  # eager first: loads the kernels
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels(x, out)
    for _ in range(2):
        out.fill_(float("nan"))
        kernels.h.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    x.copy_(_gpu_x(rows, h, seed=2))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    _check(out, x, w1, w3, w2, 10.0, "graph replay, new x")


@pytest.mark.gpu
def test_the_first_call_may_be_captured():
    """SharedExpertKernels loads its kernels when built: a first call inside
    a capture (a tactic pair no other test launches) replays correctly."""
    from moebench.kernels.shared_expert import SharedExpertKernels

    h, i, rows = 4096, 512, 3
    w1, w3, w2 = _gpu_weights(h, i, seed=31)
    kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), 10.0, tactics=FIRST_CALL_TACTICS)
    x = _gpu_x(rows, h, seed=7)
    out = torch.full((rows, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels(x, out)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, w1, w3, w2, 10.0, "first call captured")


@pytest.mark.gpu
def test_step_shared_expert_takes_the_kernels_on_the_gpu():
    h, i = 4096, 256
    w1, w3, w2 = _gpu_weights(h, i, seed=4)
    shared = StepSharedExpert(w1, w3, w2, 10.0)
    assert shared.path == "kernels" and shared.kernel_refusal is None
    x = _gpu_x(8, h, seed=3)
    torch_out = StepSharedExpert(w1, w3, w2, 10.0, kernels=False)(x)
    out = shared(x)
    assert shared.last_path == "kernels"
    _check(out, x, w1, w3, w2, 10.0, "StepSharedExpert", torch_out)
    big = _gpu_x(9, h, seed=5)  # more rows than the kernels take: the torch path
    shared(big)
    assert shared.last_path == "torch"


@pytest.mark.gpu
def test_kernels_reject_bad_calls():
    from moebench.kernels.shared_expert import SharedExpertKernels

    h, i = 4096, 256
    w1, w3, w2 = _gpu_weights(h, i, seed=6)
    kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), 10.0)
    x = _gpu_x(4, h, seed=1)
    with pytest.raises(ValueError, match="9 rows"):
        kernels(_gpu_x(9, h, seed=1))
    with pytest.raises(TypeError, match="out must be torch.bfloat16"):
        kernels(x, torch.empty(4, h, device="cuda"))
    with pytest.raises(ValueError, match="out must have shape"):
        kernels(x, torch.empty(5, h, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="limit"):
        SharedExpertKernels(kernels.weights, 0.0)
    with pytest.raises(ValueError, match="tactics\\[1\\]"):
        SharedExpertKernels(kernels.weights, 10.0, tactics={1: SharedTactic(warps_k=12)})
    with pytest.raises(ValueError, match="weights: the kernels need a CUDA device"):
        SharedExpertKernels(to_shared_layout(w1.cpu(), w3.cpu(), w2.cpu()), 10.0)
