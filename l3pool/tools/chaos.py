"""`l3pool chaos`: fault scenarios against a local cluster, checking every page read back.

    l3pool chaos                 # every scenario on a fresh LocalCluster (etcd, master, 2 agents)
    l3pool chaos --quick --json  # fewer pages and iterations (tests)
    l3pool chaos --scenarios master_down,etcd_wiped

Scenarios (each bounded in time):
    master_down       master killed: blocking per call (p99), Prefetcher.interrupt() (p99), healthy(),
                      recovery after the restart (a fresh put + get round-trips)
    master_hung       master SIGSTOPped while a prefetch batch is inside Mooncake: interrupt()
                      latency, quarantined pages, calls while hung, recovery after SIGCONT, leaks
    master_restart    master restarted under read traffic, other keys written into the freed
                      space, then reads of the old keys (miss or right bytes, never wrong ones)
    agent_killed      an agent SIGKILLed under prefetch/get traffic; then restarted
    etcd_wiped        etcd restarted with an empty data dir: time until the namespace and member
                      records are back; a reader that does not create namespaces attaches again
    foreign_object    another key's complete object stored under a fresh key with a plain Mooncake
                      client: any OK read of that key is wrong bytes (key-bound trailer needed)
    writer_killed     a writer process SIGKILLed mid-put; the same keys put again by a live client:
                      an OK put whose key does not read back is a false OK; reclaim of the dead
                      writer's space (master_allocated_bytes back to its baseline), when in bounds

Every checked read goes into destination pages poisoned first; a page counts as wrong when its
outcome is OK and its bytes differ from what was written under its key. Exit 0 when no scenario
saw a wrong byte, a false put OK, a leaked L2 page or an error; 1 otherwise; 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from l3pool.measure import percentile
from l3pool.procenv import python_env
from l3pool.tables import table

log = logging.getLogger(__name__)

SCENARIOS = (
    "foreign_object", "writer_killed", "etcd_wiped", "agent_killed", "master_hung", "master_restart", "master_down",
)  # fmt: skip
LAYOUT = "page_first"
_POISON = 0x5A


@dataclass
class Result:
    scenario: str
    pages_checked: int = 0  # pages read back with their outcome checked (OK pages byte-compared)
    wrong: int = 0  # OK pages whose bytes are not the key's
    false_ok: int = 0  # puts reported OK whose key does not read back with its bytes
    leaked: int = 0  # L2 pages still allocated after everything was freed (quarantine drained)
    recover_s: float | None = None  # from the fault's end to the first verified round trip
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.wrong == 0 and self.false_ok == 0 and self.leaked == 0 and self.error is None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _p99_ms(xs: list[float]) -> float | None:
    return round(percentile(xs, 99) * 1e3, 2) if xs else None


def _timed_interrupt(pf: Any, rid: str, d: Data, res: Result) -> float:
    """Submit a prefetch of `d.keys`, interrupt it at once, check and free what it delivered;
    seconds interrupt() took."""
    h = pf.submit(rid, d.keys)
    t = time.monotonic()
    r = h.interrupt()
    took = time.monotonic() - t
    d.check(res, np.arange(r.keys_loaded), r.pages, [_ok()] * r.keys_loaded)
    d.dst.free(r.pages)
    return took


def _wait(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until cond() held, None after `timeout`."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if cond():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(interval)


class Ctx:
    """The cluster, one store client, and the knobs of a run."""

    def __init__(self, cluster: Any, quick: bool, inject_wrong: bool) -> None:
        from l3pool.pool.store import MooncakeStore, StoreConfig

        self.c, self.quick, self.inject_wrong = cluster, quick, inject_wrong
        self.spec = _spec()
        self.store = MooncakeStore(StoreConfig(master=cluster.master, metadata=cluster.metadata_url,
                                               local_hostname=cluster.client_host))  # fmt: skip
        self.bound = 20.0 if quick else 45.0  # longest wait for a recovery

    def close(self) -> None:
        self.store.close()


def _spec() -> Any:
    from l2core import KVSpec

    return KVSpec.mla(4, page_size=16)  # 72 KB pages


def _page_set(tenant: str, n: int, seed: int, pool: Any) -> tuple[Any, list[str]]:
    """The namespace and keys of a seeded page set, its bytes written into `pool` pages 0..n-1:
    the same seed gives the same keys and bytes in every process."""
    import torch

    from l3pool.pool.keys import Namespace, page_hashes

    spec = pool.spec
    ns = Namespace.for_pool(spec, LAYOUT, "chaos", tenant=tenant)
    g = torch.Generator().manual_seed(seed)
    pool.buffer.view(pool.num_pages, -1)[:n] = torch.randint(0, 256, (n, pool.layout.page_bytes), dtype=torch.uint8,
                                                             generator=g)  # fmt: skip
    toks = np.random.default_rng(seed).integers(0, 1 << 30, n * spec.page_size)
    return ns, list(ns.keys(page_hashes(toks, spec.page_size)))


def _child_env(host: str) -> dict[str, str]:
    return python_env({"MC_TCP_BIND_ADDRESS": host})


class Data:
    """`n` pages of seeded random bytes under fresh keys: a writer pool/client and a reader pool/client."""

    def __init__(
        self, ctx: Ctx, n: int, tag: str, *, seed: int | None = None, tenant: str | None = None, store: Any = None,
        metadata: Any = None, **kw: Any,
    ) -> None:  # fmt: skip
        from l2core import HostKVPool, L2Config
        from l3pool.pool.client import L3Client

        self.ctx, self.n = ctx, n
        self.seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
        self.tenant = tenant or f"{tag}-{uuid.uuid4().hex[:8]}"
        st = store or ctx.store
        tokens = n * ctx.spec.page_size
        self.src = HostKVPool(L2Config(kv=ctx.spec, layout=LAYOUT, tokens=tokens, pin="never"))
        self.ns, self.keys = _page_set(self.tenant, n, self.seed, self.src)
        self.dst = HostKVPool(L2Config(kv=ctx.spec, layout=LAYOUT, tokens=2 * tokens, pin="never"))
        self.writer = L3Client(self.src, st, self.ns, batch_pages=64, metadata=metadata, **kw)
        self.reader = L3Client(self.dst, st, self.ns, batch_pages=64)
        self.want = self.src.buffer.view(n, -1)
        self.rows = self.dst.buffer.view(self.dst.num_pages, -1)

    def put(self) -> int:
        from l3pool.pool.protocols import Outcome

        return sum(r is Outcome.OK for r in self.writer.put(self.keys, range(self.n)))

    def poison(self, pages: np.ndarray) -> None:
        import torch

        self.rows[torch.from_numpy(np.asarray(pages, dtype=np.int64))] = _POISON

    def check(self, res: Result, idx: np.ndarray, pages: np.ndarray, outcomes: list[Any]) -> int:
        """Compare every OK page with the bytes of its key; returns how many were OK."""
        import torch

        from l3pool.pool.protocols import Outcome

        ok = np.flatnonzero(np.fromiter((o is Outcome.OK for o in outcomes), dtype=np.bool_, count=len(outcomes)))
        res.pages_checked += len(outcomes)
        if not len(ok):
            return 0
        got = self.rows[torch.from_numpy(np.asarray(pages, dtype=np.int64)[ok])]
        if self.ctx.inject_wrong:  # a reader that skipped verification: one flipped byte
            got[0, 0] ^= 0xFF
        want = self.want[torch.from_numpy(np.asarray(idx, dtype=np.int64)[ok])]
        res.wrong += int((got != want).any(dim=1).sum())
        return len(ok)

    def read(self, res: Result, idx: np.ndarray, base: int = 0) -> int:
        """Checked get of keys[idx] into poisoned destination pages base..base+len(idx)."""
        pages = np.arange(base, base + len(idx))
        self.poison(pages)
        out = self.reader.get([self.keys[i] for i in idx], pages)
        return self.check(res, idx, pages, out)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()
        self.dst.close()
        self.src.close()


def _all_put(d: Data) -> bool:
    return d.put() == d.n


def _round_trip(ctx: Ctx, res: Result, n: int = 8) -> bool:
    """A fresh put + checked get of `n` pages succeeds (the pool works again)."""
    d = Data(ctx, n, "probe")
    try:
        if d.put() != n:
            return False
        return d.read(res, np.arange(n)) == n
    finally:
        d.close()


# -- scenarios -------------------------------------------------------------------------------------
def sc_master_down(ctx: Ctx, res: Result) -> None:
    from l3pool.pool.prefetch import Prefetcher

    d = Data(ctx, 64, "mdown")
    pf = Prefetcher(d.reader, batch_pages=16, max_batch_pages=64)
    try:
        assert d.put() == 64, "initial put failed"
        ctx.c.stop_master()
        t = time.monotonic()
        d.read(res, np.arange(32))
        res.figures["first_call_s"] = round(time.monotonic() - t, 3)
        lat, ilat = [], []
        for _ in range(20 if ctx.quick else 60):
            t = time.monotonic()
            d.read(res, np.arange(32))
            lat.append(time.monotonic() - t)
            t = time.monotonic()
            d.reader.lookup(d.keys)
            lat.append(time.monotonic() - t)
            ilat.append(_timed_interrupt(pf, "r", d, res))
        res.figures.update(
            block_p99_ms=_p99_ms(lat), interrupt_p99_ms=_p99_ms(ilat), healthy_while_down=ctx.store.healthy()
        )
        res.figures["breaker"] = {k: ctx.store.stats()[k] for k in ("trips", "short_circuits")}
        ctx.c.start_master()
        res.recover_s = _wait(lambda: _round_trip(ctx, res), ctx.bound, 0.5)
        if res.recover_s is None:
            res.error = f"no verified round trip within {ctx.bound:.0f} s of the restart"
    finally:
        pf.close()
        res.leaked = d.dst.stats().used_pages
        d.close()


def sc_master_hung(ctx: Ctx, res: Result) -> None:
    from l3pool.pool.prefetch import Prefetcher

    d = Data(ctx, 64, "mhung")
    real, calls, stopped = d.reader.get, [0], threading.Event()

    def get(keys: Any, pages: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            ctx.c.signal_master(signal.SIGSTOP)
            stopped.set()
        return real(keys, pages)

    d.reader.get = get  # type: ignore[method-assign,assignment]
    pf = Prefetcher(d.reader, batch_pages=16, max_batch_pages=16)
    try:
        assert d.put() == 64, "initial put failed"
        d.poison(np.arange(d.dst.num_pages))
        h = pf.submit("hung", d.keys)
        if not stopped.wait(10):
            raise RuntimeError("the prefetch never reached its second batch")
        time.sleep(0.2)  # the second batch is inside Mooncake now
        t = time.monotonic()
        r = h.interrupt()
        ilat = [time.monotonic() - t]
        d.check(res, np.arange(r.keys_loaded), r.pages, [_ok()] * r.keys_loaded)
        res.figures.update(hung_interrupt_ms=round(ilat[0] * 1e3, 2), quarantined=pf.quarantined_pages())
        d.dst.free(r.pages)
        _wait(lambda: ctx.store.breaker.is_open, 5)
        lat = []
        for i in range(20 if ctx.quick else 60):
            t = time.monotonic()
            ctx.store.exists(d.keys[:8])
            lat.append(time.monotonic() - t)
            ilat.append(_timed_interrupt(pf, f"r{i}", d, res))
        res.figures.update(
            block_p99_ms=_p99_ms(lat), interrupt_p99_ms=_p99_ms(ilat), healthy_while_hung=ctx.store.healthy()
        )
        ctx.c.signal_master(signal.SIGCONT)
        res.recover_s = _wait(lambda: pf.quarantined_pages() == 0 and _round_trip(ctx, res), ctx.bound, 0.1)
        if res.recover_s is None:
            res.error = f"no recovery within {ctx.bound:.0f} s of SIGCONT (quarantined {pf.quarantined_pages()})"
    finally:
        ctx.c.signal_master(signal.SIGCONT)
        pf.close()
        res.leaked = d.dst.stats().used_pages
        d.close()


def _ok() -> Any:
    from l3pool.pool.protocols import Outcome

    return Outcome.OK


def _grew(xs: list[float], k: int) -> bool:
    return len(xs) > k


def _read_all_since(rounds: list[dict[str, int]], mark: int, n: int) -> bool:
    return any(r["ok"] == n for r in rounds[mark:])


def sc_master_restart(ctx: Ctx, res: Result) -> None:
    """Read traffic in this process, and a reader process that is SIGSTOPped at a random moment
    (most of its time is inside one batched get) while the master restarts and other keys are
    written into the freed space, then SIGCONTed: the stalled get must not return OK pages with
    the other keys' bytes (issue 10, case 1)."""
    n = 128
    d = Data(ctx, n, "mrestart")
    stop = threading.Event()
    errors: list[str] = []
    rng = np.random.default_rng()

    def traffic() -> None:
        while not stop.is_set():
            try:
                d.read(res, np.sort(rng.choice(n, 16, replace=False)))
            except Exception as e:  # counted: the scenario fails
                errors.append(f"{type(e).__name__}: {e}")
                return

    t = threading.Thread(target=traffic, name="chaos-traffic", daemon=True)
    others: list[Data] = []
    tmp = tempfile.mkdtemp(prefix="l3pool-chaos-")
    stop_file = os.path.join(tmp, "stop")
    rounds: list[dict[str, int]] = []
    starts: list[float] = []  # when the reader announced a get
    child = subprocess.Popen(_child_cmd(ctx, "reader", d, "--stop-file", stop_file), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=_child_env(ctx.c.client_host))  # fmt: skip

    def collect() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                if "start" in r:
                    starts.append(time.monotonic())
                else:
                    rounds.append(r)

    reader = threading.Thread(target=collect, name="chaos-reader-out", daemon=True)
    reader.start()
    try:
        t.start()
        for cycle in range(2 if ctx.quick else 3):
            if _wait(functools.partial(_all_put, d), ctx.bound, 0.5) is None:
                raise RuntimeError(f"puts of the reader's keys not working within {ctx.bound:.0f} s")
            mark = len(rounds)
            if _wait(functools.partial(_read_all_since, rounds, mark, n), ctx.bound) is None:
                raise RuntimeError(f"the reader process never read all {n} pages (code {child.poll()})")
            k = len(starts)  # stop it 0-5 ms into its next get (a get of 128 pages takes ~10-30 ms here)
            if _wait(functools.partial(_grew, starts, k), 5.0, 0.0005) is None:
                raise RuntimeError("the reader process stopped reading")
            time.sleep(float(rng.uniform(0, 0.005)))
            child.send_signal(signal.SIGSTOP)
            ctx.c.stop_master()
            ctx.c.start_master()
            t0 = time.monotonic()
            for k in range(2):  # other keys written into the space the old objects had
                o = Data(ctx, n, f"other{cycle}{k}")
                others.append(o)
                if _wait(functools.partial(_all_put, o), ctx.bound, 0.5) is None:
                    raise RuntimeError(f"puts not working {ctx.bound:.0f} s after the master restart")
                if res.recover_s is None:
                    res.recover_s = time.monotonic() - t0
            child.send_signal(signal.SIGCONT)
            time.sleep(0.3)
        stop.set()
        t.join(30)
        res.figures["old_keys_ok"] = d.read(res, np.arange(n))  # after the last restart: misses
        if errors:
            res.error = errors[0]
    finally:
        stop.set()
        t.join(30)
        child.send_signal(signal.SIGCONT)
        Path(stop_file).touch()
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
        reader.join(5)
        with contextlib.suppress(OSError):
            os.unlink(stop_file)
            os.rmdir(tmp)
        for o in others:
            o.close()
        d.close()
    res.pages_checked += sum(r["pages"] for r in rounds)
    res.wrong += sum(r["wrong"] for r in rounds)
    res.figures.update(reader_rounds=len(rounds), reader_wrong=sum(r["wrong"] for r in rounds))


