"""A sweep over ranks (`sweep --devices`, torchrun): the job (`sweep_job`),
each rank's share of the cases (`sweep_share`: the cost-balanced plan of
`shard.plan_shards`, run piece by piece) and the merge of what the ranks
delivered into one run (`merge_sweep`: every planned case once, in the
order one process would store them). `launch.py` runs the ranks and knows
none of this."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pandas as pd

from moebench.bench.interrupt import INTERRUPTED
from moebench.bench.merge import FAKE_GPU_ENV, CaseRunner, Job, RankReport, host_provenance, undelivered, workers_of


def sweep_job(config, devices: tuple[int, ...] | None = None, runner: CaseRunner | None = None) -> Job:
    """The Job of a sweep of `config` (a SweepConfig) over ranks: devices, the
    CUDA index of each local rank (None: LOCAL_RANK); runner: a stand-in for
    run_sweep (tests), a module-level function (cases, device) -> frame."""
    return Job("sweep", config, sweep_share, merge_sweep, devices, runner)


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


def sweep_share(job: Job, rank: int, world: int, device, box) -> bool:
    """Run rank `rank`'s share of a sweep on `device`, one (preset, tp)
    piece at a time, each put into the store (`box`, a launch.Outbox) when
    done; True when an interrupt stopped it."""
    from dataclasses import replace

    from moebench.bench.interrupt import interrupted_rows
    from moebench.bench.launch import ignore_interrupts
    from moebench.bench.shard import pieces_of, plan_shards, shard_configs

    device = str(device)
    share = plan_shards(sweep_cases(job), world)[rank]
    done = 0
    for piece in pieces_of(share):
        if job.runner is not None:
            frame, info = job.runner(piece, device), {}
        else:
            from moebench.bench.sweep import run_sweep

            frames, info = [], {}
            for cfg in shard_configs(job.config, piece):
                result = run_sweep(replace(cfg, device=device))
                frames.append(result.frame)
                info = info or result.manifest
                if result.manifest.get("interrupted"):
                    break
            frame = pd.concat(frames, ignore_index=True)
        stopped = bool(interrupted_rows(frame).any())
        if stopped:
            ignore_interrupts()
        box.piece(frame.to_dict("records"), info)
        done += len(piece)
        box.put("progress", done)
        if stopped:
            return True
    return False


def merge_sweep(job: Job, reports: Sequence[RankReport], stopped: str | None = None):
    """One sweep run (RunResult) of what the ranks delivered: each rank's
    rows; every case of its share it did not deliver stored as
    `merge.undelivered` says (an interrupt: skipped; `stopped`: the
    launcher stopped it, e.g. a timeout: failed, its interrupted rows too)."""
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
        status, error = undelivered(report, stopped)
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
    manifest = dict(infos[0]) if infos else host_provenance(config)
    manifest.update(
        kind="sweep", sharded=True, world=len(reports), workers=workers_of(reports, stopped),
        plan=[[c.label() for c in s] for s in shares], timing_methods=methods,
        timing_counts=timing_counts_used(config, methods),
        worker_manifests=[{k: m.get(k) for k in ("device", "copy_bw_gbps", "groups")} for m in infos],
    )  # fmt: skip
    if any(m.get("groups") for m in infos):  # every worker's groups (rotation, x writes), each naming its worker
        manifest["groups"] = [{**g, "worker": i} for i, m in enumerate(infos) for g in m.get("groups") or []]
    manifest.setdefault("schema", 1)
    manifest.setdefault("seed", config.seed)
    manifest.pop("interrupted", None)
    if (frame["error"] == INTERRUPTED).any():
        manifest["interrupted"] = True
        signals = [r.end.get("signal") for r in reports if r.end and r.end.get("signal")]
        if signals:
            manifest["interrupt_signal"] = signals[0]
    return RunResult(frame, manifest)
