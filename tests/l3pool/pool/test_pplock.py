"""PP-stage locks against the real local cluster (etcd + mooncake_master + a decode agent).

The master runs with a 2 s read lease (LocalCluster's `default_kv_lease_ttl`, the master's
`--default_kv_lease_ttl=2000`) instead of 10 s, so "held longer than Mooncake's own lease" and "nothing stays
pinned" take seconds. Stages of the multi-process tests are separate Python processes, each with
its own HostKVPool + MooncakeStore + L3Client + StageLocks for its layer range."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from l2core import HostKVPool, KVSpec
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.metadata import Metadata
from l3pool.pool.pplock import LockError, StageLocks, UnknownRequest, _prefix_lens
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig
from l3pool.procenv import python_env

from ..pool_helpers import random_pool

ROOT = Path(__file__).resolve().parents[3]
STAGES = 4
LAYERS_PER_STAGE = 2
SPEC = KVSpec.mla(LAYERS_PER_STAGE, page_size=16)  # 36,864 B pages
KV_LEASE_MS = 2000  # the master's read lease in these tests
LOCK_TTL = 2


def _namespaces(tenant: str) -> list[Namespace]:
    return [
        Namespace.for_pool(
            SPEC, "page_first_direct", "ppm", layers=(s * LAYERS_PER_STAGE, (s + 1) * LAYERS_PER_STAGE), tenant=tenant
        )
        for s in range(STAGES)
    ]


def _pool(pages: int, seed: int) -> HostKVPool:
    return random_pool(SPEC, "page_first_direct", pages, seed)


def _hashes(r: int, pages: int) -> list[bytes]:
    toks = np.random.default_rng(1000 + r).integers(0, 1 << 20, pages * SPEC.page_size)
    return page_hashes(toks, SPEC.page_size)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    name = f"l3pl{uuid.uuid4().hex[:4]}"
    with LocalCluster(agents=1, segment_size="32MB", name=name, default_kv_lease_ttl=str(KV_LEASE_MS)) as c:
        yield c


@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[MooncakeStore]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cluster.client_env().items():
            mp.setenv(k, v)
        s = MooncakeStore(
            StoreConfig(master=cluster.master, metadata=cluster.metadata_url, local_hostname=cluster.client_host)
        )
    yield s
    s.close()


@pytest.fixture
def md(cluster: LocalCluster) -> Iterator[Metadata]:
    e = EtcdClient(cluster.etcd_endpoints)
    yield Metadata(e, cluster.key_prefix)
    e.close()


def _wait(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


# -- in-process protocol checks ------------------------------------------------------------------
def test_protocol_lengths_reports_and_errors(store: MooncakeStore, md: Metadata) -> None:
    nss = _namespaces(uuid.uuid4().hex)
    pool = _pool(16, seed=1)
    clients = [L3Client(pool, store, ns) for ns in nss]
    locks = [StageLocks(md, store, nss, s, ttl=LOCK_TTL, refresh_s=0.5) for s in range(STAGES)]
    try:
        hashes = _hashes(0, 8)
        for s, (cl, ns) in enumerate(zip(clients, nss, strict=True)):
            keys = ns.keys(hashes)
            n = 5 if s == 2 else 8  # stage 2 lacks pages 5..7
            assert cl.put(keys[:n], range(n)) == [Outcome.OK] * n
        time.sleep(KV_LEASE_MS / 1000 + 0.3)  # the lease of put's own completeness check lapses first
        rid = f"req-{uuid.uuid4().hex[:8]}"
        g = locks[0].acquire(rid, hashes)
        assert (g.length, g.per_stage, g.stages, g.pages) == (5, (8, 8, 5, 8), STAGES, 8)
        with pytest.raises(LockError, match="already locked"):
            locks[0].acquire(rid, hashes)
        assert [locks[s].join(rid, page_hashes=hashes) for s in range(1, STAGES)] == [5, 5, 5]
        # held pages carry a Mooncake read lease: the master refuses to remove them
        assert store.remove(nss[3].keys(hashes)[0]) is Outcome.LEASE
        info = locks[1].lock_info(rid)
        assert info is not None and info["length"] == 5 and info["done"] == [] and info["ttl_left"] > 0
        assert any(e.key == rid for e in md.locks())
        assert locks[1].report_done(rid) is False
        assert locks[1].report_done(rid) is False  # duplicate: ignored
        assert locks[0].report_done(rid) is False
        assert locks[2].report_done(rid) is False
        lk = locks[2].lock_info(rid)
        assert lk is not None and lk["done"] == [0, 1, 2]
        t0 = time.perf_counter()
        assert locks[3].report_done(rid) is True  # the last report releases
        assert md.etcd.get(locks[0].lock_key(rid)) is None, "lock still there after the last report"
        assert time.perf_counter() - t0 < 1.0
        assert not md.etcd.get_prefix(locks[0].lock_key(rid) + "/")  # markers gone with it
        assert locks[3].report_done(rid) is False  # late: ignored
        assert locks[0].report_done(rid) is False
        assert all(rid not in lk_.held() for lk_ in locks)
        # unknown ids: a clear error, never a hang
        with pytest.raises(UnknownRequest, match="no lock for request 'nope-1'"):
            locks[1].join("nope-1", timeout=0.05)
        with pytest.raises(UnknownRequest, match="never acquired or joined"):
            locks[1].report_done("nope-2")
        with pytest.raises(ValueError, match="request id"):
            locks[0].acquire("bad/id", hashes)
        # a re-used id after release is a new lock; a stage's late report for the old one is ignored
        assert locks[0].acquire(rid, hashes).length == 5
        assert locks[1].report_done(rid) is False
        lk = locks[0].lock_info(rid)
        assert lk is not None and lk["done"] == []
        assert [locks[s].join(rid) for s in range(1, STAGES)] == [5, 5, 5]
        assert [locks[s].report_done(rid) for s in range(STAGES)] == [False, False, False, True]
        assert md.etcd.get(locks[0].lock_key(rid)) is None
    finally:
        for lk_ in locks:
            lk_.close()
        for cl in clients:
            cl.close()
        pool.close()


def test_lock_expires_without_holders_and_unpins(store: MooncakeStore, md: Metadata) -> None:
    """A holder that stops (close() without reporting, as a dead process would) lets the lock
    expire within the TTL, and its pages' read leases lapse: the master may remove them again."""
    nss = _namespaces(uuid.uuid4().hex)
    pool = _pool(8, seed=2)
    clients = [L3Client(pool, store, ns) for ns in nss]
    lk = StageLocks(md, store, nss, 0, ttl=LOCK_TTL, refresh_s=0.5)
    try:
        hashes = _hashes(1, 4)
        for cl, ns in zip(clients, nss, strict=True):
            cl.put(ns.keys(hashes), range(4))
        rid = f"req-{uuid.uuid4().hex[:8]}"
        assert lk.acquire(rid, hashes).length == 4
        time.sleep(KV_LEASE_MS / 1000 + 0.5)  # past one Mooncake lease: still leased through our refresh
        assert store.remove(nss[1].keys(hashes)[1]) is Outcome.LEASE
        lk.close()
        t = _wait(lambda: md.etcd.get(lk.lock_key(rid)) is None, LOCK_TTL + 2, "lock expiry")
        assert t <= LOCK_TTL + 1.5
        time.sleep(KV_LEASE_MS / 1000 + 0.3)
        assert store.remove(nss[1].keys(hashes)[1]) is Outcome.OK  # nothing pinned any more
    finally:
        lk.close()
        for cl in clients:
            cl.close()
        pool.close()


