"""Split a sweep's case grid across a host's GPUs (`moebench sweep --devices`).

One worker process per GPU, started the way torchrun starts them (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment, plus MOEBENCH_GPU_INDEX = the physical GPU the rank owns). Each
case runs on exactly one GPU:

1. `plan_shards` assigns cases to devices: cases of one (preset, tp) weight
   group stay together where the balance allows it (weights are generated per
   group), a group too large for one device's share is cut at `rows`
   boundaries (each piece is still a full rows x scenarios x backends x
   tactics product, so one SweepConfig runs it), then the pieces go to
   devices by longest-processing-time-first greedy over `expected_cost`.
2. `launch_workers` starts one process per shard (spawn, never fork: CUDA),
   each writes its results piece by piece (atomic renames) into a scratch
   directory; a worker that dies (exception, signal, timeout) is reported
   with its exit code and whatever it had finished is kept. Ctrl-C or
   SIGTERM in the parent reaches every worker as an interrupt: each keeps
   the cases it measured (run_sweep's own rule) and stops.
3. `merge_results` joins the workers' frames, adds `gpu_index` / `gpu_serial`,
   and marks every case of a dead worker that has no row with status
   "failed" and the worker's error (of an interrupted one: "skipped",
   `INTERRUPTED`), so the store is complete.
4. `run_sharded_sweep` does 1-3 for a SweepConfig and writes one run with
   `store.write_run` (atomic: no half-written result file ever).

NVLink multicast stays off in every worker (`worker_env`): NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from moebench.bench import L2_MULTIPLE
from moebench.bench.cases import Case, SweepConfig
from moebench.bench.interrupt import INTERRUPTED, interrupted_rows, sigterm_as_interrupt
from moebench.reports.store import CASE_COLUMNS

#: Environment every worker gets: NVLink multicast off (DESIGN.md, device notes).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: L2 of an H200 (bytes) the cost model sizes the rotation with.
H200_L2_BYTES = 60 * 1024 * 1024
#: Cost (in bytes-equivalent) of one case beyond its streamed bytes: launch,
#: oracle gate, timing loop overhead.
CASE_OVERHEAD_BYTES = 8 * 1024 * 1024
#: Columns the merge adds.
GPU_COLUMNS = ("gpu_index", "gpu_serial")
#: Environment variables a worker's runner reports its progress through.
PROGRESS_ENV = "MOEBENCH_WORKER_PROGRESS"
PROGRESS_OFFSET_ENV = "MOEBENCH_WORKER_PROGRESS_OFFSET"
#: Seconds an interrupted parent waits for its workers to store what they
#: measured and exit: first for a Ctrl-C the workers saw themselves, then
#: after passing the interrupt on (SIGTERM) before killing them.
INTERRUPT_GRACE_S = (3.0, 60.0)
#: Exit code of a worker that stopped on an interrupt (128 + SIGINT).
INTERRUPTED_EXIT = 130
#: Columns that identify a case in a result frame.
CASE_KEY = CASE_COLUMNS

CaseRunner = Callable[[list[Case], str], pd.DataFrame]


# --------------------------------------------------------------------------- plan


def expected_cost(case: Case, l2_bytes: int = H200_L2_BYTES) -> float:
    """Relative run time of `case`: bytes one call streams (the most experts
    rows x top_k routes can touch, x their logical bytes, + activations) times
    the rotation layers a cold-L2 sweep uses (>= 4 x L2 working set, as in
    sweep.layer_count), + a fixed per-case overhead. Only ratios matter."""
    shape = case.shape
    touched = min(case.rows * shape.top_k, shape.experts)
    nbytes = touched * shape.expert_bytes() + 4 * case.rows * shape.hidden
    layers = max(1, math.ceil(L2_MULTIPLE * l2_bytes / nbytes))
    return float(min(layers, 64) * nbytes + CASE_OVERHEAD_BYTES)


def _group_key(case: Case):
    return (case.config, case.tp)


def plan_shards(
    cases: Sequence[Case], devices: int | Sequence[int], cost: Callable[[Case], float] = expected_cost
) -> list[list[Case]]:
    """Cases per device (one list per device, in `devices` order).

    Every case lands exactly once; each list keeps the input order. A (preset,
    tp) group stays on one device unless its cost exceeds total / n_devices;
    then it is cut at `rows` boundaries into pieces of at most half that
    share (a single rows value is never cut). Pieces are placed by LPT greedy
    (most costly first, onto the least loaded device, ties to the lower
    index), so the most loaded device carries at most total / n + the most
    costly piece. Deterministic for the same input. Raises ValueError for no
    devices or duplicate cases.
    """
    n = devices if isinstance(devices, int) else len(devices)
    if n < 1:
        raise ValueError(f"need at least one device, got {devices!r}")
    cases = list(cases)
    if len(set(cases)) != len(cases):
        raise ValueError("cases has duplicates")
    costs = [float(cost(c)) for c in cases]
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError("cost must be finite and >= 0 for every case")
    total = sum(costs)
    share = total / n

    groups: dict = {}
    for i, c in enumerate(cases):
        groups.setdefault(_group_key(c), []).append(i)
    pieces: list[list[int]] = []
    for idx in groups.values():
        gcost = sum(costs[i] for i in idx)
        if n == 1 or gcost <= share:
            pieces.append(idx)
            continue
        by_rows: dict[int, list[int]] = {}
        for i in idx:
            by_rows.setdefault(cases[i].rows, []).append(i)
        limit = share / 2
        piece: list[int] = []
        pcost = 0.0
        for ridx in by_rows.values():
            rcost = sum(costs[i] for i in ridx)
            if piece and pcost + rcost > limit:
                pieces.append(piece)
                piece, pcost = [], 0.0
            piece = piece + ridx
            pcost += rcost
        if piece:
            pieces.append(piece)

    order = sorted(range(len(pieces)), key=lambda p: (-sum(costs[i] for i in pieces[p]), pieces[p][0]))
    loads = [0.0] * n
    assigned: list[list[int]] = [[] for _ in range(n)]
    for p in order:
        d = min(range(n), key=lambda k: (loads[k], k))
        assigned[d].extend(pieces[p])
        loads[d] += sum(costs[i] for i in pieces[p])
    return [[cases[i] for i in sorted(a)] for a in assigned]


def parse_devices(spec: str, available: int | None = None) -> list[int]:
    """'all' -> every visible GPU (torch.cuda.device_count() unless
    `available` is given); '0,2,3' -> [0, 2, 3]. Raises ValueError for an
    empty, malformed, duplicate or out-of-range list."""
    if available is None:
        import torch

        available = torch.cuda.device_count()
    spec = str(spec).strip()
    if available < 1:
        raise ValueError(f"devices (--devices): {spec!r} but no GPU is visible")
    if spec == "all":
        return list(range(available))
    try:
        out = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError as error:
        raise ValueError(f"devices (--devices): expected 'all' or e.g. 0,1, got {spec!r}") from error
    if not out:
        raise ValueError("devices (--devices): empty list")
    if len(set(out)) != len(out):
        raise ValueError(f"devices (--devices): duplicates in {spec!r}")
    bad = [d for d in out if not 0 <= d < available]
    if bad:
        raise ValueError(f"devices (--devices): {bad} not in [0, {available}) visible GPUs")
    return out


def shard_configs(config: SweepConfig, cases: Sequence[Case]) -> list[SweepConfig]:
    """SweepConfigs that together run exactly `cases` (a shard of
    expand_cases(config)), one per (preset, tp) piece. Raises ValueError when
    a piece is not a full rows x scenarios x backends x tactics product
    (plan_shards never makes one)."""
    out = []
    groups: dict = {}
    for c in cases:
        groups.setdefault(_group_key(c), []).append(c)
    for (cfg, tp), group in groups.items():
        axes = [tuple(dict.fromkeys(getattr(c, a) for c in group)) for a in ("rows", "scenario", "backend", "tactic")]
        if math.prod(len(a) for a in axes) != len(group):
            raise ValueError(f"cases of {cfg.name} tp{tp} are not a full product; cannot run them as one sweep")
        preset = cfg.name.split("+", 1)[0]
        out.append(replace(config, presets=(preset,), tp=(tp,), rows=axes[0], scenarios=axes[1],
                           backends=axes[2], tactics=axes[3]))  # fmt: skip
    return out


# ------------------------------------------------------------------ environment


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(
    rank: int,
    world: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    gpu_index: int | None = None,
    base: dict | None = None,
) -> dict[str, str]:
    """The environment of worker `rank` of `world`: `base` (default
    os.environ) + torchrun's variables + MOEBENCH_GPU_INDEX + MULTICAST_OFF
    (always wins over `base`)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank}")
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        MOEBENCH_GPU_INDEX=str(rank if gpu_index is None else gpu_index),
    )  # fmt: skip
    env.update(MULTICAST_OFF)
    return env


