"""The store client recovers by itself and fails fast, against a real local cluster (etcd,
mooncake_master, decode agents in their namespaces): a Mooncake client that keeps failing while its
master answers is rebuilt with every buffer registered again; a frozen master is detected within
~0.6 s and the call it caught returns after MC_RPC_TIMEOUT_MS (not 30 s); a dead donor costs one
slow get, after which its objects answer MISS at once while the other donor's pages arrive intact.
Every wait is bounded; every page that counts as a hit is compared byte for byte."""

from __future__ import annotations

import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.connection import PROBE_KEY
from l3pool.pool.keys import Namespace
from l3pool.pool.metadata import Metadata
from l3pool.pool.prefetch import Prefetcher
from l3pool.pool.store import RPC_TIMEOUT_MS, MooncakeStore, Outcome, StoreConfig

from ..conftest import slack, wait_for
from ..pool_helpers import cluster_store, random_keys, random_pool

SPEC = KVSpec.mla(2, page_size=16)  # 36 KB pages
LAYOUT = "page_first_direct"
N = 32
DEFAULT_DEADLINE = StoreConfig.call_deadline_s  # the product's default (the dataclass field's)


class Pages:
    """`n` pages of known bytes stored under `keys` by a writer; a reader pool + client."""

    def __init__(self, store: MooncakeStore, n: int = N, seed: int = 3) -> None:
        self.n = n
        self.ns = Namespace.for_pool(SPEC, LAYOUT, "recover", tenant=uuid.uuid4().hex)
        self.wpool = random_pool(SPEC, LAYOUT, n, seed)
        self.writer = L3Client(self.wpool, store, self.ns, batch_pages=n)
        self.keys = random_keys(self.ns, n, seed)
        self.pool = HostKVPool(L2Config(kv=SPEC, layout=LAYOUT, tokens=n * SPEC.page_size, pin="never"))
        self.reader = L3Client(self.pool, store, self.ns, batch_pages=n)
        self.want = self.wpool.buffer.view(n, -1)
        self.took = 0.0

    def put(self) -> list[Outcome]:
        return self.writer.put(self.keys, range(self.n))

    def get(self) -> list[Outcome]:
        """Get every page into poisoned pages; every OK page must hold its own bytes. `took`:
        the seconds of the get itself."""
        self.pool.buffer.fill_(0xA5)
        t = time.monotonic()
        out = self.reader.get(self.keys, range(self.n))
        self.took = time.monotonic() - t
        rows = self.pool.buffer.view(self.n, -1)
        for i, o in enumerate(out):
            if o is Outcome.OK:
                assert torch.equal(rows[i], self.want[i]), f"page {i} is OK but holds other bytes"
        return out

    def close(self) -> None:
        self.reader.close()
        self.writer.close()
        self.pool.close()
        self.wpool.close()


@pytest.fixture
def cluster1() -> Iterator[LocalCluster]:
    with LocalCluster(agents=1, segment_size="64MB", name=f"l3rc{uuid.uuid4().hex[:4]}") as c:
        yield c


@pytest.fixture
def cluster2() -> Iterator[LocalCluster]:
    with LocalCluster(agents=2, segment_size="64MB", name=f"l3rc{uuid.uuid4().hex[:4]}") as c:
        yield c


class BrokenClient:
    """A Mooncake client that answers RPC_FAIL (-900) to every call while its master is fine (what
    the reviewer's readers got for 13 s after a master restart); with `probe_ok` the store's probe
    (a batch_is_exist of PROBE_KEY alone) still gets through. close() is recorded."""

    def __init__(self, real: Any, probe_ok: bool) -> None:
        self.real, self.probe_ok, self.closed = real, probe_ok, threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name in ("register_buffer", "unregister_buffer", "get_hostname"):
            return getattr(self.real, name)
        if name == "close":
            return self._close

        def call(keys: list[str], *a: Any) -> list[int]:
            if self.probe_ok and keys == [PROBE_KEY]:
                return list(self.real.batch_is_exist(keys))
            return [-900] * len(keys)

        return call

    def _close(self) -> int:
        self.closed.set()
        return int(self.real.close())


