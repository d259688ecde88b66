"""The plan of a sweep / step / tune from its command-line options: option
lists parsed ('1-8', 'a,b'), the size overrides checked against each preset,
and, without a GPU, the presets that run at the reduced CPU geometry with the
note saying what runs. Torch-free at import (the CLI imports it at start-up).

Errors are ValueError naming the option as typed (--top-k, --experts, ...):
`option_message` renames a config field's message to its option.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


def parse_int_list(text: str, option: str, lo: int, hi: int) -> tuple[int, ...]:
    """'1-8', '1,2,4', '6' or '1-4,8' -> sorted distinct ints in [lo, hi].
    Raises ValueError naming `option`."""
    values: set[int] = set()
    expected = (
        f"expected a list of integers in [{lo}, {hi}] such as '{lo}-{min(hi, lo + 3)}', '{lo},{min(hi, lo + 1)}'"
        f" or '{lo}'"
    )
    for part in (p.strip() for p in str(text).split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"{option}: cannot parse {part!r} ({expected})")
        start, end = int(match[1]), int(match[2] or match[1])
        if start > end:
            raise ValueError(f"{option}: {part!r} is a descending range; write '{end}-{start}' ({expected})")
        if not (lo <= start and end <= hi):  # before expanding: '1-300000000' must not build the range
            bad = sorted(v for v in {start, end} if not lo <= v <= hi)
            raise ValueError(f"{option}: {bad} outside [{lo}, {hi}]")
        values.update(range(start, end + 1))
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


def default_rows(reduced: bool) -> str:
    """--rows when not given: every row count (`record.ALL_ROWS`), or the
    reduced run's few (`record.REDUCED_ROWS`), as the option would spell them."""
    from moebench.record import ALL_ROWS, REDUCED_ROWS

    return ",".join(str(r) for r in (REDUCED_ROWS if reduced else ALL_ROWS))


@dataclass(frozen=True)
class SweepPlan:
    """What `sweep` runs: its config; the note of a CPU run (else None); the
    GPUs of a sharded sweep (--devices, else None) and its backends."""

    config: object
    note: str | None
    gpus: tuple[int, ...] | None
    backends: tuple[str, ...] | None


def sweep_plan(*, preset, hidden, intermediate, experts, top_k, rows, tp, backends, scenario, tactics, seed,
               warm_l2, layers, replays, warmup, graph, split, back_to_back, device, devices, worker_timeout, trace,
               label, out) -> SweepPlan:  # fmt: skip
    """The plan of `moebench sweep` from its options as typed (None: not
    given): on the CPU a smaller default grid (rows 1,4,8, TP 1,8) at the
    reduced geometry. Checks everything that can be checked before a case
    runs, except that `out` takes files. Raises ValueError / TypeError
    naming the option (or the config field: option_message renames it)."""
    from moebench.backends.registry import backend_names
    from moebench.bench.cases import SweepConfig
    from moebench.bench.sweep import validate_sweep
    from moebench.env import resolve_device
    from moebench.record import MAX_ROWS
    from moebench.reports.store import run_dir_name

    run_dir_name(label)
    backend_list = None
    if backends == "all":
        backend_list = backend_names()
    elif backends != "default":
        backend_list = parse_names(backends, "--backends")
    gpus = None
    if devices is not None:
        from moebench.bench import launch, shard

        if device is not None:
            raise ValueError("--device and --devices exclude each other (--devices picks the GPUs)")
        if launch.under_torchrun():
            raise ValueError("--devices: not under torchrun (its --nproc-per-node starts one rank per GPU)")
        gpus = shard.parse_devices(devices, launch.visible_gpu_count())
        dev = resolve_device("cpu")  # the CLI process itself measures nothing
    else:
        dev = resolve_device(device)
    if worker_timeout is not None and (gpus is None or not worker_timeout > 0):
        raise ValueError("--worker-timeout: needs --devices and a positive number of seconds")
    reduced = dev.type == "cpu" and gpus is None
    # A CPU run is a smoke run of the reference: a smaller default grid.
    rows = default_rows(reduced) if rows is None else rows
    tp = ("1,8" if reduced else "1,2,4,8") if tp is None else tp
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    names, note = presets_to_run(preset, {"hidden": hidden, "intermediate": intermediate, "experts": experts,
                                           "top_k": top_k}, reduced, backend_list)  # fmt: skip
    config = SweepConfig(
        presets=names, hidden=hidden, intermediate=intermediate,
        experts=experts, top_k=top_k, tp=parse_int_list(tp, "--tp", 1, 64),
        rows=parse_int_list(rows, "--rows", 1, MAX_ROWS), scenarios=parse_names(scenario, "--scenario"),
        backends=backend_list, tactics=parse_names(tactics, "--tactics"), seed=seed, warm_l2=warm_l2,
        layers=layers, device=f"cuda:{gpus[0]}" if gpus else str(dev), reduced=reduced, warmup=warmup,
        replays=replays, use_graph=graph, trace=trace, split=split, back_to_back=back_to_back,
    )  # fmt: skip
    if gpus is None:  # a sharded sweep's workers check the tactics on their own GPU
        validate_sweep(config)
    else:
        from moebench.bench.pipeline import check_backend_names
        from moebench.bench.sweep import default_backends

        backend_list = backend_list or default_backends("cuda")
        check_backend_names(backend_list)
    return SweepPlan(
        config, note, None if gpus is None else tuple(gpus), None if backend_list is None else tuple(backend_list)
    )


