"""RoutedExpertGemm: weight checks (CPU) and the whole route -> GEMM1 -> GEMM2
path against the fp64 oracle, eager and under a CUDA graph (GPU)."""

import dataclasses

import pytest
import torch

from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.moe_output import finalize
from moebench.record import TILE, build_route_record
from moebench.formats import dequantize_mxfp8
from moebench.reference import ORACLE_TOLERANCE, reference_gemm2, reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights

binding = pytest.importorskip("moebench.kernels.binding", reason="needs nvidia-cutlass-dsl")


def _small(tp=4, experts=32, device="cpu"):
    shape = get_preset("dsv41-flash", hidden=512, intermediate=1152, experts=experts).shard(tp)
    return shape, generate_expert_weights(shape, seed=3, device=device)


@pytest.fixture(scope="module")
def small_cpu_weights():
    """One CPU layer for the checks that only read it (generating one takes seconds on the CPU)."""
    return _small()[1]


@pytest.mark.parametrize("top_k", [0, 9, True])
def test_check_weights_rejects_top_k(top_k, small_cpu_weights):
    w = small_cpu_weights
    with pytest.raises(ValueError, match="top_k"):
        binding.check_weights(w, top_k)


def test_check_weights_rejects_experts_not_multiple_of_32():
    shape = get_preset("dsv41-flash", hidden=256, intermediate=256, experts=48).shard(2)
    w = generate_expert_weights(shape, seed=0)
    with pytest.raises(ValueError, match="experts must be a multiple of 32"):
        binding.check_weights(w, 6)


def test_check_weights_rejects_nonzero_padding():
    _, w = _small()  # I/tp = 288, padded 384
    w.w13[0, w.intermediate] = 1
    with pytest.raises(ValueError, match="padding"):
        binding.check_weights(w, 6)


def test_check_weights_rejects_cpu_tensors(small_cpu_weights):
    w = small_cpu_weights
    with pytest.raises(ValueError, match="w13 must be on a CUDA device"):
        binding.check_weights(w, 6)


def test_check_weights_rejects_non_weights():
    with pytest.raises(TypeError, match="ExpertWeights"):
        binding.check_weights(object(), 6)


def _bare_gemm(hidden=512, top_k=6, experts=64, intermediate=256):
    """A RoutedExpertGemm bound to CPU stand-ins: only the host-side checks run."""
    import types

    g = object.__new__(binding.RoutedExpertGemm)
    g.kw = types.SimpleNamespace(hidden=hidden, experts=experts, intermediate=intermediate, device=torch.device("cpu"))
    g.top_k = top_k
    return g


def test_route_rejects_top_k_tensors_off_x_device_or_not_tensors():
    g = _bare_gemm()
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    ids = torch.zeros(2, 6, dtype=torch.int32)
    tw = torch.ones(2, 6)
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor"):
        g.route(x, ids.tolist(), tw)
    with pytest.raises(TypeError, match="topk_weights must be a torch.Tensor"):
        g.route(x, ids, None)
    with pytest.raises(ValueError, match="topk_ids is on meta"):
        g.route(x, ids.to("meta"), tw)
    with pytest.raises(ValueError, match="topk_weights is on meta"):
        g.route(x, ids, tw.to("meta"))
    with pytest.raises(ValueError, match="topk_ids must be int32"):
        g.route(x, ids.long(), tw)  # int64 ids: the kernel reads int32
    with pytest.raises(ValueError, match="x must be"):
        g.route(torch.zeros(9, 512, dtype=torch.bfloat16), torch.zeros(9, 6, dtype=torch.int32), torch.ones(9, 6))


def test_gemms_reject_non_routing_and_foreign_h():
    g = _bare_gemm()
    with pytest.raises(TypeError, match="Routing"):
        g.gemm1(object())
    with pytest.raises(TypeError, match="Routing"):
        g.gemm2({"x": 1}, torch.zeros(1), torch.zeros(1))
    u8 = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    routing = binding.Routing(
        u8(1, 512),
        u8(1, 16),
        torch.zeros(1, 6, dtype=torch.int32),
        torch.ones(1, 6),
        torch.zeros(1, 6, dtype=torch.int32),
        torch.zeros(32, dtype=torch.int32),
        ctas=6,
    )
    with pytest.raises(ValueError, match="h_q must be"):
        g.gemm2(routing, u8(48, 128), u8(48, 8))
    with pytest.raises(ValueError, match="h_scale must be"):
        g.gemm2(routing, u8(48, 256), torch.zeros(48, 8))
    with pytest.raises(TypeError, match="h_q must be a torch.Tensor"):
        g.gemm2(routing, None, u8(48, 8))


