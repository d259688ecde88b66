"""`moebench step`: time a whole decode-step MoE layer at 1-8 token rows.

The layer (`integration.step_layer`): gate -> router top-k -> shared expert ->
routed experts -> finalize (top-k weighted sum + shared add), one rank of a
TP layer, for each backend: ours (DEFERRED_FINALIZE, `make_step`) = `MoEStep` +
`RoutedExpertGemm` + the finalize kernel, with the fused front (top-k + MXFP8 x + route record in one
launch) bound to the layer's router where `step.front_applies` (DeepSeek-V4
sqrtsoftplus routing with the layer's bias: every generated layer), else the
runner's router + `route`; any other backend (torch-bf16, FlashInfer, ...) =
the same gate / router / shared expert with the backend's routed experts, the
shared output added after. The routing_path column says which path a case
took ("front", "router+route: <why not the front>", "router"); the shared_path
column which path the shared expert took ("kernels": the fused shared-expert
kernels, "torch: <why not the kernels>"; ", side stream" where the whole step
runs it beside the gate and the routed experts, `--overlap-shared`, the
default, as serving stacks do; `--serial-shared` runs it in order). The routing follows the sweep's scenarios: the gate's
weights are chosen (`scenario_gate_weight`) so the real gate GEMM and router
pick each row's scenario experts.

Tactics, as `moebench sweep --tactics`: each backend runs every tactic of
`tactics` ("all": every tactic it offers for the shape,
`sweep.expand_all_tactics`), each (backend, tactic) pair with its own prepared
layers (`Backend.prepare(..., tactic)`), so `--backends moebench --tactics
fp8,bf16` compares our two kernel families in the whole step (the
kernel_tactics column names the family each row ran). A pair that
cannot run is skipped with the reason (`sweep.skip_reason`: the backend is
unavailable, the tactic is not offered for the shape, or
`tactic_unavailable_reason`); a name no selected backend offers fails up front
(`sweep.check_tactic_names`, naming --tactics).

Ranks: `ranks` = 1 times one rank's shard (I/tp, drawn directly, no
all-reduce: the shape `moebench sweep --tp` times) in this process;
`ranks` = tp runs a real TP-N step: N ranks started by PyTorch's launcher
(`launch.launch_local` on this host, or torchrun on several:
`launch.rank_main`), one GPU each, torch.distributed over NCCL (gloo on the
CPU), NVLink multicast off. Every rank slices one full seeded layer
(`slice_layer`), runs its slice and the all-reduce (SUM, BF16) of the layer
output.

The step reaches a backend only through the `Backend` interface: a backend
that declares DEFERRED_FINALIZE in `Backend.step_capabilities` (ours) runs
inside `MoEStep` with the finalize kernel (`KernelStep`), with its fused
front bound to the router where it also declares FUSED_FRONT; any other runs
its `forward` behind the runner's router (`BackendStep`): `make_step`.

Correctness gate (per case, layer 0): the step's output (all-reduced) vs
`step_oracle` of the layer (the full unsliced layer for a TP-N step, on rank
0), fp64, in the oracle family of the backend (`Backend.oracle`); a relative
Frobenius error above `reference.ORACLE_TOLERANCE` fails the case, which is
then not timed.

Timing: each quantity is its own CUDA graph, replayed and timed with device
events (`timing.time_graph`); one call of the graph walks `layers` distinct
layers' weights (>= 4x L2, cold L2; 1 with warm_l2) and the per-call time is
replay / layers:
- median_us / p10_us / p90_us: the whole step from the router logits on
  (front or router, shared expert, routed experts, finalize; with ranks > 1 the
  all-reduce too): the issue's target, which excludes the gate;
- step_with_gate_us: the same with the gate GEMM in front (with the shared
  expert on its side stream the gate overlaps it, so step_with_gate_us -
  median_us is less than gate_us); gate_us: the gate alone;
- kernel_<stage>_us: each stage alone (moebench: front, shared, gemm1,
  gemm2, finalize, with router + route instead of front off the front path;
  other backends: router, shared, experts, shared_add) in its own graph, fed
  by an eager run of the stages before it ("per-stage CUDA graphs", not nvtx ranges): a
  stage's time includes its launch but not the overlap programmatic
  dependent launch gives neighbours, so stage_sum_us >= the whole step;
- allreduce_us: the all-reduce of a BF16 [rows, H] buffer alone (ranks > 1),
  allreduce_share_pct = 100 * allreduce_us / median_us.
Without a GPU, and for a backend that cannot be captured, the same quantities
are timed eagerly (`timing_method`). bytes = the logical MXFP4 bytes of the
rank's touched experts + the shared expert's BF16 weights + activations in
and out (gbps over them); the gate's weights are not counted.

Results: one row per (preset, rows, scenario, backend, tactic)
(`STEP_COLUMNS`, the sweep's columns plus the step's), rank 0's numbers; with
ranks > 1 every rank's row also goes to a per-rank table. `moebench report`
renders both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import pandas as pd
import torch
import torch.distributed as dist

from moebench.backends.base import DEFERRED_FINALIZE, FUSED_FRONT
from moebench.bench.bandwidth import copy_bandwidth_gbps, size_matched_ceiling_gbps, triton_available
from moebench.bench.cases import CPU_BACKENDS, Case, SweepConfig, expand_cases, rotation_bytes, unique_bytes
from moebench.bench.columns import KERNEL_COLUMNS, STEP_COLUMNS, STEP_STAGES, typed
from moebench.bench.pipeline import (
    RunResult, case_row, check_tactic_names, error_text, expand_all_tactics, is_peer, jsonable,
    load_backends, pair_label, reduced_of, release, select_backends, skip_reason, unrun_rows, validate,
)  # fmt: skip
from moebench.bench.interrupt import sigterm_as_interrupt
from moebench.bench.launch import placement, visible_gpu_count
from moebench.bench.sweep import (
    LAYER_SEED_STRIDE, canonical_bytes, forced_layers_error, layer_count, timing_counts, timing_counts_used,
    timing_methods,
)  # fmt: skip
from moebench.bench.timing import Timing, time_graph
from moebench.env import environment, resolve_device
from moebench.formats import generate_activations
from moebench.integration.step_layer import (
    BackendStep, DecodeStep, KernelStep, build_runner, generate_full_layer, generate_shard_layer,
    scenario_gate_weight, slice_layer, step_oracle,
)  # fmt: skip
from moebench.backends.base import ORACLE_TOLERANCES as ORACLES_TOL
from moebench.reference import ORACLE_TOLERANCE, relative_error
from moebench.routing import SCENARIOS, scenario_topk_ids
from moebench.traffic import unique_experts

#: Backends a step runs on a GPU when none are named (unavailable ones are skipped with the reason).
GPU_STEP_BACKENDS = ("moebench", "torch-bf16", "flashinfer-w4a16", "flashinfer-w4a8")
#: How the per-kernel split is measured (stored in the manifest).
STAGE_TIMING = "per-stage CUDA graphs (each stage alone, fed by an eager run of the stages before it)"
STAGE_TIMING_CPU = "per-stage eager calls, host wall clock (no GPU)"
#: torch.distributed collective timeout of a TP step (s): long enough for a
#: rank still compiling kernels while the others wait.
PG_TIMEOUT_S = 600
#: How long the other ranks may outlive a dead rank before they are stopped (s).
RANK_GRACE_S = 30.0

ProgressFn = Callable[[int, int, str, str], None]


@dataclass(frozen=True)
class StepConfig(SweepConfig):
    """What `run_step` measures: a `SweepConfig` (presets, overrides, rows,
    scenarios, backends, seed, warm_l2, layers, device, reduced, timing
    counts, memory_fraction, trace) whose `tp` holds one degree, plus:

    ranks: 1 = one rank's I/tp shard on one device, no all-reduce; tp = a
    real TP-`tp` step, one process per rank with the all-reduce. devices:
    the CUDA indices of the ranks (as this process numbers them; None = 0..ranks-1;
    ignored on the CPU, where the ranks use gloo). tactics: as the sweep's,
    per backend (module docstring). overlap_shared: the whole step runs the
    shared expert on a side stream beside the gate and the routed experts
    (every backend; `DecodeStep`), else in order. Raises ValueError /
    TypeError naming the field.
    """

    ranks: int = 1
    devices: tuple[int, ...] | None = None
    overlap_shared: bool = True

    _command = "step"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.tp) != 1:
            raise ValueError(f"tp (--tp): a step takes one TP degree, got {self.tp}")
        tp = self.tp[0]
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks not in (1, tp):
            raise ValueError(f"ranks must be 1 (one rank's shard) or tp={tp} (a real TP-{tp} step), got {self.ranks!r}")
        if self.back_to_back:
            raise ValueError(
                "back_to_back (--back-to-back) is a sweep option: a step's gate and router write each"
                " layer's input before its routed experts, a layer boundary of its own"
            )
        if not isinstance(self.overlap_shared, bool):
            raise TypeError(
                f"overlap_shared (--overlap-shared/--serial-shared) must be a bool, "
                f"got {type(self.overlap_shared).__name__}"
            )
        if self.devices is not None:
            devs = tuple(self.devices)
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devs):
                raise ValueError(f"devices (--devices): expected CUDA indices >= 0, got {devs}")
            if len(set(devs)) != len(devs) or len(devs) != self.ranks:
                raise ValueError(f"devices (--devices): need {self.ranks} distinct GPUs (one per rank), got {devs}")
            object.__setattr__(self, "devices", devs)


#: What run_step returns: frame (STEP_COLUMNS, rank 0's numbers), manifest (kind "step"),
#: ranks (every rank's rows; None for a one-process run).
StepResult = RunResult


def default_step_backends(device: torch.device | str) -> tuple[str, ...]:
    """Backends a step runs when none are named: CPU_BACKENDS on the CPU,
    GPU_STEP_BACKENDS on a GPU."""
    return CPU_BACKENDS if torch.device(device).type == "cpu" else GPU_STEP_BACKENDS


def _selection(config: StepConfig, dev: torch.device) -> tuple[bool, tuple[str, ...]]:
    """(reduced geometry?, backend names) of `config` on `dev`."""
    return reduced_of(config, dev), select_backends(config, dev, GPU_STEP_BACKENDS)


def validate_step(config: StepConfig) -> None:
    """The checks `run_step` makes before measuring anything (device,
    backend names, tactic names, the replay trace), for a caller that wants
    them up front. Raises ValueError naming the option."""
    validate(config, resolve_device(config.device), GPU_STEP_BACKENDS)


# ----------------------------------------------------------------------------- collectives


def _agree(error: str | None, world: int) -> str | None:
    """Every rank's `error` (None = fine) -> the first error of any rank
    ("rank r: ..."), the same on every rank; None when all are fine."""
    if world == 1:
        return error
    everyone: list = [None] * world
    dist.all_gather_object(everyone, error)
    for rank, e in enumerate(everyone):
        if e is not None:
            return f"rank {rank}: {e}"
    return None


def _first_reasons(reasons: dict, world: int) -> dict:
    """Every rank's {key: reason, None = can run} -> per key the first
    rank's reason ("rank r: ..." past rank 0), the same on every rank: a
    backend or tactic runs only where every rank can run it (the same
    collectives everywhere)."""
    if world == 1:
        return reasons
    everyone: list = [None] * world
    dist.all_gather_object(everyone, reasons)
    return {k: next((f"rank {r}: {rs[k]}" if r else rs[k] for r, rs in enumerate(everyone) if rs[k]), None)
            for k in reasons}  # fmt: skip


def _from_rank0(value, world: int):
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _min_over_ranks(value: int, world: int) -> int:
    if world == 1:
        return value
    everyone: list = [None] * world
    dist.all_gather_object(everyone, int(value))
    return min(everyone)


def rank_barrier(world: int, device: torch.device) -> None:
    """Wait for every one of `world` ranks (none when world is 1)."""
    if world == 1:
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


# ----------------------------------------------------------------------------- one rank


def run_rank(
    config: StepConfig,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str | None = None,
    *,
    progress: ProgressFn | None = None,
    emit: Callable[[dict], None] | None = None,
) -> tuple[list[dict], dict]:
    """Measure every case of `config` as rank `rank` of `world` (world > 1
    needs torch.distributed initialized, one process per rank; every rank
    must call this with the same config). Returns (rows, info): one row per
    case (STEP_COLUMNS, this rank's numbers) and what the manifest records
    (environment, copy bandwidth, layers per preset, backend reasons).
    progress(done, total, label, status) after each case; emit(row) too.
    Raises ValueError for unknown backends or tactics (before measuring
    anything) or an unusable device; failures inside cases never raise (they
    are recorded, the same on every rank)."""
    if not isinstance(config, StepConfig):
        raise TypeError(f"config must be a StepConfig, got {type(config).__name__}")
    dev = resolve_device(device if device is not None else config.device)
    reduced, names = _selection(config, dev)
    backends, reasons = load_backends(names, dev)
    check_tactic_names(config, names, backends, reduced=reduced)  # before anything is measured
    env = environment(dev)
    copy_bytes, copy_repeats = ((1 << 30), 20) if dev.type == "cuda" else ((64 << 20), 5)
    copy_bw = copy_bandwidth_gbps(dev, copy_bytes, copy_repeats)
    reasons = _first_reasons(reasons, world)
    cases = expand_all_tactics(expand_cases(config, names, reduced=reduced), backends)  # the same on every rank
    total = len(cases)
    rows_out: list[dict] = []

    def record(row: dict) -> None:
        row["peer"] = is_peer(backends, row["backend"])  # whose failure it is (the CLI's exit rule)
        rows_out.append(row)
        if emit is not None:
            emit(row)
        if progress is not None:
            pair = pair_label(row["backend"], row["tactic"])
            label = f"{row['preset']} rows={row['rows']} {row['scenario']} {pair}"
            progress(len(rows_out), total, label, row["status"])

    base = {"device": env["device"]["name"], "sm_count": env["device"]["sm_count"], "commit": env["commit"],
            "seed": config.seed, "kind": "step", "ranks": world, "rank": rank, **placement(dev)}  # fmt: skip
    groups = []
    interrupted = False
    try:
        for preset in config.presets:
            cfg = config.config_for(preset, reduced=reduced)
            pairs = list(dict.fromkeys((c.backend, c.tactic) for c in cases if c.config == cfg))
            groups.append(_run_preset(config, cfg, rank, world, dev, env, copy_bw, pairs, backends, reasons,
                                      base, record))  # fmt: skip
            release(dev)
    except KeyboardInterrupt:
        if world > 1:  # the launching process collects what the ranks delivered
            raise
        interrupted = True  # one rank here: the measured cases are kept, the rest skipped
        rows_out += unrun_rows("step", cases, rows_out, base, backends)
    info = {"copy_bw_gbps": copy_bw, "copy_bw_bytes": copy_bytes, "reduced": reduced, "backends": reasons,
            "groups": groups, "env": env, "rank": rank}  # fmt: skip
    if interrupted:
        info["interrupted"] = True
    return rows_out, info


def _run_preset(config, cfg, rank, world, dev, env, copy_bw, pairs, backends, reasons, base, record) -> dict:
    """All cases of one preset on this rank, per (backend, tactic) of `pairs`;
    returns the manifest's group info."""
    tp = config.tp[0]
    shape = cfg.shard(tp)
    sliced = world > 1
    cases = [(r, s) for r in config.rows for s in config.scenarios]
    ids = {(r, s): scenario_topk_ids(s, r, shape.top_k, shape.experts, config.seed, config.trace) for r, s in cases}
    xs = {r: generate_activations(r, shape.hidden, config.seed) for r in config.rows}  # CPU: same bits on every rank
    shared_bytes = 3 * shape.intermediate * shape.hidden * 2
    min_touched = rotation_bytes(shape, ids.values()) + shared_bytes
    # Canonical experts + shared expert + a case's gate (BF16 + its fp32 copy) per layer;
    # each (backend, tactic) pair's prepared copy is budgeted below, per pair.
    per_layer = canonical_bytes(shape) + shared_bytes + 6 * shape.experts * shape.hidden
    budget = None
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        transient = canonical_bytes(cfg.shard(1)) * (2 if sliced else 0)  # the full layer being sliced (+ rank 0's)
        budget = max(per_layer, int(free * config.memory_fraction) - transient)
    forced = config.warm_l2 or config.layers is not None
    if config.warm_l2:
        layers, capped = 1, False
    elif config.layers is not None:
        layers, capped = config.layers, False
    else:
        layers, capped = layer_count(min_touched, env["device"]["l2_bytes"], per_layer, budget)
    layers = _min_over_ranks(layers, world)  # every rank must run the same collectives
    info = {"preset": cfg.name, "tp": tp, "layers": layers, "layers_capped": capped, "min_touched_bytes": min_touched,
            "layers_per_backend": {}}  # fmt: skip

    def backend_layers(name: str) -> int:
        """The rotation a (backend, tactic) pair gets: all generated layers,
        fewer when its prepared copies do not fit beside them (e.g.
        torch-bf16's 4x bytes); one pair's copies are held at a time."""
        extra = backends[name].prepared_bytes(shape)
        n = layers
        if budget is not None and extra > 0 and not forced:
            n = max(1, min(layers, (budget - layers * per_layer) // extra))
        return _min_over_ranks(n, world)

    def all_cases(status: str, error: str, pair: tuple[str, str]) -> None:
        for r, s in cases:
            record(case_row("step", Case(cfg, tp, r, s, *pair, config.seed), base, status=status, error=error,
                            layers=layers,
                        shared_bytes=shared_bytes, bytes=unique_bytes(shape, ids[(r, s)]) + shared_bytes,
                        unique_experts=unique_experts(ids[(r, s)], shape.experts)))  # fmt: skip

    # Which pairs run here, and why the others do not (as the sweep says it), the same on every rank.
    skip = _first_reasons({(n, t): skip_reason(backends, reasons, n, t, shape, dev) for n, t in pairs}, world)

    weights, oracle_weights = [], None
    error = forced_layers_error(layers, per_layer, budget, config.memory_fraction)
    try:
        for layer in range(layers if error is None else 0):
            seed = config.seed + LAYER_SEED_STRIDE * layer
            if sliced:
                full = generate_full_layer(cfg, seed, dev)
                weights.append(slice_layer(full, tp, rank))
                if layer == 0 and rank == 0:
                    oracle_weights = full
                del full
            else:
                weights.append(generate_shard_layer(cfg, tp, seed, dev))
        if oracle_weights is None and not sliced and weights:
            oracle_weights = weights[0]
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: the whole preset fails
        error = f"weight generation failed ({layers} layers): {error_text(e)}"
        weights.clear()
        oracle_weights = None
        release(dev)
    error = _agree(error, world)
    if error is not None:
        for pair in pairs:
            all_cases("skipped" if skip[pair] else "failed", skip[pair] or error, pair)
        return {**info, "error": error}

    for pair in pairs:
        name, tactic = pair
        if skip[pair] is not None:
            all_cases("skipped", skip[pair], pair)
            continue
        backend = backends[name]
        n_layers = backend_layers(name)
        info["layers_per_backend"][pair_label(name, tactic)] = n_layers
        prepared, error = [], None
        try:
            prepared = [backend.prepare(w.experts, shape, tactic) for w in weights[:n_layers]]
        except Exception as e:  # noqa: BLE001
            error = f"prepare failed: {error_text(e)}"
            prepared = []
            release(dev)
        error = _agree(error, world)
        if error is not None:
            all_cases("failed", error, pair)
            continue
        for r, s in cases:
            row = _run_case(config, cfg, shape, rank, world, dev, backend, prepared, weights[:n_layers],
                            oracle_weights, xs[r], ids[(r, s)], s, n_layers, copy_bw)  # fmt: skip
            record(case_row("step", Case(cfg, tp, r, s, name, tactic, config.seed), base, **row))
        del prepared
        release(dev)
    del weights, oracle_weights
    return info


def make_step(runner, backend, prepared, x, **kind) -> DecodeStep:
    """The decode step of `backend`'s prepared layer, by what the backend
    declares it can do (`Backend.step_capabilities`): with DEFERRED_FINALIZE
    its prepared layer runs inside `MoEStep` (route, GEMM1, GEMM2, the
    finalize kernel with the shared add fused: `KernelStep`), binding the
    layer's router to its fused front where it declares FUSED_FRONT; any
    other backend runs its `forward` behind the runner's router
    (`BackendStep`). kind: all_reduce, overlap_shared, as DecodeStep takes."""
    caps = backend.step_capabilities
    if DEFERRED_FINALIZE in caps:
        return KernelStep(runner, prepared, x, front=FUSED_FRONT in caps, **kind)
    return BackendStep(runner, backend, prepared, x, **kind)


def _routing_path(step: DecodeStep) -> str:
    """The routing path a step took (the routing_path column): "front" (our
    fused front), "router+route: <why the front does not apply>" (our kernels
    behind the runner's router), "router" (a backend behind the runner's router)."""
    reason = getattr(step, "front_refusal", None)
    return f"{step.routing_path}: {reason}" if reason else step.routing_path


def _shared_path(step: DecodeStep) -> str:
    """The shared expert's path (the shared_path column): "kernels" (the fused
    shared-expert kernels of `StepSharedExpert`), "torch: <why not the
    kernels>", or the shared expert's class name when it does not say;
    ", side stream" appended where the step overlaps it (`overlap_shared`,
    on a CUDA device: on the CPU the side stream is a plain call)."""
    shared = step.runner._shared_experts
    path = getattr(shared, "path", None)
    if path is None:
        path = type(shared).__name__
    else:
        reason = getattr(shared, "kernel_refusal", None)
        path = f"{path}: {reason}" if path != "kernels" and reason else path
    return f"{path}, side stream" if step.overlap_shared and step.x.is_cuda else path


def _run_case(config, cfg, shape, rank, world, dev, backend, prepared, weights, oracle_weights, x_cpu, ids_cpu,
              scenario, layers, copy_bw) -> dict:  # fmt: skip
    """Gate then time one case on this rank; returns its own columns (the
    same status on every rank)."""
    rows = x_cpu.shape[0]
    shared_bytes = 3 * shape.intermediate * shape.hidden * 2
    nbytes = unique_bytes(shape, ids_cpu) + shared_bytes
    l2 = environment_l2(dev)
    row: dict = {
        "oracle": backend.oracle, "layers": layers, "shared_bytes": shared_bytes, "bytes": nbytes,
        "unique_experts": unique_experts(ids_cpu, shape.experts),
        "l2_multiple": (layers * (nbytes - 4 * rows * shape.hidden) / l2) if l2 else None,
    }  # fmt: skip
    kw = dict(top_k=shape.top_k, routed_scaling_factor=shape.routed_scaling_factor, swiglu_limit=shape.swiglu_limit)
    steps: list[DecodeStep] = []
    gates = []
    error = None
    part = None
    try:
        x = x_cpu.to(dev)
        for layer, w in enumerate(weights):
            seed = config.seed + LAYER_SEED_STRIDE * layer + 1009 * rows + 17 * SCENARIOS.index(scenario)
            gate = scenario_gate_weight(x_cpu, ids_cpu, shape.experts, w.bias, seed).to(dev)
            gates.append(gate)
            runner = build_runner(w, gate, **kw)
            steps.append(
                make_step(
                    runner, backend, prepared[layer], x, all_reduce=world > 1, overlap_shared=config.overlap_shared
                )
            )
        row["kernel_tactics"] = backend.kernel_tactics(prepared[0], rows)  # e.g. which kernel family ran
        row["routing_path"] = _routing_path(steps[0])
        row["shared_path"] = _shared_path(steps[0])
        part = steps[0].partial(with_gate=True)
        _, got = steps[0].routing()
        row["unique_experts"] = unique_experts(got, shape.experts)
    except Exception as e:  # noqa: BLE001 - a backend failure fails its case only
        error = error_text(e)
    error = _agree(error, world)
    if error is not None:
        return {**row, "status": "failed", "error": error}

    # Correctness: the (all-reduced) step vs the fp64 oracle of the layer (the full one for TP-N).
    out = part
    if world > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    verdict = None
    if rank == 0:
        try:
            oracle, _ = step_oracle(oracle_weights, gates[0], steps[0].x, **kw, activation=backend.oracle)
            err = relative_error(out, oracle)
            what = "the full unsliced layer" if world > 1 else "the layer"
            tol = ORACLES_TOL[backend.oracle]
            verdict = (err, None if err <= tol else
                       f"rel. error {err:.3g} vs the {backend.oracle} oracle of {what} exceeds {tol:g}")  # fmt: skip
        except Exception as e:  # noqa: BLE001
            verdict = (None, f"oracle failed: {error_text(e)}")
    err, error = _from_rank0(verdict, world)
    row["max_rel_err"] = err
    if error is not None:
        return {**row, "status": "failed", "error": error}

    try:
        timings = _time_case(config, steps, backend.capturable, dev, world, rows, shape.hidden)
        error = None
    except Exception as e:  # noqa: BLE001
        timings, error = None, error_text(e)
        if dev.type == "cuda":
            try:
                torch.cuda.synchronize(dev)
            except Exception:  # noqa: BLE001
                pass
    error = _agree(error, world)
    if error is not None:
        return {**row, "status": "failed", "error": error}
    step = timings.pop("step")
    row.update(status="ok", median_us=step.median_us, p10_us=step.p10_us, p90_us=step.p90_us,
               timing_method=step.method)  # fmt: skip
    row["step_with_gate_us"] = timings.pop("step_with_gate").median_us
    row["gate_us"] = timings.pop("gate").median_us
    ar = timings.pop("allreduce", None)
    if ar is not None:
        row["allreduce_us"] = ar.median_us
        row["allreduce_share_pct"] = 100.0 * ar.median_us / step.median_us if step.median_us > 0 else None
    for name, t in timings.items():
        row[f"kernel_{name}_us"] = t.median_us
    row["stage_sum_us"] = sum(t.median_us for t in timings.values()) if timings else None
    gbps = nbytes / (step.median_us * 1e-6) / 1e9 if step.median_us > 0 else None
    row["gbps"] = gbps
    row["pct_copy_bw"] = 100.0 * gbps / copy_bw if gbps and copy_bw else None
    if dev.type == "cuda":
        try:
            ceiling = size_matched_ceiling_gbps(nbytes, dev)
        except Exception:  # noqa: BLE001 - the ceiling is optional
            ceiling = None
        row["ceiling_gbps"] = ceiling
        row["pct_size_ceiling"] = 100.0 * gbps / ceiling if gbps and ceiling else None
    del steps, gates
    return row


def environment_l2(dev: torch.device) -> int | None:
    """L2 bytes of a CUDA device, None on the CPU."""
    if dev.type != "cuda":
        return None
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)) or None


def _time_case(config, steps, capturable, dev, world, rows, hidden) -> dict[str, Timing]:
    """Every timed quantity of one case (see the module docstring). The
    quantities with collectives come first, in the same order on every rank."""
    graph = config.use_graph and capturable
    counts = dict(
        timing_counts(config, len(steps), graph, dev),
        # The NCCL watchdog thread queries events while a rank captures.
        capture_error_mode="thread_local" if world > 1 else "global",
    )  # fmt: skip

    def timed(fn) -> Timing:
        return time_graph(fn, **counts)

    out: dict[str, Timing] = {}
    rank_barrier(world, dev)
    out["step"] = timed(lambda: [s.run(with_gate=False) for s in steps])
    rank_barrier(world, dev)
    out["step_with_gate"] = timed(lambda: [s.run(with_gate=True) for s in steps])
    if world > 1:
        buf = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=dev)
        rank_barrier(world, dev)
        out["allreduce"] = timed(lambda: [dist.all_reduce(buf, op=dist.ReduceOp.SUM) for _ in steps])
    # Local from here on: no collectives.
    out["gate"] = timed(lambda: [s.gate() for s in steps])
    if config.split:
        calls = [s.stage_calls() for s in steps]
        for i, (name, _) in enumerate(calls[0]):
            out[name] = timed(lambda i=i: [c[i][1]() for c in calls])
    return out


