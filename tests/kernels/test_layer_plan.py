"""LayerPlan (CPU): the family, every (stage, rows) tactic and the fused choice
with their sources, from the tables or the built-ins; its validation; and a
binding of a plan on CPU weights with a recording launcher (what it compiles
and launches, in order)."""

import dataclasses

import pytest
import torch

from moebench.kernels import table as tb
from moebench.kernels.family import FamilyChoice, resolve_family
from moebench.kernels.fused_tactic import LayerChoice, default_fused_tactic
from moebench.kernels.layer_plan import LayerPlan, PlannedFused, PlannedTactic, plan_layer
from moebench.kernels.tactic import GemmTactic, default_tactic
from moebench.models import get_preset
from moebench.record import MAX_ROWS, max_ctas

DEVICE = "NVIDIA H200"


@pytest.fixture
def shape():
    return tb.ShapeClass.of(get_preset("dsv41-flash", experts=64).shard(4))


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty tuning directory in front of nothing (the package's tables are
    not on the path: `search=[tmp_path]`)."""
    tb.reset_log_once()
    yield [tmp_path]
    tb.reset_log_once()


def _plan(shape, tables, fp8=None, tactics=None, **kwargs):
    family = resolve_family(fp8, tactics, DEVICE, shape, num_sms=132, search=tables)
    return plan_layer(shape, family, device_name=DEVICE, num_sms=132, tactics=tactics, tables=tables, **kwargs)


def test_without_a_table_every_tactic_is_the_families_builtin_default(shape, tables):
    plan = _plan(shape, tables)
    assert plan.family.family == "fp8" and plan.family.source == "built-in"
    for (stage, rows), t in plan.tactics.items():
        assert t == default_tactic(shape.gemm_shape, stage, max_ctas(rows, shape.top_k, shape.experts), fp8=True)
        assert plan.tactic_sources[stage, rows].startswith("default (fp8")
    assert plan.fused_tactics == dict.fromkeys(range(1, MAX_ROWS + 1))
    assert all(s.startswith("the pair") or s.startswith("default") for s in plan.fused_sources.values())
    bf16 = _plan(shape, tables, fp8=False)
    assert bf16.family.source == "asked" and not any(t.fp8 for t in bf16.tactics.values())


def test_explicit_tactics_leave_the_other_stage_at_its_default_as_the_layers_operand(shape, tables):
    """tactics={} (or one stage given) ignores the tables; the stages it leaves
    out run the built-in default, as the `_a16` twin where the layer runs the
    BF16 operand (the binding before the plan did; the H100 run of
    test_binding caught the plan giving the MXFP8-operand default)."""
    for act_bf16 in (True, False):
        plan = _plan(shape, tables, fp8=False, tactics={}, act_bf16=act_bf16)
        assert all(t.act_bf16 == act_bf16 for t in plan.tactics.values())
        assert all(s.startswith("default") for s in plan.tactic_sources.values())
    given = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=2, ctas_per_sm=2)
    plan = _plan(shape, tables, fp8=False, tactics={1: given})
    assert all(plan.tactics[1, r] == given for r in range(1, MAX_ROWS + 1))  # explicit: as given
    assert all(plan.tactics[2, r].act_bf16 for r in range(1, MAX_ROWS + 1))


def test_table_entries_their_a16_twins_and_the_fused_choice(shape, tables):
    tuned = GemmTactic(tile_rows=64, warps_m=1, warps_k=4, unroll=2, ctas_per_sm=2)
    f8 = GemmTactic(32, 4, 2, 4, 2, fp8=True)
    ft = default_fused_tactic(shape.gemm_shape, max_ctas(1, shape.top_k, shape.experts))
    table = tb.TuningTable(shape, {"name": DEVICE, "sm_count": 132}, {(1, 6): tb.TableEntry(tuned, 10.0, 9.0, 11.0)},
                           fp8_entries={(1, 4): tb.TableEntry(f8, 10.0, 9.0, 11.0)},
                           fused_entries={1: tb.TableEntry(LayerChoice(ft), 9.0, 8.0, 10.0)})  # fmt: skip
    from moebench.tuning.table import write_table

    path = write_table(table, tables[0])
    bf16 = _plan(shape, tables, fp8=False)
    planned = bf16.planned(1, 6)
    assert planned.tactic == dataclasses.replace(tuned, act_bf16=True) and planned.source.startswith(f"table {path}")
    assert "_a16" in planned.reason and bf16.planned(1, 5).source.startswith("default")
    assert _plan(shape, tables, fp8=False, act_bf16=False).tactic(1, 6) == tuned
    fp8 = _plan(shape, tables, fp8=True)
    assert fp8.tactic(1, 4) == f8 and fp8.tactic_sources[1, 4] == f"table {path} fp8.gemm1[4]"
    assert fp8.fused_at(1) == ft and fp8.fused_sources[1] == f"table {path} fp8.fused[1]"
    assert fp8.fused_at(2) is None
    # explicit tactics: the caller's per stage, defaults for the other, tables ignored (the pair)
    explicit = _plan(shape, tables, tactics={2: GemmTactic(32, 4, 1, 3, 2, fp8=True)})
    assert explicit.family.source == "tactics" and explicit.tactic_sources[2, 3] == "explicit"
    assert explicit.tactic_sources[1, 3] == "default" and explicit.fused_at(1) is None
    # fused=True: the built-in fused tactic everywhere it fits; fused=False: the pair
    assert all(f is not None for f in _plan(shape, tables, fp8=True, fused=True).fused_tactics.values())
    assert _plan(shape, tables, fp8=True, fused=False).fused_at(1) is None
    with pytest.raises(ValueError, match="fused=True needs the FP8 family"):
        _plan(shape, tables, fp8=False, fused=True)


def test_a_plan_is_validated_and_a_substitution_too(shape, tables):
    plan = _plan(shape, tables, fp8=True)
    bf = GemmTactic(64, 1, 8, 2, 2)
    with pytest.raises(ValueError, match="GEMM1 rows 3: .* not an fp8 tactic"):
        plan.with_tactic(1, 3, bf)
    with pytest.raises(ValueError, match=r"tactics\[2\] .* cannot run GEMM2"):
        plan.with_tactic(2, 3, GemmTactic(32, 4, 1, 1, 1, fp8=True, spec=True, stages=2))
    with pytest.raises(ValueError, match="rows must be an int"):
        plan.with_tactic(1, 9, plan.tactic(1, 1))
    other = GemmTactic(32, 4, 2, 4, 2, fp8=True)
    swapped = plan.with_tactic(1, 3, other)
    assert swapped.tactic(1, 3) == other and swapped.tactic_sources[1, 3] == "candidate"
    assert {k: v for k, v in swapped.tactics.items() if k != (1, 3)} == {
        k: v for k, v in plan.tactics.items() if k != (1, 3)
    }
    ft = default_fused_tactic(shape.gemm_shape, max_ctas(2, shape.top_k, shape.experts))
    assert plan.with_fused(2, ft).fused_at(2) == ft and plan.fused_at(2) is None
    bf16 = _plan(shape, tables, fp8=False)
    with pytest.raises(ValueError, match="needs the FP8 family"):
        bf16.with_fused(2, ft)
    with pytest.raises(ValueError, match="gemms must be a tuple of 8"):
        LayerPlan(shape, plan.family, False, plan.gemms[:7], plan.fused)
    with pytest.raises(TypeError, match="family must be a FamilyChoice"):
        LayerPlan(shape, "fp8", False, plan.gemms, plan.fused)
    with pytest.raises(ValueError, match="source must be a non-empty str"):
        PlannedTactic(other, "")
    with pytest.raises(TypeError, match="fused must be a FusedTactic or None"):
        PlannedFused(other, "x")
    assert isinstance(plan.family, FamilyChoice) and "gemm1" in plan.describe(1)


def test_plan_layer_refuses_arguments_it_would_silently_ignore_or_misread(shape, tables):
    """A stage key 3 or '1' used to leave the defaults in place without a word,
    a str `tables` was searched letter by letter, a num_sms of 0 was taken;
    rows outside 1..8 read past the plan (ctas 0, describe IndexError)."""
    family = resolve_family(True, None, DEVICE, shape, num_sms=132, search=tables)
    t = default_tactic(shape.gemm_shape, 1, max_ctas(1, shape.top_k, shape.experts), fp8=True)

    def plan(**kwargs):
        return plan_layer(shape, family, **{"device_name": DEVICE, "num_sms": 132, "tables": tables, **kwargs})

    for tactics, error, match in (
        ({3: t}, ValueError, "tactics keys must be the stages 1 and 2, got 3"),
        ({"1": t}, ValueError, "tactics keys must be the stages 1 and 2, got '1'"),
        ([t], TypeError, "tactics must be None or a dict"),
        ({1: t.name}, TypeError, r"tactics\[1\] must be a GemmTactic"),
    ):
        with pytest.raises(error, match=match):
            plan(tactics=tactics)
    for sms in (0, -3, "132", True):
        with pytest.raises(ValueError, match="num_sms must be a positive int"):
            plan(num_sms=sms)
    with pytest.raises(TypeError, match="tables must be None or a list of directories"):
        plan(tables=str(tables[0]))
    ok = plan()
    for rows in (0, 9):
        for read in (ok.ctas, ok.describe):
            with pytest.raises(ValueError, match="rows must be an int in"):
                read(rows)


# ----------------------------------------------------------------------------- binding on CPU


binding = pytest.importorskip("moebench.kernels.binding", reason="needs nvidia-cutlass-dsl")


class Recorder(binding.KernelLauncher):
    """Records what a binding compiles and launches (no kernel runs)."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.launched: list = []

    def compile_route(self, **flags):
        self.compiled.append(("route", tuple(sorted(flags.items()))))

    def compile_front(self, experts, top_k, image, deq=False):
        self.compiled.append(("front", deq))

    def compile_gemm(self, shape, tactic, stage, wide_scales):
        self.compiled.append((f"gemm{stage}", tactic.name))

    def compile_fused(self, shape, tactic, wide_scales):
        self.compiled.append(("fused", tactic.name))

    def route(self, *args, release_after_wait=False, inputs_ready=False, x_deq_out=None, **kwargs):
        self.launched.append(("route", release_after_wait, inputs_ready, x_deq_out is not None))

    def front(self, *args, **kwargs):
        self.launched.append(("front",))

    def gemm1(self, kw, *args, tactic, **kwargs):
        self.launched.append(("gemm1", tactic.name, kw.w13.data_ptr()))

    def gemm2(self, kw, *args, tactic, **kwargs):
        self.launched.append(("gemm2", tactic.name, kw.w2.data_ptr()))

    def fused(self, kw, *args, tactic, **kwargs):
        self.launched.append(("fused", tactic.name, kw.w13.data_ptr()))

    def act_to_bf16(self, q, scale, out):
        self.launched.append(("act_to_bf16",))
        return out