@pytest.mark.parametrize("probe_ok", [False, True], ids=["probe-fails", "probe-passes"])
def test_a_client_that_keeps_failing_is_rebuilt(cluster1: LocalCluster, probe_ok: bool) -> None:
    """The master answers but the store's client fails every call (and its probe, or not): within
    rebuild_after_s (1 s) + a probe it is replaced by a new client with the L3Client's buffers
    registered again (pages round-trip byte-exact through them), the old client is closed once
    unused, `rebuilds` counts 1."""
    st = cluster_store(cluster1)
    p = Pages(st)
    try:
        assert p.put() == [Outcome.OK] * N
        broken = BrokenClient(st.conn.current.s, probe_ok)
        st.conn.current.s = broken
        assert set(p.get()) == {Outcome.UNAVAILABLE}
        t0 = time.monotonic()
        while (out := p.get()) != [Outcome.OK] * N:
            assert time.monotonic() - t0 < 5 * slack(), f"not recovered in 5 s: {set(out)} {st.stats()}"
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert took < 3 * slack(), took
        s = st.stats()
        assert s["rebuilds"] == 1 and s["rebuild_failures"] == 0, s
        assert broken.closed.wait(10), "the old client was never closed"
        assert st.conn.current.s is not broken and st.conn.current.gen == 1
    finally:
        p.close()
        st.close()


def test_master_sigstop_then_restart_recovers(cluster1: LocalCluster) -> None:
    """SIGSTOP the master, then restart it: within 3 s of the master answering again new pages
    round-trip byte-exact (the restart lost the old ones: misses, never other bytes)."""
    st = cluster_store(cluster1)
    p = Pages(st)
    try:
        assert p.put() == [Outcome.OK] * N
        assert cluster1.signal_master(signal.SIGSTOP)
        time.sleep(1.0)
        assert set(p.get()) <= {Outcome.UNAVAILABLE, Outcome.ERROR}
        cluster1.stop_master()
        cluster1.start_master()  # returns once its ports listen
        t0 = time.monotonic()
        while True:
            out = p.get()
            assert Outcome.OK not in out  # the old objects died with the master
            if p.put() == [Outcome.OK] * N and p.get() == [Outcome.OK] * N:
                break
            assert time.monotonic() - t0 < 3 * slack(), f"no round trip 3 s after the restart: {st.stats()}"
            time.sleep(0.05)
    finally:
        cluster1.signal_master(signal.SIGCONT)
        p.close()
        st.close()


def test_frozen_master_detected_fast_and_calls_fail_fast(cluster1: LocalCluster) -> None:
    """Master SIGSTOPped: the breaker opens within ~0.6 s (1 s bound) while the first call still
    hangs; that call returns within MC_RPC_TIMEOUT_MS (2 s, + 1 s); every later call answers in
    <= 50 ms (median of 30, p90 too); after SIGCONT the pages are there again, byte-exact."""
    st = cluster_store(cluster1)
    p = Pages(st)
    try:
        assert p.put() == [Outcome.OK] * N
        assert cluster1.signal_master(signal.SIGSTOP)
        t0 = time.monotonic()
        first: list[float] = []
        th = threading.Thread(target=lambda: (p.reader.lookup(p.keys), first.append(time.monotonic() - t0)))
        th.start()
        detect = wait_for(lambda: st.breaker.is_open, 40, "the breaker to open")
        th.join(40)
        assert first, "the first call never returned"
        assert detect <= 1.0 * slack(), f"frozen master detected after {detect:.2f} s"
        assert first[0] <= (RPC_TIMEOUT_MS / 1e3 + 1) * slack(), f"the first call blocked {first[0]:.1f} s"
        lat = []
        for _ in range(10):
            for fn in (p.get, p.put, lambda: p.reader.lookup(p.keys)):
                t = time.monotonic()
                out = fn()
                lat.append(time.monotonic() - t)
                assert out == 0 if isinstance(out, int) else Outcome.OK not in out, out
        med, p90 = statistics.median(lat), float(np.percentile(lat, 90))
        assert med <= 0.05 and p90 <= 0.05 * slack(), f"per call: median {med * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms"
        cluster1.signal_master(signal.SIGCONT)
        t0 = time.monotonic()
        while p.get() != [Outcome.OK] * N:
            assert time.monotonic() - t0 < 10 * slack(), f"pages not back 10 s after SIGCONT: {st.stats()}"
            time.sleep(0.1)
        assert st.stats()["rebuilds"] == 0  # the client was never broken: nothing to rebuild
    finally:
        cluster1.signal_master(signal.SIGCONT)
        p.close()
        st.close()


