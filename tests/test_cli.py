import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.backends.registry import load_backend
from moebench.cli import app
from moebench.reports.outdir import REPORT_RECORD

runner = CliRunner()
TINY = ["--preset", "dsv4-flash", "--hidden", "128", "--intermediate", "64", "--experts", "8", "--top-k", "2",
        "--tp", "1", "--rows", "1,2", "--scenario", "uniform", "--replays", "2", "--warmup", "0"]  # fmt: skip


def test_presets():
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0, result.output
    for name in ("dsv41-flash", "dsv4-flash", "dsv4-pro"):
        assert name in result.output
    assert "640" in result.output  # dsv41 TP4 padding 576 -> 640


def test_env_lists_backends_with_reasons():
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    assert "torch-bf16" in result.output and "flashinfer-w4a16" in result.output


def test_sweep_then_report(tmp_path):
    result = runner.invoke(app, ["sweep", *TINY, "--out", str(tmp_path), "--label", "tiny"])
    assert result.exit_code == 0, result.output
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-tiny")
    assert (runs[0] / "results.parquet").is_file() and (runs[0] / "manifest.json").is_file()
    assert "CPU" in result.output and str(runs[0]) in result.output.replace("\n", "")

    out = tmp_path / "out"
    rep = runner.invoke(app, ["report", str(runs[0]), "--out", str(out)])
    assert rep.exit_code == 0, rep.output
    text = (out / "summary.md").read_text()
    assert "torch-bf16" in text and "reference" in text
    again = runner.invoke(app, ["report", str(runs[0]), "--out", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    assert runner.invoke(app, ["report", str(runs[0]), "--out", str(out), "--force"]).exit_code == 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--rows", "9"], "--rows"),
        (["--rows", "a-b"], "--rows"),
        (["--tp", "5"], "tp=5"),
        (["--scenario", "nope"], "scenario"),
        (["--backends", "nope"], "backends"),
        (["--label", "../x"], "label"),
        (["--tactics", "nope"], "--tactics"),
        (["--device", "foo"], "'cuda[:N]'"),
        (["--tp", "3"], "reduced geometry"),
    ],
)
def test_sweep_user_errors_exit_2_with_one_line(tmp_path, args, needle):
    result = runner.invoke(app, ["sweep", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_report_of_missing_run(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "none")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_python_dash_m_entry_point_exists():
    assert (Path(__file__).resolve().parents[1] / "moebench" / "__main__.py").is_file()


def test_a_ctrl_c_while_the_command_starts_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C in the seconds `moebench` spends importing torch printed a traceback from inside the import:
    the command's entry point (`moebench` and `python -m moebench` alike) says it in one line, exit 130."""
    import sys
    import tomllib

    from moebench import __main__ as entry

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts["moebench"] == "moebench.__main__:main"

    class Interrupted:  # an import finder that is interrupted where the CLI's imports would be
        def find_spec(self, name, path=None, target=None):
            if name == "moebench.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "moebench.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C) while moebench was starting\n"


def test_check_passes_on_cpu():
    result = runner.invoke(app, ["check", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "pass" in result.output and "FAIL" not in result.output
    assert "route record" in result.output and "torch-bf16" in result.output


def test_check_exits_1_on_a_failing_item(monkeypatch):
    from moebench.bench import selfcheck

    monkeypatch.setattr(selfcheck, "_record_invariants", lambda: (_ for _ in ()).throw(AssertionError("bad")))
    result = runner.invoke(app, ["check", "--device", "cpu"])
    assert result.exit_code == 1 and "FAIL" in result.output


# ----------------------------------------------------------------------------- tune / report --baseline


def _stored_run(root, label, medians, *, device="NVIDIA H200", failed_rows=(), spread=0.01, manifest_extra=None):
    """A stored run with one moebench case per rows (tight 1 % spread unless
    told; manifest_extra: e.g. a step run's kind and ranks)."""
    import math

    import pandas as pd

    from moebench.reports.store import REQUIRED_COLUMNS, write_run

    rows = []
    for r, us in medians.items():
        failed = r in failed_rows
        row = dict.fromkeys(REQUIRED_COLUMNS)
        row.update(preset="dsv41-flash", hidden=5120, intermediate=576, experts=384, top_k=6, tp=4, rows=r,
                   scenario="correlated", backend="moebench", tactic="default",
                   status="failed" if failed else "ok", error="rel. error 0.4 exceeds 0.01" if failed else "",
                   median_us=math.nan if failed else us, p10_us=math.nan if failed else us * (1 - spread),
                   p90_us=math.nan if failed else us * (1 + spread), unique_experts=6 * r, bytes=28_000_000 * r,
                   gbps=1000.0, pct_copy_bw=25.0, pct_size_ceiling=math.nan, max_rel_err=1e-3, device=device,
                   sm_count=132, commit="abc")  # fmt: skip
        if (manifest_extra or {}).get("kind") == "step":
            row.update(ranks=manifest_extra.get("ranks", 1), step_with_gate_us=us + 2.0, gate_us=2.0,
                       allreduce_us=math.nan, allreduce_share_pct=math.nan, stage_sum_us=us)  # fmt: skip
        rows.append(row)
    manifest = {"device": {"name": device, "sm_count": 132}, "copy_bw_gbps": 4000.0, "reduced": False,
                **(manifest_extra or {})}  # fmt: skip
    return write_run(
        pd.DataFrame(rows).reindex(columns=list(dict.fromkeys([*REQUIRED_COLUMNS, *rows[0]])))
        if rows
        else pd.DataFrame(columns=list(REQUIRED_COLUMNS)),
        manifest,
        root=root,
        label=label,
    )


def test_tune_without_a_gpu_fails_with_one_red_line(tmp_path):
    result = runner.invoke(app, ["tune", "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs an sm_90 GPU" in lines[0] and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_tune_fp8_without_a_gpu_fails_with_one_red_line(tmp_path):
    result = runner.invoke(app, ["tune", "--fp8", "--space", "ship", "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs an sm_90 GPU" in lines[0] and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []
    assert "--fp8" in runner.invoke(app, ["tune", "--help"]).output


@pytest.mark.parametrize("args, needle", [(["--space", "huge"], "--space"), (["--rows", "0"], "--rows"),
                                          (["--tp", "5"], "tp=5"), (["--stages", "3"], "--stages"),
                                          (["--fp8", "--space", "huge"], "--space"),
                                          (["--fp8", "--rows", "9"], "--rows")])  # fmt: skip
def test_tune_user_errors_exit_2(tmp_path, args, needle):
    result = runner.invoke(app, ["tune", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output


def test_report_baseline_fail_above_exit_codes(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    same = _stored_run(tmp_path / "runs", "same", {1: 20.1, 6: 39.0})
    slow = _stored_run(tmp_path / "runs", "slow", {1: 20.0, 6: 46.0})
    ok = runner.invoke(app, ["report", str(same), "--baseline", str(base), "--fail-above", "5%",
                             "--out", str(tmp_path / "r1")])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "faster" in ok.output and (tmp_path / "r1" / "report.html").is_file()
    assert (tmp_path / "r1" / "compare.png").read_bytes().startswith(b"\x89PNG")
    assert "Comparison" in (tmp_path / "r1" / "summary.md").read_text()

    bad = runner.invoke(app, ["report", str(slow), "--baseline", str(base), "--fail-above", "5%",
                              "--out", str(tmp_path / "r2")])  # fmt: skip
    assert bad.exit_code == 1 and "slower than the baseline by more than 5 %" in bad.output
    assert "### Regressions (1)" in (tmp_path / "r2" / "summary.md").read_text()
    lenient = runner.invoke(app, ["report", str(slow), "--baseline", str(base), "--fail-above", "20%",
                                  "--out", str(tmp_path / "r3")])  # fmt: skip
    assert lenient.exit_code == 0, lenient.output
    no_gate = runner.invoke(app, ["report", str(slow), "--baseline", str(base), "--out", str(tmp_path / "r4")])
    assert no_gate.exit_code == 0 and "slower" in no_gate.output


def test_report_failed_case_is_a_regression(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0}, failed_rows=(6,))
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    assert result.exit_code == 1 and "failed" in result.output
    assert not (tmp_path / "r" / "report.html").exists()


def test_report_case_ok_in_the_baseline_but_not_timed_now_fails_the_gate(tmp_path):
    """A case timed in the baseline that is skipped or absent now (a backend that stopped running) is
    "lost": exit 1 naming the cases and why, shown in the summary and the HTML; new cases stay informational."""
    import pandas as pd

    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 2: 30.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.0, 2: 30.0, 7: 45.0})  # rows 6 gone, rows 7 new
    df = pd.read_parquet(cur / "results.parquet")
    df.loc[df["rows"] == 2, ["status", "error", "median_us", "p10_us", "p90_us"]] = [
        "skipped",
        "flashinfer not installed",
        float("nan"),
        float("nan"),
        float("nan"),
    ]
    df.to_parquet(cur / "results.parquet", index=False)
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r")])  # fmt: skip
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "2 case(s) ok in the baseline were not timed in this run (lost)" in message
    assert (
        "moebench dsv41-flash TP4 rows 2 correlated default (skipped in this run (flashinfer not installed);"
        " ok in the baseline)" in message
    )
    assert "rows 6 correlated default (not in this run; ok in the baseline)" in message and "rows 7" not in message
    assert "1 same, 2 lost, 1 new" in message
    text = (tmp_path / "r" / "summary.md").read_text()
    assert "### Regressions (2)" in text and "2 lost" in text
    assert 'class="lost"' in (tmp_path / "r" / "report.html").read_text()
    new_only = _stored_run(tmp_path / "runs", "more", {1: 20.0, 2: 30.0, 6: 40.0, 7: 45.0})  # a new case: a pass
    ok = runner.invoke(app, ["report", str(new_only), "--baseline", str(base), "--fail-above", "5%",
                             "--out", str(tmp_path / "r2"), "--no-html"])  # fmt: skip
    assert ok.exit_code == 0 and "1 new" in ok.output, ok.output


def test_report_of_runs_timed_with_too_few_replays_is_unclear_not_a_false_alarm(tmp_path):
    """Two --replays 1 runs of the same code (p10 = p90 = median: noise 0 %) were judged "slower by 28 %"
    (exit 1); the cases are now unclear for too few replays, and a gate that judged nothing exits 2."""
    one = {"timing_methods": ["cuda-events"], "timing_counts": {"cuda-events": {"warmup": 0, "replays": 1}}}
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0}, spread=0.0, manifest_extra=one)
    cur = _stored_run(tmp_path / "runs", "cur", {1: 25.6, 6: 40.0}, spread=0.0, manifest_extra=one)
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "slower than the baseline" not in message and "2 unclear" in message
    assert "no case could be judged" in message and "2 timed with fewer than 10 replays" in message
    assert "too few replays to judge" in (tmp_path / "r" / "summary.md").read_text()


def test_report_of_real_cpu_sweeps_says_cpu_timings_cannot_gate(tmp_path):
    """Two CPU sweeps: one line says CPU timings cannot gate (exit 2, never a pass; with or without
    --fail-above), and the cases' notes, from the manifests' timing_counts, say how few replays timed them."""
    runs = []
    for label in ("one", "two"):
        result = runner.invoke(app, ["sweep", *TINY, "--backends", "torch-bf16", "--out", str(tmp_path / "runs"),
                                     "--label", label])  # fmt: skip  # TINY: --replays 2
        assert result.exit_code == 0, result.output
        runs.append(next((tmp_path / "runs").glob(f"*-{label}")))
    for n, gate in enumerate((["--fail-above", "5%"], [])):
        result = runner.invoke(app, ["report", str(runs[1]), "--baseline", str(runs[0]), *gate,
                                     "--out", str(tmp_path / f"r{n}"), "--no-html"])  # fmt: skip
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and "CPU timings cannot gate" in message, result.output
        assert "slower" not in message.split("verdicts:")[1] and "faster" not in message.split("verdicts:")[1]
        assert "replays 2 in this run, 2 in the baseline" in (tmp_path / f"r{n}" / "summary.md").read_text()


def test_report_of_a_run_timed_another_way_is_not_judged_slower(tmp_path):
    """A --no-graph run (cuda-events) against a CUDA-graph baseline was judged slower (exit 1): now each
    case is a mismatch naming both timing methods, and a gate that compared nothing exits 2."""
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0}, manifest_extra={"timing_methods": ["cuda-graph"]})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 26.0, 6: 50.0}, manifest_extra={"timing_methods": ["cuda-events"]})
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "slower than the baseline" not in message and "2 mismatch" in message
    assert "timed with cuda-events vs cuda-graph" in message
    assert "timed with cuda-events vs cuda-graph" in (tmp_path / "r" / "summary.md").read_text()


def test_report_other_device_is_reported_not_compared(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0}, device="NVIDIA H100 80GB HBM3")
    cur = _stored_run(tmp_path / "runs", "cur", {1: 40.0})
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r")])  # fmt: skip
    assert result.exit_code == 2 and "another device" in result.output and "H100" in result.output
    assert "mismatch" in (tmp_path / "r" / "summary.md").read_text()


