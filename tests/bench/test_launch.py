"""The launch of a sweep or a step over ranks (moebench/bench/launch.py): the
merge of what the ranks delivered (pure), and `sweep --devices` on PyTorch's
elastic launch with stand-in GPUs (MOEBENCH_FAKE_GPU: the ranks run on the
CPU) and stand-in piece runners. torchrun itself: test_torchrun.py."""

import os
import pickle
import signal
import time

import pandas as pd
import pytest
from typer.testing import CliRunner

from moebench.bench import launch, run
from moebench.bench.cases import SweepConfig, expand_cases
from moebench.bench.interrupt import INTERRUPTED
from moebench.bench.merge import Job, RankReport
from moebench.bench.pipeline import case_row
from moebench.bench.shard import plan_shards
from moebench.bench.sweep_ranks import merge_sweep, sweep_job, sweep_share
from moebench.cli import app
from moebench.reports.store import read_run


def fake_runner(cases, device):
    """Stand-in for run_sweep: one ok row per case; a TP-2 piece with backend
    'die' kills the process (no cleanup, like an OOM kill)."""
    if any(c.backend == "die" and c.tp == 2 for c in cases):
        os._exit(9)
    return pd.DataFrame([case_row("sweep", c, {}, status="ok", median_us=1.0, device=device, bytes=c.rows,
                                  max_rel_err=1e-3, error=f"nvls={os.environ.get('NCCL_NVLS_ENABLE')}")
                         for c in cases])  # fmt: skip


def slow_runner(cases, device):
    """fake_runner one case at a time, 0.3 s each, keeping what it measured
    on an interrupt as run_sweep does; rank 0's first case sends SIGTERM to
    the launching process (a cancelled CI job)."""
    frames = []
    for i, c in enumerate(cases):
        try:
            if i == 1 and os.environ["RANK"] == "0":
                os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(0.3)
        except KeyboardInterrupt:
            rest = fake_runner(cases[i:], device).assign(status="skipped", error=INTERRUPTED, median_us=None)
            return pd.concat([*frames, rest], ignore_index=True)
        frames.append(fake_runner([c], device))
    return pd.concat(frames, ignore_index=True)


def _job(**over):
    kw = dict(presets=("dsv4-flash",), tp=(1, 2), rows=(1, 2), scenarios=("uniform",), backends=("a", "b"),
              device="cpu", reduced=False)  # fmt: skip
    kw.update(over)
    return sweep_job(SweepConfig(**kw))


def _delivered(job, world, rank, **end):
    """RankReport of a rank that ran its whole share with fake_runner."""
    cases = plan_shards(expand_cases(job.config, job.config.backends, reduced=False), world)[rank]
    rows = fake_runner([c for c in cases if c.backend != "die"], "cpu").to_dict("records")
    return RankReport(rank, {"host": "h0", "gpu_index": rank, "gpu_serial": f"s{rank}"}, [{"rows": rows, "info": {}}],
                      end or {"status": "done"})  # fmt: skip


def test_a_job_carries_its_rank_program_and_merge_and_travels_pickled():
    """The launcher runs what the job carries; a launched job reaches its
    ranks pickled, so both are module-level functions."""
    from moebench.bench.decode_step import merge_step, step_config, step_job, step_rank

    job = _job()
    assert (job.kind, job.run, job.merge, job.collective) == ("sweep", sweep_share, merge_sweep, False)
    step = step_job(step_config(tp=2, ranks=2, device="cpu"))
    assert (step.run, step.merge, step.collective) == (step_rank, merge_step, True)
    for launched in (job, step):
        assert pickle.loads(pickle.dumps(launched)) == launched
    with pytest.raises(TypeError, match="run must be callable"):
        Job("sweep", job.config, "sweep_share", merge_sweep)
    with pytest.raises(TypeError, match="merge must be callable"):
        Job("sweep", job.config, sweep_share, None)
    with pytest.raises(ValueError, match="kind must be a non-empty str"):
        Job("", job.config, sweep_share, merge_sweep)


