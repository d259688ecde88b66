"""Where the fused layer's time goes: each CTA's %globaltimer stamps
(`kernels.fused.TRACE_STAMPS`) of one traced launch, and the variants of
its tactic timed side by side with the pair in one run.

For a preset at each TP and row count (correlated routing, the layer's real
expert count), a rotation of 16 layer calls with different experts (seeds
0-15) is timed under one CUDA graph, route kernel included, for the pair
(`RoutedExpertGemm`, the tables' tactics) and for each fused variant: the
built-in tactic, its resident loads issued `lead` GEMM1 steps before
GEMM1's last issue (--leads), resident 0 (all of GEMM2 on the ring) and
GEMM1 with the pair's rows 1-2 unroll and stages (G1_VARIANTS), and the
GEMM1 / GEMM2 tactics named by --g1 / --g2 in place of the built-in's.
Then one traced launch of each variant (call 0 of the rotation) prints the
stamps over the CTAs (min / median / max µs after the first CTA's start)
and the CTA that finished last.

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/fused_trace.py \
        --preset dsv41-flash --tp 4,8 --rows 1,2,8 [--leads 0,8] [--g1 NAMES] [--g2 NAMES] [--out F.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from arg_types import int_list, new_file  # scripts/ (this script's folder, first on sys.path)

from moebench.bench.timing import time_graph
from moebench.formats import generate_activations, generate_expert_weights
from moebench.kernels.binding import RoutedExpertGemm
from moebench.kernels.fused import TRACE_STAMPS, default_fused_tactic, fused_layer, fused_workspace_bytes
from moebench.kernels.gemm import alloc_workspace
from moebench.kernels.tactic import GemmTactic
from moebench.models import get_preset
from moebench.record import TILE, max_ctas
from moebench.routing import scenario_topk_ids

CALLS = 16
G1_VARIANTS = (GemmTactic(16, 4, 4, 8, 1, stages=3, fp8=True),)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _tactics(text: str) -> list[GemmTactic]:
    try:
        return [GemmTactic.from_name(v) for v in text.split(",") if v]
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated GEMM tactic names: {error}") from None


def stamps_summary(trace: torch.Tensor) -> dict:
    """Per stamp: (min, median, max) µs after the earliest start over the CTAs
    that have it, and the stamps of the CTA whose GEMM2 ended last."""
    t = trace.cpu().double()
    t0 = t[:, 0][t[:, 0] >= 0].min()
    out = {}
    for k, name in enumerate(TRACE_STAMPS):
        col = t[:, k][t[:, k] >= 0]
        if col.numel():
            us = (col - t0) / 1e3
            out[name] = (round(us.min().item(), 2), round(us.median().item(), 2), round(us.max().item(), 2))
    last = int(torch.argmax(t[:, TRACE_STAMPS.index("gemm2_done")]))
    out["last_cta"] = {"cta": last, **{n: round((t[last, k] - t0).item() / 1e3, 2) for k, n in enumerate(TRACE_STAMPS)
                                        if t[last, k] >= 0}}  # fmt: skip
    return out


def run_case(preset: str, tp: int, rows_list: list[int], leads: list[int], g1s=(), g2s=()) -> list[dict]:
    shape = get_preset(preset).shard(tp)
    experts, top_k = shape.config.experts, shape.config.top_k
    weights = generate_expert_weights(shape, seed=0, device="cuda")
    layer = RoutedExpertGemm(weights, top_k, None, fp8=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for rows in rows_list:
        ids = [scenario_topk_ids("correlated", rows, top_k, experts, seed=j).cuda() for j in range(CALLS)]
        xs = [generate_activations(rows, shape.hidden, seed=j, device="cuda") for j in range(CALLS)]
        w = torch.rand(rows, top_k, device="cuda")
        ctas = max_ctas(rows, top_k, experts)
        ft = default_fused_tactic(shape, ctas, sms)
        variants = {"pair": None}
        if ft is not None:
            variants[ft.name] = ft
            for lead in leads:
                v = dataclasses.replace(ft, lead=lead)
                variants[v.name] = v
            v = dataclasses.replace(ft, resident=0)
            variants[v.name] = v
            for g1 in (*G1_VARIANTS, *g1s):  # G1_VARIANTS: the pair's rows 1-2 GEMM1 (unroll 8, 3 stages)
                v = dataclasses.replace(ft, gemm1=g1)
                if v.why_invalid(shape) is None:
                    variants[v.name] = v
                else:
                    print(f"# {v.name}: {v.why_invalid(shape)}", flush=True)
            for g2 in g2s:
                v = dataclasses.replace(ft, gemm2=g2)
                if v.why_invalid(shape) is None:
                    variants[v.name] = v
                else:
                    print(f"# {v.name}: {v.why_invalid(shape)}", flush=True)
        n = TILE * ctas
        h_q = torch.empty(n, layer.kw.intermediate, dtype=torch.uint8, device="cuda")
        h_s = torch.empty(n, layer.kw.intermediate // 32, dtype=torch.uint8, device="cuda")
        out = torch.empty(n, layer.kw.hidden, dtype=torch.bfloat16, device="cuda")
        ws = alloc_workspace(fused_workspace_bytes(ctas), "cuda")

        def fused_call(r, tactic, trace=None):
            fused_layer(layer.kw, r.x_quant, r.x_scale, r.record, r.ctas, h_q, h_s, out,
                        tactic=tactic, workspace=ws, trace=trace)  # fmt: skip

        def calls(tactic):
            def fn():
                for j in range(CALLS):
                    r = layer.route(xs[j], ids[j], w)
                    layer.gemms(r) if tactic is None else fused_call(r, tactic)

            return fn

        for name, tactic in variants.items():
            timing = time_graph(calls(tactic), warmup=5, replays=50, calls_per_replay=CALLS)
            row = {"preset": preset, "tp": tp, "rows": rows, "variant": name, "us": round(timing.median_us, 2)}
            if tactic is not None:
                trace = torch.empty(sms, len(TRACE_STAMPS), dtype=torch.int64, device="cuda")
                fused_call(layer.route(xs[0], ids[0], w), tactic, trace)
                torch.cuda.synchronize()
                row["stamps"] = stamps_summary(trace)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--preset", default="dsv41-flash", help="a preset of `moebench presets` (default: dsv41-flash)")
    ap.add_argument("--tp", type=int_list((1, 2, 4, 8)), default=[4, 8], help="TP degrees of 1, 2, 4, 8 (4,8)")
    ap.add_argument("--rows", type=int_list(range(1, 9)), default=[1, 2, 8], help="token rows of 1-8 (1,2,8)")
    ap.add_argument("--leads", type=_ints, default=[0, 8], help="`lead` variants to time, >= 0 (0,8)")
    ap.add_argument("--g1", type=_tactics, default=[], help="more GEMM1 tactics (names, e.g. r16_m4_k4_u8_c1_b3_f8)")
    ap.add_argument("--g2", type=_tactics, default=[], help="more GEMM2 tactics (names, e.g. r16_m16_k1_u2_c1_b4_f8)")
    ap.add_argument("--out", default=None, type=new_file, help="write the rows as JSON here (must not exist)")
    args = ap.parse_args()
    from moebench.models import PRESETS

    if args.preset not in PRESETS:
        ap.error(f"--preset must be one of {', '.join(sorted(PRESETS))}, got {args.preset!r}")
    if any(v < 0 for v in args.leads):
        ap.error(f"--leads must be >= 0, got {args.leads}")
    if not torch.cuda.is_available():
        raise SystemExit("fused_trace.py needs a CUDA GPU")
    results = [row for tp in args.tp for row in run_case(args.preset, tp, args.rows, args.leads, args.g1, args.g2)]
    if args.out:
        with open(args.out, "x") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
