"""Interruptible prefetch: pull a request's prefix from L3 into local L2 pages in the background.

    pf = Prefetcher(l3_client, batch_pages=32, max_batch_pages=256, max_inflight=2)
    h = pf.submit("req-7", keys)          # returns at once; a worker thread moves the pages
    ...                                   # the engine decides to start loading into L1:
    res = h.interrupt()                   # stops once the batches in flight landed
    use(res.pages)                        # the contiguous prefix of L2 page ids that arrived intact
    pool.free(res.pages)                  # ... the caller owns them now
    pf.close()

Batches grow: the first is `batch_pages` pages (the first pages arrive fast), each later one
`growth` times the one before, up to `max_batch_pages` (`batch_schedule`; a tail smaller than the
first batch joins the batch before it when that stays within the cap). Mooncake's TCP gets cost
a fixed amount per call and their throughput grows with the call size, so a few large calls
approach one raw call of all the pages, while the cap bounds what `interrupt()` waits for;
`growth=1` gives fixed `batch_pages` batches. Up to `pipeline` batches of one prefetch are in
flight. Default 1: each Mooncake call keeps a thread busy waiting for its transfer, and on a
host with few cores (measured on 2, TCP) a second call in flight slows the transfers more than
it hides of the per-call cost; with growing batches that cost is small anyway. `pipeline=2`
overlaps the next batch with the current one where cores are plentiful. L2 pages are allocated
per batch, on the worker when the batch is issued, through the `alloc` hook (default: the
pool's free pages; the tiered cache evicts LRU pages for it); a batch shrinks to what it gets
when L2 runs short, and the prefix ends there. So an interrupted prefetch never holds more than
it returns plus the batches in flight. Each batch is one `L3Client.get` (zero-copy Mooncake
`batch_get_into` into the L2 pages; give the client `batch_pages >= max_batch_pages`, or it
cuts the batch into several calls); a miss or failure ends the prefix at the first non-OK page
of that batch and every page after it (and every later batch) is freed. `interrupt()` stops
issuing batches and waits for the ones in flight for at most `interrupt_wait_s` (default 50 ms:
half the 100 ms target, the rest is slack for a loaded host); a batch still in flight then (a
Mooncake call hanging while the master is down: 4.3-30 s, measured) is left behind and the
prefix that landed before it is returned at once.

Quarantine: the L2 pages of a batch left behind stay allocated, owned by the worker, until its
Mooncake call returns (a hung `batch_get_into` may still write into them), and only then are
freed; `quarantined_pages()` counts them. They are never delivered and never handed out again
before the call returned. `close()` waits for such calls.

Hung pool: `wait_live()` is `wait()` bounded by the pool's liveness (the cache's wait_complete
and timeout policies use it). While a batch has been inside L3 longer than half the client's
`call_deadline_s`, the waiter asks the store whether the master answers a one-key lookup within
the other half (`L3Pages.answering`, every half deadline, ~1 ms healthy); when it does not, and
does not within a whole deadline when asked again (a loaded host can deschedule one probe past
its half deadline), the prefetch is interrupted at once: the prefix that landed is delivered and
the batch in flight is left behind, quarantined as above. A frozen master so costs a waiting load() about two
`call_deadline_s`, not Mooncake's RPC timeout; a slow transfer of a healthy master is waited for.

Ownership: until a result is *delivered* (returned by `wait()` or `interrupt()` of its handle)
every L2 page of a prefetch belongs to the prefetcher, which frees it on `cancel()`, on failure,
when a newer generation supersedes it, and on `close()`. Once delivered, `result.pages` belong to
the caller, who must `pool.free()` them; nothing else ever touches them again.

Generations: every `submit` for a request id gets the next generation number. When a newer
generation exists, an older prefetch stops at its next batch boundary and its result is
discarded (pages freed): its handle delivers an empty result with `superseded=True`, never data
over the newer one.

Concurrency: `max_inflight` prefetches run at once (one thread each, plus `pipeline` I/O threads
each); later submissions wait in FIFO order. L3Client calls share per-client staging/trailer
buffers when the namespace uses checksums or layer_first staging, so in those modes the batches of
concurrent prefetches are serialised.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from l2core.allocator import OutOfPages
from l2core.spec import ConfigError
from l2core.units import check_int
from l3pool import metrics
from l3pool.pool.protocols import L3Pages, Outcome

log = logging.getLogger(__name__)
_PRIORITY = {"interrupt": 0, "supersede": 1, "cancel": 2}

__all__ = ["PrefetchClosed", "PrefetchHandle", "PrefetchResult", "Prefetcher", "batch_schedule"]


def batch_schedule(n: int, first: int, cap: int, growth: float = 2.0) -> list[int]:
    """Batch sizes for a prefetch of `n` pages: `first`, then each batch `growth` times the one
    before, up to `cap`; a remainder smaller than `first` joins the batch before it when that
    batch stays within `cap`. Every batch is <= `cap`; the sizes sum to `n`."""
    if first < 1 or cap < 1 or growth < 1:
        raise ValueError(f"bad batch schedule: first={first} cap={cap} growth={growth}")
    out: list[int] = []
    size, left = float(min(first, cap)), n
    while left > 0:
        k = min(int(size), left)
        if 0 < left - k < first and left <= cap:
            k = left  # fold a small tail into this batch
        out.append(k)
        left -= k
        size = min(size * growth, float(cap))
    return out


class PrefetchClosed(RuntimeError):
    """The prefetcher was closed: no new prefetches."""


@dataclass
class PrefetchResult:
    """What a prefetch delivered. `pages[i]` holds the bytes of `keys[i]` for i < keys_loaded."""

    request_id: str
    generation: int
    pages: np.ndarray  # int64 L2 page ids, the contiguous prefix that arrived intact
    keys_loaded: int
    interrupted: bool = False  # interrupt() stopped it before the end of its keys
    error: str | None = None  # an exception ended it (the prefix before it is still valid)
    cancelled: bool = False  # cancel()/close(): nothing delivered, everything freed
    superseded: bool = False  # a newer generation of the request exists: discarded, freed
    left_in_flight: int = 0  # interrupt() returned before these pages' batch landed (quarantined)
    stopped_by: str | None = None  # Outcome value of the first non-OK page that ended the prefix
    keys_total: int = 0
    batch_ms: list[float] = field(default_factory=list)  # latency of each batch (get + bookkeeping)
    elapsed_s: float = 0.0  # from the worker's start to the end of its last batch
    queued_s: float = 0.0  # from submit() to the worker's start

    @property
    def complete(self) -> bool:
        return self.keys_loaded == self.keys_total


class PrefetchHandle:
    """One submitted prefetch. Thread-safe; its result is delivered at most once with pages."""

    def __init__(self, owner: Prefetcher, request_id: str, generation: int, keys: list[str]) -> None:
        self._owner, self.request_id, self.generation, self.keys = owner, request_id, generation, keys
        self._stop = threading.Event()  # ask the worker to stop at the next batch boundary
        self._done = threading.Event()  # the worker finished; _result is set
        self._lock = threading.Lock()
        self._why: str | None = None  # "interrupt" | "cancel" | "supersede"
        self._result: PrefetchResult | None = None
        self._delivered = False
        # worker -> interrupt() hand-over (under _lock): the prefix that landed, pages in flight
        self._got: list[np.ndarray] = []
        self._loaded = 0
        self._inflight_pages = 0
        self._detached = False  # interrupt() delivered without waiting for the batches in flight
        self._batch_ms: list[float] = []
        self._batch_t0: float | None = None  # perf_counter() when the oldest batch in flight was issued
        self.submitted_at = time.perf_counter()

    # -- caller side -----------------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        """Block until the prefetch ends; TimeoutError after `timeout` s (the prefetch goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"prefetch {self.request_id!r} gen {self.generation} not done within {timeout} s")
        return self._deliver()

    def wait_live(self, timeout: float | None = None) -> PrefetchResult:
        """`wait()`, unless the pool stops answering while a batch is in flight: then the
        prefetch is interrupted at once (module docstring "Hung pool"). TimeoutError after
        `timeout` s, as `wait()`. Without a client deadline it is `wait()`."""
        d = self._owner.client.call_deadline_s
        if d is None:
            return self.wait(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        step, checked = d / 5, -float("inf")
        while True:
            left = None if end is None else end - time.monotonic()
            if self._done.wait(step if left is None else max(0.0, min(step, left))):
                return self._deliver()
            if left is not None and left <= step:
                raise TimeoutError(f"prefetch {self.request_id!r} gen {self.generation} not done within {timeout} s")
            t0, now = self._batch_t0, time.perf_counter()
            if t0 is None or now - t0 < d / 2 or now - checked < d / 2:
                continue
            checked = now
            # a missed probe is confirmed by a second one of a whole deadline before the batch is
            # left behind: one probe's thread, descheduled on a loaded host, is no hung master
            client = self._owner.client
            if not client.answering(d / 2) and not self._done.is_set() and not client.answering(d):
                log.warning("prefetch %s gen %d: L3 does not answer while a batch has been in flight for %.0f ms: "
                            "interrupted", self.request_id, self.generation,
                            (time.perf_counter() - t0) * 1e3)  # fmt: skip
                return self.interrupt(0.0)

    def interrupt(self, timeout: float | None = None) -> PrefetchResult:
        """Stop issuing batches and return the prefix that arrived (usable). Waits at most
        `timeout` s (default: the prefetcher's `interrupt_wait_s`) for the batches in flight;
        when they have not landed by then, returns the prefix before them and leaves their pages
        quarantined until their Mooncake calls return (`result.left_in_flight`)."""
        self._ask("interrupt")
        wait = self._owner.interrupt_wait_s if timeout is None else timeout
        if self._done.wait(wait):
            return self._deliver()
        with self._lock:
            if not self._done.is_set():
                return self._detach_locked()
        return self._deliver()

    def _detach_locked(self) -> PrefetchResult:
        """Deliver the prefix that landed now; the worker frees the rest when its calls return."""
        self._detached = True
        pages = np.concatenate(self._got) if self._got else np.empty(0, dtype=np.int64)
        self._got = []
        r = PrefetchResult(
            self.request_id, self.generation, pages, self._loaded, interrupted=True, keys_total=len(self.keys),
            batch_ms=list(self._batch_ms), elapsed_s=time.perf_counter() - self.submitted_at,
            left_in_flight=self._inflight_pages,
        )  # fmt: skip
        self._owner._quarantine(self._inflight_pages)
        self._result = r
        if not self._owner._is_current(self):
            self._discard_locked("supersede")
        self._delivered = True
        self._owner._forget(self)
        # pages left in flight (a Mooncake call that outlived interrupt_wait_s) are worth a warning;
        # a prefetch still queued or between batches has none, and returning at once is the plan
        log.log(
            logging.WARNING if self._inflight_pages else logging.DEBUG,
            "prefetch %s gen %d: interrupt() returned %d pages without waiting for %d pages in flight (quarantined)",
            self.request_id, self.generation, self._loaded, self._inflight_pages,
        )  # fmt: skip
        return r

    def cancel(self) -> bool:
        """Stop and free everything. False when the result was already delivered (the caller
        owns those pages) or the prefetch was already cancelled/discarded."""
        self._ask("cancel")
        with self._lock:
            if self._delivered:
                return False
            if self._done.is_set():
                return self._discard_locked("cancel")
        return True  # the worker frees its pages when it stops

    # -- internals -------------------------------------------------------------------------
    def _ask(self, why: str) -> None:
        with self._lock:  # cancel > supersede > interrupt
            if self._why is None or _PRIORITY[why] > _PRIORITY[self._why]:
                self._why = why
        self._stop.set()

    def _finish(self, result: PrefetchResult) -> None:
        """Worker: publish the result; free it at once when it must not be delivered."""
        with self._lock:
            if self._detached:  # interrupt() delivered already; the worker freed the rest
                self._done.set()
                return
            self._result = result
            self._done.set()
            why = self._why
            if why in ("cancel", "supersede") or not self._owner._is_current(self):
                self._discard_locked(why or "supersede")

    def _discard_locked(self, why: str) -> bool:
        r = self._result
        assert r is not None
        if r.cancelled or r.superseded:
            return False
        self._owner._free(r.pages)
        self._owner._forget(self)
        r.pages = np.empty(0, dtype=np.int64)
        r.keys_loaded = 0
        if why == "cancel":
            r.cancelled = True
        else:
            r.superseded = True
        return True

    def _deliver(self) -> PrefetchResult:
        with self._lock:
            r = self._result
            assert r is not None
            if not self._delivered and not (r.cancelled or r.superseded) and not self._owner._is_current(self):
                self._discard_locked("supersede")  # a newer generation came after it finished
            self._delivered = True
            self._owner._forget(self)
            return r

    @property
    def delivered(self) -> bool:
        return self._delivered


class Prefetcher:
    """Background L3 -> L2 prefetch over one L3Client. See the module docstring."""

    def __init__(
        self,
        client: L3Pages,
        *,
        batch_pages: int = 32,
        max_batch_pages: int | None = None,
        growth: float = 2.0,
        max_inflight: int = 2,
        pipeline: int = 1,
        interrupt_wait_s: float = 0.05,
        alloc: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        """`batch_pages`: the first batch; `max_batch_pages` (default: the larger of `batch_pages`
        and the client's `batch_pages`): the cap later batches grow to by `growth` (>= 1).
        `alloc(n)`: where a batch's L2 pages come from, called on the worker thread when the batch
        is issued: up to `n` pages of the client's pool, now owned by the prefetcher (fewer: L2
        is full, the prefix ends there). Default: the pool's free pages. An owner that keeps
        evictable pages in the pool (the tiered cache) makes room there under its own lock:
        room made before submit() is not reserved, so concurrent allocations could take it."""
        cap = max(batch_pages, client.batch_pages) if max_batch_pages is None else max_batch_pages
        for name, v in (
            ("batch_pages", batch_pages), ("max_batch_pages", cap), ("max_inflight", max_inflight),
            ("pipeline", pipeline),
        ):  # fmt: skip
            check_int(name, v, 1)
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth >= 1:
            raise ConfigError(f"growth must be a number >= 1, got {growth!r}")
        if isinstance(interrupt_wait_s, bool) or not isinstance(interrupt_wait_s, (int, float)) or interrupt_wait_s < 0:
            raise ConfigError(f"interrupt_wait_s must be a number >= 0, got {interrupt_wait_s!r}")
        if cap < batch_pages:
            raise ConfigError(f"max_batch_pages ({cap}) must be >= batch_pages ({batch_pages})")
        if cap > client.batch_pages:
            log.info("prefetch batches up to %d pages are cut into L3Client calls of %d", cap, client.batch_pages)
        self.client, self.pool = client, client.pool
        self.batch_pages, self.max_batch_pages, self.growth = batch_pages, cap, float(growth)
        self.max_inflight, self.pipeline = max_inflight, pipeline
        self.interrupt_wait_s = float(interrupt_wait_s)
        self._alloc_fn = alloc or self._alloc_free
        self._quarantined = 0  # pages of left-behind batches whose Mooncake call has not returned
        self.quarantined_total = 0
        self._lock = threading.Lock()
        self._gens: dict[str, int] = {}
        self._live: dict[int, PrefetchHandle] = {}  # handles whose result was not delivered
        self._closed = False
        # checksum trailers and layer_first staging are per-client buffers: one batch at a time
        self._serial = threading.Lock() if (client.ns.checksum or client.staging_bytes) else None
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="l3pool-prefetch")
        self._io = ThreadPoolExecutor(max_workers=max_inflight * pipeline, thread_name_prefix="l3pool-prefetch-io")
        self.batch_ms: collections.deque[float] = collections.deque(maxlen=100_000)  # every batch, all prefetches

    # -- API -------------------------------------------------------------------------------
    def submit(self, request_id: str, keys: Sequence[str]) -> PrefetchHandle:
        """Start prefetching `keys` (a request's page keys, in prefix order) into fresh L2 pages."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        ks = list(keys)
        prefix = self.client.ns.key_prefix
        bad = next((k for k in ks if not isinstance(k, str) or not k.startswith(prefix)), None)
        if bad is not None:
            raise ValueError(f"key {bad!r} is not in this client's namespace {self.client.ns_id}")
        with self._lock:
            if self._closed:
                raise PrefetchClosed("the prefetcher is closed")
            gen = self._gens.get(request_id, 0) + 1
            self._gens[request_id] = gen
            older = [h for h in self._live.values() if h.request_id == request_id]
            h = PrefetchHandle(self, request_id, gen, ks)
            self._live[id(h)] = h
        for o in older:  # stop and discard the older generations (or free an undelivered result)
            o._ask("supersede")
            with o._lock:
                if o._done.is_set() and not o._delivered:
                    o._discard_locked("supersede")
        self._pool.submit(self._run, h)
        return h

    def generation(self, request_id: str) -> int:
        """The newest generation submitted for `request_id` (0: never)."""
        with self._lock:
            return self._gens.get(request_id, 0)

    def inflight(self) -> int:
        """Prefetches submitted and not yet finished."""
        with self._lock:
            return sum(1 for h in self._live.values() if not h.done())

    def quarantined_pages(self) -> int:
        """L2 pages held by batches that interrupt() left behind and whose call has not returned."""
        with self._lock:
            return self._quarantined

    def close(self) -> None:
        """Cancel every prefetch whose result was not delivered, free its pages, join the threads
        (waiting for calls still inside Mooncake: their pages are freed only after they return)."""
        with self._lock:
            self._closed = True
            handles = list(self._live.values())
        for h in handles:
            h.cancel()
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        for h in handles:  # results that finished while shutting down
            h.cancel()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _is_current(self, h: PrefetchHandle) -> bool:
        with self._lock:
            return self._gens.get(h.request_id) == h.generation

    def _quarantine(self, n: int) -> None:
        with self._lock:
            self._quarantined += n
            self.quarantined_total += n

    def _free(self, pages: np.ndarray) -> None:
        if len(pages):
            self.pool.free(pages)

    def _alloc(self, n: int) -> tuple[np.ndarray, str | None]:
        """Up to `n` L2 pages from the `alloc` hook, and why not all (None: all `n`)."""
        try:
            pages = self._alloc_fn(n)
        except Exception as e:  # the owner's hook: ends the prefix like a full L2, never the worker
            log.warning("prefetch: allocating %d L2 pages failed: %s", n, e)
            return np.empty(0, dtype=np.int64), f"L2 allocation failed: {type(e).__name__}: {e}"
        if len(pages) > n:
            self._free(pages)
            return np.empty(0, dtype=np.int64), f"L2 allocation failed: {len(pages)} pages for {n}"
        if len(pages) == n:
            return pages, None
        return pages, f"L2 is full: asked for {n} pages, got {len(pages)} ({self.pool.allocator.free_pages} free)"

    def _alloc_free(self, n: int) -> np.ndarray:
        """The default hook: `n` free pages of the pool, or as many as are free."""
        try:
            return self.pool.alloc(n)
        except OutOfPages:
            pass
        k = self.pool.allocator.free_pages
        if 0 < k < n:
            with contextlib.suppress(OutOfPages):  # another user may take them first
                return self.pool.alloc(k)
        return np.empty(0, dtype=np.int64)

    def _get(self, keys: list[str], pages: np.ndarray) -> list[Outcome]:
        if self._serial is None:
            return self.client.get(keys, pages)
        with self._serial:
            return self.client.get(keys, pages)

    def _run(self, h: PrefetchHandle) -> None:
        """One prefetch: up to `pipeline` batches in flight, consumed in order; stops issuing
        at the first stop request, miss, failure or full L2, then drains what is in flight
        (its pages are freed only after their transfer returned)."""
        t0 = time.perf_counter()
        res = PrefetchResult(
            h.request_id, h.generation, np.empty(0, dtype=np.int64), 0, keys_total=len(h.keys),
            queued_s=t0 - h.submitted_at,
        )  # fmt: skip
        n = len(h.keys)
        sizes = iter(batch_schedule(n, self.batch_pages, self.max_batch_pages, self.growth))
        flight: collections.deque[tuple[int, np.ndarray, Future[list[Outcome]], float]] = collections.deque()
        issued, issuing, ended = 0, True, False
        try:
            while True:
                while issuing and len(flight) < self.pipeline and issued < n:
                    if h._stop.is_set():
                        issuing = False
                        break
                    ks = h.keys[issued : issued + next(sizes)]
                    pages, full = self._alloc(len(ks))
                    if full:
                        res.error, issuing = full, False
                        if not len(pages):
                            break
                        ks = ks[: len(pages)]
                    with h._lock:
                        if h._detached:
                            self._free(pages)
                            issuing = False
                            break
                        h._inflight_pages += len(pages)
                    flight.append((issued, pages, self._io.submit(self._get, ks, pages), time.perf_counter()))
                    h._batch_t0 = flight[0][3]
                    issued += len(ks)
                if not flight:
                    break
                start, pages, fut, tb = flight.popleft()
                try:
                    out = fut.result()
                except BaseException as e:
                    h._batch_t0 = flight[0][3] if flight else None
                    if not self._landed(h, pages):
                        self._free(pages)
                    if not ended:
                        res.error = f"{type(e).__name__}: {e}"
                        log.warning("prefetch %s gen %d: batch at %d failed: %s", h.request_id, h.generation, start, e)
                    ended = True
                    issuing = False
                    continue
                h._batch_t0 = flight[0][3] if flight else None
                if self._landed(h, pages):  # left behind by interrupt(): freed there
                    ended = True
                    continue
                if ended:  # after the prefix ended
                    self._free(pages)
                    continue
                k = next((i for i, r in enumerate(out) if r is not Outcome.OK), len(out))
                self._free(pages[k:])
                ms = (time.perf_counter() - tb) * 1e3
                with h._lock:
                    h._got.append(pages[:k])
                    h._loaded += k
                    h._batch_ms.append(ms)
                res.batch_ms.append(ms)
                self.batch_ms.append(ms)
                res.keys_loaded += k
                if k:
                    metrics.PREFETCH_PAGES.inc(k)
                if k < len(out):
                    res.stopped_by, ended, issuing = out[k].value, True, False
        finally:
            for _, pages, fut, _ in flight:  # only on an unexpected exception above
                with contextlib.suppress(BaseException):
                    fut.result()
                if not self._landed(h, pages):
                    self._free(pages)
            with h._lock:
                got, h._got = h._got, []
            res.pages = np.concatenate(got) if got else np.empty(0, dtype=np.int64)
            res.elapsed_s = time.perf_counter() - t0
            stopped_early = res.keys_loaded < n and res.stopped_by is None and res.error is None
            res.interrupted = h._stop.is_set() and h._why == "interrupt" and stopped_early
            if res.interrupted:
                metrics.PREFETCH_INTERRUPTS.inc()
            if res.error is not None:
                metrics.PREFETCH_ERRORS.inc()
            h._finish(res)

    def _landed(self, h: PrefetchHandle, pages: np.ndarray) -> bool:
        """A batch's call returned: its pages are no longer in flight. True when interrupt()
        left it behind: its pages are freed here, and only then leave the quarantine (so a
        caller that saw quarantined_pages() == 0 finds them free)."""
        with h._lock:
            h._inflight_pages -= len(pages)
            detached = h._detached
        if detached:
            self._free(pages)
            with self._lock:
                self._quarantined -= len(pages)
        return detached

    def _forget(self, h: PrefetchHandle) -> None:
        """The handle's pages are delivered or freed: nothing left for close() to free."""
        with self._lock:
            self._live.pop(id(h), None)
