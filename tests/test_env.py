import pytest

from moebench.env import device_info, environment, git_commit, package_versions, resolve_device


def test_cpu_environment(monkeypatch):
    info = device_info("cpu")
    assert info.kind == "cpu" and info.sm_count >= 1 and not info.is_sm90
    env = environment("cpu")
    assert env["device"]["kind"] == "cpu" and env["packages"]["torch"]
    monkeypatch.setenv("MOEBENCH_COMMIT", "deadbeef")
    assert git_commit() == "deadbeef"


def test_missing_packages_read_as_none():
    versions = package_versions()
    assert set(versions) >= {"torch", "nvidia-cutlass-dsl", "flashinfer-python", "triton"}
    assert versions["torch"] is not None


def test_bad_device():
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("not a device")
