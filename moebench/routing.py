"""DeepSeek-V4 router reference (`sqrtsoftplus`) and seeded routing scenarios.

Router (docs/design.md "Routing"): scores = sqrt(softplus(logits)) in fp32 with
softplus(x) = max(x, 0) + log1p(exp(-|x|)); experts chosen by top_k of
scores + bias (bias_vl for image rows, whose input id lies in
[image_sentinel_lo, image_sentinel_lo + 5)); ties go to the lower expert id;
weights are the unbiased scores of the chosen experts divided by their sum
(added in top-k order, floored at 1e-20), times routed_scaling_factor.
Hash routing (the first layers of DeepSeek-V4) takes the experts from a
token -> experts table instead of the top-k.

Non-finite logits, defined so that outputs are never duplicated, out of range
or NaN:
- a NaN selection score (NaN logit or NaN bias) ranks below every number, -inf
  included; among equals the lower id wins, so the ids of a row stay distinct;
- a chosen expert whose score is NaN gets weight 0;
- if a chosen score is +inf, the +inf experts share the row's weight equally
  and the others get 0;
- logits of -inf give score 0; an all -inf row gets weights 0 (the 1e-20 floor).
"""

from __future__ import annotations

import math
import numbers
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: Image rows are marked by five consecutive sentinel token ids.
IMAGE_SENTINELS = 5
#: Floor of the renormalization sum.
WEIGHT_SUM_FLOOR = 1e-20

SCENARIOS = ("uniform", "zipf", "hot", "correlated", "replay")


@dataclass(frozen=True)
class RouterConfig:
    """The router's DeepSeek-V4 top-k parameters.

    bias / bias_vl: fp32 [experts] score-correction biases (selection only);
    image_sentinel_lo: first of the five image sentinel ids (0 = no image
    routing); hash_table: int [vocab, top_k] token -> experts (hash layers).
    """

    experts: int
    top_k: int
    routed_scaling_factor: float = 1.0
    bias: torch.Tensor | None = None
    bias_vl: torch.Tensor | None = None
    image_sentinel_lo: int = 0
    hash_table: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.experts, int) or isinstance(self.experts, bool) or self.experts <= 0:
            raise ValueError(f"experts must be a positive int, got {self.experts!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be an int in [1, experts={self.experts}], got {self.top_k!r}")
        rsf = self.routed_scaling_factor
        if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real):
            raise TypeError(f"routed_scaling_factor must be a real number, got {type(rsf).__name__}")
        if not (rsf > 0 and math.isfinite(rsf)):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {rsf}")
        for name in ("bias", "bias_vl", "hash_table"):
            t = getattr(self, name)
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        for name in ("bias", "bias_vl"):
            b = getattr(self, name)
            if b is not None and (b.dtype != torch.float32 or tuple(b.shape) != (self.experts,)):
                raise ValueError(f"{name} must be float32 [{self.experts}], got {b.dtype} {tuple(b.shape)}")
        if self.hash_table is not None:
            t = self.hash_table
            if t.dtype not in (torch.int32, torch.int64) or t.dim() != 2 or t.shape[1] != self.top_k:
                raise ValueError(f"hash_table must be int [vocab, top_k={self.top_k}], got {t.dtype} {tuple(t.shape)}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.experts):
                raise ValueError(f"hash_table ids must lie in [0, {self.experts})")
            ordered = t.sort(dim=1).values
            repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero()
            if repeats.numel():
                row = int(repeats[0])
                dup = ordered[row, 1:][ordered[row, 1:] == ordered[row, :-1]]
                raise ValueError(
                    f"hash_table row {row} (token id {row}) repeats expert {int(dup[0])}:"
                    f" {t[row].tolist()}; each row must name top_k={self.top_k} distinct experts"
                )
        lo = self.image_sentinel_lo
        if not isinstance(lo, int) or isinstance(lo, bool) or lo < 0:
            raise ValueError(f"image_sentinel_lo must be an int >= 0, got {lo!r}")


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)) in fp32 with the stable softplus max(x, 0) + log1p(exp(-|x|))."""
    x = logits.to(torch.float32)
    return torch.sqrt(torch.clamp_min(x, 0) + torch.log1p(torch.exp(-x.abs())))


def _check_logits(logits: torch.Tensor, experts: int) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] != experts:
        raise ValueError(f"logits must be [rows, {experts}], got {tuple(logits.shape)}")


def _renormalize(chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """Unbiased chosen scores [rows, k] -> fp32 weights by the module's rules."""
    scores = torch.nan_to_num(chosen, nan=0.0, posinf=float("inf"))
    inf = torch.isinf(scores)
    any_inf = inf.any(dim=1, keepdim=True)
    total = torch.zeros(scores.shape[0], dtype=torch.float32, device=scores.device)
    for k in range(scores.shape[1]):  # fp32 sum in top-k order
        total = total + scores[:, k]
    total = torch.clamp_min(total, WEIGHT_SUM_FLOOR).unsqueeze(1)
    weights = scores / total
    share = inf.to(torch.float32) / inf.sum(dim=1, keepdim=True).clamp_min(1)
    weights = torch.where(any_inf, share, weights)
    return weights * torch.tensor(scale, dtype=torch.float32)


