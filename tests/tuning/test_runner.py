"""The GPU runner of `moebench tune`: the H check on the CPU; the runner
itself on an sm_90 GPU."""

from dataclasses import replace

import pytest
import torch

from moebench.models import get_preset
from moebench.env import device_info
from moebench.kernels.fused_tactic import FusedTactic, LayerChoice, fused_candidates
from moebench.kernels.tactic import GemmShape, GemmTactic, two_plane_twin
from moebench.record import max_ctas
from moebench.kernels.gemm import act_to_bf16
from moebench.kernels.table import LAYER
from moebench.tuning.layer_runner import LayerRunner
from moebench.tuning.runner import TuneConfig, h_mismatch, require_tuning_device


def test_h_check_accepts_one_code_off_in_rare_places_and_rejects_more():
    gen = torch.Generator().manual_seed(0)
    ref_q = torch.randint(0, 0x70, (16, 2048), dtype=torch.uint8, generator=gen)
    ref_s = torch.full((16, 64), 120, dtype=torch.uint8)
    assert h_mismatch(ref_q.clone(), ref_s.clone(), ref_q, ref_s) is None
    near = ref_q.clone()
    near[0, :20] += 1  # 20 of 32768 bytes one code apart
    assert h_mismatch(near, ref_s, ref_q, ref_s) is None
    far = ref_q.clone()
    far[0, 0] += 2
    assert "2 e4m3 codes apart" in h_mismatch(far, ref_s, ref_q, ref_s)
    many = ref_q.clone()
    many[:, :64] ^= 0x01
    assert "of H bytes equal" in h_mismatch(many, ref_s, ref_q, ref_s)
    scales = ref_s.clone()
    scales[:, :2] = 0
    assert "of H scales equal" in h_mismatch(ref_q, scales, ref_q, ref_s)
    assert h_mismatch(ref_q[:0], ref_s[:0], ref_q[:0], ref_s[:0]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_require_tuning_device_says_what_is_missing():
    with pytest.raises(RuntimeError, match="needs an sm_90 GPU"):
        require_tuning_device()


def test_config_shapes():
    cfg = TuneConfig(preset="dsv41-flash", tp=(4, 8))
    assert [s.intermediate for s in cfg.shapes()] == [576, 288]


@pytest.mark.gpu
@pytest.mark.parametrize("act_bf16, fp8", [(True, False), (False, False), (True, True)], ids=["a16", "e4m3", "fp8"])
def test_runner_checks_times_and_tunes_a_small_shape(act_bf16, fp8):
    from moebench.tuning.runner import GemmStageRunner, run_tune
    from moebench.tuning.space import Fp8Space, TacticSpace

    shape = get_preset("dsv41-flash", experts=64).shard(8)
    dev = require_tuning_device()
    space = Fp8Space(4) if fp8 else TacticSpace(tile_rows=(32, 64), warps=((1, 8), (4, 2)), unroll=(2,),
                                                ctas_per_sm=(2,), persistent=(True,))  # fmt: skip
    act_bf16 = act_bf16 and not fp8  # the FP8 family ignores it
    for stage in (1, 2):
        run = GemmStageRunner(shape, stage, dev, layers=2, replays=5, warmup=1, space=space, act_bf16=act_bf16,
                              fp8=fp8)  # fmt: skip
        tactics = run.valid_tactics(6)
        assert tactics[0] == run.default(6) and all(t.act_bf16 == act_bf16 and t.fp8 == fp8 for t in tactics)
        for t in tactics:
            assert run.check(t, 6) is None, t.name
        timing = run.time(tactics[0], 6)
        assert timing.method == "cuda-graph" and timing.median_us > 0
    cfg = TuneConfig(preset="dsv41-flash", experts=64, tp=(8,), rows=(1, 6), space=space, repeats=1, top=2,
                     replays=5, warmup=1, layers=2, act_bf16=act_bf16, fp8=fp8)  # fmt: skip
    outcome = run_tune(cfg)
    (table,) = outcome.tables
    assert set(table.entries_of(fp8)) == {(1, 1), (1, 6), (2, 1), (2, 6)} and not table.entries_of(not fp8)
    assert set(table.fused_entries) == ({1, 6} if fp8 else set())  # --fp8 also times the pair against fused
    e = table.entry(2, 6, fp8)
    assert e.tactic.fp8 == fp8
    assert e.provenance["device"] == torch.cuda.get_device_name(0) and e.provenance["timing"]["layers"] == 2
    assert e.tactic.act_bf16 == act_bf16 and e.provenance["timing"]["act_bf16"] == act_bf16


def test_run_tune_flow_on_the_cpu_with_stand_in_kernels(monkeypatch):
    """The runner's plumbing (routing, oracle, poisoned buffers, checks,
    timing, tuner, table) with stand-in GEMMs that copy the oracle's output;
    tactics with unroll 4 corrupt it and must never be picked."""
    from moebench.tuning import runner as rn
    from moebench.tuning.space import TacticSpace

    routes, _ = _stand_in_kernels(monkeypatch)  # unroll-4 tactics corrupt the output
    space = TacticSpace(tile_rows=(32, 64), warps=((1, 4), (4, 1)), unroll=(2, 4), ctas_per_sm=(2,),
                        persistent=(True,))  # fmt: skip
    cfg = TuneConfig(preset="dsv41-flash", hidden=256, intermediate=512, experts=8, tp=(4,), rows=(1, 6),
                     space=space, repeats=1, top=2, replays=3, warmup=0, layers=2)  # fmt: skip
    outcome = rn.run_tune(cfg)
    (table,) = outcome.tables
    assert set(table.entries) == {(1, 1), (1, 6), (2, 1), (2, 6)}
    for (stage, rows), e in table.entries.items():
        assert e.tactic.unroll != 4 and e.rejected >= 1
        assert e.provenance["timing"]["layers"] == 2 and e.provenance["moebench_version"]
        res = outcome.results[4, stage].results[rows]
        assert all("incorrect" in why for why in res.rejected.values())
        assert any(name.endswith("_u4_c2_a16") for name in res.rejected)  # (the a16 twins: act_bf16 default)
    assert {shape for shape, _ in routes} == {(1, 6), (6, 6)}  # every timing ran the route kernel first
    assert table.shape.intermediate == 128 and table.file_name.startswith("E=8,H=256,I=128,top_k=6,")


def _stand_in_kernels(monkeypatch, wrong=lambda tactic: tactic.unroll == 4, wrong_fused=lambda ft: False,
                      fused_calls=None):  # fmt: skip
    """Stand-in GEMMs and fused layer copying the oracle's output (wrong for
    `wrong` tactics / `wrong_fused` fused tactics; each fused launch's
    tactic appended to `fused_calls`) and a CPU 'tuning device': the
    runner's plumbing without a GPU. Returns (routes, misuse): each stand-in
    route launch's (ids shape, whether the ids are readable early:
    release_after_wait or inputs_ready), and the GEMM1 tactics given
    topk_ids without spec or spec without them."""
    import types

    from moebench.kernels import binding  # imported before the stand-in modules: it keeps the real ones
    from moebench.tuning import runner as rn

    live, misuse = [], []

    def case_of(record):  # the checks read the torch builder's record
        return next(c for c in live if record is c["route"].record)

    def gemm1(kw, x_q, x_s, record, ctas, h_q, h_s, *, tactic, x_deq=None, h_deq_out=None, topk_ids=None):
        if (topk_ids is not None) != tactic.spec:
            misuse.append(tactic.name)  # a spec GEMM1 reads the ids; any other must not be given them
        case = case_of(record)
        h_q.copy_(case["ref_q"])
        h_s.copy_(case["ref_s"])
        if wrong(tactic):
            h_q[: case["used"], :8] ^= 0x0F

    def gemm2(kw, h_q, h_s, record, ctas, out, *, tactic, h_deq=None):
        case = case_of(record)
        if "oracle" not in case:  # the pair of a GEMM1 timing (GEMM2 at its default): no output needed
            return
        out.copy_(case["oracle"].to(out.dtype))
        if wrong(tactic):
            out[: case["used"]] *= 1.5

    def fused_layer(kw, x_q, x_s, record, ctas, h_q, h_s, out, *, tactic, workspace, trace=None, stream=None):
        if fused_calls is not None:
            fused_calls.append(tactic)
        case = case_of(record)
        h_q.copy_(case["ref_q"])
        h_s.copy_(case["ref_s"])
        out.copy_(case["oracle"].to(out.dtype))
        if wrong_fused(tactic):
            out[: case["used"]] *= 1.5

    original = rn.GemmStageRunner._case

    def tracking_case(self, rows):
        case = original(self, rows)
        if all(case is not c for c in live):
            live.append(case)
        return case

    routes = []  # the timed path starts with the route kernel (record + MXFP8 x), as the binding's

    def launch_route_quantize(
        x, x_q, x_s, ids, record, permuted, experts, *, x_deq_out=None, release_after_wait=False, inputs_ready=False
    ):
        # whether a spec GEMM1 may read the ids before its wait: either promise gives it
        routes.append((tuple(ids.shape), release_after_wait or inputs_ready))

    def alloc_workspace(nbytes, device):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    monkeypatch.setitem(__import__("sys").modules, "moebench.kernels.gemm",
                        types.SimpleNamespace(gemm1=gemm1, gemm2=gemm2, act_to_bf16=act_to_bf16,
                                              alloc_workspace=alloc_workspace))  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "moebench.kernels.fused",
                        types.SimpleNamespace(fused_layer=fused_layer, fused_workspace_bytes=lambda ctas: 64 * ctas))  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "moebench.kernels.route",
                        types.SimpleNamespace(launch_route_quantize=launch_route_quantize))  # fmt: skip
    monkeypatch.setattr(rn.GemmStageRunner, "_case", tracking_case)
    monkeypatch.setattr(rn, "require_tuning_device", lambda device=None: torch.device("cpu"))
    # the stand-in forward launches nothing, so on the CPU the layer call and its x writes alone are both Python
    # wall clock and their difference is noise that can be negative: `less` would then raise ("nothing left to
    # measure"), failing the candidate on a loaded machine only (the two-host torchrun test flaked so)
    from moebench.bench import timing

    real_less = timing.less

    def noise_tolerant_less(total, part):
        try:
            return real_less(total, part)
        except ValueError:
            return total

    monkeypatch.setattr(timing, "less", noise_tolerant_less)
    _stand_in_launcher(monkeypatch, binding.KERNELS, routes, misuse, fused_calls)
    return routes, misuse


