"""TP-shared L2 vs per-rank L2 pools: effective capacity, D2H traffic, hit rate (MLA, TP = 1..8).

    PYTHONPATH=. python -m bench.tp_shared [--json] [--out FILE] [--tp 1,2,4,8] [--device cpu|cuda]

For each TP size, TP rank processes (spawned; with --device cuda they share the one GPU) run the
same request trace through their own cache controller, one variant after another:
  shared     one TP-shared cache (`TPShared` movers) per rank over ONE shared L2 pool of `--l2-pages` pages
             (l2core.shm; rank 0 copies D2H, every rank loads), digests compared across the
             ranks every `--check-every` requests (any difference fails the run);
  per_rank   one `TieredCache` per rank over its own pool, the same total host memory split over
             the ranks: `--l2-pages / TP` pages each (what a TP group of private pools gets);
  per_rank_x one `TieredCache` per rank over `--l2-pages` pages each: TP times the memory, the
             private pools' effective capacity equal to the shared pool's.
The trace: `--requests` requests, each a document prefix (`--docs` documents of `--doc-pages`
pages, Zipf-popular with exponent `--zipf`) plus `--suffix-pages` new pages, over an L1 of
`--l1-pages` pages (small: reuse goes through L2); write_through L1 -> L2, no L3.
Row fields: `effective_capacity_pages` (distinct pages the group can hold in L2), `d2h_bytes` /
`d2h_submissions` (device -> host bytes and copy jobs, all ranks together, per request),
`hit_rate` (L1 + L2 hit pages / pages requested, rank 0; every rank has the same by the SPMD
invariant, checked), `host_bytes_total` (host memory of the group's pools), `memory_factor`.
The per-rank variants wait for their backups after each request (`flush()`): the base
controller indexes a backup when its copy completes, so without the wait the ranks' hit rates
differ by timing (not SPMD; SGLang evens them out with an all-reduce MIN over the ranks).
`targets`: capacity x TP and D2H bytes / TP (against per_rank_x: the same effective capacity,
hence the same misses) within 2 %, and TP=8 shared's hit rate >= per_rank_x's (8x the memory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import uuid
from typing import Any

import numpy as np

from bench._pool_cli import add_report_args, emit_report
from bench._ranks import CTX, reported, run_ranks
from l3pool.cliutil import UserError

VARIANTS = ("shared", "per_rank", "per_rank_x")


def _trace(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(document, request seed) per request: the same on every rank."""
    rng = np.random.default_rng(args.seed)
    w = 1.0 / np.arange(1, args.docs + 1) ** args.zipf
    docs = rng.choice(args.docs, size=args.requests, p=w / w.sum())
    return [(int(d), 10_000 + i) for i, d in enumerate(docs)]


def _rank(args: argparse.Namespace, tp: int, rank: int, name: str, barrier: Any, q: Any) -> None:
    with reported(q, rank, on_error=barrier.abort):
        for v in VARIANTS:
            if tp == 1 and v == "per_rank_x":
                continue  # = per_rank at TP 1
            barrier.wait(120)
            q.put((rank, v, _variant(args, tp, rank, f"{name}-{v}", v)))


