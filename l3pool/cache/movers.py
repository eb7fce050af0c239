"""The cache's movers: what moves bytes between the tiers (and owns the threads doing it), behind
small protocols; the cache (controller.py) keeps the books and hands them plans.

- `Loads`: L2 <-> L1 jobs (l2core's TransferEngine, or its TP-shared twin); the load thread.
- `BackupSink`: L1 -> L2 backups (`BackupPlan`: hashes, L1 pages, the L2 pages booked for them):
  `Backups` copies on the backup thread and the cache books the L2 copies when a copy completes;
  `InlineBackups` copies and books them before the call that planned them returns.
- `L3In`: L3 lookups and L3 -> L2 prefetches (`Fetch`, over pool.prefetch.Prefetcher).
- `L3Out`: L2 -> L3 writes, queued (`Writes`, over the coalescing L3Writer) or at once (write-back
  on eviction); their outcomes go back to the cache's books (`Hooks.written`).
`plain_movers()` makes these for one cache; `l3pool.cache.shared.TPShared` the TP-shared ones;
`l3pool.cache.build()` picks. A mover talks back to the cache only through `Hooks` (below), and
only the cache changes its books. A new mover is one class with these methods, passed in a
`Movers` from a factory (`MoverFactory`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from l2core.spec import ConfigError
from l2core.transfer import TransferEngine
from l3pool.cache.config import CacheConfig
from l3pool.cache.policy import prefetch_policy
from l3pool.cache.types import L1, CacheError
from l3pool.cache.writer import L3Writer
from l3pool.pool.prefetch import Prefetcher, PrefetchHandle, PrefetchResult
from l3pool.pool.protocols import HostPages, L3Pages, Outcome

log = logging.getLogger(__name__)
PutOutcome = tuple[list[Outcome] | None, BaseException | None, float]  # (outcomes, error, seconds)


@dataclass(slots=True)
class BackupPlan:
    """L1 pages `l1` (hashes `hashes`) to copy into the L2 pages `l2` booked for them."""

    hashes: list[bytes]
    l1: np.ndarray
    l2: np.ndarray
    reason: str
    hits: np.ndarray  # their L1 hit counts (carried into L2)
    held: bool = False  # the cache pinned the L1 pages and marked the hashes pending (Hooks.hold)


class Hooks(Protocol):
    """What a mover may ask of the cache (its books change only through these)."""

    mu: threading.Condition  # the cache's lock

    def slots(self, l1_pages: np.ndarray) -> torch.Tensor: ...

    def alloc_prefetch(self, n: int) -> np.ndarray: ...

    def free_l2(self, pages: np.ndarray) -> None: ...

    def hold(self, plan: BackupPlan) -> None: ...

    def backup_done(self, plan: BackupPlan, ok: bool, err: str | None) -> None: ...

    def written(self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None,
                unpin: bool) -> None: ...  # fmt: skip

    def error(self, what: str) -> None: ...


class Loads(Protocol):
    def submit_load(self, slots: torch.Tensor, src: np.ndarray) -> int: ...

    def submit_backup(self, slots: torch.Tensor, dst: np.ndarray) -> int: ...

    def wait(self, jobs: list[int], timeout: float | None = None) -> list[Any]: ...

    def wait_layer(self, job: int, layer: int, timeout: float | None) -> None: ...

    def close(self) -> None: ...


class BackupSink(Protocol):
    copies: bool  # this process copies the bytes it books (its D2H bytes are counted)

    def submit(self, plan: BackupPlan) -> None: ...

    def busy(self) -> bool: ...

    def wait_idle(self, timeout: float | None) -> bool: ...

    def before_reuse(self) -> None: ...

    def close(self) -> None: ...


class L3In(Protocol):
    def lookup(self, rid: str, keys: list[str]) -> tuple[int, bool]:
        """Pages of `keys` present in L3 (a prefix), and whether the lookup failed (then a miss)."""
        ...

    def start(self, rid: str, keys: list[str], wait_all: bool) -> PrefetchHandle: ...

    def finish(self, h: PrefetchHandle, wait_all: bool) -> PrefetchResult:
        """The prefetch's result at load(); a CacheError is a failure of the cache (raised), any
        other error a failed read (a miss)."""
        ...

    def forget(self, rid: str) -> None: ...

    def close(self) -> None: ...


class L3Out(Protocol):
    pins: bool  # the cache pins the pages it queues until their put returned

    @property
    def puts(self) -> int:
        """Put calls made for queued pages (batches)."""
        ...

    def submit(self, hs: list[bytes], pages: np.ndarray) -> None: ...

    def put_now(self, keys: list[str], pages: np.ndarray) -> PutOutcome | None: ...

    def settle(self) -> None: ...

    def pending(self) -> int: ...

    def flush(self, timeout: float | None) -> bool: ...

    def close(self) -> None: ...


class Backups:
    """L1 -> L2 copies on the backup thread: the cache holds the L1 pages (pins) until the copy
    completed, then books the L2 copies (`Hooks.backup_done`)."""

    copies = True

    def __init__(self, engine: Loads, hooks: Hooks) -> None:
        self.engine, self.hooks = engine, hooks
        self._q: queue.Queue[tuple[int, BackupPlan] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._inflight = 0
        self._thread = threading.Thread(target=self._run, name="l3pool-cache-backup", daemon=True)
        self._thread.start()

    def submit(self, plan: BackupPlan) -> None:
        self.hooks.hold(plan)
        try:
            job = self.engine.submit_backup(self.hooks.slots(plan.l1), plan.l2)
        except BaseException:
            self.hooks.backup_done(plan, False, None)
            raise
        self._track(job, plan)

    def _track(self, job: int, plan: BackupPlan) -> None:
        with self._idle:
            self._inflight += 1
        self._q.put((job, plan))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            job, plan = item
            try:
                res = self.engine.wait([job])[0]
                ok, err = res.ok, res.error
            except Exception as e:
                ok, err = False, f"{type(e).__name__}: {e}"
            try:
                self._done(plan, ok, err)
            except Exception as e:
                log.exception("backup completion failed")
                self.hooks.error(f"backup completion failed: {e}")
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _done(self, plan: BackupPlan, ok: bool, err: str | None) -> None:
        self.hooks.backup_done(plan, ok, err)

    def busy(self) -> bool:
        return self._inflight > 0

    def wait_idle(self, timeout: float | None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def before_reuse(self) -> None:
        """Evicted L1 pages are about to be reused (their copies held pins: nothing to wait for)."""

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class InlineBackups:
    """L1 -> L2 copies on the caller's thread, booked before the call that planned them (commit(),
    match()) returns: no backup thread, no L1 pins across calls. The books after each call then
    depend on the calls alone (a trace replay needs no flush() between requests, as bench.eviction's
    does), and the L2 copy exists when commit() returns. The caller pays the copy, under the cache's
    lock (as write_back's copies on eviction do). `TieredCache(..., movers=partial(plain_movers,
    sink=InlineBackups))`."""

    copies = True

    def __init__(self, engine: Loads, hooks: Hooks) -> None:
        self.engine, self.hooks = engine, hooks

    def submit(self, plan: BackupPlan) -> None:
        try:
            res = self.engine.wait([self.engine.submit_backup(self.hooks.slots(plan.l1), plan.l2)])[0]
        except BaseException:
            self.hooks.backup_done(plan, False, None)  # its L2 pages freed
            raise
        self.hooks.backup_done(plan, res.ok, res.error)  # a failed copy: a background error

    def busy(self) -> bool:
        return False

    def wait_idle(self, timeout: float | None) -> bool:
        return True

    def before_reuse(self) -> None:
        """Nothing is in flight."""

    def close(self) -> None:
        pass


class Fetch:
    """L3 lookups through the client; prefetches on the Prefetcher's thread into L2 pages it asks
    the cache for, ended at load() by the prefetch policy."""

    def __init__(self, cfg: CacheConfig, l3: L3Pages, hooks: Hooks) -> None:
        self.l3 = l3
        self.policy = prefetch_policy(cfg.prefetch_policy, cfg.prefetch_timeout_s)
        self.prefetcher = Prefetcher(
            l3, batch_pages=cfg.prefetch_batch_pages, max_batch_pages=cfg.prefetch_max_batch_pages,
            alloc=hooks.alloc_prefetch,
        )  # fmt: skip

    def lookup(self, rid: str, keys: list[str]) -> tuple[int, bool]:
        try:
            return self.l3.lookup(keys), False
        except Exception as e:
            log.warning("L3 lookup for %s failed (treated as a miss): %s", rid, e)
            return 0, True

    def start(self, rid: str, keys: list[str], wait_all: bool) -> PrefetchHandle:
        return self.prefetcher.submit(rid, keys)

    def finish(self, h: PrefetchHandle, wait_all: bool) -> PrefetchResult:
        """`wait_all`: load() started it, or PP (every stage needs the locked length): waited for
        whole, a hung master included (its batch ends with Mooncake's RPC timeout)."""
        return h.wait() if wait_all else self.policy.finish(h)

    def forget(self, rid: str) -> None:
        pass

    def close(self) -> None:
        self.prefetcher.close()


class Writes:
    """L2 -> L3 puts: queued ones on the coalescing writer thread (the cache pins their pages),
    write-backs at once; every outcome goes back to the cache's books under its lock."""

    pins = True

    def __init__(self, cfg: CacheConfig, l3: L3Pages, hooks: Hooks, more_coming: Callable[[], bool],
                 client: L3Pages | None = None) -> None:  # fmt: skip
        self.l3, self.hooks = l3, hooks
        self.writer = self._writer(client or l3, cfg, more_coming)

    def _writer(self, client: L3Pages, cfg: CacheConfig, more_coming: Callable[[], bool]) -> L3Writer:
        return L3Writer(client, self._done, cfg.writer_batch_pages, cfg.writer_linger_ms, more_coming,
                        parallel=cfg.writer_parallel)  # fmt: skip

    def _done(
        self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None, s: float
    ) -> None:
        with self.hooks.mu:
            self.hooks.written(hs, pages, res, err, self.pins)

    def submit(self, hs: list[bytes], pages: np.ndarray) -> None:
        self.writer.submit(hs, pages)

    def put_now(self, keys: list[str], pages: np.ndarray) -> PutOutcome | None:
        t0 = time.perf_counter()
        try:
            return self.l3.put(keys, pages), None, time.perf_counter() - t0
        except Exception as e:
            return None, e, time.perf_counter() - t0

    def settle(self) -> None:
        """Outcomes not booked yet are booked now (these are booked as they come)."""

    def pending(self) -> int:
        return self.writer.pending()

    @property
    def puts(self) -> int:
        return self.writer.puts

    def flush(self, timeout: float | None) -> bool:
        return self.writer.flush(timeout)

    def close(self) -> None:
        self.writer.close()


@dataclass
class Movers:
    """One cache's movers (what a `MoverFactory` makes)."""

    engine: Any  # Loads: a TransferEngine (or l2core.shm's SharedTransferEngine)
    backups: BackupSink
    l3_in: L3In | None = None
    l3_out: L3Out | None = None

    def stats(self) -> dict[str, Any]:
        """What stats() adds for these movers."""
        return {}

    def tp_digest(self, books: tuple[Any, ...]) -> int:
        raise CacheError("tp_digest() / tp_check() are for a TP-shared cache (CacheConfig.tp_shared)")

    def tp_check(self, step: int, digest: Callable[[], int], timeout: float, error: Callable[[str], None]) -> list[int]:
        raise CacheError("tp_digest() / tp_check() are for a TP-shared cache (CacheConfig.tp_shared)")

    def close(self) -> None:
        """Stop the threads (the backups first: the writer may wait for them), then the engine."""
        try:
            self.backups.close()
            if self.l3_out is not None:
                self.l3_out.close()
            if self.l3_in is not None:
                self.l3_in.close()
        finally:
            self.engine.close()


MoverFactory = Callable[[CacheConfig, L1, HostPages, "L3Pages | None", Hooks], Movers]


def engine_over(l2: HostPages, l1: L1, make: Callable[..., Any] = TransferEngine, **kw: Any) -> Any:
    """The L2 <-> L1 engine (ConfigError when the buffers do not match the pool's KV spec)."""
    try:
        return make(l2, l1.bufs, **kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"L1 buffers do not match the L2 pool's KV spec: {e}") from None


def plain_movers(cfg: CacheConfig, l1: L1, l2: HostPages, l3: L3Pages | None, hooks: Hooks, *,
                 sink: Callable[[Any, Hooks], BackupSink] = Backups,
                 make: Callable[..., Any] = TransferEngine) -> Movers:  # fmt: skip
    """The movers of one engine's own cache: its engine (`make`: TransferEngine, or l2core's
    ProcessTransferEngine for CacheConfig.copy_process), backup sink (`sink`: the backup thread,
    or `InlineBackups`), prefetcher and writer."""
    if cfg.tp_shared:
        raise ConfigError("tp_shared = true: the cache needs the TP-shared movers (l3pool.cache.build() picks them)")
    engine = engine_over(l2, l1, make)
    m = Movers(engine, sink(engine, hooks))
    try:
        if l3 is not None:
            m.l3_in = Fetch(cfg, l3, hooks)
            m.l3_out = Writes(cfg, l3, hooks, m.backups.busy)
    except BaseException:
        m.close()
        raise
    return m
