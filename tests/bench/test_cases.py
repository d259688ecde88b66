import pytest
import torch

from moebench.bench.cases import SweepConfig, expand_cases, rotation_bytes, unique_bytes
from moebench.traffic import unique_experts
from moebench.models import get_preset


def test_unique_bytes_counts_distinct_local_experts_and_activations():
    shape = get_preset("dsv41-flash").shard(4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, -1, 384]], dtype=torch.int32)
    assert unique_experts(ids, shape.experts) == 7
    expected = 7 * shape.expert_bytes() + 2 * 2 * shape.hidden * 2
    assert unique_bytes(shape, ids) == expected
    # Logical bytes: the TP4 padding (576 -> 640) is not counted.
    i, h = 576, 5120
    assert shape.expert_bytes() == 3 * i * h // 2 + 3 * i * h // 32


def test_rotation_bytes_is_the_shapes_fewest_not_the_sweeps():
    """The rotation is sized by one row over top_k experts whatever rows a
    sweep holds; a routing that touches fewer (-1 ids) lowers it."""
    shape = get_preset("dsv41-flash").shard(4)
    one_row = 6 * shape.expert_bytes() + 2 * shape.hidden * 2
    rows4 = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    assert rotation_bytes(shape, [rows4]) == one_row == rotation_bytes(shape, [])
    assert rotation_bytes(shape, [rows4, torch.arange(6).reshape(1, 6)]) == one_row
    sparse = torch.tensor([[3, -1, -1, -1, -1, -1]], dtype=torch.int32)
    assert rotation_bytes(shape, [rows4, sparse]) == unique_bytes(shape, sparse) < one_row


def test_unique_bytes_rejects_wrong_top_k():
    shape = get_preset("dsv4-flash").shard(1)
    with pytest.raises(ValueError, match="topk_ids"):
        unique_bytes(shape, torch.zeros(2, 5, dtype=torch.int32))


def test_grid_and_reduced_geometry():
    cfg = SweepConfig(tp=(1, 8), rows=(1, 2), scenarios=("uniform", "hot"), tactics=("default",))
    cases = expand_cases(cfg, ("torch-bf16", "reference"), reduced=True)
    assert len(cases) == 2 * 2 * 2 * 2
    c = cases[0]
    assert (c.config.hidden, c.config.intermediate, c.config.experts) == (512, 256, 32)
    full = expand_cases(cfg, ("torch-bf16",), reduced=False)[0]
    assert full.config.hidden == 5120
    over = SweepConfig(hidden=1024).config_for("dsv41-flash", reduced=True)
    assert over.hidden == 1024 and over.experts == 32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rows=(0,)), "rows"),
        (dict(rows=(9,)), "rows"),
        (dict(presets=("nope",)), "presets"),
        (dict(scenarios=("weird",)), "scenario"),
        (dict(scenarios=("replay",)), "replay"),
        (dict(tp=(5,)), "tp=5"),
        (dict(replays=0), "replays"),
        (dict(rows=(1, 1)), "duplicates"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SweepConfig(**kwargs)


def test_reduced_tp_error_suggests_the_reduced_geometrys_degrees():
    # Without a GPU the reduced I=256 runs: suggest its degrees, not the preset's (3, 12 ... would fail too).
    for tp in (16, 3):
        with pytest.raises(ValueError) as info:
            SweepConfig(tp=(tp,), reduced=True)
        text = str(info.value)
        assert (
            "valid --tp values on the CPU: 1,2,4,8," in text
            and "the sweep runs a reduced geometry" in text
            and "9,12" not in text
        )
    with pytest.raises(ValueError, match=r"valid --tp values: 1,2,3,4,6,8,9,12,18,24,36$"):
        SweepConfig(tp=(16,), reduced=False)
    with pytest.raises(ValueError, match=r"valid --tp values: 1,2,4,8$"):  # an --intermediate runs on both
        SweepConfig(tp=(16,), intermediate=256, reduced=True)


def test_trace_is_only_taken_with_the_replay_scenario(tmp_path):
    with pytest.raises(ValueError, match=r"--trace.*--scenario"):
        SweepConfig(scenarios=("correlated",), trace=tmp_path / "t.npz")
    cfg = SweepConfig(scenarios=("replay", "correlated"), trace=tmp_path / "t.npz")
    assert cfg.trace == tmp_path / "t.npz"


def test_back_to_back_must_be_a_bool():
    assert SweepConfig().back_to_back is False and SweepConfig(back_to_back=True).back_to_back is True
    with pytest.raises(TypeError, match="back_to_back"):
        SweepConfig(back_to_back="yes")
