import os

import pandas as pd
import pytest

from moebench.bench.cases import SweepConfig, expand_cases
from moebench.bench.shard import (
    MULTICAST_OFF, expected_cost, launch_workers, merge_results, parse_devices, plan_shards,
    run_sharded_sweep, shard_configs, worker_env,
)  # fmt: skip
from moebench.bench.sweep import COLUMNS
from moebench.reports.store import read_run


def _grid(**over):
    kw = dict(presets=("dsv41-flash", "dsv4-flash", "dsv4-pro"), tp=(1, 2, 4, 8), rows=tuple(range(1, 9)),
              scenarios=("uniform", "correlated"), backends=("a", "b"), device="cpu")  # fmt: skip
    kw.update(over)
    cfg = SweepConfig(**kw)
    return cfg, expand_cases(cfg, cfg.backends, reduced=False)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_plan_every_case_once_balanced_deterministic(n):
    _, cases = _grid()
    shards = plan_shards(cases, n)
    assert len(shards) == n
    flat = [c for s in shards for c in s]
    assert sorted(map(cases.index, flat)) == list(range(len(cases)))
    loads = [sum(map(expected_cost, s)) for s in shards]
    total = sum(loads)
    assert max(loads) <= 1.15 * total / n
    assert plan_shards(cases, n) == shards
    assert plan_shards(list(cases), list(range(n))) == shards
    for s in shards:  # input order kept
        assert [cases.index(c) for c in s] == sorted(cases.index(c) for c in s)


def test_plan_keeps_groups_together_when_possible():
    _, cases = _grid()
    shards = plan_shards(cases, 4)  # 12 groups on 4 devices: none needs cutting
    homes = {}
    for d, s in enumerate(shards):
        for c in s:
            homes.setdefault((c.config, c.tp), set()).add(d)
    assert all(len(v) == 1 for v in homes.values())


def test_plan_cuts_a_big_group_at_rows_and_configs_cover_it():
    cfg, cases = _grid(presets=("dsv4-pro",), tp=(1,))
    shards = plan_shards(cases, 4)
    assert all(shards)
    for s in shards:
        configs = shard_configs(cfg, s)
        got = [c for sc in configs for c in expand_cases(sc, sc.backends, reduced=False)]
        assert sorted(map(cases.index, got)) == sorted(map(cases.index, s))
    with pytest.raises(ValueError):
        plan_shards(cases, 0)
    with pytest.raises(ValueError):
        plan_shards(cases + cases[:1], 2)


def test_plan_balance_bound_random_costs():
    import random

    _, cases = _grid()
    rng = random.Random(0)
    cost = {c: rng.uniform(1, 100) for c in cases}
    for n in (2, 3, 5, 8):
        shards = plan_shards(cases, n, cost=cost.__getitem__)
        loads = [sum(cost[c] for c in s) for s in shards]
        # LPT bound: the most loaded device has at most share + the largest piece (<= share / 2 + one rows unit).
        assert max(loads) <= sum(loads) / n * 1.6
        assert sum(len(s) for s in shards) == len(cases)


def test_parse_devices():
    assert parse_devices("all", 4) == [0, 1, 2, 3]
    assert parse_devices("0,2", 4) == [0, 2]
    for bad in ("", "0,0", "5", "x", "all"):
        with pytest.raises(ValueError):
            parse_devices(bad, 4 if bad != "all" else 0)


def test_worker_env_torchrun_and_multicast_off():
    env = worker_env(1, 4, master_port=1234, gpu_index=6, base={"NCCL_NVLS_ENABLE": "1", "KEEP": "x"})
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["MOEBENCH_GPU_INDEX"] == "6" and env["KEEP"] == "x"
    for k, v in MULTICAST_OFF.items():
        assert env[k] == v
    with pytest.raises(ValueError):
        worker_env(4, 4)


# ----------------------------------------------------------------- fake workers


