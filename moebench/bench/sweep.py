"""The sweep: every case of a SweepConfig, gated for correctness, then timed.

Per (preset, tp) group: `layers` distinct seeded weight sets are generated on
the device (enough that one replay's working set is >= 4 x L2 for a routing
that touches the shape's fewest bytes, one row over top_k experts
(`cases.rotation_bytes`), so that the count, and the share of a replay's
boundary each layer call carries, does not depend on which row counts the
sweep holds; capped by a memory budget; 1 with warm_l2). Then one
(backend, tactic) pair at a time is prepared once per weight set (fewer
sets where its prepared copies do not fit the budget beside them: the
`layers` column), runs its cases and is released, so that a pair's
rotation does not depend on which other backends share the sweep; per
(rows, scenario) the routing, weights and activations are drawn once, and
each case:

1. is skipped with a reason when unavailable or the tactic is not offered;
2. runs layer 0 once and is compared with the fp64 oracle of its family
   (reference_moe(activation=backend.oracle)) through `reference.oracle_gate`:
   the whole output's relative error within the backend's tolerance and
   every row's within twice that (NaN/Inf never pass); a case off its oracle
   is failed and not timed; on CUDA, when it is to be timed as a graph, the
   output of one graph replay (poisoned first) is gated the same way; then
   every other layer of the rotation but the last once, eagerly, against
   its own weight set's oracle (the last is gated from the timed graph,
   step 3). Every gated output's error against the BF16-activation fp64
   oracle is kept too (`err_bf16`, the worst; the same oracle for every
   backend, so the column reads across them, where `max_rel_err` is each
   backend against its own family's);
3. is timed as one closure calling forward for every layer in turn on static
   input buffers, at a layer boundary by default: before each call a plain
   kernel (`layer_writes`: x rewritten from that layer's own source buffer,
   no programmatic dependent launch) writes the x the call reads, as the kernel
   before the MoE does in a decode step, so nothing of call i+1 starts
   before its input exists. The writes are timed alone once per (rows,
   group) and timing method, at the group's layer count (the same writes,
   no MoE: `x_write_us`, one value for every backend), in WRITE_BATCHES
   batches with the replays doubled until the batches' medians agree
   within WRITE_SPREAD_US (the manifest's groups[].x_writes), and that
   median subtracted from every case of the rows:
   per call = T(writes + calls) / layers - x_write_us (`timing.less_us`).
   `SweepConfig.back_to_back` (`--back-to-back`) times the calls back to
   back instead (call i+1 may start under call i): the `boundary` column and
   the manifest say which. After the timing, the timed graph itself (the
   same capture) is checked: the last layer's output is poisoned with NaN,
   the graph replayed once, and that output gated against the last layer's
   own fp64 oracle (its own weight set); a failure fails the case;
4. where the backend splits its forward (`Backend.stage_calls`,
   `routed_call`; our kernels do), each stage is timed alone the same way
   (kernel_<stage>_us: a graph of that stage for every layer, fed by an eager
   run of the stages before it, with the case's boundary: each layer's x
   written before its stage call and the case's x_write_us subtracted; it
   includes the stage's launch but not the overlap programmatic dependent
   launch gives its neighbours), and so is the
   routed-expert path without the finalize (routed_us: route + GEMM1 + GEMM2
   in one graph, with its % of copy bandwidth over the same bytes). Medians
   only. Stage times are not additive (PDL overlaps neighbours in the layer
   call), and routed_us can come out a little above the layer call (measured,
   back to back: up to ~2 % for the a16 family at rows 6-8): without the
   finalize between layers, the next layer's early-launched kernels meet a
   different GEMM2 tail. A failure here leaves the case ok, with the reason
   in its note. `SweepConfig.split=False` (`--no-split`) skips this step.

Bytes: `bytes` (and gbps, pct_copy_bw) is the logical MXFP4 count, the same
for every backend (`cases.unique_bytes`); `read_bytes` what the backend
really reads in its own layout (`Backend.read_bytes`, else `bytes`) and
`read_gbps` the bandwidth over it. `peer` is the backend's `Backend.peer`
(whether a failed case is a peer's, which the CLI fails only with --strict).

Any exception inside a backend marks that case failed with the message; the
sweep goes on. Without a GPU the sweep runs on the CPU at a reduced geometry
(cases.CPU_REDUCED) with the CPU backends and says so in the manifest.

This module composes backends (through the registry) with the timing
harness; the harness itself (timing.py, bandwidth.py) knows only callables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import pandas as pd
import torch

from moebench.backends.base import Backend
from moebench.backends.registry import backend_names
from moebench.bench import EAGER_REPLAYS_CAP, EAGER_WARMUP_CAP
from moebench.bench.bandwidth import copy_bandwidth_gbps, size_matched_ceiling_gbps, triton_available
from moebench.bench.budget import LayerBudget, forced_layers_error, layer_count  # noqa: F401 - re-exported
from moebench.bench.cases import CPU_BACKENDS, Case, SweepConfig, expand_cases, rotation_bytes, unique_bytes
from moebench.bench.columns import COLUMNS, SWEEP_STAGES, typed  # noqa: F401 - COLUMNS: the sweep's, re-exported
from moebench.bench.pipeline import (
    RunResult, case_row, check_tactics_once, error_text, expand_all_tactics, is_peer, jsonable, load_backends,
    reduced_of, release, select_backends, skip_reason, unrun_rows, validate,
)  # fmt: skip
from moebench.bench.launch import placement
from moebench.bench.timing import Steady, less_us, time_graph, time_steady
from moebench.env import environment, resolve_device
from moebench.formats import generate_activations, generate_expert_weights
from moebench.models import MX_BLOCK, RankShape
from moebench.reference import ORACLE_TOLERANCE, ROW_TOLERANCE_FACTOR, oracle_gate, reference_moe, relative_error
from moebench.routing import scenario_topk_ids, scenario_weights
from moebench.traffic import unique_experts

#: How kernel_<stage>_us and routed_us are measured (stored in the manifest).
STAGE_TIMING = (
    "kernel_<stage>_us: each stage alone, fed by an eager run of the stages before it;"
    " routed_us: route + GEMM1 + GEMM2 as forward launches them, no finalize;"
    " both with the case's timing method, layer rotation and boundary"
)
#: How a replay's layer calls meet (the `boundary` column and the manifest's "boundary").
LAYER_BOUNDARY, BACK_TO_BACK = "layer", "back-to-back"
#: What each boundary means (the manifest's "boundary_timing").
BOUNDARY_TIMING = {
    LAYER_BOUNDARY: "a plain kernel (x from the layer's own source buffer, no PDL) writes each call's x just"
    " before it; the writes alone (x_write_us: the same writes, no MoE, measured once per rows and group"
    " until their batches agree within 0.05 us, groups[].x_writes) are subtracted from every backend:"
    " per call = T(writes + calls) / layers - x_write_us, medians",
    BACK_TO_BACK: "layer calls back to back on static inputs (--back-to-back): call i+1 may start under call i;"
    " per call = T(calls) / layers",
}
STATUSES = ("ok", "failed", "skipped")
#: Seed stride between rotation layers' weight sets.
LAYER_SEED_STRIDE = 1_000_003

ProgressFn = Callable[[int, int, Case, str], None]
#: What run_sweep returns (frame, manifest; ranks None).
SweepResult = RunResult


def canonical_bytes(shape: RankShape) -> int:
    """Device bytes of one canonical (padded) weight set of `shape`."""
    e, h, ip = shape.experts, shape.hidden, shape.padded_intermediate
    per_expert = 2 * ip * h // 2 + 2 * ip * h // MX_BLOCK + h * ip // 2 + h * ip // MX_BLOCK
    return e * per_expert + 4 * e


def default_backends(device: torch.device | str) -> tuple[str, ...]:
    """The backends a sweep runs when none are named: on the CPU
    cases.CPU_BACKENDS, on a GPU every registered backend but "reference"."""
    if torch.device(device).type == "cpu":
        return CPU_BACKENDS
    return tuple(n for n in backend_names() if n != "reference")


@contextlib.contextmanager
def _nvtx_range(message: str):
    try:
        import nvtx
    except ImportError:
        yield
        return
    with nvtx.annotate(message):
        yield


def run_sweep(config: SweepConfig, progress: ProgressFn | None = None) -> SweepResult:
    """Run every case of `config`; see the module docstring.

    progress(done, total, case, status) is called after each case.
    Raises TypeError for a bad config, ValueError for unknown backend names
    or an unusable device; failures inside cases never raise. A
    KeyboardInterrupt while measuring ends the sweep early: the measured
    cases are returned, the others skipped (INTERRUPTED), and the manifest
    says "interrupted": true.
    """
    if not isinstance(config, SweepConfig):
        raise TypeError(f"config must be a SweepConfig, got {type(config).__name__}")
    dev = resolve_device(config.device)
    reduced = reduced_of(config, dev)
    names = select_backends(config, dev)
    backends, reasons = load_backends(names, dev)
    check_tactics_once(config, names, backends, reduced=reduced)

    env = environment(dev)
    dinfo = env["device"]
    if dev.type == "cuda":
        copy_bytes, copy_repeats = 1 << 30, 20
    else:
        copy_bytes, copy_repeats = 64 << 20, 5
    copy_bw = copy_bandwidth_gbps(dev, copy_bytes, copy_repeats)

    cases = expand_all_tactics(expand_cases(config, names, reduced=reduced), backends)
    total = len(cases)
    rows_out: list[dict] = []
    groups_info: list[dict] = []
    base = {"device": dinfo["name"], "sm_count": dinfo["sm_count"], "commit": env["commit"], "seed": config.seed,
            "boundary": boundary_of(config), **placement(dev)}  # fmt: skip

    position = {case: i for i, case in enumerate(cases)}
    placed: list[int] = []  # each row's case position: rows come pair by pair, the frame keeps case order

    def emit(case: Case, row: dict) -> None:
        row["peer"] = is_peer(backends, case.backend)
        rows_out.append(row)
        placed.append(position[case])
        if progress is not None:
            progress(len(rows_out), total, case, row["status"])

    group_keys = list(dict.fromkeys((c.config, c.tp) for c in cases))
    # The sweep's GPU made current (a no-op when it already is, e.g. in a
    # `--devices` worker): kernels launched through the driver API land in its context.
    interrupted = False
    try:
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            for cfg, tp in group_keys:
                group = [c for c in cases if c.config == cfg and c.tp == tp]
                info = _run_group(config, cfg.shard(tp), group, backends, reasons, dev, dinfo, copy_bw, base, emit)
                groups_info.append({"preset": cfg.name, "tp": tp, **info})
                release(dev)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, as the CLI maps it): the measured cases are kept
        interrupted = True
        done = set(placed)
        unrun = [case for i, case in enumerate(cases) if i not in done]
        rows_out += unrun_rows("sweep", unrun, [], base, backends)
        placed += [position[case] for case in unrun]

    rows_out = [row for _, row in sorted(zip(placed, rows_out), key=lambda pr: pr[0])]
    frame = typed(rows_out, "sweep")
    methods = timing_methods(frame)
    manifest = {
        "schema": 1,
        "kind": "sweep",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reduced": reduced,
        "seed": config.seed,
        "warm_l2": config.warm_l2,
        "copy_bw_gbps": copy_bw,
        "copy_bw_bytes": copy_bytes,
        "size_ceiling": "triton" if (dev.type == "cuda" and triton_available()) else None,
        "oracle_tolerance": ORACLE_TOLERANCE,  # the mxfp8 / bf16 gate; per backend: Backend.tolerance
        "stage_timing": STAGE_TIMING if config.split else None,
        "boundary": boundary_of(config),
        "boundary_timing": BOUNDARY_TIMING[boundary_of(config)],
        "row_tolerance_factor": ROW_TOLERANCE_FACTOR,  # each row's error within this x the backend's tolerance
        # what the rows were timed with (config.use_graph is what was asked for: a CPU run
        # or a backend that cannot be captured times eagerly)
        "timing_methods": methods,
        "timing_counts": timing_counts_used(config, methods),
        "backends": reasons,
        "groups": groups_info,
        "config": jsonable(asdict(config)),
        **env,
    }
    if interrupted:
        manifest["interrupted"] = True
    return RunResult(frame, manifest)


def boundary_of(config) -> str:
    """The boundary `config` times its layer calls at: "back-to-back" with
    `back_to_back`, else "layer" (module docstring, step 3)."""
    return BACK_TO_BACK if getattr(config, "back_to_back", False) else LAYER_BOUNDARY


def validate_sweep(config: SweepConfig) -> None:
    """The checks `run_sweep` makes before measuring anything (device,
    backend names, tactic names), for a caller that wants them up front.
    Raises ValueError naming the option."""
    validate(config, resolve_device(config.device))


def layer_writes(x: torch.Tensor, layers: int) -> list[Callable[[], object]]:
    """The kernels before each of `layers` layer calls at a layer boundary:
    call l writes x (the static input every call reads) from a source buffer
    of its own holding x's values, as `torch.mul(source[l], 1, out=x)`: one
    plain elementwise kernel (exact: x times one; a same-dtype copy_ would be
    a memcpy, not a kernel, in a CUDA graph), never chained to the next
    launch by programmatic dependent launch; the inputs stay what the oracle
    saw."""
    sources = [x.clone() for _ in range(layers)]
    return [lambda s=s: torch.mul(s, 1, out=x) for s in sources]


#: The x writes are timed until their batches' medians agree within this (µs per call).
WRITE_SPREAD_US = 0.05
#: ... in this many batches, the replays doubled up to this cap.
WRITE_BATCHES, WRITE_MAX_REPLAYS = 5, 6400


def measure_writes(config, x: torch.Tensor, layers: int, graph: bool, dev) -> Steady:
    """The x writes of `layers` layer calls (`layer_writes`, no MoE) timed
    alone, once per (rows, group): on CUDA graphs in WRITE_BATCHES batches,
    the replays doubled until the batch medians agree within
    WRITE_SPREAD_US; elsewhere (eager) one timing with the case counts."""
    writes = layer_writes(x, layers)
    counts = timing_counts(config, layers, graph, dev)
    if graph and dev.type == "cuda":
        return time_steady(lambda: [w() for w in writes], spread_us=WRITE_SPREAD_US, batches=WRITE_BATCHES,
                           max_replays=max(WRITE_MAX_REPLAYS, counts["replays"]), **counts)  # fmt: skip
    timing = time_graph(lambda: [w() for w in writes], **counts)
    return Steady(timing, timing.p90_us - timing.p10_us, counts["replays"], 1, False)


def steady_record(steady: Steady) -> dict:
    """What the manifest keeps of a write measurement."""
    return {"us": steady.timing.median_us, "spread_us": steady.spread_us, "replays": steady.replays,
            "batches": steady.batches, "steady": steady.steady, "method": steady.timing.method}  # fmt: skip


def timing_counts_used(config, methods: list[str]) -> dict[str, dict[str, int]]:
    """{method: {"warmup": n, "replays": n}}: the counts the rows timed with
    each of `methods` really ran (config.warmup / config.replays for CUDA
    graphs; an eager timing, on the CPU, with --no-graph or for a backend
    that cannot be captured, caps them at EAGER_WARMUP_CAP /
    EAGER_REPLAYS_CAP, `timing_counts`)."""
    return {m: capped_counts(config, m == "cuda-graph") for m in methods}


def capped_counts(config, full: bool) -> dict[str, int]:
    """{"warmup", "replays"} of `config`, as given for CUDA-graph timing
    (`full`), else capped at EAGER_WARMUP_CAP / EAGER_REPLAYS_CAP."""
    return {
        "warmup": config.warmup if full else min(config.warmup, EAGER_WARMUP_CAP),
        "replays": config.replays if full else min(config.replays, EAGER_REPLAYS_CAP),
    }


def timing_methods(frame: pd.DataFrame) -> list[str]:
    """The distinct `timing_method` values of a run's rows (sorted; the rows
    that were not timed have none)."""
    if "timing_method" not in frame:
        return []
    return sorted({str(m) for m in frame["timing_method"].dropna() if str(m)})


def read_bytes_of(
    backend: Backend | None, shape: RankShape, topk_ids: torch.Tensor, fallback: int
) -> tuple[int, str | None]:
    """(`backend.read_bytes(shape, topk_ids)`, None), or (`fallback`, None)
    when it returns None or the backend did not load, or (`fallback`, why)
    when it raises or returns something other than a positive int."""
    if backend is None:
        return fallback, None
    try:
        value = backend.read_bytes(shape, topk_ids)
    except Exception as error:  # noqa: BLE001 - the count is extra: the case stays as it is
        return fallback, f"read_bytes failed: {error_text(error)}"
    if value is None:
        return fallback, None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return fallback, f"read_bytes returned {value!r}, expected a positive int (bytes used instead)"
    return value, None


@dataclass(frozen=True)
class _Group:
    """What every case of one (preset, tp) group shares: the run's config,
    the rank shape, the device (and its L2), the loaded backends, the run's
    common columns and copy bandwidth, and `emit` (the run's row sink)."""

    config: SweepConfig
    shape: RankShape
    dev: torch.device
    l2_bytes: int | None
    backends: dict
    base: dict
    copy_bw: float | None
    emit: Callable[[Case, dict], None]


@dataclass(frozen=True)
class CaseInputs:
    """The device inputs of one (rows, scenario) and the columns they fix."""

    ids: torch.Tensor
    topk_w: torch.Tensor
    x: torch.Tensor
    common: dict  # unique_experts, bytes, ceiling_gbps


def group_routings(config, shape: RankShape, group: list[Case]) -> dict[tuple[int, str], torch.Tensor]:
    """(rows, scenario) -> the CPU top-k ids of every case of the group, drawn once."""
    keys = dict.fromkeys((c.rows, c.scenario) for c in group)
    return {(r, s): scenario_topk_ids(s, r, shape.top_k, shape.experts, config.seed, config.trace) for r, s in keys}


def pair_skips(group: list[Case], backends, reasons, shape: RankShape, dev) -> dict[tuple[str, str], str]:
    """(backend, tactic) -> why that pair cannot run here (`skip_reason`), for the pairs that cannot."""
    pairs = dict.fromkeys((c.backend, c.tactic) for c in group)
    found = {pair: skip_reason(backends, reasons, *pair, shape, dev) for pair in pairs}
    return {pair: reason for pair, reason in found.items() if reason is not None}


def memory_budget(config, dev) -> int | None:
    """The bytes a group may hold: memory_fraction of the free device memory (None on the CPU)."""
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free * config.memory_fraction)


