"""Print README.md's measured tables from one stored comparison run.

    python3 scripts/readme_tables.py reports/runs/<date>-<label>

One table per TP degree (dsv41-flash, correlated): each backend's "µs / %
of copy" per rows, the fastest peer and our speed-up over it (the peer's µs
over ours). Ours is the "nopdl=default" case: the default tactics with the
route launched without PDL, as the peers' first kernels are (the run's PDL
A/B found PDL worth 0.1-0.3 µs at TP8, beyond the noise at 3 of its 5
points, and nothing beyond the noise at TP4); the peers
run "default". Then the error table (the worst `err` and
`err_bf16` over rows 1-8 per backend and TP). Every number comes from the
one run named, so no ratio is quoted across runs;
tests/reports/test_committed_runs.py checks the README's cells against it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moebench.reports.store import read_run  # noqa: E402

#: README column -> backend, in the README's order (ours first).
COLUMNS = {
    "moebench (ours)": "moebench",
    "FlashInfer W4A16": "flashinfer-w4a16",
    "FlashInfer W4A8": "flashinfer-w4a8",
    "Marlin W4A16": "marlin-w4a16",
    "humming W4A16": "humming-w4a16",
    "humming W4A8": "humming-w4a8",
    "triton_kernels": "triton-mxfp4",
    "torch BF16": "torch-bf16",
}
ROWS = (1, 2, 4, 6, 8)


#: The tactic README quotes per backend (every other backend: "default").
OURS_TACTIC = "nopdl=default"


def cases(df, tp: int):
    """The run's ok cases of dsv41-flash, correlated, at `tp`: ours at
    OURS_TACTIC, every peer at its default."""
    keep = (df.preset == "dsv41-flash") & (df.tp == tp) & (df.scenario == "correlated") & (df.status == "ok")
    tactic = df.tactic == df.backend.map(_tactic)
    return df[keep & tactic]


def _tactic(backend: str) -> str:
    return OURS_TACTIC if backend == "moebench" else "default"


def check_run(df, manifest: dict, run) -> list[int]:
    """The TP degrees of the run's dsv41-flash correlated cases, once every
    case the tables quote is there: each backend of COLUMNS at its tactic,
    status ok, at every rows of ROWS per TP. Raises ValueError naming `run`
    (the run's path) and what is missing: full-size cases (a reduced CPU
    run), the err_bf16 column, any such case, or the cases a TP lacks
    (backend, tactic and rows)."""
    if manifest.get("reduced"):
        raise ValueError(f"{run} is a reduced CPU run (manifest 'reduced': true): README quotes full-size GPU runs")
    if "err_bf16" not in df.columns:
        raise ValueError(f"{run} has no 'err_bf16' column (stored before it was measured): the error table quotes it")
    keep = (df.preset == "dsv41-flash") & (df.scenario == "correlated") & (df.status == "ok")
    tps = sorted(int(t) for t in df[keep].tp.unique())
    if not tps:
        raise ValueError(f"{run} holds no ok dsv41-flash case at the correlated scenario: nothing README quotes")
    missing = []
    for tp in tps:
        sel = cases(df, tp)
        for backend in COLUMNS.values():
            rows = sorted(set(ROWS) - {int(r) for r in sel[sel.backend == backend].rows})
            if rows:
                missing.append(f"TP{tp} {backend} {_tactic(backend)} rows {','.join(map(str, rows))}")
    if missing:
        raise ValueError(
            f"{run} lacks ok dsv41-flash correlated cases the tables quote: {'; '.join(missing)} (ours at tactic"
            f" {OURS_TACTIC!r}, every peer at 'default', rows {','.join(map(str, ROWS))})"
        )
    return tps


def speed_table(df, tp: int) -> list[str]:
    sel = cases(df, tp)
    head = ["rows", *COLUMNS, "fastest peer", "speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rows in ROWS:
        case = sel[sel.rows == rows].set_index("backend")
        cells = [str(rows)]
        for backend in COLUMNS.values():
            rec = case.loc[backend]
            cells.append(f"{rec.median_us:.1f} / {rec.pct_copy_bw:.1f} %")
        peers = case.drop("moebench")["median_us"]
        cells += [peers.idxmin(), f"{peers.min() / case.loc['moebench', 'median_us']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def error_table(df, tps) -> list[str]:
    head = ["backend", *(f"TP{tp} err / err_bf16" for tp in tps)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for col, backend in COLUMNS.items():
        cells = [col]
        for tp in tps:
            sel = cases(df, tp)
            sel = sel[sel.backend == backend]
            cells.append(f"{sel.max_rel_err.max():.1e} / {sel.err_bf16.max():.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a stored run directory (reports/runs/<date>-<label>)")
    args = parser.parse_args(argv)
    try:
        df, manifest = read_run(args.run)
        tps = check_run(df, manifest, args.run)
    except (OSError, ValueError) as error:  # FileNotFoundError, a damaged run, one without the quoted cases
        parser.error(f"argument run: {error}")
    for tp in tps:
        print(f"**TP{tp}**, correlated: µs per layer call / % of copy\n")
        print("\n".join(speed_table(df, tp)) + "\n")
    print("Worst error over rows 1-8 (correlated): `err` against each backend's oracle / `err_bf16` against the"
          " BF16-activation fp64 oracle\n")  # fmt: skip
    print("\n".join(error_table(df, tps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
