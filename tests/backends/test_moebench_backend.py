"""The moebench backend's tactic names: which kernel family each runs
(RoutedExpertGemm's `fp8` and `tactics`), their errors and skip reasons, and
the kernel_tactics column naming the family that ran."""

from types import SimpleNamespace

import pytest
import torch

from moebench.backends.moebench import MoebenchBackend
from moebench.formats import generate_expert_weights
from moebench.kernels.tactic import GemmTactic
from moebench.models import get_preset
from moebench.kernels.family import FamilyChoice

SHAPE = get_preset("dsv41-flash").shard(4)
#: dsv41-flash at H 32768 (TP1): no fp8 tactic fits (the staged activation tile outgrows shared memory).
WIDE = get_preset("dsv41-flash", hidden=32768).shard(1)


def test_tactic_names_and_the_error_for_others():
    backend = MoebenchBackend()
    assert backend.valid_tactics(SHAPE) == ("default", "builtin", "tuned", "fp8", "bf16", "fused")
    for name in backend.valid_tactics(SHAPE):
        backend.check_tactic(SHAPE, name)
    for bad in ("BF16", "fp16", "", "f8"):
        with pytest.raises(ValueError, match=rf"tactic '{bad}' is not valid for backend 'moebench'.*'bf16'"):
            backend.check_tactic(SHAPE, bad)


def test_tables_dir_tactic_checks_its_directory(tmp_path):
    """ "tables=DIR": accepted where DIR holds tuning tables, refused with what
    is wrong otherwise (naming the directory); skipped, naming DIR, where
    none of its tables is for this device and shape."""
    import shutil

    from moebench.kernels.table import PACKAGE_TABLES

    backend = MoebenchBackend()
    assert backend.tactic_forms == ("tables=DIR", "nopdl=TACTIC")
    empty, tables = tmp_path / "empty", tmp_path / "tables"
    empty.mkdir()
    tables.mkdir()
    shutil.copy(next(PACKAGE_TABLES.glob("*I=576*")), tables)  # dsv41-flash TP4's
    backend.check_tactic(SHAPE, f"tables={tables}")
    assert backend.accepts_tactic(SHAPE, f"tables={tables}")
    for bad, why in ((f"tables={tmp_path / 'none'}", "is not a directory"), (f"tables={empty}", "holds no tuning"),
                     ("tables=", "needs a directory")):  # fmt: skip
        assert not backend.accepts_tactic(SHAPE, bad)
        with pytest.raises(ValueError, match=f"tactic '{bad}' of backend 'moebench': .*{why}"):
            backend.check_tactic(SHAPE, bad)
    with pytest.raises(ValueError, match=r"expected one of .*'fused'\) or 'tables=DIR'"):
        backend.check_tactic(SHAPE, "table")
    why = backend.tactic_unavailable_reason(SHAPE, f"tables={tables}", "cpu")  # no table for a "cpu" device
    assert why is not None and str(tables) in why and "device_name=cpu" in why


def test_family_tactics_are_skipped_where_their_built_ins_do_not_fit():
    backend = MoebenchBackend()
    for name in ("default", "builtin", "fp8", "bf16", "fused"):
        assert backend.tactic_unavailable_reason(SHAPE, name, "cpu") is None, name
    for name in ("fp8", "fused"):  # the fused layer runs the FP8 family
        why = backend.tactic_unavailable_reason(WIDE, name, "cpu")
        assert why is not None and "no fp8 GEMM1 tactic" in why and "shared memory" in why
    assert backend.tactic_unavailable_reason(WIDE, "bf16", "cpu") is None


def test_nopdl_form_wraps_one_of_the_backends_tactics(tmp_path):
    """ "nopdl=TACTIC": TACTIC with the route launched without PDL; TACTIC must
    be one this backend takes (a tables=DIR too), never another nopdl=; its
    skip reason is TACTIC's."""
    backend = MoebenchBackend()
    (tmp_path / "t.json").write_text("{}")
    for good in ("nopdl=default", "nopdl=fp8", "nopdl=fused", f"nopdl=tables={tmp_path}"):
        backend.check_tactic(SHAPE, good)
    for bad, why in (("nopdl=", "needs one of this backend's tactics"), ("nopdl=nopdl=default", "needs one"),
                     ("nopdl=BF16", "got 'BF16'"), (f"nopdl=tables={tmp_path / 'no'}", "is not a directory")):  # fmt: skip
        assert not backend.accepts_tactic(SHAPE, bad)
        with pytest.raises(ValueError, match=f"tactic '{bad}' of backend 'moebench': .*{why}"):
            backend.check_tactic(SHAPE, bad)
    assert backend.tactic_unavailable_reason(WIDE, "nopdl=fp8", "cpu") == backend.tactic_unavailable_reason(
        WIDE, "fp8", "cpu"
    )


