"""L1 <-> L2 transfer engine: a backup (device -> host) thread and a load (host -> device) thread.

Lifecycle:
    eng = TransferEngine(pool, bufs)          # bufs: per-layer device buffers (see ops.py)
    jid = eng.submit_backup(slots, pages)     # D2H of all layers; ordered after the caller's
                                              # current stream at submit time
    jid = eng.submit_load(slots, pages)       # H2D, layer by layer
    eng.wait_layer(jid, i)                    # forward pass: layer i may be read now
    eng.wait([jid]) / eng.pop_finished()      # JobResult per job (ok, error, bytes, seconds)
    eng.close()                               # drains queued jobs, stops the threads

With `split=SplitRead(group)` (MLA, TP ranks; l2core.split_read) a load copies only this rank's
byte slice of every page and an all-gather per layer completes it; `wait_layer` waits for both.

Each thread owns a stream of the device's provider (`l2core.devices`; CUDA: a CUDA stream; on
CPU the copies are synchronous in the thread). A job that
fails (bad slots, CUDA error, ...) completes with ok=False and its error text, the failure is
counted, layer waiters get a TransferError, and the thread goes on with the next job.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from . import ops
from .devices import provider_for
from .layout import HostKV
from .split_read import SplitRead

log = logging.getLogger(__name__)

# Loads get the highest stream priority (CUDA clamps -100 to its greatest): the forward pass waits
# on them layer by layer, so their short scatter kernels must not queue behind its blocks
# (bench.cache on an H200: exposed load 0.12 -> 0.09 of the load with staged per-layer copies).
# Backups run at the default priority (0), the compute's own.
LOAD_PRIORITY = -100

JobKind = Literal["backup", "load"]


class TransferError(RuntimeError):
    """A transfer job failed; the message carries the job's error."""


@dataclass(frozen=True)
class JobResult:
    job_id: int
    kind: JobKind
    ok: bool
    num_pages: int
    nbytes: int
    seconds: float
    error: str | None = None


@dataclass
class _Job:
    job_id: int
    kind: JobKind
    slots: torch.Tensor
    pages: torch.Tensor
    after: Any  # the provider's event recorded on the submitter's stream, or None
    layers_done: int = 0  # layers whose copy is enqueued (CUDA) / done (CPU)
    layer_events: list[Any] = field(default_factory=list)
    error: str | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class EngineStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    bytes_backed_up: int = 0
    bytes_loaded: int = 0


class JobBook:
    """The job book of an L1 <-> L2 engine (TransferEngine, l2core.copyproc's ProcessTransferEngine):
    jobs in flight in `_jobs`, results in `_finished`, both under `_lock`; the submits, result waits
    and layer waits both engines answer alike, over their own `_submit` and `_order_after_layer`."""

    _jobs: dict[int, Any]  # each with layers_done, error and cond (the child's reports, or this process's)
    _finished: dict[int, JobResult]
    _lock: threading.Condition
    pool: HostKV

    def poll(self, job_id: int) -> JobResult | None:
        """The job's result if it has finished (not removed), else None."""
        with self._lock:
            if job_id not in self._finished and job_id not in self._jobs:
                raise KeyError(f"unknown or already popped job {job_id}")
            return self._finished.get(job_id)

    def pop_finished(self) -> list[JobResult]:
        """All finished results, oldest first; they are removed."""
        with self._lock:
            out = [self._finished[k] for k in sorted(self._finished)]
            self._finished.clear()
            return out

    def wait(self, ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in `ids` finished; return (and remove) their results in order."""
        ids = list(ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for i in ids:
                if i not in self._jobs and i not in self._finished:
                    raise KeyError(f"unknown or already popped job {i}")
            while not all(i in self._finished for i in ids):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"jobs {[i for i in ids if i not in self._finished]} not done in {timeout} s")
                self._lock.wait(left)
            return [self._finished.pop(i) for i in ids]

    def submit_backup(self, slots: torch.Tensor | Sequence[int], pages: np.ndarray | Sequence[int]) -> int:
        """Copy all layers of `slots` into host `pages` (device -> host), ordered after the caller's
        current stream at submit time."""
        return self._submit("backup", slots, pages)

    def submit_load(self, slots: torch.Tensor | Sequence[int], pages: np.ndarray | Sequence[int]) -> int:
        """Copy host `pages` into `slots`, layer by layer (host -> device)."""
        return self._submit("load", slots, pages)

    def _submit(self, kind: JobKind, slots: Any, pages: Any) -> int:
        raise NotImplementedError

    def wait_layer(self, job_id: int, layer: int, timeout: float | None = None) -> None:
        """Block until layer `layer` of load job `job_id` may be read by the caller's stream."""
        if not 0 <= layer < self.pool.spec.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.pool.spec.num_layers})")
        with self._lock:
            job = self._jobs.get(job_id)
            done = self._finished.get(job_id)
        if job is None:
            if done is None:
                raise KeyError(f"unknown or already popped job {job_id}")
            if not done.ok:
                raise TransferError(f"load job {job_id} failed: {done.error}")
            return  # finished: every layer is on the device and its copy stream synchronized
        with job.cond:
            ok = job.cond.wait_for(lambda: job.layers_done > layer or job.error is not None, timeout)
            if not ok:
                raise TimeoutError(f"layer {layer} of job {job_id} not loaded within {timeout} s")
            if job.layers_done <= layer:
                raise TransferError(f"load job {job_id} failed: {job.error}")
        self._order_after_layer(job, layer)

    def _order_after_layer(self, job: Any, layer: int) -> None:
        """Make the caller's current stream wait for the copy of `layer` (enqueued, not yet done)."""
        raise NotImplementedError


