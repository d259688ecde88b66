"""The moebench command line: a thin Typer layer over the library.

    moebench sweep    measure backends over presets / TP / rows / scenarios
    moebench tune     tune the GEMM tactics per rows on this GPU, write tuning tables
    moebench report   summarize a stored run (table, summary.md, report.html);
                      --baseline RUN compares, --fail-above 5% gates CI
    moebench check    quick self-check (codecs, record, oracle, backends)
    moebench env      device, driver, versions, available backends
    moebench presets  geometry presets and their per-TP shapes
    moebench step     time a whole decode-step MoE layer (gate, router, shared expert,
                      routed experts, finalize; --tp N: N ranks with the all-reduce)

User errors print one red line and exit 2; failed checks, regressions
beyond --fail-above and unwritable outputs exit 1, as does a sweep or step
in which a case of ours failed (a peer's failed case, a backend whose
`Backend.peer` is true, only with --strict). A sweep or step
interrupted by Ctrl-C or SIGTERM stores the cases it measured (the rest
skipped, the manifest marked "interrupted") and exits 130 / 143.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moebench.bench import EAGER_REPLAYS_CAP, EAGER_WARMUP_CAP, MAX_LAYERS  # torch-free: the help texts quote them
from moebench.bench.interrupt import sigterm_as_interrupt  # torch-free too
from moebench.bench.plan import option_message, parse_names, step_plan, sweep_plan  # noqa: F401 - torch-free too
from moebench.models import KERNEL_EXPERTS_NOTE  # torch-free too
from moebench.reports import outdir, rich_tables  # torch- and pandas-free too
from moebench.reports.outdir import REPORT_RECORD, default_report_dir  # noqa: F401 - the CLI's names for them
from moebench.reports.rich_tables import escape_markup
from moebench.reports.rich_tables import fmt as _fmt  # noqa: F401 - the CLI's name for it


def _flags_as_flags(params: list) -> list:
    """`params` with an empty metavar on every plain flag (a bool option
    that takes no value, --help included) that has none, so that the help
    shows `--warm-l2`, not `--warm-l2 <bool>` (typer's rich help prints a
    flag's type as if it took a value, which `--warm-l2 true` is refused)."""
    for param in params:
        if getattr(param, "is_flag", False) and not getattr(param, "count", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    """A command whose help shows plain flags as flags (_flags_as_flags)."""

    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    """The app's group, its help showing plain flags as flags (_flags_as_flags)."""

    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


app = typer.Typer(
    name="moebench",
    cls=_Group,
    help="Microbenchmarks and tuning for low-batch MXFP4 routed-expert MoE decode on Hopper.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _Console(Console):
    """A rich Console that outlives its reader: when the pipe it prints to
    closes (`moebench sweep | head`), printing stops (the stream goes to
    /dev/null) and the command goes on, so a run is still stored and the exit
    code is the work's, not rich's default SystemExit(1) in mid-run."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stream = sys.stderr if self.stderr else sys.stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _wide_console(width: int) -> Console:
    """A console for a wide table: at least `width` columns when stdout is not
    a terminal (logs, CI keep every column on one line), the terminal's own
    width when it is one (COLUMNS is honored; rich folds what does not fit)."""
    return _Console(highlight=False, width=console.width if console.is_terminal else max(console.width, width))


console = _Console(highlight=False)
err_console = _Console(stderr=True, highlight=False)

USAGE_ERROR = 2


def _fail(message: str, code: int = USAGE_ERROR) -> typer.Exit:
    from rich.markup import escape

    # Escaped: messages quote shapes like [steps, rows, top_k] that rich would eat.
    err_console.print(f"[red]error: {escape(message)}[/red]", soft_wrap=True)
    return typer.Exit(code)


def _version() -> str:
    """The installed package's version, else moebench.__version__ (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moebench")
    except PackageNotFoundError:
        import moebench

        return getattr(moebench, "__version__", "unknown")


def _print_version(value: bool) -> None:
    if value:
        console.print(f"moebench {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the moebench version and exit."
    ),
) -> None:
    """Microbenchmarks and tuning for low-batch MXFP4 routed-expert MoE decode on Hopper."""
    for stream in (sys.stdout, sys.stderr):  # an ASCII terminal: 'µs' and the box lines print as '?'
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            "µ─".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(errors="replace")


def _path(text) -> Path:
    """A path option's value (typer `parser`): an empty one is refused, since
    Path("") is the current directory and the user meant something else;
    click then names the option (exit 2)."""
    if isinstance(text, Path):  # a default
        return text
    if not str(text).strip():
        raise typer.BadParameter("the path is empty; give a path ('.' for the current directory)")
    return Path(text)


def _check_out(out, option: str = "--out", *, runs: bool = False) -> None:
    """outdir.check_out(...), a refusal as a usage error. Call it after the
    other checks, so that a refused command creates nothing."""
    try:
        outdir.check_out(out, option, runs=runs)
    except ValueError as error:
        raise _fail(str(error)) from None


# Options of several verbs, declared once (typer reads them from the annotation; the default stays in the
# signature). Sizes: sweep, step and tune; the run's grid: sweep and step.
PresetOpt = Annotated[str, typer.Option(help="Preset name(s), comma-separated, or 'all' (see `moebench presets`).")]
HiddenOpt = Annotated[int, typer.Option(help="Override hidden size H.")]
IntermediateOpt = Annotated[int, typer.Option(help="Override moe intermediate size I (before TP).")]
ExpertsOpt = Annotated[int, typer.Option(help=f"Override routed experts E ({KERNEL_EXPERTS_NOTE}).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Override top_k (at most 8).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of weights, routing and activations (0 to 2**32 - 1).")]
RowsOpt = Annotated[str, typer.Option(help="Token rows: '1-8', '1,2,4' or '6' (1..8); default 1-8 (1,4,8 on the CPU).")]
ScenarioOpt = Annotated[str, typer.Option(
    help="Routing scenarios, comma-separated, of: uniform, zipf, hot, correlated, replay (replay reads --trace).")]
TacticsOpt = Annotated[str, typer.Option(help=(
    "Tactics per backend: 'default', 'all' (every tactic each backend offers) or a list (moebench: default ="
    " the kernel family the tuning tables time faster (FP8 where no table and its built-ins fit), its tuned"
    " tactics else built-in; builtin = what runs without any table; tuned = default, skipped without a table;"
    " fp8 / bf16 = that kernel family (FP8: wgmma, BF16: mma.sync), skipped where it cannot run;"
    " torch-bf16: grouped, gather)."
))]
GraphOpt = Annotated[bool, typer.Option("--graph/--no-graph", help="CUDA-graph replay for capturable backends.")]
WarmL2Opt = Annotated[bool, typer.Option("--warm-l2", help="Time one weight set over and over (warm L2).")]
LayersOpt = Annotated[int, typer.Option(
    help=f"Force the number of rotated weight sets, 1 to {MAX_LAYERS} (default: >= 4x L2).")]
TraceOpt = Annotated[Path, typer.Option(
    parser=_path, help="Top-k trace (.npz with topk_ids) for the replay scenario; only with replay in --scenario.")]
LabelOpt = Annotated[str, typer.Option(help="Run label: the run goes to OUT/<UTC date>-<label> (1-100 ASCII"
                                       " letters, digits, '.', '_', '-', starting with a letter or digit).")]
RunsOutOpt = Annotated[Path, typer.Option(parser=_path, help="Root directory of stored runs.")]
DeviceOpt = Annotated[str, typer.Option(help="'cpu' or 'cuda[:N]' (default: the GPU if any).")]


@app.command(cls=_Command)
def sweep(
    preset: PresetOpt = "dsv41-flash",
    hidden: HiddenOpt = None,
    intermediate: IntermediateOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    rows: RowsOpt = None,
    tp: str = typer.Option(
        None, help="Tensor-parallel degrees (one rank's shape each); default 1,2,4,8 (1,8 on the CPU)."
    ),
    backends: str = typer.Option(
        "default", help="'default' (GPU: all but reference; CPU: reference,torch-bf16), 'all', or a list."
    ),
    scenario: ScenarioOpt = "correlated",
    tactics: TacticsOpt = "default",
    seed: SeedOpt = 0,
    warm_l2: WarmL2Opt = False,
    layers: LayersOpt = None,
    replays: int = typer.Option(100, help="Timed replays per case under CUDA graphs; eager timing (the CPU, --no-graph, an uncapturable backend) takes at most "
        f"{EAGER_REPLAYS_CAP} (the manifest's timing_counts says what ran)."),
    warmup: int = typer.Option(10, help=f"Warm-up calls per case (eager timing: at most {EAGER_WARMUP_CAP})."),
    graph: GraphOpt = True,
    split: bool = typer.Option(
        True, "--split/--no-split", help="Also time each stage alone and the routed path (route + GEMM1 + GEMM2)"
        " of backends that split their forward (moebench); --no-split: the layer call only, about a third of the"
        " timing work."
    ),
    back_to_back: bool = typer.Option(
        False, "--back-to-back", help="Time the layer calls of a replay back to back (call i+1 may start under call"
        " i) instead of at a layer boundary (default: a plain kernel writes each call's x just before it, its own"
        " time, x_write_us, is subtracted). Stored in the run; `report --baseline` does not compare the two."
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Exit 1 when a peer's case failed too (a backend that is not ours, e.g. one off its"
        " oracle); without it only our cases' failures fail the command, the peers' are stored and listed."
    ),
    device: DeviceOpt = None,
    devices: str = typer.Option(
        None, help="Split the cases over GPUs: 'all' or a list like '0,1' (one worker process per GPU,"
        " each case on one GPU, one merged run). Default: one process on --device."
    ),
    worker_timeout: float = typer.Option(
        None, "--worker-timeout", help="With --devices: stop workers still running after this many seconds"
        " (their unfinished cases are stored as failed)."
    ),
    trace: TraceOpt = None,
    label: LabelOpt = "sweep",
    out: RunsOutOpt = Path("reports/runs"),
) -> None:
    """Measure backends over presets x TP x rows x scenarios.

    Every case is gated on the fp64 oracle (the whole output and each row),
    then timed at a layer boundary (each layer call's x written just before
    it, the writes' own time subtracted; --back-to-back: calls back to back),
    and the timed graph's last layer is checked again; the run is stored under
    OUT/<UTC date>-<label>. For backends that split their forward (moebench)
    each stage and the routed path (route + GEMM1 + GEMM2) are timed too:
    about three times the timing work of such a case (--no-split skips it)."""
    from moebench.reports.summary import summary_table

    try:
        plan = sweep_plan(
            preset=preset, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, rows=rows, tp=tp,
            backends=backends, scenario=scenario, tactics=tactics, seed=seed, warm_l2=warm_l2, layers=layers,
            replays=replays, warmup=warmup, graph=graph, split=split, back_to_back=back_to_back, device=device,
            devices=devices, worker_timeout=worker_timeout, trace=trace, label=label, out=out,
        )  # fmt: skip
    except (ValueError, TypeError) as error:
        raise _fail(option_message(error)) from None
    _check_out(out, runs=True)  # last of the checks, before any case runs
    if plan.gpus is not None:
        console.print(f"sweep over GPUs {', '.join(map(str, plan.gpus))}: one worker process each")
    elif plan.note:
        console.print(f"[yellow]{escape_markup(plan.note)}[/yellow]")
    stored, signals = _measure("sweep", plan, out, label, worker_timeout)
    if stored.path is None:
        return
    frame, manifest = stored.result.frame, stored.result.manifest
    _print_summary(summary_table(frame))
    counts = frame["status"].value_counts().to_dict()
    bw = manifest.get("copy_bw_gbps")
    console.print(
        f"{counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped"
        + (f"; copy bandwidth {bw:.1f} GB/s" if isinstance(bw, (int, float)) else "")
        + ("" if manifest.get("sharded") else "; layer calls timed " + (
            "back to back (--back-to-back)" if plan.config.back_to_back else
            "at a layer boundary (x writes subtracted)"))
    )  # fmt: skip
    _finish(frame, manifest, stored.path, signals, strict)


def _measure(kind: str, plan, out: Path, label: str, timeout_s):
    """bench.run.measure under a progress bar, SIGTERM taken as Ctrl-C;
    (Stored, the signals received). Errors become one red line."""
    from moebench.bench.run import measure

    signals: list[int] = []
    command = shlex.join(["moebench", *sys.argv[1:]])
    try:
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task(kind, total=None)

            def progress(done: int, total: int, what: str, status: str) -> None:
                bar.update(task, completed=min(done, total), total=total,
                           description=f"{what}: {status}" if what else kind)  # fmt: skip

            with sigterm_as_interrupt() as signals:
                stored = measure(kind, plan, out=out, label=label, command=command, timeout_s=timeout_s,
                                 progress=progress)  # fmt: skip
    except (ValueError, TypeError) as error:
        raise _fail(option_message(error)) from None
    except OSError as error:
        raise _fail(f"cannot write the run under {out}: {error}", 1) from None
    except KeyboardInterrupt:  # before the first case was measured (a run keeps what it measured)
        raise _fail("interrupted before any case was measured; nothing stored",
                    128 + (signals[-1] if signals else signal.SIGINT)) from None
    if stored.path is None:
        console.print(f"rank {stored.rank} of {stored.world}: measured its share; rank 0 stores the run")
    return stored, signals


def _finish(frame, manifest: dict, path, signals: list[int], strict: bool) -> None:
    """After a run is stored at `path`: each launched worker's line, the
    path, then the exit: 128 + signal when interrupted, 1 when a worker
    died or a case failed (`_fail_unless_every_case_passed`)."""
    workers = manifest.get("workers") or []
    for w in workers if manifest.get("sharded") else ():
        gpu = f"GPU {w['gpu_index']} ({w.get('gpu_serial') or 'serial unknown'})" if w.get("gpu_index") is not None \
            else f"rank {w['rank']} ({w.get('host') or 'host unknown'})"  # fmt: skip
        console.print(f"  {gpu}: {w['rows']} rows" + (f" [red]{escape_markup(w['error'])}[/red]" if w.get("error")
                                                      else "")  # fmt: skip
                      + ("; [yellow]interrupted[/yellow]" if w.get("status") == "interrupted" else ""))
    console.print(f"run stored in [bold]{path}[/bold]")
    _fail_if_interrupted(frame, manifest, path, signals)
    dead = [w for w in workers if w.get("error")]
    if dead:
        raise _fail("; ".join(w["error"] for w in dead) + f" ({len(dead)} worker(s) died; their unfinished cases"
                    f" are stored as failed in {path})", 1)  # fmt: skip
    _fail_unless_every_case_passed(frame, path, strict)


def _fail_if_interrupted(frame, manifest: dict, path, signals: list[int]) -> None:
    """After an interrupted run was stored at `path`: exit 128 + the signal
    (130 for Ctrl-C, 143 for SIGTERM), saying how many cases were measured."""
    from moebench.reports.gate import interrupted_exit

    stop = interrupted_exit(frame, manifest, path, signals)
    if stop is not None:
        raise _fail(*stop)


def _fail_unless_every_case_passed(frame, path, strict: bool = False) -> None:
    """After a run is stored at `path`: list the peers' failed cases, then
    exit 1 when reports.gate.judge_run says the run fails (no case ran, a
    case of ours failed, a peer's with `strict`); return otherwise."""
    from moebench.reports.gate import FAILED, judge_run

    verdict = judge_run(frame, path, strict)
    if verdict.peers:
        console.print(f"[yellow]{verdict.peers} peer case(s) failed (stored as failed in {escape_markup(path)}; not"
                      f" ours: {'--strict fails the command on them' if strict else 'pass --strict to fail on them'}"
                      "):[/yellow]")  # fmt: skip
        for line in verdict.peer_lines:
            console.print(f"  {escape_markup(line)}", soft_wrap=True)
    if verdict.failure is not None:
        raise _fail(verdict.failure, FAILED)


def _print_summary(table_df) -> None:
    """Render summary_table(df) with rich; columns that hold one value for
    every row (preset, tp, scenario, tactic) move into the title; skipped
    rows are said below it, one line per backend and reason."""
    skipped = table_df[table_df["status"] == "skipped"]
    table_df = table_df[table_df["status"] != "skipped"]
    if len(table_df):
        table, note = rich_tables.summary_table(table_df)
        out = _wide_console(150)  # wide enough for the table even when stdout is not a terminal (logs, CI)
        out.print(table)
        if note:
            out.print(note)
    for (backend, reason), group in skipped.groupby(["backend", "note"], sort=False, dropna=False):
        n = len(group)
        console.print(f"[yellow]skipped[/yellow] {escape_markup(backend)} ({n} case{'s' if n != 1 else ''}):"
                      f" {escape_markup(reason)}", soft_wrap=True)  # fmt: skip


@app.command(cls=_Command)
def step(
    preset: PresetOpt = "dsv41-flash",
    hidden: HiddenOpt = None,
    intermediate: IntermediateOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    tp: int = typer.Option(
        1, help="Tensor-parallel degree N: N ranks, one process per GPU (gloo processes on the CPU), each"
        " holding all experts at I/N, with the all-reduce of the layer output."
    ),
    one_rank: bool = typer.Option(
        False, "--one-rank", help="Time one rank's I/tp shard on one device, without the all-reduce"
        " (the shape `sweep --tp` times)."
    ),
    rows: RowsOpt = None,
    scenario: ScenarioOpt = "correlated",
    backends: str = typer.Option(
        "default", help="'default' (GPU: moebench, torch-bf16, flashinfer-w4a16/-w4a8; CPU: reference,"
        " torch-bf16), 'all', or a list."
    ),
    tactics: TacticsOpt = "default",
    seed: SeedOpt = 0,
    warm_l2: bool = typer.Option(False, "--warm-l2", help="Time one layer's weights over and over (warm L2)."),
    layers: int = typer.Option(None, help=f"Force the number of rotated layers, 1 to {MAX_LAYERS} (default: >= 4x L2)."),
    replays: int = typer.Option(100, help="Timed replays per quantity under CUDA graphs; eager timing (the CPU, --no-graph) takes at most "
        f"{EAGER_REPLAYS_CAP} (the manifest's timing_counts says what ran)."),
    warmup: int = typer.Option(10, help=f"Warm-up calls per quantity (eager timing: at most {EAGER_WARMUP_CAP})."),
    graph: GraphOpt = True,
    split: bool = typer.Option(
        True, "--split/--no-split", help="Also time each stage alone (kernel_<stage>_us, stage_sum_us: moebench's"
        " front, shared, GEMM1, GEMM2, finalize; torch-bf16's router, shared, experts, shared_add)."
        " --no-split times only the whole step (with and without the gate) and the gate alone: less timing work,"
        " for when only the step's latency matters."
    ),
    overlap_shared: bool = typer.Option(
        True, "--overlap-shared/--serial-shared", help="Run the shared expert on a side CUDA stream beside the gate"
        " and the routed experts (every backend; as serving stacks do), or in order with them."
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Exit 1 when a peer's case failed too (a backend that is not ours); without it only"
        " our cases' failures fail the command, the peers' are stored and listed."
    ),
    device: str = typer.Option(None, help="'cpu' or 'cuda[:N]' (default: the GPU if any; with --tp N > 1 only"
                               " the kind counts, --devices picks the GPUs)."),
    devices: str = typer.Option(None, help="With --tp N > 1: the N GPUs of the ranks, e.g. '0,1' or 'all'"
                                " (default: the first N)."),
    timeout: float = typer.Option(None, help="With --tp N > 1: stop the ranks after this many seconds."),
    trace: TraceOpt = None,
    label: LabelOpt = "step",
    out: RunsOutOpt = Path("reports/runs"),
) -> None:
    """Time a whole decode-step MoE layer; store the run.

    The layer: gate -> router -> shared expert -> routed experts -> finalize
    [-> all-reduce], per rows, backend and tactic under CUDA graphs, gated on
    the fp64 oracle of the layer."""
    try:
        plan = step_plan(
            preset=preset, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, tp=tp,
            one_rank=one_rank, rows=rows, scenario=scenario, backends=backends, tactics=tactics, seed=seed,
            warm_l2=warm_l2, layers=layers, replays=replays, warmup=warmup, graph=graph, split=split,
            overlap_shared=overlap_shared, device=device, devices=devices, timeout=timeout, trace=trace, label=label,
            out=out,
        )  # fmt: skip
    except (ValueError, TypeError) as error:
        raise _fail(option_message(error)) from None
    _check_out(out, runs=True)  # last of the checks, before any rank runs

    console.print(f"decode step, TP{tp}: {plan.where}")
    if plan.note:
        console.print(f"[yellow]{escape_markup(plan.note)}[/yellow]")
    stored, signals = _measure("step", plan, out, label, timeout)
    if stored.path is None:
        return
    result = stored.result
    _print_step(result.frame, result.ranks)
    counts = result.frame["status"].value_counts().to_dict()
    console.print(f"{counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped")
    _finish(result.frame, result.manifest, stored.path, signals, strict)


#: The step tables' width when stdout is not a terminal: a normal wide terminal's.
STEP_TABLE_WIDTH = 160


def _print_tables(tables, width: int = STEP_TABLE_WIDTH) -> None:
    """Print rich_tables' (table, lines below) pairs, wide enough that no
    number is cut when stdout is not a terminal (a terminal folds at its width)."""
    out = _wide_console(width)
    for table, lines in tables:
        out.print(table)
        for line in lines:
            out.print(line, soft_wrap=True)


def _print_step(frame, ranks=None, table=None) -> None:
    """The step table (whole step, gate, all-reduce; then the per-stage
    split; `table`: step_summary_table(frame) when the caller has it) and,
    for a TP step, the per-rank tables."""
    from moebench.reports.summary import rank_table, step_summary_table

    table = step_summary_table(frame) if table is None else table
    table = table.drop(columns=["p10_us", "p90_us"])  # in summary.md / report.html
    title = "decode step (µs; the step excludes the gate)"
    if ranks is not None and len(ranks) and ranks["rank"].nunique() > 1:
        title = "decode step (µs, rank 0's timings: every rank below; the step excludes the gate)"
    _print_tables(rich_tables.split_tables(table, title))
    if ranks is not None and len(ranks):
        _print_tables(rich_tables.split_tables(rank_table(ranks), "per rank (µs)",
                                               constant_keys=("preset", "scenario", "tactic")))
    if "timing_method" in frame.columns and (frame["timing_method"].astype(str) == "cpu-wallclock").any():
        console.print("[yellow]CPU wall-clock timings: each column is timed on its own and they are noisy, so they"
                      " need not add up (step vs +gate, Σ stages vs step).[/yellow]", soft_wrap=True)


@app.command(cls=_Command)
def presets() -> None:
    """Geometry presets and one rank's shape per TP degree."""
    for table in rich_tables.presets_tables():
        console.print(table)


@app.command(cls=_Command)
def env(
    device: DeviceOpt = None,
    bandwidth: bool = typer.Option(True, "--bandwidth/--no-bandwidth", help="Measure copy bandwidth on a GPU."),
) -> None:
    """Device, driver, package versions, commit and available backends."""
    from moebench.backends.registry import available_backends
    from moebench.bench.bandwidth import copy_bandwidth_gbps
    from moebench.env import environment, resolve_device

    try:
        dev = resolve_device(device)
    except ValueError as error:
        raise _fail(option_message(error)) from None
    info = environment(dev)
    bw = copy_bandwidth_gbps(dev) if dev.type == "cuda" and bandwidth else None
    for table in rich_tables.environment_tables(info, bw, available_backends(dev)):
        console.print(table)


@app.command(cls=_Command)
def check(
    device: DeviceOpt = None,
) -> None:
    """Quick self-check; exits 1 when any item fails."""
    from moebench.bench.selfcheck import run_checks, skipped_backends
    from moebench.env import resolve_device

    try:
        dev = resolve_device(device)
    except ValueError as error:
        raise _fail(option_message(error)) from None
    with console.status("checking ..."):
        results = run_checks(dev)
    console.print(rich_tables.check_table(dev, results, skipped_backends(dev)))
    console.print(f"--experts: {KERNEL_EXPERTS_NOTE}", soft_wrap=True)
    failed = [r.name for r in results if not r.ok]
    if failed:
        raise _fail(f"{len(failed)} check(s) failed: {', '.join(failed)}", 1)
    console.print(f"[green]all {len(results)} checks passed[/green]")


@app.command(cls=_Command)
def report(
    run_dir: Path = typer.Argument(..., parser=_path, help="A run directory (results.parquet + manifest.json)."),
    baseline: Path = typer.Option(
        None, parser=_path, help="A baseline run directory to compare with (per-case verdicts)."
    ),
    fail_above: str = typer.Option(
        None, "--fail-above", help="Exit 1 when a case is slower than the baseline by more than this percentage"
        " ('5%' or '5'; a bare number is percent, so 0.05 means 0.05 %), failed, or lost (ok in the baseline,"
        " skipped or absent now). A case is 'slower' when its change is beyond the runs' noise; a regression"
        " only when it is also beyond this threshold. Without it the verdicts are judged at 5 % and only shown."
    ),
    out: Path = typer.Option(
        None, parser=_path, help="Where summary.md (and report.html + plots) go (default: beside the run,"
        " in RUN_DIR's sibling <run>-report/, so a committed run directory stays as committed)."
    ),
    html: bool = typer.Option(True, "--html/--no-html", help="Also write report.html with PNG plots."),
    force: bool = typer.Option(
        False, "--force", help="Replace an earlier report: its files (summary.md, report.html, the plots) are"
        " overwritten, and those an earlier report recorded writing there (.moebench-report.json) that this"
        " one does not write are removed; other files, same-named ones included, are left alone."
    ),
) -> None:
    """Summarize a run; with --baseline, compare it per case.

    Prints a table and writes summary.md and report.html, by default beside
    RUN_DIR in <run>-report/ (never into the run). With --baseline and
    --fail-above, exits 1 on a regression: a case slower beyond the
    threshold, failed, or lost (ok in the baseline but skipped or absent in
    RUN_DIR). A comparison that cannot judge anything (a baseline recorded
    another way, no case in common, every compared case unclear) exits 2
    with the reason, with or without --fail-above: it is never a pass."""
    from moebench.reports.gate import judge_comparison
    from moebench.reports.report import plan_report, report_markdown, write_report_html

    try:
        plan = plan_report(run_dir, baseline=baseline, fail_above=fail_above, out=out, html=html, force=force)
    except (FileNotFoundError, ValueError) as error:
        raise _fail(option_message(error)) from None
    out, where, target, comparison = plan.out, plan.where, plan.target, plan.comparison
    try:  # only now that every check passed (a refused report creates nothing), before any output:
        out.mkdir(parents=True, exist_ok=True)  # a report that cannot be written is not a verdict
    except OSError as error:
        raise _fail(f"{where}: cannot create {out}: {error.strerror or error}") from None
    earlier = outdir.report_record(target.parent)  # the files an earlier report wrote there (read before this one)
    try:  # --force replaces a link itself, never the file it points to (which may be anywhere)
        for path in plan.taken:
            if path.is_symlink():
                path.unlink()
    except OSError as error:
        raise _fail(f"cannot replace the link {path}: {error}", 1) from None
    if plan.manifest.get("reduced"):
        console.print("[yellow]This run used a reduced geometry on the CPU.[/yellow]")
    _print_summary(plan.summary)
    if plan.step_run:
        _print_step(plan.df, plan.ranks, table=plan.step_table)
    if comparison is not None:
        _print_comparison(comparison)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(report_markdown(plan), encoding="utf-8")
        console.print(f"wrote [bold]{target}[/bold]")
        stale = target.parent / "report.html"
        if not html and not force and stale.exists():
            whose = "an earlier report's" if "report.html" in earlier else "not this report's"
            console.print(f"[yellow]{stale} is {whose} (--no-html leaves it as it is)[/yellow]")
        paths = []
        if html:
            paths = write_report_html(plan)
            plots = f"{len(paths) - 1} plots" if len(paths) > 1 else "no plots: no case was timed or failed"
            console.print(f"wrote [bold]{paths[0]}[/bold] ({plots})")
        if force:
            removed = outdir.remove_stale_report_files(target.parent, [target, *paths], earlier)
            if removed:
                console.print(f"removed {', '.join(removed)} from {target.parent} (an earlier report's; this one"
                              f" does not write {'it' if len(removed) == 1 else 'them'})")  # fmt: skip
        outdir.write_report_record(target.parent, [target, *paths])
    except OSError as error:  # exit 1, as the module docstring and docs/ci.md say: not a usage error
        raise _fail(f"cannot write the report under {target.parent}: {error}", 1) from None
    if comparison is None:
        return
    stop = judge_comparison(comparison, plan.threshold, gated=plan.gated)
    if stop is not None:
        raise _fail(*stop)


def _print_comparison(comp) -> None:
    """Render a Comparison: mismatches / notes, then one row per case (its
    errors are the report's exit message, printed once, last)."""
    from moebench.reports.compare import within_threshold_note

    for m in comp.mismatches:
        console.print(f"[yellow]mismatch: {m}[/yellow]", soft_wrap=True)
    for n in comp.notes:
        console.print(f"[dim]note: {n}[/dim]", soft_wrap=True)
    _wide_console(150).print(rich_tables.comparison_table(comp))
    console.print("verdicts: " + (", ".join(f"{n} {v}" for v, n in comp.counts.items()) or "none"))
    within = within_threshold_note(comp)
    if within and not comp.errors:
        console.print("no regression:" + within, soft_wrap=True)
    if comp.unclear_note and not len(comp.regressions) and not comp.errors:  # an all-unclear error says it already
        console.print(f"[yellow]{comp.unclear_note}[/yellow]", soft_wrap=True)


@app.command(cls=_Command)
def merge(
    runs: list[Path] = typer.Argument(..., parser=_path, help="Two or more stored run directories."),
    label: str = typer.Option(..., help="Label of the merged run: OUT/<UTC date>-<label>."),
    out: RunsOutOpt = Path("reports/runs"),
) -> None:
    """Store the cases of several runs of one commit and device as one run
    (a comparison measured over several device calls). The parts are kept."""
    from moebench.reports.store import merge_runs, run_dir_name, write_run

    try:
        run_dir_name(label)
        frame, manifest = merge_runs(runs)
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise _fail(option_message(error)) from None
    _check_out(out, runs=True)
    manifest = {**manifest, "command": shlex.join(["moebench", *sys.argv[1:]])}
    try:
        path = write_run(frame, manifest, root=out, label=label)
    except OSError as error:
        raise _fail(f"cannot write the run under {out}: {error}", 1) from None
    console.print(f"{len(frame)} cases from {len(runs)} runs stored in [bold]{path}[/bold]")


@app.command(cls=_Command)
def tune(
    preset: PresetOpt = "dsv41-flash",
    hidden: HiddenOpt = None,
    intermediate: IntermediateOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    tp: str = typer.Option("4", help="Tensor-parallel degrees: one table per rank shape."),
    rows: str = typer.Option("1-8", help="Token rows to tune (1..8)."),
    stages: str = typer.Option("1,2", help="GEMM stages to tune (1, 2)."),
    space: str = typer.Option(
        "quick", help="Tactic space: 'quick' (default), 'full', or 'ship' (the defaults and their neighbours,"
        " <= 10 per stage: what the shipped tables are tuned over)."
    ),
    scenario: str = typer.Option("correlated", help="Routing scenario of the timed cases."),
    repeats: int = typer.Option(3, help="Extra timings of each finalist."),
    top: int = typer.Option(3, help="Finalists re-timed per row count, at least 2 (the default is always re-timed"
                            " too)."),
    replays: int = typer.Option(50, help="Timed CUDA-graph replays per timing."),
    warmup: int = typer.Option(10, help="Warm-up calls per timing."),
    layers: LayersOpt = None,
    warm_l2: WarmL2Opt = False,
    act_bf16: bool = typer.Option(
        True, "--act-bf16/--e4m3",
        help="Time the BF16-activation (_a16) twins, what the runtime runs by default; --e4m3 times the"
             " MXFP8-operand tactics. Ignored with --fp8.",
    ),
    fp8: bool = typer.Option(
        False, "--fp8",
        help="Tune the FP8 (wgmma, _f8) kernel family instead of the BF16 one: e4m3-layout weights, the MXFP8"
             " x / H as they are, candidates from the fp8 defaults, the measured warp-specialized variants and"
             " their neighbours (--space sets how many: ship 10, quick 16, full 48 per stage, GEMM1 twice that"
             " with the spec twins); the entries go"
             " to the table's 'fp8' part (what FP8 layers run), the BF16 entries stay. By default each layer runs"
             " the family whose entries are faster.",
    ),
    distinct_layers: bool = typer.Option(
        False, "--distinct-layers", help="Generate every rotated weight set (default: copies of the first)."
    ),
    seed: SeedOpt = 0,
    budget: float = typer.Option(
        None, help="Wall-time budget in seconds: no new step starts that would end past it; the tables keep"
        " what was done (exit 1 lists what was left out)."
    ),
    jobs: int = typer.Option(
        None, help="Worker processes compiling the kernels ahead of the timing (default: cores - 1; 0: compile"
        " in this process)."
    ),
    summary: Path = typer.Option(
        None, parser=_path, help="Also write the tuned-vs-default gains here (markdown; a .json beside it)."
    ),
    device: str = typer.Option(None, help="'cuda[:N]' (default: the current GPU)."),
    out: Path = typer.Option(
        None, parser=_path, help="Directory of the tables (default: $MOEBENCH_TUNING_DIR, else ./tuning-tables;"
        " moebench/tuning/tables ships them with the package)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a table of another device or a newer version."),
) -> None:
    """Tune the GEMM tactics per rows on this GPU; write tuning tables.

    One table per shape class, holding each kernel family's entries (BF16;
    with --fp8 the FP8 family's, merged next to them); prints what tuning
    buys over the built-in tactics at rows 1, 4, 8, and which kernel family
    each shape class tuned now runs by default (the faster by the tables' µs)."""
    from moebench.tuning.family import default_families
    from moebench.tuning.plan import tune_plan
    from moebench.tuning.save import tables_dir, write_gains_summary

    try:
        plan = tune_plan(
            preset=preset, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, tp=tp, rows=rows,
            stages=stages, space=space, scenario=scenario, repeats=repeats, top=top, replays=replays, warmup=warmup,
            layers=layers, warm_l2=warm_l2, act_bf16=act_bf16, fp8=fp8, distinct_layers=distinct_layers, seed=seed,
            budget=budget, jobs=jobs, summary=summary, device=device,
        )  # fmt: skip
    except (ValueError, TypeError) as error:
        raise _fail(option_message(error)) from None
    from moebench.tuning import runner as tuning_runner
    from moebench.tuning.precompile import default_jobs

    try:
        tuning_runner.require_tuning_device(device)
    except RuntimeError as error:
        raise _fail(option_message(error)) from None
    target = tables_dir(out)
    _check_out(target)  # tables and the summary must be writable before minutes of tuning, not after
    if summary is not None:
        _check_out(summary.parent, "--summary")
    configs = plan.configs()
    clock = tuning_runner.Budget(budget)
    problems: list[str] = []
    written: list = []  # (device name, shape class, SMs) of each table written

    def say(text: str) -> None:
        console.print(f"[dim][{clock.elapsed():6.1f} s][/dim] {text}", soft_wrap=True)

    def finished(config, outcome) -> None:
        for (t, stage), secs in outcome.seconds.items():
            say(f"{config.preset} TP{t} {config.family} GEMM{stage}: {len(outcome.results[t, stage].entries)} rows tuned"
                f" in {secs:.1f} s ({outcome.layers[t, stage]} weight sets)")  # fmt: skip
        problems.extend(_write_tables(outcome, target, force, label=f"{config.preset} {config.family}",
                                      written=written))  # fmt: skip

    n_jobs = default_jobs() if jobs is None else jobs
    done = tuning_runner.tune_many(configs, budget=clock, jobs=n_jobs, progress=_progress_filter(say),
                                   on_outcome=finished)  # fmt: skip
    records = tuning_runner.gains(done, tuning_runner.GAIN_ROWS)
    _print_gains(records)
    families = default_families(written, target)
    _print_default_families(families, target)
    if summary is not None:
        try:
            md, js = write_gains_summary(summary, records, families, target)
            console.print(f"wrote [bold]{md}[/bold] and [bold]{js}[/bold]")
        except OSError as error:
            problems.append(f"cannot write {summary}: {error}")
    stopped = [line for _, o in done for line in o.stopped]
    say(f"done in {clock.elapsed():.0f} s")
    if stopped:
        problems.append(f"the --budget of {budget:g} s left out: " + "; ".join(stopped))
    if problems:
        raise _fail(" | ".join(problems), 1)


def _progress_filter(say):
    """Progress lines of run_tune worth a log line (one per stage and shape),
    not one per tactic."""

    def progress(text: str) -> None:
        if text.endswith("preparing weights") or text.startswith("compiling") or "kernels submitted" in text:
            say(text)

    return progress


def _print_gains(records) -> None:
    if records:
        _wide_console(150).print(rich_tables.gains_table(records))


def _print_default_families(families, target: Path) -> None:
    if families:
        _wide_console(150).print(rich_tables.families_table(families, target))


def _write_tables(outcome, target: Path, force: bool, label: str = "", written: list | None = None) -> list[str]:
    """Print each table's picks and save it (tuning.save.save_tables: merged
    over an older table of the same device); returns the problems. Each
    table written is appended to `written` as (device name, shape class, SMs)."""
    from moebench.tuning.save import save_tables

    for table in rich_tables.picks_tables(outcome, label):
        _wide_console(150).print(table)
    saved, problems = save_tables(outcome, target, force, label)
    for s in saved:
        console.print(f"wrote [bold]{s.path}[/bold] ({len(s.table.entries)} BF16 + {len(s.table.fp8_entries)} FP8"
                      " entries)")  # fmt: skip
        if written is not None:
            written.append(s.key())
    return problems


def main() -> None:
    app()


if __name__ == "__main__":
    main()
