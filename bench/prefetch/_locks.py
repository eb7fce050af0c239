"""PP-lock latencies for `bench.prefetch`: the StageLocks protocol against its raw dependencies.

Benchmark-only code (moved out of l3pool/pplock.py: the library does not carry its benchmark).
`measure_lock_latencies` runs `n_requests` requests through `stages` StageLocks in this process and,
interleaved with them (per request the raw floor and the protocol alternate who goes first), the
raw dependency calls: one `batch_is_exist` of the same keys (the binding itself), a put-if-absent
etcd txn with a lease (what taking the lock costs) and one etcd get (what a join costs).
`lock_stats` turns the samples into the report; the comparisons use one statistic on both sides.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from l3pool.measure import percentile
from l3pool.pool.etcd import EtcdClient, EtcdError
from l3pool.pool.keys import stage_namespaces
from l3pool.pool.metadata import DEFAULT_PREFIX, Metadata
from l3pool.pool.pplock import LockError, StageLocks
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig


def lock_stats(
    acq: Sequence[float],
    raw_exists: Sequence[float],
    raw_txn: Sequence[float],
    join: Sequence[Sequence[float]],
    raw_get: Sequence[float],
    *,
    lookup: Sequence[float] = (),
    lock: Sequence[float] = (),
    release: Sequence[float] = (),
) -> dict[str, float]:
    """The report (ms and ratios) from per-request samples in seconds: `acq[i]`, `raw_exists[i]`,
    `raw_txn[i]`, `raw_get[i]` and the joins of the later stages `join[i]` belong to request i.

    Ratios compare one statistic on both sides, request by request:
    `lock_acquire_vs_raw` = median over requests of acq[i] / (raw_exists[i] + raw_txn[i]) (paired:
    both measured back to back under the same machine load); `lock_acquire_p99_vs_raw` = p99 of acq
    / p99 of the per-request raw sums (never a sum of two p99s, whose outliers need not coincide
    and would flatter the protocol); `stage_join_vs_raw` = median over requests of the mean join of
    request i / raw_get[i]; `stage_join_p99_vs_raw` = p99 of the joins / p99 of the raw gets."""
    n = len(acq)
    if not n or any(len(x) != n for x in (raw_exists, raw_txn, join, raw_get)):
        raise ValueError("lock_stats: one sample per request in each of acq, raw_exists, raw_txn, join, raw_get")
    floor = [e + t for e, t in zip(raw_exists, raw_txn, strict=True)]
    joins = [x for js in join for x in js]
    ms = 1000.0
    out = {
        "lock_acquire_p50_ms": percentile(acq, 50) * ms,
        "lock_acquire_p99_ms": percentile(acq, 99) * ms,
        "stage_join_p50_ms": percentile(joins, 50) * ms,
        "stage_join_p99_ms": percentile(joins, 99) * ms,
        "raw_exists_p50_ms": percentile(raw_exists, 50) * ms,
        "raw_exists_p99_ms": percentile(raw_exists, 99) * ms,
        "raw_etcd_txn_p50_ms": percentile(raw_txn, 50) * ms,
        "raw_etcd_txn_p99_ms": percentile(raw_txn, 99) * ms,
        "raw_acquire_floor_p50_ms": percentile(floor, 50) * ms,
        "raw_acquire_floor_p99_ms": percentile(floor, 99) * ms,
        "raw_etcd_get_p50_ms": percentile(raw_get, 50) * ms,
        "raw_etcd_get_p99_ms": percentile(raw_get, 99) * ms,
        "lock_acquire_vs_raw": statistics.median(a / f for a, f in zip(acq, floor, strict=True)),
        "lock_acquire_p99_vs_raw": percentile(acq, 99) / percentile(floor, 99),
        "stage_join_vs_raw": statistics.median(
            statistics.mean(js) / g for js, g in zip(join, raw_get, strict=True) if js
        ),
        "stage_join_p99_vs_raw": percentile(joins, 99) / percentile(raw_get, 99),
    }
    for name, xs in (("lock_lookup", lookup), ("lock_etcd", lock), ("release", release)):
        if xs:
            out[f"{name}_p50_ms"] = percentile(xs, 50) * ms
            out[f"{name}_p99_ms"] = percentile(xs, 99) * ms
    return out


def measure_lock_latencies(
    cluster_or_endpoints: Any,
    n_requests: int,
    pages: int = 512,
    stages: int = 4,
    *,
    store: MooncakeStore | None = None,
    key_prefix: str | None = None,
    ttl: int = 5,
    page_bytes: int = 4096,
    parallel_lookup: bool = True,
) -> dict[str, float]:
    """Latencies of the lock protocol (ms; see `lock_stats` for the keys and ratios): acquire
    (stage 0: lookup of `pages` pages in all `stages` namespaces + lock), join (a later stage
    obtaining the locked length), release (the last stage's report until the lock is gone), and
    the raw dependency floors measured interleaved with them.

    `cluster_or_endpoints`: a running `LocalCluster` (its etcd, master and key prefix are used; a
    store is created unless given: the caller must have `cluster.client_env()` in its environment)
    or an etcd endpoint string together with `store`. All stages run in this process, each with
    its own `StageLocks` and etcd connection; `pages` small objects per stage are put first."""
    if n_requests < 1 or pages < 1 or stages < 2:
        raise ValueError("measure_lock_latencies: n_requests >= 1, pages >= 1 and stages >= 2")
    own_store = False
    if isinstance(cluster_or_endpoints, str):
        endpoints, prefix = cluster_or_endpoints, key_prefix or DEFAULT_PREFIX
        if store is None:
            raise ValueError("with etcd endpoints, pass store=")
    else:
        c = cluster_or_endpoints
        endpoints, prefix = c.etcd_endpoints, key_prefix or c.key_prefix
        if store is None:
            store = MooncakeStore(StoreConfig(master=c.master, metadata=c.metadata_url, local_hostname=c.client_host))
            own_store = True
    tag = os.urandom(4).hex()
    nss = stage_namespaces("bench-" + tag, stages, page_bytes, tenant=tag)
    hashes = [os.urandom(16) for _ in range(pages)]
    buf = np.random.default_rng(0).integers(0, 256, page_bytes, dtype=np.uint8)
    store.register(buf.ctypes.data, buf.nbytes)
    etcds = [EtcdClient(endpoints) for _ in range(stages)]
    locks = [
        StageLocks(Metadata(etcds[s], prefix), store, nss, s, ttl=ttl, parallel_lookup=parallel_lookup)
        for s in range(stages)
    ]
    acq: list[float] = []
    raw_ex: list[float] = []
    raw_txn: list[float] = []
    raw_get: list[float] = []
    lookup: list[float] = []
    lock: list[float] = []
    join: list[list[float]] = []
    rel: list[float] = []
    all_keys = [k for ns in nss for k in ns.keys(hashes)]
    raw_lease = etcds[0].lease_grant(max(60, 10 * ttl))
    raw_prefix = f"{prefix.rstrip('/')}/bench-raw/{tag}-"

    def raw(i: int) -> None:
        t0 = time.perf_counter()
        codes = store._s.batch_is_exist(all_keys)  # the binding itself: the floor of the lookup
        t1 = time.perf_counter()
        created, _ = etcds[0].put_if_absent(f"{raw_prefix}{i}", '{"length":0}', lease=raw_lease)
        t2 = time.perf_counter()
        kv = etcds[1 % stages].get(f"{raw_prefix}{i}")
        t3 = time.perf_counter()
        if sum(c == 1 for c in codes) != len(all_keys) or not created or kv is None:
            raise LockError("benchmark: raw floor calls did not see the benchmark's own keys")
        raw_ex.append(t1 - t0)
        raw_txn.append(t2 - t1)
        raw_get.append(t3 - t2)

    try:
        for ns in nss:
            keys = ns.keys(hashes)
            res = store.put(keys, [buf.ctypes.data] * pages, [page_bytes] * pages)
            if any(r is not Outcome.OK for r in res):
                raise LockError(f"benchmark setup: put failed: {sorted({r.value for r in res})}")
        for i in range(n_requests):
            rid = f"bench-{tag}-{i}"
            if i % 2 == 0:
                raw(i)
            t0 = time.perf_counter()
            g = locks[0].acquire(rid, hashes)
            acq.append(time.perf_counter() - t0)
            lookup.append(g.lookup_s)
            lock.append(g.lock_s)
            join.append([])
            for s in range(1, stages):
                t0 = time.perf_counter()
                n = locks[s].join(rid)
                join[-1].append(time.perf_counter() - t0)
                if n != g.length:
                    raise LockError(f"stage {s} joined with {n} pages, stage 0 locked {g.length}")
            for s in range(stages - 1):
                locks[s].report_done(rid)
            t0 = time.perf_counter()
            released = locks[stages - 1].report_done(rid)
            rel.append(time.perf_counter() - t0)
            if not released or etcds[0].get(locks[0].lock_key(rid)) is not None:
                raise LockError(f"{rid}: lock not gone after the last report")
            if i % 2 == 1:
                raw(i)
    finally:
        for lk in locks:
            lk.close()
        with contextlib.suppress(EtcdError):
            etcds[0].lease_revoke(raw_lease)  # the raw floor's keys go with it
        for e in etcds:
            e.close()
        for ns in nss:  # a running pool keeps nothing of the benchmark (forced: the lookups leased them)
            with contextlib.suppress(Exception):
                store.remove_prefix(ns.key_prefix, force=True)
        store.unregister(buf.ctypes.data)
        if own_store:
            store.close()
    return lock_stats(acq, raw_ex, raw_txn, join, raw_get, lookup=lookup, lock=lock, release=rel)
