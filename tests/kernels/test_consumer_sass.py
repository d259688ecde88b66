"""The fp8 consumers' step loops by SASS class (scripts/sass_counts.py --loop;
docs/notes/consumer-sass.md): sm_90a compiles on the CPU, dsv41-flash TP4."""

from __future__ import annotations

import pytest
from kernel_checks import compile_reports

from moebench.kernels.tactic import GemmTactic

# The worker compiles one kernel and reads its own SASS dump (CUTE_DSL_DUMP_DIR) back.
_COMPILE_SPEC = """
import glob, importlib.util, os
from pathlib import Path
from moebench.kernels.gemm import compile_gemm
from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.models import get_preset
import moebench

_path = Path(moebench.__file__).resolve().parents[1] / "scripts" / "sass_counts.py"
_spec = importlib.util.spec_from_file_location("sass_counts", _path)
sass_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_counts)

def compile_spec(spec):
    preset, tp, stage, name, mode = spec.split(":")
    resident = {"stream": False, "resident": True}.get(mode, mode)
    compile_gemm(GemmShape.of(get_preset(preset).shard(int(tp))), GemmTactic.from_name(name), int(stage), False,
                 resident)
    files = glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.sass"))
    if not files:
        return {"loop": None}
    text = "".join(open(f).read() for f in files)
    loop = sass_counts.step_loop(sass_counts.parse_sass(text))
    waits = [x["args"] for x in loop if x["op"].startswith("WARPGROUP.DEPBAR")]
    return {"loop": sass_counts.loop_report(spec, text), "waits": waits}
"""

ONE = "dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8"
TWO = "dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_p2_f8"
G2 = "dsv41-flash:4:2:r32_m4_k1_u3_c4_b4_f8"


@pytest.mark.compile
def test_consumer_step_loops_by_class():
    """Each class count sums to the loop's length; the two-plane loop has twice
    the one-plane loop's QGMMAs and the same decode (one A fragment per block,
    two B planes); a block's decode is at most 10 integer instructions per
    warp (its two e2m1 words, 5 each); GEMM1's exponents are one shift per
    E8M0 code (2 a block: rows g and g + 8); the "math" probe has the whole decode
    and no QGMMA, the "mma" probe no decode and no scaling."""
    specs = [f"{s}:{m}" for s in (ONE, TWO, G2) for m in ("stream", "math", "mma")]
    reports = compile_reports(_COMPILE_SPEC, specs)
    assert len(reports) == len(specs) and all(r["regs"] for r in reports)
    for r in reports:
        assert all(s == 0 for s in r["spills"]), f"{r['spec']}: spills {r['spills']}"
    if reports[0]["loop"] is None:
        pytest.skip("nvdisasm not available: SASS not checked")
    loops = {r["spec"]: r["loop"] for r in reports}
    classes = ("load", "decode", "scale_int", "scale_fp", "wgmma", "sync", "bookkeeping")
    for spec, rep in loops.items():
        assert sum(rep[c] for c in classes) == rep["total"], spec
    one, two, g2 = (loops[f"{s}:stream"] for s in (ONE, TWO, G2))
    assert one["qgmma"] == one["blocks"] == 4 and two["qgmma"] == 2 * one["qgmma"], (one, two)
    assert two["decode"] == one["decode"] and two["scale_fp"] > one["scale_fp"]  # hi + lo adds
    assert g2["qgmma"] == g2["blocks"] == 6
    for rep in (one, two, g2):
        assert 0 < rep["per_block"]["decode"] <= 10, rep["spec"]
    # one m-tile a warp: one shift per E8M0 code (byte loads: no byte select, no exponent mask),
    # two codes a block; two m-tiles (GEMM2) a scale word a chunk, two instructions per code
    assert one["per_block"]["scale_int"] == two["per_block"]["scale_int"] == 2, (one, two)
    assert g2["per_block"]["scale_int"] == 4, g2
    for s in (ONE, TWO, G2):
        math, mma = loops[f"{s}:math"], loops[f"{s}:mma"]
        assert math["qgmma"] == 0 and math["decode"] == loops[f"{s}:stream"]["decode"], s
        assert mma["decode"] == mma["scale_int"] == mma["scale_fp"] == 0 and mma["qgmma"] > 0, s


@pytest.mark.compile
def test_pipelined_consumers_keep_their_wgmmas_in_flight():
    """The `_d1` twins' step loops wait exactly as `pipelined_step` asks:
    wgmma.wait_group 1 once a chunk (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the
    step's last a drain (0x0). Stricter than test_consumer.py's compile
    check (a 0x<d> wait anywhere in the kernel, which a fully serialized
    pipeline fails): this one also fails where ptxas serializes part of the
    step (its C7514 remark puts a DEPBAR ... 0x0 after a QGMMA)."""
    specs = [f"{s.replace('_b4_', '_b4_d1_')}:stream" for s in (ONE, TWO, G2)]
    reports = compile_reports(_COMPILE_SPEC, specs)
    assert all(all(s == 0 for s in r["spills"]) for r in reports), [r["spills"] for r in reports]
    if reports[0]["loop"] is None:
        pytest.skip("nvdisasm not available: SASS not checked")
    for r in reports:
        chunks = r["loop"]["blocks"] // (GemmTactic.from_name(r["spec"].split(":")[3]).tile_rows // 16)
        waits = [w.replace(" ", "") for w in r["waits"]]
        assert len(waits) == chunks and waits[:-1] == ["gsb0,0x1"] * (chunks - 1), (r["spec"], r["waits"])
        assert waits[-1] == "gsb0,0x0", (r["spec"], r["waits"])
