"""The fused layer's tactics as tables store them, the candidates `tune`
times against the pair, and the per-rows choice (CPU; the rules of one
FusedTactic are in test_fused.py)."""

import pytest

from moebench.kernels.fused_tactic import FusedTactic, LayerChoice, default_fused_tactic, fused_candidates
from moebench.kernels.tactic import GemmShape
from moebench.models import PRESETS, get_preset
from moebench.record import MAX_ROWS, max_ctas


def _shapes():
    for name in PRESETS:
        for tp in (1, 2, 4, 8):
            yield name, tp, get_preset(name).shard(tp)


def test_candidates_start_with_the_builtin_and_all_run():
    for name, tp, shape in _shapes():
        for rows in range(1, MAX_ROWS + 1):
            ctas = max_ctas(rows, shape.top_k, shape.experts)
            cands = fused_candidates(shape, ctas)
            base = default_fused_tactic(shape, ctas)
            assert (cands[0] == base) if base is not None else cands == (), (name, tp, rows)
            assert len(set(cands)) == len(cands) <= 8 and len({c.name for c in cands}) == len(cands)
            assert all(c.why_invalid(GemmShape.of(shape)) is None for c in cands), (name, tp, rows)
            # without resident units the lead means nothing: never two names for one launch
            assert all(c.lead == 0 for c in cands if c.resident == 0)
    tp4 = get_preset("dsv41-flash").shard(4)
    cands = fused_candidates(tp4, max_ctas(1, 6, 384))
    assert len(cands) >= 4 and {c.resident for c in cands} >= {0, cands[0].resident}
    assert any(c.lead is None for c in cands) and len({c.gemm2 for c in cands}) == 2
    assert fused_candidates(tp4, 6, limit=2) == cands[:2]
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="limit must be a positive int"):
            fused_candidates(tp4, 6, limit=bad)


def test_fused_tactics_round_trip_through_their_fields():
    for _, _, shape in _shapes():
        for ft in fused_candidates(shape, max_ctas(8, shape.top_k, shape.experts)):
            fields = ft.to_fields()
            assert fields["name"] == ft.name and fields["gemm1"]["name"] == ft.gemm1.name
            assert FusedTactic.from_fields(fields) == ft
            assert LayerChoice.from_fields(LayerChoice(ft).to_fields()) == LayerChoice(ft)


def test_fused_fields_errors_name_what_is_wrong():
    ft = default_fused_tactic(get_preset("dsv41-flash").shard(4), 6)
    good = ft.to_fields()
    with pytest.raises(TypeError, match="must be an object"):
        FusedTactic.from_fields([good])
    with pytest.raises(ValueError, match=r"lacks \['resident'\]"):
        FusedTactic.from_fields({k: v for k, v in good.items() if k != "resident"})
    with pytest.raises(ValueError, match="does not match its fields"):
        FusedTactic.from_fields({**good, "name": ft.name + "x"})
    with pytest.raises(ValueError, match="invalid fused tactic.*lead"):
        FusedTactic.from_fields({**good, "lead": -1})
    with pytest.raises(ValueError, match="invalid fused tactic"):
        FusedTactic.from_fields({**good, "gemm2": {"tile_rows": 16}})
    assert FusedTactic.from_fields({k: v for k, v in good.items() if k != "name"}) == ft


def test_layer_choice_names_the_pair_or_the_fused_tactic():
    ft = default_fused_tactic(get_preset("dsv41-flash").shard(4), 6)
    assert LayerChoice().name == "pair" and LayerChoice(None).to_fields() == {"name": "pair"}
    assert LayerChoice(ft).name == ft.name and LayerChoice.from_fields({"name": "pair"}) == LayerChoice(None)
    with pytest.raises(ValueError, match="holds only its name"):
        LayerChoice.from_fields({"name": "pair", "resident": 0})
    with pytest.raises(TypeError, match="fused must be a FusedTactic or None"):
        LayerChoice(ft.gemm1)


def test_fused_fields_are_exactly_what_to_fields_writes():
    good = default_fused_tactic(get_preset("dsv41-flash").shard(4), 6).to_fields()
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        FusedTactic.from_fields({**good, "extra": 1})
    with pytest.raises(ValueError, match=r"lacks \['lead'\]"):  # None (early loads) and 0 differ: never guessed
        FusedTactic.from_fields({k: v for k, v in good.items() if k != "lead"})
