import math
import time

import pytest
import torch

from moebench.backends.registry import register_backend, unregister_backend
from moebench.backends.torch_bf16 import TorchBF16Backend
from moebench.bench.cases import SweepConfig
from moebench.bench.sweep import COLUMNS, layer_count, run_sweep
from moebench.reports.store import REQUIRED_COLUMNS

TINY = dict(
    presets=("dsv4-flash",),
    hidden=128,
    intermediate=64,
    experts=8,
    top_k=2,
    tp=(1,),
    rows=(1, 3),
    scenarios=("uniform",),
    replays=3,
    warmup=1,
    device="cpu",
)


class WrongBackend(TorchBF16Backend):
    """Correct shape, wrong numbers: must fail the gate and never be timed."""

    name = "test-wrong"
    calls = 0

    def forward(self, prepared, x, topk_ids, topk_weights):
        type(self).calls += 1
        return super().forward(prepared, x, topk_ids, topk_weights) * 2


class RaisingBackend(TorchBF16Backend):
    name = "test-raising"

    def forward(self, prepared, x, topk_ids, topk_weights):
        raise RuntimeError("boom in forward")


class UnavailableBackend(TorchBF16Backend):
    name = "test-unavailable"

    def unavailable_reason(self, device):
        return "needs a unicorn"


@pytest.fixture
def injected():
    backends = {"test-wrong": WrongBackend, "test-raising": RaisingBackend, "test-unavailable": UnavailableBackend}
    for name, cls in backends.items():
        register_backend(name, cls)
    WrongBackend.calls = 0
    yield tuple(backends)
    for name in backends:
        unregister_backend(name)


def test_cpu_sweep_rows_columns_and_failures(injected):
    seen = []
    cfg = SweepConfig(backends=("torch-bf16", "reference", *injected), **TINY)
    result = run_sweep(cfg, progress=lambda done, total, case, status: seen.append((done, total, status)))
    df = result.frame
    assert list(df.columns) == list(COLUMNS)
    assert set(REQUIRED_COLUMNS) <= set(df.columns)
    assert len(df) == 2 * 5 and [s[0] for s in seen] == list(range(1, 11)) and seen[-1][1] == 10
    by = {(r.backend, r.rows): r for r in df.itertuples()}

    for backend in ("torch-bf16", "reference"):
        for rows in (1, 3):
            r = by[(backend, rows)]
            assert r.status == "ok", r.error
            assert r.median_us > 0 and r.p10_us <= r.median_us <= r.p90_us
            assert r.max_rel_err <= 1e-2
            assert r.timing_method == "cpu-wallclock" and r.layers == 1
            assert math.isclose(r.gbps, r.bytes / (r.median_us * 1e-6) / 1e9)
            assert r.pct_copy_bw > 0 and math.isnan(r.pct_size_ceiling)
    assert by[("torch-bf16", 1)].oracle == "bf16" and by[("reference", 1)].oracle == "mxfp8"

    wrong = by[("test-wrong", 3)]
    assert wrong.status == "failed" and "oracle" in wrong.error and wrong.max_rel_err > 0.5
    assert math.isnan(wrong.median_us) and wrong.timing_method == ""
    assert WrongBackend.calls == 2  # one gate call per case, never timed

    raising = by[("test-raising", 1)]
    assert raising.status == "failed" and "boom in forward" in raising.error and math.isnan(raising.median_us)

    skipped = by[("test-unavailable", 1)]
    assert skipped.status == "skipped" and skipped.error == "needs a unicorn"

    m = result.manifest
    assert m["reduced"] is True and m["copy_bw_gbps"] > 0 and m["seed"] == 0
    assert m["backends"]["test-unavailable"] == "needs a unicorn"
    assert m["device"]["kind"] == "cpu" and "torch" in m["packages"]


def test_sweep_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backends"):
        run_sweep(SweepConfig(backends=("no-such-backend",), **TINY))


def test_a_tactic_one_backend_lacks_is_skipped_for_it():
    cfg = SweepConfig(backends=("reference", "torch-bf16"), tactics=("gather",), **{**TINY, "rows": (1,)})
    df = run_sweep(cfg).frame.set_index("backend")
    assert df.loc["reference", "status"] == "skipped" and "gather" in df.loc["reference", "error"]
    assert df.loc["torch-bf16", "status"] == "ok"


def test_a_tactic_no_selected_backend_offers_fails_up_front_naming_the_valid_ones(monkeypatch):
    from moebench.bench import sweep as sw

    measured = []
    monkeypatch.setattr(sw, "copy_bandwidth_gbps", lambda *a, **k: measured.append(1) or 1.0)
    cfg = SweepConfig(backends=("reference", "torch-bf16"), tactics=("default", "nope"), **TINY)
    for check in (sw.validate_sweep, sw.run_sweep):
        with pytest.raises(ValueError, match="--tactics") as info:
            check(cfg)
        text = str(info.value)
        assert "'nope'" in text and "'all'" in text and "reference: default" in text and "gather" in text
    assert measured == []  # nothing measured before the check


