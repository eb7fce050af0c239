"""The cache's index internals against simple reference models: the ghost list's ring and set, the
LRU record ring of TierIndex (wrap-around, compaction, victims order), insert_pinned, the addition
generation and the lookups the controller reuses across a request's calls."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pytest

from l2core.allocator import PageAllocator
from l3pool.cache import CacheConfig, GhostList
from l3pool.cache._internal import _pages_of, _seen
from l3pool.cache.index import TierIndex, hash64, key64

from .cache_helpers import Engine, chain

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
        live = [int(g._ring[(g._head - g._size + i) % cap]) for i in range(g._size)] if cap else []
        assert live == list(ref.d), step  # the ring holds them oldest first, one-to-one with the set


def test_ghost_leading_of_is_leading_of_hash64() -> None:
    hs = [os.urandom(16) for _ in range(12)]
    g = GhostList(64)
    assert g.leading_of(hs) == 0  # empty
    g.add(hash64(hs[:5]))
    g.add([key64(hs[7])])
    keys = hash64(hs).tolist()
    assert keys[7] == key64(hs[7]) and keys[0] == int.from_bytes(hs[0][:8], "little")
    for start in range(0, 13):
        assert g.leading_of(hs, start) == g.leading(keys[start:]), start
    assert g.leading_of(hs) == 5 and g.leading_of(hs, 7) == 1 and g.leading_of(hs, 12) == 0


def _hashes(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


def test_tier_index_lru_ring_matches_reference_model() -> None:
    """Random inserts, touches, pins, unpins, victims and drops over a small tier: the victims come
    in the reference LRU order, and check() holds after every step, across many wrap-arounds of the
    record ring and its compactions (one page stays evictable and untouched while others churn)."""
    rng = random.Random(1)
    n = 24
    alloc = PageAllocator(n)
    t = TierIndex("T", alloc)
    lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
    ref = np.zeros(n, dtype=np.int64)
    tag = 0
    cap0 = t._cap
    for step in range(6000):
        op = rng.random()
        cached = np.flatnonzero(t.cached)
        if op < 0.25 and alloc.free_pages:
            k = rng.randint(1, min(4, alloc.free_pages))
            pages = alloc.alloc(k)
            tag += 1
            got = t.insert(_hashes(k, tag), pages)
            assert np.array_equal(got, pages)
            for p in pages.tolist():
                lru[p] = None
        elif op < 0.55 and cached.size:
            pages = np.asarray(rng.sample(cached.tolist(), min(5, cached.size)), dtype=np.int64)
            t.touch(pages)
            for p in pages.tolist():
                if p in lru:
                    lru.move_to_end(p)
        elif op < 0.65 and cached.size:
            pages = np.asarray(rng.sample(cached.tolist(), min(3, cached.size)), dtype=np.int64)
            t.pin(pages)
            ref[pages] += 1
            for p in pages.tolist():
                lru.pop(p, None)
        elif op < 0.75 and ref.any():
            pages = np.flatnonzero(ref)[:3]
            t.unpin(pages)
            ref[pages] -= 1
            for p in pages.tolist():
                if ref[p] == 0:
                    lru[p] = None
        elif op < 0.95:
            k = rng.randint(1, 4)
            v, hs = t.victims(k)
            want = list(lru)[:k]
            assert v.tolist() == want, step
            assert len(hs) == len(want) and all(h not in t.index for h in hs)
            for p in want:
                del lru[p]
            alloc.free(v)
        elif cached.size:
            p = int(rng.choice(cached.tolist()))
            if ref[p] == 0:
                t.drop(np.asarray([p]))
                lru.pop(p, None)
                alloc.free([p])
        t.check()
        assert t.evictable == len(lru)
    assert t._tail > 4 * cap0  # the ring wrapped several times


def test_tier_index_ring_compacts_dead_records() -> None:
    alloc = PageAllocator(8)
    t = TierIndex("T", alloc)
    pages = alloc.alloc(8)
    t.insert(_hashes(8, 0), pages)
    cap = t._cap
    for _ in range(3 * cap // 7):  # page 0 stays the oldest while 7 pages churn: the window overflows
        t.touch(pages[1:])
    t.check()
    assert t._tail - t._head <= t._cap and t._cap == cap  # compacted, not grown
    v, hs = t.victims(8)
    assert v.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and hs == _hashes(8, 0)


def test_insert_pinned_generation_and_still() -> None:
    alloc = PageAllocator(16)
    t = TierIndex("T", alloc)
    a = alloc.alloc(4)
    g0 = t.gen
    used, newly = t.insert_pinned(_hashes(4, 1), a)
    assert np.array_equal(used, a) and np.array_equal(newly, a) and t.gen == g0 + 1
    assert t.ref[a].tolist() == [1, 1, 1, 1] and t.evictable == 0  # pinned at insert: no records
    t.check()
    b = alloc.alloc(4)
    hs = _hashes(2, 1) + _hashes(2, 2)  # two known hashes (theirs wins), two new
    used, newly = t.insert_pinned(hs, b)
    assert used.tolist() == [*a[:2].tolist(), *b[2:].tolist()] and newly.tolist() == b[2:].tolist()
    g1 = t.gen
    t.unpin(np.concatenate([a, newly]))
    seen = t.pages_of(hs)  # a0 a1 b2 b3; LRU: a0 a1 a2 a3 b2 b3
    t.touch(seen[2:])
    t.pin(seen[:1])
    assert t.gen == g1  # touches and pins add no hash
    v, _ = t.victims(2)  # removals do not bump gen: still() drops what they removed
    assert t.gen == g1 and v.tolist() == [int(a[1]), int(a[2])]
    assert t.still(seen).tolist() == [int(a[0]), -1, *b[2:].tolist()]
    assert np.array_equal(t.still(seen), t.pages_of(hs))
    assert np.array_equal(t.still(np.asarray([-1, int(seen[0])])), [-1, int(seen[0])])
    t.check()


def test_pages_of_reuses_a_lookup_only_while_no_hash_was_added() -> None:
    alloc = PageAllocator(16)
    t = TierIndex("T", alloc)
    hs = _hashes(6, 3)
    t.insert(hs[:3], alloc.alloc(3))
    a = t.pages_of(hs)
    seen = _seen(t, 0, a)
    assert np.array_equal(_pages_of(t, seen, hs, 1, 5), a[1:5])
    s2 = _pages_of(t, seen, hs, 0, 6)
    s2[:] = 99  # a copy: the stored lookup stays intact
    assert np.array_equal(_pages_of(t, seen, hs, 0, 6), a)
    v, _ = t.victims(1)  # a removal: still() drops it from the reused lookup
    assert _pages_of(t, seen, hs, 0, 3).tolist() == [-1, int(a[1]), int(a[2])] and v.tolist() == [int(a[0])]
    alloc.free(v)
    late = alloc.alloc(2)
    t.insert(hs[3:5], late)  # added after the lookup: a stale `seen` must not be used
    assert _pages_of(t, seen, hs, 2, 6).tolist() == [int(a[2]), *late.tolist(), -1]
    assert _pages_of(t, seen, hs, 0, 2).tolist() == [-1, int(a[1])]
    assert _pages_of(t, _seen(t, 2, t.pages_of(hs[2:])), hs, 1, 4).tolist() == t.pages_of(hs[1:4]).tolist()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


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
    assert c._l1_alloc.used_pages == int(c.t1.cached.sum()) == 8


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
