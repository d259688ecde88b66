"""`moebench tune` on the GPU: our GEMM kernels behind the tuner's callables.

`GemmStageRunner` is the runner of FlashInfer's autotuner pattern for one
(shape, stage): `valid_tactics(rows)` and, for one tactic, `check(tactic,
rows)` (its output against the fp64 oracle) and `time(tactic, rows)` (the
routed-expert path as the binding launches it: the route kernel (record +
MXFP8 x), GEMM1, GEMM2, under a CUDA graph, cycling through enough distinct
weight sets that the working set is >= 4 x L2: what the sweep's `routed_us`
measures, so table times are routed-path times). The other stage runs its
partner tactic: GEMM1's candidates run beside GEMM2's default; GEMM2's beside
the GEMM1 tactic just tuned for the same rows (`partners`), so a table's pair
is timed together when one run tunes both stages (a run of GEMM2 alone times
it beside GEMM1's default). The timed path has its own copies of the record
and the MXFP8 x, which the route kernel rewrites; `check` reads the torch
builder's. `run_tune` tunes GEMM1 then GEMM2 for each TP degree, then
re-times GEMM1's finalists beside the tuned GEMM2 (`_revisit_gemm1`: one more
round of the stage-by-stage search), and returns one `TuningTable` per shape
class.

Rotated weight sets: layer 0 is generated (and is what the checks use); by
default the other layers are device copies of its kernel layout
(`copy_layers`), which keeps the L2 cold exactly as distinct weights do (a
replay reads every copy from its own addresses; the kernels' time does not
depend on the weight values) and makes a shape's setup a few memcpys
instead of generating and converting up to 64 weight sets.
`copy_layers=False` generates each layer (as the sweep does).

Checks (DESIGN.md numerics): GEMM1's H bytes equal the oracle's for
>= 99.9 % of the elements of used tiles and its scales likewise, no byte more
than one e4m3 code apart where the block scales agree (`h_mismatch`; the FP8
family, whose tensor-core sums are not bit-exact: `h_fp8_mismatch`); GEMM2's rows (on the
oracle's H) within ORACLE_TOLERANCE relative Frobenius error, no NaN,
padding rows zero. Outputs are poisoned before each checked launch.

`TuneConfig(fp8=True)` (`moebench tune --fp8`) tunes the FP8 (wgmma)
family instead: e4m3-layout weights, MXFP8 x / H fed as they are, fp8
candidates (`space.Fp8Space`), entries in the table's "fp8" part.

Needs an sm_90 GPU and nvidia-cutlass-dsl; `require_tuning_device` says why
not in one line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

import torch

from moebench import __version__
from moebench.backends.moebench import INPUTS_READY  # the route launch the sweep times
from moebench.bench import check_layers, check_seed
from moebench.env import environment, resolve_device
from moebench.kernels.table import LAYER, STAGE_LABELS, ShapeClass, TuningTable
from moebench.kernels.tactic import GemmShape, GemmTactic, default_tactic
from moebench.models import RankShape, get_preset
from moebench.record import MAX_ROWS, TILE, max_ctas
from moebench.tuning.space import DEFAULT_FP8_SPACE, DEFAULT_SPACE, Fp8Space, NeighbourSpace, TacticSpace, valid_tactics
from moebench.tuning.tuner import TuneResult, tune

#: Device memory share the rotated weight sets may take.
MEMORY_FRACTION = 0.6
LAYER_SEED_STRIDE = 1_000_003


def require_tuning_device(device: str | torch.device | None = None) -> torch.device:
    """The CUDA device to tune on; raises RuntimeError with one line saying
    what is missing (an sm_90 GPU, or nvidia-cutlass-dsl)."""
    if not torch.cuda.is_available():
        raise RuntimeError("moebench tune needs an sm_90 GPU (H100/H200); CUDA is not available here")
    try:
        dev = resolve_device(device)
    except ValueError as error:
        raise RuntimeError(f"moebench tune needs an sm_90 GPU: {error}") from None
    if dev.type != "cuda":
        raise RuntimeError(f"moebench tune needs an sm_90 GPU; got device {dev}")
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        raise RuntimeError(f"moebench tune needs an sm_90 GPU; {torch.cuda.get_device_name(dev)} is sm_{major}{minor}")
    if importlib.util.find_spec("cutlass") is None:
        raise RuntimeError("moebench tune needs nvidia-cutlass-dsl (pip install 'moebench[kernels]')")
    return dev


@dataclass(frozen=True)
class TuneConfig:
    """What `run_tune` tunes: one preset (with overrides) at each TP degree,
    rows, the routing scenario and seed the timings use, the tactic space,
    tuner settings (repeats, top), timing counts and the L2 mode.
    act_bf16 (default True, what a BF16-family RoutedExpertGemm runs by default): the
    candidates are the `_a16` twins of the space's tactics (BF16 activation
    operand), timed and checked with the BF16 x / H the binding feeds them,
    so a table holds the tactics that won as the runtime runs them.
    fp8 (default False): tune the FP8 (wgmma) kernel family instead (what
    an FP8-family RoutedExpertGemm runs; act_bf16 is then ignored): the
    candidates come from an `Fp8Space` (the default space becomes
    DEFAULT_FP8_SPACE; another space must be an Fp8Space, and an Fp8Space
    needs fp8) and the entries go to the table's "fp8" part.
    stages: GEMM stages 1 / 2 and (fp8 only) LAYER, the pair against the
    fused layer per rows (`layer_runner.LayerRunner`, the table's
    "fp8.fused"), in that order whatever the order given; None (the
    default): (1, 2, LAYER) with fp8, else (1, 2).
    pair_tables: where LAYER takes the pair's tactics at rows this run did
    not tune them (directories, in order; None: the runtime's search path;
    `tune_and_save` puts the output directory first, so the choice is made
    against the pair the written table will sit in front of)."""

    preset: str = "dsv41-flash"
    hidden: int | None = None
    intermediate: int | None = None
    experts: int | None = None
    top_k: int | None = None
    tp: tuple[int, ...] = (4,)
    rows: tuple[int, ...] = tuple(range(1, MAX_ROWS + 1))
    stages: tuple[int, ...] | None = None
    scenario: str = "correlated"
    seed: int = 0
    space: TacticSpace = DEFAULT_SPACE
    repeats: int = 3
    top: int = 3
    warmup: int = 10
    replays: int = 50
    layers: int | None = None
    warm_l2: bool = False
    device: str | None = None
    copy_layers: bool = True
    act_bf16: bool = True
    fp8: bool = False
    pair_tables: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_seed(self.seed)
        check_layers(self.layers)
        for name in ("act_bf16", "fp8", "warm_l2", "copy_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.stages is None:
            object.__setattr__(self, "stages", (1, 2, LAYER) if self.fp8 else (1, 2))
        stages = self.stages
        if not isinstance(stages, tuple) or not stages or len(set(stages)) != len(stages) or any(
            isinstance(st, bool) or st not in (1, 2, LAYER) for st in stages
        ):  # fmt: skip
            raise ValueError(f"stages must be distinct stages of 1, 2, {LAYER} (the layer choice), got {stages!r}")
        if LAYER in stages and not self.fp8:
            raise ValueError(f"stages: {LAYER} (the pair against the fused layer) needs fp8: the fused layer is"
                             " the FP8 family's")  # fmt: skip
        object.__setattr__(self, "stages", tuple(sorted(stages)))
        if self.fp8 and self.space is DEFAULT_SPACE:
            object.__setattr__(self, "space", DEFAULT_FP8_SPACE)
        if self.fp8 != isinstance(self.space, Fp8Space):
            want = "an Fp8Space (space.FP8_SPACES)" if self.fp8 else "a TacticSpace or NeighbourSpace (space.SPACES)"
            raise ValueError(f"space: fp8={self.fp8} tunes the {self.family} family and needs {want},"
                             f" got {type(self.space).__name__}")  # fmt: skip

    @property
    def family(self) -> str:
        """The kernel family tuned: 'FP8' or 'BF16'."""
        return "FP8" if self.fp8 else "BF16"

    def shapes(self) -> list[RankShape]:
        cfg = get_preset(self.preset, hidden=self.hidden, intermediate=self.intermediate, experts=self.experts,
                         top_k=self.top_k)  # fmt: skip
        return [cfg.shard(tp) for tp in self.tp]


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
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        st = self.stage if stage is None else stage
        return operand_twins(
            [default_tactic(self.gshape, st, ctas, self.num_sms, self.wide, fp8=self.fp8)], self.act_bf16
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
        # the timed path's own record and MXFP8 x (the route kernel rewrites them each replay)
        case.update(t_record=route.record.clone(), t_x_q=case["x_q"].clone(), t_x_s=case["x_s"].clone())
        n = TILE * route.ctas
        if self.act_bf16:  # the BF16 operands the binding feeds a16 tactics (gemm.act_to_bf16: the kernels' bits)
            from moebench.kernels.gemm import act_to_bf16

            case["x_deq"] = act_to_bf16(case["x_q"], case["x_s"])
            case["t_x_deq"] = case["x_deq"].clone()
            case["ref_deq"] = act_to_bf16(case["ref_q"], case["ref_s"])
            case["h_deq"] = torch.zeros(n, s.intermediate, dtype=torch.bfloat16, device=dev)
        # both stages' buffers: `time` runs the routed path (route, GEMM1, GEMM2)
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
            if tactic.fp8:  # the numerics margin, not just a correct kernel: one-plane GEMM1s fail it
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
        return self.partners[rows] if rows in self.partners else self.default(rows, 3 - self.stage)

    def time(self, tactic: GemmTactic, rows: int):
        """Timing (µs per routed-expert path) of `tactic` at `rows` in its
        context: a CUDA graph that runs, per rotated weight set, the route
        kernel (record + MXFP8 x; released after its wait for a `spec`
        GEMM1), GEMM1 and GEMM2 as the binding does, this stage with `tactic`
        and the other with `partner(rows)`. The path, not the kernel alone,
        because programmatic dependent launch overlaps each kernel's start
        with the previous one's tail and a tactic changes that overlap
        (docs/perf-notes.md v4: a bulk-ring GEMM2 is slower alone but faster
        after GEMM1; session 11: a 2-CTA/SM GEMM1 is 2.8 µs slower behind
        the route kernel than alone, and `spec` only helps behind it).
        Candidates of one stage share the rest, so their differences are the
        tactic's own."""
        from moebench.bench.timing import time_graph
        from moebench.kernels.gemm import gemm1, gemm2
        from moebench.kernels.route import launch_route_quantize

        case = self._case(rows)
        route = case["route"]
        ctas = route.ctas
        other = self.partner(rows)
        t1, t2 = (tactic, other) if self.stage == 1 else (other, tactic)
        if t2.act_bf16 and not t1.act_bf16:
            raise ValueError(f"an a16 GEMM2 ({t2.name}) needs an a16 GEMM1 to write its BF16 H, got {t1.name}")
        a1 = dict(x_deq=case["t_x_deq"], h_deq_out=case["h_deq"]) if t1.act_bf16 else {}
        a2 = dict(h_deq=case["h_deq"]) if t2.act_bf16 else {}
        ids, record, x_q, x_s = case["ids"], case["t_record"], case["t_x_q"], case["t_x_s"]

        def launch_all() -> None:
            for kw in self.kws:
                launch_route_quantize(
                    case["x"],
                    x_q,
                    x_s,
                    ids,
                    record,
                    case["permuted"],
                    self.shape.experts,
                    x_deq_out=case["t_x_deq"] if t1.act_bf16 else None,
                    release_after_wait=t1.spec,
                    inputs_ready=INPUTS_READY,
                )
                gemm1(
                    kw,
                    x_q,
                    x_s,
                    record,
                    ctas,
                    case["h_q"],
                    case["h_s"],
                    tactic=t1,
                    topk_ids=ids if t1.spec else None,
                    **a1,
                )
                gemm2(kw, case["h_q"], case["h_s"], record, ctas, case["out"], tactic=t2, **a2)

        return time_graph(launch_all, warmup=self.warmup, replays=self.replays, calls_per_replay=len(self.kws),
                          use_graph=True, device=self.device)  # fmt: skip


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
#: ... and one the tuner takes (`GemmStageRunner.check`): the one-plane FP8 GEMM1 (~99.67 %
#: on the H200) leaves no numerics margin at TP4 (issue 36 item 4); its two-plane twin
#: (`planes` 2, CPU model ~99.99 %) keeps DESIGN's 25 %.
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


