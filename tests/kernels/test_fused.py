"""The fused layer (GEMM1 + GEMM2 in one launch, GEMM2's first units
resident): tactic rules and sm_90a cross-compiles (CPU); bit-for-bit
equality with the pair of the same tactics, the oracle, self-cleaning
counters and CUDA-graph replay (GPU)."""

import pytest
import torch
from kernel_checks import compile_reports, sass_count

from moebench.formats import dequantize_mxfp8, generate_activations, generate_expert_weights, quantize_mxfp8
from moebench.kernels.fused import MAX_LEAD, MAX_RESIDENT, FusedTactic, fused_smem_bytes, fused_workspace_bytes
from moebench.kernels.limits import SMEM_PER_CTA
from moebench.kernels.tactic import GemmTactic
from moebench.models import get_preset
from moebench.record import TILE, build_route_record, max_ctas, route_words

#: GEMM1: 64-row items of four warpgroups splitting K (16 warps); GEMM2: the same 16 warps as
#: 128-row items (K split in two) or, where I / 32 = 9 chunks allow no split, 256-row items.
G1 = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True)
G2 = {("dsv41-flash", 4): GemmTactic(16, 8, 2, 3, 1, stages=4, fp8=True),
      ("dsv41-flash", 8): GemmTactic(16, 16, 1, 3, 1, stages=4, fp8=True),
      ("dsv4-flash", 4): GemmTactic(16, 8, 2, 4, 1, stages=4, fp8=True)}  # fmt: skip


def test_fused_tactic_rules_and_name():
    tp4 = get_preset("dsv41-flash").shard(4)
    ft = FusedTactic(G1, G2[("dsv41-flash", 4)], 2)
    assert ft.name == "r16_m4_k4_u4_c1_b4_f8+r16_m8_k2_u3_c1_b4_f8_res2" and ft.why_invalid(tp4) is None
    assert fused_smem_bytes(ft, tp4) <= SMEM_PER_CTA
    # three resident 128-row units no longer fit beside GEMM1's ring and activation tile
    assert "shared memory" in FusedTactic(G1, G2[("dsv41-flash", 4)], 3).why_invalid(tp4)
    for key, g2 in G2.items():
        assert FusedTactic(G1, g2, 2).why_invalid(get_preset(key[0]).shard(key[1])) is None, key
    bad = {
        "one CTA per SM": FusedTactic(G1, GemmTactic(32, 4, 1, 3, 2, stages=4, fp8=True)),
        "fp8 on the bulk ring": FusedTactic(G1, GemmTactic(32, 8, 2, 3, 1, fp8=True)),
        "warps differ": FusedTactic(G1, GemmTactic(32, 4, 1, 3, 1, stages=4, fp8=True)),
        "spec": FusedTactic(GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, spec=True), G2[("dsv41-flash", 4)]),
        "divide": FusedTactic(G1, G2[("dsv41-flash", 4)]),  # 6 does not divide TP8's 9 GEMM2 chunks
    }
    for why, t in bad.items():
        shape = get_preset("dsv41-flash").shard(8 if why == "divide" else 4)
        assert why in t.why_invalid(shape), (why, t.why_invalid(shape))
    for r in (-1, MAX_RESIDENT + 1):
        with pytest.raises(ValueError, match="resident"):
            FusedTactic(G1, G1, r)
    for r in (True, 1.0):
        with pytest.raises(TypeError, match="resident must be an int"):
            FusedTactic(G1, G1, r)
    with pytest.raises(TypeError, match="gemm2 must be a GemmTactic"):
        FusedTactic(G1, "r16_m8_k2_u3_c1_b4_f8")
    assert FusedTactic(G1, G2[("dsv41-flash", 4)], 2, 0).name == ft.name + "_ld0"
    for ld in (-1, MAX_LEAD + 1):
        with pytest.raises(ValueError, match="lead must be None or an int"):
            FusedTactic(G1, G1, 2, ld)
    for ld in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="lead must be None or an int"):
            FusedTactic(G1, G1, 2, ld)
    assert fused_workspace_bytes(0) == 16 and fused_workspace_bytes(6) == 48
    with pytest.raises(ValueError, match="ctas"):
        fused_workspace_bytes(-1)


