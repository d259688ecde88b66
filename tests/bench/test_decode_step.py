"""`moebench step` (bench/decode_step.py): the config, a one-rank step and a
TP-2 step over gloo on the CPU at a small geometry, the CLI and the report;
GPU tests with our kernels (one GPU) and a real TP-2 NCCL step (two GPUs)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from moebench.backends.registry import load_backend
from moebench.bench import decode_step, pipeline
from moebench.bench.decode_step import (
    KERNEL_COLUMNS, StepConfig, rank_devices, run_step, step_config, validate_step,
)  # fmt: skip
from moebench.bench.launch import MULTICAST_OFF
from moebench.cli import app
from moebench.reference import ORACLE_TOLERANCE
from moebench.reports.store import read_run, read_table

runner = CliRunner()
#: A small geometry every path takes (the kernels too: H % 128, E % 32, I/tp % 32).
SMALL = dict(presets=("dsv4-flash",), hidden=256, intermediate=256, experts=32, top_k=4)
SMALL_ARGS = ["--preset", "dsv4-flash", "--hidden", "256", "--intermediate", "256", "--experts", "32",
              "--top-k", "4", "--replays", "2", "--warmup", "0"]  # fmt: skip


def test_step_config_validation():
    cfg = step_config(**SMALL, tp=2, ranks=2, device="cpu")
    assert cfg.tp == (2,) and cfg.ranks == 2
    with pytest.raises(ValueError, match="one TP degree"):
        StepConfig(**SMALL, tp=(1, 2))
    with pytest.raises(ValueError, match="ranks"):
        step_config(**SMALL, tp=4, ranks=2)
    with pytest.raises(ValueError, match="devices"):
        step_config(**SMALL, tp=2, ranks=2, devices=(0,))
    with pytest.raises(ValueError, match="devices"):
        step_config(**SMALL, tp=2, ranks=2, devices=(1, 1))
    assert step_config(**SMALL, tp=1, tactics=("default", "fp8")).tactics == ("default", "fp8")
    assert step_config(**SMALL, tp=1).overlap_shared is True
    with pytest.raises(TypeError, match="overlap_shared"):
        step_config(**SMALL, tp=1, overlap_shared="no")
    with pytest.raises(ValueError, match="back_to_back .* is a sweep option"):
        step_config(**SMALL, tp=1, back_to_back=True)  # a step's gate and router are its layer boundary
    with pytest.raises(ValueError, match="tp=3"):
        step_config(**SMALL, tp=3)
    with pytest.raises(ValueError, match="without a GPU the step runs a reduced geometry") as info:
        StepConfig(presets=("dsv41-flash",), tp=(3,), reduced=True)  # the step's words, not the sweep's
    assert "sweep" not in str(info.value)


def test_more_ranks_than_gpus_names_both_numbers(monkeypatch):
    monkeypatch.setattr(decode_step, "resolve_device", lambda device=None: torch.device("cuda", 0))
    monkeypatch.setattr(decode_step, "visible_gpu_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* but 1 is visible"):
        rank_devices(step_config(**SMALL, tp=2, ranks=2))


def _check_ok(frame: pd.DataFrame, stages, shared: str = "torch: the kernels need a CUDA device") -> None:
    """Every case ok and gated, its stages and paths as expected; `shared`: the
    start of every shared_path (the CPU takes the torch shared expert)."""
    assert (frame["status"] == "ok").all(), frame[["backend", "rows", "error"]].to_string()
    assert frame["shared_path"].str.startswith(shared).all(), frame["shared_path"].tolist()
    assert (frame["max_rel_err"] < ORACLE_TOLERANCE).all()
    assert (frame["median_us"] > 0).all() and (frame["step_with_gate_us"] > 0).all() and (frame["gate_us"] > 0).all()
    for _, row in frame.iterrows():
        names = stages[row["backend"]]
        got = [c for c in KERNEL_COLUMNS if not math.isnan(row[c])]
        assert got == [f"kernel_{n}_us" for n in names]
        assert row["stage_sum_us"] == pytest.approx(sum(row[c] for c in got))
        assert row["routing_path"] == ROUTING_PATHS[row["backend"]]
    assert (frame["kind"] == "step").all()


BACKEND_STAGES = {"torch-bf16": ("router", "shared", "experts", "shared_add"),
                  "reference": ("router", "shared", "experts", "shared_add"),
                  "moebench": ("front", "shared", "gemm1", "gemm2", "finalize")}  # fmt: skip
#: The routing path each backend's step takes on these layers (DeepSeek-V4 routing with a bias: the front applies).
ROUTING_PATHS = {"torch-bf16": "router", "reference": "router", "moebench": "front"}


def test_one_rank_step_on_the_cpu():
    # reference would take torch-bf16's path again (BackendStep), at ten times its cost
    cfg = step_config(**SMALL, tp=2, rows=(1, 3), scenarios=("correlated", "hot"),
                      backends=("torch-bf16", "moebench"), device="cpu", warmup=0, replays=2)  # fmt: skip
    res = run_step(cfg)
    assert res.ranks is None and res.manifest["kind"] == "step" and res.manifest["ranks"] == 1
    frame = res.frame
    assert len(frame) == 2 * 2 * 2
    ran = frame[frame["backend"] != "moebench"]
    _check_ok(ran, BACKEND_STAGES)
    assert ran["allreduce_us"].isna().all() and (ran["intermediate"] == 128).all()
    assert (ran["timing_method"] == "cpu-wallclock").all()
    skipped = frame[frame["backend"] == "moebench"]
    assert (skipped["status"] == "skipped").all() and skipped["error"].str.contains("CUDA").all()
    # Bytes = the touched experts + the shared expert + activations.
    assert (frame["bytes"] > frame["shared_bytes"]).all()
    assert set(frame[frame["scenario"] == "hot"]["unique_experts"]) <= set(range(1, 32))


def test_step_tactics_on_the_cpu():
    """Each (backend, tactic) runs, or is skipped with the sweep's reason: a
    tactic the backend does not offer, a backend that cannot run here (then
    every tactic of it); "all" = every tactic each backend offers. The stage
    split is the other tests' (--no-split here: which pairs run is the point)."""
    cfg = step_config(**SMALL, tp=2, rows=(1,), backends=("torch-bf16", "reference", "moebench"),
                      tactics=("default", "gather", "fp8"), device="cpu", warmup=0, replays=2, split=False)  # fmt: skip
    frame = run_step(cfg).frame
    pairs = [(b, t) for b in ("torch-bf16", "reference", "moebench") for t in ("default", "gather", "fp8")]
    assert list(zip(frame["backend"], frame["tactic"])) == pairs
    ok = frame[frame["status"] == "ok"]
    assert set(zip(ok["backend"], ok["tactic"])) == {("torch-bf16", "default"), ("torch-bf16", "gather"),
                                                      ("reference", "default")}  # fmt: skip
    assert (ok["max_rel_err"] < ORACLE_TOLERANCE).all() and (ok["median_us"] > 0).all()
    errors = dict(zip(zip(frame["backend"], frame["tactic"]), frame["error"]))
    assert errors[("torch-bf16", "fp8")] == "tactic 'fp8' not offered for this shape (valid: default, grouped, gather)"
    assert errors[("reference", "gather")].startswith("tactic 'gather' not offered")
    moe = frame[frame["backend"] == "moebench"]
    assert (moe["status"] == "skipped").all() and moe["error"].str.contains("CUDA").all()
    assert (frame[frame["status"] == "skipped"]["layers"] > 0).all()

    every = run_step(step_config(**SMALL, tp=2, rows=(1,), backends=("reference", "torch-bf16"), tactics=("all",),
                                 device="cpu", warmup=0, replays=2, split=False)).frame  # fmt: skip
    grouped = load_backend("torch-bf16").default_alias(None) == "grouped"  # else it names "gather"
    assert list(zip(every["backend"], every["tactic"])) == [("reference", "default"), ("torch-bf16", "default")] + (
        [("torch-bf16", "gather")] if grouped else []
    )
    assert (every["status"] == "ok").all(), every[["backend", "tactic", "error"]].to_string()


