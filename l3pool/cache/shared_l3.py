"""The L3 tier of a TP-shared cache (`TPShared` movers with an L3Client: `TPFetch`, `TPWrites`): what keeps the ranks'
bookkeeping identical while only rank 0 talks to the pool.

- **Lookups.** Rank 0 alone asks L3 how much of a request's prefix it holds and publishes the
  answer in its group's segment (`Handshake`: one row of `TABLE_SLOTS` per L3 lookup, numbered
  alike on every rank); the other ranks' `match()` waits for it, so every rank's `Match.l3` agrees.
- **Prefetch.** `SharedFetcher.start` runs on the caller's thread at `prefetch()` (or `load()`),
  on every rank alike: the L2 pages are already allocated there (same inputs, same pages) and get
  their next generation (`SharedTransferEngine.begin_external`). Rank 0 alone issues the gets into
  those shared pages, batch by batch (`batch_schedule`), publishing each batch's intact prefix as
  it lands (the page generations). At `load()` rank 0 ends its prefetch by the prefetch policy
  (interrupt: no new batch; the batch in flight is waited for, since its pages are every rank's
  bookkeeping and cannot be quarantined on one rank) and publishes the number of pages that
  arrived; the other ranks wait for that number (bounded by `load_timeout_s`; at once when rank 0
  died) and keep exactly that prefix. Every rank frees the pages after it on the caller's thread.
- **Writes.** Only rank 0 has an L3 writer. It takes no pins (their release would be timing):
  a put waits until rank 0's D2H copy of its pages completed, and rank 0 waits for the puts still
  reading a page before new bytes go into it (`Reading`, through the engine's `before_write`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from l2core.ops import fence_acquire, fence_release
from l2core.shm import SharedTransferEngine
from l2core.shm_segment import TABLE_SLOTS, Segment
from l2core.transfer import TransferError
from l3pool import metrics
from l3pool.cache.config import CacheConfig
from l3pool.cache.movers import Hooks, PutOutcome, Writes
from l3pool.cache.types import CacheError
from l3pool.cache.writer import L3Writer
from l3pool.pool.prefetch import PrefetchResult, batch_schedule
from l3pool.pool.protocols import L3Pages, Outcome

log = logging.getLogger(__name__)
_LIVENESS_S = 0.05  # how often a waiting rank looks whether rank 0 still runs


class Handshake:
    """Rank 0 -> other ranks, per L3 lookup `seq`: row `seq % TABLE_SLOTS` of the segment's table
    holds [seq + 1, looked-up pages + 1, arrived pages + 1] (0: not published yet)."""

    def __init__(self, seg: Segment, rank: int) -> None:
        self.seg, self.rank, self.t = seg, rank, seg.table

    def publish_lookup(self, seq: int, n: int) -> None:
        row = self.t[seq % TABLE_SLOTS]
        row[0] = 0
        row[2] = 0
        row[1] = n + 1
        fence_release()
        row[0] = seq + 1

    def publish_count(self, seq: int, n: int, rid: str) -> None:
        row = self.t[seq % TABLE_SLOTS]
        if int(row[0]) != seq + 1:
            raise CacheError(
                f"TP rank 0: the handshake row of request {rid!r} was reused ({TABLE_SLOTS} L3 lookups since)"
            )
        fence_release()  # the page generations before the count
        row[2] = n + 1

    def wait(self, seq: int, col: int, timeout: float, what: str) -> int:
        """Rank > 0: the value rank 0 published in column `col` for `seq`. CacheError when rank 0
        died, reused the row, or did not publish within `timeout` s."""
        row = self.t[seq % TABLE_SLOTS]
        t0 = time.monotonic()
        check, pause = t0, 1e-5
        while True:
            tag, v = int(row[0]), int(row[col])
            if tag == seq + 1 and v:
                fence_acquire()  # the value before what it announces (page generations, bytes)
                return v - 1
            if tag > seq + 1:
                raise CacheError(
                    f"TP rank {self.rank}: rank 0 reused the handshake row of {what} (ranks too far apart)"
                )
            now = time.monotonic()
            if now >= check:
                if not self.seg.creator_alive():
                    raise CacheError(
                        f"TP rank {self.rank}: rank 0 (pid {self.seg.creator_pid}) died before publishing {what}: "
                        "the TP group must restart"
                    )
                check = now + _LIVENESS_S
            if now - t0 >= timeout:
                raise CacheError(f"TP rank {self.rank}: rank 0 did not publish {what} within {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class SharedFetch:
    """One request's L3 -> L2 prefetch into pages allocated on every rank. The controller's
    `load()` calls `SharedFetcher.finish` first; what the prefetch policy and `release()` then
    call (interrupt / wait / cancel / delivered) is PrefetchHandle's surface."""

    def __init__(
        self, owner: SharedFetcher, rid: str, seq: int, keys: list[str], pages: np.ndarray, gens: np.ndarray,
        wait_all: bool,
    ) -> None:  # fmt: skip
        self.owner, self.request_id, self.seq, self.keys = owner, rid, seq, keys
        self.pages, self.gens = pages, gens
        self.wait_all = wait_all  # started by load(): waited for whole
        self.count = 0  # rank 0: the intact prefix landed (published page by page)
        self.error: str | None = None
        self.stopped_by: str | None = None
        self.stop = threading.Event()
        self.done = threading.Event()
        self.result: PrefetchResult | None = None
        self.delivered = False
        self.t0 = time.perf_counter()

    def interrupt(self, timeout: float | None = None) -> PrefetchResult:
        assert self.result is not None, "SharedFetcher.finish() comes first"
        return self.result

    wait = interrupt

    def cancel(self) -> bool:
        return self.owner.cancel(self)


