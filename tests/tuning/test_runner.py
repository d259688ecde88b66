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
