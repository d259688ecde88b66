"""Time GEMM1, GEMM2 and both under CUDA graphs on the GPU (cold L2).

For dsv41-flash (real E = 384) at TP4 and TP8, correlated routing, rows
1, 2, 4, 6, 8: one graph replays the kernels over enough distinct weight sets
(random kernel-layout bytes, realistic E8M0 scales) that the weights touched
per replay are >= 4x the 60 MB L2. Reports the median per call (p10/p90 over
replays), GB/s over the unique bytes (logical weights + scales of the touched
experts + activations in and out) and % of the 4215 GB/s copy bandwidth.

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/time_gemms.py [--out F.json]
        [--tp 4,8] [--rows 1,2,4,6,8] [--variants] [--bulk] [--split-k] [--act-bf16] [--fp8] [--fp8-bulk]

Needs an sm_90 GPU with nvidia-cutlass-dsl (exits with a message otherwise).

--variants adds alternative tactics (split-K ones included); --bulk adds the
bulk-copy load path variants (BULK_1 / BULK_2); --split-k adds only the split-K variants (SPLIT_K_1 / SPLIT_K_2 below, those valid for the
shape). Split-K launches share one zeroed workspace per shape, allocated
once before any graph is captured. --act-bf16 adds, for every tactic timed,
its act_bf16 twin (`_a16`: BF16 activations x_deq / h_deq, dequantized once
before capture; GEMM1 also writes h_deq), and "both" for each a16 pair of
the defaults; bytes are counted as for the MXFP8 operand (same logical
bytes, so GB/s compare directly). --fp8 adds the fp8 (wgmma) tactics
F8_1 / F8_2 valid for the shape and the fp8 default (`default_fp8_tactic`),
and "both" for every fp8 pair (the random weight bytes serve either layout).
--fp8-bulk does the same with the fp8 tactics on the bulk ring
(F8_BULK_1 / F8_BULK_2, v11).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
from arg_types import int_list, new_file  # scripts/ (this script's folder, first on sys.path)

from moebench.bench import L2_MULTIPLE
from moebench.bench.timing import time_graph as bench_time_graph
from moebench.formats import generate_activations, quantize_mxfp8
from moebench.kernels.gemm import act_to_bf16, alloc_workspace, gemm1, gemm2
from moebench.kernels.layout import KernelWeights
from moebench.kernels.tactic import GemmShape, GemmTactic, default_fp8_tactic, default_tactic, workspace_bytes_for
from moebench.models import get_preset
from moebench.record import TILE, build_route_record
from moebench.routing import scenario_topk_ids
from moebench.tuning import space as tuning_space

#: Split-K variants (v3, docs/perf-notes.md): GEMM1 at 3 CTAs/SM x 4 warps (the
#: rows 6/8 default, K split 2 / 4 ways) and 1 x 8 warps split 4 (the rows 1-2
#: default; 2 x 8 warps x unroll 2 split 4 spills at 128 registers, left out);
#: GEMM2 512-row items split 2 / 3 (TP8: 9 K chunks, only 3 divides) and
#: 128-row items split 2.
SPLIT_K_1 = [GemmTactic(64, 1, 4, 4, 3, split_k=2), GemmTactic(64, 1, 4, 4, 3, split_k=4),
             GemmTactic(64, 1, 8, 4, 1, split_k=4)]  # fmt: skip
SPLIT_K_2 = [GemmTactic(64, 8, 1, 2, 2, split_k=2), GemmTactic(64, 8, 1, 2, 2, split_k=3),
             GemmTactic(32, 4, 1, 4, 4, split_k=2, persistent=False)]  # fmt: skip
#: Bulk-copy load path variants (v4, docs/perf-notes.md): a producer warp
#: streams each item's K slabs into a ring of shared-memory stages.
BULK_1 = [GemmTactic(64, 1, 8, 2, 2, stages=4), GemmTactic(64, 1, 8, 2, 1, stages=8),
          GemmTactic(64, 1, 4, 4, 2, stages=4), GemmTactic(64, 1, 4, 2, 3, stages=4),
          GemmTactic(64, 1, 8, 1, 2, stages=6), GemmTactic(64, 2, 4, 2, 2, stages=3)]  # fmt: skip
BULK_2 = [GemmTactic(64, 8, 1, 2, 2, stages=4), GemmTactic(64, 1, 8, 2, 2, stages=4),
          GemmTactic(64, 4, 2, 2, 2, stages=4), GemmTactic(64, 8, 1, 1, 2, stages=6),
          GemmTactic(32, 8, 1, 2, 3, stages=4), GemmTactic(64, 2, 4, 2, 2, stages=4)]  # fmt: skip
#: fp8 (wgmma) variants (v7, docs/perf-notes.md): one or two warpgroups of
#: 32-row warps, K split over 1-4 of them, 1-3 CTAs/SM, split-K.
F8_1 = [GemmTactic(32, 4, 2, 4, 2, fp8=True), GemmTactic(32, 4, 2, 4, 2, split_k=2, fp8=True),
        GemmTactic(32, 4, 2, 4, 2, split_k=4, fp8=True), GemmTactic(32, 4, 1, 4, 3, split_k=4, fp8=True),
        GemmTactic(32, 4, 2, 2, 2, split_k=4, fp8=True), GemmTactic(32, 4, 1, 2, 4, split_k=2, fp8=True),
        GemmTactic(32, 4, 4, 4, 1, fp8=True), GemmTactic(32, 4, 1, 2, 4, split_k=4, fp8=True)]  # fmt: skip
F8_2 = [GemmTactic(32, 4, 1, 3, 4, fp8=True), GemmTactic(32, 4, 1, 3, 4, split_k=2, fp8=True),
        GemmTactic(32, 4, 1, 3, 3, fp8=True), GemmTactic(32, 8, 1, 3, 2, fp8=True),
        GemmTactic(32, 4, 2, 3, 2, fp8=True)]  # fmt: skip
#: fp8 tactics on the bulk ring (v11, warp-specialized: a producer warp streams the
#: weights, the warpgroups decode from shared memory): 32- / 16-row warps, one to
#: four warpgroups, 1-4 CTAs/SM, 2-6 stages.
# The measured warp-specialized fp8 variants live with the tuner's FP8 space (one list for both).
F8_BULK_1, F8_BULK_2 = list(tuning_space.F8_BULK_1), list(tuning_space.F8_BULK_2)
COPY_GBPS = 4215.0
L2_BYTES = 60e6
TOP_K = 6


def random_kernel_weights(shape, seed: int) -> KernelWeights:
    """Random MXFP4 bytes in the kernel layout (codes are arbitrary nibbles), E8M0 in 116..124."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, i, e = shape.hidden, shape.intermediate, shape.experts

    def codes(*s):
        return torch.randint(0, 256, s, generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)

    def scales(*s):
        return torch.randint(116, 125, s, generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)

    return KernelWeights(
        codes(e, 2 * i // 32, h // 32, 32, 16), scales(e, 2 * i // 32, h // 32, 8, 4),
        codes(e, h // 32, i // 32, 32, 16), scales(e, h // 32, i // 32, 8, 4),
        torch.full((e,), shape.swiglu_limit, device="cuda"), h, i, shape.padded_intermediate, 124, 116,
    )  # fmt: skip


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device copy (read + write), median of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    return 2 * a.numel() / sorted(ts[2:])[len(ts[2:]) // 2] / 1e9


def time_graph(fn, n_calls: int, replays: int = 30) -> tuple[float, float, float]:
    """(median, p10, p90) microseconds per call of a graph of `fn` (n_calls calls;
    moebench.bench.timing.time_graph)."""
    t = bench_time_graph(fn, warmup=1, replays=replays, calls_per_replay=n_calls)
    return t.median_us, t.p10_us, t.p90_us


def bench_shape(
    tp: int,
    rows_list,
    variants: bool,
    split_k: bool,
    results: list,
    bulk: bool = False,
    act_bf16: bool = False,
    fp8: bool = False,
    fp8_bulk: bool = False,
) -> None:
    shape = get_preset("dsv41-flash").shard(tp)
    gs = GemmShape.of(shape)
    h, i = shape.hidden, shape.intermediate
    per_expert_1 = 2 * i * h // 2 + 2 * i * h // 32
    per_expert_2 = h * i // 2 + h * i // 32
    ids_by_rows = {r: scenario_topk_ids("correlated", r, TOP_K, shape.experts, seed=r) for r in rows_list}
    min_touched = min(len(set(v.flatten().tolist())) for v in ids_by_rows.values())
    n_sets = max(2, math.ceil(L2_MULTIPLE * L2_BYTES / (min_touched * (per_expert_1 + per_expert_2))))
    n_sets = min(n_sets, int(40e9 // (shape.experts * (per_expert_1 + per_expert_2))))
    sets = [random_kernel_weights(shape, seed=s) for s in range(n_sets)]
    extra1, extra2 = [], []
    if variants:
        np_ = dict(persistent=False)
        extra1 += [GemmTactic(64, 1, 4, 4, 3, **np_), GemmTactic(64, 1, 4, 4, 4, **np_),
                GemmTactic(64, 1, 8, 2, 2, **np_), GemmTactic(64, 1, 8, 4, 1, **np_),
                GemmTactic(64, 1, 4, 4, 3), GemmTactic(64, 1, 4, 2, 4, **np_)]  # fmt: skip
        extra2 += [GemmTactic(64, 8, 1, 2, 2, **np_), GemmTactic(32, 8, 1, 4, 2, **np_),
                GemmTactic(64, 4, 2, 2, 2, **np_), GemmTactic(64, 8, 1, 2, 2),
                GemmTactic(32, 4, 1, 4, 4, **np_), GemmTactic(64, 4, 1, 3, 4, **np_)]  # fmt: skip
    if bulk:
        extra1 += [t for t in BULK_1 if t.valid_for(gs, 1) is None]
        extra2 += [t for t in BULK_2 if t.valid_for(gs, 2) is None]
    if variants or split_k:
        extra1 += [t for t in SPLIT_K_1 if t.valid_for(gs, 1) is None]
        extra2 += [t for t in SPLIT_K_2 if t.valid_for(gs, 2) is None]
    # one zeroed workspace for every split-K launch of this shape (allocated
    # once, outside any capture; the kernels leave its counters at zero)
    ctas_max = max(build_route_record(v.cuda(), shape.experts).ctas for v in ids_by_rows.values())
    f8_list1 = (F8_1 if fp8 else []) + (F8_BULK_1 if fp8_bulk else [])
    f8_list2 = (F8_2 if fp8 else []) + (F8_BULK_2 if fp8_bulk else [])
    fp8 = fp8 or fp8_bulk
    f8_1 = [t for t in f8_list1 if t.valid_for(gs, 1) is None]
    f8_2 = [t for t in f8_list2 if t.valid_for(gs, 2) is None]
    need = workspace_bytes_for(
        gs, [(1, t, ctas_max) for t in extra1 + f8_1] + [(2, t, ctas_max) for t in extra2 + f8_2]
    )
    ws = alloc_workspace(need, "cuda") if need else None
    for rows in rows_list:
        ids = ids_by_rows[rows]
        touched = len(set(ids.flatten().tolist()))
        route = build_route_record(ids.cuda(), shape.experts)
        t1s = [default_tactic(gs, 1, route.ctas)] + [t for t in extra1 if t != default_tactic(gs, 1, route.ctas)]
        t2s = [default_tactic(gs, 2, route.ctas)] + [t for t in extra2 if t != default_tactic(gs, 2, route.ctas)]
        base1, base2 = list(t1s), list(t2s)
        if act_bf16:  # the a16 twin of every tactic, right after the MXFP8 ones
            t1s += [dataclasses.replace(t, act_bf16=True) for t in base1]
            t2s += [dataclasses.replace(t, act_bf16=True) for t in base2]
        f8d = {}
        if fp8:
            for stage, ts, extra in ((1, t1s, f8_1), (2, t2s, f8_2)):
                try:
                    f8d[stage] = default_fp8_tactic(gs, stage, route.ctas)
                    ts.append(f8d[stage])
                except ValueError as error:
                    print(f"TP{tp} rows {rows}: no fp8 GEMM{stage} tactic: {error}")
                ts += [t for t in extra if t.valid_for(gs, stage) is None and t != f8d.get(stage)]
        x_q, x_s = quantize_mxfp8(generate_activations(rows, h, seed=rows, device="cuda"))
        n = TILE * route.ctas
        used = TILE * route.tiles_used
        h_q = torch.zeros(n, i, dtype=torch.uint8, device="cuda")
        h_s = torch.zeros(n, i // 32, dtype=torch.uint8, device="cuda")
        out = torch.zeros(n, h, dtype=torch.bfloat16, device="cuda")
        x_deq = act_to_bf16(x_q, x_s) if act_bf16 else None
        h_deq = torch.zeros(n, i, dtype=torch.bfloat16, device="cuda") if act_bf16 else None

        def g1(kw, t1):
            kw = dataclasses.replace(kw, operand="e4m3") if t1.fp8 else kw
            a16 = dict(x_deq=x_deq, h_deq_out=h_deq) if t1.act_bf16 else {}
            gemm1(kw, x_q, x_s, route.record, route.ctas, h_q, h_s, tactic=t1, workspace=ws, **a16)

        def g2(kw, t2):
            kw = dataclasses.replace(kw, operand="e4m3") if t2.fp8 else kw
            a16 = dict(h_deq=h_deq) if t2.act_bf16 else {}
            gemm2(kw, h_q, h_s, route.record, route.ctas, out, tactic=t2, workspace=ws, **a16)

        d1, d2 = t1s[0], t2s[0]
        act1 = rows * (h + h // 32) + used * (i + i // 32)
        act2 = used * (i + i // 32) + used * h * 2
        bytes1 = touched * per_expert_1 + act1
        bytes2 = touched * per_expert_2 + act2
        for t1 in t1s:
            for t2 in t2s:
                first_t2, first_t1 = t2 is t2s[0], t1 is t1s[0]
                a16_pair = (
                    t1.act_bf16
                    and t2.act_bf16
                    and dataclasses.replace(t1, act_bf16=False) == d1
                    and dataclasses.replace(t2, act_bf16=False) == d2
                )
                a16_pair = a16_pair or (t1.fp8 and t2.fp8)
                cases = []
                if first_t2:
                    cases.append(("gemm1", t1.name, bytes1, lambda t1=t1: [g1(kw, t1) for kw in sets]))
                if first_t1:
                    cases.append(("gemm2", t2.name, bytes2, lambda t2=t2: [g2(kw, t2) for kw in sets]))
                # (never a16 GEMM2 after an MXFP8 GEMM1: it would read an h_deq nobody wrote)
                if (
                    (first_t1 or first_t2 or (t1.bulk and t2.bulk) or a16_pair)
                    and (t1.act_bf16 or not t2.act_bf16)
                    and t1.fp8 == t2.fp8
                ):
                    cases.append(
                        (
                            "both",
                            f"{t1.name}+{t2.name}",
                            bytes1 + bytes2,
                            lambda t1=t1, t2=t2: [(g1(kw, t1), g2(kw, t2)) for kw in sets],
                        )
                    )
                for kernel, tactic, nbytes, fn in cases:
                    med, p10, p90 = time_graph(fn, n_sets)
                    gbps = nbytes / (med * 1e-6) / 1e9
                    rec = dict(preset="dsv41-flash", tp=tp, rows=rows, experts_touched=touched,
                               tiles=route.tiles_used, kernel=kernel, tactic=tactic, weight_sets=n_sets,
                               median_us=med, p10_us=p10, p90_us=p90, bytes=nbytes, gbps=gbps,
                               pct_copy_bw=100 * gbps / COPY_GBPS)  # fmt: skip
                    results.append(rec)
                    print(
                        f"TP{tp} rows {rows} ({touched:2d} experts) {kernel:5s} {tactic:40s} "
                        f"{med:7.2f} us [{p10:6.2f},{p90:6.2f}] {nbytes / 1e6:7.1f} MB {gbps:7.0f} GB/s "
                        f"{rec['pct_copy_bw']:5.1f}%",
                        flush=True,
                    )
    sets = ws = None  # free the weight sets before the next shape
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tp",
        default="4,8",
        type=int_list((1, 2, 4, 8)),
        help="TP degrees of dsv41-flash, comma-separated (of 1, 2, 4, 8; default 4,8)",
    )
    ap.add_argument(
        "--rows",
        default="1,2,4,6,8",
        type=int_list(range(1, 9)),
        help="token rows, comma-separated (1..8; default 1,2,4,6,8)",
    )
    ap.add_argument("--variants", action="store_true", help="also time alternative tactics (split-K included)")
    ap.add_argument("--split-k", action="store_true", help="also time the split-K variants (only those)")
    ap.add_argument("--bulk", action="store_true", help="also time the bulk-copy variants (all bulk pairs in 'both')")
    ap.add_argument(
        "--act-bf16",
        action="store_true",
        help="also time the act_bf16 (_a16) twin of every tactic, and the a16 defaults in 'both'",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="also time the fp8 (_f8) twin of every MXFP8 tactic, and the fp8 defaults in 'both'",
    )
    ap.add_argument(
        "--fp8-bulk",
        action="store_true",
        help="also time the fp8 tactics on the bulk ring (the warp-specialized kernels, v11) and the"
        " fp8 defaults, and 'both' for every fp8 pair",
    )
    ap.add_argument("--out", default=None, type=new_file, help="write the results as JSON here (a new file)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("time_gemms.py needs an sm_90 GPU (H100 / H200) and torch with CUDA")
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s (reference {COPY_GBPS:.0f})")
    results: list = []
    for tp in args.tp:
        bench_shape(
            tp, args.rows, args.variants, args.split_k, results, args.bulk, args.act_bf16, args.fp8, args.fp8_bulk
        )
    if args.out:
        with open(args.out, "x") as f:
            json.dump(dict(copy_gbps=bw, device=torch.cuda.get_device_name(), results=results), f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