def test_frozen_master_costs_a_call_its_deadline(cluster1: LocalCluster) -> None:
    """Master SIGSTOPped while a prefetch's get is inside Mooncake: a load waiting for it
    (`wait_live`, the wait_complete and timeout policies) returns within about two deadlines (the
    product's default, 40 ms: a missed half-deadline probe, then a whole-deadline one that confirms
    it), interrupted, the get's pages quarantined; every lookup from then
    on answers within 50 ms (its deadline + 20 us per key + the hand-off) as a miss, the first
    ones included, and the breaker opens on the failed probe. After SIGCONT the quarantine
    drains, no page leaks, pages round-trip."""
    st = cluster_store(cluster1, call_deadline_s=DEFAULT_DEADLINE)
    assert DEFAULT_DEADLINE is not None and DEFAULT_DEADLINE < 0.05  # the bound below: deadline + hand-off
    p = Pages(st)
    pf: Prefetcher | None = None
    go = threading.Event()
    try:
        assert p.put() == [Outcome.OK] * N and p.reader.lookup(p.keys) == N
        started, real = threading.Event(), p.reader.get

        def held_get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
            started.set()
            go.wait(10)  # enters Mooncake once the master is frozen
            return real(keys, pages)

        p.reader.get = held_get  # type: ignore[method-assign]
        pf = Prefetcher(p.reader, batch_pages=N, max_inflight=1)
        h = pf.submit("r", p.keys)
        assert started.wait(10)
        assert cluster1.signal_master(signal.SIGSTOP)
        go.set()
        time.sleep(0.05)  # the get is inside Mooncake, waiting for the master
        t = time.monotonic()
        res = h.wait_live()
        took = time.monotonic() - t
        assert res.interrupted and res.keys_loaded == 0 and res.left_in_flight == N, res
        lat = []
        for _ in range(8):
            t = time.monotonic()
            assert p.reader.lookup(p.keys) == 0
            lat.append(time.monotonic() - t)
        bound = 0.05 * slack()
        took_bound = (DEFAULT_DEADLINE * 1.5 + 0.04) * slack()  # the two probes + a liveness step and hand-offs
        assert took <= took_bound, f"the load waited {took * 1e3:.0f} ms for a get caught by the frozen master"
        assert max(lat) <= bound, f"lookups took {[round(x * 1e3) for x in lat]} ms"
        assert st.stats()["overdue_calls"] >= 1
        wait_for(lambda: st.breaker.is_open, 5, "the breaker to open")
        cluster1.signal_master(signal.SIGCONT)
        wait_for(lambda: pf is not None and pf.quarantined_pages() == 0, 40, "the quarantine to drain")
        assert p.pool.stats().used_pages == 0
        p.reader.get = real  # type: ignore[method-assign]
        t0 = time.monotonic()
        while p.get() != [Outcome.OK] * N:
            assert time.monotonic() - t0 < 10 * slack(), f"pages not back 10 s after SIGCONT: {st.stats()}"
            time.sleep(0.1)
    finally:
        go.set()
        cluster1.signal_master(signal.SIGCONT)
        if pf is not None:
            pf.close()
        p.close()
        st.close()


