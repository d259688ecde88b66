"""Summaries of a stored run: a per-case table and a markdown report.

The markdown table is written here (a few lines) rather than through
pandas' `to_markdown`, which needs `tabulate` — not installed on the H200
host, and not worth a dependency.
"""

from __future__ import annotations

import math

import pandas as pd

CASE_KEYS = ("preset", "tp", "rows", "scenario")
#: Relative errors, printed in scientific notation: against each backend's own oracle, against BF16's.
ERROR_COLUMNS = ("max_rel_err", "err_bf16")
BASELINE = "torch-bf16"
SUMMARY_COLUMNS = (
    "preset", "tp", "rows", "scenario", "unique_experts", "backend", "tactic", "status",
    "median_us", "gbps", "pct_copy_bw", "pct_size_ceiling", "vs_torch_bf16", "max_rel_err", "note",
)  # fmt: skip


def failed_cases(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ours, peers): the failed rows of a run split by whose backend failed,
    by the `peer` column (`Backend.peer`). A row without it (runs stored
    before the column) counts as ours, so that no failure passes unseen."""
    if "status" not in df.columns:
        return df.iloc[0:0], df.iloc[0:0]
    failed = df[df["status"].astype(str) == "failed"]
    if "peer" not in failed.columns:
        return failed, failed.iloc[0:0]
    peer = failed["peer"].astype("boolean").fillna(False).astype(bool)
    return failed[~peer], failed[peer]


def failure_lines(failed: pd.DataFrame, most: int = 10) -> list[str]:
    """'backend[tactic] preset TP<tp> rows <rows> <scenario>: <error>' of the
    first `most` rows of `failed`, then how many more."""
    lines = []
    for rec in failed.head(most).to_dict("records"):
        tactic = rec.get("tactic")
        name = rec.get("backend") if tactic in (None, "", "default") else f"{rec.get('backend')}[{tactic}]"
        lines.append(
            f"{name} {rec.get('preset')} TP{rec.get('tp')} rows {rec.get('rows')} {rec.get('scenario')}:"
            f" {rec.get('error') or 'no reason recorded'}"
        )
    if len(failed) > most:
        lines.append(f"and {len(failed) - most} more (see the table)")
    return lines


def _with_ratio_and_note(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of df with vs_torch_bf16 (the best ok torch-bf16 median of the
    same case / this median) and note (the error text), sorted by case then
    median µs."""
    ok_base = df[(df["backend"] == BASELINE) & (df["status"] == "ok")]
    base = ok_base.groupby(list(CASE_KEYS), dropna=False)["median_us"].min().rename("_base_us")
    out = df.merge(base, how="left", left_on=list(CASE_KEYS), right_index=True)
    out["vs_torch_bf16"] = out["_base_us"] / out["median_us"]
    out["note"] = out["error"].fillna("").astype(str)
    return out.sort_values([*CASE_KEYS, "median_us"], na_position="last", kind="stable")


#: A sweep's routed-expert path without the finalize (backends that split their forward).
ROUTED_COLUMNS = ("routed_us", "routed_pct_copy_bw")


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, backend, tactic), sorted by case then median µs:
    SUMMARY_COLUMNS (err_bf16 after max_rel_err where some row has it),
    with routed_us / routed_pct_copy_bw and the
    kernel_<stage>_us columns inserted before vs_torch_bf16 where some row
    has them (runs stored before them, or without a split backend, lack them),
    and read_gbps (over the bytes the backend really reads) after gbps.

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
    out = _with_ratio_and_note(df)
    columns = list(SUMMARY_COLUMNS)
    at = columns.index("vs_torch_bf16")
    columns[at:at] = [c for c in ROUTED_COLUMNS if _has_values(df, c)] + kernel_columns(df)
    if _has_values(df, "read_gbps"):  # what the backend really reads (runs stored before it lack it)
        columns.insert(columns.index("gbps") + 1, "read_gbps")
    if _has_values(df, "err_bf16"):  # every backend vs the BF16 oracle (runs stored before it lack it)
        columns.insert(columns.index("max_rel_err") + 1, "err_bf16")
    return out[columns].reset_index(drop=True)


#: Step runs (`moebench step`): per-case columns shown, then the present kernel_<stage>_us ones.
STEP_SUMMARY_COLUMNS = (
    "preset", "tp", "ranks", "rows", "scenario", "unique_experts", "backend", "tactic", "status", "median_us",
    "p10_us", "p90_us", "step_with_gate_us", "gate_us", "allreduce_us", "allreduce_share_pct",
    "stage_sum_us",
)  # fmt: skip
STEP_TAIL_COLUMNS = ("gbps", "pct_copy_bw", "vs_torch_bf16", "max_rel_err", "note")
RANK_COLUMNS = (
    "preset", "rows", "scenario", "backend", "tactic", "rank", "gpu_index", "status", "median_us", "allreduce_us",
    "allreduce_share_pct", "gate_us", "stage_sum_us",
)  # fmt: skip