def _stand_in_launcher(monkeypatch, launcher, routes, misuse, fused_calls):
    """The timed layers (RoutedExpertGemm.bind + forward) launch through the
    binding's launcher: record the route launches, the spec misuse and the
    fused tactics, launch nothing."""

    def timed_route(x, x_q, x_s, ids, record, permuted, experts, *, release_after_wait=False, inputs_ready=False,
                    **kwargs):  # fmt: skip
        routes.append((tuple(ids.shape), release_after_wait or inputs_ready))

    def timed_gemm1(*args, tactic, topk_ids=None, **kwargs):
        if (topk_ids is not None) != tactic.spec:
            misuse.append(tactic.name)

    def timed_fused(*args, tactic, **kwargs):
        if fused_calls is not None:
            fused_calls.append(tactic)

    for name, fn in (("route", timed_route), ("gemm1", timed_gemm1), ("gemm2", lambda *a, **k: None),
                     ("fused", timed_fused), ("act_to_bf16", lambda q, scale, out: out),
                     ("compile_route", lambda **k: None), ("compile_gemm", lambda *a: None),
                     ("compile_fused", lambda *a: None)):  # fmt: skip
        monkeypatch.setattr(launcher, name, fn, raising=False)


SMALL = ["--hidden", "256", "--intermediate", "512", "--experts", "8", "--tp", "4", "--rows", "1,4",
         "--replays", "2", "--warmup", "0", "--repeats", "1", "--top", "2", "--layers", "2", "--jobs", "0"]  # fmt: skip


