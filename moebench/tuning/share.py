"""`moebench tune` under torchrun: each rank's share of the tuning configs
and the gathering of what the ranks tuned.

The ranks run `bench.launch.rank_main` with the Job `tune_job` makes:
its config a `TuneJob`, its rank program `tune_share`, its merge
`merge_tune`; the results store, the heartbeats, the end words and rank
0's wait are the sweep's. A rank tunes its share (`share_of`:
whole TuneConfigs, one per (preset, TP degree), dealt round-robin in the
plan's priority order: no cost of a config is known before its tactics are
counted on the GPU) on its own GPU, and puts each config's outcome into the
store as soon as it is tuned. Rank 0 gathers them (`merge_tune`, pure) in
the plan's order, as one process would have tuned them; a config a rank
did not deliver is named with the reason (the rank died, or was
interrupted). Writing the tables is `tuning.save`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from moebench.bench.merge import Job, RankReport, undelivered


@dataclass(frozen=True)
class TuneJob:
    """What every rank of a launched tune runs: the plan (tuning.plan.TunePlan),
    the wall-time budget of each rank (s, None: none), the compiling workers
    per rank (None: precompile.default_jobs()), progress(text) for the log
    lines (this process's; never sent to another)."""

    plan: object
    budget: float | None = None
    jobs: int | None = None
    progress: Callable[[str], None] | None = None

    @property
    def device(self) -> str | None:
        """The plan's --device (rank_main places the rank on its GPU)."""
        return self.plan.settings.get("device")


@dataclass
class Gathered:
    """What rank 0 gathered: (TuneConfig, TuneOutcome) of every config
    delivered, in the plan's order; one problem line per config not
    delivered (`not tuned: <preset> TP<tp> <family>: <why>`)."""

    done: list = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def tune_job(plan, budget: float | None = None, jobs: int | None = None,
             progress: Callable[[str], None] | None = None) -> Job:  # fmt: skip
    """The launch Job of a tune of `plan` over ranks (TuneJob's fields)."""
    return Job("tune", TuneJob(plan, budget, jobs, progress), tune_share, merge_tune)


def share_of(count: int, world: int) -> list[list[int]]:
    """The config indices (0..count-1) of each of `world` ranks, round-robin."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return [list(range(rank, count, world)) for rank in range(world)]


def tune_share(job: Job, rank: int, world: int, device, box) -> bool:
    """Tune rank `rank`'s share of `job` (its config a TuneJob) on `device`
    (a torch.device: its GPU, whose index the configs are given; on the CPU
    they keep the plan's), each config's outcome put into the store (`box`,
    a launch.Outbox) when tuned. Without --jobs the rank compiles with its
    part of the host's cores (precompile.default_jobs over
    LOCAL_WORLD_SIZE). False (an interrupt raises KeyboardInterrupt to
    rank_main, which tells the store)."""
    from moebench.tuning import runner
    from moebench.tuning.precompile import default_jobs

    tune: TuneJob = job.config
    configs = tune.plan.configs()
    mine = share_of(len(configs), world)[rank]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this host, sharing its cores
    if not mine:
        return False
    if device.type == "cuda":
        configs = [replace(c, device=str(device)) for c in configs]
    delivered: list[int] = []

    def deliver(config, outcome) -> None:  # tune_many calls it once per config, in the order given
        i = mine[len(delivered)]
        box.piece([{"index": i, "config": config, "outcome": outcome}])
        delivered.append(i)
        box.put("progress", len(delivered))

    runner.tune_many([configs[i] for i in mine], budget=runner.Budget(tune.budget),
                     jobs=default_jobs(local) if tune.jobs is None else tune.jobs, progress=tune.progress,
                     on_outcome=deliver)  # fmt: skip
    return False


def merge_tune(job: Job, reports: Sequence[RankReport], stopped: str | None = None) -> Gathered:
    """Gather the ranks' outcomes (RankReport pieces) of `job` (`tune_job`'s)
    in the plan's order; each config a rank did not deliver named with
    merge.undelivered's reason."""
    configs = job.config.plan.configs()
    shares = share_of(len(configs), len(reports))
    got: dict[int, tuple] = {}
    problems = []
    for report, share in zip(reports, shares):
        for piece in report.pieces:
            for item in piece["rows"]:
                got[item["index"]] = (item["config"], item["outcome"])
        missing = [i for i in share if i not in got]
        if missing:
            _, why = undelivered(report, stopped)
            names = ", ".join(f"{configs[i].preset} TP{configs[i].tp[0]} {configs[i].family}" for i in missing)
            problems.append(f"not tuned: {names}: {why}")
    return Gathered([got[i] for i in sorted(got)], problems)
