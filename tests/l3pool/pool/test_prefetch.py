"""Prefetcher against the real local cluster (etcd, mooncake_master, 2 agents in their own network
namespaces when root): interrupt at random points, generations, cancel/close, a dead agent, bad
input, and a `l3pool prefetch-check --json` smoke run. Bounded: every wait has a timeout."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core import ConfigError, HostKVPool, KVSpec, L2Config
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.prefetch import PrefetchClosed, Prefetcher, batch_schedule
from l3pool.pool.store import MooncakeStore, Outcome
from l3pool.procenv import python_env

from ..conftest import wait_for
from ..pool_helpers import cluster_store, random_keys, random_pool

SPEC = KVSpec.mla(2, page_size=16)  # 36 KB pages
LAYOUT = "page_first_direct"
CLUSTER_SEGMENT = "128MB"  # per agent of this module's cluster (conftest)
N = 96  # pages per test prefix
POISON = 0xA5  # byte every reader page holds until a prefetch writes it
REPO = Path(__file__).resolve().parents[3]


class Setup:
    """A writer pool holding known bytes under `keys`, and a reader pool + client to prefetch into."""

    def __init__(self, store: MooncakeStore, n: int = N, reader_pages: int = 4 * N) -> None:
        self.ns = Namespace.for_pool(SPEC, LAYOUT, "pf", tenant=uuid.uuid4().hex)
        self.wpool = random_pool(SPEC, LAYOUT, n, n)
        self.writer = L3Client(self.wpool, store, self.ns, batch_pages=32)
        self.keys = random_keys(self.ns, n, n)
        assert self.writer.put(self.keys, range(n)) == [Outcome.OK] * n
        self.pool = HostKVPool(L2Config(kv=SPEC, layout=LAYOUT, tokens=reader_pages * SPEC.page_size, pin="never"))
        self.poison_pool()
        self.client = L3Client(self.pool, store, self.ns, batch_pages=32)
        self.want = self.wpool.buffer.view(n, -1)

    def poison_pool(self) -> None:
        """Every reader page holds POISON (call while no checked result is held): a page the
        prefetcher hands out without writing it never already holds a key's bytes."""
        self.pool.buffer.fill_(POISON)

    def release(self, pages: np.ndarray) -> None:
        """Poison, then free: the LIFO allocator hands these very pages out next, and they must
        not still hold the expected bytes (that made the interrupted-prefetch checks vacuous)."""
        self.pool.fill_pages(pages, POISON)
        self.pool.free(pages)

    def check_prefix(self, pages: np.ndarray) -> None:
        """pages[i] holds key i's bytes, for every i of the prefix."""
        got = self.pool.buffer.view(self.pool.num_pages, -1)[torch.from_numpy(pages)]
        assert torch.equal(got, self.want[: len(pages)])

    def used(self) -> int:
        return self.pool.stats().used_pages

    def close(self) -> None:
        self.client.close()
        self.writer.close()
        self.pool.close()
        self.wpool.close()


@pytest.fixture
def setup(store: MooncakeStore) -> Iterator[Setup]:
    s = Setup(store)
    yield s
    s.close()


# -- the batch schedule (pure) -------------------------------------------------------------------
def test_batch_schedule_examples() -> None:
    assert batch_schedule(512, 32, 128) == [32, 64, 128, 128, 128, 32]
    assert batch_schedule(512, 64, 256) == [64, 128, 256, 64]
    assert batch_schedule(96, 16, 32) == [16, 32, 32, 16]
    assert batch_schedule(100, 16, 128) == [16, 32, 52]  # a tail < first joins the last batch
    assert batch_schedule(20, 16, 128) == [20]
    assert batch_schedule(96, 8, 8, growth=1) == [8] * 12  # fixed batches, the old behaviour
    assert batch_schedule(10, 4, 4, growth=1) == [4, 4, 2]  # folding never exceeds the cap
    assert batch_schedule(0, 16, 64) == [] and batch_schedule(1, 16, 64) == [1]
    assert batch_schedule(100, 10, 1000, growth=1.5) == [10, 15, 22, 33, 20]
    for bad in ((10, 0, 4, 2.0), (10, 4, 0, 2.0), (10, 4, 8, 0.5)):
        with pytest.raises(ValueError):
            batch_schedule(*bad)