def visible_gpu_count() -> int:
    """CUDA devices this process sees (torch.cuda.device_count(); honours
    CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_uuid(index: int) -> str:
    """"GPU-<uuid>" of the CUDA device `index` as this process numbers it
    (CUDA_VISIBLE_DEVICES applied), or "" when torch cannot say."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001
        return ""
    if not uuid:
        return ""
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def gpu_serial(index: int) -> str:
    """Board serial of the CUDA device `index` (pynvml, else nvidia-smi); ""
    if unknown. The device is looked up by its UUID where torch gives one, so
    CUDA_VISIBLE_DEVICES and a CUDA order that differs from NVML's do not
    mix up the boards; by index otherwise."""
    uuid = gpu_uuid(index)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
                      else pynvml.nvmlDeviceGetHandleByIndex(index))  # fmt: skip
            serial = pynvml.nvmlDeviceGetSerial(handle)
            return serial.decode() if isinstance(serial, bytes) else str(serial)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", uuid or str(index), "--query-gpu=serial", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        return out.stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


# ----------------------------------------------------------------------- launch


@dataclass
class WorkerFrame:
    """What one worker delivered: its rows (may be empty) and its GPU."""

    rank: int
    gpu_index: int
    gpu_serial: str
    frame: pd.DataFrame


