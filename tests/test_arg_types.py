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


def test_a_list_names_each_value_once():
    # consumer.py --tp 4,4 (or time_gemms.py --rows 1,1) measured the same shape twice, two identical records
    assert arg_types.int_list((1, 2, 4, 8))("8,4") == [8, 4]
    with pytest.raises(argparse.ArgumentTypeError, match=r"\[4\] given more than once in '4,8,4'"):
        arg_types.int_list((1, 2, 4, 8))("4,8,4")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\['b'\] given more than once"):
        arg_types.name_list(["a", "b"])("b,a,b")


def test_name_list_and_positive_int():
    assert arg_types.name_list(["a", "b"])("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"\['c'\] not in \['a', 'b'\]"):
        arg_types.name_list(["a", "b"])("a,c")
    assert arg_types.positive_int("3") == 3
    for text in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 1"):
            arg_types.positive_int(text)


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # each parsed these lists only inside its GPU loop: a typo in the second preset failed after the first
        # one's measurements (lost), rows 0 / 9 or TP 3 ran shapes outside the regime, or a traceback
        ("time_front", ["--presets", "dsv41-flash,typo"], r"argument --presets: \['typo'\] not in"),
        ("time_front", ["--rows", "0"], r"argument --rows: \[0\] not in"),
        ("time_front", ["--calls", "0"], r"argument --calls: expected an integer >= 1, got 0"),
        ("time_shared", ["--presets", "x"], r"argument --presets: \['x'\] not in"),
        ("time_shared", ["--tp", "3"], r"argument --tp: \[3\] not in \[1, 2, 4, 8\]"),
        ("timeline", ["--preset", "x"], r"argument --preset: invalid choice: 'x'"),
        ("timeline", ["--rows", "1,x"], r"argument --rows: expected comma-separated integers, got '1,x'"),
        ("timeline", ["--scenario", "replay"], r"argument --scenario: invalid choice: 'replay'"),
        ("triton_route_probe", ["--rows", "9"], r"argument --rows: \[9\] not in"),
        # fused_trace.py dropped the empty item of '1,,2', timed TP 4 twice for '4,4', and met an --out in a
        # missing directory only after the GPU work
        ("fused_trace", ["--rows", "1,,2"], r"argument --rows: expected comma-separated integers, got '1,,2'"),
        ("fused_trace", ["--tp", "4,4"], r"argument --tp: \[4\] given more than once"),
        (
            "fused_trace",
            ["--out", "/nonexistent-dir/t.json"],
            r"argument --out: .* directory /nonexistent-dir does not",
        ),
    ],
)
def test_a_gpu_scripts_bad_list_exits_2_before_the_gpu(script, args, message):
    import re

    done = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert re.search(message, done.stderr), done.stderr
