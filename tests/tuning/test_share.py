"""A tune's share per rank and rank 0's gathering (moebench/tuning/share.py),
pure: torchrun itself is test_tune_torchrun.py."""

import pytest

from moebench.bench.interrupt import INTERRUPTED
from moebench.bench.merge import RankReport
from moebench.tuning.plan import TunePlan
from moebench.tuning.share import merge_tune, share_of, tune_job, tune_share


def test_share_of_deals_the_configs_round_robin():
    assert share_of(5, 2) == [[0, 2, 4], [1, 3]]
    assert share_of(1, 3) == [[0], [], []]
    with pytest.raises(ValueError, match="world"):
        share_of(3, 0)


def _delivered(rank, indices, configs, end="done"):
    rows = [{"index": i, "config": configs[i], "outcome": f"outcome {i}"} for i in indices]
    return RankReport(rank, {"host": "h", "gpu_index": rank}, [{"rows": [r], "info": {}} for r in rows],
                      {"status": end} if end else None)  # fmt: skip


def test_merge_tune_gathers_in_plan_order_and_names_what_was_not_delivered():
    plan = TunePlan(("dsv41-flash", "dsv4-pro"), (2, 4), {"layers": 2})
    job = tune_job(plan)
    assert (job.kind, job.run, job.merge) == ("tune", tune_share, merge_tune)  # what the launcher runs
    configs = plan.configs()  # flash TP2, flash TP4, pro TP2, pro TP4: ranks 0, 1, 2, 0
    reports = [_delivered(0, [0, 3], configs), _delivered(1, [], configs, end=None),
               _delivered(2, [2], configs, end="interrupted")]  # fmt: skip
    reports[1].failure = "killed by signal SIGKILL"
    gathered = merge_tune(job, reports)
    assert [(c.preset, c.tp, o) for c, o in gathered.done] == [
        ("dsv41-flash", (2,), "outcome 0"), ("dsv4-pro", (2,), "outcome 2"), ("dsv4-pro", (4,), "outcome 3")]  # fmt: skip
    assert gathered.problems == ["not tuned: dsv41-flash TP4 BF16: rank 1 (h, GPU 1) died: killed by signal SIGKILL"]
    reports[2].pieces = []
    assert merge_tune(job, reports).problems[1] == f"not tuned: dsv4-pro TP2 BF16: {INTERRUPTED}"


def test_ranks_of_one_host_share_its_cores_for_compiling(monkeypatch):
    from moebench.tuning import precompile

    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert [precompile.default_jobs(n) for n in (1, 8, 64)] == [127, 15, 0]
    with pytest.raises(ValueError, match="ranks"):
        precompile.default_jobs(0)