def with_read_bytes(row: dict, backend, shape: RankShape, ids: torch.Tensor) -> dict:
    """`row` with read_bytes (`read_bytes_of`; a problem noted on an ok row) and read_gbps."""
    if row.get("bytes") is not None and row.get("read_bytes") is None:
        row["read_bytes"], note = read_bytes_of(backend, shape, ids, row["bytes"])
        if note and row.get("status") == "ok":
            row["error"] = "; ".join(t for t in (row.get("error"), note) if t)
    if row.get("median_us") is not None and row.get("read_bytes"):
        row["read_gbps"] = row["read_bytes"] / (row["median_us"] * 1e-6) / 1e9
    return row


def with_bandwidth(row: dict, common: dict, copy_bw: float | None) -> dict:
    """`row` with gbps, pct_copy_bw, pct_size_ceiling and routed_pct_copy_bw over the case's logical bytes."""
    nbytes = common["bytes"]
    if row.get("median_us") is not None:
        gbps = nbytes / (row["median_us"] * 1e-6) / 1e9
        row["gbps"] = gbps
        row["pct_copy_bw"] = 100.0 * gbps / copy_bw if copy_bw else None
        ceiling = common["ceiling_gbps"]
        row["pct_size_ceiling"] = 100.0 * gbps / ceiling if ceiling else None
    if row.get("routed_us") and copy_bw:
        row["routed_pct_copy_bw"] = 100.0 * nbytes / (row["routed_us"] * 1e-6) / 1e9 / copy_bw
    return row


