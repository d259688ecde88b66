"""The prologue the peer backends share (FlashInfer, humming, Marlin,
triton_kernels): whether their library can run here, and the checks a
prepare makes before it converts anything.

- `package_reason`: an sm_90 GPU, the package findable (else the backend's
  own "not installed, see the bundle" line), and importing what the backend
  needs raising nothing (else "importing <package> failed: <error>": the
  library and the error named, as the sweep shows it in the skip reason);
- `vllm_reason`: each of vLLM's compiled libraries a backend calls loads;
- `prepare_prologue`: the tactic offered, the weights of the shape, the
  backend runnable on the weights' device; returns that device.
- `FINALIZE_LAUNCH`: the finalize row their LAUNCHES tables end with.

What follows the prologue (a version check, a module marker, a clamp rule)
stays in each backend.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from moebench.backends import vllm_ops
from moebench.backends.base import Backend, check_weights, require_runnable, sm90_reason
from moebench.formats import ExpertWeights
from moebench.models import RankShape


#: The last launch of a layer call on vLLM 0.26.0's TP path, the same for every modular-kernel
#: peer (Marlin, humming, triton_kernels): finalize copies the reduced rows into the output.
#: A row of their LAUNCHES tables: (stage, launch, where vLLM runs it, in fused_moe/).
FINALIZE_LAUNCH = (
    "finalize",
    "aten.copy_ (output)",
    "modular_kernel.py:1338 -> no_dp_ep.py:91 -> topk_weight_and_reduce.py:76",
)


def first_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s message, first line only, at most `limit` characters."""
    return (str(error).splitlines() or [""])[0][:limit]


def package_reason(
    device: torch.device | str, package: str, *, missing: str, imports: Callable[[], object] | None = None
) -> str | None:
    """Why a backend on `package` cannot run on `device`: not an sm_90 GPU;
    `package` not findable (`missing`, the backend's words); `imports()`
    (importing what it needs) raising: "importing <package> failed: <type>:
    <first line>". None when all pass."""
    reason = sm90_reason(device)
    if reason:
        return reason
    if importlib.util.find_spec(package) is None:
        return missing
    if imports is not None:
        try:
            imports()
        except Exception as error:  # noqa: BLE001 - any import failure is a reason
            return f"importing {package} failed: {type(error).__name__}: {first_line(error)}"
    return None


def vllm_reason(*which: str, what: str | None = None) -> str | None:
    """The first of vLLM's libraries `which` ("moe", "c") that cannot be
    used here, as `vllm_ops.reason` says it (prefixed "<what> is unavailable: "
    when given), or None when all load."""
    for lib in which:
        why = vllm_ops.reason(lib)
        if why is not None:
            return f"{what} is unavailable: {why}" if what else why
    return None


def prepare_prologue(backend: Backend, weights: ExpertWeights, shape: RankShape, tactic: str) -> torch.device:
    """What every peer's prepare checks first: `tactic` offered for `shape`
    (ValueError), `weights` of `shape` (TypeError / ValueError), the backend
    runnable on the weights' device (RuntimeError naming it and why).
    Returns that device."""
    backend.check_tactic(shape, tactic)
    check_weights(weights, shape)
    device = weights.w13.device
    require_runnable(backend, device)
    return device
