"""Environment and provenance: the device, its driver, package versions, commit.

Everything here is best effort and never raises for a missing package, GPU or
git checkout: an unknown value is None. The git commit comes from the
MOEBENCH_COMMIT environment variable when set (the H200 host runs a copy of
the tree without .git), else from `git rev-parse HEAD` in the package's
checkout.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: Distribution name -> import name of the packages whose versions a run records.
TRACKED_PACKAGES = {
    "torch": "torch",
    "nvidia-cutlass-dsl": "cutlass",
    "flashinfer-python": "flashinfer",
    "humming-kernels": "humming",
    "triton": "triton",
    "nvtx": "nvtx",
    "numpy": "numpy",
    "pandas": "pandas",
}


@dataclass(frozen=True)
class DeviceInfo:
    """What a run executed on.

    kind: "cuda" or "cpu"; name: e.g. "NVIDIA H200"; capability: "9.0" (None on
    CPU); sm_count: streaming multiprocessors (CPU: logical cores);
    l2_bytes: L2 cache size in bytes (None when unknown, e.g. on CPU);
    memory_bytes: device memory in bytes (None on CPU); driver: the NVIDIA
    driver version string, None when unknown.
    """

    kind: str
    name: str
    capability: str | None
    sm_count: int
    l2_bytes: int | None
    memory_bytes: int | None
    driver: str | None


#: Device strings moebench takes: cpu, cuda, cuda:N.
_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """`device`, or the current CUDA device when one is present, else the CPU.

    Raises ValueError for a CUDA device on a machine without CUDA, or a device
    string torch does not parse.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    expected = "expected 'cpu' or 'cuda[:N]' (e.g. 'cuda' for the current GPU, 'cuda:1' for the second)"
    if isinstance(device, str) and not _DEVICE.match(device.strip()):
        raise ValueError(f"device (--device): {expected}, got {device!r}")
    try:
        dev = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device (--device): {expected}, got {device!r} ({error})") from error
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device (--device): {device!r} asked for, but CUDA is not available here"
                             " (use 'cpu', or leave --device out)")  # fmt: skip
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device (--device): {device!r} does not exist ({torch.cuda.device_count()} GPUs:"
                             f" cuda:0..cuda:{torch.cuda.device_count() - 1})")  # fmt: skip
    elif dev.type != "cpu":
        raise ValueError(f"device (--device): {expected}, got {device!r}")
    return dev


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """DeviceInfo of `device` (default: as `resolve_device`)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return DeviceInfo(
            kind="cuda",
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=int(props.multi_processor_count),
            l2_bytes=int(getattr(props, "L2_cache_size", 0)) or None,
            memory_bytes=int(props.total_memory),
            driver=_driver_version(),
        )
    return DeviceInfo(
        kind="cpu",
        name=platform.processor() or platform.machine() or "cpu",
        capability=None,
        sm_count=os.cpu_count() or 1,
        l2_bytes=None,
        memory_bytes=None,
        driver=None,
    )


def package_versions() -> dict[str, str | None]:
    """Installed version of each tracked package (None when not importable).

    A package counts as present only if its import name is findable, so a
    stale dist-info without the package reads as missing.
    """

    versions: dict[str, str | None] = {}
    for dist, module in TRACKED_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            versions[dist] = None
            continue
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def git_commit() -> str | None:
    """MOEBENCH_COMMIT if set, else `git rev-parse HEAD` of the package's checkout
    (suffixed "+dirty" when tracked files differ), else None."""
    env = os.environ.get("MOEBENCH_COMMIT")
    if env:
        return env.strip()
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def launcher_environment(device: str) -> dict:
    """`environment(device)` for a process that launched workers on `device`
    and lost them before they reported theirs; the default device's when
    `device` is not one this process sees (a stand-in worker's)."""
    try:
        return environment(device)
    except ValueError:
        return environment(None)


def environment(device: torch.device | str | None = None) -> dict:
    """Provenance of a run as a JSON-ready dict: device (DeviceInfo fields),
    python, platform, torch CUDA runtime, package versions, git commit."""
    info = device_info(device)
    return {
        "device": asdict(info),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cuda_runtime": torch.version.cuda,
        "packages": package_versions(),
        "commit": git_commit(),
    }
