"""What a sweep and a step share: which backends a run selects and loads,
the checks made before anything is measured, the rows of a case, the cases
an interrupt left unrun, and the result of a run.

`sweep.run_sweep` and `decode_step.run_rank` both measure through these;
the launcher (`launch.py`) spreads either over processes and hosts. A new
backend is found through the registry here; a new column is declared in
`columns.py`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from moebench.backends.base import DEFAULT_TACTIC, Backend, BackendUnavailable
from moebench.backends.registry import backend_names, load_backend
from moebench.bench.cases import CPU_BACKENDS, Case, SweepConfig
from moebench.bench.columns import columns_of
from moebench.bench.interrupt import INTERRUPTED
from moebench.models import RankShape

#: The tactic name that stands for every tactic a backend offers for a shape.
ALL_TACTICS = "all"


@dataclass
class RunResult:
    """frame: one row per case; manifest: JSON-ready provenance; ranks:
    every rank's rows of a TP step run over several ranks (else None)."""

    frame: pd.DataFrame
    manifest: dict
    ranks: pd.DataFrame | None = None


def error_text(error: BaseException) -> str:
    """The first line of "Type: message" (at most 500 characters)."""
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:500] if text else type(error).__name__


def release(device: torch.device) -> None:
    """Free what Python and the CUDA caching allocator hold (a no-op beyond gc on the CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def jsonable(value):
    """`value` with containers as lists / dicts and anything else not JSON as str."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ----------------------------------------------------------------------------- backends


def check_backend_names(names) -> None:
    """Raise ValueError naming the unknown ones unless every name is registered."""
    known = backend_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"backends (--backends): unknown {unknown}; expected names from {list(known)}")


def select_backends(config: SweepConfig, device: torch.device, gpu_default: tuple[str, ...] | None = None
                    ) -> tuple[str, ...]:  # fmt: skip
    """The backend names `config` selects on `device`: its own list, else
    CPU_BACKENDS on the CPU and `gpu_default` on a GPU (None: every
    registered backend but "reference"). ValueError for unknown names."""
    if config.backends is not None:
        names = tuple(config.backends)
    elif device.type == "cpu":
        names = CPU_BACKENDS
    else:
        names = gpu_default or tuple(n for n in backend_names() if n != "reference")
    check_backend_names(names)
    return names


def load_backends(names, device: torch.device | None = None) -> tuple[dict[str, Backend], dict[str, str | None]]:
    """(the backends of `names` that load, by name; why each cannot run on
    `device`, None when it can). Without a device no availability check is
    made (enough to list tactics). Never raises for a backend's own failure."""
    backends: dict[str, Backend] = {}
    reasons: dict[str, str | None] = {}
    for name in names:
        try:
            backends[name] = load_backend(name)
            reasons[name] = None if device is None else backends[name].unavailable_reason(device)
        except BackendUnavailable as error:
            reasons[name] = error.reason
        except Exception as error:  # noqa: BLE001
            reasons[name] = f"availability check failed: {error_text(error)}"
    return backends, reasons


def is_peer(backends: dict[str, Backend], name: str) -> bool:
    """`Backend.peer` of backend `name` (True, a peer, for one that did not load)."""
    backend = backends.get(name)
    return bool(backend.peer) if backend is not None else True


def pair_label(backend: str, tactic: str) -> str:
    """ "backend" for its default tactic, else "backend[tactic]"."""
    return backend if tactic == DEFAULT_TACTIC else f"{backend}[{tactic}]"


# ----------------------------------------------------------------------------- tactics


