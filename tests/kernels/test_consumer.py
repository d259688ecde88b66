"""The pipelined wgmma consumer (`GemmTactic.mma_depth`, `_d<d>`) and the
compute-only measurement mode (`compile_gemm(..., resident=True)`,
scripts/consumer.py): sm_90a cross-compiles and SASS (CPU), numerics vs the
fp64 oracle and bit for bit vs the unpipelined twin, graph replay (GPU)."""

import dataclasses

import pytest
import torch
from kernel_checks import compile_reports, sass_count
from test_gemm import (
    _check_graph_replay,
    _check_h_fp8,
    _check_rows,
    _gpu_case,
    _graph_case,
    _routings,
    _run_gemm1,
    _run_gemm2,
)

from moebench.formats import dequantize_mxfp8, generate_activations, quantize_mxfp8
from moebench.kernels.tactic import MAX_MMA_DEPTH, GemmShape, GemmTactic, default_fp8_tactic
from moebench.models import PRESETS
from moebench.record import TILE, build_route_record
from moebench.routing import scenario_topk_ids

#: dsv41-flash TP4's fp8 defaults (GEMM1 64-row items, four warpgroups, unroll 4; GEMM2 one
#: warpgroup per CTA, 4 CTAs/SM, unroll 3) with every depth they take, and a 32-row GEMM1 twin.
PIPED_1 = [GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, mma_depth=d) for d in (1, 2, 3)] + [
    GemmTactic(32, 4, 4, 4, 1, stages=4, fp8=True, mma_depth=2)
]
PIPED_2 = [GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True, mma_depth=d) for d in (1, 2)]


def piped_twins(tactic: GemmTactic) -> list[GemmTactic]:
    """The pipelined twins (mma_depth 1 .. unroll - 1) of an fp8 bulk tactic; [] otherwise."""
    if not (tactic.fp8 and tactic.bulk):
        return []
    return [dataclasses.replace(tactic, mma_depth=d) for d in range(1, min(MAX_MMA_DEPTH, tactic.unroll - 1) + 1)]


# ---------------------------------------------------------------------- CPU
def test_mma_depth_name_fields_and_validation():
    t = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, mma_depth=2)
    assert t.name == "r16_m4_k4_u4_c1_b4_d2_f8" and GemmTactic.from_name(t.name) == t
    assert t.to_fields()["mma_depth"] == 2 and GemmTactic.from_fields(t.to_fields()) == t
    assert "mma_depth" not in dataclasses.replace(t, mma_depth=0).to_fields()  # the shipped tables stay as they are
    with pytest.raises(ValueError, match="needs an fp8 tactic on the bulk ring"):
        GemmTactic(32, 4, 1, 3, 4, fp8=True, mma_depth=1)
    with pytest.raises(ValueError, match="needs an fp8 tactic on the bulk ring"):
        GemmTactic(64, 1, 4, 4, 2, stages=4, mma_depth=1)
    with pytest.raises(ValueError, match="less than unroll 3"):
        GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True, mma_depth=3)
    with pytest.raises(ValueError, match=r"mma_depth must be in \[0, 3\]"):
        GemmTactic(32, 4, 1, 8, 4, stages=2, fp8=True, mma_depth=4)
    with pytest.raises(TypeError, match="mma_depth must be an int"):
        GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True, mma_depth=1.0)
    with pytest.raises(ValueError, match="canonical form"):
        GemmTactic.from_name("r32_m4_k1_u3_c4_b4_d0_f8")
    assert piped_twins(GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True)) == PIPED_2
    assert piped_twins(GemmTactic(32, 4, 1, 3, 4, fp8=True)) == []


def test_resident_is_checked():
    from moebench.kernels.gemm import check_resident

    check_resident(True, PIPED_1[0])
    check_resident(False, GemmTactic())
    with pytest.raises(ValueError, match="needs a tactic on the bulk ring"):
        check_resident(True, GemmTactic(32, 4, 1, 3, 4, fp8=True))
    with pytest.raises(TypeError, match="resident must be a bool"):
        check_resident(1, PIPED_1[0])
    check_resident("mma", PIPED_1[0])
    check_resident("math", PIPED_2[0])
    with pytest.raises(TypeError, match="resident must be a bool or one of"):
        check_resident("tensor", PIPED_1[0])
    with pytest.raises(ValueError, match="is not fp8"):
        check_resident("mma", GemmTactic(64, 1, 4, 4, 2, stages=4))