def test_tune_command_writes_tables_and_prints_the_gains(monkeypatch, tmp_path):
    """`moebench tune` over two presets and the ship space with stand-in
    kernels: one table per shape class, gains at rows 1 and 4 (8 was not
    tuned), the summary files, exit 0."""
    import json

    from typer.testing import CliRunner

    from moebench.cli import app
    from moebench.kernels.table import read_table

    _stand_in_kernels(monkeypatch, wrong=lambda t: t.ctas_per_sm == 4)
    summary = tmp_path / "gains" / "tune-gains.md"
    result = CliRunner().invoke(app, ["tune", "--preset", "dsv41-flash,dsv4-pro", *SMALL, "--space", "ship",
                                      "--out", str(tmp_path / "tables"), "--summary", str(summary)])  # fmt: skip
    assert result.exit_code == 0, result.output
    tables = sorted((tmp_path / "tables").iterdir())
    assert len(tables) == 1  # both presets shrink to the same shape class here: merged into one table
    table = read_table(tables[0])
    assert set(table.entries) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(e.tactic.ctas_per_sm != 4 for e in table.entries.values())
    assert table.entry(1, 1).provenance["timing"]["layer_copies"] is True
    assert "tuned vs built-in default" in result.output
    records = json.loads(summary.with_suffix(".json").read_text())
    assert [(r["preset"], r["rows"]) for r in records] == [("dsv41-flash", 1), ("dsv41-flash", 4),
                                                            ("dsv4-pro", 1), ("dsv4-pro", 4)]  # fmt: skip
    for r in records:
        for key in ("gemm1", "gemm2", "both"):
            g = r[key]
            assert g["default_us"] > 0 and g["tuned_us"] > 0
            assert g["gain_us"] == pytest.approx(g["default_us"] - g["tuned_us"])
        # both stages tuned: GEMM2 was timed beside the tuned GEMM1, so "both" is measured, not estimated
        both = r["both"]
        assert not both["estimated"]
        final = r.get("revisit", {}).get("tuned_us", r["gemm2"]["tuned_us"])
        assert (both["default_us"], both["tuned_us"]) == (r["gemm1"]["default_us"], final)
    assert "| dsv4-pro | BF16 | 4 | 4 |" in summary.read_text()


