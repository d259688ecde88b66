"""The route record and permute map (moebench.record), checked against
docs/design.md "The routed-expert path" property by property and against an
expected record built here independently."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebench.record import RouteRecord, build_route_record, check_topk_ids, cta_words, max_ctas, route_words


# ----------------------------------------------------------------------------- formulas


MAX_CTAS_EXAMPLES = [(1, 6, 384, 6), (8, 6, 384, 48), (8, 8, 512, 64), (8, 8, 4, 11), (0, 6, 384, 0),
                     (8, 6, 1, 6), (1, 1, 1, 1), (6, 6, 22, 22 + 14 // 8), (2, 8, 3, 3 + 13 // 8)]  # fmt: skip


@pytest.mark.parametrize("rows, top_k, experts, want", MAX_CTAS_EXAMPLES)
def test_max_ctas_examples(rows, top_k, experts, want):
    assert max_ctas(rows, top_k, experts) == want


@pytest.mark.parametrize("c, words", [(0, 0), (1, 4), (3, 4), (4, 4), (5, 8), (11, 12), (48, 48), (64, 64)])
def test_cta_words(c, words):
    assert cta_words(c) == words
    assert route_words(c) == 4 + 2 * words + 8 * c


def test_route_words_examples():
    assert route_words(0) == 4
    assert route_words(6) == 4 + 16 + 48 == 68
    assert route_words(11) == 4 + 24 + 88 == 116
    assert route_words(48) == 4 + 96 + 384 == 484


def partitions(n: int, parts: int, largest: int | None = None):
    """Integer partitions of n into at most `parts` positive parts (non-increasing)."""
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    if parts == 0:
        return
    for first in range(min(n, largest), 0, -1):
        for rest in partitions(n - first, parts - 1, first):
            yield (first,) + rest


def test_max_ctas_is_the_tight_bound_over_all_routings():
    # Any routing of S slots over at most E experts needs sum ceil(n_e / 8)
    # tiles; max_ctas is the largest such sum (brute force over partitions).
    for rows in range(0, 9):
        for top_k in range(1, 9):
            slots = rows * top_k
            if slots > 24:
                continue
            for experts in (1, 2, 3, 5, 8, 30):
                worst = max(sum(-(-n // 8) for n in p) for p in partitions(slots, experts))
                assert max_ctas(rows, top_k, experts) == worst, (rows, top_k, experts)


def test_max_ctas_bad_input():
    for bad in (dict(rows=-1, top_k=6, experts=8), dict(rows=1, top_k=1.5, experts=8),
                dict(rows=1, top_k=6, experts=-3)):  # fmt: skip
        name = next(k for k, v in bad.items() if not (isinstance(v, int) and v >= 0))
        with pytest.raises(ValueError, match=name):
            max_ctas(**bad)


# ----------------------------------------------------------------------------- builder


def expected_record(ids: list[list[int]], top_k: int, experts: int) -> tuple[list[int], list[list[int]], int]:
    """The record and permute map, built from docs/design.md's text."""
    rows = len(ids)
    slots = rows * top_k
    f = min(experts, slots)
    ctas = f + (slots - f) // 8
    w = -(-ctas // 4) * 4
    local = sorted((e, t * top_k + k) for t in range(rows) for k, e in enumerate(ids[t]) if 0 <= e < experts)
    tile_expert, tile_valid, tile_slots = [], [], []
    for e in sorted({e for e, _ in local}):
        mine = [s for x, s in local if x == e]
        for start in range(0, len(mine), 8):
            chunk = mine[start : start + 8]
            tile_expert.append(e)
            tile_valid.append(len(chunk))
            tile_slots += chunk + [-1] * (8 - len(chunk))
    used = len(tile_expert)
    permuted = [[-1] * top_k for _ in range(rows)]
    for i, s in enumerate(tile_slots):
        if s >= 0:
            permuted[s // top_k][s % top_k] = i
    record = [used, len(local), rows, top_k]
    record += tile_expert + [-1] * (w - used)
    record += tile_valid + [0] * (w - used)
    record += tile_slots + [-1] * (8 * ctas - len(tile_slots))
    return record, permuted, ctas


def check_properties(rec: RouteRecord, ids: torch.Tensor, experts: int) -> None:
    rows, top_k = ids.shape
    idl = ids.tolist()
    ctas = max_ctas(rows, top_k, experts)
    w = cta_words(ctas)
    assert rec.ctas == ctas and rec.permuted_rows == 8 * ctas
    assert rec.record.dtype == torch.int32 and rec.record.shape == (route_words(ctas),)
    assert rec.permuted.dtype == torch.int32 and rec.permuted.shape == (rows, top_k)
    r = rec.record.tolist()
    used, valid = r[0], r[1]
    assert r[2:4] == [rows, top_k]
    assert used == rec.tiles_used and valid == int(rec.record[1])  # header: valid slots
    assert used <= ctas
    tile_expert = r[4 : 4 + w]
    tile_valid = r[4 + w : 4 + 2 * w]
    tile_slots = r[4 + 2 * w :]
    assert len(tile_slots) == 8 * ctas
    assert rec.tile_expert.tolist() == tile_expert and rec.tile_valid_rows.tolist() == tile_valid
    assert rec.tile_slots.shape == (ctas, 8) and rec.tile_slots.flatten().tolist() == tile_slots

    local = {t * top_k + k for t in range(rows) for k in range(top_k) if 0 <= idl[t][k] < experts}
    assert valid == len(local)
    # every local slot exactly once, nothing else; non-local slots are absent
    present = [s for s in tile_slots if s != -1]
    assert sorted(present) == sorted(local) and len(present) == len(set(present))
    assert all(s == -1 or 0 <= s < rows * top_k for s in tile_slots)
    # the permute map and the slot table are inverse
    perm = rec.permuted.tolist()
    for t in range(rows):
        for k in range(top_k):
            p = perm[t][k]
            if t * top_k + k in local:
                assert 0 <= p < 8 * used and tile_slots[p] == t * top_k + k
            else:
                assert p == -1
    # unused tiles: expert -1, 0 valid rows, slots -1 (also the cta_words padding)
    assert tile_expert[used:] == [-1] * (w - used)
    assert tile_valid[used:] == [0] * (w - used)
    assert tile_slots[8 * used :] == [-1] * (8 * (ctas - used))
    # used tiles
    assert all(0 <= e < experts for e in tile_expert[:used])
    assert tile_expert[:used] == sorted(tile_expert[:used])  # ascending by expert
    for tile in range(used):
        chunk = tile_slots[8 * tile : 8 * tile + 8]
        n = tile_valid[tile]
        assert 1 <= n <= 8
        assert all(s != -1 for s in chunk[:n]) and chunk[n:] == [-1] * (8 - n)  # padding at the end
        assert all(idl[s // top_k][s % top_k] == tile_expert[tile] for s in chunk[:n])
    for e in set(tile_expert[:used]):
        tiles = [i for i in range(used) if tile_expert[i] == e]
        n = sum(1 for s in local if idl[s // top_k][s % top_k] == e)
        assert len(tiles) == -(-n // 8)
        assert tiles == list(range(tiles[0], tiles[0] + len(tiles)))  # consecutive
        mine = [s for i in tiles for s in tile_slots[8 * i : 8 * i + 8] if s != -1]
        assert mine == sorted(mine)  # slots ascend within an expert
        assert all(tile_valid[i] == 8 for i in tiles[:-1])


@st.composite
def routings(draw):
    experts = draw(st.one_of(st.integers(1, 512), st.sampled_from([1, 2, 3, 8, 384, 512])))
    rows = draw(st.integers(0, 8))
    top_k = draw(st.integers(1, 8))
    ids_from = st.integers(-2, experts + 1)
    if draw(st.booleans()):  # few distinct ids, so experts get many slots (several tiles)
        pool = draw(st.lists(ids_from, min_size=1, max_size=4))
        ids_from = st.sampled_from(pool)
    ids = draw(st.lists(st.lists(ids_from, min_size=top_k, max_size=top_k), min_size=rows, max_size=rows))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(ids, dtype=dtype).view(rows, top_k), experts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings())
def test_builder_properties(case):
    ids, experts = case
    rec = build_route_record(ids, experts)
    check_properties(rec, ids, experts)
    record, permuted, ctas = expected_record(ids.tolist(), ids.shape[1], experts)
    assert rec.ctas == ctas
    assert rec.record.tolist() == record
    assert rec.permuted.tolist() == permuted


def test_builder_example():
    # 2 rows x top-3 over 4 local experts; 7 is on another rank, -1 too
    ids = torch.tensor([[2, 0, 7], [0, -1, 2]], dtype=torch.int32)
    rec = build_route_record(ids, 4)
    assert rec.ctas == 4 + (6 - 4) // 8 == 4
    w = 4
    assert rec.record.tolist()[:4] == [2, 4, 2, 3]
    assert rec.tile_expert.tolist() == [0, 2, -1, -1]
    assert rec.tile_valid_rows.tolist() == [2, 2, 0, 0]
    assert rec.tile_slots.tolist() == [[1, 3] + [-1] * 6, [0, 5] + [-1] * 6, [-1] * 8, [-1] * 8]
    assert rec.permuted.tolist() == [[8, 0, -1], [1, -1, 9]]
    assert rec.record.numel() == route_words(4) == 4 + 2 * w + 32


def test_builder_many_slots_one_expert():
    ids = torch.full((8, 8), 3, dtype=torch.int64)
    ids[0, :3] = torch.tensor([0, 1, 2])
    rec = build_route_record(ids, 4)
    assert rec.ctas == 11 and rec.tiles_used == 3 + 8  # the max_ctas bound is reached
    assert rec.tile_expert.tolist() == [0, 1, 2] + [3] * 8 + [-1]
    assert rec.tile_valid_rows.tolist() == [1, 1, 1] + [8] * 7 + [5] + [0]
    check_properties(rec, ids, 4)


def test_builder_zero_rows_and_all_nonlocal():
    rec = build_route_record(torch.zeros(0, 6, dtype=torch.int32), 384)
    assert rec.ctas == 0 and rec.record.tolist() == [0, 0, 0, 6] and rec.permuted.shape == (0, 6)
    ids = torch.tensor([[-1, 5, 9]] * 4)
    rec = build_route_record(ids, 5)  # 5 and 9 are outside [0, 5)
    assert rec.tiles_used == 0 and int(rec.record[1]) == 0
    assert rec.permuted.tolist() == [[-1] * 3] * 4
    check_properties(rec, ids, 5)


def test_builder_keeps_device():
    rec = build_route_record(torch.tensor([[1, 2]]), 4)
    assert rec.record.device.type == "cpu" and rec.permuted.device.type == "cpu"


@pytest.mark.parametrize(
    "ids, experts, exc, match",
    [
        (torch.zeros(2, 6), 8, TypeError, "topk_ids"),
        (torch.zeros(2, 6, dtype=torch.int16), 8, TypeError, "topk_ids"),
        ([[0, 1]], 8, TypeError, "topk_ids"),
        (torch.zeros(2, 3, 2, dtype=torch.int32), 8, ValueError, "topk_ids"),
        (torch.zeros(6, dtype=torch.int32), 8, ValueError, "topk_ids"),
        (torch.zeros(9, 6, dtype=torch.int32), 8, ValueError, "rows"),
        (torch.zeros(2, 9, dtype=torch.int32), 16, ValueError, "top_k"),
        (torch.zeros(2, 0, dtype=torch.int32), 16, ValueError, "top_k"),
        (torch.zeros(2, 6, dtype=torch.int32), 0, ValueError, "experts"),
        (torch.zeros(2, 6, dtype=torch.int32), 513, ValueError, "experts"),
        (torch.zeros(2, 6, dtype=torch.int32), 8.0, TypeError, "experts"),
    ],
)
def test_builder_bad_input(ids, experts, exc, match):
    with pytest.raises(exc, match=match):
        check_topk_ids(ids, experts)
    with pytest.raises(exc, match=match):
        build_route_record(ids, experts)