def in_process_dma_warning(method: str, device_type: str) -> str | None:
    """The warning a copy method made of host-planned DMAs earns on a GPU in the forward pass's own
    process (None where it earns none)."""
    if method not in ops.DMA_ONLY_METHODS or device_type != "cuda":
        return None
    return (
        f"TransferEngine(method={method!r}) on a GPU submits its copies from the forward pass's own process: "
        "measured there it slowed concurrent compute by +541 % (H100, 2026-12-07, slots then on the device; "
        "not re-measured since); it is meant for the copy process (l2core.copyproc.ProcessTransferEngine)"
    )


class TransferEngine(JobBook):
    # False where the engine is the copy process's own (the place the DMA-only methods are meant for)
    warn_in_process_dma = True

    def __init__(
        self,
        pool: HostKV,
        bufs: Sequence[torch.Tensor],
        *,
        method: ops.Method = "auto",
        max_sms: int = ops.DEFAULT_MAX_SMS,
        layers_per_step: int = 1,
        split: SplitRead | None = None,
        load_priority: int = LOAD_PRIORITY,
    ) -> None:
        spec = pool.spec
        if len(bufs) != spec.num_layers * spec.num_kv:
            raise ValueError(f"expected {spec.num_layers * spec.num_kv} device buffers, got {len(bufs)}")
        if layers_per_step < 1:
            raise ValueError("layers_per_step must be >= 1")
        if isinstance(load_priority, bool) or not isinstance(load_priority, int):
            raise TypeError(f"load_priority must be an int, got {type(load_priority).__name__}")
        ops._check_buffers(bufs, pool.layout, (0, spec.num_layers))  # once, up front
        self.pool, self.bufs = pool, list(bufs)
        self.device = self.bufs[0].device
        self.provider = provider_for(self.device)  # copies, streams, events of this device type
        if split is not None:
            split.bind(pool.layout, self.device, self.provider)  # MLA only (ConfigError otherwise)
        self.split = split  # MLA split reads across TP ranks (l2core.split_read), or None
        self.method, self.max_sms, self.layers_per_step = method, max_sms, layers_per_step
        self.load_priority = load_priority
        if self.warn_in_process_dma and (why := in_process_dma_warning(method, self.device.type)):
            log.warning(why)
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._finished: dict[int, JobResult] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._queues: dict[JobKind, queue.Queue[_Job | None]] = {"backup": queue.Queue(), "load": queue.Queue()}
        self._threads = [
            threading.Thread(target=self._run, args=(kind,), name=f"l2core-{kind}", daemon=True)
            for kind in ("backup", "load")
        ]
        for t in self._threads:
            t.start()

    # -- submission --------------------------------------------------------------------------
    def _submit(self, kind: JobKind, slots: Any, pages: Any) -> int:
        if self._closed:
            raise RuntimeError("TransferEngine is closed")
        s = ops._as_index(slots, "slots")
        p = ops._as_index(torch.as_tensor(np.asarray(pages, dtype=np.int64)), "pages")
        if self.method in ops.DMA_ONLY_METHODS and s.device.type == "cpu":
            s = s.clone()  # read on the host by the copy itself: kept there, the caller's tensor not
        else:
            s = self.provider.to_device(s, self.device)
        after = self.provider.record(None, self.device)  # ordered after the submitter's stream
        job = _Job(next(self._ids), kind, s, p, after)
        with self._lock:
            self._jobs[job.job_id] = job
            self.stats.submitted += 1
        self._queues[kind].put(job)
        return job.job_id

    # -- the two worker threads ----------------------------------------------------------------
    def _run(self, kind: JobKind) -> None:
        stream = self.provider.new_stream(self.device, self.load_priority if kind == "load" else 0)
        flag = self.provider.error_flag()  # set by asynchronous kernels on a bad slot
        q = self._queues[kind]
        while True:
            job = q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._execute(job, stream, flag)
            except Exception as e:
                job.error = f"{type(e).__name__}: {e}"
                log.warning("l2core %s job %d failed: %s", kind, job.job_id, job.error)
            self._finish(job, time.perf_counter() - t0)

    def _execute(self, job: _Job, stream: Any, flag: torch.Tensor | None) -> None:
        spec = self.pool.spec
        # No per-call device sync for the slot check: kernels flag bad slots, checked at job end.
        kw: dict[str, Any] = {
            "method": self.method,
            "max_sms": self.max_sms,
            "validated": True,
            "check_slots": flag is None,
            "error_flag": flag,
        }
        prov = self.provider
        with prov.stream_context(stream):
            if job.after is not None:
                prov.wait(stream, self.device, job.after)
            if job.kind == "backup":
                ops.transfer(self.bufs, job.slots, self.pool.buffer, job.pages, self.pool.layout, to_host=True, **kw)
                self._sync(stream, flag)
                return
            if self.split is not None and self.split.active(int(job.pages.numel())):
                slots = prov.to_device(job.slots, self.device)  # its scatter indexes the device buffers
                self.split.load(
                    self.bufs, slots, self.pool.buffer, job.pages, provider=prov, stream=stream,
                    publish=lambda i, ev: self._publish(job, i, i + 1, ev), method=self.method, max_sms=self.max_sms,
                )  # fmt: skip
                self._sync(stream, flag)
                return
            for lb in range(0, spec.num_layers, self.layers_per_step):
                le = min(spec.num_layers, lb + self.layers_per_step)
                ops.transfer(
                    self.bufs,
                    job.slots,
                    self.pool.buffer,
                    job.pages,
                    self.pool.layout,
                    to_host=False,
                    layers=(lb, le),
                    **kw,
                )
                self._publish(job, lb, le, self._layer_event(job, stream, lb))
            self._sync(stream, flag)

    def _layer_event(self, job: _Job, stream: Any, lb: int) -> Any:
        """The event that marks the step of `job` starting at layer `lb` done on `stream` (None on a
        synchronous device); l2core.copyproc's child records a preallocated interprocess one."""
        return self.provider.record(stream, self.device) if stream is not None else None

    def _publish(self, job: _Job, lb: int, le: int, ev: Any) -> None:
        """Layers [lb, le) of a load may be read once `ev` completed (None: now)."""
        with job.cond:
            job.layer_events.extend([ev] * (le - lb))
            job.layers_done = le
            job.cond.notify_all()

    def _sync(self, stream: Any, flag: torch.Tensor | None) -> None:
        if stream is None or flag is None:
            return
        self.provider.synchronize(stream)
        if int(flag[0]) != 0:
            flag.zero_()
            raise IndexError("device slot out of range: the kernel skipped those tokens")

    def _finish(self, job: _Job, seconds: float) -> None:
        nbytes = 0 if job.error else job.slots.numel() * self.pool.spec.token_bytes
        res = JobResult(job.job_id, job.kind, job.error is None, job.pages.numel(), nbytes, seconds, job.error)
        with job.cond:
            job.layers_done = self.pool.spec.num_layers if job.error is None else job.layers_done
            job.cond.notify_all()
        with self._lock:
            self._finished[job.job_id] = res
            self._jobs.pop(job.job_id, None)
            self.stats.completed += 1
            if job.error:
                self.stats.failed += 1
            elif job.kind == "backup":
                self.stats.bytes_backed_up += nbytes
            else:
                self.stats.bytes_loaded += nbytes
            self._lock.notify_all()
        with job.cond:
            job.cond.notify_all()

    # -- completion --------------------------------------------------------------------------
    def _order_after_layer(self, job: _Job, layer: int) -> None:
        with job.cond:
            ev = job.layer_events[layer] if layer < len(job.layer_events) else None
        if ev is not None:
            self.provider.wait(None, self.device, ev)

    def close(self) -> None:
        """Finish the queued jobs, then stop both threads."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
