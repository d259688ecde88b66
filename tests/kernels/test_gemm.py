"""GEMM1 / GEMM2 kernels: sm_90a cross-compiles (CPU) and numerics vs the
fp64 oracle, CUDA-graph capture (GPU)."""

import pytest
import torch
from kernel_checks import assert_pair_graph_replays, compile_reports, sass_count

from moebench.formats import dequantize_mxfp8, generate_activations, generate_expert_weights, quantize_mxfp8
from moebench.kernels.tactic import (
    GemmShape, GemmTactic, default_tactic, workspace_bytes, workspace_bytes_for, workspace_parts,
)  # fmt: skip
from moebench.models import PRESETS, get_preset
from moebench.record import TILE, build_route_record, max_ctas, route_words

TPS = (1, 2, 4, 8)
ALL_SHAPES = [(p, tp) for p in sorted(PRESETS) for tp in TPS]

# A spec is (preset, tp, stage, wide, ctas[, tactic fields]): the default
# tactic for ctas, or GemmTactic(**fields) when given.
_COMPILE_SPEC = """
from moebench.kernels.gemm import compile_gemm
from moebench.kernels.tactic import GemmShape, GemmTactic, default_tactic
from moebench.models import get_preset

def compile_spec(spec):
    preset, tp, stage, wide, ctas, *fields = spec
    shape = GemmShape.of(get_preset(preset).shard(tp))
    tactic = GemmTactic(**fields[0]) if fields else default_tactic(shape, stage, ctas, 132, wide)
    compile_gemm(shape, tactic, stage, wide)
    return {}
"""


def _compile_reports(specs):
    reports = compile_reports(_COMPILE_SPEC, specs)
    for rep in reports:
        rep.update(
            have_sass=bool(rep["instr"]), hmma=sass_count(rep, r"HMMA\.16816\.F32\.BF16"),
            qgmma=sass_count(rep, r"QGMMA\.64x8x32\.F32\.E4M3\.E4M3"), f2fp_e4m3=sass_count(rep, r"F2FP\.F16\.E4M3"),
            atom_inc=sass_count(rep, r"ATOMG\.E\.INC\.STRONG\.GPU"),
            ldg_strong=sass_count(rep, r"LDG\.E(?:\.64|\.128)?\.STRONG\.GPU"),
            ldg_ef128=sass_count(rep, r"LDG\.E\.EF\.128"), ublkcp=sass_count(rep, r"UBLKCP"),
            local=sass_count(rep, r"\b(?:LDL|STL)\b"),
        )  # fmt: skip
    return reports


def _checked_reports(specs):
    """`_compile_reports(specs)` after the checks every GEMM kernel must pass:
    one report per spec, a ptxas report without spills and, where SASS was
    dumped (else the test is skipped), no local memory and HMMA present."""
    reports = _compile_reports(specs)
    assert len(reports) == len(specs)
    for rep in reports:
        assert rep["regs"], f"{rep['spec']}: no ptxas report"
        assert all(s == 0 for s in rep["spills"]), f"{rep['spec']}: spills {rep['spills']}"
        if not rep["have_sass"]:
            pytest.skip("nvdisasm not available: SASS not checked")
        assert rep["local"] == 0, f"{rep['spec']}: local memory traffic in SASS"
        fp8 = len(rep["spec"]) > 5 and rep["spec"][5].get("fp8", False)
        if fp8:  # native FP8: wgmma m64n8k32 e4m3 (no F2FP emulation, which mma.sync e4m3 gets on sm_90)
            assert rep["qgmma"] > 0 and rep["f2fp_e4m3"] == 0, f"{rep['spec']}: no QGMMA.64x8x32 / F2FP seen"
        else:
            assert rep["hmma"] > 0, f"{rep['spec']}: no HMMA.16816.F32.BF16"
    return reports


# The two longest compile tests run once per stage (GEMM1, GEMM2), the
# defaults' also once per preset: tests that pytest-xdist's workers can take
# side by side, together compiling the same kernels as one test over all
# (presets' shapes differ, so no kernel is compiled twice).


@pytest.mark.compile
@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_default_tactics_compile_for_sm90a_without_spills(preset, stage):
    specs, seen = [], set()

    def add(p, tp, stage, wide, ctas):
        shape = GemmShape.of(get_preset(p).shard(tp))
        key = (shape, stage, wide, default_tactic(shape, stage, ctas, 132, wide))
        if key not in seen:  # compile_gemm is cached: one report per distinct kernel
            seen.add(key)
            specs.append((p, tp, stage, wide, ctas))

    for tp in TPS:  # every distinct default over rows 1..8 (ctas 6..48 at top-6)
        for ctas in (None, 6, 12, 24, 36, 48):
            add(preset, tp, stage, False, ctas)
    for ctas in (None, 6, 24) if preset == "dsv41-flash" else ():  # two-multiply decode for E8M0 codes > 128
        add(preset, 4 if stage == 1 else 8, stage, True, ctas)
    for rep in _checked_reports(specs):
        # register path: 16-byte evict-first loads; bulk-ring defaults: bulk copies (L2 evict-first)
        assert rep["ldg_ef128"] > 0 or rep["ublkcp"] > 0, f"{rep['spec']}: no evict-first / bulk weight loads"


#: Split-K tactics the next GPU run measures (scripts/time_gemms.py SPLIT_K_1 /
#: SPLIT_K_2; GEMM1 shapes are the same at TP4 and TP8): (preset, tp, stage, tactic).
SPLIT_K_TACTICS = [
    ("dsv41-flash", 4, 1, GemmTactic(64, 1, 4, 4, 3, split_k=2)),
    ("dsv41-flash", 4, 1, GemmTactic(64, 1, 4, 4, 3, split_k=4)),
    ("dsv41-flash", 4, 1, GemmTactic(64, 1, 8, 4, 1, split_k=4)),
    ("dsv41-flash", 4, 2, GemmTactic(64, 8, 1, 2, 2, split_k=2)),
    ("dsv41-flash", 4, 2, GemmTactic(64, 8, 1, 2, 2, split_k=3)),
    ("dsv41-flash", 4, 2, GemmTactic(32, 4, 1, 4, 4, split_k=2, persistent=False)),
    ("dsv41-flash", 8, 2, GemmTactic(64, 8, 1, 2, 2, split_k=3)),
]


def _fields(t: GemmTactic) -> dict:
    return {f: getattr(t, f) for f in t.__dataclass_fields__}


@pytest.mark.compile
def test_split_k_tactics_compile_for_sm90a_without_spills():
    specs = []
    for preset, tp, stage, t in SPLIT_K_TACTICS:
        assert t.valid_for(get_preset(preset).shard(tp), stage) is None, (t.name, stage)
        specs.append((preset, tp, stage, False, None, _fields(t)))
    # the two-multiply decode (E8M0 codes > 128) with split 4
    specs.append(("dsv41-flash", 4, 1, True, None, _fields(GemmTactic(64, 1, 4, 3, 3, split_k=4))))
    for rep in _checked_reports(specs):
        assert rep["ldg_ef128"] > 0, f"{rep['spec']}: no evict-first loads"
        # the arrival (self-cleaning atomic increment) and the gpu-scope reads of the partials
        assert rep["atom_inc"] > 0, f"{rep['spec']}: no ATOMG.E.INC.STRONG.GPU"
        assert rep["ldg_strong"] > 0, f"{rep['spec']}: partials not read with gpu-scope loads"


def test_split_k_validation():
    with pytest.raises(ValueError, match="split_k"):
        GemmTactic(split_k=0)
    with pytest.raises(ValueError, match="split_k"):
        GemmTactic(split_k=17)
    with pytest.raises(TypeError, match="split_k"):
        GemmTactic(split_k=2.0)
    assert GemmTactic().split_k == 1 and GemmTactic().name == "r64_m1_k8_u2_c2"  # names unchanged
    assert GemmTactic(split_k=4).name == "r64_m1_k8_u2_c2_s4"
    tp4 = GemmShape(5120, 576, 384)  # GEMM1: 160 K chunks; GEMM2: 18
    tp8 = GemmShape(5120, 288, 384)  # GEMM2: 9 K chunks
    assert GemmTactic(64, 1, 4, 4, 3, split_k=4).valid_for(tp4, 1) is None
    assert GemmTactic(64, 1, 4, 4, 3, split_k=5).valid_for(tp4, 1) is None
    why = GemmTactic(64, 1, 4, 4, 3, split_k=3).valid_for(tp4, 1)
    assert why is not None and "split_k 3 does not divide the 160 K chunks" in why
    why = GemmTactic(64, 8, 1, 2, 2, split_k=2).valid_for(tp8, 2)
    assert why is not None and "does not divide the 9 K chunks" in why
    assert GemmTactic(64, 8, 1, 2, 2, split_k=3).valid_for(tp8, 2) is None
    # every warp of a unit needs a chunk of its slice: 18 / 6 = 3 chunks < 4 warps
    why = GemmTactic(32, 4, 4, 2, 2, split_k=6).valid_for(tp4, 2)
    assert why is not None and "warps_k 4 exceeds the 3 K chunks of a slice" in why
    assert GemmTactic(32, 4, 3, 2, 2, split_k=6).valid_for(tp4, 2) is None
    for p, tp in ALL_SHAPES:  # the defaults never split K (that choice waits for a GPU measurement)
        sh = GemmShape.of(get_preset(p).shard(tp))
        for stage in (1, 2):
            for ctas in (None, 1, 6, 24, 48):
                assert default_tactic(sh, stage, ctas).split_k == 1