def _put(g: _Group, routings: dict, case: Case, **values) -> None:
    """Emit `case`'s row with `values` and its read bytes."""
    row = case_row("sweep", case, g.base, **values)
    g.emit(case, with_read_bytes(row, g.backends.get(case.backend), g.shape, routings[(case.rows, case.scenario)]))


def case_inputs(g: _Group, routings: dict) -> dict[tuple[int, str], CaseInputs]:
    """(rows, scenario) -> the case's device inputs, drawn once per group, and
    the columns they fix (the size-matched ceiling where it can be measured)."""
    inputs = {}
    for (rows, scenario), ids_cpu in routings.items():
        nbytes = unique_bytes(g.shape, ids_cpu)
        ceiling = None
        if g.dev.type == "cuda":
            with contextlib.suppress(Exception):  # the ceiling is optional
                ceiling = size_matched_ceiling_gbps(nbytes, g.dev)
        inputs[(rows, scenario)] = CaseInputs(
            ids_cpu.to(g.dev),
            scenario_weights(rows, g.shape.top_k, g.config.seed, scale=g.shape.routed_scaling_factor).to(g.dev),
            generate_activations(rows, g.shape.hidden, g.config.seed, g.dev),
            {"unique_experts": unique_experts(ids_cpu, g.shape.experts), "bytes": nbytes, "ceiling_gbps": ceiling},
        )
    return inputs


