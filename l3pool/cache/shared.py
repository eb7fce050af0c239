"""`SharedTieredCache`: the tiered cache of one TP rank over a TP-shared L2 pool (l2core.shm).

For MLA models every TP rank holds the bit-identical latent KV, so the group keeps one L2 copy:
rank 0 copies D2H into the shared pool, every rank loads the same pages. `stack.build()` makes
this class when `CacheConfig.tp_shared` is set (with `tp_group`, `tp_rank`, `tp_size`).

**SPMD-deterministic bookkeeping (the invariant).** Each rank keeps its own L1/L2 allocators
and indexes; they stay identical because every decision depends only on the calls (same calls,
same arguments, same order on every rank: the TP ranks run one scheduler), never on timing:
- an L1 -> L2 backup is indexed in L2 when it is *submitted*, on every rank (the base class
  indexes it when the copy completes, which differs per rank); its L1 pages are not pinned for
  the copy (pins would make L1 evictability timing-dependent): rank 0 instead waits for its
  in-flight copies before an evicted L1 page is reused;
- the bytes' readiness is not bookkeeping: a load waits until rank 0 published the generation of
  every source page (`l2core.shm.SharedTransferEngine`), and fails rather than serve a page that
  changed under it.
`tp_check(step)` publishes a digest of both allocators, both indexes (keys, LRU order, hit
counts) and the page generations in the shared segment and raises `Divergence` when another
rank's digest for the same step differs. Call it at the same point of every step.

**Split reads (MLA, l2core.split_read).** Given a torch.distributed `process_group` of the TP
ranks (used by nothing else: its collectives run on the load thread), each rank copies only its
1/TP byte slice of every loaded page host -> device and an all-gather per layer completes the
pages on every rank; `wait_layer(i)` covers both. Small loads read whole pages
(`split_min_rank_bytes`, default `l2core.split_read.SPLIT_MIN_RANK_BYTES`). The loads are
already SPMD (same calls in the same order on every rank), which the collectives need.

Not supported yet (ConfigError `L3_REFUSED`): an L3 tier and PP stage locks. The prefetcher
allocates L2 pages on its own thread and `load()` keeps whatever prefix had arrived when it
interrupts the prefetch: both depend on timing, so the ranks' L2 allocators and indexes would
split; every rank would also get the same objects into the shared pages, and the L3 writer could
read a page before rank 0's copy completed. What it would take (what SGLang's HiCache does, see
l3pool.adapters.sglang_shared_pool): L2 pages for a prefetch allocated on the calling thread at
`prefetch()`, the same on every rank; rank 0 alone getting from L3 and publishing the number of
pages that arrived (the segment's generations); the other ranks' `load()` waiting for that
number instead of cutting the prefetch themselves — a cross-rank handshake this controller has
no channel for yet besides the segment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from l2core.allocator import PageAllocator
from l2core.pool import HostKVPool
from l2core.shm import Divergence, SharedHostMemory, SharedTransferEngine, state_digest
from l2core.spec import ConfigError
from l2core.split_read import SPLIT_MIN_RANK_BYTES, SplitRead
from l3pool.cache._internal import _EMPTY, _Backup
from l3pool.cache.config import CacheConfig
from l3pool.cache.controller import TieredCache
from l3pool.cache.index import TierIndex
from l3pool.cache.types import L1
from l3pool.pool.client import L3Client
from l3pool.pool.pplock import StageLocks

# One home for the refusal (stack.build refuses first, the class again when built by hand).
L3_REFUSED = (
    "tp_shared works with L1 + L2 only: with an L3 tier (or PP stage locks) each rank's prefetcher would "
    "allocate L2 pages and cut prefetches on its own thread, at times that differ per rank, and every rank "
    'would write the shared pages from L3 (l3pool/README.md, "TP-shared L2")'
)


class SharedTieredCache(TieredCache):
    _tp_shared = True

    def __init__(
        self, cfg: CacheConfig, l1: L1, l2: HostKVPool, l3: L3Client | None = None, locks: StageLocks | None = None,
        *, process_group: Any = None, split_min_rank_bytes: int = SPLIT_MIN_RANK_BYTES,
    ) -> None:  # fmt: skip
        if not isinstance(cfg, CacheConfig) or not cfg.tp_shared:
            raise ConfigError("SharedTieredCache needs a CacheConfig with tp_shared = true")
        mem = getattr(l2, "memory", None)
        if not isinstance(mem, SharedHostMemory):
            raise ConfigError("tp_shared needs an L2 pool over shared memory: L2Config(shared=TPGroup(...))")
        g = mem.group
        if (g.name, g.rank, g.size) != (cfg.tp_group, cfg.tp_rank, cfg.tp_size):
            raise ConfigError(
                f"the L2 pool belongs to TP group {g.name!r} rank {g.rank}/{g.size}, the cache config says "
                f"{cfg.tp_group!r} rank {cfg.tp_rank}/{cfg.tp_size}"
            )
        if l3 is not None or locks is not None:
            raise ConfigError(L3_REFUSED)
        split = None
        if process_group is not None:  # checked before the base class starts its threads
            split = SplitRead(process_group, tp_size=g.size, rank=g.rank, min_rank_bytes=split_min_rank_bytes)
        super().__init__(cfg, l1, l2, l3, locks)
        self._engine.close()  # the base engine copies on every rank: replaced by the shared one
        try:
            self._engine: SharedTransferEngine = SharedTransferEngine(  # type: ignore[assignment]
                l2, l1.bufs, ready_timeout_s=cfg.load_timeout_s, split=split
            )
        except BaseException:
            self.close()
            raise
        self.split = split
        self._loads.wait_layer = self._engine.wait_layer  # the handles' per-layer waits go to it too
        self.rank, self.tp_size = g.rank, g.size
        self.shared = mem

    # -- deterministic backups ---------------------------------------------------------------------
    def _backup(self, hs: list[bytes], l1p: np.ndarray, reason: str) -> None:
        todo = self._l2_targets(hs, l1p, "L1 -> L2 backup")
        if todo is None:
            return
        hk, pk, dst = todo
        hits = self.t1.hits[pk].copy()
        try:
            job = self._engine.submit_backup(self.slots(pk), dst)  # rank 0 copies; the rest complete at once
        except BaseException:
            self.l2.free(dst)
            raise
        self._backed_up(hk, dst, hits, reason)  # indexed now, on every rank alike
        if self.rank:
            self._stats.d2h_bytes -= len(hk) * self.page_bytes  # no bytes moved on this rank
        with self._bk_idle:
            self._bk_inflight += 1
        # the backup thread only collects the job (rank 0: publishes the pages' generations)
        self._backups.put(_Backup(job, [], _EMPTY, _EMPTY, reason, _EMPTY))

    def _write_back_l1(self, hs: list[bytes], victims: np.ndarray) -> None:
        before = self._stats.d2h_bytes
        super()._write_back_l1(hs, victims)  # indexes at once (the engine's job is synchronous)
        if self.rank:
            self._stats.d2h_bytes = before  # no bytes moved on this rank

    def _evict_l1(self, n: int) -> np.ndarray:
        victims = super()._evict_l1(n)
        if self.rank == 0 and self._engine.backups_in_flight():
            # their L1 pages were not pinned: the copies must be done before a victim is reused
            self._engine.drain_backups(self.cfg.load_timeout_s)
        return victims

    # -- the cross-rank check ------------------------------------------------------------------------
    def tp_digest(self) -> int:
        """64-bit digest of this rank's bookkeeping: allocators, indexes, page generations."""
        with self._mu:
            return state_digest(
                *_alloc_state(self.l2.allocator), *_index_state(self.t2),
                *_alloc_state(self._l1_alloc), *_index_state(self.t1), self._engine.want,
            )  # fmt: skip

    def tp_check(self, step: int, timeout: float = 0.0) -> list[int]:
        """Publish this rank's digest for `step` and compare it with the other ranks' (those that
        reached `step`; `timeout` > 0: wait that long for all). Raises Divergence (also recorded
        as a background error) when they differ. Returns the ranks compared."""
        try:
            return self.shared.check_step(step, self.tp_digest(), timeout)
        except Divergence as e:
            self._error(str(e))
            raise

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        e = self._engine
        d["tp_shared"] = {
            "group": self.shared.group.name, "rank": self.rank, "size": self.tp_size,
            "d2h_submissions": e.submissions, "d2h_bytes": e.d2h_bytes, "skipped_backups": e.skipped_backups,
            "split_loads": self.split.split_jobs if self.split else 0,
            "whole_loads": self.split.whole_jobs if self.split else None,
            "split_h2d_bytes": self.split.h2d_bytes if self.split else 0,
        }  # fmt: skip
        return d


def _alloc_state(a: PageAllocator) -> tuple[np.ndarray, np.ndarray]:
    with a.holding_free():
        return a._stack[: a.free_pages].copy(), a._used.copy()


def _index_state(t: TierIndex) -> tuple[np.ndarray, bytes, np.ndarray, np.ndarray]:
    pages = np.flatnonzero(t.cached).astype(np.int64)
    keys = b"".join(t.keys_of(pages)) if pages.size else b""
    return pages, keys, t.lru(), t.hits.copy()
