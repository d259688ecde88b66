"""Print the per-stage times (kernel_<stage>_us) of stored sweep runs, one
line per case: `python3 scripts/stage_times.py RUN_DIR_OR_ROOT [--backend NAME]`.
A root (e.g. $OUT/runs) is searched for */results.parquet. The sweep's own
table leaves these columns out (they are in the report's summary.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

KEYS = ["backend", "preset", "tp", "rows", "scenario"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory or a root holding run directories")
    parser.add_argument("--backend", default=None, help="only this backend's rows")
    args = parser.parse_args(argv)
    files = [args.path / "results.parquet"] if (args.path / "results.parquet").is_file() else sorted(
        args.path.glob("*/results.parquet"))  # fmt: skip
    if not files:
        print(f"no results.parquet under {args.path}", file=sys.stderr)
        return 2
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    if args.backend is not None:
        frame = frame[frame["backend"] == args.backend]
    stages = [c for c in frame.columns if c.startswith("kernel_") and c.endswith("_us") and frame[c].notna().any()]
    if frame.empty or not stages:
        print("no rows with kernel_<stage>_us", file=sys.stderr)
        return 1
    shown = frame[[c for c in KEYS if c in frame.columns] + ["median_us", *stages]].sort_values(KEYS)
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