def test_workspace_bytes():
    tp4 = GemmShape(5120, 576, 384)
    t1 = GemmTactic(64, 1, 4, 4, 3, split_k=4)
    t2 = GemmTactic(64, 8, 1, 2, 2, split_k=2)
    assert workspace_bytes(tp4, GemmTactic(), 48, 1) == 0
    assert workspace_parts(tp4, GemmTactic(), 48, 2) == (0, 0)
    # GEMM1, 48 tiles: 48 x 18 items; a 4-byte counter each (rounded up to 16 bytes in all),
    # partials [split 4][8 tokens][64 rows] fp32 each
    items1 = 48 * (2 * 576 // 64)
    assert workspace_parts(tp4, t1, 48, 1) == (-(-4 * items1 // 16) * 16, items1 * 4 * 8 * 64 * 4)
    assert workspace_bytes(tp4, t1, 48, 1) == sum(workspace_parts(tp4, t1, 48, 1))
    # GEMM2: 512-row items, 10 per tile
    items2 = 48 * (5120 // 512)
    assert workspace_parts(tp4, t2, 48, 2) == (items2 * 4, items2 * 2 * 8 * 512 * 4)
    assert workspace_bytes(tp4, t1, 0, 1) == 0
    assert workspace_bytes(tp4, t1, 7, 1) % 16 == 0
    # one buffer for several launches: the largest counters + the largest partials
    c1, p1 = workspace_parts(tp4, t1, 48, 1)
    c2, p2 = workspace_parts(tp4, t2, 48, 2)
    launches = [(1, t1, 48), (2, t2, 48), (1, GemmTactic(), 48), (1, t1, 6)]
    assert workspace_bytes_for(tp4, launches) == max(c1, c2) + max(p1, p2)
    assert workspace_bytes_for(tp4, [(1, GemmTactic(), 48)]) == 0
    with pytest.raises(ValueError, match="cannot run"):
        workspace_bytes(GemmShape(5120, 288, 384), t2, 6, 2)  # 9 chunks, split 2
    with pytest.raises(ValueError, match="ctas"):
        workspace_bytes(tp4, t1, -1, 1)
    with pytest.raises(ValueError, match="stage"):
        workspace_bytes(tp4, t1, 6, 3)
    with pytest.raises(TypeError, match="tactic"):
        workspace_bytes(tp4, "s4", 6, 1)


def test_tactic_validation():
    with pytest.raises(ValueError, match="tile_rows"):
        GemmTactic(tile_rows=48)
    with pytest.raises(ValueError, match="warps_m"):
        GemmTactic(warps_m=8, warps_k=4)
    with pytest.raises(TypeError, match="pdl"):
        GemmTactic(pdl=1)
    shape = GemmShape(5120, 288, 384)
    assert GemmTactic(tile_rows=128).valid_for(shape, 1) is not None  # 576 rows not / 128
    assert GemmTactic(tile_rows=32).valid_for(shape, 1) is not None  # half a gate/up block
    for p, tp in ALL_SHAPES:
        s = GemmShape.of(get_preset(p).shard(tp))
        for stage in (1, 2):
            for ctas in (None, 1, 6, 24, 48):
                assert default_tactic(s, stage, ctas).valid_for(s, stage) is None


# ---------------------------------------------------------------------- GPU
def _gpu_case(preset, tp, experts, seed, device="cuda"):
    shape = get_preset(preset, experts=experts).shard(tp)
    weights = generate_expert_weights(shape, seed=seed, device=device)
    return shape, weights


def _byte_ordinal(b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> integers ordered like their values (sign-magnitude)."""
    v = b.view(torch.uint8).to(torch.int32)
    mag = v & 0x7F
    return torch.where(v >= 0x80, -mag, mag)


def _routings(experts, rows_list=(1, 3, 6, 8), top_k=6):
    from moebench.routing import scenario_topk_ids

    out = []
    for rows in rows_list:
        for scen in ("uniform", "correlated", "hot", "zipf"):
            out.append((f"{scen}-r{rows}", scenario_topk_ids(scen, rows, top_k, experts, seed=rows)))
    one = torch.full((8, top_k), 5, dtype=torch.int32)  # every slot on one expert: 6 tiles
    out.append(("one-expert", one))
    mixed = scenario_topk_ids("uniform", 5, top_k, experts, seed=9)
    mixed[::2, 1::2] = -1  # experts of other ranks
    mixed[1, 0] = experts + 3
    out.append(("nonlocal", mixed))
    return out


def _run_gemm1(kw, x_q, x_s, route, tactic=None, workspace=None):
    from moebench.kernels.gemm import gemm1

    n = TILE * route.ctas
    h_q = torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda")  # poison
    h_s = torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda")
    gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=tactic, workspace=workspace)
    return h_q, h_s


def _run_gemm2(kw, h_q, h_s, route, tactic=None, workspace=None):
    from moebench.kernels.gemm import gemm2

    out = torch.full((TILE * route.ctas, kw.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=tactic, workspace=workspace)
    return out


def _check_h(h_q, h_s, ref_q, ref_s, used_rows, label):
    hq, rq = h_q[:used_rows], ref_q.view(torch.uint8)[:used_rows]
    hs, rs = h_s[:used_rows], ref_s[:used_rows]
    equal = (hq == rq).double().mean().item()
    same_scale = (hs == rs).double().mean().item()
    assert equal >= 0.999, f"{label}: only {equal:.5f} of H bytes equal"
    assert same_scale >= 0.999, f"{label}: only {same_scale:.5f} of H scales equal"
    blocks_ok = (hs == rs).repeat_interleave(32, dim=1)
    dist = (_byte_ordinal(hq) - _byte_ordinal(rq)).abs()
    sel = dist[blocks_ok]
    assert sel.numel() == 0 or int(sel.max()) <= 1, f"{label}: H bytes more than one code apart"


def _check_rows(out, oracle, route, label):
    from moebench.reference import ORACLE_TOLERANCE, relative_error

    used = TILE * route.tiles_used
    assert not torch.isnan(out[:used]).any(), f"{label}: rows of used tiles not written / NaN"
    err = relative_error(out[:used].double(), oracle[:used])
    assert err <= ORACLE_TOLERANCE, f"{label}: relative error {err:.3e}"
    valid = route.tile_valid_rows.tolist()
    for t in range(route.tiles_used):
        assert torch.all(out[TILE * t + valid[t] : TILE * (t + 1)] == 0), f"{label}: padding rows not zero"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", ALL_SHAPES)
def test_gemms_match_the_oracle(preset, tp):
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp)
    kw = to_kernel_layout(weights)
    assert not kw.wide_scales
    worst = 0.0
    for label, ids in _routings(experts):
        label = f"{preset} TP{tp} {label}"
        rows = ids.shape[0]
        x = generate_activations(rows, shape.hidden, seed=rows + tp, device="cuda")
        x_q, x_s = quantize_mxfp8(x)
        route = build_route_record(ids.cuda(), experts)
        h_q, h_s = _run_gemm1(kw, x_q, x_s, route)
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
        used = TILE * route.tiles_used
        _check_h(h_q, h_s, ref_q, ref_s, used, label)
        # GEMM2 on the oracle's H (isolates GEMM2), then on GEMM1's own H
        ref_h = dequantize_mxfp8(ref_q, ref_s, torch.float64)
        oracle = reference_gemm2(ref_h, weights, route)
        out = _run_gemm2(kw, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route)
        worst = max(worst, _check_rows(out, oracle, route, label))
        out2 = _run_gemm2(kw, h_q, h_s, route)
        _check_rows(out2, oracle, route, label + " (chained)")
    print(f"{preset} TP{tp}: worst GEMM2 relative error {worst:.2e}")


@pytest.mark.gpu
def test_wide_weight_scales_are_exact():
    """E8M0 weight codes above 128 take the two-multiply decode."""
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 32
    shape, weights = _gpu_case("dsv4-flash", 8, experts, seed=2)
    # rescale: w x 2^16 and x / 2^16 keeps every product; codes reach ~140
    for name in ("w13_scale", "w2_scale"):
        t = getattr(weights, name)
        t.copy_(torch.where(t > 0, t + 16, t))
    kw = to_kernel_layout(weights)
    assert kw.wide_scales and kw.max_scale_code > 128
    from moebench.routing import scenario_topk_ids

    ids = scenario_topk_ids("uniform", 4, 6, experts, seed=1)
    x = generate_activations(4, shape.hidden, seed=3, device="cuda") * 2.0**-16
    x_q, x_s = quantize_mxfp8(x)
    route = build_route_record(ids.cuda(), experts)
    h_q, h_s = _run_gemm1(kw, x_q, x_s, route)
    ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
    _check_h(h_q, h_s, ref_q, ref_s, TILE * route.tiles_used, "wide scales")
    oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
    out = _run_gemm2(kw, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route)
    _check_rows(out, oracle, route, "wide scales")


@pytest.mark.gpu
def test_other_tactics_match_the_oracle():
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 32
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=7)
    kw = to_kernel_layout(weights)
    from moebench.routing import scenario_topk_ids

    ids = scenario_topk_ids("correlated", 6, 6, experts, seed=4)
    x = generate_activations(6, shape.hidden, seed=4, device="cuda")
    x_q, x_s = quantize_mxfp8(x)
    route = build_route_record(ids.cuda(), experts)
    ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
    oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
    for t1 in (
        GemmTactic(64, 1, 4, 4, 3),
        GemmTactic(128, 1, 16, 1, 1, pdl=False),
        GemmTactic(64, 2, 8, 3, 1),
        GemmTactic(64, 1, 8, 2, 2, persistent=False),
    ):
        if t1.valid_for(kw, 1) is None:
            h_q, h_s = _run_gemm1(kw, x_q, x_s, route, tactic=t1)
            _check_h(h_q, h_s, ref_q, ref_s, TILE * route.tiles_used, t1.name)
    for t2 in (
        GemmTactic(64, 4, 2, 3, 2),
        GemmTactic(128, 1, 8, 1, 1),
        GemmTactic(32, 16, 1, 4, 1, pdl=False),
        GemmTactic(64, 8, 1, 2, 2, persistent=False),
    ):
        if t2.valid_for(kw, 2) is None:
            out = _run_gemm2(kw, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route, tactic=t2)
            _check_rows(out, oracle, route, t2.name)


def _graph_case(rows: int, ids_seed: int, operand: str = "bf16", weights_seed: int = 5):
    """dsv41-flash TP4 (64 experts) weights (seed `weights_seed`) in the
    `operand` layout (the default tactics: BF16 or fp8), a correlated routing
    of `rows`, MXFP8 activations (seed 1) and zeroed GEMM buffers, for the
    graph-replay tests (here, test_consumer.py's and test_two_plane.py's)."""
    from moebench.kernels.layout import to_kernel_layout
    from moebench.routing import scenario_topk_ids

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=weights_seed)
    kw = to_kernel_layout(weights, operand)
    route = build_route_record(scenario_topk_ids("correlated", rows, 6, experts, seed=ids_seed).cuda(), experts)
    x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=1, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.zeros(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.zeros(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.zeros(n, kw.hidden, dtype=torch.bfloat16, device="cuda")
    return shape, kw, route, x_q, x_s, h_q, h_s, out


def _check_graph_replay(case, t1: GemmTactic | None, t2: GemmTactic | None, follows: str) -> None:
    """GEMM1 (`t1`) + GEMM2 (`t2`; None: the defaults) on a _graph_case
    `case` in a CUDA graph: kernel_checks.assert_pair_graph_replays, the new
    activations drawn with seed 2 (`follows`: "out" or "h_q" must change)."""
    from moebench.kernels.gemm import gemm1, gemm2

    shape, kw, route, x_q, x_s, h_q, h_s, out = case

    def step():
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1)
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2)

    x_new = quantize_mxfp8(generate_activations(x_q.shape[0], shape.hidden, seed=2, device="cuda"))
    assert_pair_graph_replays(step, (x_q, x_s), x_new, h_q, h_s, out, TILE * route.tiles_used, follows)


@pytest.mark.gpu
@pytest.mark.parametrize("operand", ["bf16", "e4m3", "e4m3-bulk"])
def test_cuda_graph_replay_matches_eager_and_follows_inputs(operand):
    bulk = operand.endswith("-bulk")  # the warp-specialized fp8 pair (F8_BULK_*)
    case = _graph_case(6, ids_seed=2, operand=operand.removesuffix("-bulk"))
    _, kw, *_ = case
    t1 = next((t for t in F8_BULK_1 if t.valid_for(kw, 1) is None), None) if bulk else None
    t2 = next((t for t in F8_BULK_2 if t.valid_for(kw, 2) is None), None) if bulk else None
    assert not bulk or (t1 and t2)
    _check_graph_replay(case, t1, t2, follows="out")


@pytest.mark.gpu
def test_launch_rejects_bad_arguments():
    from moebench.kernels.gemm import gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout

    experts = 32
    shape, weights = _gpu_case("dsv4-flash", 8, experts, seed=1)
    kw = to_kernel_layout(weights)
    route = build_route_record(torch.tensor([[1, 2, 3, 4, 5, 6]], dtype=torch.int32, device="cuda"), experts)
    x_q, x_s = quantize_mxfp8(generate_activations(1, shape.hidden, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.empty(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.empty(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="h_q_out"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q[:, :-32], h_s)
    with pytest.raises(TypeError, match="x_scale"):
        gemm1(kw, x_q, x_s.float(), route.record, route.ctas, h_q, h_s)
    with pytest.raises(ValueError, match="record"):
        gemm1(kw, x_q, x_s, route.record[:-1], route.ctas, h_q, h_s)
    with pytest.raises(TypeError, match="out"):
        gemm2(kw, h_q, h_s, route.record, route.ctas, torch.empty(n, kw.hidden, device="cuda"))


# ---------------------------------------------------------------------- GPU: split-K
#: (GEMM1 tactic, GEMM2 tactic) pairs the split-K GPU tests run at dsv41-flash TP4
#: (GEMM1 K = 5120: 160 chunks; GEMM2 K = 576: 18 chunks, so GEMM2 splits 2 or 3).
def _split_k_pairs(split_k: int):
    s2 = split_k if 18 % split_k == 0 else 3
    return [
        (GemmTactic(64, 1, 4, 4, 3, split_k=split_k), GemmTactic(64, 8, 1, 2, 2, split_k=s2)),
        (GemmTactic(64, 1, 8, 4, 1, split_k=split_k, persistent=False),
         GemmTactic(32, 4, 1, 4, 4, split_k=s2, persistent=False)),
        (GemmTactic(128, 1, 8, 1, 1, split_k=split_k, pdl=False), GemmTactic(64, 4, 2, 2, 2, split_k=s2, pdl=False)),
    ]  # fmt: skip


def _split_k_workspace(kw, pairs, ctas=48):
    """One zeroed workspace for every launch of `pairs` up to `ctas` tiles, and
    the size of its counter region (front)."""
    from moebench.kernels.gemm import alloc_workspace

    launches = [(1, t1, ctas) for t1, _ in pairs] + [(2, t2, ctas) for _, t2 in pairs]
    counters = max(workspace_parts(kw, t, c, st)[0] for st, t, c in launches)
    return alloc_workspace(workspace_bytes_for(kw, launches), kw.device), counters


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_matches_the_oracle_and_leaves_the_workspace_clean(split_k):
    """Split-K GEMM1 / GEMM2 (persistent, one CTA per unit, without PDL) on
    poisoned outputs, every routing of `_routings` (rows 1-8, one expert,
    non-local ids) against the oracle; the same launch twice gives the same
    bits (fixed reduction order); the counters are all zero afterwards."""
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=13)
    kw = to_kernel_layout(weights)
    pairs = _split_k_pairs(split_k)
    for t1, t2 in pairs:
        assert t1.valid_for(kw, 1) is None and t2.valid_for(kw, 2) is None, (t1.name, t2.name)
    ws, counter_bytes = _split_k_workspace(kw, pairs)
    for label, ids in _routings(experts):
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 40, device="cuda"))
        route = build_route_record(ids.cuda(), experts)
        used = TILE * route.tiles_used
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
        oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
        for t1, t2 in pairs:
            tag = f"{label} {t1.name} / {t2.name}"
            h_q, h_s = _run_gemm1(kw, x_q, x_s, route, tactic=t1, workspace=ws)
            _check_h(h_q, h_s, ref_q, ref_s, used, tag)
            h_q2, h_s2 = _run_gemm1(kw, x_q, x_s, route, tactic=t1, workspace=ws)
            assert torch.equal(h_q[:used], h_q2[:used]) and torch.equal(h_s[:used], h_s2[:used]), tag
            out = _run_gemm2(
                kw, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route, tactic=t2, workspace=ws
            )
            _check_rows(out, oracle, route, tag)
            out2 = _run_gemm2(kw, h_q, h_s, route, tactic=t2, workspace=ws)
            _check_rows(out2, oracle, route, tag + " (chained)")
            out3 = _run_gemm2(kw, h_q, h_s, route, tactic=t2, workspace=ws)
            assert torch.equal(out2[:used].view(torch.int16), out3[:used].view(torch.int16)), tag
            torch.cuda.synchronize()
            assert int(torch.count_nonzero(ws[:counter_bytes])) == 0, f"{tag}: arrival counters not reset"


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_cuda_graph_replays_self_clean(split_k):
    """GEMM1 + GEMM2 with split-K (PDL between them) under a CUDA graph,
    sharing one workspace: outputs poisoned before each replay, two replays in
    a row equal the eager bits (a counter left non-zero by a replay would
    make the next one skip or double an epilogue and leave poison), then a
    replay on new activations matches the oracle."""
    from moebench.kernels.gemm import gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2
    from moebench.routing import scenario_topk_ids

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=17)
    kw = to_kernel_layout(weights)
    t1, t2 = _split_k_pairs(split_k)[0]
    ws, counter_bytes = _split_k_workspace(kw, [(t1, t2)])
    ids = scenario_topk_ids("correlated", 8, 6, experts, seed=3)
    route = build_route_record(ids.cuda(), experts)
    x_q, x_s = quantize_mxfp8(generate_activations(8, shape.hidden, seed=5, device="cuda"))
    n = TILE * route.ctas
    used = TILE * route.tiles_used
    h_q = torch.zeros(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.zeros(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.zeros(n, kw.hidden, dtype=torch.bfloat16, device="cuda")

    def step():
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, workspace=ws)
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2, workspace=ws)

    def poison():
        h_q.fill_(0xFF)
        h_s.fill_(0xFE)
        out.fill_(float("nan"))

    step()
    torch.cuda.synchronize()
    eager = (h_q.clone(), h_s.clone(), out.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(2):
        poison()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_q[:used], eager[0][:used]) and torch.equal(h_s[:used], eager[1][:used]), replay
        assert torch.equal(out[:used].view(torch.int16), eager[2][:used].view(torch.int16)), replay
        assert int(torch.count_nonzero(ws[:counter_bytes])) == 0, f"replay {replay}: counters not reset"
    x_new = quantize_mxfp8(generate_activations(8, shape.hidden, seed=6, device="cuda"))
    x_q.copy_(x_new[0])
    x_s.copy_(x_new[1])
    poison()
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
    _check_h(h_q, h_s, ref_q, ref_s, used, "graph, new x")
    oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
    _check_rows(out, oracle, route, "graph, new x")


@pytest.mark.gpu
def test_split_k_launch_needs_a_large_enough_workspace():
    from moebench.kernels.gemm import alloc_workspace, gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout
    from moebench.routing import scenario_topk_ids

    experts = 32
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=1)
    kw = to_kernel_layout(weights)
    route = build_route_record(scenario_topk_ids("uniform", 2, 6, experts, seed=1).cuda(), experts)
    x_q, x_s = quantize_mxfp8(generate_activations(2, shape.hidden, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.empty(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.empty(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.empty(n, kw.hidden, dtype=torch.bfloat16, device="cuda")
    t1, t2 = GemmTactic(64, 1, 4, 4, 3, split_k=4), GemmTactic(64, 8, 1, 2, 2, split_k=2)
    with pytest.raises(ValueError, match="workspace is required"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1)
    with pytest.raises(ValueError, match="workspace is required"):
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2)
    small = alloc_workspace(workspace_bytes(kw, t1, route.ctas, 1) - 16, "cuda")
    with pytest.raises(ValueError, match="workspace must hold"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, workspace=small)
    with pytest.raises(TypeError, match="workspace"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, workspace=small.float())
    # a tactic without split-K ignores the workspace argument
    gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, workspace=None)
    torch.cuda.synchronize()


# ---------------------------------------------------------------- bulk-copy load path (tactic.stages > 0)
#: Bulk tactics under test: 1 / 2 / 8 compute warps, K interleaved over warps,
#: 2-4 stages; at every preset the K chunks are not all multiples of a stage
#: (partial last stage) for some of them.
BULK_1 = [GemmTactic(64, 1, 8, 2, 2, stages=4), GemmTactic(64, 2, 4, 2, 2, stages=3),
          GemmTactic(64, 1, 4, 2, 3, stages=2)]  # fmt: skip
BULK_2 = [GemmTactic(64, 8, 1, 2, 2, stages=4), GemmTactic(64, 1, 8, 2, 2, stages=4),
          GemmTactic(32, 8, 1, 2, 3, stages=4)]  # fmt: skip


def test_bulk_tactic_validation():
    assert GemmTactic(stages=4).name == "r64_m1_k8_u2_c2_b4" and GemmTactic(stages=4).bulk
    assert not GemmTactic().bulk
    with pytest.raises(ValueError, match="stages must be 0"):
        GemmTactic(stages=1)
    with pytest.raises(ValueError, match="stages"):
        GemmTactic(stages=9)
    with pytest.raises(ValueError, match="split_k 1"):
        GemmTactic(stages=4, split_k=2)
    why = GemmTactic(64, 1, 8, 4, 2, stages=4).valid_for(GemmShape(7168, 512, 384), 1)
    assert why is not None and "shared memory" in why
    # the register path too: 16 warps of 128 rows hold 128 KB of fp32 partial sums
    why = GemmTactic(128, 1, 16, 1, 2).valid_for(GemmShape(7168, 512, 384), 1)
    assert why is not None and "fp32 partial sums need 131072 bytes" in why and "2 CTAs per SM" in why
    assert (
        GemmTactic(32, 4, 4, 8, 1, stages=8, fp8=True)
        .valid_for(GemmShape(7168, 512, 384), 1)
        .endswith("at 1 CTA per SM")
    )
    for bad in (True, 1.0, 3):
        with pytest.raises(ValueError, match="stage must be 1 or 2"):
            GemmTactic().valid_for(GemmShape(7168, 512, 384), bad)
    from moebench.kernels.tactic import default_fp8_tactic

    for kw in (dict(num_sms=0), dict(num_sms=True), dict(num_sms=1.5), dict(ctas=True)):
        with pytest.raises(ValueError, match="num_sms|ctas"):
            default_tactic(GemmShape(7168, 512, 384), 1, **{"ctas": 4, **kw})
        with pytest.raises(ValueError, match="num_sms|ctas"):
            default_fp8_tactic(GemmShape(7168, 512, 384), 1, **{"ctas": 4, **kw})
    assert GemmTactic.from_name("r64_m1_k8_u2_c2_b4") == GemmTactic(stages=4)


@pytest.mark.compile
def test_bulk_tactics_compile_for_sm90a_without_spills():
    specs = [("dsv41-flash", 4, 1, False, None, _fields(t)) for t in BULK_1]
    specs += [("dsv41-flash", 4, 2, False, None, _fields(t)) for t in BULK_2]
    specs.append(("dsv4-pro", 8, 1, True, None, _fields(BULK_1[0])))  # two-multiply decode
    for rep in _checked_reports(specs):
        assert rep["ublkcp"] > 0, f"{rep['spec']}: no bulk copy (UBLKCP)"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", ALL_SHAPES)
def test_bulk_load_path_matches_the_oracle(preset, tp):
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp + 11)
    kw = to_kernel_layout(weights)
    for label, ids in _routings(experts, rows_list=(1, 6, 8)):
        label = f"{preset} TP{tp} {label}"
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows, device="cuda"))
        route = build_route_record(ids.cuda(), experts)
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
        oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
        for t1 in BULK_1:
            if t1.valid_for(kw, 1) is None:
                h_q, h_s = _run_gemm1(kw, x_q, x_s, route, tactic=t1)
                _check_h(h_q, h_s, ref_q, ref_s, TILE * route.tiles_used, f"{label} {t1.name}")
        for t2 in BULK_2:
            if t2.valid_for(kw, 2) is None:
                out = _run_gemm2(kw, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route, tactic=t2)
                _check_rows(out, oracle, route, f"{label} {t2.name}")


@pytest.mark.gpu
def test_bulk_graph_replay_matches_eager_and_is_repeatable():
    from moebench.kernels.gemm import gemm1, gemm2

    shape, kw, route, x_q, x_s, h_q, h_s, out = _graph_case(8, ids_seed=3)

    def step():
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=BULK_1[0])
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=BULK_2[0])

    step()
    torch.cuda.synchronize()
    eager = (h_q.clone(), h_s.clone(), out.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    used = TILE * route.tiles_used
    for _ in range(3):  # the mbarrier ring starts afresh in every launch
        h_q.fill_(0xFF)
        h_s.fill_(0xFF)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_q[:used], eager[0][:used]) and torch.equal(h_s[:used], eager[1][:used])
        assert torch.equal(out[:used].view(torch.int16), eager[2][:used].view(torch.int16))


# ---------------------------------------------------------------- BF16 activation operand (tactic.act_bf16)
#: act_bf16 variants of the default tactics (register and bulk paths) at dsv41-flash TP4.
A16_1 = [GemmTactic(64, 1, 4, 4, 3, act_bf16=True), GemmTactic(64, 1, 8, 4, 1, act_bf16=True),
         GemmTactic(64, 1, 8, 2, 2, act_bf16=True), GemmTactic(64, 1, 4, 4, 2, stages=4, act_bf16=True)]  # fmt: skip
A16_2 = [GemmTactic(64, 8, 1, 2, 2, act_bf16=True), GemmTactic(64, 4, 2, 2, 2, stages=4, act_bf16=True),
         GemmTactic(32, 4, 1, 4, 4, persistent=False, act_bf16=True)]  # fmt: skip


def _kernel_act_decode_bits(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """CPU emulation of the kernels' e4m3 decode of byte q with E8M0 s
    (`fp4.e4m3x4_to_bf16x2` bit move, then two round-to-nearest bf16
    multiplies by `fp4.act_multipliers`): int16 bf16 bits."""
    q, s = q.to(torch.int32), s.to(torch.int32)
    bits = (q & 0x80) << 8 | (q & 0x7F) << 4  # value x 2^-120
    m1 = (torch.minimum(s, torch.tensor(134)) + 120) << 7
    m2 = torch.where(s == 255, torch.tensor(0x7FC0), (torch.maximum(s, torch.tensor(134)) - 7) << 7)

    def bf(b):
        return (b.to(torch.int32) << 16).view(torch.float32)

    def mul(a, b):  # bf16 x bf16 is exact in fp32 here; the cast rounds to nearest even
        return ((bf(a) * bf(b)).to(torch.bfloat16).view(torch.int16).to(torch.int32)) & 0xFFFF

    return mul(mul(bits, m1), m2).to(torch.int16)


def test_act_bf16_tactic_name_and_serialization():
    t = GemmTactic(64, 1, 4, 4, 3, act_bf16=True)
    assert t.name == "r64_m1_k4_u4_c3_a16" and not GemmTactic().act_bf16
    for t in (*A16_1, *A16_2, GemmTactic(64, 1, 4, 4, 3, split_k=2, act_bf16=True)):
        assert GemmTactic.from_name(t.name) == t
        assert GemmTactic.from_fields(t.to_fields()) == t
    old = GemmTactic().to_fields()
    del old["act_bf16"]  # tables written before the field: default False
    assert GemmTactic.from_fields(old) == GemmTactic()
    with pytest.raises(TypeError, match="act_bf16"):
        GemmTactic(act_bf16=1)


def test_act_to_bf16_is_the_kernel_decode_bit_for_bit():
    from moebench.kernels.gemm import act_to_bf16

    q = torch.arange(256, dtype=torch.int32).repeat_interleave(256).to(torch.uint8)  # every (q, s) pair
    s = torch.arange(256, dtype=torch.int32).repeat(256).to(torch.uint8)
    want = _kernel_act_decode_bits(q, s)
    qb = q.view(256 * 256, 1).expand(-1, 32).contiguous()  # one 32-block per pair
    got = act_to_bf16(qb, s.view(-1, 1)).view(torch.int16)[:, 0]
    finite = s != 255
    assert torch.equal(got[finite], want[finite])
    nan = got[~finite].view(torch.bfloat16)
    assert torch.isnan(nan).all() and torch.isnan(want[~finite].view(torch.bfloat16)).all()
    assert (got[~finite] == 0x7FFF).all()
    # == dequantize_mxfp8 wherever that is exact in BF16 (no NaN byte / code, no overflow / underflow)
    qv = q.view(torch.float8_e4m3fn).float()
    ref = dequantize_mxfp8(qb.view(torch.float8_e4m3fn), s.view(-1, 1), torch.float64)[:, 0]
    ok = finite & ((q & 0x7F) != 0x7F) & (ref.abs() < 2.0**127) & ((ref == 0) | (ref.abs() >= 2.0**-126))
    assert torch.equal(got[ok].view(torch.bfloat16).double(), ref[ok]) and qv.numel() == 65536
    # the memory order is the B-fragment order: 16 bytes of lane (g, c) = bf16 k0..k7 = b[0..3]
    row = act_to_bf16(qb[:1], torch.full((1, 1), 127, dtype=torch.uint8))
    assert row.view(torch.int32).shape == (1, 16)
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    x_q, x_s = quantize_mxfp8(torch.randn(3, 64) * 7)
    act_to_bf16(x_q, x_s, out=out)
    assert torch.equal(out.float(), dequantize_mxfp8(x_q, x_s, torch.float32))
    with pytest.raises(ValueError, match="scale"):
        act_to_bf16(x_q, x_s[:, :1])


@pytest.mark.compile
def test_act_bf16_tactics_compile_for_sm90a_without_spills():
    specs = [("dsv41-flash", 4, 1, False, None, _fields(t)) for t in A16_1]
    specs += [("dsv41-flash", 4, 2, False, None, _fields(t)) for t in A16_2]
    for rep in _checked_reports(specs):
        assert rep["ldg_ef128"] > 0 or rep["ublkcp"] > 0, f"{rep['spec']}: no evict-first / bulk weight loads"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv41-flash", 8), ("dsv4-flash", 2)])
def test_act_bf16_matches_the_oracle_and_the_e4m3_path_bit_for_bit(preset, tp):
    """Fresh random inputs, poisoned outputs: GEMM1 H bytes vs the oracle and
    its h_deq == act_to_bf16(h_q, h_s); GEMM2 rows vs the oracle; every
    act_bf16 output equal bit for bit to the same tactic's e4m3 output."""
    import dataclasses

    from moebench.kernels.gemm import act_to_bf16, gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout
    from moebench.reference import reference_gemm1, reference_gemm2

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp + 23)
    kw = to_kernel_layout(weights)
    for label, ids in _routings(experts, rows_list=(1, 6, 8)):
        label = f"{preset} TP{tp} {label}"
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 5, device="cuda"))
        x_deq = act_to_bf16(x_q, x_s)
        route = build_route_record(ids.cuda(), experts)
        used, n = TILE * route.tiles_used, TILE * route.ctas
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
        oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
        for t1 in A16_1:
            if t1.valid_for(kw, 1) is not None:
                continue
            h_q = torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda")
            h_s = torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda")
            h_d = torch.full((n, kw.intermediate), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, x_deq=x_deq, h_deq_out=h_d)
            _check_h(h_q, h_s, ref_q, ref_s, used, f"{label} {t1.name}")
            e_q, e_s = _run_gemm1(kw, x_q, x_s, route, tactic=dataclasses.replace(t1, act_bf16=False))
            assert torch.equal(h_q[:used], e_q[:used]) and torch.equal(h_s[:used], e_s[:used]), t1.name
            want = act_to_bf16(h_q[:used], h_s[:used]).view(torch.int16)
            assert torch.equal(h_d[:used].view(torch.int16), want), f"{label} {t1.name}: h_deq"
        h_deq = act_to_bf16(ref_q.view(torch.uint8).contiguous(), ref_s.contiguous())
        for t2 in A16_2:
            if t2.valid_for(kw, 2) is not None:
                continue
            out = torch.full((n, kw.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm2(
                kw,
                ref_q.view(torch.uint8).contiguous(),
                ref_s.contiguous(),
                route.record,
                route.ctas,
                out,
                tactic=t2,
                h_deq=h_deq,
            )
            _check_rows(out, oracle, route, f"{label} {t2.name}")
            e = _run_gemm2(
                kw,
                ref_q.view(torch.uint8).contiguous(),
                ref_s.contiguous(),
                route,
                tactic=dataclasses.replace(t2, act_bf16=False),
            )
            assert torch.equal(out[:used].view(torch.int16), e[:used].view(torch.int16)), f"{label} {t2.name}"


@pytest.mark.gpu
def test_act_bf16_launch_arguments_are_checked():
    from moebench.kernels.gemm import act_to_bf16, gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=1)
    kw = to_kernel_layout(weights)
    route = build_route_record(torch.full((2, 6), 3, dtype=torch.int32, device="cuda"), experts)
    x_q, x_s = quantize_mxfp8(generate_activations(2, shape.hidden, seed=1, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.zeros(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.zeros(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    h_d = torch.zeros(n, kw.intermediate, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(n, kw.hidden, dtype=torch.bfloat16, device="cuda")
    t1, t2 = A16_1[0], A16_2[0]
    with pytest.raises(ValueError, match="x_deq is required"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, h_deq_out=h_d)
    with pytest.raises(ValueError, match="h_deq_out is required"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, x_deq=act_to_bf16(x_q, x_s))
    with pytest.raises(ValueError, match="does not use BF16"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, x_deq=act_to_bf16(x_q, x_s))
    with pytest.raises((TypeError, ValueError), match="x_deq"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, x_deq=x_q, h_deq_out=h_d)
    with pytest.raises(ValueError, match="h_deq is required"):
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2)
    with pytest.raises((TypeError, ValueError), match="h_deq"):
        gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2, h_deq=h_d[:-8])


# ----------------------------------------------------------------------------- fp8 tactics (_f8)
#: fp8 (wgmma) tactics the tests run: one / two warpgroups, K split over
#: warpgroups and across CTAs (split-K), 1-3 CTAs per SM.
F8_1 = [GemmTactic(32, 4, 2, 4, 2, fp8=True), GemmTactic(16, 4, 2, 4, 3, fp8=True),
        GemmTactic(16, 4, 1, 4, 4, fp8=True), GemmTactic(16, 4, 2, 4, 3, split_k=2, fp8=True),
        GemmTactic(32, 8, 1, 2, 1, fp8=True)]  # fmt: skip
F8_2 = [GemmTactic(32, 4, 1, 3, 4, fp8=True), GemmTactic(16, 4, 1, 3, 4, fp8=True),
        GemmTactic(16, 8, 1, 3, 3, fp8=True), GemmTactic(16, 4, 2, 3, 4, fp8=True),
        GemmTactic(16, 4, 1, 3, 4, split_k=3, fp8=True)]  # fmt: skip
#: fp8 tactics on the bulk ring (warp-specialized): 32- and 16-row warps, one to
#: five warpgroups (20 compute warps), 1-3 CTAs per SM (the oracle test skips those a shape rejects);
#: F8_BULK_2's last is dsv41-flash TP4's rows 4-5 GEMM2 pick (two stages of unroll 6).
F8_BULK_1 = [GemmTactic(32, 4, 4, 2, 1, stages=4, fp8=True), GemmTactic(16, 4, 2, 4, 2, stages=3, fp8=True),
             GemmTactic(32, 4, 2, 2, 2, stages=4, fp8=True), GemmTactic(16, 4, 5, 4, 1, stages=6, fp8=True)]  # fmt: skip
F8_BULK_2 = [GemmTactic(32, 4, 1, 3, 2, stages=4, fp8=True), GemmTactic(16, 4, 2, 3, 3, stages=4, fp8=True),
             GemmTactic(32, 8, 2, 3, 1, stages=4, fp8=True),
             GemmTactic(32, 4, 2, 2, 2, stages=4, fp8=True), GemmTactic(16, 8, 1, 2, 2, stages=3, fp8=True),
             GemmTactic(32, 4, 1, 6, 4, stages=2, fp8=True)]  # fmt: skip


def test_fp8_tactic_name_validity_and_default():
    from moebench.kernels.tactic import default_fp8_tactic

    t = GemmTactic(32, 4, 2, 4, 2, fp8=True)
    assert t.name == "r32_m4_k2_u4_c2_f8" and GemmTactic.from_name(t.name) == t
    with pytest.raises(ValueError, match="excludes act_bf16"):
        GemmTactic(fp8=True, act_bf16=True)
    with pytest.raises(TypeError, match="fp8"):
        GemmTactic(fp8=1)
    with pytest.raises(TypeError, match="tile_rows must be an int"):
        GemmTactic(tile_rows=32.0)
    with pytest.raises(ValueError, match="ctas"):
        default_fp8_tactic(GemmShape.of(get_preset("dsv41-flash").shard(4)), 1, -1)
    with pytest.raises(ValueError, match="stage"):
        default_fp8_tactic(GemmShape.of(get_preset("dsv41-flash").shard(4)), 3)
    shape = GemmShape.of(get_preset("dsv41-flash").shard(4))
    assert t.valid_for(shape, 1) is None
    assert "tile_rows 16 or 32" in GemmTactic(64, 1, 4, 4, 3, fp8=True).valid_for(shape, 1)
    assert "warps_m a multiple of 4" in GemmTactic(32, 2, 4, 2, 2, fp8=True).valid_for(shape, 1)
    assert "divide" in GemmTactic(32, 4, 1, 4, 2, fp8=True).valid_for(shape, 2)  # 18 K chunks
    assert "shared memory" in GemmTactic(32, 4, 2, 4, 8, fp8=True).valid_for(shape, 1)
    assert GemmTactic(32, 4, 4, 2, 1, stages=4, fp8=True).valid_for(shape, 1) is None  # the bulk ring
    why = GemmTactic(32, 4, 4, 4, 1, stages=8, fp8=True).valid_for(shape, 1)
    assert "the fp32 partial sums, the fp8 activation tile, 8 bulk stages need" in why
    for ctas in (1, 6, 20, 40):
        for stage in (1, 2):
            d = default_tactic(shape, stage, ctas, 132, fp8=True)
            assert d.fp8 and d == default_fp8_tactic(shape, stage, ctas) and d.valid_for(shape, stage) is None
    assert default_fp8_tactic(GemmShape.of(get_preset("dsv41-flash").shard(8)), 1).tile_rows == 16  # 576 rows
    # v11: the warp-specialized kernels; 64-row items where they take fewer passes (rows 1 at TP4);
    # GEMM1 as its two-plane twin (issue 36 item 4: the one-plane misses the numerics margin)
    assert default_fp8_tactic(shape, 1, 1).name == "r16_m4_k4_u4_c1_b4_p2_f8"
    assert [default_fp8_tactic(shape, 1, max_ctas(r, 6, 384)).name[:3] for r in (4, 6, 8)] == ["r32", "r16", "r32"]
    assert default_fp8_tactic(shape, 2, 6).name == "r32_m4_k1_u3_c4_b4_f8"
    pro = GemmShape.of(get_preset("dsv4-pro").shard(8))  # H 7168: 4 stages of 128-row items do not fit, 3 do,
    assert default_fp8_tactic(pro, 1, max_ctas(4, 6, 384)).name == "r32_m4_k4_u4_c1_b2_p2_f8"  # 2 beside 2 planes
    with pytest.raises(ValueError, match="tile_rows must be"):
        GemmTactic(16, 4, 2, 4, 3)


def _fp8_compile_specs(gemm1, gemm2):
    """Compile specs of the fp8 tactics `gemm1` / `gemm2` valid for dsv41-flash
    TP4, plus gemm1[1] at dsv4-flash TP8 compiled for special weight scales
    (codes 0 / 255)."""
    shape = GemmShape.of(get_preset("dsv41-flash").shard(4))
    specs = [("dsv41-flash", 4, 1, False, None, _fields(t)) for t in gemm1 if t.valid_for(shape, 1) is None]
    specs += [("dsv41-flash", 4, 2, False, None, _fields(t)) for t in gemm2 if t.valid_for(shape, 2) is None]
    return specs + [("dsv4-flash", 8, 1, True, None, _fields(gemm1[1]))]


@pytest.mark.compile
def test_fp8_tactics_compile_for_sm90a_without_spills():
    specs = _fp8_compile_specs(F8_1, F8_2)
    assert len(specs) >= 8
    for rep in _checked_reports(specs):  # 16-row warps load 8 bytes per lane and chunk
        assert sass_count(rep, r"LDG\.E\.EF\.(?:64|128)") > 0, f"{rep['spec']}: no evict-first weight loads"


@pytest.mark.compile
def test_fp8_bulk_tactics_compile_for_sm90a_without_spills():
    specs = _fp8_compile_specs(F8_BULK_1, F8_BULK_2)
    assert len(specs) >= 6
    for rep in _checked_reports(specs):  # the weights arrive by bulk copy, the warps read shared memory
        assert rep["ublkcp"] > 0, f"{rep['spec']}: no bulk copy (UBLKCP)"
        assert sass_count(rep, r"LDS\.(?:64|128)") > 0, f"{rep['spec']}: no 8/16-byte shared loads"


def _check_h_fp8(h_q, h_s, ref_q, ref_s, used_rows, label):
    """GEMM1 H of an fp8 tactic vs the oracle's. Hopper's FP8 tensor cores
    sum a 32-K block with fewer bits than fp32 (DeepSeek-V3 report, 3.3.2),
    so an element far below its block's maximum may land several e4m3 codes
    from the oracle's (the codes are dense there) while the value is off by
    a tiny fraction of the block, and a value near a rounding boundary moves
    one code: bytes >= 99 % equal over the used rows, scales >= 99.9 %, and
    the dequantized H within the oracle tolerance (relative Frobenius, 1e-2;
    measured 1.2-1.9e-3 on the H200): `moebench.tuning.runner.h_fp8_mismatch`,
    which the tuner's check uses too."""
    from moebench.tuning.runner import h_fp8_mismatch

    hq, rq = h_q[:used_rows], ref_q.view(torch.uint8)[:used_rows]
    hs, rs = h_s[:used_rows], ref_s[:used_rows]
    print(f"{label}: {(hq == rq).double().mean().item():.5f} of H bytes equal")
    why = h_fp8_mismatch(hq, hs, rq, rs)
    assert why is None, f"{label}: {why}"


def _fp8_check(kw8, weights, x_q, x_s, route, label, t1s=F8_1, t2s=F8_2):
    """Every fp8 tactic (and the default, tactic=None) vs the oracle on poisoned outputs."""
    from moebench.kernels.gemm import alloc_workspace
    from moebench.kernels.tactic import workspace_bytes_for
    from moebench.reference import reference_gemm1, reference_gemm2

    ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
    oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
    from moebench.kernels.tactic import default_fp8_tactic

    t1s = [t for t in t1s if t.valid_for(kw8, 1) is None]
    t2s = [t for t in t2s if t.valid_for(kw8, 2) is None]
    need = workspace_bytes_for(GemmShape.of(kw8), [(1, t, route.ctas) for t in t1s] + [(2, t, route.ctas) for t in t2s])
    ws = alloc_workspace(need, "cuda") if need else None
    used = TILE * route.tiles_used
    try:
        default_fp8_tactic(kw8, 1)
    except ValueError:  # no fp8 GEMM1 for this shape: the launch says so
        with pytest.raises(ValueError, match="no fp8 GEMM1"):
            _run_gemm1(kw8, x_q, x_s, route)
        t1s = None
    for t1 in [None, *t1s] if t1s is not None else []:
        h_q, h_s = _run_gemm1(kw8, x_q, x_s, route, tactic=t1, workspace=ws)
        _check_h_fp8(h_q, h_s, ref_q, ref_s, used, f"{label} {t1.name if t1 else 'default'}")
    for t2 in [None, *t2s]:
        out = _run_gemm2(kw8, ref_q.view(torch.uint8).contiguous(), ref_s.contiguous(), route, tactic=t2, workspace=ws)
        _check_rows(out, oracle, route, f"{label} {t2.name if t2 else 'default'}")
    return ws


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv41-flash", 8), ("dsv4-flash", 2), ("dsv4-pro", 1)])
def test_fp8_tactics_match_the_oracle(preset, tp):
    """Fresh random weights (e4m3 layout) and activations, every routing
    shape (one expert, non-local ids, hot, uniform...), poisoned outputs."""
    from moebench.kernels.layout import to_kernel_layout

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp + 31)
    kw8 = to_kernel_layout(weights, operand="e4m3")
    assert not kw8.special_scales
    for label, ids in _routings(experts, rows_list=(1, 6, 8)):
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 9, device="cuda"))
        route = build_route_record(ids.cuda(), experts)
        t1s, t2s = (
            (F8_1 + F8_BULK_1, F8_2 + F8_BULK_2)
            if label.startswith(("correlated", "one", "nonlocal"))
            else (F8_1[:1] + F8_BULK_1[:1], F8_2[:1] + F8_BULK_2[:1])
        )
        _fp8_check(kw8, weights, x_q, x_s, route, f"{preset} TP{tp} {label}", t1s, t2s)


@pytest.mark.gpu
def test_fp8_special_and_wide_weight_scales_are_exact():
    """Weight codes 0 (2^-127) and > 128 with activations scaled to match:
    the fp8 kernels compiled for special scales vs the oracle."""
    from moebench.kernels.layout import to_kernel_layout
    from moebench.routing import scenario_topk_ids

    experts = 32
    shape, weights = _gpu_case("dsv4-flash", 8, experts, seed=3)
    for name in ("w13_scale", "w2_scale"):
        t = getattr(weights, name)
        t.copy_(torch.where(t > 0, t + 16, t))  # codes ~ 135-140
    # expert 0's weight scales: all code 0 .. 3 (2^-127 .. 2^-124), its rows big enough to matter
    weights.w13_scale[0] = torch.where(weights.w13_scale[0] > 0, weights.w13_scale[0] % 4, 0)
    kw8 = to_kernel_layout(weights, operand="e4m3")
    assert kw8.special_scales and kw8.min_scale_code == 0
    ids = scenario_topk_ids("uniform", 4, 6, experts, seed=1)
    ids[:, 0] = 0
    x = generate_activations(4, shape.hidden, seed=3, device="cuda") * 2.0**-16
    x_q, x_s = quantize_mxfp8(x)
    route = build_route_record(ids.cuda(), experts)
    _fp8_check(kw8, weights, x_q, x_s, route, "special scales", F8_1[:2] + F8_BULK_1[1:2], F8_2[:2] + F8_BULK_2[:1])


@pytest.mark.gpu
def test_fp8_tactic_and_weight_layout_must_match():
    from moebench.kernels.gemm import gemm1

    shape, kw, route, x_q, x_s, h_q, h_s, out = _graph_case(2, ids_seed=1)
    with pytest.raises(ValueError, match="does not match the weights"):
        gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=F8_1[0])
    import dataclasses

    kw8 = dataclasses.replace(kw, operand="e4m3")
    with pytest.raises(ValueError, match="does not match the weights"):
        gemm1(kw8, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=GemmTactic(64, 1, 8, 4, 1))


# ---------------------------------------------------------------- spec: GEMM1's first stages before its wait
#: spec tactics (fp8 bulk GEMM1) and their plain twins (the last: dsv41-flash TP4's rows 4-5 pick).
SPEC_1 = [GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, spec=True),
          GemmTactic(32, 4, 4, 4, 1, stages=4, fp8=True, spec=True),
          GemmTactic(16, 4, 2, 8, 2, stages=2, fp8=True, spec=True),
          GemmTactic(16, 4, 2, 8, 1, stages=4, fp8=True, spec=True)]  # fmt: skip


def test_spec_tactic_validation():
    t = SPEC_1[0]
    assert t.name == "r16_m4_k4_u4_c1_b4_sp_f8" and GemmTactic.from_name(t.name) == t
    for bad in (dict(stages=0), dict(fp8=False, tile_rows=32), dict(pdl=False)):
        with pytest.raises(ValueError, match="spec"):
            GemmTactic(
                **{
                    **dict(tile_rows=16, warps_m=4, warps_k=4, unroll=4, ctas_per_sm=1, stages=4, fp8=True, spec=True),
                    **bad,
                }
            )
    with pytest.raises(TypeError, match="spec must be a bool"):
        GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, spec=1)
    shape = get_preset("dsv41-flash").shard(4)
    assert t.valid_for(shape, 1) is None
    assert "GEMM1" in t.valid_for(shape, 2)