def generate_weights(g: _Group, layers: int) -> list:
    """The group's `layers` canonical weight sets (seeded per layer). Raises what generation raises."""
    return [generate_expert_weights(g.shape, g.config.seed + LAYER_SEED_STRIDE * i, g.dev) for i in range(layers)]


class WriteTimes:
    """The x writes' µs per call, measured once per (rows, timing method) of a
    group at its layer count (`measure_writes`), recorded in `record`
    (the manifest's groups[].x_writes). `_run_group` measures every rows of
    the group up front, before the first backend runs (measured lazily
    between backends' cases, TP4's writes at rows 3-8 did not settle: perf-notes
    session 24); an eager value a non-capturable backend needs is measured
    when first asked for."""

    def __init__(self, g: _Group, layers: int, record: dict) -> None:
        self.g, self.layers, self.record, self.done = g, layers, record, {}

    def __call__(self, rows: int, graph: bool) -> float:
        if (rows, graph) not in self.done:
            x = generate_activations(rows, self.g.shape.hidden, self.g.config.seed, self.g.dev)
            self.done[rows, graph] = steady = measure_writes(self.g.config, x, self.layers, graph, self.g.dev)
            self.record[f"{rows}{'' if graph else ' eager'}"] = steady_record(steady)
        return self.done[rows, graph].timing.median_us


