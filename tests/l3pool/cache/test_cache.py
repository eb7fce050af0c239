"""TieredCache unit tests over real L1 tensors, a real HostKVPool + TransferEngine, the real
L3Client/Prefetcher, and an in-memory FakePageStore for L3 (the real-Mooncake cases are in
test_cache_cluster.py). Every request checks the bytes of its hit pages after poisoning free L1."""

from __future__ import annotations

import random
import threading
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from l2core import ops
from l2core.spec import ConfigError
from l2core.transfer import TransferError
from l3pool.cache import L1, BackgroundError, CacheConfig, CacheError, CacheFull, GhostList, TieredCache, UnknownRequest
from l3pool.pool.prefetch import Prefetcher, PrefetchHandle

from ..cache_helpers import LAYERS, SPEC, Engine, P, chain, contents
from ..fake_store import FakePageStore

# the native extension is built (or loaded) before any test times a copy: a JIT build in the
# shared cache dir (other checkouts rebuild it) took 25-30 s inside a flush() here
pytestmark = pytest.mark.usefixtures("native")

D = SPEC.dim


def mk(engines: list[Engine], **kw: object) -> Engine:
    cfg = kw.pop("cfg", None)
    e = Engine(cfg, **kw)  # type: ignore[arg-type]
    engines.append(e)
    return e


# -- config and bad input -------------------------------------------------------------------------
def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="did you mean 'write_through'"):
        CacheConfig(l1_to_l2="write_trough")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="did you mean 'best_effort'"):
        CacheConfig(prefetch_policy="best-effort")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hit_threshold"):
        CacheConfig(hit_threshold=0)
    with pytest.raises(ConfigError, match="ghost_capacity"):
        CacheConfig(ghost_capacity=-1)
    with pytest.raises(ConfigError, match="prefetch_timeout_s"):
        CacheConfig(prefetch_timeout_s=-0.1)
    with pytest.raises(ConfigError, match="prefetch_max_batch_pages"):
        CacheConfig(prefetch_batch_pages=64, prefetch_max_batch_pages=32)
    with pytest.raises(ConfigError, match=r"unknown cache config key 'hit_treshold' \(did you mean 'hit_threshold'"):
        CacheConfig.from_dict({"hit_treshold": 3})
    c = CacheConfig.from_dict({"l2_to_l3": "write_back", "ghost_capacity": 0})
    assert c.l2_to_l3 == "write_back" and c.ghost_capacity == 0


def test_bad_l1_buffers(engines: list[Engine]) -> None:
    e = mk(engines)
    with pytest.raises(ConfigError, match="dtype"):
        TieredCache(CacheConfig(), L1([b.float() for b in e.bufs], P), e.pool)
    with pytest.raises(ConfigError, match="shape"):
        TieredCache(CacheConfig(), L1([torch.zeros(64, 1, D + 1, dtype=torch.bfloat16)] * LAYERS, P), e.pool)
    with pytest.raises(ConfigError, match="expected 3 device buffers"):
        TieredCache(CacheConfig(), L1(e.bufs[:2], P), e.pool)
    with pytest.raises(ConfigError, match="page_size"):
        TieredCache(CacheConfig(), L1(e.bufs, P * 2), e.pool)
    with pytest.raises(ConfigError, match="CacheConfig"):
        TieredCache({"l1_to_l2": "write_back"}, L1(e.bufs, P), e.pool)  # type: ignore[arg-type]


def test_pp_needs_l3(engines: list[Engine]) -> None:
    e = mk(engines)
    locks = SimpleNamespace(stages=2, stage=0, acquire=None, join=None, report_done=None)  # plays the role
    with pytest.raises(ConfigError, match="pipeline-stage locks need an L3Client"):
        TieredCache(CacheConfig(), L1(e.bufs, P), e.pool, None, locks)  # type: ignore[arg-type]