# ----------------------------------------------------------------------------- the run


def _frame(rows: list[dict]) -> pd.DataFrame:
    return typed(rows, "step")


def step_cases(config: StepConfig) -> tuple[list[Case], dict]:
    """(every case of `config` as the ranks expand it, the backends loaded
    without an availability check): what a merged step run holds."""
    dev = torch.device("cpu" if str(config.device or "cuda").startswith("cpu") else "cuda")
    # the names were checked where the run was planned (a rank that does not know one fails its cases)
    reduced, names = reduced_of(config, dev), config.backends or select_backends(config, dev, GPU_STEP_BACKENDS)
    backends = load_backends(names)[0]
    return expand_all_tactics(expand_cases(config, names, reduced=reduced), backends), backends


def step_manifest(config: StepConfig, info: dict, **extra) -> dict:
    """The manifest of a step run from a rank's `info` (run_rank's) and `extra` entries."""
    env = info.get("env") or {}
    return {
        "schema": 1,
        "kind": "step",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reduced": info.get("reduced"),
        "seed": config.seed,
        "warm_l2": config.warm_l2,
        "copy_bw_gbps": info.get("copy_bw_gbps"),
        "copy_bw_bytes": info.get("copy_bw_bytes"),
        "oracle_tolerance": ORACLE_TOLERANCE,
        "stage_timing": (
            None
            if not config.split
            else STAGE_TIMING
            if env.get("device", {}).get("kind") == "cuda"
            else STAGE_TIMING_CPU
        ),
        "step_excludes": "the gate (router GEMM): gate_us and step_with_gate_us report it",
        "size_ceiling": "triton" if (env.get("device", {}).get("kind") == "cuda" and triton_available()) else None,
        "backends": info.get("backends"),
        "groups": info.get("groups"),
        "ranks": config.ranks,
        "config": jsonable(asdict(config)),
        **env,
        **{k: v for k, v in extra.items() if k not in env},
    }


