"""Time the shared expert under CUDA graphs on the GPU: torch path vs the fused kernels.

For each preset at TP 4 and 8 (one rank's I/tp) and rows 1, 6, 8: one CUDA
graph replays the shared expert of N distinct layers (N such that the weights
one replay reads are >= 4x the L2, cold L2 as in a real step; timed with
`moebench.bench.timing.time_graph`, per call = replay / N) for

    torch            StepSharedExpert(kernels=False): F.linear, .float(), SwiGLU, .to(bf16), F.linear
    kernels          SharedExpertKernels: GEMM1 (+ SwiGLU) -> GEMM2, PDL between them
    gemm1 / gemm2    each kernel alone (gemm2 reads the h the eager check left)
    kernels-warm     the kernels on ONE layer over and over (weights in L2: the launch/latency floor)

and prints median µs [p10, p90], GB/s over the weight bytes (6 * H * I per
call) and % of the measured copy bandwidth (bench.bandwidth; the JSON also
holds % of the size-matched read ceiling of the weight bytes where Triton is
installed). Every variant's output is first
checked against the fp64 shared expert (rel. Frobenius <= 1e-2, no NaN) on
fresh inputs; a failing variant is reported as failed and not timed.
--variants also times alternative tactics of each GEMM (paired with the
other GEMM's default).

    PYTHONPATH=$PWD python3 scripts/time_shared.py [--presets dsv41-flash,dsv4-flash,dsv4-pro]
        [--tp 4,8] [--rows 1,6,8] [--variants] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from arg_types import int_list, name_list, new_file  # scripts/ (this script's folder, first on sys.path)

from moebench.bench import L2_MULTIPLE
from moebench.bench.bandwidth import copy_bandwidth_gbps, size_matched_ceiling_gbps
from moebench.bench.timing import time_graph
from moebench.integration.step_layer import StepSharedExpert
from moebench.kernels.shared_expert import (
    SharedExpertKernels, SharedTactic, default_shared_tactic, to_shared_layout,
)  # fmt: skip
from moebench.models import PRESETS, get_preset
from moebench.reference import ORACLE_TOLERANCE, relative_error, swiglu_clamped

#: Most device memory the layers of one shape may take (bytes; two copies each).
MEMORY_CAP = 20e9


def layer_weights(h: int, i: int, seed: int):
    """w1, w3 BF16 [I, H] (std 1/sqrt(H)), w2 BF16 [H, I] (std 1/sqrt(I)), as step_layer draws them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(rows, cols, k):
        return (torch.randn(rows, cols, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)

    return draw(i, h, h), draw(i, h, h), draw(h, i, i)


def oracle(x, w1, w3, w2, limit) -> torch.Tensor:
    xd = x.double()
    return swiglu_clamped(xd @ w1.double().T, xd @ w3.double().T, limit) @ w2.double().T


def variants(h: int, i: int, stage: int, sms: int) -> list[SharedTactic]:
    """Alternatives around the default of GEMM`stage` (valid ones only):
    the other tile_m with the cluster scaled to keep the CTA count, half /
    double the cluster, two warps side by side, one more CTA per SM, no PDL."""
    d = default_shared_tactic(h, i, stage, sms)
    out = []

    def add(**kw):
        fields = {f: getattr(d, f) for f in d.__dataclass_fields__}
        fields.update(kw)
        try:
            t = SharedTactic(**fields)
        except (TypeError, ValueError):
            return
        if t != d and t not in out and t.valid_for(h, i, stage) is None:
            out.append(t)

    other = 1 if d.tile_m == 2 else 2
    add(
        tile_m=other,
        cluster_k=min(8, max(1, d.cluster_k * other // d.tile_m)),
        unroll=max(1, d.unroll * d.tile_m // other),
    )
    add(cluster_k=max(1, d.cluster_k // 2), ctas_per_sm=max(1, d.ctas_per_sm - 1))
    add(cluster_k=min(8, d.cluster_k * 2), ctas_per_sm=min(4, d.ctas_per_sm + 1))
    add(warps_m=2, warps_k=max(1, d.warps_k // 2))
    add(tile_m=2, warps_k=4, unroll=max(1, d.unroll // 2), ctas_per_sm=max(1, d.ctas_per_sm - 1))
    add(ctas_per_sm=d.ctas_per_sm + 1)
    add(pdl=False)
    return out


def bench_shape(preset: str, tp: int, rows_list, do_variants: bool, copy_gbps: float, results: list) -> None:
    cfg = get_preset(preset)
    shape = cfg.shard(tp)
    h, i, limit = cfg.hidden, shape.intermediate, cfg.swiglu_limit
    wbytes = 6 * h * i  # w1 + w3 + w2, BF16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)) or 60 << 20
    n_layers = max(2, math.ceil(L2_MULTIPLE * l2 / wbytes))
    n_layers = min(n_layers, max(2, int(MEMORY_CAP // (2 * wbytes))))
    defaults = {s: default_shared_tactic(h, i, s, sms) for s in (1, 2)}
    pairs = [("kernels", defaults)]
    if do_variants:
        pairs += [(f"kernels {t.name}+default", {1: t, 2: defaults[2]}) for t in variants(h, i, 1, sms)]
        pairs += [(f"kernels default+{t.name}", {1: defaults[1], 2: t}) for t in variants(h, i, 2, sms)]
    ceiling = size_matched_ceiling_gbps(wbytes, "cuda")  # one read-streaming launch of the weight bytes
    ceiling_txt = f"{ceiling:.0f} GB/s = {wbytes / ceiling / 1e3:.2f} us" if ceiling else "n/a (no Triton)"
    print(
        f"{preset} TP{tp}: H {h}, I {i}, weights {wbytes / 1e6:.1f} MB/call, {n_layers} layers per replay"
        f" ({n_layers * wbytes / l2:.1f} x L2); size-matched ceiling {ceiling_txt}; defaults GEMM1"
        f" {defaults[1].name}, GEMM2 {defaults[2].name}",
        flush=True,
    )
    torch_layers, kernel_layers, first = [], {name: [] for name, _ in pairs}, None
    for layer in range(n_layers):
        w1, w3, w2 = layer_weights(h, i, seed=1000 * tp + layer)
        if first is None:
            first = (w1, w3, w2)
        torch_layers.append(StepSharedExpert(w1, w3, w2, limit, kernels=False))
        sw = to_shared_layout(w1, w3, w2)
        for name, tactics in pairs:
            kernel_layers[name].append(SharedExpertKernels(sw, limit, tactics=tactics))
    for rows in rows_list:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        x = torch.randn(rows, h, generator=gen, device="cuda").to(torch.bfloat16)
        ref = oracle(x, *first, limit)
        out = torch.empty(rows, h, dtype=torch.bfloat16, device="cuda")
        base = dict(preset=preset, tp=tp, hidden=h, intermediate=i, rows=rows, layers=n_layers,
                    weight_bytes=wbytes, size_ceiling_gbps=ceiling)  # fmt: skip

        def record(variant, tactics, fn, err, calls=n_layers, nbytes=wbytes):
            rec = dict(base, variant=variant, tactics=tactics, max_rel_err=err)
            if err is None or not err <= ORACLE_TOLERANCE:
                rec.update(status="failed", error=f"rel. error {err} vs fp64 exceeds {ORACLE_TOLERANCE}")
                print(f"  rows {rows} {variant:48s} FAILED ({rec['error']})", flush=True)
            else:
                t = time_graph(fn, warmup=3, replays=50, calls_per_replay=calls)
                gbps = nbytes / (t.median_us * 1e-6) / 1e9
                rec.update(status="ok", median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, gbps=gbps,
                           pct_copy_bw=100 * gbps / copy_gbps, timing_method=t.method,
                           pct_size_ceiling=(100 * gbps / ceiling) if ceiling and nbytes == wbytes else None,
                           )  # fmt: skip
                print(
                    f"  rows {rows} {variant:48s} {t.median_us:7.2f} us [{t.p10_us:6.2f}, {t.p90_us:6.2f}]"
                    f" {gbps:7.0f} GB/s {rec['pct_copy_bw']:5.1f}%  err {err:.1e}",
                    flush=True,
                )
            results.append(rec)

        t_err = relative_error(torch_layers[0](x).double(), ref)
        record("torch", "F.linear", lambda: [s(x) for s in torch_layers], t_err)
        for name, tactics in pairs:
            ks = kernel_layers[name]
            ks[0].h.fill_(float("nan"))
            out.fill_(float("nan"))
            ks[0](x, out)
            err = relative_error(out.double(), ref)
            names = f"{tactics[1].name}+{tactics[2].name}"
            record(name, names, lambda ks=ks: [k(x, out) for k in ks], err)
            if name == "kernels":
                record("gemm1", tactics[1].name, lambda: [k.launch_gemm1(x) for k in ks], err, nbytes=4 * h * i)
                record("gemm2", tactics[2].name, lambda: [k.launch_gemm2(rows, out) for k in ks], err, nbytes=2 * h * i)
                # one layer n_layers times per replay (its weights stay in L2): one call per
                # graph launch would time the host's submission gap instead of the kernels
                record("kernels-warm", names, lambda: [ks[0](x, out) for _ in ks], err)
    torch_layers = kernel_layers = None  # free the layers before the next shape
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="dsv41-flash,dsv4-flash,dsv4-pro", type=name_list(sorted(PRESETS)))
    ap.add_argument("--tp", default="4,8", type=int_list((1, 2, 4, 8)), help="TP degrees (of 1, 2, 4, 8)")
    ap.add_argument("--rows", default="1,6,8", type=int_list(range(1, 9)), help="token rows (1-8)")
    ap.add_argument("--variants", action="store_true", help="also time alternative tactics of each GEMM")
    ap.add_argument("--json", default=None, type=new_file, help="write the results as JSON here (a new file)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_shared.py needs a CUDA GPU")
    t0 = time.time()
    bw = copy_bandwidth_gbps("cuda")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, copy bandwidth {bw:.0f} GB/s")
    results: list = []
    for preset in args.presets:
        for tp in args.tp:
            bench_shape(preset, tp, args.rows, args.variants, bw, results)
    if args.json:
        with open(args.json, "x") as f:
            json.dump(
                dict(
                    device=props.name,
                    sms=props.multi_processor_count,
                    copy_gbps=bw,
                    torch=torch.__version__,
                    results=results,
                ),
                f,
                indent=1,
            )
        print(f"results in {args.json}")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
