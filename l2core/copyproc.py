"""ProcessTransferEngine: TransferEngine's copies submitted from a second OS process.

    pool = HostKVPool(L2Config(kv=spec, tokens=n, shared=TPGroup("inst-7", rank=0, size=1)))
    bufs = l1.kv_buffers(spec, slots, "cuda")          # CPU L1: kv_stack(...).share_memory_()
    eng = ProcessTransferEngine(pool, bufs)            # TransferEngine's arguments and API
    jid = eng.submit_load(slots, pages); eng.wait_layer(jid, i); eng.wait([jid]); eng.close()

Why: loads issued from a worker thread of the process that runs the forward pass slowed the
forward pass by up to +54 % on an H200, the same DMAs issued from a second process by +1.3 %
(the GIL: +0.5 %): the cost is contention on the CUDA driver's per-context state between two
threads of one process. So this engine only hands jobs to one child process (multiprocessing
"spawn") that runs a plain `TransferEngine` over the very same memory:

- **L2**: the child maps the pool's `/dev/shm` segment (`l2core.shm.SharedHostMemory`: a pool
  with `L2Config(shared=TPGroup(name, rank=0, size=1))`, or any rank of a TP-shared pool) by
  path at the same offset, MAP_SHARED, and pins its own mapping when the parent's is pinned and
  L1 is CUDA (cudaHostRegister is per process). A pool over private memory is refused
  (ConfigError). No byte of the pool is copied.
- **L1**: CPU buffers must be shared-memory tensors (`is_shared()`); CUDA buffers reach the child
  through torch.multiprocessing's CUDA IPC (they are pickled into the spawn); the parent keeps
  them alive.
- **Jobs** go over a pipe as one message each (a header and the int64 slot and page arrays),
  validated here first (the errors `l2core.ops.transfer` gives: see `_submit`). The child
  reports each load step (`layers_done`) and each completion (ok, error, pages, bytes, seconds)
  over a second pipe; a reader thread here fills the same structures TransferEngine keeps, so
  `wait_layer` / `poll` / `wait` / `pop_finished` behave the same.
- **Events (CUDA)**: preallocated rings of interprocess events, created once here and opened once
  in the child: per kind an "after" ring (recorded here on the submitter's current stream at
  submit, waited on by the child's copy stream: a backup sees the compute that wrote L1) and a
  layer ring (recorded by the child after each load step, waited on by the caller's current
  stream in `wait_layer` once the child reported the step). A slot is reused only after its job's
  completion arrived here (FIFO per kind: the child runs each kind's jobs in order), which bounds
  the jobs in flight per kind (`max_in_flight`; a submit beyond it blocks). CPU: no events, the
  child's copies are synchronous.
- **Failure**: when the child dies, every job in flight completes with ok=False and an error
  naming the exit code, layer waiters get TransferError, later submits raise TransferError; a
  layer is never reported loaded unless the child reported it.

Differences from TransferEngine: page/slot count mismatches and out-of-range pages or slots
raise at submit (nothing is sent) instead of completing the job with ok=False; no `split`
(SplitRead's collectives belong to the rank's own process group).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import mmap
import multiprocessing as mp
import os
import signal
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import Any

import numpy as np
import torch

from . import ops
from .layout import HostKV, HostLayout
from .memory import HostMemory
from .spec import ConfigError, KVSpec
from .transfer import LOAD_PRIORITY, EngineStats, JobBook, JobKind, JobResult, TransferEngine, TransferError, _Job
from .units import check_int

log = logging.getLogger(__name__)

__all__ = ["ProcessTransferEngine"]

_KINDS: tuple[JobKind, JobKind] = ("backup", "load")
# parent -> child: job_id, kind (0 backup, 1 load, -1 stop), after slot, layer base, n slots, n pages
_JOB = struct.Struct("<qqqqqq")
# child -> parent: tag, then per tag
_READY, _FAIL, _STEP, _DONE, _BYE = 1, 2, 3, 4, 5
_TAG = struct.Struct("<B")
_STEP_MSG = struct.Struct("<Bqq")  # tag, job_id, layers_done
_DONE_MSG = struct.Struct("<Bq?qqd")  # tag, job_id, ok, num_pages, nbytes, seconds; then the error text


def _exit_text(pid: int, code: int | None) -> str:
    if code is None:
        return f"the copy process (pid {pid}) closed its pipe but still runs"
    if code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        return f"the copy process (pid {pid}) exited with code {code} (killed by {sig})"
    return f"the copy process (pid {pid}) exited with code {code}"


def _segment_of(pool: HostKV) -> tuple[str, int, int]:
    """(path, inode, byte offset of pool.buffer in the file) of a pool over a /dev/shm segment;
    ConfigError naming the fix for any other memory."""
    from .shm import SharedHostMemory

    mem = getattr(pool, "memory", None)
    if not isinstance(mem, SharedHostMemory) or getattr(mem, "_mm", None) is None:
        what = type(mem).__name__ if mem is not None else "no .memory"
        raise ConfigError(
            f"ProcessTransferEngine: the copy process must map the pool's host memory, but this pool's is {what} "
            "(private to this process); build the pool over shared memory: "
            "L2Config(..., shared=TPGroup(name, rank=0, size=1)) (a /dev/shm segment)"
        )
    seg = mem.segment
    off = pool.buffer.data_ptr() - mem.tensor.data_ptr()
    if off < 0 or off + pool.layout.total_bytes > mem.nbytes:
        raise ConfigError("ProcessTransferEngine: pool.buffer is not inside its SharedHostMemory")
    return str(seg.path), int(seg.ino), int(seg.data_off) + off


@dataclass
class _PJob:
    """The parent's view of a job in flight: what the child reported so far."""

    job_id: int
    kind: JobKind
    num_pages: int
    layer_base: int  # first slot of its layer events in the layer ring (loads on CUDA), else -1
    layers_done: int = 0  # layers the child reported enqueued (CUDA) / done (CPU)
    error: str | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)


