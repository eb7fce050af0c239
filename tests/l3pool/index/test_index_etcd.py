"""The global index against a real etcd (and, end to end, real TieredCaches over a real
mooncake_master): instances register their event endpoints under leases; an instance killed with
SIGKILL loses its entries once its lease ends; a restarted index rebuilds from snapshots; a pool
member leaving drops the L3 hints; two caches' requests give the prefixes their tiers hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from l3pool.cache import CacheConfig
from l3pool.cache.events import KvEventPublisher
from l3pool.index.client import IndexClient
from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.index.types import TierPrefix
from l3pool.pool.keys import hash_keys
from l3pool.pool.metadata import Metadata
from l3pool.pool.store import MooncakeStore
from l3pool.procenv import python_env

from ..cache_helpers import Engine, chain
from ..conftest import EtcdServer, MasterServer, wait_for
from ..pool_helpers import master_store

pytestmark = pytest.mark.usefixtures("native")


def _service(md: Metadata) -> IndexService:
    return IndexService(GlobalIndex(100_000), metadata=md, poll_s=0.2, snapshot_timeout_s=1.0, retry_s=0.2).start()


_CHILD = r"""
import sys, time, numpy as np
from l3pool.cache.events import KvEventPublisher
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.metadata import Metadata
pub = KvEventPublisher("child", "ns", heartbeat_s=0.2)
pub.bind(lambda under_lock: (under_lock(), {"l1": np.arange(1, 11, dtype=np.uint64)})[1])
pub.register(Metadata(EtcdClient(sys.argv[1]), sys.argv[2]), ttl=2)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_killed_instance_vanishes_when_its_lease_ends(md: Metadata, etcd_server: EtcdServer) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, etcd_server.endpoints, md.prefix],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env(), start_new_session=True,
    )  # fmt: skip
    svc = _service(md)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert svc.wait_live(["child"], 15)
        keys = np.arange(1, 11, dtype=np.uint64)
        assert svc.index.query(keys, "ns").of("child") == TierPrefix(10, 10, 10)
        assert "child" in md.kv_sources()
        t0 = time.monotonic()
        os.killpg(child.pid, signal.SIGKILL)  # no deregistration: only the lease ends it
        child.wait(10)
        wait_for(lambda: "child" not in svc.status()["instances"], 15, "the index to agree")
        # out of the answers at once; its entries are swept in parts right after (table.py), so the
        # count may lag the answers by the sweep (seen: 4 entries left under -n 4)
        assert svc.index.query(keys, "ns").per_instance == {}
        wait_for(lambda: svc.index.stats()["entries"] == 0, 5, "the instance's entries to be swept")
        gone = time.monotonic() - t0
        assert gone < 6, f"entries outlived the 2 s lease by {gone:.1f} s"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        svc.close()


def test_index_restart_rebuilds_from_snapshots_and_member_loss_clears_l3(md: Metadata) -> None:
    pubs = [KvEventPublisher(f"p{i}", "ns", heartbeat_s=0.2) for i in range(2)]
    state = {"p0": np.arange(1, 21, dtype=np.uint64), "p1": np.arange(1, 6, dtype=np.uint64)}
    try:
        for p in pubs:
            p.bind(lambda under_lock, iid=p.instance: (under_lock(), {"l2": state[iid]})[1])
            p.register(md, ttl=5)
        keys = np.arange(1, 31, dtype=np.uint64)
        svc = _service(md)
        try:
            assert svc.wait_live(["p0", "p1"], 15)
            time.sleep(0.3)
            pubs[0].stored("l3", keys[:25])  # wrote pages to the pool
            wait_for(lambda: svc.index.query(keys, "ns").pool_l3 == 25, 15, "the index to agree")
            before = svc.index.query(keys, "ns")
        finally:
            svc.close()
        assert before.of("p0") == TierPrefix(0, 20, 25) and before.of("p1") == TierPrefix(0, 5, 25)
        svc = _service(md)  # a new index process: nothing until each instance's snapshot came
        try:
            assert svc.index.query(keys, "ns").per_instance == {}
            assert svc.wait_live(["p0", "p1"], 15)
            assert svc.index.query(keys, "ns") == before  # the L3 hints came back with p0's snapshot
            with IndexClient(svc.endpoint) as c:
                assert c.query(keys, "ns") == before
            # a pool member (decode agent) leaves: its pages are gone, which ones is unknown
            lease = md.etcd.lease_grant(30)
            md.etcd.put(md.member_key("agent-0"), "{}", lease=lease)
            time.sleep(0.6)  # seen by a membership poll
            md.etcd.lease_revoke(lease)
            wait_for(lambda: svc.index.query(keys, "ns").pool_l3 == 0, 15, "the index to agree")
            assert svc.index.query(keys, "ns").of("p0") == TierPrefix(0, 20, 20)
        finally:
            svc.close()
    finally:
        for p in pubs:
            p.close()
    assert md.kv_sources() == {}  # close() deregistered them