def test_objects_that_do_not_play_a_role_are_refused_by_name(engines: list[Engine]) -> None:
    e = mk(engines)
    with pytest.raises(ConfigError, match=r"l2 must play the HostPages role .*: dict lacks alloc, allocator, buffer"):
        TieredCache(CacheConfig(), L1(e.bufs, P), {})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"locks must play the StageLockService role .*lacks acquire, join"):
        TieredCache(CacheConfig(), L1(e.bufs, P), e.pool, None, SimpleNamespace(stages=2, stage=0))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"l3 must play the L3Pages role .*lacks .*lookup"):
        TieredCache(CacheConfig(), L1(e.bufs, P), e.pool, SimpleNamespace(pool=e.pool))  # type: ignore[arg-type]


def test_load_handle(engines: list[Engine]) -> None:
    store = FakePageStore()
    w = mk(engines, store=store)
    hs = chain(1, 6)
    w.run("w", hs)
    w.cache.flush()
    e = mk(engines, l1_pages=16, l2_pages=32, store=store, cfg=CacheConfig(prefetch_policy="wait_complete"))
    e.run("a", hs[:2])
    for i in range(4):  # hs[:2] leaves L1 for L2
        e.run(f"f{i}", chain(10 + i, 4))
    e.run("b", hs[:1])  # hs[0] back in L1
    full = chain(2, 2, prefix=hs)
    _, h = e.start("c", full)
    assert (h.l1, h.l2, h.l3, h.hit_pages) == (1, 1, 4, 6) and len(h.l1_pages) == 8
    assert h.loaded_bytes == 5 * SPEC.page_bytes and h.l3_wait_s > 0
    assert torch.equal(h.slots, e.cache.slots(h.l1_pages)) and h.slots.numel() == 8 * P
    h.wait()
    assert h.wait_s > 0
    assert torch.equal(e.l1_of(h.l1_pages[:6]), contents(hs))
    e.compute(full[6:], h.l1_pages[6:])
    e.cache.commit("c", full, h.l1_pages)
    h.wait_layer(LAYERS - 1)  # the job was collected by commit: still answers
    e.cache.release("c")
    with pytest.raises(UnknownRequest):
        h.wait_layer(0)
    assert e.used() == (0, 0)


def test_bad_requests(engines: list[Engine]) -> None:
    e = mk(engines, l1_pages=8)
    c = e.cache
    hs = chain(0, 4)
    for call in (lambda: c.release("nope"), lambda: c.alloc_l1("nope", 1), lambda: c.commit("nope", hs, [0])):
        with pytest.raises(UnknownRequest, match="unknown request id 'nope'"):
            call()
    with pytest.raises(ValueError, match="request_id"):
        c.match("", hs)
    with pytest.raises(ValueError, match="page_hashes"):
        c.match("r", ["ab" * 8])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="repeat a hash"):
        c.match("r", hs + hs[:1])
    m = c.match("r", hs)
    with pytest.raises(CacheError, match="already active"):
        c.match("r", hs)
    with pytest.raises(CacheError, match="load\\(\\) before commit"):
        c.commit("r", hs, [0, 1, 2, 3])
    h = c.load(m, total_pages=4)
    with pytest.raises(CacheError, match="already loaded"):
        c.load(m)
    with pytest.raises(ValueError, match="only 3 L1 pages"):
        c.commit("r", hs, h.l1_pages[:3])
    foreign = c.alloc_l1("r", 1)
    c2 = c.match("other", chain(9, 2))
    h2 = c.load(c2, total_pages=2)
    with pytest.raises(ValueError, match="not allocated to request 'r'"):
        c.commit("r", hs, np.concatenate([h.l1_pages[:3], h2.l1_pages[:1]]))
    with pytest.raises(IndexError, match="out of range"):
        c.commit("r", hs, [0, 1, 2, 99])
    with pytest.raises(TypeError, match="integers"):
        c.commit("r", hs, np.zeros(4, dtype=np.float32))
    with pytest.raises(CacheFull, match="L1 full: need 9 pages"):
        c.alloc_l1("r", 9)
    c.release("r")
    c.release("other")
    assert foreign.size == 1 and e.used() == (0, 0)
    assert c.stats()["l1_pages"]["pinned"] == 0