def test_a_tactic_no_selected_backend_offers_fails_before_measuring(monkeypatch):
    measured = []
    monkeypatch.setattr(decode_step, "copy_bandwidth_gbps", lambda *a, **k: measured.append(1) or 1.0)
    for ranks in (1, 2):
        cfg = step_config(**SMALL, tp=2, ranks=ranks, rows=(1,), backends=("reference", "torch-bf16"),
                          tactics=("default", "fp8"), device="cpu")  # fmt: skip
        for check in (validate_step, run_step):
            with pytest.raises(ValueError, match="--tactics") as info:
                check(cfg)
            assert "'fp8'" in str(info.value) and "torch-bf16: default, grouped, gather" in str(info.value)
    assert measured == []


def test_one_rank_moebench_step_takes_the_front_on_the_cpu(monkeypatch, tmp_path):
    """The moebench step's wiring in run_step on the CPU, with a torch stand-in
    for RoutedExpertGemm and the torch finalize: the fused front is bound to
    each layer's router, replaces router + route, and the row says so. Each
    tactic gets its own prepared layers; "tuned" without a tuning table and a
    tactic torch-bf16 does not offer are skipped with the reason."""
    from pathlib import Path

    from moebench.backends.moebench import MoebenchBackend
    from moebench.integration.step_layer import KernelStep
    from moebench.moe_output import finalize as torch_finalize

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "integration"))
    from integration_checks import FakeRoutedExpertGemm

    class StandIn(MoebenchBackend):
        capturable = False

        def unavailable_reason(self, device):
            return None

        def prepare(self, weights, shape, tactic="default"):
            prepared.append(tactic)
            return FakeRoutedExpertGemm(weights, shape.top_k)

    prepared = []
    monkeypatch.setenv("MOEBENCH_TUNING_DIR", str(tmp_path))  # no tuning table: "tuned" is skipped

    real_load = pipeline.load_backend
    monkeypatch.setattr(pipeline, "load_backend", lambda n: StandIn() if n == "moebench" else real_load(n))
    monkeypatch.setattr(decode_step, "KernelStep",
                        lambda *a, **k: KernelStep(*a, finalize_fn=torch_finalize, **k))  # fmt: skip
    # one row count (3: several tiles' worth of slots); the one-row step is test_one_rank_step_on_the_cpu's
    cfg = step_config(**SMALL, tp=2, rows=(3,), scenarios=("correlated",), backends=("moebench", "torch-bf16"),
                      tactics=("default", "fp8", "tuned"), device="cpu", warmup=0, replays=2, layers=2)  # fmt: skip
    frame = run_step(cfg).frame
    assert len(frame) == 2 * 3
    ok = frame[frame["status"] == "ok"]
    ran = [("moebench", "default"), ("moebench", "fp8"), ("torch-bf16", "default")]
    assert list(zip(ok["backend"], ok["tactic"])) == ran
    _check_ok(ok, BACKEND_STAGES)
    assert prepared == ["default", "default", "fp8", "fp8"]  # per tactic, per layer
    moe = ok[ok["backend"] == "moebench"]
    assert moe["kernel_router_us"].isna().all() and moe["kernel_route_us"].isna().all()
    skipped = frame[frame["status"] == "skipped"].set_index(["backend", "tactic"])["error"]
    assert skipped[[("moebench", "tuned")]].str.startswith("no tuning table").all()
    assert moe["kernel_tactics"].str.startswith("fp8 family (built-in); gemm1 ").all()  # the family that ran
    assert (ok[ok["backend"] == "torch-bf16"]["kernel_tactics"] == "").all()  # a backend that says nothing
    assert skipped[[("torch-bf16", "fp8")]].str.startswith("tactic 'fp8' not offered").all()
    assert skipped[[("torch-bf16", "tuned")]].str.startswith("tactic 'tuned' not offered").all()