@pytest.mark.parametrize("gate", [["--fail-above", "5%"], []])
def test_report_against_an_empty_baseline_is_an_error_not_a_pass(tmp_path, gate):
    base = _stored_run(tmp_path / "runs", "empty", {})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0})
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), *gate, "--out", str(tmp_path / "r"),
                                 "--no-html"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "holds no cases" in result.output and "Traceback" not in result.output
    text = (tmp_path / "r" / "summary.md").read_text()
    assert "**error**" in text and "not a pass" in text and "No regressions" not in text


def test_report_with_nothing_in_common_is_an_error(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0})
    cur = _stored_run(tmp_path / "runs", "cur", {6: 40.0})
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    assert result.exit_code == 2 and "no case could be compared" in result.output
    assert "1 new" in result.output and "1 lost" in result.output


def test_report_option_errors(tmp_path):
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    assert runner.invoke(app, ["report", str(run), "--fail-above", "5%"]).exit_code == 2
    bad = runner.invoke(app, ["report", str(run), "--baseline", str(run), "--fail-above", "lots"])
    assert bad.exit_code == 2 and "--fail-above must be a percentage" in bad.output
    gone = runner.invoke(app, ["report", str(run), "--baseline", str(tmp_path / "nope")])
    assert gone.exit_code == 2 and "does not exist" in gone.output
    # an --out that cannot be created: exit 2 before any table, never the regression code 1
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        out = ro / "report"
        import os

        if os.access(ro, os.W_OK):  # root ignores the mode: use a path no one can create
            out = Path("/proc/moebench-cannot-create")
        result = runner.invoke(
            app, ["report", str(run), "--baseline", str(run), "--fail-above", "5", "--out", str(out)]
        )
        assert result.exit_code == 2 and "--out: cannot create" in result.output, result.output
        assert "wrote" not in result.output and not out.exists()
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("cur_extra, base_extra, needle", [
    ({"kind": "step", "ranks": 2}, {}, "run kind: step vs baseline sweep"),  # step TP2 vs a sweep
    ({}, {"kind": "step", "ranks": 2}, "run kind: sweep vs baseline step"),
    ({"kind": "step", "ranks": 2}, {"kind": "step", "ranks": 1}, "ranks: 2 vs baseline 1"),  # vs --one-rank
])  # fmt: skip
def test_report_other_run_kind_or_ranks_is_reported_not_compared(tmp_path, cur_extra, base_extra, needle):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0}, manifest_extra=base_extra)
    cur = _stored_run(tmp_path / "runs", "cur", {1: 40.0, 6: 80.0}, manifest_extra=cur_extra)
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert needle in result.output and "--baseline" in result.output and "not compared" in result.output
    assert "slower than the baseline" not in result.output and "tactics differ" not in result.output
    assert "only the" not in result.output  # no key hint: the runs differ as a whole
    text = (tmp_path / "r" / "summary.md").read_text()
    assert "**mismatch**" in text and "No regressions" not in text


