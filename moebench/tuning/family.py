"""What layers run after a tuning run: the kernel family `moebench` picks
by default for each table just written (`moebench.kernels.family`'s rule),
as a markdown table for the tuning summary."""

from __future__ import annotations

from pathlib import Path

from moebench.kernels.family import FamilyChoice, choose_family
from moebench.kernels.table import default_search_dirs


def family_markdown(choices: list[tuple[str, FamilyChoice]]) -> str:
    """A markdown table of what layers run by default: per (label, choice)
    one line per row count the tables time (one line "-" when none) with
    each family's µs, the faster and the layer's family; then each choice's
    reason."""
    lines = ["| shape | rows | BF16 µs | FP8 µs | faster | layer runs |", "|---|---|---|---|---|---|"]
    for label, c in choices:
        timed = [t for t in c.times if t.faster is not None]
        for t in timed:
            cells = ["-" if v is None else f"{v:.1f}" for v in (t.bf16_us, t.fp8_us)]
            lines.append(f"| {label} | {t.rows} | {cells[0]} | {cells[1]} | {t.faster} | {c.family} |")
        if not timed:
            lines.append(f"| {label} | - | - | - | - | {c.family} |")
    notes = [f"- {label}: {c.describe()}" for label, c in choices]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def default_families(written, target: str | Path) -> list[tuple[str, FamilyChoice]]:
    """[(shape label, FamilyChoice)]: the kernel family `moebench` runs by
    default for each distinct (device name, shape class, SMs) in `written`
    (tables just written by `moebench tune`), from the tables in `target`
    first, then the runtime's search path (default_search_dirs)."""
    search = list(dict.fromkeys(Path(p).resolve() for p in (target, *default_search_dirs())))
    out = []
    for name, shape, sms in dict.fromkeys(written):
        out.append((f"{shape.describe()} on {name}", choose_family(name, shape, search=search, num_sms=sms)))
    return out
