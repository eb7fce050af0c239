"""Integrity under faults (issue 10, part A) against real etcd/master/agents, every wait bounded:

(a) another key's complete object (page + trailer) stored under a key with a plain Mooncake client
(b) objects without a trailer / of another size / with another format's trailer
(c) two MHA geometries with equal page bytes and model string
(d) a writer SIGKILLed in the middle of a large put: no false put OKs, its space reclaimed
(e) a reader whose get spans a master restart (stale replica descriptors, other keys written into
    the freed space) and plain reads after a restart

Every get that is checked reads into pages poisoned with a sentinel first, so a get that writes
nothing cannot pass, and every OK page is compared with the bytes its key was written with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from l2core import HostKVPool, KVSpec
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client, key_digest
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, Outcome, outcome_of
from l3pool.pool.trailer import TRAILER, TRAILER_BYTES, TRAILER_MAGIC

from ..pool_helpers import cluster_store, random_keys, random_pool

REPO = Path(__file__).resolve().parents[3]
SENTINEL = 0xA5
SPECS = {"mla": KVSpec.mla(6, page_size=16), "mha": KVSpec.mha(4, 2, 64, page_size=16)}
# every layout, and layer_first in both modes
CONFIGS = [
    (att, layout, mode)
    for att in ("mla", "mha")
    for layout, mode in (
        ("page_first", "multi"),
        ("page_first_direct", "multi"),
        ("layer_first", "multi"),
        ("layer_first", "staging"),
    )
]


def _poison(pool: HostKVPool, pages: Any) -> None:
    addrs, sizes = pool.layout.page_runs(np.asarray(list(pages)))
    flat = pool.buffer.numpy()
    for a, s in zip(addrs.reshape(-1).tolist(), sizes.reshape(-1).tolist(), strict=True):
        flat[a : a + s] = SENTINEL


def _checked_get(
    client: L3Client, keys: list[str], dst: list[int], want: dict[str, bytes]
) -> tuple[list[Outcome], int]:
    """get into poisoned pages; returns the outcomes and the number of OK pages with wrong bytes."""
    _poison(client.pool, dst)
    res = client.get(keys, dst)
    wrong = sum(
        1
        for k, p, r in zip(keys, dst, res, strict=True)
        if r is Outcome.OK and client.pool.page_bytes_of(p) != want.get(k)
    )
    return res, wrong


class _Scratch:
    """A registered host buffer for raw (plain Mooncake) objects."""

    def __init__(self, store: MooncakeStore, nbytes: int) -> None:
        self.store, self.buf = store, np.zeros(nbytes, dtype=np.uint8)
        store.register(self.buf.ctypes.data, self.buf.nbytes)

    @property
    def ptr(self) -> int:
        return int(self.buf.ctypes.data)

    def close(self) -> None:
        self.store.unregister(self.ptr)


# -- (a) another key's complete object under a key ---------------------------------------------------
@pytest.mark.parametrize(("attention", "layout", "mode"), CONFIGS)
def test_another_keys_object_is_a_miss(store: MooncakeStore, attention: str, layout: str, mode: str) -> None:
    spec = SPECS[attention]
    pool = random_pool(spec, layout, 64, len(layout) + len(attention))
    ns = Namespace.for_pool(spec, layout, "m1", tenant=uuid.uuid4().hex)
    other_ns = Namespace.for_pool(spec, layout, "m1", tenant=uuid.uuid4().hex)  # same geometry and size
    client = L3Client(pool, store, ns, batch_pages=8, layer_first_mode=mode)  # type: ignore[arg-type]
    other = L3Client(pool, store, other_ns, batch_pages=8, layer_first_mode=mode)  # type: ignore[arg-type]
    n, size = 6, spec.page_bytes + TRAILER_BYTES
    scratch = _Scratch(store, size)
    try:
        keys, victims = random_keys(ns, n, seed=1), random_keys(ns, n, seed=2)
        foreign = random_keys(other_ns, n, seed=3)
        want = {k: pool.page_bytes_of(p) for k, p in zip(keys, range(n), strict=True)}
        want.update({k: pool.page_bytes_of(p) for k, p in zip(foreign, range(n, 2 * n), strict=True)})
        assert client.put(keys, range(n)) == [Outcome.OK] * n
        assert other.put(foreign, range(n, 2 * n)) == [Outcome.OK] * n
        # copy each complete object (page + its trailer) under a key it does not belong to
        for src, dst in zip(keys, victims, strict=True):
            assert store.get([src], [scratch.ptr], [size]) == [Outcome.OK]
            assert store.put([dst], [scratch.ptr], [size]) == [Outcome.OK]
        crossed = random_keys(ns, n, seed=4)  # another namespace's objects under this namespace's keys
        for src, dst in zip(foreign, crossed, strict=True):
            assert store.get([src], [scratch.ptr], [size]) == [Outcome.OK]
            assert store.put([dst], [scratch.ptr], [size]) == [Outcome.OK]
        assert client.lookup(victims) == n  # present as far as Mooncake knows
        res, wrong = _checked_get(client, victims + crossed, list(range(2 * n, 4 * n)), want)
        assert res == [Outcome.MISS] * (2 * n) and wrong == 0
        assert client.stats.trailer_rejections == 2 * n and client.stats.gets == 0
        # the genuine objects still read back bit-exact
        res, wrong = _checked_get(client, keys, list(range(2 * n, 3 * n)), want)
        assert res == [Outcome.OK] * n and wrong == 0
    finally:
        scratch.close()
        client.close()
        other.close()
        pool.close()


# -- (b) no trailer / another size / another format -------------------------------------------------
@pytest.mark.parametrize(("attention", "layout", "mode"), CONFIGS)
def test_objects_without_trailer_or_of_another_size_are_misses(
    store: MooncakeStore, attention: str, layout: str, mode: str
) -> None:
    spec = SPECS[attention]
    pool = random_pool(spec, layout, 64, 7)
    ns = Namespace.for_pool(spec, layout, "m1", checksum=layout == "page_first", tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns, batch_pages=4, layer_first_mode=mode)  # type: ignore[arg-type]
    pb = spec.page_bytes
    scratch = _Scratch(store, pb + 2 * TRAILER_BYTES)
    try:
        keys = random_keys(ns, 6, seed=5)
        scratch.buf[:] = np.frombuffer(np.random.default_rng(1).bytes(scratch.buf.nbytes), dtype=np.uint8)
        tr = scratch.buf[pb : pb + TRAILER_BYTES].view(TRAILER)

        def trailer(**kw: int) -> None:
            tr["magic"], tr["version"], tr["flags"] = TRAILER_MAGIC, ns.format_version, int(ns.checksum)
            tr["length"], tr["key"], tr["checksum"] = pb, 0, 0
            for f, v in kw.items():
                tr[f] = v

        cases: list[tuple[str, int, Callable[[str], None]]] = [
            ("bare page (an older version's object)", pb, lambda k: None),
            ("page + 8-byte CRC (format 1 with checksum)", pb + 8, lambda k: None),
            ("longer object", pb + 2 * TRAILER_BYTES, lambda k: trailer(key=key_digest(k))),
            ("zero trailer", pb + TRAILER_BYTES, lambda k: tr.view(np.uint8).fill(0)),
            ("format version 1", pb + TRAILER_BYTES, lambda k: trailer(key=key_digest(k), version=1)),
            ("another length", pb + TRAILER_BYTES, lambda k: trailer(key=key_digest(k), length=pb - 1)),
        ]
        for key, (_what, size, make) in zip(keys, cases, strict=True):
            make(key)
            assert store.put([key], [scratch.ptr], [size]) == [Outcome.OK]
        res, wrong = _checked_get(client, keys, list(range(32, 38)), {})
        assert res == [Outcome.MISS] * len(cases), list(zip([c[0] for c in cases], res, strict=True))
        assert wrong == 0 and client.stats.trailer_rejections == len(cases) and client.stats.gets == 0
    finally:
        scratch.close()
        client.close()
        pool.close()


# -- (c) head geometry ------------------------------------------------------------------------------
def test_mha_head_geometry_namespaces_isolated(store: MooncakeStore) -> None:
    """2 heads x 128 and 4 heads x 64: same model string, same page bytes, other namespaces;
    neither reads the other's pages, even when an object is copied across by hand."""
    a_spec, b_spec = KVSpec.mha(4, 2, 128, page_size=16), KVSpec.mha(4, 4, 64, page_size=16)
    assert a_spec.page_bytes == b_spec.page_bytes
    tenant = uuid.uuid4().hex
    a_pool, b_pool = random_pool(a_spec, "page_first", 64, 1), random_pool(b_spec, "page_first", 64, 2)
    a_ns = Namespace.for_pool(a_spec, "page_first", "same-model", tenant=tenant)
    b_ns = Namespace.for_pool(b_spec, "page_first", "same-model", tenant=tenant)
    assert a_ns.ns_id != b_ns.ns_id
    a, b = L3Client(a_pool, store, a_ns), L3Client(b_pool, store, b_ns)
    size = a_spec.page_bytes + TRAILER_BYTES
    scratch = _Scratch(store, size)
    try:
        hashes = page_hashes(np.arange(8 * 16), 16)  # the same tokens on both sides
        assert a.put(a_ns.keys(hashes), range(8)) == [Outcome.OK] * 8
        assert b.lookup(b_ns.keys(hashes)) == 0
        res, wrong = _checked_get(b, b_ns.keys(hashes), list(range(8, 16)), {})
        assert res == [Outcome.MISS] * 8 and wrong == 0
        for ka, kb in zip(a_ns.keys(hashes), b_ns.keys(hashes), strict=True):  # copy A's objects to B's keys
            assert store.get([ka], [scratch.ptr], [size]) == [Outcome.OK]
            assert store.put([kb], [scratch.ptr], [size]) == [Outcome.OK]
        res, wrong = _checked_get(b, b_ns.keys(hashes), list(range(8, 16)), {})
        assert res == [Outcome.MISS] * 8 and wrong == 0 and b.stats.trailer_rejections == 8
        with pytest.raises(ValueError, match="namespace"):
            b.get(a_ns.keys(hashes), range(8))
        with pytest.raises(Exception, match="num_kv_heads"):
            L3Client(b_pool, store, a_ns)  # a namespace that does not describe the pool is refused
    finally:
        scratch.close()
        a.close()
        b.close()
        a_pool.close()
        b_pool.close()


