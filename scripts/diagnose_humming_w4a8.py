"""Where humming-w4a8's 1-3 % error vs the "fp8_token" oracle comes from.

Runs one layer call of the humming-w4a8 backend (dsv41-flash, TP 1 and 4,
rows 1 / 6 / 8, correlated routing, the sweep's weight generator) and compares
each of its intermediates with the oracle's, stage by stage:

  x      humming's per-token e4m3 x (may_quant_input)  vs  quantize_fp8_per_token(x)
  gu     its GEMM1 output (BF16 [rows*top_k, 2I])      vs  fp64 gate|up from its own x
  h      its per-token e4m3 H (may_process_input)      vs  quantize_fp8_per_token(swiglu(gu))
  out    the finalized output                          vs  the fp8_token oracle (fp64), and
         vs the same fp64 computation with gate/up rounded to BF16 before the SwiGLU
         (humming's GEMM1 writes BF16) -- if the error dropped there, the BF16
         intermediate would explain it (on the H200 it does not: docs/baselines.md).

    source .bundles/unpack.sh && PYTHONPATH=$PWD python3 scripts/diagnose_humming_w4a8.py
"""

from __future__ import annotations

import torch

from moebench.backends.registry import load_backend
from moebench.formats import dequantize_mxfp4, generate_activations, generate_expert_weights
from moebench.models import get_preset
from moebench.reference import quantize_fp8_per_token, reference_moe, relative_error, swiglu_clamped
from moebench.routing import scenario_topk_ids, scenario_weights


def rel(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.double(), b.double()
    differ = float((a != b).double().mean())
    return f"rel {relative_error(a, b):.2e}, {100 * differ:5.1f} % of elements differ"


def gate_up(x_values, weights, ids, dtype=torch.float64):
    """fp64 gate / up [rows*top_k, I] of slot t*top_k+k (expert ids[t, k])."""
    i, ip = weights.intermediate, weights.padded_intermediate
    rows, top_k = ids.shape
    g = torch.empty(rows * top_k, i, dtype=dtype, device=x_values.device)
    u = torch.empty_like(g)
    for t in range(rows):
        for k in range(top_k):
            e = int(ids[t, k])
            wg = dequantize_mxfp4(weights.w13[e, :i], weights.w13_scale[e, :i], dtype)
            wu = dequantize_mxfp4(weights.w13[e, ip : ip + i], weights.w13_scale[e, ip : ip + i], dtype)
            g[t * top_k + k] = x_values[t].to(dtype) @ wg.T
            u[t * top_k + k] = x_values[t].to(dtype) @ wu.T
    return g, u


def finish(h, weights, ids, tw, dtype=torch.float64):
    """sum_k w * (h[t*top_k+k] @ w2[e]^T) in fp64."""
    i = weights.intermediate
    rows, top_k = ids.shape
    out = torch.zeros(rows, weights.hidden, dtype=dtype, device=h.device)
    for t in range(rows):
        for k in range(top_k):
            e = int(ids[t, k])
            w2 = dequantize_mxfp4(weights.w2[e, :, : i // 2], weights.w2_scale[e, :, : i // 32], dtype)
            out[t] += float(tw[t, k]) * (h[t * top_k + k].to(dtype) @ w2.T)
    return out


def main() -> None:
    from humming.layer import HummingMethod

    config = get_preset("dsv41-flash")
    backend = load_backend("humming-w4a8")
    for tp in (1, 4):
        shape = config.shard(tp)
        weights = generate_expert_weights(shape, seed=0, device="cuda")
        prepared = backend.prepare(weights, shape)
        limit = float(weights.clamp[0])
        for rows in (1, 6, 8):
            x = generate_activations(rows, shape.hidden, seed=rows, device="cuda")
            ids = scenario_topk_ids("correlated", rows, shape.top_k, shape.experts, seed=rows).cuda()
            tw = scenario_weights(rows, shape.top_k, seed=rows).cuda()
            out = backend.forward(prepared, x, ids, tw).clone()
            torch.cuda.synchronize()
            m = rows * shape.top_k
            buf = prepared.buffers[(rows, shape.top_k)]
            gu = buf["gu"][:m].clone()
            a, a_scale = HummingMethod.may_quant_input(prepared.layer, x, sublayer_name="w13")
            x_h = a.float() * a_scale.float().view(rows, -1)
            print(f"TP{tp} rows {rows}: a {tuple(a.shape)} {a.dtype}, a_scale {tuple(a_scale.shape)} {a_scale.dtype}")
            print(f"  x   : {rel(x_h, quantize_fp8_per_token(x))}")
            g, u = gate_up(x_h, weights, ids)
            i = shape.intermediate
            print(f"  gu  : gate {rel(gu[:, :i], g)}; up {rel(gu[:, i:], u)}")
            print(f"        (gate vs fp64 rounded to BF16: {rel(gu[:, :i], g.to(torch.bfloat16))})")
            h, group_scale, token_scale = HummingMethod.may_process_input(
                prepared.layer, buf["gu"], activation_type="binary_split", activation_impl=prepared.activation,
                sublayer_name="w2")  # fmt: skip
            scale = group_scale if group_scale is not None else token_scale
            print(
                f"  h   : {tuple(h.shape)} {h.dtype}, scale {tuple(scale.shape)} {scale.dtype}"
                f" ({'group' if group_scale is not None else 'token'})"
            )
            if scale.dim() == 1 or scale.shape[-1] == 1:
                h_h = h[:m].float() * scale[:m].float().view(m, 1)
                sw = swiglu_clamped(gu[:, :i].float(), gu[:, i:].float(), limit)
                h_ref = quantize_fp8_per_token(sw)
                print(f"  h   : {rel(h_h, h_ref)} (same gu, oracle quantization)")
            oracle = reference_moe(x, ids, tw, weights, activation="fp8_token").output
            sw_bf16 = swiglu_clamped(g.to(torch.bfloat16).double(), u.to(torch.bfloat16).double(), limit)
            emulated = finish(quantize_fp8_per_token(sw_bf16).double(), weights, ids, tw)
            print(
                f"  out : vs fp8_token oracle {relative_error(out, oracle):.2e};"
                f" vs the oracle with BF16 gate/up {relative_error(out, emulated):.2e};"
                f" emulated vs oracle {relative_error(emulated, oracle):.2e}",
                flush=True,
            )
        del prepared, weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