@pytest.fixture(scope="module")
def cpu_layer():
    """A small FP8-family layer on the CPU: (ShapeClass, RankShape, canonical weights, kernel layout)."""
    from moebench.formats import generate_expert_weights
    from moebench.kernels.layout import to_kernel_layout

    rank = get_preset("dsv41-flash", hidden=512, intermediate=1152, experts=32).shard(4)
    w = generate_expert_weights(rank, seed=3, device="cpu")
    return tb.ShapeClass.of(rank), rank, w, to_kernel_layout(w, "e4m3")


def cpu_plan(cpu_layer, fused=None):
    sclass, _, _, kw = cpu_layer
    family = resolve_family(True, None, DEVICE, sclass)
    return plan_layer(sclass, family, device_name=DEVICE, num_sms=132, wide_scales=kw.scale_variant(True),
                      tables=[], fused=fused)  # fmt: skip


def layer_inputs(rank, rows):
    from moebench.routing import scenario_topk_ids

    x = torch.zeros(rows, rank.hidden, dtype=torch.bfloat16)
    ids = scenario_topk_ids("correlated", rows, rank.top_k, rank.experts, 0).to(torch.int32)
    return x, ids, torch.ones(rows, rank.top_k)


def test_a_bound_plan_compiles_and_launches_what_the_plan_names(cpu_layer):
    _, rank, w, kw = cpu_layer
    plan = cpu_plan(cpu_layer)
    rec = Recorder()
    layer = binding.RoutedExpertGemm.bind(kw, plan, source=w, launcher=rec)
    assert layer.plan is plan and layer.tactics == plan.tactics and layer.family_choice is plan.family
    assert {(f"gemm{s}", t.name) for (s, _), t in plan.tactics.items()} <= set(rec.compiled)
    assert ("route", (("quantize", True),)) in rec.compiled
    for rows in (1, 4, 8):
        rec.launched.clear()
        layer.forward(*layer_inputs(rank, rows))
        t1, t2 = plan.tactic(1, rows), plan.tactic(2, rows)
        assert rec.launched == [("route", t1.spec, False, False), ("gemm1", t1.name, kw.w13.data_ptr()),
                                ("gemm2", t2.name, kw.w2.data_ptr())]  # fmt: skip
    fused = cpu_plan(cpu_layer, fused=True)
    rec = Recorder()
    layer = binding.RoutedExpertGemm.bind(kw, fused, launcher=rec)
    assert layer.fused_workspace is not None and ("fused", fused.fused_at(2).name) in rec.compiled
    layer.forward(*layer_inputs(rank, 2))
    assert rec.launched == [("route", False, False, False), ("fused", fused.fused_at(2).name, kw.w13.data_ptr())]