def test_a_tables_dir_tactic_is_checked_up_front_and_skipped_without_its_table(tmp_path):
    """`--tactics tables=DIR` with moebench: a missing or empty DIR fails
    before anything is measured, naming --tactics and what is wrong; a DIR
    without a table for this device (the CPU) skips the case naming DIR; a
    backend without the form (torch-bf16 alone) does not know the name."""
    from moebench.bench import sweep as sw

    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "E=1.json").write_text("{}")
    base = {**TINY, "rows": (1,)}
    for bad, why in ((tmp_path / "none", "is not a directory"), (tmp_path, "holds no tuning table")):
        cfg = SweepConfig(backends=("moebench",), tactics=(f"tables={bad}",), **base)
        with pytest.raises(ValueError, match=f"--tactics.*{why}"):
            sw.validate_sweep(cfg)
    cfg = SweepConfig(backends=("moebench",), tactics=(f"tables={tables}",), **base)
    df = run_sweep(cfg).frame
    assert list(df["tactic"]) == [f"tables={tables}"] and (df["status"] == "skipped").all()
    cfg = SweepConfig(backends=("torch-bf16",), tactics=(f"tables={tables}",), **base)
    with pytest.raises(ValueError, match="not offered by the selected backends.*is a tactic of moebench"):
        sw.validate_sweep(cfg)
    cfg = SweepConfig(backends=("torch-bf16", "moebench"), tactics=(f"tables={tables}",), **base)
    df = run_sweep(cfg).frame.set_index("backend")
    assert df.loc["torch-bf16", "error"].startswith(f"tactic 'tables={tables}' is not one of torch-bf16's (valid:")


def test_moebench_backend_offers_default_builtin_and_tuned(monkeypatch, tmp_path):
    """ "tuned" is skipped with the reason while no table covers the device
    and shape class; a table in $MOEBENCH_TUNING_DIR makes it available."""
    from moebench.backends.moebench import MoebenchBackend
    from moebench.kernels.tactic import default_tactic
    from moebench.models import get_preset
    from moebench.kernels import table as tb
    from moebench.tuning.table import write_table

    shape = get_preset("dsv41-flash").shard(4)
    backend = MoebenchBackend()
    assert backend.valid_tactics(shape) == ("default", "builtin", "tuned", "fp8", "bf16", "fused")
    validate = SweepConfig(backends=("moebench",), tactics=("tuned", "builtin", "default"), **TINY)
    from moebench.bench.sweep import validate_sweep

    validate_sweep(validate)  # all three are moebench tactics: no error
    monkeypatch.setenv("MOEBENCH_TUNING_DIR", str(tmp_path))
    tb.reset_log_once()
    assert backend.tactic_unavailable_reason(shape, "default", "cpu") is None
    why = backend.tactic_unavailable_reason(shape, "tuned", "cpu")
    assert "no tuning table E=384,H=5120,I=576,top_k=6,device_name=cpu" in why and str(tmp_path) in why
    t = default_tactic(shape, 1, 6)
    table = tb.TuningTable(tb.ShapeClass.of(shape), {"name": "cpu"}, {(1, 1): tb.TableEntry(t, 10.0, 9.0, 11.0)})
    write_table(table, tmp_path)
    assert backend.tactic_unavailable_reason(shape, "tuned", "cpu") is None


def test_moebench_backend_fp8_tactic_is_skipped_with_the_reason_where_it_cannot_run():
    """ "fp8" (the FP8 kernel family by name) is available where fp8 tactics fit
    both GEMMs, else its reason names the GEMM and the rule."""
    from moebench.backends.moebench import MoebenchBackend
    from moebench.models import get_preset

    backend = MoebenchBackend()
    assert backend.tactic_unavailable_reason(get_preset("dsv41-flash").shard(4), "fp8", "cpu") is None
    wide = get_preset("dsv41-flash", hidden=32768).shard(1)  # the staged activation tile outgrows shared memory
    why = backend.tactic_unavailable_reason(wide, "fp8", "cpu")
    assert why is not None and "no fp8 GEMM1 tactic" in why and "shared memory" in why


def test_layer_count():
    mb = 1 << 20
    assert layer_count(14 * mb, 60 * mb, 900 * mb, None) == (18, False)
    assert layer_count(14 * mb, 60 * mb, 900 * mb, 4500 * mb) == (5, True)
    assert layer_count(14 * mb, None, 900 * mb, None) == (1, False)
    assert layer_count(500 * mb, 60 * mb, 900 * mb, 100 * mb) == (1, False)
    with pytest.raises(ValueError):
        layer_count(0, 60 * mb, 1, None)


@pytest.mark.gpu
def test_gpu_sweep_torch_bf16_small():
    cfg = SweepConfig(**{**TINY, "device": "cuda", "backends": ("torch-bf16",), "replays": 10})
    df = run_sweep(cfg).frame
    assert (df["status"] == "ok").all(), df["error"].tolist()
    assert (df["timing_method"] == "cuda-graph").all()
    assert torch.cuda.is_available()


