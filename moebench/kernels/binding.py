"""RoutedExpertGemm: the route kernel (with the MXFP8 quantization of x fused
in, or the fused front) and the GEMM pair bound to one MoE layer's
routed-expert weights.

    x (BF16) + top-k ids ──► route (MXFP8 x, record, permute map) ─┐
    router logits + x ──► front (top-k, MXFP8 x, record) ───────────┤ (after set_front)
                                                                    ▼
                         GEMM1 (SwiGLU, MXFP8 H) ─► GEMM2 ─► UnfinalizedMoEOutput

The weights are converted once from the canonical layout (`formats.ExpertWeights`)
to the kernels' layout; every kernel is compiled when the layer is bound (never
inside a CUDA-graph capture) and cached per process and shape class. Calls
launch on torch's current stream with programmatic dependent launch between the
kernels and no host synchronization, so a CUDA graph captures them.

A layer runs one of two kernel families, each with its own copy of the
weights in its layout: FP8 (e4m3 weights for wgmma, the MXFP8 x and H as
they are) or BF16 (weights decoded to BF16 for mma.sync). By default the
tuning tables' measured µs choose (`kernels.family`); with no table, FP8
where its built-in tactics fit the shape. `fp8=True` / `False` asks for one.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moebench.formats import ExpertWeights
from moebench.kernels import front as _front
from moebench.kernels import fused as _fused
from moebench.kernels import gemm as _gemm
from moebench.kernels import route as _route
from moebench.kernels.family import FamilyChoice, resolve_family
from moebench.kernels.layout import KernelWeights, to_kernel_layout
from moebench.kernels.layer_plan import LayerPlan, plan_layer
from moebench.kernels.table import ShapeClass
from moebench.kernels.tactic import GemmShape, GemmTactic, workspace_bytes_for
from moebench.moe_output import UnfinalizedMoEOutput
from moebench.record import MAX_EXPERTS, MAX_ROWS, MAX_TOP_K, TILE, cta_words, max_ctas, route_words

__all__ = [
    "KERNELS", "FrontConfig", "KernelLauncher", "LayerPlan", "Routing", "RoutedExpertGemm",
    "build_routed_expert_gemms", "check_weights", "cta_words", "max_ctas", "route_words",
]  # fmt: skip

FrontConfig = _front.FrontConfig

logger = logging.getLogger(__name__)


@dataclass
class Routing:
    """What GEMM1 and GEMM2 read, from `RoutedExpertGemm.route` or `.front`.

    x_quant uint8 (e4m3) [rows, H], x_scale uint8 (E8M0) [rows, H/32],
    topk_ids int32 [rows, top_k], topk_weights fp32 [rows, top_k],
    permuted int32 [rows, top_k] (slot -> permuted row, -1 non-local),
    record int32 [route_words(ctas)], ctas: token tiles the record allows for;
    x_deq bf16 [rows, H] (the act_bf16 GEMM1 operand, written by the same
    launch as x_quant when the GEMM1 tactic of this row count reads it) or None;
    early_ids: the launch that made the record released its dependents only
    after its own griddepcontrol.wait (`route` for a `spec` GEMM1 tactic), so
    GEMM1 may read topk_ids before its wait; rows: token rows (1-8), what
    picks the tactics of every launch after the route.
    """

    x_quant: torch.Tensor
    x_scale: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    permuted: torch.Tensor
    record: torch.Tensor
    ctas: int
    x_deq: torch.Tensor | None = None
    early_ids: bool = False
    rows: int = 0

    def __post_init__(self) -> None:
        # the row count, said once where the Routing is made (route / front pass it; a Routing
        # made elsewhere takes its ids' rows); GEMM1, GEMM2 and the fused launch read this
        if not self.rows and isinstance(self.topk_ids, torch.Tensor):
            self.rows = self.topk_ids.shape[0]


def check_weights(weights: ExpertWeights, top_k: int) -> None:
    """Raise ValueError (TypeError for a wrong type) unless `weights` can take
    the kernels: CUDA tensors, contiguous and 16-byte aligned; hidden and the
    padded intermediate multiples of 128, the logical intermediate a multiple
    of 32; experts a multiple of 32 in [32, 512]; top_k in [1, 8]; the
    intermediate padding zero. Each message names what is wrong."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be an int in [1, {MAX_TOP_K}], got {top_k!r}")
    e, h = weights.experts, weights.hidden
    i, ip = weights.intermediate, weights.padded_intermediate
    if e % 32 or not 32 <= e <= MAX_EXPERTS:
        raise ValueError(f"experts must be a multiple of 32 in [32, {MAX_EXPERTS}], got {e}")
    if h % 128:
        raise ValueError(f"hidden must be a multiple of 128, got {h}")
    if ip % 128 or i % 32:
        raise ValueError(f"padded intermediate must be a multiple of 128 and the logical one of 32, got {ip} / {i}")
    if not weights.padding_is_zero():
        raise ValueError(f"the intermediate padding ({i}..{ip}) of w13/w2 or their scales is not zero")
    for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp"):
        t = getattr(weights, name)
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")


