"""One rank of a whole decode-step MoE layer, built to be timed.

    x BF16 [T, H] ─► gate (fp32 logits [T, E]) ─► router (sqrtsoftplus top-k)
      ├─► shared expert (fused kernels, or BF16 GEMMs)                ─► shared [T, H]
      └─► routed experts: our kernels (MoEStep: the fused front, or the router
                          then route where the front does not apply; GEMM1 ─► GEMM2)
                          or a backend's forward (torch-bf16, FlashInfer, ...)
    ─► finalize (top-k weighted sum + the shared add) [─► all-reduce over the TP group]

- `LayerWeights`: one rank's weights of one layer (router bias, its slice of
  the shared expert, its slice of the routed experts). `generate_full_layer`
  + `slice_layer` give a real TP-N rank (slices of one full layer, so the
  all-reduced output can be checked against the unsliced layer);
  `generate_shard_layer` draws one rank's shard directly (the shape
  `moebench sweep --tp` times, with the same expert weights as the sweep).
- `scenario_gate_weight`: a BF16 gate weight whose logits for the case's x
  put each row's scenario experts on top, so a real gate GEMM and the real
  router reproduce a benchmark routing scenario (uniform, correlated, ...).
- `StepGate` / `StepSharedExpert`: the gate and the shared expert as a
  serving stack runs them (weights converted once, one GEMM per projection;
  the shared expert on the fused kernels of `kernels.shared_expert` where
  they apply, `path` says), under the reference's names (`protocol.Gate`,
  `protocol.SharedExperts`).
- `KernelStep`: `MoEStep` + `RoutedExpertGemm` (its fused front bound to the
  layer's router where `front_applies`: top-k + MXFP8 x + route record in
  one launch instead of the torch router and `route`) + the finalize kernel
  (the shared add fused into it); `BackendStep`: the same layer with a backend's
  routed experts, the shared output added after. Both expose the whole step
  (`run`), the gate (`gate`) and each stage on its own (`stage_calls`).
- `step_oracle`: the reference layer's finalized forward in fp64.

Shapes are one rank's: rows T (1..8), hidden H, routed experts E, top_k, the
rank's intermediate I (I_full / tp) for the routed and the shared expert.
"""

from __future__ import annotations

import abc
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moebench.formats import ExpertWeights, generate_expert_weights
from moebench.integration.reference_layer import (
    Mxfp4Experts, ReferenceGate, ReferenceMoELayer, ReferenceRouter, ReferenceSharedExpert,
)  # fmt: skip
from moebench.integration.side_stream import on_side_stream
from moebench.integration.step import MoEStep, bind_front, build_moe_steps, front_refusal
from moebench.integration.tp_step import rank_slice
from moebench.models import MoEConfig
from moebench.moe_output import MoEOutput, UnfinalizedMoEOutput
from moebench.record import MAX_ROWS
from moebench.reference import reference_moe, swiglu_clamped
from moebench.routing import RouterConfig, route

__all__ = [
    "BackendStep", "DecodeStep", "FixedLogitsGate", "KernelStep", "LayerWeights", "StepGate",
    "StepSharedExpert", "build_runner", "generate_full_layer", "generate_shard_layer",
    "scenario_gate_weight", "slice_layer", "step_oracle",
]  # fmt: skip

#: Target logits of a scenario gate: N(0, NOISE²) everywhere, + BOOST on the
#: row's scenario experts. With the router bias of std BIAS_STD the chosen
#: experts' selection scores (~2.4) stay well above every other (~1.4 at most).
SCENARIO_BOOST = 6.0
SCENARIO_NOISE = 0.3
BIAS_STD = 0.1
_SHARED_SEED = 7_777
_BIAS_SEED = 104_729
_GATE_SEED = 15_485_863


# ----------------------------------------------------------------------------- weights


@dataclass
class LayerWeights:
    """One rank's weights of one MoE layer (the gate weight is per case, see
    `scenario_gate_weight`).

    bias: fp32 [E] router selection bias (replicated on every rank);
    shared_w1 / shared_w3: BF16 [I, H] gate / up rows of the shared expert,
    shared_w2: BF16 [H, I] (I = this rank's slice); experts: this rank's
    canonical MXFP4 routed experts (`formats.ExpertWeights`).
    """

    bias: torch.Tensor
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor
    experts: ExpertWeights

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared expert's BF16 weights (read once per call)."""
        return sum(t.numel() * t.element_size() for t in (self.shared_w1, self.shared_w3, self.shared_w2))