def test_layer_count_is_bounded_for_tiny_shapes():
    from moebench.bench import MAX_LAYERS

    assert layer_count(1024, 60 << 20, 4096, None) == (MAX_LAYERS, True)
    assert layer_count(1024, 60 << 20, 4096, 8 * 4096) == (8, True)


class GraphOnlyWrongBackend(TorchBF16Backend):
    """Right when called eagerly, wrong inside a CUDA graph: the sweep must
    gate the replay too, since the replay is what it times."""

    name = "test-graph-wrong"

    def forward(self, prepared, x, topk_ids, topk_weights):
        out = super().forward(prepared, x, topk_ids, topk_weights)
        return out * 2 if torch.cuda.is_current_stream_capturing() else out


@pytest.mark.gpu
def test_gpu_sweep_gates_the_graph_replay():
    register_backend("test-graph-wrong", GraphOnlyWrongBackend)
    try:
        cfg = SweepConfig(backends=("torch-bf16", "test-graph-wrong"), **{**TINY, "device": "cuda", "rows": (3,)})
        df = run_sweep(cfg).frame
    finally:
        unregister_backend("test-graph-wrong")
    by = {r.backend: r for r in df.itertuples()}
    assert by["torch-bf16"].status == "ok", by["torch-bf16"].error
    wrong = by["test-graph-wrong"]
    assert wrong.status == "failed" and "CUDA-graph replay" in wrong.error and wrong.max_rel_err > 0.5
    assert math.isnan(wrong.median_us)


class StagedBackend(TorchBF16Backend):
    """torch-bf16 cut into three named stages plus a routed path (no finalize),
    counting how often each is called; each call costs 0.2 ms, well above the
    layer boundary's x write that the sweep subtracts."""

    name = "test-staged"
    calls: dict = {}

    def _count(self, name):
        time.sleep(2e-4)
        type(self).calls[name] = type(self).calls.get(name, 0) + 1

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        return [(n, lambda n=n: self._count(n)) for n in ("route", "gemm1", "finalize")]

    def routed_call(self, prepared, x, topk_ids, topk_weights):
        return lambda: self._count("routed")


class BadStageBackend(TorchBF16Backend):
    name = "test-bad-stage"

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        return [("warp-drive", lambda: None)]

    def routed_call(self, prepared, x, topk_ids, topk_weights):
        return lambda: time.sleep(2e-4)  # a cost above the boundary's x write


class RepeatedStageBackend(TorchBF16Backend):
    name = "test-repeated-stage"

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        return [("gemm1", lambda: None), ("gemm1", lambda: None)]

    def routed_call(self, prepared, x, topk_ids, topk_weights):
        raise RuntimeError("no routed path today")


def test_a_split_backend_gets_per_stage_and_routed_times():
    """kernel_<stage>_us for the stages a backend names (the others NaN),
    routed_us with its % of copy over the case's bytes; a backend without a
    split gets none; a stage name outside SWEEP_STAGES leaves the case ok
    with the reason in its note."""
    from moebench.bench.sweep import STAGE_TIMING, SWEEP_STAGES

    names = {
        "test-staged": StagedBackend,
        "test-bad-stage": BadStageBackend,
        "test-repeated-stage": RepeatedStageBackend,
    }
    for name, cls in names.items():
        register_backend(name, cls)
    StagedBackend.calls = {}
    try:
        result = run_sweep(SweepConfig(backends=("torch-bf16", *names), **{**TINY, "rows": (3,)}))
    finally:
        for name in names:
            unregister_backend(name)
    by = {r["backend"]: r for r in result.frame.to_dict("records")}
    staged = by["test-staged"]
    assert staged["status"] == "ok" and staged["error"] == ""
    for stage in ("route", "gemm1", "finalize"):
        assert staged[f"kernel_{stage}_us"] > 0
    assert math.isnan(staged["kernel_gemm2_us"])
    assert staged["routed_us"] > 0
    pct = 100.0 * staged["bytes"] / (staged["routed_us"] * 1e-6) / 1e9 / result.manifest["copy_bw_gbps"]
    assert math.isclose(staged["routed_pct_copy_bw"], pct)
    # every timed call ran (warmup + replays, eager on the CPU); routed as often as a stage
    assert set(StagedBackend.calls) == {"route", "gemm1", "finalize", "routed"}
    assert len(set(StagedBackend.calls.values())) == 1 and StagedBackend.calls["route"] >= TINY["replays"]
    plain = by["torch-bf16"]
    assert all(math.isnan(plain[f"kernel_{s}_us"]) for s in SWEEP_STAGES) and math.isnan(plain["routed_us"])
    bad = by["test-bad-stage"]
    assert bad["status"] == "ok" and bad["median_us"] > 0
    assert "per-stage timing failed" in bad["error"] and "warp-drive" in bad["error"]
    assert bad["routed_us"] > 0  # the routed path is timed even though the stages failed
    rep = by["test-repeated-stage"]
    assert rep["status"] == "ok" and math.isnan(rep["kernel_gemm1_us"]) and math.isnan(rep["routed_us"])
    assert (
        "distinct names" in rep["error"] and "routed-path timing failed: RuntimeError: no routed path" in rep["error"]
    )
    assert result.manifest["stage_timing"] == STAGE_TIMING