def _run_pair(g: _Group, pair, cases, weights, n_layers, inputs, oracles, writes, routings) -> None:
    """Prepare (backend, tactic) `pair` once per weight set of its rotation,
    run its `cases`, emit their rows; the prepared copies are freed after."""
    name, tactic = pair
    backend = g.backends[name]
    try:
        prepared, failed = [backend.prepare(w, g.shape, tactic) for w in weights[:n_layers]], None
    except Exception as error:  # noqa: BLE001 - the pair's cases fail, the sweep goes on
        prepared, failed = [], f"prepare failed: {error_text(error)}"
        release(g.dev)
    for case in cases:
        inp = inputs[(case.rows, case.scenario)]
        l2_part = n_layers * (inp.common["bytes"] - 4 * case.rows * g.shape.hidden) / g.l2_bytes if g.l2_bytes else None
        common = {**inp.common, "layers": n_layers, "l2_multiple": l2_part}
        if failed is not None:
            _put(g, routings, case, status="failed", error=failed, **common)
            continue
        row = _run_case(g.config, case, backend, prepared, weights[:n_layers], inp.x, inp.ids, inp.topk_w,
                        oracles[(case.rows, case.scenario)], g.dev, writes)  # fmt: skip
        _put(g, routings, case, **common, **with_bandwidth(row, inp.common, g.copy_bw))
    del prepared
    release(g.dev)


