"""The CLI's plumbing (moebench/cli_support.py): plain flags shown as
flags, empty paths refused, one red error line with its exit code, the
output directory checks as usage errors, the version."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import typer

from moebench import cli_support


def test_plain_flags_lose_their_type_and_other_options_keep_it():
    flag = SimpleNamespace(is_flag=True, count=False, metavar=None)
    counted = SimpleNamespace(is_flag=True, count=True, metavar=None)
    named = SimpleNamespace(is_flag=True, count=False, metavar="<x>")
    valued = SimpleNamespace(is_flag=False, metavar=None)
    assert cli_support.flags_as_flags([flag, counted, named, valued]) == [flag, counted, named, valued]
    assert (flag.metavar, counted.metavar, named.metavar, valued.metavar) == ("", None, "<x>", None)


def test_an_empty_path_is_refused_and_a_default_passes():
    assert cli_support.parse_path("a/b") == Path("a/b") and cli_support.parse_path(Path("")) == Path("")
    for text in ("", "  "):
        with pytest.raises(typer.BadParameter, match="the path is empty"):
            cli_support.parse_path(text)


def test_fail_prints_one_escaped_red_line_and_returns_the_exit(capsys):
    exit_ = cli_support.fail("bad shape [steps, rows, top_k]")
    assert isinstance(exit_, typer.Exit) and exit_.exit_code == cli_support.USAGE_ERROR == 2
    assert capsys.readouterr().err.strip() == "error: bad shape [steps, rows, top_k]"
    assert cli_support.fail("x", 1).exit_code == 1


def test_check_out_refuses_a_file_as_a_usage_error(tmp_path, capsys):
    cli_support.check_out(tmp_path / "new")  # made, returns
    assert (tmp_path / "new").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(typer.Exit) as exc:
        cli_support.check_out(tmp_path / "file", "--summary")
    assert exc.value.exit_code == 2 and "error: --summary: " in capsys.readouterr().err


def test_the_version_is_the_installed_packages_else_the_source_trees(monkeypatch):
    import importlib.metadata as metadata

    import moebench

    monkeypatch.setattr(metadata, "version", lambda name: f"{name} 9.9")
    assert cli_support.package_version() == "moebench 9.9"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli_support.package_version() == moebench.__version__
    cli_support.print_version(False)  # not asked: returns
    with pytest.raises(typer.Exit) as exc:
        cli_support.print_version(True)
    assert exc.value.exit_code == 0