def _check_config(config: MoEConfig) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a models.MoEConfig, got {type(config).__name__}")


def _router_bias(experts: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + _BIAS_SEED)
    return (BIAS_STD * torch.randn(experts, generator=gen)).to(device)


def _shared_weights(hidden: int, inter: int, seed: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(seed + _SHARED_SEED)

    def draw(rows: int, cols: int, k: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)

    return draw(inter, hidden, hidden), draw(inter, hidden, hidden), draw(hidden, inter, inter)


def generate_full_layer(config: MoEConfig, seed: int, device: torch.device | str = "cpu") -> LayerWeights:
    """The full (unsliced, TP1) layer of `config`, seeded, on `device`:
    routed experts `generate_expert_weights(config.shard(1), seed)`, the
    shared expert at the full intermediate (BF16, std 1/sqrt(K)), the router
    bias (std 0.1, drawn on the CPU so every device gets the same bits).
    The same seed gives the same layer on every GPU of one kind, which is
    what lets TP ranks slice one layer without exchanging it."""
    _check_config(config)
    dev = torch.device(device)
    experts = generate_expert_weights(config.shard(1), seed, dev)
    w1, w3, w2 = _shared_weights(config.hidden, config.intermediate, seed, dev)
    return LayerWeights(_router_bias(config.experts, seed, dev), w1, w3, w2, experts)


def slice_layer(full: LayerWeights, tp: int, rank: int) -> LayerWeights:
    """Rank `rank` of a TP-`tp` split of `full`: the routed experts'
    `tp_step.rank_slice` and rows [r*I/tp, (r+1)*I/tp) of the shared expert
    (w1 / w3 rows, w2 columns; copies); the bias is shared. Raises ValueError
    for a bad tp / rank (I/tp must be a multiple of 32)."""
    experts = rank_slice(full.experts, tp, rank)
    s = experts.intermediate
    lo, hi = rank * s, (rank + 1) * s
    return LayerWeights(
        full.bias, full.shared_w1[lo:hi].contiguous(), full.shared_w3[lo:hi].contiguous(),
        full.shared_w2[:, lo:hi].contiguous(), experts,
    )  # fmt: skip


def generate_shard_layer(config: MoEConfig, tp: int, seed: int, device: torch.device | str = "cpu") -> LayerWeights:
    """One rank's shard of a TP-`tp` layer drawn directly (no full layer):
    routed experts `generate_expert_weights(config.shard(tp), seed)` (the
    weights `moebench sweep --tp` uses for that seed) and a shared expert of
    intermediate I/tp. Raises ValueError for a tp that does not split I."""
    _check_config(config)
    dev = torch.device(device)
    shape = config.shard(tp)
    experts = generate_expert_weights(shape, seed, dev)
    w1, w3, w2 = _shared_weights(config.hidden, shape.intermediate, seed, dev)
    return LayerWeights(_router_bias(config.experts, seed, dev), w1, w3, w2, experts)


def scenario_gate_weight(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: int,
    bias: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """A BF16 gate weight [E, H] (CPU) whose logits x @ W^T make the DeepSeek-V4
    router pick, for each row t of `x` (BF16 [T, H]), exactly the experts of
    `topk_ids[t]` (int [T, top_k], distinct per row) as a set.

    Target logits D [T, E] = N(0, 0.3²) + 6 on the row's experts (seeded);
    W = D^T (X X^T)^-1 X, the least-norm solution of X W^T = D (fp64, then
    rounded to BF16). The gate GEMM stays a real E x H GEMM; only its values
    are chosen. Checked here with the router on the CPU (with `bias`, fp32
    [E], when given). Raises ValueError for bad shapes or linearly dependent
    rows of x, RuntimeError if the rounded weight does not reproduce the
    routing (not expected: the margin is ~1 in selection score)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"x must be a BF16 [rows, H] tensor, got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")  # fmt: skip
    rows = x.shape[0]
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != rows:
        raise ValueError(f"topk_ids must be [{rows}, top_k], got {tuple(getattr(topk_ids, 'shape', ()))}")
    ids = topk_ids.detach().to("cpu", torch.int64)
    top_k = ids.shape[1]
    if rows and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"topk_ids must lie in [0, {experts})")
    xd = x.detach().to("cpu", torch.float64)
    gen = torch.Generator().manual_seed(seed + _GATE_SEED)
    target = torch.randn(experts, rows, generator=gen, dtype=torch.float64) * SCENARIO_NOISE
    target[ids, torch.arange(rows).unsqueeze(1).expand_as(ids)] += SCENARIO_BOOST
    try:
        weight = target @ torch.linalg.solve(xd @ xd.T, xd)
    except RuntimeError as error:  # torch.linalg.LinAlgError
        raise ValueError(f"x: its {rows} rows are linearly dependent; cannot place the scenario routing") from error
    weight = weight.to(torch.bfloat16).contiguous()
    logits = F.linear(x.detach().cpu().float(), weight.float())
    cpu_bias = None if bias is None else bias.detach().to("cpu", torch.float32)
    _, got = route(logits, RouterConfig(experts, top_k, 1.0, cpu_bias))
    for t in range(rows):
        if set(got[t].tolist()) != set(ids[t].tolist()):
            raise RuntimeError(f"the scenario gate routes row {t} to {sorted(got[t].tolist())}, "
                               f"not {sorted(ids[t].tolist())}")  # fmt: skip
    return weight


# ----------------------------------------------------------------------------- gate, shared expert


class StepGate:
    """The gate as a serving GPU runs it: x BF16 [T, H] -> (fp32 logits [T, E],
    None) = linear(x.float(), W.float()) with the fp32 copy of the BF16 weight
    W [E, H] made once. Same numerics as `ReferenceGate` (fp32 products of the
    BF16 operands, fp32 accumulation); it reads 4 bytes per weight (a BF16-in,
    fp32-out gate GEMM would read 2)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"weight must be BF16 [E, H], got {getattr(weight, 'dtype', type(weight))}")
        self.weight = weight
        self.weight_f32 = weight.float().contiguous()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x.float(), self.weight_f32), None


