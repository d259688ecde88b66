"""`torchrun ... -m moebench tune` on the CPU: two simulated hosts on
localhost (one torchrun each, c10d rendezvous, gloo) with the tuner's
stand-in kernels and a fixed stand-in timing (tune_entry.py). The tables
rank 0 merges and writes equal a one-process tune's entry for entry; a
killed rank's configs are named as not tuned and the others' tables are
written. Each torchrun start costs seconds of imports on every rank."""

import json
import signal
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from moebench.cli import app
from moebench.kernels.table import read_table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "bench"))
from test_torchrun import ROOT, torchrun  # noqa: E402 - the sweep's two-host launcher of torchruns

ENV = {"PYTHONPATH": f"{ROOT}:{HERE}"}
SMALL = ["--hidden", "256", "--intermediate", "512", "--experts", "8", "--rows", "1,4", "--replays", "2",
         "--warmup", "0", "--repeats", "1", "--top", "2", "--layers", "2", "--jobs", "0", "--space", "ship"]  # fmt: skip


def _entries(directory: Path) -> dict:
    """{file name: {(family, stage, rows): (tactic, runner-up, µs)}} of the tables in `directory`."""
    out = {}
    for path in sorted(directory.glob("*.json")):
        table = read_table(path)
        out[path.name] = {(fp8, *key): (e.tactic.name, e.runner_up and e.runner_up.name, e.median_us)
                          for fp8 in (False, True) for key, e in table.entries_of(fp8).items()}  # fmt: skip
    return out


def test_two_hosts_tune_writes_the_tables_of_one_process(tmp_path, monkeypatch):
    """2 hosts x 2 ranks, 4 configs (2 presets x TP 2, 4): one each; both
    presets shrink to one shape class per TP, so rank 0 merges two ranks'
    tables into each file, later configs' entries winning as in one process."""
    from tune_entry import install

    args = ["tune", "--preset", "dsv41-flash,dsv4-pro", "--tp", "2,4", *SMALL]
    done = torchrun([*args, "--summary", str(tmp_path / "cluster.md")], tmp_path / "cluster", module="tune_entry",
                    env=ENV)  # fmt: skip
    assert [p.returncode for p in done] == [0, 0], "\n".join(p.stdout for p in done)
    assert "rank 2 of 4: tuned its share; rank 0 writes the tables" in done[1].stdout
    install(monkeypatch)
    one = CliRunner().invoke(app, [*args, "--summary", str(tmp_path / "one.md"), "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    merged, single = _entries(tmp_path / "cluster"), _entries(tmp_path / "one")
    assert len(single) == 2 and all(len(entries) == 4 for entries in single.values())
    assert merged == single
    gains = [json.loads((tmp_path / name).read_text()) for name in ("cluster.json", "one.json")]
    assert [[(r["preset"], r["tp"], r["rows"], r["gemm1"], r["gemm2"]) for r in g] for g in gains] == [
        [(r["preset"], r["tp"], r["rows"], r["gemm1"], r["gemm2"]) for r in gains[1]]
    ] * 2


def test_a_killed_rank_is_reported_and_the_others_tables_written(tmp_path):
    """Rank 1 (TP 4) is SIGKILLed as it starts tuning: rank 0 writes its TP-2
    table once rank 1's heartbeat is silent, names TP 4 as not tuned and why,
    and exits 1."""
    args = ["tune", "--preset", "dsv41-flash", "--tp", "2,4", *SMALL]
    done = torchrun(args, tmp_path, nproc=1, module="tune_entry",
                    env={**ENV, "MOEBENCH_TEST_DIE_TP": "4", "MOEBENCH_DEAD_AFTER_S": "4"})  # fmt: skip
    assert done[0].returncode == 1, done[0].stdout
    out = " ".join(done[0].stdout.split())
    assert "not tuned: dsv41-flash TP4 BF16: rank 1 (" in out and "died" in out, out
    (entries,) = _entries(tmp_path).values()
    assert set(entries) == {(False, s, r) for s in (1, 2) for r in (1, 4)}
    assert ",I=256," in next(tmp_path.glob("*.json")).name  # 512 / TP 2


def test_an_interrupt_writes_what_was_tuned(tmp_path):
    """Ctrl-C to both torchruns while rank 1 is in its config (TP 4) and rank
    0 has tuned its own (TP 2): rank 0 writes the TP-2 table, names TP 4 as
    not run (interrupted), exits 1."""
    markers = tmp_path / "markers"
    markers.mkdir()

    def interrupt(procs):
        deadline = time.monotonic() + 240
        while not {"rank-1", "tuned-0"} <= {p.name for p in markers.iterdir()} and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # rank 0 puts its outcome into the store right after its marker
        for p in procs:
            p.send_signal(signal.SIGINT)

    args = ["tune", "--preset", "dsv41-flash", "--tp", "2,4", *SMALL]
    done = torchrun(args, tmp_path / "tables", nproc=1, module="tune_entry", on_start=interrupt,
                    env={**ENV, "MOEBENCH_TEST_SLOW_TP": "4", "MOEBENCH_TEST_MARKERS": str(markers)})  # fmt: skip
    out = " ".join(done[0].stdout.split())
    assert done[0].returncode == 1 and "not tuned: dsv41-flash TP4 BF16: not run: interrupted" in out, out
    (entries,) = _entries(tmp_path / "tables").values()
    assert set(entries) == {(False, s, r) for s in (1, 2) for r in (1, 4)}