def test_report_where_every_case_is_unclear_is_an_error_not_a_pass(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    noisy = _stored_run(tmp_path / "runs", "noisy", {1: 20.5, 6: 41.0}, spread=0.3)
    result = runner.invoke(app, ["report", str(noisy), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    assert result.exit_code == 2 and "no case could be judged" in result.output
    message = " ".join(result.output.split())
    assert "regressions are not ruled out" in message and message.count("unclear (") == 1  # said once, not twice
    assert "No regressions" not in (tmp_path / "r" / "summary.md").read_text()


def test_report_with_some_unclear_cases_says_regressions_are_not_ruled_out(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.0, 6: 40.0})
    noisy = _stored_run(tmp_path / "runs", "noisy", {6: 41.0}, spread=0.3)
    # one tight case, one noisy one: the noisy run's rows 6 joins the tight rows 1
    import pandas as pd

    df = pd.concat([pd.read_parquet(cur / "results.parquet").iloc[:1], pd.read_parquet(noisy / "results.parquet")])
    df.to_parquet(cur / "results.parquet", index=False)
    result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--fail-above", "5%",
                                 "--out", str(tmp_path / "r"), "--no-html"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "1 case unclear" in result.output and "regressions not ruled out" in result.output
    text = (tmp_path / "r" / "summary.md").read_text()
    assert "No regressions." not in text and "1 case unclear" in text


def test_report_refuses_to_replace_any_file_it_writes(tmp_path):
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.1, 6: 39.0})
    out = tmp_path / "r"
    args = ["report", str(cur), "--baseline", str(base), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    (out / "summary.md").unlink()
    (out / "report.html").unlink()
    plots = {p.name: p.read_bytes() for p in out.iterdir() if p.name != REPORT_RECORD}
    assert {"latency.png", "bandwidth.png", "compare.png"} <= set(plots)
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--force" in again.output
    for name in plots:
        assert name in again.output.replace("\n", "")
    assert not (out / "summary.md").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != REPORT_RECORD} == plots
    assert "vs baseline" not in again.output  # refused before any work
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0 and (out / "summary.md").is_file()


def test_report_of_a_run_with_corrupt_fields_names_the_file(tmp_path):
    """A manifest whose device / packages is not an object, a results column
    of strings, a ranks table without its rank column: exit 2 naming the
    file, no traceback (and never 1, the regression code)."""
    import json

    import pandas as pd

    for n, (what, needle) in enumerate([
        ("device", "'device' must be a JSON object"), ("packages", "'packages' must be a JSON object"),
        ("median", "column 'median_us' must be numeric"), ("ranks", "lacks the 'rank' column"),
        ("reduced", "'reduced' must be true or false, got \"no\""),
    ]):  # fmt: skip
        run = _stored_run(tmp_path / f"runs{n}", "x", {1: 20.0})
        manifest = json.loads((run / "manifest.json").read_text())
        if what in ("device", "packages", "reduced"):
            manifest[what] = {"device": "cpu", "packages": ["torch"], "reduced": "no"}[what]
            (run / "manifest.json").write_text(json.dumps(manifest))
        elif what == "median":
            df = pd.read_parquet(run / "results.parquet")
            df["median_us"] = df["median_us"].astype(str)
            df.to_parquet(run / "results.parquet")
        else:
            pd.DataFrame({"x": [1]}).to_parquet(run / "ranks.parquet")
        result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / f"out{n}")])
        assert result.exit_code == 2 and needle in result.output, (what, result.output)
        assert "Traceback" not in result.output
        if what == "reduced":
            assert "manifest.json" in result.output.replace("\n", "")


def test_report_no_html_says_an_older_report_html_is_left(tmp_path):
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").write_text("the user's own page")
    result = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-html"])
    assert result.exit_code == 0 and "is not this report's (--no-html leaves it" in " ".join(result.output.split())
    assert (out / "report.html").read_text() == "the user's own page"
    earlier = tmp_path / "earlier"
    assert runner.invoke(app, ["report", str(run), "--out", str(earlier)]).exit_code == 0
    (earlier / "summary.md").unlink()
    result = runner.invoke(app, ["report", str(run), "--out", str(earlier), "--no-html"])
    assert result.exit_code == 0 and "is an earlier report's (--no-html leaves it" in " ".join(result.output.split())


def test_report_run_that_is_a_file_or_out_that_is_a_file(tmp_path):
    import pandas as pd

    afile = tmp_path / "afile"
    afile.write_text("mine")
    result = runner.invoke(app, ["report", str(afile)])
    assert result.exit_code == 2 and "is not a directory" in result.output and "does not exist" not in result.output
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    result = runner.invoke(app, ["report", str(run), "--baseline", str(afile)])
    assert result.exit_code == 2 and "--baseline" in result.output and "is not a directory" in result.output
    for out in (afile, afile / "sub"):
        result = runner.invoke(app, ["report", str(run), "--out", str(out)])
        assert result.exit_code == 2 and "--out" in result.output and "not a directory" in result.output
        assert "moebench" not in result.output and "Errno" not in result.output and "Traceback" not in result.output
    assert afile.read_text() == "mine" and not (run / "summary.md").exists()
    step = _stored_run(tmp_path / "runs", "step", {1: 20.0}, manifest_extra={"kind": "step"})
    pd.read_parquet(step / "results.parquet").drop(columns=["gate_us"]).to_parquet(step / "results.parquet")
    result = runner.invoke(app, ["report", str(step)])
    assert result.exit_code == 2 and "RUN_DIR" in result.output and "gate_us" in result.output


def test_report_out_that_is_or_is_inside_a_run_directory_is_refused(tmp_path):
    """--out naming another stored run (the baseline, a folder inside a run,
    a link to one) would mix report files into that run: exit 2 naming
    --out, and the runs are left as they are. --out RUN_DIR itself, or a
    folder inside it, is refused too: a report never writes into its run."""
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.1})
    (tmp_path / "link").symlink_to(base)
    before = {run: sorted(p.name for p in run.rglob("*")) for run in (base, cur)}
    for out in (base, base / "report", tmp_path / "runs" / "x" / ".." / base.name,
                tmp_path / "link" / "r"):  # fmt: skip
        result = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--out", str(out)])
        assert result.exit_code == 2, (out, result.output)
        assert "--out" in result.output and "a stored run directory" in result.output, result.output
        assert "wrote" not in result.output and "Traceback" not in result.output
    assert {run: sorted(p.name for p in run.rglob("*")) for run in (base, cur)} == before
    result = runner.invoke(app, ["report", str(cur), "--out", str(base)])
    assert result.exit_code == 2 and "without --out the report goes beside RUN_DIR" in result.output.replace("\n", " ")
    for out in (cur, cur / "a" / "b"):  # RUN_DIR itself or a folder in it: the help says "never into the run"
        same = runner.invoke(app, ["report", str(cur), "--out", str(out)])
        assert same.exit_code == 2 and "--out" in same.output and "never writes into the run" in same.output
    with pytest.MonkeyPatch.context() as mp:  # the same, spelled from inside it (Path(".").parent is ".")
        mp.chdir(cur)
        here = runner.invoke(app, ["report", str(cur), "--out", "."])
    assert here.exit_code == 2 and "RUN_DIR itself" in here.output, here.output
    assert {run: sorted(p.name for p in run.rglob("*")) for run in (base, cur)} == before
    ok = runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--out", str(tmp_path / "runs" / "r")])
    assert ok.exit_code == 0, ok.output  # beside the runs is fine


