import pytest

from moebench.env import device_info, environment, git_commit, package_versions, resolve_device


def test_cpu_environment(monkeypatch):
    info = device_info("cpu")
    assert info.kind == "cpu" and info.sm_count >= 1 and info.capability is None
    env = environment("cpu")
    assert env["device"]["kind"] == "cpu" and env["packages"]["torch"]
    monkeypatch.setenv("MOEBENCH_COMMIT", "deadbeef")
    assert git_commit() == "deadbeef"


def test_missing_packages_read_as_none():
    versions = package_versions()
    assert set(versions) >= {"torch", "nvidia-cutlass-dsl", "flashinfer-python", "triton"}
    assert versions["torch"] is not None


def test_bad_device():
    for bad in ("tpu", "not a device", "foo", "cuda:x", "cuda:-1", "mps", "gpu0", ""):
        with pytest.raises(ValueError, match=r"--device.*expected 'cpu' or 'cuda\[:N\]'"):
            resolve_device(bad)
    assert resolve_device("cpu") == resolve_device(" cpu ") == __import__("torch").device("cpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="CUDA is not available here"):
        resolve_device("cuda:0")