@pytest.mark.parametrize(
    "given", [{"tactics": {}}, {"fp8": True}, {"fused": False}, {"tables": []}, {"act_bf16": False}]
)
def test_a_plan_with_another_choice_argument_is_refused_not_ignored(cpu_layer, given):
    """RoutedExpertGemm(plan=p, tactics=...) used to run p and drop the tactics without a word."""
    _, rank, w, _ = cpu_layer
    with pytest.raises(ValueError, match=f"{next(iter(given))} cannot be given with it"):
        binding.RoutedExpertGemm(w, rank.top_k, plan=cpu_plan(cpu_layer), **given)


def test_bind_refuses_weights_not_of_the_plan(cpu_layer):
    from moebench.kernels.layout import to_kernel_layout

    _, _, w, kw = cpu_layer
    plan = cpu_plan(cpu_layer)
    with pytest.raises(ValueError, match="not laid out for the plan"):
        binding.RoutedExpertGemm.bind(to_kernel_layout(w, "bf16"), plan, launcher=Recorder())
    with pytest.raises(ValueError, match="wide_scales"):
        binding.RoutedExpertGemm.bind(kw, dataclasses.replace(plan, wide_scales=not plan.wide_scales),
                                      launcher=Recorder())  # fmt: skip
    with pytest.raises(TypeError, match="plan must be a LayerPlan"):
        binding.RoutedExpertGemm.bind(kw, "plan", launcher=Recorder())