def test_no_split_times_the_layer_call_only():
    """split=False (--no-split): a backend that splits its forward is timed
    as the layer call only: no stage or routed call runs, the columns stay
    NaN, the manifest says no stage timing; a non-bool split is refused."""
    from moebench.bench.sweep import SWEEP_STAGES

    register_backend("test-staged", StagedBackend)
    StagedBackend.calls = {}
    try:
        result = run_sweep(
            SweepConfig(backends=("test-staged",), split=False, **{**TINY, "rows": (3,), "replays": 30, "warmup": 5})
        )
    finally:
        unregister_backend("test-staged")
    row = result.frame.to_dict("records")[0]
    assert row["status"] == "ok" and row["median_us"] > 0 and row["error"] == ""
    assert all(math.isnan(row[f"kernel_{s}_us"]) for s in SWEEP_STAGES) and math.isnan(row["routed_us"])
    assert StagedBackend.calls == {}
    assert result.manifest["stage_timing"] is None and result.manifest["config"]["split"] is False
    # what the rows were timed with, not what was asked for (no CUDA graph on the CPU)
    assert result.manifest["config"]["use_graph"] is True
    assert result.manifest["timing_methods"] == [row["timing_method"]] and "graph" not in row["timing_method"]
    # and with what counts: eager timing caps what --replays / --warmup asked
    assert result.manifest["config"]["replays"] == 30 and result.manifest["config"]["warmup"] == 5
    assert result.manifest["timing_counts"] == {row["timing_method"]: {"warmup": 2, "replays": 20}}
    with pytest.raises(TypeError, match="split must be a bool"):
        SweepConfig(split="no")


@pytest.mark.gpu
def test_gpu_sweep_times_our_stages_and_routed_path():
    """dsv41-flash TP8 rows 6: the moebench row carries every stage and the
    routed path, each positive; the routed path (no finalize) is not slower
    than the layer call by more than noise and PDL effects, each GEMM is
    faster than the routed path."""
    from moebench.bench.sweep import SWEEP_STAGES

    cfg = SweepConfig(
        presets=("dsv41-flash",),
        tp=(8,),
        rows=(6,),
        scenarios=("correlated",),
        backends=("moebench",),
        tactics=("default", "fp8"),
        replays=20,
        warmup=3,
        device="cuda",
    )
    df = run_sweep(cfg).frame
    assert (df["status"] == "ok").all(), df["error"].tolist()
    for r in df.to_dict("records"):
        assert r["error"] == "", r["error"]
        for s in SWEEP_STAGES:  # ours: route, gemm1, gemm2, finalize; the peers' glue stages stay empty
            ours = s in ("route", "gemm1", "gemm2", "finalize")
            assert r[f"kernel_{s}_us"] > 0 if ours else math.isnan(r[f"kernel_{s}_us"]), (r["tactic"], s)
        assert r["routed_us"] < 1.05 * r["median_us"], r  # no finalize; PDL neighbours differ (sweep docstring)
        assert max(r["kernel_gemm1_us"], r["kernel_gemm2_us"]) < r["routed_us"], r
        assert 0 < r["routed_pct_copy_bw"] < 100


def test_all_tactics_of_a_backend_that_cannot_run_here_are_listed_and_skipped():
    """`--tactics all` with moebench on the CPU: one skipped row per tactic it
    offers (default, builtin, tuned, fp8, bf16), each with the reason."""
    cfg = SweepConfig(backends=("moebench",), tactics=("all",), **{**TINY, "rows": (1,)})
    df = run_sweep(cfg).frame
    assert set(df["tactic"]) >= {"default", "builtin", "fp8", "bf16"} and "all" not in set(df["tactic"])
    assert (df["status"] == "skipped").all() and df["error"].str.contains("CUDA").all()


def test_moebench_backend_says_which_kernel_tactics_a_row_ran():
    """The sweep's kernel_tactics column: each GEMM's tactic at the case's
    rows and whether the tuning table or a default chose it."""
    from types import SimpleNamespace

    from moebench.backends.moebench import MoebenchBackend
    from moebench.kernels.tactic import GemmTactic

    t1, t2 = GemmTactic(16, 4, 4, 4, 1, stages=6, fp8=True), GemmTactic(32, 4, 1, 3, 3, stages=6, fp8=True)
    prepared = SimpleNamespace(
        tactics={(1, 6): t1, (2, 6): t2},
        tactic_sources={(1, 6): "table /x/E=384.json fp8.gemm1[6]", (2, 6): "default (fp8)"},
    )
    text = MoebenchBackend().kernel_tactics(prepared, 6)
    assert text == "fp8 family; gemm1 r16_m4_k4_u4_c1_b6_f8 (table); gemm2 r32_m4_k1_u3_c3_b6_f8 (default (fp8))"
    assert "kernel_tactics" in COLUMNS