def _has_values(df: pd.DataFrame, col: str) -> bool:
    """Whether column `col` exists and some row holds a number in it."""
    return col in df.columns and bool(pd.to_numeric(df[col], errors="coerce").notna().any())


#: Stages in launch order (a step's and a sweep's): kernel_<stage>_us columns are shown in this order.
STAGE_ORDER = ("front", "router", "shared", "route", "gemm1", "gemm2", "finalize", "experts", "shared_add")


def kernel_columns(df: pd.DataFrame) -> list[str]:
    """The kernel_<stage>_us columns of `df` that hold a value, in launch
    order (STAGE_ORDER; stages it does not know last, as they come)."""
    cols = [c for c in df.columns if str(c).startswith("kernel_") and str(c).endswith("_us") and _has_values(df, c)]
    rank = {f"kernel_{name}_us": i for i, name in enumerate(STAGE_ORDER)}
    return sorted(cols, key=lambda c: rank.get(c, len(STAGE_ORDER)))


def shared_overlap(manifest: dict) -> bool:
    """Whether a step run asked for the shared expert on a side stream
    (`moebench step --overlap-shared`; runs stored before the option ran it
    in order)."""
    return bool((manifest.get("config") or {}).get("overlap_shared", False))


def shared_stream_text(manifest: dict) -> str:
    """How a step run ran the shared expert (`shared_overlap`, and on the
    CPU the side stream is a plain call)."""
    if not shared_overlap(manifest):
        return "in order with the routed experts (--serial-shared)"
    if (manifest.get("device") or {}).get("kind") != "cuda":
        return "in order: --overlap-shared, but on the CPU the side stream is a plain call"
    return "on a side CUDA stream beside the gate and the routed experts (--overlap-shared)"


def stage_timing_text(manifest: dict) -> str | None:
    """How a run timed its stages, for the reports: the manifest's
    `stage_timing`, "not timed (--no-split)" when the run skipped it
    (stored as null), None for a run stored before the field existed."""
    if "stage_timing" not in manifest:
        return None
    return manifest["stage_timing"] or "not timed (--no-split)"


def boundary_text(manifest: dict) -> str | None:
    """How a sweep run met its layer calls, for the reports: "layer (...)"
    or "back-to-back (...)" from the manifest's boundary; "back-to-back"
    for a sweep stored before the field (it timed that way); None for a
    step run (its gate and router are the boundary)."""
    if manifest.get("kind") == "step":
        return None
    boundary = manifest.get("boundary") or "back-to-back"
    how = manifest.get("boundary_timing") or (
        "stored before the layer-boundary timing: calls back to back" if "boundary" not in manifest else ""
    )
    return f"{boundary} ({how})" if how else boundary


def is_step_run(df: pd.DataFrame, manifest: dict | None = None) -> bool:
    """Whether a stored run is a `moebench step` run (manifest kind, else a
    `kind` column)."""
    if manifest and manifest.get("kind") in ("step", "sweep"):
        return manifest["kind"] == "step"
    return "kind" in df.columns and bool((df["kind"] == "step").any())