class SharedFetcher:
    """Starts, ends and cancels the shared prefetches of one rank (module docstring)."""

    def __init__(
        self, l3: L3Pages, engine: SharedTransferEngine, hand: Handshake, free: Any, *, rank: int, batch_pages: int,
        max_batch_pages: int, max_inflight: int, timeout_s: float,
    ) -> None:  # fmt: skip
        self.l3, self.engine, self.hand, self.free, self.rank = l3, engine, hand, free, rank
        self.first, self.cap, self.timeout_s = batch_pages, max_batch_pages, timeout_s
        self._pool = ThreadPoolExecutor(max_inflight, "l3pool-tp-prefetch") if rank == 0 else None
        self.quarantined = 0  # rank 0: pages of gets that never returned (never freed)

    def start(self, rid: str, seq: int, keys: list[str], pages: np.ndarray, wait_all: bool) -> SharedFetch:
        """Every rank, on the caller's thread, with the pages it just allocated for `keys`."""
        gens = self.engine.begin_external(pages) if len(pages) else np.empty(0, dtype=np.uint64)
        h = SharedFetch(self, rid, seq, keys[: len(pages)], pages, gens, wait_all)
        if self._pool is not None and len(pages):
            self._pool.submit(self._run, h)
        else:
            h.done.set()
        return h

    def _run(self, h: SharedFetch) -> None:
        """Rank 0: the gets, batch by batch, until the end, a non-OK page, or a stop."""
        i = 0
        try:
            for k in batch_schedule(len(h.keys), self.first, self.cap):
                if h.stop.is_set():
                    break
                out = self.l3.get(h.keys[i : i + k], h.pages[i : i + k])
                ok = next((j for j, o in enumerate(out) if o is not Outcome.OK), len(out))
                if ok:
                    self.engine.publish_external(h.pages[i : i + ok], h.gens[i : i + ok])
                    h.count = i + ok
                    metrics.PREFETCH_PAGES.inc(ok)
                if ok < k:
                    h.stopped_by = out[ok].value
                    break
                i += k
        except Exception as e:  # the prefix before it stands
            h.error = f"{type(e).__name__}: {e}"
            metrics.PREFETCH_ERRORS.inc()
        finally:
            h.done.set()

    def finish(self, h: SharedFetch, policy: str, after_s: float) -> PrefetchResult:
        """load(), every rank: the prefix every rank keeps. Rank 0 ends its gets by the policy
        (`policy`: best_effort / timeout after `after_s` / wait_complete) and publishes the count;
        the others wait for it. The pages after it are freed here, alike on every rank."""
        n = len(h.pages)
        if self.rank == 0:
            if h.wait_all or policy == "wait_complete":
                h.done.wait(self.timeout_s)
            elif policy == "timeout":
                h.done.wait(after_s)
            h.stop.set()
            if not h.done.wait(self.timeout_s):  # the batch in flight: its pages are every rank's
                raise CacheError(
                    f"TP rank 0: an L3 get of request {h.request_id!r} did not return within {self.timeout_s} s"
                )
            count = h.count
            if n:
                self.hand.publish_count(h.seq, count, h.request_id)
        else:
            count = self.hand.wait(h.seq, 2, self.timeout_s, f"the L3 prefetch of {h.request_id!r}") if n else 0
            if count > n:
                raise CacheError(f"TP rank {self.rank}: rank 0 published {count} pages of {n} for {h.request_id!r}")
        self.free(h.pages[count:])
        interrupted = count < len(h.keys) and h.stopped_by is None and h.error is None and self.rank == 0
        if interrupted:
            metrics.PREFETCH_INTERRUPTS.inc()
        h.result = PrefetchResult(
            h.request_id, 1, h.pages[:count], count, interrupted=interrupted, error=h.error, stopped_by=h.stopped_by,
            keys_total=len(h.keys), elapsed_s=time.perf_counter() - h.t0,
        )  # fmt: skip
        h.delivered = True
        return h.result

    def cancel(self, h: SharedFetch) -> bool:
        """release() before load(): every page goes back, alike on every rank (rank 0 first waits
        for its get in flight; one that never returns keeps its pages, logged as quarantined)."""
        if h.delivered:
            return False
        h.delivered = True
        if self.rank == 0:
            h.stop.set()
            if not h.done.wait(self.timeout_s):  # never raised: release() must finish
                self.quarantined += len(h.pages)
                log.error("TP rank 0: an L3 get of %s still writes into %d L2 pages: never freed", h.request_id,
                          len(h.pages))  # fmt: skip
                return True
        self.free(h.pages)
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Reading:
    """Rank 0: how many queued or running L3 puts read each L2 page (they hold no pins)."""

    def __init__(self, num_pages: int, timeout_s: float) -> None:
        self.n = np.zeros(num_pages, dtype=np.int32)
        self.cv = threading.Condition()
        self.timeout_s = timeout_s
        self.waits = 0  # rewrites that waited for a put

    def add(self, pages: np.ndarray) -> None:
        with self.cv:
            np.add.at(self.n, pages, 1)

    def done(self, pages: np.ndarray) -> None:
        with self.cv:
            np.subtract.at(self.n, pages, 1)
            self.cv.notify_all()

    def wait_unread(self, pages: np.ndarray) -> None:
        """Before new bytes go into `pages` (the engine's before_write)."""
        with self.cv:
            if self.n[pages].any():
                self.waits += 1
            if not self.cv.wait_for(lambda: not self.n[pages].any(), self.timeout_s):
                raise CacheError(f"L2 pages still read by an L3 put after {self.timeout_s} s: not rewritten")