@pytest.mark.compile
def test_spec_tactics_compile_for_sm90a_without_spills():
    specs = [("dsv41-flash", 4, 1, False, None, _fields(t)) for t in SPEC_1]
    for rep in _checked_reports(specs):  # the prediction: relaxed gpu loads of the ids, shared atomics,
        # bulk copies, then the wait (ACQBULK) and the trap on a disagreeing record
        assert sass_count(rep, r"LDG\.E\.STRONG\.GPU") >= 2, rep["spec"]
        assert sass_count(rep, r"ATOMS\.OR") >= 2 and sass_count(rep, r"BPT\.TRAP") == 1, rep["spec"]


@pytest.mark.gpu
def test_spec_gemm1_equals_its_plain_twin_and_replays():
    """A spec GEMM1 (ids read and stages issued before the wait) writes the
    same H bytes as the same tactic without spec, over routings with
    distinct, non-local and repeated ids (the last switch the prediction
    off), eagerly and under graph replay behind the route kernel."""
    import dataclasses

    from moebench.kernels.gemm import gemm1
    from moebench.kernels.layout import to_kernel_layout
    from moebench.kernels.route import launch_route_quantize

    experts = 64
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=17)
    kw = to_kernel_layout(weights, "e4m3")
    gen = torch.Generator().manual_seed(23)
    cases = []
    for rows in (1, 2, 4, 6, 8):
        distinct = torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(rows)])
        holes = distinct.clone()
        holes[torch.rand(rows, 6, generator=gen) < 0.3] = -1
        repeats = torch.randint(0, 4, (rows, 6), generator=gen)
        cases += [(f"distinct-r{rows}", distinct), (f"non-local-r{rows}", holes), (f"repeats-r{rows}", repeats)]
    for t in SPEC_1:
        plain = dataclasses.replace(t, spec=False)
        for label, ids in cases:
            ids = ids.to(torch.int32).cuda()
            route = build_route_record(ids, experts)
            x_q, x_s = quantize_mxfp8(generate_activations(ids.shape[0], shape.hidden, seed=2, device="cuda"))
            want = _run_gemm1(kw, x_q, x_s, route, tactic=plain)
            n = TILE * route.ctas
            h_q = torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda")
            h_s = torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda")
            gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t, topk_ids=ids)
            used = TILE * route.tiles_used
            assert torch.equal(h_q[:used], want[0][:used]) and torch.equal(h_s[:used], want[1][:used]), (
                f"{t.name} {label}"
            )
    # behind the route kernel that releases after its wait, in a graph; new ids between replays
    t, rows = SPEC_1[0], 6
    x = generate_activations(rows, shape.hidden, seed=3, device="cuda")
    ids = torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(rows)]).to(torch.int32).cuda()
    ctas = max_ctas(rows, 6, experts)
    record = torch.empty(route_words(ctas), dtype=torch.int32, device="cuda")
    permuted = torch.empty(rows, 6, dtype=torch.int32, device="cuda")
    x_q = torch.empty(rows, shape.hidden, dtype=torch.uint8, device="cuda")
    x_s = torch.empty(rows, shape.hidden // 32, dtype=torch.uint8, device="cuda")
    h_q = torch.empty(TILE * ctas, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.empty(TILE * ctas, kw.intermediate // 32, dtype=torch.uint8, device="cuda")

    # two layers per replay: the second route kernel follows the first GEMM1 under PDL; with
    # inputs_ready it reads ids and x before its wait and lets GEMM1 launch on entry
    for ready in (False, True):

        def step():
            for _ in range(2):
                launch_route_quantize(
                    x, x_q, x_s, ids, record, permuted, experts, release_after_wait=not ready, inputs_ready=ready
                )
                gemm1(kw, x_q, x_s, record, ctas, h_q, h_s, tactic=t, topk_ids=ids)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in range(3):
            ids.copy_(torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(rows)]).to(torch.int32))
            x.copy_(generate_activations(rows, shape.hidden, seed=seed + 11, device="cuda"))
            h_q.fill_(0xFF)
            graph.replay()
            torch.cuda.synchronize()
            route = build_route_record(ids, experts)
            want_q, want_s = quantize_mxfp8(x)
            assert torch.equal(x_q, want_q.view(torch.uint8)) and torch.equal(x_s, want_s), f"replay {seed} {ready}"
            want = _run_gemm1(kw, x_q, x_s, route, tactic=dataclasses.replace(t, spec=False))
            used = TILE * route.tiles_used
            assert torch.equal(h_q[:used], want[0][:used]), f"replay {seed} inputs_ready={ready}"


# ---------------------------------------------------------------------- cluster_k (K split over a cluster)
#: GEMM1 at dsv41-flash TP8 (160 K chunks: 54 items at rows 1, fewer than the SMs), 2- and 4-CTA
#: clusters, with and without spec, and 128-row items (TP4 only); GEMM2 at TP4 (18 K chunks) in
#: 2-CTA clusters. The tests skip what a shape rejects.
CLUSTER_1 = [GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=2),
             GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=2, spec=True),
             GemmTactic(16, 4, 2, 4, 1, stages=4, fp8=True, cluster_k=4)]  # fmt: skip
