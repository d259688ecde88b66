"""The plan of `moebench tune` (moebench/tuning/plan.py): options checked
on any machine, one TuneConfig per (preset, TP degree)."""

import pytest

from moebench.tuning.plan import tune_plan


def _options(**kw):
    opts = dict(preset="dsv41-flash", hidden=None, intermediate=None, experts=None, top_k=None, tp="4", rows="1-8",
                stages="1,2", space="quick", scenario="correlated", repeats=3, top=3, replays=50, warmup=10,
                layers=None, warm_l2=False, act_bf16=True, fp8=False, distinct_layers=False, seed=0, budget=None,
                jobs=None, summary=None, device=None)  # fmt: skip
    return {**opts, **kw}


def test_one_config_per_preset_and_tp():
    from moebench.tuning.space import FP8_SPACES, SPACES

    plan = tune_plan(**_options(preset="dsv41-flash,dsv4-pro", tp="1,4", rows="1,4", stages="2"))
    configs = plan.configs()
    assert [(c.preset, c.tp) for c in configs] == [("dsv41-flash", (1,)), ("dsv41-flash", (4,)),
                                                   ("dsv4-pro", (1,)), ("dsv4-pro", (4,))]  # fmt: skip
    assert all(c.rows == (1, 4) and c.stages == (2,) and c.copy_layers and c.act_bf16 for c in configs)
    assert configs[0].space == SPACES["quick"]
    fp8 = tune_plan(**_options(fp8=True, distinct_layers=True)).configs()[0]
    assert fp8.fp8 and not fp8.act_bf16 and not fp8.copy_layers and fp8.space == FP8_SPACES["quick"]


def test_bad_options_are_named(tmp_path):
    for kw, message in (({"space": "huge"}, "--space: expected one of"), ({"scenario": "replay"}, "--scenario"),
                        ({"tp": "0"}, "--tp"), ({"rows": "9"}, "--rows"), ({"stages": "3"}, "--stages"),
                        ({"top": 1}, "--top must be >= 2"), ({"warmup": -1}, "--warmup must be >= 0"),
                        ({"budget": 0.0}, "--budget must be a positive"), ({"jobs": -1}, "--jobs must be >= 0"),
                        ({"summary": tmp_path}, "--summary: .* is a directory"),
                        # its records go to the .json beside it: they overwrote the markdown
                        ({"summary": tmp_path / "gains.json"}, "--summary: .*gains.json ends in .json"),
                        ({"experts": 2}, "--experts 2 is below")):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=message):
            tune_plan(**_options(**kw))


def test_a_device_index_is_refused_under_torchrun(monkeypatch):
    assert tune_plan(**_options(device="cuda:1")).settings["device"] == "cuda:1"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tune_plan(**_options(device="cuda")).settings["device"] == "cuda"
    with pytest.raises(ValueError, match="--device: under torchrun each rank tunes on its LOCAL_RANK's GPU"):
        tune_plan(**_options(device="cuda:1"))


def test_stages_take_fused_with_fp8_and_default_to_it():
    from moebench.kernels.table import LAYER

    def stages(**kw):
        return tune_plan(**_options(**kw)).configs()[0].stages

    assert stages(stages=None) == (1, 2) and stages(stages=None, fp8=True) == (1, 2, LAYER)
    assert stages(stages="fused", fp8=True) == (LAYER,) and stages(stages="fused,2", fp8=True) == (2, LAYER)
    assert stages(stages="1,2", fp8=True) == (1, 2)  # the pair's tactics alone, no layer choice
    for kw, message in (({"stages": "fused"}, "'fused' .* needs --fp8"),
                        ({"stages": "fused,fused", "fp8": True}, "'fused' given twice"),
                        ({"stages": "3", "fp8": True}, r"--stages: cannot parse '3' in '3'; expected 1, 2 and, with --fp8"),
                        ({"stages": "1,fast", "fp8": True}, "--stages: cannot parse 'fast'"),
                        ({"stages": "fused,", "fp8": True}, "--stages: cannot parse ''"),
                        ({"stages": "1,1"}, "'1' given twice")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            tune_plan(**_options(**kw))


def test_tune_config_checks_its_stages():
    from moebench.kernels.table import LAYER
    from moebench.tuning.runner import TuneConfig

    assert TuneConfig(stages=(2, 1)).stages == (1, 2) and TuneConfig().stages == (1, 2)
    assert TuneConfig(fp8=True).stages == (1, 2, LAYER) and TuneConfig(fp8=True, stages=(LAYER,)).stages == (LAYER,)
    for bad in ((), (1, 1), (0,), (True,), [1, 2], (4,)):
        with pytest.raises(ValueError, match="stages must be distinct stages"):
            TuneConfig(stages=bad)
    with pytest.raises(ValueError, match="needs fp8"):
        TuneConfig(stages=(1, LAYER))


def test_a_plan_writing_to_a_directory_takes_the_pair_from_it_first(tmp_path):
    from moebench.kernels.table import default_search_dirs

    plan = tune_plan(**_options(fp8=True))
    assert plan.configs()[0].pair_tables is None  # the runtime's search path
    rest = tuple(str(d) for d in default_search_dirs())
    assert plan.writing_to(tmp_path).configs()[0].pair_tables == (str(tmp_path), *rest)
    assert plan.writing_to(tmp_path / "new").configs()[0].pair_tables == rest  # nothing there yet
