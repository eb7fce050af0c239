"""TP rank processes for test_cache_shared_l3.py: one TP-shared cache (TPShared movers) with an L3 tier per rank over
one shared L2 pool and a real mooncake_master (each rank a pure Mooncake client), the same requests
on every rank. Every L3 call a rank makes is counted."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from l3pool.cache import CacheConfig
from l3pool.pool.store import MooncakeStore, StoreConfig

from ..cache_helpers import Engine, chain

WRITTEN = chain(1, 12)  # what the write phase (or the parent) puts into L3
QUERY = chain(3, 3, prefix=WRITTEN[:10])  # 10 of its pages hit L3, 3 more are computed


def main(scenario: str, name: str, rank: int, size: int, q: Any, rpc: str, meta: str, tenant: str, sig: str) -> None:
    """`sig`: a file rank 0 writes its pid to when its get started (rank0_dies). Not the queue: a
    process killed while its queue feeder holds the queue's lock would leave the lock held."""
    try:
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # the test is the application: stay on loopback
        store = MooncakeStore(StoreConfig(master=rpc, metadata=meta))
        try:
            out = SCENARIOS[scenario](name, rank, sig, store, tenant, size)
            q.put((rank, "result", out))
        finally:
            store.close()
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def _engine(
    group: str, rank: int, size: int, store: MooncakeStore, tenant: str, l2_pages: int = 48, **cfg: Any
) -> tuple[Engine, Counter]:
    cfg.setdefault("load_timeout_s", 30.0)
    c = CacheConfig(tp_shared=True, tp_group=group, tp_rank=rank, tp_size=size, writer_linger_ms=20, **cfg)
    eng = Engine(c, l1_pages=16, l2_pages=l2_pages, store=store, tenant=tenant)
    eng.poison_free_l2 = lambda: None  # type: ignore[method-assign]  # the pool is shared (shared_ranks.py)
    # every rank attached before any goes on (a rank 0 far ahead could otherwise finish, and the
    # group's segment go, before a slow rank even opened it); also the digests of the empty caches
    seen = eng.cache.tp_check(15, timeout=120.0)
    assert len(seen) == size, f"only ranks {seen} attached within 120 s"
    calls: Counter = Counter()
    l3 = eng.l3
    assert l3 is not None
    for op in ("lookup", "get", "put"):
        real = getattr(l3, op)

        def counted(*a: Any, _real: Any = real, _op: str = op) -> Any:
            calls[_op] += 1
            return _real(*a)

        setattr(l3, op, counted)
    return eng, calls


def _write_then_read(name: str, rank: int, sig: str, store: MooncakeStore, tenant: str, size: int) -> dict[str, Any]:
    """Group 1 computes WRITTEN (rank 0 writes it to L3); a fresh group 2 loads QUERY from L3 by
    wait_complete, then again from L1; then group 3 loads it by a prefetch interrupted by the
    timeout policy while rank 0's gets are slow (2 pages per 0.25 s)."""
    out: dict[str, Any] = {}
    eng, calls = _engine(f"{name}-w", rank, size, store, tenant)
    try:
        eng.run("w", WRITTEN)
        eng.cache.flush()
        eng.cache.tp_check(0, timeout=30.0)
        out["w"] = (dict(calls), eng.cache.stats()["l2_to_l3_writes"])
    finally:
        eng.close()
    eng, calls = _engine(f"{name}-r", rank, size, store, tenant, prefetch_policy="wait_complete")
    try:
        m = eng.run("r", QUERY)  # asserts every hit page's bytes
        eng.cache.tp_check(1, timeout=30.0)
        m2 = eng.run("r2", QUERY)
        eng.cache.tp_check(2, timeout=30.0)
        out["r"] = ((m.l1, m.l2, m.l3), (m2.l1, m2.l2, m2.l3), dict(calls), eng.cache.tp_digest(), eng.used())
    finally:
        eng.close()
    eng, calls = _engine(
        f"{name}-i", rank, size, store, tenant, prefetch_policy="timeout", prefetch_timeout_s=0.4,
        prefetch_batch_pages=2, prefetch_max_batch_pages=2,
    )  # fmt: skip
    try:
        if rank == 0:
            slow = eng.l3.get  # type: ignore[union-attr]
            eng.l3.get = lambda k, p: (time.sleep(0.25), slow(k, p))[1]  # type: ignore[method-assign,union-attr]
        m = eng.cache.match("i", QUERY)
        eng.cache.prefetch(m)
        h = eng.cache.load(m, total_pages=len(QUERY))
        for i in range(3):
            h.wait_layer(i)
        hit = h.hit_pages
        from ..cache_helpers import contents

        assert bool((eng.l1_of(h.l1_pages[:hit]) == contents(QUERY[:hit])).all()), "wrong bytes after the interrupt"
        eng.compute(QUERY[hit:], h.l1_pages[hit:])
        eng.cache.commit("i", QUERY, h.l1_pages)
        eng.cache.release("i")
        eng.cache.tp_check(3, timeout=30.0)
        st = eng.cache.stats()
        out["i"] = (
            m.l3,
            hit,
            h.l3,
            dict(calls),
            eng.cache.tp_digest(),
            eng.used(),
            st["prefetch_interrupted"],
            h.l3_wait_s,
        )
    finally:
        eng.close()
    return out


