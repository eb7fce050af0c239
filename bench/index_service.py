"""Event lag through the real IndexService while instances churn (issue 19: event lag p99 <= 50 ms).

    PYTHONPATH=. python -m bench.index_service [--json] [--out FILE] [--instances 64] [--pages 100000]

The table holds `--instances` x `--pages` (all but two instances stored directly, as bench.index
does; `--hints` L3 hints so ageing and a pool clear sweep the whole table). The service serves it
with two real sources in other processes (bench/index/_client.py): `load`, a KvEventPublisher
sending `--event-rate` event messages per second of `--event-keys` keys, and `churn`, an instance
holding `--pages` pages in L1. After a quiet window (`--quiet-s`), `--rounds` rounds of:
`churn` resynchronised (a gap: its 100 K entries swept and its snapshot stored, `replace`), a pool
member leaving (`clear_pool`), `churn` leaving (`remove_instance`), `churn` joining again (its
snapshot stored), `--pause-s` after each; ageing runs every `--age-s` throughout. Reported: the
service's own event lag (`event_lag_*`: the publisher's `sent_at` of a message's oldest operation
to its apply, i.e. end to end over ZeroMQ) for `load`'s messages in the quiet window and during
the churn (the quiet window has no instance churn, but ageing runs in it too), how long each
churn operation took as seen from outside (until it is done: live again, no hint left, the
leaving instance's slot free again), `load`'s gaps/resyncs (none expected), and `loadavg` at the start and the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._pool_cli import add_report_args, emit_report
from bench.index import loadavg, read_line, start_worker, stop_worker
from l3pool.cliutil import guarded, nonneg_float, positive_float, positive_int
from l3pool.pool.kv_events import SourceInfo


def _wait(cond: Any, timeout: float = 60.0) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"not within {timeout} s")
        time.sleep(0.002)
    return time.perf_counter() - t0


def _lag(xs: list[float]) -> dict[str, Any]:
    a = np.asarray(xs, dtype=np.float64) * 1e3
    if not a.size:
        return {"samples": 0}
    return {"samples": int(a.size), "p50": round(float(np.percentile(a, 50)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}  # fmt: skip


def at_least_3(text: str) -> int:
    """--instances: the publisher, the churned instance and at least one static instance."""
    n = positive_int(text)
    if n < 3:
        raise argparse.ArgumentTypeError(f"must be >= 3, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.index_service", description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=at_least_3, default=64)
    p.add_argument("--pages", type=positive_int, default=100_000)
    p.add_argument(
        "--hints", type=positive_int, default=50_000, help="L3 hints in the table (restored after each pool clear)"
    )
    p.add_argument("--event-rate", type=positive_float, default=500.0)
    p.add_argument("--event-keys", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--pause-s", type=nonneg_float, default=0.4)
    p.add_argument("--quiet-s", type=positive_float, default=3.0)
    p.add_argument("--age-s", type=positive_float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_report_args(p)
    args = p.parse_args(argv)
    load_start = loadavg()
    from l3pool.index.service import IndexService
    from l3pool.index.table import GlobalIndex

    rng = np.random.default_rng(args.seed)
    n_static, per = args.instances - 2, args.pages
    gi = GlobalIndex(args.instances * per + args.hints, max(64, args.instances), l3_ttl_s=3600.0)
    names = [f"inst-{i}" for i in range(n_static)]
    t0 = time.perf_counter()
    for n in names:
        gi.add_instance(n)
        gi.set_live(n, True)
        own = rng.integers(1, 1 << 63, size=per, dtype=np.uint64)
        for a in range(0, per, 4096):
            k = own[a : a + 4096]
            gi.apply(n, "", np.array([[int(rng.integers(0, 2)), 1, len(k)]], dtype=np.int64), k)
    hints = rng.integers(1, 1 << 63, size=args.hints, dtype=np.uint64)
    hint_ops = np.array([[2, 1, len(hints)]], dtype=np.int64)
    gi.apply(names[0], "", hint_ops, hints)
    fill_s = time.perf_counter() - t0
    ops: dict[str, list[float]] = {"resync": [], "pool_clear": [], "leave": [], "join": []}
    with tempfile.TemporaryDirectory(prefix="bench-index-svc-") as tmp:
        work = Path(tmp)
        load = start_worker("events", {"instance": "load", "rate": args.event_rate, "keys": args.event_keys}, work)
        churn = start_worker("churn", {"instance": "churn", "pages": per}, work)
        try:
            srcs = {
                "load": SourceInfo.from_json(read_line(load, 60)),
                "churn": SourceInfo.from_json(read_line(churn, 60)),
            }
            with IndexService(gi, age_s=args.age_s) as svc:
                svc.set_sources(srcs)
                if not svc.wait_live(list(srcs), 60):
                    raise RuntimeError("the sources did not become live within 60 s")
                time.sleep(1.0)  # the SUB's subscriptions reach the PUBs (ZeroMQ's slow joiner)

                def row(iid: str) -> dict[str, Any]:
                    r: dict[str, Any] = svc.status()["instances"].get(iid, {})
                    return r

                svc._lag.clear()
                time.sleep(args.quiet_s)
                quiet = list(svc._lag)
                svc._lag.clear()
                t_churn = time.perf_counter()
                for _ in range(args.rounds):
                    r0 = row("churn")["resyncs"]
                    assert churn.stdin is not None
                    churn.stdin.write("gap\n")
                    churn.stdin.flush()
                    resynced = lambda r0=r0: row("churn").get("resyncs", 0) > r0 and row("churn")["live"]  # noqa: E731
                    ops["resync"].append(_wait(resynced))
                    time.sleep(args.pause_s)
                    c0 = gi.stats()["pool_clears"]
                    svc.pool_member_left()
                    cleared = lambda c0=c0: gi.stats()["pool_clears"] > c0 and gi.native.pool_count == 0  # noqa: E731
                    ops["pool_clear"].append(_wait(cleared))
                    gi.apply(names[0], "", hint_ops, hints)  # the hints back: ageing sweeps the table again
                    time.sleep(args.pause_s)
                    free = len(gi._free)
                    svc.set_sources({"load": srcs["load"]})  # until its sweep is done (its slot free again)
                    ops["leave"].append(_wait(lambda free=free: len(gi._free) > free))
                    time.sleep(args.pause_s)
                    svc.set_sources(srcs)
                    ops["join"].append(_wait(lambda: "churn" in gi.instances()))
                    time.sleep(args.pause_s)
                churn_s = time.perf_counter() - t_churn
                during = list(svc._lag)
                st = svc.status()
        finally:
            stop_worker(load)
            stop_worker(churn)
    lr = st["instances"]["load"]
    report = {
        "bench": "index_service",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "instances": args.instances,
        "pages": per,
        "entries": st["index"]["entries"],
        "fill_s": round(fill_s, 2),
        "event_rate": args.event_rate,
        "event_keys": args.event_keys,
        "quiet_event_lag_ms": _lag(quiet),
        "churn_event_lag_ms": _lag(during),
        "churn_event_lag_p99_ms": _lag(during).get("p99"),
        "churn_s": round(churn_s, 2),
        "op_wall_ms_median": {k: round(statistics.median(v) * 1e3, 1) for k, v in ops.items() if v},
        "op_wall_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in ops.items()},
        "load_events": lr.get("events"),
        "load_gaps": lr.get("gaps"),
        "load_resyncs": lr.get("resyncs"),
        "sweep_parts": st["index"]["sweep_parts"],
        "churn_event_lag_p99_ms<=50": None if not during else _lag(during)["p99"] <= 50.0,
        "note": args.note,
    }
    emit_report(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(guarded("python -m bench.index_service", main))
