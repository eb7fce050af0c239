"""The L2 -> L3 writer thread: coalesces pages queued by many requests into large puts.

Each `submit(hashes, pages)` is a few pages of one request; Mooncake's TCP puts pay a fixed cost
per call (the demo's per-request puts ran at 0.25-0.5 GB/s against ~1.0 GB/s raw on this 2-core
machine), so the thread takes everything queued, waits up to `linger_ms` for a batch of
`batch_pages` to fill, and writes it with one `L3Client.put` (which cuts it into calls of the
client's `batch_pages`: give the client at least the writer's batch). `flush()` ends a linger at
once (whoever flushes waits for everything anyway). A batch of at least 2 x `min_split_pages` is
written as up to `parallel` concurrent puts of contiguous parts (L3Client is thread-safe; measured
on the H200 host, 256 pages of 576 KiB over loopback TCP: one put 64.7 ms, 2 parts 61.3 ms,
4 parts 55.4 ms, raw `batch_put_from` of the same bytes 56.4 ms; medians of 9). The pages stay
pinned in L2 (the controller pins them before submitting) until every part returned; `on_done`
runs on the writer thread with the pages and their outcomes, or with the exception a put raised.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from l3pool.pool.protocols import L3Pages, Outcome

log = logging.getLogger(__name__)

DoneFn = Callable[[list[bytes], np.ndarray, "list[Outcome] | None", "BaseException | None", float], None]


@dataclass
class _Item:
    hashes: list[bytes]
    pages: np.ndarray


_FLUSH = _Item([], np.empty(0, dtype=np.int64))  # queued by flush(): stop lingering


class L3Writer:
    def __init__(
        self,
        client: L3Pages,
        on_done: DoneFn,
        batch_pages: int = 512,
        linger_ms: float = 2.0,
        more_coming: Callable[[], bool] | None = None,
        parallel: int = 4,
        min_split_pages: int = 32,
    ) -> None:
        """`more_coming()`: True while pages are on their way (the controller's L1 -> L2 backups in
        flight): a short batch then waits up to 10x `linger_ms` for them instead of `linger_ms`."""
        self.client, self.on_done, self.more_coming = client, on_done, more_coming
        self.batch_pages, self.linger_s = batch_pages, linger_ms / 1e3
        self.parallel, self.min_split_pages = max(1, parallel), max(1, min_split_pages)
        self._parts = ThreadPoolExecutor(self.parallel - 1, "l3pool-cache-writer-part") if self.parallel > 1 else None
        self._q: queue.Queue[_Item | None] = queue.Queue()
        self._idle = threading.Condition()
        self._queued = 0  # pages submitted and not yet done
        self.puts = 0  # put calls made (batches)
        self.t_first: float | None = None  # perf_counter of the first submit since reset (bench)
        self.t_last: float | None = None  # perf_counter when the last put returned
        self._thread = threading.Thread(target=self._run, name="l3pool-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, hashes: Sequence[bytes], pages: np.ndarray) -> None:
        with self._idle:
            self._queued += len(hashes)
            if self.t_first is None:
                self.t_first = time.perf_counter()
        self._q.put(_Item(list(hashes), pages))

    def pending(self) -> int:
        with self._idle:
            return self._queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted page was written (or failed). False on timeout."""
        self._q.put(_FLUSH)
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._parts is not None:
            self._parts.shutdown()

    def _take(self, first: _Item) -> tuple[list[_Item], bool]:
        items, n = [first], len(first.hashes)
        t0 = time.monotonic()
        deadline, hard = t0 + self.linger_s, t0 + 10 * self.linger_s
        while n < self.batch_pages:
            left = deadline - time.monotonic()
            if left <= 0 and self.more_coming is not None and time.monotonic() < hard and self.more_coming():
                left = min(self.linger_s, hard - time.monotonic())
            try:
                it = self._q.get_nowait() if left <= 0 else self._q.get(timeout=left)
            except queue.Empty:
                break
            if it is None:
                return items, True
            if it is _FLUSH:
                break
            items.append(it)
            n += len(it.hashes)
        return items, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._q.get()
            if first is None:
                return
            if first is _FLUSH:
                continue
            items, stop = self._take(first)
            hashes = [h for it in items for h in it.hashes]
            pages = np.concatenate([it.pages for it in items])
            t0 = time.perf_counter()
            res: list[Outcome] | None = None
            err: BaseException | None = None
            try:
                res = self._put(hashes, pages)
                self.puts += 1
            except Exception as e:  # surfaced through on_done -> the controller's errors
                err = e
                log.warning("L3 writer: put of %d pages failed: %s", len(hashes), e)
            try:
                self.on_done(hashes, pages, res, err, time.perf_counter() - t0)
            except Exception:
                log.exception("L3 writer: completion handler failed")
            with self._idle:
                self.t_last = time.perf_counter()
                self._queued -= len(hashes)
                self._idle.notify_all()

    def _put(self, hashes: list[bytes], pages: np.ndarray) -> list[Outcome]:
        """One batch, in up to `parallel` concurrent parts; returns only after every part did
        (the pages are read until then), raising the first exception any part raised."""
        keys = self.client.ns.keys(hashes)
        parts = min(self.parallel, len(keys) // self.min_split_pages)
        if parts <= 1 or self._parts is None:
            return self.client.put(keys, pages)
        cut = np.linspace(0, len(keys), parts + 1).astype(np.int64).tolist()
        futs: list[Future[list[Outcome]]] = [
            self._parts.submit(self.client.put, keys[a:b], pages[a:b]) for a, b in itertools.pairwise(cut[1:])
        ]
        out: list[Outcome] = []
        err: BaseException | None = None
        try:
            out += self.client.put(keys[: cut[1]], pages[: cut[1]])
        except BaseException as e:
            err = e
        for f in futs:  # wait for every part, also after a failure
            try:
                out += f.result()
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err
        return out
