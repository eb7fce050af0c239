"""The cache's per-tier moved bytes and seconds (what a router's measured bandwidth reads)."""

from __future__ import annotations

from l3pool.cache import CacheConfig
from l3pool.router import InstanceModel

from ..cache_helpers import SPEC, Engine, chain
from ..fake_store import FakePageStore


def test_moved_bytes_and_seconds_count_each_tiers_copies(engines: list[Engine]) -> None:
    store = FakePageStore()
    a = Engine(None, l1_pages=8, l2_pages=64, store=store)  # type: ignore[arg-type]
    engines.append(a)
    hs = chain(1, 6)
    a.run("a1", hs)
    assert a.cache.stats()["moved_bytes"] == {"l2": 0, "l3": 0}  # nothing loaded yet
    a.run("a2", hs)  # an L1 hit moves nothing
    assert a.cache.stats()["moved_bytes"] == {"l2": 0, "l3": 0}
    for i in range(3):  # hs leaves L1, stays in L2
        a.run(f"fill{i}", chain(100 + i, 4))
    assert a.run("a3", hs).l2 == 6
    st = a.cache.stats()
    assert st["moved_bytes"] == {"l2": 6 * SPEC.page_bytes, "l3": 0}
    assert st["moved_s"]["l2"] > 0 and st["moved_s"]["l3"] == 0
    a.cache.flush()
    b = Engine(CacheConfig(prefetch_policy="wait_complete"), l1_pages=8, l2_pages=64, store=store)
    engines.append(b)
    assert b.run("b1", hs[:4] + chain(3, 2, prefix=hs[:4])[4:]).l3 == 4
    st = b.cache.stats()
    # the L3 pages came L3 -> L2 (prefetch), then L2 -> L1 (load)
    assert st["moved_bytes"] == {"l2": 4 * SPEC.page_bytes, "l3": 4 * SPEC.page_bytes}
    assert st["moved_s"]["l2"] > 0 and st["moved_s"]["l3"] > 0
    m = InstanceModel("b")
    m.observe(st)  # a router reads the counters as they are
    assert m.bw["l3"].measured and m.bw["l3"].bps == st["moved_bytes"]["l3"] / st["moved_s"]["l3"]
