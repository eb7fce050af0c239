"""The L2 -> L3 writer thread: coalesces pages queued by many requests into large puts.

Each `submit(hashes, pages)` is a few pages of one request; Mooncake's TCP puts pay a fixed cost
per call (the demo's per-request puts ran at 0.25-0.5 GB/s against ~1.0 GB/s raw on this 2-core
machine), so the thread takes everything queued, waits up to `linger_ms` for a batch of
`batch_pages` to fill, and writes it with one `L3Client.put` (which cuts it into calls of the
client's `batch_pages`: give the client at least the writer's batch). The pages stay pinned in
L2 (the controller pins them before submitting) until the put returned; `on_done` runs on the
writer thread with the pages and their outcomes, or with the exception a put raised.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from l3pool.pool.client import L3Client
from l3pool.pool.store import Outcome

log = logging.getLogger(__name__)

DoneFn = Callable[[list[bytes], np.ndarray, "list[Outcome] | None", "BaseException | None", float], None]


@dataclass
class _Item:
    hashes: list[bytes]
    pages: np.ndarray


class L3Writer:
    def __init__(
        self,
        client: L3Client,
        on_done: DoneFn,
        batch_pages: int = 512,
        linger_ms: float = 2.0,
        more_coming: Callable[[], bool] | None = None,
    ) -> None:
        """`more_coming()`: True while pages are on their way (the controller's L1 -> L2 backups in
        flight): a short batch then waits up to 10x `linger_ms` for them instead of `linger_ms`."""
        self.client, self.on_done, self.more_coming = client, on_done, more_coming
        self.batch_pages, self.linger_s = batch_pages, linger_ms / 1e3
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
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

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
            items.append(it)
            n += len(it.hashes)
        return items, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._q.get()
            if first is None:
                return
            items, stop = self._take(first)
            hashes = [h for it in items for h in it.hashes]
            pages = np.concatenate([it.pages for it in items])
            t0 = time.perf_counter()
            res: list[Outcome] | None = None
            err: BaseException | None = None
            try:
                res = self.client.put(self.client.ns.keys(hashes), pages)
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
