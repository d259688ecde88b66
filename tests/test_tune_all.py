"""scripts/tune_all.sh: what it refuses before anything runs (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tune_all.sh"


@pytest.mark.parametrize(("fp8", "name"), [("0", "tune-all.log"), ("1", "tune-all-fp8.log.preflight")])
def test_an_earlier_runs_log_is_kept(tmp_path, fp8, name):
    # the log was truncated before the tuning started: a rerun into the same OUT lost the earlier run's output
    (tmp_path / name).write_text("an earlier run\n")
    env = {**os.environ, "OUT": str(tmp_path), "FP8": fp8}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and f"tune_all.sh: {tmp_path}/{name} exists" in done.stderr, done.stderr
    assert (tmp_path / name).read_text() == "an earlier run\n" and sorted(os.listdir(tmp_path)) == [name]
