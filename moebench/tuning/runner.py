"""`moebench tune` on the GPU: our GEMM kernels behind the tuner's callables.

`GemmStageRunner` is the runner of FlashInfer's autotuner pattern for one
(shape, stage): `valid_tactics(rows)` and, for one tactic, `check(tactic,
rows)` (its output against the fp64 oracle) and `time(tactic, rows)`: the
layer the runtime would run with that tactic (the runner's `LayerPlan` with
the candidate substituted, `candidate_plan`), bound on every rotated weight
set (`RoutedExpertGemm.bind`) and called through the binding's own
`forward` (route kernel with the MXFP8 x and record, GEMM1, GEMM2) at the
layer boundary, as the sweep times a layer call (`timed_layers`: each
layer's x write before its call, the writes' time taken off), under a CUDA
graph, cycling through enough distinct weight sets that the working set is
>= 4 x L2: what the sweep's `routed_us` measures, so table times are
routed-path times and the tuned launch sequence is the one that runs
(tests/kernels/test_layer_plan.py records both). The other stage runs its
partner tactic: GEMM1's candidates run beside GEMM2's default; GEMM2's beside
the GEMM1 tactic just tuned for the same rows (`partners`), so a table's pair
is timed together when one run tunes both stages (a run of GEMM2 alone times
it beside GEMM1's default). `check` launches the stage alone on the torch
builder's record and the oracle's inputs. `run_tune` tunes GEMM1 then GEMM2 for each TP degree, then
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
from moebench.bench import check_layers, check_seed
from moebench.env import environment, resolve_device
from moebench.kernels.table import LAYER, STAGE_LABELS, ShapeClass, TuningTable
from moebench.kernels.tactic import GemmShape
from moebench.models import RankShape, get_preset
from moebench.record import ALL_ROWS, max_ctas
from moebench.tuning.space import DEFAULT_FP8_SPACE, DEFAULT_SPACE, Fp8Space, TacticSpace, valid_tactics
from moebench.tuning.stage_runner import (  # noqa: F401 - re-exported: the tune run's pieces, one import path
    FP8_H_EQUAL,
    FP8_H_MARGIN,
    LAYER_SEED_STRIDE,
    MEMORY_FRACTION,
    GemmStageRunner,
    bind_layers,
    candidate_plan,
    copy_kernel_weights,
    h_fp8_mismatch,
    h_mismatch,
    operand_twins,
    timed_layers,
)
from moebench.tuning.tuner import TuneResult, tune


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
    rows: tuple[int, ...] = ALL_ROWS
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