def sc_agent_killed(ctx: Ctx, res: Result) -> None:
    from l3pool.pool.prefetch import Prefetcher

    n = 96 if ctx.quick else 256
    d = Data(ctx, n, "agent")
    pf = Prefetcher(d.reader, batch_pages=16, max_batch_pages=64)
    stop = threading.Event()
    errors: list[str] = []
    loaded = [0, 0]

    def traffic() -> None:
        while not stop.is_set():
            try:
                r = pf.submit("t", d.keys).wait(30)
                d.check(res, np.arange(r.keys_loaded), r.pages, [_ok()] * r.keys_loaded)
                loaded[0] += r.keys_loaded
                loaded[1] += 1
                d.dst.free(r.pages)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                return

    t = threading.Thread(target=traffic, name="chaos-traffic", daemon=True)
    try:
        assert d.put() == n, "initial put failed"
        t.start()
        time.sleep(0.3)
        ctx.c.kill_agent(1, signal.SIGKILL)
        time.sleep(1.0 if ctx.quick else 3.0)
        stop.set()
        t.join(60)
        res.figures.update(prefetches=loaded[1], pages_loaded=loaded[0])
        t0 = time.monotonic()
        etcd = ctx.c.etcd()
        try:  # the dead agent's member key lives until its lease expires; a new process may not take it
            _wait(lambda: etcd.get(ctx.c.member_key(1)) is None, ctx.c.lease_ttl + 5.0)
        finally:
            etcd.close()
        ctx.c.start_agent(1)
        if _wait(lambda: _round_trip(ctx, res), ctx.bound, 0.5) is not None:
            res.recover_s = time.monotonic() - t0  # restart (registration) + first verified round trip
        else:
            res.error = f"no verified round trip within {ctx.bound:.0f} s of the agent's restart"
        if errors:
            res.error = errors[0]
    finally:
        stop.set()
        t.join(30)
        pf.close()
        res.leaked = d.dst.stats().used_pages
        d.close()


