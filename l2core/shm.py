"""TP-shared L2: one host copy of the (bit-identical) MLA latent KV per TP group.

    group = TPGroup("inst-7", rank=r, size=8)                # every rank: same name and size
    pool = HostKVPool(L2Config(kv=KVSpec.mla(61), tokens=1 << 20, shared=group))
    eng = SharedTransferEngine(pool, bufs)                   # rank 0 copies D2H; all ranks load
    jid = eng.submit_backup(slots, pages)                    # every rank, same pages, same order
    jid = eng.submit_load(slots, pages)                      # waits until rank 0's copy completed

**The SPMD invariant.** Every rank runs its own allocator and index over the one shared pool
and must make identical decisions: the same calls with the same arguments in the same order
give the same page ids on every rank. Nothing here synchronises the ranks' bookkeeping; it only
holds when the engine drives all ranks alike (TP ranks run the same scheduler step) and when no
decision depends on timing (the cache's tp_shared mode indexes a backup when it is submitted,
not when it completes). `state_digest()` + `SharedHostMemory.check_step()` compare the ranks'
state per step and raise `Divergence` when it broke.

**Readiness.** Only rank 0 writes page bytes. `submit_backup` gives each target page its next
generation on every rank (the same number everywhere, by the invariant); rank 0 sets the page's
shared generation to 0 before the copy and to the new one after it completed. `submit_load`
waits (bounded) until every source page shows the generation this rank expects, and the job
fails (ok=False) if any of them changed while it copied: a torn page is never served, also when
rank 0 died mid-copy (its pages stay at 0; the load times out and fails).

**Ordering.** The generation words are plain stores and loads in the shared mapping; native
fences (`l2core.ops.fence_release` / `fence_acquire`, std::atomic_thread_fence) order them against
the page bytes, as a seqlock does: rank 0 fences after `invalidate` (0 is seen before any new
byte) and before `publish` (every byte before the new generation); a reader fences after seeing
the expected generations (before its copy reads a byte) and after its copy (before it reads the
generations again). x86-64 keeps these orders anyway (TSO; the fences compile to nothing there);
aarch64 needs them (`dmb`). The copy threads' and the CUDA event's completion reach the fencing
thread through their own synchronisation (join, event wait) first.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .memory import HostMemory, PinMode, _mbind, mbind_interleave
from .ops import fence_acquire, fence_release
from .shm_segment import Divergence, Segment, SegmentError, ShmTooSmall, TPGroup
from .spec import ConfigError, parse_size
from .transfer import JobResult, TransferEngine, TransferError

log = logging.getLogger(__name__)

__all__ = [
    "Divergence", "SegmentError", "SharedHostMemory", "SharedTransferEngine", "ShmTooSmall", "TPGroup",
    "state_digest",
]  # fmt: skip


def _cpu_node() -> int:
    """The NUMA node of the CPU this thread runs on (0 when unknown)."""
    cpu = os.sched_getaffinity(0)
    first = min(cpu) if cpu else 0
    for p in Path(f"/sys/devices/system/cpu/cpu{first}").glob("node*"):
        return int(p.name[4:])
    return 0


class SharedHostMemory(HostMemory):
    """Host memory in a `/dev/shm` file mapped MAP_SHARED by every rank of a TP group.

    Rank 0 creates the segment (l2core.shm_segment: O_EXCL, free-space check, janitor), advises
    huge pages, sets the NUMA placement (`interleave` over every online node, `socket`: bound to
    one node), faults the pages in and marks the segment ready; the other ranks wait for that
    (up to `group.open_timeout_s`) and map the same file. Every rank pins its own mapping (the
    accelerator's registration is per process). `num_pages`: the pool's pages (one generation
    word each). Huge pages on tmpfs need `shmem_enabled` = advise (or within_size/always) in
    /sys/kernel/mm/transparent_hugepage; with `never` the advice is a no-op.
    """

    _align = False  # every rank sees the data at the same file offset
    _HUGE_FIELD = "ShmemPmdMapped"

    def __init__(
        self, size: int | str, group: TPGroup, num_pages: int, *, pin: PinMode = "auto", hugepages: bool = True,
        janitor: bool = True,
    ) -> None:  # fmt: skip
        if not isinstance(group, TPGroup):
            raise ConfigError(f"group must be an l2core.shm.TPGroup, got {type(group).__name__}")
        nbytes = parse_size(size, "host memory size")
        self.group = group
        self.placement_nodes: list[int] = []
        node = (
            group.numa_node if group.numa_node is not None else (_cpu_node() if group.placement == "socket" else None)
        )
        if group.rank == 0:
            self.segment = Segment.create(
                group.name, group.size, nbytes, num_pages, directory=group.directory, placement=group.placement,
                janitor=janitor,
            )  # fmt: skip
        else:
            self.segment = Segment.open(
                group.name, group.rank, group.size, nbytes, num_pages, directory=group.directory,
                timeout=group.open_timeout_s,
            )  # fmt: skip
        try:
            super().__init__(nbytes, numa_node=node, pin=pin, hugepages=hugepages)
        except BaseException:
            self.segment.close()
            raise
        if group.rank == 0:
            self.segment.mark_ready()

    @property
    def creator(self) -> bool:
        return self.group.rank == 0

    def _map(self, length: int) -> tuple[mmap.mmap, int]:
        return self.segment.mm, self.segment.data_off

    def _place(self) -> None:
        if not self.creator:
            return  # the file's policy was set by rank 0, and its pages are in already
        if self.group.placement == "interleave":
            # one online node (this machine, most VMs): nothing to interleave, a no-op
            self.placement_nodes = mbind_interleave(self.ptr, self.nbytes)
        elif self.numa_node is not None:
            _mbind(self.ptr, self.nbytes, self.numa_node)
            self.placement_nodes = [self.numa_node]

    def _first_touch(self) -> None:
        if self.creator:
            self.tensor.zero_()  # the other ranks must not touch: rank 0 may be writing already

    # -- readiness / digests (the segment's, exposed here) ------------------------------------------
    def ready(self, pages: np.ndarray, gens: np.ndarray) -> np.ndarray:
        return self.segment.ready(pages, gens)

    def check_step(self, step: int, digest: int, timeout: float = 0.0) -> list[int]:
        """Publish this rank's digest for `step` and compare (Segment.check_digest)."""
        return self.segment.check_digest(step, digest, timeout)

    def close(self) -> None:
        if self._mm is None:
            return
        super().close()
        self.segment.close()


def state_digest(*parts: Any) -> int:
    """A 64-bit digest of numpy arrays / bytes (a rank's allocator + index state)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, np.ndarray):
            h.update(str(p.dtype).encode() + str(p.shape).encode())
            h.update(np.ascontiguousarray(p).tobytes())
        else:
            h.update(bytes(p))
    return int.from_bytes(h.digest(), "little")


class SharedTransferEngine:
    """A TransferEngine over a TP-shared pool (same interface): rank 0 copies D2H and publishes
    each page's generation after its bytes; the other ranks' backups are no-ops that complete at
    once (their engines still get a completion per job); loads on every rank wait for the pages'
    readiness (up to `ready_timeout_s`) and fail if a page changed under the copy."""

    def __init__(self, pool: Any, bufs: Sequence[torch.Tensor], *, ready_timeout_s: float = 30.0, **kw: Any) -> None:
        mem = pool.memory
        if not isinstance(mem, SharedHostMemory):
            raise ConfigError("SharedTransferEngine needs a pool over SharedHostMemory (L2Config(shared=TPGroup(...)))")
        self.inner = TransferEngine(pool, bufs, **kw)
        self.pool, self.mem, self.seg = pool, mem, mem.segment
        self.writer = mem.group.rank == 0
        self.ready_timeout_s = ready_timeout_s
        self.want = np.zeros(pool.num_pages, dtype=np.uint64)  # this rank's generation per page
        self._mine: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}  # real job -> (kind, pages, gens)
        self._fake: dict[int, JobResult] = {}  # jobs answered here (non-writer backups, unready loads)
        self._ids = itertools.count(-1, -1)
        self._lock = threading.Lock()
        self.submissions = 0  # D2H jobs this rank submitted to its device
        self.d2h_bytes = 0
        self.skipped_backups = 0  # backups answered without a copy (ranks > 0)

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fake_job(self, kind: str, pages: np.ndarray, ok: bool, error: str | None = None) -> int:
        jid = next(self._ids)
        with self._lock:
            self._fake[jid] = JobResult(jid, kind, ok, int(pages.size), 0, 0.0, error)  # type: ignore[arg-type]
        return jid

    def submit_backup(self, slots: Any, pages: np.ndarray | Sequence[int]) -> int:
        p = np.asarray(pages, dtype=np.int64).reshape(-1)
        self.want[p] += 1  # every rank: the bookkeeping is identical (the SPMD invariant)
        if not self.writer:
            self.skipped_backups += 1
            return self._fake_job("backup", p, True)
        self.seg.invalidate(p)  # before any new byte lands: readers of the old bytes fail their check
        fence_release()  # ... and seen before any of them, on every CPU
        jid = self.inner.submit_backup(slots, p)
        with self._lock:
            self._mine[jid] = ("backup", p, self.want[p].copy())
        self.submissions += 1
        self.d2h_bytes += int(p.size) * self.pool.layout.page_bytes
        return jid

    def wait_ready(self, pages: np.ndarray, timeout: float | None = None) -> bool:
        """Block until every page shows this rank's generation (rank 0's copy completed)."""
        gens = self.want[pages]
        if (gens == 0).any():
            return False  # never backed up on this rank: nothing valid to wait for
        deadline = time.monotonic() + (self.ready_timeout_s if timeout is None else timeout)
        pause = 1e-5
        while not self.seg.ready(pages, gens).all():
            if self.writer and self._publish_done():
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        fence_acquire()  # the generations read before any byte of the pages (pairs with publish's)
        return True

    def _publish_done(self) -> bool:
        """Rank 0: publish the generations of every finished backup not yet collected, without
        collecting it (its waiter, e.g. the cache's backup thread, may itself wait for a lock the
        caller of wait_ready holds). True if anything new was published."""
        with self._lock:
            jobs = [(j, p, g) for j, (k, p, g) in self._mine.items() if k == "backup"]
        new = False
        for j, pages, gens in jobs:
            try:
                res = self.inner.poll(j)
            except KeyError:
                continue  # collected meanwhile: _settle published it
            if res is None or not res.ok:
                continue
            cur = self.want[pages] == gens
            fresh = cur & ~self.seg.ready(pages, gens)
            if fresh.any():
                fence_release()  # the copy's bytes before the generations that make them loadable
                self.seg.publish(pages[fresh], gens[fresh])
                new = True
        return new

    def submit_load(self, slots: Any, pages: np.ndarray | Sequence[int]) -> int:
        p = np.asarray(pages, dtype=np.int64).reshape(-1)
        if not self.wait_ready(p):
            bad = p[~self.seg.ready(p, self.want[p])][:8].tolist()
            return self._fake_job("load", p, False, f"L2 pages {bad} not ready (rank 0's backup did not complete)")
        jid = self.inner.submit_load(slots, p)
        with self._lock:
            self._mine[jid] = ("load", p, self.want[p].copy())
        return jid

    def _settle(self, res: JobResult) -> JobResult:
        with self._lock:
            meta = self._mine.pop(res.job_id, None)
        if meta is None:
            return res
        kind, pages, gens = meta
        if kind == "backup":
            if res.ok:
                cur = self.want[pages] == gens  # a page reallocated since keeps its 0 (a newer copy is queued)
                fence_release()  # the copy's bytes before the generations that make them loadable
                self.seg.publish(pages[cur], gens[cur])
            return res
        fence_acquire()  # the load's reads of the bytes before the generations are read again
        if res.ok and not self.seg.ready(pages, gens).all():
            bad = pages[~self.seg.ready(pages, gens)][:8].tolist()
            return JobResult(res.job_id, res.kind, False, res.num_pages, 0, res.seconds,
                             f"L2 pages {bad} were rewritten by rank 0 during the load (torn: not served)")  # fmt: skip
        return res

    def wait(self, ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        ids = list(ids)
        with self._lock:
            fakes = {i: self._fake.pop(i) for i in ids if i in self._fake}
        real = [i for i in ids if i not in fakes]
        got = dict(zip(real, self.inner.wait(real, timeout), strict=True)) if real else {}
        return [fakes[i] if i in fakes else self._settle(got[i]) for i in ids]

    def poll(self, job_id: int) -> JobResult | None:
        with self._lock:
            if job_id in self._fake:
                return self._fake[job_id]
        return self.inner.poll(job_id)

    def wait_layer(self, job_id: int, layer: int, timeout: float | None = None) -> None:
        with self._lock:
            fake = self._fake.get(job_id)
        if fake is not None:
            if not fake.ok:
                raise TransferError(f"load job {job_id} failed: {fake.error}")
            return
        self.inner.wait_layer(job_id, layer, timeout)

    def backups_in_flight(self) -> int:
        with self._lock:
            return sum(1 for k, _, _ in self._mine.values() if k == "backup")

    def drain_backups(self, timeout: float = 60.0) -> None:
        """Rank 0: block until every backup submitted so far has finished copying (a caller
        about to reuse their source pages); the results stay for whoever waits on them."""
        with self._lock:
            jobs = [j for j, (k, _, _) in self._mine.items() if k == "backup"]
        deadline = time.monotonic() + timeout
        for j in jobs:
            while True:
                try:
                    if self.inner.poll(j) is not None:
                        break
                except KeyError:
                    break  # collected already
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"backup job {j} not finished within {timeout} s")
                time.sleep(1e-4)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> SharedTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
