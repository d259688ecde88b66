import math

import pandas as pd

from moebench.reports.summary import markdown_table, summary_table, to_markdown


def results():
    base = dict(preset="p", tp=8, rows=1, scenario="uniform", unique_experts=6, pct_copy_bw=1.0,
                pct_size_ceiling=float("nan"), max_rel_err=1e-3, error="")  # fmt: skip
    return pd.DataFrame([
        {**base, "backend": "torch-bf16", "tactic": "default", "status": "ok", "median_us": 40.0, "gbps": 1.0},
        {**base, "backend": "torch-bf16", "tactic": "gather", "status": "ok", "median_us": 80.0, "gbps": 0.5},
        {**base, "backend": "moebench", "tactic": "default", "status": "ok", "median_us": 10.0, "gbps": 4.0},
        {**base, "backend": "flashinfer-w4a16", "tactic": "default", "status": "failed",
         "median_us": float("nan"), "gbps": float("nan"), "error": "rel. error 0.5 | bad"},
        {**base, "rows": 2, "backend": "moebench", "tactic": "default", "status": "ok", "median_us": 12.0,
         "gbps": 3.0},
    ])  # fmt: skip


def test_summary_ratio_vs_best_torch_bf16():
    s = summary_table(results())
    first = s[s["rows"] == 1]
    assert first["backend"].tolist() == ["moebench", "torch-bf16", "torch-bf16", "flashinfer-w4a16"]
    ratio = dict(zip(first["backend"] + "/" + first["tactic"], first["vs_torch_bf16"]))
    assert ratio["moebench/default"] == 4.0 and ratio["torch-bf16/gather"] == 0.5
    assert math.isnan(ratio["flashinfer-w4a16/default"])
    assert math.isnan(s[s["rows"] == 2]["vs_torch_bf16"].iloc[0])  # no baseline at 2 rows


def test_markdown():
    text = to_markdown(results(), {"device": {"name": "NVIDIA H200"}, "copy_bw_gbps": 4215.0, "reduced": True,
                                   "commit": "abc"})  # fmt: skip
    assert "NVIDIA H200" in text and "4215.0 GB/s" in text and "reduced" in text and "commit abc" in text
    assert "rel. error 0.5 \\| bad" in text
    table = markdown_table(pd.DataFrame({"a": [1.0, float("nan")], "b": ["x", "y"]}))
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.00 | x |", "|  | y |"]
    odd = markdown_table(pd.DataFrame({"tactic": ["tables=<b>&x|y"]}))
    assert odd.splitlines()[2] == "| tables=&lt;b&gt;&amp;x\\|y |"


def test_summary_shows_the_routed_path_and_stages_only_where_a_row_has_them():
    from moebench.reports.summary import SUMMARY_COLUMNS

    df = results()
    assert list(summary_table(df).columns) == list(SUMMARY_COLUMNS)  # older runs: no such columns
    df["routed_us"] = [float("nan"), float("nan"), 8.0, float("nan"), 9.5]
    df["routed_pct_copy_bw"] = float("nan")  # present but empty: not shown
    df["kernel_gemm1_us"] = [float("nan")] * 4 + [5.0]
    df["kernel_gemm2_us"] = float("nan")
    s = summary_table(df)
    cols = list(s.columns)
    assert cols[cols.index("pct_size_ceiling") + 1 : cols.index("vs_torch_bf16")] == ["routed_us", "kernel_gemm1_us"]
    assert s[s["rows"] == 2]["routed_us"].iloc[0] == 9.5


def test_kernel_columns_come_in_launch_order():
    from moebench.reports.summary import kernel_columns

    df = pd.DataFrame(
        {
            "kernel_gemm2_us": [1.0],
            "kernel_warp_us": [1.0],
            "kernel_front_us": [1.0],
            "kernel_finalize_us": [1.0],
            "kernel_shared_us": [float("nan")],
            "kernel_gemm1_us": [2.0],
        }
    )
    assert kernel_columns(df) == [
        "kernel_front_us",
        "kernel_gemm1_us",
        "kernel_gemm2_us",
        "kernel_finalize_us",
        "kernel_warp_us",
    ]


def test_shared_stream_text_names_the_setting_and_the_device():
    from moebench.reports.summary import shared_stream_text

    gpu = {"device": {"kind": "cuda"}}
    assert "side CUDA stream" in shared_stream_text({**gpu, "config": {"overlap_shared": True}})
    assert shared_stream_text({**gpu, "config": {"overlap_shared": False}}).startswith("in order")
    assert shared_stream_text(gpu).startswith("in order")  # stored before the option
    assert "on the CPU" in shared_stream_text({"device": {"kind": "cpu"}, "config": {"overlap_shared": True}})


def test_kernel_tactics_table_lists_the_cases_that_recorded_them():
    import pandas as pd

    from moebench.reports.summary import kernel_tactics_table

    df = pd.DataFrame({"tp": [4, 4, 8], "rows": [1, 6, 1], "backend": ["moebench", "torch-bf16", "moebench"],
                       "kernel_tactics": ["gemm1 A (table); gemm2 B (table)", None, " "]})  # fmt: skip
    t = kernel_tactics_table(df)
    assert list(t.columns) == ["tp", "rows", "backend", "kernel_tactics"] and len(t) == 1
    assert t["kernel_tactics"].iloc[0].startswith("gemm1 A")
    assert kernel_tactics_table(df.drop(columns="kernel_tactics")).empty


def test_failed_cases_split_ours_from_the_peers_and_the_report_lists_the_peers():
    """A failed row is a peer's when its `peer` column says so; a run
    stored before the column counts every failure as ours. summary.md lists
    the failed peer cases with their reasons and says how the sweep was
    bounded; read_gbps joins the table where the run has it."""
    from moebench.reports.summary import failed_cases, failure_lines

    df = results()
    ours, peers = failed_cases(df)  # no peer column: ours
    assert len(ours) == 1 and peers.empty
    df["peer"] = pd.array([True, True, False, True, False], dtype="boolean")
    ours, peers = failed_cases(df)
    assert ours.empty and peers["backend"].tolist() == ["flashinfer-w4a16"]
    assert failure_lines(peers) == ["flashinfer-w4a16 p TP8 rows 1 uniform: rel. error 0.5 | bad"]
    df.loc[df["backend"] == "flashinfer-w4a16", "peer"] = pd.NA
    assert len(failed_cases(df)[0]) == 1  # unknown: ours
    df["peer"] = pd.array([True, True, False, True, False], dtype="boolean")
    df["read_gbps"] = [0.5, 0.25, 4.0, float("nan"), 3.0]
    text = to_markdown(df, {"device": {"name": "NVIDIA H200"}, "boundary": "layer",
                            "boundary_timing": "x written before each call"})  # fmt: skip
    assert "- layer boundary: layer (x written before each call)" in text
    assert "failed peer cases (1; not ours, they fail the command only with --strict)" in text
    assert "  - flashinfer-w4a16 p TP8 rows 1 uniform: rel. error 0.5 | bad" in text
    assert list(summary_table(df).columns).index("read_gbps") == list(summary_table(df).columns).index("gbps") + 1
    old = to_markdown(results(), {"device": {"name": "NVIDIA H200"}})  # a sweep stored before the field
    assert "- layer boundary: back-to-back (stored before the layer-boundary timing" in old
    from moebench.reports.summary import boundary_text

    assert boundary_text({"kind": "step"}) is None  # a step's gate and router are its boundary
