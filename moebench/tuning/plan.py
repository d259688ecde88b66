"""The plan of `moebench tune` from its options: every option checked
(messages naming it) before the GPU is asked for, then one TuneConfig per
(preset, TP degree). Torch-free until `configs` is called.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from moebench.bench.plan import check_geometry, parse_int_list, parse_names


@dataclass(frozen=True)
class TunePlan:
    """The checked options of a tune: presets, TP degrees, rows and stages
    parsed; `settings` the TuneConfig fields they share."""

    presets: tuple[str, ...]
    tps: tuple[int, ...]
    settings: dict

    def writing_to(self, target) -> TunePlan:
        """This plan with its tables written into the directory `target`: the
        pair-or-fused step takes the pair's tactics it does not tune from
        `target` first, then the runtime's search path (TuneConfig.pair_tables)."""
        from moebench.kernels.table import default_search_dirs

        dirs = ((str(target),) if Path(target).is_dir() else ()) + tuple(str(d) for d in default_search_dirs())
        return replace(self, settings={**self.settings, "pair_tables": dirs})

    def configs(self) -> list:
        """One tuning_runner.TuneConfig per (preset, TP degree), in that order."""
        from moebench.tuning.runner import TuneConfig

        return [TuneConfig(preset=name, tp=(t,), **self.settings) for name in self.presets for t in self.tps]


def parse_stages(text: str | None, fp8: bool) -> tuple[int, ...]:
    """--stages: comma-separated 1, 2 and 'fused' (kernels.table.LAYER, --fp8
    only), each at most once; None: 1,2 (with fp8: 1,2,fused). Raises
    ValueError naming --stages."""
    from moebench.kernels.table import FUSED_KEY, LAYER

    if text is None:
        return (1, 2, LAYER) if fp8 else (1, 2)
    want = "expected 1, 2 and, with --fp8, 'fused', comma-separated, each once (e.g. '1,2,fused')"
    tokens = [t.strip() for t in str(text).split(",")]
    out: list[int] = []
    for token in tokens:
        stage = {"1": 1, "2": 2, FUSED_KEY: LAYER}.get(token)
        if stage is None:
            raise ValueError(f"--stages: cannot parse {token!r} in {text!r}; {want}")
        if stage in out:
            raise ValueError(f"--stages: {token!r} given twice in {text!r}; {want}")
        out.append(stage)
    if LAYER in out and not fp8:
        raise ValueError("--stages: 'fused' (the pair against the fused layer) needs --fp8: the fused layer is the"
                         " FP8 family's")  # fmt: skip
    return tuple(sorted(out))


def tune_plan(*, preset, hidden, intermediate, experts, top_k, tp, rows, stages, space, scenario, repeats, top,
              replays, warmup, layers, warm_l2, act_bf16, fp8, distinct_layers, seed, budget, jobs, summary,
              device) -> TunePlan:  # fmt: skip
    """Check `moebench tune`'s options as typed (the GPU is not asked for).
    Raises ValueError / TypeError naming the option (or the config field:
    bench.plan.option_message renames it)."""
    from moebench.bench.cases import SweepConfig
    from moebench.models import PRESETS
    from moebench.record import MAX_ROWS
    from moebench.routing import SCENARIOS
    from moebench.tuning.space import FP8_SPACES, SPACES

    if space not in SPACES:
        raise ValueError(f"--space: expected one of {sorted(SPACES)}, got {space!r}")
    if scenario not in SCENARIOS or scenario == "replay":
        raise ValueError(f"--scenario: expected one of {[s for s in SCENARIOS if s != 'replay']}, got {scenario!r}")
    names = tuple(PRESETS) if preset.strip() == "all" else parse_names(preset, "--preset")
    tps = parse_int_list(tp, "--tp", 1, 64)
    check_geometry(names, {"hidden": hidden, "intermediate": intermediate, "experts": experts,
                            "top_k": top_k}, reduced=False)  # fmt: skip
    # The sweep's checks of the presets, TP degrees and seed (messages naming --preset / --tp / --seed),
    # before the GPU check, so that a bad option is named on any machine.
    SweepConfig(presets=names, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                tp=tps, seed=seed, layers=layers, reduced=False)  # fmt: skip
    row_list = parse_int_list(rows, "--rows", 1, MAX_ROWS)
    stage_list = parse_stages(stages, fp8)
    for name, v, lo in (
        ("--repeats", repeats, 1),
        ("--top", top, 2),
        ("--replays", replays, 1),
        ("--warmup", warmup, 0),
    ):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if budget is not None and not budget > 0:
        raise ValueError(f"--budget must be a positive number of seconds, got {budget}")
    if jobs is not None and jobs < 0:
        raise ValueError(f"--jobs must be >= 0, got {jobs}")
    if device is not None and ":" in str(device):
        from moebench.bench.launch import under_torchrun

        if under_torchrun():
            raise ValueError(f"--device: under torchrun each rank tunes on its LOCAL_RANK's GPU; got {device!r},"
                             " give 'cuda' or no --device")  # fmt: skip
    if summary is not None and Path(summary).exists() and Path(summary).is_dir():
        raise ValueError(f"--summary: {summary} is a directory; give a file name, e.g. tune-gains.md")
    if summary is not None and Path(summary).suffix == ".json":
        raise ValueError(f"--summary: {summary} ends in .json, the name of the records written beside the"
                         " markdown (which they would overwrite); give a .md name, e.g. tune-gains.md")  # fmt: skip
    settings = dict(
        hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, rows=row_list, stages=stage_list,
        scenario=scenario, seed=seed, space=(FP8_SPACES if fp8 else SPACES)[space], repeats=repeats, top=top,
        warmup=warmup, replays=replays, layers=layers, warm_l2=warm_l2, device=device,
        copy_layers=not distinct_layers, act_bf16=act_bf16 and not fp8, fp8=fp8,
    )  # fmt: skip
    return TunePlan(names, tps, settings)
