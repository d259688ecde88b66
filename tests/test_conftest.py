"""tests/conftest.py's `-n auto` worker count: one per CPU core (at most 8)
without a GPU, one where an sm_90 GPU is present (GPU tests never share the card)."""

import importlib.util
from pathlib import Path


def _conftest():
    """tests/conftest.py as a module of its own (`import conftest` may find tests/backends' one)."""
    spec = importlib.util.spec_from_file_location("moebench_tests_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_workers_one_per_core_without_a_gpu_and_one_with_it(monkeypatch):
    conftest = _conftest()
    monkeypatch.setattr(conftest, "_has_sm90", lambda: False)
    monkeypatch.setattr(conftest, "_cpu_cores", lambda: 2)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setattr(conftest, "_cpu_cores", lambda: 64)
    assert conftest.pytest_xdist_auto_num_workers(None) == 8
    monkeypatch.setattr(conftest, "_has_sm90", lambda: True)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