def sc_etcd_wiped(ctx: Ctx, res: Result) -> None:
    from l3pool.pool.client import L3Client
    from l3pool.pool.etcd import EtcdClient
    from l3pool.pool.metadata import Metadata

    etcd = EtcdClient(ctx.c.etcd_endpoints)
    md = Metadata(etcd, ctx.c.key_prefix)
    d = Data(ctx, 32, "etcd", metadata=md, stats_interval=0.5)
    reader = None
    try:
        assert d.put() == 32, "initial put failed"
        keys = [md.namespace_key(d.ns.ns_id)] + [ctx.c.member_key(k) for k in range(len(ctx.c.agents))]
        ctx.c.stop_etcd(wipe=True)
        t0 = time.monotonic()
        ctx.c.start_etcd()
        res.figures["etcd_up_s"] = round(time.monotonic() - t0, 3)
        back = _wait(lambda: all(etcd.get(k) is not None for k in keys), ctx.bound)
        if back is None:
            missing = [k for k in keys if _safe(functools.partial(etcd.get, k)) is None]
            res.error = f"records not back within {ctx.bound:.0f} s: {missing}"
            return
        res.recover_s = round(time.monotonic() - t0, 3)  # from the restart: etcd up + records written again
        reader = L3Client(d.dst, ctx.store, d.ns, metadata=md, create_namespace=False)
        d.reader.close()
        d.reader = reader
        d.read(res, np.arange(32))
    finally:
        d.close()
        etcd.close()