def step_summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per step case: the whole step (median / p10 / p90 µs, gate
    excluded), with the gate, the gate alone, the all-reduce and its share,
    the sum of the stages, each stage's µs (kernel_<stage>_us, those with
    values), GB/s, vs_torch_bf16 (as summary_table) and the error vs the
    oracle; sorted by case then median. Raises ValueError naming missing
    columns."""
    need = set(STEP_SUMMARY_COLUMNS) | {"error", "gbps", "pct_copy_bw", "max_rel_err"}
    missing = sorted(need - set(df.columns))
    if missing:
        raise ValueError(f"step results lack columns {missing}")
    out = _with_ratio_and_note(df)
    columns = [*STEP_SUMMARY_COLUMNS, *kernel_columns(df), *STEP_TAIL_COLUMNS]
    if not _has_values(df, "stage_sum_us"):  # a --no-split step
        columns.remove("stage_sum_us")
    for col in ("routing_path", "shared_path"):  # runs stored before the columns lack them
        if col in df.columns:
            columns.insert(columns.index("status"), col)
    return out[columns].reset_index(drop=True)


def rank_table(ranks: pd.DataFrame) -> pd.DataFrame:
    """Per-rank rows of a TP step (the run's ranks.parquet): the step, the
    all-reduce, the gate and each stage as that rank timed them."""
    columns = [c for c in RANK_COLUMNS if c in ranks.columns] + kernel_columns(ranks)
    if "max_rel_err" in ranks.columns:
        columns.append("max_rel_err")
    keys = [c for c in ("preset", "rows", "scenario", "backend", "tactic", "rank") if c in ranks.columns]
    return ranks.sort_values(keys, kind="stable")[columns].reset_index(drop=True)


def _cell(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        if value != 0 and (abs(value) < 10**-digits or abs(value) >= 1e7):
            return f"{value:.3g}"
        return f"{value:.{digits}f}"
    text = str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # text, not HTML
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, digits: int = 2) -> str:
    """GitHub markdown table of `frame` (floats with `digits` decimals,
    missing values empty, '|' escaped, '&', '<' and '>' as entities so a
    name such as a tactic's directory shows as written)."""
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = [header, rule]
    for row in frame.itertuples(index=False):
        cells = (_error_cell(v) if c in ERROR_COLUMNS else _cell(v, digits) for c, v in zip(frame.columns, row))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _error_cell(value) -> str:
    """A relative error with 3 significant digits (2 decimals would show a
    0.0147 that failed a 1e-2 gate as 0.01)."""
    text = _cell(value, 2)
    return f"{value:.2e}" if text and isinstance(value, float) else text


#: Columns naming a case in the kernel-tactics table (those present are shown).
TACTIC_KEY_COLUMNS = ("preset", "tp", "rows", "scenario", "backend", "tactic")
#: The kernel-tactics table's title in summary.md and report.html.
KERNEL_TACTICS_TITLE = "Kernel tactics (GEMM tactic per case and where it came from)"


def kernel_tactics_table(df: pd.DataFrame) -> pd.DataFrame:
    """The cases whose backend recorded the kernels' tactics (`kernel_tactics`,
    e.g. 'gemm1 r16_m4_k4_u4_c1_b3_f8 (table); gemm2 ... (table)'), with the
    columns that name the case; empty when no case recorded them."""
    if "kernel_tactics" not in df.columns:
        return pd.DataFrame()
    keep = df["kernel_tactics"].notna() & (df["kernel_tactics"].astype(str).str.strip() != "")
    cols = [c for c in TACTIC_KEY_COLUMNS if c in df.columns] + ["kernel_tactics"]
    return df.loc[keep, cols].reset_index(drop=True)


def to_markdown(df: pd.DataFrame, manifest: dict, ranks: pd.DataFrame | None = None) -> str:
    """A markdown report of a run: provenance, then `summary_table(df)`; for
    a step run also `step_summary_table(df)` and, given its per-rank table,
    `rank_table(ranks)`."""
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
    if manifest.get("interrupted"):
        lines.append("- **interrupted** (Ctrl-C or SIGTERM): the cases it did not reach are skipped")
    if manifest.get("warm_l2"):
        lines.append("- warm L2: one weight set timed over and over")
    counts = df["status"].value_counts().to_dict() if "status" in df.columns else {}
    lines.append("- cases: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "failed", "skipped")))
    boundary = boundary_text(manifest)
    if boundary and not is_step_run(df, manifest):
        lines.append(f"- layer boundary: {boundary}")
    ours, peers = failed_cases(df)
    if len(peers):
        lines.append(f"- failed peer cases ({len(peers)}; not ours, they fail the command only with --strict):")
        lines += [f"  - {line}" for line in failure_lines(peers)]
    step = is_step_run(df, manifest)
    timing = stage_timing_text(manifest)
    if step:
        lines.append(f"- decode step over {manifest.get('ranks', 1)} rank(s); µs exclude the gate (gate_us,"
                     f" step_with_gate_us report it); per-stage split: {timing or '-'}")  # fmt: skip
        lines.append(f"- shared expert: {shared_stream_text(manifest)}")
    elif timing and (manifest["stage_timing"] is None or _has_values(df, ROUTED_COLUMNS[0]) or kernel_columns(df)):
        # a --no-split run says so; a split one only where a backend split its forward
        lines.append(f"- stages and routed path: {timing}")
    if manifest.get("sharded"):
        workers = manifest.get("workers") or []
        lines.append("- sharded over GPUs " + ", ".join(
            f"{w.get('gpu_index')} ({w.get('gpu_serial') or 'serial ?'})" + (" DIED" if w.get("error") else "")
            for w in workers))  # fmt: skip
    lines += ["", markdown_table(summary_table(df)), ""]
    tactics = kernel_tactics_table(df)
    if len(tactics):
        lines += [f"## {KERNEL_TACTICS_TITLE}", "",
                  markdown_table(tactics), ""]  # fmt: skip
    if step:
        lines += ["## Decode step (µs)", "", markdown_table(step_summary_table(df)), ""]
        if ranks is not None and len(ranks):
            lines += ["## Per rank (µs)", "", markdown_table(rank_table(ranks)), ""]
    return "\n".join(lines)