def test_batch_schedule_properties() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n, first = rng.randrange(0, 3000), rng.randrange(1, 200)
        cap, growth = rng.randrange(first, 600), rng.choice([1, 1.5, 2, 3, 4.5])
        sizes = batch_schedule(n, first, cap, growth)
        assert sum(sizes) == n and all(0 < k <= cap for k in sizes)
        if n:
            assert sizes[0] == min(n, first) or (len(sizes) == 1 and sizes[0] == n <= cap)
        body = sizes[:-1]  # all but the last batch grow geometrically up to the cap
        assert all(abs(b - min(cap, first * growth**i)) <= 1 for i, b in enumerate(body))
        assert all(a <= b for a, b in itertools.pairwise(body))
        assert len(sizes) < 2 or sizes[-1] >= first or sizes[-2] + sizes[-1] > cap


def test_config_errors(setup: Setup) -> None:
    with pytest.raises(ConfigError, match="growth"):
        Prefetcher(setup.client, growth=0.5)
    with pytest.raises(ConfigError, match="max_batch_pages"):
        Prefetcher(setup.client, batch_pages=64, max_batch_pages=32)
    with pytest.raises(ConfigError, match="max_batch_pages"):
        Prefetcher(setup.client, max_batch_pages=0)
    for bad in (-0.1, "1", True):
        with pytest.raises(ConfigError, match="interrupt_wait_s"):
            Prefetcher(setup.client, interrupt_wait_s=bad)  # type: ignore[arg-type]
    with Prefetcher(setup.client, batch_pages=8) as pf:  # the cap defaults to the client's batch
        assert (pf.batch_pages, pf.max_batch_pages, pf.growth) == (8, setup.client.batch_pages, 2.0)


# -- against the cluster ----------------------------------------------------------------------------
def test_full_prefetch_is_exact(setup: Setup) -> None:
    with Prefetcher(setup.client, batch_pages=16) as pf:
        res = pf.submit("r", setup.keys).wait(20)
        sizes = batch_schedule(N, 16, pf.max_batch_pages, pf.growth)
    assert res.complete and not res.interrupted and res.error is None and res.generation == 1
    assert res.keys_loaded == N == len(res.pages) and len(res.batch_ms) == len(sizes) == 4
    setup.check_prefix(res.pages)
    assert setup.used() == N  # the caller owns the prefix now
    setup.release(res.pages)
    assert setup.used() == 0


def test_check_catches_a_skipped_batch_on_recycled_pages(setup: Setup) -> None:
    """The byte check can fail: after a full prefetch is released, a prefetch of the same keys
    gets the same pages back (LIFO); one batch that writes nothing yet says OK is caught."""
    with Prefetcher(setup.client, batch_pages=16, max_batch_pages=16) as pf:
        first = pf.submit("a", setup.keys).wait(20)
        setup.release(first.pages)
        real, calls = setup.client.get, [0]

        def skips_second_batch(keys: list[str], pages: np.ndarray) -> list[Outcome]:
            calls[0] += 1
            return [Outcome.OK] * len(keys) if calls[0] == 2 else real(keys, pages)

        setup.client.get = skips_second_batch  # type: ignore[method-assign]
        again = pf.submit("b", setup.keys).wait(20)
    assert again.complete and sorted(again.pages.tolist()) == sorted(first.pages.tolist())  # recycled
    with pytest.raises(AssertionError):
        setup.check_prefix(again.pages)
    got = setup.pool.read_pages(again.pages[16:32])
    assert bool((got == POISON).all())  # exactly the skipped batch holds the sentinel
    setup.check_prefix(again.pages[:16])
    setup.release(again.pages)


def test_interrupt_at_random_points(setup: Setup) -> None:
    """Seeded random interrupt times, some while queued behind another prefetch: every returned
    prefix is contiguous and byte-exact, and after freeing it no L2 page is left in use."""
    rng = random.Random(1234)
    base = setup.used()
    slow = setup.client.get

    def get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
        time.sleep(0.002)  # every batch takes a little time, so interrupts land mid-way
        return slow(keys, pages)

    setup.client.get = get  # type: ignore[method-assign]
    partial = 0
    with Prefetcher(setup.client, batch_pages=8, max_inflight=2) as pf:
        for trial in range(10):
            setup.poison_pool()  # nothing is held between trials
            hs = [pf.submit(f"t{trial}-{j}", setup.keys) for j in range(3)]  # the third one queues
            time.sleep(rng.uniform(0, 0.05))
            for h in hs:
                t0 = time.perf_counter()
                res = h.interrupt(timeout=20)
                assert time.perf_counter() - t0 < 5
                assert res.error is None and res.keys_loaded == len(res.pages) <= N
                assert res.interrupted == (res.keys_loaded < N)
                assert len(set(res.pages.tolist())) == len(res.pages)
                setup.check_prefix(res.pages)
                partial += res.keys_loaded < N
                setup.release(res.pages)
            assert setup.used() == base
    assert partial > 0  # the trials really interrupted something