# -- (d) a writer killed in the middle of a large put -----------------------------------------------
WRITER = r"""
import sys
import numpy as np
from l2core import HostKVPool, KVSpec, L2Config
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, StoreConfig
master, meta, host, tenant, n = sys.argv[1:6]
n = int(n)
spec = KVSpec.mla(8, page_size=64)
pool = HostKVPool(L2Config(kv=spec, layout="page_first", tokens=n * 64, pin="never"))
pool.buffer.fill_(7)
st = MooncakeStore(StoreConfig(master=master, metadata=meta, local_hostname=host))
ns = Namespace.for_pool(spec, "page_first", "killed-writer", tenant=tenant)
c = L3Client(pool, st, ns, batch_pages=n)
keys = ns.keys(page_hashes(np.arange(n * 64), 64))
print("READY", flush=True)
c.put(keys, range(n))
print("DONE", flush=True)
"""


def _allocated(c: LocalCluster) -> float:
    with urllib.request.urlopen(f"{c.admin_url}/metrics", timeout=3) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("master_allocated_bytes "):
                return float(line.split()[1])
    raise AssertionError("no master_allocated_bytes in /metrics")


def test_killed_writer_no_false_put_ok_and_space_reclaimed() -> None:
    """A writer SIGKILLed mid-put (after the master allocated its objects, before it finished):
    later puts of the same keys never report OK for unreadable keys (PENDING instead), the dead
    writer's space is freed within 2 x put_start_release_timeout_sec, and the keys can be stored
    again. Measured times are printed (pytest -s)."""
    spec, n = KVSpec.mla(8, page_size=64), 400  # 590 KB pages: 236 MB in one put batch
    discard, release = 3, 6
    with LocalCluster(
        agents=1,
        segment_size="512MB",
        name=f"l3pw{uuid.uuid4().hex[:4]}",
        put_start_discard_timeout_sec=discard,
        put_start_release_timeout_sec=release,
    ) as c:
        st = cluster_store(c)
        pool = random_pool(spec, "page_first", 2 * n, 3)
        tenant = uuid.uuid4().hex
        ns = Namespace.for_pool(spec, "page_first", "killed-writer", tenant=tenant)
        client = L3Client(pool, st, ns, batch_pages=64)
        keys = ns.keys(page_hashes(np.arange(n * 64), 64))
        want = {k: pool.page_bytes_of(p) for k, p in zip(keys, range(n), strict=True)}
        env = {**os.environ, **c.client_env(), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        w = subprocess.Popen(
            [sys.executable, "-c", WRITER, c.master, c.metadata_url, c.client_host, tenant, str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=REPO,
        )
        try:
            assert w.stdout is not None
            assert w.stdout.readline().strip() == "READY"
            deadline = time.monotonic() + 30
            while _allocated(c) == 0 and time.monotonic() < deadline and w.poll() is None:
                time.sleep(0.002)
            os.kill(w.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            w.wait(10)
            assert "DONE" not in w.stdout.read(), "the writer finished before it was killed: no abandoned put"
            held = _allocated(c)
            assert held > 0 and all(r is Outcome.MISS for r in st.exists(keys)), "not an abandoned put"

            # the same keys from another process: never OK for a key that is not readable
            in_window = time.monotonic() - t_kill < discard - 0.5  # the dead put still holds its keys
            res = client.put(keys, range(n))
            ok = [k for k, r in zip(keys, res, strict=True) if r is Outcome.OK]
            pending = res.count(Outcome.PENDING)
            got, wrong = _checked_get(client, ok, list(range(n, n + len(ok))), want) if ok else ([], 0)
            assert got == [Outcome.OK] * len(ok) and wrong == 0  # every OK is readable with its bytes
            assert set(res) <= {Outcome.OK, Outcome.PENDING} and (pending > 0 or not in_window), res
            assert client.stats.puts == len(ok) and client.stats.put_pending == pending
            t_put = time.monotonic() - t_kill

            # the abandoned objects' space comes back (Mooncake's put-start release timeout)
            bound = 2 * release + 10
            while _allocated(c) > len(ok) * (spec.page_bytes + TRAILER_BYTES) and time.monotonic() - t_kill < bound:
                time.sleep(0.25)
            reclaimed = time.monotonic() - t_kill
            assert _allocated(c) <= len(ok) * (spec.page_bytes + TRAILER_BYTES), f"{held} bytes still held"
            print(
                f"\nkilled writer: {held / 1e6:.0f} MB held; put after {t_put:.2f} s: {pending} PENDING, "
                f"{len(ok)} OK (all readable); space reclaimed {reclaimed:.1f} s after the kill "
                f"(discard {discard} s, release {release} s)"
            )
            # and the keys can be stored again, truthfully
            deadline = time.monotonic() + 2 * discard + 10
            while time.monotonic() < deadline:
                res = client.put(keys, range(n))
                if res == [Outcome.OK] * n:
                    break
                time.sleep(0.5)
            assert res == [Outcome.OK] * n, {r: res.count(r) for r in set(res)}
            got, wrong = _checked_get(client, keys, list(range(n, 2 * n)), want)
            assert got == [Outcome.OK] * n and wrong == 0
        finally:
            if w.poll() is None:
                w.kill()
            client.close()
            pool.close()
            st.close()


# -- (e) master restart -----------------------------------------------------------------------------
class _StallingStore:
    """A store whose multi-buffer get looks up the replicas, then stalls (runs `stall`), then
    transfers from the replicas it looked up: Mooncake's get session API makes the reader's
    stall between lookup and transfer deterministic."""

    def __init__(self, inner: MooncakeStore, stall: Callable[[], None]) -> None:
        self._inner, self._stall, self.stalled = inner, stall, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_multi(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[Outcome]:
        s = self._inner._s
        assert s.batch_get_session_start(list(keys)) == [0] * len(keys)
        self._stall()
        self.stalled += 1
        offs = [np.concatenate([[0], np.cumsum(z)[:-1]]).tolist() for z in sizes]
        codes = s.batch_get_into_multi_buffer_ranges(list(keys), ptrs, sizes, offs)
        s.batch_get_session_end(list(keys))
        return [Outcome.BAD_REQUEST if 0 <= c != sum(z) else outcome_of(c) for c, z in zip(codes, sizes, strict=True)]


@pytest.mark.parametrize("checksum", [False, True])
def test_master_restart_never_ok_with_wrong_bytes(checksum: bool) -> None:
    """Objects written; a reader looks them up and stalls while the master restarts and other keys
    of the same size are written into the freed space; its transfer then reads those other
    objects: every page is a miss (their trailers name other keys), none OK with wrong bytes.
    Then plain reads of the old keys after the restart: misses too."""
    spec, n = SPECS["mla"], 16
    with LocalCluster(agents=1, segment_size="64MB", name=f"l3pr{uuid.uuid4().hex[:4]}") as c:
        st = cluster_store(c)
        pool = random_pool(spec, "page_first", 4 * n, 11)
        ns = Namespace.for_pool(spec, "page_first", "m1", checksum=checksum, tenant=uuid.uuid4().hex)
        writer = L3Client(pool, st, ns, batch_pages=n)
        old, new = random_keys(ns, n, seed=1), random_keys(ns, n, seed=2)
        want = {k: pool.page_bytes_of(p) for k, p in zip(old, range(n), strict=True)}
        new_bytes = {pool.page_bytes_of(p) for p in range(n, 2 * n)}
        stalled: dict[str, float] = {}

        def restart_and_overwrite() -> None:
            t0 = time.monotonic()
            c.stop_master()
            c.start_master()
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:  # until the agent has remounted its segment
                if writer.put(new, range(n, 2 * n)) == [Outcome.OK] * n:
                    break
                time.sleep(0.3)
            else:
                raise AssertionError("no put succeeded within 40 s of the master's restart")
            stalled["recovered_s"] = time.monotonic() - t0

        reader = L3Client(pool, _StallingStore(st, restart_and_overwrite), ns, batch_pages=n)  # type: ignore[arg-type]
        try:
            assert writer.put(old, range(n)) == [Outcome.OK] * n
            dst = list(range(2 * n, 3 * n))
            res, wrong = _checked_get(reader, old, dst, want)
            assert wrong == 0, f"{wrong} pages OK with another key's bytes"
            assert res == [Outcome.MISS] * n, res
            # the scenario really happened: the stale transfer delivered the other keys' bytes
            landed = sum(1 for p in dst if pool.page_bytes_of(p) in new_bytes)
            assert landed > 0 and reader.stats.trailer_rejections == n
            # after the restart the old keys are gone: plain reads are misses, never OK
            res, wrong = _checked_get(writer, old, dst, want)
            assert res == [Outcome.MISS] * n and wrong == 0
            fresh = {k: pool.page_bytes_of(p) for k, p in zip(new, range(n, 2 * n), strict=True)}
            res, wrong = _checked_get(writer, new, dst, fresh)
            assert res == [Outcome.OK] * n and wrong == 0
            print(f"\nmaster restart: writes after {stalled['recovered_s']:.1f} s; {landed} stale pages rejected")
        finally:
            reader.close()
            writer.close()
            pool.close()
            st.close()


# -- one client, several threads ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "mode", "checksum"),
    [("page_first", "multi", True), ("layer_first", "staging", True), ("page_first_direct", "multi", False)],
)
def test_client_shared_by_threads(store: MooncakeStore, layout: str, mode: str, checksum: bool) -> None:
    """N threads put and get different keys through one client (fewer buffer slots than
    threads): every page OK and bit-exact."""
    spec, threads, per, rounds = SPECS["mha"], 6, 8, 5
    pool = random_pool(spec, layout, threads * per * 2, 13)
    ns = Namespace.for_pool(spec, layout, "m1", checksum=checksum, tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns, batch_pages=3, layer_first_mode=mode, max_concurrency=4)  # type: ignore[arg-type]
    errors: list[str] = []
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        src = list(range(t * per, (t + 1) * per))
        dst = list(range(threads * per + t * per, threads * per + (t + 1) * per))
        want_src = [pool.page_bytes_of(p) for p in src]
        start.wait()
        for r in range(rounds):
            keys = random_keys(ns, per, seed=1000 * t + r)
            want = dict(zip(keys, want_src, strict=True))
            if client.put(keys, src) != [Outcome.OK] * per:
                errors.append(f"thread {t} round {r}: put failed")
            res, wrong = _checked_get(client, keys, dst, want)
            if res != [Outcome.OK] * per or wrong:
                errors.append(f"thread {t} round {r}: {res} wrong={wrong}")

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join(120)
    try:
        assert not any(x.is_alive() for x in ts), "threads did not finish within 120 s"
        assert not errors, errors[:5]
        assert client.stats.gets == threads * per * rounds and client.stats.trailer_rejections == 0
        assert client.stats.checksum_failures == 0
        assert len(client._slots) <= 4
    finally:
        client.close()
        pool.close()