def test_tp2_step_a_failing_rank_and_a_timeout(monkeypatch):
    # A rank that fails leaves every case failed with the reason (the launching
    # process's checks are bypassed, the ranks reject the backend name themselves).
    monkeypatch.setattr(decode_step, "validate_step", lambda config: None)
    bad = step_config(**SMALL, tp=2, ranks=2, rows=(1, 2), backends=("nope",), device="cpu", warmup=0, replays=2)
    res = run_step(bad, timeout_s=600)
    cfg = step_config(**SMALL, tp=2, ranks=2, rows=(2,), backends=("torch-bf16",), tactics=("default", "gather"),
                      device="cpu", warmup=0, replays=2)  # fmt: skip
    pairs = [("torch-bf16", "default"), ("torch-bf16", "gather")]
    assert len(res.frame) == 2 and (res.frame["status"] == "failed").all()
    assert res.frame["error"].str.contains("rank 0 .* died: ValueError: backends").all(), res.frame["error"].tolist()
    assert all(w["error"] for w in res.manifest["workers"])

    # Ranks stopped by the timeout say so (not "killed by signal 15"), for every (backend, tactic).
    res = run_step(cfg, timeout_s=0.5)
    assert (res.frame["status"] == "failed").all() and list(zip(res.frame["backend"], res.frame["tactic"])) == pairs
    assert res.frame["error"].str.contains("stopped after the 0.5 s timeout").all(), res.frame["error"].tolist()
    # no rank reported its environment: the run keeps the host's provenance (device, versions, commit)
    assert res.manifest["device"]["name"] and res.manifest["packages"] and "commit" in res.manifest
    assert "no rank reported" in res.manifest["provenance_from"]


