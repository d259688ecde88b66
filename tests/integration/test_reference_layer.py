"""The reference DeepSeek-V4 MoE layer vs a naive per-token loop, and the runner protocol."""

from __future__ import annotations

import pytest
import torch

from moebench.formats import dequantize_mxfp4, dequantize_mxfp8, generate_activations, quantize_mxfp8
from moebench.integration.protocol import is_moe_runner
from moebench.moe_output import UnfinalizedMoEOutput
from moebench.reference import relative_error, swiglu_clamped
from moebench.routing import IMAGE_SENTINELS, sqrtsoftplus

from integration_checks import TINY, build_reference_layer


@pytest.fixture(scope="module")
def layer():
    return build_reference_layer(TINY, seed=3)


def _mxfp8(v: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8(*quantize_mxfp8(v), dtype=torch.float64)


def naive_layer(layer, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The layer, one token and one expert at a time, in fp64 (MXFP8 x and h,
    as the routed experts define them)."""
    router, ex, sh = layer.router, layer.routed_experts, layer._shared_experts
    i, ip = ex.intermediate, ex.w13_weight.shape[1] // 2
    w13 = dequantize_mxfp4(ex.w13_weight, ex.w13_weight_scale, torch.float64)
    w2 = dequantize_mxfp4(ex.w2_weight, ex.w2_weight_scale, torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        # Router, written out: sqrtsoftplus scores, biased selection, unbiased weights.
        logits = layer.gate.weight.float() @ x[t].float()
        scores = sqrtsoftplus(logits).double()
        tid = None if input_ids is None else int(input_ids[t])
        if router._hash_indices_table is not None:
            ids = router._hash_indices_table[tid].tolist()
        else:
            bias = router.e_score_correction_bias
            lo = router.image_sentinel_lo
            if router.bias_vl is not None and lo > 0 and lo <= tid < lo + IMAGE_SENTINELS:
                bias = router.bias_vl
            sel = scores + bias.double()
            ids = sorted(range(len(sel)), key=lambda e: (-float(sel[e]), e))[: router.top_k]
        chosen = scores[ids]
        weights = chosen / chosen.sum() * router.routed_scaling_factor
        xq = _mxfp8(x[t : t + 1])[0]
        for e, w in zip(ids, weights):
            gate, up = w13[e, :i] @ xq, w13[e, ip : ip + i] @ xq
            h = _mxfp8(swiglu_clamped(gate, up, float(ex.clamp[e]))[None])[0]
            out[t] += w * (w2[e, :, :i] @ h)
        out[t] *= layer.routed_scaling_factor
        hs = swiglu_clamped(sh.w1.double() @ xt, sh.w3.double() @ xt, sh.limit)
        out[t] += sh.w2.double() @ hs
    return out


@pytest.mark.parametrize("rows", range(1, 9))
def test_forward_matches_naive_loop(layer, rows):
    x = generate_activations(rows, TINY.hidden, seed=rows)
    out = layer.forward(x)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (rows, TINY.hidden)
    assert relative_error(out, naive_layer(layer, x)) < 1e-2


def test_image_rows_use_bias_vl():
    layer = build_reference_layer(TINY, seed=5, image_sentinel_lo=1000)
    x = generate_activations(4, TINY.hidden, seed=9)
    ids = torch.tensor([7, 1000, 1004, 1005])
    assert relative_error(layer.forward(x, ids), naive_layer(layer, x, ids)) < 1e-2
    # The image rows route differently from the same rows as text.
    logits, _ = layer.gate(x)
    _, image = layer.router.select_experts(hidden_states=x, router_logits=logits, input_ids=ids)
    _, text = layer.router.select_experts(
        hidden_states=x, router_logits=logits, input_ids=torch.zeros(4, dtype=torch.int64)
    )
    assert torch.equal(image[[0, 3]], text[[0, 3]])


def test_hash_layer_takes_experts_from_the_table():
    layer = build_reference_layer(TINY, seed=6, hash_vocab=50)
    x = generate_activations(3, TINY.hidden, seed=2)
    ids = torch.tensor([0, 17, 49])
    logits, _ = layer.gate(x)
    _, topk = layer.router.select_experts(hidden_states=x, router_logits=logits, input_ids=ids)
    assert torch.equal(topk, layer.router._hash_indices_table[ids])
    assert relative_error(layer.forward(x, ids), naive_layer(layer, x, ids)) < 1e-2


def test_runner_side_scale_is_applied():
    layer = build_reference_layer(TINY, seed=3, routed_scaling_factor=2.0)
    x = generate_activations(2, TINY.hidden, seed=4)
    assert relative_error(layer.forward(x), naive_layer(layer, x)) < 1e-2


def test_forward_impl_defers_only_within_the_config(layer):
    x = generate_activations(4, TINY.hidden, seed=1)
    config = layer.moe_config
    config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens = True, 4
    try:
        shared, routed = layer._forward_impl(x, x, x, None)
        assert isinstance(routed, UnfinalizedMoEOutput)
        assert routed.gemm2_permuted.dtype == torch.bfloat16
        # A deferred layer's forward still finalizes.
        assert relative_error(layer.forward(x), naive_layer(layer, x)) < 1e-2
        shared5, routed5 = layer._forward_impl(generate_activations(5, TINY.hidden), None, None, None)
        assert isinstance(routed5, torch.Tensor)
        config.deferral_supported = False
        assert isinstance(layer._forward_impl(x)[1], torch.Tensor)
    finally:
        config._defer_moe_finalize, config.defer_moe_finalize_max_num_tokens = False, 0
        config.deferral_supported = True


def test_capture_fn_sees_the_topk_ids(layer):
    seen = []
    layer.router.capture_fn = seen.append
    try:
        x = generate_activations(3, TINY.hidden, seed=8)
        logits, _ = layer.gate(x)
        _, ids = layer.router.select_experts(hidden_states=x, router_logits=logits)
    finally:
        layer.router.capture_fn = None
    assert len(seen) == 1 and torch.equal(seen[0], ids)


def test_reference_layer_satisfies_the_protocol(layer):
    assert is_moe_runner(layer)