def run_step(config: StepConfig, progress: ProgressFn | None = None, *, timeout_s: float | None = None) -> StepResult:
    """Run every case of `config` (module docstring): in this process when
    config.ranks == 1, else in config.ranks processes started by PyTorch's
    elastic launch (`launch.launch_local`; under torchrun `run.measure`
    runs the ranks instead).

    progress(done, total, label, status) after each case (rank 0's).
    Raises TypeError for a bad config, ValueError for unknown backends or
    tactics, an unusable device or more ranks than visible GPUs (naming both
    numbers), before measuring anything;
    failures inside cases never raise, and a rank that dies leaves its cases
    failed with the reason.
    """
    if not isinstance(config, StepConfig):
        raise TypeError(f"config must be a StepConfig, got {type(config).__name__}")
    if config.ranks == 1:
        dev = resolve_device(config.device)
        # The device made current, as a rank process does: every launch and stream lands on it.
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            rows, info = run_rank(config, 0, 1, dev, progress=progress)
        frame = _frame(rows)
        methods = timing_methods(frame)
        manifest = step_manifest(
            config, info, devices=[str(dev)], timing_methods=methods, timing_counts=timing_counts_used(config, methods)
        )
        if info.get("interrupted"):
            manifest["interrupted"] = True
        return StepResult(frame, manifest)
    from moebench.bench.launch import launch_local

    rank_devices(config)  # more ranks than GPUs: fails here, naming both numbers
    validate_step(config)  # unknown backends or tactics fail here, not in every rank
    with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the ranks stop, what they measured is kept
        return launch_local(step_job(config), config.ranks, timeout_s=timeout_s,
                            progress=None if progress is None else lambda d, t: progress(d, t, "", ""),
                            total=len(step_cases(config)[0]))  # fmt: skip