_COMPILE_SPEC = """
from moebench.kernels.gemm import compile_gemm
from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.models import get_preset

def compile_spec(spec):
    preset, tp, stage, wide, resident, name = spec
    compile_gemm(GemmShape.of(get_preset(preset).shard(tp)), GemmTactic.from_name(name), stage, wide, resident)
    return {}
"""


@pytest.mark.compile
def test_pipelined_tactics_compile_without_spills_and_keep_their_wgmmas_in_flight():
    """No spills, native QGMMA, and the pipeline in the SASS: a
    `WARPGROUP.DEPBAR.LE gsb0, 0x<d>` (ptxas did not serialize the wgmmas,
    which puts a DEPBAR ... 0x0 after every one), bulk copies and shared loads."""
    specs = [("dsv41-flash", 4, 1, False, False, t.name) for t in PIPED_1]
    specs += [("dsv41-flash", 4, 2, False, False, t.name) for t in PIPED_2]
    specs += [("dsv4-flash", 8, 1, True, False, PIPED_1[1].name)]  # special weight scales (codes 0 / 255)
    reports = compile_reports(_COMPILE_SPEC, specs)
    assert len(reports) == len(specs)
    for rep in reports:
        name = rep["spec"][5]
        assert rep["regs"] and all(s == 0 for s in rep["spills"]), f"{name}: spills {rep['spills']}"
        if not rep["instr"]:
            pytest.skip("nvdisasm not available: SASS not checked")
        depth = GemmTactic.from_name(name).mma_depth
        assert sass_count(rep, r"\b(?:LDL|STL)\b") == 0, name
        assert sass_count(rep, r"QGMMA\.64x8x32\.F32\.E4M3\.E4M3") > 0, name
        assert sass_count(rep, rf"WARPGROUP\.DEPBAR\.LE gsb0, 0x{depth}\b") > 0, f"{name}: wgmmas serialized"
        assert sass_count(rep, r"UBLKCP") > 0 and sass_count(rep, r"LDS\.(?:64|128)") > 0, name


@pytest.mark.compile
def test_resident_twins_compile_for_both_families():
    """The compute-only twin of an fp8 and a BF16 bulk tactic and the two
    fp8 probes compile, with their bulk copies (the first stages), no
    spills, and the wgmmas exactly where the probe keeps them."""
    specs = [
        ("dsv41-flash", 4, 1, False, True, PIPED_1[0].name),
        ("dsv41-flash", 4, 2, False, True, "r64_m4_k2_u2_c2_b4"),
    ]
    specs += [("dsv41-flash", 4, 2, False, probe, PIPED_2[1].name) for probe in ("mma", "math")]
    for rep in compile_reports(_COMPILE_SPEC, specs):
        assert rep["regs"] and all(s == 0 for s in rep["spills"]), rep["spec"]
        if rep["instr"]:
            assert sass_count(rep, r"UBLKCP") > 0, rep["spec"]
            qgmma = sass_count(rep, r"QGMMA\.64x8x32")
            # the "mma" probe keeps every wgmma (results live in the accumulator), "math" has none
            fp8 = GemmTactic.from_name(rep["spec"][5]).fp8
            assert (qgmma > 0) == (fp8 and rep["spec"][4] != "math"), f"{rep['spec']}: {qgmma} QGMMA"


# ---------------------------------------------------------------------- GPU
def _oracle(weights, x_q, x_s, route):
    from moebench.reference import reference_gemm1, reference_gemm2

    ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
    return ref_q, ref_s, reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)


def _pair_tactics(kw8, ctas):
    """(stage, plain, [its pipelined twins]) of the fp8 defaults for `ctas` tiles (bulk ring only)."""
    out = []
    for stage in (1, 2):
        try:
            base = default_fp8_tactic(kw8, stage, ctas)
        except ValueError:
            continue
        twins = [t for t in piped_twins(base) if t.valid_for(kw8, stage) is None]
        if twins:
            out.append((stage, base, twins))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [(p, tp) for p in sorted(PRESETS) for tp in (1, 2, 4, 8)])
