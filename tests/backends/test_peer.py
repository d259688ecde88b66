"""The peers' shared prologue (backends/peer.py)."""

import importlib.util

import pytest
import torch

from moebench.backends import peer
from moebench.backends.marlin import MarlinW4A16Backend
from moebench.formats import generate_expert_weights
from moebench.models import get_preset


def _hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_package_reason_names_the_gpu_then_the_package_then_the_import(monkeypatch):
    assert "CUDA" in peer.package_reason("cpu", "torch", missing="-")
    _hopper(monkeypatch)
    assert peer.package_reason("cuda:0", "no_such_package_here", missing="install it") == "install it"

    def broken():
        raise OSError("libfoo.so: undefined symbol: bar\nmore")

    assert peer.package_reason("cuda:0", "torch", missing="-", imports=broken) == (
        "importing torch failed: OSError: libfoo.so: undefined symbol: bar"
    )
    assert peer.package_reason("cuda:0", "torch", missing="-", imports=lambda: None) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert peer.package_reason("cuda:0", "torch", missing="gone") == "gone"


def test_vllm_reason_says_which_library_and_for_what(monkeypatch):
    monkeypatch.setattr(peer.vllm_ops, "reason", lambda which: None if which == "moe" else f"{which} missing")
    assert peer.vllm_reason("moe") is None
    assert peer.vllm_reason("moe", "c") == "c missing"
    assert peer.vllm_reason("c", what="the op") == "the op is unavailable: c missing"


def test_prepare_prologue_checks_tactic_weights_then_the_device():
    backend = MarlinW4A16Backend()
    shape = get_preset("dsv4-flash", experts=8, hidden=256, intermediate=128).shard(1)
    weights = generate_expert_weights(shape)
    with pytest.raises(ValueError, match="tactic 'fast'"):
        peer.prepare_prologue(backend, weights, shape, "fast")
    with pytest.raises(ValueError, match="do not match"):
        peer.prepare_prologue(backend, weights, get_preset("dsv4-flash", experts=16, hidden=256,
                                                           intermediate=128).shard(1), "default")  # fmt: skip
    with pytest.raises(RuntimeError, match="'marlin-w4a16' cannot run on cpu"):
        peer.prepare_prologue(backend, weights, shape, "default")