@dataclass
class TuneOutcome:
    """One table per shape class, and the tuner's per-stage results
    (for display): {(tp, stage): TuneResult}, weight sets and seconds per
    (tp, stage); stopped: what a budget left out (one line each)."""

    tables: list[TuningTable] = field(default_factory=list)
    results: dict[tuple[int, int], TuneResult] = field(default_factory=dict)
    #: tp -> GEMM1's finalists re-timed beside the tuned GEMM2 (`run_tune`'s revisit)
    revisits: dict[int, TuneResult] = field(default_factory=dict)
    layers: dict[tuple[int, int], int] = field(default_factory=dict)
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)


def provenance(device: torch.device, extra: dict | None = None) -> dict:
    """Device, driver, versions, commit and date of a measurement."""
    env = environment(device)
    d = env["device"]
    return {
        "device": d["name"], "sm_count": d["sm_count"], "capability": d["capability"], "driver": d["driver"],
        "cuda_runtime": env["cuda_runtime"], "packages": env["packages"], "python": env["python"],
        "commit": env["commit"], "moebench_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(extra or {}),
    }  # fmt: skip


def tuning_specs(config: TuneConfig, num_sms: int, wide_scales: bool = False) -> list:
    """(GemmShape, stage, tactic, wide_scales) of every kernel `run_tune(config)`
    will compile, in the order it needs them (for `precompile`)."""
    out, seen = [], set()
    for shape in config.shapes():
        g = GemmShape.of(shape)
        for stage in (st for st in config.stages if st != LAYER):  # the fused layer compiles in-process
            for rows in config.rows:
                ctas = max_ctas(rows, shape.top_k, shape.experts)
                ts = valid_tactics(g, stage, ctas, num_sms=num_sms, space=config.space, wide_scales=wide_scales)
                for t in operand_twins(ts, config.act_bf16):
                    spec = (g, stage, t, wide_scales)
                    if spec not in seen:
                        seen.add(spec)
                        out.append(spec)
    return out