@dataclass
class WorkerFailure:
    """A worker that died, or stopped on an interrupt (`interrupted`; error
    is then INTERRUPTED): its GPU, the cases it owned, and why."""

    rank: int
    gpu_index: int
    gpu_serial: str
    cases: list[Case]
    error: str
    interrupted: bool = False


@dataclass
class LaunchResult:
    frames: list[WorkerFrame]
    failures: list[WorkerFailure]
    workers: list[dict] = field(default_factory=list)  # per rank: exit code, error, counts
    interrupted: bool = False  # the parent was interrupted (Ctrl-C / SIGTERM) and stopped the workers


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    write(tmp)
    os.replace(tmp, path)


def _worker_main(rank: int, env: dict, runner: CaseRunner, pieces: list[list[Case]], out_dir: str) -> None:
    """Entry point of one worker process (spawned): env first, then the work."""
    os.environ.clear()
    os.environ.update(env)
    out = Path(out_dir)
    gpu = int(env["MOEBENCH_GPU_INDEX"])
    fake = env.get("MOEBENCH_FAKE_GPU") == "1"
    info = {"rank": rank, "gpu_index": gpu, "gpu_serial": "", "gpu_uuid": "", "pid": os.getpid()}
    os.environ[PROGRESS_ENV] = str(out / f"worker-{rank}-progress.json")
    # started with SIGINT ignored (`launch_workers`: no traceback from a Ctrl-C during the start-up
    # imports); from here on a Ctrl-C is an interrupt as usual
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM (the parent passing an interrupt on, `timeout`) as Ctrl-C, around the handlers too: a
    # second one while unwinding is an interrupt, never the default action (killed before the record)
    with sigterm_as_interrupt() as seen:
        try:
            _worker_pieces(info, fake, gpu, runner, pieces, out, rank, seen)
        except KeyboardInterrupt:  # outside a case (run_sweep keeps the cases it measured itself)
            _stopped_on_interrupt(info, out, rank, seen)
        except SystemExit:
            raise
        except BaseException as error:  # noqa: BLE001 - reported to the parent, then exit nonzero
            text = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            info["error"] = text
            info["traceback"] = traceback.format_exc()[-4000:]
            _write_atomic(out / f"worker-{rank}.json", lambda p: p.write_text(json.dumps(info)))
            raise SystemExit(1) from None