def test_default_fused_tactic_for_every_preset_tp_and_row_count():
    """A built-in fused tactic runs every preset x TP 1/2/4/8 at every row
    count; its resident units are what the busiest CTA takes at that many
    tiles where they fit (dsv41-flash TP4 rows 1: 240 GEMM2 units of 128 rows
    on 132 CTAs, 2 each), else as many as fit (TP1: none, v13's order), loaded
    after GEMM1's last issue (lead 0)."""
    from moebench.kernels.fused import default_fused_tactic
    from moebench.models import PRESETS

    for preset in PRESETS:
        for tp in (1, 2, 4, 8):
            shape = get_preset(preset).shard(tp)
            for rows in range(1, 9):
                ctas = max_ctas(rows, shape.top_k, shape.experts)
                ft = default_fused_tactic(shape, ctas)
                assert ft is not None and ft.why_invalid(shape) is None, (preset, tp, rows)
                units2 = ctas * (shape.hidden // ft.gemm2.item_rows)
                units1 = ctas * (2 * shape.intermediate // ft.gemm1.item_rows)
                busiest = -(-units2 // min(max(units1, units2), 132))
                assert ft.lead == 0, (preset, tp, rows)
                more = FusedTactic(ft.gemm1, ft.gemm2, ft.resident + 1)
                assert ft.resident == busiest or (ft.resident < busiest and more.why_invalid(shape)), (preset, tp)
    tp4 = get_preset("dsv41-flash").shard(4)
    assert default_fused_tactic(tp4, 6).name == "r16_m4_k4_u4_c1_b4_f8+r16_m8_k2_u3_c1_b4_f8_res2_ld0"
    assert default_fused_tactic(get_preset("dsv41-flash").shard(1), 6).resident == 0
    with pytest.raises(ValueError, match="ctas"):
        default_fused_tactic(tp4, 0)


_COMPILE_SPEC = """
from moebench.kernels.fused import FusedTactic, compile_fused
from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.models import get_preset

def compile_spec(spec):
    preset, tp, f1, f2, resident, lead, trace = spec
    shape = GemmShape.of(get_preset(preset).shard(tp))
    compile_fused(shape, FusedTactic(GemmTactic(**f1), GemmTactic(**f2), resident, lead), False, trace)
    return {}
"""


def _fields(t: GemmTactic) -> dict:
    return {f: getattr(t, f) for f in t.__dataclass_fields__}


@pytest.mark.compile
def test_fused_layer_compiles_for_sm90a_without_spills():
    specs = [(p, tp, _fields(G1), _fields(g2), 2, None, False) for (p, tp), g2 in G2.items()]
    tp4 = ("dsv41-flash", 4, _fields(G1), _fields(G2[("dsv41-flash", 4)]))
    specs.append((*tp4, 0, None, False))  # all of GEMM2 on the ring
    specs.append((*tp4, 2, 0, True))  # resident loads after GEMM1's last issue, traced
    reports = compile_reports(_COMPILE_SPEC, specs)
    assert len(reports) == len(specs)
    for rep in reports:
        assert rep["regs"] and all(s == 0 for s in rep["spills"]), f"{rep['spec']}: spills {rep['spills']}"
        if not rep["instr"]:
            pytest.skip("nvdisasm not available: SASS not checked")
        assert sass_count(rep, r"\b(?:LDL|STL)\b") == 0, rep["spec"]
        assert sass_count(rep, r"QGMMA\.64x8x32\.F32\.E4M3\.E4M3") > 0, rep["spec"]
        assert sass_count(rep, r"UBLKCP") > 0, rep["spec"]
        # the hand-off: GEMM1's release add, GEMM2's acquire spin and coherent H loads, the self-cleaning arrival
        assert sass_count(rep, r"REDG\.E\.ADD\.S32\.STRONG\.GPU") == 1, rep["spec"]
        assert sass_count(rep, r"LDG\.E\.128\.STRONG\.GPU") > 0, rep["spec"]
        assert sass_count(rep, r"ATOMG\.E\.INC\.STRONG\.GPU") == 1, rep["spec"]
        traced = rep["spec"][-1]
        assert (sass_count(rep, r"SR_GLOBALTIMER") > 0) == traced, rep["spec"]  # stamps only in a traced build


@pytest.mark.compile
def test_the_fused_candidates_tune_times_compile_without_spills():
    """Every fused candidate `moebench tune --fp8` offers for dsv41-flash at
    TP 4 and 8 (rows 1-8; `fused_candidates`) compiles for sm_90a without
    spills: a candidate that cannot build would only show on the GPU."""
    from moebench.kernels.fused import fused_candidates

    specs = []
    for tp in (4, 8):
        shape = get_preset("dsv41-flash").shard(tp)
        for rows in range(1, 9):
            for ft in fused_candidates(shape, max_ctas(rows, 6, shape.experts)):
                spec = ("dsv41-flash", tp, _fields(ft.gemm1), _fields(ft.gemm2), ft.resident, ft.lead, False)
                if spec not in specs:
                    specs.append(spec)
    assert len(specs) >= 8
    for rep in compile_reports(_COMPILE_SPEC, specs):
        assert rep["regs"] and all(n == 0 for n in rep["spills"]), f"{rep['spec']}: spills {rep['spills']}"


# ---------------------------------------------------------------------- GPU
EXPERTS = 64


def _routings(rows_list=(1, 2, 8), top_k=6):
    from moebench.routing import scenario_topk_ids

    out = []
    for rows in rows_list:
        for scen in ("uniform", "correlated", "hot"):
            out.append((f"{scen}-r{rows}", scenario_topk_ids(scen, rows, top_k, EXPERTS, seed=rows)))
    out.append(("one-expert", torch.full((8, top_k), 5, dtype=torch.int32)))  # every slot on one expert
    mixed = scenario_topk_ids("uniform", 5, top_k, EXPERTS, seed=9)
    mixed[::2, 1::2] = -1  # experts of other ranks
    mixed[1, 0] = EXPERTS + 3
    out.append(("nonlocal", mixed))
    return out


def _layer(preset, tp, seed, experts=EXPERTS, top_k=None):
    from moebench.kernels.layout import to_kernel_layout

    over = {} if top_k is None else {"top_k": top_k}
    shape = get_preset(preset, experts=experts, **over).shard(tp)
    weights = generate_expert_weights(shape, seed=seed, device="cuda")
    return shape, weights, to_kernel_layout(weights, operand="e4m3")


def _pair(kw, x_q, x_s, route, t1, t2):
    from moebench.kernels.gemm import gemm1, gemm2

    n = TILE * route.ctas
    h_q = torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda")
    h_s = torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda")
    out = torch.full((n, kw.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1)
    gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2)
    return h_q, h_s, out


def _fused(kw, x_q, x_s, route, ft, workspace):
    from moebench.kernels.fused import fused_layer

    n = TILE * route.ctas
    h_q = torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda")  # poison
    h_s = torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda")
    out = torch.full((n, kw.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused_layer(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, out, tactic=ft, workspace=workspace)
    return h_q, h_s, out


def _same(a, b, used, what):
    assert torch.equal(a[:used].view(torch.uint8), b[:used].view(torch.uint8)), what


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", sorted(G2))
def test_fused_layer_equals_the_pair_bit_for_bit_and_the_oracle(preset, tp):
    """Every routing shape (one expert: 6 tiles; rows 8: several units per
    CTA, GEMM2 units beyond the resident ones on the ring), resident 0 / 1 /
    2 loaded early and 2 after GEMM1's last issue (lead 0), poisoned outputs: H, its scales and the rows equal gemm1 + gemm2 with
    the same tactics bit for bit, the rows meet the fp64 oracle, the
    counters are zero after each launch and a second launch on the same
    workspace gives the same bits."""
    from moebench.kernels.gemm import alloc_workspace
    from moebench.reference import ORACLE_TOLERANCE, reference_gemm1, reference_gemm2, relative_error

    shape, weights, kw = _layer(preset, tp, seed=tp + 3)
    t2 = G2[(preset, tp)]
    for label, ids in _routings():
        rows = ids.shape[0]
        route = build_route_record(ids.cuda(), EXPERTS)
        x_q, x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows + 1, device="cuda"))
        want = _pair(kw, x_q, x_s, route, G1, t2)
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), weights, route)
        oracle = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), weights, route)
        used = TILE * route.tiles_used
        ws = alloc_workspace(fused_workspace_bytes(route.ctas), "cuda")
        for resident, lead in ((0, None), (1, None), (2, None), (2, 0)):
            ft = FusedTactic(G1, t2, resident, lead)
            what = f"{preset} TP{tp} {label} resident {resident} lead {lead}"
            for launch in range(2):
                got = _fused(kw, x_q, x_s, route, ft, ws)
                torch.cuda.synchronize()
                for a, b, name in zip(got, want, ("H", "H scales", "rows")):
                    _same(a, b, used, f"{what} launch {launch}: {name} differ from the pair's")
                assert not torch.any(ws.view(torch.int32)), f"{what}: counters not back to zero"
            err = relative_error(got[2][:used].double(), oracle[:used])
            assert err <= ORACLE_TOLERANCE, f"{what}: relative error {err:.3e} vs the oracle"


