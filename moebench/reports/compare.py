"""Regression comparison of two stored runs: per case, the ratio of medians
and a verdict that respects the noise.

Cases are matched on (preset, tp, rows, scenario, backend, tactic). For a
case ok in both runs:

    ratio     = median(current) / median(baseline)        (> 1: slower)
    delta_pct = 100 * (ratio - 1)
    noise_pct = half the wider relative p10-p90 spread of the two runs
                = 50 * max((p90 - p10) / median)
    verdict   = "slower" / "faster"  when |delta_pct| > noise_pct
                "same"               when |delta_pct| <= noise_pct <= threshold_pct
                "unclear"            when the noise exceeds the threshold and
                                     the change hides in it, or when either
                                     run timed the case with fewer than
                                     MIN_REPLAYS replays (its p10-p90 spread
                                     is no noise estimate: with one replay it
                                     is 0 and any change would read as
                                     slower / faster)

The replays of a row are the manifest's "timing_counts"[row's
"timing_method"]["replays"]; runs stored before timing_counts fall back to
the manifest's ["config"]["replays"] (the count asked for); a run that records
neither is judged as before, without the check.

Other verdicts: "failed" (the current case failed its correctness gate or
did not run: shown as failed, never as a time), "lost" (ok in the baseline,
but skipped in the current run or absent from it: a backend that stopped
running must not pass unnoticed), "fixed" (failed in the baseline, ok now),
"skipped" (skipped in the current run but not ok in the baseline, or
skipped in the baseline), "new" (only in the current run: informational),
"missing" (only in the baseline, where it was not ok), "mismatch" (the
case's shape H/I/E/top_k, seed or touched experts differ between the runs,
or its timing_method: "cuda-graph" vs "cuda-events" (--no-graph, an
uncapturable backend) vs "cpu-wallclock" time different things, or its
boundary ("layer" vs "back-to-back"); or the runs differ as a whole:
device, geometry, L2 mode, run kind (sweep vs step), rank count or a
sweep's layer boundary (a run stored before the field was back to back);
reported, not compared). A regression is a
"slower" case with delta_pct > threshold_pct, a "failed" case or a "lost"
one.

A comparison that compared nothing (an empty baseline or current run, or
no case of one with a time, or a failure, in the other) or judged nothing
(every compared case "unclear") is an error (`Comparison.errors`), never a
pass: a gate that measured nothing, or ruled nothing out, must not say "no
regressions". So is a comparison of CPU runs (every case timed in both runs
timed "cpu-wallclock"): eager wall-clock times on a shared CPU, at most
`moebench.bench.EAGER_REPLAYS_CAP` replays, are too noisy to gate, and
they time torch on a CPU, not the GPU kernels; their verdicts are shown,
not judged.

The run-level mismatches are `mismatch.py`'s (`store.merge_runs` refuses
runs that mismatch, too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from moebench.reports.mismatch import mismatch_kinds, run_mismatches
from moebench.reports.store import CASE_COLUMNS
from moebench.reports.summary import markdown_table

MATCH_KEYS = CASE_COLUMNS
SHAPE_KEYS = ("hidden", "intermediate", "experts", "top_k")
VERDICTS = (
    "faster", "slower", "same", "unclear", "failed", "lost", "fixed", "skipped", "new", "missing", "mismatch",
)  # fmt: skip
COLUMNS = (
    *MATCH_KEYS, "verdict", "ratio", "delta_pct", "noise_pct", "median_us", "p10_us", "p90_us",
    "base_median_us", "base_p10_us", "base_p90_us", "status", "base_status", "note",
)  # fmt: skip
DEFAULT_THRESHOLD_PCT = 5.0
#: Fewest timed replays (samples) per run for a case to be judged slower / faster / same. The noise is
#: the p10-p90 spread, and p10 / p90 of fewer than 10 samples are not percentiles: below 10 samples
#: less than one sample lies under p10 (over p90), so they are interpolated from the extreme samples,
#: and with one sample p10 = p90 = median (noise 0 %). Eager timings cap replays at
#: EAGER_REPLAYS_CAP (20, moebench.bench), at or above this minimum, so --no-graph runs with the
#: default --replays are judged (CPU runs are never judged: CPU_CANNOT_GATE).
MIN_REPLAYS = 10
#: Verdicts of cases that were actually compared (or failed: a regression either way).
COMPARED = ("faster", "slower", "same", "unclear", "fixed", "failed")


@dataclass
class Comparison:
    """frame: one row per matched case (COLUMNS); mismatches: run-level
    differences (device, geometry, L2 mode, run kind, ranks), one line each:
    any of them means no case was compared; notes:
    differences worth knowing that do not stop the comparison (driver,
    versions); threshold_pct: the regression threshold; errors: why the
    comparison cannot gate anything (module docstring), one line each."""

    frame: pd.DataFrame
    threshold_pct: float
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    current_label: str = "current"
    baseline_label: str = "baseline"
    errors: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> pd.DataFrame:
        f = self.frame
        judged = CPU_CANNOT_GATE not in self.errors  # CPU times are shown, not judged: no "slower" regression
        slower = (f["verdict"] == "slower") & (f["delta_pct"] > self.threshold_pct) & judged
        return f[slower | f["verdict"].isin(("failed", "lost"))]

    @property
    def counts(self) -> dict[str, int]:
        vc = self.frame["verdict"].value_counts().to_dict()
        return {v: int(vc.get(v, 0)) for v in VERDICTS if vc.get(v, 0)}

    @property
    def device_mismatch(self) -> bool:
        return any(m.startswith("device") for m in self.mismatches)

    @property
    def differs_in(self) -> str:
        """What the run-level mismatches are about ('device, run kind'), '' when none."""
        return mismatch_kinds(self.mismatches)

    @property
    def unclear_note(self) -> str | None:
        """The sentence to show when unclear cases leave regressions not
        ruled out (None without unclear cases)."""
        unclear = self.frame[self.frame["verdict"] == "unclear"]
        n = len(unclear)
        if not n:
            return None
        why = _unclear_why(unclear["note"], self.threshold_pct)
        return f"{n} case{'s' if n != 1 else ''} unclear ({why}): regressions not ruled out"


#: The error of a comparison whose cases were all timed on the CPU (module docstring).
CPU_CANNOT_GATE = (
    "CPU timings cannot gate: the compared cases were timed by CPU wall clock (eager, few replays on a"
    " shared host; torch on a CPU, not the GPU kernels), so their verdicts are shown, not judged; compare"
    " runs timed on a GPU (cuda-graph)"
)

#: The note of an "unclear" case whose times cannot be compared at all.
NO_VALID_TIME = "no valid time: a median / p10 / p90 missing, not finite or not positive"
#: The start of the note of an "unclear" case timed with fewer than MIN_REPLAYS replays.
FEW_REPLAYS = f"too few replays to judge (fewer than {MIN_REPLAYS}: p10 / p90 are no noise estimate)"


def _unclear_why(notes: pd.Series, threshold_pct: float) -> str:
    """Why the unclear cases with these notes are unclear: noise, too few
    replays and / or no valid time, with counts ('noise above the 5 %
    threshold, or 2 timed with fewer than 10 replays')."""
    invalid = int((notes == NO_VALID_TIME).sum())
    few = int(notes.str.startswith(FEW_REPLAYS).sum())
    parts = [f"noise above the {threshold_pct:g} % threshold"] if len(notes) > invalid + few else []
    if few:
        parts.append(f"{few} timed with fewer than {MIN_REPLAYS} replays")
    if invalid:
        parts.append(f"{invalid} without a valid time")
    return ", or ".join(parts)


def parse_threshold(text: str | float | int) -> float:
    """'5%', '5' or 5 -> 5.0 (percent); '0.5%' -> 0.5. Raises ValueError for
    anything else or a negative / non-finite value."""
    if isinstance(text, bool):
        raise ValueError(f"threshold must be a percentage like '5%', got {text!r}")
    raw = str(text).strip()
    number = raw[:-1].strip() if raw.endswith("%") else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"threshold must be a percentage like '5%', got {text!r}") from None
    if not math.isfinite(value) or math.copysign(1.0, value) < 0:  # -0 too: a sign says the user meant something else
        raise ValueError(f"threshold must be a finite percentage >= 0, got {text!r}")
    return value


