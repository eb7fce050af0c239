"""Per-tier page index (hash -> page, LRU order, reference counts, hit counts) and the ghost list.

Both live in compiled code (l2core's native extension, `PageIndex` / `GhostSet` in
native/csrc/page_index.cpp); the classes here are thin wrappers that name them for the
controller and the tests.

One `TierIndex` per tier over that tier's one allocator (L2: the HostKVPool's; L1: the cache's
PageAllocator). The map keys on the whole 16-byte page hash (an open-addressing table of
(hash bits, page) slots; two hashes that share 8 bytes are two pages). Per page it keeps the
hash, the reference count (pins), the hit count (distinct requests) and whether it is indexed;
`ref`, `cached` and `hits` are numpy views of that native memory (`ref` and `cached` read-only:
only the index changes them). The evictable pages (cached, unpinned) form an intrusive doubly
linked LRU list over page ids: pin, unpin, touch and evict are O(1) per page, independent of the
tier's size. A request's hashes travel as one buffer (`l3pool.pool.keys.join_hashes`) and each whole-request
step is one native call: `pin_prefix` (probe + pin the leading run), `count_hits` (probe, count,
touch), `insert` (probe, index the absent ones, pin or queue them), `evict` (the LRU victims out
of the map, their first 8 hash bytes into the ghost list).
Measured on bench.cache's bookkeeping (512-page requests on a full 16K-page L1, 256 evictions
each, 2 shared cores): the whole request 0.31 -> 0.092 ms thread-CPU p50, 0.58 -> 0.15 ms p99,
against the pure-Python index this replaced (dict probes through map(), numpy per-page arrays, a
ring of LRU records, a Python set for the ghost list); the native calls take ~47 us of it,
eviction with its ghost adds ~24 us. Details in l3pool/cache/README.md.
Not thread-safe: the controller holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from l2core import _native
from l2core.allocator import PageAllocator
from l2core.units import check_int
from l3pool.pool.keys import HASH_BYTES, join_hashes, split_hashes

Hashes = Sequence[bytes] | bytes


def _check(native: Any) -> None:
    """A native structure's self-check, as the AssertionError tests expect."""
    try:
        native.check()
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


