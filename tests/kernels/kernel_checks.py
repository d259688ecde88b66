"""Checks shared by the kernel tests (route, quantize, finalize): compiling a
CuTe DSL kernel for sm_90a and reading its SASS, the spill and PDL-order
checks on that SASS, misaligned views for host validation, poisoned guard
buffers, per-launch timing in a CUDA graph, and the GEMM pair's
graph-replay check.

Imported by name (`from kernel_checks import ...`): tests/ has no
__init__.py files, so pytest's default (prepend) import mode puts
tests/kernels on sys.path before it imports a test file from here."""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import torch

_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4}\*/\s+([^;]+);")
_GLOBAL_ACCESS = re.compile(r"(@!?P\d+ )?(LDG|STG)")

# --------------------------------------------------------------------------- compile and SASS

# A compile worker: a child process that imports the DSL once and serves
# requests until its stdin closes (the DSL reads CUTE_DSL_KEEP / _DUMP_DIR /
# _COMPILER_OPT once per process, so they are set before it is imported). A
# request is one JSON line {"source": ..., "specs": [...]}: `source` defines
# compile_spec(spec) -> dict (it compiles one kernel; the dict joins the
# report). The worker prints one JSON report per spec, then a line DONE. The
# kernels' compile caches are emptied before each spec, so every spec is
# compiled (and ptxas reports on it) as in a fresh process.
_CHILD = textwrap.dedent(
    """
    import atexit, glob, json, os, re, shutil, sys, tempfile
    dump = tempfile.mkdtemp(prefix="moebench_sass_")
    atexit.register(shutil.rmtree, dump, ignore_errors=True)  # the cubins and SASS are read before exit
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=dump,
                      CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    instr_re = re.compile(r"/\\*[0-9a-f]{4}\\*/\\s+([^;]+);")
    for request in sys.stdin:
        request = json.loads(request)
        namespace = {}
        exec(request["source"], namespace)
        for spec in request["specs"]:
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("moebench.kernels"):
                    for v in list(vars(m).values()):
                        if callable(getattr(v, "cache_clear", None)):
                            v.cache_clear()
            for f in glob.glob(os.path.join(dump, "*")):
                os.remove(f)
            r, w = os.pipe()
            saved = os.dup(2), os.dup(1)
            os.dup2(w, 2); os.dup2(w, 1)
            try:
                extra = namespace["compile_spec"](spec)
            finally:
                sys.stdout.flush(); sys.stderr.flush()
                os.dup2(saved[0], 2); os.dup2(saved[1], 1); os.close(w); os.close(saved[0]); os.close(saved[1])
            log = os.read(r, 1 << 22).decode(errors="replace"); os.close(r)
            sass = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.sass")))
            print(json.dumps(dict(extra, spec=spec,
                regs=[int(x) for x in re.findall(r"Used (\\d+) registers", log)],
                spills=[int(x) for x in re.findall(r"(\\d+) bytes spill (?:stores|loads)", log)],
                instr=[s.strip() for s in instr_re.findall(sass)])), flush=True)
        print("DONE", flush=True)
    """
)

#: Specs one worker compiles before a second worker is worth it.
_SPECS_PER_CHILD = 3

#: The compile workers of this pytest process (started on first use, one per CPU core of its share).
_WORKERS: list = []


