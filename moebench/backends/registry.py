"""Backend registry: name -> factory, imported lazily.

Each entry is a "module:attribute" spec (imported only when the backend is
asked for) or a zero-argument callable returning a `Backend`. A backend whose
module or package is missing is *unavailable with a reason*, never an
ImportError: `available_backends(device)` lists every name with None (can
run) or the reason it cannot.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from moebench.backends.base import Backend, BackendUnavailable

Factory = Callable[[], Backend]

#: Built-in backends. Later paths register here: "moebench" (our kernels),
#: the FlashInfer, humming and vLLM Marlin baselines.
BUILTIN: dict[str, str] = {
    "torch-bf16": "moebench.backends.torch_bf16:TorchBF16Backend",
    "reference": "moebench.backends.reference:ReferenceBackend",
    "moebench": "moebench.backends.moebench:MoebenchBackend",
    "flashinfer-w4a16": "moebench.backends.flashinfer:FlashInferW4A16Backend",
    "flashinfer-w4a8": "moebench.backends.flashinfer:FlashInferW4A8Backend",
    "humming-w4a16": "moebench.backends.humming:HummingW4A16Backend",
    "humming-w4a8": "moebench.backends.humming:HummingW4A8Backend",
    "marlin-w4a16": "moebench.backends.marlin:MarlinW4A16Backend",
    "triton-mxfp4": "moebench.backends.triton_mxfp4:TritonMxfp4Backend",
}

_registry: dict[str, str | Factory] = dict(BUILTIN)


def backend_names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_registry)


def register_backend(name: str, factory: str | Factory, *, replace: bool = False) -> None:
    """Register `factory` ("module:attribute" or a callable returning a Backend)
    under `name`. Raises ValueError if `name` is taken and not `replace`, or
    the factory is neither a spec nor callable."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in _registry and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True)")
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"factory spec must be 'module:attribute', got {factory!r}")
    elif not callable(factory):
        raise ValueError(f"factory must be a 'module:attribute' string or callable, got {factory!r}")
    _registry[name] = factory


def unregister_backend(name: str) -> None:
    """Remove `name` (restoring nothing). Raises ValueError for an unknown name."""
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; registered: {list(_registry)}")
    del _registry[name]


def _resolve(name: str) -> Factory:
    entry = _registry[name]
    if callable(entry):
        return entry
    module_name, attr = entry.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or str(error)
        if missing == module_name or module_name.startswith(f"{missing}."):
            reason = f"module {module_name} is not present"
        else:
            reason = f"needs package {missing.split('.')[0]!r} ({error})"
        raise BackendUnavailable(name, reason) from error
    except Exception as error:  # noqa: BLE001 - any import-time failure is a reason
        raise BackendUnavailable(name, f"importing {module_name} failed: {type(error).__name__}: {error}") from error
    try:
        return getattr(module, attr)
    except AttributeError as error:
        raise BackendUnavailable(name, f"{module_name} has no {attr}") from error


def load_backend(name: str) -> Backend:
    """A new instance of backend `name`.

    Raises ValueError for an unknown name; BackendUnavailable (with `.reason`)
    when its module or a package it needs cannot be imported.
    """
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; expected one of {list(_registry)}")
    factory = _resolve(name)
    try:
        backend = factory()
    except BackendUnavailable:
        raise
    except Exception as error:  # noqa: BLE001
        raise BackendUnavailable(name, f"constructing it failed: {type(error).__name__}: {error}") from error
    if not isinstance(backend, Backend):
        raise BackendUnavailable(name, f"factory returned {type(backend).__name__}, not a Backend")
    return backend


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """None when backend `name` can run on `device`, else why not. Raises
    ValueError only for an unknown name."""
    try:
        backend = load_backend(name)
    except BackendUnavailable as error:
        return error.reason
    try:
        return backend.unavailable_reason(device)
    except Exception as error:  # noqa: BLE001
        return f"availability check failed: {type(error).__name__}: {error}"


def available_backends(device: torch.device | str) -> dict[str, str | None]:
    """Every registered name -> None (runs on `device`) or the reason it cannot."""
    return {name: unavailable_reason(name, device) for name in _registry}
