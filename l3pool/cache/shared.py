"""`TPShared`: the movers of one TP rank's cache over a TP-shared L2 pool (l2core.shm).

For MLA models every TP rank holds the bit-identical latent KV, so the group keeps one L2 copy:
rank 0 copies D2H into the shared pool, every rank loads the same pages. `build()` makes the cache
with these movers when `CacheConfig.tp_shared` is set (with `tp_group`, `tp_rank`, `tp_size`).
Every rank keeps its own books (allocators, indexes), identical because every decision depends on
the calls alone (same calls, same order on every rank), never on timing: a backup is booked in L2
when it is *submitted*, on every rank, and its L1 pages are not pinned for the copy (rank 0 instead
waits for its copies in flight before an evicted L1 page is reused); a load waits until rank 0
published the generation of every source page (`SharedTransferEngine`). `cache.tp_check(step)`
compares a digest of every rank's books (and the page generations) and raises `Divergence`.
With `process_group` (torch.distributed, the TP ranks, used by nothing else) loads are MLA split
reads (l2core.split_read): each rank copies 1/TP of every page, an all-gather per layer completes
them. With L3 (l3pool.cache.shared_l3): rank 0 alone talks to the pool and publishes what it saw.
PP stage locks are refused (`PP_REFUSED`, l3pool/cache/config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from l2core.shm import Divergence, SharedHostMemory, SharedTransferEngine, state_digest
from l2core.spec import ConfigError
from l2core.split_read import SPLIT_MIN_RANK_BYTES, SplitRead
from l3pool.cache.config import PP_REFUSED, CacheConfig
from l3pool.cache.movers import BackupPlan, Backups, Hooks, Movers, engine_over
from l3pool.cache.shared_l3 import TPFetch, TPWrites
from l3pool.cache.types import L1
from l3pool.pool.protocols import HostPages, L3Pages

_EMPTY = np.empty(0, dtype=np.int64)


class TPBackups(Backups):
    """Booked at submit on every rank alike, no pins; rank 0 copies, the backup thread collects."""

    def __init__(self, engine: SharedTransferEngine, hooks: Hooks, rank: int, timeout_s: float) -> None:
        super().__init__(engine, hooks)
        self.shared_engine, self.copies, self.timeout_s = engine, rank == 0, timeout_s

    def submit(self, plan: BackupPlan) -> None:
        try:
            job = self.engine.submit_backup(self.hooks.slots(plan.l1), plan.l2)  # the others complete at once
        except BaseException:
            self.hooks.free_l2(plan.l2)
            raise
        self.hooks.backup_done(plan, True, None)  # booked now, on every rank alike
        self._track(job, BackupPlan([], _EMPTY, _EMPTY, plan.reason, _EMPTY))  # rank 0: publishes generations

    def _done(self, plan: BackupPlan, ok: bool, err: str | None) -> None:
        if not ok:
            self.hooks.error(f"L1 -> L2 backup failed: {err}")

    def before_reuse(self) -> None:
        if self.copies and self.shared_engine.backups_in_flight():  # their L1 pages were not pinned
            self.shared_engine.drain_backups(self.timeout_s)


class TPSharedMovers(Movers):
    rank = 0
    size = 1
    shared: SharedHostMemory
    split: SplitRead | None = None

    def stats(self) -> dict[str, Any]:
        e, s = self.engine, self.split
        fetch, out = self.l3_in, self.l3_out
        return {"tp_shared": {
            "group": self.shared.group.name, "rank": self.rank, "size": self.size,
            "d2h_submissions": e.submissions, "d2h_bytes": e.d2h_bytes, "skipped_backups": e.skipped_backups,
            "split_loads": s.split_jobs if s else 0, "whole_loads": s.whole_jobs if s else None,
            "split_h2d_bytes": s.h2d_bytes if s else 0,
            "fetch_quarantined": fetch.fetcher.quarantined if isinstance(fetch, TPFetch) else 0,
            "rewrite_waits": out.reading.waits if isinstance(out, TPWrites) else 0,
        }}  # fmt: skip

    def tp_digest(self, books: tuple[Any, ...]) -> int:
        return state_digest(*books, self.engine.want)

    def tp_check(self, step: int, digest: Callable[[], int], timeout: float, error: Callable[[str], None]) -> list[int]:
        try:
            return self.shared.check_step(step, digest(), timeout)
        except Divergence as e:
            error(str(e))  # also a background error
            raise


class TPShared:
    """The MoverFactory of a TP-shared cache (`TieredCache(..., movers=TPShared(...))`; build() does it)."""

    def __init__(self, process_group: Any = None, split_min_rank_bytes: int = SPLIT_MIN_RANK_BYTES) -> None:
        self.process_group, self.split_min_rank_bytes = process_group, split_min_rank_bytes

    def __call__(self, cfg: CacheConfig, l1: L1, l2: HostPages, l3: L3Pages | None, hooks: Hooks) -> Movers:
        if not cfg.tp_shared:
            raise ConfigError("the TP-shared movers need a CacheConfig with tp_shared = true")
        mem = getattr(l2, "memory", None)
        if not isinstance(mem, SharedHostMemory):
            raise ConfigError("tp_shared needs an L2 pool over shared memory: L2Config(shared=TPGroup(...))")
        g = mem.group
        if (g.name, g.rank, g.size) != (cfg.tp_group, cfg.tp_rank, cfg.tp_size):
            raise ConfigError(
                f"the L2 pool belongs to TP group {g.name!r} rank {g.rank}/{g.size}, the cache config says "
                f"{cfg.tp_group!r} rank {cfg.tp_rank}/{cfg.tp_size}"
            )
        split = None
        if self.process_group is not None:
            split = SplitRead(self.process_group, tp_size=g.size, rank=g.rank, min_rank_bytes=self.split_min_rank_bytes)
        t = cfg.load_timeout_s
        engine = engine_over(l2, l1, SharedTransferEngine, ready_timeout_s=t, split=split)
        m = TPSharedMovers(engine, TPBackups(engine, hooks, g.rank, t))
        m.rank, m.size, m.shared, m.split = g.rank, g.size, mem, split
        try:
            if l3 is not None:
                m.l3_in = TPFetch(cfg, l3, engine, mem.segment, g.rank, hooks)
                if g.rank == 0:  # the only rank that writes to L3
                    m.l3_out = TPWrites(cfg, l3, hooks, m.backups.busy, engine, l2.num_pages)
        except BaseException:
            m.close()
            raise
        return m


__all__ = ["PP_REFUSED", "Divergence", "TPBackups", "TPShared", "TPSharedMovers"]