def _compile_children(n_specs: int) -> int:
    """How many workers compile n_specs specs side by side: one per CPU core
    (pytest waits idle meanwhile), at most one per _SPECS_PER_CHILD specs.
    Under pytest-xdist the cores are shared among its workers (each runs
    tests, and compile workers of its own, side by side with the others)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores //= int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(cores, n_specs // _SPECS_PER_CHILD))


def _stop_workers() -> None:
    while _WORKERS:
        proc, err = _WORKERS.pop()
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        err.close()


atexit.register(_stop_workers)


def _workers(n: int) -> list:
    """n running compile workers (more are started when fewer are running)."""
    if any(proc.poll() is not None for proc, _ in _WORKERS):
        _stop_workers()
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    while len(_WORKERS) < n:
        err = tempfile.TemporaryFile("w+")  # a file, not a pipe: the worker writes without waiting on us
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)  # fmt: skip
        _WORKERS.append((proc, err))
    return _WORKERS[:n]


def compile_reports(compile_spec_source: str, specs: list) -> list[dict]:
    """Compile one kernel per spec for sm_90a in worker processes and read
    back what ptxas and the SASS say. compile_spec_source: Python source
    defining `compile_spec(spec) -> dict` (compiles the kernel of one
    JSON-able spec; the dict's items join its report). The specs are dealt
    round-robin to up to one worker per CPU core; the workers live as long as
    this process, so the DSL is imported once per worker, not per call.
    Returns one report per spec, in the order of specs: spec, regs / spills
    (from ptxas' remarks), instr (the SASS instructions; empty when no
    disassembler is installed) and the extra items."""
    n = _compile_children(len(specs))
    source = textwrap.dedent(compile_spec_source)
    reports = [None] * len(specs)
    try:
        workers = _workers(n)
        for c, (proc, _) in enumerate(workers):
            proc.stdin.write(json.dumps({"source": source, "specs": specs[c::n]}) + "\n")
            proc.stdin.flush()
        for c, (proc, err) in enumerate(workers):
            k = 0
            for line in proc.stdout:  # child c compiles specs[c::n]
                if line.startswith("DONE"):
                    break
                if line.startswith("{"):
                    reports[c + n * k] = json.loads(line)
                    k += 1
            else:  # the worker died
                proc.wait(timeout=60)
                err.seek(0)
                raise AssertionError(f"compile worker exited with {proc.returncode}: {err.read()[-4000:]}")
    except BaseException:
        _stop_workers()  # a failed or interrupted request leaves no half-read worker behind
        raise
    return [rep for rep in reports if rep is not None]


def sass_count(report: dict, pattern: str) -> int:
    """How many SASS instructions of a `compile_reports` report match `pattern`."""
    return sum(bool(re.search(pattern, s)) for s in report["instr"])


def sass_first(report: dict, pattern: str) -> int:
    """Index of the first SASS instruction matching `pattern`, -1 if none."""
    return next((n for n, s in enumerate(report["instr"]) if re.search(pattern, s)), -1)


def compile_sm90a(kernel, *args, ptx: bool = False) -> tuple[str, str | None]:
    """(SASS, PTX) of cute.compile(kernel, *args) for sm_90a; PTX is None unless asked for."""
    import cutlass.cute as cute

    keep = "--keep-sass --keep-ptx" if ptx else "--keep-sass"
    with tempfile.TemporaryDirectory() as d:
        f = cute.compile(kernel, *args, options=f"--gpu-arch sm_90a {keep} --dump-dir {d}")
        return f.artifacts.SASS, (f.artifacts.PTX if ptx else None)


def sass_instructions(sass: str) -> list[str]:
    """The instructions of a SASS listing, one per entry, without offsets or ';'."""
    return [s.strip() for s in _SASS_INSTR.findall(sass)]


def assert_sass_without_spills(instr: list[str], kernel: str) -> str:
    """Some SASS came back and it uses no local memory; returns it as one text."""
    assert len(instr) > 50, "no SASS came back"
    text = "\n".join(instr)
    # local memory = register spills (or a stack frame)
    assert not re.search(r"\b(STL|LDL)\b", text), f"register spills in the {kernel} kernel"
    return text


def assert_pdl_order(instr: list[str], pdl: bool) -> None:
    """PDL: trigger dependents (PREEXIT) and wait on the previous grid (ACQBULK)
    exactly when pdl, and the wait comes before any global access."""
    text = "\n".join(instr)
    assert ("PREEXIT" in text) == pdl
    assert ("ACQBULK" in text) == pdl
    if pdl:
        first_global = min(i for i, s in enumerate(instr) if _GLOBAL_ACCESS.match(s))
        assert instr.index("ACQBULK") < first_global


# --------------------------------------------------------------------------- host validation


def misaligned(shape, dtype) -> torch.Tensor:
    """A contiguous CPU tensor of shape and dtype whose data is not 16-byte aligned."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.empty(n + 16, dtype=dtype)
    off = next(i for i in range(1, 16) if (buf.data_ptr() + i * buf.element_size()) % 16)
    return buf[off : off + n].view(shape)


# --------------------------------------------------------------------------- GPU


def guarded(n: int, poison: int, dtype: torch.dtype, guard: int, device):
    """A buffer filled with poison, and a view of n elements with guard elements before and after."""
    buf = torch.full((n + 2 * guard,), poison, dtype=dtype, device=device)
    return buf, buf[guard : guard + n]


def assert_guards_intact(buf: torch.Tensor, guard: int, n: int, poison: int, msg: str) -> None:
    """The guard elements on each side of buf's n-element middle still hold poison."""
    b = buf.cpu()
    assert (b[:guard] == poison).all() and (b[guard + n :] == poison).all(), msg


def graph_launch_times(launch, n: int = 100, replays: int = 20) -> tuple[float, list[float]]:
    """(median, all) per-launch times in us of a CUDA graph of n back-to-back
    launch() calls, over `replays` timed replays (after one eager launch and
    one untimed replay)."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            launch()
    graph.replay()
    times = []
    for _ in range(replays):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1000 / n)
    return sorted(times)[len(times) // 2], times


def assert_pair_graph_replays(step, x, x_new, h_q, h_s, out, used: int, follows: str) -> None:
    """The GEMM1 + GEMM2 pair `step()` (writing H = (h_q, h_s) and `out`
    from the activations x = (x_q, x_s)) in a CUDA graph: after one eager
    call, a replay into poisoned buffers (h_q 0xFF, h_s 0xFE, out NaN)
    writes the eager bytes in the first `used` rows of each; with x_new
    copied into x, a replay changes buffer `follows` ("h_q" or "out") in
    those rows, so the graph reads its inputs, not a copy taken at capture."""
    bufs = {"h_q": h_q, "h_s": h_s, "out": out}
    if follows not in ("h_q", "out"):
        raise ValueError(f"follows: 'h_q' or 'out', got {follows!r}")
    step()
    torch.cuda.synchronize()
    eager = {name: t.clone() for name, t in bufs.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    h_q.fill_(0xFF)
    h_s.fill_(0xFE)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h_q[:used], eager["h_q"][:used]) and torch.equal(h_s[:used], eager["h_s"][:used])
    assert torch.equal(out[:used].view(torch.int16), eager["out"][:used].view(torch.int16))
    for dst, src in zip(x, x_new, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(bufs[follows][:used], eager[follows][:used])
