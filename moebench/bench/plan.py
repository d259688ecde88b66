"""The plan of a sweep / step / tune from its command-line options: option
lists parsed ('1-8', 'a,b'), the size overrides checked against each preset,
and, without a GPU, the presets that run at the reduced CPU geometry with the
note saying what runs. Torch-free at import (the CLI imports it at start-up).

Errors are ValueError naming the option as typed (--top-k, --experts, ...):
`option_message` renames a config field's message to its option.
"""

from __future__ import annotations

import re

def parse_int_list(text: str, option: str, lo: int, hi: int) -> tuple[int, ...]:
    """'1-8', '1,2,4', '6' or '1-4,8' -> sorted distinct ints in [lo, hi].
    Raises ValueError naming `option`."""
    values: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match or (match[2] is not None and int(match[1]) > int(match[2])):
            raise ValueError(f"{option}: cannot parse {part!r} (expected a list of integers in [{lo}, {hi}]"
                             f" such as '{lo}-{min(hi, lo + 3)}', '{lo},{min(hi, lo + 1)}' or '{lo}')")
        start = int(match[1])
        values.update(range(start, int(match[2] or start) + 1))
    bad = sorted(v for v in values if not lo <= v <= hi)
    if bad:
        raise ValueError(f"{option}: {bad} outside [{lo}, {hi}]")
    return tuple(sorted(values))


