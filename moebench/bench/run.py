"""`moebench sweep` and `moebench step` as one library call: measure a
planned run where it is to run, then store it.

- under torchrun (`launch.under_torchrun`): this process is one rank; it
  runs its share (`launch.rank_main`) and rank 0 stores the merged run;
- `sweep --devices` / `step --tp N`: the ranks are started on this host by
  PyTorch's elastic launch (`launch.launch_local`), this process stores;
- else in this process (`sweep.run_sweep`, `decode_step.run_step` with one rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moebench.bench.pipeline import RunResult

#: progress(done, total, what, status) while a run measures.
Progress = Callable[[int, int, str, str], None]
#: The piece runner of a launched sweep's ranks (None: run_sweep); a stand-in for tests.
PIECE_RUNNER = None


@dataclass
class Stored:
    """A stored run: the result and its directory; on a torchrun rank that
    does not store (rank > 0) both are None and `rank` / `world` say which."""

    result: RunResult | None
    path: Path | None
    rank: int = 0
    world: int = 1


def measure(kind: str, plan, *, out: Path, label: str, command: str, timeout_s: float | None = None,
            progress: Progress | None = None) -> Stored:  # fmt: skip
    """Measure `plan` (bench.plan's SweepPlan or StepPlan) of `kind`
    ("sweep" or "step") and store it under `out` as <date>-<label>, the
    manifest's "command" = `command`. timeout_s: the ranks' limit of a
    launched run (--worker-timeout, step's --timeout). Raises ValueError
    for a bad plan, OSError when the run cannot be written;
    KeyboardInterrupt only before anything was measured."""
    from moebench.bench.decode_step import step_job
    from moebench.bench.launch import launch_local, rank_main, under_torchrun
    from moebench.bench.sweep_ranks import sweep_cases, sweep_job
    from moebench.reports.store import write_run

    if kind not in ("sweep", "step"):
        raise ValueError(f"kind must be 'sweep' or 'step', got {kind!r}")
    config = plan.config
    if under_torchrun():
        result = rank_main(sweep_job(config) if kind == "sweep" else step_job(config))
        if result is None:
            return Stored(None, None, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    elif kind == "sweep" and plan.gpus is not None:
        job = sweep_job(config, tuple(plan.gpus), PIECE_RUNNER)
        result = launch_local(
            job,
            len(plan.gpus),
            timeout_s=timeout_s,
            total=len(sweep_cases(job)),
            progress=None if progress is None else lambda d, t: progress(d, t, "", ""),
        )
    elif kind == "sweep":
        from moebench.bench.sweep import run_sweep

        result = run_sweep(config, progress=None if progress is None else
                           lambda d, t, case, status: progress(d, t, case.label(), status))  # fmt: skip
    else:
        from moebench.bench.decode_step import run_step

        result = run_step(config, progress=progress, timeout_s=timeout_s)
    manifest = {**result.manifest, "command": command}
    tables = {"ranks": result.ranks} if result.ranks is not None else None
    path = write_run(result.frame, manifest, root=out, label=label, tables=tables)
    return Stored(result, path, 0, int(os.environ.get("WORLD_SIZE", "1")))
