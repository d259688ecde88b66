"""scripts/diagnose_fp8_margin.py's argument errors (no GPU needed; met before any computing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "diagnose_fp8_margin.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # --rows 0 printed "whole 0.0000 row 0.0000" for an empty layer and exited 0; --tp 0 ended in a traceback
        (["--rows", "0"], "argument --rows: invalid choice: 0"),
        (["--rows", "9"], "argument --rows: invalid choice: 9"),
        (["--tp", "0"], "argument --tp: invalid choice: 0"),
        (["--tp", "3"], "argument --tp: invalid choice: 3"),
    ],
)
def test_out_of_range_arguments_exit_2_naming_them(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and done.stdout == ""