def run_tune(
    config: TuneConfig,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    probe: Callable[[GemmStageRunner], None] | None = None,
) -> TuneOutcome:
    """Tune every (TP degree, stage, rows) of `config` on its GPU; returns one
    TuningTable per shape class (not written: the caller writes them).
    `should_stop()` (e.g. a wall-time budget) is asked before each shape,
    stage and row count; what it leaves out is listed in `outcome.stopped`
    (a table then holds the entries done). `probe(runner)` is called with
    each stage's runner before it tunes (tune_many: the precompiled-kernel
    check). Raises RuntimeError (require_tuning_device) without an sm_90 GPU."""
    import time

    dev = require_tuning_device(config.device)
    say = progress or (lambda text: None)
    stop = should_stop or (lambda: False)
    outcome = TuneOutcome()
    base = provenance(dev)
    for shape in config.shapes():
        sclass = ShapeClass.of(shape)
        entries = {}
        weight_sets = None
        for stage in config.stages:
            if stop():
                outcome.stopped.append(f"{config.preset} TP{shape.tp} {STAGE_LABELS[stage]} rows {list(config.rows)}")
                continue
            start = time.perf_counter()
            say(f"{shape.describe()} {config.family} {STAGE_LABELS[stage]}: preparing weights")
            # GEMM2's candidates run beside the GEMM1 tactic just tuned for their rows; the layer
            # choice's pair is both GEMMs' tactics tuned now (else the runtime's)
            partners = {r: e.tactic for (st, r), e in entries.items() if st == 1} if stage == 2 else None
            if stage == LAYER:
                partners = {key: e.tactic for key, e in entries.items()}
            runner = _stage_runner(config, shape, stage, dev, weight_sets, partners)
            weight_sets = runner.weight_sets
            if probe is not None:
                probe(runner)
            prov = {**base, "timing": {
                "method": "cuda-graph", "warmup": config.warmup, "replays": config.replays,
                "layers": runner.layers, "layer_copies": config.copy_layers and runner.layers > 1,
                "warm_l2": config.warm_l2, "scenario": config.scenario, "seed": config.seed,
                "repeats": config.repeats, "top": config.top, "wide_scales": runner.wide,
                "act_bf16": runner.act_bf16, "fp8": config.fp8,
            }}  # fmt: skip

            def step(rows: int, name: str, status: str, _stage=stage) -> None:
                say(f"{shape.describe()} {STAGE_LABELS[_stage]} rows={rows}: {name} {status}")

            result = tune(
                shape, list(config.rows), lambda _s, rows, r=runner: r.valid_tactics(rows),
                runner.time, runner.check, repeats=config.repeats, top=config.top,
                prefer=runner.default, provenance=prov, progress=step, should_stop=stop,
            )  # fmt: skip
            if result.stopped:
                outcome.stopped.append(f"{config.preset} TP{shape.tp} {STAGE_LABELS[stage]} rows {result.stopped}")
            outcome.results[shape.tp, stage] = result
            outcome.layers[shape.tp, stage] = runner.layers
            outcome.seconds[shape.tp, stage] = time.perf_counter() - start
            for rows, entry in result.entries.items():
                entries[stage, rows] = entry
            del runner
            if stage == 2 and 1 in config.stages and not stop():
                revisit = _revisit_gemm1(config, shape, dev, weight_sets, outcome.results.get((shape.tp, 1)),
                                         entries, base, say, stop)  # fmt: skip
                if revisit is not None:
                    outcome.revisits[shape.tp] = revisit
                    for rows, entry in revisit.entries.items():  # the first pass's candidate counts stay
                        first = entries[1, rows]
                        entries[1, rows] = replace(entry, candidates=first.candidates, rejected=first.rejected)
        del weight_sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        d = base
        device = {"name": d["device"], "sm_count": d["sm_count"], "capability": d["capability"]}
        fused = {rows: e for (st, rows), e in entries.items() if st == LAYER}
        gemms = {key: e for key, e in entries.items() if key[0] != LAYER}
        table = (TuningTable(sclass, device, fp8_entries=gemms, fused_entries=fused) if config.fp8
                 else TuningTable(sclass, device, gemms))  # fmt: skip
        outcome.tables.append(table)
    return outcome