# ----------------------------------------------------------------------------- TP-N processes


def rank_devices(config: StepConfig) -> tuple[torch.device, list[int] | None]:
    """(device kind of the ranks, their CUDA indices or None on the CPU).
    Raises ValueError when config.ranks exceeds the visible GPUs, naming both."""
    dev = resolve_device(config.device)
    if dev.type == "cpu":
        return dev, None
    available = visible_gpu_count()
    if config.ranks > available:
        raise ValueError(
            f"tp (--tp): a TP-{config.ranks} step needs {config.ranks} GPUs (one per rank), but "
            f"{available} {'is' if available == 1 else 'are'} visible"
        )
    devices = list(config.devices) if config.devices is not None else list(range(config.ranks))
    bad = [d for d in devices if d >= available]
    if bad:
        raise ValueError(f"devices (--devices): {bad} not in [0, {available}) visible GPUs")
    return dev, devices


def step_config(**kwargs) -> StepConfig:
    """StepConfig(**kwargs) with `tp` given as an int (or a 1-tuple); a
    shorthand for callers that build one from options. Raises as StepConfig."""
    tp = kwargs.get("tp", 1)
    kwargs["tp"] = (tp,) if isinstance(tp, int) else tuple(tp)
    return StepConfig(**kwargs)


# ----------------------------------------------------------------------------- the step's ranks, launched