def test_pipelined_tactics_match_the_oracle_and_their_plain_twin(preset, tp):
    """Every preset x TP 1/2/4/8 x rows 1-8 (correlated), plus non-local ids
    and one expert: fresh random weights and activations, poisoned outputs;
    each pipelined twin of the shape's fp8 defaults meets the oracle (H and
    rows) and writes the very bytes its unpipelined twin writes."""
    from moebench.kernels.layout import to_kernel_layout

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp + 101)
    kw8 = to_kernel_layout(weights, operand="e4m3")
    cases = [(f"correlated-r{r}", scenario_topk_ids("correlated", r, 6, experts, seed=r + 40)) for r in range(1, 9)]
    cases += [(label, ids) for label, ids in _routings(experts, rows_list=(8,)) if label in ("one-expert", "nonlocal")]
    checked = 0
    for label, ids in cases:
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 77, device="cuda"))
        route = build_route_record(ids.cuda(), experts)
        ref_q, ref_s, oracle = _oracle(weights, x_q, x_s, route)
        used = TILE * route.tiles_used
        h_in, hs_in = ref_q.view(torch.uint8).contiguous(), ref_s.contiguous()
        for stage, base, twins in _pair_tactics(kw8, route.ctas):
            want = _run_gemm1(kw8, x_q, x_s, route, tactic=base) if stage == 1 else None
            want2 = _run_gemm2(kw8, h_in, hs_in, route, tactic=base) if stage == 2 else None
            for t in twins:
                what = f"{preset} TP{tp} {label} {t.name}"
                if stage == 1:
                    h_q, h_s = _run_gemm1(kw8, x_q, x_s, route, tactic=t)
                    _check_h_fp8(h_q, h_s, ref_q, ref_s, used, what)
                    assert torch.equal(h_q[:used], want[0][:used]) and torch.equal(h_s[:used], want[1][:used]), what
                else:
                    out = _run_gemm2(kw8, h_in, hs_in, route, tactic=t)
                    _check_rows(out, oracle, route, what)
                    assert torch.equal(out[:used].view(torch.int16), want2[:used].view(torch.int16)), what
                checked += 1
    assert checked > 0, f"{preset} TP{tp}: no pipelined tactic fits"


@pytest.mark.gpu
def test_pipelined_pair_replays_in_a_graph_and_follows_inputs():
    """The pipelined GEMM1 + GEMM2 (dsv41-flash TP4) in a CUDA graph: a
    replay into poisoned buffers equals the eager call, new activations
    change the rows."""
    case = _graph_case(6, ids_seed=3, operand="e4m3")
    _, kw, *_ = case
    t1, t2 = PIPED_1[1], PIPED_2[-1]
    assert t1.valid_for(kw, 1) is None and t2.valid_for(kw, 2) is None
    _check_graph_replay(case, t1, t2, follows="out")


@pytest.mark.gpu
def test_resident_launches_finish_at_any_size():
    """The compute-only twin (and the fp8 probes) terminates whether a CTA
    has fewer steps than stages (rows 1) or many (64 tiles), for both
    families' bulk tactics."""
    from moebench.kernels.layout import to_kernel_layout

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=9)
    kws = {True: to_kernel_layout(weights, operand="e4m3"), False: to_kernel_layout(weights, operand="bf16")}
    gs = GemmShape.of(shape)
    pairs = [(PIPED_1[0], PIPED_2[0]), (GemmTactic(64, 1, 4, 4, 2, stages=4), GemmTactic(64, 4, 2, 2, 2, stages=4))]
    for ids in (torch.tensor([[3]], dtype=torch.int32), torch.randperm(experts)[:64].view(8, 8).to(torch.int32)):
        route = build_route_record(ids.cuda(), experts)
        x_q, x_s = quantize_mxfp8(generate_activations(ids.shape[0], shape.hidden, seed=4, device="cuda"))
        n = TILE * route.ctas
        h_q = torch.zeros(n, gs.intermediate, dtype=torch.uint8, device="cuda")
        h_s = torch.full((n, gs.intermediate // 32), 127, dtype=torch.uint8, device="cuda")
        out = torch.zeros(n, gs.hidden, dtype=torch.bfloat16, device="cuda")
        from moebench.kernels.gemm import gemm1, gemm2

        for t1, t2 in pairs:
            kw = kws[t1.fp8]
            for mode in (True, "mma", "math") if t1.fp8 else (True,):
                gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, torch.zeros_like(h_s), tactic=t1, resident=mode)
                gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2, resident=mode)
                torch.cuda.synchronize()