# -- tiers, bytes, LRU ----------------------------------------------------------------------------
def test_hits_move_the_right_bytes_through_every_tier(engines: list[Engine]) -> None:
    store = FakePageStore()
    a = mk(engines, l1_pages=8, l2_pages=64, store=store)
    hs = chain(1, 6)
    assert a.run("a1", hs).hit_pages == 0
    assert a.run("a2", hs).l1 == 6  # L1 hit
    for i in range(3):  # evict hs from L1 (8 pages): they stay in L2
        a.run(f"fill{i}", chain(100 + i, 4))
    m = a.run("a3", chain(2, 2, prefix=hs))
    assert (m.l1, m.l2) == (0, 6)
    a.cache.flush()
    assert len(store.objects) == 6 + 12 + 2  # write_through everywhere
    b = mk(engines, l1_pages=8, l2_pages=64, store=store, cfg=CacheConfig(prefetch_policy="wait_complete"))
    m = b.run("b1", chain(3, 2, prefix=hs[:4]))
    assert (m.l1, m.l2, m.l3) == (0, 0, 4)
    st = b.cache.stats()
    assert st["hit_pages"]["l3"] == 4 and st["hit_bytes"]["l3"] == 4 * SPEC.page_bytes
    assert set(st["api_s"]) == {"match", "prefetch", "load", "commit", "release"}
    assert all(v > 0 for v in st["api_s"].values())
    assert a.used() == b.used() == (0, 0)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_every_l2_layout(engines: list[Engine], layout: str) -> None:
    store = FakePageStore()
    a = mk(engines, l1_pages=8, store=store, layout=layout)
    hs = chain(1, 6)
    a.run("a", hs)
    a.run("f", chain(2, 6))  # hs leaves L1
    assert a.run("b", hs).l2 == 6  # bytes checked after poisoning free L1 and L2 pages
    a.cache.flush()
    b = mk(engines, store=store, layout=layout, cfg=CacheConfig(prefetch_policy="wait_complete"))
    assert b.run("c", hs).l3 == 6
    assert a.used() == b.used() == (0, 0)


def test_lru_evicts_least_recently_used(engines: list[Engine]) -> None:
    e = mk(engines, l1_pages=8, cfg=CacheConfig(l1_to_l2="write_back"))
    x, y = chain(1, 4), chain(2, 4)
    e.run("x", x)
    e.run("y", y)
    e.run("x2", x)  # x is now the most recently used
    e.run("z", chain(3, 4))  # evicts y
    assert e.cache.match("q", x).l1 == 4
    e.cache.release("q")
    m = e.cache.match("q2", y)
    assert (m.l1, m.l2) == (0, 4)  # write_back wrote y to L2 when it was evicted
    e.cache.release("q2")
    assert e.cache.stats()["evictions"]["l1"] == 4


def test_write_back_writes_on_eviction_only(engines: list[Engine]) -> None:
    store = FakePageStore()
    e = mk(engines, l1_pages=8, l2_pages=8, store=store, cfg=CacheConfig(l1_to_l2="write_back", l2_to_l3="write_back"))
    a = chain(1, 4)
    e.run("a", a)
    e.run("a2", a)
    e.cache.flush()
    st = e.cache.stats()
    assert st["d2h_bytes"] == 0 and st["l1_to_l2_writes"] == {} and not store.objects
    e.run("b", chain(2, 4))
    e.run("c", chain(3, 4))  # evicts a from L1 -> written to L2
    e.cache.flush()
    st = e.cache.stats()
    assert st["l1_to_l2_writes"] == {"back": 4} and st["l2_to_l3_writes"] == {} and not store.objects
    for i in range(3):  # L2 (8 pages) fills up: a leaves L2 -> written to L3
        e.run(f"f{i}", chain(10 + i, 4))
    e.cache.flush()
    st = e.cache.stats()
    assert st["l2_to_l3_writes"].get("back", 0) >= 4 and st["evictions"]["l2"] >= 4
    assert all(k in store.objects for k in e.l3.ns.keys(a))  # type: ignore[union-attr]
    m = e.run("a3", a)
    assert m.l3 == 4  # and the bytes came back right (checked in run)


