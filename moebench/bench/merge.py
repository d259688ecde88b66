"""A launched run (`Job`: what every rank runs, and how what the ranks
delivered becomes one run) and what every kind of job's merge shares: the
reports the ranks put into the results store (`RankReport`), why a rank
did not deliver (`undelivered`), the manifest's `workers`. Pure functions
of the reports; `launch.py` runs the ranks and collects the reports.

A job carries its own rank program and merge: `sweep_ranks.sweep_job`,
`decode_step.step_job`, `tuning.share.tune_job`. The launcher names
none of them: the bench never imports the tuner, which sits above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from moebench.bench.interrupt import INTERRUPTED

#: Ranks run on the CPU as stand-ins for GPUs (tests: `--devices` without a GPU).
FAKE_GPU_ENV = "MOEBENCH_FAKE_GPU"

CaseRunner = Callable[[list, str], pd.DataFrame]
#: A rank's program: run(job, rank, world, device (torch.device), box (launch.Outbox)) -> True when an
#: interrupt stopped it. It puts what it measured into `box` as it goes.
RankProgram = Callable[["Job", int, int, object, object], bool]
#: The merge of what the ranks delivered: merge(job, reports, stopped) -> the run (a RunResult; a tune's
#: tuning.share.Gathered). `stopped`: why the launcher stopped the ranks, INTERRUPTED, or None.
Merger = Callable[["Job", Sequence["RankReport"], "str | None"], object]


# ----------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Job:
    """What every rank runs: kind (its name: "sweep", "step", "tune"), its
    config, the rank program `run` and the `merge` of the ranks' reports
    (module-level functions: a launched job is pickled to its ranks);
    devices: the CUDA index of each local rank (None: LOCAL_RANK; ignored
    on the CPU); runner: a sweep's piece runner (cases, device) -> frame
    (None: run_sweep; a module-level function, for tests); collective: the
    ranks run collectives with one another (a TP step): over NCCL on GPUs,
    and a rank that fails ends its process, or the others would wait in a
    collective."""

    kind: str
    config: object
    run: RankProgram
    merge: Merger
    devices: tuple[int, ...] | None = None
    runner: CaseRunner | None = None
    collective: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must be a non-empty str, got {self.kind!r}")
        for name in ("run", "merge"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable, got {type(getattr(self, name)).__name__}")


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


def undelivered(report: RankReport, stopped: str | None) -> tuple[str, str]:
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
        error = None if fine else undelivered(r, stopped)[1]
        out.append({"rank": r.rank, **{k: r.hello.get(k) for k in ("host", "gpu_index", "gpu_serial", "gpu_uuid",
                                                                    "pid", "multicast_env")},
                    "status": end.get("status"), "signal": end.get("signal"), "exit": r.failure, "error": error,
                    "rows": sum(len(p["rows"]) for p in r.pieces)})  # fmt: skip
    return out


def host_provenance(config) -> dict:
    """The manifest of a run no rank reported its environment for: this process's."""
    from moebench.env import launcher_environment

    return {
        **launcher_environment(config.device or "cpu"),
        "provenance_from": "the launching process (no rank reported its environment)",
    }