CLUSTER_1_TP4 = [GemmTactic(32, 4, 2, 4, 1, stages=4, fp8=True, cluster_k=2)]
CLUSTER_2 = [GemmTactic(32, 4, 1, 3, 2, stages=4, fp8=True, cluster_k=2)]


def test_cluster_tactic_validation_name_and_table_fields():
    from moebench.kernels.tactic import cluster_landing_bytes

    t = CLUSTER_1[1]
    assert t.name == "r16_m4_k4_u4_c1_b4_cl2_sp_f8" and GemmTactic.from_name(t.name) == t
    assert GemmTactic.from_fields(t.to_fields()) == t and t.to_fields()["cluster_k"] == 2
    plain = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True)
    assert "cluster_k" not in plain.to_fields()  # the shipped tables' entries stay as they are
    assert cluster_landing_bytes(t) == 2 * 1 * 8 * 64 * 4 and cluster_landing_bytes(plain) == 0
    for bad in (dict(fp8=False, tile_rows=32), dict(stages=0), dict(cluster_k=9), dict(cluster_k=0)):
        with pytest.raises(ValueError, match="cluster_k"):
            GemmTactic(
                **{
                    **dict(
                        tile_rows=16, warps_m=4, warps_k=4, unroll=4, ctas_per_sm=1, stages=4, fp8=True, cluster_k=2
                    ),
                    **bad,
                }
            )
    with pytest.raises(TypeError, match="cluster_k must be an int"):
        GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=2.0)
    tp8, tp4 = get_preset("dsv41-flash").shard(8), get_preset("dsv41-flash").shard(4)
    for c in CLUSTER_1:
        assert c.valid_for(tp8, 1) is None and c.valid_for(tp4, 1) is None, c.name
    for c in CLUSTER_1_TP4:
        assert c.valid_for(tp4, 1) is None and "multiple of 128 rows" in c.valid_for(tp8, 1), c.name
    for c in CLUSTER_2:
        assert c.valid_for(tp4, 2) is None, c.name
    # 160 chunks are not whole steps of 3 x 16 per rank; 9 GEMM2 chunks at TP8 do not split in two
    why = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=3).valid_for(tp8, 1)
    assert "cluster_k 3 needs cluster_k * warps_k * unroll (48) to divide the 160 K chunks" in why
    assert "to divide the 9 K chunks" in CLUSTER_2[0].valid_for(tp8, 2)


