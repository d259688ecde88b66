"""The options of the moebench verbs declared apart from the verbs: those of
several verbs (declared once) and the long ones of `tune` and `report`.
Typer reads each from the annotation; the default stays in the verb's
signature. Torch-free: `moebench --help` reads it at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moebench.bench import EAGER_REPLAYS_CAP, EAGER_WARMUP_CAP, MAX_LAYERS
from moebench.cli_support import parse_path
from moebench.models import KERNEL_EXPERTS_NOTE

# Options of several verbs, declared once (typer reads them from the annotation; the default stays in the
# signature). Sizes: sweep, step and tune; the run's grid: sweep and step.
PresetOpt = Annotated[str, typer.Option(help="Preset name(s), comma-separated, or 'all' (see `moebench presets`).")]
HiddenOpt = Annotated[int, typer.Option(help="Override hidden size H.")]
IntermediateOpt = Annotated[int, typer.Option(help="Override moe intermediate size I (before TP).")]
ExpertsOpt = Annotated[int, typer.Option(help=f"Override routed experts E ({KERNEL_EXPERTS_NOTE}).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Override top_k (at most 8).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of weights, routing and activations (0 to 2**32 - 1).")]
RowsOpt = Annotated[str, typer.Option(help="Token rows: '1-8', '1,2,4' or '6' (1..8); default 1-8 (1,4,8 on the CPU).")]
ScenarioOpt = Annotated[
    str,
    typer.Option(
        help="Routing scenarios, comma-separated, of: uniform, zipf, hot, correlated, replay (replay reads --trace)."
    ),
]
TacticsOpt = Annotated[
    str,
    typer.Option(
        help=(
            "Tactics per backend: 'default', 'all' (every tactic each backend offers) or a list (moebench: default ="
            " the kernel family the tuning tables time faster (FP8 where no table and its built-ins fit), its tuned"
            " tactics else built-in; builtin = what runs without any table; tuned = default, skipped without a table;"
            " fp8 / bf16 = that kernel family (FP8: wgmma, BF16: mma.sync), skipped where it cannot run;"
            " fused = fp8 with GEMM1 and GEMM2 in one launch where its built-in fused tactic fits;"
            " tables=DIR = default with the tuning tables of the directory DIR alone (relative to the current"
            " directory, no commas), e.g. 'tables=new,tables=old' to time a re-tuned table beside the one it"
            " replaces; nopdl=TACTIC = TACTIC with the route (the layer's first launch) launched without PDL,"
            " as the peers' first kernels are, e.g. 'default,nopdl=default'; torch-bf16: grouped, gather;"
            " marlin-w4a16, triton-mxfp4, humming-*: ep = vLLM's expert-map path, never the default)."
        )
    ),
]
GraphOpt = Annotated[bool, typer.Option("--graph/--no-graph", help="CUDA-graph replay for capturable backends.")]
WarmL2Opt = Annotated[bool, typer.Option("--warm-l2", help="Time one weight set over and over (warm L2).")]
LayersOpt = Annotated[
    int, typer.Option(help=f"Force the number of rotated weight sets, 1 to {MAX_LAYERS} (default: >= 4x L2).")
]
TraceOpt = Annotated[
    Path,
    typer.Option(
        parser=parse_path,
        help="Top-k trace (.npz with topk_ids) for the replay scenario; only with replay in --scenario.",
    ),
]
LabelOpt = Annotated[
    str,
    typer.Option(
        help="Run label: the run goes to OUT/<UTC date>-<label> (1-100 ASCII"
        " letters, digits, '.', '_', '-', starting with a letter or digit). Under the checkout's reports/runs/,"
        " git ignores a run of the default label; label a run you mean to commit."
    ),
]
RunsOutOpt = Annotated[Path, typer.Option(parser=parse_path, help="Root directory of stored runs.")]
DeviceOpt = Annotated[str, typer.Option(help="'cpu' or 'cuda[:N]' (default: the GPU if any).")]


# `tune`'s options of more than a line.
SpaceOpt = Annotated[
    str,
    typer.Option(
        help="Tactic space: 'quick' (default), 'full', or 'ship' (the defaults and their neighbours,"
        " <= 10 per stage: what the shipped tables are tuned over)."
    ),
]
TopOpt = Annotated[
    int, typer.Option(help="Finalists re-timed per row count, at least 2 (the default is always re-timed too).")
]
ActBf16Opt = Annotated[
    bool,
    typer.Option(
        "--act-bf16/--e4m3",
        help="Time the BF16-activation (_a16) twins, what the runtime runs by default; --e4m3 times the"
        " MXFP8-operand tactics. Ignored with --fp8.",
    ),
]
Fp8Opt = Annotated[
    bool,
    typer.Option(
        "--fp8",
        help="Tune the FP8 (wgmma, _f8) kernel family instead of the BF16 one: e4m3-layout weights, the MXFP8"
        " x / H as they are, candidates from the fp8 defaults, the measured warp-specialized variants and"
        " their neighbours (--space sets how many: ship 10, quick 16, full 48 per stage, GEMM1 twice that"
        " with its spec twins and a few 2-CTA cluster twins, cluster_k 2; every GEMM1 two-plane, _p2, like the"
        " built-in default, where one fits the shape); the entries go"
        " to the table's 'fp8' part (what FP8 layers run), the BF16 entries stay. By default each layer runs"
        " the family whose entries are faster.",
    ),
]
DistinctLayersOpt = Annotated[
    bool, typer.Option("--distinct-layers", help="Generate every rotated weight set (default: copies of the first).")
]
BudgetOpt = Annotated[
    float,
    typer.Option(
        help="Wall-time budget in seconds: no new step starts that would end past it; the tables keep"
        " what was done (exit 1 lists what was left out)."
    ),
]
JobsOpt = Annotated[
    int,
    typer.Option(
        help="Worker processes compiling the kernels ahead of the timing (default: cores - 1; 0: compile"
        " in this process)."
    ),
]
SummaryOpt = Annotated[
    Path,
    typer.Option(
        parser=parse_path,
        help="Also write the tuned-vs-default gains here (markdown, e.g. tune-gains.md; a .json beside it);"
        " existing ones are replaced only with --force.",
    ),
]
TablesOutOpt = Annotated[
    Path,
    typer.Option(
        parser=parse_path,
        help="Directory of the tables (default: $MOEBENCH_TUNING_DIR, else ./tuning-tables;"
        " moebench/kernels/tables ships them with the package).",
    ),
]

# `report`'s.
RunDirArg = Annotated[
    Path, typer.Argument(parser=parse_path, help="A run directory (results.parquet + manifest.json).")
]
BaselineOpt = Annotated[
    Path, typer.Option(parser=parse_path, help="A baseline run directory to compare with (per-case verdicts).")
]
FailAboveOpt = Annotated[
    str,
    typer.Option(
        "--fail-above",
        help="Exit 1 when a case is slower than the baseline by more than this percentage"
        " ('5%' or '5'; a bare number is percent, so 0.05 means 0.05 %), failed, or lost (ok in the baseline,"
        " skipped or absent now). A case is 'slower' when its change is beyond the runs' noise; a regression"
        " only when it is also beyond this threshold. Without it the verdicts are judged at 5 % and only shown.",
    ),
]
ReportOutOpt = Annotated[
    Path,
    typer.Option(
        parser=parse_path,
        help="Where summary.md (and report.html + plots) go (default: beside the run,"
        " in RUN_DIR's sibling <run>-report/, so a committed run directory stays as committed); never a run"
        " directory or a folder inside one, RUN_DIR's included.",
    ),
]
ReportForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace an earlier report: its files (summary.md, report.html, the plots) are"
        " overwritten, and those an earlier report recorded writing there (.moebench-report.json) that this"
        " one does not write are removed; other files, same-named ones included, are left alone.",
    ),
]

# The longer options of sweep and step.
SweepTpOpt = Annotated[
    str, typer.Option(help="Tensor-parallel degrees (one rank's shape each); default 1,2,4,8 (1,8 on the CPU).")
]
SweepBackendsOpt = Annotated[
    str, typer.Option(help="'default' (GPU: all but reference; CPU: reference,torch-bf16), 'all', or a list.")
]
SweepReplaysOpt = Annotated[
    int,
    typer.Option(
        help="Timed replays per case under CUDA graphs; eager timing (the CPU, --no-graph, an uncapturable backend) takes at most "
        f"{EAGER_REPLAYS_CAP} (the manifest's timing_counts says what ran)."
    ),
]
SweepWarmupOpt = Annotated[
    int, typer.Option(help=f"Warm-up calls per case (eager timing: at most {EAGER_WARMUP_CAP}).")
]
SweepSplitOpt = Annotated[
    bool,
    typer.Option(
        "--split/--no-split",
        help="Also time each stage alone and the routed path (route + GEMM1 + GEMM2)"
        " of backends that split their forward (moebench); --no-split: the layer call only, about a third of the"
        " timing work.",
    ),
]
SweepBackToBackOpt = Annotated[
    bool,
    typer.Option(
        "--back-to-back",
        help="Time the layer calls of a replay back to back (call i+1 may start under call"
        " i) instead of at a layer boundary (default: a plain kernel writes each call's x just before it, its own"
        " time, x_write_us, is subtracted). Stored in the run; `report --baseline` does not compare the two.",
    ),
]
SweepStrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Exit 1 when a peer's case failed too (a backend that is not ours, e.g. one off its"
        " oracle); without it only our cases' failures fail the command, the peers' are stored and listed.",
    ),
]
SweepDevicesOpt = Annotated[
    str,
    typer.Option(
        help="Split the cases over GPUs: 'all' or a list like '0,1' (one worker process per GPU,"
        " each case on one GPU, one merged run). Default: one process on --device."
    ),
]
SweepWorkerTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--worker-timeout",
        help="With --devices: stop workers still running after this many seconds"
        " (their unfinished cases are stored as failed).",
    ),
]
StepTpOpt = Annotated[
    int,
    typer.Option(
        help="Tensor-parallel degree N: N ranks, one process per GPU (gloo processes on the CPU), each"
        " holding all experts at I/N, with the all-reduce of the layer output."
    ),
]
StepOneRankOpt = Annotated[
    bool,
    typer.Option(
        "--one-rank",
        help="Time one rank's I/tp shard on one device, without the all-reduce (the shape `sweep --tp` times).",
    ),
]
StepBackendsOpt = Annotated[
    str,
    typer.Option(
        help="'default' (GPU: moebench, torch-bf16, flashinfer-w4a16/-w4a8; CPU: reference,"
        " torch-bf16), 'all', or a list."
    ),
]
StepWarmL2Opt = Annotated[bool, typer.Option("--warm-l2", help="Time one layer's weights over and over (warm L2).")]
StepLayersOpt = Annotated[
    int, typer.Option(help=f"Force the number of rotated layers, 1 to {MAX_LAYERS} (default: >= 4x L2).")
]
StepReplaysOpt = Annotated[
    int,
    typer.Option(
        help="Timed replays per quantity under CUDA graphs; eager timing (the CPU, --no-graph) takes at most "
        f"{EAGER_REPLAYS_CAP} (the manifest's timing_counts says what ran)."
    ),
]
StepWarmupOpt = Annotated[
    int, typer.Option(help=f"Warm-up calls per quantity (eager timing: at most {EAGER_WARMUP_CAP}).")
]
StepSplitOpt = Annotated[
    bool,
    typer.Option(
        "--split/--no-split",
        help="Also time each stage alone (kernel_<stage>_us, stage_sum_us: moebench's"
        " front, shared, GEMM1, GEMM2, finalize; torch-bf16's router, shared, experts, shared_add)."
        " --no-split times only the whole step (with and without the gate) and the gate alone: less timing work,"
        " for when only the step's latency matters.",
    ),
]
StepOverlapSharedOpt = Annotated[
    bool,
    typer.Option(
        "--overlap-shared/--serial-shared",
        help="Run the shared expert on a side CUDA stream beside the gate"
        " and the routed experts (every backend; as serving stacks do), or in order with them.",
    ),
]
StepStrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Exit 1 when a peer's case failed too (a backend that is not ours); without it only"
        " our cases' failures fail the command, the peers' are stored and listed.",
    ),
]
StepDeviceOpt = Annotated[
    str,
    typer.Option(
        help="'cpu' or 'cuda[:N]' (default: the GPU if any; with --tp N > 1 only"
        " the kind counts, --devices picks the GPUs)."
    ),
]
StepDevicesOpt = Annotated[
    str, typer.Option(help="With --tp N > 1: the N GPUs of the ranks, e.g. '0,1' or 'all' (default: the first N).")
]
StepTimeoutOpt = Annotated[float, typer.Option(help="With --tp N > 1: stop the ranks after this many seconds.")]