def test_dead_donor_costs_one_slow_get(cluster2: LocalCluster) -> None:
    """Agent 0 SIGKILLed: the first get pays Mooncake's ~1 s transfer failure for its pages and
    marks its endpoint dead; every later get answers its pages MISS at once (median <= 50 ms over
    10 gets, while the master still lists its segment) and the other donor's pages OK, byte-exact."""
    st = cluster_store(cluster2)
    p = Pages(st, n=64)
    try:
        assert p.put() == [Outcome.OK] * 64
        eps = st.replica_endpoints(p.keys)
        assert eps is not None and all(len(e) == 1 for e in eps)
        where = [next(iter(e)) for e in eps]
        etcd = cluster2.etcd()
        try:
            segments = {m.info.id: m.info.segment for m in Metadata(etcd, cluster2.key_prefix).members()}
        finally:
            etcd.close()
        dead_seg = segments[cluster2.agents[0].id]
        assert set(where) <= set(segments.values()), (where, segments)  # a replica's endpoint = its segment
        on_dead = [i for i, e in enumerate(where) if e == dead_seg]
        assert 0 < len(on_dead) < 64, where  # both donors hold pages
        assert not cluster2.kill_agent(0)
        out = p.get()
        first = p.took
        assert first <= 3 * slack(), f"first get after the kill took {first:.2f} s"
        assert all(out[i] is not Outcome.OK for i in on_dead)
        lat = []
        for _ in range(10):
            out = p.get()
            lat.append(p.took)
            assert [i for i, o in enumerate(out) if o is not Outcome.OK] == on_dead, out
        med = statistics.median(lat)
        assert med <= 0.05 * slack(), f"per get after detection: median {med * 1e3:.1f} ms of {lat}"
        s = st.stats()
        # each get skipped every dead-donor page, until the master dropped the segment (5-11 s after
        # the kill; a loaded machine's gets reach it): then its objects are gone, nothing to skip
        skipped = s["dead_skipped_items"]
        assert s["dead_endpoints_marked"] == 1 and skipped >= len(on_dead) and skipped % len(on_dead) == 0, s
        assert s["state"] == "closed" and s["trips"] == 0, s  # a dead donor is not a dead master
    finally:
        p.close()
        st.close()


def test_dead_donor_puts_fail_fast(cluster2: LocalCluster) -> None:
    """Agent 0 SIGKILLed after a writer stored pages on both donors: the first put after the kill
    may fail its dead-donor pages (TRANSFER_FAIL, never OK) and marks the donor dead; every later
    put goes to the live donor: median <= 50 ms over 10 puts (~1 s each without steering, while the
    master still lists the dead segment), every page OK, present and read back byte-exact."""
    st = cluster_store(cluster2)
    p = Pages(st, n=32)
    try:
        assert p.put() == [Outcome.OK] * 32
        eps = st.replica_endpoints(p.keys)
        assert eps is not None and len(set().union(*eps)) == 2, eps  # both donors hold pages
        assert not cluster2.kill_agent(0)
        lat = []
        for r in range(11):
            keys = random_keys(p.ns, 32, 100 + r)
            t = time.monotonic()
            out = p.writer.put(keys, range(32))
            took = time.monotonic() - t
            there = st.exists(keys)
            assert [i for i, o in enumerate(out) if o is Outcome.OK and there[i] is not Outcome.OK] == [], (out, there)
            assert Outcome.OK in out, out  # the live donor takes pages
            if r == 0:
                assert took <= 3 * slack(), f"first put after the kill took {took:.2f} s"
                continue
            lat.append(took)
            assert out == [Outcome.OK] * 32, f"put {r} after detection: {out}"
            p.pool.buffer.fill_(0xA5)
            assert p.reader.get(keys, range(32)) == [Outcome.OK] * 32
            assert torch.equal(p.pool.buffer.view(32, -1), p.want), f"put {r}: pages read back differ"
        med = statistics.median(lat)
        assert med <= 0.05 * slack(), f"per put after detection: median {med * 1e3:.1f} ms of {lat}"
        s = st.stats()
        assert s["dead_endpoints_marked"] == 1 and s["steered_puts"] >= 10, s
        assert s["state"] == "closed" and s["trips"] == 0, s  # a dead donor is not a dead master
    finally:
        p.close()
        st.close()
