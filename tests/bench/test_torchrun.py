"""`torchrun ... -m moebench sweep|step` on the CPU: simulated hosts on
localhost (one torchrun per host, c10d rendezvous, gloo), reduced runs.
The merged run equals a one-process run case for case; a killed rank's
cases are stored failed; an interrupt keeps what was measured. Each torchrun
start costs seconds of imports on every rank: the runs are tiny."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.bench.launch import free_port
from moebench.bench.interrupt import INTERRUPTED
from moebench.cli import app
from moebench.reports.store import read_run, read_table

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
GEOMETRY = ["--preset", "dsv4-flash", "--hidden", "256", "--intermediate", "256", "--experts", "32", "--top-k", "4",
            "--replays", "2", "--warmup", "0", "--no-split"]  # fmt: skip
FACTS = ["preset", "tp", "rows", "scenario", "backend", "tactic", "status", "bytes", "unique_experts"]


def torchrun(args, out: Path, *, nnodes: int = 2, nproc: int = 2, module: str = "moebench", env=None,
             on_start=None) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Run `torchrun --nnodes N --nproc-per-node G -m module ARGS --out OUT`
    once per simulated host, all on localhost; on_start(procs) once started."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "OMP_NUM_THREADS": "1",
           **(env or {})}  # fmt: skip
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
         "--rdzv-conf", f"is_host={int(host == 0)}",  # the first host holds the rendezvous, as its own machine would
         "--max-restarts", "0", "-m", module, *args, "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) for host in range(nnodes)]  # fmt: skip
    if on_start is not None:
        on_start(procs)
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), p.stdout.read(), None) for p in procs]


def _facts(frame):
    return frame.sort_values(FACTS[:6]).reset_index(drop=True)


def test_two_hosts_sweep_and_step_equal_the_single_process_runs(tmp_path):
    sweep = ["sweep", *GEOMETRY, "--rows", "1,2", "--tp", "1,2", "--backends", "reference,torch-bf16"]
    done = torchrun(sweep, tmp_path / "cluster")
    assert [p.returncode for p in done] == [0, 0], "\n".join(p.stdout for p in done)
    one = CliRunner().invoke(app, [*sweep, "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    (run,) = (tmp_path / "cluster").iterdir()
    merged, manifest = read_run(run)
    single, _ = read_run(next((tmp_path / "one").iterdir()))
    assert list(merged[FACTS[:6]].itertuples(index=False)) == list(single[FACTS[:6]].itertuples(index=False))
    assert (_facts(merged)[FACTS] == _facts(single)[FACTS]).all().all()
    assert _facts(merged)["max_rel_err"].tolist() == pytest.approx(_facts(single)["max_rel_err"].tolist(), rel=1e-3)
    assert sorted(set(merged["launch_rank"])) == [0, 1, 2, 3] and (merged["host"] != "").all()
    assert manifest["sharded"] and manifest["world"] == 4 and "command" in manifest

    step = ["step", *GEOMETRY, "--rows", "1", "--tp", "4", "--backends", "torch-bf16"]
    done = torchrun(step, tmp_path / "cluster-step")
    assert [p.returncode for p in done] == [0, 0], "\n".join(p.stdout for p in done)
    local = CliRunner().invoke(app, [*step, "--out", str(tmp_path / "local-step")])
    assert local.exit_code == 0, local.output
    (run,) = (tmp_path / "cluster-step").iterdir()
    merged, _ = read_run(run)
    single, _ = read_run(next((tmp_path / "local-step").iterdir()))
    assert (_facts(merged)[FACTS] == _facts(single)[FACTS]).all().all() and (merged["status"] == "ok").all()
    assert merged["max_rel_err"].tolist() == pytest.approx(single["max_rel_err"].tolist(), rel=1e-3)
    assert sorted(read_table(run, "ranks")["rank"]) == [0, 1, 2, 3]


def test_a_killed_rank_leaves_its_cases_failed(tmp_path):
    """Rank 1 (the TP-2 group) is SIGKILLed in its prepare: rank 0 stores the
    run once rank 1's heartbeat is silent, its cases failed with the reason."""
    args = ["sweep", *GEOMETRY, "--rows", "1,2", "--tp", "1,2", "--backends", "die"]
    done = torchrun(args, tmp_path, nproc=1, module="torchrun_entry", env={"MOEBENCH_DEAD_AFTER_S": "4"})
    (run,) = tmp_path.iterdir()
    df, manifest = read_run(run)
    assert done[0].returncode == 1, done[0].stdout  # a rank died: the command fails, the run is stored
    assert len(df) == 4 and set(df[df.tp == 1].status) == {"ok"} and set(df[df.tp == 2].status) == {"failed"}
    assert df[df.tp == 2].error.str.contains("rank 1 .* died: it stopped without a word").all(), df.error.tolist()
    assert [w["error"] is None for w in manifest["workers"]] == [True, False]


def test_an_interrupt_keeps_what_every_rank_measured(tmp_path):
    """Ctrl-C to both torchruns once each rank measured its 1-row cases: the
    run keeps what was measured, the rest is skipped (INTERRUPTED), rank 0
    says so (exit 130)."""
    markers = tmp_path / "markers"
    markers.mkdir()

    def interrupt(procs):
        deadline = time.monotonic() + 240
        while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGINT)

    args = ["sweep", *GEOMETRY, "--rows", "1,2,3", "--tp", "1,2", "--backends", "slow"]
    done = torchrun(args, tmp_path / "runs", nproc=1, module="torchrun_entry",
                    env={"MOEBENCH_TEST_MARKERS": str(markers)}, on_start=interrupt)  # fmt: skip
    assert "interrupted (SIGINT)" in done[0].stdout, done[0].stdout
    (run,) = (tmp_path / "runs").iterdir()
    df, manifest = read_run(run)
    assert manifest["interrupted"] is True and len(df) == 6
    assert set(df[df.rows == 1].status) == {"ok"}  # every rank's measured cases kept
    skipped = df[df.status == "skipped"]  # a rank may finish a 2-row case before the signal lands
    assert set(df.status) == {"ok", "skipped"} and (skipped.error == INTERRUPTED).all() and (skipped.rows > 1).all()
