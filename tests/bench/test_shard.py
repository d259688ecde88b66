"""The plan of a sweep over ranks (moebench/bench/shard.py); the GPU test of
`sweep --devices` against one-GPU sweeps. The launch itself: test_launch.py."""

import pandas as pd
import pytest

from moebench.bench.cases import SweepConfig, expand_cases
from moebench.bench.shard import expected_cost, parse_devices, pieces_of, plan_shards, shard_configs
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


def test_parse_devices_names_a_malformed_list_without_a_gpu_too():
    """On a CPU machine `--devices x` said "'x' but no GPU is visible", not what --devices takes."""
    with pytest.raises(ValueError, match=r"expected 'all' or e.g. 0,1, got 'x'"):
        parse_devices("x", 0)
    with pytest.raises(ValueError, match="duplicates"):
        parse_devices("0,0", 0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        parse_devices("0,1", 0)


def test_pieces_of_a_shard_are_its_weight_groups_in_order():
    _, cases = _grid(presets=("dsv4-flash",), tp=(1, 2), rows=(1, 2), scenarios=("uniform",))
    pieces = pieces_of(cases)
    assert [p[0].tp for p in pieces] == [1, 2] and [c for p in pieces for c in p] == cases


#: The reduced sweep both GPU tests run (a grid option added per test).
_GPU_SWEEP = ["--preset", "dsv4-flash", "--rows", "1,6", "--scenario", "correlated", "--backends",
              "moebench,torch-bf16", "--layers", "2", "--replays", "10", "--warmup", "2"]  # fmt: skip


def _sweep(tmp_path, name: str, *args: str) -> None:
    """`moebench sweep` of `_GPU_SWEEP` and `args` stored under tmp_path/name (exit 0 asserted)."""
    from typer.testing import CliRunner

    from moebench.cli import app

    result = CliRunner().invoke(app, ["sweep", *_GPU_SWEEP, *args, "--out", str(tmp_path / name)])
    assert result.exit_code == 0, result.output


def _assert_same_cases(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """The same cases, statuses, shapes, touched experts, bytes and layers, and
    oracle errors within 1e-3, whatever the row order."""
    key = ["preset", "tp", "rows", "scenario", "backend", "tactic"]
    facts = [*key, "status", "hidden", "intermediate", "experts", "top_k", "unique_experts", "bytes", "layers"]
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a[facts], b[facts], check_dtype=False)
    assert a["max_rel_err"].to_numpy() == pytest.approx(b["max_rel_err"].to_numpy(), rel=1e-3, abs=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_gpu_sweep_equals_the_union_of_two_one_gpu_sweeps(tmp_path):
    """The same grid as one sweep over GPUs 0 and 1 and as two one-GPU sweeps
    (TP4 cases, then TP8 cases): the same cases, statuses, shapes, touched
    experts, bytes and oracle errors."""
    _sweep(tmp_path, "a", "--tp", "4,8", "--devices", "0,1")
    _sweep(tmp_path, "b", "--tp", "4", "--device", "cuda:0")
    _sweep(tmp_path, "c", "--tp", "8", "--device", "cuda:0")
    sharded, manifest = read_run(next((tmp_path / "a").iterdir()))
    union = pd.concat([read_run(next((tmp_path / d).iterdir()))[0] for d in ("b", "c")], ignore_index=True)
    _assert_same_cases(sharded, union)
    assert (sharded["status"] == "ok").all()
    assert set(sharded["gpu_index"]) == {0, 1} and manifest["sharded"]
    assert len({w["gpu_uuid"] for w in manifest["workers"]}) == 2  # two boards, not one twice


@pytest.mark.gpu
def test_gpu_devices_all_equals_a_one_process_sweep(tmp_path):
    """`--devices all` (the workers started by torch's elastic launch, one per
    GPU, even where there is one) against the same sweep in this process: the
    same cases, statuses, shapes, touched experts, bytes and oracle errors,
    every row stamped with its worker's GPU."""
    import torch

    _sweep(tmp_path, "a", "--tp", "4", "--devices", "all")
    _sweep(tmp_path, "b", "--tp", "4", "--device", "cuda:0")
    (a, manifest), (b, _) = (read_run(next((tmp_path / d).iterdir())) for d in ("a", "b"))
    _assert_same_cases(a, b)
    assert (a["status"] == "ok").all() and len(a) == 4
    assert set(a["gpu_index"]) == set(range(torch.cuda.device_count())) and manifest["sharded"]