class ReadyPuts:
    """Rank 0's writer client: a put waits until rank 0's D2H copies of its pages completed (the
    shared cache indexes a backup when it is submitted)."""

    def __init__(self, client: L3Pages, engine: SharedTransferEngine, timeout_s: float) -> None:
        self.client, self.engine, self.timeout_s = client, engine, timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def put(self, keys: Any, pages: Any) -> list[Outcome]:
        p = np.asarray(pages, dtype=np.int64).reshape(-1)
        if not self.engine.wait_ready(p, self.timeout_s):
            raise TransferError(f"{p.size} L2 pages not copied by rank 0 within {self.timeout_s} s: not put to L3")
        return self.client.put(keys, pages)


class TPWriter(L3Writer):
    """The L3 writer of rank 0: every page it takes is counted in `reading` until its put returned."""

    def __init__(self, reading: Reading, *a: Any, **kw: Any) -> None:
        self.reading = reading
        super().__init__(*a, **kw)

    def submit(self, hashes: Any, pages: np.ndarray) -> None:
        self.reading.add(pages)
        super().submit(hashes, pages)


class TPFetch:
    """The L3In mover of a TP rank: lookups and prefetch lengths through rank 0 (the handshake);
    a prefetch's L2 pages are allocated on the caller's thread, the same on every rank."""

    def __init__(
        self, cfg: CacheConfig, l3: L3Pages, engine: SharedTransferEngine, seg: Segment, rank: int, hooks: Hooks
    ) -> None:
        self.cfg, self.l3, self.rank, self.hooks = cfg, l3, rank, hooks
        self.hand = Handshake(seg, rank)
        self.fetcher = SharedFetcher(
            l3, engine, self.hand, hooks.free_l2, rank=rank, batch_pages=cfg.prefetch_batch_pages,
            max_batch_pages=cfg.prefetch_max_batch_pages, max_inflight=2, timeout_s=cfg.load_timeout_s,
        )  # fmt: skip
        self._seqs: dict[str, int] = {}  # request -> its lookup's handshake row (until its fetch starts)
        self._seq = 0

    def lookup(self, rid: str, keys: list[str]) -> tuple[int, bool]:
        seq, failed = self._seq, False
        self._seq += 1
        if self.rank == 0:
            try:
                n = self.l3.lookup(keys)
            except Exception as e:  # a miss, published as one
                log.warning("L3 lookup for %s failed (treated as a miss): %s", rid, e)
                n, failed = 0, True
            self.hand.publish_lookup(seq, n)
        else:
            n = self.hand.wait(seq, 1, self.cfg.load_timeout_s, f"the L3 lookup of {rid!r}")
        if n:
            self._seqs[rid] = seq
        return n, failed

    def start(self, rid: str, keys: list[str], wait_all: bool) -> Any:
        with self.hooks.mu:
            pages = self.hooks.alloc_prefetch(len(keys))
            return self.fetcher.start(rid, self._seqs.pop(rid), keys, pages, wait_all)

    def finish(self, h: Any, wait_all: bool) -> PrefetchResult:
        if not h.delivered:
            self.fetcher.finish(h, self.cfg.prefetch_policy, self.cfg.prefetch_timeout_s)
        res: PrefetchResult = h.wait()
        return res

    def forget(self, rid: str) -> None:
        self._seqs.pop(rid, None)

    def close(self) -> None:
        self.fetcher.close()


