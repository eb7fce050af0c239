"""Eviction policies on the demo's workload: hit rates of the tiered cache under each policy.

    PYTHONPATH=. python -m bench.eviction [--json] [--out FILE] [--policies lru,lfu] [--l1-pages N] [--l2-pages N]

The demo's agentic multi-turn trace (l3pool.demo.workload: `--sessions` sessions of up to `--turns`
turns, each turn the whole conversation so far plus new tokens, sessions interleaved turn by turn)
is replayed, request by request, through one TieredCache per policy (CacheConfig.eviction) with an
L1 of `--l1-pages` and an L2 of `--l2-pages` pages of `--page-size` tokens (no L3; write_through
L1 -> L2): match, load, commit, release, no compute (a tiny MLA spec: the bytes do not matter
here). `hit_rate`: hit pages / requested pages, per tier and in all; `bound`: what a cache that
never evicts would hit (each request's leading run of pages an earlier request had). Both tiers
use the same policy. CPU only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from typing import Any

from bench._pool_cli import add_report_args, emit_report
from l2core import KVSpec
from l2core.l1 import kv_buffers
from l3pool.cache import L1, CacheConfig, build
from l3pool.cache.policy import EVICTION_POLICIES
from l3pool.cliutil import guarded
from l3pool.demo import WorkloadConfig, generate
from l3pool.pool.keys import page_hashes


def bound(reqs: list[Any], page_size: int) -> float:
    """Hit pages / requested pages of a cache that never evicts: each request's leading run of
    pages some earlier request had."""
    seen: set[bytes] = set()
    hit = asked = 0
    for r in reqs:
        hs = page_hashes(r.tokens, page_size)
        n = next((i for i, h in enumerate(hs) if h not in seen), len(hs))
        hit, asked = hit + n, asked + len(hs)
        seen.update(hs)
    return hit / asked if asked else 0.0


def replay(policy: str, reqs: list[Any], page_size: int, l1_pages: int, l2_pages: int) -> dict[str, Any]:
    spec = KVSpec.mla(2, page_size=page_size, kv_lora_rank=28, rope_dim=4)
    bufs = kv_buffers(spec, l1_pages * page_size, "cpu")
    cfg = CacheConfig(eviction=policy, l1_to_l2="write_through")  # type: ignore[arg-type]
    stack = build(L1(bufs, page_size), spec, l2_tokens=l2_pages * page_size, pin="never", cache=cfg)
    c = stack.cache
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            hs = page_hashes(r.tokens, page_size)
            rid = f"r{i}"
            h = c.load(c.match(rid, hs), total_pages=len(hs))
            h.wait()
            c.commit(rid, hs, h.l1_pages)
            c.release(rid)
            c.flush()  # the backups land before the next request (a replay, not a race)
        st = c.stats()
    finally:
        stack.close()
    asked = sum(st["hit_pages"].values()) + st["miss_pages"]
    return {
        "hit_rate": round(sum(st["hit_pages"].values()) / asked, 4),
        "hit_rate_by_tier": {t: round(n / asked, 4) for t, n in st["hit_pages"].items() if t != "l3"},
        "evictions": st["evictions"],
        "requested_pages": asked,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--policies", default=",".join(EVICTION_POLICIES), help="comma-separated (default: all)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--min-context", type=int, default=2048)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--l1-pages", type=int, default=512)
    p.add_argument("--l2-pages", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in EVICTION_POLICIES]
    if bad or not policies:
        p.error(f"--policies: {bad or 'none'} not among {sorted(EVICTION_POLICIES)}")
    for name in ("sessions", "turns", "page_size", "l1_pages", "l2_pages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    wl = WorkloadConfig(sessions=args.sessions, turns=args.turns, min_context=args.min_context,
                        max_context=args.max_context, seed=args.seed)  # fmt: skip
    reqs = generate(wl)
    longest = max(r.length for r in reqs) // args.page_size
    if longest > args.l1_pages:
        p.error(f"--l1-pages must hold the longest request ({longest} pages)")
    report: dict[str, Any] = {
        "benchmark": "bench.eviction",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "requests": len(reqs),
        "l1_pages": args.l1_pages,
        "l2_pages": args.l2_pages,
        "page_size": args.page_size,
        "bound": round(bound(reqs, args.page_size), 4),
        "policies": {pol: replay(pol, reqs, args.page_size, args.l1_pages, args.l2_pages) for pol in policies},
    }
    summary = [f"{'bound (no eviction)':26s} {report['bound']}"]
    summary += [f"{pol:26s} hit_rate {r['hit_rate']} {r['hit_rate_by_tier']}" for pol, r in report["policies"].items()]
    emit_report(report, args, summary)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("python -m bench.eviction", main))
