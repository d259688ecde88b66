"""Time the fused front against the separate chain under CUDA graphs on the GPU.

For each preset (default dsv41-flash: E 384, top-6, H 5120) and rows
1..8, one graph holds N back-to-back calls of each variant; reports the
median per call (p10/p90 over replays) of:

    front           the fused front (top-k + MXFP8 x + route record), one launch
    route           the route kernel alone (on the chain's top-k ids)
    quantize+route  the quantize kernel then the route kernel
    chain           torch router reference + quantize + route (for context:
                    about 30 small torch kernels)

and, with --after-producer, each call behind a producer kernel that writes
the logits (as the gate GEMM would), minus the producer alone: the latency a
step sees when the front waits on its input (PDL). Target (issue 5 item 1):
front <= route + 1 us at rows 1-8.

    PYTHONPATH=$PWD python3 scripts/time_front.py [--presets dsv41-flash,dsv4-pro]
        [--rows 1,2,4,6,8] [--calls 100] [--after-producer] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from arg_types import int_list, name_list, new_file, positive_int  # scripts/ (this script's folder, first on sys.path)

from moebench.bench.timing import time_graph as bench_time_graph
from moebench.formats import generate_activations
from moebench.kernels.front import FrontConfig, launch_front
from moebench.kernels.quantize import launch_quantize_mxfp8
from moebench.kernels.route import launch_route
from moebench.models import PRESETS, get_preset
from moebench.record import max_ctas, route_words
from moebench.routing import RouterConfig, route


def time_graph(fn, n_calls: int, replays: int = 30) -> tuple[float, float, float]:
    """(median, p10, p90) microseconds per call of a graph of n_calls calls of `fn`
    (moebench.bench.timing.time_graph)."""
    t = bench_time_graph(lambda: [fn() for _ in range(n_calls)], warmup=1, replays=replays, calls_per_replay=n_calls)
    return t.median_us, t.p10_us, t.p90_us


def bench(preset: str, rows: int, calls: int, after_producer: bool) -> list[dict]:
    shape = get_preset(preset)
    e, k, h = shape.experts, shape.top_k, shape.hidden
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(rows)
    bias = (0.1 * torch.randn(e, generator=gen)).to(dev)
    config = FrontConfig(bias, scale=shape.routed_scaling_factor)
    router = RouterConfig(e, k, shape.routed_scaling_factor, bias)
    x = generate_activations(rows, h, seed=rows, device=dev)
    src = (2 * torch.randn(rows, e, generator=gen)).to(dev)
    logits = src.clone()
    ids = route(logits, router)[1]
    ctas = max_ctas(rows, k, e)

    def i32(*s):
        return torch.empty(*s, dtype=torch.int32, device=dev)

    topk_ids, record, permuted = i32(rows, k), i32(route_words(ctas)), i32(rows, k)
    topk_w = torch.empty(rows, k, dtype=torch.float32, device=dev)
    x_q = torch.empty(rows, h, dtype=torch.uint8, device=dev)
    x_s = torch.empty(rows, h // 32, dtype=torch.uint8, device=dev)

    def producer():
        torch.add(src, 0, out=logits)

    variants = {
        "front": lambda: launch_front(x, logits, config, k, None, topk_ids, topk_w, x_q, x_s, record, permuted),
        "route": lambda: launch_route(ids, record, permuted, e),
        "quantize+route": lambda: (launch_quantize_mxfp8(x, x_q, x_s), launch_route(ids, record, permuted, e)),
        "chain": lambda: (launch_quantize_mxfp8(x, x_q, x_s),
                          launch_route(route(logits, router)[1], record, permuted, e)),
    }  # fmt: skip
    out = []
    base = time_graph(producer, calls)[0] if after_producer else 0.0
    for name, fn in variants.items():
        med, p10, p90 = time_graph(fn, calls)
        row = dict(preset=preset, rows=rows, variant=name, median_us=med, p10_us=p10, p90_us=p90)
        if after_producer:
            row["after_producer_us"] = time_graph(lambda fn=fn: (producer(), fn()), calls)[0] - base
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--presets", default="dsv41-flash", type=name_list(sorted(PRESETS)), help="presets, comma-separated"
    )
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8", type=int_list(range(1, 9)), help="token rows (1-8)")
    ap.add_argument("--calls", type=positive_int, default=100, help="calls per graph")
    ap.add_argument(
        "--after-producer",
        action="store_true",
        help="also time each call behind a logits-producing kernel (minus that kernel)",
    )
    ap.add_argument("--out", default=None, type=new_file, help="write the results as JSON here (a new file)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_front.py needs a CUDA GPU")
    t0 = time.time()
    results = []
    print(f"{torch.cuda.get_device_name()}")
    for preset in args.presets:
        for rows in args.rows:
            rs = bench(preset, rows, args.calls, args.after_producer)
            results += rs
            by = {r["variant"]: r for r in rs}
            line = "  ".join(f"{v} {r['median_us']:6.2f}" for v, r in by.items())
            if args.after_producer:
                line += "  | after producer: " + "  ".join(f"{v} {r['after_producer_us']:6.2f}" for v, r in by.items())
            verdict = "OK" if by["front"]["median_us"] <= by["route"]["median_us"] + 1.0 else "SLOW"
            print(f"{preset} rows {rows}: {line} us  (front <= route + 1 us: {verdict})")
    if args.out:
        with open(args.out, "x") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
