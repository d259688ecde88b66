"""A sweep, a step or a tune over several processes and hosts, on PyTorch's launcher.

Two ways in, one rank program (`rank_main`), which runs what the `Job`
carries (merge.py): its rank program, then on the merging process its
merge (`sweep_ranks.py`, `decode_step.py`, a tune's `tuning/share.py`);
the launcher names none of them.

- `torchrun --nnodes N --nproc-per-node G -m moebench sweep|step|tune ...`:
  torchrun starts every rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR /
  MASTER_PORT in its environment) and each runs the CLI, which calls
  `rank_main` (`run.measure`; a tune: `tuning.save.tune_and_save`); rank 0
  hosts the results store and stores the run (a tune: writes the tables).
- `sweep --devices` / `step --tp N` on one host: `launch_local` starts the
  ranks through torch.distributed's elastic launch API (`LaunchConfig`,
  `elastic_launch`; c10d rendezvous on 127.0.0.1, no restarts); the
  launching process hosts the results store and stores the run, knowing
  each rank's exit code.

Every rank: NVLink multicast off in its environment before any
communicator exists (MULTICAST_OFF); its GPU (`devices[LOCAL_RANK]`, else
LOCAL_RANK) made current; a process group (gloo, or NCCL for a step on
GPUs with a gloo group beside it for the records) over which rank 0 tells
the others where the results store is. A sweep rank takes its
cost-balanced share of the cases (`shard.plan_shards` over the world:
weight groups kept together) and runs it piece by piece (one run_sweep per
(preset, tp) piece); a step rank runs every case of the TP step. Each rank
puts what it measured into the store as soon as a piece (a sweep) or a
case (a step) is done, with its host / GPU index / serial (`hello/<rank>`),
a heartbeat, and at the end its status (`end/<rank>`: done, interrupted,
or the error). The store lives in the merging process (rank 0 or the
launcher), so a rank that dies loses only what it had not put there.

The job's merge (pure functions of what the ranks put) gives one run; a
case a rank did not deliver is stored failed with the reason (the rank
died: its exit code or signal, or a heartbeat older than
`dead_after_s()`), or skipped (INTERRUPTED) when the rank stopped on an
interrupt. Ctrl-C / SIGTERM reach every rank (from the terminal or from
torchrun's agent), which keeps what it measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from moebench.bench.interrupt import INTERRUPTED, sigterm_as_interrupt
from moebench.bench.merge import FAKE_GPU_ENV, Job, RankReport

#: Environment of every rank: NVLink multicast off (DESIGN.md, device notes).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: host:port of a results store the launching process hosts (`launch_local`); unset under torchrun.
RESULTS_STORE_ENV = "MOEBENCH_RESULTS_STORE"
#: Under torchrun: the address other hosts reach rank 0's results store at (default: its FQDN).
RESULTS_ADDR_ENV = "MOEBENCH_RESULTS_ADDR"
#: Seconds between a rank's heartbeats, and after which a silent rank counts as dead
#: (override: MOEBENCH_DEAD_AFTER_S); a rank compiling kernels still beats.
HEARTBEAT_S = 2.0
DEAD_AFTER_S = 120.0
DEAD_AFTER_ENV = "MOEBENCH_DEAD_AFTER_S"
#: torch.distributed timeout (s): long enough for a rank still compiling kernels while the others wait.
PG_TIMEOUT_S = 600
#: Seconds a rank with an NCCL communicator may take to exit before it is ended (`rank_main`).
EXIT_GRACE_S = 20.0
#: Seconds torchrun's agent gives the ranks to store what they measured after an interrupt.
SHUTDOWN_GRACE_S = 30


def dead_after_s() -> float:
    """Seconds without a heartbeat after which a rank counts as dead."""
    return float(os.environ.get(DEAD_AFTER_ENV, DEAD_AFTER_S))


# ----------------------------------------------------------------------------- where a rank runs


def visible_gpu_count() -> int:
    """CUDA devices this process sees (honours CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_uuid(index: int) -> str:
    """ "GPU-<uuid>" of CUDA device `index` as this process numbers it, or "" when torch cannot say."""
    try:
        import torch

        text = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # noqa: BLE001
        return ""
    return "" if not text else text if text.startswith("GPU-") else f"GPU-{text}"


def gpu_serial(index: int) -> str:
    """Board serial of CUDA device `index` (pynvml, else nvidia-smi; looked up
    by UUID where torch gives one, so CUDA_VISIBLE_DEVICES and a CUDA order
    that differs from NVML's do not mix up boards); "" if unknown."""
    uid = gpu_uuid(index)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uid) if uid else pynvml.nvmlDeviceGetHandleByIndex(index)
            serial = pynvml.nvmlDeviceGetSerial(handle)
            return serial.decode() if isinstance(serial, bytes) else str(serial)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-i", uid or str(index), "--query-gpu=serial", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
        return out.stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def placement(device) -> dict:
    """The launcher columns of rows measured by this process on `device`
    (a torch.device): host, launch_rank (RANK, 0 outside a launch),
    gpu_index (the physical GPU: MOEBENCH_GPU_INDEX where a launch set it,
    else the device's index; None on the CPU) and gpu_serial."""
    index = os.environ.get("MOEBENCH_GPU_INDEX")
    gpu = int(index) if index else (device.index if device.type == "cuda" else None)
    if os.environ.get(FAKE_GPU_ENV) == "1" and gpu is not None:
        serial = f"fake-{gpu}"
    else:
        serial = gpu_serial(device.index or 0) if device.type == "cuda" else ""
    return {"host": socket.gethostname(), "launch_rank": int(os.environ.get("RANK", "0")), "gpu_index": gpu,
            "gpu_serial": serial}  # fmt: skip