@pytest.mark.parametrize(("first", "cap", "growth", "pipeline"), [(4, 64, 2.0, 2), (2, 32, 3.0, 3), (8, 8, 1.0, 1)])
def test_growing_batches_interrupt_at_batch_boundaries(
    setup: Setup, first: int, cap: int, growth: float, pipeline: int
) -> None:
    """Batches follow the schedule (each one Mooncake call of at most `cap` pages, at most
    `pipeline` in flight); an interrupt at a random time returns a byte-exact prefix that ends
    on a batch boundary, and nothing leaks."""
    rng = random.Random(first * 100 + cap)
    base = setup.used()
    real = setup.client.get
    index = {k: i for i, k in enumerate(setup.keys)}
    calls: list[tuple[int, int]] = []
    mu = threading.Lock()
    inflight = [0, 0]  # now, most

    def get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
        with mu:
            calls.append((index[keys[0]], len(keys)))
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
        time.sleep(0.001 + 0.0002 * len(keys))  # larger batches take longer, as on the wire
        try:
            return real(keys, pages)
        finally:
            with mu:
                inflight[0] -= 1

    setup.client.get = get  # type: ignore[method-assign]
    sizes = batch_schedule(N, first, cap, growth)
    bounds = set(np.cumsum([0, *sizes]).tolist())
    with Prefetcher(setup.client, batch_pages=first, max_batch_pages=cap, growth=growth, pipeline=pipeline) as pf:
        full = pf.submit("full", setup.keys).wait(20)
        assert full.complete and sorted(calls) == list(zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes, strict=True))
        setup.check_prefix(full.pages)
        setup.release(full.pages)
        partial = 0
        for trial in range(12):
            setup.poison_pool()  # nothing is held between trials
            h = pf.submit(f"g{trial}", setup.keys)
            time.sleep(rng.uniform(0, 0.03))
            res = h.interrupt(timeout=20)
            assert res.error is None and res.keys_loaded == len(res.pages) and res.keys_loaded in bounds
            assert res.interrupted == (res.keys_loaded < N)
            setup.check_prefix(res.pages)
            partial += res.keys_loaded < N
            setup.release(res.pages)
            assert setup.used() == base
    assert 1 <= inflight[1] <= pipeline and max(k for _, k in calls) <= cap
    assert partial > 0


def test_interrupt_warns_only_when_it_leaves_pages_in_flight(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    """interrupt() returning before the worker finished is worth a warning only when a batch is
    still in flight (its pages quarantined); a prefetch still queued has none: debug level."""
    base = setup.used()
    started, go = threading.Event(), threading.Event()
    real = setup.client.get

    def held_get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
        started.set()
        go.wait(10)  # the call hangs, as under a frozen master
        return real(keys, pages)

    setup.client.get = held_get  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="l3pool.pool.prefetch")
    try:
        with Prefetcher(setup.client, batch_pages=8, max_inflight=1) as pf:
            busy = pf.submit("busy", setup.keys)
            assert started.wait(10)
            queued = pf.submit("queued", setup.keys)  # waits for the one worker: nothing in flight
            r = queued.interrupt(timeout=0)
            assert r.interrupted and r.keys_loaded == 0 and r.left_in_flight == 0
            r = busy.interrupt(timeout=0)
            assert r.interrupted and r.keys_loaded == 0 and r.left_in_flight == 8
            go.set()
    finally:
        go.set()
    recs = [(x.levelno, x.getMessage()) for x in caplog.records if x.name == "l3pool.pool.prefetch"]
    warned = [m for lv, m in recs if lv >= logging.WARNING]
    assert len(warned) == 1 and "prefetch busy gen 1" in warned[0] and "8 pages in flight" in warned[0], recs
    assert any(lv == logging.DEBUG and "prefetch queued gen 1" in m and "0 pages in flight" in m for lv, m in recs)
    assert pf.quarantined_pages() == 0 and setup.used() == base


