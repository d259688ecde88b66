"""The route record: what GEMM1 and GEMM2 read, and the permute map.

For `ctas` token tiles of TILE = 8 permuted rows, the record is int32
[route_words(ctas)]:

    [0]                     tiles used
    [1]                     valid slots (local (t, k) slots)
    [2]                     rows
    [3]                     top_k
    [4 : 4+W]               tile_expert[W]      expert of each tile, -1 unused
    [4+W : 4+2W]            tile_valid_rows[W]  rows of the tile in use, 0 unused
    [4+2W : 4+2W+8*ctas]    tile_slots[8*ctas]  expanded index t*top_k+k of each
                                                permuted row, -1 padding / unused
with W = cta_words(ctas). Tiles ascend by expert id; an expert with n slots
takes ceil(n/8) consecutive tiles; within an expert, slots ascend. The permute
map permuted[t, k] is the permuted row (tile*8 + position) of slot (t, k); an id
outside [0, E) is non-local (-1 for experts on other ranks): its slot maps to -1
and is never read or written.

This torch builder is the oracle the route kernel is held to, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.models import MAX_EXPERTS, MAX_TOP_K

#: Permuted rows per token tile.
TILE = 8
#: Most token rows the low-batch path takes.
MAX_ROWS = 8
#: The row counts a run measures or tunes unless told otherwise: every one the kernels serve.
ALL_ROWS = tuple(range(1, MAX_ROWS + 1))
#: The row counts of a reduced (CPU smoke) run unless told otherwise.
REDUCED_ROWS = (1, 4, 8)
HEADER_WORDS = 4


def max_ctas(rows: int, top_k: int, experts: int) -> int:
    """The most 8-row token tiles any routing of rows*top_k slots needs:
    f + (rows*top_k - f) // 8 with f = min(experts, rows*top_k)."""
    for name, v in (("rows", rows), ("top_k", top_k), ("experts", experts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    slots = rows * top_k
    filled = min(experts, slots)
    return filled + (slots - filled) // TILE


def cta_words(ctas: int) -> int:
    """`ctas` rounded up to a multiple of four (the record's table width)."""
    return (ctas + 3) // 4 * 4


def route_words(ctas: int) -> int:
    """int32 length of the route record for `ctas` token tiles:
    4 + 2*cta_words(ctas) + 8*ctas."""
    return HEADER_WORDS + 2 * cta_words(ctas) + TILE * ctas


@dataclass(frozen=True)
class RouteRecord:
    """A built record (int32 [route_words(ctas)]) and permute map (int32 [rows, top_k])."""

    record: torch.Tensor
    permuted: torch.Tensor
    ctas: int

    @property
    def tiles_used(self) -> int:
        return int(self.record[0])

    @property
    def tile_expert(self) -> torch.Tensor:
        """int32 [cta_words(ctas)], -1 for unused tiles."""
        w = cta_words(self.ctas)
        return self.record[HEADER_WORDS : HEADER_WORDS + w]

    @property
    def tile_valid_rows(self) -> torch.Tensor:
        """int32 [cta_words(ctas)], 0 for unused tiles."""
        w = cta_words(self.ctas)
        return self.record[HEADER_WORDS + w : HEADER_WORDS + 2 * w]

    @property
    def tile_slots(self) -> torch.Tensor:
        """int32 [ctas, 8]: expanded index of each permuted row, -1 padding."""
        w = cta_words(self.ctas)
        return self.record[HEADER_WORDS + 2 * w :].view(self.ctas, TILE)

    @property
    def permuted_rows(self) -> int:
        """Rows of the permuted buffers (8 * ctas)."""
        return TILE * self.ctas


def check_topk_ids(topk_ids: torch.Tensor, experts: int) -> None:
    """Raise TypeError / ValueError unless `topk_ids` is an integer [rows, top_k]
    tensor with 0 <= rows <= 8, 1 <= top_k <= 8 and experts in [1, 512]."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [rows, top_k], got shape {tuple(topk_ids.shape)}")
    rows, top_k = topk_ids.shape
    if rows > MAX_ROWS:
        raise ValueError(f"topk_ids has {rows} rows; the record takes at most {MAX_ROWS}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"topk_ids: top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    if isinstance(experts, bool) or not isinstance(experts, int):
        raise TypeError(f"experts must be an int in [1, {MAX_EXPERTS}], got {type(experts).__name__} {experts!r}")
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be an int in [1, {MAX_EXPERTS}], got {experts!r}")


def build_route_record(topk_ids: torch.Tensor, experts: int) -> RouteRecord:
    """Build the route record and permute map of `topk_ids` [rows, top_k]
    (int32/int64; ids outside [0, experts) are non-local) for `experts` local
    experts, on topk_ids' device. Raises as `check_topk_ids`."""
    check_topk_ids(topk_ids, experts)
    rows, top_k = topk_ids.shape
    ctas = max_ctas(rows, top_k, experts)
    w = cta_words(ctas)
    ids = topk_ids.detach().to("cpu", torch.int64).flatten().tolist()
    record = [0] * route_words(ctas)
    tile_expert = [-1] * w
    tile_valid = [0] * w
    tile_slots = [-1] * (TILE * ctas)
    permuted = [-1] * (rows * top_k)
    by_expert: dict[int, list[int]] = {}
    for slot, e in enumerate(ids):
        if 0 <= e < experts:
            by_expert.setdefault(e, []).append(slot)
    tile = 0
    for e in sorted(by_expert):
        slots = by_expert[e]
        for start in range(0, len(slots), TILE):
            chunk = slots[start : start + TILE]
            tile_expert[tile], tile_valid[tile] = e, len(chunk)
            for pos, slot in enumerate(chunk):
                tile_slots[tile * TILE + pos] = slot
                permuted[slot] = tile * TILE + pos
            tile += 1
    assert tile <= ctas, "max_ctas bound violated"
    valid = sum(len(s) for s in by_expert.values())
    record[:HEADER_WORDS] = [tile, valid, rows, top_k]
    record[HEADER_WORDS:] = tile_expert + tile_valid + tile_slots
    device = topk_ids.device
    return RouteRecord(
        torch.tensor(record, dtype=torch.int32, device=device),
        torch.tensor(permuted, dtype=torch.int32, device=device).view(rows, top_k),
        ctas,
    )