def test_report_without_out_writes_beside_the_run_not_into_it(tmp_path):
    """A committed run directory stays as committed: without --out the report
    goes to RUN_DIR's sibling <run>-report, with the rules of --out (refused
    over an earlier report unless --force; the record beside it)."""
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    before = sorted(p.name for p in run.iterdir())
    beside = run.with_name(run.name + "-report")
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run.iterdir()) == before
    assert all((beside / name).is_file() for name in ("summary.md", "report.html", REPORT_RECORD))
    assert str(beside / "summary.md") in result.output.replace("\n", "")
    again = runner.invoke(app, ["report", str(run)])
    assert again.exit_code == 2 and "default report directory" in again.output and "--force" in again.output
    assert runner.invoke(app, ["report", str(run), "--force"]).exit_code == 0
    with pytest.MonkeyPatch.context() as mp:  # RUN_DIR spelled '.': still its sibling, by name
        mp.chdir(run)
        here = runner.invoke(app, ["report", ".", "--force"])
    assert here.exit_code == 0 and sorted(p.name for p in run.iterdir()) == before, here.output
    blocked = _stored_run(tmp_path / "runs", "y", {1: 20.0})
    blocked.with_name(blocked.name + "-report").write_text("a file in the way")
    result = runner.invoke(app, ["report", str(blocked)])
    assert result.exit_code == 2 and "default report directory" in result.output and "not a directory" in result.output


def test_a_refused_report_creates_no_out_directory(tmp_path):
    """Every usage error is found before --out (or a missing parent of it)
    is created."""
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    for n, args in enumerate([
        [str(run), "--baseline", str(run), "--fail-above", "lots"],
        [str(run), "--fail-above", "5%"],  # needs --baseline
        [str(run), "--baseline", str(tmp_path / "nope")],
        [str(tmp_path / "no-such-run")],
        [str(run), "--baseline", str(run / "results.parquet")],
    ]):  # fmt: skip
        out = tmp_path / "new" / f"out{n}"
        result = runner.invoke(app, ["report", *args, "--out", str(out)])
        assert result.exit_code == 2, (args, result.output)
        assert not (tmp_path / "new").exists(), args