def test_cluster_grid_is_whole_clusters():
    from moebench.kernels.gemm import StreamingGemmKernel

    pytest.importorskip("cutlass")
    shape = GemmShape.of(get_preset("dsv41-flash").shard(8))
    k = StreamingGemmKernel(CLUSTER_1[0], shape, 1)
    assert k.grid(6, 132) == 2 * min(6 * 9, 132 // 2) == 108  # rows 1: 54 items, one 2-CTA cluster each
    assert k.grid(48, 132) == 132 and k.grid(48, 133) == 132  # persistent: whole clusters on the SMs
    k4 = StreamingGemmKernel(CLUSTER_1[2], shape, 1)
    assert k4.grid(6, 132) == 132 and k4.nb_c * 4 == k4.nb


@pytest.mark.compile
def test_cluster_tactics_compile_for_sm90a_without_spills():
    specs = [("dsv41-flash", 8, 1, False, None, _fields(t)) for t in CLUSTER_1]
    specs += [("dsv41-flash", 4, 1, False, None, _fields(t)) for t in CLUSTER_1_TP4]
    specs += [("dsv41-flash", 4, 2, False, None, _fields(t)) for t in CLUSTER_2]
    for rep in _checked_reports(specs):  # st.async hand-off to rank 0, the start-up cluster barrier, bulk copies
        assert sass_count(rep, r"^STAS") > 0, f"{rep['spec']}: no st.async (STAS)"
        assert sass_count(rep, r"UCGABAR_ARV") == 1 and sass_count(rep, r"UCGABAR_WAIT") == 1, rep["spec"]
        assert rep["ublkcp"] > 0, f"{rep['spec']}: no bulk copy (UBLKCP)"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 8), ("dsv41-flash", 4)])