def _safe(fn: Callable[[], Any]) -> Any:
    with contextlib.suppress(Exception):
        return fn()
    return None


def sc_foreign_object(ctx: Ctx, res: Result) -> None:
    d = Data(ctx, 16, "foreign")
    try:
        assert d.put() == 16, "initial put failed"
        from l3pool.pool.keys import page_hashes

        fresh = d.ns.keys(page_hashes(np.random.default_rng().integers(0, 1 << 30, 8 * ctx.spec.page_size), 16))
        raw = ctx.store._s  # a plain Mooncake client, as any other program could use it
        for k, src in zip(fresh, d.keys, strict=False):
            blob = raw.get(src)
            if not blob or raw.put(k, blob) != 0:
                raise RuntimeError(f"could not copy the object of {src} under {k}")
        pages = np.arange(8)
        d.poison(pages)
        out = d.reader.get(fresh, pages)
        # fresh key i holds key i's object: an OK page is wrong however its bytes look
        from l3pool.pool.protocols import Outcome

        res.pages_checked += len(out)
        res.wrong += sum(o is Outcome.OK for o in out)
        res.note = "needs the key-bound trailer" if res.wrong else ""
    finally:
        d.close()


def sc_writer_killed(ctx: Ctx, res: Result) -> None:
    from l3pool.pool.admin import MasterAdmin

    admin = MasterAdmin(ctx.c.admin_url)
    n = 128
    d = Data(ctx, n, "wkill")
    try:
        base = admin.metrics().get("master_allocated_bytes", 0.0)
        p = subprocess.Popen(_child_cmd(ctx, "writer", d), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, env=_child_env(ctx.c.client_host))  # fmt: skip
        assert p.stdout is not None
        line = p.stdout.readline()  # "putting" right before the put
        if "putting" not in line:
            p.kill()
            raise RuntimeError(f"writer did not start (code {p.wait(10)})")
        time.sleep(0.01)
        p.kill()
        p.wait(10)
        peak = admin.metrics().get("master_allocated_bytes", 0.0)
        out = d.writer.put(d.keys, range(n))
        from l3pool.pool.protocols import Outcome

        ok = np.flatnonzero([o is Outcome.OK for o in out])
        pages = np.arange(n)
        d.poison(pages)
        got = d.reader.get(d.keys, pages)
        d.check(res, np.arange(n), pages, got)
        res.false_ok = int(sum(got[i] is not Outcome.OK for i in ok))
        res.figures.update(put_ok=len(ok), read_ok=sum(g is Outcome.OK for g in got),
                           dead_writer_bytes=int(peak - base))  # fmt: skip
        from l3pool.pool.trailer import object_bytes

        want = base + sum(g is Outcome.OK for g in got) * object_bytes(ctx.spec.page_bytes) * 1.0
        reclaim = _wait(lambda: admin.metrics().get("master_allocated_bytes", 0.0) <= want + 1, ctx.bound, 0.5)
        res.figures["reclaim_s"] = None if reclaim is None else round(reclaim, 2)
        if reclaim is None:
            res.note = f"dead writer's space not reclaimed within {ctx.bound:.0f} s"
    finally:
        d.close()