def _run_group(config, shape, group, backends, reasons, dev, dinfo, copy_bw, base, emit) -> dict:
    """Measure one (preset, tp) group; returns what the manifest records of it.
    Routing first (CPU, cheap); the rotation is sized by the shape's fewest
    touched bytes (`LayerBudget`). The canonical weight sets are held for the
    whole group; each (backend, tactic) pair's prepared copies only while its
    cases run (one pair at a time, as in the step), so a pair's rotation does
    not depend on which other backends share the sweep."""
    g = _Group(config, shape, dev, dinfo["l2_bytes"], backends, base, copy_bw, emit)
    routings = group_routings(config, shape, group)
    min_touched = rotation_bytes(shape, routings.values())
    skip = pair_skips(group, backends, reasons, shape, dev)
    active = [pair for pair in dict.fromkeys((c.backend, c.tactic) for c in group) if pair not in skip]
    if not active:  # nothing runs here: no weights to generate
        for case in group:
            ids = routings[(case.rows, case.scenario)]
            _put(g, routings, case, status="skipped", error=skip[(case.backend, case.tactic)],
                 unique_experts=unique_experts(ids, shape.experts), bytes=unique_bytes(shape, ids))  # fmt: skip
        return {"layers": 0, "layers_capped": False, "min_touched_bytes": min_touched}
    budget = LayerBudget.plan(config, min_touched, g.l2_bytes, canonical_bytes(shape), memory_budget(config, dev))
    layers = budget.layers
    info = {"layers": layers, "layers_capped": budget.capped, "min_touched_bytes": min_touched,
            "layers_per_backend": {}, "x_writes": {}}  # fmt: skip
    error = budget.forced_error(config.memory_fraction)
    weights = []
    if error is None:
        try:
            weights = generate_weights(g, layers)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the whole group fails
            weights.clear()
            release(dev)
            error = f"weight generation failed ({layers} layers): {error_text(e)}"
    if error is not None:  # every case failed with it (skipped ones keep their reason)
        for case in group:
            reason = skip.get((case.backend, case.tactic))
            _put(g, routings, case, status="skipped" if reason else "failed", error=reason or error, layers=layers)
        return {**info, "error": error}
    inputs = case_inputs(g, routings)
    for case in group:  # the skipped pairs first: they hold no memory
        if (case.backend, case.tactic) in skip:
            _put(g, routings, case, status="skipped", error=skip[(case.backend, case.tactic)], layers=layers,
                 **inputs[(case.rows, case.scenario)].common)  # fmt: skip
    oracles: dict = {key: {} for key in routings}  # per (rows, scenario): {(oracle family, layer): fp64 output}
    writes = WriteTimes(g, layers, info["x_writes"])
    if not config.back_to_back:  # every rows' writes first, before any backend has run: one GPU state for all
        for rows in sorted({c.rows for c in group if (c.backend, c.tactic) in active}):
            writes(rows, config.use_graph and dev.type == "cuda")
    for pair in active:
        n_layers = budget.for_pair(backends[pair[0]].prepared_bytes(shape))
        info["layers_per_backend"][f"{pair[0]}:{pair[1]}"] = n_layers
        _run_pair(g, pair, [c for c in group if (c.backend, c.tactic) == pair], weights, n_layers, inputs, oracles,
                  writes, routings)  # fmt: skip
    del weights, inputs, oracles
    return info


