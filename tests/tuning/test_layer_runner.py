"""`moebench tune --fp8`'s layer step on the GPU: the pair and every fused
candidate checked against the oracle and timed on one rotation; a fused
launch that writes nothing is rejected. (Its plumbing on the CPU, with
stand-in kernels, is in test_runner.py.)"""

import pytest

from moebench.kernels.fused_tactic import LayerChoice
from moebench.models import get_preset


@pytest.mark.gpu
def test_layer_runner_checks_and_times_the_pair_and_every_fused_candidate(monkeypatch):
    from moebench.kernels import fused
    from moebench.kernels.table import LAYER
    from moebench.tuning.layer_runner import LayerRunner
    from moebench.tuning.runner import TuneConfig, require_tuning_device, run_tune

    shape = get_preset("dsv41-flash", experts=64).shard(8)
    dev = require_tuning_device()
    run = LayerRunner(shape, dev, layers=2, replays=5, warmup=1)
    for rows in (1, 6):
        cands = run.valid_tactics(rows)
        assert cands[0] == run.default(rows) == LayerChoice(None) and len(cands) >= 3
        for choice in cands:  # every fused kernel meets the oracle; the tuner refuses it beside a two-plane pair
            assert run.oracle_mismatch(choice, rows) is None, choice.name
            assert (run.check(choice, rows) is None) == (choice.fused is None or run.pair(rows)[0].planes == 1)
        assert run.time(cands[0], rows).median_us > 0 and run.time(cands[1], rows).median_us > 0
    with monkeypatch.context() as m:  # a fused launch that writes nothing: its poisoned H and rows stay
        m.setattr(fused, "fused_layer", lambda *a, **k: None)
        assert run.oracle_mismatch(run.valid_tactics(1)[1], 1).startswith("H: ")
    # run_tune's layer step alone: the pair's tactics are the runtime's, the entries its fp8.fused
    cfg = TuneConfig(preset="dsv41-flash", experts=64, tp=(8,), rows=(1, 6), stages=(LAYER,), repeats=1, top=2,
                     replays=5, warmup=1, layers=2, fp8=True)  # fmt: skip
    (table,) = run_tune(cfg).tables
    assert set(table.fused_entries) == {1, 6} and not table.fp8_entries and not table.entries
    assert all(e.candidates == len(run.valid_tactics(r)) for r, e in table.fused_entries.items())