def test_cancel_and_close_free_everything(setup: Setup) -> None:
    base = setup.used()
    pf = Prefetcher(setup.client, batch_pages=8, max_inflight=1)
    a = pf.submit("a", setup.keys)
    b = pf.submit("b", setup.keys)  # queued behind a
    assert b.cancel() and a.cancel()
    assert a.wait(20).cancelled and len(a.wait().pages) == 0
    assert b.wait(20).cancelled
    assert setup.used() == base
    done = pf.submit("c", setup.keys)
    done._done.wait(20)  # finished, never delivered
    running = pf.submit("d", setup.keys)
    pf.close()
    assert done.wait(1).cancelled and running.wait(1).cancelled
    assert setup.used() == base and pf.inflight() == 0
    with pytest.raises(PrefetchClosed):
        pf.submit("e", setup.keys)
    # a delivered result is the caller's: cancel() then frees nothing
    with Prefetcher(setup.client) as pf2:
        h = pf2.submit("f", setup.keys)
        res = h.wait(20)
        assert not h.cancel()
    assert setup.used() == base + N
    setup.release(res.pages)


def test_older_generation_never_overwrites_newer(setup: Setup) -> None:
    base = setup.used()
    gate = threading.Event()
    real = setup.client.get

    def get(keys: list[str], pages: np.ndarray) -> list[Outcome]:
        gate.wait(10)  # the first generation is held back until the newer one exists
        return real(keys, pages)

    setup.client.get = get  # type: ignore[method-assign]
    with Prefetcher(setup.client, batch_pages=N, max_inflight=2) as pf:
        old = pf.submit("req", setup.keys)
        time.sleep(0.05)
        new = pf.submit("req", setup.keys[: N // 2])
        assert (old.generation, new.generation, pf.generation("req")) == (1, 2, 2)
        gate.set()
        r_new, r_old = new.wait(20), old.wait(20)  # the newer may even finish first
        assert r_old.superseded and len(r_old.pages) == 0 and r_old.keys_loaded == 0
        assert r_new.generation == 2 and r_new.keys_loaded == N // 2 and not r_new.superseded
        setup.check_prefix(r_new.pages)
        # a finished but undelivered result is discarded by a newer submit too
        g3 = pf.submit("req2", setup.keys)
        g3._done.wait(20)
        g4 = pf.submit("req2", setup.keys[:8])
        assert g3.wait(1).superseded and g4.wait(20).keys_loaded == 8
        setup.release(g4.wait().pages)
    setup.release(r_new.pages)
    assert setup.used() == base


def test_miss_ends_prefix_and_errors_free(setup: Setup) -> None:
    base = setup.used()
    keys = list(setup.keys)
    keys[37] = setup.ns.keys([b"\x01" * 16])[0]  # never written
    with Prefetcher(setup.client, batch_pages=16) as pf:
        res = pf.submit("m", keys).wait(20)
        assert res.keys_loaded == 37 and res.stopped_by == Outcome.MISS.value and res.error is None
        setup.check_prefix(res.pages)
        setup.release(res.pages)

        def boom(keys: list[str], pages: np.ndarray) -> list[Outcome]:
            raise RuntimeError("transport exploded")

        setup.client.get = boom  # type: ignore[method-assign]
        res = pf.submit("e", setup.keys).wait(20)
        assert res.keys_loaded == 0 and "transport exploded" in (res.error or "")
    assert setup.used() == base
    # L2 too small: the prefix ends where the pool ran out (the batch that did not fit shrinks to
    # the free pages), byte-exact up to there
    small = HostKVPool(L2Config(kv=SPEC, layout=LAYOUT, tokens=40 * SPEC.page_size, pin="never"))
    client = L3Client(small, setup.client.store, setup.ns)
    try:
        with Prefetcher(client, batch_pages=16) as pf:
            res = pf.submit("s", setup.keys).wait(20)
        assert res.keys_loaded == 40 == len(res.pages) and "L2 is full" in (res.error or "")
        got = small.buffer.view(small.num_pages, -1)[torch.from_numpy(res.pages)]
        assert torch.equal(got, setup.want[:40])
        small.free(res.pages)
        assert small.stats().used_pages == 0
    finally:
        client.close()
        small.close()


def test_bad_input(setup: Setup, store: MooncakeStore) -> None:
    with pytest.raises(ConfigError, match="batch_pages"):
        Prefetcher(setup.client, batch_pages=0)
    with pytest.raises(ConfigError, match="max_inflight"):
        Prefetcher(setup.client, max_inflight=0)
    other = Namespace.for_pool(SPEC, LAYOUT, "other-model")
    with Prefetcher(setup.client) as pf:
        with pytest.raises(ValueError, match="namespace"):
            pf.submit("x", other.keys([b"\x02" * 16]))
        with pytest.raises(ValueError, match="request_id"):
            pf.submit("", setup.keys)
        with pytest.raises(TimeoutError):
            gate = threading.Event()
            real = setup.client.get
            setup.client.get = lambda k, p: (gate.wait(5), real(k, p))[1]  # type: ignore[method-assign]
            h = pf.submit("slow", setup.keys)
            try:
                h.wait(0.05)
            finally:
                gate.set()
        setup.release(h.wait(20).pages)
        empty = pf.submit("empty", []).wait(5)
        assert empty.keys_loaded == 0 and empty.complete
    assert setup.used() == 0


def test_dead_agent_gives_shorter_prefix() -> None:
    """Kill one donor: the pages it held fail (transfer failure or miss); the prefetch returns the
    prefix before the first of them, byte-exact, with no error. Own cluster (destructive)."""
    with LocalCluster(agents=2, segment_size="64MB", name=f"l3pd{uuid.uuid4().hex[:4]}", lease_ttl=3) as c:
        st = cluster_store(c)
        s = Setup(st, n=64)
        try:
            c.kill_agent(0, signal.SIGKILL)
            with Prefetcher(s.client, batch_pages=8) as pf:
                t0 = time.monotonic()
                res = pf.submit("dead", s.keys).wait(60)
                assert time.monotonic() - t0 < 60
            assert res.error is None and res.keys_loaded < 64 and res.stopped_by is not None
            s.check_prefix(res.pages)
            # ground truth: the first page that cannot be read now is where the prefix ended
            scratch = s.pool.alloc(64)
            truth = s.client.get(s.keys, scratch)
            s.release(scratch)
            first_bad = next(i for i, r in enumerate(truth) if r is not Outcome.OK)
            assert res.keys_loaded == first_bad
            s.release(res.pages)
            assert s.used() == 0
        finally:
            s.close()
            st.close()


def test_cli_prefetch_check_json(tmp_path: Path) -> None:
    env = python_env()
    cmd = [sys.executable, "-m", "l3pool.cli", "prefetch-check", "--json", "--pages", "48", "--batch", "8",
           "--requests", "2", "--interrupt-after", "0.5", "--layers", "2", "--page-size", "16",
           "--segment-size", "64MB", "--name", f"l3pq{uuid.uuid4().hex[:4]}",
           "--state-dir", str(tmp_path)]  # no cluster recorded there: it starts its own  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["correct"] is True and rep["requests"] == 2
    assert rep["prefetch_GBps"] > 0 and rep["batch_p99_ms"] >= rep["batch_p50_ms"] > 0
    assert rep["interrupt_p99_ms"] is not None and rep["leaked_pages"] == 0


def test_prefetch_check_catches_interrupted_batches_that_write_nothing(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch check's interrupted phase lands on the pages the full phase just freed (LIFO),
    which held the expected bytes: a get that writes nothing there must still fail the check."""
    from l3pool.tools import prefetch_check as pt

    for k, v in cluster.client_env().items():
        monkeypatch.setenv(k, v)
    seen: set[str] = set()
    real = L3Client.get

    def nothing_on_repeat(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
        if keys[0] in seen:  # the second pass over a batch (the interrupted phase): write nothing
            return [Outcome.OK] * len(keys)
        seen.add(keys[0])
        return real(self, keys, pages)

    monkeypatch.setattr(L3Client, "get", nothing_on_repeat)
    ps = pt.PrefixSet(2, 16, 48, 2, 0, uuid.uuid4().hex)
    wa = cluster.agents[-1]
    ep = pt.Endpoints(cluster.master, cluster.metadata_url, cluster.client_host, cluster.etcd_endpoints,
                      wa.netns, wa.ip if wa.netns else None, cluster.mode)  # fmt: skip
    args = argparse.Namespace(batch=8, inflight=2, interrupt_after="1.0")
    rep = pt.run_test(ps, ep, args, progress=False)
    phases = {f["phase"] for f in rep["failures"]}
    assert rep["correct"] is False and phases == {"interrupt"}, rep["failures"]
    assert rep["leaked_pages"] == 0


def test_prefetch_check_byte_checks_every_prefix_however_it_ended(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefixes of prefetches that ended early are byte-checked too, not only complete ones: a
    full-phase prefetch stopped by a failed batch after 8 intact pages reports 0 wrong pages of 8,
    an interrupted-phase one whose first batch wrote nothing reports its 8 pages wrong, and every
    page of every returned prefix is counted in checked_pages."""
    from l3pool.tools import prefetch_check as pt

    for k, v in cluster.client_env().items():
        monkeypatch.setenv(k, v)
    ps = pt.PrefixSet(2, 16, 48, 2, 0, uuid.uuid4().hex)
    r0, r1 = ps.keys(0), ps.keys(1)
    passes: dict[str, int] = {}
    real = L3Client.get

    def faulty(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
        seen = passes[keys[0]] = passes.get(keys[0], 0) + 1  # 1: the full phase, 2: the interrupted one
        if (seen, keys[0]) in ((1, r0[8]), (2, r1[8])):  # the second batch of a request fails
            return [Outcome.TRANSFER_FAIL] * len(keys)
        if (seen, keys[0]) == (2, r1[0]):  # r1's first batch reports OK but writes nothing
            return [Outcome.OK] * len(keys)
        return real(self, keys, pages)

    monkeypatch.setattr(L3Client, "get", faulty)
    wa = cluster.agents[-1]
    ep = pt.Endpoints(cluster.master, cluster.metadata_url, cluster.client_host, cluster.etcd_endpoints,
                      wa.netns, wa.ip if wa.netns else None, cluster.mode)  # fmt: skip
    args = argparse.Namespace(batch=8, inflight=2, interrupt_after="1.0")
    rep = pt.run_test(ps, ep, args, progress=False)
    fails = {(f["request"], f["phase"]): (f["loaded"], f["wrong_pages"], f["stopped_by"]) for f in rep["failures"]}
    assert fails == {(0, "full"): (8, 0, "transfer_fail"), (1, "interrupt"): (8, 8, "transfer_fail")}, rep
    assert rep["checked_pages"] == {"full": 8 + 48, "interrupt": sum(rep["interrupted_prefix_pages"])}
    assert rep["interrupted_prefix_pages"][1] == 8 and rep["correct"] is False and rep["leaked_pages"] == 0


def test_prefetch_check_leaves_nothing_in_the_pool(
    cluster: LocalCluster, store: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs against users' running pools: its test set is removed at the end, and what a
    writer stored before it failed is removed too (the error still reaches the user)."""
    from l3pool.cliutil import UserError
    from l3pool.tools import prefetch_check as pt

    for k, v in cluster.client_env().items():
        monkeypatch.setenv(k, v)
    wa = cluster.agents[-1]
    ep = pt.Endpoints(cluster.master, cluster.metadata_url, cluster.client_host, cluster.etcd_endpoints,
                      wa.netns, wa.ip if wa.netns else None, cluster.mode)  # fmt: skip
    args = argparse.Namespace(batch=8, inflight=2, interrupt_after="0.5")

    ps = pt.PrefixSet(2, 16, 48, 2, 0, uuid.uuid4().hex)
    keys = [k for r in range(ps.requests) for k in ps.keys(r)]
    rep = pt.run_test(ps, ep, args, progress=False)
    assert rep["correct"] is True and rep["test_pages_removed"] == len(keys) == 96
    assert not store.present(keys).any()

    real_writer = pt.run_writer
    stored: list[int] = []

    def writer_then_fails(ps: pt.PrefixSet, ep: pt.Endpoints) -> dict[str, object]:
        real_writer(ps, ep)
        stored.append(int(store.present([k for r in range(ps.requests) for k in ps.keys(r)]).sum()))
        raise UserError("the writer stored 96 of 192 test pages (96 POOL_FULL)", code=1)

    monkeypatch.setattr(pt, "run_writer", writer_then_fails)
    ps2 = pt.PrefixSet(2, 16, 48, 2, 1, uuid.uuid4().hex)
    with pytest.raises(UserError, match="POOL_FULL"):
        pt.run_test(ps2, ep, args, progress=False)
    assert stored == [96]  # the pages were there when the writer failed ...
    assert not store.present([k for r in range(ps2.requests) for k in ps2.keys(r)]).any()  # ... and are gone


# -- wait_live: a waiter bounded by the pool's liveness (fake store: logic only) -----------------
class _Fake:
    """A writer's pages in a FakePageStore and a reader client with a deadline set."""

    def __init__(self, delay_s: float) -> None:
        from ..fake_store import FakePageStore

        self.store = FakePageStore()
        self.store.call_deadline_s = 0.05
        self.ns = Namespace.for_pool(SPEC, LAYOUT, "live", tenant=uuid.uuid4().hex)
        self.wpool = random_pool(SPEC, LAYOUT, 16, 7)
        self.keys = random_keys(self.ns, 16, 7)
        writer = L3Client(self.wpool, self.store, self.ns, batch_pages=16)  # type: ignore[arg-type]
        assert writer.put(self.keys, range(16)) == [Outcome.OK] * 16
        writer.close()
        self.pool = HostKVPool(L2Config(kv=SPEC, layout=LAYOUT, tokens=32 * SPEC.page_size, pin="never"))
        self.client = L3Client(self.pool, self.store, self.ns, batch_pages=16)  # type: ignore[arg-type]
        self.store.get_delay_s = delay_s

    def close(self) -> None:
        self.client.close()
        self.pool.close()
        self.wpool.close()


def test_wait_live_waits_for_a_slow_transfer_of_a_live_pool() -> None:
    """A get slower than the deadline while the store answers: waited for, whole, byte-exact
    (the liveness checks ran, and none interrupted it)."""
    f = _Fake(delay_s=0.3)
    try:
        with Prefetcher(f.client, batch_pages=16, max_inflight=1) as pf:
            res = pf.submit("slow", f.keys).wait_live(timeout=10)
            assert not res.interrupted and res.keys_loaded == 16 and res.left_in_flight == 0
            got = f.pool.buffer.view(f.pool.num_pages, -1)[torch.from_numpy(res.pages)]
            assert torch.equal(got, f.wpool.buffer.view(16, -1))
            assert f.store.calls.count("answers") >= 3  # every half deadline while the batch was out
            f.pool.free(res.pages)
    finally:
        f.close()


def test_wait_live_does_not_leave_a_batch_behind_for_one_missed_probe() -> None:
    """One liveness probe without an answer (its thread descheduled on a loaded host) is asked
    again before the batch is left behind: the live pool's slow transfer is waited for, whole."""
    f = _Fake(delay_s=0.3)
    try:
        with Prefetcher(f.client, batch_pages=16, max_inflight=1) as pf:
            f.store.answers_missed = 1
            res = pf.submit("blip", f.keys).wait_live(timeout=10)
            assert f.store.answers_missed == 0  # the missed probe ran
            assert not res.interrupted and res.keys_loaded == 16 and res.left_in_flight == 0, res
            got = f.pool.buffer.view(f.pool.num_pages, -1)[torch.from_numpy(res.pages)]
            assert torch.equal(got, f.wpool.buffer.view(16, -1))
            assert pf.quarantined_pages() == 0
            f.pool.free(res.pages)
    finally:
        f.close()


def test_wait_live_interrupts_when_the_pool_stops_answering() -> None:
    """The store stops answering while a batch is in flight: wait_live() returns within about
    two deadlines (a missed probe, then the one that confirms it), interrupted, the batch's pages
    quarantined until its call returns, then freed; a timeout still raises TimeoutError while the
    pool answers."""
    f = _Fake(delay_s=1.0)
    try:
        with Prefetcher(f.client, batch_pages=16, max_inflight=1) as pf:
            h = pf.submit("hung", f.keys)
            f.store.exists_answer = Outcome.UNAVAILABLE
            t0 = time.monotonic()
            res = h.wait_live()
            took = time.monotonic() - t0
            assert res.interrupted and res.keys_loaded == 0 and res.left_in_flight == 16, res
            assert took < 0.5, took  # ~25-35 ms; the get itself takes 1 s
            assert pf.quarantined_pages() == 16
            wait_for(lambda: pf.quarantined_pages() == 0, 10, "the quarantine to drain")
            assert f.pool.stats().used_pages == 0
            f.store.exists_answer = None
            with pytest.raises(TimeoutError):
                pf.submit("slow", f.keys).wait_live(timeout=0.2)
    finally:
        f.close()
