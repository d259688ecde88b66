"""The GPU runner of `moebench tune`: the H check on the CPU; the runner
itself on an sm_90 GPU."""

import pytest
import torch

from moebench.models import get_preset
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
def test_runner_checks_times_and_tunes_a_small_shape():
    from moebench.tuning.runner import GemmStageRunner, run_tune
    from moebench.tuning.space import TacticSpace

    shape = get_preset("dsv41-flash", experts=64).shard(8)
    dev = require_tuning_device()
    space = TacticSpace(tile_rows=(32, 64), warps=((1, 8), (4, 2)), unroll=(2,), ctas_per_sm=(2,),
                        persistent=(True,))  # fmt: skip
    for stage in (1, 2):
        run = GemmStageRunner(shape, stage, dev, layers=2, replays=5, warmup=1, space=space)
        tactics = run.valid_tactics(6)
        assert tactics[0] == run.default(6)
        for t in tactics:
            assert run.check(t, 6) is None, t.name
        timing = run.time(tactics[0], 6)
        assert timing.method == "cuda-graph" and timing.median_us > 0
    cfg = TuneConfig(preset="dsv41-flash", experts=64, tp=(8,), rows=(1, 6), space=space, repeats=1, top=2,
                     replays=5, warmup=1, layers=2)  # fmt: skip
    outcome = run_tune(cfg)
    (table,) = outcome.tables
    assert set(table.entries) == {(1, 1), (1, 6), (2, 1), (2, 6)}
    e = table.entry(2, 6)
    assert e.provenance["device"] == torch.cuda.get_device_name(0) and e.provenance["timing"]["layers"] == 2


def test_run_tune_flow_on_the_cpu_with_stand_in_kernels(monkeypatch):
    """The runner's plumbing (routing, oracle, poisoned buffers, checks,
    timing, tuner, table) with stand-in GEMMs that copy the oracle's output;
    tactics with unroll 4 corrupt it and must never be picked."""
    import types

    from moebench.tuning import runner as rn
    from moebench.tuning.space import TacticSpace

    def gemm1(kw, x_q, x_s, record, ctas, h_q, h_s, *, tactic):
        case = next(c for c in live if c["route"].record is record)
        h_q.copy_(case["ref_q"])
        h_s.copy_(case["ref_s"])
        if tactic.unroll == 4:
            h_q[: case["used"], :8] ^= 0x0F

    def gemm2(kw, h_q, h_s, record, ctas, out, *, tactic):
        case = next(c for c in live if c["route"].record is record)
        out.copy_(case["oracle"].to(out.dtype))
        if tactic.unroll == 4:
            out[: case["used"]] *= 1.5

    live = []
    original = rn.GemmStageRunner._case

    def tracking_case(self, rows):
        case = original(self, rows)
        if all(case is not c for c in live):
            live.append(case)
        return case

    monkeypatch.setitem(__import__("sys").modules, "moebench.kernels.gemm",
                        types.SimpleNamespace(gemm1=gemm1, gemm2=gemm2))  # fmt: skip
    monkeypatch.setattr(rn.GemmStageRunner, "_case", tracking_case)
    monkeypatch.setattr(rn, "require_tuning_device", lambda device=None: torch.device("cpu"))
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
        assert any(name.endswith("_u4_c2") for name in res.rejected)
    assert table.shape.intermediate == 128 and table.file_name.startswith("E=8,H=256,I=128,top_k=6,")