# ----------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def bound():
    """The BF16 family (asked for by name: 64 experts have no shipped table, so
    the default would be the FP8 family's built-ins)."""
    shape = get_preset("dsv41-flash", experts=64).shard(4)
    w = generate_expert_weights(shape, seed=11, device="cuda")
    return shape, w, binding.RoutedExpertGemm(w, shape.top_k, fp8=False)


@pytest.fixture(scope="module")
def bound_fp8(bound):
    """The FP8 family on the same weights."""
    shape, w, _ = bound
    return shape, w, binding.RoutedExpertGemm(w, shape.top_k, fp8=True)


@pytest.fixture(params=["bf16", "fp8"])
def either(request):
    """Each family's binding in turn."""
    return request.getfixturevalue("bound" if request.param == "bf16" else "bound_fp8")


def _run(gemm, x, ids, tw):
    routing = gemm.route(x, ids, tw)
    return routing, gemm.gemms(routing)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("scenario", ["correlated", "uniform", "hot"])
def test_route_and_gemms_match_the_oracle(either, rows, scenario):
    shape, w, gemm = either
    ids = scenario_topk_ids(scenario, rows, shape.top_k, shape.experts, seed=rows).cuda()
    tw = scenario_weights(rows, shape.top_k, seed=rows, scale=1.5).cuda()
    x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
    routing, out = _run(gemm, x, ids, tw)
    want = build_route_record(ids, shape.experts)
    assert torch.equal(routing.record, want.record) and torch.equal(routing.permuted, want.permuted)
    ref = reference_moe(x, ids, tw, w, activation="mxfp8")
    valid = torch.arange(routing.ctas * 8, device="cuda") < want.tiles_used * 8
    rows_err = relative_error(out.gemm2_permuted[valid], ref.unfinalized.gemm2_permuted[valid])
    final_err = relative_error(finalize(out), ref.output)
    assert rows_err <= ORACLE_TOLERANCE and final_err <= ORACLE_TOLERANCE, (rows_err, final_err)


