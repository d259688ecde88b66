"""Kernels compiled in worker processes and loaded by the timing process
(CPU: cross-compiled for sm_90a, loaded, not launched)."""

import logging
from concurrent.futures import Future

import pytest

from moebench.kernels.tactic import GemmShape, GemmTactic
from moebench.tuning.precompile import KernelPrecompiler, default_jobs, export_prefix

# A shape no other test compiles in this process (compile_gemm caches per process).
SHAPE = GemmShape(hidden=512, intermediate=128, experts=32)
A = (SHAPE, 1, GemmTactic(64, 1, 4, 2, 2), False)
B = (SHAPE, 2, GemmTactic(32, 4, 1, 2, 2), False)


def test_export_prefix_is_a_c_identifier_unique_per_spec():
    names = {export_prefix(s) for s in (A, B, (SHAPE, 1, GemmTactic(64, 1, 4, 2, 2), True))}
    assert len(names) == 3 and all(n.isidentifier() and n.startswith("moebench_gemm") for n in names)
    assert isinstance(default_jobs(), int) and default_jobs() >= 0


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="jobs"):
        KernelPrecompiler([A], tmp_path, 0)
    with pytest.raises(TypeError, match="spec"):
        KernelPrecompiler([("shape", 1, None, False)], tmp_path, 1)


@pytest.mark.compile
def test_a_worker_compiles_and_the_timing_process_loads_it(tmp_path, caplog):
    from moebench.kernels import gemm

    with KernelPrecompiler([A], tmp_path, 1) as pre:
        assert gemm.get_compiled_provider() == pre.get
        kernel, compiled = gemm.compile_gemm(A[0], A[2], A[1], A[3])
        assert pre.loaded == 1 and compiled.load_from_binary  # the worker's export, loaded here
        assert kernel.grid(6, 132) > 0 and compiled.execution_args.signature.parameters.keys() >= {"w", "grid"}
        assert (tmp_path / (export_prefix(A) + ".o")).is_file()
        # never submitted: compiled here as before
        _, here = gemm.compile_gemm(B[0], B[2], B[1], B[3])
        assert not here.load_from_binary and pre.loaded == 1
        # a failed export falls back (one warning) and turns the provider off
        broken = Future()
        broken.set_exception(RuntimeError("worker died"))
        c = (SHAPE, 1, GemmTactic(64, 1, 2, 2, 2), False)
        pre.futures[c] = broken
        with caplog.at_level(logging.WARNING, logger="moebench.tuning"):
            _, fallback = gemm.compile_gemm(c[0], c[2], c[1], c[3])
        assert not fallback.load_from_binary and pre.fallbacks == 1 and "worker died" in caplog.text
        assert "1 loaded" in pre.summary()
    assert gemm.get_compiled_provider() is None


def test_a_failing_worker_kernel_that_passes_in_process_turns_the_provider_off(tmp_path, caplog):
    from moebench.kernels import gemm

    def checker(pre, results):
        def check():
            pre.loaded += 1 if pre._enabled else 0  # as if the provider served the kernel while on
            return results.pop(0)

        return check

    with KernelPrecompiler([], tmp_path, 1) as pre:
        pre.verify_with(lambda: None)  # the provider served nothing: not verified yet
        assert pre._enabled and not pre._verified
        with caplog.at_level(logging.WARNING, logger="moebench.tuning"):
            pre.verify_with(checker(pre, ["only 0.2 of H bytes equal the oracle's", None]))
        assert not pre._enabled and pre.fallbacks == 1 and "in-process from now on" in caplog.text
        assert pre.get(*A[:1], A[2], A[1], A[3]) is None  # off: compile_gemm compiles here
    with KernelPrecompiler([], tmp_path, 1) as pre:
        pre.verify_with(checker(pre, ["relative error 0.5", "relative error 0.5"]))  # the tactic is wrong
        assert pre._enabled and pre._verified and pre.fallbacks == 0
    with KernelPrecompiler([], tmp_path, 1) as pre:
        pre.verify_with(checker(pre, [None]))
        assert pre._enabled and pre._verified
        pre.verify_with(lambda: pytest.fail("verified once only"))
    assert gemm.get_compiled_provider() is None


@pytest.mark.gpu
def test_the_workers_kernel_gives_the_same_bytes_on_the_gpu(tmp_path):
    """The exported, loaded kernel launches under the runner and writes the
    same H as the same tactic compiled in-process (scripts/tune_all.sh runs
    this first and compiles in-process if it fails)."""
    import torch

    from moebench.kernels import gemm
    from moebench.models import get_preset
    from moebench.tuning.runner import GemmStageRunner, require_tuning_device

    shape = get_preset("dsv41-flash", experts=64).shard(8)
    runner = GemmStageRunner(shape, 1, require_tuning_device(), layers=1, replays=3, warmup=1)
    tactic = runner.default(6)
    gemm.compile_gemm.cache_clear()
    with KernelPrecompiler([(GemmShape.of(shape), 1, tactic, runner.wide)], tmp_path, 1) as pre:
        assert runner.check(tactic, 6) is None and pre.loaded == 1
        loaded = runner._case(6)["h_q"].clone(), runner._case(6)["h_s"].clone()
        assert runner.time(tactic, 6).median_us > 0  # captured in a CUDA graph too
    gemm.compile_gemm.cache_clear()
    assert runner.check(tactic, 6) is None
    assert torch.equal(runner._case(6)["h_q"], loaded[0]) and torch.equal(runner._case(6)["h_s"], loaded[1])
