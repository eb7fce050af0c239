"""One simulated prefill client of `bench.scale`: replays a trace's metadata traffic against the pool.

Run by `bench.scale` as its own process (loaded from this file, so the `bench` package's torch
check is not paid per client: nothing here needs torch):

    python -c <loader> CONFIG.json          # stdout: "ready", then (after stdin gives the start) "done"

The config (JSON, written by `bench.scale`) names the pool (master, metadata URL, etcd, key
prefix, this client's address), the trace (`TraceSpec`), the pipeline stages, the offered rate
and the window. After setup the client prints `ready` and waits for one line on stdin: the wall
clock time (unix s) to start at (EOF: the parent went away, exit). It then sends requests on an
open-loop schedule (request k at start + k / rate; a late request goes at once and its lateness is
recorded, so saturation shows as `late_s`, not as a lower offered rate) until start + seconds,
and writes its samples to the config's `out` file.

One request of the trace (session s, turn t; `n` pages: the shared system prompt, the session's
earlier turns, this turn's new pages), as a pipeline-parallel prefill with `stages` stages does it
on the pool's metadata path:
    index     (with a global index) one query: every instance's cached prefix per tier
    acquire   stage 0: one `batch_is_exist` over every stage's keys + the lock (one etcd txn)
    join      stages 1..S-1: one etcd get each (the locked length)
    put       every stage: one `batch_put_from` of its missing tail (small pages)
    events    (with a global index) the request's pages enter this instance's simulated L2 (`L2Ring`;
              the oldest leave) and its computed pages were written to L3: KV events through
              `KvEventPublisher`, which batches them (one message per linger), never a call here
    report    stages S-1..1, then 0: one txn each; the non-last ones keep the lease alive (one
              keep-alive each), the last one revokes the lease
The calls are counted per request on this (the request) thread, by kind (`CallCounter`): every
request must cost the same number of calls whatever its page count and the pool's size
(`calls_per_request`: S + 1 master calls, 3S etcd calls on the request thread, plus the one lease
each lock consumes, granted ahead on stage 0's background thread when a spare is ready, else on
the request thread; the joining stages never take a lock, so they keep no spare leases). One warm-up
request before `ready` opens the connections and is left out of the samples.

A membership reader (what a router or the index does) lists the members every `members_every_s`
on a thread of its own: one etcd range over `members/` (`members_read`
"range": ids, records and lease ids, what a router needs), or `Metadata.members()` ("members":
the range plus one lease-TTL call per member, what `l3pool inspect` shows), counted as `members`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from l3pool.pool.etcd import EtcdClient
from l3pool.pool.keys import Namespace, hash_keys, split_hashes, stage_namespaces
from l3pool.pool.metadata import Metadata
from l3pool.pool.pplock import StageLocks
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig


@dataclass(frozen=True)
class TraceSpec:
    """An agentic trace: `sessions` sessions share a `prefix_pages` system prompt; every turn of a
    session adds `new_pages` pages; a session that would pass `max_pages` starts over as a new one."""

    sessions: int = 64
    prefix_pages: int = 16
    new_pages: int = 4
    max_pages: int = 128

    def __post_init__(self) -> None:
        for name in ("sessions", "prefix_pages", "new_pages", "max_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"trace {name} must be an int >= 1, got {v!r}")
        if self.prefix_pages + self.new_pages > self.max_pages:
            raise ValueError("trace max_pages must hold at least the prefix and one turn")


def calls_per_request(stages: int, index: bool = False) -> dict[str, int]:
    """What one request costs on the metadata path, whatever its pages and the pool's size:
    master = one lookup + one put per stage; etcd_request_thread = lock txn + S-1 joins + S reports
    + S-1 keep-alives + 1 revoke (= 3S); lease = the one lease its lock lives under; index = one
    query (with a global index)."""
    out = {"master": 1 + stages, "etcd_request_thread": 3 * stages, "lease": 1}
    return out | ({"index": 1} if index else {})


def hex_keys(prefix: str, raw: bytes) -> list[str]:
    """`prefix + hex(16-byte hash)` for every 16 bytes of `raw` (vectorised: no loop over pages)."""
    hexes = np.frombuffer(raw.hex().encode(), dtype="S32").astype("U32")
    return np.char.add(prefix, hexes).tolist()  # type: ignore[no-any-return]


class Trace:
    """The requests of one client: the sessions `s` with `s % clients == client`, round robin, each
    owned by one client so its turns stay in order. Keys per stage are built once per session
    generation (vectorised), requests slice them."""

    def __init__(self, spec: TraceSpec, namespaces: list[Namespace], client: int, clients: int, seed: int) -> None:
        self.spec, self.nss = spec, namespaces
        self.mine = [s for s in range(spec.sessions) if s % clients == client] or [client]
        self.rng = np.random.default_rng([seed, client])
        shared = np.random.default_rng([seed, 1 << 30]).bytes(16 * spec.prefix_pages)  # every client: same prompt
        self.shared = shared
        self.turn = dict.fromkeys(self.mine, 0)
        self.keys: dict[int, list[list[str]]] = {}
        self.hashes: dict[int, list[bytes]] = {}
        self.k64: dict[int, np.ndarray] = {}
        self.k = 0

    def _fresh(self, s: int) -> None:
        raw = self.shared + self.rng.bytes(16 * (self.spec.max_pages - self.spec.prefix_pages))
        self.hashes[s] = split_hashes(raw)  # 16-byte page hashes (bytes)
        self.k64[s] = hash_keys(raw)  # the KV events' page keys
        self.keys[s] = [hex_keys(f"{ns.ns_id}/", raw) for ns in self.nss]
        self.turn[s] = 0

    def next(self) -> tuple[list[bytes], np.ndarray, list[list[str]], int]:
        """(page hashes, their 64-bit keys, keys per stage of the next request, the pages expected to
        hit: the earlier turns)."""
        sp = self.spec
        s = self.mine[self.k % len(self.mine)]
        self.k += 1
        n = sp.prefix_pages + (self.turn[s] + 1) * sp.new_pages
        if s not in self.keys or n > sp.max_pages:
            self._fresh(s)
            n = sp.prefix_pages + sp.new_pages
        expect = n - sp.new_pages if self.turn[s] else 0  # turn 0: the prompt may not be stored yet
        self.turn[s] += 1
        return self.hashes[s][:n], self.k64[s][:n], [ks[:n] for ks in self.keys[s]], expect


class CallCounter:
    """Counts calls by kind: on the request thread (`request`) and on every other thread (`other`)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.request: Counter[str] = Counter()
        self.other: Counter[str] = Counter()
        self._mu = threading.Lock()

    def hit(self, kind: str) -> None:
        if threading.get_ident() == self.thread:
            self.request[kind] += 1
        else:
            with self._mu:
                self.other[kind] += 1

    def wrap_store(self, store: MooncakeStore) -> None:
        real = store._guarded  # every Mooncake binding call goes through it (l3pool/pool/store.py)

        def counted(n: int, name: str, *args: Any, **kw: Any) -> Any:
            self.hit("master")
            return real(n, name, *args, **kw)

        store._guarded = counted  # type: ignore[method-assign]

    def wrap_etcd(self, etcd: EtcdClient, kind: str = "etcd") -> None:
        real = etcd.call  # every etcd request goes through it (l3pool/pool/etcd.py)

        def counted(path: str, body: dict[str, Any], *, bypass: bool = False) -> dict[str, Any]:
            self.hit("lease" if path == "/v3/lease/grant" else kind)
            return real(path, body, bypass=bypass)

        etcd.call = counted  # type: ignore[method-assign]

    def wrap_index(self, client: Any) -> None:
        real = client._call  # every request of an IndexClient goes through it (l3pool/index/client.py)

        def counted(kind: str, *args: Any) -> Any:
            self.hit("index")
            return real(kind, *args)

        client._call = counted