@pytest.mark.gpu
def test_non_local_ids_are_skipped(either):
    shape, w, gemm = either
    ids = scenario_topk_ids("uniform", 4, shape.top_k, shape.experts, seed=5)
    ids[0, 0], ids[2, 3] = -1, shape.experts + 7
    ids = ids.cuda()
    tw = scenario_weights(4, shape.top_k, seed=5).cuda()
    x = generate_activations(4, shape.hidden, seed=5, device="cuda")
    routing, out = _run(gemm, x, ids, tw)
    assert int(routing.permuted[0, 0]) == -1 and int(routing.permuted[2, 3]) == -1
    ref = reference_moe(x, ids, tw, w, activation="mxfp8")
    assert relative_error(finalize(out), ref.output) <= ORACLE_TOLERANCE


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_and_follows_inputs(either):
    shape, w, gemm = either
    rows = 6
    ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=1).cuda()
    tw = scenario_weights(rows, shape.top_k, seed=1).cuda()
    x = generate_activations(rows, shape.hidden, seed=1, device="cuda")
    eager = finalize(_run(gemm, x, ids, tw)[1]).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(gemm, x, ids, tw)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = finalize(_run(gemm, x, ids, tw)[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    x.copy_(generate_activations(rows, shape.hidden, seed=2, device="cuda"))
    ids.copy_(scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=2).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    ref = reference_moe(x, ids, tw, w, activation="mxfp8")
    assert relative_error(captured, ref.output) <= ORACLE_TOLERANCE


@pytest.mark.gpu
def test_accepts(bound):
    shape, w, gemm = bound
    x = generate_activations(4, shape.hidden, seed=0, device="cuda")
    assert gemm.accepts(x, w)
    assert not gemm.accepts(x.float())
    assert not gemm.accepts(torch.zeros(9, shape.hidden, dtype=torch.bfloat16, device="cuda"))
    assert not gemm.accepts(x[:, :-128])
    reloaded = generate_expert_weights(shape, seed=11, device="cuda")
    assert not gemm.accepts(x, reloaded)


@pytest.mark.gpu
def test_tactics_come_from_the_tuning_table_else_the_default(tmp_path, monkeypatch):
    """Per family, each (stage, rows) tactic from the table else the built-in
    default; by default the family the tables choose (the faster by their
    µs, one per layer), with no table the FP8 family's built-ins."""
    from moebench.backends.moebench import MoebenchBackend
    from moebench.kernels.tactic import GemmTactic
    from moebench.kernels import table as tb
    from moebench.tuning.table import write_table

    shape = get_preset("dsv41-flash", experts=64).shard(4)
    w = generate_expert_weights(shape, seed=5, device="cuda")
    monkeypatch.setenv(tb.ENV_DIR, str(tmp_path))
    tb.reset_log_once()
    plain = binding.RoutedExpertGemm(w, shape.top_k, fp8=False)  # no table: the built-in BF16 defaults
    assert all(s.startswith("default") for s in plain.tactic_sources.values())
    assert plain.family == "bf16" and plain.family_choice.source == "asked" and plain.kw.operand == "bf16"
    default = binding.RoutedExpertGemm(w, shape.top_k)  # no table: the FP8 family, its built-ins fit
    assert default.fp8 and default.family == "fp8" and default.family_choice.source == "built-in"
    assert all(t.fp8 for t in default.tactics.values()) and default.kw.operand == "e4m3"
    assert all(s.startswith("default (fp8") for s in default.tactic_sources.values())
    tuned = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=2, ctas_per_sm=2)
    entry = tb.TableEntry(tuned, 10.0, 9.0, 11.0)
    name = torch.cuda.get_device_name(0)
    table = tb.TuningTable(tb.ShapeClass.of(shape), {"name": name, "sm_count": 132}, {(1, 6): entry})
    path = write_table(table, tmp_path)
    tb.reset_log_once()
    gemm = binding.RoutedExpertGemm(w, shape.top_k)  # only the BF16 family has an entry: BF16 runs
    assert gemm.family == "bf16" and gemm.family_choice.source == "tables"
    # the table's tactic, run with the BF16 activation operand (act_bf16=True, the default)
    assert gemm.tactics[1, 6] == dataclasses.replace(tuned, act_bf16=True) and str(path) in gemm.tactic_sources[1, 6]
    as_tabled = binding.RoutedExpertGemm(w, shape.top_k, act_bf16=False)
    assert as_tabled.tactics[1, 6] == tuned
    assert gemm.tactics[1, 5] == plain.tactics[1, 5] and gemm.tactic_sources[1, 5].startswith("default")
    builtin = binding.RoutedExpertGemm(w, shape.top_k, {})  # explicit: tables ignored, the built-in rule (FP8)
    assert builtin.tactics == default.tactics and builtin.family_choice.source == "built-in"
    assert binding.RoutedExpertGemm(w, shape.top_k, {}, fp8=False).tactics == plain.tactics
    # the FP8 family's entries (the table's fp8 part) serve fp8 layers only; BF16 layers keep theirs
    f8 = GemmTactic(32, 4, 2, 4, 2, fp8=True)
    plain8 = binding.RoutedExpertGemm(w, shape.top_k, fp8=True)  # no fp8 part yet: the fp8 defaults
    assert all(s.startswith("default") for s in plain8.tactic_sources.values())
    assert plain8.tactics == default.tactics
    table = tb.TuningTable(
        tb.ShapeClass.of(shape),
        {"name": name, "sm_count": 132},
        {(1, 6): entry},
        fp8_entries={(1, 4): tb.TableEntry(f8, 10.0, 9.0, 11.0)},
    )
    write_table(table, tmp_path)  # the same device and the BF16 entry kept: replaces the first
    tb.reset_log_once()
    mixed = binding.RoutedExpertGemm(w, shape.top_k, fp8=False)
    assert mixed.tactics[1, 6] == gemm.tactics[1, 6] and mixed.tactics[1, 4] == plain.tactics[1, 4]
    fp8 = binding.RoutedExpertGemm(w, shape.top_k, fp8=True)
    assert fp8.tactics[1, 4] == f8 and fp8.tactic_sources[1, 4] == f"table {path} fp8.gemm1[4]"
    assert fp8.tactics[1, 6] == plain8.tactics[1, 6] and fp8.tactic_sources[1, 6].startswith("default (fp8")
    # by default: BF16 timed at rows 6 only, FP8 at rows 4 only: no row count both time, one each: FP8
    chosen = binding.RoutedExpertGemm(w, shape.top_k)
    assert chosen.family == "fp8" and chosen.family_choice.source == "tables" and chosen.tactics == fp8.tactics
    # the sweep's / step's tactic names bind the same (the "fp8" one once passed tactics={}: tables ignored)
    backend = MoebenchBackend()
    prepared = backend.prepare(w, shape, "fp8")
    assert prepared.tactics == fp8.tactics and prepared.tactic_sources == fp8.tactic_sources
    assert backend.prepare(w, shape, "bf16").tactics == mixed.tactics
    assert backend.prepare(w, shape, "default").tactics == chosen.tactics
    assert backend.kernel_tactics(prepared, 4).startswith(f"fp8 family (asked); gemm1 {f8.name} (table); gemm2 ")
    # a faster BF16 entry at rows 4 too: rows 4 timed by both, BF16 faster there and the only one at 6: BF16
    table.entries[1, 4] = tb.TableEntry(tuned, 5.0, 4.9, 5.1)
    write_table(table, tmp_path)
    tb.reset_log_once()
    chosen = binding.RoutedExpertGemm(w, shape.top_k)
    assert chosen.family == "bf16" and chosen.family_choice.reason == "bf16 faster at rows 4, 6"
    assert backend.kernel_tactics(backend.prepare(w, shape, "default"), 6).startswith("bf16 family (tables); gemm1 ")
    tb.reset_log_once()


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp", [("dsv41-flash", 4), ("dsv41-flash", 8), ("dsv4-pro", 4)])
def test_the_default_binding_runs_the_tables_family_and_matches_the_oracle(preset, tp):
    """A real layer shape (all experts, the shipped tables' shape classes):
    the binding built as MoEStep / `moebench step` / build_routed_expert_gemms
    build it runs the family `choose_family` picks (on an H200 the shipped
    tables make it FP8), and route -> GEMM1 -> GEMM2 match the oracle: the
    record bit for bit, H bytes by the family's rule (FP8: >= 99 % equal,
    `h_fp8_mismatch`; BF16: >= 99.9 %, `h_mismatch`), GEMM2's rows and the
    finalized rows each within 2e-2 and in norm within 1e-2. Inputs are fresh
    (seeds no other test uses), so a row left unwritten holds no answer."""
    from moebench.kernels.family import choose_family
    from moebench.tuning.runner import h_fp8_mismatch, h_mismatch
    from moebench.kernels.table import ShapeClass

    shape = get_preset(preset).shard(tp)
    w = generate_expert_weights(shape, seed=70 + tp, device="cuda")
    (gemm,) = binding.build_routed_expert_gemms([(w, shape.top_k)])
    if gemm is None:  # it logged why; say it here
        binding.RoutedExpertGemm(w, shape.top_k)
        raise AssertionError("build_routed_expert_gemms refused a layer RoutedExpertGemm binds")
    name = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = choose_family(name, ShapeClass.of(shape), num_sms=sms)
    assert gemm.family == want.family and gemm.family_choice == want
    if "H200" in name:
        assert gemm.family == "fp8" and want.source == "tables", want
        assert all(s.startswith("table ") and " fp8.gemm" in s for s in gemm.tactic_sources.values())
    assert all(t.fp8 == gemm.fp8 for t in gemm.tactics.values())
    judge = h_fp8_mismatch if gemm.fp8 else h_mismatch
    for rows in range(1, 9):
        for scenario in ("correlated", "uniform"):
            seed = 9000 + 97 * rows + tp + (scenario == "uniform")
            ids = scenario_topk_ids(scenario, rows, shape.top_k, shape.experts, seed=seed).cuda()
            tw = scenario_weights(rows, shape.top_k, seed=seed, scale=1.5).cuda()
            x = generate_activations(rows, shape.hidden, seed=seed, device="cuda")
            routing = gemm.route(x, ids, tw)
            h_q, h_s = gemm.gemm1(routing)
            out = gemm.gemm2(routing, h_q, h_s)
            ref = reference_moe(x, ids, tw, w, activation="mxfp8")
            label = f"{preset} TP{tp} {gemm.family} rows {rows} {scenario}"
            assert torch.equal(routing.record, ref.route.record), label
            assert torch.equal(routing.permuted, ref.route.permuted), label
            used = TILE * ref.route.tiles_used
            ref_q, ref_s = ref.h_values, ref.h_scale
            why = judge(h_q[:used], h_s[:used], ref_q.view(torch.uint8)[:used], ref_s[:used])
            assert why is None, f"{label}: {why}"
            slots = routing.permuted.flatten()
            slots = slots[slots >= 0].long()
            got, oracle = out.gemm2_permuted[slots], ref.unfinalized.gemm2_permuted[slots]
            assert relative_error(got, oracle) <= ORACLE_TOLERANCE, label
            # Row by row, GEMM2 is held to the oracle of the H it was given: the H bytes that
            # differ from the oracle's (the rule above) move one permuted row further than the
            # whole output (seen on the H200: dsv41-flash TP8 fp8 rows 3 uniform, one row 2.5e-2
            # from the end-to-end oracle); the finalized tokens below keep the end-to-end row gate.
            h_given = dequantize_mxfp8(h_q[:used].view(torch.float8_e4m3fn), h_s[:used], dtype=torch.float64)
            given = reference_gemm2(h_given[:, : ref.h_values.shape[1]], w, ref.route)[slots]
            for i in range(slots.numel()):
                assert relative_error(got[i], given[i]) <= 2e-2, f"{label}: permuted row {int(slots[i])}"
            final = finalize(out)
            assert relative_error(final, ref.output) <= ORACLE_TOLERANCE, label
            for t in range(rows):
                assert relative_error(final[t], ref.output[t]) <= 2e-2, f"{label}: token {t}"


@pytest.mark.gpu
def test_split_k_tactics_get_one_workspace_and_match_the_oracle(bound):
    from moebench.kernels.tactic import GemmTactic

    shape, w, plain = bound
    assert plain.workspace is None  # the defaults do not split K
    tactics = {1: GemmTactic(64, 1, 4, 4, 3, split_k=4), 2: GemmTactic(64, 8, 1, 2, 2, split_k=2)}
    gemm = binding.RoutedExpertGemm(w, shape.top_k, tactics)
    ws = gemm.workspace
    assert ws is not None and ws.dtype == torch.uint8 and int(torch.count_nonzero(ws)) == 0
    for rows in (1, 6, 8):
        ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=rows).cuda()
        tw = scenario_weights(rows, shape.top_k, seed=rows).cuda()
        x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
        routing, out = _run(gemm, x, ids, tw)
        ref = reference_moe(x, ids, tw, w, activation="mxfp8")
        assert relative_error(finalize(out), ref.output) <= ORACLE_TOLERANCE, rows
    with pytest.raises(ValueError, match="workspace must be"):
        binding.RoutedExpertGemm(w, shape.top_k, tactics, workspace=ws[:-16])
    shared = binding.RoutedExpertGemm(w, shape.top_k, tactics, workspace=ws)
    assert shared.workspace is ws