class FixedLogitsGate:
    """A gate that already ran: returns (`logits`, None) whatever x is (the
    step timed from the router logits on, without the gate GEMM)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.logits, None


class StepSharedExpert:
    """The shared expert as a serving GPU runs it: gate_up = x @ [w1; w3]^T
    (one BF16 GEMM, fp32 accumulation, BF16 out), h = swiglu_clamped in fp32
    rounded to BF16, out = h @ w2^T (BF16 [T, H]). w1 / w3 BF16 [I, H], w2 BF16
    [H, I], limit: the SwiGLU clamp.

    On an sm_90 GPU with nvidia-cutlass-dsl and a shape the kernels take
    (`kernels.shared_expert.shape_refusal`), calls of 1-8 rows run the two
    fused weight-streaming kernels (`SharedExpertKernels`: the same math, one
    launch per GEMM, weights converted once here); everything else (other row
    counts, the CPU, `kernels=False`) takes the torch path above. `path` says
    which path 1-8 row calls take ("kernels" or "torch"), `kernel_refusal`
    why not the kernels (None when they are used), `last_path` which path the
    latest call took (None before the first). tactics: optional
    {stage: SharedTactic} for the kernels (default: built-in per shape)."""

    def __init__(
        self,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        limit: float,
        *,
        kernels: bool = True,
        tactics: dict | None = None,
    ) -> None:
        if w1.shape != w3.shape or w2.shape != (w1.shape[1], w1.shape[0]):
            raise ValueError(f"w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} must be [I, H], w2 {tuple(w2.shape)} [H, I]")
        self.w13 = torch.cat([w1, w3]).contiguous()
        self.w2 = w2.contiguous()
        self.inter = w1.shape[0]
        self.limit = float(limit)
        self.kernels = None
        self.kernel_refusal: str | None = "kernels=False" if not kernels else _shared_kernel_refusal(w1, w3, w2)
        if self.kernel_refusal is None:
            from moebench.kernels.shared_expert import SharedExpertKernels, to_shared_layout

            self.kernels = SharedExpertKernels(to_shared_layout(w1, w3, w2), self.limit, tactics=tactics)
        self.last_path: str | None = None

    @property
    def path(self) -> str:
        """ "kernels" when calls of 1-8 rows take the fused kernels, else "torch"."""
        return "kernels" if self.kernels is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.kernels.accepts(x):
            self.last_path = "kernels"
            return self.kernels(x)
        self.last_path = "torch"
        gate_up = F.linear(x, self.w13).float()  # one widening launch for both halves
        i = self.inter
        h = swiglu_clamped(gate_up[:, :i], gate_up[:, i:], self.limit).to(torch.bfloat16)
        return F.linear(h, self.w2)


def _shared_kernel_refusal(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why the fused shared-expert kernels cannot serve these weights (None: they can)."""
    from moebench.kernels.shared_expert import default_shared_tactic, kernels_refusal, shape_refusal

    if any(t.dtype != torch.bfloat16 for t in (w1, w3, w2)):
        return "the kernels take BF16 weights"
    if not (w1.device == w3.device == w2.device):
        return "w1, w3 and w2 are on different devices"
    hidden, inter = int(w1.shape[1]), int(w1.shape[0])
    reason = kernels_refusal(w1.device) or shape_refusal(hidden, inter)
    if reason:
        return reason
    sms = torch.cuda.get_device_properties(w1.device).multi_processor_count
    try:  # a shape the rules allow but no built-in tactic fits (e.g. a huge K)
        for stage in (1, 2):
            default_shared_tactic(hidden, inter, stage, sms)
    except ValueError as error:
        return str(error)
    return None