def _child_cmd(ctx: Ctx, role: str, d: Data, *extra: str) -> list[str]:
    return [sys.executable, "-m", "l3pool.tools.chaos", "_child", role, "--master", ctx.c.master, "--metadata",
            ctx.c.metadata_url, "--host", ctx.c.client_host, "--tenant", d.tenant, "--pages", str(d.n),
            "--seed", str(d.seed), *extra]  # fmt: skip


def _child_main(argv: list[str]) -> int:
    """A second client process over a seeded page set (`Data` with the same tenant and seed).

    writer: prints "putting", then puts every page in one call (sc_writer_killed SIGKILLs it).
    reader: gets every page in one call, round after round, into poisoned pages, compares every
    OK page with the seeded bytes and prints one JSON line per round, until --stop-file exists
    (sc_master_restart SIGSTOPs it in the middle of a get)."""
    from l2core import HostKVPool, L2Config
    from l3pool.pool.client import L3Client
    from l3pool.pool.store import MooncakeStore, StoreConfig

    p = argparse.ArgumentParser(prog="python -m l3pool.tools.chaos _child")
    p.add_argument("role", choices=("writer", "reader"))
    for k in ("master", "metadata", "host", "tenant"):
        p.add_argument(f"--{k}", required=True)
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--stop-file", default="")
    a = p.parse_args(argv)
    spec = _spec()
    pool = HostKVPool(L2Config(kv=spec, layout=LAYOUT, tokens=2 * a.pages * spec.page_size, pin="never"))
    ns, keys = _page_set(a.tenant, a.pages, a.seed, pool)
    try:
        with MooncakeStore(StoreConfig(master=a.master, metadata=a.metadata, local_hostname=a.host)) as store:
            client = L3Client(pool, store, ns, batch_pages=a.pages)
            try:
                _child_role(a, client, keys)
            finally:
                client.close()
    finally:
        pool.close()
    return 0