@pytest.mark.gpu
def test_act_bf16_binding_writes_x_deq_and_matches_the_e4m3_binding(bound):
    """The default binding runs the _a16 twins: route() writes x_deq in the
    quantize launch (the bits act_to_bf16 gives), and its GEMM outputs equal
    an act_bf16=False binding's bit for bit (and the oracle)."""
    from moebench.kernels.gemm import act_to_bf16

    shape, w, gemm = bound
    e4m3 = binding.RoutedExpertGemm(w, shape.top_k, act_bf16=False, fp8=False)
    with pytest.raises(TypeError, match="act_bf16"):
        binding.RoutedExpertGemm(w, shape.top_k, act_bf16=1)
    for rows in (1, 4, 6, 8):
        assert gemm.tactics[1, rows].act_bf16 and gemm.tactics[2, rows].act_bf16
        assert not e4m3.tactics[1, rows].act_bf16
        assert gemm.tactics[1, rows].name == e4m3.tactics[1, rows].name + "_a16"
        ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=rows).cuda()
        tw = scenario_weights(rows, shape.top_k, seed=rows).cuda()
        x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
        routing, out = _run(gemm, x, ids, tw)
        assert e4m3.route(x, ids, tw).x_deq is None
        assert torch.equal(
            routing.x_deq.view(torch.int16), act_to_bf16(routing.x_quant, routing.x_scale).view(torch.int16)
        )
        _, want = _run(e4m3, x, ids, tw)
        idx = want.expanded_idx_to_permuted_idx.flatten()
        idx = idx[idx >= 0].long()
        assert torch.equal(out.gemm2_permuted[idx], want.gemm2_permuted[idx]), rows
        ref = reference_moe(x, ids, tw, w, activation="mxfp8")
        assert relative_error(finalize(out), ref.output) <= ORACLE_TOLERANCE


