from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli import app, parse_int_list

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


def test_parse_int_list():
    assert parse_int_list("1-8", "--rows", 1, 8) == tuple(range(1, 9))
    assert parse_int_list("4,1,2,2", "--rows", 1, 8) == (1, 2, 4)
    assert parse_int_list("1-2,6", "--rows", 1, 8) == (1, 2, 6)
    for bad in ("", "0", "3-1", "x", "1,,2", "-1"):
        with pytest.raises(ValueError, match="--rows"):
            parse_int_list(bad, "--rows", 1, 8)


def test_python_dash_m_entry_point_exists():
    assert (Path(__file__).resolve().parents[1] / "moebench" / "__main__.py").is_file()


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
