"""scripts/sass_counts.py's step-loop breakdown on synthetic nvdisasm text (no DSL needed)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "sass_counts", Path(__file__).resolve().parents[1] / "scripts" / "sass_counts.py"
)
sass_counts = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_counts)

# A prologue, an outer loop holding the step loop (which holds a spin loop of its own),
# as nvdisasm prints them: the step loop is the innermost one with a QGMMA.
_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD.MOV.U32 R9, RZ, RZ, RZ ;
.L_x_2:
        /*0020*/                   LEA R24, R70, UR6, 0x3 ;
.L_x_3:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R24+URZ+0x15000], R17 ;
        /*0040*/              @!P0 BRA `(.L_x_3) ;
        /*0050*/                   LDS.64 R16, [R26+0x4000] ;
        /*0060*/                   LDS R74, [R25+0x8000] ;
        /*0070*/                   IMAD.SHL.U32 R27, R16, 0x4, RZ ;
        /*0080*/                   SHF.R.U32.HI R28, RZ, 0x2, R16 ;
        /*0090*/                   LOP3.LUT R27, R27, 0x8c8c8c8c, RZ, 0xc0, !PT ;
        /*00a0*/                   LOP3.LUT R41, R27, 0x10101010, R28, 0xf8, !PT ;
        /*00b0*/                   LOP3.LUT R40, R16, 0x9c9c9c9c, RZ, 0xc0, !PT ;
        /*00c0*/                   IMAD.SHL.U32 R20, R74, 0x800000, RZ ;
        /*00d0*/                   LOP3.LUT R20, R20, 0x7f800000, RZ, 0xc0, !PT ;
        /*00e0*/                   WARPGROUP.ARRIVE ;
        /*00f0*/                   UMOV UR10, UR12 ;
        /*0100*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R24, R40, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/                   LDS.64 R18, [R75+0x1f080] ;
        /*0130*/                   FMUL R41, R24, R20 ;
        /*0140*/                   FFMA R8, R18, R41, R8 ;
        /*0150*/                   VIADD R70, R70, 0x1 ;
        /*0160*/                   ISETP.NE.U32.AND P1, PT, R70, 0xa, PT ;
        /*0170*/               @P1 BRA `(.L_x_2) ;
        /*0180*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x200 ;
        /*0190*/               @P2 BRA `(.L_x_1) ;
        /*01a0*/                   EXIT ;
"""


def test_the_step_loop_is_the_innermost_loop_with_a_qgmma_and_its_classes_sum_to_it():
    loop = sass_counts.step_loop(sass_counts.parse_sass(_SASS))
    assert (loop[0]["addr"], loop[-1]["addr"]) == (0x20, 0x170)  # not the spin loop, not the unit loop
    rep = sass_counts.loop_breakdown(loop)
    assert rep["total"] == len(loop) == 22
    assert sum(rep[c] for c in sass_counts.CLASSES) == rep["total"]
    assert rep["qgmma"] == 1
    assert rep["load"] == 3  # two weight-side LDS and the fp32 activation scales
    assert rep["decode"] == 5  # the e2m1 word's five integer instructions
    assert rep["scale_int"] == 2  # the E8M0 exponent
    assert rep["scale_fp"] == 2
    assert rep["wgmma"] == 3  # ARRIVE, QGMMA, DEPBAR
    assert rep["sync"] == 1  # the try-wait (its branch is bookkeeping)
    assert rep["bookkeeping"] == 6  # LEA, the two BRA, UMOV, VIADD, ISETP


