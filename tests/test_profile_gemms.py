"""scripts/profile_gemms.py's argument errors, met before any GPU work (no GPU needed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_gemms.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # each of these reached torch.cuda (a traceback, or on a GPU a failure after the allocations)
        (["--tp", "3", "1:r64_m1_k4_u4_c3_a16"], r"argument --tp: invalid choice: 3"),
        (["--rows", "9", "1:r64_m1_k4_u4_c3_a16"], r"argument --rows: invalid choice: 9"),
        (["3:r64_m1_k4_u4_c3_a16"], r"argument specs: '3:r64_m1_k4_u4_c3_a16': expected STAGE:TACTIC_NAME"),
        (["1:bogus"], r"argument specs: '1:bogus': cannot parse tactic name 'bogus'"),
        (
            ["2:r16_m4_k4_u4_c1_b4_p2_f8"],
            r"dsv41-flash TP4: 2:r16_m4_k4_u4_c1_b4_p2_f8 cannot run GEMM2 here: planes 2",
        ),
        (
            ["--resident", "yes", "1:r64_m1_k4_u4_c3_a16"],
            r"--resident yes: resident .* needs a tactic on the bulk ring",
        ),
        (
            ["--resident", "math", "1:r64_m1_k4_u4_c2_b4"],
            r"--resident math: resident probe 'math' splits the fp8 .* is not fp8",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert "Traceback" not in done.stderr
