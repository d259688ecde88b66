"""Where triton-mxfp4's route stage spends its time (issue 37: 163 µs with
vLLM's bitmatrix pack): each launch of `triton_mxfp4_glue.make_routing_data`
timed alone, as CUDA graphs of back-to-back repeats (warm, no host work
inside: a compile or autotune would happen in the eager warm-up, never in a
replay), beside the whole call, and the pack at vLLM's tile (BLOCK_M 512)
against one sized to the rows (BLOCK_M 16).

    python3 scripts/triton_route_probe.py [--experts 384] [--top-k 6] [--rows 1,4,8]

Needs a GPU, triton and triton_kernels (the vllm-moe bundle). Prints one row
per (rows, launch): µs per launch (median of the replays).
"""

from __future__ import annotations

import argparse

import torch
from arg_types import int_list  # scripts/ (this script's folder, first on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--rows", default="1,4,8", type=int_list(range(1, 9)), help="token rows (1-8)")
    parser.add_argument("--repeats", type=int, default=20, help="launches per graph replay")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    from moebench.backends import triton_mxfp4_glue as glue
    from moebench.bench.timing import time_graph

    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(rows)])
        ids = ids.to(torch.int32).cuda()
        weights = torch.rand(rows, args.top_k, generator=g).cuda()
        ids16 = ids.to(torch.int16)
        words = triton.cdiv(args.experts, 32)
        bits = torch.zeros(rows, words, dtype=torch.uint32, device="cuda")

        def pack(block_m: int) -> None:
            grid = (triton.cdiv(rows, block_m),)
            glue._pack_bitmatrix_kernel[grid](bits, ids16, rows, args.top_k, WORDS=words, BLOCK_M=block_m,
                                              BLOCK_K=glue.PACK_BLOCK_K)  # fmt: skip

        parts = {
            "ids.to(int16)": lambda: ids.to(torch.int16),
            "weights.to(bf16)": lambda: weights.to(torch.bfloat16),
            "zeros(bitmatrix)": lambda: torch.zeros(rows, words, dtype=torch.uint32, device="cuda"),
            f"pack_bitmatrix BLOCK_M={glue.PACK_BLOCK_M} (vLLM's)": lambda: pack(glue.PACK_BLOCK_M),
            "pack_bitmatrix BLOCK_M=16 (sized to the rows)": lambda: pack(16),
            "eq + where (invalid weights)": lambda: torch.where(ids16 == -1, -1.0, weights),
            "make_routing_data (all of it)": lambda: glue.make_routing_data(ids, weights, args.experts),
        }
        for name, fn in parts.items():
            t = time_graph(lambda fn=fn: [fn() for _ in range(args.repeats)], warmup=3, replays=50,
                           calls_per_replay=args.repeats)  # fmt: skip
            print(f"rows {rows}  {name:48s} {t.median_us:8.2f} µs  (p10 {t.p10_us:.2f}, p90 {t.p90_us:.2f})")


if __name__ == "__main__":
    main()
