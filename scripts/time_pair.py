"""Time the fused GEMM1 + GEMM2 launch (`gemm.gemm_pair`) against the two
launches, cold L2 (weight sets rotated as in time_gemms.py), correlated
routing as `moebench sweep` draws it (seed 0), fp8 tactics:

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/time_pair.py \
        --preset dsv41-flash --tp 4,8 --rows 1,4,6,8

Per (TP, rows): the two launches with the fp8 defaults (GEMM1 default +
GEMM2 default), the two launches with the fused pair's tactics, and the
fused launch; µs, GB/s over the unique bytes, % of the measured copy
bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from moebench.formats import generate_activations, quantize_mxfp8
from moebench.kernels.gemm import alloc_workspace, gemm1, gemm2, gemm_pair, pair_workspace_bytes
from moebench.kernels.tactic import GemmShape, default_fp8_tactic, fused_gemm2_tactic
from moebench.models import get_preset
from moebench.record import TILE, build_route_record
from moebench.routing import scenario_topk_ids

from time_gemms import L2_BYTES, copy_bandwidth, random_kernel_weights, time_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dsv41-flash")
    ap.add_argument("--tp", default="4,8")
    ap.add_argument("--rows", default="1,4,6,8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_pair.py needs a CUDA GPU")
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    for tp in (int(t) for t in args.tp.split(",")):
        shape = get_preset(args.preset).shard(tp)
        gs = GemmShape.of(shape)
        h, i = shape.hidden, shape.intermediate
        per1 = 2 * i * h // 2 + 2 * i * h // 32
        per2 = h * i // 2 + h * i // 32
        rows_list = [int(r) for r in args.rows.split(",")]
        ids_by_rows = {r: scenario_topk_ids("correlated", r, shape.top_k, shape.experts, 0) for r in rows_list}
        min_touched = min(len(set(v.flatten().tolist())) for v in ids_by_rows.values())
        n_sets = max(2, math.ceil(4 * L2_BYTES / (min_touched * (per1 + per2))))
        sets = [dataclasses.replace(random_kernel_weights(shape, seed=s), operand="e4m3") for s in range(n_sets)]
        for rows in rows_list:
            ids = ids_by_rows[rows]
            touched = len(set(ids.flatten().tolist()))
            route = build_route_record(ids.cuda(), shape.experts)
            t1 = default_fp8_tactic(gs, 1, route.ctas)
            d2 = default_fp8_tactic(gs, 2, route.ctas)
            f2 = fused_gemm2_tactic(gs, t1)
            ws = alloc_workspace(pair_workspace_bytes(route.ctas), "cuda")
            x_q, x_s = quantize_mxfp8(generate_activations(rows, h, seed=0, device="cuda"))
            n, used = TILE * route.ctas, TILE * route.tiles_used
            h_q = torch.zeros(n, i, dtype=torch.uint8, device="cuda")
            h_s = torch.zeros(n, i // 32, dtype=torch.uint8, device="cuda")
            out = torch.zeros(n, h, dtype=torch.bfloat16, device="cuda")
            nbytes = touched * (per1 + per2) + rows * (h + h // 32) + 2 * used * (i + i // 32) + used * h * 2

            def two(t2):
                return lambda: [(gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1),
                                 gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2)) for kw in sets]

            def fused():
                return [gemm_pair(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, out, tactic1=t1, tactic2=f2,
                                  workspace=ws) for kw in sets]

            cases = [(f"two {t1.name}+{d2.name}", two(d2))]
            if f2 is not None:
                cases += [(f"two {t1.name}+{f2.name}", two(f2)), (f"fused {t1.name}+{f2.name}", fused)]
            for label, fn in cases:
                med, p10, p90 = time_graph(fn, n_sets)
                gbps = nbytes / (med * 1e-6) / 1e9
                print(f"{args.preset} TP{tp} rows {rows} ({touched:2d} experts) {label:58s} {med:7.2f} us"
                      f" [{p10:6.2f},{p90:6.2f}] {nbytes / 1e6:6.1f} MB {gbps:6.0f} GB/s {100 * gbps / copy_gbps:5.1f}%",
                      flush=True)
            assert int(ws.view(torch.int32).abs().sum()) == 0, "fused pair left its counters non-zero"
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