def build_runner(
    weights: LayerWeights,
    gate_weight: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_limit: float,
    *,
    reference: bool = False,
) -> ReferenceMoELayer:
    """A `protocol.MoERunner` of one rank's layer: the router folds
    `routed_scaling_factor` (runner-side factor 1.0, as DeepSeek-V4); gate and
    shared expert are `StepGate` / `StepSharedExpert`, or with `reference`
    the reference's (`ReferenceGate`, `ReferenceSharedExpert`)."""
    experts = weights.experts.experts
    if reference:
        gate = ReferenceGate(gate_weight)
        shared = ReferenceSharedExpert(weights.shared_w1, weights.shared_w3, weights.shared_w2, swiglu_limit)
    else:
        gate = StepGate(gate_weight)
        shared = StepSharedExpert(weights.shared_w1, weights.shared_w3, weights.shared_w2, swiglu_limit)
    router = ReferenceRouter(experts, top_k, routed_scaling_factor, weights.bias)
    return ReferenceMoELayer(gate, router, shared, Mxfp4Experts(weights.experts))


# ----------------------------------------------------------------------------- steps

Call = Callable[[], object]


class DecodeStep(abc.ABC):
    """One rank's MoE layer for one static input x BF16 [T, H].

    run(with_gate=...) -> BF16 [T, H]: the rank's finalized output (the TP
    partial), all-reduced (SUM, in place) over `group` when `all_reduce`;
    `partial(with_gate)` is the same without the all-reduce. overlap_shared:
    the whole step runs the shared expert on a side stream beside the gate
    and the routed experts (`side_stream.on_side_stream`), as a serving stack
    does (then run(with_gate=True) minus run() is not the gate's time alone:
    the gate overlaps the shared expert); the stages alone run in order
    either way. Raises ValueError for x not BF16 [rows, H], TypeError for a
    non-bool overlap_shared. Without the gate
    the step starts from the router logits one eager gate call made at
    construction (`self.logits`). `gate()` runs the gate alone.
    `stage_calls()` runs the stages (`stages`, in order) once eagerly and
    returns one closure per stage that reruns just that stage on the inputs
    the stages before it produced (for per-stage timing). No call syncs the
    host, so a CUDA graph captures each of them (when the routed path can be
    captured)."""

    stages: tuple[str, ...] = ()

    def __init__(
        self,
        runner: ReferenceMoELayer,
        x: torch.Tensor,
        *,
        all_reduce: bool = False,
        group=None,
        overlap_shared: bool = True,
    ) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"x must be BF16 [rows, H], got {getattr(x, 'dtype', type(x))}")
        if not isinstance(overlap_shared, bool):
            raise TypeError(f"overlap_shared must be a bool, got {type(overlap_shared).__name__}")
        self.runner = runner
        self.x = x
        self.all_reduce = all_reduce
        self.group = group
        self.overlap_shared = overlap_shared
        self.logits = runner.gate(x)[0]

    def gate(self) -> torch.Tensor:
        """The router logits of x (the gate GEMM alone)."""
        return self.runner.gate(self.x)[0]

    @abc.abstractmethod
    def partial(self, with_gate: bool = False) -> torch.Tensor:
        """The rank's finalized output BF16 [T, H], before any all-reduce."""

    def run(self, with_gate: bool = False) -> torch.Tensor:
        """The step: partial(with_gate), then the all-reduce when asked for."""
        out = self.partial(with_gate)
        if self.all_reduce:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def routing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k]) of x."""
        return self.runner.router.select_experts(
            hidden_states=self.x, router_logits=self.logits, topk_indices_dtype=torch.int32
        )

    def stage_calls(self) -> list[tuple[str, Call]]:
        state = {"x": self.x, "logits": self.logits}
        calls = []
        for name in self.stages:
            fn = getattr(self, f"_stage_{name}")
            inputs = dict(state)
            calls.append((name, functools.partial(fn, inputs)))
            state.update(fn(inputs))
        return calls

    # stages shared by both kinds
    def _stage_router(self, s: dict) -> dict:
        weights, ids = self.runner.router.select_experts(
            hidden_states=s["x"], router_logits=s["logits"], topk_indices_dtype=torch.int32
        )
        return {"topk_weights": weights, "topk_ids": ids}

    def _stage_shared(self, s: dict) -> dict:
        return {"shared": self.runner._shared_experts(s["x"])}


class KernelStep(DecodeStep):
    """The layer on our kernels: `MoEStep` (gate, shared expert, then the fused
    front where `front_applies`, else the runner's router + `route`; then
    `gemms`) and the finalize kernel with the shared add fused. Stages, as
    MoEStep runs them:

    - front path (`FRONT_STAGES`): front (top-k + MXFP8 x + route record in
      one launch), shared, gemm1, gemm2, finalize;
    - router path (`ROUTER_STAGES`): router (the runner's torch top-k),
      shared, route (MXFP8 x + route record), gemm1, gemm2, finalize.

    gemm: a RoutedExpertGemm bound to the runner's routed experts, or None:
    then the step builds it as a serving stack does at load
    (`step.build_moe_steps`: `kernels.binding.build_routed_expert_gemms`,
    the tuning tables' family and tactics, the front bound per `front`);
    finalize_fn(unfinalized, scale=, shared=) -> BF16 [T, H]: default the
    finalize kernel (`kernels.finalize.finalize`, compiled here, outside any
    capture); front: bind the fused front to the runner's router
    (`step.bind_front`, compiled here) where its routing allows it (the
    DeepSeek-V4 sqrtsoftplus top-k with the layer's bias); with False the
    gemm is left as it is. `uses_front` / `front_refusal` (None on the front
    path, else why not) / `routing_path` ("front" or "router+route") say
    which path the step takes. Raises ValueError when MoEStep would not take
    the kernels for this call (rows outside 1..8, another device, weights the
    gemm is not bound to)."""

    FRONT_STAGES = ("front", "shared", "gemm1", "gemm2", "finalize")
    ROUTER_STAGES = ("router", "shared", "route", "gemm1", "gemm2", "finalize")
    stages = FRONT_STAGES

    def __init__(
        self,
        runner,
        gemm,
        x,
        *,
        finalize_fn=None,
        front: bool = True,
        all_reduce: bool = False,
        group=None,
        overlap_shared: bool = True,
    ) -> None:
        super().__init__(runner, x, all_reduce=all_reduce, group=group, overlap_shared=overlap_shared)
        if gemm is None:
            (self.step,) = build_moe_steps([runner], MAX_ROWS, front=front, overlap_shared=overlap_shared)
            gemm = self.step.gemm
            if gemm is None:
                raise ValueError("the low-batch kernels refused this layer (build_routed_expert_gemms logged why)")
        else:
            if front:
                bind_front(gemm, runner)  # a refusal is reported by front_refusal below
            self.step = MoEStep(runner, gemm, MAX_ROWS, overlap_shared=overlap_shared)
        self.front_refusal = front_refusal(gemm, runner)
        self.uses_front = self.front_refusal is None
        self.stages = self.FRONT_STAGES if self.uses_front else self.ROUTER_STAGES
        if finalize_fn is None:
            from moebench.kernels.finalize import compile_finalize_kernel, finalize

            compile_finalize_kernel(True)
            finalize_fn = finalize
        self.finalize_fn = finalize_fn
        self.gemm = gemm
        fixed = copy.copy(runner)
        fixed.gate = FixedLogitsGate(self.logits)
        self.step_no_gate = MoEStep(fixed, gemm, MAX_ROWS, overlap_shared=overlap_shared)
        if not self.step.uses_kernels(x, low_batch=True):
            raise ValueError(
                f"the low-batch kernels do not take this call (x {tuple(x.shape)} {x.dtype} on {x.device}; "
                f"layer deferrable: {self.step.deferrable})"
            )

    def partial(self, with_gate: bool = False) -> torch.Tensor:
        out = (self.step if with_gate else self.step_no_gate).run(self.x, None, low_batch=True)
        if not isinstance(out, MoEOutput) or not isinstance(out.routed, UnfinalizedMoEOutput):
            raise RuntimeError("MoEStep did not take the low-batch kernels")
        return self.finalize_fn(out.routed, scale=out.routed_scaling_factor, shared=out.shared_output)

    @property
    def routing_path(self) -> str:
        """ "front" (fused front) or "router+route" (the runner's router, then route)."""
        return "front" if self.uses_front else "router+route"

    def _stage_front(self, s: dict) -> dict:
        return {"routing": self.gemm.front(s["x"], s["logits"], None)}

    def _stage_route(self, s: dict) -> dict:
        return {"routing": self.gemm.route(s["x"], s["topk_ids"], s["topk_weights"])}

    def _stage_gemm1(self, s: dict) -> dict:
        return {"h": self.gemm.gemm1(s["routing"])}

    def _stage_gemm2(self, s: dict) -> dict:
        return {"routed": self.gemm.gemm2(s["routing"], *s["h"])}

    def _stage_finalize(self, s: dict) -> dict:
        return {"out": self.finalize_fn(s["routed"], scale=1.0, shared=s["shared"])}


def _add_shared(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return (routed.float() + shared.float()).to(torch.bfloat16)


class BackendStep(DecodeStep):
    """The layer with a backend's routed experts (`backends.base.Backend`:
    its `forward` routes, runs the experts and finalizes the top-k sum), the
    shared output added after in fp32. Stages: router, shared, experts,
    shared_add. prepared: `backend.prepare(...)` of the runner's experts."""

    stages = ("router", "shared", "experts", "shared_add")
    routing_path = "router"

    def __init__(
        self, runner, backend, prepared, x, *, all_reduce: bool = False, group=None, overlap_shared: bool = True
    ) -> None:
        super().__init__(runner, x, all_reduce=all_reduce, group=group, overlap_shared=overlap_shared)
        self.backend = backend
        self.prepared = prepared

    def partial(self, with_gate: bool = False) -> torch.Tensor:
        with on_side_stream(self.runner._shared_experts, self.x, self.overlap_shared) as shared:  # as MoEStep
            logits = self.gate() if with_gate else self.logits
            weights, ids = self.runner.router.select_experts(
                hidden_states=self.x, router_logits=logits, topk_indices_dtype=torch.int32
            )
            routed = self.backend.forward(self.prepared, self.x, ids, weights)
        return _add_shared(routed, shared)

    def _stage_experts(self, s: dict) -> dict:
        return {"routed": self.backend.forward(self.prepared, s["x"], s["topk_ids"], s["topk_weights"])}

    def _stage_shared_add(self, s: dict) -> dict:
        return {"out": _add_shared(s["routed"], s["shared"])}


# ----------------------------------------------------------------------------- oracle


def step_oracle(
    weights: LayerWeights,
    gate_weight: torch.Tensor,
    x: torch.Tensor,
    *,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_limit: float,
    activation: str = "mxfp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp64 [T, H], topk_ids int32 [T, top_k]): the reference layer's
    finalized forward of x (BF16 [T, H]) with `weights` (pass the full layer
    to check a TP all-reduce): `ReferenceGate` (fp32 logits), the reference
    router, the routed experts by `reference_moe(activation=...)` in fp64
    (the oracle family of the backend under test: "mxfp8", "bf16",
    "fp8_token") and the shared expert in fp64 from its BF16 weights; routed +
    shared. With "mxfp8" this is `ReferenceMoELayer.forward` without its BF16
    roundings. Raises as reference_moe for bad inputs."""
    runner = build_runner(weights, gate_weight, top_k, routed_scaling_factor, swiglu_limit, reference=True)
    logits, _ = runner.gate(x)
    topk_w, topk_ids = runner.router.select_experts(
        hidden_states=x, router_logits=logits, topk_indices_dtype=torch.int32
    )
    xd = x.double()
    shared = swiglu_clamped(xd @ weights.shared_w1.double().T, xd @ weights.shared_w3.double().T, swiglu_limit)
    shared = shared @ weights.shared_w2.double().T
    routed = reference_moe(x, topk_ids, topk_w, weights.experts, activation=activation, dtype=torch.float64).output
    return routed + shared, topk_ids
