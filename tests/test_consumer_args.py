"""scripts/consumer.py's argument errors, met before any GPU work (no GPU needed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "consumer.py"
BULK_BF16 = "r64_m1_k4_u4_c2_b4"
TWO_PLANE = "r16_m4_k4_u4_c1_b4_p2_f8"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # each of these used to reach the GPU: an --out written only after every measurement, a tactic
        # filtered out without a word (nothing measured), a GEMM2 tactic skipped at run time
        (["--out", "{tmp}"], "is a directory; give a file name"),
        (["--out", "{tmp}/missing/c.json"], "does not exist"),
        (["--out", "{tmp}/mine.json"], "argument --out: .*mine.json exists; give a new file name"),
        (["--family", "fp8", "--gemm1", BULK_BF16], f"--gemm1 {BULK_BF16} is a bf16 tactic but --family is fp8"),
        (["--stage", "2", "--gemm1", TWO_PLANE], f"--gemm1 {TWO_PLANE} given but --stage is 2"),
        (["--gemm2", TWO_PLANE], "are GEMM1's only"),
        (["--family", "fp9"], r"argument --family: \['fp9'\] not in fp8, bf16"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, args, message):
    (tmp_path / "mine.json").write_text("a user's results")  # overwritten after the GPU run, before
    done = _run(*[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 2, done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert "--family: --family" not in done.stderr
    assert (tmp_path / "mine.json").read_text() == "a user's results"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"preset": "x"}, r"ValueError\(\"unknown preset 'x'"),
        ({"preset": "dsv41-flash", "tp": 4, "tactic": BULK_BF16, "stage": 1, "family": "bf16"}, r"KeyError\('real'\)"),
    ],
)
def test_recompute_names_a_record_it_cannot_read(tmp_path, record, message):
    # each ended in a traceback from inside the loop over the records
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"sms": 132, "results": [record]}))
    done = _run("--recompute", str(path))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    prefix = rf"--recompute {re.escape(str(path))}: results\[0\] is not a consumer.py record \("
    assert re.search(prefix + message, done.stderr), done.stderr
