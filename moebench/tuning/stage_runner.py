"""The tuner's runner for one (shape, stage) on the GPU: `GemmStageRunner`
(FlashInfer's autotuner pattern: `valid_tactics(rows)`, `check(tactic,
rows)`, `time(tactic, rows)`) and the pieces it times and checks with:
`candidate_plan` (the runner's `LayerPlan` with the candidate substituted),
`bind_layers` / `timed_layers` (the binding's own `forward` on every rotated
weight set, at the layer boundary), the operand twins and the H checks.
What is timed and checked, and why: `tuning/runner.py`'s docstring.
`runner.py` (the tune run) and `layer_runner.py` (the pair-or-fused step)
both build on this module, which imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moebench.backends.moebench import INPUTS_READY  # the route launch the sweep times
from moebench.kernels.layer_plan import LayerPlan
from moebench.kernels.table import LAYER, ShapeClass
from moebench.kernels.tactic import GemmShape, GemmTactic, default_tactic
from moebench.models import RankShape
from moebench.record import ALL_ROWS, MAX_ROWS, TILE, max_ctas
from moebench.tuning.space import DEFAULT_SPACE, NeighbourSpace, TacticSpace, valid_tactics

#: Device memory share the rotated weight sets may take.
MEMORY_FRACTION = 0.6
LAYER_SEED_STRIDE = 1_000_003


class GemmStageRunner:
    """One (shape, stage) on the GPU: weights, routings and buffers are made
    once; `check` and `time` take a tactic (see the module docstring).
    `weight_sets` ([canonical layer-0 weights, kernel layouts of every
    rotated layer], e.g. another stage's runner's) skips generating them."""

    def __init__(self, shape: RankShape, stage: int, device: torch.device, *, scenario: str = "correlated",
                 seed: int = 0, layers: int | None = None, warm_l2: bool = False, warmup: int = 10,
                 replays: int = 50, space: TacticSpace | NeighbourSpace = DEFAULT_SPACE,
                 weight_sets: list | None = None, copy_layers: bool = True, act_bf16: bool = True,
                 fp8: bool = False, partners: dict[int, GemmTactic] | None = None) -> None:  # fmt: skip
        from moebench.bench.cases import rotation_bytes
        from moebench.bench.sweep import canonical_bytes, layer_count
        from moebench.env import device_info
        from moebench.formats import generate_expert_weights
        from moebench.kernels.layout import to_kernel_layout
        from moebench.routing import scenario_topk_ids

        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        self.shape, self.stage, self.device = shape, stage, device
        self.fp8 = bool(fp8)
        self.act_bf16 = bool(act_bf16) and not self.fp8  # the FP8 family reads the MXFP8 x / H as they are
        operand = "e4m3" if self.fp8 else "bf16"
        self.gshape = GemmShape.of(shape)
        self.warmup, self.replays, self.space = warmup, replays, space
        info = device_info(device)
        self.num_sms = info.sm_count
        self.ids = {r: scenario_topk_ids(scenario, r, shape.top_k, shape.experts, seed) for r in range(1, MAX_ROWS + 1)}
        if weight_sets is None:  # [canonical weights of layer 0, kernel layouts of every layer]
            if warm_l2:
                n = 1
            elif layers is not None:
                n = layers
            else:
                free, _ = torch.cuda.mem_get_info(device)
                min_touched = rotation_bytes(shape, self.ids.values())
                n, _ = layer_count(min_touched, info.l2_bytes, 2 * canonical_bytes(shape),
                                   int(free * MEMORY_FRACTION))  # fmt: skip
            weights0 = generate_expert_weights(shape, seed, device)
            kws = [to_kernel_layout(weights0, operand)]
            for layer in range(1, n):
                if copy_layers:
                    kws.append(copy_kernel_weights(kws[0]))
                    continue
                w = generate_expert_weights(shape, seed + LAYER_SEED_STRIDE * layer, device)
                kws.append(to_kernel_layout(w, operand))
                del w
            weight_sets = [weights0, kws]
        self.weight_sets = weight_sets
        self.weights0, self.kws = weight_sets
        self.layers = len(self.kws)
        if any(kw.operand != operand for kw in self.kws):
            raise ValueError(f"weight_sets are laid out for another operand; fp8={self.fp8} needs {operand!r}")
        # the kernels' compile-time scale flag (fp8: special scales, else wide scales)
        self.wide = any(kw.scale_variant(self.fp8) for kw in self.kws)
        self.seed = seed
        self.partners = dict(partners or {})  # rows -> the other stage's tactic (else its default)
        self._inputs: dict[int, dict] = {}
        self.base_plan = self._base_plan(info.name)

    def _base_plan(self, device_name: str) -> LayerPlan:
        """The layer `time` substitutes candidates into: this family, every
        (stage, rows) at its built-in default as run (`default`), the pair."""
        from moebench.kernels.family import FamilyChoice
        from moebench.kernels.layer_plan import plan_layer

        family = FamilyChoice(self.fp8, "asked", f"moebench tune{' --fp8' if self.fp8 else ''}")
        plan = plan_layer(ShapeClass.of(self.shape), family, device_name=device_name, num_sms=self.num_sms,
                          wide_scales=self.wide, tactics={}, act_bf16=self.act_bf16, fused=False)  # fmt: skip
        for rows in ALL_ROWS:
            for stage in (1, 2):
                plan = plan.with_tactic(stage, rows, self.builtin(rows, stage), "default (tune)")
        return plan

    def valid_tactics(self, rows: int) -> tuple[GemmTactic, ...]:
        """The space's tactics for this stage at `rows` (the default first),
        as `_a16` twins when the runner times the BF16 operand (fp8: the
        Fp8Space's fp8 tactics)."""
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        ts = valid_tactics(self.gshape, self.stage, ctas, num_sms=self.num_sms, space=self.space,
                           wide_scales=self.wide)  # fmt: skip
        return operand_twins(ts, self.act_bf16)

    def default(self, rows: int, stage: int | None = None) -> GemmTactic:
        """GEMM`stage`'s (default: this runner's) built-in default at `rows`, as
        run: its `_a16` twin with the BF16 operand."""
        return self.builtin(rows, self.stage if stage is None else stage)

    def builtin(self, rows: int, stage: int) -> GemmTactic:
        """GEMM`stage`'s built-in default at `rows`, as run (`default`)."""
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        return operand_twins(
            [default_tactic(self.gshape, stage, ctas, self.num_sms, self.wide, fp8=self.fp8)], self.act_bf16
        )[0]

    def _case(self, rows: int) -> dict:
        """Routing, activations, oracle and static buffers of `rows` (cached)."""
        if rows in self._inputs:
            return self._inputs[rows]
        from moebench.formats import dequantize_mxfp8, generate_activations, quantize_mxfp8
        from moebench.record import build_route_record
        from moebench.reference import reference_gemm1, reference_gemm2

        dev, s = self.device, self.shape
        route = build_route_record(self.ids[rows].to(dev), s.experts)
        x = generate_activations(rows, s.hidden, self.seed + rows, dev)
        x_q, x_s = quantize_mxfp8(x)
        ref_q, ref_s = reference_gemm1(dequantize_mxfp8(x_q, x_s, torch.float64), self.weights0, route)
        case = {"route": route, "x_q": x_q.view(torch.uint8).contiguous(), "x_s": x_s.contiguous(),
                "ref_q": ref_q.view(torch.uint8).contiguous(), "ref_s": ref_s.contiguous(),
                "used": TILE * route.tiles_used, "x": x.contiguous(),
                "ids": self.ids[rows].to(dev, torch.int32).contiguous(),
                "permuted": torch.empty(rows, s.top_k, dtype=torch.int32, device=dev)}  # fmt: skip
        # the timed layers' routing weights (carried to the output, never read by the GEMMs)
        case["topk_w"] = torch.full((rows, s.top_k), 1.0 / s.top_k, dtype=torch.float32, device=dev)
        n = TILE * route.ctas
        if self.act_bf16:  # the BF16 operands the binding feeds a16 tactics (gemm.act_to_bf16: the kernels' bits)
            from moebench.kernels.gemm import act_to_bf16

            case["x_deq"] = act_to_bf16(case["x_q"], case["x_s"])
            case["ref_deq"] = act_to_bf16(case["ref_q"], case["ref_s"])
            case["h_deq"] = torch.zeros(n, s.intermediate, dtype=torch.bfloat16, device=dev)
        # the checks' buffers (`time` runs the bound layers, which allocate their own)
        case["h_q"] = torch.zeros(n, s.intermediate, dtype=torch.uint8, device=dev)
        case["h_s"] = torch.zeros(n, s.intermediate // 32, dtype=torch.uint8, device=dev)
        case["out"] = torch.empty(n, s.hidden, dtype=torch.bfloat16, device=dev)
        if self.stage == 2:
            case["oracle"] = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), self.weights0, route)
        self._inputs[rows] = case
        return case

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _launch(self, kw, case: dict, tactic: GemmTactic) -> None:
        from moebench.kernels.gemm import gemm1, gemm2

        route = case["route"]
        if self.stage == 1:
            a16 = dict(x_deq=case["x_deq"], h_deq_out=case["h_deq"]) if tactic.act_bf16 else {}
            gemm1(
                kw,
                case["x_q"],
                case["x_s"],
                route.record,
                route.ctas,
                case["h_q"],
                case["h_s"],
                tactic=tactic,
                topk_ids=case["ids"] if tactic.spec else None,
                **a16,
            )
        else:
            a16 = dict(h_deq=case["ref_deq"]) if tactic.act_bf16 else {}
            gemm2(kw, case["ref_q"], case["ref_s"], route.record, route.ctas, case["out"], tactic=tactic, **a16)

    def check(self, tactic: GemmTactic, rows: int) -> str | None:
        """None when `tactic`'s output at `rows` matches the oracle, else why."""
        case = self._case(rows)
        used = case["used"]
        if self.stage == 1:
            case["h_q"].fill_(0xFF)
            case["h_s"].fill_(0xFE)
            self._launch(self.kws[0], case, tactic)
            self._sync()
            got, want = (case["h_q"][:used], case["h_s"][:used]), (case["ref_q"][:used], case["ref_s"][:used])
            if tactic.fp8:  # a floor, not the numerics margin (Fp8Space keeps GEMM1s two-plane)
                return h_fp8_mismatch(*got, *want, least=FP8_H_MARGIN)
            return h_mismatch(*got, *want)
        case["out"].fill_(float("nan"))
        self._launch(self.kws[0], case, tactic)
        self._sync()
        return self.rows_mismatch(case)

    def rows_mismatch(self, case: dict) -> str | None:
        """None when the rows `case["out"]` holds (poisoned with NaN before the
        launch) match the oracle: the used tiles written, within
        ORACLE_TOLERANCE relative Frobenius error, padding rows zero."""
        from moebench.reference import ORACLE_TOLERANCE, relative_error

        out = case["out"][: case["used"]]
        if torch.isnan(out).any():
            return "rows of used tiles not written (NaN)"
        err = relative_error(out.double(), case["oracle"][: case["used"]])
        if not err <= ORACLE_TOLERANCE:
            return f"relative error {err:.3g} exceeds {ORACLE_TOLERANCE:g}"
        valid = case["route"].tile_valid_rows.tolist()
        for t in range(case["route"].tiles_used):
            if not torch.all(case["out"][TILE * t + valid[t] : TILE * (t + 1)] == 0):
                return f"padding rows of tile {t} not zero"
        return None

    def partner(self, rows: int) -> GemmTactic:
        """The other stage's tactic in `time` at `rows`: `partners[rows]`, else
        that stage's default (`default`)."""
        return self.partners[rows] if rows in self.partners else self.builtin(rows, 3 - self.stage)

    def plan(self, tactic: GemmTactic, rows: int) -> LayerPlan:
        """The layer plan `time` binds for `tactic` at `rows`: the runner's
        base plan (`base_plan`) with this stage at `rows` running `tactic`
        and the other stage its `partner(rows)`."""
        other = self.partner(rows)
        return candidate_plan(self.base_plan, self.stage, rows, tactic, other)

    def time(self, tactic: GemmTactic, rows: int):
        """Timing (µs per routed-expert layer call) of `tactic` at `rows`: the
        layer the runtime would run with that tactic (`plan`: the other
        stage at its partner), bound on every rotated weight set
        (`RoutedExpertGemm.bind`) and called as the sweep times a layer at
        the layer boundary (`time_plan`): per rotated layer the write of x,
        then the binding's own `forward` (route, GEMM1, GEMM2); the writes'
        time taken off. The path, not the kernel alone, because
        programmatic dependent launch overlaps each kernel's start with the
        previous one's tail and a tactic changes that overlap
        (docs/perf-notes.md v4: a bulk-ring GEMM2 is slower alone but faster
        after GEMM1; session 11: a 2-CTA/SM GEMM1 is 2.8 µs slower behind
        the route kernel than alone, and `spec` only helps behind it).
        Candidates of one stage share the rest, so their differences are the
        tactic's own."""
        return self.time_plan(self.plan(tactic, rows), rows)

    def time_plan(self, plan: LayerPlan, rows: int):
        """`plan` bound on every rotated weight set, timed at the layer
        boundary at `rows` (`time`)."""
        from moebench.bench.timing import less, time_graph

        case = self._case(rows)
        counts = dict(warmup=self.warmup, replays=self.replays, calls_per_replay=self.layers, use_graph=True,
                      device=self.device)  # fmt: skip
        if "writes" not in case:
            from moebench.bench.sweep import layer_writes

            case["writes"] = layer_writes(case["x"], self.layers)
        writes = case["writes"]
        layers = bind_layers(self.kws, plan, self.weights0)
        run = timed_layers(layers, case["x"], case["ids"], case["topk_w"], writes)
        timing = time_graph(run, **counts)
        # the x writes alone (the sweep's x_write_us), timed right after: their median comes off
        return less(timing, time_graph(lambda: [w() for w in writes], **counts))