def step_job(config: StepConfig):
    """The launch.Job of a TP-N step of `config`: every rank runs `step_rank`,
    the merging process `merge_step`; the ranks run collectives together."""
    from moebench.bench.merge import Job

    return Job("step", config, step_rank, merge_step, config.devices, collective=True)


def step_rank(job, rank: int, world: int, device: torch.device, box) -> bool:
    """Run every case of a step as rank `rank`; rows put into the store
    (`box`, a launch.Outbox) as each case is done. True when an interrupt
    stopped it (one rank)."""
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        box.piece(rows, {}, replace_last=True)
        if rank == 0:  # every rank runs every case of a step: rank 0's count is the run's
            box.put("progress", len(rows))

    got, info = run_rank(job.config, rank, world, device, emit=emit)
    box.piece(got, info, replace_last=True)
    rank_barrier(world, device)  # no rank leaves while another still runs a collective
    return bool(info.get("interrupted"))


def merge_step(job, reports, stopped: str | None = None) -> StepResult:
    """One step run (with `ranks`) of what the ranks delivered (merge.RankReport):
    rank 0's rows as the run's cases, every case it did not deliver stored
    as `merge.undelivered` of the first rank that failed says; every rank's
    rows in `ranks`."""
    from moebench.bench.interrupt import INTERRUPTED
    from moebench.bench.merge import host_provenance, undelivered, workers_of

    config = job.config
    latest = {r.rank: (r.pieces[-1] if r.pieces else {"rows": [], "info": {}}) for r in reports}
    # the cases rank 0 did not deliver: failed with the first failed rank's reason, else as rank 0 says
    failed = [r for r in reports if (r.end or {}).get("status") not in ("done", "interrupted")]
    status, error = undelivered(failed[0] if failed else reports[0], stopped)
    rank0 = [dict(r) for r in latest[0]["rows"]]
    if stopped not in (None, INTERRUPTED):
        rank0 = [dict(r, status="failed", error=error) if r.get("error") == INTERRUPTED else r for r in rank0]
    cases, backends = step_cases(config)
    base = {"kind": "step", "ranks": len(reports), "rank": 0, "seed": config.seed, "launch_rank": 0,
            **{k: reports[0].hello.get(k) for k in ("host", "gpu_index", "gpu_serial")}}  # fmt: skip
    rank0 += unrun_rows("step", cases, rank0, base, backends, error, status)
    frame = typed(rank0, "step")
    ranks = typed([row for r in reports for row in latest[r.rank]["rows"]], "step")
    info = next((latest[r.rank]["info"] for r in reports if latest[r.rank]["info"].get("env")), None)
    extra = {}
    if info is None:
        info = {"env": host_provenance(config), "reduced": config.reduced}
        extra["provenance_from"] = "the launching process (no rank reported its environment)"
    methods = timing_methods(frame)
    manifest = step_manifest(config, info, devices=[r.hello.get("gpu_index") for r in reports],
                             workers=workers_of(reports, stopped), timing_methods=methods,
                             timing_counts=timing_counts_used(config, methods),
                             rank_manifests=[{k: latest[r.rank]["info"].get(k) for k in ("copy_bw_gbps", "groups")}
                                             for r in reports], **extra)  # fmt: skip
    if (frame["error"] == INTERRUPTED).any():
        manifest["interrupted"] = True
    return RunResult(frame, manifest, ranks if len(reports) > 1 else None)


__all__ = [
    "GPU_STEP_BACKENDS", "KERNEL_COLUMNS", "STAGE_TIMING", "STEP_COLUMNS", "STEP_STAGES", "StepConfig",
    "StepResult", "default_step_backends", "make_step", "merge_step", "rank_devices", "run_rank", "run_step",
    "step_config", "step_job", "step_rank", "validate_step",
]  # fmt: skip