def _stopped_on_interrupt(info: dict, out: Path, rank: int, seen: list[int]) -> None:
    """Record that worker `rank` stopped on an interrupt (and which signal:
    SIGTERM when `seen` holds one, else SIGINT), and exit with
    INTERRUPTED_EXIT (further signals ignored: the record must land)."""
    _ignore_interrupts()
    info["interrupted"] = True
    info["signal"] = int(seen[-1]) if seen else int(signal.SIGINT)
    _write_atomic(out / f"worker-{rank}.json", lambda p: p.write_text(json.dumps(info)))
    raise SystemExit(INTERRUPTED_EXIT)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_pieces(info: dict, fake: bool, gpu: int, runner: CaseRunner, pieces, out: Path, rank: int,
                   seen: list[int]) -> None:
    """The body of `_worker_main`: the GPU, then each piece's frame saved as
    it is done; a piece that comes back interrupted (INTERRUPTED rows) is
    saved and ends the worker (`_stopped_on_interrupt`)."""
    if fake:
        info["gpu_serial"], info["gpu_uuid"] = f"fake-{gpu}", f"GPU-fake-{gpu}"
    else:
        import torch

        # As under torchrun: this rank's GPU is the current device, so every
        # allocation, kernel launch and stream of the worker lands on it.
        torch.cuda.set_device(gpu)
        info["gpu_serial"], info["gpu_uuid"] = gpu_serial(gpu), gpu_uuid(gpu)
    _write_atomic(out / f"worker-{rank}.json", lambda p: p.write_text(json.dumps(info)))
    device = "cpu" if fake else f"cuda:{gpu}"
    done = 0
    for k, piece in enumerate(pieces):
        os.environ[PROGRESS_OFFSET_ENV] = str(done)
        frame = runner(piece, device)
        stopped = bool(interrupted_rows(frame).any())
        if stopped:  # store it without being interrupted again
            _ignore_interrupts()
        _write_atomic(out / f"worker-{rank}-part-{k:04d}.parquet", lambda p: frame.to_parquet(p, index=False))
        if stopped:
            _stopped_on_interrupt(info, out, rank, seen)
        done += len(piece)
        os.environ[PROGRESS_OFFSET_ENV] = str(done)
        report_progress(0)


def report_progress(done: int) -> None:
    """Inside a worker: record that `done` cases of the current piece are
    finished (the parent's progress display polls it). A no-op outside a
    worker; never raises."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    try:
        total = int(os.environ.get(PROGRESS_OFFSET_ENV, "0")) + int(done)
        _write_atomic(Path(path), lambda p: p.write_text(json.dumps({"done": total})))
    except Exception:  # noqa: BLE001 - progress is best effort
        pass


def _progress_of(scratch: Path, world: int) -> int:
    done = 0
    for rank in range(world):
        try:
            done += int(json.loads((scratch / f"worker-{rank}-progress.json").read_text())["done"])
        except Exception:  # noqa: BLE001 - not written yet, or mid-rename
            pass
    return done


def _pieces(cases: list[Case]) -> list[list[Case]]:
    """A shard's cases cut into its (preset, tp) pieces, in order."""
    groups: dict = {}
    for c in cases:
        groups.setdefault(_group_key(c), []).append(c)
    return list(groups.values())


