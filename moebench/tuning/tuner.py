"""The tuner: the fastest correct tactic per row count, told apart from noise.

Knows callables, not GPUs (FlashInfer's autotuner pattern): the caller
hands over the candidates, `time_fn(tactic, rows)` returning a Timing-like
object (median_us, p10_us, p90_us) and `check_fn(tactic, rows)` returning
None when the tactic's output is correct, else the error text. Per row count:

1. every candidate is checked; a wrong one (or one whose check or timing
   raises) is rejected with the reason and never timed or picked;
2. the correct ones are timed once and ranked by median;
3. the `top` fastest are re-timed `repeats` more times, interleaved
   (A B C A B C ...) so drift hits them alike; each finalist's time is the
   median of its 1 + repeats medians (p10 / p90 likewise), so one lucky
   pass cannot win;
4. the winner is the fastest pooled median; the runner-up and margin are
   recorded, and `separated` says whether the winner's p90 lies below the
   runner-up's p10. With `prefer` (e.g. the built-in default), a preferred
   finalist that is not separated from the winner is kept instead: a table
   entry should not churn on noise.

The preferred tactic, when correct, is always re-timed with the finalists
(one more finalist when it is not among the `top` fastest), so what tuning
buys over it (`RowsResult.baseline` vs the entry) compares pooled times
taken side by side, not the winner's against one first-pass timing.

`should_stop()` (e.g. a wall-time budget) is asked before each row count;
once it says True the remaining row counts are left out (`TuneResult.stopped`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moebench.kernels.tactic import GemmTactic
from moebench.kernels.table import TableEntry

TimeFn = Callable[[GemmTactic, int], object]
CheckFn = Callable[[GemmTactic, int], "str | None"]
ProgressFn = Callable[[int, str, str], None]


@dataclass(frozen=True)
class Measurement:
    """A tactic's time at one row count (µs): median, p10, p90 pooled over
    `passes` timings."""

    tactic: GemmTactic
    median_us: float
    p10_us: float
    p90_us: float
    passes: int = 1


@dataclass(frozen=True)
class RowsResult:
    """The outcome at one row count.

    entry: the table entry (None when no candidate was correct); first_pass:
    every correct candidate's first timing, fastest first; finalists: the
    re-timed ones (pooled), fastest first; rejected: tactic name -> reason;
    note: why the pick differs from the fastest, if it does; baseline: the
    preferred tactic's pooled time (None without `prefer`, or when it was
    rejected).
    """

    rows: int
    entry: TableEntry | None
    first_pass: tuple[Measurement, ...]
    finalists: tuple[Measurement, ...]
    rejected: dict[str, str]
    note: str = ""
    baseline: Measurement | None = None


@dataclass
class TuneResult:
    """Per row count results; `entries` keeps the rows that got a tactic;
    `stopped`: row counts left out because `should_stop` said so."""

    results: dict[int, RowsResult] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)

    @property
    def entries(self) -> dict[int, TableEntry]:
        return {r: res.entry for r, res in self.results.items() if res.entry is not None}

    @property
    def failed_rows(self) -> list[int]:
        return [r for r, res in self.results.items() if res.entry is None]


def _name(tactic) -> str:
    return getattr(tactic, "name", str(tactic))


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _timing(value, tactic) -> Measurement:
    """Measurement from a Timing-like object; ValueError unless its median,
    p10 and p90 are finite, positive and ordered."""
    try:
        med, p10, p90 = (float(getattr(value, k)) for k in ("median_us", "p10_us", "p90_us"))
    except (AttributeError, TypeError, ValueError) as error:
        raise ValueError(f"time_fn must return median_us / p10_us / p90_us, got {value!r}") from error
    if not all(math.isfinite(v) and v > 0 for v in (med, p10, p90)) or not p10 <= med <= p90:
        raise ValueError(f"time_fn returned an unusable timing: median {med}, p10 {p10}, p90 {p90}")
    return Measurement(tactic, med, p10, p90)


def _pool(tactic, runs: list[Measurement]) -> Measurement:
    med = statistics.median(m.median_us for m in runs)
    p10 = min(statistics.median(m.p10_us for m in runs), med)
    p90 = max(statistics.median(m.p90_us for m in runs), med)
    return Measurement(tactic, med, p10, p90, len(runs))


def tune(  # noqa: C901 - owned by layer-plan, removed when it lands
    shape,
    rows_list: Sequence[int],
    candidates: Sequence[GemmTactic] | Callable[[object, int], Sequence[GemmTactic]],
    time_fn: TimeFn,
    check_fn: CheckFn,
    *,
    repeats: int = 3,
    top: int = 3,
    prefer: GemmTactic | Callable[[int], GemmTactic | None] | None = None,
    provenance: dict | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TuneResult:
    """Pick the fastest correct tactic for each row count in `rows_list`
    (module docstring).

    shape: what the tactics serve (passed to a callable `candidates(shape,
    rows)`; else informational); candidates: tactics (distinct), or that
    callable; time_fn / check_fn: as the module docstring; repeats: extra
    timings of each finalist (>= 1); top: finalists (>= 2); prefer: a tactic
    (or rows -> tactic) kept when tied within noise; provenance: stored in
    every entry; progress(rows, tactic name, status) after each step;
    should_stop: asked before each row count (True: leave the rest out).
    Raises ValueError / TypeError for bad arguments; failures of a tactic
    never raise (they reject it).
    """
    rows_list = list(rows_list)
    if not rows_list or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in rows_list):
        raise ValueError(f"rows_list must be positive ints, got {rows_list!r}")
    if len(set(rows_list)) != len(rows_list):
        raise ValueError(f"rows_list has duplicates: {rows_list}")
    if not callable(time_fn) or not callable(check_fn):
        raise TypeError("time_fn and check_fn must be callable")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 2:
        raise ValueError(f"top must be an int >= 2, got {top!r}")
    provenance = dict(provenance or {})
    say = progress or (lambda rows, name, status: None)

    result = TuneResult()
    for index, rows in enumerate(rows_list):
        if should_stop is not None and should_stop():
            result.stopped = rows_list[index:]
            break
        preferred = prefer(rows) if callable(prefer) else prefer
        cands = list(candidates(shape, rows) if callable(candidates) else candidates)
        if not cands:
            raise ValueError(f"no candidate tactics for rows={rows}")
        names = [_name(t) for t in cands]
        if len(set(names)) != len(names):
            raise ValueError(f"candidates for rows={rows} have duplicates")
        rejected: dict[str, str] = {}
        first: list[Measurement] = []
        for tactic in cands:
            name = _name(tactic)
            try:
                error = check_fn(tactic, rows)
            except Exception as exc:  # noqa: BLE001 - a failing tactic is rejected, not fatal
                error = f"check raised {_error_text(exc)}"
            if error:
                rejected[name] = f"incorrect: {error}"
                say(rows, name, "rejected")
                continue
            try:
                first.append(_timing(time_fn(tactic, rows), tactic))
            except Exception as exc:  # noqa: BLE001
                rejected[name] = f"timing failed: {_error_text(exc)}"
                say(rows, name, "failed")
                continue
            say(rows, name, "timed")
        first.sort(key=lambda m: m.median_us)
        if not first:
            result.results[rows] = RowsResult(rows, None, (), (), rejected, "no correct tactic")
            continue

        finalists = first[:top]
        if preferred is not None and all(m.tactic != preferred for m in finalists):
            finalists += [m for m in first if m.tactic == preferred]
        runs: dict[str, list[Measurement]] = {_name(m.tactic): [m] for m in finalists}
        for _ in range(repeats):
            for m in finalists:
                name = _name(m.tactic)
                if name in rejected:
                    continue
                try:
                    runs[name].append(_timing(time_fn(m.tactic, rows), m.tactic))
                except Exception as exc:  # noqa: BLE001 - flaky on re-time: out
                    rejected[name] = f"re-timing failed: {_error_text(exc)}"
                    say(rows, name, "failed")
            say(rows, "finalists", "re-timed")
        pooled = sorted((_pool(m.tactic, runs[_name(m.tactic)]) for m in finalists
                         if _name(m.tactic) not in rejected), key=lambda m: m.median_us)  # fmt: skip
        if not pooled:
            result.results[rows] = RowsResult(rows, None, tuple(first), (), rejected, "every finalist failed")
            continue

        winner, note = pooled[0], ""
        baseline = next((m for m in pooled if preferred is not None and m.tactic == preferred), None)
        if preferred is not None and preferred != winner.tactic:
            for m in pooled[1:]:
                if m.tactic == preferred and m.p10_us <= winner.p90_us:
                    note = (f"kept {_name(preferred)}: within noise of {_name(winner.tactic)}"
                            f" ({m.median_us:.2f} vs {winner.median_us:.2f} µs)")  # fmt: skip
                    winner = m
                    break
        others = [m for m in pooled if m is not winner]
        runner = others[0] if others else None
        entry = TableEntry(
            tactic=winner.tactic, median_us=winner.median_us, p10_us=winner.p10_us, p90_us=winner.p90_us,
            runner_up=None if runner is None else runner.tactic,
            runner_up_us=None if runner is None else runner.median_us,
            margin_pct=None if runner is None else 100.0 * (runner.median_us / winner.median_us - 1.0),
            separated=runner is not None and winner.p90_us < runner.p10_us,
            candidates=len(cands), rejected=len(rejected), provenance=provenance,
        )  # fmt: skip
        result.results[rows] = RowsResult(rows, entry, tuple(first), tuple(pooled), rejected, note, baseline)
    return result
