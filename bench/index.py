"""Global KV index microbenchmark: ingest rate, query latency, memory per indexed page.

    PYTHONPATH=. python -m bench.index [--json] [--out FILE] [--instances 64] [--pages 100000]

ingest   every instance's `--pages` distinct pages stored into L1 or L2 as event batches of
         `--batch` keys (one native call per batch through GlobalIndex.apply, lock and Python frame
         included), on one thread: `ingest_pages_per_s`. `ingest_mixed_pages_per_s`: batches of
         half removals, half stores of the same count (the table stays the same size).
         `decode_ingest_pages_per_s`: the same batches as wire messages (msgpack decode + apply),
         what the service's loop pays per message.
query    `--queries` requests of `--request-pages` pages: half are "hot" prefixes that every
         instance holds (stored in all of them, L1 or L2 at random; the AND runs the whole request
         for every instance, the worst case), half are a window of one instance's own pages with a
         random cut. `query_p50_ms`/`query_p99_ms`: GlobalIndex.query (one native call + the
         PrefixHits of every live instance), wall clock; `query_thread_cpu_*` the same calls' thread
         CPU time (what they cost without the preemption a shared machine adds);
         `native_query_p99_ms` the native call alone;
         `client_query_p99_ms`: IndexClient -> IndexService over ZeroMQ on loopback.
memory   `bytes_per_page`: the table's bytes over the pages indexed at the end (and over capacity).
Answers are checked against the stored state for a sample of requests (`correct`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from typing import Any

import numpy as np

from bench._pool_cli import add_report_args, check_out, emit_report
from l3pool.cli import guarded
from l3pool.measure import percentile


def _ms(xs: list[float], q: float) -> float:
    return round(percentile(xs, q) * 1e3, 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--pages", type=int, default=100_000, help="distinct pages indexed per instance")
    p.add_argument("--batch", type=int, default=512, help="keys per event batch")
    p.add_argument("--request-pages", type=int, default=512)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--hot", type=int, default=200, help="hot prefixes held by every instance")
    p.add_argument("--client-queries", type=int, default=500, help="queries over ZeroMQ (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("instances", "pages", "batch", "request_pages", "queries", "hot"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.client_queries < 0:
        p.error("--client-queries must be >= 0")
    if args.pages < args.request_pages:
        p.error("--pages must be >= --request-pages")
    check_out(args)
    from l3pool.index.table import GlobalIndex
    from l3pool.pool import kv_events as kv

    rng = np.random.default_rng(args.seed)
    n_inst, per, R = args.instances, args.pages, args.request_pages
    hot_keys = rng.integers(1, 1 << 63, size=(args.hot, R), dtype=np.uint64)
    own = rng.integers(1, 1 << 63, size=(n_inst, per), dtype=np.uint64)
    capacity = n_inst * per + args.hot * R
    gi = GlobalIndex(capacity, max(64, n_inst), l3_ttl_s=3600.0)
    names = [f"inst-{i}" for i in range(n_inst)]
    for n in names:
        gi.add_instance(n)
        gi.set_live(n, True)
    tier_of = rng.integers(0, 2, size=n_inst)  # each instance's own pages: L1 or L2

    # -- ingest: every instance's own pages, in batches ------------------------------------------
    batches = [(i, own[i, a : a + args.batch]) for i in range(n_inst) for a in range(0, per, args.batch)]
    order = rng.permutation(len(batches))  # instances interleaved, as events arrive
    ops_of = {}
    c0, t0 = time.thread_time(), time.perf_counter()
    for j in order.tolist():
        i, k = batches[j]
        o = ops_of.get((int(tier_of[i]), len(k)))
        if o is None:
            o = ops_of[(int(tier_of[i]), len(k))] = np.array([[tier_of[i], 1, len(k)]], dtype=np.int64)
        gi.apply(names[i], "", o, k)
    ingest_s = time.perf_counter() - t0
    ingest_cpu_s = time.thread_time() - c0
    n_keys = n_inst * per
    # hot prefixes: every instance, L1 or L2, and the pool for half of them
    for h in range(args.hot):
        for n in names:
            gi.apply(n, "", np.array([[int(rng.integers(0, 2)), 1, R]], dtype=np.int64), hot_keys[h])
        if h % 2 == 0:
            gi.apply(names[0], "", np.array([[2, 1, R]], dtype=np.int64), hot_keys[h])
    # mixed: remove a batch, store it back (same size)
    mixed = [batches[j] for j in order[: min(len(order), 4000)].tolist()]
    c0, t0 = time.thread_time(), time.perf_counter()
    for i, k in mixed:
        t = int(tier_of[i])
        gi.apply(names[i], "", np.array([[t, 0, len(k)], [t, 1, len(k)]], dtype=np.int64), np.concatenate([k, k]))
    mixed_s, mixed_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    mixed_keys = 2 * sum(len(k) for _, k in mixed)
    # decode + apply of wire messages (stores of pages already present: the same table work)
    msgs = [
        kv.encode_events(names[i], 1, s + 1, "", [int(tier_of[i]), 1, len(k)], k.astype("<u8").tobytes())
        for s, (i, k) in enumerate(mixed)
    ]
    c0, t0 = time.thread_time(), time.perf_counter()
    for m in msgs:
        b = kv.decode_events(m)
        gi.apply(b.instance, b.namespace, b.ops, b.keys)
    decode_s, decode_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    decode_keys = sum(len(k) for _, k in mixed)

    # -- queries ----------------------------------------------------------------------------------
    reqs = []
    truth: list[tuple[int, int] | None] = []
    for q in range(args.queries):
        if q % 2 == 0:
            reqs.append(hot_keys[int(rng.integers(args.hot))])
            truth.append(None)
        else:
            i = int(rng.integers(n_inst))
            a = int(rng.integers(0, per - R + 1))
            cut = int(rng.integers(0, R))
            req = own[i, a : a + R].copy()
            req[cut:] = rng.integers(1, 1 << 63, size=R - cut, dtype=np.uint64)  # a miss from `cut` on
            reqs.append(req)
            truth.append((i, cut))
    lat, cpu, nat = [], [], []
    ok = True
    live = gi._live
    for q, req in enumerate(reqs):
        c0, t0 = time.thread_time(), time.perf_counter()
        h = gi.query(req)
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        t0 = time.perf_counter()
        gi.native.query(req, 0, 1, live)
        nat.append(time.perf_counter() - t0)
        tr = truth[q]
        if q < 200:
            if tr is None:
                ok = ok and all(h.of(n).l2 == R for n in names) and len(h.per_instance) == n_inst
            else:
                i, cut = tr
                tp = h.of(names[i])
                ok = ok and (tp.l2 == cut) and (tp.l1 == (cut if tier_of[i] == 0 else 0))
    client: list[float] = []
    if args.client_queries:
        from l3pool.index.client import IndexClient
        from l3pool.index.service import IndexService

        with IndexService(gi) as svc, IndexClient(svc.endpoint, timeout_s=5.0) as c:
            for q in range(args.client_queries):
                t0 = time.perf_counter()
                h = c.query(reqs[q % len(reqs)])
                client.append(time.perf_counter() - t0)
    st = gi.stats()
    gi.check()
    report: dict[str, Any] = {
        "benchmark": "bench.index",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "device": "cpu",
        "instances": n_inst,
        "pages_per_instance": per,
        "request_pages": R,
        "batch_keys": args.batch,
        "ingest_pages_per_s": round(n_keys / ingest_s),
        "ingest_thread_cpu_pages_per_s": round(n_keys / ingest_cpu_s),
        "ingest_mixed_pages_per_s": round(mixed_keys / mixed_s),
        "ingest_mixed_thread_cpu_pages_per_s": round(mixed_keys / mixed_cpu_s),
        "decode_ingest_pages_per_s": round(decode_keys / decode_s),
        "decode_ingest_thread_cpu_pages_per_s": round(decode_keys / decode_cpu_s),
        "ingest_batch_us": round(ingest_s / len(batches) * 1e6, 2),
        "query_p50_ms": _ms(lat, 50),
        "query_p99_ms": _ms(lat, 99),
        "query_thread_cpu_p50_ms": _ms(cpu, 50),
        "query_thread_cpu_p99_ms": _ms(cpu, 99),
        "native_query_p50_ms": _ms(nat, 50),
        "native_query_p99_ms": _ms(nat, 99),
        "client_query_p50_ms": _ms(client, 50) if client else None,
        "client_query_p99_ms": _ms(client, 99) if client else None,
        "entries": st["entries"],
        "nbytes": st["nbytes"],
        "bytes_per_page": round(st["nbytes"] / max(1, st["entries"]), 1),
        "bytes_per_page_of_capacity": st["bytes_per_page"],
        "rejected": st["rejected"],
        "correct": bool(ok and st["rejected"] == 0),
    }
    report["targets"] = {
        "ingest_pages_per_s>=5e6": report["ingest_pages_per_s"] >= 5e6,
        "ingest_thread_cpu_pages_per_s>=5e6": report["ingest_thread_cpu_pages_per_s"] >= 5e6,
        "query_p99_ms<=1": report["query_p99_ms"] <= 1.0,
        "query_thread_cpu_p99_ms<=1": report["query_thread_cpu_p99_ms"] <= 1.0,
    }
    emit_report(report, args)
    return 0 if report["correct"] else 1


if __name__ == "__main__":
    sys.exit(guarded("python -m bench.index", main))
