"""scripts/arg_types.py: the argparse types the GPU scripts share, and the
scripts' output files refused before any GPU work (no GPU needed)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_SPEC = importlib.util.spec_from_file_location("arg_types", SCRIPTS / "arg_types.py")
arg_types = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(arg_types)


def test_new_file_takes_a_new_name_in_an_existing_directory(tmp_path):
    assert arg_types.new_file(str(tmp_path / "r.json")) == str(tmp_path / "r.json")
    (tmp_path / "mine.json").write_text("x")
    (tmp_path / "link.json").symlink_to(tmp_path / "gone")
    for path, message in ((tmp_path / "mine.json", "exists; give a new file name"),
                          (tmp_path / "link.json", "exists; give a new file name"),  # a dangling link too
                          (tmp_path, "is a directory; give a file name"),
                          (tmp_path / "no" / "r.json", "does not exist")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            arg_types.new_file(str(path))


@pytest.mark.parametrize(("script", "option"), [("time_gemms", "--out"), ("time_front", "--out"),
                                                ("time_shared", "--json")])  # fmt: skip
def test_a_scripts_existing_output_file_is_refused_before_the_gpu(tmp_path, script, option):
    # each wrote its JSON with open(..., "w") after every measurement: a file of that name was overwritten
    mine = tmp_path / "mine.json"
    mine.write_text("a user's results")
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), option, str(mine)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"argument {option}: {mine} exists" in done.stderr
    assert mine.read_text() == "a user's results"