def test_the_rotation_does_not_depend_on_the_rows_in_the_sweep():
    """A case's replay rotates the same weight-set count alone or beside
    other row counts: the manifest's min_touched_bytes is the shape's."""
    touched = []
    for rows in ((3,), (1, 3)):
        result = run_sweep(SweepConfig(backends=("torch-bf16",), **{**TINY, "rows": rows}))
        (group,) = result.manifest["groups"]
        touched.append(group["min_touched_bytes"])
    assert touched[0] == touched[1] > 0


def test_forced_layers_error_names_layers_only_beyond_the_budget():
    """The sweep's and the step's check of a forced --layers against the memory
    budget: None when it fits or there is no budget (the CPU), else the sizes."""
    from moebench.bench.sweep import forced_layers_error

    assert forced_layers_error(4, 10**9, 4 * 10**9, 0.6) is None
    assert forced_layers_error(64, 10**9, None, 0.6) is None
    text = forced_layers_error(5, 10**9, 4 * 10**9, 0.6)
    assert text == (
        "layers (--layers) 5 need 5.0 GB of weights, more than the 4.0 GB budget (memory_fraction 0.6"
        " of the free device memory)"
    )


def test_one_pair_is_prepared_at_a_time_and_the_frame_keeps_case_order(monkeypatch):
    """Each (backend, tactic) pair's prepared copies are made, timed and
    released before the next pair's (so a pair's rotation does not depend on
    the backends beside it: a GPU sweep with torch-bf16 gave moebench 6
    weight sets instead of 9), while the rows keep the cases' order."""
    from moebench.bench import sweep

    events = []
    real_prepare, real_release = TorchBF16Backend.prepare, sweep.release

    def prepare(self, weights, shape, tactic="default"):
        events.append(f"prepare {tactic}")
        return real_prepare(self, weights, shape, tactic)

    def release(device):
        events.append("release")
        real_release(device)

    monkeypatch.setattr(TorchBF16Backend, "prepare", prepare)
    monkeypatch.setattr(sweep, "release", release)
    cfg = SweepConfig(backends=("torch-bf16",), tactics=("default", "gather"), layers=2,
                      **{k: v for k, v in TINY.items() if k != "rows"}, rows=(1, 2, 3))  # fmt: skip
    result = run_sweep(cfg)
    pairs = [e for e in events if e != "release"]
    assert pairs == ["prepare default"] * 2 + ["prepare gather"] * 2, events
    first_gather = events.index("prepare gather")
    assert "release" in events[:first_gather], events  # the default copies went before the gather ones came
    df = result.frame
    assert list(zip(df["rows"], df["tactic"])) == [(r, t) for r in (1, 2, 3) for t in ("default", "gather")]
    assert (df["status"] == "ok").all() and (df["layers"] == 2).all()
    (group,) = result.manifest["groups"]
    assert group["layers_per_backend"] == {"torch-bf16:default": 2, "torch-bf16:gather": 2}


def test_an_interrupted_sweep_keeps_the_cases_it_measured():
    """Ctrl-C (or SIGTERM, which the CLI maps to it) threw away every
    measured case; now the sweep returns them, the cases it did not reach
    are skipped with the reason, and the manifest says it was interrupted."""
    from moebench.bench.interrupt import INTERRUPTED

    def progress(done, total, case, status):
        if done == 2:
            raise KeyboardInterrupt

    cfg = SweepConfig(backends=("torch-bf16",), **{k: v for k, v in TINY.items() if k != "rows"}, rows=(1, 2, 3, 4))
    result = run_sweep(cfg, progress=progress)
    df = result.frame
    assert result.manifest["interrupted"] is True
    assert list(df["rows"]) == [1, 2, 3, 4] and list(df["status"]) == ["ok", "ok", "skipped", "skipped"]
    assert (df["error"].iloc[2:] == INTERRUPTED).all()
    assert "interrupted" not in run_sweep(cfg).manifest


class AliasedBackend(TorchBF16Backend):
    """ "default" names "grouped" whatever this torch has (the tactics as torch-bf16's with _grouped_mm)."""

    name = "test-aliased"

    def valid_tactics(self, shape):
        return ("default", "grouped", "gather")

    def default_alias(self, shape):
        return "grouped"


@pytest.mark.parametrize("listed, stored", [
    (("grouped", "gather"), ["default", "gather"]),
    (("default", "gather"), ["default", "gather"]),
    (("grouped", "default"), ["default"]),
    (("gather", "grouped", "default", "grouped"), ["gather", "default"]),
    (("all",), ["default", "gather"]),
    (("grouped", "all"), ["default", "gather"]),
])  # fmt: skip
def test_the_default_alias_is_stored_as_default_however_the_tactics_are_spelled(listed, stored):
    """`grouped,gather` stored "grouped" while `grouped,default` stored "default": the tactic "default"
    names is the same kernel, stored as "default" whether "default" is listed too or not."""
    from moebench.bench.cases import Case
    from moebench.bench.sweep import expand_all_tactics
    from moebench.models import get_preset

    cfg = get_preset("dsv4-flash", hidden=128, intermediate=64, experts=8, top_k=2)
    backends = {AliasedBackend.name: AliasedBackend()}
    cases = [Case(cfg, 1, 1, "uniform", AliasedBackend.name, tactic=t) for t in listed]
    assert [c.tactic for c in expand_all_tactics(cases, backends)] == stored