def test_tune_command_stops_at_the_budget_and_says_what_it_left_out(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from moebench.cli import app

    _stand_in_kernels(monkeypatch)
    result = CliRunner().invoke(app, ["tune", *SMALL, "--space", "ship", "--budget", "0.001",
                                      "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "--budget" in result.output and "left out" in result.output and "GEMM1" in result.output
    assert list(tmp_path.iterdir()) == []  # nothing tuned, no empty table written


def test_budget_stops_when_the_next_step_would_overrun():
    from moebench.tuning.runner import Budget

    now = [0.0]
    b = Budget(10.0, clock=lambda: now[0])
    assert not b()  # no step measured yet
    now[0] = 3.0
    assert not b()  # steps of 3 s: 3 + 1.25 * 3 <= 10
    now[0] = 7.0
    assert b()  # the longest step is now 4 s: 7 + 1.25 * 4 > 10
    assert not Budget(None, clock=lambda: now[0])()
    with pytest.raises(ValueError, match="budget"):
        Budget(0)


def test_copies_of_the_first_layer_are_new_allocations_with_the_same_values():
    from moebench.formats import generate_expert_weights
    from moebench.kernels.layout import to_kernel_layout
    from moebench.tuning.runner import copy_kernel_weights

    shape = get_preset("dsv41-flash", hidden=256, intermediate=512, experts=8).shard(4)
    kw = to_kernel_layout(generate_expert_weights(shape, 0, "cpu"))
    copy = copy_kernel_weights(kw)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        a, b = getattr(kw, name), getattr(copy, name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert copy.max_scale_code == kw.max_scale_code and copy.hidden == kw.hidden


def test_tuning_specs_list_each_kernel_once_in_the_order_needed():
    from moebench.kernels.tactic import default_tactic
    from moebench.tuning.runner import tuning_specs
    from moebench.tuning.space import SHIP_SPACE

    cfg = TuneConfig(preset="dsv41-flash", tp=(4, 8), space=SHIP_SPACE)
    specs = tuning_specs(cfg, 132)
    assert len(specs) == len(set(specs)) <= 2 * 2 * SHIP_SPACE.limit
    assert [s[1] for s in specs[:3]] == [1, 1, 1] and specs[0][0].intermediate == 576
    # rows 1: 6 token tiles; the BF16-operand twin (TuneConfig.act_bf16 default)
    assert specs[0][2] == replace(default_tactic(specs[0][0], 1, 6, 132), act_bf16=True)


def test_operand_twins_are_what_the_runtime_runs():
    """The tuner times the BF16-operand (_a16) twins by default (the
    binding's default operand); fp8 tactics stay; order kept, duplicates
    dropped; act_bf16=False leaves the tactics as they are."""
    from moebench.kernels.tactic import GemmTactic
    from moebench.tuning.runner import operand_twins

    a, b = GemmTactic(64, 1, 4, 4, 3), GemmTactic(64, 8, 1, 2, 2)
    f8 = GemmTactic(32, 4, 2, 4, 2, fp8=True)
    twins = operand_twins([a, b, f8, GemmTactic(64, 1, 4, 4, 3, act_bf16=True)], True)
    assert [t.name for t in twins] == ["r64_m1_k4_u4_c3_a16", "r64_m8_k1_u2_c2_a16", "r32_m4_k2_u4_c2_f8"]
    assert operand_twins([a, b, f8], False) == (a, b, f8)


def test_tuning_specs_compile_the_operand_the_run_times():
    """precompile builds exactly the kernels run_tune times: the _a16 twins
    by default, the MXFP8-operand tactics with act_bf16=False."""
    from moebench.tuning.runner import TuneConfig, tuning_specs
    from moebench.tuning.space import SPACES

    a16 = tuning_specs(TuneConfig(tp=(4,), rows=(1, 6), space=SPACES["ship"]), 132)
    e4 = tuning_specs(TuneConfig(tp=(4,), rows=(1, 6), space=SPACES["ship"], act_bf16=False), 132)
    assert a16 and len(a16) == len(e4)
    assert all(t.act_bf16 for _, _, t, _ in a16) and not any(t.act_bf16 for _, _, t, _ in e4)
    assert [t.name for _, _, t, _ in a16] == [t.name + "_a16" for _, _, t, _ in e4]


# ----------------------------------------------------------------------------- the FP8 family (--fp8)


def test_h_fp8_mismatch_allows_the_fp8_sums_but_not_real_errors():
    from moebench.formats import quantize_mxfp8
    from moebench.tuning.runner import FP8_H_MARGIN, h_fp8_mismatch

    ref_q, ref_s = quantize_mxfp8(torch.randn(32, 256, generator=torch.Generator().manual_seed(0)))
    ref_q = ref_q.view(torch.uint8)
    assert h_fp8_mismatch(ref_q.clone(), ref_s.clone(), ref_q, ref_s) is None
    near = ref_q.clone()
    near[0, :40] ^= 0x01  # 40 of 8192 bytes one code off (~0.5 %): the FP8 tensor cores' sums
    assert h_fp8_mismatch(near, ref_s, ref_q, ref_s) is None
    # ... but not the tuner's margin (the one-plane FP8 GEMM1: ~0.33 % off); 8 bytes (~0.1 %) pass it
    assert "of H bytes equal" in h_fp8_mismatch(near, ref_s, ref_q, ref_s, least=FP8_H_MARGIN)
    few = ref_q.clone()
    few[0, :8] ^= 0x01
    assert h_fp8_mismatch(few, ref_s, ref_q, ref_s, least=FP8_H_MARGIN) is None
    assert h_mismatch(near, ref_s, ref_q, ref_s) is not None  # stricter than the BF16 family's check
    many = ref_q.clone()
    many[:, :8] ^= 0x0F
    assert "of H bytes equal" in h_fp8_mismatch(many, ref_s, ref_q, ref_s)
    scales = ref_s.clone()
    scales[:, 0] += 1
    assert "of H scales equal" in h_fp8_mismatch(ref_q, scales, ref_q, ref_s)
    big = ref_q.clone()
    big[:3] = torch.where(big[:3] & 0x7F < 0x70, big[:3] + 0x08, big[:3])  # a few rows far off: the error shows
    big[3:] = ref_q[3:]
    why = h_fp8_mismatch(big, ref_s, ref_q, ref_s)
    assert why is not None and ("relative error" in why or "bytes equal" in why)
    assert h_fp8_mismatch(ref_q[:0], ref_s[:0], ref_q[:0], ref_s[:0]) is None


def test_fp8_config_takes_the_fp8_space_and_refuses_a_bf16_one():
    from moebench.tuning.space import DEFAULT_FP8_SPACE, FP8_SPACES, SHIP_SPACE, Fp8Space

    cfg = TuneConfig(fp8=True)
    assert cfg.space is DEFAULT_FP8_SPACE and cfg.family == "FP8" and TuneConfig().family == "BF16"
    assert TuneConfig(fp8=True, space=FP8_SPACES["ship"]).space.limit == 10
    with pytest.raises(ValueError, match="fp8=True tunes the FP8 family and needs an Fp8Space"):
        TuneConfig(fp8=True, space=SHIP_SPACE)
    with pytest.raises(ValueError, match="fp8=False tunes the BF16 family and needs a TacticSpace"):
        TuneConfig(space=Fp8Space())
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        TuneConfig(fp8=1)


def test_fp8_space_holds_valid_fp8_tactics_the_default_first():
    from moebench.kernels.tactic import GemmShape, default_fp8_tactic
    from moebench.models import PRESETS
    from moebench.record import max_ctas
    from moebench.tuning.space import F8_BULK_1, FP8_SPACES, Fp8Space, fp8_why_invalid, valid_tactics

    for preset in PRESETS:
        for tp in (1, 2, 4, 8):
            shape = get_preset(preset).shard(tp)
            g = GemmShape.of(shape)
            for stage in (1, 2):
                for rows in (1, 8):
                    ctas = max_ctas(rows, shape.top_k, shape.experts)
                    ts = valid_tactics(g, stage, ctas, space=FP8_SPACES["ship"])
                    assert ts[0] == default_fp8_tactic(g, stage, ctas) and len(set(ts)) == len(ts)
                    # GEMM1: 10 + 2 cluster twins (cluster_k 2), each with its spec twin, + the pipelined
                    # twin (mma_depth 1) of each bulk default (at most 2 per stage), each as its
                    # two-plane twin: one plane only where no two-plane GEMM1 runs the shape
                    assert 2 <= len(ts) <= (28 if stage == 1 else 13) and all(t.fp8 and t.split_k == 1 for t in ts)
                    assert stage == 1 or not any(t.cluster_k > 1 for t in ts)
                    planes = {t.planes for t in ts}
                    if stage == 2 or two_plane_twin(default_fp8_tactic(g, 1, ctas), g) is None:
                        assert planes == {1}, (preset, tp, stage, rows)
                    else:
                        assert planes == {2}, (preset, tp, rows)
                    piped = [t for t in ts if t.mma_depth]
                    assert len(piped) <= 2
                    if stage == 1:  # every bulk-ring tactic with PDL has its spec twin beside it
                        plain = {(t.tile_rows, t.warps_k, t.unroll, t.ctas_per_sm, t.cluster_k) for t in ts
                                 if t.bulk and t.pdl and not t.spec and not t.mma_depth}  # fmt: skip
                        spec = {(t.tile_rows, t.warps_k, t.unroll, t.ctas_per_sm, t.cluster_k) for t in ts if t.spec}
                        assert spec == plain, (preset, tp, rows)
                    assert all(fp8_why_invalid(t, g, stage) is None for t in ts), (preset, tp, stage)
                assert set(FP8_SPACES["ship"].tactics_for(g, stage)) <= set(FP8_SPACES["full"].tactics_for(g, stage))
    g = GemmShape.of(get_preset("dsv41-flash").shard(4))
    assert two_plane_twin(F8_BULK_1[1], g) in Fp8Space(10).tactics_for(g, 1)  # the measured variants, two-plane
    tp8 = Fp8Space(10).tactics_for(GemmShape.of(get_preset("dsv41-flash").shard(8)), 1)
    assert [t.name for t in tp8 if t.cluster_k > 1 and not t.spec][:1] == ["r16_m4_k4_u4_c1_b4_cl2_p2_f8"]
    assert any(t.stages == 3 for t in Fp8Space(48).tactics_for(g, 1))  # and the defaults' neighbours
    # step 4: five warpgroups where the 160 K chunks divide, 5 CTAs per SM, CTA size for CTAs per SM
    full1, full2 = FP8_SPACES["full"].tactics_for(g, 1), FP8_SPACES["full"].tactics_for(g, 2)
    assert any(t.warps_k == 5 and t.warps == 20 for t in full1)
    assert any(t.ctas_per_sm == 5 for t in full2) and any(t.ctas_per_sm == 2 and t.warps_k == 2 for t in full1)
    assert not any(t.warps_k == 5 for t in FP8_SPACES["ship"].tactics_for(g, 1))  # ship: steps 1-3 fill it
    assert len(full1) > len(FP8_SPACES["quick"].tactics_for(g, 1))  # step 5 (second neighbours) in 'full'
    assert all(t.warps * t.ctas_per_sm <= 64 for t in full1 + full2)
    with pytest.raises(ValueError, match="limit"):
        Fp8Space(0)


def test_layer_step_refuses_fused_beside_a_two_plane_pair():
    """The fused kernels' GEMM1 is one-plane: beside a pair whose GEMM1 is
    two-plane (the FP8 default) every fused candidate is refused, naming the
    margin; beside a one-plane pair, and for the pair itself, nothing is."""
    shape = get_preset("dsv41-flash").shard(4)
    g = GemmShape.of(shape)
    one = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True)
    two, gemm2 = two_plane_twin(one, g), GemmTactic(32, 4, 1, 3, 4, stages=4, fp8=True)
    fused = LayerChoice(fused_candidates(g, max_ctas(1, shape.top_k, shape.experts), 132)[0])

    class Stub:
        def __init__(self, t1):
            self.pair = lambda rows: (t1, gemm2)

    assert "numerics margin" in LayerRunner.margin_reason(Stub(two), fused, 1)
    assert LayerRunner.margin_reason(Stub(two), LayerChoice(None), 1) is None
    assert LayerRunner.margin_reason(Stub(one), fused, 1) is None


def test_run_tune_fp8_flow_on_the_cpu_with_stand_in_kernels(monkeypatch):
    """--fp8's plumbing: e4m3-layout weights, the MXFP8 operands as they are
    (no BF16 copies), fp8 candidates only, the entries in the fp8 part."""
    from moebench.tuning import runner as rn
    from moebench.tuning.space import Fp8Space

    fused_calls = []
    routes, misuse = _stand_in_kernels(monkeypatch, wrong=lambda t: t.unroll == 2,
                                       wrong_fused=lambda ft: ft.resident == 0, fused_calls=fused_calls)  # fmt: skip
    seen, timed = [], []
    original = rn.GemmStageRunner._launch
    original_time = rn.GemmStageRunner.time

    def time(self, tactic, rows):
        if type(self) is rn.GemmStageRunner:  # (the layer step's LayerRunner times through it too)
            timed.append((self.stage, rows, tactic, self.partner(rows), dict(self.partners)))
        return original_time(self, tactic, rows)

    monkeypatch.setattr(rn.GemmStageRunner, "time", time)

    def launch(self, kw, case, tactic):
        seen.append((kw.operand, tactic))
        assert "x_deq" not in case and not self.act_bf16
        return original(self, kw, case, tactic)

    monkeypatch.setattr(rn.GemmStageRunner, "_launch", launch)
    # the fused plumbing: its candidates run and are checked (the margin rule that refuses them beside
    # a two-plane pair is tested alone: test_layer_step_refuses_fused_beside_a_two_plane_pair)
    monkeypatch.setattr(LayerRunner, "margin_reason", lambda self, choice, rows: None)
    cfg = TuneConfig(preset="dsv41-flash", hidden=512, intermediate=1024, experts=8, tp=(4,), rows=(1, 6),
                     space=Fp8Space(6), repeats=1, top=2, replays=3, warmup=0, layers=2, fp8=True)  # fmt: skip
    outcome = rn.run_tune(cfg)
    (table,) = outcome.tables
    assert table.entries == {} and set(table.fp8_entries) == {(1, 1), (1, 6), (2, 1), (2, 6)}
    assert seen and all(op == "e4m3" and t.fp8 for op, t in seen)
    for (stage, rows), e in table.fp8_entries.items():
        assert e.tactic.fp8 and e.tactic.unroll != 2
        assert e.provenance["timing"]["fp8"] is True and e.provenance["timing"]["act_bf16"] is False
        res = outcome.results[4, stage].results[rows]
        assert all(name.endswith("_f8") for name in res.rejected)
    assert any(outcome.results[4, s].results[r].rejected for s in (1, 2) for r in (1, 6))
    # the last stage: the pair (the GEMM tactics just tuned) against each fused candidate, per rows
    assert cfg.stages == (1, 2, LAYER) and set(table.fused_entries) == {1, 6}
    assert outcome.tables[0].to_dict()["schema"] == 3
    for rows, e in table.fused_entries.items():
        res = outcome.results[4, LAYER].results[rows]
        cands = {m.tactic.name for m in res.first_pass} | set(res.rejected)
        sms = device_info(torch.device("cpu")).sm_count
        shape = cfg.shapes()[0]
        fused = fused_candidates(GemmShape.of(shape), max_ctas(rows, shape.top_k, shape.experts), sms)
        assert len(fused) >= 3 and cands == {"pair"} | {ft.name for ft in fused}  # the pair and every fused one
        assert set(res.rejected) == {n for n in cands if "_res0" in n}  # the wrong fused output is never picked
        assert "_res0" not in e.tactic.name and e.provenance["timing"]["fp8"] is True
    assert fused_calls and all(isinstance(ft, FusedTactic) for ft in fused_calls)
    # GEMM1's candidates include spec twins, launched with the ids and behind a route kernel that
    # releases after its wait; GEMM2's were all timed beside the GEMM1 the table holds for their rows
    assert any(t.spec for st, _, t, _, _ in timed if st == 1) and not misuse
    spec_timed = sum(t.spec for st, _, t, _, _ in timed if st == 1)
    assert sum(release for _, release in routes) >= spec_timed * 2  # layers=2: one route launch per layer
    # GEMM2 beside the first pass's GEMM1; the revisit's GEMM1 beside the GEMM2 the table holds
    first = {r: outcome.results[4, 1].results[r].entry.tactic for r in (1, 6)}
    assert {(r, p) for st, r, _, p, _ in timed if st == 2} == set(first.items())
    assert all(not ps or p == table.fp8_entries[2, r].tactic for st, r, _, p, ps in timed if st == 1)
    assert all(r in ps for st, r, _, _, ps in timed if st == 2)


def test_tune_fp8_command_keeps_the_bf16_entries(monkeypatch, tmp_path):
    """`moebench tune` then `moebench tune --fp8` into one directory: one
    table holding both families; the gains say which family."""
    import json

    from typer.testing import CliRunner

    from moebench.cli import app
    from moebench.kernels.table import read_table

    _stand_in_kernels(monkeypatch, wrong=lambda t: False)
    small = [a if a != "256" else "512" for a in SMALL]  # H 512: room for the fp8 tactics' K split
    small[small.index("--intermediate") + 1] = "1024"
    out = str(tmp_path / "tables")
    first = CliRunner().invoke(app, ["tune", *small, "--space", "ship", "--out", out])
    assert first.exit_code == 0, first.output
    summary = tmp_path / "gains.md"
    second = CliRunner().invoke(app, ["tune", "--fp8", *small, "--space", "ship", "--out", out,
                                      "--summary", str(summary)])  # fmt: skip
    assert second.exit_code == 0, second.output
    text = " ".join(second.output.split())
    assert "(4 BF16 + 4 FP8 entries, fp8.fused: " in text and "FP8 GEMM1" in text, second.output
    assert "FP8 pair or fused" in text, second.output  # --fp8 also times the pair against the fused layer
    (path,) = (tmp_path / "tables").iterdir()
    table = read_table(path)
    assert len(table.entries) == 4 and len(table.fp8_entries) == 4
    assert all(not e.tactic.fp8 for e in table.entries.values())
    assert all(e.tactic.fp8 for e in table.fp8_entries.values())
    records = json.loads(summary.with_suffix(".json").read_text())
    assert {r["family"] for r in records} == {"FP8"} and "| dsv41-flash | FP8 | 4 | 1 |" in summary.read_text()
    # which family each tuned shape class now runs by default, from both families' µs in the table
    from moebench.kernels.family import choose_family

    runs = choose_family(table.device["name"], table.shape, search=[tmp_path / "tables"])
    assert runs.source == "tables" and [t.rows for t in runs.times if t.bf16_us and t.fp8_us] == [1, 4]
    assert "what `moebench` runs by default now" in text and f"on {table.device['name']} │ {runs.family} │" in text
    label = f"{table.shape.describe()} on {table.device['name']}"
    md = summary.read_text()
    assert "## What `moebench` runs by default" in md and f"- {label}: {runs.describe()}" in md
    assert f"| {label} | 4 | {runs.times[3].bf16_us:.1f} | {runs.times[3].fp8_us:.1f} |" in md
    again = CliRunner().invoke(app, ["tune", *small, "--rows", "1", "--space", "ship", "--out", out])
    assert again.exit_code == 0, again.output  # re-tuning BF16 rows keeps the FP8 part
    assert len(read_table(path).fp8_entries) == 4 and set(read_table(path).fused_entries) == {1, 4}
    # the pair-or-fused choice alone (its entries are the whole table): written, the rest kept
    fused_only = tmp_path / "fused-only"
    alone = CliRunner().invoke(app, ["tune", "--fp8", *small, "--stages", "fused", "--rows", "4", "--out",
                                     str(fused_only)])  # fmt: skip
    assert alone.exit_code == 0, alone.output
    assert "(0 BF16 + 0 FP8 entries, fp8.fused: " in " ".join(alone.output.split()), alone.output
    t = read_table(fused_only / path.name)
    assert set(t.fused_entries) == {4} and not t.fp8_entries and not t.entries
    merged = CliRunner().invoke(app, ["tune", "--fp8", *small, "--stages", "fused", "--rows", "1", "--out", out])
    assert merged.exit_code == 0, merged.output
    back = read_table(path)
    assert set(back.fused_entries) == {1, 4} and len(back.fp8_entries) == 4 and len(back.entries) == 4


def test_run_tune_revisits_gemm1_beside_the_tuned_gemm2(monkeypatch):
    """The stage-by-stage search's extra round: with pair times where GEMM1
    B beats the default A beside GEMM2's default C, GEMM2 D wins beside B,
    and A beats B beside D, the table ends with the pair (A, D), both timed
    together, and the gains say GEMM1 changed in the revisit."""
    from types import SimpleNamespace

    from moebench.kernels.tactic import default_tactic
    from moebench.record import max_ctas
    from moebench.tuning import runner as rn

    _stand_in_kernels(monkeypatch, wrong=lambda t: False)

    def valid(self, rows):  # the default and one other tactic per stage
        d = self.default(rows)
        return (d, replace(d, unroll=1 if d.unroll != 1 else 2))

    d1, d2 = {}, {}  # the built-in defaults (A, C) per rows

    def time(self, tactic, rows):
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        d1[rows], d2[rows] = (default_tactic(self.gshape, st, ctas, self.num_sms, self.wide) for st in (1, 2))
        t1, t2 = (tactic, self.partner(rows)) if self.stage == 1 else (self.partner(rows), tactic)
        us = {(True, True): 10.0, (False, True): 9.0, (True, False): 7.0, (False, False): 8.0}[
            t1 == d1[rows], t2 == d2[rows]
        ]
        return SimpleNamespace(median_us=us, p10_us=us - 0.01, p90_us=us + 0.01)

    monkeypatch.setattr(rn.GemmStageRunner, "valid_tactics", valid)
    monkeypatch.setattr(rn.GemmStageRunner, "time", time)
    cfg = TuneConfig(preset="dsv41-flash", hidden=256, intermediate=512, experts=8, tp=(4,), rows=(1, 6),
                     repeats=1, top=2, replays=3, warmup=0, layers=2, act_bf16=False)  # fmt: skip
    outcome = rn.run_tune(cfg)
    (table,) = outcome.tables
    for r in (1, 6):
        assert outcome.results[4, 1].results[r].entry.tactic != d1[r]  # B won beside GEMM2's default
        assert table.entry(2, r).tactic != d2[r]  # D won beside B
        assert table.entry(1, r).tactic == d1[r] and table.entry(1, r).median_us == 7.0  # A, beside D
        assert table.entry(1, r).provenance["timing"]["revisit"] is True
    records = rn.gains([(cfg, outcome)], rows=(1, 6))
    assert all(rec["revisit"]["changed"] and rec["both"]["tuned_us"] == 7.0 for rec in records)
    assert all(rec["both"]["default_us"] == 10.0 for rec in records)


def test_the_layer_step_times_the_pair_the_tables_will_hold(monkeypatch, tmp_path):
    """LayerRunner's pair: this run's picks, else the tactics the runtime
    takes along its search path (`TuneConfig.pair_tables`; tune_and_save puts
    the output directory first)."""
    from moebench.kernels.table import ShapeClass, TableEntry, TuningTable
    from moebench.kernels.tactic import default_fp8_tactic, default_tactic
    from moebench.tuning import runner as rn
    from moebench.tuning.space import Fp8Space
    from moebench.tuning.table import write_table

    _stand_in_kernels(monkeypatch, wrong=lambda t: False)
    dev = torch.device("cpu")
    cfg = TuneConfig(preset="dsv41-flash", hidden=512, intermediate=1024, experts=8, tp=(4,), fp8=True, layers=1,
                     pair_tables=(str(tmp_path),))  # fmt: skip
    shape = cfg.shapes()[0]
    g, sms = GemmShape.of(shape), device_info(dev).sm_count
    ctas = max_ctas(1, shape.top_k, shape.experts)
    builtin = tuple(default_fp8_tactic(g, st, ctas, sms) for st in (1, 2))
    alt = tuple(next(t for t in Fp8Space(6).tactics_for(g, st, sms) if t != builtin[st - 1] and t.valid_for(g, st)
                     is None) for st in (1, 2))  # fmt: skip
    entries = {(st, 1): TableEntry(alt[st - 1], 5.0, 4.0, 6.0) for st in (1, 2)}
    write_table(TuningTable(ShapeClass.of(shape), {"name": device_info(dev).name, "sm_count": sms},
                            fp8_entries=entries), tmp_path)  # fmt: skip
    run = rn._stage_runner(cfg, shape, LAYER, dev, None, {})
    assert run.search == [str(tmp_path)] and run.pair(1) == alt  # the table's pair
    assert run.pair(2) == tuple(default_tactic(g, st, max_ctas(2, 6, 8), sms, run.wide, fp8=True) for st in (1, 2))
    tuned = rn._stage_runner(cfg, shape, LAYER, dev, run.weight_sets, {(1, 1): builtin[0]})
    assert tuned.pair(1) == (builtin[0], alt[1])  # this run's pick first
