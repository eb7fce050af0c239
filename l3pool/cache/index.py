"""Per-tier page index (hash -> page, LRU order, reference counts, hit counts) and the ghost list.

One `TierIndex` per tier over that tier's one allocator (L2: the HostKVPool's; L1: the cache's
PageAllocator). Lookups are one dict probe per page through `map()` (C-speed); per-page state
(refs, hit counts, residency, hash) is numpy arrays indexed by page id, updated with one
vectorised call per request. LRU: a ring of (page, version) records; a page gets a record, with
a new version, each time it becomes evictable (cached, unpinned) or is used while evictable; a
record is live when its version is the page's latest and the page is still evictable. Eviction
scans from the old end, skipping dead records: every step is a numpy call over a batch,
O(victims + dead records), independent of the tier's size; the ring is compacted only when the
records between its oldest live one and the young end overflow it (never in bench.cache's steady
state). Measured per 512-page request (bench.cache bookkeeping, 2K / 20K / 80K L1 pages):
argpartition over stamps 0.44 / 0.67 / 1.40 ms p50; an OrderedDict of evictable pages 0.64 /
0.71 / 0.78 ms; the record queue 0.42 / 0.48 / 0.46 ms (with all else as it was then).
`gen` counts additions to the hash -> page mapping and `removed` removals, so the controller can
reuse a request's lookup across its calls (`still()` drops pages removed since).
Not thread-safe: the controller holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import filterfalse, repeat

import numpy as np

from l2core.allocator import PageAllocator

_EMPTY = np.empty(0, dtype=np.int64)


def hash64(hashes: Sequence[bytes]) -> np.ndarray:
    """The first 8 bytes of each page hash (16 bytes, or any multiple of 8) as uint64, little
    endian: the ghost list's keys."""
    if not hashes:
        return np.empty(0, dtype=np.uint64)
    return np.frombuffer(b"".join(hashes), dtype="<u8")[0 :: len(hashes[0]) // 8]


def key64(h: bytes) -> int:
    """hash64 of one hash."""
    return int.from_bytes(h[:8], "little")


class TierIndex:
    def __init__(self, name: str, allocator: PageAllocator) -> None:
        n = allocator.num_pages
        self.name, self.alloc = name, allocator
        self.num_pages = n
        self.index: dict[bytes, int] = {}
        self.hash_of = np.full(n, None, dtype=object)  # page -> its hash (bytes) or None
        self.ref = np.zeros(n, dtype=np.int32)
        self.cached = np.zeros(n, dtype=np.bool_)
        self.hits = np.zeros(n, dtype=np.int32)  # distinct requests that used the cached page
        self.stamp = np.zeros(n, dtype=np.int64)  # version of the page's latest LRU record
        self.clock = 0
        self._cap = max(1024, 4 * n)
        self._q = np.empty(self._cap, dtype=np.int64)  # LRU records (a ring): page ...
        self._qv = np.empty(self._cap, dtype=np.int64)  # ... and its version then
        self._head = self._tail = 0  # record counters; record i lives in slot i % _cap
        self._nev = 0  # evictable pages (cached and unpinned)
        self.evictions = 0
        self.gen = 0  # bumped when a hash is added to the mapping (see still())
        self.removed = 0  # bumped when hashes are removed from it

    # -- lookups ------------------------------------------------------------------------------
    def prefix(self, hashes: Sequence[bytes], start: int = 0, stop: int | None = None) -> np.ndarray:
        """Pages of the leading run of `hashes[start:stop]` present in this tier."""
        pages = self.pages_of(hashes[start:stop])
        miss = np.flatnonzero(pages < 0)
        return pages[: miss[0]] if miss.size else pages

    def pages_of(self, hashes: Sequence[bytes]) -> np.ndarray:
        """Page of each hash, -1 where absent."""
        n = len(hashes)  # map() over two iterables runs in C: ~25 ns per page here
        if not self.index:  # an empty tier (L2 before any backup): no probes
            return np.full(n, -1, dtype=np.int64)
        return np.fromiter(map(self.index.get, hashes, repeat(-1, n)), dtype=np.int64, count=n)

    def still(self, pages: np.ndarray) -> np.ndarray:
        """pages_of() now, from `pages` an earlier pages_of() returned with `gen` unchanged since
        (no hash added): only removals can have happened, and a removed page is no longer cached
        (it can be cached again only by an addition). One gather instead of a probe pass."""
        return np.where((pages >= 0) & self.cached[pages], pages, -1)

    # -- per-page state -------------------------------------------------------------------------
    # Invariant: every evictable page (cached, ref == 0) has exactly one live record in
    # records [_head, _tail), its latest; `_nev` counts them. check() verifies both.
    def _evictable(self, pages: np.ndarray) -> np.ndarray:
        return pages[self.cached[pages] & (self.ref[pages] == 0)]

    def _append(self, pages: np.ndarray) -> None:
        """Records for `pages` (distinct, evictable now) at the young end."""
        k = pages.size
        if k == 0:
            return
        if self._tail + k - self._head > self._cap:
            self._compact(k)
        self.clock += 1
        self.stamp[pages] = self.clock
        a = self._tail % self._cap
        b = min(self._cap, a + k)
        self._q[a:b], self._qv[a:b] = pages[: b - a], self.clock
        if b - a < k:  # wrapped around
            self._q[: k - (b - a)], self._qv[: k - (b - a)] = pages[b - a :], self.clock
        self._tail += k

    def _records(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Records [start, end) (end - start <= _cap): views, or copies where they wrap."""
        a, n = start % self._cap, end - start
        if a + n <= self._cap:
            return self._q[a : a + n], self._qv[a : a + n]
        w = self._cap - a
        return (
            np.concatenate([self._q[a:], self._q[: n - w]]),
            np.concatenate([self._qv[a:], self._qv[: n - w]]),
        )

    def _live(self, q: np.ndarray, v: np.ndarray) -> np.ndarray:
        return (self.stamp[q] == v) & self.cached[q] & (self.ref[q] == 0)

    def _compact(self, room: int) -> None:
        """The ring is full of records: keep the live ones (grown if they and `room` need it).
        A ring, not an array compacted when its end is reached: the records between the oldest
        live one and the young end fit (~2 per L1 page in bench.cache), so steady state never
        compacts; compacting 64K records cost ~0.25 ms every ~96 requests, the p99 here."""
        q, v = self._records(self._head, self._tail)
        ok = self._live(q, v)
        q, v = q[ok], v[ok]
        m = q.size
        cap = max(self._cap, 2 * (m + room))
        nq, nv = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
        nq[:m], nv[:m] = q, v
        self._q, self._qv, self._cap, self._head, self._tail = nq, nv, cap, 0, m

    def touch(self, pages: np.ndarray) -> None:
        """Mark used now: the evictable ones among `pages` become the youngest (a pinned page
        becomes the youngest when its last pin goes)."""
        self._append(self._evictable(pages))

    # The pages of one pin/unpin are distinct (a request's hash chain never repeats a hash), so a
    # fancy-index += is exact; np.add.at cost ~25 us per call here, 10x more.
    def pin(self, pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        self._nev -= int(np.count_nonzero(self.cached[pages] & (self.ref[pages] == 0)))
        self.ref[pages] += 1  # their records die: ref > 0

    def unpin(self, pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        self.ref[pages] -= 1
        if (self.ref[pages] < 0).any():
            raise AssertionError(f"{self.name}: reference count below zero")
        ev = self._evictable(pages)
        self._nev += ev.size
        self._append(ev)

    def check(self) -> None:
        """Every evictable page has exactly one live record and `_nev` counts them (tests)."""
        q, v = self._records(self._head, self._tail)
        live = q[self._live(q, v)]
        want = np.flatnonzero(self.cached & (self.ref == 0))
        if live.size != np.unique(live).size or not np.array_equal(np.sort(live), want) or self._nev != want.size:
            raise AssertionError(f"{self.name}: LRU out of sync ({live.size} live, {want.size} evictable, {self._nev})")

    def insert(self, hashes: Sequence[bytes], pages: np.ndarray) -> np.ndarray:
        """Index `pages` under `hashes`; where a hash is already indexed the existing page wins.
        Returns the page now indexed for each hash (ours or the existing one)."""
        return self._insert(hashes, pages, False)[0]

    def insert_pinned(
        self, hashes: Sequence[bytes], pages: np.ndarray, have: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """insert(), and the pages it newly indexed are pinned too (one reference each, so they
        get no LRU record that would die at once). `have`: pages_of(hashes) if the caller knows
        it (a fresh array; modified). Returns (page now indexed per hash, the pages newly
        indexed and pinned)."""
        return self._insert(hashes, pages, True, have)

    def _insert(
        self, hashes: Sequence[bytes], pages: np.ndarray, pin: bool, have: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if have is None:
            have = self.pages_of(hashes)
        new = have < 0
        k = int(np.count_nonzero(new))
        if k == 0:
            self.touch(have)
            return have, _EMPTY
        if k == new.size:  # all new (a fresh suffix: the common case): no index lists
            pn, hl = pages, hashes if isinstance(hashes, list) else list(hashes)
        else:
            sel = np.flatnonzero(new)
            pn = pages[sel]
            hl = [hashes[i] for i in sel.tolist()]
            self.touch(have[~new])
        self.index.update(zip(hl, pn.tolist(), strict=True))
        self.gen += 1
        ho = np.empty(len(hl), dtype=object)
        ho[:] = hl
        self.hash_of[pn] = ho
        self.cached[pn] = True
        self.hits[pn] = 0
        if pin:  # ref was 0 (not cached, so not pinned by anyone): pinned now, not evictable
            self.ref[pn] += 1
        else:
            ev = pn[self.ref[pn] == 0]
            self._nev += ev.size
            self._append(ev)
        have[new] = pn
        return have, pn

    def victims(self, n: int) -> tuple[np.ndarray, list[bytes]]:
        """Up to `n` unpinned cached pages, least recently used first, removed from the index
        (the caller writes them back if its policy says so, then frees them)."""
        if n <= 0:
            return _EMPTY, []
        got: list[np.ndarray] = []
        need = min(n, self._nev)
        while need > 0 and self._head < self._tail:
            end = min(self._tail, self._head + max(2 * need, 256))
            q, v = self._records(self._head, end)
            idx = np.flatnonzero(self._live(q, v))[:need]
            got.append(q[idx])
            need -= idx.size
            self._head = self._head + int(idx[-1]) + 1 if need == 0 else end
        if not got:
            return _EMPTY, []
        cand = np.concatenate(got) if len(got) > 1 else got[0]
        # every candidate is live: cached, unpinned, indexed (no None filtering, all evictable)
        hs: list[bytes] = self.hash_of[cand].tolist()
        self._unindex(hs, cand)
        self._nev -= cand.size
        self.evictions += int(cand.size)
        return cand, hs

    def drop(self, pages: np.ndarray) -> list[bytes]:
        """Remove cached `pages` from the index (not freed); returns their hashes."""
        ho = self.hash_of[pages]
        hs: list[bytes] = ho[ho != None].tolist()  # noqa: E711 - elementwise on an object array
        self._nev -= int(np.count_nonzero(self.cached[pages] & (self.ref[pages] == 0)))
        self._unindex(hs, pages)
        return hs

    def _unindex(self, hs: list[bytes], pages: np.ndarray) -> None:
        deque(map(self.index.__delitem__, hs), maxlen=0)  # C-speed loop
        self.removed += 1
        self.hash_of[pages] = None
        self.cached[pages] = False

    @property
    def evictable(self) -> int:
        return self._nev


class GhostList:
    """A bounded set of 64-bit page hashes recently evicted from L1 (O(1) add and lookup).

    A ring of `capacity` uint64 plus a Python set of the same ints: the ring gives the order
    (the oldest entry leaves when a new one arrives), the set the membership. Entries stay until
    they age out (a lookup does not remove them), and adding a hash already present is a no-op, so
    the ring's live slots and the set stay one-to-one. Since L1 evicts in LRU order, the ring
    holds the most recently evicted `capacity` distinct pages: ARC's ghost list. Measured with
    tracemalloc (tests/l3pool/test_cache.py), int objects included: 75-77 bytes per entry.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"ghost list capacity must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._ring = np.zeros(capacity, dtype=np.uint64)
        self._size = 0
        self._head = 0
        self._set: set[int] = set()

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, key: int) -> bool:
        return key in self._set

    def add(self, keys: Sequence[int] | np.ndarray) -> None:
        """Remember `keys` (newest last); the oldest entries leave when the ring is full."""
        if self.capacity == 0 or len(keys) == 0:
            return
        s = self._set
        arr = keys if isinstance(keys, np.ndarray) else None
        lst: list[int] = keys.tolist() if isinstance(keys, np.ndarray) else list(keys)
        n0 = len(s)
        if s.isdisjoint(lst):
            s.update(lst)
            if len(s) - n0 != len(lst):  # a key repeats within the batch: undo, take the slow path
                s.difference_update(lst)
                arr = None
                new = list(dict.fromkeys(lst))
            else:  # the common case (L1 victims are distinct, rarely in the list): 2 set passes
                new = lst
                s.difference_update(new[: -self.capacity])  # only the newest `capacity` stay
                if len(new) > self.capacity:
                    new, arr = new[-self.capacity :], None
                self._place(new, arr, added=True)
                return
        else:
            arr = None
            new = list(filterfalse(s.__contains__, dict.fromkeys(lst)))
        new = new[-self.capacity :]
        if new:
            self._place(new, None, added=False)

    def _place(self, new: list[int], arr: np.ndarray | None, added: bool) -> None:
        """Put `new` (distinct, absent before; already in the set when `added`) into the ring,
        dropping the entries they overwrite from the set. Two slices, no per-key index arrays."""
        m, cap, s = len(new), self.capacity, self._set
        vals = np.asarray(new, dtype=np.uint64) if arr is None else arr.astype(np.uint64, copy=False)
        over = self._size + m - cap  # live entries overwritten (the oldest ones, from _head on)
        if over > 0:
            a = (self._head - self._size) % cap  # the oldest entry
            b = min(cap, a + over)
            old = self._ring[a:b].tolist() + self._ring[: over - (b - a)].tolist()
            s.difference_update(old)
        a = self._head
        b = min(cap, a + m)
        self._ring[a:b] = vals[: b - a]
        self._ring[: m - (b - a)] = vals[b - a :]
        if not added:
            s.update(new)
        self._head = (a + m) % cap
        self._size = min(cap, self._size + m)

    def leading(self, keys: Sequence[int]) -> int:
        """Length of the leading run of `keys` present."""
        s = self._set
        for i, k in enumerate(keys):
            if k not in s:
                return i
        return len(keys)

    def leading_of(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """leading(hash64(hashes[start:])), converting only the keys it looks at (it stops at
        the first miss, usually the first page)."""
        s = self._set
        if not s:
            return 0
        for i in range(start, len(hashes)):
            if int.from_bytes(hashes[i][:8], "little") not in s:
                return i - start
        return max(0, len(hashes) - start)
