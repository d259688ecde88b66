"""The checkout itself: what git ignores (a user's own runs, not the
committed measurements) and documents that stay inside the repository."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"git cannot run here: {error}")
    if done.returncode == 128:  # not a checkout (an unpacked sdist)
        pytest.skip(done.stderr.strip())
    return done


def _ignored(path: str) -> bool:
    return _git("check-ignore", "-q", "--no-index", path).returncode == 0


def test_a_default_sweep_or_step_leaves_nothing_untracked_and_committed_runs_stay_trackable():
    """`moebench sweep` from the checkout stored reports/runs/<date>-sweep/, an untracked directory in the
    repository: runs of the default labels (and their -2, -3 ... siblings) and a default tune's tables are
    ignored, while a labelled run, every committed run and every tracked file stay visible to git."""
    for path in ("reports/runs/2026-12-06-sweep/results.parquet", "reports/runs/2026-12-06-sweep-2/manifest.json",
                 "reports/runs/2026-12-06-step/results.parquet", "reports/runs/2026-12-06-step-11/ranks.parquet",
                 "reports/runs/2026-12-06-sweep-report/summary.md", "tuning-tables/E=8.json"):  # fmt: skip
        assert _ignored(path), path
    for path in ("reports/runs/2026-12-06-h200-sweep/results.parquet", "reports/runs/2026-12-06-step-tp2/x.json",
                 "reports/runs/2026-12-06-sweeps/results.parquet"):  # fmt: skip
        assert not _ignored(path), path
    tracked = _git("ls-files", "-ci", "--exclude-standard").stdout.split()
    assert tracked == [], f"tracked files the .gitignore would hide if added again: {tracked}"
    committed = {Path(p).parts[2] for p in _git("ls-files", "reports/runs").stdout.split() if len(Path(p).parts) > 3}
    assert committed and not [run for run in committed if _ignored(f"reports/runs/{run}/results.parquet")]
