"""A launched run (`Job`: a sweep or a step and its config) and the merge
of what its ranks delivered (`RankReport`s) into one run: every planned
case once, in the order one process would store them, each row with host,
launch_rank, gpu_index and gpu_serial; a case a rank did not deliver
stored failed with the reason, or skipped (INTERRUPTED) when the rank
stopped on an interrupt. Pure functions of the reports; `launch.py` runs
the ranks and collects the reports.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from moebench.bench.interrupt import INTERRUPTED

#: Ranks run on the CPU as stand-ins for GPUs (tests: `--devices` without a GPU).
FAKE_GPU_ENV = "MOEBENCH_FAKE_GPU"

CaseRunner = Callable[[list, str], pd.DataFrame]


# ----------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Job:
    """What every rank runs: kind "sweep", "step" or "tune" and its config
    (a tune's: tuning.share.TuneJob);
    devices: the CUDA index of each local rank (None: LOCAL_RANK; ignored
    on the CPU); runner: a sweep's piece runner (cases, device) -> frame
    (None: run_sweep; a module-level function, for tests)."""

    kind: str
    config: object
    devices: tuple[int, ...] | None = None
    runner: CaseRunner | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("sweep", "step", "tune"):
            raise ValueError(f"kind must be 'sweep', 'step' or 'tune', got {self.kind!r}")


def sweep_cases(job: Job) -> list:
    """The unexpanded cases of a sweep job (what the ranks share out)."""
    from moebench.bench.cases import expand_cases
    from moebench.bench.pipeline import select_backends

    import torch

    config = job.config
    on_cpu = str(config.device or "cpu").startswith("cpu") or os.environ.get(FAKE_GPU_ENV) == "1"
    # the names were checked where the run was planned (a test's stand-in backends live only there)
    names = config.backends or select_backends(config, torch.device("cpu" if on_cpu else "cuda"))
    return expand_cases(config, names, reduced=bool(config.reduced))


@dataclass
class RankReport:
    """What one rank put into the results store: hello (host, GPU, pid,
    multicast env), pieces (each {"rows": [...], "info": {...}}), end
    ({"status": "done" | "interrupted" | "error", ...}, None when it never
    said), failure (the launcher's word on its exit, else None)."""

    rank: int
    hello: dict = field(default_factory=dict)
    pieces: list = field(default_factory=list)
    end: dict | None = None
    failure: str | None = None


# ----------------------------------------------------------------------------- merging


def _failure(report: RankReport, stopped: str | None) -> tuple[str, str]:
    """(status, error) of the cases rank `report.rank` planned but did not
    deliver. `stopped`: why the launcher stopped the ranks (its timeout),
    or INTERRUPTED when an interrupt reached the launcher (then a rank that
    never said a word was stopped, not lost)."""
    where = report.hello
    gpu = f", GPU {where['gpu_index']}" if where.get("gpu_index") is not None else ""
    name = f"rank {report.rank} ({where.get('host', 'host unknown')}{gpu})"
    end = report.end or {}
    if stopped == INTERRUPTED:
        return ("failed", f"{name} died: {end.get('error')}") if end.get("status") == "error" else \
            ("skipped", INTERRUPTED)  # fmt: skip
    if end.get("status") == "interrupted" and not stopped:
        return "skipped", INTERRUPTED
    if stopped:
        return "failed", f"{name} {stopped}"
    if end.get("status") == "error":
        return "failed", f"{name} died: {end.get('error')}"
    if end.get("status") == "done":
        return "failed", f"{name} delivered no row for this case"
    why = report.failure or "it stopped without a word (no heartbeat; killed, or its host was lost)"
    return "failed", f"{name} died: {why}"


def workers_of(reports: Sequence[RankReport], stopped: str | None = None) -> list[dict]:
    """The manifest's `workers`: each rank's host, GPU, pid, exit word and error (None when it finished)."""
    out = []
    for r in reports:
        end = r.end or {}
        # a rank that finished its work is no failure, even when the launcher stopped it as it left
        fine = end.get("status") == "done" or (end.get("status") == "interrupted" and stopped in (None, INTERRUPTED))
        error = None if fine else _failure(r, stopped)[1]
        out.append({"rank": r.rank, **{k: r.hello.get(k) for k in ("host", "gpu_index", "gpu_serial", "gpu_uuid",
                                                                    "pid", "multicast_env")},
                    "status": end.get("status"), "signal": end.get("signal"), "exit": r.failure, "error": error,
                    "rows": sum(len(p["rows"]) for p in r.pieces)})  # fmt: skip
    return out


def merge_sweep(job: Job, reports: Sequence[RankReport], stopped: str | None = None):
    """One sweep run (RunResult) of what the ranks delivered: each rank's
    rows; every case of its share it did not deliver stored as `_failure`
    says (an interrupt: skipped; `stopped`: the launcher stopped it, e.g.
    a timeout: failed, its interrupted rows too)."""
    from moebench.bench.columns import typed
    from moebench.bench.pipeline import (
        RunResult, case_key, expand_all_tactics, load_backends, row_key, unrun_rows,
    )  # fmt: skip
    from moebench.bench.shard import plan_shards
    from moebench.bench.sweep import timing_counts_used, timing_methods

    config = job.config
    cases = sweep_cases(job)
    shares = plan_shards(cases, len(reports))
    backends = load_backends(dict.fromkeys(c.backend for c in cases))[0]
    rows, infos = [], []
    for report, share in zip(reports, shares):
        mine = [row for piece in report.pieces for row in piece["rows"]]
        infos += [piece["info"] for piece in report.pieces if piece["info"]]
        status, error = _failure(report, stopped)
        if stopped not in (None, INTERRUPTED):  # what the launcher's stop left unrun failed, not skipped
            mine = [dict(r, status="failed", error=error) if r.get("error") == INTERRUPTED else r for r in mine]
        where = {k: report.hello.get(k) for k in ("host", "gpu_index", "gpu_serial")}
        base = {**where, "launch_rank": report.rank, "seed": config.seed}
        planned = expand_all_tactics(share, backends)
        mine += [row for row in unrun_rows("sweep", planned, mine, base, backends, error, status)]
        rows += [{**r, **{k: v for k, v in where.items() if r.get(k) in (None, "")}, "launch_rank": report.rank}
                 for r in mine]  # fmt: skip
    order = {case_key(c): i for i, c in enumerate(expand_all_tactics(cases, backends))}
    rows.sort(key=lambda r: order.get(row_key(r), len(order)))  # the cases' order, as one process stores them
    frame = typed(rows, "sweep")
    methods = timing_methods(frame)
    manifest = dict(infos[0]) if infos else _host_provenance(config)
    manifest.update(
        kind="sweep", sharded=True, world=len(reports), workers=workers_of(reports, stopped),
        plan=[[c.label() for c in s] for s in shares], timing_methods=methods,
        timing_counts=timing_counts_used(config, methods),
        worker_manifests=[{k: m.get(k) for k in ("device", "copy_bw_gbps", "groups")} for m in infos],
    )  # fmt: skip
    manifest.setdefault("schema", 1)
    manifest.setdefault("seed", config.seed)
    manifest.pop("interrupted", None)
    if (frame["error"] == INTERRUPTED).any():
        manifest["interrupted"] = True
        signals = [r.end.get("signal") for r in reports if r.end and r.end.get("signal")]
        if signals:
            manifest["interrupt_signal"] = signals[0]
    return RunResult(frame, manifest)


def _host_provenance(config) -> dict:
    """The manifest of a run no rank reported its environment for: this process's."""
    from moebench.env import launcher_environment

    return {
        **launcher_environment(config.device or "cpu"),
        "provenance_from": "the launching process (no rank reported its environment)",
    }


def merge_step(job: Job, reports: Sequence[RankReport], stopped: str | None = None):
    """One step run (RunResult with `ranks`) of what the ranks delivered:
    rank 0's rows as the run's cases, every case it did not deliver stored
    as `_failure` of the first rank that failed says; every rank's rows in
    `ranks`."""
    from moebench.bench.columns import typed
    from moebench.bench.decode_step import step_cases, step_manifest
    from moebench.bench.pipeline import RunResult, unrun_rows
    from moebench.bench.sweep import timing_counts_used, timing_methods

    config = job.config
    latest = {r.rank: (r.pieces[-1] if r.pieces else {"rows": [], "info": {}}) for r in reports}
    # the cases rank 0 did not deliver: failed with the first failed rank's reason, else as rank 0 says
    failed = [r for r in reports if (r.end or {}).get("status") not in ("done", "interrupted")]
    status, error = _failure(failed[0] if failed else reports[0], stopped)
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
        info = {"env": _host_provenance(config), "reduced": config.reduced}
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


def merge(job: Job, reports: Sequence[RankReport], stopped: str | None = None):
    """merge_sweep, merge_step or (a tune) tuning.share.merge_tune, by the job's kind."""
    if job.kind == "tune":
        from moebench.tuning.share import merge_tune

        return merge_tune(job, reports, stopped)
    return (merge_sweep if job.kind == "sweep" else merge_step)(job, reports, stopped)