def test_cluster_k_matches_the_oracle(preset, tp):
    """K split over the CTAs of a cluster, sums handed to rank 0 through
    distributed shared memory: every routing shape (one expert: 6 tiles;
    rows 8: several units per cluster, so the landing zone's parities are
    reused and freed), poisoned outputs, the fp64 oracle; a second launch
    gives the same bits (deterministic, nothing left over in the mbarriers)."""
    from moebench.kernels.layout import to_kernel_layout

    experts = 64
    shape, weights = _gpu_case(preset, tp, experts, seed=tp + 41)
    kw8 = to_kernel_layout(weights, operand="e4m3")
    for label, ids in _routings(experts, rows_list=(1, 2, 8)):
        rows = ids.shape[0]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 5, device="cuda"))
        route = build_route_record(ids.cuda(), experts)
        t1s = [t for t in CLUSTER_1 + CLUSTER_1_TP4 if t.valid_for(kw8, 1) is None and not t.spec]
        t2s = [t for t in CLUSTER_2 if t.valid_for(kw8, 2) is None]
        _fp8_check(kw8, weights, x_q, x_s, route, f"{preset} TP{tp} {label}", t1s=t1s, t2s=t2s)
        used = TILE * route.tiles_used
        for t in t1s:
            first = _run_gemm1(kw8, x_q, x_s, route, tactic=t)
            again = _run_gemm1(kw8, x_q, x_s, route, tactic=t)
            assert torch.equal(first[0][:used], again[0][:used]), f"{t.name} {label}: not repeatable"
        # a spec cluster tactic (the ids read before the wait) writes what its plain twin writes
        for t in [t for t in CLUSTER_1 if t.spec and t.valid_for(kw8, 1) is None]:
            import dataclasses

            from moebench.kernels.gemm import gemm1

            want = _run_gemm1(kw8, x_q, x_s, route, tactic=dataclasses.replace(t, spec=False))
            h_q = torch.full_like(want[0], 0xFF)
            h_s = torch.full_like(want[1], 0xFE)
            gemm1(kw8, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t, topk_ids=ids.cuda())
            assert torch.equal(h_q[:used], want[0][:used]) and torch.equal(h_s[:used], want[1][:used]), (
                f"{t.name} {label}"
            )