def _stage_runner(config: TuneConfig, shape, stage: int, dev, weight_sets, partners) -> GemmStageRunner:
    """The GemmStageRunner of GEMM`stage` of `shape` with `config`'s timing
    settings, on the run's shared weight sets, beside `partners`; for stage
    LAYER the LayerRunner, `partners` the {(stage, rows): tactic} tuned now."""
    common = dict(scenario=config.scenario, seed=config.seed, layers=config.layers, warm_l2=config.warm_l2,
                  warmup=config.warmup, replays=config.replays, space=config.space, weight_sets=weight_sets,
                  copy_layers=config.copy_layers)  # fmt: skip
    if stage == LAYER:
        from moebench.tuning.layer_runner import LayerRunner

        return LayerRunner(shape, dev, tuned=partners, search=config.pair_tables, **common)
    return GemmStageRunner(shape, stage, dev, act_bf16=config.act_bf16, fp8=config.fp8, partners=partners,
                           **common)  # fmt: skip


def _revisit_gemm1(config, shape, dev, weight_sets, first, entries, base, say, stop) -> TuneResult | None:
    """One more round of the stage-by-stage search: GEMM1's finalists at
    each row count (the first pass's re-timed ones) timed again beside the
    GEMM2 tuned for those rows, the first pass's pick preferred (kept unless
    another is faster beyond the noise). The first pass timed GEMM1 beside
    GEMM2's default, so a GEMM1 that wins there may lose beside the GEMM2 the
    table holds (session 11: dsv41-flash TP8 rows 4 / 8). None when there is
    nothing to revisit."""
    if first is None:
        return None
    rows = [r for r, res in first.results.items() if res.entry is not None and (2, r) in entries
            and len(res.finalists) > 1]  # fmt: skip
    if not rows:
        return None
    finalists = {r: tuple(m.tactic for m in first.results[r].finalists) for r in rows}
    picks = {r: entries[1, r].tactic for r in rows}
    runner = _stage_runner(config, shape, 1, dev, weight_sets, {r: entries[2, r].tactic for r in rows})
    say(f"{shape.describe()} {config.family} GEMM1: revisiting {len(rows)} row counts beside the tuned GEMM2")
    prov = {**base, "timing": {**entries[1, rows[0]].provenance.get("timing", {}), "revisit": True}}
    return tune(
        shape,
        rows,
        lambda _s, r: finalists[r],
        runner.time,
        runner.check,
        repeats=config.repeats,
        top=max(2, config.top),
        prefer=lambda r: picks[r],
        provenance=prov,
        should_stop=stop,
    )


