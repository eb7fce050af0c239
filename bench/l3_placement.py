"""What Mooncake's placement options (ReplicateConfig fields) do to put speed, on L3Client's objects.

    PYTHONPATH=. python -m bench.l3_placement [--json] [--out FILE] [--pages 32] [--rounds 15]

Each round puts the same L2 pages (MLA, 78 layers, page_first_direct: 5.75 MB) once per variant
under fresh keys, as L3Client stores them (two fragments per object: the page and a 32-byte
trailer row, one `batch_put_from_multi_buffers` call), the variants' order rotating per round; the
round's objects are removed before the next, so every round allocates the same memory. Variants:
the binding's default (what L3Client passes), an explicit default ReplicateConfig, one preferred
segment, all agents as preferred segments, `prefer_alloc_in_same_node`, two replicas, hard pin,
`group_ids` (one group id per object, as SGLang passes with `enable_group_semantics`), the page
alone (one fragment, no trailer: what the trailer costs; SGLang's MLA object) and the page with
its trailer as ONE contiguous fragment (page + 32 bytes from a buffer whose page stride has room
for the trailer: what a trailer inside the L2 page stride would give). `vs_default` is the default's time /
the variant's paired per round (> 1: faster), median with min/max. A variant whose puts did not all
succeed says so (`outcomes`). Uses the running local cluster, else starts one (2 agents).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter
from typing import Any

import torch

from bench._pool_cli import add_pool_args, add_report_args, emit_report, loadavg_1m
from bench.l3 import fill
from l2core import HostKVPool, KVSpec, L2Config
from l3pool.cliutil import guarded
from l3pool.cluster.running import pool_endpoints
from l3pool.measure import spread
from l3pool.pool.store import MooncakeStore, Outcome, Placement
from l3pool.pool.trailer import TRAILER_BYTES


def _segments(admin: str | None) -> list[str]:
    """The donors' segment names from the master's /get_all_segments ([] without its admin URL)."""
    if not admin:
        return []
    with urllib.request.urlopen(f"{admin}/get_all_segments", timeout=5) as r:
        return [ln.strip() for ln in r.read().decode().split() if ":" in ln]


def variants(agents: list[str]) -> dict[str, Placement]:
    v: dict[str, Placement] = {"default": None, "explicit_default": {}}
    if agents:
        v["preferred_segment"] = {"preferred_segment": agents[0]}
        v["preferred_segments"] = {"preferred_segments": agents}
    return v | {
        "prefer_alloc_in_same_node": {"prefer_alloc_in_same_node": True},
        "replica_num_2": {"replica_num": 2},
        "with_hard_pin": {"with_hard_pin": True},
    }


def run(store: MooncakeStore, agents: list[str], args: argparse.Namespace) -> dict[str, Any]:
    spec, n = KVSpec.mla(78), args.pages
    pool = HostKVPool(L2Config(kv=spec, layout="page_first_direct", tokens=(n + 1) * spec.page_size, pin="never"))
    fill(pool, 7)
    store.register(pool.buffer.data_ptr(), pool.buffer.numel())
    pages = pool.alloc(n + 1)
    addrs, sizes = pool.page_runs(pages[:n])
    trailer_base = int(pool.page_runs(pages[n:])[0][0, 0])  # one spare page holds the trailer rows
    frags = [[int(a), trailer_base + TRAILER_BYTES * i] for i, a in enumerate(addrs[:, 0])]
    lens = [[int(s), TRAILER_BYTES] for s in sizes[:, 0]]
    # the same pages in a buffer whose stride leaves room for the trailer: one fragment per object
    stride = spec.page_bytes + TRAILER_BYTES
    strided = torch.empty(n * stride, dtype=torch.uint8)
    strided.view(n, stride)[:, : spec.page_bytes].copy_(pool.read_pages(pages[:n]))
    store.register(strided.data_ptr(), strided.numel())
    s_addrs = [strided.data_ptr() + i * stride for i in range(n)]
    plan = variants(agents)
    names = [*plan, "group_ids", "page_only", "one_fragment_with_trailer"]
    t: dict[str, list[float]] = {k: [] for k in names}
    outcomes: dict[str, Counter[str]] = {k: Counter() for k in names}
    prefix = f"placement-{uuid.uuid4().hex[:10]}/"
    try:
        for rnd in range(args.rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                keys = [f"{prefix}{name}/{uuid.uuid4().hex}" for _ in range(n)]
                t0 = time.perf_counter()
                if name == "page_only":
                    res = store.put(keys, addrs[:, 0].tolist(), sizes[:, 0].tolist())
                elif name == "one_fragment_with_trailer":
                    res = store.put(keys, s_addrs, [stride] * n)
                elif name == "group_ids":
                    res = store.put_multi(keys, frags, lens, replicate={"group_ids": [f"g:{k}" for k in keys]})
                else:
                    res = store.put_multi(keys, frags, lens, replicate=plan[name])
                t[name].append(time.perf_counter() - t0)
                outcomes[name].update(r.value for r in res)
            store.remove_prefix(prefix, force=True)
    finally:
        store.remove_prefix(prefix, force=True)
        store.unregister(pool.buffer.data_ptr())
        store.unregister(strided.data_ptr())
        pool.close()
    gb = n * spec.page_bytes / 1e9
    rows = []
    for name in names:
        vs = [d / x for d, x in zip(t["default"], t[name], strict=True)]
        rows.append({
            "variant": name,
            "replicate": plan.get(name),
            "put_GBps": round(gb / statistics.median(t[name]), 3),
            "vs_default": round(statistics.median(vs), 4),
            "vs_default_spread": spread(vs, 4),
            "outcomes": dict(outcomes[name]),
            "all_ok": set(outcomes[name]) == {Outcome.OK.value},
        })  # fmt: skip
    return {"pages": n, "page_bytes": spec.page_bytes, "rounds": args.rounds, "segments": agents, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.l3_placement", description=__doc__.splitlines()[0])
    add_report_args(p)
    add_pool_args(p, segment_size="2GB")
    p.add_argument("--pages", type=int, default=32, help="pages per put")
    p.add_argument("--rounds", type=int, default=15, help="rounds (each variant once per round)")
    args = p.parse_args(argv)
    for name in ("pages", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    load_start = loadavg_1m()
    with pool_endpoints(args.master, args.metadata, args.host, segment_size=args.segment_size,
                        state_dir=args.state_dir) as ep:  # fmt: skip
        store = ep.store()
        try:
            result = run(store, _segments(ep.admin), args)
        finally:
            store.close()
    report = {
        "benchmark": "bench.l3_placement",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "loadavg_1m": {"start": load_start, "end": loadavg_1m()},
        "pool": ep.mode,
        **result,
    }
    summary = [
        f"{r['variant']:26s} put {r['put_GBps']:6.3f} GB/s  vs default x{r['vs_default']:.3f} "
        f"[{r['vs_default_spread']['min']:.2f}-{r['vs_default_spread']['max']:.2f}]  all_ok={r['all_ok']}"
        + ("" if r["all_ok"] else f" {r['outcomes']}")
        for r in result["rows"]
    ]
    emit_report(report, args, summary)
    return 0


if __name__ == "__main__":
    sys.exit(guarded("python -m bench.l3_placement", main))
