"""TP rank processes for test_cache_shared.py: one TP-shared cache (TPShared movers) per rank over one shared L2
pool, the same request trace on every rank (spawned, as TP ranks are separate processes)."""

from __future__ import annotations

from typing import Any

from l2core.shm import Divergence
from l3pool.cache import CacheConfig

from ..cache_helpers import Engine, chain

STEPS = 16


def main(
    name: str, rank: int, size: int, q: Any, diverge: tuple[int, int] | None, every: int = 1, split: str | None = None
) -> None:
    """`split`: a file-store path: the ranks join a gloo group there and load by split reads."""
    try:
        _run(name, rank, size, q, diverge, every, split)
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def _group(store: str, rank: int, size: int) -> Any:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=20)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size, timeout=timeout)
    return dist.new_group(list(range(size)), backend="gloo", timeout=timeout)


def _run(
    name: str, rank: int, size: int, q: Any, diverge: tuple[int, int] | None, every: int, split: str | None
) -> None:
    cfg = CacheConfig(tp_shared=True, tp_group=name, tp_rank=rank, tp_size=size, load_timeout_s=30.0)
    kw: dict[str, Any] = {}
    if split is not None:  # every load split, however small (the default threshold would read whole pages)
        kw = {"tp_process_group": _group(split, rank, size), "tp_split_min_rank_bytes": 0}
    eng = Engine(cfg, l1_pages=16, l2_pages=48, **kw)
    # L2 poison is per-process test scaffolding: on a shared pool a rank would poison pages another
    # rank (ahead or behind in time) still uses, so it is off here; L1 is per rank and stays poisoned
    eng.poison_free_l2 = lambda: None  # type: ignore[method-assign]
    prefixes = [chain(s, 5) for s in range(4)]
    hits, steps = 0, []
    try:
        for step in range(STEPS):
            hs = chain(100 + step, 3, prefixes[step % 4])  # a shared prefix, evicted from L1 in between
            m = eng.run(f"r{step}", hs)  # asserts the hit pages' bytes
            hits += m.l2
            if diverge is not None and (rank, step) == diverge:
                eng.run("extra", chain(999, 4))  # this rank alone: its allocator decides differently
            if (step + 1) % every:
                continue  # free-running: a rank > 0 may be ahead of rank 0 and wait for its copies
            try:
                eng.cache.tp_check(step, timeout=30.0)
                steps.append("ok")
            except Divergence as e:
                steps.append(str(e))
                break
        if steps[-1] == "ok":
            eng.cache.flush()
        st = eng.cache.stats()
        q.put((rank, "result", (steps, hits, st["tp_shared"], st["d2h_bytes"], st["l2_pages"]["cached"])))
    finally:
        try:
            eng.close()
        except Exception:
            pass