class Budget:
    """A wall-time budget for `should_stop`: True once the next step, taken
    as long as the longest of the last `window` steps (the time between two
    calls) times `safety`, would end past the deadline. `seconds` None: never
    stops."""

    def __init__(self, seconds: float | None, *, safety: float = 1.25, window: int = 8, clock=None) -> None:
        import time

        if seconds is not None and (isinstance(seconds, bool) or not seconds > 0):
            raise ValueError(f"budget seconds must be positive or None, got {seconds!r}")
        self.clock = clock or time.monotonic
        self.start = self.clock()
        self.deadline = None if seconds is None else self.start + float(seconds)
        self.safety, self.window = safety, window
        self._last: float | None = None
        self._steps: list[float] = []

    def elapsed(self) -> float:
        return self.clock() - self.start

    def __call__(self) -> bool:
        now = self.clock()
        if self._last is not None:
            self._steps = (self._steps + [now - self._last])[-self.window :]
        self._last = now
        if self.deadline is None:
            return False
        return now + self.safety * max(self._steps, default=0.0) > self.deadline


def tune_many(
    configs: list[TuneConfig],
    *,
    budget: Budget | None = None,
    jobs: int = 0,
    kernel_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_outcome: Callable[[TuneConfig, TuneOutcome], None] | None = None,
) -> list[tuple[TuneConfig, TuneOutcome]]:
    """`run_tune` over `configs` (e.g. one per preset x TP, in priority
    order) under one wall-time `budget`; `on_outcome(config, outcome)` right
    after each (e.g. write its table, so a cut-off run keeps what it did).
    With `jobs` > 0 the kernels of every config are compiled up front by that
    many worker processes (`precompile.KernelPrecompiler`, exports under
    `kernel_dir`, default a temporary directory) while the GPU times.
    Raises RuntimeError (require_tuning_device) without an sm_90 GPU."""
    import contextlib
    import tempfile

    from moebench.env import device_info

    if not configs:
        raise ValueError("configs must not be empty")
    dev = require_tuning_device(configs[0].device)
    budget = budget or Budget(None)
    say = progress or (lambda text: None)
    done: list[tuple[TuneConfig, TuneOutcome]] = []
    with contextlib.ExitStack() as stack:
        if jobs > 0:
            from moebench.tuning.precompile import KernelPrecompiler

            sms = device_info(dev).sm_count
            specs = [spec for c in configs for spec in tuning_specs(c, sms)]
            directory = kernel_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="moebench-kernels-"))
            pre = stack.enter_context(KernelPrecompiler(specs, directory, jobs))
            say(f"compiling {len(pre.futures)} kernels in {jobs} worker processes")
        probe = None
        if jobs > 0:

            def probe(runner: GemmStageRunner, rows: int = configs[0].rows[0]) -> None:
                # the first kernel the run needs, checked once with the workers' build (else in-process)
                pre.verify_with(lambda: runner.check(runner.default(rows), rows))

        for config in configs:
            outcome = run_tune(config, progress=progress, should_stop=budget, probe=probe)
            done.append((config, outcome))
            if on_outcome is not None:
                on_outcome(config, outcome)
        if jobs > 0:
            say(pre.summary())
    return done