def _variant(args: argparse.Namespace, tp: int, rank: int, group: str, variant: str) -> dict[str, Any]:
    import torch

    from l2core import KVSpec
    from l2core.l1 import kv_buffers
    from l3pool.cache import L1, CacheConfig, build
    from l3pool.pool.keys import page_hashes

    dev = torch.device(args.device)
    torch.set_num_threads(1)  # TP processes share the host's cores: one copy thread each
    spec = KVSpec.mla(args.layers, page_size=args.page_size)
    P = spec.page_size
    shared = variant == "shared"
    l2_pages = args.l2_pages // tp if variant == "per_rank" else args.l2_pages
    tp_kw: dict[str, Any] = {"tp_shared": True, "tp_group": group, "tp_rank": rank, "tp_size": tp} if shared else {}
    cfg = CacheConfig(l1_to_l2="write_through", l2_to_l3="write_through", ghost_capacity=0, **tp_kw)
    bufs = kv_buffers(spec, args.l1_pages * P, dev)
    stack = build(L1(bufs, P), spec, l2_tokens=l2_pages * P, cache=cfg, pin="auto")
    cache = stack.cache
    eng: Any = cache._engine
    if shared:
        eng = eng.inner  # SharedTransferEngine -> the device-facing TransferEngine
    subs = [0, 0]
    submit = eng.submit_backup

    def counted(slots: Any, pages: Any) -> int:
        subs[0] += 1
        subs[1] += len(pages) * spec.page_bytes
        return submit(slots, pages)

    eng.submit_backup = counted  # type: ignore[method-assign]
    docs: dict[int, list[bytes]] = {}
    hit = total = 0
    t0 = time.perf_counter()
    try:
        for step, (d, seed) in enumerate(_trace(args)):
            if d not in docs:
                toks = np.random.default_rng(d).integers(0, 1 << 30, args.doc_pages * P)
                docs[d] = page_hashes(toks, P)
            toks = np.random.default_rng(seed).integers(0, 1 << 30, args.suffix_pages * P)
            hs = docs[d] + page_hashes(toks, P, parent=docs[d][-1])
            rid = f"r{step}"
            m = cache.match(rid, hs)
            h = cache.load(m, total_pages=len(hs))
            for i in range(args.layers):
                h.wait_layer(i)
            s = cache.slots(h.l1_pages[h.hit_pages :])
            for b in bufs:
                b[s] = float(step % 7)  # "compute" the rest
            cache.commit(rid, hs, h.l1_pages)
            cache.release(rid)
            if not shared:
                # the base controller indexes a backup when its copy completes: without this wait
                # the ranks' hit rates differ by timing (measured: 0.054 vs 0.060 at TP=8 on 2
                # busy cores); with it every backup is in L2 before the next request, which is
                # when the shared controller indexes it too (at submit), so the variants compare
                cache.flush()
            hit += h.hit_pages
            total += len(hs)
            if shared and args.check_every and (step + 1) % args.check_every == 0:
                cache.tp_check(step, timeout=60.0)  # type: ignore[attr-defined]
        cache.flush()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        st = cache.stats()
    finally:
        stack.close()
    return {
        "seconds": time.perf_counter() - t0,
        "hit_pages": hit,
        "pages": total,
        "l2_hit_pages": st["l2_hit_pages"] if "l2_hit_pages" in st else None,
        "l2_pages": l2_pages,
        "page_bytes": spec.page_bytes,
        "d2h_submissions": subs[0],
        "d2h_bytes": subs[1],
    }


def run_tp(args: argparse.Namespace, tp: int) -> dict[str, dict[int, dict[str, Any]]]:
    barrier = CTX.Barrier(tp)
    name = f"bench-{uuid.uuid4().hex[:8]}-tp{tp}"
    want = tp * (len(VARIANTS) - (1 if tp == 1 else 0))
    got: dict[str, dict[int, dict[str, Any]]] = {}
    for r, v, res in run_ranks(_rank, lambda r, q: (args, tp, r, name, barrier, q), tp, want, args.timeout, f"TP={tp}"):
        got.setdefault(v, {})[r] = res
    return got