def _graph_output(backend, prepared, x, ids, topk_w) -> torch.Tensor:
    """The output of one CUDA-graph replay of `backend.forward` (warmed up on a
    side stream, captured, its output poisoned with NaN, replayed), cloned."""
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        backend.forward(prepared, x, ids, topk_w)
    torch.cuda.current_stream(x.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(prepared, x, ids, topk_w)
    out.fill_(float("nan"))
    graph.replay()
    result = out.clone()
    torch.cuda.synchronize(x.device)
    del graph
    return result


class _OffOracle(Exception):
    """A gated output is off its oracle (the case fails with this message)."""


#: The oracle every backend's `err_bf16` is measured against: BF16 activations (x and H
#: unquantized), fp64 math (reference.reference_moe), so the column reads across backends.
BF16_ORACLE = "bf16"


def _oracle(oracles: dict, family: str, layer: int, weights, x, ids, topk_w) -> torch.Tensor:
    """The fp64 oracle output of `layer`'s weight set in `family` (cached per case inputs)."""
    key = (family, layer)
    if key not in oracles:
        oracles[key] = reference_moe(x, ids, topk_w, weights[layer], activation=family,
                                     dtype=torch.float64).output  # fmt: skip
    return oracles[key]


def _worst(row: dict, col: str, value: float) -> None:
    """row[col] = the larger of its value and `value` (NaN wins)."""
    old = row.get(col)
    row[col] = value if old is None or not value <= old else old


def _gate(row: dict, backend, out, oracles: dict, layer: int, inputs: tuple, what: str) -> None:
    """Gate `out` (layer `layer`'s output) against its fp64 oracle in the
    backend's family (`reference.oracle_gate` at the backend's tolerance),
    keeping the worst errors in `row`, and its error against the BF16 oracle
    in `err_bf16`; raises _OffOracle naming `what` was checked when it
    fails. inputs: (weights, x, ids, topk_w) of the case."""
    oracle = _oracle(oracles, backend.oracle, layer, *inputs)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(oracle.shape):
        raise ValueError(f"forward returned {getattr(out, 'shape', type(out).__name__)}, expected"
                         f" {tuple(oracle.shape)}")  # fmt: skip
    err, row_err, why = oracle_gate(out, oracle, backend.tolerance)
    _worst(row, "max_rel_err", err)
    _worst(row, "max_row_rel_err", row_err)
    _worst(row, "err_bf16", err if backend.oracle == BF16_ORACLE else
           relative_error(out, _oracle(oracles, BF16_ORACLE, layer, *inputs)))  # fmt: skip
    if why is not None:
        raise _OffOracle(f"{what}{why} vs the {backend.oracle} oracle")


def _run_case(config, case, backend, prepared, weights, x, ids, topk_w, oracles, dev, write_us) -> dict:
    """Gate then time one case (module docstring, steps 2-4); returns the
    case's own columns. `weights`: the canonical weight set of each layer of
    `prepared` (the oracles of layer 0 and of the last layer); write_us(rows,
    graph): the x writes' µs per call, measured once per group."""
    row: dict = {"oracle": backend.oracle}
    last = len(prepared) - 1
    graph = config.use_graph and backend.capturable
    try:
        row["kernel_tactics"] = backend.kernel_tactics(prepared[0], case.rows)
        inputs = (weights, x, ids, topk_w)
        with _nvtx_range(case.label()):
            _gate(row, backend, backend.forward(prepared[0], x, ids, topk_w), oracles, 0, inputs, "")
            if graph and dev.type == "cuda":  # what is timed is a replay: gate one first (poisoned)
                _gate(row, backend, _graph_output(backend, prepared[0], x, ids, topk_w), oracles, 0, inputs,
                      "CUDA-graph replay (the eager call passed): ")  # fmt: skip
            for layer in range(1, last):  # every layer of the rotation gated once (the last: the timed graph)
                _gate(row, backend, backend.forward(prepared[layer], x, ids, topk_w), oracles, layer, inputs,
                      f"layer {layer + 1} of {last + 1} (its own weights, eager; layer 1 passed): ")  # fmt: skip
            counts = timing_counts(config, len(prepared), graph, dev)
            writes = None if config.back_to_back else layer_writes(x, len(prepared))
            written = write_us(case.rows, graph and dev.type == "cuda") if writes else None
            outputs: list = [None]

            def call_all_layers() -> None:
                for i, p in enumerate(prepared):
                    if writes:
                        writes[i]()
                    outputs[0] = backend.forward(p, x, ids, topk_w)

            def timed_output(replay) -> torch.Tensor:
                """The last layer's output of one more replay of what was timed (poisoned first)."""
                if isinstance(outputs[0], torch.Tensor):
                    outputs[0].fill_(float("nan"))
                replay()
                return outputs[0].clone() if isinstance(outputs[0], torch.Tensor) else outputs[0]

            timing = time_graph(call_all_layers, **counts, check=timed_output)
            _gate(row, backend, timing.checked, oracles, last, inputs,
                  f"the timed {'graph' if timing.method == 'cuda-graph' else 'calls'}, layer {last + 1} of"
                  f" {last + 1} (its own weights; layer 1 passed): ")  # fmt: skip
            if written is not None:
                timing = less_us(timing, written)
    except _OffOracle as error:
        row.update(status="failed", error=str(error))
        return row
    except Exception as error:  # noqa: BLE001 - a backend failure fails its case only
        if dev.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
        row.update(status="failed", error=error_text(error))
        return row
    row.update(
        status="ok", median_us=timing.median_us, p10_us=timing.p10_us, p90_us=timing.p90_us,
        timing_method=timing.method, x_write_us=written,
    )  # fmt: skip
    notes = []
    parts = (("per-stage timing", _time_stages), ("routed-path timing", _time_routed)) if config.split else ()
    for what, part in parts:
        try:
            row.update(part(config, backend, prepared, x, ids, topk_w, graph, dev, writes, written))
        except Exception as error:  # noqa: BLE001 - the split is extra: the case stays ok, the note says why
            if dev.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(dev)
            notes.append(f"{what} failed: {error_text(error)}")
    if notes:
        row["error"] = "; ".join(notes)
    return row


def timing_counts(config, calls: int, graph: bool, dev) -> dict:
    """`time_graph` keyword arguments of a case: `calls` calls per replay,
    the config's warmup / replays, capped for slow eager paths (the
    reference, anything on the CPU: EAGER_WARMUP_CAP / EAGER_REPLAYS_CAP)."""
    return dict(
        **capped_counts(config, graph and dev.type == "cuda"), calls_per_replay=calls, use_graph=graph, device=dev
    )


def _time_at_boundary(calls: list[Callable[[], object]], writes, written: float | None, counts: dict) -> float:
    """Median µs per call of `calls` (one per layer) timed as the case was:
    each after its layer's write, the writes' µs per call subtracted (`writes`
    and `written`), or back to back (`writes` None)."""
    if writes is None:
        return time_graph(lambda: [call() for call in calls], **counts).median_us

    def run() -> None:
        for write, call in zip(writes, calls):
            write()
            call()

    return less_us(time_graph(run, **counts), written).median_us


def _time_stages(config, backend, prepared, x, ids, topk_w, graph: bool, dev, writes=None, written=None) -> dict:
    """kernel_<stage>_us of a backend that splits its forward (module
    docstring, step 4), with the case's timing counts and boundary; {}
    otherwise. Raises ValueError when the stages are not distinct
    SWEEP_STAGES names, the same for every layer."""
    per_layer = [list(backend.stage_calls(p, x, ids, topk_w)) for p in prepared]
    if not per_layer[0]:
        return {}
    names = [name for name, _ in per_layer[0]]
    if len(set(names)) != len(names) or any(n not in SWEEP_STAGES for n in names):
        raise ValueError(f"{backend.name}.stage_calls named {names}; expected distinct names from {SWEEP_STAGES}")
    for layer, calls in enumerate(per_layer[1:], 1):
        if [name for name, _ in calls] != names:
            raise ValueError(
                f"{backend.name}.stage_calls gave layer {layer} the stages"
                f" {[name for name, _ in calls]}, layer 0 {names}; expected the same for every layer"
            )
    counts = timing_counts(config, len(prepared), graph, dev)
    return {
        f"kernel_{name}_us": _time_at_boundary([calls[i][1] for calls in per_layer], writes, written, counts)
        for i, name in enumerate(names)
    }


def _time_routed(config, backend, prepared, x, ids, topk_w, graph: bool, dev, writes=None, written=None) -> dict:
    """routed_us (module docstring, step 4) at the case's boundary; {} for a backend without it."""
    routed = [backend.routed_call(p, x, ids, topk_w) for p in prepared]
    if routed[0] is None:
        return {}
    counts = timing_counts(config, len(prepared), graph, dev)
    return {"routed_us": _time_at_boundary(routed, writes, written, counts)}