def test_report_force_removes_the_files_of_an_earlier_report_it_does_not_write(tmp_path):
    """--force over an earlier report: its plots that the new report does not
    draw (compare.png without --baseline; every plot of a run whose cases
    were all skipped; report.html with --no-html) are removed, anything
    else in --out is left alone."""
    import pandas as pd

    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.1, 6: 39.0})
    out = tmp_path / "r"
    out.mkdir()
    mine = {"notes.txt": "mine", "figure.png": "mine too"}
    for name, text in mine.items():
        (out / name).write_text(text)
    assert runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--out", str(out)]).exit_code == 0
    assert (out / "compare.png").is_file()
    result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert not (out / "compare.png").exists() and (out / "latency.png").is_file()
    assert "compare.png" not in (out / "report.html").read_text()

    skipped = _stored_run(tmp_path / "runs", "skipped", {1: 20.0})
    df = pd.read_parquet(skipped / "results.parquet")
    df = df.assign(status="skipped", median_us=float("nan"), p10_us=float("nan"), p90_us=float("nan"))
    df.to_parquet(skipped / "results.parquet", index=False)
    result = runner.invoke(app, ["report", str(skipped), "--out", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(["summary.md", "report.html", REPORT_RECORD, *mine])
    result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force", "--no-html"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(["summary.md", REPORT_RECORD, *mine])
    assert {name: (out / name).read_text() for name in mine} == mine

    # files that only share a report file's name, with no record of an earlier report, are the user's:
    # --force overwrites what this report writes and removes nothing else (a user's report.html too)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("summary.md", "report.html", "compare.png", "speedup.png", "kernels.png"):
        (theirs / name).write_text("mine")
    result = runner.invoke(app, ["report", str(cur), "--out", str(theirs), "--force"])
    assert result.exit_code == 0 and "removed" not in result.output, result.output
    assert all((theirs / n).read_text() == "mine" for n in ("compare.png", "speedup.png", "kernels.png"))


def test_sweep_tactics_all_expands_per_backend(tmp_path):
    args = [a for a in TINY if a not in ("--rows", "1,2")] + ["--rows", "1"]
    result = runner.invoke(app, ["sweep", *args, "--backends", "torch-bf16", "--tactics", "all",
                                 "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    import pandas as pd

    df = pd.read_parquet(next(tmp_path.iterdir()) / "results.parquet")
    # "default" only names "grouped" (or "gather" without torch._grouped_mm): that kernel is timed once, as
    # "default", so a baseline recorded with --tactics all matches a run with the default tactic
    alias = load_backend("torch-bf16").default_alias(None)
    assert list(df["tactic"]) == (["default", "gather"] if alias == "grouped" else ["default"])

    # listed by hand, too
    result = runner.invoke(app, ["sweep", *args, "--backends", "torch-bf16", "--tactics", f"{alias},default,default",
                                 "--out", str(tmp_path / "listed")])  # fmt: skip
    assert result.exit_code == 0, result.output
    df = pd.read_parquet(next((tmp_path / "listed").iterdir()) / "results.parquet")
    assert list(df["tactic"]) == ["default"]


@pytest.mark.parametrize("command", [[], ["sweep"], ["step"], ["report"], ["tune"], ["check"], ["env"]])
def test_help_shows_plain_flags_as_flags(command):
    """`--warm-l2 <bool>` read as if the flag took a value (`--warm-l2 true` is refused): a flag shows no type,
    an option that takes a value keeps its own."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "--help" in result.output and "<bool>" not in result.output, result.output
    if command in (["sweep"], ["step"]):
        assert "--warm-l2" in result.output and "<int>" in result.output
        flag = next(line for line in result.output.splitlines() if "--warm-l2 " in line)
        assert "Time one" in flag and "<" not in flag


def test_experts_help_and_check_say_what_the_gpu_kernels_take():
    """`--experts` said "at most 512", yet the GPU kernels refuse E = 144 that a CPU run takes: the help of
    every command with --experts and `moebench check` say it, with the multiple the kernels check."""
    from moebench.formats import generate_expert_weights
    from moebench.kernels.binding import check_weights
    from moebench.models import KERNEL_EXPERTS_MULTIPLE, KERNEL_EXPERTS_NOTE, get_preset

    said = f"a multiple of {KERNEL_EXPERTS_MULTIPLE} for the moebench GPU kernels"
    assert said in KERNEL_EXPERTS_NOTE
    for command in ("sweep", "step", "tune"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
        assert result.exit_code == 0 and said in " ".join(result.output.split()), (command, result.output)
    result = runner.invoke(app, ["check", "--device", "cpu"])
    assert result.exit_code == 0 and said in " ".join(result.output.split()), result.output
    # the multiple said is the one the kernels' binding checks
    for experts, refused in ((KERNEL_EXPERTS_MULTIPLE + 16, True), (2 * KERNEL_EXPERTS_MULTIPLE, False)):
        shape = get_preset("dsv4-flash", hidden=128, intermediate=64, experts=experts, top_k=2).shard(1)
        with pytest.raises(ValueError) as error:
            check_weights(generate_expert_weights(shape), 2)  # CPU weights: refused at the latest for the device
        assert ("experts must be a multiple of" in str(error.value)) == refused, str(error.value)


def test_tune_fp8_help_says_the_gemm1_candidates_are_two_plane():
    """`tune --help` listed the FP8 candidates without saying GEMM1's are two-plane (`_p2`) only, as the
    tuning space holds them (and the built-in default runs): the help says it, and it holds for the space."""
    from moebench.kernels.tactic import default_fp8_tactic
    from moebench.models import get_preset
    from moebench.tuning.space import FP8_SPACES

    result = runner.invoke(app, ["tune", "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert "every GEMM1 two-plane, _p2," in " ".join(result.output.split()), result.output
    shape = get_preset("dsv41-flash").shard(4)
    assert default_fp8_tactic(shape, 1).planes == 2
    assert {t.planes for t in FP8_SPACES["quick"].tactics_for(shape, 1)} == {2}


def test_sweep_tactics_help_names_every_tactic_and_form_a_backend_takes():
    """`--tactics` help left out `nopdl=TACTIC` and the vLLM peers' `ep`: a user had to read the code to find them."""
    from moebench.backends.registry import backend_names
    from moebench.models import get_preset

    result = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    said = " ".join(result.output.split())
    shape = get_preset("dsv41-flash").shard(4)
    for name in backend_names():
        backend = load_backend(name)
        for tactic in (*backend.valid_tactics(shape), *getattr(backend, "tactic_forms", ())):
            assert re.search(rf"(?<![\w-]){re.escape(tactic)}(?![\w-])", said), (name, tactic)  # a word, not "st-ep"


def test_sweep_says_skipped_backends_once_each_not_a_row_per_case(tmp_path):
    """`--backends all` on the CPU listed a skipped row per case and backend (120 at the default rows); now
    the table holds the cases that ran and each skipped backend is one line with its reason and count."""
    import pandas as pd

    result = runner.invoke(app, ["sweep", *TINY, "--backends", "all", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    df = pd.read_parquet(next(tmp_path.iterdir()) / "results.parquet")
    skipped = df[df["status"] == "skipped"]
    assert skipped["backend"].nunique() >= 2 and (skipped.groupby("backend").size() == 2).all()  # rows 1, 2
    lines = result.output.splitlines()
    for backend, group in skipped.groupby("backend"):
        said = [line for line in lines if line.startswith(f"skipped {backend} (2 cases): ")]
        assert len(said) == 1 and str(group["error"].iloc[0])[:40] in said[0], result.output
    assert not [line for line in lines if line.startswith("│") and "skipped" in line]
    assert f"{len(skipped)} skipped" in result.output  # the count line still counts every case


def test_step_tables_fit_a_normal_terminal_and_say_a_repeated_message_once(tmp_path):
    """The CPU step table was ~260 columns wide, its `shared` column one message repeated on every row:
    the message is said once below the table, the stage split is a table of its own, and each table fits
    120 columns (the test's console is not a terminal, so nothing is folded to fit)."""
    from rich.cells import cell_len

    args = [a for a in TINY if a not in ("--rows", "1,2")] + ["--rows", "1,2"]
    result = runner.invoke(app, ["step", *args, "--backends", "torch-bf16,reference", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table_lines = [line for line in result.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and max(cell_len(line) for line in table_lines) <= 120, result.output
    message = "torch: the kernels need a CUDA device, got cpu"
    assert result.output.count(message) == 1 and "shared expert (every row): " + message in result.output
    assert "stage split" in result.output and "Σ stages" in result.output


def test_step_tactics_as_the_sweeps(tmp_path):
    """`step --tactics`: the same list / 'all' as the sweep's; a tactic a
    backend lacks (or a backend that cannot run on the CPU) is a skipped
    row with the reason; the tactic column is stored and shown."""
    import pandas as pd

    args = [a for a in TINY if a not in ("--rows", "1,2")] + ["--rows", "1"]
    result = runner.invoke(app, ["step", *args, "--backends", "torch-bf16,moebench", "--tactics", "default,fp8",
                                 "--out", str(tmp_path / "a")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tactic" in result.output and "fp8" in result.output
    df = pd.read_parquet(next((tmp_path / "a").iterdir()) / "results.parquet")
    assert list(zip(df["backend"], df["tactic"], df["status"])) == [
        ("torch-bf16", "default", "ok"), ("torch-bf16", "fp8", "skipped"),
        ("moebench", "default", "skipped"), ("moebench", "fp8", "skipped")]  # fmt: skip
    assert df["error"].iloc[1].startswith("tactic 'fp8' not offered for this shape")

    result = runner.invoke(app, ["step", *args, "--backends", "torch-bf16", "--tactics", "all",
                                 "--out", str(tmp_path / "b")])  # fmt: skip
    assert result.exit_code == 0, result.output
    df = pd.read_parquet(next((tmp_path / "b").iterdir()) / "results.parquet")
    alias = load_backend("torch-bf16").default_alias(None)
    assert list(df["tactic"]) == (["default", "gather"] if alias == "grouped" else ["default"])
    assert (df["status"] == "ok").all()

    # a tactic only an unselected backend offers: refused up front, naming that backend
    result = runner.invoke(app, ["step", *args, "--backends", "torch-bf16", "--tactics", "default,fp8",
                                 "--out", str(tmp_path / "c")])  # fmt: skip
    assert result.exit_code == 2 and "'fp8' is a tactic of moebench: add it to --backends" in result.output
    assert not (tmp_path / "c").exists()


def test_error_text_in_brackets_survives(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "[myrun]")])
    assert result.exit_code != 0
    assert "[myrun]" in result.output


def test_sweep_out_pointing_at_a_file_fails_before_measuring(tmp_path):
    target = tmp_path / "afile"
    target.write_text("mine")
    result = runner.invoke(app, ["sweep", "--rows", "1", "--tp", "1", "--out", str(target)])
    assert result.exit_code == 2 and "--out" in result.output and "No GPU" not in result.output
    assert target.read_text() == "mine"


@pytest.mark.parametrize("command", ["sweep", "step"])
def test_unwritable_out_fails_before_anything_is_measured(tmp_path, command, monkeypatch):
    """An --out that cannot take a run is refused up front (exit 2), not after
    the measuring; a command refused for another reason creates no directory."""
    import moebench.reports.store as store

    measured = []
    if command == "sweep":
        import moebench.bench.sweep as sw

        monkeypatch.setattr(sw, "run_sweep", lambda *a, **k: measured.append(1))
    else:
        import moebench.bench.decode_step as ds

        monkeypatch.setattr(ds, "run_step", lambda *a, **k: measured.append(1))

    def refuse(root):
        raise OSError(f"cannot write runs under {root}: Permission denied")

    monkeypatch.setattr(store, "check_run_root", refuse)
    result = runner.invoke(app, [command, *TINY, "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "--out: cannot write runs under" in result.output, result.output
    assert not measured and "Traceback" not in result.output


def test_check_run_root_makes_the_directory_and_leaves_no_probe(tmp_path):
    from moebench.reports.store import check_run_root

    root = check_run_root(tmp_path / "a" / "b")
    assert root.is_dir() and list(root.iterdir()) == []
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ValueError, match="not a directory"):
        check_run_root(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "mine"


def test_name_lists_reject_empty_items_and_presets_take_all(tmp_path):
    from moebench.cli import parse_names

    assert parse_names("a, b,a", "--preset") == ("a", "b")
    for bad in ("a,,b", "a,", ",", ""):
        with pytest.raises(ValueError, match="--preset"):
            parse_names(bad, "--preset")
    result = runner.invoke(app, ["sweep", *TINY[2:], "--preset", "dsv4-flash,,", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "empty item" in result.output and not (tmp_path / "x").exists()
    result = runner.invoke(app, ["sweep", "--preset", "all", "--rows", "1", "--tp", "1", "--backends", "torch-bf16",
                                 "--out", str(tmp_path / "all")])  # fmt: skip
    assert result.exit_code == 0, result.output
    import pandas as pd

    from moebench.models import PRESETS

    df = pd.read_parquet(next((tmp_path / "all").iterdir()) / "results.parquet")
    # the CPU runs each distinct reduced ("+custom") layer once: more than the default preset, all known ones
    ran = {p.split("+")[0] for p in df["preset"]}
    assert len(ran) >= 2 and ran <= set(PRESETS)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU the moebench backend runs")
def test_sweep_where_every_case_is_skipped_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["sweep", "--rows", "1", "--tp", "8", "--backends", "moebench", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "no case ran" in result.output


@pytest.mark.parametrize(
    "command, args, needle",
    [
        ("sweep", ["--replays", "0"], "--replays must be an int >= 1, got 0"),
        ("sweep", ["--warmup", "-1"], "--warmup must be"),
        ("sweep", ["--layers", "0"], "--layers must be"),
        ("sweep", ["--layers", "3", "--warm-l2"], "--layers must not be set with --warm-l2 (which times"),
        ("step", ["--layers", "3", "--warm-l2"], "--layers must not be set with --warm-l2 (which times"),
        ("sweep", ["--seed", "-1"], "--seed must be"),
        ("sweep", ["--seed", "18446744073709551615"], "--seed must be an int in [0, 4294967295]"),
        ("step", ["--seed", "4294967296"], "--seed must be an int in [0, 4294967295]"),
        ("tune", ["--seed", "-1"], "--seed must be an int in [0, 4294967295]"),  # before the GPU check
        ("tune", ["--layers", "0"], "--layers must be an int in [1, 64], got 0"),
        ("tune", ["--layers", "1000000"], "--layers must be an int in [1, 64], got 1000000"),
        ("sweep", ["--layers", "65"], "--layers must be an int in [1, 64], got 65"),
        ("step", ["--layers", "1000000"], "--layers must be an int in [1, 64]"),
        ("step", ["--tp", "2", "--one-rank", "--timeout", "3"], "--timeout: only for a real TP step"),
        ("step", ["--tp", "1", "--timeout", "3"], "--timeout: needs --tp N > 1"),
        ("step", ["--tp", "2", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        ("sweep", ["--hidden", "100"], "--hidden must be a multiple of 128, got 100"),
        ("sweep", ["--intermediate", "100"], "--intermediate must be a multiple of 32"),
        ("sweep", ["--experts", "0"], "--experts must be a positive int"),
        ("sweep", ["--top-k", "500"], "--top-k must be at most 8 (the routing and the route record), got 500"),
        ("sweep", ["--top-k", "9"], "--top-k must be at most 8"),  # every case would fail inside the routing
        ("sweep", ["--experts", "513"], "--experts must be at most 512"),
        ("sweep", ["--experts", "4"], "--experts 4 is below dsv41-flash's top_k 6"),
        ("sweep", ["--experts", "4", "--top-k", "8"], "--top-k 8 exceeds --experts 4"),
        ("step", ["--replays", "0"], "--replays must be"),
        ("step", ["--hidden", "100"], "--hidden must be"),
        ("step", ["--top-k", "9"], "--top-k must be at most 8"),
        ("tune", ["--hidden", "100"], "--hidden must be"),
        ("tune", ["--top-k", "9"], "--top-k must be at most 8"),
        ("tune", ["--experts", "4", "--top-k", "6"], "--top-k 6 exceeds --experts 4; expected --top-k <= 4"),
        ("tune", ["--tp", "5"], "(--tp)"),
    ],
)
def test_option_errors_name_the_option(tmp_path, command, args, needle):
    result = runner.invoke(app, [command, *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert needle in result.output.replace("\n", "") and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["sweep", "step"])
def test_trace_without_the_replay_scenario_is_an_error(tmp_path, command):
    result = runner.invoke(app, [command, "--trace", str(tmp_path / "t.npz"), "--scenario", "correlated",
                                 "--out", str(tmp_path / "runs")])  # fmt: skip
    assert result.exit_code == 2, result.output
    text = result.output.replace("\n", "")
    assert "--trace" in text and "--scenario" in text and "replay" in text


def test_cpu_tp_suggestion_is_the_reduced_geometrys(tmp_path):
    for command in ("sweep", "step"):
        result = runner.invoke(app, [command, "--tp", "16", "--out", str(tmp_path)])
        text = result.output.replace("\n", "")
        assert result.exit_code == 2 and "valid --tp values on the CPU: 1,2,4,8," in text and "9,12" not in text
        assert f"the {command} runs a reduced geometry" in text


def test_cpu_sweep_notes_the_reduced_geometry_and_drops_repeats(tmp_path):
    from moebench.reports.store import read_run

    result = runner.invoke(app, ["sweep", "--preset", "dsv41-flash,dsv4-flash", "--backends", "moebench,reference",
                                 "--tp", "1", "--rows", "1", "--replays", "2", "--warmup", "0",
                                 "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "No GPU: running reference on the CPU" in text  # moebench cannot: its cases are skipped
    assert "(H=512, I=256, E=32, top_k=6) whatever the preset" in text and "only labels" in text
    assert "dsv4-flash (same layer as dsv41-flash)" in text
    frame, _ = read_run(next(tmp_path.iterdir()))
    assert list(frame["preset"]) == ["dsv41-flash+custom"] * 2
    assert dict(zip(frame["backend"], frame["status"])) == {"moebench": "skipped", "reference": "ok"}


def test_cpu_runs_of_gpu_only_backends_say_every_case_is_skipped(tmp_path):
    """Without a GPU, `--backends moebench` cannot run: the banner says so
    (never 'running moebench on the CPU') and the cases are stored as skipped
    (a runnable backend next to it is the one the banner names: the next test)."""
    for command in ("sweep", "step"):
        out = tmp_path / command
        result = runner.invoke(app, [command, "--backends", "moebench", "--rows", "1", "--replays", "2",
                                     "--warmup", "0", "--out", str(out)])  # fmt: skip
        text = " ".join(result.output.split())
        assert result.exit_code == 1 and "no case ran (every case was skipped)" in text, text
        assert "none of the backends (moebench) runs on the CPU" in text, text
        assert "running moebench" not in text


def test_version_and_help_texts():
    from moebench import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"moebench {__version__}"
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert "Time a whole decode-step MoE layer; store the run." in top.output
    assert "Tune the GEMM tactics per rows on this GPU; write tuning tables." in top.output
    for command in ("sweep", "step"):
        help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}).output
        text = " ".join(help_text.replace("│", " ").split())  # the whole list, however wrapped
        assert "uniform, zipf, hot, correlated, replay (replay reads --trace)" in text


def test_bad_label_and_threshold_name_their_options(tmp_path):
    result = runner.invoke(app, ["sweep", "--label", "a/b", "--rows", "1", "--tp", "8", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--label must be" in result.output, result.output
    result = runner.invoke(app, ["report", str(tmp_path), "--baseline", str(tmp_path), "--fail-above", "abc"])
    assert result.exit_code == 2 and "--fail-above must be a percentage" in result.output, result.output


def test_a_run_with_a_failed_or_no_case_exits_1_after_it_is_stored(capsys):
    """A sweep / step stores its run, then exits 1 when a case failed its
    correctness gate or when every case was skipped; ok cases beside skipped
    ones are not an error."""
    import pandas as pd
    import typer

    from moebench.cli import _fail_unless_every_case_passed

    def frame(*statuses):
        return pd.DataFrame(
            {"status": list(statuses), "error": ["" if s == "ok" else f"why {s} {i}" for i, s in enumerate(statuses)]}
        )

    _fail_unless_every_case_passed(frame("ok", "skipped"), "RUN")  # returns
    with pytest.raises(typer.Exit) as exc:
        _fail_unless_every_case_passed(frame("ok", "failed", "skipped"), "RUN")
    assert exc.value.exit_code == 1
    err = capsys.readouterr().err
    assert "1 case(s) failed: an error, or an output off the oracle (stored as failed in RUN): why failed 1" in err
    with pytest.raises(typer.Exit) as exc:
        _fail_unless_every_case_passed(frame("skipped", "skipped"), "RUN")
    assert exc.value.exit_code == 1 and "no case ran (every case was skipped)" in capsys.readouterr().err
    # a peer's failure: listed, exit 0; with strict, exit 1; a row without `peer` counts as ours
    peers = frame("ok", "failed", "failed").assign(peer=pd.array([False, True, None], dtype="boolean"))
    with pytest.raises(typer.Exit) as exc:
        _fail_unless_every_case_passed(peers, "RUN")
    assert exc.value.exit_code == 1 and "1 case(s) failed" in capsys.readouterr().err
    peers["peer"] = pd.array([False, True, True], dtype="boolean")
    _fail_unless_every_case_passed(peers, "RUN")  # returns
    assert "2 peer case(s) failed" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(typer.Exit) as exc:
        _fail_unless_every_case_passed(peers, "RUN", strict=True)
    assert exc.value.exit_code == 1 and "2 peer case(s) failed (--strict)" in capsys.readouterr().err


def test_report_force_replaces_links_not_the_files_they_point_to(tmp_path):
    """A report file that is a link (to a file outside the run) is replaced
    by --force as a link: the file it pointed to is left as it was."""
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    precious = tmp_path / "precious.md"
    precious.write_text("mine", encoding="utf-8")
    beside = run.with_name(run.name + "-report")  # where the report goes without --out
    beside.mkdir()
    (beside / "summary.md").symlink_to(precious)
    refused = runner.invoke(app, ["report", str(run), "--no-html"])
    assert refused.exit_code == 2 and "--force" in refused.output
    result = runner.invoke(app, ["report", str(run), "--no-html", "--force"])
    assert result.exit_code == 0, result.output
    assert precious.read_text(encoding="utf-8") == "mine"
    assert not (beside / "summary.md").is_symlink() and (beside / "summary.md").read_text(encoding="utf-8") != "mine"


def test_report_that_cannot_be_written_exits_1(tmp_path):
    """An unwritable report file is an error of the run, not of the usage:
    exit 1, as docs/ci.md says."""
    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    out = tmp_path / "rep"
    (out / "summary.md").mkdir(parents=True)
    result = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-html", "--force"])
    assert result.exit_code == 1 and "cannot write the report" in result.output, result.output


@pytest.mark.parametrize("args, option", [
    (["sweep", "--out", ""], "'--out'"), (["step", "--out", " "], "'--out'"), (["report", ""], "'run_dir'"),
    (["report", ".", "--baseline", ""], "'--baseline'"), (["sweep", "--trace", "", "--scenario", "replay"], "'--trace'"),
    (["tune", "--summary", ""], "'--summary'"), (["tune", "--out", ""], "'--out'"),
])  # fmt: skip
def test_an_empty_path_is_a_usage_error_naming_the_option(tmp_path, monkeypatch, args, option):
    """Path("") is the current directory: an empty path option would write a
    run or a report into wherever the command was started. Refused (exit 2)
    before anything is written."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"Invalid value for {option}" in text and "the path is empty" in text
    assert list(tmp_path.iterdir()) == []


def test_an_ascii_terminal_gets_the_tables_not_a_traceback(tmp_path):
    """With an ASCII stdout (PYTHONIOENCODING=ascii, or LANG=C without
    UTF-8 mode) the 'µs' of a table header raised UnicodeEncodeError after
    the run was stored, and exited 1."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([sys.executable, "-m", "moebench", "sweep", *TINY, "--backends", "torch-bf16",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "run stored in" in proc.stdout and "?s" in proc.stdout  # the µ of 'µs', replaced


def test_a_run_is_not_stored_inside_another_run(tmp_path):
    """`sweep --out RUN` nested the new run among the files of a stored one
    (report refused the same); sweep and step now refuse it, naming --out."""
    result = runner.invoke(app, ["sweep", *TINY, "--backends", "torch-bf16", "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    (run,) = (tmp_path / "runs").iterdir()
    for command in ("sweep", "step"):
        for out in (run, run / "sub"):
            result = runner.invoke(app, [command, *TINY, "--backends", "torch-bf16", "--out", str(out)])
            message = " ".join(result.output.split())
            assert result.exit_code == 2 and f"--out: {out} is" in message and "outside any run" in message, message
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "results.parquet"]


def test_a_reader_that_goes_away_loses_nothing(tmp_path):
    """`moebench sweep | head -1`: the reader closes the pipe after a line;
    the sweep still stores its run and exits 0 (rich's default was exit 1
    in mid-run, the run lost)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "moebench", "sweep", "--tp", "8", "--rows", "1", "--backends", "torch-bf16",
           "--out", str(tmp_path), "--label", "piped"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "100"})
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    (run,) = tmp_path.iterdir()
    assert (run / "results.parquet").is_file() and run.name.endswith("-piped")


def test_report_record_is_read_with_care(tmp_path):
    """A hand-edited record is no traceback and removes nothing; a record that
    is a link is neither trusted nor written through; a directory from before
    the record whose report.html is ours still gets its stale plots removed."""
    base = _stored_run(tmp_path / "runs", "base", {1: 20.0, 6: 40.0})
    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.1, 6: 39.0})
    out = tmp_path / "r"
    assert runner.invoke(app, ["report", str(cur), "--baseline", str(base), "--out", str(out)]).exit_code == 0
    for junk in ('{"files": 5}', '{"files": null}', "[1, 2]", "not json"):
        (out / REPORT_RECORD).write_text(junk)
        result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force"])
        assert result.exit_code == 0 and "Traceback" not in result.output, (junk, result.output)
    # the last run wrote a fresh record; an older report's compare.png is back, without a record
    (out / "compare.png").write_bytes(b"\x89PNG old")
    (out / REPORT_RECORD).unlink()
    result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force"])
    assert result.exit_code == 0 and "removed compare.png" in result.output, result.output
    assert not (out / "compare.png").exists()
    # a record that is a link: not trusted, not written through
    precious = tmp_path / "precious.txt"
    precious.write_text('{"files": ["latency.png"]}')
    (out / REPORT_RECORD).unlink()
    (out / REPORT_RECORD).symlink_to(precious)
    result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert precious.read_text() == '{"files": ["latency.png"]}' and not (out / REPORT_RECORD).is_symlink()


def test_report_force_removes_an_earlier_reports_per_tp_plot_only(tmp_path):
    """A per-TP plot (latency_tp<N>.png) an earlier report recorded writing,
    and this one does not write, is removed by --force; one the record does
    not name (a user's file) stays."""
    import json

    cur = _stored_run(tmp_path / "runs", "cur", {1: 20.1, 6: 39.0})
    out = tmp_path / "r"
    assert runner.invoke(app, ["report", str(cur), "--out", str(out)]).exit_code == 0
    record = json.loads((out / REPORT_RECORD).read_text())["files"]
    (out / "latency_tp8.png").write_bytes(b"\x89PNG old")
    (out / "latency_tp16.png").write_bytes(b"mine")
    (out / REPORT_RECORD).write_text(json.dumps({"files": [*record, "latency_tp8.png"]}))
    result = runner.invoke(app, ["report", str(cur), "--out", str(out), "--force"])
    assert result.exit_code == 0 and "removed latency_tp8.png" in result.output, result.output
    assert not (out / "latency_tp8.png").exists() and (out / "latency_tp16.png").read_bytes() == b"mine"


def _wrong_backend(name: str, peer: bool):
    """A torch-bf16 whose output is twice the oracle's, registered as `name`, declared a peer or ours."""
    from moebench.backends.torch_bf16 import TorchBF16Backend

    def forward(self, prepared, x, topk_ids, topk_weights):
        return TorchBF16Backend.forward(self, prepared, x, topk_ids, topk_weights) * 2

    return type(
        f"Wrong{name.title().replace('-', '')}", (TorchBF16Backend,), {"name": name, "peer": peer, "forward": forward}
    )


def test_a_peers_failure_fails_the_sweep_only_with_strict(tmp_path):
    """A peer off its oracle is stored failed and listed with the reason;
    the command exits 0, or 1 with --strict. A failing backend of ours
    (`peer = False`) fails the command either way. 'Ours' is the declared
    attribute, never the name."""
    import pandas as pd

    from moebench.backends.registry import register_backend, unregister_backend

    register_backend("test-wrong-peer", _wrong_backend("test-wrong-peer", True))
    register_backend("test-wrong-ours", _wrong_backend("test-wrong-ours", False))
    try:
        args = ["sweep", *TINY, "--backends", "torch-bf16,test-wrong-peer", "--out", str(tmp_path / "a")]
        lenient = runner.invoke(app, args)
        strict = runner.invoke(app, [*args[:-1], str(tmp_path / "b"), "--strict"])
        ours = runner.invoke(app, ["sweep", *TINY, "--backends", "torch-bf16,test-wrong-ours",
                                   "--out", str(tmp_path / "c")])  # fmt: skip
    finally:
        unregister_backend("test-wrong-peer")
        unregister_backend("test-wrong-ours")
    assert lenient.exit_code == 0, lenient.output
    text = " ".join(lenient.output.split())
    assert "2 peer case(s) failed" in text and "pass --strict to fail on them" in text
    assert "test-wrong-peer dsv4-flash+custom TP1 rows 1 uniform: rel. error" in text
    (run,) = (tmp_path / "a").iterdir()
    df = pd.read_parquet(run / "results.parquet")
    wrong = df[df["backend"] == "test-wrong-peer"]
    assert (wrong["status"] == "failed").all() and wrong["peer"].all() and not df["peer"].isna().any()
    assert runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-html"]).exit_code == 0
    assert "failed peer cases (2; not ours" in (tmp_path / "rep" / "summary.md").read_text()
    assert strict.exit_code == 1 and "2 peer case(s) failed (--strict)" in " ".join(strict.output.split())
    assert ours.exit_code == 1 and "2 case(s) failed" in " ".join(ours.output.split()), ours.output
    assert "peer case" not in ours.output


def test_back_to_back_is_stored_and_named(tmp_path):
    import json

    import pandas as pd

    result = runner.invoke(app, ["sweep", *TINY, "--backends", "torch-bf16", "--back-to-back", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "back to back (--back-to-back)" in " ".join(result.output.split())
    (run,) = tmp_path.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["boundary"] == "back-to-back" and manifest["config"]["back_to_back"] is True
    df = pd.read_parquet(run / "results.parquet")
    assert (df["boundary"] == "back-to-back").all() and df["x_write_us"].isna().all()
    assert "--back-to-back" in runner.invoke(app, ["sweep", "--help"]).output
    assert "--strict" in runner.invoke(app, ["step", "--help"]).output


def test_tactics_help_names_every_tactic_of_ours():
    """`--tactics fused` runs (moebench backend, GPU) but neither --help nor usage.md named it: the help of
    sweep and step names every tactic the moebench backend offers."""
    import re

    from moebench.backends.moebench import MoebenchBackend

    tactics = [MoebenchBackend.BUILTIN, MoebenchBackend.TUNED, MoebenchBackend.FP8, MoebenchBackend.BF16,
               MoebenchBackend.FUSED]  # fmt: skip
    docs = (Path(__file__).parents[1] / "docs" / "usage.md").read_text(encoding="utf-8")
    for command in ("sweep", "step"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
        text = " ".join(result.output.split())
        for tactic in tactics:
            assert re.search(rf"\b{tactic} (/ \w+ )?=", text), (command, tactic)
            assert f"`{tactic}`" in docs, tactic


def test_an_interrupted_report_says_so_in_one_line_and_the_rerun_is_not_refused(tmp_path, monkeypatch):
    """An interrupted `report` exited 130 without a word and left a partial <run>-report/ that the rerun
    refused without --force: one line says it, the directory is as it was, and the rerun writes the report."""
    from moebench.reports import report

    run = _stored_run(tmp_path / "runs", "x", {1: 20.0})
    beside = run.with_name(run.name + "-report")
    with monkeypatch.context() as mp:
        mp.setattr(report, "write_report_html", lambda plan, into=None: (_ for _ in ()).throw(KeyboardInterrupt))
        result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 130, result.output
    said = [line for line in result.output.splitlines() if "interrupted" in line]
    assert said == [f"error: interrupted (SIGINT): no report written; {beside} is as it was"], result.output
    assert not beside.exists() and "Traceback" not in result.output
    again = runner.invoke(app, ["report", str(run)])
    assert again.exit_code == 0 and (beside / "summary.md").is_file(), again.output


def test_an_interrupted_check_or_other_command_says_so_in_one_line(monkeypatch):
    """`check` (and every command without words of its own for it) stopped by Ctrl-C exited 130 silently."""
    from moebench.bench import selfcheck
    from moebench.reports import rich_tables

    monkeypatch.setattr(selfcheck, "run_checks", lambda dev: (_ for _ in ()).throw(KeyboardInterrupt))
    result = runner.invoke(app, ["check", "--device", "cpu"])
    assert result.exit_code == 130 and result.output.strip().splitlines() == [
        "error: interrupted (Ctrl-C) before every item was checked; nothing was judged"
    ], result.output
    monkeypatch.setattr(rich_tables, "presets_tables", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 130, result.output
    assert result.output.strip() == "error: interrupted (Ctrl-C) before the command finished"


def test_check_names_no_option_it_does_not_have():
    """`check` said "--experts: ..." though it has no --experts option: it names the commands that do."""
    result = runner.invoke(app, ["check", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "--experts" not in runner.invoke(app, ["check", "--help"]).output
    line = next(line for line in result.output.splitlines() if "--experts" in line)
    assert not line.startswith("--experts") and "sweep, step and tune" in line, line
