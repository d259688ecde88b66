import pytest

from moebench.backends.base import Backend, BackendUnavailable
from moebench.backends.registry import (
    available_backends,
    backend_names,
    load_backend,
    register_backend,
    unregister_backend,
)


def test_builtin_names_and_cpu_availability():
    names = backend_names()
    for name in (
        "torch-bf16",
        "reference",
        "moebench",
        "flashinfer-w4a16",
        "flashinfer-w4a8",
        "humming-w4a16",
        "humming-w4a8",
    ):
        assert name in names
    avail = available_backends("cpu")
    assert avail["torch-bf16"] is None and avail["reference"] is None
    assert set(avail) == set(names)
    assert all(r is None or isinstance(r, str) for r in avail.values())


def test_missing_module_is_a_reason_not_an_import_error():
    register_backend("test-missing-module", "moebench.backends.no_such_module:Thing")
    try:
        reason = available_backends("cpu")["test-missing-module"]
        assert "moebench.backends.no_such_module" in reason
        with pytest.raises(BackendUnavailable) as info:
            load_backend("test-missing-module")
        assert info.value.reason == reason
    finally:
        unregister_backend("test-missing-module")


def test_missing_package_inside_a_backend_module(tmp_path, monkeypatch):
    # A backend module that imports a package that is not installed (like flashinfer).
    (tmp_path / "fake_fi_backend.py").write_text("import flashinfer_not_installed_here\nclass B: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("test-fake-fi", "fake_fi_backend:B")
    try:
        reason = available_backends("cpu")["test-fake-fi"]
        assert "flashinfer_not_installed_here" in reason and "package" in reason
    finally:
        unregister_backend("test-fake-fi")


def test_factory_errors_become_reasons():
    def broken():
        raise RuntimeError("no device memory")

    register_backend("test-broken", broken)
    register_backend("test-not-backend", lambda: object())
    try:
        avail = available_backends("cpu")
        assert "no device memory" in avail["test-broken"]
        assert "not a Backend" in avail["test-not-backend"]
    finally:
        unregister_backend("test-broken")
        unregister_backend("test-not-backend")


def test_registration_validation():
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch-bf16", "x:y")
    with pytest.raises(ValueError, match="module:attribute"):
        register_backend("test-bad-spec", "no_colon")
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("nope")
    with pytest.raises(ValueError, match="unknown backend"):
        unregister_backend("nope")


def test_loaded_backend_follows_the_interface():
    b = load_backend("torch-bf16")
    assert isinstance(b, Backend) and b.name == "torch-bf16" and b.oracle == "bf16" and b.capturable
    r = load_backend("reference")
    assert r.oracle == "mxfp8" and not r.capturable


def test_the_correctness_gate_follows_the_oracle_family():
    from moebench.backends.base import ORACLE_TOLERANCES
    from moebench.backends.humming import HummingW4A8Backend
    from moebench.backends.torch_bf16 import TorchBF16Backend as TorchBf16Backend
    from moebench.reference import ACTIVATIONS, ORACLE_TOLERANCE

    assert set(ORACLE_TOLERANCES) == set(ACTIVATIONS)
    assert ORACLE_TOLERANCES["mxfp8"] == ORACLE_TOLERANCES["bf16"] == ORACLE_TOLERANCE
    assert HummingW4A8Backend.oracle == "fp8_token" and HummingW4A8Backend.tolerance.fget(HummingW4A8Backend) == 3e-2
    assert TorchBf16Backend.tolerance.fget(TorchBf16Backend) == ORACLE_TOLERANCE