def candidate_plan(base: LayerPlan, stage: int, rows: int, tactic, partner: GemmTactic | None = None) -> LayerPlan:
    """`base` with one tuning candidate substituted at `rows`: a GemmTactic
    at GEMM`stage` (1 or 2), the other stage running `partner` (None: as in
    `base`), the pair; or (stage LAYER) a LayerChoice, the pair or a fused
    tactic. Raises ValueError where the result cannot run."""
    if stage == LAYER:
        return base.with_fused(rows, tactic.fused, "candidate")
    plan = base.with_tactic(stage, rows, tactic, "candidate")
    return plan if partner is None else plan.with_tactic(3 - stage, rows, partner, "partner")


def bind_layers(kws, plan: LayerPlan, source=None, launcher=None) -> list:
    """One `RoutedExpertGemm` of `plan` per rotated kernel-layout weight set
    in `kws` (each its own workspaces, as layers at runtime)."""
    from moebench.kernels.binding import RoutedExpertGemm

    return [RoutedExpertGemm.bind(kw, plan, source=source, launcher=launcher) for kw in kws]


def timed_layers(layers: list, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 writes: list | None) -> Callable[[], None]:  # fmt: skip
    """What `moebench tune` times for one candidate, as the sweep times a
    layer call at the layer boundary (`bench.sweep`'s `_time_routed`): for
    each bound layer, the write of x (`writes[i]`; None: back to back) then
    the layer's `forward` (route, then the pair or the fused launch), with
    the route launch the backend's (`INPUTS_READY`). The very calls the
    runtime makes: the tuned sequence is the one that runs."""

    def run() -> None:
        for i, layer in enumerate(layers):
            if writes:
                writes[i]()
            layer.forward(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY)

    return run


