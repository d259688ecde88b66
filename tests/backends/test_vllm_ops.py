"""vllm_ops: where vLLM's libraries are looked for, and why they cannot load."""

import pytest
import torch

from moebench.backends import vllm_ops


def test_unknown_library_is_refused_by_name():
    with pytest.raises(ValueError, match="which must be one of"):
        vllm_ops.reason("marlin")


def test_env_folder_comes_first_then_bundle_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_ops.ENV_DIR, str(tmp_path))
    paths = vllm_ops.candidates("moe")
    assert paths[0] == tmp_path / "_moe_C_stable_libtorch.abi3.so"
    assert any(p.parent.name == vllm_ops.BUNDLE_DIR for p in paths[1:])


def test_find_returns_the_first_existing_file(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_ops.ENV_DIR, str(tmp_path))
    assert vllm_ops.find("c") is None or vllm_ops.find("c").parent != tmp_path
    (tmp_path / "_C_stable_libtorch.abi3.so").write_bytes(b"")
    assert vllm_ops.find("c") == tmp_path / "_C_stable_libtorch.abi3.so"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-machine reason")
def test_cpu_machine_gets_a_reason_not_an_error():
    for which in vllm_ops.LIBRARIES:
        assert "CUDA" in vllm_ops.reason(which)
        with pytest.raises(RuntimeError, match="CUDA"):
            vllm_ops.load(which)