def test_cli_step_then_report(tmp_path):
    result = runner.invoke(app, ["step", *SMALL_ARGS, "--rows", "1", "--backends", "torch-bf16",
                                 "--out", str(tmp_path), "--label", "s"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "decode step" in result.output and "excludes the gate" in result.output
    assert "need not add up" in " ".join(result.output.split())  # the CPU timings' caveat
    (run,) = list(tmp_path.iterdir())
    df, manifest = read_run(run)
    assert manifest["kind"] == "step" and "stage_timing" in manifest and "command" in manifest
    assert read_table(run, "ranks") is None
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    text = (tmp_path / "rep" / "summary.md").read_text()
    assert "## Decode step" in text and "kernel_experts_us" in text
    assert "Decode step" in (tmp_path / "rep" / "report.html").read_text()
    assert (tmp_path / "rep" / "kernels.png").is_file()
    # on by default; on the CPU the side stream is a plain call, so the path does not claim it
    assert manifest["config"]["overlap_shared"] and not df["shared_path"].str.contains("side stream").any()
    assert "- shared expert: in order: --overlap-shared, but on the CPU" in text


def test_cli_step_no_split_serial_shared_then_report(tmp_path):
    """--no-split: the whole step and the gate only (no per-stage columns, no
    stage sum, the manifest says so); --serial-shared: the shared expert in
    order, and the report says so."""
    result = runner.invoke(app, ["step", *SMALL_ARGS, "--rows", "1", "--backends", "torch-bf16", "--no-split",
                                 "--serial-shared", "--out", str(tmp_path), "--label", "s"])  # fmt: skip
    assert result.exit_code == 0, result.output
    (run,) = list(tmp_path.iterdir())
    df, manifest = read_run(run)
    assert manifest["stage_timing"] is None and manifest["config"]["split"] is False
    assert manifest["timing_methods"] == sorted(set(df["timing_method"])) and len(manifest["timing_methods"]) == 1
    assert set(manifest["timing_counts"]) == set(manifest["timing_methods"])
    row = df.iloc[0]
    assert row["status"] == "ok" and row["median_us"] > 0 and row["gate_us"] > 0
    assert all(math.isnan(row[c]) for c in KERNEL_COLUMNS) and math.isnan(row["stage_sum_us"])
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    text = (tmp_path / "rep" / "summary.md").read_text()
    assert "## Decode step" in text and "per-stage split: not timed (--no-split)" in text
    assert "stage_sum_us" not in text  # no empty column
    assert "stage timing: not timed (--no-split)" in (tmp_path / "rep" / "report.html").read_text()
    assert not manifest["config"]["overlap_shared"] and "- shared expert: in order" in text
    assert not df["shared_path"].str.contains("side stream").any(), df["shared_path"].tolist()


def test_cli_tp2_step_stores_the_ranks_and_report_renders_them(tmp_path):
    """A real TP-2 step over gloo: every (backend, tactic) on both ranks in the
    same sequence, the all-reduce timed, NVLink multicast off in each rank;
    the ranks table stored and rendered by the report."""
    result = runner.invoke(app, ["step", *SMALL_ARGS, "--rows", "2", "--tp", "2", "--backends", "torch-bf16,reference",
                                 "--tactics", "default,gather", "--out", str(tmp_path), "--timeout", "600"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 ranks on the CPU (gloo)" in result.output and "per rank" in result.output
    (run,) = list(tmp_path.iterdir())
    frame, manifest = read_run(run)
    pairs = [("torch-bf16", "default"), ("torch-bf16", "gather"), ("reference", "default"), ("reference", "gather")]
    assert list(zip(frame["backend"], frame["tactic"])) == pairs
    ran = frame[frame["status"] == "ok"]
    assert len(ran) == 3 and frame["error"].iloc[3].startswith("tactic 'gather' not offered")
    _check_ok(ran, BACKEND_STAGES)
    assert (ran["allreduce_us"] > 0).all() and (ran["allreduce_share_pct"] > 0).all()
    ranks = read_table(run, "ranks")
    for rank in (0, 1):  # every rank ran the same (backend, tactic) sequence
        mine = ranks[ranks["rank"] == rank]
        assert list(zip(mine["backend"], mine["tactic"], mine["status"])) == list(
            zip(frame["backend"], frame["tactic"], frame["status"])
        )
    workers = manifest["workers"]
    assert [w["status"] for w in workers] == ["done", "done"] and not any(w["error"] for w in workers)
    assert all(w["multicast_env"] == MULTICAST_OFF for w in workers)
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-html"])
    assert rep.exit_code == 0, rep.output
    text = (tmp_path / "rep" / "summary.md").read_text()
    assert "## Per rank" in text and "allreduce_us" in text


@pytest.mark.parametrize("args, needle", [
    (["--tp", "3"], "tp=3"), (["--devices", "0"], "--devices"), (["--timeout", "5"], "--timeout"),
    (["--rows", "9"], "--rows"), (["--backends", "nope"], "backends"), (["--tp", "0"], "--tp"),
    (["--scenario", "nope"], "scenario"), (["--label", "../x"], "label"), (["--tactics", "nope"], "--tactics"),
    (["--tactics", "fp8"], "--tactics"), (["--tactics", ","], "--tactics"),
    (["--one-rank", "--tp", "2", "--devices", "0"], "--one-rank times one rank"),
])  # fmt: skip
def test_cli_step_user_errors(tmp_path, args, needle):
    result = runner.invoke(app, ["step", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- GPU

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
def test_gpu_step_moebench_and_torch_vs_oracle_under_graphs():
    cfg = step_config(presets=("dsv4-flash",), hidden=1024, intermediate=512, experts=64, tp=1, rows=(1, 4, 8),
                      backends=("moebench", "torch-bf16"), device="cuda", layers=2, warmup=2, replays=10)  # fmt: skip
    res = run_step(cfg)
    _check_ok(res.frame, BACKEND_STAGES, shared="kernels")
    assert (res.frame["timing_method"] == "cuda-graph").all()
    assert (res.frame["layers"] == 2).all()


@pytest.mark.gpu
def test_gpu_step_full_preset_one_rank_of_tp4():
    """Both kernel families of our backend (`--tactics default,fp8`) in the whole step."""
    cfg = step_config(presets=("dsv41-flash",), tp=4, rows=(1, 8), backends=("moebench",), tactics=("default", "fp8"),
                      device="cuda", layers=2, warmup=2, replays=10)  # fmt: skip
    res = run_step(cfg)
    _check_ok(res.frame, BACKEND_STAGES, shared="kernels")
    assert list(res.frame["tactic"]) == ["default", "default", "fp8", "fp8"]
    assert (res.frame["intermediate"] == 576).all() and (res.frame["padded_intermediate"] == 640).all()


@pytest.mark.gpu
@two_gpus
def test_gpu_tp2_step_matches_the_single_gpu_oracle():
    cfg = step_config(presets=("dsv4-flash",), hidden=1024, intermediate=512, experts=64, tp=2, ranks=2,
                      rows=(1, 5, 8), backends=("moebench", "torch-bf16"), device="cuda", devices=(0, 1), layers=2,
                      warmup=2, replays=10)  # fmt: skip
    res = run_step(cfg, timeout_s=900)
    _check_ok(
        res.frame, BACKEND_STAGES, shared="kernels"
    )  # max_rel_err: the all-reduced output vs the full layer's oracle
    assert (res.frame["allreduce_us"] > 0).all() and (res.frame["timing_method"] == "cuda-graph").all()
    assert sorted(set(res.ranks["gpu_index"])) == [0, 1] and (res.ranks["status"] == "ok").all()
    workers = res.manifest["workers"]
    assert all(w["multicast_env"] == MULTICAST_OFF and w["status"] == "done" for w in workers)


def test_a_terminated_tp_step_stops_its_ranks_and_removes_its_scratch(tmp_path):
    """SIGTERM to `moebench step --tp 2` (a CI job cancelled, `timeout`) left
    the rank processes' scratch directory behind; the ranks are now stopped
    and the scratch removed, as on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "moebench", "step", *SMALL_ARGS, "--tp", "2", "--rows", "1-8",
           "--backends", "reference", "--out", str(tmp_path / "runs")]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(children) < 2 and proc.poll() is None:
        time.sleep(0.2)
        with contextlib.suppress(OSError):
            children = {int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()}
    assert list(tmp_path.glob("moebench-launch-*")) and len(children) >= 2, proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert not list(tmp_path.glob("moebench-launch-*"))

    def running(pid: int) -> bool:  # a zombie awaiting its new parent has stopped
        with contextlib.suppress(FileNotFoundError):
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        return False

    deadline = time.monotonic() + 10  # a process being torn down reads "R" for a moment
    while any(map(running, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if running(pid)]


def test_a_tp_step_checks_the_replay_trace_before_starting_its_ranks(tmp_path):
    """`step --tp 2 --scenario replay` with a bad --trace started both ranks,
    which died on it, and stored a run of failed cases (exit 1); it is now the
    usage error `--tp 1` gives (exit 2), and nothing is stored."""
    import numpy as np

    plain = tmp_path / "ids.npy"
    np.save(plain, np.zeros((2, 8, 4), dtype=np.int64))  # numpy.save: not an .npz archive
    for trace, why in ((tmp_path / "missing.npz", "No such file"), (plain, "not an .npz archive")):
        result = runner.invoke(app, ["step", *SMALL_ARGS, "--rows", "1", "--tp", "2", "--scenario", "replay",
                                     "--trace", str(trace), "--out", str(tmp_path / "runs")])  # fmt: skip
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and f"--trace {trace}" in message and why in message, result.output
        assert not (tmp_path / "runs").exists()


def test_an_interrupted_step_keeps_the_cases_it_measured():
    """One rank in this process: Ctrl-C keeps the measured cases, the rest
    are skipped with the reason, and the manifest says so."""
    from moebench.bench.interrupt import INTERRUPTED

    def progress(done, total, label, status):
        if done == 1:
            raise KeyboardInterrupt

    cfg = step_config(**SMALL, tp=1, rows=(1, 2, 3), backends=("torch-bf16",), device="cpu", warmup=0, replays=2)
    res = run_step(cfg, progress=progress)
    assert res.manifest["interrupted"] is True
    assert list(res.frame["status"]) == ["ok", "skipped", "skipped"]
    assert (res.frame["error"].iloc[1:] == INTERRUPTED).all()


def test_a_terminated_sweep_stores_what_it_measured(tmp_path):
    """SIGTERM (a CI job cancelled, `timeout`) to `moebench sweep`: the run
    is stored with the cases measured so far, and the exit code is 143."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [a for a in SMALL_ARGS if a not in ("--replays", "2")] + ["--replays", "20"]  # ~9 s of cases
    cmd = [sys.executable, "-m", "moebench", "sweep", *args, "--tp", "1,2,4,8", "--rows", "1-8",
           "--backends", "torch-bf16,reference", "--out", str(tmp_path / "runs"), "--label", "t"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(6)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    if proc.returncode == 0:
        pytest.skip("the sweep finished before the signal")
    assert proc.returncode == 128 + signal.SIGTERM, out
    if "interrupted before any case was measured" in out:
        pytest.skip("the signal came before the first case (a slow machine)")
    (run,) = (tmp_path / "runs").iterdir()
    df, manifest = read_run(run)
    assert manifest["interrupted"] is True and len(df) == 2 * 4 * 8
    assert "interrupted (SIGTERM)" in " ".join(out.split()) and json.dumps(manifest)
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-html"])
    assert rep.exit_code == 0 and "**interrupted**" in (tmp_path / "rep" / "summary.md").read_text(), rep.output
