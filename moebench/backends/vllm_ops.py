"""vLLM's compiled MoE ops, loaded from the vllm wheel's own libraries.

The Marlin and triton_kernels peers run vLLM's call sequence with vLLM's own
kernels, not stand-ins. Two libraries of the `vllm==0.26.0` wheel hold them:

- "moe": `_moe_C_stable_libtorch.abi3.so` registers `torch.ops._moe_C`
  (`moe_wna16_marlin_gemm`, `moe_align_block_size`, `moe_sum`, ...);
- "c": `_C_stable_libtorch.abi3.so` registers `torch.ops._C`
  (`gptq_marlin_repack`, `silu_and_mul_with_clamp`, ...).

Where they are looked for, in order: the folder `$MOEBENCH_VLLM_OPS`; a
`vllm_ops/` folder on sys.path (what `scripts/build_vllm_bundle.sh` packs
into the bundle's `site/`); an installed `vllm` package's folder (found
without importing vllm). Nothing is loaded at import: `reason(which)` says
why a library cannot be used (None when it can) and `load(which)` loads it
once (`torch.ops.load_library`). They need libtorch, CUDA 13's runtime and a
GPU driver: on a CPU-only machine the reason says so.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch

VLLM_VERSION = "0.26.0"
#: Library of each op family, the torch.ops namespace it registers and one op it must hold.
LIBRARIES = {
    "moe": ("_moe_C_stable_libtorch.abi3.so", "_moe_C", "moe_wna16_marlin_gemm"),
    "c": ("_C_stable_libtorch.abi3.so", "_C", "silu_and_mul_with_clamp"),
}
ENV_DIR = "MOEBENCH_VLLM_OPS"
BUNDLE_DIR = "vllm_ops"


def _check(which: str) -> None:
    if which not in LIBRARIES:
        raise ValueError(f"which must be one of {sorted(LIBRARIES)}, got {which!r}")


def candidates(which: str) -> list[Path]:
    """The paths looked at for library `which`, in order (module docstring)."""
    _check(which)
    name = LIBRARIES[which][0]
    dirs = []
    if os.environ.get(ENV_DIR):
        dirs.append(Path(os.environ[ENV_DIR]))
    dirs += [Path(p or ".") / BUNDLE_DIR for p in sys.path]
    spec = importlib.util.find_spec("vllm") if "vllm" not in sys.modules else sys.modules["vllm"].__spec__
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) for p in spec.submodule_search_locations]
    return [d / name for d in dirs]


def find(which: str) -> Path | None:
    """The first existing file of `candidates(which)`, or None."""
    return next((p for p in candidates(which) if p.is_file()), None)


@functools.cache
def _load(path: str) -> None:
    torch.ops.load_library(path)


def reason(which: str) -> str | None:
    """Why vLLM's library `which` ("moe" or "c") cannot be used here, or None
    after loading it. Never raises for a missing or unloadable library."""
    _check(which)
    name, namespace, op = LIBRARIES[which]
    if not torch.cuda.is_available():
        return f"vLLM's {name} needs a CUDA GPU and torch's CUDA build"
    path = find(which)
    if path is None:
        return (
            f"vLLM's {name} (vllm=={VLLM_VERSION}) not found in ${ENV_DIR}, a {BUNDLE_DIR}/ folder on"
            " sys.path or an installed vllm: build the bundle with scripts/build_vllm_bundle.sh"
        )
    try:
        _load(str(path))
    except Exception as error:  # noqa: BLE001 - any load failure is a reason
        return f"loading {path} failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if not hasattr(getattr(torch.ops, namespace), op):
        return f"{path} loaded but registered no torch.ops.{namespace}.{op}"
    return None


def load(which: str):
    """Load library `which` and return its torch.ops namespace (e.g.
    `load("moe").moe_sum`). Raises RuntimeError with `reason` if it cannot."""
    why = reason(which)
    if why is not None:
        raise RuntimeError(why)
    return getattr(torch.ops, LIBRARIES[which][1])
