"""SASS instruction counts of compiled GEMM kernels (CPU cross-compile, sm_90a).

    PYTHONPATH=$PWD python3 scripts/sass_counts.py PRESET:TP:STAGE:TACTIC_NAME[:MODE] ...
    PYTHONPATH=$PWD python3 scripts/sass_counts.py --loop PRESET:TP:STAGE:TACTIC_NAME[:MODE] ...

e.g. dsv41-flash:4:1:r64_m1_k4_u4_c3 dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8:math. MODE is
the kernel `compile_gemm` builds: stream (default: the real ring), resident (compute only),
mma or math (its two halves: `compile_gemm`'s resident probes). One JSON line per kernel:
registers, spills, HMMA count and the ALU-pipe instructions (LOP3, SHF, PRMT, LEA, IMAD,
ISETP, SEL, ...) between the first and last HMMA (or QGMMA: the fp8 wgmma tactics), per
HMMA (docs/perf-notes.md v4-v7). With --loop, instead: the consumer's steady-state step
loop (`step_loop`) and its instructions by class (`loop_breakdown`), per loop iteration
and per wgmma (docs/notes/consumer-sass.md). SASS kept in $SASS_OUT (default:
moebench_sass_out in the system's temporary folder).
"""

from __future__ import annotations

import collections
import re

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_REG = re.compile(r"\bR(\d+)\b")

ALU = (
    "LOP3", "SHF", "PRMT", "LEA", "IMAD", "ISETP", "SEL", "IADD3", "MOV", "SHL", "SHR", "IMNMX", "VIMNMX",
    "FSEL", "PLOP3", "LOP", "ISCADD", "BFE", "BFI", "P2R", "R2P", "LEA.HI",
)  # fmt: skip

#: The classes of `loop_breakdown`, in report order.
CLASSES = ("load", "decode", "scale_int", "scale_fp", "wgmma", "sync", "bookkeeping")
#: Integer instructions that the taint of `loop_breakdown` follows (their results carry data).
_INT_DATA = ("LOP3", "SHF", "PRMT", "IMAD", "IADD3", "LEA", "SEL", "MOV", "VIADD", "IMNMX", "VIMNMX", "BMSK", "I2F",
             "F2FP", "F2F", "I2FP", "HADD2", "HMUL2", "HFMA2", "IABS", "FLO", "POPC")  # fmt: skip
_FP = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FCHK", "FSETP", "FSEL")
_SYNC = ("SYNCS", "BAR", "NANOSLEEP", "WARPSYNC", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "DEPBAR", "ARRIVES")
#: Integer instructions of the ALU pipe (half rate on sm_90: 16 lanes / clock / SM sub-partition).
ALU_PIPE = ("LOP3", "SHF", "PRMT", "IADD3", "LEA", "SEL", "ISETP", "PLOP3", "MOV", "IMNMX", "VIMNMX", "FSEL",
            "FSETP", "FMNMX", "BMSK", "IABS", "FLO", "POPC")  # fmt: skip