def _num(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.nan
    return v


def classify(
    median: float,
    p10: float,
    p90: float,
    base_median: float,
    base_p10: float,
    base_p90: float,
    threshold_pct: float = DEFAULT_THRESHOLD_PCT,
) -> tuple[str, float, float, float]:
    """(verdict, ratio, delta_pct, noise_pct) of two ok timings (module
    docstring). A non-positive or missing time gives "unclear"."""
    vals = (median, p10, p90, base_median, base_p10, base_p90)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals) or median <= 0 or base_median <= 0:
        return "unclear", math.nan, math.nan, math.nan
    ratio = median / base_median
    delta = 100.0 * (ratio - 1.0)
    noise = 50.0 * max(max(p90 - p10, 0.0) / median, max(base_p90 - base_p10, 0.0) / base_median)
    if abs(delta) > noise:
        verdict = "slower" if delta > 0 else "faster"
    elif noise <= threshold_pct:
        verdict = "same"
    else:
        verdict = "unclear"
    return verdict, ratio, delta, noise


def timing_method(row: dict, manifest: dict) -> str | None:
    """How `row` was timed ("cuda-graph", "cuda-events", "cpu-wallclock"):
    its "timing_method", else the run's only entry of "timing_methods" (runs
    stored before the column); None when unknown."""
    method = row.get("timing_method")
    if isinstance(method, str) and method:
        return method
    methods = manifest.get("timing_methods")
    return methods[0] if isinstance(methods, list) and len(methods) == 1 and isinstance(methods[0], str) else None