@pytest.mark.gpu
def test_cluster_k_graph_replay_follows_new_inputs():
    """A captured cluster GEMM1 + GEMM2 replayed with new x and new ids
    equals eager launches of the same tactics (the mbarrier phases carry
    over between launches without host work)."""
    from moebench.kernels.gemm import gemm1, gemm2
    from moebench.kernels.layout import to_kernel_layout

    experts, rows = 64, 8
    shape, weights = _gpu_case("dsv41-flash", 4, experts, seed=5)
    kw8 = to_kernel_layout(weights, operand="e4m3")
    t1, t2 = CLUSTER_1[0], CLUSTER_2[0]
    assert t1.valid_for(kw8, 1) is None and t2.valid_for(kw8, 2) is None
    gen = torch.Generator().manual_seed(7)
    ctas = max_ctas(rows, 6, experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(rows)]).to(torch.int32).cuda()
    route = build_route_record(ids, experts)
    record = route.record.clone()
    x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=1, device="cuda"))
    x_q = x_q.view(torch.uint8).clone()
    h_q = torch.zeros(TILE * ctas, kw8.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.zeros(TILE * ctas, kw8.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.zeros(TILE * ctas, kw8.hidden, dtype=torch.bfloat16, device="cuda")

    def step():
        gemm1(kw8, x_q, x_s, record, ctas, h_q, h_s, tactic=t1)
        gemm2(kw8, h_q, h_s, record, ctas, out, tactic=t2)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        new_ids = torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(rows)]).to(torch.int32)
        new_route = build_route_record(new_ids.cuda(), experts)
        record.copy_(new_route.record)
        q, s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=seed + 20, device="cuda"))
        x_q.copy_(q.view(torch.uint8))
        x_s.copy_(s)
        h_q.fill_(0xFF)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want_h = _run_gemm1(kw8, x_q, x_s, new_route, tactic=t1)
        want_out = _run_gemm2(kw8, want_h[0], want_h[1], new_route, tactic=t2)
        used = TILE * new_route.tiles_used
        assert torch.equal(h_q[:used], want_h[0][:used]) and torch.equal(h_s[:used], want_h[1][:used]), seed
        assert torch.equal(out[:used], want_out[:used]), f"replay {seed}"


