"""scripts/ncu_hotloop.py on a synthetic Nsight Compute source-page CSV."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "ncu_hotloop", Path(__file__).resolve().parents[1] / "scripts" / "ncu_hotloop.py"
)
ncu_hotloop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_hotloop)

_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_long_sb","stall_selected","stall_long_sb (Not Issued)"'
)


def _block(name, rows):
    lines = [f'"Kernel Name","{name}",', _HEADER]
    lines += [
        f'"0x{i:04x}","{src}","{smp}","{ex}","{lsb}","{sel}","99"' for i, (src, ex, smp, lsb, sel) in enumerate(rows)
    ]
    return "\n".join(lines)


def test_hot_loop_opcodes_and_stalls(tmp_path, capsys):
    gemm = _block(
        "gemm",
        [
            ("LDC R1, c[0x0][0x28]", 10, 1, 1, 0),
            ("@!P0 NANOSLEEP.SYNCS 0x989680", 40, 6, 6, 0),  # in the loop: once per step
            ("LOP3.LUT R2, R2, 0x9c9c9c9c, RZ, 0xc0, !PT", 40, 2, 0, 2),
            ("QGMMA.64x8x32.F32.E4M3.E4M3 R24, R40, gdesc[UR4], RZ, !UPT", 40, 3, 0, 3),
            ("EXIT", 10, 0, 0, 0),
        ],
    )
    other = _block("route", [("IMAD R0, R1, R2, RZ", 5, 1, 0, 1)])
    s = ncu_hotloop.summarize(ncu_hotloop.kernel_blocks(gemm)[0][1])
    assert (s["loop_len"], s["steps"], s["mma_per_step"]) == (3, 40, 1)
    assert s["executed"] == 140 and s["samples"] == 12 and s["loop_samples"] == 11
    assert s["ops"]["NANOSLEEP"] == [40, 6]  # the predicate is not the opcode
    assert s["stalls_loop"] == {"long_sb": 6, "selected": 5}  # "(Not Issued)" columns left out
    path = tmp_path / "src.csv"
    path.write_text(gemm + "\n" + other + "\n")
    assert ncu_hotloop.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "== gemm" in out and "== route" in out
    assert "hot loop: 3 SASS instructions executed 40 times each (1 MMA per step)" in out


def test_not_an_ncu_csv(tmp_path, capsys):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    assert ncu_hotloop.main([str(path)]) == 2
    assert "no kernel block found" in capsys.readouterr().err
    assert ncu_hotloop.main([str(tmp_path / "missing.csv")]) == 2


def test_a_block_without_the_source_counters_is_refused(tmp_path, capsys):
    # without "Source" it ended in a KeyError traceback; without the counters it printed a report of zeros
    path = tmp_path / "x.csv"
    for header, missing in (('"Address","Foo"', "'Source', 'Instructions Executed'"),
                            ('"Address","Source"', "'Instructions Executed'")):  # fmt: skip
        path.write_text(f'"Kernel Name","gemm"\n{header}\n"0x1","2","3"\n')
        assert ncu_hotloop.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert f"kernel 'gemm' has no column {missing}" in err and "SourceCounters" in err