def under_torchrun() -> bool:
    """Whether this process is one rank of several started by torchrun."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


# ----------------------------------------------------------------------------- the results store


class Outbox:
    """A rank's side of the results store (keys under moebench/)."""

    def __init__(self, store, rank: int) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("moebench/", store)
        self.rank = rank
        self.pieces = 0

    def put(self, what: str, value) -> None:
        self.store.set(f"{what}/{self.rank}", json.dumps(value, default=str))

    def piece(self, rows: list[dict], info: dict | None = None, *, replace_last: bool = False) -> None:
        """Put one delivery (`replace_last`: it supersedes the previous one: a step's growing row list)."""
        k = self.pieces - 1 if replace_last and self.pieces else self.pieces
        self.store.set(f"rows/{self.rank}/{k}", pickle.dumps({"rows": rows, "info": info or {}}))
        if k == self.pieces:
            self.pieces += 1
            self.store.set(f"pieces/{self.rank}", str(self.pieces))


def read_reports(store, world: int, failures: dict[int, str] | None = None) -> list[RankReport]:
    """Every rank's RankReport from the store (`failures`: the launcher's word per rank)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("moebench/", store)

    def get(key: str):
        return prefixed.get(key) if prefixed.check([key]) else None

    reports = []
    for rank in range(world):
        hello, end, count = get(f"hello/{rank}"), get(f"end/{rank}"), get(f"pieces/{rank}")
        pieces = [pickle.loads(get(f"rows/{rank}/{k}")) for k in range(int(count or 0))]
        reports.append(RankReport(rank, json.loads(hello) if hello else {}, pieces, json.loads(end) if end else None,
                                  (failures or {}).get(rank)))  # fmt: skip
    return reports


def _heartbeat(addr: tuple[str, int], rank: int, stop: threading.Event) -> None:
    """Beat every HEARTBEAT_S on a connection of its own until `stop` is set."""
    import torch.distributed as dist

    try:
        store = dist.PrefixStore("moebench/", dist.TCPStore(addr[0], addr[1], is_master=False,
                                                            timeout=timedelta(seconds=30)))  # fmt: skip
        while not stop.is_set():
            store.set(f"beat/{rank}", str(time.time()))
            stop.wait(HEARTBEAT_S)
    except Exception:  # noqa: BLE001 - the merging process is gone: nothing to tell
        pass


def wait_for_ranks(store, world: int, me: int, interrupted: bool = False) -> None:
    """Rank 0 under torchrun: wait until every other rank said its end, or
    is silent past dead_after_s() (`interrupted`, this rank stopped early:
    at most a few heartbeats, the agent's grace is short)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("moebench/", store)
    limit = min(dead_after_s(), 5 * HEARTBEAT_S) if interrupted else dead_after_s()
    start = time.time()
    while True:
        waiting = []
        for rank in range(world):
            if rank == me or prefixed.check([f"end/{rank}"]):
                continue
            beat = float(prefixed.get(f"beat/{rank}")) if prefixed.check([f"beat/{rank}"]) else start
            if time.time() - beat < limit:
                waiting.append(rank)
        if not waiting or (interrupted and time.time() - start > limit):
            return
        time.sleep(0.2)


# ----------------------------------------------------------------------------- one rank


def ignore_interrupts() -> None:
    """SIGINT and SIGTERM ignored from here on: what a stopping rank measured must land in the store."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def rank_main(job: Job):
    """The program of one rank (module docstring). Returns, on the rank
    that merges under torchrun (rank 0), the merged RunResult; else None."""
    import torch
    import torch.distributed as dist

    os.environ.update(MULTICAST_OFF)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    fake = os.environ.get(FAKE_GPU_ENV) == "1"
    config = job.config
    on_gpu = not fake and str(config.device or "cuda").startswith("cuda") and torch.cuda.is_available()
    gpu = job.devices[local] if job.devices else local
    if on_gpu or fake:
        os.environ["MOEBENCH_GPU_INDEX"] = str(gpu)
    if on_gpu:
        torch.cuda.set_device(gpu)  # as torchrun's ranks do: every launch and stream of the rank lands on it
    device = torch.device("cuda", gpu) if on_gpu else torch.device("cpu")
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    nccl = job.collective and on_gpu
    kwargs = {"device_id": device} if nccl else {}
    dist.init_process_group("nccl" if nccl else "gloo", timeout=timedelta(seconds=PG_TIMEOUT_S), **kwargs)
    records = dist.new_group(backend="gloo") if nccl else None
    merge_here = RESULTS_STORE_ENV not in os.environ and rank == 0
    store, addr = _results_store(rank, records)
    box = Outbox(store, rank)
    where = placement(device)
    box.put("hello", {**where, "gpu_uuid": gpu_uuid(gpu) if on_gpu else "", "pid": os.getpid(),
                      "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}})  # fmt: skip
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(addr, rank, stop), daemon=True).start()
    end: dict = {"status": "done"}
    with sigterm_as_interrupt() as seen:
        try:
            if job.run(job, rank, world, device, box):
                end = {"status": "interrupted"}
        except KeyboardInterrupt:
            end = {"status": "interrupted"}
        except Exception as error:  # noqa: BLE001 - reported to the merge, which fails this rank's cases
            from moebench.bench.pipeline import error_text

            end = {"status": "error", "error": error_text(error)}
        if end["status"] == "interrupted":
            end["signal"] = int(seen[-1]) if seen else int(signal.SIGINT)
            ignore_interrupts()  # what was measured must land
        box.put("end", end)
        stop.set()
        if end["status"] == "error" and job.collective and world > 1 and not merge_here:
            _leave(1)  # the other ranks wait in a collective: the launcher stops them once it sees this exit
        result = None
        if merge_here:
            ignore_interrupts()
            wait_for_ranks(store, world, rank, interrupted=end["status"] != "done")
            result = job.merge(job, read_reports(store, world), None)
    if end["status"] == "interrupted" and RESULTS_STORE_ENV in os.environ:
        # launched here and stopped: what it measured is in the store, and the launcher, shutting
        # down, never reads a return value (the rank would wait for that until killed)
        _leave()
    if nccl:
        # destroy_process_group, or the communicator's teardown at exit, can hang once NCCL
        # collectives were captured in CUDA graphs (pytorch#115388); what the rank measured is
        # in the store. Under torchrun a rank that does not store leaves at once; a rank of
        # `launch_local` must hand the launcher its return value first (else the launcher
        # waits for it forever), so it is ended EXIT_GRACE_S after it returned; the storing
        # rank 0 under torchrun tears the communicator down beside its work, given as long.
        if RESULTS_STORE_ENV in os.environ:
            threading.Thread(target=_leave_after, args=(EXIT_GRACE_S,), daemon=True).start()
        elif not merge_here:
            _leave()
        else:
            teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
            teardown.start()
            teardown.join(EXIT_GRACE_S)
        return result
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return result


def _leave_after(seconds: float) -> None:
    time.sleep(seconds)
    _leave()


def _leave(code: int = 0) -> None:
    """Exit this process at once with `code`, its output flushed."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _results_store(rank: int, group):
    """(a client of the results store, its (host, port)): the launcher's
    (RESULTS_STORE_ENV), else one rank 0 hosts, its address broadcast over
    the gloo group `group` (None: the world group)."""
    import torch.distributed as dist

    if RESULTS_STORE_ENV in os.environ:
        host, port = os.environ[RESULTS_STORE_ENV].rsplit(":", 1)
        addr = (host, int(port))
        return dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=PG_TIMEOUT_S)), addr
    box: list = [None]
    store = None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=PG_TIMEOUT_S))  # fmt: skip
        box = [(os.environ.get(RESULTS_ADDR_ENV) or socket.getfqdn(), store.port)]
    dist.broadcast_object_list(box, src=0, group=group)
    addr = tuple(box[0])
    if store is None:
        store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=PG_TIMEOUT_S))
    return store, addr