@pytest.mark.gpu
def test_gemm2_alone_after_other_gemm1_calls_reads_the_matching_h(bound):
    """With act_bf16, GEMM1 writes H into layer-owned buffers (h_q and its BF16
    copy together), so GEMM2 timed alone in a graph, after other GEMM1 calls,
    is capturable and reads an h_deq that matches the h_q it is given."""
    shape, w, gemm = bound
    rows = 6
    ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=9).cuda()
    tw = scenario_weights(rows, shape.top_k, seed=9).cuda()
    x = generate_activations(rows, shape.hidden, seed=9, device="cuda")
    routing = gemm.route(x, ids, tw)
    h = gemm.gemm1(routing)
    assert gemm.gemm1(routing)[0].data_ptr() == h[0].data_ptr()
    eager = gemm.gemm2(routing, *h).gemm2_permuted.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm.gemm2(routing, *h)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = gemm.gemm2(routing, *h).gemm2_permuted
    graph.replay()
    torch.cuda.synchronize()
    idx = routing.permuted.flatten()
    idx = idx[idx >= 0].long()
    assert torch.equal(out[idx], eager[idx])


@pytest.mark.gpu
def test_fp8_binding_runs_fp8_twins_and_matches_the_oracle(bound):
    """fp8=True: e4m3 weight layout, every tactic an fp8 (wgmma) one (no
    BF16 copies of x / H), route + GEMMs vs the oracle at every row count;
    explicit tactics must match the layout."""
    from moebench.kernels.tactic import GemmTactic

    shape, w, gemm = bound
    f8 = binding.RoutedExpertGemm(w, shape.top_k, fp8=True)
    assert f8.kw.operand == "e4m3" and f8.x_deq is None and f8.h_deq is None
    for rows in range(1, 9):
        for stage in (1, 2):
            t = f8.tactics[stage, rows]
            assert t.fp8 and t.valid_for(f8.kw, stage) is None, (stage, rows, t.name)
        ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=rows + 40).cuda()
        tw = scenario_weights(rows, shape.top_k, seed=rows).cuda()
        x = generate_activations(rows, shape.hidden, seed=rows + 40, device="cuda")
        routing, out = _run(f8, x, ids, tw)
        assert routing.x_deq is None
        ref = reference_moe(x, ids, tw, w, activation="mxfp8")
        assert relative_error(finalize(out), ref.output) <= ORACLE_TOLERANCE, rows
    with pytest.raises(ValueError, match="fp8"):
        binding.RoutedExpertGemm(w, shape.top_k, {1: GemmTactic(64, 1, 8, 4, 1)}, fp8=True)
    with pytest.raises(ValueError, match="fp8"):
        binding.RoutedExpertGemm(w, shape.top_k, {2: GemmTactic(32, 4, 1, 3, 2, fp8=True)}, fp8=False)
    with pytest.raises(ValueError, match="tactics mix the fp8 and BF16 families"):
        binding.RoutedExpertGemm(
            w, shape.top_k, {1: GemmTactic(64, 1, 8, 4, 1), 2: GemmTactic(32, 4, 1, 3, 2, fp8=True)}
        )
    with pytest.raises(TypeError, match="fp8 must be a bool or None"):
        binding.RoutedExpertGemm(w, shape.top_k, fp8="yes")
    # explicit tactics without fp8: the layer runs their family
    by_tactics = binding.RoutedExpertGemm(w, shape.top_k, {2: GemmTactic(32, 4, 1, 3, 2, fp8=True)})
    assert by_tactics.family == "fp8" and by_tactics.family_choice.source == "tactics"
    assert by_tactics.kw.operand == "e4m3" and by_tactics.tactics[2, 6] == GemmTactic(32, 4, 1, 3, 2, fp8=True)
    # built-in defaults and a partial explicit dict (act_bf16 left at its default True)
    for given in ({}, {1: GemmTactic(32, 4, 2, 4, 2, fp8=True)}):
        g = binding.RoutedExpertGemm(w, shape.top_k, given, fp8=True)
        assert all(t.fp8 and not t.act_bf16 for t in g.tactics.values())