def test_merge_of_two_ranks_holds_every_case_once_in_order_with_where_it_ran():
    job = _job()
    merged = merge_sweep(job, [_delivered(job, 2, 0), _delivered(job, 2, 1)])
    df = merged.frame
    cases = expand_cases(job.config, ("a", "b"), reduced=False)
    assert list(zip(df.tp, df.rows, df.backend)) == [(c.tp, c.rows, c.backend) for c in cases]
    assert (df.status == "ok").all() and set(df.launch_rank) == {0, 1}
    assert set(zip(df.launch_rank, df.gpu_index, df.gpu_serial, df.host)) == {(0, 0, "s0", "h0"), (1, 1, "s1", "h0")}
    assert merged.manifest["sharded"] and [w["error"] for w in merged.manifest["workers"]] == [None, None]


def test_merge_keeps_every_workers_groups():
    """Each worker's rotation and x-write measurements (its manifest's
    groups) stay at the top of the merged manifest, naming the worker: not
    only the first worker's."""
    job = _job()
    reports = [_delivered(job, 2, 0), _delivered(job, 2, 1)]
    for r in reports:
        r.pieces[0]["info"] = {"device": {"name": "cpu"}, "groups": [{"tp": 4 + 4 * r.rank, "x_writes": {"1": {}}}]}
    manifest = merge_sweep(job, reports).manifest
    assert [(g["tp"], g["worker"]) for g in manifest["groups"]] == [(4, 0), (8, 1)]
    assert [w["groups"] for w in manifest["worker_manifests"]] == [[{"tp": 4, "x_writes": {"1": {}}}],
                                                                   [{"tp": 8, "x_writes": {"1": {}}}]]  # fmt: skip


@pytest.mark.parametrize("end, failure, stopped, status, needle", [
    (None, "exit code 9", None, "failed", "rank 1 (h0, GPU 1) died: exit code 9"),
    (None, None, None, "failed", "rank 1 (h0, GPU 1) died: it stopped without a word"),
    ({"status": "error", "error": "RuntimeError: boom"}, None, None, "failed", "died: RuntimeError: boom"),
    ({"status": "interrupted", "signal": 15}, None, None, "skipped", INTERRUPTED),
    ({"status": "interrupted"}, None, "stopped after the 5 s timeout", "failed", "stopped after the 5 s timeout"),
])  # fmt: skip
def test_a_rank_that_did_not_deliver_leaves_its_cases_failed_or_skipped(end, failure, stopped, status, needle):
    job = _job()
    lost = RankReport(1, {"host": "h0", "gpu_index": 1}, [], end, failure)
    df = merge_sweep(job, [_delivered(job, 2, 0), lost], stopped).frame
    share = plan_shards(expand_cases(job.config, ("a", "b"), reduced=False), 2)[1]
    theirs = df[df.launch_rank == 1]
    assert len(df) == 8 and len(theirs) == len(share) and (theirs.status == status).all()
    assert theirs.error.str.contains(needle, regex=False).all(), theirs.error.tolist()
    assert (df[df.launch_rank == 0].status == "ok").all()


def test_a_step_rank0_that_died_leaves_every_tactic_of_all_failed():
    """Rank 0 delivered its 'gather' rows and died before the 'all' ones:
    a failed row for each tactic 'all' stands for (never the name 'all')."""
    from moebench.bench.decode_step import merge_step, step_cases, step_config, step_job

    cfg = step_config(presets=("dsv4-flash",), hidden=256, intermediate=256, experts=32, top_k=4, tp=2, ranks=2,
                      rows=(1, 4), backends=("torch-bf16",), tactics=("gather", "all"), device="cpu")  # fmt: skip
    cases, _ = step_cases(cfg)
    mine = [case_row("step", c, {"rank": 0}, status="ok", median_us=1.0) for c in cases if c.tactic == "gather"]
    reports = [RankReport(0, {"host": "h"}, [{"rows": mine, "info": {}}], {"status": "error", "error": "boom"}),
               RankReport(1, {"host": "h"}, [], {"status": "done"})]  # fmt: skip
    res = merge_step(step_job(cfg), reports)
    got = sorted(zip(res.frame["rows"], res.frame["tactic"], res.frame["status"]))
    assert got == sorted((c.rows, c.tactic, "ok" if c.tactic == "gather" else "failed") for c in cases)
    assert "all" not in set(res.frame["tactic"]) and len({c.tactic for c in cases}) > 1
    assert res.frame[res.frame["status"] == "failed"]["error"].str.contains("rank 0 (h) died: boom", regex=False).all()
    assert [w["error"] is None for w in res.manifest["workers"]] == [False, True]
    assert "no rank reported" in res.manifest["provenance_from"]  # no rank's environment: this process's


