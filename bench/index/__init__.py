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
         `native_query_p99_ms` the native call alone.
client   over the wire, as a router asks: the IndexService serves this table; a separate process
         sends `--client-rounds` rounds of `--client-queries` requests through IndexClient (one
         ZeroMQ round trip each on loopback, paced at `--client-rate` per second) while another
         process, a KV-event source, sends `--event-rate` event messages per second of
         `--event-keys` keys (so queries meet event ingestion, as in a cluster).
         `client_query_p50_ms`/`client_query_p99_ms`: the median over the rounds of each round's
         percentile, `client_query_rounds_ms` every round's [p50, p99] (the spread);
         `client_cpu_us_per_query` the client process's CPU per query (its I/O threads included),
         `service_cpu_us_per_query_with_ingestion` the service's (this process's CPU over the
         phase / queries: the concurrent event ingestion included, the same for any query path).
churn    (bench/index/_churn.py) `--churn-rounds` rounds of one instance leaving, being resynchronised,
         and of L3 hint ageing and a pool clear, while another thread queries at `--churn-rate`
         per second: each operation's lock holds (`churn_lock_hold_max_ms`: the longest native
         call under the index's lock, what a query can wait behind) and the latency of the queries
         that overlapped it (`churn_query_p99_ms`), beside a quiet window's; a third thread applies
         other instances' event batches (`--churn-event-rate` per second of `--churn-event-keys`
         keys) and their apply latency is reported the same way (`churn_event_p99_ms`).
memory   `bytes_per_page`: the table's bytes over the pages indexed at the end (and over capacity).
Answers are checked against the stored state for a sample of requests (`correct`).
`loadavg` is the machine's load average (1, 5, 15 min) at the start and the end: on a shared
machine the wall-clock numbers move with it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._pool_cli import add_report_args, emit_report
from l3pool.measure import percentile
from l3pool.pool.kv_events import SourceInfo
from l3pool.procenv import python_env


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _ms(xs: list[float], q: float) -> float:
    return round(percentile(xs, q) * 1e3, 4)


WORKER_FILE = Path(__file__).with_name("_client.py")
# loads the worker from its file: `python -m bench.index._client` would run bench/__init__'s torch check
_LOADER = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('bench_index_client', sys.argv[1]); "
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))"
)


def start_worker(role: str, cfg: dict[str, Any], work: Path) -> subprocess.Popen[str]:
    path = work / f"{role}.json"
    path.write_text(json.dumps(cfg))
    return subprocess.Popen([sys.executable, "-c", _LOADER, str(WORKER_FILE), role, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=python_env(),
                            start_new_session=True)  # fmt: skip


def read_line(p: subprocess.Popen[str], timeout: float) -> str:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"a bench.index worker gave no answer within {timeout:.0f} s (exit {p.poll()})")
    return line


def stop_worker(p: subprocess.Popen[str]) -> None:
    for f in (p.stdin, p.stdout):
        with contextlib.suppress(OSError):
            if f is not None:
                f.close()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=5)


