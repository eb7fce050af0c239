"""TieredCache under racing requests on the real cluster fixtures (etcd, mooncake_master, an
in-process donor): two instances sharing one L3 namespace and a two-stage PP pair under
StageLocks, each used by several threads at once, with L1 and L2 far smaller than the working
set. Prefetches (interrupted at random points: best_effort after a random queueing time),
L1 -> L2 backups, L2 -> L3 writer puts, evictions in both tiers and PP locks all race, and
every hit page of every request is byte-checked against its page's contents after the free L1
and L2 pages were poisoned (`Engine.run`). At the end nothing is pinned, active, quarantined,
locked or leaked, and each root prefix read back from L3 by a fresh instance holds its bytes.

Bounded: a fixed number of requests per thread, no new request after DEADLINE_S, thread joins
with timeouts; 480 requests in ~2.5 s (~5.5 s with its fixtures) on 2 shared cores. It is one
test in the suite; to stress, run it in a loop
(`for i in $(seq 50); do pytest -q tests/l3pool/cache/test_cache_stress.py || break; done`)."""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from l3pool.cache import CacheConfig, CacheFull
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.keys import Namespace
from l3pool.pool.metadata import Metadata
from l3pool.pool.pplock import StageLocks
from l3pool.pool.store import MooncakeStore

from ..cache_helpers import LAYERS, SPEC, Engine, chain
from ..conftest import EtcdServer

pytestmark = pytest.mark.usefixtures("native")

ROOTS = [chain(500 + s, 6) for s in range(8)]  # shared prefixes: 48 pages, more than any tier holds
REQUESTS = 60  # per thread
DEADLINE_S = 20.0  # no new request after this (the test stops by itself even on a slow host)
JOIN_S = 60.0


def _request(rnd: random.Random, seed: int) -> list[bytes]:
    """A root's first 1-6 pages, then 0-3 pages of its own."""
    root = rnd.choice(ROOTS)
    return chain(seed, rnd.randint(0, 3), prefix=root[: rnd.randint(1, len(root))])


