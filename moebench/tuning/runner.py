"""`moebench tune` on the GPU: our GEMM kernels behind the tuner's callables.

`GemmStageRunner` is the runner of FlashInfer's autotuner pattern for one
(shape, stage): `valid_tactics(rows)` and, for one tactic, `check(tactic,
rows)` (its output against the fp64 oracle) and `time(tactic, rows)` (under
a CUDA graph, cycling through enough distinct weight sets that the working
set is >= 4 x L2, as the sweep does). `run_tune` tunes GEMM1 and GEMM2 for
each TP degree and returns one `TuningTable` per shape class.

Checks (DESIGN.md numerics): GEMM1's H bytes equal the oracle's for
>= 99.9 % of the elements of used tiles and its scales likewise, no byte more
than one e4m3 code apart where the block scales agree; GEMM2's rows (on the
oracle's H) within ORACLE_TOLERANCE relative Frobenius error, no NaN,
padding rows zero. Outputs are poisoned before each checked launch.

Needs an sm_90 GPU and nvidia-cutlass-dsl; `require_tuning_device` says why
not in one line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from moebench import __version__
from moebench.env import environment, resolve_device
from moebench.kernels.tactic import GemmShape, GemmTactic, default_tactic
from moebench.models import RankShape, get_preset
from moebench.record import MAX_ROWS, TILE, max_ctas
from moebench.tuning.space import DEFAULT_SPACE, TacticSpace, valid_tactics
from moebench.tuning.table import ShapeClass, TuningTable
from moebench.tuning.tuner import TuneResult, tune

#: Working set of one timed replay, in L2 sizes (as the sweep).
L2_MULTIPLE = 4
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
    tuner settings (repeats, top), timing counts and the L2 mode."""

    preset: str = "dsv41-flash"
    hidden: int | None = None
    intermediate: int | None = None
    experts: int | None = None
    top_k: int | None = None
    tp: tuple[int, ...] = (4,)
    rows: tuple[int, ...] = tuple(range(1, MAX_ROWS + 1))
    stages: tuple[int, ...] = (1, 2)
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
                 replays: int = 50, space: TacticSpace = DEFAULT_SPACE,
                 weight_sets: list | None = None) -> None:  # fmt: skip
        from moebench.bench.cases import unique_bytes
        from moebench.bench.sweep import canonical_bytes, layer_count
        from moebench.env import device_info
        from moebench.formats import generate_expert_weights
        from moebench.kernels.layout import to_kernel_layout
        from moebench.routing import scenario_topk_ids

        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        self.shape, self.stage, self.device = shape, stage, device
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
                min_touched = min(unique_bytes(shape, ids) for ids in self.ids.values())
                n, _ = layer_count(min_touched, info.l2_bytes, 2 * canonical_bytes(shape),
                                   int(free * MEMORY_FRACTION))  # fmt: skip
            weights0 = generate_expert_weights(shape, seed, device)
            kws = [to_kernel_layout(weights0)]
            for layer in range(1, n):
                w = generate_expert_weights(shape, seed + LAYER_SEED_STRIDE * layer, device)
                kws.append(to_kernel_layout(w))
                del w
            weight_sets = [weights0, kws]
        self.weight_sets = weight_sets
        self.weights0, self.kws = weight_sets
        self.layers = len(self.kws)
        self.wide = any(kw.wide_scales for kw in self.kws)
        self.seed = seed
        self._inputs: dict[int, dict] = {}

    def valid_tactics(self, rows: int) -> tuple[GemmTactic, ...]:
        """The space's tactics for this stage at `rows` (the default first)."""
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        return valid_tactics(self.gshape, self.stage, ctas, num_sms=self.num_sms, space=self.space,
                             wide_scales=self.wide)  # fmt: skip

    def default(self, rows: int) -> GemmTactic:
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        return default_tactic(self.gshape, self.stage, ctas, self.num_sms, self.wide)

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
                "used": TILE * route.tiles_used}  # fmt: skip
        n = TILE * route.ctas
        if self.stage == 1:
            case["h_q"] = torch.empty(n, s.intermediate, dtype=torch.uint8, device=dev)
            case["h_s"] = torch.empty(n, s.intermediate // 32, dtype=torch.uint8, device=dev)
        else:
            case["oracle"] = reference_gemm2(dequantize_mxfp8(ref_q, ref_s, torch.float64), self.weights0, route)
            case["out"] = torch.empty(n, s.hidden, dtype=torch.bfloat16, device=dev)
        self._inputs[rows] = case
        return case

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _launch(self, kw, case: dict, tactic: GemmTactic) -> None:
        from moebench.kernels.gemm import gemm1, gemm2

        route = case["route"]
        if self.stage == 1:
            gemm1(kw, case["x_q"], case["x_s"], route.record, route.ctas, case["h_q"], case["h_s"], tactic=tactic)
        else:
            gemm2(kw, case["ref_q"], case["ref_s"], route.record, route.ctas, case["out"], tactic=tactic)

    def check(self, tactic: GemmTactic, rows: int) -> str | None:
        """None when `tactic`'s output at `rows` matches the oracle, else why."""
        case = self._case(rows)
        used = case["used"]
        if self.stage == 1:
            case["h_q"].fill_(0xFF)
            case["h_s"].fill_(0xFE)
            self._launch(self.kws[0], case, tactic)
            self._sync()
            return h_mismatch(case["h_q"][:used], case["h_s"][:used], case["ref_q"][:used], case["ref_s"][:used])
        from moebench.reference import ORACLE_TOLERANCE, relative_error

        case["out"].fill_(float("nan"))
        self._launch(self.kws[0], case, tactic)
        self._sync()
        out = case["out"][:used]
        if torch.isnan(out).any():
            return "rows of used tiles not written (NaN)"
        err = relative_error(out.double(), case["oracle"][:used])
        if not err <= ORACLE_TOLERANCE:
            return f"relative error {err:.3g} exceeds {ORACLE_TOLERANCE:g}"
        valid = case["route"].tile_valid_rows.tolist()
        for t in range(case["route"].tiles_used):
            if not torch.all(case["out"][TILE * t + valid[t]: TILE * (t + 1)] == 0):
                return f"padding rows of tile {t} not zero"
        return None

    def time(self, tactic: GemmTactic, rows: int):
        """Timing (µs per launch) of `tactic` at `rows` under a CUDA graph
        that launches it once per rotated weight set."""
        from moebench.bench.timing import time_graph

        case = self._case(rows)

        def launch_all() -> None:
            for kw in self.kws:
                self._launch(kw, case, tactic)

        return time_graph(launch_all, warmup=self.warmup, replays=self.replays, calls_per_replay=len(self.kws),
                          use_graph=True, device=self.device)  # fmt: skip


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


@dataclass
class TuneOutcome:
    """One table per shape class, and the tuner's per-stage results
    (for display): {(tp, stage): TuneResult}."""

    tables: list[TuningTable] = field(default_factory=list)
    results: dict[tuple[int, int], TuneResult] = field(default_factory=dict)
    layers: dict[tuple[int, int], int] = field(default_factory=dict)


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


def run_tune(config: TuneConfig, progress: Callable[[str], None] | None = None) -> TuneOutcome:
    """Tune every (TP degree, stage, rows) of `config` on its GPU; returns one
    TuningTable per shape class (not written: the caller writes them).
    Raises RuntimeError (require_tuning_device) without an sm_90 GPU."""
    dev = require_tuning_device(config.device)
    say = progress or (lambda text: None)
    outcome = TuneOutcome()
    base = provenance(dev)
    for shape in config.shapes():
        sclass = ShapeClass.of(shape)
        entries = {}
        weight_sets = None
        for stage in config.stages:
            say(f"{shape.describe()} GEMM{stage}: preparing weights")
            runner = GemmStageRunner(shape, stage, dev, scenario=config.scenario, seed=config.seed,
                                     layers=config.layers, warm_l2=config.warm_l2, warmup=config.warmup,
                                     replays=config.replays, space=config.space,
                                     weight_sets=weight_sets)  # fmt: skip
            weight_sets = runner.weight_sets
            prov = {**base, "timing": {
                "method": "cuda-graph", "warmup": config.warmup, "replays": config.replays,
                "layers": runner.layers, "warm_l2": config.warm_l2, "scenario": config.scenario,
                "seed": config.seed, "repeats": config.repeats, "top": config.top,
                "wide_scales": runner.wide,
            }}  # fmt: skip

            def step(rows: int, name: str, status: str, _stage=stage) -> None:
                say(f"{shape.describe()} GEMM{_stage} rows={rows}: {name} {status}")

            result = tune(
                shape, list(config.rows), lambda _s, rows, r=runner: r.valid_tactics(rows),
                runner.time, runner.check, repeats=config.repeats, top=config.top,
                prefer=runner.default, provenance=prov, progress=step,
            )  # fmt: skip
            outcome.results[shape.tp, stage] = result
            outcome.layers[shape.tp, stage] = runner.layers
            for rows, entry in result.entries.items():
                entries[stage, rows] = entry
            del runner
        del weight_sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        d = base
        table = TuningTable(sclass, {"name": d["device"], "sm_count": d["sm_count"], "capability": d["capability"]},
                            entries)  # fmt: skip
        outcome.tables.append(table)
    return outcome


__all__ = ["GemmStageRunner", "TuneConfig", "TuneOutcome", "h_mismatch", "provenance", "require_tuning_device",
           "run_tune"]  # fmt: skip