def over_the_wire(gi: Any, reqs: list[np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    """IndexClient -> IndexService round trips from another process, under event ingestion from a
    third (the module docstring's `client` section)."""
    from l3pool.index.client import IndexClient
    from l3pool.index.service import IndexService

    load = "load-0"
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp, IndexService(gi) as svc:
        work = Path(tmp)
        np.save(work / "requests.npy", np.stack(reqs))
        with IndexClient(svc.endpoint, timeout_s=5.0) as c:  # the answers over the wire are the table's
            correct = all(c.query(r) == gi.query(r) for r in reqs[:50])
        events = None
        try:
            if args.event_rate > 0:  # the source takes the last instance's slot: answers stay 64 wide
                gi.remove_instance(gi.instances()[-1])
                events = start_worker(
                    "events", {"instance": load, "rate": args.event_rate, "keys": args.event_keys}, work
                )
                svc.set_sources({load: SourceInfo.from_json(read_line(events, 60))})
                if not svc.wait_live([load], timeout=30):
                    raise RuntimeError("the index did not synchronise the event source within 30 s")
            applied0 = svc.status()["instances"].get(load, {}).get("events", 0)
            t0, c0 = time.perf_counter(), time.process_time()
            query = start_worker("query", {"endpoint": svc.endpoint, "requests": str(work / "requests.npy"),
                                      "rate": args.client_rate, "queries": args.client_queries,
                                      "rounds": args.client_rounds, "namespace": ""}, work)  # fmt: skip
            budget = 60 + args.client_rounds * (0.5 + args.client_queries / (args.client_rate or 1000) * 3)
            res = json.loads(read_line(query, budget))
            wall, service_cpu = time.perf_counter() - t0, time.process_time() - c0
            stop_worker(query)
            applied = svc.status()["instances"].get(load, {}).get("events", 0) - applied0
        finally:
            if events is not None:
                stop_worker(events)
    rounds = [(_ms(x, 50), _ms(x, 99)) for x in res["rounds"]]
    p50, p99 = [r[0] for r in rounds], [r[1] for r in rounds]
    return {
        "client_query_p50_ms": round(statistics.median(p50), 4),
        "client_query_p99_ms": round(statistics.median(p99), 4),
        "client_query_p50_ms_spread": [min(p50), max(p50)],
        "client_query_p99_ms_spread": [min(p99), max(p99)],
        "client_query_rounds_ms": [list(r) for r in rounds],
        "client_queries": sum(len(x) for x in res["rounds"]),
        "client_rate_per_s": args.client_rate,
        "client_answered_instances": res["instances"],
        "event_messages_during_queries_per_s": round(applied / wall, 1),
        "client_correct": bool(correct),
        # CPU per query (what load on a shared machine does not inflate much): the client process
        # (its I/O threads included) per round, and this process (the service: queries and the
        # event ingestion meanwhile, which costs the same with either query path) over the phase
        "client_cpu_us_per_query": round(statistics.median(res["cpu_per_query_s"]) * 1e6, 1),
        "client_cpu_us_per_query_spread": [
            round(min(res["cpu_per_query_s"]) * 1e6, 1),
            round(max(res["cpu_per_query_s"]) * 1e6, 1),
        ],
        "service_cpu_us_per_query_with_ingestion": round(service_cpu / max(1, len(p50) * args.client_queries) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--pages", type=int, default=100_000, help="distinct pages indexed per instance")
    p.add_argument("--batch", type=int, default=512, help="keys per event batch")
    p.add_argument("--request-pages", type=int, default=512)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--hot", type=int, default=200, help="hot prefixes held by every instance")
    p.add_argument("--client-queries", type=int, default=1000, help="queries over ZeroMQ per round (0: skip)")
    p.add_argument("--client-rounds", type=int, default=5, help="rounds of --client-queries")
    p.add_argument("--client-rate", type=float, default=500.0, help="queries/s over ZeroMQ (0: back to back)")
    p.add_argument("--event-rate", type=float, default=500.0,
                   help="KV-event messages/s from a source during the queries (0: none)")  # fmt: skip
    p.add_argument("--event-keys", type=int, default=64, help="keys per event message")
    p.add_argument("--churn-rounds", type=int, default=5, help="rounds of leave/resync/age/pool-clear (0: skip)")
    p.add_argument("--churn-rate", type=float, default=2000.0, help="queries/s during the churn phase")
    p.add_argument("--churn-event-rate", type=float, default=500.0,
                   help="other instances' event batches/s during the churn phase (0: none)")  # fmt: skip
    p.add_argument("--churn-event-keys", type=int, default=512, help="keys per churn-phase event batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("instances", "pages", "batch", "request_pages", "queries", "hot"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("client_queries", "churn_rounds"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if not args.churn_rate > 0:
        p.error("--churn-rate must be > 0")
    for name in ("client_rounds", "event_keys", "churn_event_keys"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("client_rate", "event_rate", "churn_event_rate"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.pages < args.request_pages:
        p.error("--pages must be >= --request-pages")
    load_start = loadavg()
    from bench.index._churn import churn
    from l3pool.index.table import GlobalIndex
    from l3pool.pool import kv_events as kv

    rng = np.random.default_rng(args.seed)
    n_inst, per, R = args.instances, args.pages, args.request_pages
    hot_keys = rng.integers(1, 1 << 63, size=(args.hot, R), dtype=np.uint64)
    own = rng.integers(1, 1 << 63, size=(n_inst, per), dtype=np.uint64)
    capacity = n_inst * per + args.hot * R
    shift = [0.0]  # seconds added to the index's clock: the churn phase ages every L3 hint out
    gi = GlobalIndex(capacity, max(64, n_inst), l3_ttl_s=3600.0, clock=lambda: time.monotonic() + shift[0])
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
    st = gi.stats()  # before the over-the-wire phase (its event source replaces one instance)

    def contents(i: int) -> dict[str, np.ndarray]:  # instance i's snapshot (its hot pages in L2)
        hot = hot_keys.ravel()
        return {"l1": own[i], "l2": hot} if tier_of[i] == 0 else {"l2": np.concatenate([own[i], hot])}

    ch = None
    if args.churn_rounds:
        ch = churn(gi, names, contents, hot_keys[::2].ravel(), reqs, shift, args.churn_rounds, args.churn_rate,
                   event_rate=args.churn_event_rate, event_keys=args.churn_event_keys)  # fmt: skip
    wire = over_the_wire(gi, reqs, args) if args.client_queries else None
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
        **(wire or {"client_query_p50_ms": None, "client_query_p99_ms": None}),
        "churn_query_p99_ms": ch["query_p99_ms"] if ch else None,
        "churn_lock_hold_max_ms": ch["lock_hold_max_ms"] if ch else None,
        "churn_event_p99_ms": ch["event_p99_ms"] if ch else None,
        "churn_lock_hold_max_thread_cpu_ms": ch["lock_hold_max_thread_cpu_ms"] if ch else None,
        "churn": ch,
        "entries": st["entries"],
        "nbytes": st["nbytes"],
        "bytes_per_page": round(st["nbytes"] / max(1, st["entries"]), 1),
        "bytes_per_page_of_capacity": st["bytes_per_page"],
        "rejected": st["rejected"],
        "correct": bool(
            ok and st["rejected"] == 0 and (wire is None or wire["client_correct"]) and (ch is None or ch["correct"])
        ),
        "loadavg": {"start": load_start, "end": loadavg()},
    }
    report["targets"] = {
        "ingest_pages_per_s>=5e6": report["ingest_pages_per_s"] >= 5e6,
        "ingest_thread_cpu_pages_per_s>=5e6": report["ingest_thread_cpu_pages_per_s"] >= 5e6,
        "query_p99_ms<=1": report["query_p99_ms"] <= 1.0,
        "query_thread_cpu_p99_ms<=1": report["query_thread_cpu_p99_ms"] <= 1.0,
        "client_query_p99_ms<=1": None if wire is None else report["client_query_p99_ms"] <= 1.0,
        "churn_query_p99_ms<=1": None if ch is None or ch["query_p99_ms"] is None else ch["query_p99_ms"] <= 1.0,
        "churn_lock_hold_max_thread_cpu_ms<=1": None if ch is None else ch["lock_hold_max_thread_cpu_ms"] <= 1.0,
        "churn_event_p99_ms<=50": None if ch is None or ch["event_p99_ms"] is None else ch["event_p99_ms"] <= 50.0,
    }
    emit_report(report, args)
    return 0 if report["correct"] else 1
