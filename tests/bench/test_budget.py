"""The one rotation rule of the sweep and the step (bench/budget.py)."""

from types import SimpleNamespace

import pytest

from moebench.bench import MAX_LAYERS
from moebench.bench.budget import LayerBudget


def _config(warm_l2=False, layers=None):
    return SimpleNamespace(warm_l2=warm_l2, layers=layers)


def test_plan_follows_warm_l2_then_a_forced_count_then_l2():
    mb = 1 << 20
    assert LayerBudget.plan(_config(warm_l2=True), mb, 50 * mb, mb, None) == LayerBudget(1, False, True, mb, None)
    assert LayerBudget.plan(_config(layers=7), mb, 50 * mb, mb, None) == LayerBudget(7, False, True, mb, None)
    assert LayerBudget.plan(_config(), 10 * mb, 50 * mb, mb, None) == LayerBudget(20, False, False, mb, None)
    capped = LayerBudget.plan(_config(), 1, 50 * mb, mb, None)
    assert capped.layers == MAX_LAYERS and capped.capped
    assert LayerBudget.plan(_config(), 10 * mb, 50 * mb, mb, 5 * mb).layers == 5  # the budget holds 5


@pytest.mark.parametrize("forced", [False, True])
def test_a_pair_walks_fewer_sets_where_its_copies_do_not_fit(forced):
    budget = LayerBudget(layers=10, capped=False, forced=forced, per_layer_bytes=100, budget_bytes=1400)
    assert budget.for_pair(0) == 10
    assert budget.for_pair(100) == (10 if forced else 4)  # (1400 - 10 * 100) // 100
    assert budget.for_pair(10_000) == (10 if forced else 1)  # never below one
    assert budget.for_pair(100, layers=6) == 6  # the step's count after the ranks agree: (1400 - 600) // 100 = 8
    assert LayerBudget(10, False, False, 100, None).for_pair(100) == 10  # no budget: the CPU


def test_forced_error_names_layers():
    budget = LayerBudget(layers=30, capped=False, forced=True, per_layer_bytes=10**9, budget_bytes=20 * 10**9)
    assert "layers (--layers) 30 need 30.0 GB" in budget.forced_error(0.5)
    assert budget.forced_error(0.5, layers=20) is None