class L2Ring:
    """The simulated instance's host tier as the global index sees it: the last `capacity` distinct
    page keys its requests used (FIFO), its KV events published under the same lock the snapshot
    reads under."""

    def __init__(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.uint64)
        self.n = 0
        self.mu = threading.Lock()

    def add(self, new: np.ndarray) -> np.ndarray:
        """Store `new` (fewer than capacity); returns the keys pushed out (vectorised ring copy)."""
        cap, k = len(self.keys), len(new)
        at = self.n % cap
        idx = (at + np.arange(k)) % cap
        out = self.keys[idx[self.n + np.arange(k) >= cap]].copy()
        self.keys[idx] = new
        self.n += k
        return out

    def held(self) -> np.ndarray:
        return self.keys[: min(self.n, len(self.keys))]

    def contents(self, under_lock: Any) -> dict[str, np.ndarray]:
        with self.mu:
            out = {"l1": np.zeros(0, dtype=np.uint64), "l2": self.held().copy()}
            if under_lock is not None:
                under_lock()
            return out


def _namespaces(stages: int, tag: str, page_bytes: int) -> list[Namespace]:
    return stage_namespaces(f"scale-{tag}", stages, page_bytes, tenant=tag)


class Client:
    """The pool side of one simulated prefill client (see the module docstring)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.stages = int(cfg["stages"])
        self.page_bytes = int(cfg["page_bytes"])
        self.calls = CallCounter()
        self.store = MooncakeStore(StoreConfig(master=cfg["master"], metadata=cfg["metadata"],
                                               local_hostname=cfg["host"]))  # fmt: skip
        self.calls.wrap_store(self.store)
        spec = TraceSpec(**cfg["trace"])
        self.buf = np.random.default_rng(cfg["client"]).integers(0, 256, spec.max_pages * self.page_bytes, np.uint8)
        self.store.register(self.buf.ctypes.data, self.buf.nbytes)
        self.nss = _namespaces(self.stages, cfg["tag"], self.page_bytes)
        self.trace = Trace(spec, self.nss, cfg["client"], cfg["clients"], cfg["seed"])
        self.etcds = [EtcdClient(cfg["etcd"]) for _ in range(self.stages)]
        for e in self.etcds:
            self.calls.wrap_etcd(e)
        # stage 0 takes the locks (spare leases ready, as by default); the joining stages never grant one
        self.locks = [
            StageLocks(Metadata(e, cfg["key_prefix"]), self.store, self.nss, s, ttl=int(cfg["lock_ttl"]),
                       parallel_lookup=False, **({} if s == 0 else {"spare_leases": 0}))
            for s, e in enumerate(self.etcds)
        ]  # fmt: skip
        self.members_etcd = EtcdClient(cfg["etcd"])
        self.calls.wrap_etcd(self.members_etcd, "members")
        self.instance = f"{cfg['tag']}-c{cfg['client']}"
        self.index: Any = None
        self.pub: Any = None
        if cfg.get("index"):  # a global index runs: publish this instance's KV events, query it per request
            from l3pool.cache.events import KvEventPublisher
            from l3pool.index.client import IndexClient

            self.ring = L2Ring(int(cfg["index_l2_pages"]))
            self.pub_etcd = EtcdClient(cfg["etcd"])
            self.calls.wrap_etcd(self.pub_etcd, "events_lease")
            self.pub = KvEventPublisher(self.instance, namespace=self.nss[0].ns_id)
            self.pub.bind(self.ring.contents)
            self.pub.register(Metadata(self.pub_etcd, cfg["key_prefix"]), ttl=10)
            self.index = IndexClient(cfg["index"], timeout_s=5.0)
            self.calls.wrap_index(self.index)
        self.samples: dict[str, list[float]] = {
            k: [] for k in ("index_query", "lookup", "lock", "acquire", "join", "put", "release", "request", "members")
        }
        self.per_request: Counter[str] = Counter()  # "master,etcd,lease" -> requests with that count
        self.hits = self.expected = self.put_pages = self.put_failed = self.errors = 0
        self.index_hits = 0
        self.members_seen: list[int] = []
        self.late: list[float] = []
        self.first_error = ""

    def request(self, i: int) -> None:
        hashes, k64, keys, expect = self.trace.next()
        rid = f"{self.instance}-{i}"
        before = self.calls.request.copy()
        t0 = time.perf_counter()
        if self.index is not None:  # what a router asks before it picks the instance
            hits = self.index.query(k64, namespace=self.nss[0].ns_id)
            self.samples["index_query"].append(time.perf_counter() - t0)
            self.index_hits += min(hits.of(self.instance).l2, expect)
        t0 = time.perf_counter()
        g = self.locks[0].acquire(rid, hashes)
        t1 = time.perf_counter()
        for s in range(1, self.stages):
            if self.locks[s].join(rid) != g.length:
                raise RuntimeError(f"{rid}: stage {s} joined with another length than stage 0 locked")
        t2 = time.perf_counter()
        for s in range(self.stages):  # each stage stores its missing tail (at least this turn's pages)
            miss = keys[s][g.per_stage[s] :]
            ptrs = (self.buf.ctypes.data + self.page_bytes * np.arange(len(miss))).tolist()
            outs = self.store.put(miss, ptrs, [self.page_bytes] * len(miss))
            self.put_pages += len(miss)
            self.put_failed += len(outs) - outs.count(Outcome.OK)
        if self.pub is not None:
            # every page of the request is in its L2 now (fetched from L3 or computed; the oldest leave),
            # and the computed ones were written to L3
            computed = k64[g.per_stage[0] :]
            with self.ring.mu:
                fresh = k64[~np.isin(k64, self.ring.held())]
                gone = self.ring.add(fresh)
                self.pub.stored("l2", fresh)
                self.pub.removed("l2", gone)
                self.pub.stored("l3", computed)
        t3 = time.perf_counter()
        for s in range(self.stages - 1, -1, -1):  # stage 0 last: its report revokes the lease
            released = self.locks[s].report_done(rid)
            if released != (s == 0):
                raise RuntimeError(f"{rid}: stage {s}'s report {'released' if released else 'kept'} the lock")
        t4 = time.perf_counter()
        d = self.calls.request - before
        self.per_request[f"{d['master']},{d['etcd']},{d['lease']},{d['index']}"] += 1
        for name, v in (("lookup", g.lookup_s), ("lock", g.lock_s), ("acquire", t1 - t0), ("join", t2 - t1),
                        ("put", t3 - t2), ("release", t4 - t3), ("request", t4 - t0)):  # fmt: skip
            self.samples[name].append(v)
        self.hits += min(g.length, expect)
        self.expected += expect

    def _members(self, stop: threading.Event, every: float) -> None:
        md = Metadata(self.members_etcd, self.cfg["key_prefix"])
        members = f"{md.prefix}/members/"
        full = self.cfg["members_read"] == "members"
        while not stop.wait(every):
            t0 = time.perf_counter()
            try:
                n = len(md.members()) if full else len(self.members_etcd.get_prefix(members))
            except Exception as e:  # counted, never fatal: the report says how many failed
                self.errors += 1
                self.first_error = self.first_error or f"members: {e}"
                continue
            self.samples["members"].append(time.perf_counter() - t0)
            self.members_seen.append(n)

    def warm_up(self) -> None:
        """One request outside the window (connections open, stage 0's spare leases granted), forgotten."""
        if self.index is not None:  # the index has synchronised this instance (snapshot applied)
            deadline = time.monotonic() + 30.0
            while not self.index.status()["instances"].get(self.instance, {}).get("live"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the index at {self.cfg['index']} never went live for {self.instance}")
                time.sleep(0.05)
        self.request(1 << 40)
        time.sleep(0.2)  # the lock's background thread tops its spares up again
        for xs in self.samples.values():
            xs.clear()
        self.per_request.clear()
        self.hits = self.expected = self.put_pages = self.put_failed = self.index_hits = 0
        self.events0 = self.pub.stats() if self.pub is not None else {}

    def run(self, start: float) -> None:
        seconds, rate = float(self.cfg["seconds"]), float(self.cfg["rate"])
        stop = threading.Event()
        reader = threading.Thread(target=self._members, args=(stop, float(self.cfg["members_every_s"])), daemon=True)
        time.sleep(max(0.0, start - time.time()))
        t0 = time.monotonic()
        reader.start()
        other0 = self.calls.other.copy()
        i = 0
        try:
            while True:
                due = t0 + i / rate
                now = time.monotonic()
                if due >= t0 + seconds:
                    break
                if due > now:
                    time.sleep(due - now)
                else:
                    self.late.append(now - due)
                try:
                    self.request(i)
                except Exception as e:  # counted; the report fails the row when any happened
                    self.errors += 1
                    self.first_error = self.first_error or f"request {i}: {type(e).__name__}: {e}"
                i += 1
        finally:
            stop.set()
            reader.join(timeout=5)
        self.wall_s = time.monotonic() - t0
        self.requests = i
        self.other = dict(self.calls.other - other0)

    def result(self) -> dict[str, Any]:
        ru = os.times()
        return {
            "client": self.cfg["client"],
            "requests": self.requests,
            "wall_s": self.wall_s,
            "samples": self.samples,
            "per_request_calls": dict(self.per_request),
            "background_calls": self.other,
            "late_s": self.late,
            "hits": self.hits,
            "index_hits": self.index_hits,
            "events": (
                {k: v - self.events0.get(k, 0) for k, v in self.pub.stats().items() if isinstance(v, int)}
                if self.pub is not None
                else None
            ),
            "expected_hits": self.expected,
            "put_pages": self.put_pages,
            "put_failed": self.put_failed,
            "members_seen": sorted(set(self.members_seen)),
            "member_lists": len(self.samples["members"]),
            "errors": self.errors,
            "first_error": self.first_error,
            "cpu_s": ru.user + ru.system,
            "trace": asdict(self.trace.spec),
        }

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()
            self.pub_etcd.close()
        if self.index is not None:
            self.index.close()
        for lk in self.locks:
            lk.close()
        for e in [*self.etcds, self.members_etcd]:
            e.close()
        self.store.unregister(self.buf.ctypes.data)
        self.store.close()


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        cfg = json.load(f)
    client = Client(cfg)
    try:
        client.warm_up()
        print("ready", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 3  # the parent went away before the start
        client.run(float(line))
        tmp = cfg["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(client.result(), f)
        os.replace(tmp, cfg["out"])
    finally:
        client.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
