"""The "reference" backend: the numerics oracle itself (MXFP8 x and H) in fp32.

`reference_moe(activation="mxfp8", dtype=float32)` on the weights' device:
slow (a Python loop over token tiles, host syncs while building the route
record), so it is not graph-capturable and is timed as eager calls. It exists
for correctness plumbing end to end and for the CPU run; it is no baseline.
"""

from __future__ import annotations

import torch

from moebench.backends.base import DEFAULT_TACTIC, Backend, check_forward_inputs, check_weights
from moebench.formats import ExpertWeights
from moebench.models import RankShape
from moebench.reference import reference_moe


class ReferenceBackend(Backend):
    """reference_moe in fp32 on the device (see module docstring)."""

    name = "reference"
    oracle = "mxfp8"
    capturable = False
    peer = False  # the oracle itself: if it fails, our plumbing is wrong

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> ExpertWeights:
        """The canonical weights themselves (no conversion)."""
        self.check_tactic(shape, tactic)
        check_weights(weights, shape)
        return weights

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] = reference_moe(...).output rounded to BF16."""
        if not isinstance(prepared, ExpertWeights):
            raise TypeError(f"prepared must come from ReferenceBackend.prepare, got {type(prepared).__name__}")
        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.w13.device)
        result = reference_moe(x, topk_ids, topk_weights, prepared, activation="mxfp8", dtype=torch.float32)
        return result.output.to(torch.bfloat16)