# ----------------------------------------------------------------- sweep --devices, launched


@pytest.fixture()
def fake_gpus(monkeypatch):
    """Two visible stand-in GPUs whose ranks run `runner` on the CPU, and
    backends 'a' / 'die' / 'slow' known to this process's registry."""
    from moebench.backends import registry

    monkeypatch.setenv(launch.FAKE_GPU_ENV, "1")
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 2)
    names = ("a", "die")
    for name in names:
        registry.register_backend(name, lambda: None)

    def use(runner):
        monkeypatch.setattr(run, "PIECE_RUNNER", runner)

    yield use
    for name in names:
        registry.unregister_backend(name)


ARGS = ["--preset", "dsv4-flash", "--tp", "1,2", "--rows", "1,2", "--scenario", "uniform", "--replays", "2"]


def test_sweep_devices_with_a_dying_rank_stores_a_complete_run(tmp_path, fake_gpus):
    fake_gpus(fake_runner)
    cli = CliRunner()
    result = cli.invoke(app, ["sweep", *ARGS, "--backends", "a,die", "--devices", "all", "--out", str(tmp_path)])
    assert result.exit_code == 1, result.output  # a rank died: said, and non-zero
    assert "worker(s) died" in result.output and "Traceback" not in result.output
    (run,) = tmp_path.iterdir()
    df, manifest = read_run(run)
    assert len(df) == 2 * 2 * 2 and not df.duplicated(["tp", "rows", "backend"]).any()
    dead = int(df[df.tp == 2].launch_rank.iloc[0])
    assert (df[df.launch_rank == dead].status == "failed").all()
    assert df[df.launch_rank == dead].error.str.contains(f"rank {dead} .* died: exit code 9").all()
    assert (df[df.launch_rank != dead].status == "ok").all()
    assert set(df[df.status == "ok"].error) == {"nvls=0"}  # NVLink multicast off in every rank
    assert set(df.gpu_index) == {0, 1} and set(df.gpu_serial) == {"fake-0", "fake-1"}
    assert manifest["sharded"] and "command" in manifest
    rep = cli.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-html"])
    assert rep.exit_code == 0, rep.output
    assert "sharded over GPUs" in (tmp_path / "rep" / "summary.md").read_text()


def test_sweep_devices_sigterm_keeps_what_the_ranks_measured(tmp_path, fake_gpus):
    """SIGTERM to `sweep --devices` (a cancelled CI job) reaches the ranks
    through the launcher: the run holds the measured cases, the rest
    skipped, the manifest interrupted, exit 143."""
    fake_gpus(slow_runner)
    args = [*ARGS[:4], "--rows", "1,2,3,4", "--scenario", "uniform", "--backends", "a"]
    result = CliRunner().invoke(app, ["sweep", *args, "--devices", "all", "--out", str(tmp_path)])
    assert result.exit_code == 143, result.output
    assert "Traceback" not in result.output
    (run,) = tmp_path.iterdir()
    df, manifest = read_run(run)
    assert manifest["interrupted"] is True and len(df) == 8
    assert set(df.status) == {"ok", "skipped"} and (df[df.status == "skipped"].error == INTERRUPTED).all()


@pytest.mark.parametrize("args, needle", [
    (["--devices", "5"], "not in [0, 2)"), (["--devices", "0,0"], "duplicates"), (["--devices", "x"], "--devices"),
    (["--devices", "0", "--device", "cpu"], "exclude each other"), (["--worker-timeout", "5"], "--worker-timeout"),
    (["--devices", "0", "--backends", "nope"], "unknown"),
])  # fmt: skip
def test_cli_sweep_devices_errors(tmp_path, fake_gpus, args, needle):
    result = CliRunner().invoke(app, ["sweep", "--rows", "1", "--tp", "1", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_cli_sweep_devices_all_without_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 0)
    result = CliRunner().invoke(app, ["sweep", "--devices", "all", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no GPU is visible" in result.output