def launch_workers(
    shards: Sequence[Sequence[Case]],
    devices: Sequence[int],
    runner: CaseRunner,
    scratch: str | Path,
    *,
    timeout_s: float | None = None,
    base_env: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    poll_s: float = 0.5,
) -> LaunchResult:
    """Run shards[r] on devices[r] in worker process r (spawned; torchrun-style
    env from `worker_env`; the worker makes its GPU the current device).
    runner(cases, device) -> DataFrame is called once per (preset, tp) piece
    of the shard; each piece's frame is saved as soon as it is done. A worker
    that raises, dies or outlives `timeout_s` (then it is terminated) becomes
    a WorkerFailure owning its cases that have no row. progress(done, total)
    is called every `poll_s` seconds with the cases finished so far (from
    `report_progress` in the workers and finished pieces). A KeyboardInterrupt
    (Ctrl-C, or SIGTERM mapped to it) stops the workers the gentle way
    (`_interrupt`: each stores what it measured) and the result says
    `interrupted`; any other exception terminates them before it re-raises.
    `runner` must be picklable (a module-level function)."""
    if len(shards) != len(devices):
        raise ValueError(f"{len(shards)} shards for {len(devices)} devices")
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    world = len(devices)
    total = sum(len(s) for s in shards)
    procs = []
    timed_out = set()
    interrupted = False
    try:
        for rank, (shard, gpu) in enumerate(zip(shards, devices)):
            env = worker_env(rank, world, master_port=port, gpu_index=gpu, base=base_env)
            p = ctx.Process(target=_worker_main, args=(rank, env, runner, _pieces(list(shard)), str(scratch)),
                            name=f"moebench-worker-{rank}")  # fmt: skip
            with _sigint_ignored():  # inherited through exec: the child's start-up ignores Ctrl-C
                p.start()
            procs.append(p)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs):
            if progress is not None:
                progress(_progress_of(scratch, world), total)
            if deadline is not None and time.monotonic() >= deadline:
                timed_out.update(r for r, p in enumerate(procs) if p.is_alive())
                break
            alive = next((p for p in procs if p.is_alive()), None)  # the last one may have ended since the check
            if alive is not None:
                alive.join(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
        _interrupt(procs)
    except BaseException:
        _stop(procs)
        raise
    _stop([procs[r] for r in timed_out])
    for p in procs:
        p.join()
    if progress is not None:
        progress(_progress_of(scratch, world), total)

    frames, failures, workers = [], [], []
    for rank, gpu in enumerate(devices):
        p = procs[rank] if rank < len(procs) else None  # None: interrupted before it was started
        info_path = scratch / f"worker-{rank}.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        serial = info.get("gpu_serial", "")
        parts = sorted(scratch.glob(f"worker-{rank}-part-*.parquet"))
        frame = pd.concat([pd.read_parquet(f) for f in parts], ignore_index=True) if parts else pd.DataFrame()
        frames.append(WorkerFrame(rank, gpu, serial, frame))
        exitcode = p.exitcode if p is not None else None
        error = None
        # stopped by an interrupt: said so itself, or ended without an error record once the parent was
        # interrupted (terminated or killed by `_interrupt`, or never started); a crash stays a crash
        stopped = bool(info.get("interrupted")) or (interrupted and exitcode != 0 and not info.get("error"))
        if rank in timed_out:
            error = f"worker {rank} (GPU {gpu}) timed out after {timeout_s:g} s and was terminated"
        elif exitcode != 0 and not stopped:
            why = info.get("error") or (
                f"killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
            )
            error = f"worker {rank} (GPU {gpu}) died: {why}"
        measured = int((~interrupted_rows(frame)).sum())
        workers.append({"rank": rank, "gpu_index": gpu, "gpu_serial": serial, "gpu_uuid": info.get("gpu_uuid", ""),
                        "pid": info.get("pid"), "exitcode": exitcode, "error": error,
                        "signal": info.get("signal"), "cases": len(shards[rank]), "rows": len(frame),
                        "measured": measured,
                        "interrupted": stopped and error is None and measured < len(shards[rank])})  # fmt: skip
        if error is not None:
            failures.append(WorkerFailure(rank, gpu, serial, list(shards[rank]), error))
        elif stopped:
            failures.append(WorkerFailure(rank, gpu, serial, list(shards[rank]), INTERRUPTED, interrupted=True))
    return LaunchResult(frames, failures, workers, interrupted=interrupted)


@contextlib.contextmanager
def _sigint_ignored():
    """Within: SIGINT ignored in this process (main thread only; elsewhere
    nothing changes), the previous handler restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt(procs, grace_s: tuple[float, float] | None = None) -> None:
    """The parent was interrupted: give the workers `grace_s[0]` seconds to
    stop on their own (a Ctrl-C at a terminal reaches them too), then pass
    the interrupt on as SIGTERM (each stores the cases it measured), wait
    `grace_s[1]` seconds, and kill what still runs. A second Ctrl-C here
    kills them at once. Default grace: INTERRUPT_GRACE_S."""
    grace_s = grace_s or INTERRUPT_GRACE_S
    try:
        deadline = time.monotonic() + grace_s[0]
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: a KeyboardInterrupt in the worker
        deadline = time.monotonic() + grace_s[1]
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second interrupt: no more waiting (what the workers saved is still merged)
        pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _stop(procs) -> None:
    """Terminate (then kill) each still running process of `procs`, by its own handle."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


# ------------------------------------------------------------------------ merge


def _key_of_case(c: Case) -> tuple:
    return (c.config.name, c.tp, c.rows, c.scenario, c.backend, c.tactic)


def _failed_row(case: Case, error: str, columns: Sequence[str]) -> dict:
    shape = case.shape
    row = dict.fromkeys(columns)
    row.update(
        preset=case.config.name, hidden=shape.hidden, intermediate=shape.intermediate,
        padded_intermediate=shape.padded_intermediate, experts=shape.experts, top_k=shape.top_k,
        tp=case.tp, rows=case.rows, scenario=case.scenario, backend=case.backend, tactic=case.tactic,
        status="failed", error=error, seed=case.seed,
    )  # fmt: skip
    return {k: v for k, v in row.items() if k in columns}


def merge_results(frames: Sequence[WorkerFrame], failures: Sequence[WorkerFailure] = ()) -> pd.DataFrame:
    """One frame of every worker's rows with `gpu_index` and `gpu_serial`
    columns, plus one status="failed" row (error = the worker's error) for
    every case of a failed worker that has no row yet (status "skipped",
    error INTERRUPTED, for a worker stopped by an interrupt). Columns are those of
    the workers' frames (sweep.COLUMNS for real runs) + GPU_COLUMNS."""
    from moebench.bench.sweep import COLUMNS, _typed

    parts = []
    for wf in frames:
        if wf.frame is None or wf.frame.empty:
            continue
        f = wf.frame.copy()
        f["gpu_index"] = wf.gpu_index
        f["gpu_serial"] = wf.gpu_serial
        parts.append(f)
    columns = list(parts[0].columns) if parts else [*COLUMNS, *GPU_COLUMNS]
    for c in GPU_COLUMNS:
        if c not in columns:
            columns.append(c)
    have = set()
    for f in parts:
        have.update(zip(*(f[k].tolist() for k in CASE_KEY)))
    extra = []
    for fail in failures:
        for case in fail.cases:
            key = _key_of_case(case)
            if case.tactic == "all":  # expanded inside the worker: any row of that backend counts
                if any(k[:5] == key[:5] for k in have):
                    continue
            elif key in have:
                continue
            row = _failed_row(case, fail.error, columns)
            row.update(gpu_index=fail.gpu_index, gpu_serial=fail.gpu_serial)
            if fail.interrupted:
                row["status"] = "skipped"
            extra.append(row)
            have.add(key)
    if extra:
        parts.append(pd.DataFrame(extra, columns=columns))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    frame = frame.reindex(columns=columns)
    if all(c in frame.columns for c in COLUMNS):
        frame = _typed(frame)
    frame["gpu_index"] = pd.to_numeric(frame["gpu_index"], errors="coerce").astype("Int64")
    frame["gpu_serial"] = frame["gpu_serial"].fillna("").astype(str)
    return frame


# ---------------------------------------------------------------- the real thing

_MANIFEST_DIR = "MOEBENCH_SHARD_MANIFESTS"


def sweep_runner(config: SweepConfig) -> CaseRunner:
    """A CaseRunner that runs a piece with run_sweep (config restricted to
    the piece, device = the worker's GPU). Picklable."""
    return _SweepRunner(config)


@dataclass
class _SweepRunner:
    config: SweepConfig

    def __call__(self, cases: list[Case], device: str) -> pd.DataFrame:
        from moebench.bench.sweep import run_sweep

        frames = []
        before = 0
        for cfg in shard_configs(self.config, cases):
            result = run_sweep(
                replace(cfg, device=device),
                # "all" tactics expand inside run_sweep: clamp to the piece's own count.
                progress=lambda done, total, case, status, b=before: report_progress(min(b + done, len(cases))),
            )
            before += len(result.frame)
            frames.append(result.frame)
            out = os.environ.get(_MANIFEST_DIR)
            if out:
                path = Path(out) / f"manifest-{os.environ.get('RANK', '0')}-{os.getpid()}-{len(os.listdir(out))}.json"
                _write_atomic(path, lambda p: p.write_text(json.dumps(result.manifest, default=str)))
            if result.manifest.get("interrupted"):  # the rest of the piece is not run (merged as INTERRUPTED)
                break
        return pd.concat(frames, ignore_index=True)


def run_sharded_sweep(
    config: SweepConfig,
    devices: Sequence[int],
    backends: tuple[str, ...],
    root: str | Path,
    label: str = "sweep",
    *,
    timeout_s: float | None = None,
    runner: CaseRunner | None = None,
    manifest_extra: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Plan, launch, merge and store one multi-GPU sweep; returns the run
    directory (written atomically by store.write_run: no half-written run,
    even when workers die). One worker process per entry of `devices` (CUDA
    indices as this process sees them); every case of
    expand_cases(config, backends) runs on exactly one of them. The results
    carry `gpu_index` / `gpu_serial` per row; the manifest holds the plan,
    each worker's GPU index / serial / UUID / exit code / error
    (`workers`), the first worker manifest's provenance and
    `manifest_extra`. Cases of a dead worker without a row are stored as
    failed with the worker's error. progress(done, total): see
    launch_workers. Raises ValueError for a bad device list (as plan_shards)
    and OSError when the run cannot be written."""
    from moebench.bench.cases import expand_cases
    from moebench.reports.store import write_run

    cases = expand_cases(config, backends, reduced=bool(config.reduced))
    shards = plan_shards(cases, devices)
    scratch = Path(tempfile.mkdtemp(prefix="moebench-shard-"))
    try:
        mdir = scratch / "manifests"
        mdir.mkdir()
        base_env = dict(os.environ, **{_MANIFEST_DIR: str(mdir)})
        launched = launch_workers(shards, devices, runner or sweep_runner(config), scratch / "parts",
                                  timeout_s=timeout_s, base_env=base_env, progress=progress)  # fmt: skip
        frame = merge_results(launched.frames, launched.failures)
        from moebench.bench.sweep import timing_counts_used, timing_methods

        methods = timing_methods(frame)
        manifests = [json.loads(p.read_text()) for p in sorted(mdir.glob("manifest-*.json"))]
        manifest = dict(manifests[0]) if manifests else {}
        if not manifests:  # every worker died before writing one: the host's provenance
            from moebench.env import launcher_environment

            manifest.update(launcher_environment(f"cuda:{devices[0]}"),
                            provenance_from="the launching process (no worker wrote a manifest)")
        manifest.setdefault("schema", 1)
        manifest.setdefault("reduced", bool(config.reduced))
        manifest.setdefault("seed", config.seed)
        manifest.setdefault("warm_l2", config.warm_l2)
        manifest.setdefault("boundary", "back-to-back" if config.back_to_back else "layer")
        manifest.update(
            kind="sweep", sharded=True, devices=list(devices), workers=launched.workers,
            plan=[[c.label() for c in s] for s in shards],
            worker_manifests=[{k: m.get(k) for k in ("device", "copy_bw_gbps", "groups")} for m in manifests],
            timing_methods=methods,  # of every worker's rows, not the first worker's
            timing_counts=timing_counts_used(config, methods),
        )  # fmt: skip
        if interrupted_rows(frame).any():  # an interrupt that left cases unrun
            manifest["interrupted"] = True
            signals = [w["signal"] for w in launched.workers if w.get("signal")]
            if signals:
                manifest["interrupt_signal"] = signals[0]
        manifest.update(manifest_extra or {})
        return write_run(frame, manifest, root, label)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