@pytest.mark.gpu
def test_fused_layer_graph_replay_follows_new_inputs():
    """A captured fused layer (behind the route kernel) replayed with new
    ids and a new x equals the eager pair each time: no host work between
    replays (the counters clean themselves, the mbarriers are per launch)."""
    from moebench.kernels.fused import fused_layer
    from moebench.kernels.gemm import alloc_workspace
    from moebench.kernels.route import launch_route_quantize

    preset, tp, rows = "dsv41-flash", 4, 2
    shape, weights, kw = _layer(preset, tp, seed=11)
    t2 = G2[(preset, tp)]
    ft = FusedTactic(G1, t2, 2)
    gen = torch.Generator().manual_seed(5)
    ctas = max_ctas(rows, 6, EXPERTS)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:6] for _ in range(rows)]).to(torch.int32).cuda()
    x = generate_activations(rows, shape.hidden, seed=1, device="cuda")
    record = torch.empty(route_words(ctas), dtype=torch.int32, device="cuda")
    permuted = torch.empty(rows, 6, dtype=torch.int32, device="cuda")
    x_q = torch.empty(rows, shape.hidden, dtype=torch.uint8, device="cuda")
    x_s = torch.empty(rows, shape.hidden // 32, dtype=torch.uint8, device="cuda")
    h_q = torch.empty(TILE * ctas, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.empty(TILE * ctas, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.empty(TILE * ctas, kw.hidden, dtype=torch.bfloat16, device="cuda")
    ws = alloc_workspace(fused_workspace_bytes(ctas), "cuda")

    def step():
        for _ in range(2):  # two layers per replay: the second route kernel follows the fused launch
            launch_route_quantize(x, x_q, x_s, ids, record, permuted, EXPERTS, release_after_wait=True)
            fused_layer(kw, x_q, x_s, record, ctas, h_q, h_s, out, tactic=ft, workspace=ws)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        ids.copy_(torch.stack([torch.randperm(EXPERTS, generator=gen)[:6] for _ in range(rows)]).to(torch.int32))
        x.copy_(generate_activations(rows, shape.hidden, seed=seed + 20, device="cuda"))
        h_q.fill_(0xFF)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        route = build_route_record(ids, EXPERTS)
        q, s = quantize_mxfp8(x)
        want = _pair(kw, q.view(torch.uint8), s, route, G1, t2)
        used = TILE * route.tiles_used
        for a, b, name in zip((h_q, h_s, out), want, ("H", "H scales", "rows")):
            _same(a, b, used, f"replay {seed}: {name}")
        assert not torch.any(ws.view(torch.int32)), f"replay {seed}: counters not back to zero"


@pytest.mark.gpu
def test_fused_layer_rejects_bad_arguments():
    from moebench.kernels.fused import fused_layer
    from moebench.kernels.gemm import alloc_workspace
    from moebench.kernels.layout import to_kernel_layout

    shape, weights, kw = _layer("dsv41-flash", 4, seed=2)
    ids = torch.arange(6, dtype=torch.int32).view(1, 6).cuda()
    route = build_route_record(ids, EXPERTS)
    x_q, x_s = quantize_mxfp8(generate_activations(1, shape.hidden, seed=1, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.empty(n, kw.intermediate, dtype=torch.uint8, device="cuda")
    h_s = torch.empty(n, kw.intermediate // 32, dtype=torch.uint8, device="cuda")
    out = torch.empty(n, kw.hidden, dtype=torch.bfloat16, device="cuda")
    ft = FusedTactic(G1, G2[("dsv41-flash", 4)], 2)
    ws = alloc_workspace(fused_workspace_bytes(route.ctas), "cuda")
    args = (x_q, x_s, route.record, route.ctas, h_q, h_s, out)
    with pytest.raises(ValueError, match="e4m3 layout"):
        fused_layer(to_kernel_layout(weights, operand="bf16"), *args, tactic=ft, workspace=ws)
    with pytest.raises(ValueError, match="workspace must be"):
        fused_layer(kw, *args, tactic=ft, workspace=ws[:8])
    with pytest.raises(TypeError, match="tactic must be a FusedTactic"):
        fused_layer(kw, *args, tactic=G1, workspace=ws)
    with pytest.raises(ValueError, match="tactic .*shared memory"):
        fused_layer(kw, *args, tactic=FusedTactic(G1, G2[("dsv41-flash", 4)], 3), workspace=ws)
    with pytest.raises(ValueError, match="out"):
        fused_layer(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, out[:, :64], tactic=ft, workspace=ws)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="trace must have shape"):
        fused_layer(kw, *args, tactic=ft, workspace=ws, trace=torch.empty(8, 8, dtype=torch.int64, device="cuda"))
    with pytest.raises(TypeError, match="trace must be torch.int64"):
        fused_layer(kw, *args, tactic=ft, workspace=ws, trace=torch.empty(sms, 8, device="cuda"))
    import cuda.bindings.driver as cu

    trace = torch.empty(sms, 8, dtype=torch.int64, device="cuda")
    with pytest.raises(TypeError, match="with trace, stream must be None or a torch.cuda.Stream"):
        fused_layer(kw, *args, tactic=ft, workspace=ws, trace=trace, stream=cu.CUstream(0))


@pytest.mark.gpu
def test_traced_fused_layer_stamps_its_ctas_and_changes_nothing():
    """A traced launch on a side stream: the same H and rows as the pair, every
    CTA of the grid stamped start <= gemm1_done <= gemm2_done, the rows of
    the SMs beyond the grid -1; with no tile (ctas 0) the trace is all -1."""
    from moebench.kernels.fused import TRACE_STAMPS, fused_layer
    from moebench.kernels.gemm import alloc_workspace

    shape, weights, kw = _layer("dsv41-flash", 8, seed=21)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]], dtype=torch.int32).cuda()
    route = build_route_record(ids, EXPERTS)
    x_q, x_s = quantize_mxfp8(generate_activations(1, shape.hidden, seed=3, device="cuda"))
    ft = FusedTactic(G1, G2[("dsv41-flash", 8)], 1, 0)
    want = _pair(kw, x_q, x_s, route, ft.gemm1, ft.gemm2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(sms, len(TRACE_STAMPS), dtype=torch.int64, device="cuda")
    ws = alloc_workspace(fused_workspace_bytes(route.ctas), "cuda")
    n = TILE * route.ctas
    got = (torch.full((n, kw.intermediate), 0xFF, dtype=torch.uint8, device="cuda"),
           torch.full((n, kw.intermediate // 32), 0xFE, dtype=torch.uint8, device="cuda"),
           torch.full((n, kw.hidden), float("nan"), dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    fused_layer(kw, x_q, x_s, route.record, route.ctas, *got, tactic=ft, workspace=ws, trace=trace, stream=side)
    torch.cuda.synchronize()
    used = TILE * route.tiles_used
    for a, b, name in zip(got, want, ("H", "H scales", "rows")):
        _same(a, b, used, f"traced launch: {name} differ from the pair's")
    t = trace.cpu()
    ran = t[:, 0] >= 0
    grid = int(ran.sum())
    assert 0 < grid <= sms and bool(ran[:grid].all()) and bool((t[grid:] == -1).all())
    col = {name: t[:grid, k] for k, name in enumerate(TRACE_STAMPS)}
    assert bool((col["start"] <= col["gemm1_done"]).all()) and bool((col["gemm1_done"] <= col["gemm2_done"]).all())
    trace.zero_()
    empty = torch.tensor([0, 0, 1, 6], dtype=torch.int32, device="cuda")  # route_words(0): no tile
    fused_layer(kw, x_q, x_s, empty, 0, *(g[:0] for g in got), tactic=ft, workspace=ws, trace=trace)
    torch.cuda.synchronize()
    assert bool((trace == -1).all())


def _layer_meets_the_oracle(layer, weights, hidden, rows, what):
    """route -> gemms -> finalize of a RoutedExpertGemm at `rows` (correlated
    routing, top-6, fresh inputs seeded by rows) within the oracle tolerance,
    per row too."""
    from moebench.kernels.finalize import finalize
    from moebench.reference import ORACLE_TOLERANCE, oracle_gate, reference_moe
    from moebench.routing import scenario_topk_ids

    ids = scenario_topk_ids("correlated", rows, 6, EXPERTS, seed=rows).cuda()
    w = torch.rand(rows, 6, device="cuda", dtype=torch.float32)
    x = generate_activations(rows, hidden, seed=rows, device="cuda")
    got = finalize(layer.gemms(layer.route(x, ids, w)))
    want = reference_moe(x, ids, w, weights, activation="mxfp8").output
    err, row_err, why = oracle_gate(got.double(), want, ORACLE_TOLERANCE)
    assert why is None, f"{what} rows {rows}: {why}"


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv41-flash", 8)])
def test_binding_with_fused_runs_the_fused_layer_and_meets_the_oracle(preset, tp):
    """RoutedExpertGemm(fused=True): `gemms` runs the fused layer at every
    row count (route -> fused -> finalize, poisoned-free fresh outputs)
    within the oracle tolerance, per row too; fused=True on the BF16 family
    is refused."""
    from moebench.kernels.binding import RoutedExpertGemm

    shape = get_preset(preset, experts=EXPERTS).shard(tp)
    weights = generate_expert_weights(shape, seed=7, device="cuda")
    layer = RoutedExpertGemm(weights, 6, None, fp8=True, fused=True)
    assert all(layer.fused_tactics[r] is not None for r in range(1, 9))
    for rows in (1, 2, 5, 8):
        _layer_meets_the_oracle(layer, weights, shape.hidden, rows, f"{preset} TP{tp}")
    with pytest.raises(ValueError, match="fused=True needs the FP8 family"):
        RoutedExpertGemm(weights, 6, None, fp8=False, fused=True)


@pytest.mark.gpu
def test_binding_runs_the_fused_layer_where_the_tables_choose_it(tmp_path):
    """fused=None (the default): per rows, what the tables' fp8.fused entries
    say: the fused layer at rows 1 (source: the table), the pair at rows 2
    (the entry says pair) and 3-8 (no entry); both meet the oracle. fused=False
    and explicit tactics ignore the entries."""
    from moebench.kernels.binding import RoutedExpertGemm
    from moebench.kernels.fused import LayerChoice, default_fused_tactic
    from moebench.kernels.table import ShapeClass, TableEntry, TuningTable
    from moebench.tuning.table import write_table

    shape = get_preset("dsv41-flash", experts=EXPERTS).shard(8)
    weights = generate_expert_weights(shape, seed=5, device="cuda")
    ft = default_fused_tactic(shape, max_ctas(1, 6, EXPERTS))
    props = torch.cuda.get_device_properties(0)
    device = {"name": props.name, "sm_count": props.multi_processor_count, "capability": "9.0"}
    choices = {1: TableEntry(LayerChoice(ft), 10.0, 9.0, 11.0), 2: TableEntry(LayerChoice(None), 10.0, 9.0, 11.0)}
    path = write_table(TuningTable(ShapeClass.of(shape), device, fused_entries=choices), tmp_path)
    layer = RoutedExpertGemm(weights, 6, None, fp8=True, tables=[tmp_path])
    assert layer.fused_tactics[1] == ft and layer.fused_sources[1] == f"table {path} fp8.fused[1]"
    assert all(layer.fused_tactics[r] is None for r in range(2, 9)) and layer.fused_workspace is not None
    for rows in (1, 2):
        _layer_meets_the_oracle(layer, weights, shape.hidden, rows, "tables")
    assert RoutedExpertGemm(weights, 6, None, fp8=True, fused=False, tables=[tmp_path]).fused_tactics[1] is None
    assert RoutedExpertGemm(weights, 6, {}, fp8=True, tables=[tmp_path]).fused_tactics[1] is None


def _default_fused_equals_the_pair(kw, hidden, ids, experts, top_k, x_seed, what):
    """The built-in fused tactic at `ids`' rows, poisoned outputs: H, its scales
    and the rows equal gemm1 + gemm2 of the same two tactics bit for bit, the
    counters back to zero."""
    from moebench.kernels.fused import default_fused_tactic
    from moebench.kernels.gemm import alloc_workspace

    rows = ids.shape[0]
    route = build_route_record(ids.cuda(), experts)
    ft = default_fused_tactic(kw, max_ctas(rows, top_k, experts))
    assert ft is not None, what
    x_q, x_s = quantize_mxfp8(generate_activations(rows, hidden, seed=x_seed, device="cuda"))
    want = _pair(kw, x_q, x_s, route, ft.gemm1, ft.gemm2)
    ws = alloc_workspace(fused_workspace_bytes(route.ctas), "cuda")
    got = _fused(kw, x_q, x_s, route, ft, ws)
    torch.cuda.synchronize()
    used = TILE * route.tiles_used
    for a, b, name in zip(got, want, ("H", "H scales", "rows")):
        _same(a, b, used, f"{what} {ft.name}: {name} differ from the pair's")
    assert not torch.any(ws.view(torch.int32)), f"{what}: counters not back to zero"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["dsv41-flash", "dsv4-flash", "dsv4-pro"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_default_fused_layer_every_preset_tp_and_row_count(preset, tp):
    """The built-in fused tactic of each preset x TP 1/2/4/8 at rows 1-8
    (uniform routing; rows 8 also with every slot on one expert and with
    non-local ids), poisoned outputs: H and the rows equal gemm1 + gemm2 of
    the same two tactics bit for bit, counters back to zero."""
    from moebench.routing import scenario_topk_ids

    shape, weights, kw = _layer(preset, tp, seed=tp + 13)
    cases = [(f"uniform-r{r}", scenario_topk_ids("uniform", r, 6, EXPERTS, seed=r)) for r in range(1, 9)]
    cases += [c for c in _routings(rows_list=()) if c[0] in ("one-expert", "nonlocal")]
    for label, ids in cases:
        _default_fused_equals_the_pair(kw, shape.hidden, ids, EXPERTS, 6, ids.shape[0] + 2, f"{preset} TP{tp} {label}")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("top_k,experts", [(1, 64), (8, 64), (6, 512), (8, 256)])
def test_default_fused_layer_other_top_k_and_expert_counts(top_k, experts, tp):
    """top_k 1 and 8, 256 and 512 experts (issue 29's range), dsv41-flash, rows
    1 / 4 / 8 uniform: the built-in fused tactic's H and rows equal the pair's
    bit for bit, counters back to zero."""
    from moebench.routing import scenario_topk_ids

    shape, weights, kw = _layer("dsv41-flash", tp, seed=top_k + experts, experts=experts, top_k=top_k)
    for rows in (1, 4, 8):
        ids = scenario_topk_ids("uniform", rows, top_k, experts, seed=rows + 30)
        what = f"top_k {top_k} E {experts} TP{tp} rows {rows}"
        _default_fused_equals_the_pair(kw, shape.hidden, ids, experts, top_k, rows + 4, what)