def operand_twins(tactics, act_bf16: bool) -> tuple[GemmTactic, ...]:
    """`tactics` as run with the BF16 activation operand (their `_a16` twin;
    fp8 tactics, which read the MXFP8 operand, stay as they are) when
    `act_bf16`, else unchanged; order kept, duplicates dropped."""
    out = []
    for t in tactics:
        if act_bf16 and not t.fp8 and not t.act_bf16:
            t = replace(t, act_bf16=True)
        if t not in out:
            out.append(t)
    return tuple(out)


def copy_kernel_weights(kw):
    """A device copy of KernelWeights `kw` (new allocations, same values)."""
    import dataclasses

    tensors = {name: getattr(kw, name).clone() for name in ("w13", "w13_scale", "w2", "w2_scale", "clamp")}
    return dataclasses.replace(kw, **tensors)


def h_mismatch(h_q: torch.Tensor, h_s: torch.Tensor, ref_q: torch.Tensor, ref_s: torch.Tensor) -> str | None:
    """None when GEMM1's H (uint8 e4m3 bytes, uint8 E8M0 scales, rows of used
    tiles) matches the oracle's: >= 99.9 % of bytes and of scales equal, and
    no byte more than one e4m3 code apart where the block scales agree."""
    if h_q.numel() == 0:
        return None
    equal = (h_q == ref_q).double().mean().item()
    same_scale = (h_s == ref_s).double().mean().item()
    if equal < 0.999:
        return f"only {equal:.5f} of H bytes equal the oracle's"
    if same_scale < 0.999:
        return f"only {same_scale:.5f} of H scales equal the oracle's"

    def ordinal(b: torch.Tensor) -> torch.Tensor:
        v = b.to(torch.int32)
        mag = v & 0x7F
        return torch.where(v >= 0x80, -mag, mag)

    agree = (h_s == ref_s).repeat_interleave(32, dim=1)
    dist = (ordinal(h_q) - ordinal(ref_q)).abs()[agree]
    if dist.numel() and int(dist.max()) > 1:
        return f"H bytes up to {int(dist.max())} e4m3 codes apart"
    return None


