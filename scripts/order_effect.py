"""Does a sweep case's time depend on what ran before it in the process?

Runs the same one-case sweep (`moebench sweep --rows R --tp T --backends
moebench --tactics fp8`, dsv41-flash, correlated) several times in ONE process
and prints each run's layer-call and routed-path µs, optionally after other
row counts or after a large allocation that the caching allocator keeps (so
the case's buffers land in a recycled segment instead of fresh cudaMallocs).

    python scripts/order_effect.py --rows 4 --repeat 3
    python scripts/order_effect.py --rows 4 --before 1,2 --repeat 2
    python scripts/order_effect.py --rows 4 --dummy-gb 40 --repeat 2
"""

from __future__ import annotations

import argparse
import time

import torch

from moebench.bench.cases import SweepConfig
from moebench.bench.sweep import run_sweep


def _one(rows: int, tp: int, preset: str, tag: str) -> None:
    config = SweepConfig(presets=(preset,), tp=(tp,), rows=(rows,), backends=("moebench",), tactics=("fp8",),
                         device="cuda:0")
    start = time.perf_counter()
    row = run_sweep(config).frame.iloc[0]
    print(f"{tag:>10} rows {rows}: {row['status']} layer call {row['median_us']:.2f} µs, routed "
          f"{row['routed_us']:.2f} µs ({time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--preset", default="dsv41-flash")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default="", help="row counts to run first, e.g. 1,2")
    ap.add_argument("--dummy-gb", type=float, default=0.0, help="allocate and free this many GB first")
    args = ap.parse_args()
    if args.dummy_gb > 0:
        x = torch.empty(int(args.dummy_gb * 1e9), dtype=torch.uint8, device="cuda")
        x.fill_(0)
        del x  # kept by the caching allocator: later buffers are carved from this segment
        print(f"allocated and freed {args.dummy_gb} GB (reserved {torch.cuda.memory_reserved() / 1e9:.1f} GB)")
    for r in (int(v) for v in args.before.split(",") if v):
        _one(r, args.tp, args.preset, "before")
    for i in range(args.repeat):
        _one(args.rows, args.tp, args.preset, f"run {i}")


if __name__ == "__main__":
    main()