def _check_topk_tensors(topk_ids, topk_weights, device: torch.device) -> None:
    """TypeError for non-tensors, ValueError for top-k tensors off `device`."""
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, x on {device}: move it to x's device")


def _check_routing(routing) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing (from route or front), got {type(routing).__name__}")


class KernelLauncher:
    """What a binding compiles and launches its kernels with: the CuTe DSL
    kernels (`KERNELS`). Each method calls the kernel module's function of the
    same role at call time; a test subclasses it to record the launch
    sequence without a GPU (`tests/kernels/test_layer_plan.py`)."""

    def compile_route(self, **flags):
        return _route.compile_route_kernel(**flags)

    def compile_front(self, experts: int, top_k: int, image: bool, deq: bool = False):
        return _front.compile_front_kernel(experts, top_k, image, deq=deq)

    def compile_gemm(self, shape: GemmShape, tactic: GemmTactic, stage: int, wide_scales: bool):
        return _gemm.compile_gemm(shape, tactic, stage, wide_scales)

    def compile_fused(self, shape: GemmShape, tactic, wide_scales: bool):
        return _fused.compile_fused(shape, tactic, wide_scales)

    def route(self, *args, **kwargs) -> None:
        _route.launch_route_quantize(*args, **kwargs)

    def front(self, *args, **kwargs) -> None:
        _front.launch_front(*args, **kwargs)

    def gemm1(self, *args, **kwargs) -> None:
        _gemm.gemm1(*args, **kwargs)

    def gemm2(self, *args, **kwargs) -> None:
        _gemm.gemm2(*args, **kwargs)

    def fused(self, *args, **kwargs) -> None:
        _fused.fused_layer(*args, **kwargs)

    def act_to_bf16(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return _gemm.act_to_bf16(q, scale, out=out)


#: The CuTe DSL kernels: what every binding launches unless told otherwise.
KERNELS = KernelLauncher()


def _split_k_workspace(plan: LayerPlan, kw: KernelWeights, workspace: torch.Tensor | None) -> torch.Tensor | None:
    """The split-K workspace of `plan` on `kw`: None when no tactic splits
    K, else the caller's `workspace` (checked: ValueError / TypeError) or a
    new zeroed one, sized for every row count and both GEMMs."""
    need = workspace_bytes_for(plan.shape.gemm_shape,
                               ((stage, t, plan.ctas(rows)) for (stage, rows), t in plan.tactics.items()))  # fmt: skip
    if not need:
        return None
    if workspace is None:
        return _gemm.alloc_workspace(need, kw.device)
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
    have = workspace.numel() * workspace.element_size()
    if (
        workspace.dim() != 1
        or workspace.dtype not in (torch.uint8, torch.int32)
        or workspace.device != kw.device
        or have < need
        or have % 16
        or not workspace.is_contiguous()
        or workspace.data_ptr() % 16
    ):
        raise ValueError(
            f"workspace must be a contiguous, 16-byte aligned 1-D uint8/int32 tensor of"
            f" >= {need} bytes (a multiple of 16) on {kw.device}, zeroed once"
            f" (gemm.alloc_workspace), got {tuple(workspace.shape)} {workspace.dtype}"
            f" on {workspace.device}"
        )
    return workspace


def _compile(plan: LayerPlan, kw: KernelWeights, launcher: KernelLauncher) -> None:
    """Compile every kernel `plan` may launch on `kw` (cached per process)."""
    tactics = plan.tactics
    gemm1s = [t for (stage, _), t in tactics.items() if stage == 1]
    launcher.compile_route(quantize=True)
    if any(t.act_bf16 for t in gemm1s):
        launcher.compile_route(quantize=True, deq=True)
    if any(t.spec for t in gemm1s):
        launcher.compile_route(quantize=True, release_after_wait=True)  # `route` before a spec GEMM1
    shape, wide = plan.shape.gemm_shape, kw.scale_variant(plan.fp8)
    for ft in dict.fromkeys(t for t in plan.fused_tactics.values() if t is not None):
        launcher.compile_fused(shape, ft, wide)
    for (stage, _), tactic in tactics.items():
        launcher.compile_gemm(shape, tactic, stage, wide)
        if tactic.spec:  # the front's routing runs its plain twin (`gemm1`: the ids come with the record)
            launcher.compile_gemm(shape, replace(tactic, spec=False), stage, wide)


class RoutedExpertGemm:
    """The route kernel (quantize fused in) and GEMM pair bound to one layer's weights.

    weights: canonical ExpertWeights on a CUDA device (validated by
    `check_weights`); top_k: experts per row; tactics: None = per (stage,
    rows) from the tuning table of this device and shape class, else the
    built-in default (`moebench.kernels.table.load_tactic`); or explicit GEMM
    tactics {1: GemmTactic, 2: GemmTactic} (a missing stage: the built-in
    default; `{}` = the built-in defaults, no table). `tactic_sources`
    records where each (stage, rows) tactic came from.
    When a chosen tactic splits K (split_k > 1) the layer owns one zeroed
    split-K workspace (`self.workspace`, sized for every row count and both
    GEMMs by `workspace_bytes_for`, allocated here once, None otherwise);
    `workspace=` passes a caller's buffer instead (e.g. one shared by layers
    that always run one after the other on one stream; never share it between
    layers that may run concurrently). Raises ValueError / TypeError from
    `check_weights`, an invalid tactic or a too small workspace.
    `front_config` is the FrontConfig bound by `set_front` (None: no fused front).
    act_bf16 (default True): table and built-in tactics run with the BF16
    activation operand (their `_a16` twin: the route kernel / fused front
    also write x as BF16, GEMM1 also writes H as BF16, and the GEMMs skip the
    e4m3 decode; the same bits, 5-12 % less time on the H200, perf-notes v5);
    explicit `tactics` are used as given.
    fp8: the kernel family, one per layer (each lays the weights out in a
    copy of its own). None (the default): the faster family by the tuning
    tables' µs, else FP8 where its built-in tactics fit the shape, else BF16
    (`kernels.family.resolve_family`: explicit `tactics` decide by their
    family, `{}` takes the built-in rule); True: the FP8 family, weights
    laid out for the e4m3 operand, fp8 (wgmma) tactics (`_f8`: FP8 MMA on
    the MXFP8 x and H, no BF16 copies; act_bf16 is then ignored): the
    table's FP8-family entries (its "fp8" part, `moebench tune --fp8`),
    else `default_fp8_tactic`; False: the BF16 family (weights decoded to
    BF16 for mma.sync), the table's BF16 entries, else `default_tactic`.
    Explicit `tactics` must all be of the family run (ValueError naming the
    stage); a non-bool, non-None fp8 is a TypeError. `fp8` (bool) /
    `family` ("fp8" / "bf16") say which family the layer runs,
    `family_choice` (a `FamilyChoice`) how it was chosen and why.
    fused: whether `gemms` runs GEMM1 and GEMM2 as one launch (the fused
    layer, `kernels.fused`) instead of the pair, per row count
    (`fused_tactics[rows]`, a FusedTactic or None for the pair;
    `fused_sources[rows]` says why), with the layer's own zeroed counters
    (`fused_workspace`). None (the default): as the tuning tables'
    "fp8.fused" entries say (`load_layer_choice`; the pair where none does,
    with explicit `tactics`, and in the BF16 family); True: the built-in
    fused tactic at every row count where it fits (needs the FP8 family,
    ValueError otherwise); False: the pair. `gemm1` / `gemm2` stay the pair.
    tables (default None): the directories whose tuning tables choose the
    family and the tactics, in order, instead of $MOEBENCH_TUNING_DIR and the
    package's (`[dir]`: that directory's tables alone; the sweep's
    `--tactics tables=DIR`).
    All of that is decided by `kernels.layer_plan.plan_layer`: the layer's
    `plan` (a LayerPlan: family, tactics and fused choice, each with its
    source); `tactics`, `tactic_sources`, `fused_tactics`, `fused_sources`
    and `family_choice` are the plan's. `plan=` binds a plan made elsewhere
    (passing any other choice argument with it, `tactics`, `fp8`, `fused`,
    `tables` or `act_bf16=False`, is a ValueError: the plan already decided
    them, and ignoring one would run something else than asked); `bind` binds one on
    weights already in the kernel layout. The binding allocates and
    compiles what the plan names, nothing else.
    """

    def __init__(
        self,
        weights: ExpertWeights,
        top_k: int,
        tactics: dict[int, GemmTactic] | None = None,
        workspace: torch.Tensor | None = None,
        act_bf16: bool = True,
        fp8: bool | None = None,
        fused: bool | None = None,
        tables: list | None = None,
        *,
        plan: LayerPlan | None = None,
    ) -> None:
        if plan is not None:
            given = {"tactics": tactics, "fp8": fp8, "fused": fused, "tables": tables}
            given = [name for name, v in given.items() if v is not None] + ([] if act_bf16 is True else ["act_bf16"])
            if given:
                raise ValueError(
                    f"plan= decides the family, tactics and fused choice; {', '.join(given)} cannot be given with it"
                    " (change the plan instead: plan_layer(...), plan.with_tactic, plan.with_fused)"
                )
        check_weights(weights, top_k)
        if tables is not None and (not isinstance(tables, list) or not all(isinstance(d, (str, Path)) for d in tables)):
            raise TypeError(f"tables must be None or a list of directories (str or Path), got {tables!r}")
        if not isinstance(act_bf16, bool):
            raise TypeError(f"act_bf16 must be a bool, got {type(act_bf16).__name__}")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None or a bool, got {type(fused).__name__}")
        props = torch.cuda.get_device_properties(weights.w13.device)
        sclass = ShapeClass.of(weights, top_k)
        if plan is None:
            # the family first: it decides the weight layout (tactics and fp8 are checked there)
            family = resolve_family(fp8, tactics, props.name, sclass, num_sms=props.multi_processor_count,
                                    search=tables)  # fmt: skip
            if fused and not family.fp8:
                raise ValueError(f"fused=True needs the FP8 family; this layer runs {family.family}"
                                 f" ({family.source}): pass fp8=True")  # fmt: skip
        elif not isinstance(plan, LayerPlan) or plan.shape != sclass:
            raise ValueError(f"plan must be a LayerPlan of {sclass.describe()}, got {plan!r:.120}")
        else:
            family = plan.family
        kw = to_kernel_layout(weights, "e4m3" if family.fp8 else "bf16")
        if plan is None:
            plan = plan_layer(sclass, family, device_name=props.name, num_sms=props.multi_processor_count,
                              wide_scales=kw.scale_variant(family.fp8), tactics=tactics, act_bf16=act_bf16,
                              fused=fused, tables=tables)  # fmt: skip
        self._bind(kw, plan, weights, workspace, KERNELS)

    @classmethod
    def bind(
        cls,
        kw: KernelWeights,
        plan: LayerPlan,
        *,
        source: ExpertWeights | None = None,
        workspace: torch.Tensor | None = None,
        launcher: KernelLauncher | None = None,
    ) -> RoutedExpertGemm:
        """A layer bound to weights already in the kernel layout of `plan`'s
        family (`to_kernel_layout`; e.g. the tuner's rotated copies): it
        allocates and compiles what `plan` names, nothing else. `source`: the
        canonical weights (`accepts(x, weights)` compares them; default none);
        `launcher`: what compiles and launches the kernels (default the CuTe
        DSL kernels; a test passes a recording one). Raises ValueError when
        `kw` is not of the plan's shape, layout or scale flag."""
        if not isinstance(plan, LayerPlan):
            raise TypeError(f"plan must be a LayerPlan, got {type(plan).__name__}")
        if not isinstance(kw, KernelWeights):
            raise TypeError(f"kw must be a KernelWeights, got {type(kw).__name__}")
        operand = "e4m3" if plan.fp8 else "bf16"
        if GemmShape.of(kw) != plan.shape.gemm_shape or kw.operand != operand:
            raise ValueError(f"kw ({GemmShape.of(kw)}, {kw.operand}) is not laid out for the plan's"
                             f" {plan.shape.describe()}, {operand} operand")  # fmt: skip
        self = object.__new__(cls)
        self._bind(kw, plan, source, workspace, launcher or KERNELS)
        return self

    def _bind(self, kw: KernelWeights, plan: LayerPlan, source, workspace, launcher: KernelLauncher) -> None:
        """Hold `plan` on `kw`: the workspaces and buffers it needs, its kernels compiled."""
        if kw.scale_variant(plan.fp8) != plan.wide_scales:
            raise ValueError(f"plan was made for wide_scales={plan.wide_scales}; these weights have"
                             f" {kw.scale_variant(plan.fp8)}: make the plan from them")  # fmt: skip
        self.source, self.kw, self.plan, self.launcher = source, kw, plan, launcher
        self.top_k = plan.shape.top_k
        # the plan's facts, read on every call: plain dicts made once
        self.tactics, self.tactic_sources = plan.tactics, plan.tactic_sources
        self.fused_tactics, self.fused_sources = plan.fused_tactics, plan.fused_sources
        self.workspace = _split_k_workspace(plan, kw, workspace)
        self._alloc_bf16_operands()
        self.front_config: FrontConfig | None = None
        #: False: the route kernel launches without the PDL attribute, as a peer's first kernel (`nopdl=`)
        self.route_launch_pdl = True
        self.fused_workspace: torch.Tensor | None = None
        if any(t is not None for t in self.fused_tactics.values()):
            most = max(plan.ctas(r) for r in range(1, MAX_ROWS + 1))
            self.fused_workspace = _gemm.alloc_workspace(_fused.fused_workspace_bytes(most), kw.device)
        _compile(plan, kw, launcher)  # now, not inside a CUDA-graph capture

    def _alloc_bf16_operands(self) -> None:
        """The BF16 activation operands of act_bf16 tactics, allocated once for
        the most rows / tiles: x_deq [8, H] when a GEMM1 tactic reads x as BF16;
        h_deq [8*ctas(8), I] when a GEMM1 tactic writes it or a GEMM2 tactic
        reads it, with the H bytes an a16 GEMM1 writes beside it (`_h_out`)."""
        a16 = {stage for (stage, _), t in self.tactics.items() if t.act_bf16}
        device, inter = self.kw.device, self.kw.intermediate
        self.x_deq: torch.Tensor | None = None
        self.h_deq: torch.Tensor | None = None
        self._h_deq_of: int | None = None  # data_ptr of the h_q whose BF16 value h_deq holds
        self._h_out: tuple[torch.Tensor, torch.Tensor] | None = None
        if 1 in a16:
            self.x_deq = torch.empty(MAX_ROWS, self.hidden, dtype=torch.bfloat16, device=device)
        if a16:
            n = TILE * max(self.plan.ctas(r) for r in range(1, MAX_ROWS + 1))
            self.h_deq = torch.empty(n, inter, dtype=torch.bfloat16, device=device)
            # an a16 GEMM1 writes H into these (views of them are returned), so the H that GEMM2
            # is given is always the one h_deq holds, however GEMM2 is called (e.g. timed alone)
            self._h_out = (torch.empty(n, inter, dtype=torch.uint8, device=device),
                           torch.empty(n, inter // 32, dtype=torch.uint8, device=device))  # fmt: skip

    @property
    def family_choice(self) -> FamilyChoice:
        """How the layer's family was chosen, and why (the plan's)."""
        return self.plan.family

    @property
    def fp8(self) -> bool:
        """Whether the layer runs the FP8 family."""
        return self.plan.fp8

    @property
    def family(self) -> str:
        """The kernel family this layer runs: "fp8" or "bf16"."""
        return self.family_choice.family

    @property
    def experts(self) -> int:
        return self.kw.experts

    @property
    def hidden(self) -> int:
        return self.kw.hidden

    def accepts(self, x: torch.Tensor, weights: ExpertWeights | None = None) -> bool:
        """Whether a call with router input `x` can take these kernels: 1-8
        contiguous, 16-byte aligned BF16 rows of the bound hidden size on the
        weights' device, and (when `weights` is given, e.g. the runner's
        current ones) the very tensors bound here (a weight reload replaces them)."""
        ok = (
            isinstance(x, torch.Tensor)
            and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[1] == self.hidden
            and x.dtype == torch.bfloat16
            and x.device == self.kw.device
            and x.is_contiguous()
            and x.data_ptr() % 16 == 0
        )
        if ok and weights is not None:
            ok = weights.w13.data_ptr() == self.source.w13.data_ptr() and (
                weights.w2.data_ptr() == self.source.w2.data_ptr()
            )
        return bool(ok)

    def route(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, inputs_ready: bool = False
    ) -> Routing:
        """Quantize `x` (BF16 [rows, H]) to MXFP8 and build the route record of
        `topk_ids` (int32 [rows, top_k]; ids outside [0, E) are non-local);
        `topk_weights` fp32 [rows, top_k] is carried to the output. One launch
        (`route.launch_route_quantize`),
        no host sync. inputs_ready: the caller promises that x and topk_ids
        are complete when the launch starts (the kernel launched just before
        does not write them, or releases its dependents only at its end, as
        every torch kernel does): the kernel then reads and quantizes before
        its griddepcontrol.wait and lets GEMM1 launch at once (see
        `route.launch_route_quantize`, which checks the flag); a broken
        promise gives stale results. Raises ValueError unless `accepts(x)` and the top-k
        tensors match (shape, dtype, and x's device: the kernel would read a
        CPU pointer), TypeError for a non-tensor top-k argument."""
        if not self.accepts(x):
            raise ValueError(
                f"x must be contiguous bfloat16 [1..{MAX_ROWS}, {self.hidden}] on {self.kw.device},"
                f" got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
            )
        rows = x.shape[0]
        _check_topk_tensors(topk_ids, topk_weights, x.device)
        if tuple(topk_ids.shape) != (rows, self.top_k) or topk_ids.dtype != torch.int32:
            raise ValueError(
                f"topk_ids must be int32 [{rows}, {self.top_k}], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
            )
        if tuple(topk_weights.shape) != (rows, self.top_k) or topk_weights.dtype != torch.float32:
            raise ValueError(
                f"topk_weights must be float32 [{rows}, {self.top_k}], got"
                f" {topk_weights.dtype} {tuple(topk_weights.shape)}"
            )
        device = x.device
        x_quant = torch.empty(rows, self.hidden, dtype=torch.uint8, device=device)
        x_scale = torch.empty(rows, self.hidden // 32, dtype=torch.uint8, device=device)
        x_deq = self._x_deq_for(rows, device)
        ids = topk_ids.contiguous()
        ctas = max_ctas(rows, self.top_k, self.experts)
        record = torch.empty(route_words(ctas), dtype=torch.int32, device=device)
        permuted = torch.empty(rows, self.top_k, dtype=torch.int32, device=device)
        spec = self.tactics[1, rows].spec  # GEMM1 reads the ids before its wait: release after ours
        self.launcher.route(
            x,
            x_quant,
            x_scale,
            ids,
            record,
            permuted,
            self.experts,
            x_deq_out=x_deq,
            release_after_wait=spec,
            inputs_ready=inputs_ready,
            launch_pdl=self.route_launch_pdl,
        )
        return Routing(x_quant, x_scale, ids, topk_weights, permuted, record, ctas, x_deq, early_ids=spec, rows=rows)

    def _x_deq_for(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """A fresh bf16 [rows, H] for the producer to write x_deq into when the
        GEMM1 tactic of `rows` reads BF16 activations, else None."""
        if not self.tactics[1, rows].act_bf16:
            return None
        return torch.empty(rows, self.hidden, dtype=torch.bfloat16, device=device)

    def set_front(self, config: FrontConfig) -> None:
        """Use the fused front with the router's `config` (its bias tensors are
        bound: the kernel reads them at every call). Compiles the front for
        (experts, top_k, image routing) now, not inside a graph capture.
        Raises TypeError for a non-FrontConfig, ValueError when config's
        experts or device differ from the bound weights'."""
        if not isinstance(config, FrontConfig):
            raise TypeError(f"config must be a FrontConfig, got {type(config).__name__}")
        if config.experts != self.experts:
            raise ValueError(f"config: the bias has {config.experts} experts, the weights {self.experts}")
        if config.bias.device != self.kw.device:
            raise ValueError(f"config: the bias is on {config.bias.device}, the weights on {self.kw.device}")
        self.launcher.compile_front(self.experts, self.top_k, config.image)
        if any(t.act_bf16 for (stage, _), t in self.tactics.items() if stage == 1):
            self.launcher.compile_front(self.experts, self.top_k, config.image, deq=True)
        self.front_config = config

    def front(self, x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> Routing:
        """Top-k, MXFP8 quantization and route record in one launch (the fused
        front bound by `set_front`); equal bit for bit to routing the router's
        reference top-k of the same logits through `route`. No host sync.

        x: BF16 [rows, H] as `accepts` wants; router_logits: float32 [rows, E]
        (copied if it is not contiguous or 16-byte aligned); input_ids: int32 /
        int64 [rows] token ids, required with image routing (else unused).
        Returns the Routing (topk_ids int32, topk_weights fp32 included).
        Raises RuntimeError before `set_front`, ValueError / TypeError for
        bad inputs (naming the argument)."""
        config = self.front_config
        if config is None:
            raise RuntimeError("no fused front is bound: call set_front(FrontConfig) first")
        if not self.accepts(x):
            raise ValueError(
                f"x must be contiguous bfloat16 [1..{MAX_ROWS}, {self.hidden}] on {self.kw.device},"
                f" got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
            )
        if isinstance(router_logits, torch.Tensor) and (
            not router_logits.is_contiguous() or router_logits.data_ptr() % 16
        ):
            router_logits = router_logits.clone(memory_format=torch.contiguous_format)
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.contiguous()
        rows, device = x.shape[0], x.device
        ctas = max_ctas(rows, self.top_k, self.experts)
        topk_ids = torch.empty(rows, self.top_k, dtype=torch.int32, device=device)
        topk_weights = torch.empty(rows, self.top_k, dtype=torch.float32, device=device)
        x_quant = torch.empty(rows, self.hidden, dtype=torch.uint8, device=device)
        x_scale = torch.empty(rows, self.hidden // 32, dtype=torch.uint8, device=device)
        record = torch.empty(route_words(ctas), dtype=torch.int32, device=device)
        permuted = torch.empty(rows, self.top_k, dtype=torch.int32, device=device)
        x_deq = self._x_deq_for(rows, device)
        self.launcher.front(
            x,
            router_logits,
            config,
            self.top_k,
            input_ids,
            topk_ids,
            topk_weights,
            x_quant,
            x_scale,
            record,
            permuted,
            x_deq_out=x_deq,
        )
        return Routing(x_quant, x_scale, topk_ids, topk_weights, permuted, record, ctas, x_deq, rows=rows)

    def gemm1(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch GEMM1; returns H (uint8 e4m3 [8*ctas, I]) and its E8M0
        scales (uint8 [8*ctas, I/32]), by permuted row. With an act_bf16
        tactic these are views of buffers the layer owns (as its BF16 copy of
        H is): the next GEMM1 call of this layer overwrites them. Raises
        TypeError for a non-Routing."""
        _check_routing(routing)
        device = routing.x_quant.device
        slots = TILE * routing.ctas  # H rows: 8 per token tile, by permuted row
        tactic = self.tactics[1, routing.rows]
        if tactic.spec and not routing.early_ids:  # e.g. the front's routing: its ids come with its record
            tactic = replace(tactic, spec=False)
        if tactic.act_bf16:
            h_q, h_scale = self._h_out[0][:slots], self._h_out[1][:slots]
        else:
            h_q = torch.empty(slots, self.kw.intermediate, dtype=torch.uint8, device=device)
            h_scale = torch.empty(slots, self.kw.intermediate // 32, dtype=torch.uint8, device=device)
        x_deq = h_deq = None
        if tactic.act_bf16:
            x_deq = routing.x_deq
            if x_deq is None:
                # a Routing made elsewhere: dequantize here (a few torch launches, the same bits)
                x_deq = self.launcher.act_to_bf16(routing.x_quant, routing.x_scale, self.x_deq[: routing.rows])
            h_deq = self.h_deq[:slots]
        self.launcher.gemm1(self.kw, routing.x_quant, routing.x_scale, routing.record, routing.ctas,
                    h_q, h_scale, tactic=tactic, workspace=self.workspace, x_deq=x_deq,
                    h_deq_out=h_deq, topk_ids=routing.topk_ids if tactic.spec else None)  # fmt: skip
        self._h_deq_of = h_q.data_ptr() if tactic.act_bf16 else None
        return h_q, h_scale

    def gemm2(self, routing: Routing, h_q: torch.Tensor, h_scale: torch.Tensor) -> UnfinalizedMoEOutput:
        """Launch GEMM2 on GEMM1's outputs; returns the unweighted BF16 rows
        [8*ctas, H] with the routing weights and permute map. Raises TypeError
        for a non-Routing, ValueError for h_q / h_scale not of GEMM1's shape,
        dtype and device."""
        _check_routing(routing)
        n, inter = TILE * routing.ctas, self.kw.intermediate
        for name, t, want in (("h_q", h_q, (n, inter)), ("h_scale", h_scale, (n, inter // 32))):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if (
                tuple(t.shape) != want
                or t.element_size() != 1
                or t.is_floating_point()
                and name == "h_scale"
                or t.device != routing.x_quant.device
                or not t.is_contiguous()
            ):
                raise ValueError(
                    f"{name} must be contiguous uint8 {list(want)} on {routing.x_quant.device} (GEMM1's"
                    f" output), got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        out = torch.empty(TILE * routing.ctas, self.hidden, dtype=torch.bfloat16, device=h_q.device)
        tactic = self.tactics[2, routing.rows]
        h_deq = None
        if tactic.act_bf16:
            h_deq = self.h_deq[: TILE * routing.ctas]
            if self._h_deq_of != h_q.data_ptr():
                # GEMM1 ran without act_bf16 (or h_q came from elsewhere): dequantize H here
                self.launcher.act_to_bf16(h_q, h_scale, h_deq)
        self.launcher.gemm2(
            self.kw,
            h_q,
            h_scale,
            routing.record,
            routing.ctas,
            out,
            tactic=tactic,
            workspace=self.workspace,
            h_deq=h_deq,
        )
        return UnfinalizedMoEOutput(out, routing.topk_weights, routing.permuted)

    def gemms(self, routing: Routing) -> UnfinalizedMoEOutput:
        """GEMM1 then GEMM2, right after the kernel that built `routing`: one
        fused launch where the layer has a fused tactic for these rows, else the pair."""
        _check_routing(routing)
        ft = self.fused_tactics.get(routing.rows)
        if ft is None:
            return self.gemm2(routing, *self.gemm1(routing))
        n, device = TILE * routing.ctas, routing.x_quant.device
        h_q = torch.empty(n, self.kw.intermediate, dtype=torch.uint8, device=device)
        h_scale = torch.empty(n, self.kw.intermediate // 32, dtype=torch.uint8, device=device)
        out = torch.empty(n, self.hidden, dtype=torch.bfloat16, device=device)
        self.launcher.fused(
            self.kw,
            routing.x_quant,
            routing.x_scale,
            routing.record,
            routing.ctas,
            h_q,
            h_scale,
            out,
            tactic=ft,
            workspace=self.fused_workspace,
        )
        return UnfinalizedMoEOutput(out, routing.topk_weights, routing.permuted)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, inputs_ready: bool = False
    ) -> UnfinalizedMoEOutput:
        """The layer's routed experts: `route` then `gemms` (the pair or the
        fused launch the plan names at x's rows). What the backend's forward
        runs before its finalize and what `moebench tune` times per
        candidate, so the tuned launch sequence is the runtime's. Arguments
        and errors as `route`."""
        return self.gemms(self.route(x, topk_ids, topk_weights, inputs_ready=inputs_ready))


def build_routed_expert_gemms(
    layers: list[tuple[ExpertWeights, int]],
    tactics: dict[int, GemmTactic] | None = None,
    fp8: bool | None = None,
) -> list[RoutedExpertGemm | None]:
    """A RoutedExpertGemm(weights, top_k, tactics, fp8=fp8) for each
    (weights, top_k) layer that can take the kernels, None for the others
    (by default each layer runs the family its shape class's tuning tables
    choose, `RoutedExpertGemm`'s fp8=None); logs one line counting the
    layers that got the kernels, per family, and, per reason, those that
    did not."""
    reasons: Counter[str] = Counter()
    gemms: list[RoutedExpertGemm | None] = []
    for weights, top_k in layers:
        try:
            gemms.append(RoutedExpertGemm(weights, top_k, tactics, fp8=fp8))
        except (ValueError, TypeError) as error:
            reasons[str(error)] += 1
            gemms.append(None)
    bound = sum(g is not None for g in gemms)
    families = Counter(g.family for g in gemms if g is not None)
    (logger.warning if reasons else logger.info)(
        "moebench routed-expert kernels on %d of %d MoE layers%s%s",
        bound,
        len(gemms),
        " (" + ", ".join(f"{n} {f}" for f, n in sorted(families.items())) + ")" if families else "",
        "; the others keep their path: " + "; ".join(f"{r} ({n})" for r, n in reasons.items()) if reasons else "",
    )
    return gemms
