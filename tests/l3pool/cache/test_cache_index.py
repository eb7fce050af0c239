"""The cache's native index against simple reference models: the ghost list's ring and set, and
TierIndex (map on whole 16-byte keys, refs, hits, LRU list, victims, drops) under thousands of
random operations; bad calls; and the controller's hit counting across requests."""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import numpy as np
import pytest

from l2core.allocator import PageAllocator
from l3pool.cache import CacheConfig, GhostList
from l3pool.cache.index import TierIndex
from l3pool.pool.keys import hash_key, hash_keys

from ..cache_helpers import Engine, chain

pytestmark = pytest.mark.usefixtures("native")


class _GhostModel:
    """The ghost list's definition: the last `cap` distinct keys added, a re-added key keeps its place."""

    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict[int, None]()

    def add(self, keys: list[int]) -> None:
        if self.cap == 0:
            return
        for k in [k for k in dict.fromkeys(keys) if k not in self.d][-self.cap :]:
            self.d[k] = None
            if len(self.d) > self.cap:
                self.d.popitem(last=False)


@pytest.mark.parametrize("cap", [0, 1, 3, 4, 7, 16])
def test_ghost_list_matches_reference_model(cap: int) -> None:
    rng = random.Random(cap)
    g, ref = GhostList(cap), _GhostModel(cap)
    for step in range(2000):
        keys = [rng.randint(0, 40) for _ in range(rng.randint(0, 20))]  # repeats within and across batches
        g.add(np.asarray(keys, dtype=np.uint64) if step % 2 else keys)
        ref.add(keys)
        assert len(g) == len(ref.d) and all(k in g for k in ref.d), step
        assert g.order().tolist() == list(ref.d), step  # the ring holds them oldest first
        assert all((k in g) == (k in ref.d) for k in range(41)), step  # the set: the same keys, no more
        g.check()


def test_ghost_leading_of_is_leading_of_hash_keys() -> None:
    hs = [os.urandom(16) for _ in range(12)]
    g = GhostList(64)
    assert g.leading_of(hs) == 0  # empty
    g.add(hash_keys(hs[:5]))
    g.add([hash_key(hs[7])])
    keys = hash_keys(hs).tolist()
    assert keys[7] == hash_key(hs[7]) and keys[0] == int.from_bytes(hs[0][:8], "little")
    for start in range(0, 13):
        assert g.leading_of(hs, start) == g.leading(keys[start:]), start
    assert g.leading_of(hs) == 5 and g.leading_of(hs, 7) == 1 and g.leading_of(hs, 12) == 0


def test_ghost_list_native_footprint_and_errors() -> None:
    g = GhostList(1000)
    assert g.nbytes() / 1000 <= 64  # 8 B of ring + 16-32 B of set per entry
    g.add(np.arange(5000, dtype=np.uint64))
    assert len(g) == 1000 and g.order().tolist() == list(range(4000, 5000))
    g.check()
    with pytest.raises(ValueError, match="capacity"):
        GhostList(-1)
    with pytest.raises(ValueError, match="capacity"):
        GhostList(True)
    t = TierIndex("T", PageAllocator(16384))  # map (2 slots of 8 B per page) + 32-byte records + flags
    assert 48 <= t.nbytes() / 16384 <= 80


