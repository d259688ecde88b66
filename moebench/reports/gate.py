"""The exit policy of a stored run and of a comparison: what fails a
command (exit 1), what cannot be judged (exit 2), and the one-line reason.

A run fails when no case ran (every case skipped) or when a case of ours
failed (an error, or its correctness gate); a peer's failed case (the run's
`peer` column, `Backend.peer`) fails it only with `strict`. A comparison
that could not compare (another device, geometry or kind of run; no case in
common; every case unclear) is refused; with a threshold, a case slower
beyond it, failed, or lost is a regression. An interrupted run exits
128 + the signal. Functions return messages; nothing here prints.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

#: Exit code of a judged failure (a failed case, a regression).
FAILED = 1
#: Exit code of a comparison that cannot be judged (a usage error).
UNJUDGED = 2


@dataclass(frozen=True)
class RunVerdict:
    """What a stored run's cases say about the command's exit.

    peers: how many peer cases failed; peer_lines: their failure lines
    (summary.failure_lines); failure: the exit-1 message, or None when the
    command passes."""

    peers: int
    peer_lines: list[str]
    failure: str | None


def _reasons(frame) -> str:
    """Up to three distinct error texts of `frame`, sorted."""
    return "; ".join(sorted(set(frame["error"].dropna().astype(str)))[:3])


def judge_run(frame, path, strict: bool = False) -> RunVerdict:
    """The verdict on a run stored at `path` (named in the messages): a
    failure when no case ran or a case of ours failed, or with `strict` when
    a peer's case failed. Skipped cases beside ok ones are not a failure.
    `frame` needs the 'status' and 'error' columns."""
    from moebench.reports.summary import failed_cases, failure_lines

    status = frame["status"].astype(str)
    failed, peers = failed_cases(frame)
    lines = failure_lines(peers) if len(peers) else []
    failure = None
    if not ((status == "ok") | (status == "failed")).any():
        failure = "no case ran (every case was skipped): " + _reasons(frame)
    elif len(failed):
        failure = (f"{len(failed)} case(s) failed: an error, or an output off the oracle (stored as failed in"
                   f" {path}): " + _reasons(failed))  # fmt: skip
    elif strict and len(peers):
        failure = (f"{len(peers)} peer case(s) failed (--strict): an error, or an output off the oracle (stored as"
                   f" failed in {path}): " + _reasons(peers))  # fmt: skip
    return RunVerdict(peers=len(peers), peer_lines=lines, failure=failure)


def interrupted_exit(frame, manifest: dict, path, signals: list[int]) -> tuple[str, int] | None:
    """(message, exit code 128 + the signal) for a run stored at `path` that
    was interrupted (its manifest says so), else None. `signals`: those this
    process got (the last counts), else the one a sharded sweep's worker got
    (the manifest's interrupt_signal), else SIGINT."""
    from moebench.reports.store import interrupted_rows

    if not manifest.get("interrupted"):
        return None
    reached = int((~interrupted_rows(frame)).sum())
    signum = signals[-1] if signals else manifest.get("interrupt_signal") or signal.SIGINT
    return (f"interrupted ({signal.Signals(signum).name}): {reached} of {len(frame)} cases ran; the rest are"
            f" stored as skipped in {path}", 128 + signum)  # fmt: skip


def case_list(frame, most: int = 5) -> str:
    """'backend preset TP rows scenario tactic (note)' for the first `most`
    cases of a comparison frame, then how many more."""
    names = [f"{r['backend']} {r['preset']} TP{r['tp']} rows {r['rows']} {r['scenario']} {r['tactic']} ({r['note']})"
             for r in frame.head(most).to_dict("records")]  # fmt: skip
    more = len(frame) - most
    return "; ".join(names) + (f"; and {more} more (see the report)" if more > 0 else "")


def judge_comparison(comparison, threshold: float, gated: bool) -> tuple[str, int] | None:
    """(message, exit code) for a Comparison (reports.compare), else None
    when it passes: UNJUDGED when its baseline was recorded another way or
    it holds errors (nothing could be judged); FAILED, when `gated`
    (--fail-above given), for its regressions beyond `threshold` percent
    (slower, failed, lost)."""
    if comparison.mismatches:
        what = ("another device / geometry" if any(m.startswith(("device", "geometry")) for m in comparison.mismatches)
                else "a different kind of run")  # fmt: skip
        return (f"--baseline: the baseline is of {what} (it differs in {comparison.differs_in}): cases were"
                " not compared (see the mismatches and the report); compare with a baseline recorded the same"
                " way", UNJUDGED)  # fmt: skip
    if comparison.errors:
        return "; ".join(comparison.errors), UNJUDGED
    if not gated or not len(comparison.regressions):
        return None
    reg = comparison.regressions
    failed, lost = reg[reg["verdict"] == "failed"], reg[reg["verdict"] == "lost"]
    parts = []
    if len(reg) > len(failed) + len(lost):
        parts.append(f"{len(reg) - len(failed) - len(lost)} case(s) slower than the baseline by more than"
                     f" {threshold:g} %")  # fmt: skip
    if len(failed):
        parts.append(f"{len(failed)} case(s) failed their correctness gate in this run")
    if len(lost):
        parts.append(f"{len(lost)} case(s) ok in the baseline were not timed in this run (lost): "
                     + case_list(lost))  # fmt: skip
    return "; ".join(parts), FAILED