def _child_role(a: argparse.Namespace, client: Any, keys: list[str]) -> None:
    import torch

    from l3pool.pool.store import Outcome

    if a.role == "writer":
        print("putting", flush=True)
        client.put(keys, range(a.pages))
        print("done", flush=True)
        return
    pool = client.pool
    rows = pool.buffer.view(pool.num_pages, -1)
    want, dst = rows[: a.pages].clone(), np.arange(a.pages, 2 * a.pages)
    while not os.path.exists(a.stop_file):
        rows[a.pages :] = _POISON
        print('{"start": 1}', flush=True)  # the parent stops this process a few ms after this line
        out = client.get(keys, dst)
        ok = np.flatnonzero([o is Outcome.OK for o in out])
        wrong = int((rows[torch.from_numpy(dst[ok])] != want[torch.from_numpy(ok)]).any(dim=1).sum())
        print(json.dumps({"ok": len(ok), "wrong": wrong, "pages": a.pages}), flush=True)
        if not len(ok):
            time.sleep(0.05)


_FUNCS: dict[str, Callable[[Ctx, Result], None]] = {
    "master_down": sc_master_down, "master_hung": sc_master_hung, "master_restart": sc_master_restart,
    "agent_killed": sc_agent_killed, "etcd_wiped": sc_etcd_wiped, "foreign_object": sc_foreign_object,
    "writer_killed": sc_writer_killed,
}  # fmt: skip


