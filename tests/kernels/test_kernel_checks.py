"""kernel_checks.compile_reports deals the specs to its workers (one per CPU
core, kept for the session) and gives the reports back in the order of the
specs."""

import pytest
from kernel_checks import _compile_children, compile_reports

_SOURCE = """
import os

def compile_spec(spec):
    print(f"ptxas info    : Used {spec + 1} registers, 0 bytes spill stores")
    return {"pid": os.getpid()}
"""


def test_reports_come_back_in_the_order_of_the_specs_from_workers_kept_between_calls():
    specs = list(range(11))
    reports = compile_reports(_SOURCE, specs)
    assert [r["spec"] for r in reports] == specs
    assert [r["regs"] for r in reports] == [[s + 1] for s in specs] and all(r["spills"] == [0] for r in reports)
    pids = {r["pid"] for r in reports}
    assert len(pids) == _compile_children(len(specs))
    again = compile_reports(_SOURCE, specs)
    assert again == reports and {r["pid"] for r in again} == pids


def test_one_worker_for_a_few_specs_and_a_failing_spec_is_reported():
    assert _compile_children(1) == 1 and _compile_children(2) == 1
    with pytest.raises(AssertionError, match="spec 7 broke"):
        compile_reports("def compile_spec(spec):\n    assert spec != 7, 'spec 7 broke'\n    return {}", list(range(9)))
    assert [r["spec"] for r in compile_reports(_SOURCE, [1, 2])] == [1, 2]  # fresh workers after the failure


def test_pytest_xdist_workers_share_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert _compile_children(100) == 8
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert _compile_children(100) == 4 and _compile_children(6) == 2
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert _compile_children(100) == 1
