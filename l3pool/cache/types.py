"""The cache's public value types and errors (what an engine handles besides TieredCache)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from l2core.transfer import TransferError
from l3pool import metrics


class CacheError(RuntimeError):
    """A request-level misuse or a failure the caller must see."""


class UnknownRequest(CacheError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class CacheFull(CacheError):
    """Not enough unpinned pages in a tier; nothing was allocated."""


class PPShortLoad(CacheError):
    """A pipeline stage got fewer pages from L3 than the stage lock's length (the pages were lost
    despite the lock): the stages would load different counts."""


class BackgroundError(CacheError):
    """Errors of the backup thread, the L3 writer or a prefetch, raised by flush()/close()."""


@dataclass
class L1:
    """The engine's device KV: per-layer buffers (l2core.ops order: MHA K0,V0,K1,...; MLA C0,C1,...),
    token-slot indexed, `page_size` slots per page. The cache allocates and indexes all its pages."""

    bufs: Sequence[torch.Tensor]
    page_size: int

    @property
    def num_pages(self) -> int:
        return int(self.bufs[0].shape[0]) // self.page_size


@dataclass(frozen=True)
class Match:
    """Hit lengths before anything moved. `l1`, `l2`, `l3`: pages found first in that tier, in
    prefix order (L1 [0, l1), L2 [l1, l1 + l2), L3 after them)."""

    request_id: str
    pages: int  # hashes considered
    l1: int
    l2: int
    l3: int

    @property
    def hit_pages(self) -> int:
        return self.l1 + self.l2 + self.l3


@dataclass
class CacheStats:
    requests: int = 0
    hit_pages: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    miss_pages: int = 0
    hit_bytes: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    # token twins (pages x page_size): only whole pages are cached, a request's tail is never counted
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    miss_tokens: int = 0
    requested_tokens: int = 0
    wait_s: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})
    # the waits per metrics.WAIT_BUCKETS bucket (the last: above them all): l3pool_cache_wait_seconds
    wait_counts: dict[str, list[int]] = field(
        default_factory=lambda: {t: [0] * (len(metrics.WAIT_BUCKETS) + 1) for t in ("l2", "l3")}
    )
    evictions: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0})
    ghost_hits: int = 0
    # pages written per boundary and reason ("through", "selective", "ghost", "back")
    l1_to_l2_writes: dict[str, int] = field(default_factory=dict)
    l2_to_l3_writes: dict[str, int] = field(default_factory=dict)
    d2h_bytes: int = 0  # L1 -> L2 bytes copied
    l3_put_bytes: int = 0  # bytes of pages the writer made sure are in L3 (a put skips pages already
    # there: stats()["l3_client"]["bytes_put"] counts only the bytes this client stored)
    l3_put_failed: int = 0
    l3_read_failures: int = 0  # lookups/prefetches that raised or ended early on an error
    prefetch_interrupted: int = 0
    pp_short: int = 0  # PP stage loaded fewer pages than the lock length (L3 lost pages)
    # pages not backed up L1 -> L2, every L2 page pinned: "l3_slow" when pages waiting for the L3
    # writer (pinned until their put returns) held the room, "l2_pinned" by requests' pins alone
    backup_skips: dict[str, int] = field(default_factory=lambda: {"l3_slow": 0, "l2_pinned": 0})
    errors: int = 0
    api_s: dict[str, float] = field(default_factory=dict)  # wall time inside each public call
    # bytes each tier delivered and the seconds its copies ran (l2: L2 -> L1 load jobs, l3: L3 -> L2
    # prefetches, worker start to last batch): a router's measured bandwidth per tier
    moved_bytes: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    moved_s: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})

    def count_request(self, hits: dict[str, int], pages: int, page_bytes: int, page_size: int) -> None:
        """One loaded request: its hit pages per tier (l1, l2, l3) of its `pages` whole pages (in
        pages, bytes and tokens; l3pool.metrics derives its series from these)."""
        self.requests += 1
        for t, n in hits.items():
            self.hit_pages[t] += n
            self.hit_bytes[t] += n * page_bytes
            self.hit_tokens[t] += n * page_size
        miss = pages - sum(hits.values())
        self.miss_pages += miss
        self.miss_tokens += miss * page_size
        self.requested_tokens += pages * page_size

    def waited(self, tier: str, seconds: float) -> None:
        """A caller waited `seconds` on `tier` (l2: a load, l3: the prefetch at load())."""
        self.wait_s[tier] += seconds
        self.wait_counts[tier][bisect.bisect_left(metrics.WAIT_BUCKETS, seconds)] += 1

    def moved(self, tier: str, nbytes: int, seconds: float) -> None:
        """A finished copy into the tier above `tier` (caller holds the cache's lock)."""
        if nbytes > 0 and seconds > 0:
            self.moved_bytes[tier] += nbytes
            self.moved_s[tier] += seconds

    def fetched(self, res: Any, page_bytes: int) -> None:
        """A prefetch's result (pool.prefetch.PrefetchResult) at load()."""
        self.moved("l3", len(res.pages) * page_bytes, res.elapsed_s)
        self.prefetch_interrupted += int(res.interrupted)
        if res.error is not None or res.stopped_by not in (None, "miss"):
            self.l3_read_failures += 1

    def backed_up(self, reason: str, pages: int, page_bytes: int) -> None:
        """`pages` copied L1 -> L2 because of `reason` (caller holds the cache's lock)."""
        self.l1_to_l2_writes[reason] = self.l1_to_l2_writes.get(reason, 0) + pages
        self.d2h_bytes += pages * page_bytes

    def put_l3(self, reasons: Sequence[str | None], ok: np.ndarray, page_bytes: int) -> None:
        """One L2 -> L3 put's outcome: `ok[i]` for the page queued because of `reasons[i]`."""
        self.l3_put_failed += int((~ok).sum())
        self.l3_put_bytes += int(ok.sum()) * page_bytes
        for why, good in zip(reasons, ok.tolist(), strict=True):
            if good and why is not None:
                self.l2_to_l3_writes[why] = self.l2_to_l3_writes.get(why, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadTracker(Protocol):
    """What a LoadHandle may ask of the cache that made it (and nothing else of it)."""

    page_bytes: int
    num_layers: int

    def slots(self, l1_pages: np.ndarray) -> torch.Tensor: ...

    def wait_layer(self, job: int, layer: int, timeout: float | None) -> None:
        """Block until `layer` of load job `job` may be read; KeyError once the job was collected."""
        ...

    def load_ok(self, rid: str, job: int) -> bool:
        """The collected load's outcome."""
        ...

    def waited(self, tier: str, seconds: float) -> None:
        """Account time an engine spent waiting on a tier."""
        ...


class LoadHandle:
    """What load() set in motion. `l1_pages`: the request's L1 pages (hits, then loaded pages,
    then fresh ones up to `total_pages`); `hit_pages`: pages the engine need not compute, of which
    `l1` were in L1, `l2` loaded from L2 and `l3` fetched from L3 (the intact prefix that arrived).
    Per-request timings for the engine's records: `l3_wait_s` (load() waiting for the L3 -> L2
    prefetch), `wait_s` (the engine blocked in wait_layer/wait)."""

    def __init__(self, loads: LoadTracker, rid: str, l1_pages: np.ndarray, hit_pages: int, job: int | None) -> None:
        self._loads, self.request_id, self.l1_pages, self.hit_pages, self._job = loads, rid, l1_pages, hit_pages, job
        self.l1 = self.l2 = self.l3 = 0
        self.l3_wait_s = 0.0
        self.wait_s = 0.0

    @property
    def loaded_bytes(self) -> int:
        """Bytes moved L2 -> L1 for this request (the L2 and the L3 hits)."""
        return (self.l2 + self.l3) * self._loads.page_bytes

    @property
    def slots(self) -> torch.Tensor:
        return self._loads.slots(self.l1_pages)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer `layer` of the loaded pages is in L1 (raises TransferError on failure)."""
        if self._job is None:
            return
        t0 = time.perf_counter()
        try:
            self._loads.wait_layer(self._job, layer, timeout)
        except KeyError:  # commit/release already collected the job: its result decides
            if not self._loads.load_ok(self.request_id, self._job):
                raise TransferError(f"load of request {self.request_id!r} failed") from None
        finally:
            dt = time.perf_counter() - t0
            self.wait_s += dt
            self._loads.waited("l2", dt)

    def wait(self, timeout: float | None = None) -> None:
        self.wait_layer(self._loads.num_layers - 1, timeout)