class _Run:
    """Threads of one stress run: the first error of any of them, requests served / CacheFull."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.served = self.full = 0
        self.hits: dict[tuple[int, str], int] = {}  # (id of the engine, request) -> pages hit
        self.mu = threading.Lock()
        self.t0 = time.monotonic()
        self.threads: list[threading.Thread] = []

    def late(self) -> bool:
        return time.monotonic() - self.t0 > DEADLINE_S

    def one(self, e: Engine, rid: str, hs: list[bytes], think_s: float = 0.0) -> None:
        try:
            m = e.run(rid, hs, think_s=think_s)
            with self.mu:
                self.served += 1
                self.hits[id(e), rid] = m.hit_pages
        except CacheFull:  # every L1 page pinned by the other requests: legal, released, counted
            e.cache.release(rid)
            with self.mu:
                self.full += 1

    def spawn(self, name: str, fn: Callable[[], None]) -> None:
        def body() -> None:
            try:
                fn()
            except BaseException as ex:
                with self.mu:
                    self.errors.append(f"{name}: {type(ex).__name__}: {ex}")

        t = threading.Thread(target=body, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self) -> None:
        end = time.monotonic() + JOIN_S
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"threads still running after {JOIN_S} s: {alive}"
        assert not self.errors, self.errors


def test_racing_requests_across_instances_threads_and_pp_stages(
    store: MooncakeStore, etcd_server: EtcdServer, prefix: str, engines: list[Engine]
) -> None:
    run = _Run()
    # two instances over one L3 namespace: best_effort prefetches in 1, 2, 4-page batches, so a
    # load after a random queueing time interrupts them at any point
    tenant = uuid.uuid4().hex
    cfg = CacheConfig(prefetch_batch_pages=1, prefetch_max_batch_pages=4, writer_linger_ms=1.0)
    inst = [Engine(cfg, l1_pages=20, l2_pages=40, store=store, tenant=tenant) for _ in range(2)]
    engines.extend(inst)
    # a PP pair under StageLocks (its own namespaces); stage prefetches are waited for (the
    # stages load the locked length), L2 large enough that a locked fetch never runs short
    pp_tenant = uuid.uuid4().hex
    stages = [(0, LAYERS), (LAYERS, 2 * LAYERS)]
    nss = [Namespace.for_pool(SPEC, "page_first_direct", "cachetest", layers=lr, tenant=pp_tenant) for lr in stages]
    md = Metadata(EtcdClient(etcd_server.endpoints), prefix)
    locks = [StageLocks(md, store, nss, s, ttl=5, refresh_s=1.0) for s in range(2)]
    try:
        pp = [
            Engine(CacheConfig(writer_linger_ms=1.0), l1_pages=24, l2_pages=64, store=store, tenant=pp_tenant,
                   layers=lr, locks=locks[s])
            for s, lr in enumerate(stages)
        ]  # fmt: skip
        engines.extend(pp)

        def instance_worker(e: Engine, w: int) -> Callable[[], None]:
            def go() -> None:
                rnd = random.Random(w)
                for i in range(REQUESTS):
                    if run.late():
                        return
                    run.one(e, f"i{w}-{i}", _request(rnd, 1000 * w + i), think_s=rnd.choice([0, 0, 1e-3, 4e-3]))

            return go

        def pp_pair(w: int) -> tuple[Callable[[], None], Callable[[], None]]:
            todo: queue.Queue[tuple[str, list[bytes]] | None] = queue.Queue()

            def stage0() -> None:  # decides the requests; stage 1 runs each after it (joins its lock)
                rnd = random.Random(100 + w)
                try:
                    for i in range(REQUESTS):
                        if run.late():
                            return
                        rid, hs = f"p{w}-{i}", _request(rnd, 9000 + 1000 * w + i)
                        todo.put((rid, hs))
                        run.one(pp[0], rid, hs)
                finally:
                    todo.put(None)

            def stage1() -> None:
                while (item := todo.get(timeout=JOIN_S)) is not None:
                    run.one(pp[1], *item)

            return stage0, stage1

        for k, e in enumerate(inst):
            for t in range(2):
                run.spawn(f"inst{k}-t{t}", instance_worker(e, 10 * k + t))
        for w in range(2):
            s0, s1 = pp_pair(w)
            run.spawn(f"pp{w}-s0", s0)
            run.spawn(f"pp{w}-s1", s1)
        run.join()
        elapsed = time.monotonic() - run.t0

        st = []
        for e in inst + pp:
            e.cache.flush()
            st.append(e.cache.stats())
        assert run.served >= 4 * REQUESTS, (run.served, run.full, elapsed)  # the deadline did not cut it short
        for s in st:
            assert s["errors"] == 0 and s["pp_short"] == 0 and s["active_requests"] == 0, s
            assert s["l1_pages"]["pinned"] == 0 and s["l2_pages"]["pinned"] == 0, s
        for e in inst + pp:
            pf = e.cache.movers.l3_in.prefetcher  # type: ignore[union-attr]
            assert pf is not None
            end = time.monotonic() + 10  # batches interrupt() left behind free their pages when they land
            while pf.quarantined_pages() and time.monotonic() < end:
                time.sleep(0.01)
            assert e.used() == (0, 0)
        assert not md.locks(), md.locks()  # every lock released by its last stage
        # the races happened: interrupted prefetches, hits from every tier, evictions, both writes
        total = {k: sum(s[k] if isinstance(s[k], int) else sum(s[k].values()) for s in st)
                 for k in ("prefetch_interrupted", "l1_to_l2_writes", "l2_to_l3_writes")}  # fmt: skip
        assert total["prefetch_interrupted"] > 0 and total["l1_to_l2_writes"] > 0 and total["l2_to_l3_writes"] > 0
        for tier in ("l1", "l2", "l3"):
            assert sum(s["hit_pages"][tier] for s in st[:2]) > 0, (tier, st[:2])
        assert sum(s["hit_pages"]["l3"] for s in st[2:]) > 0
        # the PP stages hit the same page count in every request both served (the lock's length)
        both = [(run.hits[id(pp[0]), rid], run.hits[id(pp[1]), rid]) for (e, rid) in run.hits if e == id(pp[0])
                and (id(pp[1]), rid) in run.hits]  # fmt: skip
        assert len(both) >= REQUESTS and all(a == b for a, b in both), both
        assert all(s["evictions"]["l1"] > 0 and s["evictions"]["l2"] > 0 for s in st[:2]), st
    finally:
        for lk in locks:
            lk.close()
        md.etcd.close()
    # what the racing writers left in L3 holds the right bytes: a fresh instance reads every root
    # (its free L1 and L2 poisoned, each hit byte-checked by run())
    r = Engine(CacheConfig(prefetch_policy="wait_complete"), l1_pages=64, l2_pages=64, store=store, tenant=tenant)
    engines.append(r)
    got = [r.run(f"check{j}", root).l3 for j, root in enumerate(ROOTS)]
    assert sum(got) > 0 and r.used() == (0, 0), got
