"""SASS instruction counts of compiled GEMM kernels (CPU cross-compile, sm_90a).

    PYTHONPATH=$PWD python3 scripts/sass_counts.py PRESET:TP:STAGE:TACTIC_NAME ...

e.g. dsv41-flash:4:1:r64_m1_k4_u4_c3 dsv41-flash:4:1:r64_m1_k4_u4_c3_a16. One JSON line
per kernel: registers, spills, HMMA count and the ALU-pipe instructions
(LOP3, SHF, PRMT, LEA, IMAD, ISETP, SEL, ...) between the first and last HMMA
(the loop body), per HMMA (or QGMMA: the fp8 wgmma tactics) (docs/perf-notes.md v4-v7). SASS kept in
$SASS_OUT (default: moebench_sass_out in the system's temporary folder).
"""

import glob, json, os, re, sys, tempfile, collections

dump = tempfile.mkdtemp(prefix="moebench_sass_")
keep = os.environ.get("SASS_OUT") or os.path.join(tempfile.gettempdir(), "moebench_sass_out")
os.environ.update(
    CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=dump, CUTE_DSL_COMPILER_OPT="remarks{ptx}"
)
from moebench.kernels.gemm import compile_gemm
from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.models import get_preset

ALU = (
    "LOP3",
    "SHF",
    "PRMT",
    "LEA",
    "IMAD",
    "ISETP",
    "SEL",
    "IADD3",
    "MOV",
    "SHL",
    "SHR",
    "IMNMX",
    "VIMNMX",
    "FSEL",
    "PLOP3",
    "LOP",
    "ISCADD",
    "BFE",
    "BFI",
    "P2R",
    "R2P",
    "LEA.HI",
)
for spec in sys.argv[1:]:
    preset, tp, stage, name = spec.split(":")
    shape = GemmShape.of(get_preset(preset).shard(int(tp)))
    t = GemmTactic.from_name(name)
    for f in glob.glob(os.path.join(dump, "*")):
        os.remove(f)
    r, w = os.pipe()
    saved = os.dup(2), os.dup(1)
    os.dup2(w, 2)
    os.dup2(w, 1)
    try:
        compile_gemm(shape, t, int(stage), False)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 2)
        os.dup2(saved[1], 1)
        os.close(w)
    log = os.read(r, 1 << 22).decode(errors="replace")
    os.close(r)
    files = glob.glob(os.path.join(dump, "*.sass"))
    sass = "".join(open(f).read() for f in files)
    os.makedirs(keep, exist_ok=True)
    open(os.path.join(keep, f"{preset}_{tp}_{stage}_{name}.sass"), "w").write(sass)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    lines = [l for l in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
    ops = []
    for l in lines:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", l)
        if m:
            ops.append(m.group(1))

    def hist(seq):
        c = collections.Counter(o.split(".")[0] for o in seq)
        return c

    idx = [i for i, o in enumerate(ops) if o.startswith(("HMMA", "QGMMA"))]
    body = ops[idx[0] : idx[-1] + 1] if idx else []
    hb, ha = hist(body), hist(ops)
    alu_b = {k: v for k, v in hb.items() if k in ALU}
    nh = hb["HMMA"] + hb["QGMMA"]
    print(
        json.dumps(
            dict(
                spec=spec,
                regs=regs,
                spills=spills,
                local=ha["LDL"] + ha["STL"],
                hmma=nh,
                alu_body=sum(alu_b.values()),
                alu_per_hmma=round(sum(alu_b.values()) / max(nh, 1), 2),
                hmul2_body=hb["HMUL2"],
                fma_body=hb["FFMA"] + hb["FMUL"] + hb["FADD"],
                alu_detail=dict(sorted(alu_b.items(), key=lambda kv: -kv[1])),
                ldg=hb["LDG"],
                lds=hb["LDS"],
                total_body=len(body),
            )
        ),
        flush=True,
    )
