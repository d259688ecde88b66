"""Launch chosen GEMM tactics once each inside an NVTX range "profile", for
Nsight Compute (hardware counters: DRAM throughput, warp stall reasons,
issue-slot use), dsv41-flash, correlated routing, cold L2 (ncu flushes the
caches before each pass by default).

    source .bundles/unpack.sh && PYTHONPATH=$PWD ncu --clock-control none --nvtx \
        --nvtx-include "profile/" --section SpeedOfLight --section WarpStateStats ... \
        python3 scripts/profile_gemms.py --tp 4 --rows 6 1:r64_m1_k4_u4_c3_a16 2:r64_m8_k1_u2_c2_a16

Each spec is STAGE:TACTIC_NAME. Every tactic is launched once before the
range (compile + warm-up), then once inside it.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from moebench.formats import generate_activations, quantize_mxfp8
from moebench.kernels.gemm import act_to_bf16, alloc_workspace, check_resident, gemm1, gemm2
from moebench.kernels.tactic import GemmShape, GemmTactic, workspace_bytes_for
from moebench.models import get_preset
from moebench.record import TILE, build_route_record
from moebench.routing import scenario_topk_ids

from time_gemms import TOP_K, random_kernel_weights


def _spec(text: str) -> tuple[int, GemmTactic]:
    """An argparse `type`: STAGE:TACTIC_NAME -> (stage, tactic)."""
    stage, sep, name = text.partition(":")
    if not sep or stage not in ("1", "2"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected STAGE:TACTIC_NAME with STAGE 1 or 2")
    try:
        return int(stage), GemmTactic.from_name(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


#: The --resident choices as compile_gemm's `resident` argument.
RESIDENT = {"no": False, "yes": True, "math": "math", "mma": "mma"}


def spec_problems(shape, specs, resident: str) -> list[str]:
    """Why a spec cannot be launched on one rank's `shape` (GemmShape) in
    `resident` mode (the --resident choice): the tactic's own `valid_for`,
    then what the kernels' own check of the mode says (`check_resident`:
    the probes' bulk ring, the halves' fp8 consumer); empty when all can."""
    out = []
    for stage, t in specs:
        why = t.valid_for(shape, stage)
        if why is None:
            try:
                check_resident(RESIDENT[resident], t)
            except ValueError as error:
                why = f"--resident {resident}: {error}"
        if why is not None:
            out.append(f"{stage}:{t.name} cannot run GEMM{stage} here: {why}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4, choices=(1, 2, 4, 8), help="TP degree of dsv41-flash (default 4)")
    ap.add_argument("--rows", type=int, default=6, choices=range(1, 9), metavar="{1..8}", help="token rows (6)")
    ap.add_argument(
        "--resident",
        choices=tuple(RESIDENT),
        default="no",
        help="the consumer probes of scripts/consumer.py: yes = compute only (weights resident in shared "
        "memory), math / mma = one half of the consumer; bulk-ring tactics only (default no: the real kernel)",
    )
    ap.add_argument("specs", nargs="+", type=_spec, help="STAGE:TACTIC_NAME, e.g. 2:r64_m8_k1_u2_c2_a16")
    args = ap.parse_args()
    shape = get_preset("dsv41-flash").shard(args.tp)
    gs = GemmShape.of(shape)
    for problem in spec_problems(gs, args.specs, args.resident):
        ap.error(f"dsv41-flash TP{args.tp}: {problem}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("profile_gemms.py needs an sm_90 GPU (H100 / H200) and torch with CUDA")
    h, i = shape.hidden, shape.intermediate
    ids = scenario_topk_ids("correlated", args.rows, TOP_K, shape.experts, seed=args.rows)
    route = build_route_record(ids.cuda(), shape.experts)
    kw = random_kernel_weights(shape, seed=0)
    resident = RESIDENT[args.resident]
    specs = args.specs
    need = workspace_bytes_for(gs, [(st, t, route.ctas) for st, t in specs])
    ws = alloc_workspace(need, "cuda") if need else None
    x_q, x_s = quantize_mxfp8(generate_activations(args.rows, h, seed=args.rows, device="cuda"))
    n = TILE * route.ctas
    h_q = torch.zeros(n, i, dtype=torch.uint8, device="cuda")
    h_s = torch.zeros(n, i // 32, dtype=torch.uint8, device="cuda")
    out = torch.zeros(n, h, dtype=torch.bfloat16, device="cuda")
    x_deq = act_to_bf16(x_q, x_s)
    h_deq = torch.zeros(n, i, dtype=torch.bfloat16, device="cuda")

    def launch(stage, t):
        k = dataclasses.replace(kw, operand="e4m3") if t.fp8 else kw
        if stage == 1:
            a16 = dict(x_deq=x_deq, h_deq_out=h_deq) if t.act_bf16 else {}
            ids_in = (
                ids.to("cuda", torch.int32).contiguous() if t.spec else None
            )  # spec: the ids its producer reads before its wait
            gemm1(
                k,
                x_q,
                x_s,
                route.record,
                route.ctas,
                h_q,
                h_s,
                tactic=t,
                workspace=ws,
                topk_ids=ids_in,
                resident=resident,
                **a16,
            )
        else:
            a16 = dict(h_deq=h_deq) if t.act_bf16 else {}
            gemm2(k, h_q, h_s, route.record, route.ctas, out, tactic=t, workspace=ws, resident=resident, **a16)

    for stage, t in specs:
        launch(stage, t)
    torch.cuda.synchronize()
    for stage, t in specs:
        with torch.cuda.nvtx.range("profile"):
            launch(stage, t)
        torch.cuda.synchronize()
        print(f"GEMM{stage} {t.name}: launched", flush=True)


if __name__ == "__main__":
    main()
