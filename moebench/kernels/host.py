"""Host-side launch helpers shared by the CuTe DSL kernel modules (route,
quantize, finalize, gemm): whether the DSL is installed, argument checks that
raise TypeError / ValueError naming the argument, torch stream -> CUstream,
and torch tensor -> cute global-memory pointer. Importable without
nvidia-cutlass-dsl (HAVE_DSL is then False; `require_dsl` raises)."""

from __future__ import annotations

import torch

try:
    import cuda.bindings.driver as _cuda
    import cutlass.cute as _cute

    HAVE_DSL = True
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    HAVE_DSL = False


def require_dsl(what: str) -> None:
    """Raise RuntimeError unless nvidia-cutlass-dsl is installed; `what`
    names the kernel in the message ("the route kernel")."""
    if not HAVE_DSL:
        raise RuntimeError(f"{what} needs nvidia-cutlass-dsl (pip install moebench[kernels])")


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")


def check_threads(threads) -> None:
    """A CTA size: an int multiple of 32 in [32, 1024]."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 32 or threads % 32 or threads > 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")


def check_tensor(
    name: str,
    t,
    dtypes,
    shape: tuple[int, ...],
    device: torch.device | None = None,
    *,
    device_of: str | None = None,
    align: int | None = None,
) -> None:
    """Check a kernel argument: a torch.Tensor (else TypeError) of one of
    `dtypes` (a dtype or a tuple of them; else TypeError), of exactly
    `shape`, contiguous, on `device` (unless None; `device_of` names the
    argument that set it) and, unless `align` is None, `align`-byte aligned
    (else ValueError). Every message starts with `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        of = f" (the device of {device_of})" if device_of else ""
        raise ValueError(f"{name} must be on {device}{of}, got {t.device}")
    if align is not None and t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned (data_ptr {t.data_ptr():#x})")


def cu_stream(stream, device: torch.device):
    """The CUstream to launch on: torch's current stream of `device` for
    None, a torch.cuda.Stream's handle, or a CUstream as is (else TypeError)."""
    if stream is None:
        return _cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    if isinstance(stream, torch.cuda.Stream):
        return _cuda.CUstream(stream.cuda_stream)
    if isinstance(stream, _cuda.CUstream):
        return stream
    raise TypeError(f"stream must be None, a torch.cuda.Stream or a CUstream, got {type(stream).__name__}")


def gmem_ptr(dtype, t, align: int):
    """A cute global-memory pointer of element type `dtype` (a cutlass
    numeric type) to tensor `t`'s data, or to the address `t` when it is an
    int (compile-time stand-ins), assumed `align`-byte aligned."""
    from cutlass.cute.runtime import make_ptr

    addr = t if isinstance(t, int) else t.data_ptr()
    return make_ptr(dtype, addr, _cute.AddressSpace.gmem, assumed_align=align)


def kernel_args(struct, specs: dict, sources: dict):
    """One kernel's run-time arguments as its struct: `struct` (a
    NamedTuple class, the kernel's argument list written once) built from
    `sources` ({field: value}): a pointer field, whose spec in `specs` is
    (element type, assumed alignment), from a tensor or an address
    (`gmem_ptr`); a scalar field, whose spec is its DSL type (Int32,
    Float32), from a number. Raises ValueError unless `specs` names the
    struct's fields in order, KeyError for a field `sources` lacks."""
    if tuple(specs) != struct._fields:
        raise ValueError(f"specs name {tuple(specs)}, {struct.__name__} has {struct._fields}")
    return struct(
        *(gmem_ptr(spec[0], sources[name], spec[1]) if isinstance(spec, tuple) else spec(sources[name])
          for name, spec in specs.items())
    )  # fmt: skip