@pytest.mark.compile
@pytest.mark.parametrize("stage", (1, 2))
def test_shipped_table_tactics_compile_for_sm90a_without_spills(stage):
    """Every distinct tactic of this stage the shipped tuning tables name
    (both families, every rows entry) compiles without spills, with the
    instructions of its family, for the first shape class (by file name)
    whose table names it: 55 kernels over both stages, not the 166 of every shape class, to
    keep CI's time (a tactic's registers depend on its own parameters, the
    shape only sets loop counts and strides)."""
    from moebench.kernels.table import PACKAGE_TABLES, read_table

    by_shape = {GemmShape.of(get_preset(p).shard(tp)): (p, tp) for p, tp in ALL_SHAPES}
    specs = {}
    for path in sorted(PACKAGE_TABLES.glob("*.json")):
        table = read_table(path)
        p, tp = by_shape[table.shape.gemm_shape]  # every shipped table is a preset's rank shape
        for fp8 in (False, True):
            for (st, _rows), entry in sorted(table.entries_of(fp8).items()):
                if st == stage:
                    specs.setdefault(entry.tactic, (p, tp, stage, False, None, _fields(entry.tactic)))
    assert len(specs) >= 10
    for rep in _checked_reports(list(specs.values())):
        assert rep["ldg_ef128"] > 0 or rep["ublkcp"] > 0 or rep["qgmma"] > 0, rep["spec"]
