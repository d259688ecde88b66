"""Shared pytest setup: `gpu` tests run only where an sm_90 GPU is present;
`compile` tests only where the CuTe DSL is installed (they cross-compile for
sm_90a on the CPU).

The README's test command runs the suite under pytest-xdist with `-n auto`:
one worker per CPU core on a machine without a GPU (CI's 2 cores; at most
8), but a single worker where an sm_90 GPU is present, so the GPU tests (and
the CLI tests that run on the card there) still run one at a time and the
launch times they check see no second test on the card."""

import importlib.util
import os

import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9


def _has_cute_dsl() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def pytest_collection_modifyitems(config, items):
    gpu = _has_sm90()
    dsl = _has_cute_dsl()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs an sm_90 GPU"))
        if "compile" in item.keywords and not dsl:
            item.add_marker(pytest.mark.skip(reason="needs nvidia-cutlass-dsl"))


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: harmless where xdist is not installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU core (not xdist's physical cores: a 2-vCPU
    CI machine may count one), at most 8 (each imports torch and the DSL); one
    worker on a GPU machine."""
    return 1 if _has_sm90() else min(_cpu_cores(), 8)


if not _has_sm90():
    # Cross-compile CuTe DSL kernels for the H200 on a machine without a GPU.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