def check_tactic_names(config: SweepConfig, names, backends: dict[str, Backend], *, reduced: bool) -> None:
    """Raise ValueError (naming --tactics and the valid values) for a tactic
    name that none of the selected backends offers for any shape of the
    run, before anything is measured. "all" is always valid; a selected
    backend that could not be loaded (its tactics unknown) disables the
    check, its cases are then skipped with the reason."""
    if any(name not in backends for name in names):
        return
    shapes = [config.config_for(p, reduced=reduced).shard(tp) for p in config.presets for tp in config.tp]
    offered: dict[str, list[str]] = {}
    for name in names:
        tactics: list[str] = []
        for shape in shapes:
            tactics += [t for t in backends[name].valid_tactics(shape) if t not in tactics]
        offered[name] = tactics
    known = {t for ts in offered.values() for t in ts} | {ALL_TACTICS}
    unknown = []
    for t in config.tactics:
        formed = [backends[n] for n in names if t not in known and backends[n].tactic_form(t) is not None]
        if formed and all(b.tactic_form_error(t) for b in formed):  # a parametrized tactic whose value is wrong
            raise ValueError(f"tactics (--tactics): {t!r}: {formed[0].tactic_form_error(t)}")
        if t not in known and not formed:
            unknown.append(t)
    if unknown:
        per_backend = "; ".join(
            f"{name}: {', '.join(ts + list(backends[name].tactic_forms))}" for name, ts in offered.items()
        )
        hints = []
        for t in unknown:  # a tactic of a backend that is not selected: say which one
            owners = [n for n in backend_names() if n not in names and _offers(n, t, shapes)]
            if owners:
                hints.append(f"{t!r} is a tactic of {' / '.join(owners)}: add it to --backends")
        raise ValueError(
            f"tactics (--tactics): {', '.join(repr(t) for t in unknown)} not offered by the selected backends;"
            f" expected 'all', 'default' or a comma-separated list of {per_backend}" + "".join(f"; {h}" for h in hints)
        )


#: (config, backend names, reduced) whose tactic names `check_tactics_once` has checked in this process.
_CHECKED: set = set()


def check_tactics_once(config: SweepConfig, names, backends: dict[str, Backend], *, reduced: bool) -> None:
    """`check_tactic_names` at the first edge a run's tactic strings meet
    (`plan.sweep_plan` / `validate`, or `run_sweep` / the step when called
    directly), and not again for the same config and backends in this
    process: the strings are validated once, then trusted (each case still
    asks its backend whether the tactic runs its shape: `skip_reason`).
    Raises ValueError as `check_tactic_names`."""
    key = (config, tuple(names), reduced)
    try:
        if key in _CHECKED:
            return
    except TypeError:  # an unhashable config (a test's stand-in): check every time
        key = None
    check_tactic_names(config, names, backends, reduced=reduced)
    if key is not None and all(name in backends for name in names):  # a backend that did not load: check again
        _CHECKED.add(key)


def _offers(name: str, tactic: str, shapes) -> bool:
    """Whether backend `name` (loaded without an availability check) offers
    `tactic` for any of `shapes`; False if it does not load."""
    with contextlib.suppress(Exception):
        backend = load_backend(name)
        return backend.tactic_form(tactic) is not None or any(tactic in backend.valid_tactics(s) for s in shapes)
    return False


def validate(config: SweepConfig, device: torch.device, gpu_default: tuple[str, ...] | None = None) -> None:
    """The checks a run makes before measuring anything: backend names,
    tactic names and, for the replay scenario, the trace (it is read once
    here, cheaply, on the CPU). Raises ValueError naming the option."""
    from moebench.routing import scenario_topk_ids

    reduced = reduced_of(config, device)
    names = select_backends(config, device, gpu_default)
    check_tactics_once(config, names, load_backends(names)[0], reduced=reduced)
    if "replay" in config.scenarios:
        for preset in config.presets:
            for tp in config.tp:
                shape = config.config_for(preset, reduced=reduced).shard(tp)
                for rows in config.rows:
                    scenario_topk_ids("replay", rows, shape.top_k, shape.experts, config.seed, config.trace)


def reduced_of(config: SweepConfig, device: torch.device) -> bool:
    """Whether `config` runs the reduced geometry on `device` (its own
    choice, else only on the CPU)."""
    return config.reduced if config.reduced is not None else device.type == "cpu"


