"""Fail fast while the Mooncake master is down, against a real local cluster (etcd, mooncake_master,
one decode agent): the store's circuit breaker (master killed; master stopped with SIGSTOP so that
calls hang inside Mooncake), bounded `Prefetcher.interrupt()` with the pages of a hung batch
quarantined until its call returns, and recovery. Every wait is bounded."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.prefetch import Prefetcher
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig, StoreError

from ..conftest import slack
from ..pool_helpers import cluster_store, random_keys, random_pool

SPEC = KVSpec.mla(2, page_size=16)  # 36 KB pages
LAYOUT = "page_first_direct"
N = 64


def _p99(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs), 99))


class Pages:
    """A writer pool with known bytes stored under `keys`, and a reader pool + client."""

    def __init__(self, store: MooncakeStore, n: int = N, seed: int = 1) -> None:
        self.ns = Namespace.for_pool(SPEC, LAYOUT, "faults", tenant=uuid.uuid4().hex)
        self.wpool = random_pool(SPEC, LAYOUT, n, seed)
        self.writer = L3Client(self.wpool, store, self.ns, batch_pages=32)
        self.keys = random_keys(self.ns, n, seed)
        assert self.writer.put(self.keys, range(n)) == [Outcome.OK] * n
        self.pool = HostKVPool(L2Config(kv=SPEC, layout=LAYOUT, tokens=4 * n * SPEC.page_size, pin="never"))
        self.client = L3Client(self.pool, store, self.ns, batch_pages=32)
        self.want = self.wpool.buffer.view(n, -1)

    def check_prefix(self, pages: np.ndarray) -> None:
        got = self.pool.buffer.view(self.pool.num_pages, -1)[torch.from_numpy(pages)]
        assert torch.equal(got, self.want[: len(pages)])

    def poison(self) -> None:
        self.pool.buffer.fill_(0xA5)

    def close(self) -> None:
        self.client.close()
        self.writer.close()
        self.pool.close()
        self.wpool.close()


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=1, segment_size="64MB", name=f"l3pf{uuid.uuid4().hex[:4]}") as c:
        yield c


def test_store_config_rejects_bad_breaker_settings() -> None:
    for kw in (
        {"breaker_slow_s": 0},
        {"probe_timeout_s": -1},
        {"probe_backoff_s": (0.5, 0.1)},
        {"health_max_age_s": "x"},
    ):
        with pytest.raises(StoreError, match="StoreConfig"):
            StoreConfig(master="127.0.0.1:1", metadata="P2PHANDSHAKE", **kw)  # type: ignore[arg-type]


def test_breaker_master_killed_fails_fast_and_recovers(cluster: LocalCluster) -> None:
    """Master killed: after the first failure every call answers UNAVAILABLE within 50 ms (p99),
    healthy() is False, the breaker counts it; after the restart it closes by itself and new
    pages round-trip."""
    st = cluster_store(cluster)
    p = Pages(st)
    try:
        assert st.healthy()
        cluster.stop_master()
        first = time.monotonic()
        res = p.client.get(p.keys[:4], range(4))
        first_s = time.monotonic() - first
        assert set(res) == {Outcome.UNAVAILABLE}
        assert not st.healthy()
        lat: list[float] = []
        fresh = p.ns.keys(page_hashes(np.arange(8 * SPEC.page_size) + 10**6, SPEC.page_size))
        for i in range(30):
            for fn in (
                lambda: p.client.get(p.keys[:32], range(32)),
                lambda: p.client.put(fresh, range(64, 72)),
                lambda: [p.client.lookup(p.keys)],
            ):
                t = time.monotonic()
                out = fn()
                lat.append(time.monotonic() - t)
                assert Outcome.OK not in out and i >= 0  # a lookup of 0 pages: nothing trusted
        p99 = _p99(lat)
        assert p99 <= 0.05 * slack(), f"blocking per call p99 {p99 * 1e3:.1f} ms (first failure {first_s:.2f} s)"
        s = st.stats()
        assert s["state"] == "open" and s["trips"] == 1 and s["short_circuits"] >= 90, s
        cluster.start_master()
        t0 = time.monotonic()
        while not st.healthy():
            assert time.monotonic() - t0 < 20, f"breaker still open 20 s after the master's return: {st.stats()}"
            time.sleep(0.05)
        assert st.stats()["recoveries"] == 1
        # the restarted master lost every object: new pages round-trip
        rows = p.pool.buffer.view(p.pool.num_pages, -1)
        rows[64:72] = torch.randint(0, 256, rows[64:72].shape, dtype=torch.uint8)
        src = rows[64:72].clone()
        deadline = time.monotonic() + 20
        while p.client.put(fresh, range(64, 72)) != [Outcome.OK] * 8:
            assert time.monotonic() < deadline, "no put succeeded within 20 s of the breaker closing"
            time.sleep(0.5)
        p.poison()
        assert p.client.get(fresh, range(72, 80)) == [Outcome.OK] * 8
        assert torch.equal(rows[72:80], src)
    finally:
        p.close()
        st.close()


def test_hung_master_interrupt_is_bounded_and_quarantines(cluster: LocalCluster) -> None:
    """Master SIGSTOPped mid-prefetch: the second batch hangs inside Mooncake. interrupt() returns
    the first batch's pages (byte-exact) within 100 ms; the hung batch's pages stay allocated
    (quarantined) until Mooncake gives up; the breaker opens while the call still hangs, so later
    calls and prefetches fail fast; after SIGCONT nothing is leaked."""
    st = cluster_store(cluster, breaker_suspect_s=0.5)
    p = Pages(st)
    stopped = threading.Event()
    real = p.client.get
    calls = [0]

    def get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
        calls[0] += 1
        if calls[0] == 2:  # the master stops while the first batch's pages are already in
            assert cluster.signal_master(signal.SIGSTOP)  # returns once every master thread is stopped
            stopped.set()
        return real(keys, pages)

    p.client.get = get  # type: ignore[method-assign]
    base = p.pool.stats().used_pages
    pf = Prefetcher(p.client, batch_pages=16, max_batch_pages=16, max_inflight=2)
    try:
        p.poison()
        h = pf.submit("hung", p.keys)
        assert stopped.wait(20)
        time.sleep(0.2)  # the second batch is inside Mooncake now
        t = time.monotonic()
        res = h.interrupt()
        took = time.monotonic() - t
        assert took <= 0.1 * slack(), f"interrupt() took {took * 1e3:.0f} ms while a batch hangs"
        assert res.interrupted and res.keys_loaded == 16 and res.left_in_flight == 16
        p.check_prefix(res.pages)
        assert pf.quarantined_pages() == 16
        assert p.pool.stats().used_pages == base + 16 + 16  # delivered + quarantined, nothing else
        # the breaker opens while the call still hangs (suspect probe), then calls fail fast
        t0 = time.monotonic()
        while not st.breaker.is_open:
            assert time.monotonic() - t0 < 5, f"breaker not open 5 s into a hung call: {st.stats()}"
            time.sleep(0.02)
        lat, ilat = [], []
        for i in range(40):
            t = time.monotonic()
            assert set(st.exists(p.keys[:8])) == {Outcome.UNAVAILABLE}
            lat.append(time.monotonic() - t)
            h2 = pf.submit(f"later{i}", p.keys)
            time.sleep(0.002)
            t = time.monotonic()
            r2 = h2.interrupt()
            ilat.append(time.monotonic() - t)
            assert r2.keys_loaded == 0 and len(r2.pages) == 0
        assert _p99(lat) <= 0.05 * slack() and _p99(ilat) <= 0.1 * slack(), (_p99(lat), _p99(ilat))
        assert not st.healthy()
        assert pf.quarantined_pages() == 16  # the hung call has not returned: its pages stay out
        cluster.signal_master(signal.SIGCONT)
        t0 = time.monotonic()
        while pf.quarantined_pages() or st.breaker.is_open:
            assert time.monotonic() - t0 < 40, (pf.quarantined_pages(), st.stats())
            time.sleep(0.05)
        assert p.pool.stats().used_pages == base + 16  # only the delivered prefix: 0 leaked
        p.pool.free(res.pages)
        p.poison()
        full = pf.submit("after", p.keys).wait(20)
        assert full.complete
        p.check_prefix(full.pages)
        p.pool.free(full.pages)
        assert p.pool.stats().used_pages == base
    finally:
        cluster.signal_master(signal.SIGCONT)
        pf.close()
        p.close()
        st.close()
