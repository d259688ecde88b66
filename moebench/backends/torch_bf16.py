"""The torch BF16 baseline: weights dequantized once to BF16, plain torch ops.

prepare: the logical part of each expert (gate rows [0, I), up rows
[Ip, Ip+I), w2 columns [0, I)) is dequantized one expert at a time to BF16
(exact: e2m1 x 2^k fits BF16) into w13 [E, 2I, H] and w2 [E, H, I]. The padded
intermediate is dropped: this path reads 4x the bytes of MXFP4 (BF16 vs
4.25 bits), which is what a user of a dequantized checkpoint pays.

forward (graph-capturable: no host sync; the top-k ids stay on the device):
the rows*top_k slots are sorted by expert on the device (argsort; slot counts
by index_add, offsets by cumsum), then

- tactic "grouped" (the default where torch has `_grouped_mm`): two grouped
  GEMMs, `torch._grouped_mm(x_sorted, w13^T, offs)` and `(h, w2^T, offs)`.
  Each touched expert's weights are read once; untouched experts are empty
  groups and cost nothing. This is the honest "good torch" baseline.
- tactic "gather": gathers the weights of every slot (`w13[ids]`, `w2[ids]`)
  and runs batched matrix-vector products. An expert that k slots route to is
  copied k times and re-read: a naive torch MoE, for comparison only; it
  allocates rows*top_k experts' BF16 weights per call.

Between the GEMMs: SwiGLU with the per-expert clamp in fp32, H rounded to
BF16. Finalize: the top-k weighted sum in fp32 (non-local ids, outside
[0, E), contribute nothing), rounded to BF16. Oracle: "bf16".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.backends.base import DEFAULT_TACTIC, Backend, check_forward_inputs, check_weights
from moebench.traffic import touched_bytes
from moebench.formats import ExpertWeights, dequantize_mxfp4
from moebench.models import MX_BLOCK, RankShape

TACTICS = (DEFAULT_TACTIC, "grouped", "gather")


def has_grouped_mm() -> bool:
    """Whether this torch has `torch._grouped_mm` (torch >= 2.8)."""
    return hasattr(torch, "_grouped_mm")


@dataclass
class TorchBF16Weights:
    """Prepared weights: w13 bf16 [E, 2I, H] (gate then up), w2 bf16 [E, H, I],
    clamp fp32 [E]; mode "grouped" or "gather"."""

    w13: torch.Tensor
    w2: torch.Tensor
    clamp: torch.Tensor
    mode: str

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]


def dequantize_bf16(weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 bf16 [E, 2I, H], w2 bf16 [E, H, I]) of the logical intermediate I,
    dequantized one expert at a time (bounded temporary memory)."""
    e, h, i, ip = weights.experts, weights.hidden, weights.intermediate, weights.padded_intermediate
    dev = weights.w13.device
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=dev)
    for x in range(e):
        rows = torch.cat((weights.w13[x, :i], weights.w13[x, ip : ip + i]))
        scales = torch.cat((weights.w13_scale[x, :i], weights.w13_scale[x, ip : ip + i]))
        w13[x] = dequantize_mxfp4(rows, scales, torch.float32)
        w2[x] = dequantize_mxfp4(weights.w2[x, :, : i // 2], weights.w2_scale[x, :, : i // MX_BLOCK], torch.float32)
    return w13, w2


class TorchBF16Backend(Backend):
    """Dequantized BF16 weights + torch grouped GEMMs (see module docstring)."""

    name = "torch-bf16"
    oracle = "bf16"
    capturable = True

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        return TACTICS if has_grouped_mm() else (DEFAULT_TACTIC, "gather")

    def default_alias(self, shape: RankShape) -> str:
        """ "grouped" where torch has `_grouped_mm`, else "gather"."""
        return "grouped" if has_grouped_mm() else "gather"

    def prepared_bytes(self, shape: RankShape) -> int:
        return shape.experts * 3 * shape.intermediate * shape.hidden * 2

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """The touched experts' BF16 weights (3 * I * H * 2 bytes each: w13 and
        w2 at the logical I) + x in and the output: what the "grouped" GEMMs
        (the default) read. "gather" re-reads an expert once per slot that
        routes to it, and copies it first: this count is its lower bound."""
        return touched_bytes(shape, topk_ids, 3 * shape.intermediate * shape.hidden * 2)

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> TorchBF16Weights:
        """BF16 weights of `shape` (raises ValueError for a bad tactic or shape)."""
        self.check_tactic(shape, tactic)
        check_weights(weights, shape)
        mode = tactic if tactic != DEFAULT_TACTIC else self.default_alias(shape)
        w13, w2 = dequantize_bf16(weights)
        return TorchBF16Weights(w13, w2, weights.clamp.to(torch.float32).contiguous(), mode)

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H]; see module docstring."""
        if not isinstance(prepared, TorchBF16Weights):
            raise TypeError(f"prepared must come from TorchBF16Backend.prepare, got {type(prepared).__name__}")
        p = prepared
        check_forward_inputs(x, topk_ids, topk_weights, p.hidden, p.w13.device)
        rows, top_k = topk_ids.shape
        e, i = p.experts, p.intermediate
        if rows == 0:  # an empty step: nothing to route (rows is shape metadata, no host sync)
            return torch.zeros(0, p.hidden, dtype=torch.bfloat16, device=x.device)
        slots = rows * top_k
        ids = topk_ids.reshape(slots).to(torch.int64)
        local = (ids >= 0) & (ids < e)
        key = torch.where(local, ids, torch.full_like(ids, e))  # non-local sorts last
        token = torch.arange(slots, device=x.device) // top_k
        expert = key.clamp_max(e - 1)
        limit = torch.where(local, p.clamp[expert], torch.zeros((), device=x.device))
        if p.mode == "grouped":
            order = torch.argsort(key, stable=True)
            counts = torch.zeros(e + 1, dtype=torch.int32, device=x.device)
            counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
            offs = torch.cumsum(counts[:e], 0, dtype=torch.int32)
            xs = x[token[order]]
            h13 = torch._grouped_mm(xs, p.w13.transpose(1, 2), offs=offs)
            h = _swiglu(h13, i, limit[order]).to(torch.bfloat16)
            y_sorted = torch._grouped_mm(h, p.w2.transpose(1, 2), offs=offs)
            y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
        else:
            xs = x[token].unsqueeze(-1)
            h13 = torch.bmm(p.w13[expert], xs).squeeze(-1)
            h = _swiglu(h13, i, limit).to(torch.bfloat16)
            y = torch.bmm(p.w2[expert], h.unsqueeze(-1)).squeeze(-1)
        y = y.view(rows, top_k, p.hidden).to(torch.float32)
        w = torch.where(local.view(rows, top_k), topk_weights, 0.0).unsqueeze(-1)
        # Rows of non-local slots are never written by the grouped GEMM: mask, don't multiply.
        out = torch.where(local.view(rows, top_k, 1), w * y, 0.0).sum(dim=1)
        return out.to(torch.bfloat16)


def _swiglu(h13: torch.Tensor, i: int, limit: torch.Tensor) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32; h13 [S, 2I],
    limit fp32 [S]."""
    lim = limit.unsqueeze(-1)
    gate = torch.minimum(h13[:, :i].to(torch.float32), lim)
    up = torch.maximum(torch.minimum(h13[:, i:].to(torch.float32), lim), -lim)
    return gate * torch.sigmoid(gate) * up
