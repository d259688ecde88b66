"""The CLI's rich tables (moebench/reports/rich_tables.py): built, not printed."""

from types import SimpleNamespace

import pandas as pd
from rich.console import Console

from moebench.reports import rich_tables as rt


def _text(table) -> str:
    console = Console(width=400, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def test_cells_format_errors_ratios_status_and_notes():
    assert rt.cell("max_rel_err", float("nan")) == "-" and rt.cell("max_rel_err", 1.5e-3) == "1.5e-03"
    assert rt.cell("vs_torch_bf16", 1.234) == "1.23" and rt.cell("status", "failed") == "[red]failed[/]"
    assert rt.cell("note", "[x]" + "y" * 100) == "\\[x]" + "y" * 77
    assert rt.fmt(None) == "-" and rt.fmt(0.024) == "0.024" and rt.fmt(12.34) == "12.3" and rt.fmt(3) == "3"


def test_frame_table_moves_constant_columns_to_the_title_and_says_a_message_once():
    frame = pd.DataFrame(
        {
            "preset": ["p", "p"],
            "rows": [1, 2],
            "backend": ["a", "b"],
            "median_us": [1.0, 2.0],
            "shared_path": ["side [stream]", "side [stream]"],
            "note": ["", ""],
        }
    )
    table, lines = rt.frame_table(frame, "decode step")
    assert table.title == "decode step, preset p" and lines == ["shared expert (every row): side \\[stream]"]
    heads = [c.header for c in table.columns]
    assert heads == ["rows", "backend", "step µs"]  # the empty note column goes


def test_split_tables_adds_the_stage_table_only_when_a_stage_was_timed():
    frame = pd.DataFrame(
        {
            "preset": ["p", "p"],
            "rows": [1, 2],
            "backend": ["a", "a"],
            "median_us": [1.0, 2.0],
            "kernel_gemm1_us": [None, None],
        }
    )
    assert len(rt.split_tables(frame, "t")) == 1
    frame["kernel_gemm1_us"] = [0.5, 0.7]
    (whole, _), (stages, _) = rt.split_tables(frame, "t")
    assert "kernel_gemm1_us" not in [c.header for c in whole.columns]
    assert [c.header for c in stages.columns] == ["rows", "backend", "gemm1"] and stages.title.startswith("stage split")


def test_comparison_gains_families_and_presets_tables():
    comp = SimpleNamespace(
        threshold_pct=5.0,
        frame=pd.DataFrame(
            [
                {
                    "preset": "p",
                    "tp": 1,
                    "rows": 2,
                    "scenario": "s",
                    "backend": "b",
                    "tactic": "t",
                    "base_median_us": 10.0,
                    "median_us": 12.0,
                    "ratio": 1.2,
                    "delta_pct": 20.0,
                    "noise_pct": 1.0,
                    "verdict": "slower",
                    "note": "",
                }
            ]
        ),
    )
    text = _text(rt.comparison_table(comp))
    assert "vs baseline (threshold 5 %)" in text and "slower" in text and "1.200" in text
    g = {"default_us": 10.0, "tuned_us": 8.0, "gain_pct": 20.0}
    record = {"preset": "p", "tp": 4, "rows": 1, "gemm1": g, "gemm2": g,
              "both": {**g, "gain_us": 2.0, "estimated": True}}  # fmt: skip
    assert "8.00 (est.)" in _text(rt.gains_table([record])) and "+20.0%" in _text(rt.gains_table([record]))
    choice = SimpleNamespace(
        family="FP8",
        source="tables",
        reason="faster",
        times=[SimpleNamespace(rows=1, faster="FP8", bf16_us=9.0, fp8_us=7.0)],
    )
    assert "1: FP8 (9.0 / 7.0)" in _text(rt.families_table([("shape", choice)], "dir"))
    presets, shapes = rt.presets_tables()
    assert "dsv41-flash" in _text(presets) and "GB / rank" in _text(shapes)


def test_picks_tables_one_per_stage_and_none_correct_in_red():
    entry = SimpleNamespace(
        tactic=SimpleNamespace(name="T1"),
        median_us=5.0,
        p10_us=4.9,
        p90_us=5.2,
        runner_up=None,
        margin_pct=None,
        separated=False,
    )
    res = {
        1: SimpleNamespace(entry=entry, baseline=None, rejected=[1], note="n"),
        2: SimpleNamespace(entry=None, baseline=None, rejected=[1, 2], note=""),
    }
    outcome = SimpleNamespace(results={(4, 1): SimpleNamespace(results=res)}, layers={(4, 1): 3})
    (table,) = rt.picks_tables(outcome, "dsv41-flash BF16")
    text = _text(table)
    assert table.title == "dsv41-flash BF16 TP4 GEMM1 (3 weight sets)" and "none correct" in text and "T1" in text


def test_environment_and_check_tables():
    info = {"device": {"name": "cpu", "kind": "cpu", "sm_count": 2}, "python": "3.11", "packages": {"torch": None},
            "commit": None, "cuda_runtime": None}  # fmt: skip
    env, backends = rt.environment_tables(info, None, {"reference": None, "moebench": "needs a GPU"})
    text = _text(env)
    assert "cores" in text and "not installed" in text and "copy bandwidth" not in text
    assert "available" in _text(backends) and "needs a GPU" in _text(backends)
    assert "1234.5 GB/s" in _text(rt.environment_tables(info, 1234.5, {})[0])
    results = [SimpleNamespace(name="codec", ok=True, detail="d"), SimpleNamespace(name="oracle", ok=False, detail="x")]
    text = _text(rt.check_table("cpu", results, {"moebench": "no GPU"}))
    assert "moebench check (cpu)" in text and "FAIL" in text and "backend moebench" in text


def test_table_numbers_keep_small_values_visible():
    """A CPU run's 0.024 GB/s shows as 0.024, not 0.0; zero stays 0.0, NaN -."""
    assert rt.fmt(0.0243) == "0.024"
    assert (rt.fmt(0.06), rt.fmt(0.13), rt.fmt(0.2), rt.fmt(1.04)) == ("0.06", "0.13", "0.2", "1.0")  # one rule below 1
    assert (rt.fmt(0.999), rt.fmt(1e-5), rt.fmt(-0.5)) == ("1.0", "1.0e-05", "-0.5")
    assert rt.fmt(0.0) == "0.0"
    assert rt.fmt(12.34) == "12.3"
    assert rt.fmt(0.004, 2) == "0.004"
    assert (rt.fmt(0.02, 2), rt.fmt(0.1, 2), rt.fmt(0.5, 2)) == ("0.02", "0.10", "0.50")
    assert rt.fmt(float("nan")) == "-"
    assert rt.fmt(None) == "-"