@pytest.fixture(scope="module")
def store(mooncake_master: MasterServer) -> Iterator[MooncakeStore]:
    s = master_store(mooncake_master, segment_bytes=64 << 20)
    yield s
    s.close()


def _prefix_in(e: Engine, keys: list[int]) -> tuple[int, int]:
    """The engine's own L1 and L1+L2 prefix of `keys`, read from its tier indexes."""
    held = {}
    for tier, t in (("l1", e.cache.t1), ("l2", e.cache.t2)):
        held[tier] = set(t.key64_of(np.flatnonzero(t.cached).astype(np.int64)).tolist())

    def run(*sets: set[int]) -> int:
        n = 0
        for k in keys:
            if not any(k in s for s in sets):
                break
            n += 1
        return n

    return run(held["l1"]), run(held["l1"], held["l2"])


def test_two_caches_publish_and_the_index_answers_their_prefixes(md: Metadata, store: MooncakeStore) -> None:
    cfg = CacheConfig()
    engines = [Engine(cfg, l1_pages=16, l2_pages=24, store=store, tenant=f"e2e-{md.prefix[5:]}") for _ in range(2)]
    pubs: list[KvEventPublisher] = []
    svc = _service(md)
    try:
        ns = engines[0].l3.ns.ns_id  # type: ignore[union-attr]
        assert engines[1].l3.ns.ns_id == ns  # type: ignore[union-attr]
        for i, e in enumerate(engines):
            p = KvEventPublisher(f"e{i}", ns, heartbeat_s=0.2)
            p.attach(e.cache)
            p.register(md, ttl=5)
            pubs.append(p)
        assert svc.wait_live(["e0", "e1"], 15)
        time.sleep(0.3)
        shared = chain(11, 6)
        a = chain(12, 4, shared)  # 10 pages
        b = chain(13, 8, shared[:3])  # 11 pages
        engines[0].run("a", a)
        engines[1].run("b", b)
        for e in engines:
            e.cache.flush()
        for hs in (a, b, chain(14, 5, a)):
            keys = hash_keys(hs).tolist()
            want = {f"e{i}": _prefix_in(e, keys) for i, e in enumerate(engines)}

            def agrees(hs: list[bytes] = hs, want: dict[str, tuple[int, int]] = want) -> bool:
                h = svc.index.query(hs, ns)
                return all((h.of(n).l1, h.of(n).l2) == w for n, w in want.items())

            wait_for(agrees, 10, "the index to agree")
        # the writer's puts are reported after flush
        wait_for(lambda: svc.index.query(a, ns).pool_l3 == 10, 10, "the index to agree")
        h = svc.index.query(a, ns)
        assert (h.of("e0").l1, h.of("e0").l2) == (10, 10)
        assert h.of("e1").l2 == 3
        assert h.pool_l3 == 10 and h.of("e1").l3 == 10  # both wrote to the pool: e1 reaches a's pages there
        # e1 now needs room: its 16-page L1 evicts b's pages, and the index follows
        engines[1].run("c", chain(15, 12))
        engines[1].cache.flush()
        wait_for(
            lambda: svc.index.query(b, ns).of("e1").l1 == _prefix_in(engines[1], hash_keys(b).tolist())[0],
            10,
            "the index to agree",
        )
        st = svc.status()
        assert st["bad_messages"] == 0 and all(st["instances"][f"e{i}"]["live"] for i in range(2))
        lag = st["event_lag_ms"]
        assert lag["samples"] > 0 and 0 <= lag["p50"] <= lag["p99"] < 2000  # queued -> applied, this loaded VM
    finally:
        svc.close()
        for p in pubs:
            p.close()
        for e in engines:
            e.close()


