"""The tactic space: enumeration, validity rules, names."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebench.kernels.limits import MAX_WARPS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from moebench.kernels.tactic import GemmShape, GemmTactic, default_tactic, partial_smem_bytes
from moebench.models import PRESETS, get_preset
from moebench.record import max_ctas
from moebench.tuning import space as sp
from moebench.tuning.space import (
    FULL_SPACE, QUICK_SPACE, TacticSpace, rejected_tactics, valid_tactics, why_invalid,
)  # fmt: skip

TP4 = GemmShape.of(get_preset("dsv41-flash").shard(4))  # H 5120, I 576, E 384


def _hard_rules_hold(t: GemmTactic, shape, stage):
    assert t.valid_for(shape, stage) is None
    assert t.warps * t.ctas_per_sm <= MAX_WARPS_PER_SM
    assert (partial_smem_bytes(t) + SMEM_RESERVED_PER_CTA) * t.ctas_per_sm <= SMEM_PER_SM


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("preset,tp", [(p, tp) for p in sorted(PRESETS) for tp in (1, 4, 8)])
def test_every_valid_tactic_passes_the_rules_and_the_default_comes_first(preset, tp, stage):
    shape = GemmShape.of(get_preset(preset).shard(tp))
    for rows in (1, 6):
        ctas = max_ctas(rows, 6, shape.experts)
        tactics = valid_tactics(shape, stage, ctas)
        assert tactics[0] == default_tactic(shape, stage, ctas, 132)
        assert len(set(tactics)) == len(tactics) > 10
        for t in tactics:
            _hard_rules_hold(t, shape, stage)


def test_gemm1_items_cover_whole_gate_up_blocks_and_divide_2i():
    # 2 * 576 = 1152 = 18 x 64 = 9 x 128: 256-row items cannot tile it
    items = {t.item_rows for t in valid_tactics(TP4, 1, space=FULL_SPACE)}
    assert items == {64, 128}
    assert "not a multiple of 256" in why_invalid(GemmTactic(tile_rows=64, warps_m=4, warps_k=2), TP4, 1)
    assert "64-row gate/up" in why_invalid(GemmTactic(tile_rows=32, warps_m=1, warps_k=8), TP4, 1)


def test_gemm2_items_divide_hidden_and_warps_k_fits_k():
    assert all(TP4.hidden % t.item_rows == 0 for t in valid_tactics(TP4, 2, space=FULL_SPACE))
    tiny_k = GemmShape(hidden=512, intermediate=64, experts=32)  # K = 64: two 32-K chunks
    assert "exceeds the 2 K chunks" in why_invalid(GemmTactic(tile_rows=32, warps_m=1, warps_k=4), tiny_k, 2)
    assert all(t.warps_k <= 2 for t in valid_tactics(tiny_k, 2, space=FULL_SPACE))


def test_occupancy_and_shared_memory_rules():
    many = GemmTactic(tile_rows=32, warps_m=16, warps_k=1, unroll=1, ctas_per_sm=5)
    assert "resident warps per SM" in why_invalid(many, TP4, 2)
    big = GemmTactic(tile_rows=128, warps_m=1, warps_k=16, unroll=2, ctas_per_sm=2)  # 2 x 129 KiB
    assert partial_smem_bytes(big) == 8 * 128 * 16 * 8
    assert "shared memory per CTA" in why_invalid(big, TP4, 1)  # valid_for says it first
    one = GemmTactic(tile_rows=128, warps_m=1, warps_k=16, unroll=2, ctas_per_sm=1)
    assert why_invalid(one, TP4, 1, prune=False) is None


def test_register_pruning_is_optional():
    hungry = GemmTactic(tile_rows=64, warps_m=1, warps_k=8, unroll=4, ctas_per_sm=3)  # ~120 of 80
    assert sp.estimated_registers(hungry) > sp.register_budget(hungry)
    assert "registers" in why_invalid(hungry, TP4, 1)
    assert why_invalid(hungry, TP4, 1, prune=False) is None
    assert len(valid_tactics(TP4, 1, space=FULL_SPACE, prune=False)) > len(valid_tactics(TP4, 1, space=FULL_SPACE))


def test_non_persistent_twin_of_a_grid_that_holds_every_item_is_a_duplicate():
    t = GemmTactic(tile_rows=64, warps_m=8, warps_k=1, unroll=2, ctas_per_sm=2, persistent=False)
    # GEMM2 at 1 row: 6 tiles x 10 items = 60 <= 264 CTAs
    assert "same grid" in why_invalid(t, TP4, 2, ctas=6)
    assert why_invalid(t, TP4, 2, ctas=48) is None  # 480 items: the grids differ
    assert why_invalid(t, TP4, 2) is None  # ctas unknown


def test_rejected_and_valid_partition_the_space():
    valid = set(valid_tactics(TP4, 1, 36, space=QUICK_SPACE))
    rejected = rejected_tactics(TP4, 1, 36, space=QUICK_SPACE)
    names = {t.name for t in QUICK_SPACE.tactics()}
    assert {t.name for t in valid} | set(rejected) >= names
    assert not {t.name for t in valid} & set(rejected) - {valid_tactics(TP4, 1, 36)[0].name}
    assert all(isinstance(r, str) and r for r in rejected.values())


def test_names_round_trip_over_the_full_space():
    for t in FULL_SPACE.tactics() + [GemmTactic(pdl=False), GemmTactic(persistent=False, pdl=False)]:
        assert GemmTactic.from_name(t.name) == t


@pytest.mark.parametrize("bad", ["", "r64", "r48_m1_k8_u4_c1", "r64_m1_k8_u4_c1_x", "r64_m8_k8_u4_c1"])
def test_bad_names_raise_value_error(bad):
    with pytest.raises(ValueError, match="tactic"):
        GemmTactic.from_name(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage"):
        valid_tactics(TP4, 3)
    with pytest.raises(ValueError, match="ctas"):
        valid_tactics(TP4, 1, 0)
    with pytest.raises(TypeError, match="space"):
        valid_tactics(TP4, 1, space="quick")
    with pytest.raises(ValueError, match="unroll"):
        TacticSpace(unroll=())
    with pytest.raises(ValueError, match="tile_rows"):
        TacticSpace(tile_rows=(48,))
    with pytest.raises(ValueError, match="duplicates"):
        TacticSpace(ctas_per_sm=(1, 1))


def test_quick_space_is_a_subset_of_the_full_one():
    assert set(QUICK_SPACE.tactics()) <= set(FULL_SPACE.tactics())
    assert QUICK_SPACE.size() < FULL_SPACE.size()
    assert len(valid_tactics(TP4, 2, 36)) < 120  # compile time bounds a tuning run


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(1, 64).map(lambda v: 128 * v),
    i=st.integers(1, 96).map(lambda v: 32 * v),
    stage=st.sampled_from([1, 2]),
    ctas=st.one_of(st.none(), st.integers(1, 64)),
)
def test_valid_tactics_respect_the_hard_rules_for_any_shape(h, i, stage, ctas):
    shape = GemmShape(hidden=h, intermediate=i, experts=64)
    for t in valid_tactics(shape, stage, ctas):
        _hard_rules_hold(t, shape, stage)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("preset,tp", [(p, tp) for p in sorted(PRESETS) for tp in (1, 2, 4, 8)])
def test_ship_space_is_the_defaults_and_few_neighbours(preset, tp, stage):
    shape = GemmShape.of(get_preset(preset).shard(tp))
    ship = sp.SHIP_SPACE.tactics_for(shape, stage)
    assert 1 <= len(ship) <= sp.SHIP_SPACE.limit == 10 and len(set(ship)) == len(ship)
    union = set()
    for rows in range(1, 9):
        ctas = max_ctas(rows, 6, shape.experts)
        tactics = valid_tactics(shape, stage, ctas, space=sp.SHIP_SPACE)
        default = default_tactic(shape, stage, ctas, 132)
        assert tactics[0] == default and default in ship  # every row count's default is in the set
        assert set(tactics) <= set(ship) and len(set(tactics)) == len(tactics)
        union |= set(tactics)
        for t in tactics:
            _hard_rules_hold(t, shape, stage)
            assert t.split_k == 1  # split-K measured slower on its own (perf-notes v3)
            if t != default:
                assert why_invalid(t, shape, stage, ctas) is None  # pruned like the other spaces
    assert len(union) <= 10  # at most 10 compiles per shape and stage


def test_ship_space_varies_the_grid_levers_of_the_default():
    ship = set(sp.SHIP_SPACE.tactics_for(TP4, 1))
    defaults = sp.NeighbourSpace.defaults(TP4, 1)
    assert defaults == [GemmTactic(64, 1, 8, 4, 1), GemmTactic(64, 1, 8, 2, 2), GemmTactic(64, 1, 4, 4, 3),
                        GemmTactic(64, 1, 4, 4, 2, stages=4)]  # fmt: skip
    assert set(defaults) <= ship
    assert GemmTactic(64, 1, 4, 4, 4) in ship  # ctas_per_sm + 1 of the rows 5-8 default
    assert len(ship) <= 10  # the cap: with four defaults, lower-ranked neighbours (unroll +- 1) drop out
    gemm2 = sp.SHIP_SPACE.tactics_for(TP4, 2)
    assert gemm2[:2] == (GemmTactic(64, 4, 2, 2, 2, stages=4), GemmTactic(64, 8, 1, 2, 2))
    assert len(sp.NeighbourSpace(limit=3).tactics_for(TP4, 1)) == 3
    assert sp.SPACES["ship"] is sp.SHIP_SPACE
    with pytest.raises(ValueError, match="limit"):
        sp.NeighbourSpace(limit=0)
    with pytest.raises(ValueError, match="stage"):
        valid_tactics(TP4, 3, space=sp.SHIP_SPACE)
    with pytest.raises(ValueError, match="ctas"):
        valid_tactics(TP4, 1, 0, space=sp.SHIP_SPACE)


def test_ship_space_needs_far_fewer_compiles_than_the_quick_one():
    def compiles(space):
        n = 0
        for p in PRESETS:
            for tp in (1, 2, 4, 8):
                shape = GemmShape.of(get_preset(p).shard(tp))
                for stage in (1, 2):
                    n += len({t for r in range(1, 9) for t in valid_tactics(shape, stage, max_ctas(r, 6, shape.experts),
                                                                          space=space)})  # fmt: skip
        return n

    ship, quick = compiles(sp.SHIP_SPACE), compiles(QUICK_SPACE)
    assert ship <= 240 and quick > 5 * ship
