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

import shlex
import signal
import sys
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moebench import render
from moebench.bench.interrupt import sigterm_as_interrupt  # torch-free too
from moebench.bench.plan import option_message, parse_names, step_plan, sweep_plan  # noqa: F401 - torch-free too
from moebench.cli_options import (
    SweepTpOpt, SweepBackendsOpt, SweepReplaysOpt, SweepWarmupOpt, SweepSplitOpt, SweepBackToBackOpt, SweepStrictOpt, SweepDevicesOpt, SweepWorkerTimeoutOpt, StepTpOpt, StepOneRankOpt, StepBackendsOpt, StepWarmL2Opt, StepLayersOpt, StepReplaysOpt, StepWarmupOpt, StepSplitOpt, StepOverlapSharedOpt, StepStrictOpt, StepDeviceOpt, StepDevicesOpt, StepTimeoutOpt,
    ActBf16Opt, BaselineOpt, BudgetOpt, DeviceOpt, DistinctLayersOpt, ExpertsOpt, FailAboveOpt, Fp8Opt, GraphOpt,
    HiddenOpt, IntermediateOpt, JobsOpt, LabelOpt, LayersOpt, PresetOpt, ReportForceOpt, ReportOutOpt, RowsOpt,
    RunDirArg, RunsOutOpt, ScenarioOpt, SeedOpt, SpaceOpt, SummaryOpt, TablesOutOpt, TacticsOpt, TopKOpt, TopOpt,
    TraceOpt, WarmL2Opt,
)  # fmt: skip
from moebench.cli_support import Command as _Command  # the private names are what sweep and step call
from moebench.cli_support import Group, console, print_version, replace_unprintable
from moebench.cli_support import check_out as _check_out
from moebench.cli_support import fail as _fail
from moebench.cli_support import parse_path as _path
from moebench.models import KERNEL_EXPERTS_NOTE  # torch-free too
from moebench.reports import rich_tables  # torch- and pandas-free too
from moebench.reports.rich_tables import escape_markup

app = typer.Typer(
    name="moebench",
    cls=Group,
    help="Microbenchmarks and tuning for low-batch MXFP4 routed-expert MoE decode on Hopper.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="Print the moebench version and exit."
    ),
) -> None:
    """Microbenchmarks and tuning for low-batch MXFP4 routed-expert MoE decode on Hopper."""
    replace_unprintable()  # an ASCII terminal: 'µs' and the box lines print as '?'


