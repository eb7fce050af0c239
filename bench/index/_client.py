"""The processes of `bench.index`'s over-the-wire phase (loaded from this file by `bench.index`, so
the `bench` package's torch check is not paid per process; nothing here needs torch):

    python -c <loader> query CONFIG.json     # IndexClient queries in rounds; stdout: one JSON line
    python -c <loader> events CONFIG.json    # a KV-event source under load; stdout: its SourceInfo
    python -c <loader> churn CONFIG.json     # a scripted instance (bench.index_service); stdout: its SourceInfo

`query`: `rounds` rounds of `queries` requests (the page keys of `requests`, an .npy file of
uint64 rows), one IndexClient round trip each, paced open-loop at `rate` per second (0: back to
back; a late query goes at once). Prints {"rounds": [[seconds, ...], ...], "cpu_per_query_s": [per round:
this process's CPU seconds / queries, all its threads], "pages": ..., "instances": ...}.

`events`: a `KvEventPublisher` (instance `instance`) that sends about `rate` event messages per
second of `keys` page keys each (half stores of fresh keys into L2, half removals of the keys
stored `window` messages earlier, so the index's table keeps its size) until its stdin closes; it
prints its SourceInfo as JSON first.

`churn`: an instance holding `pages` random keys in L1 (its snapshot), speaking the wire protocol
itself (a PUB and a snapshot ROUTER, as tests/l3pool/index/test_index_service.py's Instance): a
heartbeat every 0.5 s; each "gap" line on stdin sends an empty event message two seqs on (the
index sees a gap and resynchronises it from its snapshot); it ends when stdin closes. Prints its
SourceInfo as JSON first.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque

import numpy as np


def run_queries(cfg: dict) -> dict:
    from l3pool.index.client import IndexClient

    reqs = np.load(cfg["requests"])
    rate, n, rounds = float(cfg["rate"]), int(cfg["queries"]), int(cfg["rounds"])
    out: list[list[float]] = []
    cpu: list[float] = []  # this process's CPU seconds per query, per round (all its threads)
    instances = 0
    with IndexClient(cfg["endpoint"], timeout_s=5.0) as c:
        for k in range(3):  # connect and warm the path (not measured)
            c.query(reqs[k % len(reqs)], namespace=cfg["namespace"])
        for r in range(rounds):
            lat = []
            c0 = time.process_time()
            t_start = time.perf_counter()
            for q in range(n):
                if rate > 0:
                    wait = t_start + q / rate - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                req = reqs[(r * n + q) % len(reqs)]
                t0 = time.perf_counter()
                h = c.query(req, namespace=cfg["namespace"])
                lat.append(time.perf_counter() - t0)
                instances = len(h.per_instance)
            cpu.append((time.process_time() - c0) / n)
            out.append(lat)
            time.sleep(float(cfg.get("pause_s", 0.2)))
    return {"rounds": out, "cpu_per_query_s": cpu, "pages": int(reqs.shape[1]), "instances": instances}


def run_events(cfg: dict) -> int:
    from l3pool.cache.events import KvEventPublisher

    rate, keys, window = float(cfg["rate"]), int(cfg["keys"]), int(cfg.get("window", 64))
    rng = np.random.default_rng(int(cfg.get("seed", 1)))
    held: deque[np.ndarray] = deque()
    mu = threading.Lock()

    def contents(under_lock: object) -> dict[str, np.ndarray]:
        with mu:
            l2 = np.concatenate(list(held)) if held else np.empty(0, np.uint64)
            if callable(under_lock):
                under_lock()
            return {"l1": np.empty(0, np.uint64), "l2": l2}

    pub = KvEventPublisher(cfg["instance"], namespace=cfg.get("namespace", ""))
    pub.bind(contents)
    print(pub.info().to_json(), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    half = max(1, keys // 2)
    t_start, k = time.perf_counter(), 0
    while not stop.is_set():
        wait = t_start + k / rate - time.perf_counter()
        if wait > 0:
            stop.wait(wait)
        fresh = rng.integers(1, 1 << 63, size=half, dtype=np.uint64)
        with mu:  # as a cache does: the state and its event under one lock
            held.append(fresh)
            pub.stored("l2", fresh)
            if len(held) > window:
                pub.removed("l2", held.popleft())
        k += 1
    pub.close()
    return 0


def run_churn(cfg: dict) -> int:
    import zmq

    from l3pool.pool import kv_events as kv

    iid, ns = cfg["instance"], cfg.get("namespace", "")
    keys = np.random.default_rng(int(cfg.get("seed", 2))).integers(1, 1 << 63, size=int(cfg["pages"]), dtype=np.uint64)
    tiers = {"l1": keys, "l2": np.empty(0, np.uint64), "l3": np.empty(0, np.uint64)}
    epoch, seq = kv.new_epoch(), 0
    ctx = zmq.Context.instance()
    pub, rtr = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for s in (pub, rtr):
        s.setsockopt(zmq.LINGER, 0)
        s.bind("tcp://127.0.0.1:*")
    ep = lambda s: s.getsockopt(zmq.LAST_ENDPOINT).decode()  # noqa: E731
    print(kv.SourceInfo(iid, ep(pub), ep(rtr), ns, epoch).to_json(), flush=True)
    poller = zmq.Poller()
    poller.register(rtr, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    beat = time.monotonic()
    while True:
        ready = dict(poller.poll(100))
        if rtr in ready:
            frames = rtr.recv_multipart()
            rtr.send_multipart([*frames[:-1], kv.encode_snapshot(iid, epoch, seq, ns, tiers)])
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            if not line:
                break
            if line.strip() == "gap":
                seq += 2
                pub.send(kv.encode_events(iid, epoch, seq, ns, [], b""))
        if time.monotonic() - beat >= 0.5:
            pub.send(kv.encode_events(iid, epoch, seq, ns, [], b""))
            beat = time.monotonic()
    pub.close()
    rtr.close()
    return 0


def main(argv: list[str]) -> int:
    role, path = argv[0], argv[1]
    with open(path) as f:
        cfg = json.load(f)
    if role == "query":
        print(json.dumps(run_queries(cfg)), flush=True)
        return 0
    if role == "events":
        return run_events(cfg)
    if role == "churn":
        return run_churn(cfg)
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