def parse_sass(text: str) -> list[dict]:
    """The instructions of nvdisasm text, in order: address (int), op (the full
    opcode, e.g. 'LDS.64'), pred (the guard or ''), args (operand text) and
    labels (the .L_x_ labels right before it)."""
    out, pending = [], []
    for line in text.splitlines():
        lab = _LABEL.match(line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.match(line)
        if m:
            out.append(dict(addr=int(m.group(1), 16), pred=(m.group(2) or "").strip(), op=m.group(3),
                            args=m.group(4).strip(), labels=pending))  # fmt: skip
            pending = []
    return out


def _loops(ins: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every backward branch's loop."""
    at = {lab: i for i, x in enumerate(ins) for lab in x["labels"]}
    loops = []
    for i, x in enumerate(ins):
        if x["op"].startswith("BRA"):
            t = _TARGET.search(x["args"])
            if t and t.group(1) in at and at[t.group(1)] <= i:
                loops.append((at[t.group(1)], i))
    return loops


def step_loop(ins: list[dict]) -> list[dict]:
    """The consumer's step loop: the innermost backward-branch loop that holds
    a QGMMA (or, in a kernel without one, the "math" probe, an FFMA); spin loops
    (a try-wait and its branch) hold neither. Raises ValueError when none does."""
    for key in ("QGMMA", "HMMA", "FFMA"):
        cands = [(b - a, a, b) for a, b in _loops(ins) if any(x["op"].startswith(key) for x in ins[a : b + 1])]
        if cands:
            _, a, b = min(cands)
            return ins[a : b + 1]
    raise ValueError("no loop with a QGMMA, HMMA or FFMA in this SASS")


def _dest_regs(x: dict) -> list[int]:
    """Registers an instruction writes: the first operand of a data instruction
    (LDS.64 / .128 and IMAD.WIDE: 2 / 4 / 2 registers)."""
    op = x["op"]
    if op.startswith(("ST", "BRA", "BAR", "SYNCS", "WARPGROUP", "QGMMA", "HGMMA", "NOP", "EXIT", "RED", "ATOM")):
        return []
    m = _REG.match(x["args"])
    if not m:
        return []
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return [int(m.group(1)) + k for k in range(width)]


def _src_regs(x: dict) -> set[int]:
    """Registers an instruction reads (every R operand after the destination)."""
    regs = [int(r) for r in _REG.findall(x["args"])]
    return set(regs[1:] if _dest_regs(x) else regs)


def _base_class(x: dict) -> str:
    """The class an instruction has by its opcode alone ('int' for the integer
    data instructions whose class the taint decides)."""
    op, head = x["op"], x["op"].split(".")[0]
    if head in ("LDS", "LDG", "LDSM", "LD", "LDGSTS", "STS", "STG"):
        return "load"
    if head in ("QGMMA", "HGMMA", "HMMA", "WARPGROUP") or op.startswith("WARPGROUP"):
        return "wgmma"
    if head in _SYNC:
        return "sync"
    if head in _FP:
        return "scale_fp"
    if head in _INT_DATA:
        return "int"
    return "bookkeeping"  # branches, predicates, uniform datapath, R2UR, NOP, ...


def _taint(loop: list[dict]) -> list[set[str]]:
    """Per instruction of the loop, which loads its data comes from: 'words'
    (a shared load of 64 or 128 bits: the weight words) or 'scales' (a 32-bit
    shared load: the weight scale words); two passes over the body, so values
    carried around the loop are followed too."""
    state: dict[int, set[str]] = {}
    tags = [set() for _ in loop]
    for _ in range(2):
        for i, x in enumerate(loop):
            head = x["op"].split(".")[0]
            if head == "LDS":
                t = {"words"} if (".64" in x["op"] or ".128" in x["op"]) else {"scales"}
            elif _base_class(x) in ("int", "scale_fp"):
                t = set().union(*(state.get(r, set()) for r in _src_regs(x)))
            else:
                t = set()
            tags[i] = t
            for r in _dest_regs(x):
                state[r] = t
    return tags


def loop_breakdown(loop: list[dict]) -> dict:
    """The loop's instructions by class: load (LDS/LDG/STS), decode (integer
    instructions on data from a 64/128-bit shared load: the weight words, not
    fp-derived), scale_int (integer instructions on data from a 32-bit shared
    load only: the E8M0 exponent construction), scale_fp (FFMA/FMUL/FADD/...:
    the per-block scaling), wgmma (QGMMA, WARPGROUP.ARRIVE/DEPBAR), sync
    (SYNCS, BAR, NANOSLEEP, ...) and bookkeeping (the rest: addresses, loop and
    ring counters, predicates, uniform datapath, branches). An LDS.64 of the
    fp32 activation scales goes straight into FFMA, so no integer instruction
    is tagged by it. Also: total, qgmma (QGMMA count), alu_pipe (instructions
    of the half-rate integer ALU pipe), imad (IMAD*, the FMA-heavy pipe),
    uniform (U* and R2UR: the uniform datapath), and by_op (a histogram of the
    opcodes' first word)."""
    tags = _taint(loop)
    counts = collections.Counter()
    for x, t in zip(loop, tags, strict=True):
        c = _base_class(x)
        if c == "int":
            c = "decode" if "words" in t else "scale_int" if "scales" in t else "bookkeeping"
        counts[c] += 1
    heads = collections.Counter(x["op"].split(".")[0] for x in loop)
    return dict(
        total=len(loop),
        **{c: counts[c] for c in CLASSES},
        qgmma=heads["QGMMA"],
        alu_pipe=sum(heads[h] for h in ALU_PIPE),
        imad=heads["IMAD"],
        uniform=sum(v for h, v in heads.items() if h.startswith("U") or h == "R2UR"),
        by_op=dict(sorted(heads.items(), key=lambda kv: -kv[1])),
    )


def _hmma_summary(spec, regs, spills, log_ops, hist_ops) -> dict:
    """The original report: ALU instructions between the first and last HMMA / QGMMA."""
    idx = [i for i, o in enumerate(log_ops) if o.startswith(("HMMA", "QGMMA"))]
    body = log_ops[idx[0] : idx[-1] + 1] if idx else []
    hb, ha = collections.Counter(o.split(".")[0] for o in body), collections.Counter(o.split(".")[0] for o in hist_ops)
    alu_b = {k: v for k, v in hb.items() if k in ALU}
    nh = hb["HMMA"] + hb["QGMMA"]
    return dict(
        spec=spec, regs=regs, spills=spills, local=ha["LDL"] + ha["STL"], hmma=nh, alu_body=sum(alu_b.values()),
        alu_per_hmma=round(sum(alu_b.values()) / max(nh, 1), 2), hmul2_body=hb["HMUL2"],
        fma_body=hb["FFMA"] + hb["FMUL"] + hb["FADD"], alu_detail=dict(sorted(alu_b.items(), key=lambda kv: -kv[1])),
        ldg=hb["LDG"], lds=hb["LDS"], total_body=len(body),
    )  # fmt: skip


def blocks_per_step(name: str) -> int:
    """Weight blocks (64 rows x 32 K: 1024 bytes of e2m1 + 64 E8M0 bytes) a
    warpgroup's step loop iteration consumes under fp8 tactic `name`: its
    tm (tile_rows / 16) x unroll; one wgmma each, two with two planes."""
    m = re.match(r"r(\d+)_m\d+_k\d+_u(\d+)", name)
    if not m:
        raise ValueError(f"not a GEMM tactic name: {name!r}")
    return int(m.group(1)) // 16 * int(m.group(2))


def loop_report(spec: str, sass: str) -> dict:
    """`loop_breakdown` of the step loop of one kernel's SASS (spec
    PRESET:TP:STAGE:NAME[:MODE]), with blocks (`blocks_per_step`) and
    per_block: each count / blocks, i.e. a warp's instructions per 1088 bytes
    of MXFP4 its warpgroup consumes (the "math" probe has no QGMMA; the
    two-plane twin two per block)."""
    rep = loop_breakdown(step_loop(parse_sass(sass)))
    n = blocks_per_step(spec.split(":")[3])
    keys = ("total", *CLASSES, "qgmma", "alu_pipe", "imad", "uniform")
    return dict(spec=spec, blocks=n, **rep, per_block={k: round(rep[k] / n, 2) for k in keys})


#: MODE of a spec -> compile_gemm's `resident`.
MODES = {"stream": False, "resident": True, "mma": "mma", "math": "math"}


def parse_spec(spec: str) -> tuple:
    """PRESET:TP:STAGE:TACTIC_NAME[:MODE] -> (spec, GemmShape, stage, GemmTactic,
    resident), checked before anything compiles: the preset, TP (one rank's
    shape), stage 1 or 2, a tactic name that runs that shape and stage, and a
    mode its tactic takes (resident and its probes: the bulk ring; mma / math:
    fp8 tactics). Raises argparse.ArgumentTypeError naming the spec and what
    was expected."""
    import argparse

    from moebench.kernels.tactic import GemmShape, GemmTactic
    from moebench.models import get_preset

    def bad(what: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"{spec!r}: {what}")

    parts = spec.split(":")
    if len(parts) not in (4, 5):
        raise bad(f"expected PRESET:TP:STAGE:TACTIC_NAME[:MODE], got {len(parts)} ':'-separated fields")
    preset, tp, stage, name, *mode = parts
    mode = mode[0] if mode else "stream"
    if mode not in MODES:
        raise bad(f"MODE must be one of {sorted(MODES)}, got {mode!r}")
    if not tp.isdigit() or stage not in ("1", "2"):
        raise bad(f"TP must be a positive integer and STAGE 1 or 2, got TP {tp!r}, STAGE {stage!r}")
    try:
        shape = GemmShape.of(get_preset(preset).shard(int(tp)))
        tactic = GemmTactic.from_name(name)
    except ValueError as error:
        raise bad(str(error)) from None
    why = tactic.valid_for(shape, int(stage))
    if why is None and mode != "stream" and not tactic.bulk:
        why = f"MODE {mode} needs a tactic on the bulk ring (stages >= 2, _b<stages>)"
    if why is None and mode in ("mma", "math") and not tactic.fp8:
        why = f"MODE {mode} splits the fp8 (wgmma) consumer; {name} is not fp8 (_f8)"
    if why is not None:
        raise bad(f"{name} cannot run GEMM{stage} of {preset} at TP {tp}: {why}")
    return spec, shape, int(stage), tactic, MODES[mode]


def parse_args(argv: list[str]):
    """The command line (argparse: --help, and an error naming a bad spec
    before any kernel compiles)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", action="store_true", help="the consumer's step loop by instruction class instead")
    ap.add_argument(
        "specs", nargs="+", type=parse_spec, metavar="SPEC",
        help="PRESET:TP:STAGE:TACTIC_NAME[:MODE], MODE one of stream (default), resident, mma, math;"
        " e.g. dsv41-flash:4:1:r16_m4_k4_u4_c1_b4_f8:math",
    )  # fmt: skip
    return ap.parse_intermixed_args(argv)  # --loop anywhere, as before


def main(argv: list[str]) -> None:
    import glob
    import json
    import os
    import sys
    import tempfile

    args = parse_args(argv)
    loop = args.loop
    dump = tempfile.mkdtemp(prefix="moebench_sass_")
    keep = os.environ.get("SASS_OUT") or os.path.join(tempfile.gettempdir(), "moebench_sass_out")
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=dump,
                      CUTE_DSL_COMPILER_OPT="remarks{ptx}")  # fmt: skip
    from moebench.kernels.gemm import compile_gemm

    for spec, shape, stage, tactic, resident in args.specs:
        for f in glob.glob(os.path.join(dump, "*")):
            os.remove(f)
        r, w = os.pipe()
        saved = os.dup(2), os.dup(1)
        os.dup2(w, 2)
        os.dup2(w, 1)
        try:
            compile_gemm(shape, tactic, stage, False, resident)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 2)
            os.dup2(saved[1], 1)
            os.close(w)
        log = os.read(r, 1 << 22).decode(errors="replace")
        os.close(r)
        sass = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.sass")))
        os.makedirs(keep, exist_ok=True)
        open(os.path.join(keep, spec.replace(":", "_") + ".sass"), "w").write(sass)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
        if loop:
            print(json.dumps(dict(loop_report(spec, sass), regs=regs, spills=spills)), flush=True)
            continue
        ops = [x["op"] for x in parse_sass(sass)]
        print(json.dumps(_hmma_summary(spec, regs, spills, ops, ops)), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