@pytest.mark.gpu
def test_spec_tactics_compile_their_route_kernel_and_plain_twin_when_bound():
    """A spec GEMM1 needs the route kernel that releases after its wait and,
    behind the fused front, its plain twin: both compiled when the layer is
    bound (a later call hits the cache), never inside a graph capture."""
    from moebench.kernels import gemm as _g
    from moebench.kernels import route as _r
    from moebench.kernels.tactic import GemmShape, GemmTactic

    shape = get_preset("dsv41-flash", experts=64).shard(4)
    w = generate_expert_weights(shape, seed=5, device="cuda")
    t = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, spec=True)
    bound = binding.RoutedExpertGemm(w, shape.top_k, {1: t}, fp8=True)
    hits = _r._compile.cache_info().hits
    _r.compile_route_kernel(quantize=True, release_after_wait=True)
    assert _r._compile.cache_info().hits == hits + 1
    hits = _g.compile_gemm.cache_info().hits
    _g.compile_gemm(GemmShape.of(bound.kw), dataclasses.replace(t, spec=False), 1, bound.kw.scale_variant(True))
    assert _g.compile_gemm.cache_info().hits == hits + 1


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_a_binding_built_from_a_plan_runs_it_and_matches_the_oracle(bound, fp8):
    """RoutedExpertGemm(plan=) and RoutedExpertGemm.bind(kw, plan) bind the
    plan as given (the tactics the tuner substitutes included: another
    valid tactic at one (stage, rows)), and forward (route + the GEMMs)
    matches the oracle; outputs poisoned first."""
    from moebench.kernels.layer_plan import plan_layer
    from moebench.kernels.layout import to_kernel_layout
    from moebench.kernels.table import ShapeClass
    from moebench.tuning.space import DEFAULT_FP8_SPACE, DEFAULT_SPACE, valid_tactics

    shape, w, made = bound
    made = made if not fp8 else binding.RoutedExpertGemm(w, shape.top_k, fp8=True)
    plan = made.plan
    again = binding.RoutedExpertGemm(w, shape.top_k, plan=plan)
    assert again.plan is plan and again.tactics == made.tactics and again.tactic_sources == made.tactic_sources
    sclass = ShapeClass.of(shape)
    assert plan_layer(sclass, plan.family, device_name=torch.cuda.get_device_name(0),
                      num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                      wide_scales=plan.wide_scales, act_bf16=True) == plan  # fmt: skip
    rows = 6
    space = DEFAULT_FP8_SPACE if fp8 else DEFAULT_SPACE
    other = next(t for t in valid_tactics(sclass.gemm_shape, 1, plan.ctas(rows), space=space)
                 if t != plan.tactic(1, rows) and not t.spec)  # fmt: skip
    if not fp8:
        other = dataclasses.replace(other, act_bf16=True)
    swapped = plan.with_tactic(1, rows, other)
    kw = to_kernel_layout(w, "e4m3" if fp8 else "bf16")
    layer = binding.RoutedExpertGemm.bind(kw, swapped, source=w)
    assert layer.tactics[1, rows] == other and layer.accepts(torch.zeros(rows, shape.hidden, dtype=torch.bfloat16,
                                                                        device="cuda"), w)  # fmt: skip
    ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=4).cuda()
    tw = scenario_weights(rows, shape.top_k, seed=4).cuda()
    x = generate_activations(rows, shape.hidden, seed=4, device="cuda")
    ref = reference_moe(x, ids, tw, w, activation="mxfp8")
    poison = torch.full((8 * plan.ctas(rows), shape.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison  # freed poisoned: the next output of its size takes this block
    for gemm in (again, layer, layer):
        out = gemm.forward(x, ids, tw)
        assert relative_error(finalize(out), ref.output) <= ORACLE_TOLERANCE
        out.gemm2_permuted.fill_(float("nan"))  # poisoned and freed again: the next call must write its own
        del out
