"""Transfers sized by fragments (l3pool.pool.transfers): Mooncake's TCP transport queues at most
MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (2048) transfers per peer for the whole client, and a call
over it fails or hangs 60 s and leaves the client broken. Unit tests of the cutting and the
budget; real-cluster tests with ONE donor (every fragment goes to the same peer) at the layer
counts of real models (61, 78 layers, layer_first multi-buffer), calls of 2000 pages, and
concurrent calls; and L3Client's constructor, which must leave nothing registered when it fails."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from l2core import ConfigError, KVSpec
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.etcd import EtcdUnavailable
from l3pool.pool.keys import Namespace
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig, StoreError
from l3pool.pool.transfers import (
    DEFAULT_TRANSFER_LIMIT,
    TransferBudget,
    default_budget,
    fragment_chunks,
    transfer_limit,
)

from ..fake_store import FakePageStore
from ..pool_helpers import random_keys, random_pool

# -- the cutting and the budget --------------------------------------------------------------


def test_transfer_limit_reads_the_variable_as_mooncake_does() -> None:
    env = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
    assert transfer_limit({}) == DEFAULT_TRANSFER_LIMIT == 2048
    assert transfer_limit({env: "4096"}) == 4096
    for bad in ("", "-1", "0", "1e3", "65536", "12 "):  # Mooncake falls back to its default
        assert transfer_limit({env: bad}) == DEFAULT_TRANSFER_LIMIT, bad
    assert default_budget({}) == 1024 and default_budget({env: "1"}) == 1  # half the queue, at least 1


def test_fragment_chunks_fit_the_limit_in_order() -> None:
    assert fragment_chunks([], 10) == []
    assert fragment_chunks([2] * 5, 10) == [(0, 5)]
    assert fragment_chunks([62] * 64, 2048) == [(0, 33), (33, 64)]  # the measured 33-object bound
    assert fragment_chunks([3, 3, 3, 3, 1], 6) == [(0, 2), (2, 4), (4, 5)]
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 50, 500)
    parts = fragment_chunks(counts, 100)
    assert parts[0][0] == 0 and parts[-1][1] == 500
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))  # contiguous, no gaps
    assert all(counts[lo:hi].sum() <= 100 for lo, hi in parts)
    assert all(counts[lo : hi + 1].sum() > 100 for lo, hi in parts[:-1])  # greedy: the next would not fit
    with pytest.raises(ValueError, match="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"):
        fragment_chunks([5, 11], 10)


def test_budget_bounds_fragments_in_flight_across_threads() -> None:
    budget = TransferBudget(100)
    inside, peak, lock = [0], [0], threading.Lock()

    def call(n: int) -> None:
        with budget.hold(n):
            with lock:
                inside[0] += n
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.005)
            with lock:
                inside[0] -= n

    ts = [threading.Thread(target=lambda n=n: [call(n) for _ in range(10)]) for n in (60, 40, 30, 70, 100)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not any(t.is_alive() for t in ts)
    assert 0 < peak[0] <= 100 and budget.peak <= 100 and budget.in_flight == 0 and budget.waits > 0
    with pytest.raises(ValueError):
        with budget.hold(101):
            pass
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError):
            TransferBudget(bad)  # type: ignore[arg-type]


def test_store_config_refuses_bad_max_transfers() -> None:
    for bad in (-1, 1.5, "2048", True):
        with pytest.raises(StoreError, match="max_transfers"):
            StoreConfig(master="127.0.0.1:1", metadata="P2PHANDSHAKE", max_transfers=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("layers", "limit", "batch"), [(61, 2048, 33), (78, 2048, 25), (61, 200, 3), (61, 62, 1)])
def test_client_batches_by_fragments(layers: int, limit: int, batch: int) -> None:
    """A layer_first page in multi-buffer mode is L runs + the trailer: the client's batches never
    carry more fragments than the store takes, and every page still round-trips."""
    spec = KVSpec.mla(layers, kv_lora_rank=8, rope_dim=8, page_size=2)
    pool = random_pool(spec, "layer_first", 80, layers)
    store = FakePageStore(max_transfers=limit)
    ns = Namespace.for_pool(spec, "layer_first", "frag")
    client = L3Client(pool, store, ns, batch_pages=64)
    try:
        assert client.fragments_per_page == layers + 1 and client.batch_pages == batch
        keys = random_keys(ns, 40, seed=layers)
        want = pool.read_pages(list(range(40))).clone()
        assert client.put(keys, range(40)) == [Outcome.OK] * 40
        assert client.get(keys, range(40, 80)) == [Outcome.OK] * 40
        assert bool((pool.read_pages(list(range(40, 80))) == want).all())
        assert 0 < store.peak_fragments <= limit
    finally:
        client.close()
        pool.close()


def test_client_refuses_a_page_over_the_limit_and_staging_fits() -> None:
    spec = KVSpec.mla(61, kv_lora_rank=8, rope_dim=8, page_size=2)
    pool = random_pool(spec, "layer_first", 8, 0)
    store = FakePageStore(max_transfers=40)
    ns = Namespace.for_pool(spec, "layer_first", "frag")
    try:
        with pytest.raises(ConfigError, match=r"62 transfer fragments.*staging"):
            L3Client(pool, store, ns)
        assert store.registered == {}  # the refusal registered nothing
        client = L3Client(pool, store, ns, layer_first_mode="staging", batch_pages=64)
        assert client.fragments_per_page == 2 and client.batch_pages == 20
        client.close()
        assert store.registered == {}
    finally:
        pool.close()


# -- L3Client's constructor leaves nothing registered when it fails ---------------------------------


class _FailingRegistry:
    """A namespace registry whose etcd is down (what an etcd outage looks like to L3Client)."""

    etcd: Any = None

    def namespace(self, ns_id: str) -> dict[str, Any] | None:
        raise EtcdUnavailable("etcd http://127.0.0.1:1 unreachable (test)")

    def register_namespace(self, ns_id: str, record: dict[str, Any]) -> dict[str, Any]:
        raise EtcdUnavailable("etcd http://127.0.0.1:1 unreachable (test)")

    def publish_stats(self, client_id: str, counters: dict[str, Any], lease: int = 0) -> None:
        raise AssertionError("never reached")


class _OtherRecordRegistry(_FailingRegistry):
    def namespace(self, ns_id: str) -> dict[str, Any] | None:
        return {"model": "another"}

    def register_namespace(self, ns_id: str, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "model": "another"}


class _NoNamespace(_FailingRegistry):
    def namespace(self, ns_id: str) -> dict[str, Any] | None:
        return None


def test_failed_constructor_unregisters_on_the_fake_store() -> None:
    spec = KVSpec.mla(4, kv_lora_rank=8, rope_dim=8, page_size=4)
    for layout, mode in (("page_first", "multi"), ("layer_first", "staging")):
        pool = random_pool(spec, layout, 8, 0)
        store = FakePageStore()
        ns = Namespace.for_pool(spec, layout, "leak")
        try:
            for registry in (_FailingRegistry(), _OtherRecordRegistry()):
                with pytest.raises((EtcdUnavailable, ConfigError)):
                    L3Client(pool, store, ns, metadata=registry, layer_first_mode=mode)  # type: ignore[arg-type]
                assert store.registered == {}, (layout, type(registry).__name__)
            with pytest.raises(ConfigError, match="unknown namespace"):
                L3Client(pool, store, ns, metadata=_NoNamespace(), create_namespace=False)  # type: ignore[arg-type]
            assert store.registered == {}
        finally:
            pool.close()


# -- the real pool, one donor ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=1, segment_size="512MB", name=f"l3t{uuid.uuid4().hex[:5]}") as c:
        yield c


def _round_trip(client: L3Client, pool: Any, n: int, seed: int) -> tuple[list[Outcome], list[Outcome], bool]:
    keys = random_keys(client.ns, n, seed=seed)
    want = pool.read_pages(list(range(n))).clone()
    put = client.put(keys, range(n))
    got = client.get(keys, range(n, 2 * n))
    return put, got, bool((pool.read_pages(list(range(n, 2 * n))) == want).all())


@pytest.mark.parametrize("layers", [61, 78])
def test_layer_first_multi_at_real_layer_counts(store: MooncakeStore, layers: int) -> None:
    """Before: 61 layers, default batch 64 (3968 fragments per call) failed 31 of 64 pages of
    every put and get, or every page after a 60 s hang."""
    spec = KVSpec.mla(layers, page_size=4)  # 576-element latent, bf16: 4.6 KB per layer run
    pool = random_pool(spec, "layer_first", 256, layers)
    client = L3Client(pool, store, Namespace.for_pool(spec, "layer_first", "real", tenant=uuid.uuid4().hex))
    try:
        assert client.batch_pages * client.fragments_per_page <= store.max_transfers
        t0 = time.monotonic()
        put, got, same = _round_trip(client, pool, 128, layers)
        assert put == [Outcome.OK] * 128 and got == [Outcome.OK] * 128 and same
        assert time.monotonic() - t0 < 30  # no 60 s hang
    finally:
        client.close()
        pool.close()


def test_large_calls_and_concurrent_calls_stay_under_the_limit(store: MooncakeStore) -> None:
    """Before: a 2000-page call (4000 fragments) hung 60 s and left the client failing every
    later call; four threads of 1860-fragment calls each failed every page."""
    spec = KVSpec.mla(2, page_size=4)
    pool = random_pool(spec, "page_first", 4000, 7)
    client = L3Client(
        pool, store, Namespace.for_pool(spec, "page_first", "big", tenant=uuid.uuid4().hex), batch_pages=2000
    )
    try:
        assert client.batch_pages == 512  # 2 fragments per page, half of Mooncake's 2048 in flight
        t0 = time.monotonic()
        put, got, same = _round_trip(client, pool, 2000, 1)
        assert put == [Outcome.OK] * 2000 and got == [Outcome.OK] * 2000 and same
        assert time.monotonic() - t0 < 30
    finally:
        client.close()
        pool.close()
    # straight through the store: one call of 2000 two-fragment objects is cut to fit
    keys = [f"frag-{uuid.uuid4().hex}/{i}" for i in range(2000)]
    buf = np.random.default_rng(2).integers(0, 256, 2000 * 1024, dtype=np.uint8)
    store.register(buf.ctypes.data, buf.nbytes)
    try:
        base = buf.ctypes.data
        frags = [[base + i * 1024, base + i * 1024 + 512] for i in range(2000)]
        assert store.put_multi(keys, frags, [[512, 512]] * 2000) == [Outcome.OK] * 2000
        out = np.zeros_like(buf)
        store.register(out.ctypes.data, out.nbytes)
        try:
            ob = out.ctypes.data
            got = store.get_multi(
                keys, [[ob + i * 1024, ob + i * 1024 + 512] for i in range(2000)], [[512, 512]] * 2000
            )
            assert got == [Outcome.OK] * 2000 and bytes(out) == bytes(buf)
        finally:
            store.unregister(out.ctypes.data)
    finally:
        store.unregister(buf.ctypes.data)
        for k in keys:
            store.remove(k, force=True)

    spec = KVSpec.mla(61, page_size=4)
    pool = random_pool(spec, "layer_first", 240, 3)
    client = L3Client(pool, store, Namespace.for_pool(spec, "layer_first", "conc", tenant=uuid.uuid4().hex))
    results: dict[int, tuple[list[Outcome], list[Outcome]]] = {}
    try:

        def work(t: int) -> None:  # three rounds back to back: a call starts as another returns
            src, dst = range(30 * t, 30 * t + 30), range(120 + 30 * t, 150 + 30 * t)
            for r in range(3):
                keys = random_keys(client.ns, 30, seed=100 + 10 * r + t)
                results[3 * t + r] = (client.put(keys, src), client.get(keys, dst))

        want = pool.read_pages(list(range(120))).clone()
        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts)
        assert all(r == ([Outcome.OK] * 30, [Outcome.OK] * 30) for r in results.values()) and len(results) == 12
        assert bool((pool.read_pages(list(range(120, 240))) == want).all())
        assert store.transfers.peak <= store.max_transfers and store.transfers.in_flight == 0
    finally:
        client.close()
        pool.close()


def test_failed_constructors_do_not_exhaust_the_real_client(store: MooncakeStore) -> None:
    """Before: 163 of 200 constructors that raised after registering (etcd down) left their
    buffers registered, and 36 of 50 healthy constructors then failed with register_buffer -600."""
    spec = KVSpec.mla(4, page_size=4)
    pool = random_pool(spec, "page_first", 64, 5)
    ns = Namespace.for_pool(spec, "page_first", "leak", tenant=uuid.uuid4().hex)
    before = store.conn.registered
    try:
        for _ in range(200):
            with pytest.raises(EtcdUnavailable):
                L3Client(pool, store, ns, metadata=_FailingRegistry())  # type: ignore[arg-type]
        assert store.conn.registered == before
        keys = random_keys(ns, 8, seed=9)
        for i in range(50):
            c = L3Client(pool, store, ns)
            try:
                if i == 0:
                    assert c.put(keys, range(8)) == [Outcome.OK] * 8
                assert c.get(keys, range(8, 16)) == [Outcome.OK] * 8
            finally:
                c.close()
        assert store.conn.registered == before
        assert bool((pool.read_pages(list(range(8))) == pool.read_pages(list(range(8, 16)))).all())
    finally:
        pool.close()
