"""Where a kernel's instructions and stalls go, from Nsight Compute's source page.

Reads the CSV that `ncu --import REPORT.ncu-rep --page source --csv
--print-source sass` writes (one block per profiled kernel, one row per SASS
instruction with its execution count and warp-stall samples) and prints, per
kernel:
  * instructions executed and stall samples in all;
  * the hot loop: the instructions executed as often as the kernel's most
    executed MMA (QGMMA / HGMMA / HMMA), i.e. once per step of the main loop,
    its length in SASS instructions, and the share of the samples in it;
  * an opcode histogram (executed instructions, share of the samples);
  * the stall reasons, in the hot loop and in all.

    ncu --set full -o prof python3 scripts/profile_gemms.py --tp 4 --rows 6 1:... 2:...
    ncu --import prof.ncu-rep --page source --csv --print-source sass > src.csv
    python3 scripts/ncu_hotloop.py src.csv [--top 20]

Runs anywhere (pure Python, no GPU). docs/perf-notes.md "Session 9" used it
for the v11 consumer.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys

_KERNEL = '"Kernel Name"'
_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_MMA = ("QGMMA", "HGMMA", "HMMA", "IMMA")
#: The source page's columns the hot loop is found from (without them every count would read 0;
#: without the stall samples, their shares print as '-').
COLUMNS = ("Source", "Instructions Executed")


def kernel_blocks(text: str) -> list[tuple[str, list[dict]]]:
    """(kernel name, rows) for each kernel block of a source-page CSV.
    Raises ValueError if the text holds no block, or a block lacks one of
    COLUMNS (e.g. a profile taken without the source counters)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(_KERNEL):
            name = next(csv.reader([line]))[1] if "," in line else "?"
            blocks.append((name, []))
        elif blocks:
            blocks[-1][1].append(line)
    if not blocks:
        raise ValueError(
            "no kernel block found: expected the output of `ncu --import R --page source --csv --print-source sass`"
        )
    out = []
    for name, lines in blocks:
        reader = csv.DictReader(io.StringIO("\n".join(lines)))
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"kernel {name[:60]!r} has no column {', '.join(map(repr, missing))}: expected the source page of a"
                " profile with the source counters (ncu --set full, or --section SourceCounters)"
            )
        out.append((name, list(reader)))
    return out


def _int(row: dict, key: str) -> int:
    value = (row.get(key) or "0").replace(",", "")
    return int(value) if value.isdigit() else 0


def opcode(source: str) -> str:
    """The opcode of one SASS line ('@!P0 NANOSLEEP.SYNCS 0x..' -> 'NANOSLEEP')."""
    m = _OPCODE.match(source.strip())
    return m.group(1) if m else source.strip()[:12]


def summarize(rows: list[dict]) -> dict:
    """Counts of one kernel block: totals, the hot loop, opcodes, stalls."""
    executed = [_int(r, "Instructions Executed") for r in rows]
    samples = [_int(r, "Warp Stall Sampling (All Samples)") for r in rows]
    mma = [e for r, e in zip(rows, executed) if opcode(r["Source"]).startswith(_MMA)]
    hot = max(mma) if mma else max(executed, default=0)
    loop = [i for i, e in enumerate(executed) if hot and e == hot]
    ops: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    stalls_all: collections.Counter = collections.Counter()
    stalls_loop: collections.Counter = collections.Counter()
    for i, r in enumerate(rows):
        op = ops[opcode(r["Source"])]
        op[0] += executed[i]
        op[1] += samples[i]
        for key in r:
            if key and key.startswith("stall_") and "Not Issued" not in key:
                n = _int(r, key)
                stalls_all[key[6:]] += n
                if i in loop:
                    stalls_loop[key[6:]] += n
    return dict(
        executed=sum(executed),
        samples=sum(samples),
        mma_per_step=sum(1 for i in loop if opcode(rows[i]["Source"]).startswith(_MMA)),
        loop_len=len(loop),
        steps=hot,
        loop_samples=sum(samples[i] for i in loop),
        ops=dict(ops),
        stalls_all=stalls_all,
        stalls_loop=stalls_loop,
    )


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f} %" if whole else "    - "


def report(name: str, s: dict, top: int) -> str:
    """Text report of one kernel's summary."""
    out = [
        f"== {name[:110]}",
        f"instructions executed {s['executed']:,}, stall samples {s['samples']:,}",
        f"hot loop: {s['loop_len']} SASS instructions executed {s['steps']:,} times each"
        f" ({s['mma_per_step']} MMA per step), {_pct(s['loop_samples'], s['samples'])} of the samples",
    ]
    out.append(f"{'opcode':12s} {'executed':>12s} {'share':>8s} {'samples':>8s}")
    for op, (n, smp) in sorted(s["ops"].items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{op:12s} {n:12,d} {_pct(n, s['executed'])} {_pct(smp, s['samples'])}")
    for label, counter in (("stalls in the hot loop", s["stalls_loop"]), ("stalls in all", s["stalls_all"])):
        total = sum(counter.values())
        out.append(f"{label}: " + ", ".join(f"{k} {_pct(v, total).strip()}" for k, v in counter.most_common(8)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="the CSV of `ncu --import R --page source --csv --print-source sass`")
    ap.add_argument("--top", type=int, default=20, help="opcodes to list per kernel (default 20)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top must be >= 1, got {args.top}")
    try:
        with open(args.csv, encoding="utf-8", errors="replace") as f:
            blocks = kernel_blocks(f.read())
    except (OSError, ValueError) as error:
        print(f"ncu_hotloop: {args.csv}: {error}", file=sys.stderr)
        return 2
    for name, rows in blocks:
        print(report(name, summarize(rows), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