class TierIndex:
    def __init__(self, name: str, allocator: PageAllocator) -> None:
        x = _native.load().PageIndex(name, allocator.num_pages, HASH_BYTES)
        self.name, self.alloc, self.native = name, allocator, x
        self.num_pages = allocator.num_pages
        self.ref, self.cached, self.hits = x.state()  # views of the native per-page state
        self.ref.flags.writeable = False
        self.cached.flags.writeable = False
        # the per-request calls, bound straight to the native methods (no wrapper frame):
        # pin / unpin / touch(pages int64) and, over a buffer of hashes [lo, hi):
        # lookup(buf, lo, hi) -> pages (-1: absent); pin_prefix(buf, lo, hi) -> pinned leading run;
        # count_hits(buf, lo, hi) -> hit count + 1 and touch for each present hash
        self.pin: Any = x.pin
        self.unpin: Any = x.unpin
        self.touch: Any = x.touch
        self.lookup: Any = x.lookup
        self.pin_prefix: Any = x.pin_prefix
        self.count_hits: Any = x.count_hits
        self.hit_pages: Any = x.hit_pages  # count_hits for pages already looked up (cached ones)
        self.keys_of: Any = x.keys_of  # page -> its hash (None if not cached), as a list
        self.key64_of: Any = x.key64_of  # cached pages -> the first 8 bytes of their hashes (uint64)

    # -- lookups ------------------------------------------------------------------------------

    def page_counts(self) -> dict[str, int]:
        """stats(): the tier's pages in all, free in its allocator, cached here, pinned (ref > 0)."""
        a = self.alloc
        return {"total": a.num_pages, "free": a.free_pages, "cached": int(self.cached.sum()),
                "pinned": int(np.count_nonzero(self.ref))}  # fmt: skip

    def pages_of(self, hashes: Hashes) -> np.ndarray:
        """Page of each hash, -1 where absent."""
        out: np.ndarray = self.native.lookup(join_hashes(hashes))
        return out

    def prefix(self, hashes: Hashes, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Pages of the leading run of `hashes[start:stop]` present in this tier."""
        pages = self.native.lookup(join_hashes(hashes), start, -1 if stop is None else stop)
        miss = np.flatnonzero(pages < 0)
        return pages[: miss[0]] if miss.size else pages

    # -- changes --------------------------------------------------------------------------------
    def insert(self, hashes: Hashes, pages: np.ndarray, start: int = 0) -> np.ndarray:
        """Index `pages` under `hashes[start:start + len(pages)]`; where a hash is already indexed
        the existing page wins (and counts as used). Returns the page now indexed per hash."""
        used: np.ndarray = self.native.insert(join_hashes(hashes), start, pages, False)[0]
        return used

    def insert_pinned(self, hashes: Hashes, pages: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """insert(), and the pages it newly indexed are pinned too (one reference each, so they
        never enter the LRU list only to leave it at once). Returns (page now indexed per hash,
        the pages newly indexed and pinned)."""
        used, newly = self.native.insert(join_hashes(hashes), start, pages, True)
        return used, newly

    def victims(self, n: int) -> tuple[np.ndarray, list[bytes]]:
        """Up to `n` unpinned cached pages, least recently used first, removed from the index
        (the caller writes them back if its policy says so, then frees them)."""
        pages, keys = self.native.evict(n)
        return pages, split_hashes(keys)

    def drop(self, pages: np.ndarray) -> list[bytes]:
        """Remove cached `pages` from the index (not freed); returns their hashes."""
        return split_hashes(self.native.drop(pages))

    # -- state ------------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        n: int = self.native.evictable
        return n

    @property
    def evictions(self) -> int:
        n: int = self.native.evictions
        return n

    def lru(self) -> np.ndarray:
        """The evictable pages, least recently used first (tests)."""
        out: np.ndarray = self.native.lru()
        return out

    def nbytes(self) -> int:
        """Bytes the native index allocated (map, keys, per-page state, LRU links)."""
        n: int = self.native.nbytes()
        return n

    def check(self) -> None:
        """The map, the per-page state and the LRU list agree (tests): AssertionError if not."""
        _check(self.native)


class GhostList:
    """A bounded set of 64-bit page hashes recently evicted from L1 (O(1) add and lookup).

    Native: a ring of `capacity` uint64 (the order: the oldest entry leaves when a new one
    arrives) and an open-addressing set of the same keys (the membership). Entries stay until
    they age out (a lookup does not remove them), and adding a key already present is a no-op.
    Since L1 evicts in LRU order, the ring holds the most recently evicted `capacity` distinct
    pages: ARC's ghost list. 8 bytes of ring + 16-32 bytes of set per entry (`nbytes()`).
    """

    def __init__(self, capacity: int) -> None:
        check_int("ghost list capacity", capacity, 0, ValueError)
        self.capacity = capacity
        self.native: Any = _native.load().GhostSet(capacity)

    def __len__(self) -> int:
        return len(self.native)

    def __contains__(self, key: int) -> bool:
        return key in self.native

    def add(self, keys: Sequence[int] | np.ndarray) -> None:
        """Remember `keys` (newest last); the oldest entries leave when the ring is full."""
        if self.capacity and len(keys):
            self.native.add(np.asarray(keys, dtype=np.uint64))

    def leading(self, keys: Sequence[int] | np.ndarray) -> int:
        """Length of the leading run of `keys` present."""
        if not len(keys):
            return 0
        n: int = self.native.leading(np.asarray(keys, dtype=np.uint64))
        return n

    def leading_of(self, hashes: Hashes, start: int = 0) -> int:
        """leading(hash_keys(hashes[start:])) without converting them."""
        if not self.capacity:
            return 0
        n: int = self.native.leading_of(join_hashes(hashes), start, HASH_BYTES)
        return n

    def order(self) -> np.ndarray:
        """The entries, oldest first (tests)."""
        out: np.ndarray = self.native.order()
        return out

    def nbytes(self) -> int:
        """Bytes the native ring and set allocated."""
        n: int = self.native.nbytes()
        return n

    def check(self) -> None:
        """The ring and the set agree (tests): AssertionError if not."""
        _check(self.native)