#: Row counts whose tuned-vs-default gains `gains` reports by default.
GAIN_ROWS = (1, 4, 8)


def gains(done: list[tuple[TuneConfig, TuneOutcome]], rows=GAIN_ROWS) -> list[dict]:
    """What tuning buys over the built-in defaults, per (preset, kernel
    family ("BF16" / "FP8", the config's), tp, rows in `rows`): for GEMM1 and GEMM2, the default's and the tuned tactic's pooled
    µs (timed side by side: tuner.RowsResult.baseline) -- each a time of the
    routed path (route + GEMM1 + GEMM2) with the other stage at its partner
    (`GemmStageRunner.time`: GEMM1's beside GEMM2's default, GEMM2's beside
    GEMM1's tuned tactic) -- the gain in µs and %, and the tactic names;
    "both": both defaults (GEMM1's default timing) against both tuned
    (the revisit's GEMM1 pick beside the tuned GEMM2, else GEMM2's tuned
    timing), each measured, though in different passes rather than side by
    side, when the config tuned both stages ("revisit": GEMM1's final pick,
    its time and whether it changed); else
    (`estimated`) the mean of the two default timings scaled by each stage's
    tuned/default ratio. A stage whose default failed its check or
    was not timed has None times."""
    out = []
    for config, outcome in done:
        for tp in sorted({tp for tp, _ in outcome.results}):
            for r in rows:
                rec: dict = {"preset": config.preset, "family": config.family, "tp": tp, "rows": r}
                defaults, gains_us = [], []
                complete = True
                for stage in (1, 2):
                    res = outcome.results.get((tp, stage))
                    rr = res.results.get(r) if res is not None else None
                    base = rr.baseline if rr is not None else None
                    entry = rr.entry if rr is not None else None
                    d_us = base.median_us if base is not None else None
                    t_us = entry.median_us if entry is not None else None
                    rec[f"gemm{stage}"] = {
                        "default": base.tactic.name if base is not None else None,
                        "tuned": entry.tactic.name if entry is not None else None,
                        "default_us": d_us, "tuned_us": t_us,
                        "gain_us": None if d_us is None or t_us is None else d_us - t_us,
                        "gain_pct": None if d_us is None or t_us is None else 100.0 * (d_us - t_us) / d_us,
                    }  # fmt: skip
                    if d_us is None or t_us is None:
                        complete = False
                    else:
                        defaults.append(d_us)
                        gains_us.append(t_us / d_us)  # this stage's tuned/default ratio
                if not any(rec[f"gemm{s}"]["tuned"] for s in (1, 2)):
                    continue
                measured = complete and {1, 2} <= set(config.stages)  # GEMM2 timed beside tuned GEMM1
                revisit = outcome.revisits.get(tp)
                final = revisit.results[r].entry if revisit is not None and r in revisit.results else None
                if final is not None:  # GEMM1 re-picked beside the tuned GEMM2: the table's pair
                    rec["revisit"] = {"tuned": final.tactic.name, "tuned_us": final.median_us,
                                      "changed": final.tactic.name != rec["gemm1"]["tuned"]}  # fmt: skip
                if measured:
                    pair = rec["gemm1"]["default_us"]
                    tuned = final.median_us if final is not None else rec["gemm2"]["tuned_us"]
                else:
                    pair = sum(defaults) / len(defaults) if complete else None
                    tuned = pair * gains_us[0] * gains_us[1] if complete else None
                rec["both"] = {
                    "default_us": pair, "tuned_us": tuned, "gain_us": pair - tuned if complete else None,
                    "gain_pct": 100.0 * (pair - tuned) / pair if complete else None, "estimated": not measured,
                }  # fmt: skip
                out.append(rec)
    return out


