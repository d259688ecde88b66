"""The plan of a sweep / step / tune from its options (moebench/bench/plan.py)."""

from pathlib import Path

import pytest

from moebench.bench.plan import (
    check_geometry, cpu_runnable, option_message, parse_int_list, presets_to_run, reduced_presets,
)  # fmt: skip

NO_SIZES = {"hidden": None, "intermediate": None, "experts": None, "top_k": None}


def test_parse_int_list():
    assert parse_int_list("1-8", "--rows", 1, 8) == tuple(range(1, 9))
    assert parse_int_list("4,1,2,2", "--rows", 1, 8) == (1, 2, 4)
    assert parse_int_list("1-2,6", "--rows", 1, 8) == (1, 2, 6)
    for bad in ("", "0", "3-1", "x", "1,,2", "-1"):
        with pytest.raises(ValueError, match="--rows"):
            parse_int_list(bad, "--rows", 1, 8)
    with pytest.raises(ValueError, match=r"--rows: '8-1' is a descending range; write '1-8'"):
        parse_int_list("8-1", "--rows", 1, 8)
    with pytest.raises(ValueError, match=r"--rows: \[0\] outside \[1, 8\]"):
        parse_int_list("0", "--rows", 1, 8)
    # refused before the range is built: this one used to end in a MemoryError
    with pytest.raises(ValueError, match=r"--rows: \[10000000000\] outside \[1, 8\]"):
        parse_int_list("1-10000000000", "--rows", 1, 8)


def test_option_message_names_the_option_of_a_config_field():
    assert option_message(ValueError("replays must be an int >= 1, got 0")) == "--replays must be an int >= 1, got 0"
    assert option_message(ValueError("top_k must be <= 8")) == "--top-k must be <= 8"
    assert option_message(ValueError("trace x.npz: no topk_ids")) == "--trace x.npz: no topk_ids"
    assert option_message(ValueError("preset must be known")) == "preset must be known"  # not an option's field


def test_cpu_note_names_overrides_and_warns_of_a_large_layer():
    _, note = reduced_presets(("dsv41-flash",), {}, "reference")
    assert "at the reduced geometry (H=" in note and "large layer" not in note
    _, note = reduced_presets(("dsv41-flash",), {"hidden": 131072}, "reference")
    assert "with your size overrides (H=131072" in note and "a large layer for a CPU run (1.7 GB" in note


def test_reduced_presets_drop_a_repeated_layer_and_keep_unknown_names():
    from moebench.models import PRESETS

    names = tuple(PRESETS)
    kept, note = reduced_presets((*names, "nope"), {}, "reference")
    assert kept[0] == names[0] and kept[-1] == "nope" and len(kept) <= len(names) + 1
    for name in set(names) - set(kept):
        assert f"{name} (same layer as " in note


def test_check_geometry_names_the_option():
    with pytest.raises(ValueError, match="^--experts 2 is below dsv41-flash's top_k"):
        check_geometry(("dsv41-flash",), {**NO_SIZES, "experts": 2}, reduced=False)
    with pytest.raises(ValueError, match="^--top-k 8 exceeds --experts 4; expected --top-k <= 4"):
        check_geometry(("dsv41-flash",), {**NO_SIZES, "experts": 4, "top_k": 8}, reduced=False)
    check_geometry(("dsv41-flash", "unknown"), NO_SIZES, reduced=True)  # an unknown preset is the config's to name


def test_presets_to_run_on_a_gpu_and_on_the_cpu():
    from moebench.models import PRESETS

    assert presets_to_run("all", NO_SIZES, False, None) == (tuple(PRESETS), None)
    assert presets_to_run("dsv41-flash", NO_SIZES, False, ["moebench"]) == (("dsv41-flash",), None)
    kept, note = presets_to_run("dsv41-flash", NO_SIZES, True, None)
    assert kept == ("dsv41-flash",) and note.startswith("No GPU: running reference, torch-bf16 on the CPU")
    with pytest.raises(ValueError, match="--preset: empty item"):
        presets_to_run("a,,b", NO_SIZES, True, None)


def test_cpu_runnable_keeps_unknown_names_and_drops_gpu_only_backends():
    assert cpu_runnable(["reference", "no-such-backend"]) == ["reference", "no-such-backend"]
    assert "moebench" not in cpu_runnable(["moebench"])


def _sweep_options(**kw):
    opts = dict(preset="dsv41-flash", hidden=None, intermediate=None, experts=None, top_k=None, rows=None, tp=None,
                backends="default", scenario="correlated", tactics="default", seed=0, warm_l2=False, layers=None,
                replays=100, warmup=10, graph=True, split=True, back_to_back=False, device="cpu", devices=None,
                worker_timeout=None, trace=None, label="sweep", out=Path("reports/runs"))  # fmt: skip
    return {**opts, **kw}


def test_sweep_plan_on_the_cpu_takes_the_smaller_grid_and_says_what_runs():
    from moebench.bench.plan import sweep_plan

    plan = sweep_plan(**_sweep_options())
    assert plan.config.reduced and plan.config.rows == (1, 4, 8) and plan.config.tp == (1, 8)
    assert plan.gpus is None and plan.backends is None and plan.note.startswith("No GPU: running")
    plan = sweep_plan(**_sweep_options(rows="2", tp="1", backends="reference"))
    assert plan.config.rows == (2,) and plan.config.tp == (1,) and plan.config.backends == ("reference",)


def test_sweep_plan_names_the_bad_option(tmp_path):
    from moebench.bench.plan import sweep_plan

    (tmp_path / "f").write_text("x")
    for kw, message in (({"label": "bad label"}, "label"), ({"device": "cpu", "devices": "0"}, "--device and --devices"),
                        ({"worker_timeout": 5.0}, "--worker-timeout"), ({"rows": "9"}, "--rows"),
                        ({"out": tmp_path / "f"}, "--out: .* exists and is not a directory")):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=message):
            sweep_plan(**_sweep_options(**kw))


def _step_options(**kw):
    opts = _sweep_options(label="step", tp=1, one_rank=False, overlap_shared=True, timeout=None)
    for k in ("back_to_back", "worker_timeout"):
        opts.pop(k)
    return {**opts, **kw}


def test_step_plan_one_rank_and_cpu_ranks():
    from moebench.bench.plan import step_plan

    plan = step_plan(**_step_options())
    assert plan.where == "one rank on cpu" and plan.config.ranks == 1 and plan.note.startswith("No GPU")
    plan = step_plan(**_step_options(tp=2, rows="1"))
    assert plan.where == "2 ranks on the CPU (gloo)" and plan.config.ranks == 2
    assert step_plan(**_step_options(tp=2, one_rank=True)).config.ranks == 1


def test_step_plan_names_the_bad_option():
    from moebench.bench.plan import step_plan

    for kw, message in (({"tp": 0}, "--tp: expected a TP degree"), ({"devices": "0"}, "--devices: only for several"),
                        ({"tp": 2, "devices": "0,1"}, "--devices: the ranks run on the CPU"),
                        ({"timeout": 5.0}, "--timeout: needs --tp N > 1"),
                        ({"tp": 2, "timeout": -1.0}, "--timeout must be a positive")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            step_plan(**_step_options(**kw))
