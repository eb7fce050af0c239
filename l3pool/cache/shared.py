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

**With an L3 tier** (l3pool.cache.shared_l3): rank 0 alone calls L3. Its lookups and the number
of pages each prefetch got are published in the segment's handshake table, and the other ranks'
`match()` / `load()` wait for them (bounded by `load_timeout_s`, at once when rank 0 died) instead
of deciding by their own timing; a prefetch's L2 pages are allocated on the caller's thread at
`prefetch()` (or `load()`), the same on every rank, and the pages after the published prefix are
freed there too. Only rank 0 writes L2 -> L3, without pins, each put after rank 0's D2H copy of
its pages completed; a page is rewritten only once no put reads it. A prefetch interrupted at
`load()` waits for its batch in flight (the pages are every rank's; none can be quarantined on
rank 0 alone), so an interrupt costs up to one batch's get.

Not supported (ConfigError `PP_REFUSED`): PP stage locks. Each stage's rank 0 would take or join
the etcd lock and every rank would need its length: a second handshake per request, not built.
"""

from __future__ import annotations

import collections
import time
from typing import Any, cast

import numpy as np

from l2core.allocator import PageAllocator
from l2core.pool import HostKVPool
from l2core.shm import Divergence, SharedHostMemory, SharedTransferEngine, state_digest
from l2core.spec import ConfigError
from l2core.split_read import SPLIT_MIN_RANK_BYTES, SplitRead
from l3pool.cache._internal import _EMPTY, _Backup, _Req, _timed
from l3pool.cache.config import CacheConfig
from l3pool.cache.controller import TieredCache
from l3pool.cache.index import TierIndex
from l3pool.cache.shared_l3 import Handshake, Reading, ReadyPuts, SharedFetch, SharedFetcher, TPWriter
from l3pool.cache.types import L1, LoadHandle, Match
from l3pool.pool.client import L3Client
from l3pool.pool.pplock import StageLocks
from l3pool.pool.protocols import L3Pages, Outcome

_BASE_LOAD = TieredCache.load.__wrapped__  # type: ignore[attr-defined]  # the shared load() times itself

# One home for the refusal (stack.build refuses first, the class again when built by hand).
PP_REFUSED = (
    "tp_shared does not take PP stage locks yet: every TP rank would need the lock's length from its stage's "
    'rank 0, a handshake not built (l3pool/README.md, "TP-shared L2")'
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
        if locks is not None:
            raise ConfigError(PP_REFUSED)
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
        self._seqs: dict[str, int] = {}  # request -> its L3 lookup's handshake row (until its fetch starts)
        self._l3_seq = 0
        self._done_puts: collections.deque[tuple[Any, ...]] = collections.deque()
        self.fetcher: SharedFetcher | None = None
        if l3 is not None:
            self._with_l3(cfg, l3, mem)

    def _with_l3(self, cfg: CacheConfig, l3: L3Client, mem: SharedHostMemory) -> None:
        """Swap the base's prefetcher and writer for the TP-shared ones (l3pool.cache.shared_l3)."""
        assert self.prefetcher is not None and self.writer is not None
        self.prefetcher.close()
        self.prefetcher = None
        self.writer.close()
        self.writer = None
        t = cfg.load_timeout_s
        self.hand = Handshake(mem.segment, self.rank)
        self.fetcher = SharedFetcher(
            l3, self._engine, self.hand, self._free_l2, rank=self.rank, batch_pages=cfg.prefetch_batch_pages,
            max_batch_pages=cfg.prefetch_max_batch_pages, max_inflight=2, timeout_s=t,
        )  # fmt: skip
        if self.rank == 0:  # the only rank that writes to L3
            self.reading = Reading(self.l2.num_pages, t)
            self._engine.before_write = self.reading.wait_unread
            self.writer = TPWriter(
                self.reading, cast(L3Pages, ReadyPuts(l3, self._engine, t)), self._written, cfg.writer_batch_pages,
                cfg.writer_linger_ms, lambda: self._bk_inflight > 0, parallel=cfg.writer_parallel,
            )  # fmt: skip

    # -- L3: lookups and prefetches through rank 0 ----------------------------------------------------
    def _l3_lookup(self, r: _Req) -> int:
        seq = self._l3_seq
        self._l3_seq += 1
        if self.rank == 0:
            n = super()._l3_lookup(r)
            self.hand.publish_lookup(seq, n)
        else:
            n = self.hand.wait(seq, 1, self.cfg.load_timeout_s, f"the L3 lookup of {r.rid!r}")
        if n:
            self._seqs[r.rid] = seq
        return n

    def _free_l2(self, pages: np.ndarray) -> None:
        if len(pages):
            with self._mu:
                self.l2.free(pages)

    def _start_fetch(self, r: _Req, wait_all: bool) -> None:
        """Every rank, on the caller's thread: L2 pages for the L3 hit (the same everywhere), then
        rank 0 starts the gets."""
        assert self.l3 is not None and self.fetcher is not None
        keys = self.l3.ns.keys(r.hashes[r.n2 : r.n3])
        with self._mu:
            pages = self._alloc_prefetch(len(keys))
            h = self.fetcher.start(r.rid, self._seqs.pop(r.rid), keys, pages, wait_all)
        r.prefetch = h  # type: ignore[assignment]  # PrefetchHandle's surface (interrupt, wait, cancel)

    @_timed("prefetch")
    def prefetch(self, m: Match) -> bool:
        self._check_open()
        r = self._req(m.request_id)
        if self.fetcher is None or r.n3 <= r.n2 or r.prefetch is not None or r.n_hit >= 0:
            return False
        self._start_fetch(r, wait_all=False)
        return True

    @_timed("load")
    def load(self, m: Match, total_pages: int | None = None) -> LoadHandle:
        """Every rank agrees on the L3 prefix first (rank 0 ends its prefetch by the policy and
        publishes its length; the others wait for it), then the base load uses it."""
        self._check_open()
        r = self._req(m.request_id)
        waited = 0.0
        if self.fetcher is not None and r.n_hit < 0 and r.n3 > r.n2:
            if r.prefetch is None:
                self._start_fetch(r, wait_all=True)
            h = cast(SharedFetch, r.prefetch)
            if not h.delivered:
                t0 = time.perf_counter()
                try:
                    self.fetcher.finish(h, self.cfg.prefetch_policy, self.cfg.prefetch_timeout_s)
                finally:
                    waited = time.perf_counter() - t0
                    self._add_wait("l3", waited)
        lh: LoadHandle = _BASE_LOAD(self, m, total_pages)
        lh.l3_wait_s += waited  # the base waited for a result that was already there
        return lh

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        super().release(request_id)

    # -- L3: rank 0's writes ---------------------------------------------------------------------
    def _put_now(self, hs: list[bytes], pages: np.ndarray, reason: str) -> None:
        if self.rank:
            return  # rank 0 writes
        if not self._engine.wait_ready(pages, self.cfg.load_timeout_s):
            self._error(f"write-back of {len(hs)} L2 pages to L3 skipped: rank 0's D2H copy did not complete")
            return
        super()._put_now(hs, pages, reason)

    def _written(
        self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None, s: float
    ) -> None:
        """The writer thread: the pages are free to be rewritten now; the bookkeeping of the put is
        applied under the lock when it is free (a caller holding it may wait for these pages)."""
        self.reading.done(pages)
        self._done_puts.append((hs, pages, res, err, s))
        self._apply_puts(block=False)

    def _apply_puts(self, block: bool = True) -> None:
        if not self._mu.acquire(blocking=block):
            return
        try:
            while self._done_puts:
                hs, pages, res, err, s = self._done_puts.popleft()
                self._written_locked(hs, pages, res, err, s, None, unpin=False)
                moved = self.t2.pages_of(hs) != pages  # evicted since (maybe holding another page now)
                if moved.any():
                    self._in_l3[pages[moved]] = False
        finally:
            self._mu.release()

    def _write_l3(self, hs: list[bytes], pages: np.ndarray, reason: str) -> None:
        self._apply_puts()  # what is in L3 already, up to date
        super()._write_l3(hs, pages, reason)

    def raise_errors(self) -> None:
        if self.writer is not None:
            self._apply_puts()
        super().raise_errors()

    def close(self) -> None:
        try:
            super().close()
        finally:
            fetcher = getattr(self, "fetcher", None)  # absent when __init__ failed before it
            if fetcher is not None:
                fetcher.close()

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
        if self.writer is not None:
            self._apply_puts()
        d = super().stats()
        e = self._engine
        d["tp_shared"] = {
            "group": self.shared.group.name, "rank": self.rank, "size": self.tp_size,
            "d2h_submissions": e.submissions, "d2h_bytes": e.d2h_bytes, "skipped_backups": e.skipped_backups,
            "split_loads": self.split.split_jobs if self.split else 0,
            "whole_loads": self.split.whole_jobs if self.split else None,
            "split_h2d_bytes": self.split.h2d_bytes if self.split else 0,
            "fetch_quarantined": self.fetcher.quarantined if self.fetcher else 0,
            "rewrite_waits": self.reading.waits if self.writer is not None else 0,
        }  # fmt: skip
        return d


def _alloc_state(a: PageAllocator) -> tuple[np.ndarray, np.ndarray]:
    with a.holding_free():
        return a._stack[: a.free_pages].copy(), a._used.copy()


def _index_state(t: TierIndex) -> tuple[np.ndarray, bytes, np.ndarray, np.ndarray]:
    pages = np.flatnonzero(t.cached).astype(np.int64)
    keys = b"".join(t.keys_of(pages)) if pages.size else b""
    return pages, keys, t.lru(), t.hits.copy()
