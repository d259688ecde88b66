"""The kernel timeline of our layer call inside one CUDA-graph replay: each
launch's start, duration and the gap to the previous launch's end (negative:
programmatic dependent launch overlapped them), from the profiler's (CUPTI)
kernel records, for the sweep's exact cases (routing, weights, layer
rotation: seed 0, `moebench sweep` defaults).

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/timeline.py \
        --preset dsv41-flash --tp 4 --rows 4,6,8 --tactics fp8,default [--routed]

Prints per case the per-kernel medians over the rotation's layers (duration,
gap before it) and the replay's span per layer; `--events` also prints every
launch of one replay. `--routed` drops the finalize (route + GEMM1 + GEMM2); `--gemms-only` also
drops the route kernel (each layer's routing built once, before capture:
GEMM1 then follows the previous layer's GEMM2 directly), which bounds what
taking the route off GEMM1's critical path could save.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from arg_types import int_list  # scripts/ (this script's folder, first on sys.path)
from torch.profiler import ProfilerActivity, profile

from moebench.backends.moebench import MoebenchBackend
from moebench.bench.cases import unique_bytes
from moebench.bench.sweep import LAYER_SEED_STRIDE, layer_count
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import PRESETS, get_preset
from moebench.routing import SCENARIOS, scenario_topk_ids, scenario_weights

SHORT = (
    ("quantize", "quant"),
    ("Route", "route"),
    ("route", "route"),
    ("Gemm", "gemm"),
    ("gemm", "gemm"),
    ("inaliz", "finalize"),
    ("Front", "front"),
)


def short(name: str) -> str:
    for key, label in SHORT:
        if key in name:
            return label
    return name[:40]


def kernel_events(fn, replays: int = 3):
    """(name, start_us, end_us) of every kernel of the last of `replays` graph replays of fn."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() >= 0]
    events = sorted(events, key=lambda e: e.time_range.start)
    # the replays are separated by a host sync: split on gaps > 20 µs, keep the last
    groups, cur, last_end = [], [], None
    for e in events:
        if last_end is not None and e.time_range.start - last_end > 20:
            groups.append(cur)
            cur = []
        cur.append(e)
        last_end = max(last_end or 0, e.time_range.end)
    groups.append(cur)
    last = groups[-1]
    return [(e.name, e.time_range.start, e.time_range.end) for e in last]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dsv41-flash", choices=sorted(PRESETS))
    ap.add_argument("--tp", type=int, default=4, choices=(1, 2, 4, 8))
    ap.add_argument("--rows", default="4,6,8", type=int_list(range(1, 9)), help="token rows (1-8)")
    ap.add_argument("--tactics", default="fp8")
    ap.add_argument("--scenario", default="correlated", choices=[s for s in SCENARIOS if s != "replay"])
    ap.add_argument("--routed", action="store_true", help="route + GEMM1 + GEMM2 only (no finalize)")
    ap.add_argument(
        "--gemms-only",
        action="store_true",
        help="GEMM1 + GEMM2 only, on routings built before capture (no route kernel)",
    )
    ap.add_argument("--events", action="store_true", help="print every launch of the replay")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("timeline.py needs a CUDA GPU")
    shape = get_preset(args.preset).shard(args.tp)
    rows_list = args.rows
    backend = MoebenchBackend()
    # the sweep's rotation: layers sized by its default rows 1, 2, 4, 6, 8 and these
    routings = {
        r: scenario_topk_ids(args.scenario, r, shape.top_k, shape.experts, 0)
        for r in sorted({1, 2, 4, 6, 8, *rows_list})
    }
    min_touched = min(unique_bytes(shape, ids) for ids in routings.values())
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    layers, _ = layer_count(min_touched, l2, 1, None)
    weights = [generate_expert_weights(shape, LAYER_SEED_STRIDE * layer, "cuda") for layer in range(layers)]
    for tactic in args.tactics.split(","):
        prepared = [backend.prepare(w, shape, tactic) for w in weights]
        for rows in rows_list:
            ids = routings[rows].cuda()
            w = scenario_weights(rows, shape.top_k, 0, scale=shape.routed_scaling_factor).cuda()
            x = generate_activations(rows, shape.hidden, 0, "cuda")
            if args.gemms_only:
                routed = [(p, p.route(x, ids, w)) for p in prepared]
                calls = [lambda p=p, r=r: p.gemms(r) for p, r in routed]
            elif args.routed:
                calls = [backend.routed_call(p, x, ids, w) for p in prepared]
            else:
                calls = [lambda p=p: backend.forward(p, x, ids, w) for p in prepared]
            ev = kernel_events(lambda: [c() for c in calls])
            t0 = ev[0][1]
            span = (max(e[2] for e in ev) - t0) / layers
            per: dict[str, list] = {}
            prev_end = None
            for name, s, e in ev:
                k = short(name)
                gap = None if prev_end is None else s - prev_end
                per.setdefault(k, []).append((e - s, gap))
                prev_end = e
            print(
                f"\n{args.preset} TP{args.tp} rows {rows} {tactic}: {len(ev)} launches, {layers} layers,"
                f" {span:.2f} µs per layer (first start to last end / layers), {unique_bytes(shape, ids.cpu()) / 1e6:.1f} MB"
            )
            for k, vals in per.items():
                durs = [d for d, _ in vals]
                gaps = [g for _, g in vals if g is not None]
                print(
                    f"  {k:10s} n={len(vals):3d} dur median {statistics.median(durs):6.2f} µs"
                    f" [min {min(durs):6.2f} max {max(durs):6.2f}]  gap before median"
                    f" {statistics.median(gaps) if gaps else float('nan'):6.2f} µs"
                )
            if args.events:
                for name, s, e in ev:
                    print(f"    {s - t0:9.2f} {e - s:7.2f}  {short(name)}")


if __name__ == "__main__":
    main()