def test_prefix_lens() -> None:
    m = np.array([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=bool)
    assert _prefix_lens(m) == (2, 4, 0)
    assert _prefix_lens(np.zeros((3, 0), dtype=bool)) == (0, 0, 0)


@pytest.mark.parametrize("join_after", [0.0, 0.6])
def test_joiner_keeps_lock_after_stage0_dies(store: MooncakeStore, md: Metadata, join_after: float) -> None:
    """Stage 0 stops holding right after acquire. A stage that joined at once (young lock: its
    first keep-alive waits for its periodic refresh) or later (at once) keeps the lock and its
    pages' read leases alive well past the TTL and the master's read lease."""
    nss = _namespaces(uuid.uuid4().hex)
    pool = _pool(8, seed=3)
    clients = [L3Client(pool, store, ns) for ns in nss]
    lk0 = StageLocks(md, store, nss, 0, ttl=LOCK_TTL, refresh_s=0.5)
    lk2 = StageLocks(md, store, nss, 2, ttl=LOCK_TTL, refresh_s=0.5)
    try:
        hashes = _hashes(3, 4)
        for cl, ns in zip(clients, nss, strict=True):
            cl.put(ns.keys(hashes), range(4))
        rid = f"req-{uuid.uuid4().hex[:8]}"
        assert lk0.acquire(rid, hashes).length == 4
        time.sleep(join_after)
        assert lk2.join(rid, page_hashes=hashes) == 4
        lk0.close()  # stage 0 is gone
        time.sleep(LOCK_TTL + KV_LEASE_MS / 1000 + 0.5)
        assert md.etcd.get(lk0.lock_key(rid)) is not None, "lock expired although stage 2 holds it"
        assert store.remove(nss[2].keys(hashes)[0]) is Outcome.LEASE
        assert lk2.report_done(rid) is False
    finally:
        lk0.close()
        lk2.close()
        for cl in clients:
            cl.close()
        pool.close()


# -- stages as separate processes --------------------------------------------------------------
def _stage_main() -> None:
    """Entry of a stage process: argv[1] is its JSON config; JSON events on stdout; 'go' on stdin."""
    cfg = json.loads(sys.argv[1])
    s, R, P = cfg["stage"], cfg["requests"], cfg["pages"]
    nss = _namespaces(cfg["tenant"])
    st = MooncakeStore(StoreConfig(master=cfg["master"], metadata=cfg["metadata"], local_hostname=cfg["host"]))
    pool = _pool(2 * R * P, seed=100 + s)
    cl = L3Client(pool, st, nss[s], batch_pages=32)
    md = Metadata(EtcdClient(cfg["etcd"]), cfg["prefix"])
    lk = StageLocks(md, st, nss, s, ttl=cfg["ttl"], refresh_s=0.5)

    def emit(**kw: Any) -> None:
        print(json.dumps({"stage": s, **kw}), flush=True)

    emit(event="ready")
    sys.stdin.readline()
    hashes = {r: _hashes(cfg["seed"] + r, P) for r in range(R)}
    lengths = {}
    for r in range(R):
        rid = f"{cfg['tag']}-{r}"
        if s == 0:
            lengths[r] = lk.acquire(rid, hashes[r]).length
        else:
            lengths[r] = lk.join(rid, timeout=30, page_hashes=hashes[r])
    emit(event="locked", lengths=lengths)
    if s == cfg.get("hang_stage"):
        time.sleep(600)  # holds its locks until SIGKILLed
    time.sleep(cfg["hold_s"])  # hold while the pool is under eviction pressure
    for r in range(R):
        n = lengths[r]
        keys = nss[s].keys(hashes[r][:n])
        dst = [R * P + r * P + i for i in range(n)]
        res = cl.get(keys, dst)
        bad = sum(pool.page_bytes_of(d) != pool.page_bytes_of(r * P + i) for i, d in enumerate(dst))
        released = lk.report_done(f"{cfg['tag']}-{r}")
        emit(event="done", r=r, length=n, ok=sum(x is Outcome.OK for x in res), bad_bytes=bad, released=released)
    emit(event="exit")
    lk.close()
    cl.close()
    st.close()


class _Stage:
    def __init__(self, cfg: dict[str, Any], env: dict[str, str]) -> None:
        code = (
            "import sys; sys.path.insert(0, sys.argv[2]); "
            "from tests.l3pool.pool.test_pplock import _stage_main; _stage_main()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(cfg), str(ROOT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and self.events.empty()):
                raise AssertionError(f"stage process: no {event!r} (exit code {self.proc.poll()})")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if ev["event"] == event:
                return ev

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _spawn_stages(cluster: LocalCluster, cfg: dict[str, Any]) -> list[_Stage]:
    env = python_env(cluster.client_env())
    base = {
        "master": cluster.master,
        "metadata": cluster.metadata_url,
        "host": cluster.client_host,
        "etcd": cluster.etcd_endpoints,
        "prefix": cluster.key_prefix,
        "ttl": LOCK_TTL,
        **cfg,
    }
    return [_Stage({**base, "stage": s}, env) for s in range(STAGES)]


def _put_working_set(store: MooncakeStore, nss: list[Namespace], R: int, P: int, seed: int) -> list[HostKVPool]:
    pools = []
    for s, ns in enumerate(nss):
        pool = _pool(2 * R * P, seed=100 + s)  # the same bytes the stage process will compare with
        cl = L3Client(pool, store, ns, batch_pages=32)
        for r in range(R):
            # right after the eviction-pressure test the pool is full and fragmented (objects of
            # page + trailer bytes are not an allocator bin size): POOL_FULL until eviction frees
            deadline = time.monotonic() + 15
            while (res := cl.put(ns.keys(_hashes(seed + r, P)), range(r * P, (r + 1) * P))) != [Outcome.OK] * P:
                assert set(res) <= {Outcome.OK, Outcome.POOL_FULL} and time.monotonic() < deadline, res
                time.sleep(0.2)
        cl.close()
        pools.append(pool)
    return pools


class _Pressure:
    """Writes never-read pages as fast as it can (more than the pool holds) until stopped."""

    def __init__(self, store: MooncakeStore, tenant: str) -> None:
        self.ns = Namespace.for_pool(SPEC, "page_first_direct", "pressure", tenant=tenant)
        self.pool = _pool(32, seed=7)
        self.cl = L3Client(self.pool, store, self.ns, batch_pages=32)
        self.stored = self.full = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            res = self.cl.put(self.ns.keys([os.urandom(16) for _ in range(32)]), range(32))
            i += 1
            self.stored += res.count(Outcome.OK)
            self.full += res.count(Outcome.POOL_FULL)
            if Outcome.POOL_FULL in res:
                time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)
        self.cl.close()
        self.pool.close()


def test_stage_processes_agree_under_eviction_pressure(
    cluster: LocalCluster, store: MooncakeStore, md: Metadata
) -> None:
    """4 stage processes, 6 requests x 24 pages x 4 stages (21 MB) in a 32 MB pool while another
    writer pushes far more than the pool holds, locks held 2x longer than Mooncake's read lease:
    every stage gets the same length per request and the right bytes for all of it."""
    R, P, seed, tenant = 6, 24, 10, uuid.uuid4().hex
    nss = _namespaces(tenant)
    tag = f"ev{uuid.uuid4().hex[:6]}"
    pools = _put_working_set(store, nss, R, P, seed)
    control = nss[0].keys(_hashes(seed + 50, 24))  # present and leased once, but never locked
    ccl = L3Client(pools[0], store, nss[0])
    assert ccl.put(control, range(24)) == [Outcome.OK] * 24
    stages = _spawn_stages(
        cluster,
        {"requests": R, "pages": P, "seed": seed, "tenant": tenant, "tag": tag, "hold_s": 2 * KV_LEASE_MS / 1000},
    )
    pressure = None
    try:
        for st in stages:
            st.expect("ready", 60)
        assert store.exists(control) == [Outcome.OK] * 24  # grants the control pages one read lease
        pressure = _Pressure(store, tenant)
        for st in stages:
            st.go()
        locked = [st.expect("locked", 30)["lengths"] for st in stages]
        assert all(lens == locked[0] for lens in locked), locked
        done = [[st.expect("done", 30) for _ in range(R)] for st in stages]
        for st in stages:
            st.expect("exit", 15)
        # fresh pages are leased for one read lease (put checks what it wrote), so in this small
        # pool the writer may still be short of a pool's worth: let it go on, bounded
        _wait(lambda: pressure.stored * SPEC.page_bytes > cluster.segment_bytes, 20, "pressure")
        pressure.stop()
        for s in range(STAGES):
            for ev in done[s]:
                n = locked[0][str(ev["r"])]
                assert ev["length"] == n and ev["ok"] == n and ev["bad_bytes"] == 0, (s, ev)
        assert sum(v for v in locked[0].values()) > 0
        assert sum(ev["released"] for evs in done for ev in evs) == R  # exactly one release per request
        assert not [e for e in md.locks() if e.key.startswith(tag)]
        # the pressure was real: more than the pool was written, and unlocked pages were evicted
        assert pressure.stored * SPEC.page_bytes > cluster.segment_bytes, pressure.stored
        assert store.exists(control).count(Outcome.OK) < 24
    finally:
        if pressure is not None:
            pressure.stop()
        for st in stages:
            st.kill()
        ccl.close()
        for p in pools:
            p.close()


def test_sigkilled_stage_releases_within_ttl(cluster: LocalCluster, store: MooncakeStore, md: Metadata) -> None:
    """Stage 2 is SIGKILLed while holding its locks; the others finish and report. The locks are
    gone within the TTL of the last report and no page stays leased (the master may remove it)."""
    R, P, seed, tenant = 2, 8, 200, uuid.uuid4().hex
    nss = _namespaces(tenant)
    tag = f"kill{uuid.uuid4().hex[:6]}"
    pools = _put_working_set(store, nss, R, P, seed)
    stages = _spawn_stages(
        cluster, {"requests": R, "pages": P, "seed": seed, "tenant": tenant, "tag": tag, "hold_s": 0.3, "hang_stage": 2}
    )
    try:
        for st in stages:
            st.expect("ready", 60)
        for st in stages:
            st.go()
        locked = [st.expect("locked", 30)["lengths"] for st in stages]
        assert all(lens == {str(r): P for r in range(R)} for lens in locked), locked
        stages[2].proc.send_signal(signal.SIGKILL)
        stages[2].proc.wait(10)
        for s in (0, 1, 3):
            for _ in range(R):
                ev = stages[s].expect("done", 30)
                assert ev["ok"] == P and ev["bad_bytes"] == 0 and not ev["released"]
        t_last = time.monotonic()
        for r in range(R):
            info = md.etcd.get(f"{md.locks_prefix}{tag}-{r}")
            assert info is not None  # stage 2 never reported: not released by reports
        _wait(lambda: not [e for e in md.locks() if e.key.startswith(tag)], LOCK_TTL + 3, "lock expiry")
        assert time.monotonic() - t_last <= LOCK_TTL + 1.5
        time.sleep(KV_LEASE_MS / 1000 + 0.3)  # the last read lease anyone granted has lapsed
        for r in range(R):
            for ns in nss:
                assert store.remove(ns.keys(_hashes(seed + r, P))[0]) is Outcome.OK
    finally:
        for st in stages:
            st.kill()
        for p in pools:
            p.close()