def gains_markdown(records: list[dict]) -> str:
    """`gains` as a markdown table (µs default -> tuned, gain in µs and %)."""

    def cell(g: dict) -> str:
        if g.get("default_us") is None or g.get("tuned_us") is None:
            return "-"
        return f"{g['default_us']:.1f} -> {g['tuned_us']:.1f} ({g['gain_us']:+.1f} µs, {g['gain_pct']:+.1f} %)"

    lines = ["| preset | family | TP | rows | routed µs, GEMM1 default -> tuned (gain) | routed µs, GEMM2 default -> tuned"
             " | both default -> both tuned (* estimated: the two ratios applied) | tuned GEMM1 / GEMM2 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        names = " / ".join([r.get("revisit", r["gemm1"])["tuned"] or "-", r["gemm2"]["tuned"] or "-"])
        both = cell(r["both"]) + (" *" if r["both"].get("estimated") else "")
        lines.append(f"| {r['preset']} | {r.get('family', 'BF16')} | {r['tp']} | {r['rows']} | {cell(r['gemm1'])} | {cell(r['gemm2'])}"
                     f" | {both} | {names} |")  # fmt: skip
    return "\n".join(lines) + "\n"


__all__ = ["Budget", "FP8_H_EQUAL", "FP8_H_MARGIN", "GAIN_ROWS", "GemmStageRunner", "TuneConfig", "TuneOutcome", "copy_kernel_weights",
           "gains", "gains_markdown", "h_fp8_mismatch", "h_mismatch", "provenance", "require_tuning_device", "run_tune", "tune_many",
           "tuning_specs"]  # fmt: skip
