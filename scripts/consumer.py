"""The GEMM consumer alone, per SM: GB/s of MXFP4 bytes (e2m1 + E8M0) one SM
turns into MMA results, beside its share of HBM (issue 36, item 1).

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/consumer.py [--preset dsv41-flash]
        [--tp 4] [--family fp8,bf16] [--stage 1,2] [--gemm1 NAME,...] [--gemm2 NAME,...]
        [--tiles 32,64] [--rows 1,8] [--out F.json]

For each family's tactics on the bulk ring (default: the FP8 default of the
shape with its `_d1`.. pipelined twins, and the BF16 bulk defaults), each
stage, two modes of the same kernel (`compile_gemm(..., resident=)`):

* compute only (`resident=True`): each CTA's producer loads its first
  `stages` ring steps once and the consumers run every step of every unit on
  them: the whole consumer (words from shared memory, decode, MMA, scaling,
  epilogue) with no weight bytes from HBM. Timed at several record sizes (--tiles:
  token tiles of one row each, one expert per tile), rate = the busiest SM's
  extra bytes / the extra time (the least-squares slope: launch, ramp and
  tail cancel).
  This is the tactic's ceiling. fp8 tactics also run the two halves of
  the consumer alone (`resident="mma"`: only the wgmmas; `"math"`: only
  the decode and the per-block scaling), which says which half bounds it.
* streamed (the real ring): (a) the same record sizes, the same slope
  (every SM streams at once: bounded by the HBM share too); (b) the real
  decode case: correlated routing at --rows, weights rotated over enough
  random weight sets to keep L2 cold, rate = the busiest SM's bytes / the
  time per call (launch and ramp included, as the layer sees it).

The busiest SM's bytes: ceil(units / grid) units x its CTAs (grid spread
evenly over the SMs) x bytes per unit. The share printed beside: the H200's
32 GB/s (4.24 TB/s copy / 132 SMs) and this device's measured copy rate / SMs.
Needs an sm_90 GPU (exits with a message otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arg_types import int_list, new_file  # noqa: E402  (scripts/, put on sys.path above)

#: The per-SM share of the H200's copy rate (4.24 TB/s / 132 SMs), GB/s.
H200_SHARE_GBPS = 32.0
L2_BYTES = 60e6
TOP_K = 6
#: Launches per timed call of the record-size points (per-call µs = graph time / CALLS).
CALLS = 10


def _names(text: str) -> list[str]:
    from moebench.kernels.tactic import GemmTactic

    out = []
    for name in text.split(","):
        try:
            out.append(GemmTactic.from_name(name).name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not GemmTactic.from_name(name).bulk:
            raise argparse.ArgumentTypeError(f"{name}: the consumer is measured on the bulk ring (stages >= 2)")
    return out


def _families(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in ("fp8", "bf16")]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not in fp8, bf16")
    return values


def default_tactics(shape, family: str, stage: int, ctas: int) -> list:
    """The family's measured tactics of `stage`: fp8: the default (on the
    bulk ring) and its pipelined twins (mma_depth 1 .. unroll - 1); bf16: the
    bulk defaults (GEMM1 r64_m1_k4_u4_c2_b4, GEMM2 r64_m4_k2_u2_c2_b4)."""
    from moebench.kernels.tactic import MAX_MMA_DEPTH, GemmTactic, default_fp8_tactic

    if family == "fp8":
        base = default_fp8_tactic(shape, stage, ctas)
        out = [base] if base.bulk else []
        for d in range(1, MAX_MMA_DEPTH + 1):
            if base.bulk and d < base.unroll:
                out.append(dataclasses.replace(base, mma_depth=d))
        return out
    t = GemmTactic(64, 1, 4, 4, 2, stages=4) if stage == 1 else GemmTactic(64, 4, 2, 2, 2, stages=4)
    return [t] if t.valid_for(shape, stage) is None else []


def unit_bytes(shape, stage: int, tactic) -> int:
    """MXFP4 bytes (e2m1 + E8M0) of one work unit: item rows x K."""
    k = shape.hidden if stage == 1 else shape.intermediate
    return tactic.item_rows * (k // 2 + k // 32)


def busiest_sm_bytes(shape, stage: int, tactic, tiles: int, sms: int, grid: int | None = None) -> tuple[int, int]:
    """(bytes, grid) of the busiest SM for `tiles` token tiles: CTA b of the
    grid takes q or q + 1 units (the first units % grid CTAs one more, both
    unit orders), CTA b runs on SM b % SMs (the block scheduler's round
    robin, assumed), the SM with the most units sets the time."""
    m = 2 * shape.intermediate if stage == 1 else shape.hidden
    units = tiles * (m // tactic.item_rows)
    if grid is None:
        grid = max(1, min(units, sms * tactic.ctas_per_sm)) if tactic.persistent else units
    q, r = divmod(units, grid)
    per_sm = [0] * sms
    for b in range(grid):
        per_sm[b % sms] += q + (b < r)
    return max(per_sm) * unit_bytes(shape, stage, tactic), grid


class Case:
    """One record and its buffers: token tiles of `ids` (int32 [rows, top_k])."""

    def __init__(self, shape, ids: torch.Tensor):
        from moebench.formats import generate_activations, quantize_mxfp8
        from moebench.record import TILE, build_route_record

        self.route = build_route_record(ids.cuda(), shape.experts)
        rows, n = ids.shape[0], TILE * self.route.ctas
        self.x_q, self.x_s = quantize_mxfp8(generate_activations(rows, shape.hidden, seed=rows, device="cuda"))
        h, i = shape.hidden, shape.intermediate
        gen = torch.Generator(device="cuda").manual_seed(5)
        # H: random e4m3 bytes (finite: no 0x7F / 0xFF) and E8M0 scales near 1
        self.h_q = (torch.randint(0, 126, (n, i), generator=gen, device="cuda", dtype=torch.int32)).to(torch.uint8)
        self.h_s = torch.full((n, i // 32), 127, dtype=torch.uint8, device="cuda")
        self.out = torch.zeros(n, h, dtype=torch.bfloat16, device="cuda")
        self.h_q_out = torch.zeros(n, i, dtype=torch.uint8, device="cuda")
        self.h_s_out = torch.zeros(n, i // 32, dtype=torch.uint8, device="cuda")

    def launch(self, kw, stage: int, tactic, resident: bool) -> None:
        from moebench.kernels.gemm import gemm1, gemm2

        r = self.route
        if stage == 1:
            gemm1(kw, self.x_q, self.x_s, r.record, r.ctas, self.h_q_out, self.h_s_out, tactic=tactic,
                  resident=resident)  # fmt: skip
        else:
            gemm2(kw, self.h_q, self.h_s, r.record, r.ctas, self.out, tactic=tactic, resident=resident)


def _time(fn, calls: int, replays: int) -> float:
    from moebench.bench.timing import time_graph

    return time_graph(fn, warmup=2, replays=replays, calls_per_replay=calls).median_us


def _kw_for(kw, tactic):
    return dataclasses.replace(kw, operand="e4m3") if tactic.fp8 else kw


def measure_slope(shape, kw, stage, tactic, cases, sms, resident, replays) -> dict:
    """Two record sizes, one kernel: (busiest SM bytes, µs) each and the slope."""
    pts = []
    kw = _kw_for(kw, tactic)
    for tiles, case in cases:
        nbytes, grid = busiest_sm_bytes(shape, stage, tactic, tiles, sms)
        us = _time(lambda case=case: [case.launch(kw, stage, tactic, resident) for _ in range(CALLS)], CALLS, replays)
        pts.append((tiles, nbytes, grid, us))
    return dict(points=[dict(tiles=t, sm_bytes=b, grid=g, us=u) for t, b, g, u in pts], gbps_per_sm=slope_gbps(pts))


def slope_gbps(pts) -> float:
    """Least-squares slope of busiest-SM bytes over µs (GB/s); NaN unless the bytes grow."""
    xs, ys = [p[3] for p in pts], [p[1] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0 or ys[-1] <= ys[0]:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx * 1e6 / 1e9


def measure_real(shape, sets, stage, tactic, case, sms, replays) -> dict:
    """Correlated routing at one row count, cold weights: busiest SM's bytes / µs per call."""
    nbytes, grid = busiest_sm_bytes(shape, stage, tactic, case.route.tiles_used, sms)
    kws = [_kw_for(kw, tactic) for kw in sets]
    us = _time(lambda: [case.launch(kw, stage, tactic, False) for kw in kws], len(kws), replays)
    return dict(tiles=case.route.tiles_used, sm_bytes=nbytes, grid=grid, us=us, gbps_per_sm=nbytes / (us * 1e-6) / 1e9)