def timed_replays(row: dict, manifest: dict) -> int | None:
    """How many replays (samples) timed `row`: "timing_counts" of its
    timing_method in the manifest (the only entry when the method is
    unknown), else the run's "config" "replays" (runs stored before
    timing_counts; an eager timing capped it at EAGER_REPLAYS_CAP, which is
    at least MIN_REPLAYS, so the cap never changes the verdict); None when
    the run records neither."""

    def count(value) -> int | None:
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    counts = manifest.get("timing_counts")
    if isinstance(counts, dict) and counts:
        method = timing_method(row, manifest)
        entry = counts.get(method) if method else next(iter(counts.values())) if len(counts) == 1 else None
        if isinstance(entry, dict) and count(entry.get("replays")) is not None:
            return count(entry.get("replays"))
    config = manifest.get("config")
    return count(config.get("replays")) if isinstance(config, dict) else None


def _index(df: pd.DataFrame, which: str) -> dict[tuple, dict]:
    missing = [c for c in (*MATCH_KEYS, "status", "median_us", "p10_us", "p90_us") if c not in df.columns]
    if missing:
        raise ValueError(f"{which} run lacks columns {missing}")
    out: dict[tuple, dict] = {}
    for rec in df.to_dict("records"):
        key = tuple(rec[k] for k in MATCH_KEYS)
        if key in out:
            raise ValueError(f"{which} run has two rows for case {dict(zip(MATCH_KEYS, key))}")
        out[key] = rec
    return out


def _error_text(rec: dict) -> str:
    """The row's error text ('' when none: None, NaN or empty)."""
    error = rec.get("error")
    return "" if error is None or (isinstance(error, float) and math.isnan(error)) else str(error)


