from types import SimpleNamespace

import numpy as np
import pytest

from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.models import get_preset


def test_gemm_shape_of_takes_integers_and_refuses_floats():
    """GemmShape.of keeps int-like values (numpy integers too) and refuses a
    float naming the field rather than truncating it to another shape."""
    shape = get_preset("dsv41-flash").shard(4)
    assert GemmShape.of(shape) == GemmShape(5120, 576, 384)
    assert GemmShape.of(SimpleNamespace(hidden=np.int64(4096), intermediate=512, experts=32)) == GemmShape(
        4096, 512, 32
    )
    with pytest.raises(ValueError, match="hidden must be a positive int, got 4096.7"):
        GemmShape.of(SimpleNamespace(hidden=4096.7, intermediate=512, experts=32))
    with pytest.raises(ValueError, match="experts"):
        GemmShape.of(SimpleNamespace(hidden=4096, intermediate=512, experts=True))
    with pytest.raises(TypeError, match="hidden, intermediate and experts"):
        GemmShape.of(SimpleNamespace(hidden=4096))


def _space_tactics():
    """Every tactic of every tuning space (BF16 full space, the ship and FP8
    spaces of each preset and TP, both stages), plus the flags the spaces leave out."""
    from moebench.models import PRESETS
    from moebench.tuning.space import FP8_SPACES, FULL_SPACE, SHIP_SPACE

    out = set(FULL_SPACE.tactics())
    for preset in sorted(PRESETS):
        for tp in (1, 2, 4, 8):
            shape = GemmShape.of(get_preset(preset).shard(tp))
            for stage in (1, 2):
                out.update(SHIP_SPACE.tactics_for(shape, stage))
                out.update(FP8_SPACES["full"].tactics_for(shape, stage))
    out.update(
        [
            GemmTactic(pdl=False),
            GemmTactic(persistent=False, pdl=False),
            GemmTactic(split_k=4),
            GemmTactic(64, 1, 4, 4, 3, split_k=2, act_bf16=True),
            GemmTactic(stages=4, act_bf16=True),
        ]
    )
    return sorted(out, key=lambda t: t.to_name())


def test_every_tactic_of_the_spaces_round_trips_name_and_fields():
    tactics = _space_tactics()
    assert len(tactics) > 500 and any(t.spec for t in tactics) and any(t.fp8 for t in tactics)
    names = [t.to_name() for t in tactics]
    assert len(set(names)) == len(names)  # one name per tactic
    for t, name in zip(tactics, names):
        assert t.name == name and GemmTactic.from_name(name) == t and GemmTactic.from_name(f" {name} ") == t
        fields = t.to_fields()
        assert fields["name"] == name and GemmTactic.from_fields(fields) == t


def test_name_parts_and_table_fields_follow_the_dataclass():
    from dataclasses import fields

    from moebench.kernels.tactic import NAME_PARTS, TABLE_REQUIRED, TABLE_SPARSE

    declared = [f.name for f in fields(GemmTactic)]
    assert sorted(f for f, _, _ in NAME_PARTS) == sorted(declared)
    assert list(GemmTactic().to_fields()) == ["name", *(f for f in declared if f not in TABLE_SPARSE)]
    clustered = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=2)
    assert list(clustered.to_fields()) == ["name", *(f for f in declared if f not in ("mma_depth", "planes"))]
    assert clustered.name == "r16_m4_k4_u4_c1_b4_cl2_f8"
    piped = GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, cluster_k=2, mma_depth=2, planes=2)
    assert list(piped.to_fields()) == ["name", *declared] and piped.name == "r16_m4_k4_u4_c1_b4_cl2_d2_p2_f8"
    assert GemmTactic().to_name() == "r64_m1_k8_u2_c2"
    assert GemmTactic(32, 4, 2, 4, 2, persistent=False, pdl=False, split_k=2).name == "r32_m4_k2_u4_c2_np_nopdl_s2"
    assert GemmTactic(16, 4, 4, 4, 1, stages=4, fp8=True, spec=True).name == "r16_m4_k4_u4_c1_b4_sp_f8"
    old = {k: v for k, v in GemmTactic(stages=4).to_fields().items() if k in TABLE_REQUIRED}
    assert GemmTactic.from_fields(old) == GemmTactic()  # fields a table omits take their defaults


@pytest.mark.parametrize("bad,match", [
    ("", "cannot parse"), ("r64", "cannot parse"), ("r48_m1_k8_u4_c1", "tile_rows"),
    ("r64_m1_k8_u4_c1_x", "cannot parse"), ("r64_m1_k8_u4_c1_s1", "canonical form: write 'r64_m1_k8_u4_c1'"),
    ("r64_m1_k8_u4_c1_f8_a16", "cannot parse"), ("r64_m1_k8_u4_c1_a16_f8", "excludes act_bf16"),
])  # fmt: skip
def test_bad_names_raise_value_error_naming_the_text(bad, match):
    with pytest.raises(ValueError, match=match):
        GemmTactic.from_name(bad)
    with pytest.raises(TypeError, match="must be a str"):
        GemmTactic.from_name(64)


def test_bad_fields_raise_naming_what_is_wrong():
    good = GemmTactic().to_fields()
    with pytest.raises(TypeError, match="must be an object"):
        GemmTactic.from_fields(["r64"])
    with pytest.raises(ValueError, match=r"tactic lacks \['pdl'\]"):
        GemmTactic.from_fields({k: v for k, v in good.items() if k != "pdl"})
    with pytest.raises(ValueError, match="invalid tactic: unroll"):
        GemmTactic.from_fields({**good, "unroll": 99, "name": None})
    with pytest.raises(ValueError, match="does not match its fields"):
        GemmTactic.from_fields({**good, "name": "r64_m1_k8_u4_c1"})
