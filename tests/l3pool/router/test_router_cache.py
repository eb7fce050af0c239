"""A routing decision carried out on real caches: the spill target's prefetch order goes through
the cache's match/prefetch path and lands in L2 before the request's L1 load (best_effort: the
load interrupts whatever has not arrived, so a late prefetch would show as fewer L3 pages)."""

from __future__ import annotations

from l3pool.cache import CacheConfig
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.router import PrefetchOrder, Router

from ..cache_helpers import SPEC, Engine, P, chain
from ..fake_store import FakePageStore


def test_a_spill_prefetch_order_lands_before_the_request_runs(engines: list[Engine]) -> None:
    store = FakePageStore()
    cfg = CacheConfig(prefetch_policy="best_effort")
    a = Engine(cfg, l1_pages=16, l2_pages=32, store=store)
    b = Engine(cfg, l1_pages=16, l2_pages=32, store=store, tenant="t")
    engines.extend([a, b])
    hs = chain(7, 8)
    a.run("warm", hs)  # a computes the prefix; write_through puts it in L3
    a.cache.flush()
    n = len(hs)
    hits = PrefixHits(pages=n, pool_l3=n, per_instance={"a": TierPrefix(n, n, n), "b": TierPrefix(0, 0, n)})
    r = Router("cache_aware", ["a", "b"], page_size=P, page_bytes=SPEC.page_bytes)
    r.add_load("a", "busy", work_s=5.0)  # a holds the prefix but is busy
    d = r.route("q", n * P + 1, hits)
    assert (d.instance, d.reason) == ("b", "spill")
    order = d.prefetch
    assert order == PrefetchOrder("b", 0, n)
    # carried out on b: match + prefetch at once, queued for a while, then load (bytes checked)
    m = b.run("q", hs, think_s=0.3)
    assert m.l3 == order.pages  # the match found every ordered page in L3
    st = b.cache.stats()
    assert st["hit_pages"]["l3"] == order.pages  # and every one arrived before the load began
    assert st["prefetch_interrupted"] == 0 and st["moved_bytes"]["l3"] == order.pages * SPEC.page_bytes
    # the router reads b's measured L3 rate from those counters
    r.observe("b", st)
    assert r.instances["b"].bw["l3"].measured
    r.finished("q")
    r.finished("busy")
    assert r.queued_s("a") == r.queued_s("b") == 0