# ----------------------------------------------------------------------------- one host


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fields(cls) -> set[str]:
    """The field names of the dataclass `cls`."""
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def launch_local(job: Job, nproc: int, *, timeout_s: float | None = None,
                 progress: Callable[[int, int], None] | None = None, total: int = 0):  # fmt: skip
    """Run `job` in `nproc` ranks on this host, started by torch.distributed's
    elastic launch (module docstring), and merge what they delivered (the
    launcher's word on each rank's exit: ChildFailedError's failures). Past
    `timeout_s` the ranks are stopped (SIGTERM through the launcher) and
    what they left unrun is failed with the reason. progress(done, total)
    every half second. A Ctrl-C / SIGTERM here reaches the ranks through
    the launcher; the merged run keeps what they measured. Returns the
    RunResult (interrupted: its manifest says so)."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=PG_TIMEOUT_S))  # fmt: skip
    scratch = tempfile.mkdtemp(prefix="moebench-launch-")
    # torch < 2.13 has no shutdown_timeout (the device's 2.11 refused it): there its own grace applies
    grace = {"shutdown_timeout": SHUTDOWN_GRACE_S} if "shutdown_timeout" in _fields(LaunchConfig) else {}
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"moebench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.2,
        start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=scratch), **grace,
    )  # fmt: skip
    failures: dict[int, str] = {}
    state = {"stopped": None}
    done = threading.Event()

    def watch() -> None:
        start = time.monotonic()
        while not done.wait(0.5):
            if progress is not None:
                with contextlib.suppress(Exception):
                    progress(_progress(store, nproc), total)
            if timeout_s is not None and state["stopped"] is None and time.monotonic() - start > timeout_s \
                    and not done.is_set():  # fmt: skip
                state["stopped"] = f"stopped after the {timeout_s:g} s timeout"
                os.kill(os.getpid(), signal.SIGTERM)  # the launcher stops its ranks (they keep what they measured)

    env = {**MULTICAST_OFF, RESULTS_STORE_ENV: f"127.0.0.1:{store.port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    interrupted, got = False, None
    handlers = _handlers()  # the launcher installs its own for the ranks' lifetime: ours come back after
    try:
        elastic_launch(config, rank_main)(job)
    except ChildFailedError as error:
        for rank, failure in error.failures.items():
            failures[rank] = _exit_words(failure)
    except (KeyboardInterrupt, Exception) as error:  # the launcher's SignalException on Ctrl-C / SIGTERM
        if not _is_signal(error):
            raise
        interrupted = state["stopped"] is None
        got = int(getattr(error, "sigval", signal.SIGINT))  # the launcher's SignalException names it
    finally:
        done.set()
        watcher.join()
        _restore(handlers)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    if progress is not None:
        progress(_progress(store, nproc), total)
    result = job.merge(job, read_reports(store, nproc, failures), INTERRUPTED if interrupted else state["stopped"])
    if job.devices is not None:
        result.manifest["devices"] = list(job.devices)
    if interrupted:
        result.manifest.update(interrupted=True, interrupt_signal=got)
    return result


_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


def _handlers() -> dict:
    """This process's handlers of the signals the launcher takes over (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in _SIGNALS)}


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _is_signal(error: BaseException) -> bool:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(error, (KeyboardInterrupt, SignalException))


def _exit_words(failure) -> str:
    """ "exit code N" or "killed by signal NAME" of the launcher's ProcessFailure of a rank."""
    code = failure.exitcode
    return f"killed by signal {failure.signal_name()}" if code is not None and code < 0 else f"exit code {code}"


def _progress(store, world: int) -> int:
    import torch.distributed as dist

    prefixed = dist.PrefixStore("moebench/", store)
    return sum(int(prefixed.get(f"progress/{r}")) for r in range(world) if prefixed.check([f"progress/{r}"]))