class TPWrites(Writes):
    """Rank 0's L3Out mover: no pins (a page is rewritten only once no put reads it, `Reading`),
    each put after rank 0's D2H copy of its pages completed; outcomes are booked when the cache's
    lock is free (a caller holding it may wait for these very pages) or at the next settle()."""

    pins = False

    def __init__(
        self, cfg: CacheConfig, l3: L3Pages, hooks: Hooks, more_coming: Any, engine: SharedTransferEngine,
        num_pages: int,
    ) -> None:  # fmt: skip
        self.engine, self.timeout_s = engine, cfg.load_timeout_s
        self.reading = Reading(num_pages, cfg.load_timeout_s)
        engine.before_write = self.reading.wait_unread
        self._outcomes: collections.deque[tuple[Any, ...]] = collections.deque()
        super().__init__(cfg, l3, hooks, more_coming, client=cast(L3Pages, ReadyPuts(l3, engine, self.timeout_s)))

    def _writer(self, client: L3Pages, cfg: CacheConfig, more_coming: Any) -> L3Writer:
        return TPWriter(self.reading, client, self._done, cfg.writer_batch_pages, cfg.writer_linger_ms, more_coming,
                        parallel=cfg.writer_parallel)  # fmt: skip

    def _done(self, hs: list[bytes], pages: np.ndarray, res: Any, err: BaseException | None, s: float) -> None:
        self.reading.done(pages)
        self._outcomes.append((hs, pages, res, err))
        self._book(block=False)

    def _book(self, block: bool) -> None:
        if not self.hooks.mu.acquire(blocking=block):
            return
        try:
            while self._outcomes:
                hs, pages, res, err = self._outcomes.popleft()
                self.hooks.written(hs, pages, res, err, unpin=False)
        finally:
            self.hooks.mu.release()

    def settle(self) -> None:
        self._book(block=True)

    def put_now(self, keys: list[str], pages: np.ndarray) -> PutOutcome | None:
        if not self.engine.wait_ready(pages, self.timeout_s):
            self.hooks.error(f"write-back of {len(keys)} L2 pages to L3 skipped: rank 0's D2H copy did not complete")
            return None
        return super().put_now(keys, pages)