# ----------------------------------------------------------------------------- the tuner times what runs


def _launches(layers, x, ids, tw, recorder, writes=True):
    """The launches of one timed call of `layers` (the tuner's `timed_layers`) on `recorder`."""
    from moebench.tuning.runner import timed_layers

    marks = [lambda: recorder.launched.append(("x write",))] * len(layers) if writes else None
    timed_layers(layers, x, ids, tw, marks)()
    return recorder.launched


def test_the_tuned_sequence_is_the_one_the_runtime_launches(cpu_layer, tmp_path):
    """Per candidate, the tuner binds the plan with the candidate substituted
    (`candidate_plan` + `bind_layers`) and times `timed_layers`: per rotated
    layer an x write, then the binding's own forward. Recorded on CPU, that
    is launch for launch what the runtime's binding launches once a table
    holds the tuned pair (plan_layer from that table, bound, forward after
    the layer's x write), and differs where the candidate differs."""
    from moebench.backends.moebench import INPUTS_READY
    from moebench.kernels.fused_tactic import fused_candidates
    from moebench.kernels.table import LAYER
    from moebench.tuning.runner import bind_layers, candidate_plan, copy_kernel_weights
    from moebench.tuning.space import DEFAULT_FP8_SPACE, valid_tactics
    from moebench.tuning.table import write_table

    sclass, rank, w, kw = cpu_layer
    kws = [kw, copy_kernel_weights(kw)]  # two rotated weight sets
    base = cpu_plan(cpu_layer)
    rows = 4
    x, ids, tw = layer_inputs(rank, rows)
    space = valid_tactics(sclass.gemm_shape, 1, base.ctas(rows), space=DEFAULT_FP8_SPACE)
    cand = next(t for t in space if t != base.tactic(1, rows) and not t.spec)
    partner = base.tactic(2, rows)
    rec = Recorder()
    tuned = _launches(bind_layers(kws, candidate_plan(base, 1, rows, cand, partner), w, rec), x, ids, tw, rec)
    assert [e[0] for e in tuned] == ["x write", "route", "gemm1", "gemm2"] * 2
    assert tuned[2] == ("gemm1", cand.name, kws[0].w13.data_ptr()) and tuned[6][2] == kws[1].w13.data_ptr()
    # the runtime: a table holding the tuned pair at these rows, the plan made from it, bound per layer
    table = tb.TuningTable(sclass, {"name": DEVICE, "sm_count": 132},
                           fp8_entries={(1, rows): tb.TableEntry(cand, 10.0, 9.0, 11.0),
                                        (2, rows): tb.TableEntry(partner, 10.0, 9.0, 11.0)})  # fmt: skip
    write_table(table, tmp_path)
    tb.reset_log_once()
    family = resolve_family(None, None, DEVICE, sclass, search=[tmp_path])
    runtime_plan = plan_layer(sclass, family, device_name=DEVICE, num_sms=132, wide_scales=kw.scale_variant(True),
                              tables=[tmp_path])  # fmt: skip
    assert runtime_plan.tactic(1, rows) == cand and runtime_plan.tactic_sources[1, rows].startswith("table ")
    run = Recorder()
    for k in kws:
        run.launched.append(("x write",))
        binding.RoutedExpertGemm.bind(k, runtime_plan, source=w, launcher=run).forward(
            x, ids, tw, inputs_ready=INPUTS_READY
        )
    assert run.launched == tuned
    # a GEMM2 candidate beside the GEMM1 just tuned, and the layer step's fused candidate: each what runs
    g2 = next(t for t in valid_tactics(sclass.gemm_shape, 2, base.ctas(rows), space=DEFAULT_FP8_SPACE)
              if t != partner)  # fmt: skip
    rec = Recorder()
    got = _launches(bind_layers(kws, candidate_plan(base, 2, rows, g2, cand), w, rec), x, ids, tw, rec)
    assert got[2][1] == cand.name and got[3][1] == g2.name
    ft = fused_candidates(sclass.gemm_shape, base.ctas(rows), 132)[0]
    rec = Recorder()
    got = _launches(bind_layers(kws, candidate_plan(base, LAYER, rows, LayerChoice(ft)), w, rec), x, ids, tw, rec)
    assert [e[:2] for e in got] == [("x write",), ("route", False), ("fused", ft.name)] * 2
    tb.reset_log_once()