def test_selective_counts_distinct_requests_not_insertions(engines: list[Engine]) -> None:
    """Failure mode 1: PD prefill inserts a request twice (unfinished, then finished). Counting
    insertions would reach threshold 2 and silently turn selective into write-through."""
    cfg = CacheConfig(l1_to_l2="write_through_selective", l2_to_l3="write_through_selective", hit_threshold=2)
    store = FakePageStore()
    e = mk(engines, store=store, cfg=cfg)
    hs = chain(1, 6)
    _, h = e.start("a", hs)
    e.compute(hs, h.l1_pages)
    e.cache.commit("a", hs[:4], h.l1_pages)  # unfinished
    e.cache.commit("a", hs, h.l1_pages)  # finished: same request again
    e.cache.release("a")
    e.cache.flush()
    assert e.cache.stats()["d2h_bytes"] == 0, "one request inserted twice counted as two"
    e.run("b", hs)  # a second, distinct request: proven reuse
    e.cache.flush()
    st = e.cache.stats()
    assert st["l1_to_l2_writes"] == {"selective": 6} and st["l2_to_l3_writes"] == {"selective": 6}
    assert len(store.objects) == 6


def _ghost_scenario(engines: list[Engine], ghost: int) -> tuple[int, dict[str, object], int]:
    cfg = CacheConfig(l1_to_l2="write_through_selective", l2_to_l3="write_through_selective", hit_threshold=2,
                      ghost_capacity=ghost)  # fmt: skip
    store = FakePageStore()
    e = mk(engines, l1_pages=8, l2_pages=64, cfg=cfg, store=store)
    hs = chain(1, 4)
    e.run("a", hs)  # computed once: not written (count 1)
    for i in range(4):  # the gap is longer than L1 residence: hs leaves L1
        e.run(f"gap{i}", chain(50 + i, 4))
    assert e.run("b", hs).hit_pages == 0  # rebuilt
    e.cache.flush()  # its backup (if any) is done: nothing pins it in L1
    for i in range(4):
        e.run(f"gap2{i}", chain(60 + i, 4))
    e.cache.flush()
    m = e.run("c", hs)
    return m.l2, e.cache.stats(), len(store.objects)


def test_ghost_list_rescues_reuse_beyond_l1_residence(engines: list[Engine]) -> None:
    """Failure mode 2: without a ghost list a reused prefix evicted from L1 before its second use
    is never proven (its count died with the L1 page) and never reaches L2."""
    hit_without, st0, l3_without = _ghost_scenario(engines, ghost=0)
    assert hit_without == 0 and st0["ghost_hits"] == 0 and st0["d2h_bytes"] == 0 and l3_without == 0
    hit_with, st1, l3_with = _ghost_scenario(engines, ghost=1024)
    assert hit_with == 4 and st1["ghost_hits"] == 4 and st1["l1_to_l2_writes"] == {"ghost": 4}
    assert l3_with == 4 and st1["l2_to_l3_writes"] == {"selective": 4}  # proven reuse goes on to L3


def test_ghost_list_bounded_o1_and_small() -> None:
    g = GhostList(4)
    g.add([1, 2, 3])
    g.add([3, 4, 5])  # 3 already present: no-op; 1 leaves
    assert len(g) == 4 and 1 not in g and all(k in g for k in (2, 3, 4, 5))
    g.add(list(range(100, 110)))
    assert len(g) == 4 and set(range(106, 110)) == {k for k in range(100, 110) if k in g}
    assert GhostList(0).leading([1]) == 0
    n = 200_000
    keys = np.random.default_rng(0).integers(1, 1 << 63, n, dtype=np.int64).astype(np.uint64)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    g = GhostList(n)
    for b in range(0, n, 512):
        g.add(keys[b : b + 512])
    # what Python still holds (tracemalloc) plus what the native ring and set allocated (nbytes:
    # tracemalloc cannot see C++ allocations)
    per = (tracemalloc.get_traced_memory()[0] - before + g.nbytes()) / n
    tracemalloc.stop()
    assert len(g) == n and per <= 100, f"{per:.0f} B per ghost entry"  # measured 29 B (8 ring + 21 set)
    assert g.nbytes() >= n * 8 * 2  # the ring and a set at most half full: an honest count
    t0 = time.perf_counter()
    for b in range(0, 20 * 512, 512):  # add at capacity: O(batch), not O(capacity)
        g.add(list(range(10**12 + b, 10**12 + b + 512)))
    assert (time.perf_counter() - t0) / 20 < 0.05  # O(batch), not O(capacity)


