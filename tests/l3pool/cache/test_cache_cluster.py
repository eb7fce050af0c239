"""TieredCache against real etcd + mooncake_master (conftest fixtures; an in-process Mooncake
client donates the segment): real bytes through L3 after poisoning the destinations, and PP stages
that load equal page counts under StageLocks."""

from __future__ import annotations

import uuid

import pytest

from l3pool.cache import CacheConfig, PPShortLoad
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.keys import Namespace
from l3pool.pool.metadata import Metadata
from l3pool.pool.pplock import StageLocks
from l3pool.pool.store import MooncakeStore, Outcome

from ..cache_helpers import LAYERS, SPEC, Engine, chain
from ..conftest import EtcdServer

# the native extension is built (or loaded) before any test times a copy: a JIT build in the
# shared cache dir (other checkouts rebuild it) took 25-30 s inside a flush() here
pytestmark = pytest.mark.usefixtures("native")


def test_l3_round_trip_real_bytes(store: MooncakeStore, engines: list[Engine]) -> None:
    tenant = uuid.uuid4().hex
    w = Engine(store=store, tenant=tenant, cfg=CacheConfig(writer_linger_ms=20))
    engines.append(w)
    hs = chain(1, 12)
    w.run("w", hs)
    w.run("w2", chain(2, 4))
    w.cache.flush()
    st = w.cache.stats()
    assert st["l2_to_l3_writes"] == {"through": 16} and st["l3_put_bytes"] == 16 * SPEC.page_bytes
    assert st["l3_client"]["bytes_put"] == 16 * SPEC.page_bytes
    r = Engine(store=store, tenant=tenant, l1_pages=32, l2_pages=32, cfg=CacheConfig(prefetch_policy="wait_complete"))
    engines.append(r)
    q = chain(3, 3, prefix=hs[:10])
    m = r.run("r", q)  # bytes of every hit page checked after poisoning free L1 and L2
    assert (m.l1, m.l2, m.l3) == (0, 0, 10)
    assert r.cache.stats()["hit_bytes"]["l3"] == 10 * SPEC.page_bytes
    assert r.run("r2", q).l1 == 13
    assert r.used() == w.used() == (0, 0)


def test_pp_stages_load_equal_page_counts(
    store: MooncakeStore, etcd_server: EtcdServer, prefix: str, engines: list[Engine]
) -> None:
    tenant = uuid.uuid4().hex
    stages = [(0, LAYERS), (LAYERS, 2 * LAYERS)]
    nss = [Namespace.for_pool(SPEC, "page_first_direct", "cachetest", layers=lr, tenant=tenant) for lr in stages]
    hs = chain(7, 8)
    for s, lr in enumerate(stages):  # writers: every stage's pages in L3
        w = Engine(store=store, tenant=tenant, layers=lr)
        engines.append(w)
        w.run(f"w{s}", hs)
        w.cache.flush()
    # stage 1 lost page 5 (forced: the put's completeness check leased it): common prefix 5
    assert store.remove(nss[1].keys(hs)[5], force=True) is Outcome.OK
    md = Metadata(EtcdClient(etcd_server.endpoints), prefix)
    locks = [StageLocks(md, store, nss, s, ttl=5, refresh_s=1.0) for s in range(2)]
    try:
        cfg = CacheConfig(l2_to_l3="write_back")  # readers do not put page 5 back (their L2 never evicts)
        rd = [Engine(cfg, store=store, tenant=tenant, layers=lr, locks=locks[s]) for s, lr in enumerate(stages)]
        engines.extend(rd)
        rd[0].run("warm", hs[:7], release=True)  # stage 0 alone would now hold 7 pages in L1
        rd[1].run("warm", hs[:7])
        assert rd[0].cache.match("peek", hs).l1 == 5  # a lock for "peek" too: the lock's length wins
        rd[0].cache.release("peek")  # stage 1 never joins "peek": its lock expires by itself
        ms = [e.run("q", hs) for e in rd]
        assert [m.hit_pages for m in ms] == [5, 5], ms
        assert ms[0].l1 == 5 and ms[1].l1 == 5
        assert locks[0].lock_info("q") is None  # released after both stages loaded
        st = [e.cache.stats() for e in rd]
        assert st[0]["hit_pages"]["l3"] == st[1]["hit_pages"]["l3"] == 5  # "warm": the locked 5 from L3
        assert all(s["pp_short"] == 0 and s["errors"] == 0 for s in st)
        assert all(e.used() == (0, 0) for e in rd)
        # stage 1 loses a locked page on the way (its get of it fails): it must not go on shorter
        real_get = rd[1].l3.get  # type: ignore[union-attr]

        def short_get(keys: list[str], pages: object) -> list[Outcome]:
            out = real_get(keys[:2], pages[:2])  # type: ignore[index]
            return out + [Outcome.TRANSFER_FAIL] * (len(keys) - 2)

        fresh = chain(8, 6)
        for s, lr in enumerate(stages):
            w = Engine(store=store, tenant=tenant, layers=lr)
            engines.append(w)
            w.run(f"w2{s}", fresh)
            w.cache.flush()
        assert rd[0].run("f", fresh).l3 == 6
        rd[1].l3.get = short_get  # type: ignore[union-attr,method-assign]
        m = rd[1].cache.match("f", fresh)
        assert m.l3 == 6
        with pytest.raises(PPShortLoad, match="got 2 of the 6 locked pages"):
            rd[1].cache.load(m, total_pages=6)
        rd[1].cache.release("f")
        assert rd[1].cache.stats()["pp_short"] == 1 and locks[0].lock_info("f") is None
        assert rd[1].used() == (0, 0)
    finally:
        for lk in locks:
            lk.close()
        md.etcd.close()