def route(
    logits: torch.Tensor, config: RouterConfig, input_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V4 router on fp32 `logits` [rows, E].

    Returns (topk_weights fp32 [rows, top_k], topk_ids int32 [rows, top_k]).
    `input_ids` ([rows] int) is needed for image routing (bias_vl with a
    sentinel) and for hash routing. Raises TypeError/ValueError for bad
    logits, missing or out-of-table input ids.
    """
    _check_logits(logits, config.experts)
    rows = logits.shape[0]
    device = logits.device
    scores = sqrtsoftplus(logits)
    needs_ids = config.hash_table is not None or (config.bias_vl is not None and config.image_sentinel_lo > 0)
    if needs_ids:
        if input_ids is None:
            raise ValueError("input_ids is required for hash routing or image (bias_vl) routing")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be an int32/int64 torch.Tensor [{rows}], got {type(input_ids).__name__}")
        if input_ids.dim() != 1 or input_ids.shape[0] != rows:
            raise ValueError(f"input_ids must be [{rows}], got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be int32/int64, got {input_ids.dtype}")
    if config.hash_table is not None:
        table = config.hash_table.to(device)
        ids64 = input_ids.to(device, torch.int64)  # type: ignore[union-attr]
        if rows and (int(ids64.min()) < 0 or int(ids64.max()) >= table.shape[0]):
            raise ValueError(
                f"input_ids outside the hash table [0, {table.shape[0]}): "
                f"min {int(ids64.min())}, max {int(ids64.max())}"
            )
        topk_ids = table[ids64].to(torch.int64)
    else:
        sel = scores.clone()
        if config.bias is not None:
            sel = sel + config.bias.to(device)
        if config.bias_vl is not None and config.image_sentinel_lo > 0:
            lo = config.image_sentinel_lo
            ids = input_ids.to(device)  # type: ignore[union-attr]
            image = (ids >= lo) & (ids < lo + IMAGE_SENTINELS)
            sel = torch.where(image.unsqueeze(1), scores + config.bias_vl.to(device), sel)
        # NaN ranks below -inf: map NaN to -inf and push true -inf one notch up.
        key = torch.where(torch.isnan(sel), torch.full_like(sel, float("-inf")), sel)
        rank = torch.isnan(sel).to(torch.int8)  # 0 = number, 1 = NaN
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort(rank.gather(1, order), dim=1, stable=True).indices)
        topk_ids = order[:, : config.top_k]
    chosen = scores.gather(1, topk_ids)
    weights = _renormalize(chosen, config.routed_scaling_factor)
    return weights, topk_ids.to(torch.int32)


# ----------------------------------------------------------------------------- scenarios


def _distinct(gen: torch.Generator, pool: torch.Tensor, k: int, p: torch.Tensor | None = None):
    if p is None:
        return pool[torch.randperm(pool.numel(), generator=gen)[:k]]
    return pool[torch.multinomial(p, k, replacement=False, generator=gen)]


def scenario_topk_ids(
    scenario: str,
    rows: int,
    top_k: int,
    experts: int,
    seed: int = 0,
    trace: str | Path | None = None,
) -> torch.Tensor:
    """Seeded top-k ids int32 [rows, top_k] (CPU) for a benchmark scenario:

    - uniform: top_k distinct experts per row, uniformly;
    - zipf: popularity proportional to rank^-1.1 over a seeded expert order;
    - hot: one expert in every row, the others uniform;
    - correlated: speculative draft rows that share experts: a pool of
      max(top_k, round(rows*top_k*22/36)) experts, each row picks top_k distinct
      from it (about 22 distinct experts at 6 rows x top-6);
    - replay: step (seed mod steps) of a recorded trace, an .npz file with
      `topk_ids` [steps, rows_trace, top_k]; the first `rows` rows, which must
      hold distinct ids in [0, experts) per row.

    Raises ValueError for an unknown scenario, bad sizes, a missing/corrupt trace.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0, got {rows!r}")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        raise ValueError(f"experts must be a positive int, got {experts!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if scenario == "replay":
        return _replay(trace, rows, top_k, experts, seed)
    gen = torch.Generator().manual_seed(seed)
    everyone = torch.arange(experts)
    out = torch.empty(rows, top_k, dtype=torch.int64)
    if scenario == "uniform":
        for r in range(rows):
            out[r] = _distinct(gen, everyone, top_k)
    elif scenario == "zipf":
        order = torch.randperm(experts, generator=gen)
        p = torch.arange(1, experts + 1, dtype=torch.float64) ** -1.1
        for r in range(rows):
            out[r] = _distinct(gen, order, top_k, p)
    elif scenario == "hot":
        hot = int(torch.randint(experts, (), generator=gen))
        others = everyone[everyone != hot]
        for r in range(rows):
            out[r, 0] = hot
            out[r, 1:] = _distinct(gen, others, top_k - 1)
    else:  # correlated
        size = min(experts, max(top_k, round(rows * top_k * 22 / 36)))
        pool = _distinct(gen, everyone, size)
        for r in range(rows):
            out[r] = _distinct(gen, pool, top_k)
    return out.to(torch.int32)


def _replay(trace: str | Path | None, rows: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    if trace is None:
        raise ValueError("scenario 'replay' needs trace=<path to .npz with topk_ids>")
    path = Path(trace)
    try:
        data = np.load(path)
        if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy file loads as a bare array
            raise ValueError("not an .npz archive: a single array, as numpy.save writes")
        with data:
            ids = np.asarray(data["topk_ids"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip("'\"")
        if isinstance(error, ValueError) and "pickle" in why:  # np.load of a file that is not .npy / .npz
            why = "not an .npz archive"
        raise ValueError(
            f"trace {path}: cannot read topk_ids ({why}); expected an .npz archive (numpy.savez)"
            " holding an integer array topk_ids [steps, rows, top_k]"
        ) from error
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"trace {path}: topk_ids must be integer [steps, rows, top_k], got {ids.shape} {ids.dtype}")
    steps, trace_rows, trace_k = ids.shape
    if trace_k != top_k or rows > trace_rows or steps == 0:
        raise ValueError(f"trace {path} holds [{steps}, {trace_rows}, {trace_k}]; asked for {rows} rows x top-{top_k}")
    step = ids[seed % steps, :rows].astype(np.int64)
    if step.size and (step.min() < 0 or step.max() >= experts):
        raise ValueError(
            f"trace {path}: step {seed % steps} has expert ids in [{step.min()}, {step.max()}],"
            f" outside [0, {experts}) (recorded for another expert count?)"
        )
    if any(len(set(row.tolist())) != top_k for row in step):
        raise ValueError(f"trace {path}: step {seed % steps} repeats an expert within a row")
    return torch.from_numpy(step.astype(np.int32))


def scenario_weights(rows: int, top_k: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Seeded routing weights fp32 [rows, top_k] (CPU): router-like positive
    scores renormalized per row, times `scale` (the routed scaling factor).
    Raises ValueError for rows < 0, top_k < 1, or
    a scale that is not finite and > 0; TypeError for non-int sizes / seed."""
    for name, v in (("rows", rows), ("top_k", top_k), ("seed", seed)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if rows < 0 or top_k < 1:
        raise ValueError(f"need rows >= 0 and top_k >= 1, got rows={rows}, top_k={top_k}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    gen = torch.Generator().manual_seed(seed + 1)
    scores = sqrtsoftplus(torch.randn(rows, top_k, generator=gen) * 2)
    return _renormalize(scores, scale)
