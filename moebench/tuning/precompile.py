"""Compile GEMM tactics in worker processes while the GPU times others.

A tuning run needs one CuTe DSL compile per (shape, stage, tactic): about a
second of one CPU core each (measured: 0.7-1.2 s for the dsv41 TP4 GEMMs,
sm_90a, nvidia-cutlass-dsl 4.8.1), most of it in the DSL's Python front end
and ptxas, all of it single-threaded. `cute.compile` itself cannot be spread
over threads (the GIL; the DSL's MLIR context is disabled for
multithreading), and its in-process JIT cache is off for `cute.compile`
(it passes no_cache=True, so CUTE_DSL_CACHE_DIR's file cache never holds
these kernels). What works is the DSL's ahead-of-time path:

* a worker process (spawned: no CUDA context, CUTE_DSL_ARCH=sm_90a, no GPU
  visible) runs `compile_gemm` and `compiled.export_to_c(dir, prefix)`,
  which writes `<prefix>.o` (host launcher + the sm_90a cubin) and
  `<prefix>.h`;
* the timing process loads it with `cutlass.runtime.load_module(path)[prefix]`
  (~10 ms): a `CudaDialectJitCompiledFunction` with the same signature and
  argument marshalling as the in-process one; its cubin goes to the GPU on
  the first call, as an in-process compile's does.

`KernelPrecompiler` starts the workers on the specs in the order the tuner
needs them and installs itself as `gemm.compile_gemm`'s provider: a kernel
whose export is pending is waited for, one that was never submitted (e.g.
the wide-scale decode, only known once the weights exist) or whose export
or load fails is compiled in-process as before (one warning, then the
provider is off). Nothing here touches the GPU.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import astuple
from pathlib import Path

from moebench.kernels.tactic import GemmShape, GemmTactic

logger = logging.getLogger("moebench.tuning")

#: What a worker compiles: (shape, stage, tactic, wide_scales).
Spec = tuple[GemmShape, int, GemmTactic, bool]


def default_jobs(ranks: int = 1) -> int:
    """Workers worth starting here: all cores but one (the timing process),
    none on a machine of fewer than 4 cores (nothing to gain); `ranks`
    tuning processes on this host (torchrun's LOCAL_WORLD_SIZE) share the
    cores: each gets its part of them."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores //= ranks
    return cores - 1 if cores >= 4 else 0


def export_prefix(spec: Spec) -> str:
    """A C identifier naming the exported kernel of `spec`, unique per spec."""
    shape, stage, tactic, wide = spec
    digest = hashlib.sha1(repr((astuple(shape), stage, astuple(tactic), bool(wide))).encode()).hexdigest()[:16]
    return f"moebench_gemm{stage}_{digest}"


def _init_worker() -> None:
    # Cross-compile for the H200 and never open a CUDA context in a worker.
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _compile_and_export(spec: Spec, directory: str) -> tuple[str, str, float]:
    """Worker: compile `spec` and export it; returns (object path, prefix,
    compile seconds)."""
    from moebench.kernels.gemm import compile_gemm

    shape, stage, tactic, wide = spec
    prefix = export_prefix(spec)
    start = time.perf_counter()
    _, compiled = compile_gemm(shape, tactic, stage, wide)
    seconds = time.perf_counter() - start
    compiled.export_to_c(directory, prefix)
    return os.path.join(directory, prefix + ".o"), prefix, seconds


class KernelPrecompiler:
    """Worker processes compiling `specs` (in order) into `directory`, and
    the provider that hands the results to `gemm.compile_gemm` (module
    docstring). Use as a context manager, or call `close()`."""

    def __init__(self, specs: Iterable[Spec], directory: str | Path, jobs: int) -> None:
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ValueError(f"jobs must be a positive int, got {jobs!r}")
        self.directory = Path(directory)
        self.jobs = jobs
        self.futures: dict[Spec, Future] = {}
        self.loaded = 0
        self.fallbacks = 0
        self.compile_seconds = 0.0
        self.wait_seconds = 0.0
        self._modules: list = []  # the loaded modules own their JIT engines: keep them alive
        self._enabled = True
        self._verified = False
        keys = list(dict.fromkeys(_key(spec) for spec in specs))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_init_worker)  # fmt: skip
        for key in keys:
            self.futures[key] = self._pool.submit(_compile_and_export, key, str(self.directory))
        from moebench.kernels import gemm

        gemm.set_compiled_provider(self.get)

    def get(self, shape: GemmShape, tactic: GemmTactic, stage: int, wide_scales: bool):
        """The compiled kernel of this spec from a worker (waiting for it),
        or None: compile it in-process."""
        future = self.futures.get(_key((shape, stage, tactic, wide_scales)))
        if future is None or not self._enabled:
            return None
        start = time.perf_counter()
        try:
            path, prefix, seconds = future.result()
            from cutlass import runtime

            module = runtime.load_module(path)
            compiled = module[prefix]
        except Exception as error:  # noqa: BLE001 - fall back to compiling here
            self._enabled = False
            self.fallbacks += 1
            logger.warning("precompiled kernel %s (GEMM%d) unusable, compiling in-process from now on: %s: %s",
                           tactic.name, stage, type(error).__name__, str(error).splitlines()[0][:300] if str(error)
                           else "")  # fmt: skip
            return None
        finally:
            self.wait_seconds += time.perf_counter() - start
        self._modules.append(module)
        self.loaded += 1
        self.compile_seconds += seconds
        return compiled

    def verify_with(self, check) -> None:
        """Once per precompiler: `check()` runs one kernel's oracle check
        (None: correct). When it fails with the workers' kernel but passes
        with the same kernel compiled in this process, the exported kernels
        are not to be trusted here: the provider goes off (one warning) and
        compile_gemm's cache is cleared, so every kernel is compiled
        in-process from then on. When it fails both ways the tactic itself is
        at fault and the provider stays on."""
        from moebench.kernels import gemm

        if self._verified or not self._enabled:
            return
        loaded = self.loaded

        def run() -> str | None:
            try:
                return check()
            except Exception as error:  # noqa: BLE001 - reported, not raised
                return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"

        first = run()
        if self.loaded == loaded:
            return  # that kernel was not the workers' (e.g. never submitted): verify with the next one
        self._verified = True
        if first is None:
            return
        self._enabled = False
        gemm.compile_gemm.cache_clear()
        if run() is None:
            self.fallbacks += 1
            logger.warning("a kernel compiled by the workers fails its check here (%s) but passes compiled in this"
                           " process: compiling every kernel in-process from now on", first)  # fmt: skip
        else:
            self._enabled = True
            gemm.compile_gemm.cache_clear()

    def summary(self) -> str:
        done = sum(1 for f in self.futures.values() if f.done())
        return (f"{len(self.futures)} kernels submitted to {self.jobs} compile workers, {done} done, {self.loaded}"
                f" loaded ({self.compile_seconds:.0f} s of worker compile time, {self.wait_seconds:.1f} s waited),"
                f" {self.fallbacks} fallbacks")  # fmt: skip

    def close(self) -> None:
        from moebench.kernels import gemm

        if gemm.get_compiled_provider() == self.get:
            gemm.set_compiled_provider(None)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> KernelPrecompiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(spec: Spec) -> Spec:
    shape, stage, tactic, wide = spec
    if not isinstance(shape, GemmShape) or not isinstance(tactic, GemmTactic) or stage not in (1, 2):
        raise TypeError(f"a spec is (GemmShape, stage 1|2, GemmTactic, wide_scales), got {spec!r}")
    return (shape, stage, tactic, bool(wide))


__all__ = ["KernelPrecompiler", "Spec", "default_jobs", "export_prefix"]
