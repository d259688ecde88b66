"""Run-level differences between two stored runs' manifests: what makes
two runs measure different things (`run_mismatches`' mismatches: device,
geometry, L2 mode, run kind, ranks, layer boundary, shared-expert stream)
and what is only worth knowing (its notes: driver, versions, copy
bandwidth). `compare.compare_runs` refuses to compare runs that mismatch;
`store.merge_runs` refuses to merge them."""

from __future__ import annotations

from moebench.reports.summary import shared_overlap


def _device(manifest: dict) -> dict:
    dev = manifest.get("device")
    return dev if isinstance(dev, dict) else {}


def mismatch_kinds(mismatches: list[str]) -> str:
    """The kinds of run-level mismatches ('device, run kind'): each line's text before its colon."""
    return ", ".join(m.split(":")[0] for m in mismatches)


def _kind(manifest: dict) -> str:
    """'step' for a `moebench step` run; sweep runs may lack the key."""
    return manifest.get("kind") or "sweep"


def _ranks(manifest: dict) -> int:
    """Ranks of the run (sweep runs lack the key: one)."""
    ranks = manifest.get("ranks")
    return ranks if ranks is not None else 1


def _boundary(manifest: dict) -> str:
    """How a sweep run met its layer calls ("layer" or "back-to-back"); runs
    stored before the field timed them back to back."""
    return manifest.get("boundary") or "back-to-back"


def run_mismatches(current: dict, baseline: dict) -> tuple[list[str], list[str]]:
    """(mismatches, notes) between two manifests: device name / SM count /
    reduced CPU geometry / warm-L2 mode / run kind (sweep vs step) / rank
    count / a sweep's layer boundary (layer vs back-to-back) / a step's
    shared-expert stream (side or in order) are mismatches
    (the runs measure different things); driver, CUDA, package versions and
    the copy bandwidth (beyond 5 %) are notes."""
    mism, notes = [], []
    dc, db = _device(current), _device(baseline)
    if dc.get("name") != db.get("name"):
        mism.append(f"device: {dc.get('name')!r} vs baseline {db.get('name')!r}")
    elif dc.get("sm_count") != db.get("sm_count"):
        mism.append(f"device SM count: {dc.get('sm_count')} vs baseline {db.get('sm_count')}")
    if bool(current.get("reduced")) != bool(baseline.get("reduced")):
        mism.append(f"geometry: reduced={bool(current.get('reduced'))} vs baseline {bool(baseline.get('reduced'))}")
    if bool(current.get("warm_l2")) != bool(baseline.get("warm_l2")):
        mism.append(f"L2 mode: warm_l2={bool(current.get('warm_l2'))} vs baseline {bool(baseline.get('warm_l2'))}")
    if _kind(current) != _kind(baseline):
        mism.append(f"run kind: {_kind(current)} vs baseline {_kind(baseline)} (a sweep times one layer call,"
                    " a step the whole decode step)")  # fmt: skip
    if _ranks(current) != _ranks(baseline):
        mism.append(f"ranks: {_ranks(current)} vs baseline {_ranks(baseline)}")
    bounds = _boundary(current), _boundary(baseline)
    if _kind(current) == _kind(baseline) == "sweep" and bounds[0] != bounds[1]:
        mism.append(
            f"layer boundary: {bounds[0]} vs baseline {bounds[1]} (a boundary run writes each layer call's"
            " x before it; --back-to-back lets call i+1 start under call i)"
        )
    side = shared_overlap(current), shared_overlap(baseline)
    if _kind(current) == _kind(baseline) == "step" and side[0] != side[1]:
        where = {True: "side stream", False: "in order"}
        mism.append(
            f"shared expert: {where[side[0]]} vs baseline {where[side[1]]}"
            " (moebench step --overlap-shared / --serial-shared)"
        )
    if dc.get("driver") != db.get("driver"):
        notes.append(f"driver {dc.get('driver')} vs baseline {db.get('driver')}")
    if current.get("cuda_runtime") != baseline.get("cuda_runtime"):
        notes.append(f"CUDA runtime {current.get('cuda_runtime')} vs baseline {baseline.get('cuda_runtime')}")
    pc, pb = current.get("packages") or {}, baseline.get("packages") or {}
    for name in sorted(set(pc) | set(pb)):
        if pc.get(name) != pb.get(name):
            notes.append(f"{name} {pc.get(name)} vs baseline {pb.get(name)}")
    bc, bb = current.get("copy_bw_gbps"), baseline.get("copy_bw_gbps")
    if isinstance(bc, (int, float)) and isinstance(bb, (int, float)) and bb > 0 and abs(bc / bb - 1) > 0.05:
        notes.append(f"copy bandwidth {bc:.0f} vs baseline {bb:.0f} GB/s")
    return mism, notes