@app.command(cls=_Command)
def sweep(
    preset: PresetOpt = "dsv41-flash",
    hidden: HiddenOpt = None,
    intermediate: IntermediateOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    rows: RowsOpt = None,
    tp: SweepTpOpt = None,
    backends: SweepBackendsOpt = "default",
    scenario: ScenarioOpt = "correlated",
    tactics: TacticsOpt = "default",
    seed: SeedOpt = 0,
    warm_l2: WarmL2Opt = False,
    layers: LayersOpt = None,
    replays: SweepReplaysOpt = 100,
    warmup: SweepWarmupOpt = 10,
    graph: GraphOpt = True,
    split: SweepSplitOpt = True,
    back_to_back: SweepBackToBackOpt = False,
    strict: SweepStrictOpt = False,
    device: DeviceOpt = None,
    devices: SweepDevicesOpt = None,
    worker_timeout: SweepWorkerTimeoutOpt = None,
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
    render.print_summary(summary_table(frame))
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
        raise _fail(
            "interrupted before any case was measured; nothing stored",
            128 + (signals[-1] if signals else signal.SIGINT),
        ) from None
    if stored.path is None:
        console.print(f"rank {stored.rank} of {stored.world}: measured its share; rank 0 stores the run")
    return stored, signals


def _finish(frame, manifest: dict, path, signals: list[int], strict: bool) -> None:
    """After a run is stored at `path`: each launched worker's line, the
    path, then the exit: 128 + signal when interrupted, 1 when a worker
    died or a case failed (`_fail_unless_every_case_passed`)."""
    workers = manifest.get("workers") or []
    render.print_stored(manifest, path)
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
    render.print_peer_failures(verdict, path, strict)
    if verdict.failure is not None:
        raise _fail(verdict.failure, FAILED)


@app.command(cls=_Command)
def step(
    preset: PresetOpt = "dsv41-flash",
    hidden: HiddenOpt = None,
    intermediate: IntermediateOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    tp: StepTpOpt = 1,
    one_rank: StepOneRankOpt = False,
    rows: RowsOpt = None,
    scenario: ScenarioOpt = "correlated",
    backends: StepBackendsOpt = "default",
    tactics: TacticsOpt = "default",
    seed: SeedOpt = 0,
    warm_l2: StepWarmL2Opt = False,
    layers: StepLayersOpt = None,
    replays: StepReplaysOpt = 100,
    warmup: StepWarmupOpt = 10,
    graph: GraphOpt = True,
    split: StepSplitOpt = True,
    overlap_shared: StepOverlapSharedOpt = True,
    strict: StepStrictOpt = False,
    device: StepDeviceOpt = None,
    devices: StepDevicesOpt = None,
    timeout: StepTimeoutOpt = None,
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
    render.print_step(result.frame, result.ranks)
    counts = result.frame["status"].value_counts().to_dict()
    console.print(f"{counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped")
    _finish(result.frame, result.manifest, stored.path, signals, strict)


#: The step tables' width when stdout is not a terminal: a normal wide terminal's.
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
    try:
        with console.status("checking ..."):
            results = run_checks(dev)
    except KeyboardInterrupt:
        raise _fail("interrupted (Ctrl-C) before every item was checked; nothing was judged", 130) from None
    console.print(rich_tables.check_table(dev, results, skipped_backends(dev)))
    console.print(f"routed experts E (the --experts of sweep, step and tune): {KERNEL_EXPERTS_NOTE}", soft_wrap=True)
    failed = [r.name for r in results if not r.ok]
    if failed:
        raise _fail(f"{len(failed)} check(s) failed: {', '.join(failed)}", 1)
    console.print(f"[green]all {len(results)} checks passed[/green]")


@app.command(cls=_Command)
def report(
    run_dir: RunDirArg,
    baseline: BaselineOpt = None,
    fail_above: FailAboveOpt = None,
    out: ReportOutOpt = None,
    html: bool = typer.Option(True, "--html/--no-html", help="Also write report.html with PNG plots."),
    force: ReportForceOpt = False,
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
    from moebench.reports.report import ReportNotWritten, plan_report, write_report

    try:
        plan = plan_report(run_dir, baseline=baseline, fail_above=fail_above, out=out, html=html, force=force)
    except (FileNotFoundError, ValueError) as error:
        raise _fail(option_message(error)) from None

    def print_tables() -> None:  # once every check passed and the report's directory is there
        if plan.manifest.get("reduced"):
            console.print("[yellow]This run used a reduced geometry on the CPU.[/yellow]")
        render.print_summary(plan.summary)
        if plan.step_run:
            render.print_step(plan.df, plan.ranks, table=plan.step_table)
        if plan.comparison is not None:
            render.print_comparison(plan.comparison)

    signals: list[int] = []
    try:
        with sigterm_as_interrupt() as signals:
            files = write_report(plan, html=html, force=force, before_writing=print_tables)
    except ReportNotWritten as error:
        render.print_report_files(error.done)
        raise _fail(str(error), error.code) from None
    except KeyboardInterrupt as error:  # write_report removed what it had staged: a rerun is not refused
        number = signals[-1] if signals else signal.SIGINT
        done = getattr(error, "done", None)
        said = (f": no report written; {plan.out} is as it was" if done is None or done.target is None else
                f" while its files were moved into {plan.out}, which may hold part of it (--force writes it"
                " again)")  # fmt: skip
        raise _fail(f"interrupted ({signal.Signals(number).name}){said}", 128 + number) from None
    render.print_report_files(files)
    stop = None if plan.comparison is None else judge_comparison(plan.comparison, plan.threshold, gated=plan.gated)
    if stop is not None:
        raise _fail(*stop)


@app.command(cls=_Command)
def merge(
    runs: list[Path] = typer.Argument(..., parser=_path, help="Two or more stored run directories."),
    label: str = typer.Option(..., help="Label of the merged run: OUT/<UTC date>-<label>."),
    out: RunsOutOpt = Path("reports/runs"),
) -> None:
    """Store the cases of several runs of one commit and device as one run
    (a comparison measured over several device calls). The parts are kept."""
    from moebench.reports.store import merge_runs, merged_tables, run_dir_name, write_run

    try:
        run_dir_name(label)
        frame, manifest = merge_runs(runs)
        tables = merged_tables(runs)
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise _fail(option_message(error)) from None
    _check_out(out, runs=True)
    manifest = {**manifest, "command": shlex.join(["moebench", *sys.argv[1:]])}
    try:
        path = write_run(frame, manifest, root=out, label=label, tables=tables)
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
    stages: str = typer.Option(
        None,
        help="What to tune: GEMM stages 1, 2 and, with --fp8, 'fused' (the pair against the fused layer per rows,"
        " the table's fp8.fused). Default: 1,2 (with --fp8: 1,2,fused).",
    ),
    space: SpaceOpt = "quick",
    scenario: str = typer.Option("correlated", help="Routing scenario of the timed cases."),
    repeats: int = typer.Option(3, help="Extra timings of each finalist."),
    top: TopOpt = 3,
    replays: int = typer.Option(50, help="Timed CUDA-graph replays per timing."),
    warmup: int = typer.Option(10, help="Warm-up calls per timing."),
    layers: LayersOpt = None,
    warm_l2: WarmL2Opt = False,
    act_bf16: ActBf16Opt = True,
    fp8: Fp8Opt = False,
    distinct_layers: DistinctLayersOpt = False,
    seed: SeedOpt = 0,
    budget: BudgetOpt = None,
    jobs: JobsOpt = None,
    summary: SummaryOpt = None,
    device: str = typer.Option(None, help="'cuda[:N]' (default: the current GPU)."),
    out: TablesOutOpt = None,
    force: bool = typer.Option(
        False, "--force", help="Replace a table of another device or a newer version, and an existing --summary."
    ),
) -> None:
    """Tune the GEMM tactics per rows on this GPU; write tuning tables.

    One table per shape class, holding each kernel family's entries (BF16;
    with --fp8 the FP8 family's, merged next to them); prints what tuning
    buys over the built-in tactics at rows 1, 4, 8, and which kernel family
    each shape class tuned now runs by default (the faster by the tables' µs)."""
    from moebench.tuning.plan import tune_plan
    from moebench.tuning.save import check_tune_targets, tune_and_save

    try:
        plan = tune_plan(
            preset=preset, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, tp=tp, rows=rows,
            stages=stages, space=space, scenario=scenario, repeats=repeats, top=top, replays=replays, warmup=warmup,
            layers=layers, warm_l2=warm_l2, act_bf16=act_bf16, fp8=fp8, distinct_layers=distinct_layers, seed=seed,
            budget=budget, jobs=jobs, summary=summary, device=device,
        )  # fmt: skip
        target = check_tune_targets(plan, out, summary, force=force)  # the GPU and the files, before the tuning
    except (ValueError, TypeError, RuntimeError) as error:
        raise _fail(option_message(error)) from None
    run = tune_and_save(plan, target, force=force, summary=summary, budget=budget, jobs=jobs,
                        progress=render.print_tune_log, on_saved=render.print_tuned)  # fmt: skip
    render.print_tune_run(run, target)
    if run.problems:
        raise _fail(" | ".join(run.problems), 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