class SlowBackend(TorchBF16Backend):
    """A layer call of a known cost: 2 ms of sleep, returning torch-bf16's
    output of that layer (computed once per layer: the host's other work
    must not blur the cost), logging its calls."""

    name = "test-slow"
    events: list = []

    def forward(self, prepared, x, topk_ids, topk_weights):
        type(self).events.append("f")
        cached = prepared.__dict__.setdefault("cached", {})
        if x.shape[0] not in cached:
            cached[x.shape[0]] = super().forward(prepared, x, topk_ids, topk_weights)
        time.sleep(2e-3)
        return cached[x.shape[0]].clone()


def _slow_writes(monkeypatch, events):
    """sweep.layer_writes with a known 1 ms per write, logging them as w<layer>."""
    from moebench.bench import sweep

    real = sweep.layer_writes

    def writes(x, layers):
        def slow(write, layer):
            def call():
                events.append(f"w{layer}")
                time.sleep(1e-3)
                return write()

            return call

        return [slow(w, i) for i, w in enumerate(real(x, layers))]

    monkeypatch.setattr(sweep, "layer_writes", writes)


def test_layer_calls_are_timed_at_a_layer_boundary_with_the_writes_subtracted(monkeypatch):
    """By default each layer call's x is written just before it (w0 f w1 f
    ...), the writes are timed alone (x_write_us) and subtracted: a 2 ms
    call beside a 1 ms write reads ~2 ms, not 3. --back-to-back times the
    calls alone; the boundary column and the manifest say which."""
    register_backend("test-slow", SlowBackend)
    events = SlowBackend.events
    _slow_writes(monkeypatch, events)
    try:
        frames = {}
        for back in (False, True):
            events.clear()
            cfg = SweepConfig(backends=("test-slow",), layers=2, back_to_back=back, split=False,
                              **{**TINY, "rows": (3,), "replays": 10, "warmup": 1})  # fmt: skip
            result = run_sweep(cfg)
            frames[back] = (result, " ".join(events))
    finally:
        unregister_backend("test-slow")
    (boundary, events), (b2b, b2b_events) = frames[False], frames[True]
    row = boundary.frame.to_dict("records")[0]
    assert row["status"] == "ok", row["error"]
    assert row["boundary"] == "layer" and boundary.manifest["boundary"] == "layer"
    assert "x_write_us" in boundary.manifest["boundary_timing"]
    assert 1000 <= row["x_write_us"] < 1700, row["x_write_us"]
    assert 2000 <= row["median_us"] < 2800, row["median_us"]  # the 1 ms write is not in it
    assert row["p10_us"] <= row["median_us"] <= row["p90_us"]
    assert "w0 f w1 f w0 f w1 f" in events  # every timed call right after its own write
    assert "w0 w1 w0 w1" in events  # the writes timed alone
    other = b2b.frame.to_dict("records")[0]
    assert other["status"] == "ok" and other["boundary"] == "back-to-back"
    assert b2b.manifest["boundary"] == "back-to-back" and b2b.manifest["config"]["back_to_back"] is True
    assert math.isnan(other["x_write_us"]) and "w" not in b2b_events
    assert 2000 <= other["median_us"] < 2800, other["median_us"]


class SlowBackend2(SlowBackend):
    name = "test-slow-2"


def test_the_writes_are_measured_once_per_rows_for_every_backend(monkeypatch):
    """Two backends at rows 2 and 3: the writes are timed alone once per rows
    (not per case), every case of a rows subtracts that one value, and the
    manifest keeps each measurement (value, spread, replays)."""
    from moebench.bench import sweep

    measured = []
    real = sweep.measure_writes
    monkeypatch.setattr(
        sweep, "measure_writes", lambda config, x, *a: measured.append(x.shape[0]) or real(config, x, *a)
    )
    register_backend("test-slow", SlowBackend)
    register_backend("test-slow-2", SlowBackend2)
    try:
        cfg = SweepConfig(backends=("test-slow", "test-slow-2"), layers=2, split=False,
                          **{**TINY, "rows": (2, 3), "replays": 4, "warmup": 1})  # fmt: skip
        result = run_sweep(cfg)
    finally:
        unregister_backend("test-slow")
        unregister_backend("test-slow-2")
    frame = result.frame
    assert (frame["status"] == "ok").all(), frame["error"].tolist()
    assert sorted(measured) == [2, 3]
    writes = result.manifest["groups"][0]["x_writes"]
    assert set(writes) == {"2 eager", "3 eager"}  # the CPU times eagerly
    for rows in (2, 3):
        mine = frame[frame["rows"] == rows]
        assert mine["x_write_us"].nunique() == 1 and mine["x_write_us"].iloc[0] == writes[f"{rows} eager"]["us"]
        assert {"spread_us", "replays", "batches", "steady", "method"} <= set(writes[f"{rows} eager"])


