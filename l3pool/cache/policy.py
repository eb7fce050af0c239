"""Write and prefetch policies as objects: the controller asks them *which* pages move and *when*;
it does the moving (L1 -> L2 backups, the L2 -> L3 writer, synchronous write-backs on eviction).

A write policy governs one tier boundary (L1 -> L2 or L2 -> L3). Its hooks answer with masks over
page arrays, so a policy never loops over pages and never touches the cache's state:
- `on_use(hits)`: pages of a request's hit, by their distinct-request hit counts: move these now
  (asked only of a policy with `reads_use`, so the others cost no lookup per request);
- `on_insert(hits)`: pages just inserted into the upper tier (computed pages committed to L1,
  pages backed up into L2): move these now;
- `evict_copies`: whether a page evicted from the upper tier is copied down first (write-back);
- `ghost`: whether it reads the ghost list (L1 -> L2 only): rebuilt pages the ghost list proves
  were evicted before are moved at once, whatever their hit count.
A prefetch policy turns an unfinished L3 -> L2 prefetch into its result when `load()` runs. An
eviction policy picks which unpinned pages leave a tier (`LRU`, the default, or `LFU`).

A new policy is one class and one entry in `WRITE_POLICIES` / `PREFETCH_POLICIES` /
`EVICTION_POLICIES` (the names `CacheConfig` accepts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from l3pool.pool.keys import hash_keys

if TYPE_CHECKING:
    from l3pool.pool.prefetch import PrefetchHandle, PrefetchResult


class WritePolicy:
    """Moves nothing by itself (the base of every write policy)."""

    name = ""
    reason = ""  # what the stats call the pages it moves (l1_to_l2_writes / l2_to_l3_writes keys)
    evict_copies = False
    ghost = False
    reads_use = False

    def __init__(self, hit_threshold: int = 2) -> None:
        self.hit_threshold = hit_threshold

    def on_use(self, hits: np.ndarray) -> np.ndarray:
        return np.zeros(len(hits), dtype=np.bool_)

    def on_insert(self, hits: np.ndarray) -> np.ndarray:
        return np.zeros(len(hits), dtype=np.bool_)


class WriteBack(WritePolicy):
    """A page moves down when it is evicted from the upper tier (synchronously, before reuse)."""

    name = "write_back"
    reason = "back"
    evict_copies = True


class WriteThrough(WritePolicy):
    """A page moves down as soon as it enters the upper tier."""

    name = "write_through"
    reason = "through"

    def on_insert(self, hits: np.ndarray) -> np.ndarray:
        return np.ones(len(hits), dtype=np.bool_)


class WriteThroughSelective(WritePolicy):
    """A page moves down once `hit_threshold` distinct requests used it; at L1 -> L2 also when
    the ghost list proves a rebuilt page was evicted before (its reuse is proven)."""

    name = "write_through_selective"
    reason = "selective"
    ghost = True
    reads_use = True

    def _hot(self, hits: np.ndarray) -> np.ndarray:
        return np.asarray(hits) >= self.hit_threshold

    def on_use(self, hits: np.ndarray) -> np.ndarray:
        return self._hot(hits)

    def on_insert(self, hits: np.ndarray) -> np.ndarray:
        return self._hot(hits)


WRITE_POLICIES: dict[str, type[WritePolicy]] = {p.name: p for p in (WriteBack, WriteThrough, WriteThroughSelective)}


def write_policy(name: str, hit_threshold: int) -> WritePolicy:
    return WRITE_POLICIES[name](hit_threshold)


class PrefetchPolicy:
    """What load() does with an unfinished prefetch: its result (the intact prefix that arrived).
    `timeout_s`: CacheConfig.prefetch_timeout_s (only `Timeout` reads it)."""

    name = ""

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s

    def finish(self, h: PrefetchHandle) -> PrefetchResult:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    """Interrupt at once: the request computes what has not arrived."""

    name = "best_effort"

    def finish(self, h: PrefetchHandle) -> PrefetchResult:
        return h.interrupt()


class WaitComplete(PrefetchPolicy):
    """Wait for the whole prefetch, unless L3 stops answering while a batch is in flight (then
    interrupt: `PrefetchHandle.wait_live`)."""

    name = "wait_complete"

    def finish(self, h: PrefetchHandle) -> PrefetchResult:
        return h.wait_live()


class Timeout(PrefetchPolicy):
    """Wait up to `timeout_s` (less when L3 stops answering: `wait_live`), then interrupt."""

    name = "timeout"

    def finish(self, h: PrefetchHandle) -> PrefetchResult:
        try:
            return h.wait_live(self.timeout_s)
        except TimeoutError:
            return h.interrupt()


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {p.name: p for p in (BestEffort, WaitComplete, Timeout)}


def prefetch_policy(name: str, timeout_s: float) -> PrefetchPolicy:
    return PREFETCH_POLICIES[name](timeout_s)


class EvictionPolicy:
    """Which unpinned pages leave a tier when it needs room. `victims(index, n, ghost)`: up to `n`
    of the tier's evictable pages, removed from its index (a TierIndex: the native index keeps the
    mechanics - LRU links, hit counts, the map), and their hashes as one buffer; their first 8
    bytes go into `ghost` (a GhostList, L1 only) when given. The same policy serves L1 and L2."""

    name = ""

    def victims(self, index: Any, n: int, ghost: Any = None) -> tuple[np.ndarray, bytes]:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first: one native call, O(1) per page (the index's LRU list)."""

    name = "lru"

    def victims(self, index: Any, n: int, ghost: Any = None) -> tuple[np.ndarray, bytes]:
        pages, keys = index.native.evict(n, ghost.native if ghost is not None else None)
        return pages, keys


class LFU(EvictionPolicy):
    """Fewest distinct-request hits first, the least recently used first among equals: one sort
    of the evictable pages' hit counts per eviction (O(E log E) for E evictable pages, vectorised),
    then one native drop. Keeps a prefix many requests share through bursts of one-off requests."""

    name = "lfu"

    def victims(self, index: Any, n: int, ghost: Any = None) -> tuple[np.ndarray, bytes]:
        order: np.ndarray = index.lru()  # evictable pages, least recently used first
        if n < len(order):
            order = order[np.argsort(index.hits[order], kind="stable")[:n]]
        keys: bytes = index.native.drop(order) if order.size else b""
        if ghost is not None and order.size:
            ghost.add(hash_keys(keys))
        return order, keys


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU)}


def eviction_policy(name: str) -> EvictionPolicy:
    return EVICTION_POLICIES[name]()