def _case_mismatch(cur: dict, base: dict, methods: tuple[str | None, str | None] = (None, None)) -> str | None:
    """Why a case ok in both runs is not comparable ('differs from the
    baseline: ...'), None when it is. methods: the two rows' timing methods
    (`timing_method`), compared when both are known."""
    diffs = []
    if None not in methods and methods[0] != methods[1]:
        diffs.append(f"timed with {methods[0]} vs {methods[1]}")
    for k in SHAPE_KEYS:
        if k in cur and k in base and cur[k] != base[k]:
            diffs.append(f"{k} {cur[k]} vs {base[k]}")
    a, b = cur.get("boundary"), base.get("boundary")
    if isinstance(a, str) and isinstance(b, str) and a and b and a != b:
        diffs.append(f"timed at the {a} boundary vs {b}")
    for k in ("seed", "unique_experts", "layers"):  # layers: the weight sets a replay walks (the L2 working set)
        a, b = cur.get(k), base.get(k)
        if a is not None and b is not None and not (pd.isna(a) or pd.isna(b)) and a != b:
            diffs.append(f"{k} {a} vs {b}")
    return ("differs from the baseline: " + ", ".join(diffs)) if diffs else None


def compare_runs(
    current: pd.DataFrame,
    current_manifest: dict,
    baseline: pd.DataFrame,
    baseline_manifest: dict,
    *,
    threshold_pct: float = DEFAULT_THRESHOLD_PCT,
    current_label: str = "current",
    baseline_label: str = "baseline",
) -> Comparison:
    """Compare `current` with `baseline` (results frames with manifests, as
    `read_run` returns them). Raises ValueError naming the run for missing
    columns or duplicate cases, or for a bad threshold."""
    if not isinstance(threshold_pct, (int, float)) or not math.isfinite(threshold_pct) or threshold_pct < 0:
        raise ValueError(f"threshold_pct must be a finite number >= 0, got {threshold_pct!r}")
    cur_ix, base_ix = _index(current, current_label), _index(baseline, baseline_label)
    mismatches, notes = run_mismatches(current_manifest, baseline_manifest)
    runs_differ = mismatch_kinds(mismatches)
    manifests = (current_manifest, baseline_manifest)
    rows = []
    timed_with: set[str | None] = set()  # the timing methods of the cases ok in both runs
    for key in list(cur_ix) + [k for k in base_ix if k not in cur_ix]:
        row, methods = _case_row(key, cur_ix.get(key), base_ix.get(key), manifests, threshold_pct, runs_differ)
        timed_with.update(methods)
        rows.append(row)
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    errors = []
    if len(baseline) == 0:
        errors.append(f"the baseline run {baseline_label} holds no cases (an empty results.parquet): nothing to"
                      " compare with; record the baseline again with `moebench sweep`")  # fmt: skip
    if len(current) == 0:
        errors.append(f"the run {current_label} holds no cases (an empty results.parquet): nothing was measured")
    if not errors:
        unjudged = _unjudged(frame, mismatches, runs_differ, (cur_ix, base_ix), timed_with, threshold_pct)
        errors += [unjudged] if unjudged else []
    return Comparison(frame, float(threshold_pct), mismatches, notes, current_label, baseline_label, errors)


def _case_row(key: tuple, cur: dict | None, base: dict | None, manifests: tuple[dict, dict], threshold_pct: float,
              runs_differ: str) -> tuple[dict, tuple]:  # fmt: skip
    """The comparison frame's row (COLUMNS) of the case `key`, its records
    `cur` / `base` in the two runs (None where absent), and the two rows'
    timing methods when the case is ok in both (else ()). `manifests`:
    (current, baseline); `runs_differ`: the run-level mismatches' kinds."""
    row = dict(zip(MATCH_KEYS, key))
    row.update(ratio=math.nan, delta_pct=math.nan, noise_pct=math.nan, note="")
    for prefix, rec in (("", cur), ("base_", base)):
        for k in ("median_us", "p10_us", "p90_us"):
            row[prefix + k] = _num(rec[k]) if rec is not None else math.nan
    row["status"] = cur["status"] if cur is not None else ""
    row["base_status"] = base["status"] if base is not None else ""
    by_status = _status_verdict(cur, base)
    if by_status is not None:
        row["verdict"], row["note"] = by_status
        return row, ()
    _judge_times(row, cur, base, manifests, threshold_pct)
    methods = timing_method(cur, manifests[0]), timing_method(base, manifests[1])
    why = _case_mismatch(cur, base, methods)
    if runs_differ or why:
        row["verdict"] = "mismatch"
        row["note"] = why or f"the runs differ ({runs_differ}): not compared"
    return row, methods