class ProcessTransferEngine(JobBook):
    """TransferEngine's API (submit_backup, submit_load, wait_layer, poll, pop_finished, wait,
    close, stats, context manager) with the copies submitted by one child process.

    `max_in_flight`: jobs per kind between submit and completion (the event rings' size; a submit
    beyond it waits). On CUDA an engine holds `max_in_flight * (2 + load steps)` interprocess events,
    and the driver runs out of them (cudaErrorMemoryAllocation) at a few thousand per process: four
    engines of 1,088 (32 in flight, 32 layers) failed on an H100 where two ran; at the default of 8,
    a 32-layer engine holds 272. `start_timeout_s`: the child's start imports torch and, for a pinned pool
    with CUDA L1, registers its own mapping of the whole pool (cudaHostRegister: seconds per tens
    of GiB). `close_timeout_s`: how long close() lets the child drain before it is killed."""

    def __init__(
        self,
        pool: HostKV,
        bufs: Sequence[torch.Tensor],
        *,
        method: ops.Method = "auto",
        max_sms: int = ops.DEFAULT_MAX_SMS,
        layers_per_step: int = 1,
        load_priority: int = LOAD_PRIORITY,
        max_in_flight: int = 8,
        start_timeout_s: float = 600.0,
        close_timeout_s: float = 120.0,
    ) -> None:
        spec = pool.spec
        if len(bufs) != spec.num_layers * spec.num_kv:
            raise ValueError(f"expected {spec.num_layers * spec.num_kv} device buffers, got {len(bufs)}")
        if layers_per_step < 1:
            raise ValueError("layers_per_step must be >= 1")
        if isinstance(load_priority, bool) or not isinstance(load_priority, int):
            raise TypeError(f"load_priority must be an int, got {type(load_priority).__name__}")
        check_int("max_in_flight", max_in_flight, 1)
        ops._check_buffers(bufs, pool.layout, (0, spec.num_layers))
        self.pool, self.bufs = pool, list(bufs)
        self.device = self.bufs[0].device
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"ProcessTransferEngine takes cpu or cuda L1 buffers, got {self.device.type}")
        if self.device.type == "cpu":
            for i, b in enumerate(self.bufs):
                if not b.is_shared():
                    raise ConfigError(
                        f"ProcessTransferEngine: L1 buffer {i} is not in shared memory, so the copy process "
                        "cannot write it; allocate the buffers shared (l2core.l1.kv_stack(...).share_memory_(), "
                        "or call share_memory_() on them before the engine)"
                    )
        path, ino, offset = _segment_of(pool)
        from . import _native

        _native.load()  # built here, once, with its progress report; the child only loads it
        mem = pool.memory  # type: ignore[attr-defined]
        self.method, self.max_sms, self.layers_per_step = method, max_sms, layers_per_step
        self.load_priority, self.max_in_flight = load_priority, max_in_flight
        self.close_timeout_s = close_timeout_s
        self.steps = -(-spec.num_layers // layers_per_step)  # load steps (layer events) per load
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._jobs: dict[int, _PJob] = {}
        self._finished: dict[int, JobResult] = {}
        self._lock = threading.Condition()
        self._submit_lock = threading.Lock()  # one submitter at a time: ring slots go out in send order
        self._proc_lock = threading.Lock()  # one thread at a time reaps / asks the child's state
        self._closed = False
        self._dead: str | None = None  # why the child is gone, once it is
        # FIFO rings: per kind the jobs taken / completed so far; loads also their layer events
        self._head = {k: 0 for k in _KINDS}
        self._tail = {k: 0 for k in _KINDS}
        self._layer_ring_size = max_in_flight * self.steps
        self._after: dict[JobKind, list[Any]] = {"backup": [], "load": []}
        self._layer_events: list[Any] = []
        handles: dict[str, list[bytes]] | None = None
        if self.device.type == "cuda":
            n_events = len(_KINDS) * max_in_flight + self._layer_ring_size
            try:
                with torch.cuda.device(self.device):
                    self._after = {k: [torch.cuda.Event(interprocess=True) for _ in range(max_in_flight)]
                                   for k in _KINDS}  # fmt: skip
                    self._layer_events = [torch.cuda.Event(interprocess=True) for _ in range(self._layer_ring_size)]
                    handles = {k: [e.ipc_handle() for e in v] for k, v in self._after.items()}
                    handles["layers"] = [e.ipc_handle() for e in self._layer_events]
            except RuntimeError as e:  # torch.AcceleratorError is one
                self._after, self._layer_events = {"backup": [], "load": []}, []
                raise ConfigError(
                    f"ProcessTransferEngine: CUDA refused this engine's {n_events} interprocess events ({e}); "
                    f"the driver has a few thousand per process: fewer copy-process engines, or a smaller "
                    f"max_in_flight (now {max_in_flight})"
                ) from None
        init = {
            "spec": spec, "layout": pool.layout.name, "num_pages": pool.layout.num_pages,
            "memory": (path, ino, offset, pool.layout.total_bytes, bool(mem.pinned), bool(mem.hugepages)),
            "bufs": self.bufs, "method": method, "max_sms": max_sms, "layers_per_step": layers_per_step,
            "load_priority": load_priority, "events": handles,
        }  # fmt: skip
        ctx = mp.get_context("spawn")
        jobs_r, self._jobs_w = ctx.Pipe(duplex=False)
        self._results_r, results_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_child_main, args=(init, jobs_r, results_w), name="l2core-copyproc", daemon=True
        )
        try:
            self._proc.start()
        finally:
            jobs_r.close()  # the child's ends: only the child holds them now (EOF when it dies)
            results_w.close()
        self.pid: int = self._proc.pid  # type: ignore[assignment]
        try:
            self._handshake(start_timeout_s)
        except BaseException:
            self._kill_child()
            raise
        self._reader = threading.Thread(target=self._read, name="l2core-copyproc-reader", daemon=True)
        self._reader.start()

    def _handshake(self, timeout: float) -> None:
        ready = wait_ready([self._results_r, self._proc.sentinel], timeout)
        if self._results_r in ready:
            try:
                msg = self._results_r.recv_bytes()
            except (EOFError, OSError):
                msg = b""
            if msg[:1] == _TAG.pack(_READY):
                return
            if msg[:1] == _TAG.pack(_FAIL):
                raise TransferError(f"the copy process failed to start: {msg[1:].decode(errors='replace')}")
        if not ready:
            raise TimeoutError(f"the copy process (pid {self.pid}) did not start within {timeout} s")
        self._proc.join(5.0)
        raise TransferError(f"{_exit_text(self.pid, self._proc.exitcode)} while starting")

    def _kill_child(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._proc.close()
        self._jobs_w.close()
        self._results_r.close()

    # -- submission --------------------------------------------------------------------------
    def _submit(self, kind: JobKind, slots: Any, pages: Any) -> int:
        if self._closed:
            raise RuntimeError("ProcessTransferEngine is closed")
        # the checks l2core.ops.transfer makes, with its messages, before anything is sent
        s = ops._as_index(slots, "slots")
        p = ops._as_index(torch.as_tensor(np.asarray(pages, dtype=np.int64)), "pages")
        if s.device.type != "cpu":
            s = s.cpu()  # the child gets the indices as bytes (CPU slots, as the cache gives, cost no sync)
        P = self.pool.spec.page_size
        if s.numel() % P:
            raise ValueError(f"{s.numel()} slots is not a multiple of page_size {P}")
        if p.numel() * P != s.numel():
            raise ValueError(f"{p.numel()} pages do not match {s.numel()} slots (page_size {P})")
        ops._check_range(p, self.pool.layout.num_pages, "host page index")
        ops._check_range(s, self.bufs[0].shape[0], "device slot")
        msg_tail = s.numpy().tobytes() + p.numpy().tobytes()
        with self._submit_lock:
            with self._lock:
                while True:
                    self._check_open()
                    if self._head[kind] - self._tail[kind] < self.max_in_flight:
                        break
                    self._lock.wait()
                slot = self._head[kind] % self.max_in_flight
                self._head[kind] += 1
                base = slot * self.steps if kind == "load" else -1  # its block of the layer ring
                job = _PJob(next(self._ids), kind, int(p.numel()), base)
                self._jobs[job.job_id] = job
                self.stats.submitted += 1
            after = -1
            if self._after[kind]:
                self._after[kind][slot].record(torch.cuda.current_stream(self.device))
                after = slot
            head = _JOB.pack(job.job_id, _KINDS.index(kind), after, base, s.numel(), p.numel())
            try:
                self._jobs_w.send_bytes(head + msg_tail)
            except OSError as e:
                self._forget(job, kind)
                raise TransferError(f"the copy process is gone ({type(e).__name__}: {e}); close this engine") from None
        return job.job_id

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ProcessTransferEngine is closed")
        if self._dead is not None:
            raise TransferError(f"{self._dead}: this engine takes no more jobs; close it and start a new one")

    def _forget(self, job: _PJob, kind: JobKind) -> None:
        """Undo a job that never reached the child (its id was never returned)."""
        with self._lock:
            self._jobs.pop(job.job_id, None)
            res = self._finished.pop(job.job_id, None)
            self.stats.submitted -= 1
            if res is None:
                self._tail[kind] += 1
            else:  # the reader failed it already (the child died): uncount that too
                self.stats.completed -= 1
                self.stats.failed -= 1

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        conn = self._results_r
        bye = False
        try:
            while True:
                msg = conn.recv_bytes()
                tag = msg[0]
                if tag == _STEP:
                    _, jid, done = _STEP_MSG.unpack(msg)
                    self._step(jid, done)
                elif tag == _DONE:
                    _, jid, ok, npg, nbytes, secs = _DONE_MSG.unpack_from(msg)
                    err = msg[_DONE_MSG.size :].decode(errors="replace") if not ok else None
                    self._complete(jid, ok, npg, nbytes, secs, err)
                elif tag == _BYE:
                    bye = True
                    break
        except (EOFError, OSError):
            pass
        if not bye:
            with self._proc_lock:  # it closed its pipe: exiting, or gone already
                # join, not exitcode: the sentinel fires when its fds close, before it can be reaped
                self._proc.join(5.0)
                code = self._proc.exitcode
            why = _exit_text(self.pid, code)
            log.warning("l2core copy process gone: %s", why)
        else:
            why = "the copy process stopped (engine closed)"
        with self._lock:
            self._dead = why
            pending = list(self._jobs.values())
        for job in pending:
            self._complete(job.job_id, False, job.num_pages, 0, 0.0, why)
        with self._lock:
            self._lock.notify_all()

    def _step(self, jid: int, done: int) -> None:
        with self._lock:
            job = self._jobs.get(jid)
        if job is None:
            return
        with job.cond:
            job.layers_done = done
            job.cond.notify_all()

    def _complete(self, jid: int, ok: bool, npg: int, nbytes: int, secs: float, err: str | None) -> None:
        with self._lock:
            job = self._jobs.pop(jid, None)
            if job is None:
                return
            res = JobResult(jid, job.kind, ok, npg, nbytes if ok else 0, secs, None if ok else err)
            self._finished[jid] = res
            self._tail[job.kind] += 1
            self.stats.completed += 1
            if not ok:
                self.stats.failed += 1
            elif job.kind == "backup":
                self.stats.bytes_backed_up += nbytes
            else:
                self.stats.bytes_loaded += nbytes
            self._lock.notify_all()
        with job.cond:
            if ok:
                job.layers_done = self.pool.spec.num_layers
            else:
                job.error = err or "failed"
            job.cond.notify_all()

    # -- completion --------------------------------------------------------------------------
    def _order_after_layer(self, job: _PJob, layer: int) -> None:
        if self._layer_events and job.layer_base >= 0:
            ev = self._layer_events[job.layer_base + layer // self.layers_per_step]
            torch.cuda.current_stream(self.device).wait_event(ev)

    def alive(self) -> bool:
        """Whether the copy process runs (False once it died or the engine closed)."""
        if self._closed or self._dead is not None:
            return False
        with self._proc_lock:
            return self._proc.is_alive()

    def close(self) -> None:
        """Finish the queued jobs, stop the copy process, join the reader thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()  # submitters waiting for a ring slot raise
        with self._submit_lock:
            with contextlib.suppress(OSError):
                self._jobs_w.send_bytes(_JOB.pack(0, -1, -1, -1, 0, 0))  # after every job: drained first
        with self._proc_lock:
            self._proc.join(self.close_timeout_s)
            if self._proc.is_alive():
                log.warning("l2core copy process %d did not stop within %s s: killed", self.pid, self.close_timeout_s)
                self._proc.kill()
                self._proc.join()
        self._reader.join()
        self._proc.close()
        self._jobs_w.close()
        self._results_r.close()
        self._after = {"backup": [], "load": []}
        self._layer_events = []

    def __enter__(self) -> ProcessTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the child ---------------------------------------------------------------------------------
class _AttachedMemory(HostMemory):
    """The parent's /dev/shm pool bytes, mapped again (MAP_SHARED) in the copy process: no
    placement, no touch (the pages are in), pinned here when asked (per-process registration)."""

    _align = False

    def __init__(self, path: str, ino: int, offset: int, nbytes: int, *, pin: bool, hugepages: bool) -> None:
        self._src = (path, ino, offset)
        super().__init__(nbytes, pin="always" if pin else "never", hugepages=hugepages)

    def _map(self, length: int) -> tuple[mmap.mmap, int]:
        path, ino, offset = self._src
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_ino != ino:
                raise ConfigError(f"{path} is no longer the pool's segment (replaced since the engine started)")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, offset - start + self.nbytes, flags=mmap.MAP_SHARED, prot=prot, offset=start)
        finally:
            os.close(fd)
        return mm, offset - start

    def _place(self) -> None:
        pass

    def _first_touch(self) -> None:
        pass


def _open_events(device: torch.device, handles: list[bytes]) -> list[Any]:
    return [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


@dataclass
class _ChildPool:
    spec: KVSpec
    layout: HostLayout
    buffer: torch.Tensor


class _ChildEngine(TransferEngine):
    """The plain engine, fed by the parent's messages; reports steps and completions back."""

    warn_in_process_dma = False  # the copy process is where the DMA-only methods belong

    def __init__(self, init: dict[str, Any], send: Callable[[bytes], None]) -> None:
        from . import _native

        _native.load()  # before READY: a first job never waits for the native kernels (the parent built them)
        bufs: list[torch.Tensor] = init["bufs"]
        device = bufs[0].device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        path, ino, offset, nbytes, pinned, huge = init["memory"]
        layout = HostLayout(init["spec"], init["layout"], init["num_pages"])
        self.memory = _AttachedMemory(path, ino, offset, nbytes, pin=pinned and device.type == "cuda", hugepages=huge)
        self._send = send
        self._bases: dict[int, int] = {}
        ev: dict[str, list[bytes]] = init["events"] or {}  # None on CPU: no events
        self._after_ring = {k: _open_events(device, ev.get(k, [])) for k in _KINDS}
        self._layer_ring = _open_events(device, ev.get("layers", []))
        super().__init__(
            _ChildPool(layout.spec, layout, self.memory.tensor), bufs, method=init["method"], max_sms=init["max_sms"],
            layers_per_step=init["layers_per_step"], load_priority=init["load_priority"],
        )  # fmt: skip

    def take(self, msg: bytes) -> bool:
        """Queue the job in `msg`; False for the stop message."""
        jid, k, after, base, ns, npg = _JOB.unpack_from(msg)
        if k < 0:
            return False
        kind = _KINDS[k]
        idx = np.frombuffer(msg, dtype=np.int64, offset=_JOB.size).copy()
        slots, pages = torch.from_numpy(idx[:ns]), torch.from_numpy(idx[ns : ns + npg])
        self._bases[jid] = base
        self._queues[kind].put(_Job(jid, kind, slots, pages, self._after_ring[kind][after] if after >= 0 else None))
        return True

    def _execute(self, job: _Job, stream: Any, flag: torch.Tensor | None) -> None:
        # on this job's stream, ordered before its copies; DMA-only methods read them here
        if job.slots.device != self.device and self.method not in ops.DMA_ONLY_METHODS:
            with self.provider.stream_context(stream):
                job.slots = self.provider.to_device(job.slots, self.device)
        super()._execute(job, stream, flag)

    def _layer_event(self, job: _Job, stream: Any, lb: int) -> Any:
        if stream is None or not self._layer_ring:
            return None
        ev = self._layer_ring[self._bases[job.job_id] + lb // self.layers_per_step]
        ev.record(stream)
        return ev

    def _publish(self, job: _Job, lb: int, le: int, ev: Any) -> None:
        self._send(_STEP_MSG.pack(_STEP, job.job_id, le))  # after its event was recorded

    def _finish(self, job: _Job, seconds: float) -> None:
        self._bases.pop(job.job_id, None)
        nbytes = 0 if job.error else job.slots.numel() * self.pool.spec.token_bytes
        ok = job.error is None
        tail = b"" if ok else (job.error or "").encode()
        self._send(_DONE_MSG.pack(_DONE, job.job_id, ok, job.pages.numel(), nbytes, seconds) + tail)

    def close(self) -> None:
        super().close()
        self.memory.close()


def _child_main(init: dict[str, Any], jobs: Connection, results: Connection) -> None:
    """The copy process: attach, then run jobs until the stop message (or the parent is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process stops
    lock = threading.Lock()

    def send(b: bytes) -> None:
        with lock, contextlib.suppress(OSError):  # the parent is gone: nobody to tell
            results.send_bytes(b)

    try:
        eng = _ChildEngine(init, send)
    except BaseException as e:
        send(_TAG.pack(_FAIL) + f"{type(e).__name__}: {e}".encode())
        raise SystemExit(1) from None
    init.clear()  # the spawn's Process object holds this dict too: the engine alone keeps the buffers
    send(_TAG.pack(_READY))
    try:
        while True:
            try:
                msg = jobs.recv_bytes()
            except (EOFError, OSError):
                break  # the parent is gone
            if not eng.take(msg):
                break
    finally:
        eng.close()  # finishes the queued jobs, reporting each; unpins and drops the pool mapping
        send(_TAG.pack(_BYE))
        results.close()
        jobs.close()
    # Release the parent's buffers now (CUDA IPC: the producer's reference counts drop), then skip
    # the interpreter's teardown, which costs ~0.5 s of torch finalisation and does nothing we need.
    del eng
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