#: Share of H bytes an fp8 tactic must match exactly (`h_fp8_mismatch`): a correct kernel.
FP8_H_EQUAL = 0.99
#: ... and one the tuner takes (`GemmStageRunner.check`). It is a floor, not the numerics
#: margin: the one-plane FP8 GEMM1 passed it on the tuner's inputs (2026-12-06, H100) yet
#: misses the 25 % margin at the committed TP4 points (99.94 % of H bytes equal there), so
#: the FP8 space tunes only two-plane GEMM1s (`Fp8Space`, >= 99.997 % equal).
FP8_H_MARGIN = 0.999


def h_fp8_mismatch(
    h_q: torch.Tensor, h_s: torch.Tensor, ref_q: torch.Tensor, ref_s: torch.Tensor, least: float = FP8_H_EQUAL
) -> str | None:
    """None when an fp8 tactic's GEMM1 H (uint8 e4m3 bytes [rows, I], uint8
    E8M0 scales [rows, I/32], rows of used tiles) matches the oracle's.
    Hopper's FP8 tensor cores sum a 32-K block with fewer bits than fp32
    (DeepSeek-V3 report, 3.3.2), so an element far below its block's maximum
    may land several e4m3 codes from the oracle's (the codes are dense there)
    while the value is off by a tiny fraction of the block, and a value near
    a rounding boundary moves one code: >= `least` (FP8_H_EQUAL, 99 %; the
    tuner asks FP8_H_MARGIN) of bytes equal,
    >= 99.9 % of scales, and the dequantized H within ORACLE_TOLERANCE
    (relative Frobenius; measured 1.2-1.9e-3 on the H200)."""
    from moebench.formats import dequantize_mxfp8
    from moebench.reference import ORACLE_TOLERANCE, relative_error

    if h_q.numel() == 0:
        return None
    equal = (h_q == ref_q).double().mean().item()
    if equal < least:
        return f"only {equal:.5f} of H bytes equal the oracle's (fp8: >= {least})"
    same_scale = (h_s == ref_s).double().mean().item()
    if same_scale < 0.999:
        return f"only {same_scale:.5f} of H scales equal the oracle's"
    got = dequantize_mxfp8(h_q.view(torch.float8_e4m3fn), h_s, torch.float64)
    want = dequantize_mxfp8(ref_q.view(torch.float8_e4m3fn), ref_s, torch.float64)
    err = relative_error(got, want)
    if not err <= ORACLE_TOLERANCE:
        return f"dequantized H relative error {err:.3e} exceeds {ORACLE_TOLERANCE:g}"
    return None