# -- driver ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _cluster(quick: bool) -> Iterator[Any]:
    from l3pool.cluster.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="l3pool-chaos-") as tmp:
        # put-start timeouts short enough that a killed writer's space comes back within the
        # scenario's bound (between 10 and 20 s after its put started; deploy's default: 30-60 s)
        with LocalCluster(agents=2, segment_size="128MB", state_dir=tmp, name=f"chaos{uuid.uuid4().hex[:4]}",
                          lease_ttl=3, client_ttl=3, put_start_discard_timeout_sec=5,
                          put_start_release_timeout_sec=10) as c:  # fmt: skip
            yield c


def run(scenarios: list[str], quick: bool = False, inject_wrong: bool = False) -> dict[str, Any]:
    """Run `scenarios` on a fresh local cluster; the report that `--json` prints."""
    bad = [s for s in scenarios if s not in _FUNCS]
    if bad:
        raise ValueError(f"unknown scenario(s) {', '.join(bad)}; choose from {', '.join(SCENARIOS)}")
    t0 = time.monotonic()
    results: list[Result] = []
    with _cluster(quick) as c:
        old = os.environ.get("MC_TCP_BIND_ADDRESS")
        os.environ["MC_TCP_BIND_ADDRESS"] = c.client_host  # this command is the application
        ctx = Ctx(c, quick, inject_wrong)
        try:
            for name in scenarios:
                res = Result(name)
                ts = time.monotonic()
                try:
                    _FUNCS[name](ctx, res)
                except Exception as e:
                    res.error = f"{type(e).__name__}: {e}"
                    log.warning("scenario %s failed: %s", name, res.error)
                res.elapsed_s = round(time.monotonic() - ts, 2)
                if res.recover_s is not None:
                    res.recover_s = round(res.recover_s, 3)
                results.append(res)
                log.info("scenario %s: %s", name, "pass" if res.passed else "FAIL")
        finally:
            ctx.close()
            if old is None:
                os.environ.pop("MC_TCP_BIND_ADDRESS", None)
            else:
                os.environ["MC_TCP_BIND_ADDRESS"] = old
        mode = c.mode
    return {
        "passed": all(r.passed for r in results),
        "quick": quick,
        "inject_wrong": inject_wrong,
        "cluster_mode": mode,
        "elapsed_s": round(time.monotonic() - t0, 2),
        "scenarios": [r.to_json() for r in results],
    }


def render(rep: dict[str, Any]) -> str:
    head = ["scenario", "pages checked", "wrong", "false OKs", "leaked", "recover s", "result", "figures / note"]
    rows = []
    for r in rep["scenarios"]:
        fig = ", ".join(f"{k}={v}" for k, v in r["figures"].items())
        extra = "; ".join(x for x in (fig, r["note"], r["error"] or "") if x)
        rec = "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}"
        rows.append([r["scenario"], str(r["pages_checked"]), str(r["wrong"]), str(r["false_ok"]), str(r["leaked"]),
                     rec, "pass" if r["passed"] else "FAIL", extra])  # fmt: skip
    lines = table(head, rows, free_last=True)
    lines.append(f"{'PASS' if rep['passed'] else 'FAIL'} in {rep['elapsed_s']:.0f} s ({rep['cluster_mode']})")
    return "\n".join(lines)


def run_chaos(args: argparse.Namespace) -> int:
    from l3pool.cliutil import UserError, fail

    every = args.scenarios is None  # an empty --scenarios is no scenario, not all of them
    names = list(SCENARIOS) if every else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in _FUNCS]
    if bad or not names:
        raise UserError(f"unknown scenario(s) {', '.join(bad) or '(none)'}", f"choose from {', '.join(SCENARIOS)}")
    try:
        rep = run(names, quick=args.quick, inject_wrong=args.inject_wrong)
    except Exception as e:  # the cluster did not come up (missing binaries, no free ports)
        return fail("l3pool chaos", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                    "`l3pool cluster up` shows what the local cluster needs")  # fmt: skip
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0 if rep["passed"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chaos",
        help="fault scenarios against a local cluster; every page read back is checked",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--quick", action="store_true", help="fewer pages and iterations, shorter bounds")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--scenarios", default="", help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    p.add_argument("--inject-wrong", action="store_true", help=argparse.SUPPRESS)  # self-test: must exit 1
    p.set_defaults(fn=run_chaos, needs_prefill=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        from l3pool.cliutil import guarded

        sys.exit(guarded("l3pool chaos child", lambda: _child_main(sys.argv[2:])))
    sys.exit("usage: l3pool chaos (python -m l3pool.tools.chaos _child is internal)")