def _rank0_dies(name: str, rank: int, sig: str, store: MooncakeStore, tenant: str, size: int) -> tuple[str, float]:
    """Rank 0's get never returns (it tells the parent, which kills it); the others' load() must
    fail with a clear error soon after."""
    eng, _ = _engine(f"{name}-k", rank, size, store, tenant, load_timeout_s=20.0)
    try:
        if rank == 0:

            def hang(k: Any, p: Any) -> Any:
                Path(sig + ".tmp").write_text(str(os.getpid()))
                os.replace(sig + ".tmp", sig)
                time.sleep(120)

            eng.l3.get = hang  # type: ignore[method-assign,union-attr]
        m = eng.cache.match("k", QUERY)
        assert m.l3 == 10, m
        eng.cache.prefetch(m)
        try:
            eng.cache.load(m)
        except Exception as e:
            return f"{type(e).__name__}: {e}", time.time()
        return "load() returned", time.time()
    finally:
        eng.close()


def _slow_puts(name: str, rank: int, sig: str, store: MooncakeStore, tenant: str, size: int) -> list[Any]:
    """Rank 0's puts are slow (0.3 s each) and L2 holds 16 pages: 4 requests of 8 new pages each
    evict L2 pages still queued for the writer, which rank 0 must not rewrite before their put
    read them. A fresh group then loads every chain from L3 (bytes checked by Engine.run)."""
    chains = [chain(40 + i, 8) for i in range(4)]
    eng, _ = _engine(f"{name}-w", rank, size, store, tenant, l2_pages=16)
    try:
        if rank == 0:
            put = eng.l3.put  # type: ignore[union-attr]
            eng.l3.put = lambda k, p: (time.sleep(0.3), put(k, p))[1]  # type: ignore[method-assign,union-attr]
        for i, hs in enumerate(chains):
            eng.run(f"w{i}", hs)
            eng.cache.tp_check(i, timeout=30.0)
        eng.cache.flush()
        st = eng.cache.stats()
        writes = (st["l2_to_l3_writes"], st["backup_skips"], st["l3_put_failed"], st["l1_to_l2_writes"], st["errors"])
        waits = st["tp_shared"]["rewrite_waits"]
    finally:
        eng.close()
    eng, calls = _engine(f"{name}-r", rank, size, store, tenant, prefetch_policy="wait_complete")
    try:
        hits = [eng.run(f"r{i}", hs).l3 for i, hs in enumerate(chains)]  # asserts the bytes
        eng.cache.tp_check(0, timeout=30.0)
        return [writes, hits, dict(calls), eng.cache.tp_digest(), waits]
    finally:
        eng.close()


SCENARIOS = {"write_then_read": _write_then_read, "rank0_dies": _rank0_dies, "slow_puts": _slow_puts}
