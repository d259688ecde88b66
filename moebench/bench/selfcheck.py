"""`moebench check`: a quick self-check of the pieces a sweep relies on.

On the CPU (always): MXFP8 / MXFP4 codec round trips, route-record
invariants, and the reference oracle against a naive per-slot loop at a tiny
shape. On the device: every available backend against its oracle at one
small case (the CPU backends at a tiny shape when there is no GPU).
Each item returns a CheckResult; nothing raises for a failing item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moebench.backends.registry import available_backends, load_backend
from moebench.formats import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    generate_activations,
    generate_expert_weights,
    quantize_mxfp4,
    quantize_mxfp8,
)
from moebench.models import get_preset
from moebench.record import TILE, build_route_record
from moebench.reference import reference_moe, relative_error, swiglu_clamped
from moebench.routing import scenario_topk_ids, scenario_weights


@dataclass(frozen=True)
class CheckResult:
    """name: what was checked; ok: passed; detail: a number or the failure."""

    name: str
    ok: bool
    detail: str


def _codec_roundtrip(quantize, dequantize, bound: float) -> str:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=gen).float())
    q, s = quantize(x)
    y = dequantize(q, s, torch.float32)
    # Representable values survive a second round trip exactly (the scale may
    # move down a binade under the round-up rule; the values may not change).
    if not torch.equal(dequantize(*quantize(y), torch.float32), y):
        raise AssertionError("re-quantizing dequantized values changed them")
    err = relative_error(y, x.double())
    if not err <= bound:
        raise AssertionError(f"round-trip rel. error {err:.3g} > {bound}")
    return f"rel. err {err:.2e}"


def _record_invariants() -> str:
    experts, n = 16, 0
    for seed in range(20):
        rows = 1 + seed % 8
        ids = scenario_topk_ids("uniform" if seed % 2 else "hot", rows, 6, experts, seed)
        ids[0, 0] = -1  # one non-local slot
        rec = build_route_record(ids, experts)
        perm = rec.permuted.flatten().tolist()
        slots = rec.tile_slots.flatten().tolist()
        tile_expert = rec.tile_expert.tolist()
        for slot, e in enumerate(ids.flatten().tolist()):
            p = perm[slot]
            if e < 0:
                if p != -1:
                    raise AssertionError(f"non-local slot {slot} mapped to {p}")
                continue
            if slots[p] != slot or tile_expert[p // TILE] != e:
                raise AssertionError(f"slot {slot} (expert {e}) maps to row {p} inconsistently")
            n += 1
        if tile_expert[: rec.tiles_used] != sorted(tile_expert[: rec.tiles_used]):
            raise AssertionError("tiles do not ascend by expert")
    return f"{n} slots consistent"


def naive_moe(x, topk_ids, topk_weights, weights) -> torch.Tensor:
    """fp64 per-slot loop with MXFP8 x and H: out [rows, H] (the oracle's
    "mxfp8" family written the obvious way)."""
    i, ip = weights.intermediate, weights.padded_intermediate
    xq = dequantize_mxfp8(*quantize_mxfp8(x), dtype=torch.float64)
    w13, w2 = weights.dequantized(torch.float64)
    out = torch.zeros(x.shape[0], weights.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if not 0 <= e < weights.experts:
                continue
            gate, up = w13[e, :i] @ xq[t], w13[e, ip : ip + i] @ xq[t]
            h = swiglu_clamped(gate, up, float(weights.clamp[e]))
            h = dequantize_mxfp8(*quantize_mxfp8(h.unsqueeze(0)), dtype=torch.float64)[0]
            out[t] += float(topk_weights[t, k]) * (w2[e, :, :i] @ h)
    return out


def _reference_vs_naive() -> str:
    shape = get_preset("dsv4-flash", hidden=256, intermediate=128, experts=8).shard(2)
    weights = generate_expert_weights(shape, seed=1)
    x = generate_activations(3, shape.hidden, seed=1)
    ids = scenario_topk_ids("correlated", 3, shape.top_k, shape.experts, seed=1)
    w = scenario_weights(3, shape.top_k, seed=1, scale=shape.routed_scaling_factor)
    ref = reference_moe(x, ids, w, weights, activation="mxfp8").output
    err = relative_error(naive_moe(x, ids, w, weights), ref)
    if not err <= 1e-9:
        raise AssertionError(f"reference vs naive rel. error {err:.3g} > 1e-9")
    return f"rel. err {err:.2e}"


def _backend_check(name: str, device: torch.device) -> Callable[[], str]:
    def check() -> str:
        backend = load_backend(name)
        if device.type == "cuda":
            shape = get_preset("dsv41-flash").shard(8)
        else:
            shape = get_preset("dsv41-flash", hidden=256, intermediate=128, experts=16).shard(1)
        weights = generate_expert_weights(shape, seed=2, device=device)
        rows = 4
        x = generate_activations(rows, shape.hidden, seed=2, device=device)
        ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=2).to(device)
        w = scenario_weights(rows, shape.top_k, seed=2, scale=shape.routed_scaling_factor).to(device)
        oracle = reference_moe(x, ids, w, weights, activation=backend.oracle).output
        out = backend.forward(backend.prepare(weights, shape), x, ids, w)
        err = relative_error(out, oracle)
        if not err <= backend.tolerance:
            raise AssertionError(f"rel. error {err:.3g} vs the {backend.oracle} oracle > {backend.tolerance:g}")
        return f"{shape.describe()}, {rows} rows: rel. err {err:.2e} ({backend.oracle} oracle)"

    return check


def run_checks(device: torch.device) -> list[CheckResult]:
    """Run every check item on `device` (see module docstring)."""
    items: list[tuple[str, Callable[[], str]]] = [
        ("mxfp8 codec round trip", lambda: _codec_roundtrip(quantize_mxfp8, dequantize_mxfp8, 0.05)),
        ("mxfp4 codec round trip", lambda: _codec_roundtrip(quantize_mxfp4, dequantize_mxfp4, 0.2)),
        ("route record invariants", _record_invariants),
        ("reference vs naive loop (CPU, fp64)", _reference_vs_naive),
    ]
    for name, reason in available_backends(device).items():
        if reason is None:
            items.append((f"backend {name} vs oracle ({device.type})", _backend_check(name, device)))
    results = []
    for name, fn in items:
        try:
            results.append(CheckResult(name, True, fn()))
        except Exception as error:  # noqa: BLE001 - every failure is a result
            results.append(CheckResult(name, False, f"{type(error).__name__}: {error}"))
    return results


def skipped_backends(device: torch.device) -> dict[str, str]:
    """Backends the check does not run on `device`, with the reason."""
    return {n: r for n, r in available_backends(device).items() if r is not None}
