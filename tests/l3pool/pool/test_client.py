"""L3 client against the real local cluster: etcd, mooncake_master, 2 decode agents (own network
namespaces when root). Real bytes, real processes; every test is bounded in time."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from l2core import LAYOUTS, ConfigError, HostKVPool, KVSpec
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client, key_digest
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.keys import FORMAT_VERSION, Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig, StoreUnavailable
from l3pool.pool.trailer import FLAG_CHECKSUM, TRAILER, TRAILER_BYTES, TRAILER_MAGIC

from ..pool_helpers import cluster_store, random_keys, random_pool

SPECS = {"mla": KVSpec.mla(6, page_size=16), "mha": KVSpec.mha(4, 2, 64, page_size=16)}


@pytest.mark.parametrize("attention", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_bit_exact(store: MooncakeStore, attention: str, layout: str) -> None:
    spec = SPECS[attention]
    pool = random_pool(spec, layout, 64, hash((attention, layout)) % 1000)
    ns = Namespace.for_pool(spec, layout, "m1", tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns, batch_pages=8)
    try:
        rng = np.random.default_rng(1)
        src = rng.choice(32, size=20, replace=False)
        dst = 32 + rng.choice(32, size=20, replace=False)
        want = [pool.page_bytes_of(int(p)) for p in src]
        keys = random_keys(ns, 20, seed=2)
        assert client.lookup(keys) == 0
        assert client.put(keys, src) == [Outcome.OK] * 20
        assert client.lookup(keys) == 20
        assert client.get(keys, dst) == [Outcome.OK] * 20
        assert [pool.page_bytes_of(int(p)) for p in dst] == want
        assert client.stats.puts == 20 and client.stats.gets == 20 and client.stats.bytes_got == 20 * spec.page_bytes
    finally:
        client.close()
        pool.close()


def test_put_dedupes_and_never_overwrites(store: MooncakeStore) -> None:
    spec = SPECS["mla"]
    pool = random_pool(spec, "page_first_direct", 64, 0)
    ns = Namespace.for_pool(spec, "page_first_direct", "m1", tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns)
    try:
        keys = random_keys(ns, 8, seed=3)
        first = [pool.page_bytes_of(p) for p in range(8)]
        assert client.put(keys, range(8)) == [Outcome.OK] * 8
        assert client.put(keys, range(8, 16)) == [Outcome.OK] * 8  # other bytes, same keys
        assert client.stats.puts == 8 and client.stats.put_skipped == 8
        assert client.get(keys, range(16, 24)) == [Outcome.OK] * 8
        assert [pool.page_bytes_of(p) for p in range(16, 24)] == first
    finally:
        client.close()
        pool.close()


def test_namespaces_isolate_layouts_and_tenants(store: MooncakeStore) -> None:
    spec = SPECS["mha"]
    tenant = uuid.uuid4().hex
    a_pool, b_pool, c_pool = (
        random_pool(spec, "page_first", 64, 0),
        random_pool(spec, "page_first_direct", 64, 9),
        random_pool(spec, "page_first", 64, 5),
    )
    a_ns = Namespace.for_pool(spec, "page_first", "m1", tenant=tenant)
    b_ns = Namespace.for_pool(spec, "page_first_direct", "m1", tenant=tenant)  # same model + tokens
    c_ns = Namespace.for_pool(spec, "page_first", "m1", tenant=tenant + "x")
    a, b = L3Client(a_pool, store, a_ns), L3Client(b_pool, store, b_ns)
    c = L3Client(c_pool, store, c_ns)
    try:
        toks = np.arange(8 * 16)
        hashes = page_hashes(toks, 16)
        assert a.put(a_ns.keys(hashes), range(8)) == [Outcome.OK] * 8
        assert b.lookup(b_ns.keys(hashes)) == 0
        before = b_pool.page_bytes_of(3)
        assert b.get(b_ns.keys(hashes)[:1], [3]) == [Outcome.MISS]
        assert b_pool.page_bytes_of(3) == before  # nothing written on a miss
        assert c.lookup(c_ns.keys(hashes)) == 0
        with pytest.raises(ValueError, match="namespace"):
            b.get(a_ns.keys(hashes), range(8))  # another namespace's keys are refused outright
    finally:
        for x in (a, b, c):
            x.close()
        for p in (a_pool, b_pool, c_pool):
            p.close()


def test_bad_input_and_settings(store: MooncakeStore, cluster: LocalCluster) -> None:
    spec = SPECS["mla"]
    pool = random_pool(spec, "page_first", 64, 0)
    ns = Namespace.for_pool(spec, "page_first", "m1", tenant=uuid.uuid4().hex)
    with pytest.raises(ConfigError, match="layout"):
        L3Client(pool, store, Namespace.for_pool(spec, "layer_first", "m1"))
    with pytest.raises(ConfigError, match="batch_pages"):
        L3Client(pool, store, ns, batch_pages=0)
    with pytest.raises(ConfigError, match="model"):
        Namespace.for_pool(spec, "page_first", "a/b")
    client = L3Client(pool, store, ns)
    try:
        keys = random_keys(ns, 4, seed=4)
        with pytest.raises(ValueError, match="keys"):
            client.put(keys, [0, 1, 2])
        with pytest.raises(IndexError):
            client.put(keys, [0, 1, 2, 10_000])
        with pytest.raises(TypeError):
            client.get(keys, [0.5, 1.0, 2.0, 3.0])
        assert client.stats.puts == 0
    finally:
        client.close()
        pool.close()
    with pytest.raises(ValueError, match="endpoint"):
        EtcdClient("http://[bad")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        MooncakeStore(StoreConfig(master="127.0.0.1:1", metadata=cluster.metadata_url, local_hostname="127.0.0.1"))
    assert time.monotonic() - t0 < 60


def test_dead_agent_pages_become_misses(cluster: LocalCluster) -> None:
    """SIGKILL one donor mid-workload: its pages turn into misses, never errors or wrong bytes,
    and it leaves membership within the lease TTL. Runs on its own cluster (destructive)."""
    with LocalCluster(agents=2, segment_size="128MB", name=f"l3pk{uuid.uuid4().hex[:4]}", lease_ttl=3) as c:
        st = cluster_store(c)
        spec = SPECS["mla"]
        pool = random_pool(spec, "page_first_direct", 128, 0)
        ns = Namespace.for_pool(spec, "page_first_direct", "m1", tenant=uuid.uuid4().hex)
        client = L3Client(pool, st, ns, batch_pages=16)
        try:
            keys = random_keys(ns, 48, seed=6)
            want = [pool.page_bytes_of(p) for p in range(48)]
            assert client.put(keys, range(48)) == [Outcome.OK] * 48
            victim = c.agents[0]
            c.kill_agent(0, signal.SIGKILL)
            etcd = EtcdClient(c.etcd_endpoints)
            deadline = time.monotonic() + 3 + 5
            while time.monotonic() < deadline and any(
                victim.id in kv.key for kv in etcd.get_prefix(c.key_prefix + "/members/")
            ):
                time.sleep(0.2)
            assert not any(victim.id in kv.key for kv in etcd.get_prefix(c.key_prefix + "/members/"))
            time.sleep(6)  # past the master's client_ttl: the dead donor's segment is unmounted
            res = client.get(keys, range(64, 112))
            assert set(res) <= {Outcome.OK, Outcome.MISS, Outcome.TRANSFER_FAIL}
            assert Outcome.OK in res and any(r is not Outcome.OK for r in res), res
            for i, r in enumerate(res):
                if r is Outcome.OK:
                    assert pool.page_bytes_of(64 + i) == want[i]
            assert client.lookup(keys) < 48
        finally:
            client.close()
            pool.close()
            st.close()


@contextlib.contextmanager
def _small_pool_client(segment: str, layout: str, pages: int) -> Iterator[tuple[MooncakeStore, HostKVPool, L3Client]]:
    """A one-agent cluster donating `segment`, and a client of 590 KB MLA pages (batches of 32)."""
    with LocalCluster(agents=1, segment_size=segment, name=f"l3pf{uuid.uuid4().hex[:4]}") as c:
        st = cluster_store(c)
        spec = KVSpec.mla(8, page_size=64)
        pool = random_pool(spec, layout, pages, 0)
        ns = Namespace.for_pool(spec, layout, "m1", tenant=uuid.uuid4().hex)
        client = L3Client(pool, st, ns, batch_pages=32)
        try:
            yield st, pool, client
        finally:
            client.close()
            pool.close()
            st.close()


def test_full_pool_is_a_typed_outcome() -> None:
    with _small_pool_client("48MB", "page_first", 128) as (st, _, client):  # 48 MB holds ~70 pages
        keys = random_keys(client.ns, 128, seed=7)
        res = client.put(keys, range(128))
        seen = {o.value: res.count(o) for o in set(res)}
        assert Outcome.POOL_FULL in res, seen
        # a page stored, then evicted at once by the full pool (fresh objects are the only
        # evictable ones here) before put's check is POOL_FULL too: no writer holds it (PENDING
        # is only for another put that has not finished); never OK for a page that is not there
        assert set(res) <= {Outcome.OK, Outcome.POOL_FULL}, seen
        there = st.exists(keys)
        assert all(t is Outcome.OK for t, r in zip(there, res, strict=True) if r is Outcome.OK), seen
        assert all(t is Outcome.MISS for t, r in zip(there, res, strict=True) if r is not Outcome.OK), seen
        print(f"\n128 pages into a full 48 MB pool: {seen}")
        assert client.stats.put_failed == res.count(Outcome.POOL_FULL)
        assert client.stats.put_pending == 0
        assert client.stats.puts == res.count(Outcome.OK)


def test_burst_into_a_full_pool_lands_over_eviction_rounds() -> None:
    """A pool full of evictable objects (raw puts take no read lease): Mooncake refuses what it
    cannot place at once and evicts only afterwards (every 10 ms). Without retries most of a burst
    is dropped; with them every page lands (bytes checked) and the retries are counted."""
    with _small_pool_client("64MB", "page_first_direct", 96) as (st, pool, client):  # 64 MB: ~110 pages
        pb, ptr = pool.layout.page_bytes, pool.buffer.data_ptr()
        filler = [f"filler-{uuid.uuid4().hex}" for _ in range(130)]
        assert Outcome.POOL_FULL in st.put(filler, [ptr] * len(filler), [pb] * len(filler))  # saturated
        client.pool_full_retry_s = 0
        dropped = client.put(random_keys(client.ns, 32, seed=1), range(32))
        assert Outcome.POOL_FULL in dropped and client.stats.put_full_retries == 0, dropped
        client.pool_full_retry_s = 5.0  # the default 0.1 s suffices on an idle host; CI may be loaded
        keys = random_keys(client.ns, 32, seed=2)
        t0 = time.monotonic()
        assert client.put(keys, range(32, 64)) == [Outcome.OK] * 32
        took = time.monotonic() - t0
        assert client.stats.put_full_retries > 0
        print(f"\n32-page burst into a full pool: {took * 1e3:.0f} ms, {client.stats.put_full_retries} re-puts")
        pool.fill_pages(np.arange(64, 96), 0xA5)
        assert client.get(keys, range(64, 96)) == [Outcome.OK] * 32
        assert torch.equal(pool.read_pages(np.arange(64, 96)), pool.read_pages(np.arange(32, 64)))


def test_master_restart_errors_then_recovers() -> None:
    with LocalCluster(agents=1, segment_size="128MB", name=f"l3pm{uuid.uuid4().hex[:4]}") as c:
        st = cluster_store(c)
        spec = SPECS["mla"]
        pool = random_pool(spec, "page_first", 64, 0)
        ns = Namespace.for_pool(spec, "page_first", "m1", tenant=uuid.uuid4().hex)
        client = L3Client(pool, st, ns)
        try:
            keys = random_keys(ns, 4, seed=8)
            assert client.put(keys, range(4)) == [Outcome.OK] * 4
            c.stop_master()
            t0 = time.monotonic()
            res = client.put(random_keys(ns, 4, seed=9), range(4, 8))
            assert all(r is not Outcome.OK for r in res) and all(r.retryable or r is Outcome.ERROR for r in res), res
            assert client.lookup(keys) == 0  # unreachable: nothing may be trusted
            assert time.monotonic() - t0 < 60
            c.start_master()
            deadline, ok = time.monotonic() + 40, False
            fresh = random_keys(ns, 4, seed=10)
            while time.monotonic() < deadline and not ok:
                ok = client.put(fresh, range(8, 12)) == [Outcome.OK] * 4
                if not ok:
                    time.sleep(1)
            assert ok, "no recovery within 40 s of the master's return"
            assert client.get(fresh, range(12, 16)) == [Outcome.OK] * 4
            assert [pool.page_bytes_of(p) for p in range(12, 16)] == [pool.page_bytes_of(p) for p in range(8, 12)]
        finally:
            client.close()
            pool.close()
            st.close()


def test_checksum_mismatch_is_a_miss_never_wrong_bytes(store: MooncakeStore) -> None:
    """An object whose bytes do not match its trailer's checksum (the trailer itself naming the
    right key, format and length) is reported as a miss and counted as a checksum failure."""
    spec = SPECS["mla"]
    pool = random_pool(spec, "page_first", 64, 0)
    ns = Namespace.for_pool(spec, "page_first", "m1", checksum=True, tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns)
    try:
        keys = random_keys(ns, 3, seed=11)
        assert client.put(keys[:2], [0, 1]) == [Outcome.OK] * 2
        # a corrupt object: page 2's bytes under keys[2], its trailer right but for the checksum
        trailer = np.zeros(1, dtype=TRAILER)
        trailer["magic"], trailer["version"], trailer["flags"] = TRAILER_MAGIC, FORMAT_VERSION, FLAG_CHECKSUM
        trailer["length"], trailer["key"], trailer["checksum"] = spec.page_bytes, key_digest(keys[2]), 12345
        store.register(trailer.ctypes.data, trailer.nbytes)
        (addr,), (size,) = (a.tolist() for a in pool.page_runs([2]))
        assert store.put_multi(keys[2:], [[addr[0], trailer.ctypes.data]], [[size[0], TRAILER_BYTES]]) == [Outcome.OK]
        res = client.get(keys, [8, 9, 10])
        assert res == [Outcome.OK, Outcome.OK, Outcome.MISS]
        assert client.stats.checksum_failures == 1 and client.stats.trailer_rejections == 0
        assert [pool.page_bytes_of(p) for p in (8, 9)] == [pool.page_bytes_of(p) for p in (0, 1)]
        store.unregister(trailer.ctypes.data)
    finally:
        client.close()
        pool.close()


def test_unknown_namespace_and_published_stats(store: MooncakeStore, cluster: LocalCluster) -> None:
    from l3pool.pool.metadata import Metadata

    md = Metadata(EtcdClient(cluster.etcd_endpoints), cluster.key_prefix)
    spec = SPECS["mla"]
    pool = random_pool(spec, "page_first_direct", 64, 0)
    ns = Namespace.for_pool(spec, "page_first_direct", "m1", tenant=uuid.uuid4().hex)
    with pytest.raises(ConfigError, match="unknown namespace"):
        L3Client(pool, store, ns, metadata=md, create_namespace=False)
    writer = L3Client(pool, store, ns, metadata=md, stats_interval=0.2)
    try:
        assert md.namespace(ns.ns_id) == ns.record()
        reader = L3Client(pool, store, ns, metadata=md, create_namespace=False)  # now it exists
        reader.close()
        writer.put(random_keys(ns, 2, seed=12), [0, 1])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and md.stats().get(writer.client_id, {}).get("puts") != 2:
            time.sleep(0.1)
        assert md.stats()[writer.client_id]["puts"] == 2
        assert md.stats()[writer.client_id]["namespace"] == ns.ns_id
    finally:
        writer.close()
        pool.close()