def expand_all_tactics(cases: list[Case], backends: dict[str, Backend]) -> list[Case]:
    """Replace each case of tactic "all" by one case per tactic its backend
    offers for the case's shape: also for a backend that loaded but cannot
    run here (each such case is then skipped with the reason, so the run
    lists what the backend offers); just "default" for one that did not load.
    The tactic "default" only names (`Backend.default_alias`: torch-bf16's
    "grouped") is stored as "default" whether or not "default" is held too,
    from "all" or listed, so one kernel is not timed twice and its name does
    not depend on how the list was spelled (`grouped,gather` and
    `default,gather` store the same cases; a baseline recorded with
    `--tactics all` matches one recorded with the default); the same tactic
    is not repeated either. Order is kept (of first mention)."""
    from dataclasses import replace

    out: list[Case] = []
    held: set[Case] = set()
    for case in cases:
        expanded = [case]
        if case.tactic == ALL_TACTICS:
            expanded = [replace(case, tactic=DEFAULT_TACTIC)]
            if case.backend in backends:
                try:
                    expanded = [replace(case, tactic=t) for t in backends[case.backend].valid_tactics(case.shape)]
                except Exception:  # noqa: BLE001 - a backend that cannot list its tactics here: default only
                    pass
        for c in expanded:
            if c.tactic not in (DEFAULT_TACTIC, ALL_TACTICS) and c.tactic == _alias(backends, c):
                c = replace(c, tactic=DEFAULT_TACTIC)
            if c not in held:
                held.add(c)
                out.append(c)
    return out


def _alias(backends: dict[str, Backend], case: Case) -> str | None:
    """The tactic "default" names for `case` (`Backend.default_alias`), or
    None for a backend that did not load or cannot say."""
    with contextlib.suppress(Exception):
        return backends[case.backend].default_alias(case.shape)
    return None


def skip_reason(
    backends: dict[str, Backend],
    reasons: dict[str, str | None],
    name: str,
    tactic: str,
    shape: RankShape,
    device: torch.device,
) -> str | None:
    """Why (backend `name`, `tactic`) cannot run `shape` on `device`: the
    backend's own reason (`reasons`, from `unavailable_reason` or loading it),
    a tactic it does not offer for the shape, or the tactic's
    `tactic_unavailable_reason`; None when the pair can run."""
    reason = reasons.get(name)
    if reason is not None:
        return reason
    backend = backends[name]
    if not backend.accepts_tactic(shape, tactic):
        valid = ", ".join(backend.valid_tactics(shape) + backend.tactic_forms)
        if backend.tactic_form(tactic) is not None:  # checked up front; the directory changed since
            return f"tactic {tactic!r}: {backend.tactic_form_error(tactic)}"
        if any(b.tactic_form(tactic) is not None for b in backends.values()):  # another backend's form
            return f"tactic {tactic!r} is not one of {name}'s (valid: {valid})"
        return f"tactic {tactic!r} not offered for this shape (valid: {valid})"
    try:
        return backends[name].tactic_unavailable_reason(shape, tactic, device)
    except Exception as error:  # noqa: BLE001
        return f"tactic {tactic!r} availability check failed: {error_text(error)}"


# ----------------------------------------------------------------------------- rows


def case_row(kind: str, case: Case, base: dict, **values) -> dict:
    """One row of a `kind` run for `case`: every column None, then `base`
    (the run's common columns), the case's own keys and shape, then `values`."""
    shape = case.shape
    row = dict.fromkeys(columns_of(kind))
    row.update(base)
    row.update(
        preset=case.config.name, hidden=shape.hidden, intermediate=shape.intermediate,
        padded_intermediate=shape.padded_intermediate, experts=shape.experts, top_k=shape.top_k,
        tp=case.tp, rows=case.rows, scenario=case.scenario, backend=case.backend, tactic=case.tactic,
        seed=case.seed, error="",
    )  # fmt: skip
    row.update(values)
    return row


def case_key(case: Case) -> tuple:
    """(preset, tp, rows, scenario, backend, tactic) of a case, as a row names it."""
    return (case.config.name, case.tp, case.rows, case.scenario, case.backend, case.tactic)


def row_key(row) -> tuple:
    """`case_key` of a result row (a dict or a frame's row)."""
    return tuple(row[k] for k in ("preset", "tp", "rows", "scenario", "backend", "tactic"))


def unrun_rows(kind: str, cases: Iterable[Case], rows: list[dict], base: dict, backends: dict[str, Backend],
               error: str = INTERRUPTED, status: str = "skipped") -> list[dict]:  # fmt: skip
    """Rows of the `cases` that have none among `rows`: `status` with
    `error` (by default: skipped, not run because of an interrupt)."""
    have = {row_key(r) for r in rows}
    return [case_row(kind, c, base, status=status, error=error, peer=is_peer(backends, c.backend))
            for c in cases if case_key(c) not in have]  # fmt: skip
