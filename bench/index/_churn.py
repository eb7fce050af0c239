"""bench.index's churn phase: query latency while the table changes wholesale.

A thread asks `GlobalIndex.query` at `rate` per second (paced; the bench's requests in turn) while
this thread, in `rounds` rounds, makes one instance of the table
- `leave`: `remove_instance` (its membership lease ended; it is then re-added, unmeasured),
- `resync`: `replace` with the same contents (a snapshot after a resynchronisation),
- `age`: `age()` with every L3 hint expired (the clock moved past the TTL; hints restored after),
- `pool_clear`: `clear_pool()` (a pool member left; hints restored after),
and stays idle for a `quiet` window of the same queries before each of them. A third thread
applies event batches of the OTHER instances at `event_rate` per second (paced; each `event_keys`
keys: half of an instance's own pages removed and stored back in one batch, so the table keeps its
size and a removal empties entries), as the service's loop would while a change runs.

Per operation: its wall and thread-CPU time, `lock_holds` (the native calls it made: the index
holds its lock around each, so one call is the longest a query can wait behind it),
`lock_hold_max_ms` / `lock_hold_max_thread_cpu_ms` (the longest of those calls), medians over the
rounds; and the queries that overlapped it, pooled over the rounds: how many, their wall-clock
p50 / p99 / max (`quiet`: the queries that started in a quiet window, none of them behind a change);
the same for the event batches (`event_*`: from the batch handed to `GlobalIndex.apply` until it
returns, the batches overlapping the operation; `quiet`: those started in a quiet window), and
`event_lag_*`: from the time the batch was due by the writer's schedule until it returned (a batch
due while the writer waited in apply goes in late, the ones due meanwhile back to back after it:
what an event queue behind a blocked loop would see), the batches whose (due, returned) span
overlaps the operation.
Wall-clock numbers carry a shared machine's preemption; the lock-hold thread CPU is what the table
itself costs.

`departed_answered` counts answers naming an instance after its `remove_instance` returned (it
must be 0); `correct` also checks the table ends as it began.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from l3pool.measure import percentile

OPS = ("leave", "resync", "age", "pool_clear")


class TimedNative:
    """`gi.native` with the calls of one thread timed (its other threads' calls pass through)."""

    def __init__(self, native: Any, thread: int) -> None:
        self._native, self._thread = native, thread
        self.calls: list[tuple[str, float, float]] = []  # (method, wall s, thread CPU s)

    def __getattr__(self, name: str) -> Any:
        v = getattr(self._native, name)
        if not callable(v) or threading.get_ident() != self._thread:
            return v

        def timed(*a: Any, **k: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return v(*a, **k)
            finally:
                self.calls.append((name, time.perf_counter() - t0, time.thread_time() - c0))

        return timed


def _ms(x: float) -> float:
    return round(x * 1e3, 4)


def churn(
    gi: Any,
    names: list[str],
    contents: Callable[[int], dict[str, np.ndarray]],
    pool_keys: np.ndarray,
    reqs: list[np.ndarray],
    shift: list[float],
    rounds: int,
    rate: float,
    quiet_s: float = 0.05,
    event_rate: float = 500.0,
    event_keys: int = 512,
) -> dict[str, Any]:
    """The churn phase (the module docstring). `contents(i)`: instance i's snapshot (its tiers as
    `replace` takes them: what it holds now); `pool_keys`: the L3 hints to restore after `age` and
    `pool_clear` (stored by names[0]); `shift`: seconds added to the index's clock (`age` moves it
    past the TTL). `event_rate` 0: no event batches."""
    entries0 = gi.stats()["entries"]
    timed = TimedNative(gi.native, threading.get_ident())
    gi.native = timed
    stop = threading.Event()
    spans: list[tuple[float, float]] = []
    gone: list[str | None] = [None]
    seen_gone = [0]

    def ask() -> None:
        period = 1.0 / rate if rate > 0 else 0.0
        nxt = time.perf_counter()
        j = 0
        while not stop.is_set():
            if period:
                nxt += period
                d = nxt - time.perf_counter()
                if d > 0:
                    time.sleep(d)
                else:
                    nxt = time.perf_counter()  # behind: no burst to catch up
            g = gone[0]
            t0 = time.perf_counter()
            names_ = gi.query_lists(reqs[j % len(reqs)])[2]
            spans.append((t0, time.perf_counter()))
            if g is not None and g in names_ and gone[0] is g:
                seen_gone[0] += 1
            j += 1

    busy: list[str | None] = [None]  # the instance the current round churns: no events of its own
    ev_spans: list[tuple[float, float]] = []  # (handed to apply, returned)
    lag_spans: list[tuple[float, float]] = []  # (due by the writer's schedule, returned)
    half = max(1, event_keys // 2)
    pick_mu = threading.Lock()  # held by the writer from choosing an instance until its batch is in
    own_of: dict[int, tuple[int, np.ndarray]] = {}

    def write() -> None:  # other instances' event batches: remove half-batch, store it back
        period = 1.0 / event_rate
        nxt = time.perf_counter()
        j = 0
        while not stop.is_set():
            nxt += period  # behind (a batch waited): the batches due meanwhile follow back to back
            d = nxt - time.perf_counter()
            if d > 0:
                time.sleep(d)
            w = j % len(names)
            j += 1
            if w not in own_of:
                c = contents(w)
                own_of[w] = (0, c["l1"]) if "l1" in c else (1, c["l2"])
            tier, own = own_of[w]
            a = (j // len(names) * half) % max(1, len(own) - half)
            k = own[a : a + half]
            o = np.array([[tier, 0, len(k)], [tier, 1, len(k)]], dtype=np.int64)
            kk = np.concatenate([k, k])
            with pick_mu:
                if names[w] == busy[0]:
                    continue
                t0 = time.perf_counter()
                gi.apply(names[w], "", o, kk)
                t1 = time.perf_counter()
                ev_spans.append((t0, t1))
                lag_spans.append((min(nxt, t0), t1))

    pool_ops = np.array([[2, 1, len(pool_keys)]], dtype=np.int64)
    windows: dict[str, list[tuple[float, float]]] = {op: [] for op in ("quiet", *OPS)}
    per_op: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}

    def measure(op: str, fn: Callable[[], Any]) -> None:
        q0 = time.perf_counter()
        time.sleep(quiet_s)
        windows["quiet"].append((q0, time.perf_counter()))
        timed.calls = []
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        windows[op].append((t0, t1))
        calls = timed.calls
        per_op[op].append({
            "ms": _ms(t1 - t0),
            "thread_cpu_ms": _ms(c1 - c0),
            "lock_holds": len(calls),
            "lock_hold_max_ms": _ms(max((c[1] for c in calls), default=0.0)),
            "lock_hold_max_thread_cpu_ms": _ms(max((c[2] for c in calls), default=0.0)),
        })  # fmt: skip

    post_leave_ok = True
    asker = threading.Thread(target=ask, name="bench-index-churn-queries", daemon=True)
    asker.start()
    writer = threading.Thread(target=write, name="bench-index-churn-events", daemon=True)
    if event_rate > 0:
        writer.start()
    try:
        for r in range(rounds):
            i = (1 + 7 * r) % len(names)
            name = names[i]
            with pick_mu:
                busy[0] = name
            measure("leave", partial(gi.remove_instance, name))
            gone[0] = name
            post_leave_ok = post_leave_ok and name not in gi.query(reqs[0]).per_instance
            time.sleep(quiet_s / 2)  # the asker's queries meet the departed instance
            gone[0] = None
            gi.add_instance(name)
            gi.replace(name, "", contents(i))
            gi.set_live(name, True)
            gi.set_live(name, False)  # as the service does: not answered while resynchronised
            measure("resync", partial(gi.replace, name, "", contents(i)))
            gi.set_live(name, True)
            shift[0] += 2 * gi.l3_ttl_s
            measure("age", gi.age)
            gi.apply(names[0], "", pool_ops, pool_keys)
            measure("pool_clear", gi.clear_pool)
            gi.apply(names[0], "", pool_ops, pool_keys)
    finally:
        stop.set()
        asker.join(10)
        if event_rate > 0:
            writer.join(10)
        gi.native = timed._native

    def overlapping(ws: list[tuple[float, float]], sp: list[tuple[float, float]]) -> list[float]:
        return [b - a for a, b in sp if any(a < w1 and b > w0 for w0, w1 in ws)]

    def started(ws: list[tuple[float, float]], sp: list[tuple[float, float]]) -> list[float]:
        return [b - a for a, b in sp if any(w0 <= a < w1 for w0, w1 in ws)]  # not behind an earlier change

    out: dict[str, Any] = {
        "rounds": rounds, "rate_per_s": rate, "queries": len(spans),
        "event_rate_per_s": event_rate, "event_keys": 2 * half if event_rate > 0 else 0, "events": len(ev_spans),
    }  # fmt: skip
    for op in ("quiet", *OPS):
        pick = started if op == "quiet" else overlapping
        lat, ev, lag = pick(windows[op], spans), pick(windows[op], ev_spans), pick(windows[op], lag_spans)
        row: dict[str, Any] = {}
        if op != "quiet":
            for k in per_op[op][0] if per_op[op] else ():
                row[k] = round(statistics.median(x[k] for x in per_op[op]), 4)
        row.update({
            "queries": len(lat),
            "query_p50_ms": _ms(percentile(lat, 50)) if lat else None,
            "query_p99_ms": _ms(percentile(lat, 99)) if lat else None,
            "query_max_ms": _ms(max(lat)) if lat else None,
            "events": len(ev),
            "event_p50_ms": _ms(percentile(ev, 50)) if ev else None,
            "event_p99_ms": _ms(percentile(ev, 99)) if ev else None,
            "event_max_ms": _ms(max(ev)) if ev else None,
            "event_lag_p99_ms": _ms(percentile(lag, 99)) if lag else None,
        })  # fmt: skip
        out[op] = row
    all_ops = [w for op in OPS for w in windows[op]]
    during, ev_during = overlapping(all_ops, spans), overlapping(all_ops, ev_spans)
    lag_during = overlapping(all_ops, lag_spans)
    out["query_p99_ms"] = _ms(percentile(during, 99)) if during else None
    out["query_max_ms"] = _ms(max(during)) if during else None
    out["event_p50_ms"] = _ms(percentile(ev_during, 50)) if ev_during else None
    out["event_p99_ms"] = _ms(percentile(ev_during, 99)) if ev_during else None
    out["event_max_ms"] = _ms(max(ev_during)) if ev_during else None
    out["event_lag_p50_ms"] = _ms(percentile(lag_during, 50)) if lag_during else None
    out["event_lag_p99_ms"] = _ms(percentile(lag_during, 99)) if lag_during else None
    out["lock_hold_max_ms"] = max((out[op].get("lock_hold_max_ms", 0.0) for op in OPS), default=0.0)
    out["lock_hold_max_thread_cpu_ms"] = max(
        (out[op].get("lock_hold_max_thread_cpu_ms", 0.0) for op in OPS), default=0.0
    )
    out["departed_answered"] = seen_gone[0]
    out["correct"] = bool(
        post_leave_ok
        and seen_gone[0] == 0
        and gi.stats()["entries"] == entries0
        and not asker.is_alive()
        and not writer.is_alive()
    )
    return out