def _hashes(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


class _FakeTier:
    """Reference model of TierIndex: a dict for the map, an OrderedDict for the LRU list (the
    evictable pages, oldest first), lists for refs and hits; one Python step per page."""

    def __init__(self, n: int) -> None:
        self.map: dict[bytes, int] = {}
        self.key: list[bytes | None] = [None] * n
        self.ref, self.hits = [0] * n, [0] * n
        self.lru: OrderedDict[int, None] = OrderedDict()

    def lookup(self, hs: list[bytes]) -> list[int]:
        return [self.map.get(h, -1) for h in hs]

    def pin(self, pages: list[int]) -> None:
        for p in pages:
            self.lru.pop(p, None)
            self.ref[p] += 1

    def unpin(self, pages: list[int]) -> None:
        for p in pages:
            self.ref[p] -= 1
        for p in pages:
            if self.key[p] is not None and self.ref[p] == 0 and p not in self.lru:
                self.lru[p] = None

    def touch(self, pages: list[int]) -> None:
        for p in pages:
            if p in self.lru:
                self.lru.move_to_end(p)

    def prefix(self, hs: list[bytes]) -> list[int]:
        run: list[int] = []
        for h in hs:
            if h not in self.map:
                break
            run.append(self.map[h])
        return run

    def pin_prefix(self, hs: list[bytes]) -> list[int]:
        run = self.prefix(hs)
        self.pin(run)
        return run

    def count_hits(self, hs: list[bytes]) -> None:
        for p in self.lookup(hs):
            if p >= 0:
                self.hits[p] += 1
                self.touch([p])

    def insert(self, hs: list[bytes], pages: list[int], pin: bool) -> tuple[list[int], list[int]]:
        used = self.lookup(hs)
        self.touch([p for p in used if p >= 0])
        newly = []
        for i, (h, p) in enumerate(zip(hs, pages, strict=True)):
            if used[i] >= 0:
                continue
            if h in self.map:  # repeated within the call: its first page won
                used[i] = self.map[h]
                continue
            self.map[h], self.key[p], self.hits[p], used[i] = p, h, 0, p
            newly.append(p)
            if pin:
                self.ref[p] += 1
            elif self.ref[p] == 0:
                self.lru[p] = None
        return used, newly

    def remove(self, p: int) -> bytes:
        h = self.key[p]
        assert h is not None
        self.lru.pop(p, None)
        del self.map[h]
        self.key[p] = None
        return h

    def victims(self, n: int) -> tuple[list[int], list[bytes]]:
        pages = list(self.lru)[:n]
        return pages, [self.remove(p) for p in pages]

    def drop(self, pages: list[int]) -> list[bytes]:
        return [self.remove(p) for p in pages if self.key[p] is not None]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tier_index_matches_reference_model(seed: int) -> None:
    """Thousands of random whole-request operations on the native index and on _FakeTier: the
    pages, refs, hits, LRU order, victims and dropped hashes are equal after every step, and
    check() holds. Keys come from a small space in which many share their first (or last) 8
    bytes, so the map must compare whole keys; the tier is small, so the map's deletions run
    against full probe chains."""
    rng = random.Random(seed)
    n = 24
    alloc = PageAllocator(n)
    t, ref = TierIndex("T", alloc), _FakeTier(n)
    space = [a.to_bytes(8, "little") + b.to_bytes(8, "little") for a in range(3) for b in range(20)]

    def keys(k: int) -> list[bytes]:
        return rng.sample(space, k)  # distinct within a call, as a request's chain is

    for step in range(4000):
        op = rng.random()
        cached = [p for p in range(n) if ref.key[p] is not None]
        pinned = [p for p in range(n) if ref.ref[p] > 0]
        if op < 0.2 and alloc.free_pages:
            k = rng.randint(1, min(6, alloc.free_pages))
            hs, got = keys(k), alloc.alloc(k)
            pin = rng.random() < 0.5
            used, newly = t.insert_pinned(hs, got) if pin else (t.insert(hs, got), None)
            want, want_new = ref.insert(hs, got.tolist(), pin)
            assert used.tolist() == want, step
            if newly is not None:
                assert newly.tolist() == want_new, step
            alloc.free([p for p in got.tolist() if p not in want_new])
        elif op < 0.3:
            hs = keys(rng.randint(0, 8))
            assert t.pages_of(hs).tolist() == ref.lookup(hs), step
            lo = rng.randint(0, len(hs))
            assert t.prefix(hs, lo).tolist() == ref.prefix(hs[lo:]), step
        elif op < 0.4:
            hs = keys(rng.randint(0, 8))
            assert t.pin_prefix(b"".join(hs), 0, len(hs)).tolist() == ref.pin_prefix(hs), step
        elif op < 0.5:
            hs = keys(rng.randint(0, 8))
            t.count_hits(b"".join(hs), 0, len(hs))
            ref.count_hits(hs)
        elif op < 0.6 and cached:
            pages = rng.sample(cached, min(len(cached), rng.randint(1, 5)))
            t.touch(np.asarray(pages, dtype=np.int64))
            ref.touch(pages)
        elif op < 0.7 and cached:
            pages = rng.sample(cached, min(len(cached), rng.randint(1, 3)))
            t.pin(np.asarray(pages, dtype=np.int64))
            ref.pin(pages)
        elif op < 0.8 and pinned:
            pages = rng.sample(pinned, min(len(pinned), rng.randint(1, 3)))
            t.unpin(np.asarray(pages, dtype=np.int64))
            ref.unpin(pages)
        elif op < 0.95:
            k = rng.randint(0, 5)
            v, hs = t.victims(k)
            want, want_hs = ref.victims(k)
            assert v.tolist() == want and hs == want_hs, step
            alloc.free(v)
        elif cached:
            pages = [p for p in rng.sample(cached, min(len(cached), 3)) if ref.ref[p] == 0]
            dropped = t.drop(np.asarray(pages, dtype=np.int64))
            assert dropped == ref.drop(pages), step
            alloc.free(pages)
        t.check()
        assert t.ref.tolist() == ref.ref and t.hits.tolist() == ref.hits, step
        assert t.cached.tolist() == [k is not None for k in ref.key], step
        assert t.lru().tolist() == list(ref.lru) and t.evictable == len(ref.lru), step
        assert t.keys_of(np.arange(n)) == ref.key, step
    assert alloc.used_pages == len(ref.map)


def test_tier_index_keys_on_all_16_bytes() -> None:
    """Hashes that share their first 8 bytes (or their last 8) are different pages: a 64-bit
    truncation would hand out another page's bytes as a hit."""
    alloc = PageAllocator(8)
    t = TierIndex("T", alloc)
    a, b, c = bytes(8) + b"A" * 8, bytes(8) + b"B" * 8, b"C" * 8 + b"A" * 8
    t.insert([a, c], alloc.alloc(2))
    assert t.pages_of([a, b, c]).tolist() == [0, -1, 1]
    t.insert([b], alloc.alloc(1))
    assert t.pages_of([b, a, c]).tolist() == [2, 0, 1]
    v, hs = t.victims(1)
    assert v.tolist() == [0] and hs == [a] and t.pages_of([a, b, c]).tolist() == [-1, 2, 1]
    t.check()


def test_tier_index_rejects_bad_calls_and_changes_nothing() -> None:
    alloc = PageAllocator(8)
    t = TierIndex("T", alloc)
    pages = alloc.alloc(3)
    t.insert(_hashes(3, 1), pages)
    t.pin(pages[:1])
    with pytest.raises(RuntimeError, match="T: reference count of page 1 below zero"):
        t.unpin(pages[:2])  # page 0 is pinned, page 1 is not: neither changes
    assert t.ref.tolist()[:3] == [1, 0, 0] and t.lru().tolist() == [1, 2]
    with pytest.raises(IndexError, match="out of range"):
        t.pin(np.asarray([8]))
    with pytest.raises(ValueError, match="indexed under another key"):
        t.insert(_hashes(2, 2), pages[1:])
    with pytest.raises(ValueError, match="whole 16-byte keys"):
        t.native.lookup(b"x" * 17)
    with pytest.raises(ValueError, match="read-only"):
        t.ref[0] = 5  # only the index changes refs and residency
    assert t.pages_of(_hashes(3, 1)).tolist() == [0, 1, 2] and t.pages_of(_hashes(2, 2)).tolist() == [-1, -1]
    t.check()


def test_insert_pinned() -> None:
    alloc = PageAllocator(16)
    t = TierIndex("T", alloc)
    a = alloc.alloc(4)
    used, newly = t.insert_pinned(_hashes(4, 1), a)
    assert np.array_equal(used, a) and np.array_equal(newly, a)
    assert t.ref[a].tolist() == [1, 1, 1, 1] and t.evictable == 0  # pinned at insert: not in the LRU list
    t.check()
    b = alloc.alloc(4)
    hs = _hashes(2, 1) + _hashes(2, 2)  # two known hashes (theirs wins), two new
    used, newly = t.insert_pinned(hs, b)
    assert used.tolist() == [*a[:2].tolist(), *b[2:].tolist()] and newly.tolist() == b[2:].tolist()
    t.unpin(np.concatenate([a, newly]))
    assert t.lru().tolist() == [*a.tolist(), *newly.tolist()]
    seen = t.pages_of(hs)  # a0 a1 b2 b3
    t.touch(seen[2:])
    t.pin(seen[:1])
    v, _ = t.victims(2)
    assert v.tolist() == [int(a[1]), int(a[2])]
    assert t.pages_of(hs).tolist() == [int(a[0]), -1, *b[2:].tolist()]
    t.check()


def test_hit_counts_when_another_request_commits_between_match_and_commit(engines: list[Engine]) -> None:
    """A's match looked its suffix up (absent); B commits that suffix before A commits: A's commit
    must see B's pages (its lookup is stale: a hash was added), count its hit on them once, and
    index none of its own."""
    e = Engine(CacheConfig(l1_to_l2="write_through_selective", hit_threshold=1 << 20), l1_pages=32)
    engines.append(e)
    c = e.cache
    hs = chain(7, 6)
    ma = c.match("a", hs)
    ha = c.load(ma, total_pages=6)
    mb = c.match("b", hs)
    hb = c.load(mb, total_pages=6)
    assert c.commit("b", hs, hb.l1_pages) == 6
    assert c.commit("a", hs, ha.l1_pages) == 0  # B's pages won
    pages = c.t1.pages_of(hs)
    assert np.array_equal(pages, hb.l1_pages) and c.t1.hits[pages].tolist() == [2] * 6
    c.release("a")
    c.release("b")
    mc = c.match("c", hs)
    assert mc.l1 == 6 and c.t1.hits[pages].tolist() == [3] * 6
    c.release("c")
    c.t1.check()


def test_commit_after_own_evictions_hit_the_looked_up_range(engines: list[Engine]) -> None:
    """L1 holds hs[0:3] and, after a gap, hs[4:6] (unpinned, oldest): A's match looks all of them
    up, A's load evicts hs[4:6]; A's commit must index its own pages for hs[3:6] (a reused lookup
    that still named the evicted pages would index freed pages)."""
    e = Engine(CacheConfig(l1_to_l2="write_through_selective", hit_threshold=1 << 20), l1_pages=8)
    engines.append(e)
    c = e.cache
    hs, other = chain(8, 6), chain(9, 3)
    for rid, part in (("x", hs[:3]), ("y", hs[4:]), ("z", other)):
        h = c.load(c.match(rid, part), total_pages=len(part))
        assert c.commit(rid, part, h.l1_pages) == len(part)
        c.release(rid)
    m = c.match("a", hs)
    assert m.l1 == 3
    h = c.load(m, total_pages=6)  # 3 more pages: evicts hs[4], hs[5], other[0]
    assert c.t1.pages_of(hs)[3:].tolist() == [-1, -1, -1]
    assert c.commit("a", hs, h.l1_pages) == 3
    assert np.array_equal(c.t1.pages_of(hs), h.l1_pages) and c.t1.hits[h.l1_pages].tolist() == [2, 2, 2, 1, 1, 1]
    c.release("a")
    c.t1.check()
    assert c.plan.l1_alloc.used_pages == int(c.t1.cached.sum()) == 8


@pytest.mark.parametrize(
    "policy,kept", [("write_through_selective", True), ("write_through", False), ("write_back", False)]
)
def test_ghost_list_kept_only_for_the_policy_that_reads_it(engines: list[Engine], policy: str, kept: bool) -> None:
    e = Engine(CacheConfig(l1_to_l2=policy, ghost_capacity=64), l1_pages=8)  # type: ignore[arg-type]
    engines.append(e)
    c = e.cache
    for i in range(4):  # 16 pages through an 8-page L1: 8 evicted
        e.run(f"r{i}", chain(20 + i, 4))
    assert e.used() == (0, 0)
    st = c.stats()
    assert st["evictions"]["l1"] == 8
    assert st["ghost_entries"] == (8 if kept else 0)


def test_match_takes_whole_16_byte_hashes(engines: list[Engine]) -> None:
    """The native index keys on 16 bytes: other lengths are refused with one clear error, and
    two hashes that differ only in their last 8 bytes are two pages end to end."""
    e = Engine(CacheConfig(), l1_pages=8)
    engines.append(e)
    c = e.cache
    for bad in ([b"x" * 8, b"y" * 8], [b"x" * 32], [b"x" * 16, b"y" * 8]):
        with pytest.raises(ValueError, match="16-byte hashes"):
            c.match("r", bad)
    a, b = bytes(8) + b"A" * 8, bytes(8) + b"B" * 8
    e.run("a", [a])
    m = c.match("b", [b])
    assert m.l1 == 0  # shares 8 bytes with a cached page, still a miss
    c.release("b")
    assert c.match("a2", [a]).l1 == 1
    c.release("a2")
    assert e.used() == (0, 0)
