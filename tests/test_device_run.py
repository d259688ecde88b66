"""scripts/device_run.sh: the log it keeps, and what it refuses before running anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_run.sh"


def _run(tmp_path, *args):
    env = {**os.environ, "OUT": str(tmp_path), "MOEBENCH_COMMIT": "abc1234"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_log_has_the_header_the_output_and_the_exit_code(tmp_path):
    done = _run(tmp_path, "probe", "--", "bash", "-c", "echo hello; exit 3")
    assert done.returncode == 3 and "hello" in done.stdout
    log = (tmp_path / "probe.log").read_text().splitlines()
    assert log[0] == "# commit: abc1234" and log[2] == "# command: bash -c echo hello; exit 3"
    assert "hello" in log and log[-1] == "# exit code: 3"


def test_an_existing_log_is_kept_and_nothing_runs(tmp_path):
    # a second call with the same NAME truncated the first measurement's log without a word
    (tmp_path / "probe.log").write_text("an earlier measurement\n")
    done = _run(tmp_path, "probe", "--", "touch", str(tmp_path / "ran"))
    assert done.returncode == 2 and f"{tmp_path}/probe.log exists; give another NAME" in done.stderr
    assert (tmp_path / "probe.log").read_text() == "an earlier measurement\n" and not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "NAME missing"), (["--", "true"], "NAME missing"), (["probe"], "COMMAND missing"),
     (["probe", "--"], "COMMAND missing")],
)  # fmt: skip
def test_a_missing_name_or_command_is_named(tmp_path, args, message):
    # no NAME ended in bash's '$1: unbound variable'; no COMMAND wrote a log of nothing and exited 0
    done = _run(tmp_path, *args)
    assert done.returncode == 2 and f"device_run.sh: {message}; usage: device_run.sh NAME -- COMMAND" in done.stderr
    assert list(tmp_path.iterdir()) == []
