"""The result columns of a sweep and a step, in one table.

Every column is declared once here with its kind, which fixes its dtype in
the stored frame whatever the mix of cases (`typed`): "key" (left as is),
"float" (float64, NaN for missing), "int" (nullable Int64), "str" ("" for
missing), "bool" (nullable boolean). A sweep row has `COLUMNS`; a step row
has `STEP_COLUMNS` (the sweep's, then the step's own). Adding a column to
both runs is one line in `_CASE`, to the step only one line in `_STEP`.
Free of torch.
"""

from __future__ import annotations

#: Stages a backend's `stage_calls` may name in a sweep (kernel_<stage>_us), in launch
#: order: ours (route, gemm1, gemm2, finalize) and the peers' own glue (the routing
#: alignment, an activation quantize, the SwiGLU between the GEMMs, the top-k reduce).
SWEEP_STAGES = ("route", "align", "quantize", "gemm1", "activation", "gemm2", "reduce", "finalize")
#: Every stage a decode step's kind has (kernel_<stage>_us of a step).
STEP_STAGES = ("front", "router", "shared", "route", "gemm1", "gemm2", "finalize", "experts", "shared_add")

#: (name, kind) of a sweep row, in order: docs/design.md "Store" plus timing and provenance
#: extras, then where the case ran (the launcher's host, rank, GPU index and serial).
_CASE = (
    ("preset", "key"), ("hidden", "key"), ("intermediate", "key"), ("padded_intermediate", "key"),
    ("experts", "key"), ("top_k", "key"), ("tp", "key"), ("rows", "key"), ("scenario", "key"), ("backend", "key"),
    ("tactic", "key"), ("peer", "bool"), ("status", "key"), ("error", "str"), ("median_us", "float"),
    ("p10_us", "float"), ("p90_us", "float"), ("unique_experts", "int"), ("bytes", "int"), ("gbps", "float"),
    ("pct_copy_bw", "float"), ("ceiling_gbps", "float"), ("pct_size_ceiling", "float"), ("read_bytes", "int"),
    ("read_gbps", "float"), ("max_rel_err", "float"), ("max_row_rel_err", "float"), ("err_bf16", "float"),
    ("oracle", "str"),
    ("device", "str"), ("sm_count", "int"), ("commit", "str"), ("timing_method", "str"), ("boundary", "str"),
    ("x_write_us", "float"), ("layers", "int"), ("l2_multiple", "float"), ("seed", "key"), ("routed_us", "float"),
    ("routed_pct_copy_bw", "float"), *((f"kernel_{stage}_us", "float") for stage in SWEEP_STAGES),
    ("kernel_tactics", "str"),
    ("host", "str"), ("launch_rank", "int"), ("gpu_index", "int"), ("gpu_serial", "str"),
)  # fmt: skip
#: (name, kind) a step row adds to the sweep's.
_STEP = (
    ("kind", "str"), ("routing_path", "str"), ("shared_path", "str"), ("ranks", "int"), ("rank", "int"),
    ("step_with_gate_us", "float"), ("gate_us", "float"), ("stage_sum_us", "float"), ("allreduce_us", "float"),
    ("allreduce_share_pct", "float"), ("shared_bytes", "int"),
    *((f"kernel_{stage}_us", "float") for stage in STEP_STAGES if stage not in SWEEP_STAGES),
)  # fmt: skip

KINDS = dict((*_CASE, *_STEP))
#: Result columns of a sweep, in order.
COLUMNS = tuple(name for name, _ in _CASE)
#: Result columns of a step: the sweep's, then the step's own.
STEP_COLUMNS = (*COLUMNS, *(name for name, _ in _STEP))
#: kernel_<stage>_us of every step stage.
KERNEL_COLUMNS = tuple(f"kernel_{s}_us" for s in STEP_STAGES)
#: Columns the launcher fills: where a case ran.
LAUNCH_COLUMNS = ("host", "launch_rank", "gpu_index", "gpu_serial")


def columns_of(kind: str) -> tuple[str, ...]:
    """The columns of a run of `kind` ("sweep" or "step"); ValueError otherwise."""
    if kind == "sweep":
        return COLUMNS
    if kind == "step":
        return STEP_COLUMNS
    raise ValueError(f"kind must be 'sweep' or 'step', got {kind!r}")


def typed(rows, kind: str):
    """A DataFrame of `rows` (dicts or a frame) with the columns of a `kind`
    run in order (missing ones empty) at their fixed dtypes (module
    docstring), so the parquet schema is stable."""
    import pandas as pd

    columns = list(columns_of(kind))
    frame = rows.reindex(columns=columns) if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows, columns=columns)
    for col in columns:
        k = KINDS[col]
        if k == "float":
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("float64")
        elif k == "int":
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64")
        elif k == "str":
            frame[col] = frame[col].astype(object).fillna("").astype(str)
        elif k == "bool":
            frame[col] = frame[col].astype("boolean")
    if kind == "step":
        frame["kind"] = "step"
    return frame
