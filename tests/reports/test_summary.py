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
    assert cols[cols.index("pct_size_ceiling") + 1:cols.index("vs_torch_bf16")] == ["routed_us", "kernel_gemm1_us"]
    assert s[s["rows"] == 2]["routed_us"].iloc[0] == 9.5


def test_kernel_columns_come_in_launch_order():
    from moebench.reports.summary import kernel_columns

    df = pd.DataFrame({"kernel_gemm2_us": [1.0], "kernel_warp_us": [1.0], "kernel_front_us": [1.0],
                       "kernel_finalize_us": [1.0], "kernel_shared_us": [float("nan")], "kernel_gemm1_us": [2.0]})
    assert kernel_columns(df) == ["kernel_front_us", "kernel_gemm1_us", "kernel_gemm2_us", "kernel_finalize_us",
                                  "kernel_warp_us"]


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