def test_a_kernel_without_a_qgmma_uses_the_innermost_loop_with_an_ffma():
    text = _SASS.replace("QGMMA.64x8x32.F32.E4M3.E4M3 R24, R40, gdesc[UR8], RZ, !UPT, gsb0", "MOV R24, R40")
    loop = sass_counts.step_loop(sass_counts.parse_sass(text))
    assert (loop[0]["addr"], loop[-1]["addr"]) == (0x20, 0x170)
    rep = sass_counts.loop_breakdown(loop)
    assert rep["qgmma"] == 0 and rep["decode"] == 6  # the copy of decoded words is decode too
    with pytest.raises(ValueError, match="no loop with a QGMMA"):
        sass_counts.step_loop(sass_counts.parse_sass(text.replace("FFMA", "FADD").replace("MOV R24", "NOP R24")))


def test_blocks_per_step_and_the_report_per_block():
    assert sass_counts.blocks_per_step("r16_m4_k4_u4_c1_b4_f8") == 4
    assert sass_counts.blocks_per_step("r16_m4_k4_u4_c1_b4_p2_f8") == 4  # two QGMMA a block, one block
    assert sass_counts.blocks_per_step("r32_m4_k1_u3_c4_b4_f8") == 6
    with pytest.raises(ValueError, match="not a GEMM tactic name"):
        sass_counts.blocks_per_step("f8")
    rep = sass_counts.loop_report("dsv41-flash:4:1:r16_m4_k1_u1_c1_b4_f8", _SASS)
    assert rep["blocks"] == 1 and rep["per_block"]["total"] == 22 and rep["per_block"]["decode"] == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # each of these used to end in a traceback (or, with no spec, printed nothing and exited 0)
        ([], "the following arguments are required: SPEC"),
        (["dsv41-flash:4"], "'dsv41-flash:4': expected PRESET:TP:STAGE:TACTIC_NAME"),
        (["nope:4:1:r64_m1_k4_u4_c3"], "unknown preset 'nope'"),
        (["dsv41-flash:x:1:r64_m1_k4_u4_c3"], "TP must be a positive integer and STAGE 1 or 2, got TP 'x'"),
        (["dsv41-flash:4:3:r64_m1_k4_u4_c3"], "STAGE 1 or 2, got TP '4', STAGE '3'"),
        (["dsv4-flash:3:1:r64_m1_k4_u4_c3"], "tp=3: intermediate 2048 does not split"),
        (["dsv41-flash:4:1:bogus"], "cannot parse tactic name 'bogus'"),
        (["dsv41-flash:4:1:r64_m1_k4_u4_c3:foo"], "MODE must be one of"),
        (["dsv41-flash:4:2:r16_m4_k4_u4_c1_b4_p2_f8"], "cannot run GEMM2 of dsv41-flash at TP 4: planes 2"),
        (["dsv41-flash:4:1:r64_m1_k4_u4_c3:resident"], "MODE resident needs a tactic on the bulk ring"),
        (["dsv41-flash:4:1:r64_m1_k4_u4_c2_b4:math"], "MODE math splits the fp8 .* is not fp8"),
        # a bad spec after good ones is met before any of them compiles
        (["dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8", "--loop", "nope:4:1:x"], "unknown preset 'nope'"),
    ],
)
def test_a_bad_spec_exits_2_naming_it_before_anything_compiles(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("CUTE_DSL_DUMP_DIR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        sass_counts.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "CUTE_DSL_DUMP_DIR" not in os.environ  # nothing was set up for a compile


def test_help_exits_0_and_names_the_spec_format(capsys):
    with pytest.raises(SystemExit) as exit_:
        sass_counts.main(["--help"])
    assert exit_.value.code == 0
    assert "PRESET:TP:STAGE:TACTIC_NAME[:MODE]" in capsys.readouterr().out


def test_parse_spec_keeps_the_spec_and_maps_the_mode():
    spec, shape, stage, tactic, resident = sass_counts.parse_spec("dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8:math")
    assert (spec, shape.intermediate, stage, tactic.name, resident) == (
        "dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8:math", 576, 1, "r16_m4_k4_u4_c1_b4_f8", "math")  # fmt: skip
    assert sass_counts.parse_spec("dsv41-flash:8:2:r64_m1_k4_u4_c3")[4] is False
