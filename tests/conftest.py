"""Shared pytest setup: `gpu` tests run only where an sm_90 GPU is present;
`compile` tests only where the CuTe DSL is installed (they cross-compile for
sm_90a on the CPU)."""

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


if not _has_sm90():
    # Cross-compile CuTe DSL kernels for the H200 on a machine without a GPU.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