def _status_verdict(cur: dict | None, base: dict | None) -> tuple[str, str] | None:
    """(verdict, note) of a case by its statuses alone (module docstring:
    lost, missing, new, failed, skipped, fixed); None when it is ok in both
    runs, and its times decide."""
    if cur is None:
        return ("lost", "not in this run; ok in the baseline") if base["status"] == "ok" else \
            ("missing", "only in the baseline")  # fmt: skip
    if base is None:
        return ("failed", _error_text(cur)) if cur["status"] == "failed" else ("new", "not in the baseline")
    if cur["status"] == "failed":
        return "failed", _error_text(cur)
    if cur["status"] != "ok" and base["status"] == "ok":
        why = _error_text(cur)
        return "lost", f"{cur['status']} in this run" + (f" ({why})" if why else "") + "; ok in the baseline"
    if cur["status"] != "ok" or base["status"] == "skipped":
        return "skipped", _error_text(cur if cur["status"] != "ok" else base)
    if base["status"] != "ok":
        return "fixed", f"failed in the baseline: {_error_text(base)}".strip()
    return None


def _judge_times(row: dict, cur: dict, base: dict, manifests: tuple[dict, dict], threshold_pct: float) -> None:
    """Fill `row`'s verdict, ratio, delta_pct, noise_pct and note from the
    times of a case ok in both runs (`classify`); "unclear" when either run
    timed it with fewer than MIN_REPLAYS replays."""
    verdict, ratio, delta, noise = classify(
        row["median_us"], row["p10_us"], row["p90_us"], row["base_median_us"], row["base_p10_us"],
        row["base_p90_us"], threshold_pct,
    )  # fmt: skip
    row.update(verdict=verdict, ratio=ratio, delta_pct=delta, noise_pct=noise)
    replays = timed_replays(cur, manifests[0]), timed_replays(base, manifests[1])
    if verdict == "unclear" and math.isnan(ratio):
        row["note"] = NO_VALID_TIME
    elif any(n is not None and n < MIN_REPLAYS for n in replays):
        row["verdict"] = "unclear"
        shown = ["?" if n is None else n for n in replays]
        row["note"] = f"{FEW_REPLAYS}: replays {shown[0]} in this run, {shown[1]} in the baseline"


def _unjudged(frame: pd.DataFrame, mismatches: list[str], runs_differ: str, indices: tuple[dict, dict],
              timed_with: set, threshold_pct: float) -> str | None:  # fmt: skip
    """The error of a comparison of two non-empty runs that compared
    nothing, timed only on the CPU, or judged nothing (module docstring);
    None when it judged something. `indices`: the runs' cases by key."""
    compared = frame["verdict"][frame["verdict"].isin(COMPARED)]
    if compared.empty:
        counts = frame["verdict"].value_counts().to_dict()
        if mismatches:
            why = f"the runs differ in {runs_differ} (see the mismatches)"
        elif counts.get("mismatch"):
            why = ("every case timed in both runs differs from the baseline in what it measured; "
                   + frame.loc[frame["verdict"] == "mismatch", "note"].iloc[0])  # fmt: skip
        else:
            why = "the runs share no case that has a time in both" + _key_hint(*indices)
        return ("no case could be compared with the baseline ("
                + ", ".join(f"{n} {v}" for v, n in counts.items()) + "): " + why)  # fmt: skip
    if timed_with == {"cpu-wallclock"}:
        return CPU_CANNOT_GATE
    if (compared == "unclear").all():
        return _all_unclear(frame.loc[compared.index, "note"], threshold_pct)
    return None