def test_every_rows_writes_are_measured_before_any_backend_runs(monkeypatch):
    """The writes of rows 2 and 3 are both measured before the first
    backend prepares its weights (not lazily between backends' cases, where
    TP4's did not settle)."""
    from moebench.bench import sweep

    events = []
    real_writes, real_prepare = sweep.measure_writes, SlowBackend.prepare
    monkeypatch.setattr(
        sweep,
        "measure_writes",
        lambda config, x, *a: events.append(("writes", x.shape[0])) or real_writes(config, x, *a),
    )
    monkeypatch.setattr(
        SlowBackend, "prepare", lambda self, *a, **k: events.append(("prepare",)) or real_prepare(self, *a, **k)
    )
    register_backend("test-slow", SlowBackend)
    try:
        cfg = SweepConfig(backends=("test-slow",), layers=2, split=False,
                          **{**TINY, "rows": (3, 2), "replays": 4, "warmup": 1})  # fmt: skip
        result = run_sweep(cfg)
    finally:
        unregister_backend("test-slow")
    assert (result.frame["status"] == "ok").all(), result.frame["error"].tolist()
    first_prepare = events.index(("prepare",))
    assert events[:first_prepare] == [("writes", 2), ("writes", 3)], events


class StaleLayerBackend(TorchBF16Backend):
    """Computes every layer call with the first prepared layer's weights:
    right at the gate (layer 0), wrong for every later layer."""

    name = "test-stale-layer"

    def prepare(self, weights, shape, tactic="default"):
        prepared = super().prepare(weights, shape, tactic)
        self.first = getattr(self, "first", None) or prepared
        return prepared

    def forward(self, prepared, x, topk_ids, topk_weights):
        return super().forward(self.first, x, topk_ids, topk_weights)


def test_the_timed_calls_last_layer_is_gated_against_its_own_oracle():
    """After timing, the last layer's output of what was timed (one more
    replay; on the CPU one more eager run) is gated against that layer's own
    oracle: a backend that is right for layer 0 only fails, not timed; an
    honest one passes with its worst row error stored."""
    register_backend("test-stale-layer", StaleLayerBackend)
    try:
        cfg = SweepConfig(backends=("torch-bf16", "test-stale-layer"), layers=2,
                          **{**TINY, "rows": (3,)})  # fmt: skip
        df = run_sweep(cfg).frame
    finally:
        unregister_backend("test-stale-layer")
    by = {r["backend"]: r for r in df.to_dict("records")}
    ok = by["torch-bf16"]
    assert ok["status"] == "ok" and ok["layers"] == 2, ok["error"]
    assert 0 < ok["max_rel_err"] <= 1e-2 and ok["max_rel_err"] <= ok["max_row_rel_err"] <= 2e-2
    stale = by["test-stale-layer"]
    assert stale["status"] == "failed" and math.isnan(stale["median_us"])
    assert "the timed calls, layer 2 of 2" in stale["error"] and "bf16 oracle" in stale["error"], stale["error"]
    assert stale["max_rel_err"] > 0.1


class MiddleLayerBackend(TorchBF16Backend):
    """Wrong for the second of three layers only (it computes that layer with
    the first layer's weights): right at layer 0 and at the timed last layer."""

    name = "test-middle-layer"

    def prepare(self, weights, shape, tactic="default"):
        prepared = super().prepare(weights, shape, tactic)
        self.layers = [*getattr(self, "layers", []), prepared]
        return prepared

    def forward(self, prepared, x, topk_ids, topk_weights):
        wrong = len(self.layers) > 1 and prepared is self.layers[1]
        return super().forward(self.layers[0] if wrong else prepared, x, topk_ids, topk_weights)


def test_every_layer_of_the_rotation_is_gated():
    """Layers between the first and the timed last are gated once each
    (eagerly, against their own weight set's oracle): a backend wrong only
    at layer 2 of 3 fails, naming it."""
    register_backend("test-middle-layer", MiddleLayerBackend)
    try:
        cfg = SweepConfig(backends=("test-middle-layer",), layers=3, split=False, **{**TINY, "rows": (3,)})
        row = run_sweep(cfg).frame.to_dict("records")[0]
    finally:
        unregister_backend("test-middle-layer")
    assert row["status"] == "failed" and "layer 2 of 3" in row["error"], row["error"]
    assert row["max_rel_err"] > 0.1


def test_err_bf16_is_every_backends_error_against_the_bf16_oracle():
    """err_bf16 beside max_rel_err: the same number for a backend whose own
    oracle is BF16's (torch-bf16), another for one held to the MXFP8 oracle
    (reference): its MXFP8 x and H put it percent-level off BF16."""
    cfg = SweepConfig(backends=("torch-bf16", "reference"), layers=2, split=False, **{**TINY, "rows": (3,)})
    by = {r["backend"]: r for r in run_sweep(cfg).frame.to_dict("records")}
    torch_bf16, reference = by["torch-bf16"], by["reference"]
    assert torch_bf16["status"] == "ok" and reference["status"] == "ok", (torch_bf16["error"], reference["error"])
    assert torch_bf16["oracle"] == "bf16" and torch_bf16["err_bf16"] == torch_bf16["max_rel_err"]
    assert reference["oracle"] == "mxfp8" and reference["max_rel_err"] < 1e-2
    assert 3 * reference["max_rel_err"] < reference["err_bf16"] < 0.1, (reference["max_rel_err"], reference["err_bf16"])


