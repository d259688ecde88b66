"""Geometry presets and tensor-parallel slicing (moebench.models)."""

import dataclasses

import pytest

from moebench.models import PRESETS, MoEConfig, RankShape, get_preset

# docs/design.md "Geometry", transcribed: H, I, E, top_k, shared, routed_scaling_factor, swiglu_limit.
DESIGN_TABLE = {
    "dsv41-flash": (5120, 2304, 384, 6, 1, 1.5, 10.0),
    "dsv4-flash": (4096, 2048, 256, 6, 1, 1.5, 10.0),
    "dsv4-pro": (7168, 3072, 384, 6, 1, 2.5, 10.0),
}


def test_presets_match_design_table():
    assert set(PRESETS) == set(DESIGN_TABLE)
    for name, row in DESIGN_TABLE.items():
        c = get_preset(name)
        assert c.name == name
        got = (c.hidden, c.intermediate, c.experts, c.top_k, c.shared_experts,
               c.routed_scaling_factor, c.swiglu_limit)  # fmt: skip
        assert got == row, name


@pytest.mark.parametrize(
    "name, tp, sliced, padded",
    [
        ("dsv41-flash", 1, 2304, 2304),
        ("dsv41-flash", 2, 1152, 1152),
        ("dsv41-flash", 4, 576, 640),
        ("dsv41-flash", 8, 288, 384),
        ("dsv4-flash", 1, 2048, 2048),
        ("dsv4-flash", 8, 256, 256),
        ("dsv4-pro", 4, 768, 768),
        ("dsv4-pro", 8, 384, 384),
    ],
)
def test_shard_slices_and_pads(name, tp, sliced, padded):
    c = get_preset(name)
    r = c.shard(tp)
    assert isinstance(r, RankShape)
    assert r.tp == tp
    assert r.intermediate == sliced == c.intermediate // tp
    assert r.padded_intermediate == padded
    assert r.padded_intermediate % 128 == 0
    assert r.padded_intermediate - r.intermediate < 128
    # the rest of the geometry passes through unchanged
    assert (r.hidden, r.experts, r.top_k) == (c.hidden, c.experts, c.top_k)
    assert r.swiglu_limit == c.swiglu_limit
    assert r.routed_scaling_factor == c.routed_scaling_factor
    assert name in r.describe() and f"TP{tp}" in r.describe()


def test_expert_bytes_is_logical_unpadded():
    r = get_preset("dsv41-flash").shard(8)
    h, i = 5120, 288
    # w13: 2I rows of H/2 bytes + H/32 scales; w2: H rows of I/2 bytes + I/32 scales
    assert r.expert_bytes() == 2 * i * (h // 2 + h // 32) + h * (i // 2 + i // 32)


def test_overrides():
    c = get_preset("dsv41-flash", hidden=256, intermediate=192, experts=16, top_k=4)
    assert (c.hidden, c.intermediate, c.experts, c.top_k) == (256, 192, 16, 4)
    assert c.name == "dsv41-flash+custom"
    assert c.routed_scaling_factor == 1.5 and c.swiglu_limit == 10.0
    # a partial override keeps the rest of the preset
    d = get_preset("dsv4-pro", experts=64)
    assert (d.hidden, d.intermediate, d.experts, d.top_k) == (7168, 3072, 64, 6)
    # presets themselves are untouched
    assert get_preset("dsv4-pro").experts == 384
    # an override equal to the preset's own value is no override (same name, same config)
    assert get_preset("dsv41-flash", hidden=5120, top_k=6) is get_preset("dsv41-flash")
    assert get_preset("dsv41-flash", hidden=5120, top_k=4).name == "dsv41-flash+custom"
    with pytest.raises(ValueError, match="hidden"):
        get_preset("dsv41-flash", hidden=5120.0)  # a float is refused, not taken as the preset's 5120
    assert c.shard(2).intermediate == 96 and c.shard(2).padded_intermediate == 128


def test_presets_are_frozen_data():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["dsv4-pro"].hidden = 1024  # type: ignore[misc]


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        get_preset("dsv5")


@pytest.mark.parametrize("tp", [0, -1, 3, 5, 128, 4096, 2.0, True, "4"])
def test_bad_tp(tp):
    # dsv4-flash: I = 2048 does not split 3 / 5 / 4096 ways; 2048/128 = 16 is not
    # a multiple of the MX block (32)
    with pytest.raises(ValueError, match="tp"):
        get_preset("dsv4-flash").shard(tp)


def test_tp3_allowed_where_it_divides():
    # 2304 / 3 = 768, a multiple of 32: fine (padding to 768).
    r = get_preset("dsv41-flash").shard(3)
    assert (r.intermediate, r.padded_intermediate) == (768, 768)


@pytest.mark.parametrize(
    "overrides, argument",
    [
        (dict(hidden=100), "hidden"),
        (dict(hidden=192), "hidden"),
        (dict(hidden=0), "hidden"),
        (dict(intermediate=100), "intermediate"),
        (dict(intermediate=-32), "intermediate"),
        (dict(experts=0), "experts"),
        (dict(top_k=0), "top_k"),
        (dict(experts=4, top_k=6), "top_k"),
    ],
)
def test_bad_overrides_name_the_argument(overrides, argument):
    with pytest.raises(ValueError, match=argument):
        get_preset("dsv4-flash", **overrides)


def test_config_validation():
    with pytest.raises(ValueError, match="hidden"):
        MoEConfig("x", 5121, 2304, 384, 6)
    with pytest.raises(ValueError, match="hidden"):
        MoEConfig("x", 512.0, 2304, 384, 6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        MoEConfig("x", 512, 256, 8, 2, routed_scaling_factor=0.0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        MoEConfig("x", 512, 256, 8, 2, swiglu_limit=-1.0)


def test_config_rejects_non_finite_scale_and_bad_field_types():
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
        MoEConfig("x", 512, 256, 32, 4, routed_scaling_factor=float("inf"))
    with pytest.raises(TypeError, match="routed_scaling_factor must be a real"):
        MoEConfig("x", 512, 256, 32, 4, routed_scaling_factor="1.5")
    with pytest.raises(ValueError, match="shared_experts"):
        MoEConfig("x", 512, 256, 32, 4, shared_experts=-1)
    with pytest.raises(TypeError, match="name"):
        MoEConfig(None, 512, 256, 32, 4)
    MoEConfig("x", 512, 256, 32, 4, swiglu_limit=float("inf"))  # no clamp: allowed


def test_rank_shape_built_by_hand_must_equal_shard():
    cfg = get_preset("dsv4-pro")
    assert RankShape(cfg, 2, 1536, 1536) == cfg.shard(2)
    with pytest.raises(ValueError, match="use config.shard"):
        RankShape(cfg, 2, 100, 7)
    with pytest.raises(TypeError, match="MoEConfig"):
        RankShape(None, 2, 1536, 1536)