def parse_names(text: str, option: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b') (order kept, duplicates dropped). Raises ValueError
    naming `option` when empty or when an item is empty ('a,,b', 'a,'), as
    parse_int_list does."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"{option}: expected a comma-separated list, got {text!r}")
    if not all(parts):
        raise ValueError(f"{option}: empty item in {text!r} (expected e.g. 'a,b')")
    return tuple(dict.fromkeys(parts))


#: Config fields set by the option of the same name: the library's messages
#: name the field, the CLI's name the option as typed.

#: Config fields set by the option of the same name: the library's messages
#: name the field, the CLI's name the option as typed.
FIELD_OPTIONS = {"hidden": "--hidden", "intermediate": "--intermediate", "experts": "--experts",
                  "top_k": "--top-k", "replays": "--replays", "warmup": "--warmup", "layers": "--layers",
                  "seed": "--seed", "label": "--label", "threshold": "--fail-above"}  # fmt: skip



def option_message(error: Exception) -> str:
    """`error`'s text with a leading config field renamed to its option
    ('replays must be an int >= 1, got 0' -> '--replays must be ...')."""
    text = str(error)
    match = re.match(r"(\w+) must\b", text)
    if match and match[1] in FIELD_OPTIONS:
        return FIELD_OPTIONS[match[1]] + text[len(match[1]) :]
    if text.startswith("trace ") and not text.startswith("trace (--trace)"):  # the replay trace: 'trace PATH: ...'
        return "--" + text
    return text



def check_geometry(presets, overrides: dict, reduced: bool) -> None:
    """Build each known preset with the --hidden / --intermediate / --experts /
    --top-k overrides (and, when `reduced`, the CPU's reduced sizes, which run)
    so that a bad override fails here, naming its option. Unknown presets are
    left to the config (it names --preset)."""
    from moebench.bench.cases import CPU_REDUCED
    from moebench.models import PRESETS, get_preset

    given = {k: v for k, v in overrides.items() if v is not None}
    for name in (p for p in presets if p in PRESETS):
        for small in (True, False) if reduced else (False,):
            sizes = {**CPU_REDUCED, **given} if small else given
            try:
                get_preset(name, **sizes)
            except ValueError as error:
                if not str(error).startswith("top_k ("):
                    raise ValueError(option_message(error)) from None
                top_k, experts = sizes.get("top_k", PRESETS[name].top_k), sizes.get("experts", PRESETS[name].experts)
                if "top_k" not in given:
                    raise ValueError(f"--experts {experts} is below {name}'s top_k {top_k}; expected --experts >="
                                     f" {top_k} (or a smaller --top-k)") from None  # fmt: skip
                # top_k <= MAX_TOP_K (8) is below every preset's and the reduced geometry's experts
                origin = f"--experts {experts}" if "experts" in given else f"{name}'s {experts} experts"
                raise ValueError(f"--top-k {top_k} exceeds {origin}; expected --top-k <= {experts}") from None


#: One layer's expert bytes beyond which a CPU run is warned to be slow (the
#: default reduced layer is 6.5 MB).
CPU_HEAVY_BYTES = 256 * 2**20


def reduced_presets(names, overrides: dict, which: str) -> tuple[tuple[str, ...], str]:
    """Without a GPU every preset runs the reduced geometry: (the presets kept,
    those whose reduced layer equals an earlier one's dropped, and the note
    line saying what runs). Call after check_geometry."""
    from dataclasses import replace

    from moebench.bench.cases import CPU_REDUCED
    from moebench.models import PRESETS, get_preset

    sizes = {**CPU_REDUCED, **{k: v for k, v in overrides.items() if v is not None}}
    kept: dict = {}  # reduced layer (name blanked) -> preset
    dropped = []
    for name in names:
        if name not in PRESETS:
            kept[name] = name  # the config names the unknown preset
            continue
        layer = replace(get_preset(name, **sizes), name="")
        if layer in kept:
            dropped.append(f"{name} (same layer as {kept[layer]})")
        else:
            kept[layer] = name
    layers = [c for c in kept if not isinstance(c, str)]
    shapes = ", ".join(dict.fromkeys(f"(H={c.hidden}, I={c.intermediate}, E={c.experts}, top_k={c.top_k})"
                                     for c in layers))  # fmt: skip
    geometry = "the reduced geometry" if sizes == CPU_REDUCED else "the reduced geometry with your size overrides"
    # one layer's MXFP4 experts (w13 + w2 and their E8M0 scales): 3 H I E / 2 bytes x (1 + 1/16)
    largest = max((3 * c.hidden * c.intermediate * c.experts // 2 * 17 // 16 for c in layers), default=0)
    heavy = largest > CPU_HEAVY_BYTES
    note = (f"No GPU: running {which} on the CPU at {geometry} {shapes} whatever the preset, so preset"
            f" names are only labels (stored as <preset>+custom)"
            + (f"; not repeated: {', '.join(dropped)}" if dropped else "")
            + (f"; a large layer for a CPU run ({largest / 1e9:.1f} GB of MXFP4 experts, checked against an fp64"
               " oracle): expect minutes per case" if heavy else "")
            + "; CPU latencies say nothing about a GPU.")  # fmt: skip
    return tuple(kept.values()), note


def presets_to_run(preset: str, overrides: dict, reduced: bool, backend_list) -> tuple[tuple[str, ...], str | None]:
    """sweep / step: the --preset names (checked with the size overrides,
    naming their options) and, on the CPU (`reduced`), those whose reduced
    layer is new with the note line saying what runs (else None)."""
    from moebench.bench.cases import CPU_BACKENDS
    from moebench.models import PRESETS

    names = tuple(PRESETS) if str(preset).strip() == "all" else parse_names(preset, "--preset")
    check_geometry(names, overrides, reduced)
    if not reduced:
        return names, None
    runnable = cpu_runnable(backend_list or CPU_BACKENDS)
    kept, note = reduced_presets(names, overrides, ", ".join(runnable))
    if not runnable:
        note = (f"No GPU: none of the backends ({', '.join(backend_list)}) runs on the CPU, so every case is"
                f" stored as skipped with the reason.")  # fmt: skip
    return kept, note


def cpu_runnable(names) -> list[str]:
    """The backends among `names` that can run on the CPU (unknown names are
    kept: the run's own check names them)."""
    from moebench.backends.registry import backend_names, load_backend

    out = []
    for name in names:
        try:
            if name not in backend_names() or load_backend(name).unavailable_reason("cpu") is None:
                out.append(name)
        except Exception:  # noqa: BLE001 - a backend that cannot even load is not runnable
            continue
    return out

