"""The checkout itself: what git ignores (a user's own runs, not the
committed measurements) and documents that stay inside the repository."""

import re
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


def _docs() -> list[Path]:
    """The tracked documents (README.md, docs/*.md ...), not the logs and run summaries under reports/."""
    names = _git("ls-files", "*.md").stdout.split()
    return [ROOT / n for n in names if not n.startswith("reports/")] + [ROOT / "docs" / "design.md"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_no_document_points_outside_the_repository():
    """The README sent readers to "the workplace's DESIGN.md beside the repository (../shared/, not part of a
    clone)": a clone holds its own design (docs/design.md), and every document's links resolve inside it,
    anchors included."""
    outside = re.compile(r"\.\./shared|shared/device|shared/seeds|/work/|DESIGN\.md|the workplace's DESIGN")
    assert (ROOT / "docs" / "design.md").is_file()
    for doc in _docs():
        text = doc.read_text(encoding="utf-8")
        said = [m.group(0) for m in outside.finditer(text)]
        assert not said, f"{doc.relative_to(ROOT)} points outside the repository: {said}"
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = (doc.parent / target).resolve() if target else doc
            assert path.is_relative_to(ROOT.resolve()) and path.exists(), f"{doc.relative_to(ROOT)}: {link}"
            if anchor and path.suffix == ".md":
                heads = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), re.M)
                assert anchor in {_slug(h) for h in heads}, f"{doc.relative_to(ROOT)}: {link}"


def test_docs_say_the_fp8_gemm1_is_two_plane_and_the_h_check_does_not_reject_one_plane():
    """usage.md said the tuner's 99.9 % H check (`FP8_H_MARGIN`) rejects the one-plane FP8 GEMM1s (and the
    fused layer): the H100 tune of 2026-12-06 took one, which is why the default and the tuning space hold
    only two-plane GEMM1s. Every paragraph naming the check (the dated perf-notes aside) says two-plane and
    does not say the one-plane fails it."""
    for doc in _docs():
        if doc.name == "perf-notes.md":
            continue
        for para in re.split(r"\n\s*\n|\n- ", doc.read_text(encoding="utf-8")):
            if "FP8_H_MARGIN" in para:
                text = " ".join(para.split())
                assert "two-plane" in text, f"{doc.relative_to(ROOT)}: {text}"
                assert not re.search(r"one-plane[^.]*\bdo(es)? not\b", text), f"{doc.relative_to(ROOT)}: {text}"


def test_every_run_and_log_a_document_names_is_committed():
    """baselines.md cited `reports/device-runs/2026-12-06-2aabf3b-gpu-suite.log` as the log that found
    triton's extra kernels: no such log was ever committed (it was 2aabf3b-gpu-tests-peers.log). Every
    `reports/runs/NAME` and `reports/device-runs/NAME` a document names exists; a name with a placeholder
    (<date>), a wildcard or a brace list ({log,json}) is a pattern, not a name."""
    cited = re.compile(r"reports/(?:runs|device-runs)/[A-Za-z0-9._-]+(?=[^A-Za-z0-9._<*{-]|$)")
    for doc in _docs():
        for name in cited.findall(doc.read_text(encoding="utf-8")):
            name = name.rstrip(".")  # the sentence's full stop
            assert (ROOT / name).exists(), f"{doc.relative_to(ROOT)} names {name}, which is not in the repository"