class BadReadBackend(TorchBF16Backend):
    name = "test-bad-read"

    def read_bytes(self, shape, topk_ids):
        return -5


def test_read_bytes_columns():
    """read_bytes is what the backend reads in its own layout (Backend.read_bytes,
    else the normalized bytes), read_gbps the bandwidth over it; pct_copy_bw
    stays on the normalized bytes; a bad count falls back with a note. peer
    says whose backend it is."""
    from moebench.bench.cases import unique_bytes
    from moebench.routing import scenario_topk_ids

    register_backend("test-bad-read", BadReadBackend)
    try:
        result = run_sweep(SweepConfig(backends=("torch-bf16", "reference", "test-bad-read", "moebench"),
                                       **{**TINY, "rows": (3,)}))  # fmt: skip
    finally:
        unregister_backend("test-bad-read")
    by = {r["backend"]: r for r in result.frame.to_dict("records")}
    shape = SweepConfig(**TINY).config_for("dsv4-flash", reduced=True).shard(1)
    ids = scenario_topk_ids("uniform", 3, shape.top_k, shape.experts, 0)
    torch_row = by["torch-bf16"]
    assert torch_row["bytes"] == unique_bytes(shape, ids)
    assert torch_row["read_bytes"] == TorchBF16Backend().read_bytes(shape, ids) > torch_row["bytes"]
    assert math.isclose(torch_row["read_gbps"], torch_row["read_bytes"] / (torch_row["median_us"] * 1e-6) / 1e9)
    assert math.isclose(torch_row["gbps"], torch_row["bytes"] / (torch_row["median_us"] * 1e-6) / 1e9)
    assert by["reference"]["read_bytes"] == by["reference"]["bytes"]  # no layout of its own
    bad = by["test-bad-read"]
    assert bad["status"] == "ok" and bad["read_bytes"] == bad["bytes"] and "read_bytes returned -5" in bad["error"]
    skipped = by["moebench"]  # skipped on the CPU, its count stored all the same
    assert skipped["status"] == "skipped" and skipped["read_bytes"] == skipped["bytes"]
    assert math.isnan(skipped["read_gbps"])
    assert [by[n]["peer"] for n in ("torch-bf16", "reference", "moebench")] == [True, False, False]
    assert str(result.frame["peer"].dtype) == "boolean"


@pytest.mark.gpu
def test_gpu_boundary_back_to_back_and_the_timed_graphs_check():
    """On the H200: every backend at the default layer boundary with its
    writes subtracted, our kernels (route reading x after its wait) correct
    there and back to back; a backend right for layer 0 only fails the timed
    graph's check."""
    register_backend("test-stale-layer", StaleLayerBackend)
    try:
        base = dict(presets=("dsv41-flash",), tp=(4,), rows=(1, 4), scenarios=("correlated",), replays=30,
                    warmup=3, device="cuda", split=True)  # fmt: skip
        at_layer = run_sweep(SweepConfig(backends=("moebench", "torch-bf16"), tactics=("default", "fp8"),
                                         **base)).frame  # fmt: skip
        b2b = run_sweep(SweepConfig(backends=("moebench",), tactics=("default", "fp8"), back_to_back=True,
                                    **base)).frame  # fmt: skip
        stale = run_sweep(SweepConfig(backends=("test-stale-layer",), layers=2,
                                      **{**TINY, "device": "cuda", "rows": (3,)})).frame  # fmt: skip
    finally:
        unregister_backend("test-stale-layer")
    skipped = at_layer[at_layer["status"] == "skipped"]  # torch-bf16 offers no "fp8"
    assert set(zip(skipped["backend"], skipped["tactic"])) <= {("torch-bf16", "fp8")}, skipped["error"].tolist()
    at_layer = at_layer[at_layer["status"] != "skipped"]
    for df, boundary in ((at_layer, "layer"), (b2b, "back-to-back")):
        ok = df[df["status"] == "ok"]
        assert len(ok) == len(df), df[["backend", "tactic", "rows", "error"]].to_dict("records")
        assert (df["boundary"] == boundary).all() and (df["timing_method"] == "cuda-graph").all()
        assert (df["max_row_rel_err"] <= 2e-2).all()
    assert (at_layer["x_write_us"] > 0).all() and b2b["x_write_us"].isna().all()
    # one write measurement per rows for every backend; every backend's error against BF16's oracle
    assert (at_layer.groupby("rows")["x_write_us"].nunique() == 1).all(), at_layer[["rows", "x_write_us"]]
    assert (at_layer["err_bf16"] > 0).all() and (at_layer["err_bf16"] < 0.1).all()
    ours = at_layer[at_layer["backend"] == "moebench"]
    assert (ours["kernel_route_us"] > 0).all() and (ours["routed_us"] > 0).all()
    row = stale.to_dict("records")[0]
    assert row["status"] == "failed" and "the timed graph, layer 2 of 2" in row["error"], row["error"]
