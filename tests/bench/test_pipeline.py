"""What a sweep and a step share (moebench/bench/pipeline.py, columns.py) and
how a step reaches a backend (decode_step.make_step: by its declared
capabilities, never by its name)."""

import pandas as pd
import pytest
import torch

from moebench.backends.base import DEFERRED_FINALIZE, FUSED_FRONT, Backend
from moebench.backends.registry import backend_names
from moebench.bench import decode_step
from moebench.bench.cases import CPU_BACKENDS, SweepConfig, expand_cases
from moebench.bench.columns import COLUMNS, KINDS, STEP_COLUMNS, columns_of, typed
from moebench.bench.interrupt import INTERRUPTED
from moebench.bench.pipeline import case_row, load_backends, select_backends, unrun_rows

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_every_column_has_one_kind_and_the_step_extends_the_sweep():
    assert set(COLUMNS) | set(STEP_COLUMNS) == set(KINDS) and STEP_COLUMNS[: len(COLUMNS)] == COLUMNS
    assert len(set(STEP_COLUMNS)) == len(STEP_COLUMNS)
    with pytest.raises(ValueError, match="kind"):
        columns_of("tune")


def test_typed_frames_have_fixed_dtypes_whatever_the_rows_hold():
    frame = typed([{"status": "ok", "median_us": "1.5", "bytes": 3, "peer": True}, {"status": "skipped"}], "sweep")
    assert list(frame.columns) == list(COLUMNS)
    assert frame["median_us"].dtype == "float64" and str(frame["bytes"].dtype) == "Int64"
    assert frame["error"].tolist() == ["", ""] and str(frame["peer"].dtype) == "boolean"
    step = typed(pd.DataFrame([{"status": "ok"}]), "step")
    assert list(step.columns) == list(STEP_COLUMNS) and step["kind"].tolist() == ["step"]


def test_backend_selection_defaults_and_unknown_names():
    assert select_backends(SweepConfig(), CPU) == CPU_BACKENDS
    assert select_backends(SweepConfig(), GPU) == tuple(n for n in backend_names() if n != "reference")
    assert select_backends(SweepConfig(), GPU, ("moebench",)) == ("moebench",)
    with pytest.raises(ValueError, match=r"--backends.*unknown \['nope'\]"):
        select_backends(SweepConfig(backends=("nope",)), CPU)


def test_loading_says_why_a_backend_cannot_run_instead_of_raising():
    backends, reasons = load_backends(("torch-bf16", "moebench"), CPU)
    assert set(backends) == {"torch-bf16", "moebench"} and reasons["torch-bf16"] is None
    assert "CUDA" in reasons["moebench"] or "sm_90" in reasons["moebench"]
    assert load_backends(("moebench",))[1] == {"moebench": None}  # no device: no availability check


def test_unrun_rows_are_the_cases_without_a_row():
    config = SweepConfig(presets=("dsv4-flash",), tp=(1,), rows=(1, 2), backends=("torch-bf16",), device="cpu")
    cases = expand_cases(config, config.backends, reduced=True)
    measured = [case_row("sweep", cases[0], {"seed": 0}, status="ok")]
    rest = unrun_rows("sweep", cases, measured, {"seed": 0}, {})
    assert [(r["rows"], r["status"], r["error"], r["peer"]) for r in rest] == [(2, "skipped", INTERRUPTED, True)]


class _Declares(Backend):
    name, oracle = "declares", "mxfp8"

    def prepare(self, weights, shape, tactic="default"):
        return None

    def forward(self, prepared, x, topk_ids, topk_weights):
        return x


@pytest.mark.parametrize("caps, kind, front", [
    (frozenset(), "backend", None), (frozenset({DEFERRED_FINALIZE}), "kernel", False),
    (frozenset({DEFERRED_FINALIZE, FUSED_FRONT}), "kernel", True),
])  # fmt: skip
def test_a_step_takes_a_backend_by_its_capabilities_not_its_name(monkeypatch, caps, kind, front):
    made = []
    monkeypatch.setattr(
        decode_step, "KernelStep", lambda runner, prepared, x, front, **k: made.append(("kernel", front))
    )
    monkeypatch.setattr(
        decode_step, "BackendStep", lambda runner, backend, prepared, x, **k: made.append(("backend", None))
    )
    backend = type("Other", (_Declares,), {"step_capabilities": caps})()
    decode_step.make_step(None, backend, None, None, all_reduce=False, overlap_shared=True)
    assert made == [(kind, front)]