# -- concurrency ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "l1_to_l2,l2_to_l3,prefetch",
    [
        ("write_through", "write_through", "best_effort"),
        ("write_back", "write_back", "wait_complete"),
        ("write_through_selective", "write_through", "timeout"),
    ],
)
def test_pinned_pages_never_evicted_under_concurrent_requests(
    engines: list[Engine], l1_to_l2: str, l2_to_l3: str, prefetch: str
) -> None:
    """4 threads, shared prefixes, L1 and L2 far too small for the working set: every hit's bytes
    are checked (a page evicted and reused while pinned would show foreign bytes)."""
    store = FakePageStore()
    cfg = CacheConfig(l1_to_l2=l1_to_l2, l2_to_l3=l2_to_l3, prefetch_policy=prefetch, hit_threshold=2,  # type: ignore[arg-type]
                      prefetch_timeout_s=0.01)  # fmt: skip
    e = mk(engines, l1_pages=24, l2_pages=24, store=store, cfg=cfg)
    roots = [chain(s, 3) for s in range(6)]
    errors: list[BaseException] = []
    full = 0
    lock = threading.Lock()

    def worker(w: int) -> None:
        nonlocal full
        rnd = random.Random(w)
        for i in range(25):
            hs = chain(1000 * w + i, rnd.randint(0, 2), prefix=rnd.choice(roots))
            try:
                e.run(f"w{w}-{i}", hs)
            except CacheFull:
                with lock:
                    full += 1
                e.cache.release(f"w{w}-{i}")
            except BaseException as ex:
                errors.append(ex)
                return

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors[0]
    e.cache.flush()
    st = e.cache.stats()
    assert st["active_requests"] == 0 and st["l1_pages"]["pinned"] == 0 and st["l2_pages"]["pinned"] == 0
    assert st["hit_pages"]["l1"] + st["hit_pages"]["l2"] + st["hit_pages"]["l3"] > 50
    assert st["evictions"]["l1"] > 0 and st["errors"] == 0
    assert e.used() == (0, 0)