def test_prepare_nopdl_binds_the_inner_tactic_without_route_pdl(monkeypatch):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from moebench.kernels import binding, finalize

    calls = []
    monkeypatch.setattr(binding, "RoutedExpertGemm",
                        lambda weights, top_k, tactics=None, **kw: calls.append(kw) or SimpleNamespace())  # fmt: skip
    monkeypatch.setattr(finalize, "compile_finalize_kernel", lambda *a: None)
    shape = get_preset("dsv41-flash", hidden=256, intermediate=512, experts=32).shard(2)
    layer = MoebenchBackend().prepare(generate_expert_weights(shape, seed=1), shape, "nopdl=bf16")
    assert calls == [{"fp8": False, "fused": False}] and layer.route_launch_pdl is False


@pytest.fixture
def recorded(monkeypatch):
    """prepare() with RoutedExpertGemm and the finalize compile replaced by
    recorders: which arguments each tactic name binds the layer with."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from moebench.kernels import binding, finalize

    calls = []
    monkeypatch.setattr(
        binding,
        "RoutedExpertGemm",
        lambda weights, top_k, tactics=None, **kw: calls.append((top_k, tactics, kw)) or "layer",
    )
    monkeypatch.setattr(finalize, "compile_finalize_kernel", lambda *a: None)
    return calls


@pytest.mark.parametrize("tactic, want", [
    ("default", (None, {})),  # fp8=None: the family the tables choose
    ("tuned", (None, {})),
    ("builtin", ({}, {})),  # the built-in rule and tactics, tables ignored
    ("fp8", (None, {"fp8": True, "fused": False})),
    ("bf16", (None, {"fp8": False, "fused": False})),
    ("fused", (None, {"fp8": True, "fused": True})),  # GEMM1 + GEMM2 in one launch where it fits
])  # fmt: skip
def test_prepare_binds_each_tactic_name_to_its_family(recorded, tactic, want):
    shape = get_preset("dsv41-flash", hidden=256, intermediate=512, experts=32).shard(2)
    weights = generate_expert_weights(shape, seed=1)
    assert MoebenchBackend().prepare(weights, shape, tactic) == "layer"
    assert recorded == [(shape.top_k, *want)]


def test_prepare_binds_tables_dir_to_that_directory_alone(recorded, tmp_path):
    shape = get_preset("dsv41-flash", hidden=256, intermediate=512, experts=32).shard(2)
    weights = generate_expert_weights(shape, seed=1)
    (tmp_path / "t.json").write_text("{}")
    assert MoebenchBackend().prepare(weights, shape, f"tables={tmp_path}") == "layer"
    assert recorded == [(shape.top_k, None, {"tables": [tmp_path]})]


def test_prepare_rejects_an_unknown_tactic_before_binding(recorded):
    shape = get_preset("dsv41-flash", hidden=256, intermediate=512, experts=32).shard(2)
    weights = generate_expert_weights(shape, seed=1)
    with pytest.raises(ValueError, match="tactic 'BF16' is not valid"):
        MoebenchBackend().prepare(weights, shape, "BF16")
    assert recorded == []


def test_kernel_tactics_names_the_family_that_ran_and_how_it_was_chosen():
    t1, t2 = GemmTactic(16, 4, 4, 4, 1, stages=6, fp8=True), GemmTactic(32, 4, 1, 3, 3, stages=6, fp8=True)
    prepared = SimpleNamespace(
        tactics={(1, 6): t1, (2, 6): t2},
        tactic_sources={(1, 6): "table /x/E=384.json fp8.gemm1[6]", (2, 6): "default (fp8)"},
        family_choice=FamilyChoice(True, "tables", "fp8 faster at rows 1-8"),
    )
    assert MoebenchBackend().kernel_tactics(prepared, 6) == (
        "fp8 family (tables); gemm1 r16_m4_k4_u4_c1_b6_f8 (table); gemm2 r32_m4_k1_u3_c3_b6_f8 (default (fp8))"
    )
    b1, b2 = GemmTactic(64, 1, 8, 4, 1, act_bf16=True), GemmTactic(32, 8, 1, 2, 2, act_bf16=True)
    prepared = SimpleNamespace(tactics={(1, 2): b1, (2, 2): b2},
                               tactic_sources={(1, 2): "default (gemm1 rows=2)", (2, 2): "explicit"},
                               family_choice=FamilyChoice(False, "asked", "fp8=False"))  # fmt: skip
    assert MoebenchBackend().kernel_tactics(prepared, 2) == (
        f"bf16 family (asked); gemm1 {b1.name} (default (gemm1 rows=2)); gemm2 {b2.name} (explicit)"
    )


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_sweep_runs_each_family_by_name_and_says_which_ran():
    """dsv41-flash TP8 rows 1 and 6, every moebench tactic: each passes the
    sweep's oracle gate; kernel_tactics names the family each row ran (on an
    H200 the shipped tables make "default" the FP8 family)."""
    from moebench.bench.cases import SweepConfig
    from moebench.bench.sweep import run_sweep
    from moebench.kernels.family import choose_family
    from moebench.kernels.table import ShapeClass

    cfg = SweepConfig(presets=("dsv41-flash",), tp=(8,), rows=(1, 6), scenarios=("correlated",),
                      backends=("moebench",), tactics=("default", "builtin", "fp8", "bf16"), replays=10, warmup=2,
                      device="cuda", split=False)  # fmt: skip
    df = run_sweep(cfg).frame
    assert (df["status"] == "ok").all(), df["error"].tolist()
    name = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shape = get_preset("dsv41-flash").shard(8)
    default = choose_family(name, ShapeClass.of(shape), num_sms=sms)
    if "H200" in name:
        assert default.family == "fp8" and default.source == "tables", default
    want = {"default": f"{default.family} family ({default.source})", "builtin": "fp8 family (built-in)",
            "fp8": "fp8 family (asked)", "bf16": "bf16 family (asked)"}  # fmt: skip
    for r in df.to_dict("records"):
        assert r["kernel_tactics"].startswith(want[r["tactic"]] + "; gemm1 "), r
        assert r["kernel_tactics"].count("_f8") == (2 if want[r["tactic"]].startswith("fp8") else 0), r
        assert r["max_rel_err"] <= 1e-2, r


@pytest.mark.gpu
def test_gpu_tables_dir_runs_that_directorys_entries(tmp_path):
    """A copy of this GPU's shipped dsv41-flash TP4 table whose FP8 GEMM1 rows-1
    entry names another valid tactic: "tables=DIR" runs that tactic (source:
    DIR's file), "tuned" the shipped one."""
    import json

    from moebench.kernels.table import PACKAGE_TABLES, table_file_name

    src = PACKAGE_TABLES / table_file_name(SHAPE, torch.cuda.get_device_name())  # this GPU's, not the first found
    if not src.exists():
        pytest.skip(f"no shipped table for this GPU ({src.name})")
    data = json.loads(src.read_text())
    entry = data["fp8"]["gemm1"]["1"]
    other = GemmTactic(16, 4, 4, 4, 1, stages=5, fp8=True)
    assert other.name != entry["tactic"]["name"] and other.valid_for(SHAPE, 1) is None
    entry["tactic"] = {"name": other.name, **other.to_fields()}
    (tmp_path / src.name).write_text(json.dumps(data))
    weights = generate_expert_weights(SHAPE, seed=3, device="cuda")
    backend = MoebenchBackend()
    mine = backend.prepare(weights, SHAPE, f"tables={tmp_path}")
    shipped = backend.prepare(weights, SHAPE, "tuned")
    assert mine.tactics[1, 1] == other and str(tmp_path) in mine.tactic_sources[1, 1]
    assert shipped.tactics[1, 1].name == json.loads(src.read_text())["fp8"]["gemm1"]["1"]["tactic"]["name"]
    assert "table" in backend.kernel_tactics(mine, 1) and other.name in backend.kernel_tactics(mine, 1)


def test_route_launch_pdl_is_a_checked_static_switch():
    from moebench.kernels.route import _check_static

    _check_static(True, 16, True, False, launch_pdl=False)
    with pytest.raises(TypeError, match="launch_pdl"):
        _check_static(True, 16, True, False, launch_pdl="no")


@pytest.mark.gpu
def test_gpu_nopdl_route_gives_the_same_bits():
    """nopdl=default launches the route without the programmatic attribute:
    the same output bits as default, and kernel_tactics says so."""
    from moebench.formats import generate_activations
    from moebench.routing import scenario_topk_ids, scenario_weights

    backend = MoebenchBackend()
    if backend.unavailable_reason("cuda") is not None:
        pytest.skip(backend.unavailable_reason("cuda"))
    shape = get_preset("dsv41-flash").shard(8)
    weights = generate_expert_weights(shape, seed=3, device="cuda")
    outs = {}
    for tactic in ("default", "nopdl=default"):
        layer = backend.prepare(weights, shape, tactic)
        for rows in (1, 4):
            x = generate_activations(rows, shape.hidden, 3, "cuda")
            ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, 3).cuda()
            w = scenario_weights(rows, shape.top_k, 3, scale=shape.routed_scaling_factor).cuda()
            outs[tactic, rows] = backend.forward(layer, x, ids, w).clone()
        assert ("route launched without PDL" in backend.kernel_tactics(layer, 4)) == (tactic != "default")
    for rows in (1, 4):
        assert torch.equal(outs["default", rows], outs["nopdl=default", rows])
