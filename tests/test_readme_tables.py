"""scripts/readme_tables.py: README's measured tables from one stored run;
a run it cannot quote is refused naming the argument, never a traceback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moebench.reports.store import read_run, write_run

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
readme_tables = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(readme_tables)

RUN = ROOT / "reports" / "runs" / "2026-12-06-h100-dsv41-flash-compare"


def _refused(capsys, run) -> str:
    """readme_tables' error for `run`: exit 2 (argparse's usage error), no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        readme_tables.main([str(run)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument run: " in err and "Traceback" not in err
    return err


def _stored(tmp_path, keep=lambda df: df, **manifest_changes) -> Path:
    """The committed comparison run with only the rows `keep` leaves and the
    manifest changed, stored under tmp_path."""
    df, manifest = read_run(RUN)
    return write_run(keep(df), {**manifest, **manifest_changes}, root=tmp_path, label="cut")


def test_prints_the_committed_run(capsys):
    assert readme_tables.main([str(RUN)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**TP4**") and "**TP8**" in out and "| torch BF16 |" in out


@pytest.mark.parametrize("name", ["missing", "README.md"])
def test_refuses_a_path_that_is_no_run(capsys, tmp_path, name):
    run = tmp_path / name
    if name == "README.md":
        run.write_text("not a run")
    assert str(run) in _refused(capsys, run)


def test_refuses_a_run_without_the_nopdl_case(capsys, tmp_path):
    run = _stored(tmp_path, lambda df: df[df.tactic != "nopdl=default"])
    err = _refused(capsys, run)
    assert "TP4 moebench nopdl=default rows 1,2,4,6,8" in err and "TP8 moebench nopdl=default" in err


def test_refuses_a_run_without_a_backend(capsys, tmp_path):
    run = _stored(tmp_path, lambda df: df[(df.backend != "flashinfer-w4a8") | (df.tp != 8)])
    err = _refused(capsys, run)
    assert "TP8 flashinfer-w4a8 default rows 1,2,4,6,8" in err and "TP4 flashinfer" not in err


def test_refuses_a_failed_case(capsys, tmp_path):
    def fail(df):
        df = df.copy()
        df.loc[(df.backend == "marlin-w4a16") & (df.tp == 4) & (df.rows == 6), "status"] = "failed"
        return df

    assert "TP4 marlin-w4a16 default rows 6 " in _refused(capsys, _stored(tmp_path, fail))


def test_refuses_a_reduced_cpu_run(capsys, tmp_path):
    assert "reduced CPU run" in _refused(capsys, _stored(tmp_path, reduced=True))


def test_refuses_a_run_without_err_bf16(capsys, tmp_path):
    assert "'err_bf16'" in _refused(capsys, _stored(tmp_path, lambda df: df.drop(columns="err_bf16")))


def test_refuses_a_run_without_the_preset(capsys, tmp_path):
    err = _refused(capsys, _stored(tmp_path, lambda df: df[df.scenario != "correlated"]))
    assert "no ok dsv41-flash case at the correlated scenario" in err