# -- prefetch -------------------------------------------------------------------------------------
def _l3_writer(engines: list[Engine], store: FakePageStore, hs: list[bytes]) -> None:
    w = mk(engines, l1_pages=64, l2_pages=64, store=store)
    w.run("writer", hs)
    w.cache.flush()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies(engines: list[Engine], policy: str) -> None:
    store = FakePageStore()
    hs = chain(5, 48)
    _l3_writer(engines, store, hs)
    cfg = CacheConfig(prefetch_policy=policy, prefetch_timeout_s=0.15, prefetch_batch_pages=4,  # type: ignore[arg-type]
                      prefetch_max_batch_pages=4)  # fmt: skip
    r = mk(engines, l1_pages=64, l2_pages=64, store=store, cfg=cfg)
    store.get_delay_s = 0.1  # 12 batches of 4 pages: 1.2 s in all
    m = r.cache.match("q", hs)
    assert m.l3 == 48
    r.cache.prefetch(m)
    pf = r.cache.movers.l3_in.prefetcher  # type: ignore[union-attr]
    assert pf is not None
    deadline = time.monotonic() + 5
    while not pf.batch_ms and time.monotonic() < deadline:  # the first batch landed
        time.sleep(0.005)
    t0 = time.perf_counter()
    r.poison_free_l1()
    h = r.cache.load(m, total_pages=len(hs))
    waited = time.perf_counter() - t0
    h.wait()
    n = h.hit_pages
    assert torch.equal(r.l1_of(h.l1_pages[:n]), contents(hs[:n]))
    # interrupt() returns without waiting for a batch still in flight; its pages stay allocated
    # (quarantined) until that get returns, then the prefetcher frees them
    deadline = time.monotonic() + 5
    while pf.quarantined_pages() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pf.quarantined_pages() == 0
    st = r.cache.stats()
    assert st["l2_pages"]["cached"] == n and st["l2_pages"]["total"] - st["l2_pages"]["free"] == n  # tail freed
    if policy == "best_effort":  # stops at once (in-flight batch quarantined), not after all 12 (1.2 s)
        assert 0 < n < 48 and waited < 0.8
        assert st["prefetch_interrupted"] == 1
    elif policy == "wait_complete":
        assert n == 48
    else:  # waits its 150 ms, then interrupts
        assert 0 < n < 48 and waited >= 0.15
    assert r.cache.prefetch(m) is False  # loaded already
    r.compute(hs[n:], h.l1_pages[n:])
    r.cache.commit("q", hs, h.l1_pages)
    r.cache.release("q")
    r.cache.flush()
    assert r.used() == (0, 0)  # the interrupted tail was freed, the prefix is indexed
    assert r.cache.match("again", hs).l1 == 48
    r.cache.release("again")


def test_prefetch_cancelled_by_release_and_l3_errors_are_misses(engines: list[Engine]) -> None:
    store = FakePageStore()
    hs = chain(6, 16)
    _l3_writer(engines, store, hs)
    r = mk(engines, l1_pages=32, l2_pages=32, store=store)
    store.get_delay_s = 0.05
    m = r.cache.match("q", hs)
    r.cache.prefetch(m)
    r.cache.release("q")  # never loaded: the prefetch is cancelled, its pages freed
    r.cache.movers.l3_in.prefetcher.close()  # type: ignore[union-attr]  # joins the worker
    assert r.used() == (0, 0)
    r2 = mk(engines, l1_pages=32, l2_pages=32, store=store, cfg=CacheConfig(prefetch_policy="wait_complete"))
    store.get_delay_s, store.fail_get_after = 0.0, 5  # a transfer failure at page 5 ends the prefix
    assert r2.run("x", hs).l3 == 16 and r2.cache.stats()["hit_pages"]["l3"] == 5
    assert r2.cache.stats()["l3_read_failures"] == 1
    r3 = mk(engines, l1_pages=32, l2_pages=32, store=store, cfg=CacheConfig(prefetch_policy="wait_complete"))
    store.raise_on = {"get"}
    r3.run("y", hs)  # raises inside the prefetch: a miss, computed
    assert r3.cache.stats()["hit_pages"]["l3"] == 0 and r3.cache.stats()["l3_read_failures"] == 1
    store.raise_on = set()
    r2.cache.flush()  # their write-through puts done before presence checks start failing
    r3.cache.flush()
    store.raise_on = {"exists"}
    assert r3.cache.match("z", chain(7, 4)).l3 == 0  # a failed lookup is a miss
    r3.cache.release("z")
    store.raise_on = set()
    assert r2.used() == r3.used() == (0, 0)