def _all_unclear(notes: pd.Series, threshold_pct: float) -> str:
    """The error of a comparison whose compared cases (their `notes`) are all unclear, with the advice."""
    if (notes == NO_VALID_TIME).all():
        return (f"no case could be judged: all {len(notes)} compared cases are unclear ({NO_VALID_TIME}), so"
                " regressions are not ruled out; check how those runs were timed")  # fmt: skip
    if notes.str.startswith(FEW_REPLAYS).all():
        advice = (f"time both runs with --replays {MIN_REPLAYS} or more (100 recommended; each case's note says"
                  " which run had fewer)")  # fmt: skip
    else:
        advice = "re-run with more --replays on a quiet GPU"
    why = _unclear_why(notes, threshold_pct)
    return (f"no case could be judged: all {len(notes)} compared cases are unclear ({why}), so regressions are"
            f" not ruled out; {advice}")  # fmt: skip


def _key_hint(cur_ix: dict, base_ix: dict) -> str:
    """When the runs share no case but would with one match key ignored,
    which key and its values in each run ('' otherwise)."""
    if set(cur_ix) & set(base_ix):
        return ""
    for i, key in enumerate(MATCH_KEYS):
        rest = [{k[:i] + k[i + 1 :] for k in ix} for ix in (cur_ix, base_ix)]
        if rest[0] & rest[1]:
            values = [", ".join(sorted({str(k[i]) for k in ix})) for ix in (cur_ix, base_ix)]
            return (
                f"; cases match on preset, TP, rows, scenario, backend AND tactic, and only the {key} differs"
                f" ({values[0]} vs {values[1]})"
            )
    return ""


def within_threshold_note(comp: Comparison) -> str:
    """' N case(s) read slower (beyond the noise) but within the threshold.'
    when a comparison without regressions holds "slower" verdicts, else ''."""
    slower = int(comp.counts.get("slower", 0))
    if not slower or len(comp.regressions):
        return ""
    return (
        f" {slower} case(s) read slower (beyond the noise) but by no more than the {comp.threshold_pct:g} % threshold."
    )


def comparison_markdown(comp: Comparison) -> str:
    """Markdown section: verdict counts, mismatches / notes, regressions,
    then every case."""
    lines = [f"## Comparison: {comp.current_label} vs {comp.baseline_label}", ""]
    lines.append(f"- threshold: {comp.threshold_pct:g} % (slower beyond it, failed, or lost is a regression)")
    lines.append("- verdicts: " + (", ".join(f"{n} {v}" for v, n in comp.counts.items()) or "none"))
    for e in comp.errors:
        lines.append(f"- **error**: {e}")
    for m in comp.mismatches:
        lines.append(f"- **mismatch**: {m}")
    for n in comp.notes:
        lines.append(f"- note: {n}")
    reg = comp.regressions
    shown = ["preset", "tp", "rows", "scenario", "backend", "tactic", "verdict", "base_median_us", "median_us",
             "ratio", "delta_pct", "noise_pct", "note"]  # fmt: skip
    if comp.errors:  # even beside regressions (a CPU comparison's failed cases): the timings were not judged
        lines += ["", "Nothing was compared and judged (see the errors above): this is not a pass."]
    if len(reg):
        lines += ["", f"### Regressions ({len(reg)})", "", markdown_table(reg[shown])]
    elif not comp.errors and comp.unclear_note:
        lines += ["", f"No regression among the judged cases, but {comp.unclear_note}."]
    elif not comp.errors:
        lines += ["", "No regressions." + within_threshold_note(comp)]
    lines += ["", "### All cases", "", markdown_table(comp.frame[shown]), ""]
    return "\n".join(lines)
