"""The case grid of a sweep and the bytes a case moves.

A case is (preset config, tp, rows, scenario, backend, tactic, seed). The
grid is the product of `SweepConfig`'s axes. `unique_bytes` counts what any
backend must move at least once: the logical (unpadded) MXFP4 weights and
E8M0 scales of the touched local experts plus the BF16 activations in and
out; the same count for every backend, so GB/s compare directly.
`touched_bytes` is the same count for any per-expert size (a backend's own
layout: padding, BF16 copies), which `Backend.read_bytes` implementations
use with `mxfp4_bytes` for what a path really reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from moebench.bench import check_layers, check_seed
from moebench.models import PRESETS, MoEConfig, RankShape, get_preset
from moebench.record import ALL_ROWS, MAX_ROWS
from moebench.routing import SCENARIOS
from moebench.traffic import touched_bytes

#: Reduced geometry of a CPU-only run (overridable per axis).
CPU_REDUCED = {"hidden": 512, "intermediate": 256, "experts": 32}
#: Backends a CPU-only run uses.
CPU_BACKENDS = ("reference", "torch-bf16")


@dataclass(frozen=True)
class Case:
    """One measured point: a rank shape, a routing and a backend tactic."""

    config: MoEConfig
    tp: int
    rows: int
    scenario: str
    backend: str
    tactic: str = "default"
    seed: int = 0

    @property
    def shape(self) -> RankShape:
        return self.config.shard(self.tp)

    def label(self) -> str:
        return f"{self.config.name} tp{self.tp} rows={self.rows} {self.scenario} {self.backend}[{self.tactic}]"


def _tuple_of(name: str, values, kind) -> tuple:
    if isinstance(values, (str, int)):
        values = (values,)
    try:
        out = tuple(values)
    except TypeError as error:
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__}") from error
    if not out:
        raise ValueError(f"{name} must not be empty")
    for v in out:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise TypeError(f"{name}: expected {kind.__name__} values, got {v!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has duplicates: {out}")
    return out


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep measures.

    presets: preset names (models.PRESETS); hidden / intermediate / experts /
    top_k: overrides applied to every preset; tp: tensor-parallel degrees (one
    rank's shape each); rows: token rows, 1..8; scenarios: routing.SCENARIOS
    ("replay" needs `trace`, an .npz path, which only "replay" reads: a trace without
    it is an error); backends: registry names, None =
    every registered backend; tactics: tactic names tried per backend (those a
    backend does not offer for a shape are skipped with a reason); seed: of
    weights, routing and activations; warm_l2: time one weight set over and
    over (else rotate >= 4 x L2 of distinct layers); layers: force the
    rotation count; device: "cpu" / "cuda[:N]", None = the GPU if any, else
    the CPU; reduced: run a reduced geometry (CPU_REDUCED, per-axis overrides
    win), None = only on a CPU; warmup / replays: timing counts; use_graph:
    CUDA-graph replay for capturable backends; back_to_back: time the layer
    calls of a replay back to back (call i+1 may start under call i) instead
    of at a layer boundary (the default: a plain kernel writes each call's x
    just before it and its own time is subtracted; `sweep` module docstring);
    memory_fraction: share of free
    device memory the weight sets may take; split: also time each stage alone
    (and, in a sweep, the routed path) for backends that split their forward
    (False: the layer call / step only, about a third of a sweep case's
    timing work). Eager timing (a backend that is not
    capturable, or any CPU run) caps warmup / replays at 2 / 20.

    Raises ValueError / TypeError naming the field for a bad value.
    """

    presets: tuple[str, ...] = ("dsv41-flash",)
    hidden: int | None = None
    intermediate: int | None = None
    experts: int | None = None
    top_k: int | None = None
    tp: tuple[int, ...] = (1,)
    rows: tuple[int, ...] = ALL_ROWS
    scenarios: tuple[str, ...] = ("correlated",)
    backends: tuple[str, ...] | None = None
    tactics: tuple[str, ...] = ("default",)
    seed: int = 0
    warm_l2: bool = False
    layers: int | None = None
    device: str | None = None
    reduced: bool | None = None
    warmup: int = 10
    replays: int = 100
    use_graph: bool = True
    memory_fraction: float = 0.6
    trace: Path | None = None
    split: bool = True
    back_to_back: bool = False

    #: The command this config is for, as its messages name it (a class attribute, not a field).
    _command = "sweep"

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("presets", _tuple_of("presets", self.presets, str))
        for p in self.presets:
            if p not in PRESETS:
                raise ValueError(f"presets (--preset): unknown preset {p!r}; expected one of {sorted(PRESETS)}")
        set_("tp", _tuple_of("tp", self.tp, int))
        if any(t <= 0 for t in self.tp):
            raise ValueError(f"tp must be positive, got {self.tp}")
        set_("rows", _tuple_of("rows", self.rows, int))
        if any(not 1 <= r <= MAX_ROWS for r in self.rows):
            raise ValueError(f"rows must lie in [1, {MAX_ROWS}], got {self.rows}")
        set_("scenarios", _tuple_of("scenarios", self.scenarios, str))
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"scenarios (--scenario): unknown scenario {s!r}; expected one of {SCENARIOS}")
        if "replay" in self.scenarios and self.trace is None:
            raise ValueError("scenarios (--scenario): 'replay' needs trace (--trace) = an .npz with topk_ids")
        if self.trace is not None and "replay" not in self.scenarios:
            # Only the replay scenario reads the trace: never ignore one silently.
            raise ValueError(
                f"trace (--trace) is only read by the 'replay' scenario, and scenarios (--scenario) is"
                f" {','.join(self.scenarios)}; add replay to --scenario (e.g. --scenario replay) or drop --trace"
            )
        if self.backends is not None:
            set_("backends", _tuple_of("backends", self.backends, str))
        set_("tactics", _tuple_of("tactics", self.tactics, str))
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        check_seed(self.seed)
        if not isinstance(self.replays, int) or self.replays < 1:
            raise ValueError(f"replays must be an int >= 1, got {self.replays!r}")
        check_layers(self.layers)
        if self.layers is not None and self.warm_l2 is True:
            raise ValueError(
                f"layers must not be set with --warm-l2 (which times one weight set with the L2"
                f" warm), got {self.layers}: drop one of them"
            )
        if not isinstance(self.split, bool):
            raise TypeError(f"split must be a bool, got {type(self.split).__name__}")
        if not isinstance(self.back_to_back, bool):
            raise TypeError(f"back_to_back (--back-to-back) must be a bool, got {type(self.back_to_back).__name__}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        # Validate the geometry now (bad overrides / tp fail here, not mid-run).
        for p in self.presets:
            for tp in self.tp:
                self._check_tp(p, tp)

    def _check_tp(self, preset: str, tp: int) -> None:
        """Raise ValueError (naming --tp and the TP degrees that would work)
        when `preset` (with the overrides, and the reduced CPU geometry when
        this run uses it) cannot be split `tp` ways. The degrees suggested are
        those of the geometry that runs."""
        full = self.config_for(preset, reduced=False)
        small = self.config_for(preset, reduced=True) if self.reduced else full
        if small.intermediate != full.intermediate:  # the CPU's reduced I runs, not the preset's
            try:
                small.shard(tp)
            except ValueError:
                fit = 32 * tp * -(-CPU_REDUCED["intermediate"] // (32 * tp))
                raise ValueError(
                    f"tp={tp} (--tp): without a GPU the {self._command} runs a reduced geometry (intermediate"
                    f" {small.intermediate} instead of {full.name}'s {full.intermediate}, hidden {small.hidden},"
                    f" experts {small.experts}) and {small.intermediate} does not split into {tp} slices of whole"
                    f" 32-wide MX blocks; valid --tp values on the CPU: {_fmt_tps(small.intermediate, full.intermediate)},"
                    f" or give --intermediate {fit} (a multiple of {32 * tp})"
                ) from None
        try:
            full.shard(tp)
        except ValueError:
            raise ValueError(
                f"tp={tp} (--tp): {full.name}'s intermediate size {full.intermediate} does not split into"
                f" {tp} slices of whole 32-wide MX blocks; valid --tp values:"
                f" {_fmt_tps(small.intermediate, full.intermediate)}"
            ) from None

    def config_for(self, preset: str, *, reduced: bool) -> MoEConfig:
        """The preset with this sweep's overrides (and the reduced CPU geometry
        when `reduced`, explicit overrides winning)."""
        over = {k: getattr(self, k) for k in ("hidden", "intermediate", "experts", "top_k")}
        if reduced:
            for k, v in CPU_REDUCED.items():
                if over[k] is None:
                    over[k] = v
        return get_preset(preset, **over)


def _fmt_tps(*intermediates: int, limit: int = 64) -> str:
    """The TP degrees (<= limit) that split every one of `intermediates` into whole MX blocks."""
    return ",".join(
        str(t) for t in range(1, limit + 1) if all(i % t == 0 and (i // t) % 32 == 0 for i in intermediates)
    )


def expand_cases(config: SweepConfig, backends: tuple[str, ...], *, reduced: bool) -> list[Case]:
    """Every case of `config` for `backends`, grouped by (preset, tp) then
    (rows, scenario) then backend and tactic."""
    cases = []
    for preset, tp in itertools.product(config.presets, config.tp):
        cfg = config.config_for(preset, reduced=reduced)
        for rows, scenario, backend, tactic in itertools.product(
            config.rows, config.scenarios, backends, config.tactics
        ):
            cases.append(Case(cfg, tp, rows, scenario, backend, tactic, config.seed))
    return cases


def unique_bytes(shape: RankShape, topk_ids: torch.Tensor) -> int:
    """Bytes a case moves at least once: `touched_bytes` at the logical MXFP4
    size of an expert (shape.expert_bytes(): no padding). Raises ValueError
    unless topk_ids is 2-D with top_k columns."""
    return touched_bytes(shape, topk_ids, shape.expert_bytes())


def rotation_bytes(shape: RankShape, routings) -> int:
    """The touched bytes that size a replay's weight-set rotation
    (`sweep.layer_count`): those of one row over top_k distinct experts (the
    fewest any normal routing of the shape touches), or fewer if one of
    `routings` (iterable of [rows, top_k] id tensors) touches fewer (-1 ids,
    a replayed trace). So the rotation, and with it the share of a replay's
    boundary (graph launch, the first layer's ramp, the last one's tail) that
    each layer call carries, is a property of the shape, not of which row
    counts a sweep happens to hold: TP4 rows 4 timed alone rotated 4 layers
    and read 25.7 µs against 24.2 with 9 layers in a rows 1-8 sweep
    (docs/perf-notes.md, session 16). Raises ValueError as unique_bytes."""
    one_row = torch.arange(shape.top_k, dtype=torch.int64).reshape(1, shape.top_k)
    return min([unique_bytes(shape, one_row), *(unique_bytes(shape, ids) for ids in routings)])