def fake_runner(cases, device):
    """Per-case stand-in for run_sweep: one ok row per case; backend 'die'
    kills the process (no cleanup, like a segfault / OOM kill)."""
    rows = []
    for c in cases:
        if c.backend == "die" and c.rows == 2:
            os._exit(7)
        if c.backend == "raise" and c.rows == 1 and c.tp == 2:
            raise RuntimeError("boom in worker")
        shape = c.shape
        row = dict.fromkeys(COLUMNS)
        row.update(preset=c.config.name, hidden=shape.hidden, intermediate=shape.intermediate,
                   padded_intermediate=shape.padded_intermediate, experts=shape.experts, top_k=shape.top_k,
                   tp=c.tp, rows=c.rows, scenario=c.scenario, backend=c.backend, tactic=c.tactic,
                   status="ok", error="", median_us=1.0, device=device, seed=c.seed,
                   env_rank=os.environ["RANK"], env_nvls=os.environ["NCCL_NVLS_ENABLE"])  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


FAKE_ENV = dict(os.environ, MOEBENCH_FAKE_GPU="1")


def test_launch_and_merge_fake_workers(tmp_path):
    cfg, cases = _grid(presets=("dsv4-flash",), tp=(1, 2), rows=(1, 2, 3), scenarios=("uniform",))
    shards = plan_shards(cases, 2)
    res = launch_workers(shards, [3, 5], fake_runner, tmp_path / "s", timeout_s=120, base_env=FAKE_ENV)
    assert not res.failures
    df = merge_results(res.frames, res.failures)
    assert len(df) == len(cases) and (df.status == "ok").all()
    assert set(df.gpu_index) == {3, 5}
    assert set(df.gpu_serial) == {"fake-3", "fake-5"}
    assert set(df.env_nvls) == {"0"}
    assert set(df.env_rank) == {"0", "1"}
    key = ["preset", "tp", "rows", "scenario", "backend", "tactic"]
    assert not df.duplicated(key).any()


def test_dead_worker_marked_failed_rest_completes(tmp_path):
    cfg, cases = _grid(presets=("dsv4-flash",), tp=(1, 2), rows=(1, 2, 3), scenarios=("uniform",),
                       backends=("a", "die", "raise"))  # fmt: skip
    # Put every tp=2 case on the dying worker, the tp=1 ones on a healthy worker.
    healthy = [c for c in cases if c.tp == 1 and c.backend == "a"]
    dying = [c for c in cases if c not in healthy]
    res = launch_workers([healthy, dying], [0, 1], fake_runner, tmp_path / "s", timeout_s=120, base_env=FAKE_ENV)
    assert len(res.failures) == 1 and res.failures[0].gpu_index == 1
    assert "exit code 7" in res.failures[0].error or "boom" in res.failures[0].error
    df = merge_results(res.frames, res.failures)
    assert len(df) == len(cases)
    assert (df[df.gpu_index == 0].status == "ok").all()
    failed = df[df.status == "failed"]
    assert len(failed) >= 1 and (failed.gpu_index == 1).all()
    assert failed.error.str.contains("worker 1 \\(GPU 1\\)").all()


def test_run_sharded_sweep_writes_complete_store(tmp_path):
    cfg = SweepConfig(presets=("dsv4-flash",), tp=(1, 2), rows=(1, 2), scenarios=("uniform",),
                      backends=("a", "raise"), device="cpu")  # fmt: skip
    os.environ["MOEBENCH_FAKE_GPU"] = "1"
    try:
        run = run_sharded_sweep(cfg, [0, 1], cfg.backends, tmp_path / "runs", "shard-test",
                                timeout_s=120, runner=fake_runner)  # fmt: skip
    finally:
        del os.environ["MOEBENCH_FAKE_GPU"]
    df, manifest = read_run(run)
    assert len(df) == 8
    assert {"gpu_index", "gpu_serial"} <= set(df.columns)
    assert (df.status == "failed").any() and (df.status == "ok").any()
    assert sum(w["error"] is not None for w in manifest["workers"]) >= 1
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]
