"""Prefetch benchmark: l3pool's interruptible Prefetcher against raw Mooncake on the same pages.

    PYTHONPATH=. python -m bench.prefetch [--json] [--out FILE] [--master H:P --metadata URL --host IP]

Without endpoints it uses the local cluster `l3pool cluster up` left running, else starts one
(etcd, mooncake_master, 2 decode agents in their own network namespaces when root) and tears it
down afterwards. A writer process in agent 1's
namespace puts `--requests` request prefixes of `--pages` pages (KVSpec.mla(8, page_size=64),
page_first_direct: 589,824-byte pages, 302 MB per 512-page request, small enough for a 24 GiB
machine). Then, per round and request, in this process (root namespace):
  raw       one Mooncake `batch_get_into` of all the request's pages into L2 pages (timed)
  prefetch  `Prefetcher.submit(...).wait()` of the same keys into other L2 pages (timed; batches
            grow from `--batch` pages by `--growth` up to `--max-batch`, `--pipeline` in
            flight)
  interrupt a prefetch interrupted after a random fraction of its time: interrupt() latency
  raw_batched  the same raw calls cut into the prefetcher's batches, `--pipeline` in flight
raw and prefetch alternate who goes first. Byte checks: before every raw get the destination pages,
and before every prefetch (full or interrupted) the whole L2 pool, are filled with 0xA5 (untimed),
so no page can already hold the expected bytes from an earlier round (the LIFO allocator hands
the just-freed pages back); after each, every delivered page is compared with the writer's bytes
(one vectorised compare), and a full prefetch must be complete. The default schedule (64, 256,
192 pages for 512) is what measured best on a 2-core TCP host: every further Mooncake call costs
a few ms of ramp-up, a second call in flight costs CPU the transfer needs, and the 256-page cap
keeps interrupt() within one ~100 ms batch. `prefetch_ratio` = raw time / prefetch time
(medians); `prefetch_vs_batched_ratio` compares with raw_batched, i.e. the prefetcher's own
overhead over Mooncake at the same call sizes (on TCP, Mooncake's per-call cost makes 64-page
calls slower than one 512-page call). The PP-lock latencies come from
`bench.prefetch._locks.measure_lock_latencies` (4 stages x `--pages` pages), with the raw dependency floors
measured in the same run, interleaved: `raw_exists_*` (one `batch_is_exist` of the same 4 x pages
keys), `raw_etcd_txn_*` (a put-if-absent txn), `raw_etcd_get_*`; `lock_acquire_vs_raw` = median
over requests of acquire / (raw exists + raw txn) of the same request, `lock_acquire_p99_vs_raw` =
acquire p99 / p99 of those per-request sums, `stage_join_vs_raw` (median of paired ratios) and
`stage_join_p99_vs_raw` = join p99 / raw get p99. `targets` judges the locks on the paired
medians against those floors (`lock_acquire_vs_raw` and `stage_join_vs_raw` <= 1.5), not on an
absolute 2 ms, which the acquire floor alone exceeds. Exit status 1 unless `correct`.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from bench._pool_cli import add_pool_args, add_report_args, emit_report, loadavg_1m
from l2core import HostKVPool, L2Config
from l3pool.cluster.running import pool_endpoints
from l3pool.measure import percentile
from l3pool.pool.client import L3Client
from l3pool.pool.prefetch import Prefetcher, batch_schedule
from l3pool.pool.store import Outcome
from l3pool.pool.trailer import TRAILER_BYTES
from l3pool.tools.prefetch_check import LAYOUT, Endpoints, PrefixSet, check_fits, remove_test_set, run_writer

from ._locks import measure_lock_latencies

LOCK_KEYS = (
    "lock_acquire_p50_ms", "lock_acquire_p99_ms", "stage_join_p50_ms", "stage_join_p99_ms", "release_p99_ms",
    "lock_lookup_p50_ms", "lock_lookup_p99_ms", "lock_etcd_p50_ms", "lock_etcd_p99_ms",
    "raw_exists_p50_ms", "raw_exists_p99_ms", "raw_etcd_txn_p50_ms", "raw_etcd_txn_p99_ms",
    "raw_acquire_floor_p50_ms", "raw_acquire_floor_p99_ms", "raw_etcd_get_p50_ms", "raw_etcd_get_p99_ms",
    "lock_acquire_vs_raw", "lock_acquire_p99_vs_raw", "stage_join_vs_raw", "stage_join_p99_vs_raw",
)  # fmt: skip
LOCK_VS_RAW_TARGET = 1.5  # lock acquire / join over the raw Mooncake + etcd calls they consist of
POISON = 0xA5  # fill of every destination before the operation whose bytes are checked


def _lock_latencies(ep: Endpoints, requests: int, pages: int) -> tuple[dict[str, Any], str | None]:
    if ep.cluster is not None:
        got = measure_lock_latencies(ep.cluster, requests, pages=pages, stages=4)
    elif ep.etcd is not None:  # a running pool with its etcd (the local cluster of `l3pool cluster up`, or --etcd)
        store = ep.store()
        try:
            got = measure_lock_latencies(ep.etcd, requests, pages=pages, stages=4, store=store,
                                         key_prefix=ep.key_prefix)  # fmt: skip
        finally:
            store.close()
    else:
        return dict.fromkeys(LOCK_KEYS), "pplock latencies need etcd (give --etcd with --master)"
    return {k: round(v, 3) if isinstance(v := got.get(k), float) else v for k in LOCK_KEYS}, None


def bench(ps: PrefixSet, ep: Endpoints, args: argparse.Namespace) -> dict[str, Any]:
    spec = ps.spec()
    pb = spec.page_bytes
    pool = HostKVPool(L2Config(kv=spec, layout=LAYOUT, tokens=3 * ps.pages * ps.page_size, pin="never"))
    pool.buffer.fill_(POISON)  # faults every page in before timing; no page holds expected bytes
    store = ep.store()
    transport = store.cfg.protocol
    client = L3Client(pool, store, ps.namespace(), batch_pages=max(64, args.batch, args.max_batch))
    pf = Prefetcher(
        client, batch_pages=args.batch, max_batch_pages=args.max_batch, growth=args.growth,
        max_inflight=args.inflight, pipeline=args.pipeline,
    )  # fmt: skip
    sched = batch_schedule(ps.pages, args.batch, args.max_batch, args.growth)
    starts = [sum(sched[:i]) for i in range(len(sched))]
    view = pool.buffer.view(pool.num_pages, pb)
    keys = [ps.keys(r) for r in range(ps.requests)]
    want = [ps.expected(r) for r in range(ps.requests)]
    rng = random.Random(ps.seed)
    raw_s: list[float] = []
    raw_b_s: list[float] = []
    io = ThreadPoolExecutor(max_workers=args.pipeline)
    pf_s: list[float] = []
    int_ms: list[float] = []
    batch_ms: list[float] = []
    correct = True
    wrong = 0  # delivered pages whose bytes differ from the writer's
    raw_pages = pool.alloc(ps.pages)

    def check(pages: Any, r: int) -> bool:
        """Every delivered page holds request r's bytes, in key order (one vectorised compare)."""
        nonlocal wrong
        got = view[torch.from_numpy(pages)]
        bad = int((got != want[r][: len(pages)]).any(dim=1).sum())
        wrong += bad
        return bad == 0

    def poison_pool() -> None:
        """Before a prefetch (untimed): no page may already hold expected bytes when the allocator
        hands it out (LIFO returns the pages just freed, holding this request's bytes; the
        prefetcher also frees pages of dropped batches itself). Only raw_pages are allocated
        now, and they are poisoned again before each raw get anyway."""
        pool.buffer.fill_(POISON)

    addrs, sizes = pool.page_runs(raw_pages)
    # raw Mooncake reads the same objects: each page's bytes, then its 32-byte key trailer (into
    # a registered scratch row: the raw side does not verify it)
    trailers = np.zeros((ps.pages, TRAILER_BYTES), dtype=np.uint8)
    store.register(trailers.ctypes.data, trailers.nbytes)
    t_ptrs = (trailers.ctypes.data + TRAILER_BYTES * np.arange(ps.pages)).tolist()
    a_list = [[a, t] for a, t in zip(addrs[:, 0].tolist(), t_ptrs, strict=True)]
    s_list = [[s, TRAILER_BYTES] for s in sizes[:, 0].tolist()]

    def prefetch(r: int) -> bool:
        t0 = time.perf_counter()
        out = pf.submit(f"req{r}", keys[r]).wait(300)
        pf_s.append(time.perf_counter() - t0)
        batch_ms.extend(out.batch_ms)
        good = out.complete and out.error is None and len(out.pages) == ps.pages and check(out.pages, r)
        pool.free(out.pages)
        return good

    try:
        for rnd in range(args.rounds):
            for r in range(ps.requests):
                print(f"[bench.prefetch] round {rnd} request {r}", file=sys.stderr, flush=True)
                prefetch_first = (rnd * ps.requests + r) % 2 == 1
                if prefetch_first:
                    poison_pool()
                    correct &= prefetch(r)
                pool.fill_pages(raw_pages, POISON)
                t0 = time.perf_counter()
                res = store.get_multi(keys[r], a_list, s_list)
                raw_s.append(time.perf_counter() - t0)
                correct &= all(x is Outcome.OK for x in res) and check(raw_pages, r)
                if not prefetch_first:
                    poison_pool()
                    correct &= prefetch(r)
                pool.fill_pages(raw_pages, POISON)
                t0 = time.perf_counter()  # raw again, in the prefetcher's batches and pipeline depth
                window: collections.deque[Future[list[Outcome]]] = collections.deque()
                ok = True
                for i, k in zip(starts, sched, strict=True):
                    if len(window) == args.pipeline:
                        ok &= all(x is Outcome.OK for x in window.popleft().result())
                    window.append(io.submit(store.get_multi, keys[r][i : i + k], a_list[i : i + k], s_list[i : i + k]))
                ok &= all(x is Outcome.OK for f in window for x in f.result())
                raw_b_s.append(time.perf_counter() - t0)
                correct &= ok and check(raw_pages, r)
                poison_pool()
                h = pf.submit(f"req{r}", keys[r])
                time.sleep(rng.random() * statistics.median(pf_s))
                ti = time.perf_counter()
                out = h.interrupt(60)
                int_ms.append((time.perf_counter() - ti) * 1e3)
                n = out.keys_loaded
                correct &= out.error is None and len(out.pages) == n and check(out.pages, r)
                pool.free(out.pages)
    finally:
        pf.close()
        io.shutdown()
        pool.free(raw_pages)
        leaked = pool.stats().used_pages
        client.close()
        store.unregister(trailers.ctypes.data)
        store.close()
        pool.close()
    gb = ps.pages * pb / 1e9
    raw, pre = statistics.median(raw_s), statistics.median(pf_s)
    return {
        "transport": transport,
        "raw_get_GBps": round(gb / raw, 3),
        "prefetch_GBps": round(gb / pre, 3),
        "prefetch_ratio": round(raw / pre, 4),
        "raw_get_batched_GBps": round(gb / statistics.median(raw_b_s), 3),
        "prefetch_vs_batched_ratio": round(statistics.median(raw_b_s) / pre, 4),
        "interrupt_p50_ms": round(percentile(int_ms, 50), 3),
        "interrupt_p99_ms": round(percentile(int_ms, 99), 3),
        "batch_p50_ms": round(percentile(batch_ms, 50), 3),
        "batch_p99_ms": round(percentile(batch_ms, 99), 3),
        "leaked_pages": leaked,
        "wrong_pages": wrong,
        "correct": bool(correct) and leaked == 0 and wrong == 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefetch", description=__doc__.splitlines()[0])
    add_report_args(p)
    add_pool_args(p, segment_size="1GB", etcd=True)
    p.add_argument("--pages", type=int, default=512, help="pages per request")
    p.add_argument("--requests", type=int, default=2, help="distinct request prefixes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="first prefetch batch (pages)")
    p.add_argument("--max-batch", type=int, default=256, help="cap of the growing prefetch batches (pages)")
    p.add_argument("--growth", type=float, default=4.0, help="each prefetch batch this times the one before")
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--pipeline", type=int, default=1, help="batches in flight per prefetch")
    p.add_argument("--lock-requests", type=int, default=100, help="requests for the PP-lock latencies")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("pages", "requests", "rounds", "batch", "max_batch", "inflight", "pipeline", "lock_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.growth <= 1e6:  # before any pool: the schedule refuses it too, after connecting
        p.error(f"--growth must be between 1 and 1e6, got {args.growth!r}")
    load_start = loadavg_1m()
    ps = PrefixSet(8, 64, args.pages, args.requests, args.seed, uuid.uuid4().hex)
    # the given pool, the local cluster `l3pool cluster up` left running, or one started here
    with pool_endpoints(args.master, args.metadata, args.host, args.etcd, segment_size=args.segment_size,
                        name=f"l3bp{uuid.uuid4().hex[:4]}", state_dir=args.state_dir) as ep:  # fmt: skip
        check_fits(ps, ep)
        print(f"[bench.prefetch] {ep.mode}: writing the prefix set", file=sys.stderr, flush=True)
        writer = run_writer(ps, ep)
        row = bench(ps, ep, args)
        locks, lock_note = _lock_latencies(ep, args.lock_requests, args.pages)
        removed = remove_test_set(ps, ep)  # a running pool keeps nothing of the benchmark
    report: dict[str, Any] = {
        "benchmark": "bench.prefetch",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        # other work on the machine skews the numbers (shared 2-core boxes especially): 1-min load
        "loadavg_1m": {"start": load_start, "end": loadavg_1m()},
        "transport": row.pop("transport"),  # the protocol the benchmark's store was set up with
        "mode": ep.mode,
        "writer_netns": writer.get("netns"),
        "spec": "KVSpec.mla(8, page_size=64) bf16 page_first_direct",
        "page_bytes": ps.spec().page_bytes,
        "pages": args.pages,
        "stages": 4,
        "requests": args.requests,
        "rounds": args.rounds,
        "batch_pages": args.batch,
        "max_batch_pages": args.max_batch,
        "growth": args.growth,
        "batch_schedule": batch_schedule(args.pages, args.batch, args.max_batch, args.growth),
        "inflight": args.inflight,
        "pipeline": args.pipeline,
        **locks,
        "lock_note": lock_note,
        "test_pages_removed": removed,
        **row,
    }

    def at_most(k: str, limit: float) -> bool | None:
        return None if report.get(k) is None else bool(report[k] <= limit)

    report["targets"] = {
        "prefetch_ratio>=0.90": report["prefetch_ratio"] >= 0.90,
        # judged against the raw floors of the same run (paired medians; the p99 ratios move with the
        # machine's load), not an absolute 2 ms: the acquire floor alone is above 2 ms (docs/design.md)
        "lock_acquire_vs_raw<=1.5": at_most("lock_acquire_vs_raw", LOCK_VS_RAW_TARGET),
        "stage_join_vs_raw<=1.5": at_most("stage_join_vs_raw", LOCK_VS_RAW_TARGET),
        "interrupt_p99_ms<=150": at_most("interrupt_p99_ms", 150.0),
    }
    emit_report(report, args)
    return 0 if report["correct"] else 1
