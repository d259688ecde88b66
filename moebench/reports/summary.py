"""Summaries of a stored run: a per-case table and a markdown report.

The markdown table is written here (a few lines) rather than through
pandas' `to_markdown`, which needs `tabulate` — not installed on the H200
host, and not worth a dependency.
"""

from __future__ import annotations

import math

import pandas as pd

CASE_KEYS = ("preset", "tp", "rows", "scenario")
BASELINE = "torch-bf16"
SUMMARY_COLUMNS = (
    "preset", "tp", "rows", "scenario", "unique_experts", "backend", "tactic", "status",
    "median_us", "gbps", "pct_copy_bw", "pct_size_ceiling", "vs_torch_bf16", "max_rel_err", "note",
)  # fmt: skip


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, backend, tactic), sorted by case then median µs.

    vs_torch_bf16 = the best ok torch-bf16 median of the same (preset, tp,
    rows, scenario) / this median (> 1: faster than torch-bf16; NaN without
    a baseline or a time). note = the error of failed/skipped rows.
    Raises ValueError naming missing columns.
    """
    need = set(CASE_KEYS) | {"backend", "tactic", "status", "median_us", "gbps", "pct_copy_bw",
                             "pct_size_ceiling", "max_rel_err", "error", "unique_experts"}  # fmt: skip
    missing = sorted(need - set(df.columns))
    if missing:
        raise ValueError(f"results lack columns {missing}")
    out = df.copy()
    ok_base = out[(out["backend"] == BASELINE) & (out["status"] == "ok")]
    base = ok_base.groupby(list(CASE_KEYS), dropna=False)["median_us"].min().rename("_base_us")
    out = out.merge(base, how="left", left_on=list(CASE_KEYS), right_index=True)
    out["vs_torch_bf16"] = out["_base_us"] / out["median_us"]
    out["note"] = out["error"].fillna("").astype(str)
    out = out.sort_values([*CASE_KEYS, "median_us"], na_position="last", kind="stable")
    return out[list(SUMMARY_COLUMNS)].reset_index(drop=True)


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        if value != 0 and (abs(value) < 10 ** -digits or abs(value) >= 1e7):
            return f"{value:.3g}"
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, digits: int = 2) -> str:
    """GitHub markdown table of `frame` (floats with `digits` decimals,
    missing values empty, '|' escaped)."""
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = [header, rule]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v, digits) for v in row) + " |")
    return "\n".join(lines)


def to_markdown(df: pd.DataFrame, manifest: dict) -> str:
    """A markdown report of a run: provenance, then `summary_table(df)`."""
    dev = manifest.get("device") or {}
    pk = manifest.get("packages") or {}
    copy_bw = manifest.get("copy_bw_gbps")
    lines = [
        "# moebench run",
        "",
        f"- device: {dev.get('name', '?')} (sm {dev.get('capability') or '-'}, {dev.get('sm_count', '?')} SMs), "
        f"driver {dev.get('driver') or '-'}, CUDA {manifest.get('cuda_runtime') or '-'}",
        f"- torch {pk.get('torch') or '-'}, cutlass-dsl {pk.get('nvidia-cutlass-dsl') or '-'}, "
        f"flashinfer {pk.get('flashinfer-python') or '-'}, triton {pk.get('triton') or '-'}",
        f"- commit {manifest.get('commit') or '-'}, created {manifest.get('created_utc') or '-'} (UTC), "
        f"seed {manifest.get('seed', '-')}",
        f"- copy bandwidth {copy_bw:.1f} GB/s (read + write)" if isinstance(copy_bw, (int, float))
        else "- copy bandwidth: not measured",
    ]  # fmt: skip
    if manifest.get("reduced"):
        lines.append("- **reduced geometry on the CPU**: latencies are not representative of a GPU")
    if manifest.get("warm_l2"):
        lines.append("- warm L2: one weight set timed over and over")
    counts = df["status"].value_counts().to_dict() if "status" in df.columns else {}
    lines.append("- cases: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "failed", "skipped")))
    lines += ["", markdown_table(summary_table(df)), ""]
    return "\n".join(lines)