def test_malformed_registrations_are_skipped(md: Metadata) -> None:
    md.etcd.put(md.kv_source_key("junk"), "not json")
    md.etcd.put(md.kv_source_key("half"), '{"id": "half", "events": ""}')
    pub = KvEventPublisher("good", "ns", heartbeat_s=0.2)
    try:
        pub.register(md, ttl=5)
        assert set(md.kv_sources()) == {"good"}
        svc = _service(md)
        try:
            assert svc.wait_live(["good"], 15)
            assert set(svc.status()["instances"]) == {"good"}
        finally:
            svc.close()
    finally:
        pub.close()
    with pytest.raises(ValueError, match="instance id"):
        md.kv_source_key("bad/id")


def test_concurrent_requests_leave_the_index_equal_to_the_cache() -> None:
    """4 threads run requests on one cache (evicting all the time); its events, queued under the
    cache's lock, keep their order: afterwards the index holds exactly the cache's tiers."""
    import threading

    e = Engine(CacheConfig(), l1_pages=40, l2_pages=64)  # 4 requests of 7 pages pinned at once fit
    pub = KvEventPublisher("conc", "ns", heartbeat_s=0.2)
    svc = IndexService(GlobalIndex(10_000), snapshot_timeout_s=1.0, retry_s=0.2).start()
    try:
        pub.attach(e.cache)
        svc.set_sources({"conc": pub.info()})
        assert svc.wait_live(["conc"], 10)
        base = chain(40, 4)
        errors: list[BaseException] = []

        def worker(w: int) -> None:
            try:
                for j in range(12):
                    e.run(f"w{w}-{j}", chain(100 * w + j, 3, base if j % 2 else None))
            except BaseException as ex:  # reported below
                errors.append(ex)

        ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        e.cache.flush()
        held = {}
        for tier, t in (("l1", e.cache.t1), ("l2", e.cache.t2)):
            held[tier] = t.key64_of(np.flatnonzero(t.cached).astype(np.int64))

        # every event sent and applied (equal counts alone could be a last [remove x, store y] not yet
        # applied), and still so a heartbeat later (a batch taken from the queue but not yet numbered)
        def drained() -> bool:
            return pub.stats()["queued_pages"] == 0 and svc.status()["instances"]["conc"]["seq"] == pub.stats()["seq"]

        wait_for(lambda: drained() and (time.sleep(0.3) or drained()), 10, "the index to agree")
        counts = svc.index.stats()["instances"]["conc"]
        assert (counts["l1_pages"], counts["l2_pages"]) == (len(held["l1"]), len(held["l2"]))
        for tier, keys in held.items():
            if len(keys):
                h = svc.index.query(keys, "ns").of("conc")  # every page the cache holds is indexed in its tier
                assert (h.l1 if tier == "l1" else h.l2) == len(keys), tier
        assert svc.status()["instances"]["conc"]["gaps"] == 0 and pub.stats()["dropped_ops"] == 0
    finally:
        svc.close()
        pub.close()
        e.close()
