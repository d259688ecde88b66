"""Split a sweep's case grid across ranks (`moebench sweep --devices`, or
every rank under torchrun: `bench/launch.py`).

`plan_shards` assigns cases to ranks: cases of one (preset, tp) weight
group stay together where the balance allows it (weights are generated per
group), a group too large for one rank's share is cut at `rows` boundaries
(each piece is still a full rows x scenarios x backends x tactics product,
so one SweepConfig runs it: `shard_configs`), then the pieces go to ranks
by longest-processing-time-first greedy over `expected_cost`. Every rank
computes the same plan from the same config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from moebench.bench import L2_MULTIPLE
from moebench.bench.cases import Case, SweepConfig

#: L2 of an H200 (bytes) the cost model sizes the rotation with.
H200_L2_BYTES = 60 * 1024 * 1024
#: Cost (in bytes-equivalent) of one case beyond its streamed bytes: launch,
#: oracle gate, timing loop overhead.
CASE_OVERHEAD_BYTES = 8 * 1024 * 1024


# --------------------------------------------------------------------------- plan


def expected_cost(case: Case, l2_bytes: int = H200_L2_BYTES) -> float:
    """Relative run time of `case`: bytes one call streams (the most experts
    rows x top_k routes can touch, x their logical bytes, + activations) times
    the rotation layers a cold-L2 sweep uses (>= 4 x L2 working set, as in
    sweep.layer_count), + a fixed per-case overhead. Only ratios matter."""
    shape = case.shape
    touched = min(case.rows * shape.top_k, shape.experts)
    nbytes = touched * shape.expert_bytes() + 4 * case.rows * shape.hidden
    layers = max(1, math.ceil(L2_MULTIPLE * l2_bytes / nbytes))
    return float(min(layers, 64) * nbytes + CASE_OVERHEAD_BYTES)


def _group_key(case: Case):
    return (case.config, case.tp)


def plan_shards(
    cases: Sequence[Case], devices: int | Sequence[int], cost: Callable[[Case], float] = expected_cost
) -> list[list[Case]]:
    """Cases per device (one list per device, in `devices` order).

    Every case lands exactly once; each list keeps the input order. A (preset,
    tp) group stays on one device unless its cost exceeds total / n_devices;
    then it is cut at `rows` boundaries into pieces of at most half that
    share (a single rows value is never cut). Pieces are placed by LPT greedy
    (most costly first, onto the least loaded device, ties to the lower
    index), so the most loaded device carries at most total / n + the most
    costly piece. Deterministic for the same input. Raises ValueError for no
    devices or duplicate cases.
    """
    n = devices if isinstance(devices, int) else len(devices)
    if n < 1:
        raise ValueError(f"need at least one device, got {devices!r}")
    cases = list(cases)
    if len(set(cases)) != len(cases):
        raise ValueError("cases has duplicates")
    costs = [float(cost(c)) for c in cases]
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError("cost must be finite and >= 0 for every case")
    total = sum(costs)
    share = total / n

    groups: dict = {}
    for i, c in enumerate(cases):
        groups.setdefault(_group_key(c), []).append(i)
    pieces: list[list[int]] = []
    for idx in groups.values():
        gcost = sum(costs[i] for i in idx)
        if n == 1 or gcost <= share:
            pieces.append(idx)
            continue
        by_rows: dict[int, list[int]] = {}
        for i in idx:
            by_rows.setdefault(cases[i].rows, []).append(i)
        limit = share / 2
        piece: list[int] = []
        pcost = 0.0
        for ridx in by_rows.values():
            rcost = sum(costs[i] for i in ridx)
            if piece and pcost + rcost > limit:
                pieces.append(piece)
                piece, pcost = [], 0.0
            piece = piece + ridx
            pcost += rcost
        if piece:
            pieces.append(piece)

    order = sorted(range(len(pieces)), key=lambda p: (-sum(costs[i] for i in pieces[p]), pieces[p][0]))
    loads = [0.0] * n
    assigned: list[list[int]] = [[] for _ in range(n)]
    for p in order:
        d = min(range(n), key=lambda k: (loads[k], k))
        assigned[d].extend(pieces[p])
        loads[d] += sum(costs[i] for i in pieces[p])
    return [[cases[i] for i in sorted(a)] for a in assigned]


def parse_devices(spec: str, available: int | None = None) -> list[int]:
    """'all' -> every visible GPU (torch.cuda.device_count() unless
    `available` is given); '0,2,3' -> [0, 2, 3]. Raises ValueError for an
    empty, malformed, duplicate or out-of-range list."""
    if available is None:
        import torch

        available = torch.cuda.device_count()
    spec = str(spec).strip()
    out = None
    if spec != "all":  # a malformed list is named as such, GPU or not
        try:
            out = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError as error:
            raise ValueError(f"devices (--devices): expected 'all' or e.g. 0,1, got {spec!r}") from error
        if not out:
            raise ValueError("devices (--devices): empty list")
        if len(set(out)) != len(out):
            raise ValueError(f"devices (--devices): duplicates in {spec!r}")
    if available < 1:
        raise ValueError(f"devices (--devices): {spec!r} but no GPU is visible")
    if out is None:
        return list(range(available))
    bad = [d for d in out if not 0 <= d < available]
    if bad:
        raise ValueError(f"devices (--devices): {bad} not in [0, {available}) visible GPUs")
    return out


def shard_configs(config: SweepConfig, cases: Sequence[Case]) -> list[SweepConfig]:
    """SweepConfigs that together run exactly `cases` (a shard of
    expand_cases(config)), one per (preset, tp) piece. Raises ValueError when
    a piece is not a full rows x scenarios x backends x tactics product
    (plan_shards never makes one)."""
    out = []
    groups: dict = {}
    for c in cases:
        groups.setdefault(_group_key(c), []).append(c)
    for (cfg, tp), group in groups.items():
        axes = [tuple(dict.fromkeys(getattr(c, a) for c in group)) for a in ("rows", "scenario", "backend", "tactic")]
        if math.prod(len(a) for a in axes) != len(group):
            raise ValueError(f"cases of {cfg.name} tp{tp} are not a full product; cannot run them as one sweep")
        preset = cfg.name.split("+", 1)[0]
        out.append(replace(config, presets=(preset,), tp=(tp,), rows=axes[0], scenarios=axes[1],
                           backends=axes[2], tactics=axes[3]))  # fmt: skip
    return out


def pieces_of(cases: list[Case]) -> list[list[Case]]:
    """A shard's cases cut into its (preset, tp) pieces, in order."""
    groups: dict = {}
    for c in cases:
        groups.setdefault(_group_key(c), []).append(c)
    return list(groups.values())