@dataclass(frozen=True)
class StepPlan:
    """What `step` runs: its config; the note of a CPU run (else None); where
    the ranks run, in words."""

    config: object
    note: str | None
    where: str


def step_plan(*, preset, hidden, intermediate, experts, top_k, tp, one_rank, rows, scenario, backends, tactics,
              seed, warm_l2, layers, replays, warmup, graph, split, overlap_shared, device, devices, timeout, trace,
              label, out) -> StepPlan:  # fmt: skip
    """The plan of `moebench step` from its options as typed (None: not
    given): one rank (--tp 1 or --one-rank) on one device, else --tp ranks
    on as many GPUs (--devices) or CPU processes. Checks everything that can
    be checked before a rank runs, except that `out` takes files. Raises
    ValueError / TypeError naming the option."""
    from moebench.backends.registry import backend_names
    from moebench.bench.decode_step import StepConfig, rank_devices, validate_step
    from moebench.bench.launch import under_torchrun, visible_gpu_count
    from moebench.bench.shard import parse_devices
    from moebench.env import resolve_device
    from moebench.record import MAX_ROWS
    from moebench.reports.store import run_dir_name

    run_dir_name(label)
    if not isinstance(tp, int) or not 1 <= tp <= 64:
        raise ValueError(f"--tp: expected a TP degree in [1, 64], got {tp!r}")
    ranks = 1 if (tp == 1 or one_rank) else tp
    torchrun = under_torchrun()
    if torchrun:  # torchrun started the ranks: one per TP rank, on as many hosts as it was told
        world = int(os.environ["WORLD_SIZE"])
        if ranks != world or devices is not None or timeout is not None:
            raise ValueError(
                f"--tp: under torchrun a step is TP-{world}, one rank per process (--tp {world},"
                " no --one-rank, --devices or --timeout: torchrun places and stops the ranks)"
            )
    dev = resolve_device(None if device is None else device)
    if ranks > 1 and device is not None and dev.type == "cuda" and ":" in device:
        raise ValueError("--device: with --tp N > 1 give --devices (one GPU per rank), not an index")
    gpu_list = None
    if devices is not None:
        if ranks == 1:
            why = "--one-rank times one rank" if one_rank else "--tp 1 is one rank"
            raise ValueError(
                f"--devices: only for several ranks (--tp N > 1 without --one-rank; {why}); use --device for one rank"
            )
        if dev.type != "cuda":
            raise ValueError("--devices: the ranks run on the CPU here (no GPU, or --device cpu)")
        gpu_list = tuple(parse_devices(devices, visible_gpu_count()))
        if len(gpu_list) != ranks:
            raise ValueError(f"--devices: --tp {tp} needs {ranks} GPUs, got {len(gpu_list)} ({devices!r})")
    if timeout is not None and ranks == 1:
        raise ValueError(
            "--timeout: only for a real TP step (--tp N > 1 without --one-rank: it bounds the rank processes)"
            if one_rank and tp > 1
            else "--timeout: needs --tp N > 1"
        )
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout}")
    reduced = dev.type == "cpu"
    rows = default_rows(reduced) if rows is None else rows
    backend_list = None
    if backends == "all":
        backend_list = backend_names()
    elif backends != "default":
        backend_list = parse_names(backends, "--backends")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    names, note = presets_to_run(preset, {"hidden": hidden, "intermediate": intermediate, "experts": experts,
                                           "top_k": top_k}, reduced, backend_list)  # fmt: skip
    config = StepConfig(
        presets=names, hidden=hidden, intermediate=intermediate, experts=experts,
        top_k=top_k, tp=(tp,), rows=parse_int_list(rows, "--rows", 1, MAX_ROWS),
        scenarios=parse_names(scenario, "--scenario"), backends=backend_list,
        tactics=parse_names(tactics, "--tactics"), seed=seed, warm_l2=warm_l2,
        layers=layers, device=str(dev) if ranks == 1 else dev.type, reduced=reduced, warmup=warmup,
        replays=replays, use_graph=graph, trace=trace, ranks=ranks, devices=gpu_list, split=split,
        overlap_shared=overlap_shared,
    )  # fmt: skip
    gpu_used = None
    if ranks > 1 and not torchrun:
        _, gpu_used = rank_devices(config)  # more ranks than GPUs: error naming both numbers
    validate_step(config)  # unknown backends or tactics
    where = (f"{ranks} ranks under torchrun ({'NCCL' if dev.type == 'cuda' else 'gloo'})" if torchrun
             else f"{ranks} ranks on GPUs {', '.join(map(str, gpu_used))} (NCCL)" if ranks > 1 and dev.type == "cuda"
             else f"{ranks} ranks on the CPU (gloo)" if ranks > 1 else f"one rank on {dev}")  # fmt: skip
    return StepPlan(config, note if reduced else None, where)