def test_prefetch_makes_its_l2_room_when_its_batch_allocates(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch evicts L2 pages for a batch when the batch allocates, under the cache's lock.
    Room made in prefetch() before the worker ran was not reserved: an allocation in between
    took it and the prefetch came up short with evictable pages left (the stress test's PP
    stages then raised PPShortLoad, "lost despite the lock")."""
    store = FakePageStore()
    hs = chain(8, 4)
    _l3_writer(engines, store, hs)
    r = mk(engines, l1_pages=32, l2_pages=8, store=store, cfg=CacheConfig(prefetch_policy="wait_complete"))
    r.run("fill", chain(9, 8))
    r.cache.flush()
    st = r.cache.stats()["l2_pages"]
    assert st["free"] == 0 and st["cached"] == 8 and st["pinned"] == 0  # L2 full of evictable pages
    gate = threading.Event()
    real_run = Prefetcher._run

    def held_run(self: Prefetcher, h: PrefetchHandle) -> None:  # the worker starts late (busy host)
        gate.wait(10)
        real_run(self, h)

    monkeypatch.setattr(Prefetcher, "_run", held_run)
    m = r.cache.match("q", hs)
    assert m.l3 == 4 and r.cache.prefetch(m)
    taken = r.pool.alloc(r.pool.stats().free_pages)  # another allocation before the worker runs
    gate.set()
    h = r.cache.load(m, total_pages=4)
    h.wait()
    assert h.l3 == 4 and torch.equal(r.l1_of(h.l1_pages), contents(hs)), (h.l3, len(taken))
    r.pool.free(taken)
    r.cache.commit("q", hs, h.l1_pages)
    r.cache.release("q")
    assert r.cache.stats()["evictions"]["l2"] == 4 and r.used() == (0, 0)


# -- injected errors: no leaks ------------------------------------------------------------------
def _fail_transfer(monkeypatch: pytest.MonkeyPatch, to_host: bool) -> None:
    real = ops.transfer

    def bad(*a: object, **kw: object) -> object:
        if kw.get("to_host") == to_host:
            raise RuntimeError("injected transfer failure")
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "transfer", bad)


def test_load_thread_error(engines: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    e = mk(engines, l1_pages=8, l2_pages=16)
    hs = chain(1, 4)
    e.run("a", hs)
    for i in range(2):
        e.run(f"f{i}", chain(10 + i, 4))  # hs now only in L2
    _fail_transfer(monkeypatch, to_host=False)
    m, h = e.start("b", hs)
    assert m.l2 == 4
    with pytest.raises(TransferError, match="injected"):
        h.wait_layer(0)
    with pytest.raises(TransferError, match="not inserted"):
        e.cache.commit("b", hs, h.l1_pages)
    e.cache.release("b")
    assert e.used() == (0, 0) and e.cache.stats()["l1_pages"]["pinned"] == 0
    monkeypatch.undo()
    assert e.run("c", hs).l2 == 4


def test_backup_thread_error(engines: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    e = mk(engines, l1_pages=8, l2_pages=16)
    _fail_transfer(monkeypatch, to_host=True)
    e.run("a", chain(1, 4))
    with pytest.raises(BackgroundError, match=r"L1 -> L2 backup of 4 pages failed.*injected"):
        e.cache.flush()
    st = e.cache.stats()
    assert st["errors"] == 1 and st["l2_pages"]["cached"] == 0 and st["l1_pages"]["pinned"] == 0
    assert e.used() == (0, 0) and e.pool.allocator.used_pages == 0
    e.cache.flush()  # reported once


def test_write_back_eviction_error(engines: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    e = mk(engines, l1_pages=8, l2_pages=16, cfg=CacheConfig(l1_to_l2="write_back"))
    e.run("a", chain(1, 4))
    _fail_transfer(monkeypatch, to_host=True)
    e.run("b", chain(2, 4))
    e.run("c", chain(3, 4))  # evicts a: its synchronous write-back fails
    with pytest.raises(BackgroundError, match="write-back failed"):
        e.cache.flush()
    st = e.cache.stats()
    assert st["evictions"]["l1"] == 4 and st["l2_pages"]["cached"] == 0 and e.pool.allocator.used_pages == 0
    assert e.used() == (0, 0)


def test_writer_error(engines: list[Engine]) -> None:
    store = FakePageStore()
    e = mk(engines, store=store)
    store.raise_on = {"put"}  # the put itself raises
    e.run("a", chain(1, 4))
    with pytest.raises(BackgroundError, match="L2 -> L3 put of 4 pages failed"):
        e.cache.flush()
    st = e.cache.stats()
    assert st["l3_put_failed"] == 4 and st["l2_pages"]["pinned"] == 0 and e.used() == (0, 0)
    store.raise_on = set()
    e.run("b", chain(2, 4))
    e.cache.flush()
    assert len(store.objects) == 4


def test_writer_coalesces_requests(engines: list[Engine]) -> None:
    store = FakePageStore()
    e = mk(engines, l1_pages=64, l2_pages=64, store=store, cfg=CacheConfig(writer_linger_ms=200))
    for i in range(8):
        e.run(f"r{i}", chain(i, 4))
    e.cache.flush()
    st = e.cache.stats()
    assert len(store.objects) == 32 and st["l2_to_l3_writes"] == {"through": 32}
    assert st["writer_puts"] <= 3, f"{st['writer_puts']} puts for 8 requests"


def test_l2_full_of_pinned_pages_skips_backups(engines: list[Engine]) -> None:
    e = mk(engines, l1_pages=16, l2_pages=4)
    e.run("a", chain(1, 4))
    e.cache.flush()
    with e.cache._mu:  # every L2 page in use (as by requests loading from them)
        held = np.flatnonzero(e.cache.t2.cached)
        e.cache.t2.pin(held)
    assert held.size == 4
    e.run("b", chain(2, 4))  # its backup finds no L2 page to take: skipped, counted, no error
    e.cache.flush()
    st = e.cache.stats()
    assert st["backup_skips"] == {"l3_slow": 0, "l2_pinned": 4} and st["errors"] == 0
    assert st["l2_pages"]["cached"] == 4
    with e.cache._mu:
        e.cache.t2.unpin(held)
    assert e.used() == (0, 0)


def _skips(cause: str) -> float:
    lb = {"cause": cause, "tp_rank": "0", "pp_rank": "0"}  # a lone engine's rank
    return REGISTRY.get_sample_value("l3pool_cache_backup_skipped_pages_total", lb) or 0.0


def test_backups_skipped_while_l3_is_slow_are_counted(engines: list[Engine]) -> None:
    """Pages queued for the L3 writer stay pinned in L2 until their put returns: while L3 is slower
    than the backups they hold L2, and the next backups are skipped: counted as l3_slow, in stats
    and in the metric (they were skipped with a log line only)."""
    store = FakePageStore()
    e = mk(engines, l1_pages=16, l2_pages=4, store=store)
    assert e.l3 is not None
    go = threading.Event()
    real_put = e.l3.put

    def slow_put(keys: list[str], pages: object) -> object:
        go.wait(10)  # L3 does not answer yet
        return real_put(keys, pages)  # type: ignore[arg-type]

    e.l3.put = slow_put  # type: ignore[assignment,method-assign]
    before = _skips("l3_slow"), _skips("l2_pinned")
    try:
        e.run("a", chain(1, 4))  # backed up into all 4 L2 pages, queued for L3: pinned
        deadline = time.monotonic() + 10
        while e.cache.stats()["l2_pages"]["pinned"] < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        e.run("b", chain(2, 4))  # its commit's backup finds every L2 page waiting for L3: skipped
    finally:
        go.set()
    e.cache.flush()
    st = e.cache.stats()
    assert st["backup_skips"] == {"l3_slow": 4, "l2_pinned": 0} and st["errors"] == 0, st["backup_skips"]
    assert (_skips("l3_slow") - before[0], _skips("l2_pinned") - before[1]) == (4, 0)
    assert len(store.objects) == 4 and e.used() == (0, 0)  # a's pages reached L3 once it answered


def test_close_returns_every_page(engines: list[Engine]) -> None:
    e = Engine(l1_pages=8, l2_pages=16, store=FakePageStore())
    e.run("a", chain(1, 4))
    e.cache.match("open", chain(2, 2))  # still active at close
    e.cache.close()
    assert e.cache.plan.l1_alloc.used_pages == 0 and e.pool.allocator.used_pages == 0
    with pytest.raises(CacheError, match="closed"):
        e.cache.match("x", chain(3, 1))
    e.l3.close()  # type: ignore[union-attr]
    e.pool.close()