def run(args) -> list[dict]:
    from moebench.kernels.gemm import RESIDENT_PROBES
    from moebench.models import get_preset
    from moebench.routing import scenario_topk_ids
    from time_gemms import copy_bandwidth, random_kernel_weights

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    share = bw / sms
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, copy {bw:.0f} GB/s -> {share:.1f} GB/s per SM here"
          f" (H200 share {H200_SHARE_GBPS:.0f})", flush=True)  # fmt: skip
    results = []
    for tp in args.tp:
        shape = get_preset(args.preset).shard(tp)
        h, i = shape.hidden, shape.intermediate
        per_expert = 2 * i * (h // 2 + h // 32) + h * (i // 2 + i // 32)
        big = [
            (t, Case(shape, torch.randperm(shape.experts, generator=torch.Generator().manual_seed(t))[: 8 * (t // 8)]
                     .view(t // 8, 8).to(torch.int32)))
            for t in args.tiles
        ]  # fmt: skip
        reals = {r: Case(shape, scenario_topk_ids("correlated", r, TOP_K, shape.experts, seed=r)) for r in args.rows}
        touched = min((c.route.tiles_used for c in reals.values()), default=1)
        n_sets = max(
            2, min(math.ceil(3 * L2_BYTES / (touched * per_expert)), int(20e9 // (shape.experts * per_expert)))
        )
        sets = [random_kernel_weights(shape, seed=s) for s in range(n_sets)]
        ctas = max(c.route.ctas for c in reals.values()) if reals else 8
        for family in args.family:
            for stage in args.stage:
                names = (args.gemm1 if stage == 1 else args.gemm2) or []
                from moebench.kernels.tactic import GemmTactic

                tactics = [GemmTactic.from_name(n) for n in names] or default_tactics(shape, family, stage, ctas)
                tactics = [t for t in tactics if t.fp8 == (family == "fp8")]
                for t in tactics:
                    why = t.valid_for(shape, stage)
                    if why:
                        print(f"TP{tp} GEMM{stage} {t.name}: skipped ({why})", flush=True)
                        continue
                    rec = dict(preset=args.preset, tp=tp, family=family, stage=stage, tactic=t.name)
                    rec["compute"] = measure_slope(shape, sets[0], stage, t, big, sms, True, args.replays)
                    for probe in RESIDENT_PROBES if t.fp8 else ():
                        rec[f"compute_{probe}"] = measure_slope(shape, sets[0], stage, t, big, sms, probe, args.replays)
                    rec["streamed"] = measure_slope(shape, sets[0], stage, t, big, sms, False, args.replays)
                    rec["real"] = {
                        r: measure_real(shape, sets, stage, t, c, sms, args.replays) for r, c in reals.items()
                    }
                    results.append(rec)
                    real = "  ".join(
                        f"rows {r}: {v['us']:6.2f} us {v['gbps_per_sm']:5.1f}" for r, v in rec["real"].items()
                    )
                    pts = " / ".join(f"{p['us']:.1f}" for p in rec["compute"]["points"])
                    spts = " / ".join(f"{p['us']:.1f}" for p in rec["streamed"]["points"])
                    halves = (
                        f" (mma only {rec['compute_mma']['gbps_per_sm']:5.1f}, decode+scale only"
                        f" {rec['compute_math']['gbps_per_sm']:5.1f})"
                        if t.fp8
                        else ""
                    )
                    print(
                        f"TP{tp} {family:4s} GEMM{stage} {t.name:28s} compute-only {rec['compute']['gbps_per_sm']:5.1f}"
                        f"{halves}"
                        f" GB/s/SM ({pts} us)  streamed {rec['streamed']['gbps_per_sm']:5.1f} ({spts} us)"
                        f"  real {real}  | share {H200_SHARE_GBPS:.0f} (here {share:.1f})",
                        flush=True,
                    )
        sets = None
        torch.cuda.empty_cache()
    return [dict(copy_gbps=bw, sms=sms, device=torch.cuda.get_device_name(), results=results)]


def recompute(path: str) -> None:
    """Print the compute-only / streamed slopes and real-case rates of a
    saved run (its points' tiles, grid and µs) with `busiest_sm_bytes`.
    Exits with a message naming the file (and the record) it cannot read."""
    try:
        with open(path) as f:
            data = json.load(f)
        results, sms = data["results"], data["sms"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--recompute {path}: not a consumer.py --out file ({error})") from None
    print(f"{data.get('device')}: {sms} SMs, copy {data.get('copy_gbps', float('nan')):.0f} GB/s (recomputed)")
    for i, rec in enumerate(results):
        try:
            line = _recomputed(rec, sms)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise SystemExit(f"--recompute {path}: results[{i}] is not a consumer.py record ({error!r})") from None
        print(line)


def _recomputed(rec: dict, sms: int) -> str:
    """One saved record's rates, recomputed (KeyError / TypeError / ValueError on a malformed one)."""
    from moebench.kernels.tactic import GemmTactic
    from moebench.models import get_preset

    shape, t, stage = get_preset(rec["preset"]).shard(rec["tp"]), GemmTactic.from_name(rec["tactic"]), rec["stage"]
    rates = []
    for mode in ("compute", *(f"compute_{p}" for p in ("mma", "math")), "streamed"):
        if mode in rec:
            pts = [
                (p["tiles"], busiest_sm_bytes(shape, stage, t, p["tiles"], sms, p["grid"])[0], p["grid"], p["us"])
                for p in rec[mode]["points"]
            ]
            rates.append(f"{mode} {slope_gbps(pts):5.1f}")
    for rows, v in rec["real"].items():
        nbytes = busiest_sm_bytes(shape, stage, t, v["tiles"], sms, v["grid"])[0]
        rates.append(f"rows {rows}: {v['us']:6.2f} us {nbytes / (v['us'] * 1e-6) / 1e9:5.1f}")
    return f"TP{rec['tp']} {rec['family']:4s} GEMM{stage} {t.name:28s} " + "  ".join(rates)


def _argument_problems(args) -> list[str]:
    """What the GPU run would only meet late or skip without a word (an --out
    it cannot write is `new_file`'s): tactics of a family not in --family or
    of a stage not in --stage (filtered out: nothing measured), GEMM2 tactics
    GEMM2 never takes (`planes` 2, `spec`)."""
    from moebench.kernels.tactic import GemmTactic

    out = []
    for stage, names in ((1, args.gemm1), (2, args.gemm2)):
        for name in names or ():
            t = GemmTactic.from_name(name)
            family = "fp8" if t.fp8 else "bf16"
            if family not in args.family:
                out.append(f"--gemm{stage} {name} is a {family} tactic but --family is {','.join(args.family)}")
            if stage not in args.stage:
                out.append(f"--gemm{stage} {name} given but --stage is {','.join(map(str, args.stage))}")
            if stage == 2 and (t.planes != 1 or t.spec):
                out.append(f"--gemm2 {name}: planes 2 and spec (_p2, _sp) are GEMM1's only")
    return out


def main() -> None:
    from moebench.models import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dsv41-flash", choices=sorted(PRESETS), help="model preset")
    ap.add_argument("--tp", default="4", type=int_list((1, 2, 4, 8)), help="TP degrees (default 4)")
    ap.add_argument("--family", default="fp8,bf16", type=_families, help="fp8, bf16 or both (default)")
    ap.add_argument("--stage", default="1,2", type=int_list((1, 2)), help="GEMM stages (default 1,2)")
    ap.add_argument("--gemm1", default=None, type=_names, help="GEMM1 tactics (bulk ring) instead of the defaults")
    ap.add_argument("--gemm2", default=None, type=_names, help="GEMM2 tactics (bulk ring) instead of the defaults")
    ap.add_argument(
        "--tiles",
        default="16,32,48,64",
        type=int_list(range(8, 65, 8)),
        help="two or more record sizes in token tiles (multiples of 8, up to 64) for the slopes (default 16,32,48,64)",
    )
    ap.add_argument("--rows", default="1,8", type=int_list(range(1, 9)), help="real cases (default 1,8)")
    ap.add_argument("--replays", default=20, type=int, help="graph replays per timing (default 20)")
    ap.add_argument("--out", default=None, type=new_file, help="write the results as JSON here (a new file)")
    ap.add_argument(
        "--recompute",
        default=None,
        metavar="JSON",
        help="no GPU: print the rates of a saved --out file with this script's busiest-SM bytes",
    )
    args = ap.parse_args()
    if args.recompute:
        recompute(args.recompute)
        return
    if len(args.tiles) < 2 or args.tiles != sorted(set(args.tiles)):
        ap.error(f"--tiles needs two or more increasing sizes, got {args.tiles}")
    if args.replays < 3:
        ap.error(f"--replays must be at least 3, got {args.replays}")
    for problem in _argument_problems(args):
        ap.error(problem)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("consumer.py needs an sm_90 GPU (H100 / H200) and torch with CUDA")
    t0 = time.time()
    out = run(args)
    if args.out:
        with open(args.out, "x") as f:
            json.dump(out[0], f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