def rows_of(tp: int, got: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for v, ranks in got.items():
        r0 = ranks[0]
        rates = {round(x["hit_pages"] / x["pages"], 9) for x in ranks.values()}
        if len(rates) != 1:
            raise UserError(f"TP={tp} {v}: ranks saw different hit rates {sorted(rates)} (not SPMD)")
        n = args.requests
        pools = 1 if v == "shared" else tp
        out.append({
            "tp": tp, "shared": v == "shared", "variant": v,
            "memory_factor": tp if v == "per_rank_x" else 1,
            "effective_capacity_pages": r0["l2_pages"],
            "host_bytes_total": pools * r0["l2_pages"] * r0["page_bytes"],
            "d2h_bytes": sum(x["d2h_bytes"] for x in ranks.values()) / n,
            "d2h_submissions": sum(x["d2h_submissions"] for x in ranks.values()) / n,
            "hit_rate": r0["hit_pages"] / r0["pages"],
            "seconds": max(x["seconds"] for x in ranks.values()),
        })  # fmt: skip
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["tp"], r["variant"]): r for r in rows}
    out: dict[str, Any] = {}
    for tp in sorted({r["tp"] for r in rows}):
        s, p = by.get((tp, "shared")), by.get((tp, "per_rank"))
        px = by.get((tp, "per_rank_x")) or (p if tp == 1 else None)
        if s is None or p is None or px is None:
            continue
        cap = s["effective_capacity_pages"] / p["effective_capacity_pages"]
        d2h = px["d2h_bytes"] / s["d2h_bytes"] if s["d2h_bytes"] else None
        subs = px["d2h_submissions"] / s["d2h_submissions"] if s["d2h_submissions"] else None
        out[str(tp)] = {
            "capacity_ratio": cap, "capacity_ok": abs(cap / tp - 1) <= 0.02,
            "d2h_bytes_ratio": d2h, "d2h_bytes_ok": d2h is not None and abs(d2h / tp - 1) <= 0.02,
            "d2h_submissions_ratio": subs,
            "hit_rate_shared": s["hit_rate"], "hit_rate_per_rank": p["hit_rate"], "hit_rate_per_rank_x": px["hit_rate"],
            "hit_rate_ok": s["hit_rate"] >= px["hit_rate"] - 1e-12,
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tp_shared", description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--tp", default="1,2,4,8", help="TP sizes, comma-separated")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the ranks' L1 lives")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--doc-pages", type=int, default=12)
    p.add_argument("--suffix-pages", type=int, default=2)
    p.add_argument("--zipf", type=float, default=0.8)
    p.add_argument("--l1-pages", type=int, default=32)
    p.add_argument("--l2-pages", type=int, default=256, help="host pages of the group in all (shared / per_rank)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--check-every", type=int, default=16, help="requests between cross-rank digest checks (0: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per TP size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        tps = [int(x) for x in args.tp.split(",") if x]
    except ValueError:
        p.error(f"--tp must be comma-separated integers, got {args.tp!r}")
    if not tps or any(t < 1 or t > 64 for t in tps):
        p.error("--tp sizes must be in [1, 64]")
    for k in ("requests", "docs", "doc_pages", "suffix_pages", "l1_pages", "layers", "page_size"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.check_every < 0 or args.timeout <= 0:
        p.error("--check-every must be >= 0 and --timeout > 0")
    if args.l1_pages < args.doc_pages + args.suffix_pages:
        p.error("--l1-pages must hold one request (--doc-pages + --suffix-pages)")
    if any(args.l2_pages // t < args.doc_pages + args.suffix_pages for t in tps):
        p.error("--l2-pages / TP must hold one request for every --tp")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no GPU")
    from l2core import load_native

    load_native()  # build once, before the ranks start (they load the cached build)
    rows: list[dict[str, Any]] = []
    for tp in tps:
        rows += rows_of(tp, run_tp(args, tp), args)
    report = {
        "benchmark": "bench.tp_shared",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "device": args.device,
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "out", "note")},
        "rows": rows,
        "targets": targets(rows),
    }
    summary = [
        f"tp={r['tp']} {r['variant']:<10} capacity {r['effective_capacity_pages']:>5} pages  "
        f"D2H {r['d2h_bytes'] / 1e6:7.3f} MB {r['d2h_submissions']:5.2f} jobs /req  hit {r['hit_rate']:.3f}  "
        f"({r['seconds']:.1f} s)"
        for r in rows
    ] + [f"targets TP={k}: {v}" for k, v in report["targets"].items()]
    emit_report(report, args, summary)
    return 0


if __name__ == "__main__":
    from l3pool.cliutil import guarded

    sys.exit(guarded("python -m bench.tp_shared", main))
