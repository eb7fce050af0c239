"""`TieredCache`: the per-instance controller over L1 (device), L2 (host pool) and L3 (pool).

See the package docstring (l3pool/cache/__init__.py) for the lifecycle. Locking: one re-entrant lock (`_mu`) guards
the indexes, reference counts and request table; blocking waits (prefetch, load/backup jobs, L3 puts of the writer)
happen outside it, except the synchronous write-back on eviction, which is the cost that policy pays by definition.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from l2core.allocator import OutOfPages, PageAllocator
from l2core.spec import ConfigError
from l2core.transfer import TransferEngine, TransferError
from l2core.units import check_int
from l3pool import metrics
from l3pool.cache._internal import _Backup, _emit, _join, _Loads, _member, _Req, _select, _timed, check_parts
from l3pool.cache.config import CacheConfig
from l3pool.cache.index import GhostList, TierIndex, split
from l3pool.cache.policy import WaitComplete, prefetch_policy, write_policy
from l3pool.cache.tier_events import EventBatch, EventQueue
from l3pool.cache.types import (
    L1,
    BackgroundError,
    CacheError,
    CacheFull,
    CacheStats,
    LoadHandle,
    Match,
    PPShortLoad,
    UnknownRequest,
)
from l3pool.cache.writer import L3Writer
from l3pool.pool.keys import HASH_BYTES
from l3pool.pool.prefetch import Prefetcher, PrefetchResult
from l3pool.pool.protocols import HostPages, L3Pages, Outcome, StageLockService

log = logging.getLogger(__name__)
_EMPTY = np.empty(0, dtype=np.int64)
_WAIT_COMPLETE = WaitComplete()


class TieredCache:
    _tp_shared = False

    def __init__(
        self,
        cfg: CacheConfig,
        l1: L1,
        l2: HostPages,
        l3: L3Pages | None = None,
        locks: StageLockService | None = None,
    ) -> None:
        check_parts(cfg, l1, l2, l3, locks, self._tp_shared)
        try:
            self._engine = TransferEngine(l2, l1.bufs)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"L1 buffers do not match the L2 pool's KV spec: {e}") from None
        self.cfg, self.l1buf, self.l2, self.l3, self.locks = cfg, l1, l2, l3, locks
        self.pp = locks is not None and locks.stages > 1
        self.page_size = l1.page_size
        self.page_bytes = l2.layout.page_bytes
        self._l1_alloc = PageAllocator(l1.num_pages)
        self.t1 = TierIndex("L1", self._l1_alloc)
        self.t2 = TierIndex("L2", l2.allocator)  # the pool's one allocator (Prefetcher allocates there too)
        self._l1_owner = np.full(l1.num_pages, -1, dtype=np.int64)
        self._in_l3 = np.zeros(l2.num_pages, dtype=np.bool_)  # L2 page known present in L3
        self._to_l3: dict[bytes, str] = {}  # hashes queued for the writer -> why
        self._pending_l2: set[bytes] = set()  # hashes being backed up L1 -> L2
        # the policies (l3pool/cache/policy.py): which pages move, and when; the cache moves them
        self.down = write_policy(cfg.l1_to_l2, cfg.hit_threshold)  # L1 -> L2
        self.out = write_policy(cfg.l2_to_l3, cfg.hit_threshold)  # L2 -> L3
        self.fetch = prefetch_policy(cfg.prefetch_policy, cfg.prefetch_timeout_s)
        # only a policy that reads the ghost list keeps it (~35 us per 256 evictions at 64K entries)
        self.ghost = GhostList(cfg.ghost_capacity if self.down.ghost else 0)
        self._stats = CacheStats()
        self._errors: list[str] = []
        self._reqs: dict[str, _Req] = {}
        self._serial = 0
        self._mu = threading.Condition(threading.RLock())  # wait() releases every level
        self._api_mu = threading.Lock()  # stats()["api_s"] (_timed)
        self._arange = torch.arange(self.page_size)
        self._closed = False
        self._backups: queue.Queue[_Backup | None] = queue.Queue()
        self._bk_idle = threading.Condition()
        self._bk_inflight = 0
        self.prefetcher: Prefetcher | None = None
        self.writer: L3Writer | None = None
        if l3 is not None:
            self.prefetcher = Prefetcher(
                l3, batch_pages=cfg.prefetch_batch_pages, max_batch_pages=cfg.prefetch_max_batch_pages,
                alloc=self._alloc_prefetch,
            )  # fmt: skip
            self.writer = L3Writer(
                l3,
                self._written,
                cfg.writer_batch_pages,
                cfg.writer_linger_ms,
                lambda: self._bk_inflight > 0,
                parallel=cfg.writer_parallel,
            )
        self._loads = _Loads(
            self.page_bytes, l2.spec.num_layers, self.slots, self._engine.wait_layer, self._load_ok, self._add_wait
        )
        self._events = EventQueue()  # tier changes, pulled by a reader (take_events; cache/tier_events.py)
        self._reaper = threading.Thread(target=self._reap, name="l3pool-cache-backup", daemon=True)
        self._reaper.start()
        metrics.watch_cache(self)  # its l3pool_cache_* series, derived from stats() at each scrape

    # -- small helpers ----------------------------------------------------------------------------
    def slots(self, l1_pages: np.ndarray) -> torch.Tensor:
        """Token slots of L1 pages (what the engine's attention indexes)."""
        p = torch.from_numpy(np.ascontiguousarray(l1_pages, dtype=np.int64))
        return (p[:, None] * self.page_size + self._arange[None, :]).reshape(-1)

    def _req(self, rid: str) -> _Req:
        r = self._reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request id {rid!r}: match() it first (or it was released)")
        return r

    def _error(self, what: str) -> None:
        with self._mu:
            self._errors.append(what)
            self._stats.errors += 1

    def _add_wait(self, tier: str, s: float) -> None:
        with self._mu:
            self._stats.waited(tier, s)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("the cache is closed")

    # -- match ------------------------------------------------------------------------------------
    @_timed("match")
    def match(self, request_id: str, page_hashes: Sequence[bytes], max_hit: int | None = None) -> Match:
        """Hit pages per tier for `page_hashes` (prefix order) without moving bytes; pins the
        L1/L2 pages matched until release(). `max_hit` caps the hit (e.g. leave the last token
        to compute). With PP, stage 0 locks the hit for all stages, others join that lock."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        hs = page_hashes if isinstance(page_hashes, list) else list(page_hashes)
        buf = _join(hs)  # checked: 16-byte hashes, no repeats
        limit = len(hs) if max_hit is None else max(0, min(int(max_hit), len(hs)))
        with self._mu:
            if request_id in self._reqs:
                raise CacheError(f"request {request_id!r} is already active: release() it first")
            self._serial += 1
            r = _Req(request_id, self._serial, hs, buf, limit)
            # the L1 prefix, then its continuation in L2: one native probe-and-pin call per tier
            r.l1_hit = p1 = self.t1.pin_prefix(buf, 0, limit)
            r.n1 = len(p1)
            r.l2_hit = self.t2.pin_prefix(buf, r.n1, limit)
            r.n2 = r.n1 + len(r.l2_hit)
            self._reqs[request_id] = r
        n3 = r.n2
        try:
            if self.pp:
                n3 = self._pp_length(r)
            elif self.l3 is not None and limit > r.n2:
                n3 = r.n2 + self._l3_lookup(r)
        except BaseException:
            self.release(request_id)
            raise
        with self._mu:
            if n3 < r.n2:  # PP: the lock is shorter than what this stage holds locally
                self._truncate(r, n3)
            r.n3 = n3
            self._count_hits(r, r.n2, r.l1_hit if r.n2 == r.n1 else None)  # no L2 hits: L1's are known
            self._policy_on_use(r)
            return Match(request_id, len(hs), r.n1, r.n2 - r.n1, r.n3 - r.n2)

    def _l3_lookup(self, r: _Req) -> int:
        """Pages of hashes[n2:limit] present in L3 (a prefix); a failed lookup is a miss."""
        try:
            return self.l3.lookup(self.l3.ns.keys(r.hashes[r.n2 : r.limit]))  # type: ignore[union-attr]
        except Exception as e:
            log.warning("L3 lookup for %s failed (treated as a miss): %s", r.rid, e)
            with self._mu:
                self._stats.l3_read_failures += 1
            return 0

    def _pp_length(self, r: _Req) -> int:
        assert self.locks is not None
        if self.locks.stage == 0:
            n = self.locks.acquire(r.rid, r.hashes[: r.limit]).length
        else:
            n = self.locks.join(r.rid, self.cfg.pp_join_timeout_s, r.hashes[: r.limit])
        r.pp_held = True
        return n

    def shorten(self, request_id: str, n: int) -> Match:
        """Cut a matched request's hit to its first `n` pages (unpinning the rest) before prefetch and
        load: a hybrid model resumes only at a saved window checkpoint (l3pool.cache.hybrid)."""
        with self._mu:
            r = self._req(request_id)
            if r.n_hit >= 0 or r.prefetch is not None:
                raise CacheError(f"request {request_id!r}: shorten() must come before prefetch() and load()")
            self._truncate(r, n := max(0, min(int(n), r.n3)))
            r.n3, r.limit = n, min(r.limit, n)
            return Match(request_id, len(r.hashes), r.n1, r.n2 - r.n1, r.n3 - r.n2)

    def _truncate(self, r: _Req, n: int) -> None:
        k1 = min(r.n1, n)
        self.t1.unpin(r.l1_hit[k1:])
        r.l1_hit = r.l1_hit[:k1]
        k2 = min(r.n2, n) - k1
        self.t2.unpin(r.l2_hit[k2:])
        r.l2_hit = r.l2_hit[:k2]
        r.n1, r.n2 = k1, k1 + k2

    def _count_hits(self, r: _Req, upto: int, l1: np.ndarray | None = None) -> None:
        """Hit counts of hashes[counted:upto] in every tier holding them: once per request.
        `l1`: the L1 pages of hashes[counted:upto] if the caller has them (no probes)."""
        if upto <= r.counted:
            return
        lo, hi = r.counted, min(upto, len(r.hashes))
        if l1 is None:
            self.t1.count_hits(r.buf, lo, hi)  # hit count + 1 and used now, per page present
        else:
            self.t1.hit_pages(l1)
        self.t2.count_hits(r.buf, lo, hi)
        r.counted = upto

    def _policy_on_use(self, r: _Req) -> None:
        """The request's hit pages the policies move on now (selective: those whose distinct-request
        count reached the threshold)."""
        if self.down.reads_use and len(r.l1_hit):
            hot = r.l1_hit[self.down.on_use(self.t1.hits[r.l1_hit])]
            if hot.size:
                self._backup(self.t1.keys_of(hot), hot, "selective")
        if self.out.reads_use and self.writer is not None:
            p2 = self.t2.lookup(r.buf, 0, r.n2)
            p2 = p2[p2 >= 0]
            p2 = p2[~self._in_l3[p2]]
            hot = p2[self.out.on_use(self.t2.hits[p2])]
            if hot.size:
                self._write_l3(self.t2.keys_of(hot), hot, "selective")

    # -- prefetch / load --------------------------------------------------------------------------
    @_timed("prefetch")
    def prefetch(self, m: Match) -> bool:
        """Start moving the L3 hit into L2 in the background (the request is queued). False when
        there is nothing to fetch, no L3, a prefetch already started, or the request was loaded."""
        self._check_open()
        r = self._req(m.request_id)
        if self.prefetcher is None or self.l3 is None or r.n3 <= r.n2 or r.prefetch is not None or r.n_hit >= 0:
            return False
        r.prefetch = self.prefetcher.submit(r.rid, self.l3.ns.keys(r.hashes[r.n2 : r.n3]))
        return True

    def _alloc_prefetch(self, n: int) -> np.ndarray:
        """The Prefetcher's L2 pages for a batch, LRU pages evicted for them under the lock (room made
        before submit() was not reserved: others took it, and under PP that was a PPShortLoad with
        evictable pages left); fewer than `n` only when the rest of L2 is pinned."""
        with self._mu:
            self._make_room_l2(n)
            k = min(n, self.l2.allocator.free_pages)
            try:
                return self.l2.alloc(k) if k else _EMPTY
            except OutOfPages:  # another user of the pool outside the cache
                return _EMPTY

    def _finish_prefetch(self, r: _Req, started_now: bool) -> PrefetchResult | None:
        """The prefetch's result by the prefetch policy. A prefetch load() itself started, and every
        prefetch under PP (all stages must get the locked length), is waited for."""
        h = r.prefetch
        t0 = time.perf_counter()
        try:
            pol = _WAIT_COMPLETE if started_now or self.pp else self.fetch
            res = pol.finish(h) if h is not None else None
        finally:
            r.l3_wait_s = time.perf_counter() - t0
            self._add_wait("l3", r.l3_wait_s)
        return res

    @_timed("load")
    def load(self, m: Match, total_pages: int | None = None) -> LoadHandle:
        """Stop the prefetch (policy), then allocate L1 pages for the hit and submit L2 -> L1 per
        layer on the load thread. `total_pages`: the request's L1 pages in all (hit + computed
        suffix, known only now since an interrupted prefetch may shorten the hit); the handle's
        `l1_pages` then holds that many (default: the hit only; alloc_l1() adds more)."""
        self._check_open()
        r = self._req(m.request_id)
        if r.n_hit >= 0:
            raise CacheError(f"request {r.rid!r} was already loaded")
        if total_pages is not None:
            check_int("total_pages", total_pages, 0, ValueError)
        fetched, why = _EMPTY, "lost despite the lock"
        if r.n3 > r.n2:
            res: PrefetchResult | None = None
            try:
                started_now = r.prefetch is None
                if started_now and self.prefetcher is not None and self.l3 is not None:
                    r.prefetch = self.prefetcher.submit(r.rid, self.l3.ns.keys(r.hashes[r.n2 : r.n3]))
                res = self._finish_prefetch(r, started_now)
            except Exception as e:  # a failed L3 read is a miss
                log.warning("L3 fetch for %s failed (treated as a miss): %s", r.rid, e)
                with self._mu:
                    self._stats.l3_read_failures += 1
            if res is not None:
                fetched = res.pages
                with self._mu:
                    self._stats.moved("l3", len(fetched) * self.page_bytes, res.elapsed_s)
                    self._stats.prefetch_interrupted += int(res.interrupted)
                if res.error is not None or res.stopped_by not in (None, Outcome.MISS.value):
                    with self._mu:
                        self._stats.l3_read_failures += 1
                why = res.error or (f"stopped by {res.stopped_by}" if res.stopped_by else why)
        with self._mu:
            k = len(fetched)
            if k:
                used = self.t2.insert(r.buf, fetched, r.n2)
                _emit(self._events, "l2", True, r.buf[r.n2 * HASH_BYTES : (r.n2 + k) * HASH_BYTES])
                dup = fetched[used != fetched]
                if dup.size:
                    self.l2.free(dup)
                self.t2.pin(used)
                self._in_l3[used] = True
                r.l2_fetched = used
            r.n_hit = r.n2 + k
            short = self.pp and r.n_hit < r.n3
            if short:
                self._stats.pp_short += 1
        if r.pp_held:
            self._pp_report(r)
        if short:  # the stages would disagree on the prefix length: the engine must not go on
            raise PPShortLoad(
                f"PP stage {self.locks.stage if self.locks else 0}: request {r.rid!r} got {r.n_hit} of the "
                f"{r.n3} locked pages from L3 ({why}); release it and retry"
            )
        with self._mu:
            nload = r.n_hit - r.n1
            extra = 0 if total_pages is None else max(0, total_pages - r.n_hit)
            new = self._alloc_l1(r, nload + extra)
            job = None
            if nload:
                src = np.concatenate([r.l2_hit, r.l2_fetched])
                job = self._engine.submit_load(self.slots(new[:nload]), src)
                r.load_job = job
            hits = {"l1": r.n1, "l2": r.n2 - r.n1, "l3": k}
            self._stats.count_request(hits, len(r.hashes), self.page_bytes, self.page_size)
            h = LoadHandle(self._loads, r.rid, np.concatenate([r.l1_hit, new]), r.n_hit, job)
            h.l1, h.l2, h.l3 = r.n1, r.n2 - r.n1, k
            h.l3_wait_s = r.l3_wait_s
            return h

    def _pp_report(self, r: _Req) -> None:
        assert self.locks is not None
        r.pp_held = False
        try:
            self.locks.report_done(r.rid)
        except Exception as e:
            self._error(f"PP report_done({r.rid}) failed: {e}")

    @_timed("alloc_l1")
    def alloc_l1(self, request_id: str, n: int) -> np.ndarray:
        """`n` more L1 pages owned by the request (freed at release unless committed)."""
        self._check_open()
        check_int("n", n, 0, ValueError)
        with self._mu:
            return self._alloc_l1(self._req(request_id), n)

    def _alloc_l1(self, r: _Req, n: int) -> np.ndarray:
        if n == 0:
            return _EMPTY
        t1 = self.t1.native
        short = n - self._l1_alloc.free_pages
        if short > t1.evictable and self._bk_inflight:
            # pages pinned by backups in flight come free when the backup thread is done with them
            deadline = time.monotonic() + self.cfg.load_timeout_s
            while short > t1.evictable and self._bk_inflight and time.monotonic() < deadline:
                self._mu.wait(0.05)
                short = n - self._l1_alloc.free_pages
        victims = _EMPTY
        if short > 0:
            if short > t1.evictable:
                raise CacheFull(
                    f"L1 full: need {n} pages, {self._l1_alloc.free_pages} free and {t1.evictable} evictable "
                    f"of {self._l1_alloc.num_pages} (the rest are pinned by in-flight requests)"
                )
            victims = self._evict_l1(short)
        try:
            # = free(victims) + alloc(n): the allocator hands out the pages freed last first, in
            # order; the victims skip the round trip through its stack
            pages = self._l1_alloc.alloc(n - len(victims))
        except OutOfPages as e:
            self._l1_alloc.free(victims)
            raise CacheFull(f"L1 full: {e}") from None
        if victims.size:
            pages = np.concatenate([victims, pages])
        self._l1_owner[pages] = r.serial
        r.l1_owned.append(pages)
        return pages

    def _evict_l1(self, n: int) -> np.ndarray:
        """Evict `n` L1 pages (LRU); returns them still allocated (the caller reuses or frees them)."""
        # one native call: the LRU victims out of the index, their hashes into the ghost list
        victims, keys = self.t1.native.evict(n, self.ghost.native if self.ghost.capacity else None)
        _emit(self._events, "l1", False, keys)
        self._stats.evictions["l1"] += len(victims)
        if self.down.evict_copies:
            try:
                self._write_back_l1(split(keys), victims)
            except BaseException:
                self._l1_alloc.free(victims)
                raise
        return victims

    def _write_back_l1(self, hs: list[bytes], victims: np.ndarray) -> None:
        """write_back: an evicted L1 page not in L2 is copied down before its page is reused."""
        todo = self._l2_targets(hs, victims, "write-back of evicted L1 pages")
        if todo is None:
            return
        hk, vk, dst = todo
        jid = self._engine.submit_backup(self.slots(vk), dst)
        res = self._engine.wait([jid])[0]
        if not res.ok:
            self.l2.free(dst)
            self._error(f"L1 -> L2 write-back failed: {res.error}")
            return
        self._backed_up(hk, dst, np.zeros(len(hk), np.int32), "back")

    def _l2_targets(
        self, hs: list[bytes], l1p: np.ndarray, what: str
    ) -> tuple[list[bytes], np.ndarray, np.ndarray] | None:
        """Of L1 pages `l1p` (hashes `hs`), those neither in L2 nor on their way there, with L2
        pages allocated for them: (hashes, L1 pages, L2 pages); None when there are none or L2 is
        full of pinned pages (counted in `backup_skips` by cause: `l3_slow` when the pages that
        wait for the L3 writer, pinned until their put returns, hold the room they needed)."""
        keep = (self.t2.pages_of(hs) < 0) & ~_member(self._pending_l2, hs)
        if not keep.any():
            return None
        sel = np.flatnonzero(keep)
        hk, pk = [hs[i] for i in sel.tolist()], l1p[sel]
        try:
            return hk, pk, self._alloc_l2(len(hk))
        except CacheFull as e:
            queued = len(self._to_l3)
            cause = "l3_slow" if self.l2.allocator.free_pages + queued >= len(hk) else "l2_pinned"
            log.warning("%s: %d pages skipped (%s): %s; %d L2 pages wait for the L3 writer", what, len(hk), cause, e,
                        queued)  # fmt: skip
            self._stats.backup_skips[cause] += len(hk)
            return None

    def _alloc_l2(self, n: int) -> np.ndarray:
        self._make_room_l2(n)
        try:
            return self.l2.alloc(n)
        except OutOfPages as e:
            raise CacheFull(f"L2 full: {e} ({self.t2.evictable} evictable)") from None

    def _make_room_l2(self, n: int) -> None:
        short = n - self.l2.allocator.free_pages
        if short <= 0:
            return
        victims, hs = self.t2.victims(short)
        if not victims.size:
            return
        _emit(self._events, "l2", False, hs)
        self._stats.evictions["l2"] += len(victims)
        try:
            if self.out.evict_copies and self.l3 is not None:
                keep = ~self._in_l3[victims]
                if keep.any():
                    sel = np.flatnonzero(keep)
                    self._put_now([hs[i] for i in sel.tolist()], victims[sel], "back")
        finally:
            self._in_l3[victims] = False
            self.l2.free(victims)

    def _put_now(self, hs: list[bytes], pages: np.ndarray, reason: str) -> None:
        assert self.l3 is not None
        t0 = time.perf_counter()
        try:
            res: list[Outcome] | None = self.l3.put(self.l3.ns.keys(hs), pages)
            err = None
        except Exception as e:
            res, err = None, e
        self._written_locked(hs, pages, res, err, time.perf_counter() - t0, reason, unpin=False)

    # -- commit / backup / writer -----------------------------------------------------------------
    @_timed("commit")
    def commit(self, request_id: str, page_hashes: Sequence[bytes], l1_pages: np.ndarray | Sequence[int]) -> int:
        """Insert the request's full pages (`page_hashes[i]` held by `l1_pages[i]`) into L1 and let the write
        policies decide what moves down. May be called again with a longer prefix (PD: once unfinished, once
        finished); hit counts still count the request once. Returns the number of L1 pages newly indexed."""
        self._check_open()
        r = self._req(request_id)
        if r.n_hit < 0:
            raise CacheError(f"request {request_id!r}: call load() before commit()")
        hs = page_hashes if isinstance(page_hashes, list) else list(page_hashes)
        p = np.asarray(l1_pages)
        if p.size and p.dtype.kind not in "iu":
            raise TypeError(f"l1_pages must be integers, got {p.dtype}")
        p = p.astype(np.int64, copy=False).reshape(-1)
        m = len(hs)
        if len(p) < m:
            raise ValueError(f"{m} page hashes but only {len(p)} L1 pages")
        known = min(m, len(r.hashes))
        # the list match() got, or one C pass (identical objects compare by identity)
        same = hs is r.hashes or hs[:known] == r.hashes[:known]
        if (not same or known < r.n_hit) and hs[: r.n_hit] != r.hashes[: r.n_hit]:
            raise ValueError(f"page_hashes of {request_id!r} disagree with the {r.n_hit} pages it matched")
        if m < r.n_hit:
            raise ValueError(f"commit of {m} pages is shorter than the {r.n_hit} pages {request_id!r} hit")
        if same and m == known:  # match() checked r.hashes already
            buf = r.buf if m == len(r.hashes) else r.buf[: m * HASH_BYTES]
        else:
            buf = _join(hs)
        self._collect_load(r)
        if r.load_ok is False:
            raise TransferError(f"the L2 -> L1 load of {request_id!r} failed: its pages were not inserted")
        with self._mu:
            pages, n1 = p[:m], r.n1
            if len(r.l1_hit) != n1 or not (pages[:n1] == r.l1_hit).all():
                raise ValueError(f"l1_pages[:{n1}] must be the L1 hit pages load() returned")
            rest = pages[n1:]
            own = r.l1_owned[0] if len(r.l1_owned) == 1 else _EMPTY
            if rest.size and rest.size <= own.size and (rest == own[: rest.size]).all():
                pass  # the pages load() allocated, in order: in range, this request's, distinct
            elif rest.size and (rest.min() < 0 or rest.max() >= len(self._l1_owner)):
                raise IndexError(f"L1 page ids out of range [0, {len(self._l1_owner)})")
            elif (self._l1_owner[rest] != r.serial).any():
                bad = rest[self._l1_owner[rest] != r.serial][:8].tolist()
                raise ValueError(f"L1 pages {bad} were not allocated to request {request_id!r}")
            elif rest.size > 1 and not (np.diff(np.sort(rest)) != 0).all():
                raise ValueError("the same L1 page appears twice in l1_pages")
            was = self.t1.cached[rest]
            if was.any():
                idx = np.flatnonzero(was)
                if self.t1.keys_of(rest[idx]) != [hs[n1 + i] for i in idx.tolist()]:
                    raise ValueError("an L1 page committed before is committed again under another hash")
            used, newly = self.t1.insert_pinned(buf, rest, n1)
            r.l1_inserted.append(newly)
            _emit(self._events, "l1", True, newly, self.t1)
            # used[i]: the L1 page of hs[n1 + i], = r.hashes[n1 + i] when `same`; counted >= n1
            fresh = used[r.counted - n1 :] if same and m == known and r.counted >= n1 else None
            self._count_hits(r, m, fresh)
            self._policy_on_commit(r, hs, buf, np.concatenate([r.l1_hit, used]))
            return int(newly.size)

    def _collect_load(self, r: _Req) -> None:
        """The outcome of the request's L2 -> L1 load (waited for), its bytes and seconds counted."""
        if r.load_job is None or r.load_ok is not None:
            return
        try:
            res = self._engine.wait([r.load_job], timeout=self.cfg.load_timeout_s)[0]
        except KeyError:
            r.load_ok = False
            return
        with self._mu:
            r.load_ok = res.ok
            self._stats.moved("l2", res.nbytes, res.seconds)

    def _load_ok(self, rid: str, job: int) -> bool:
        with self._mu:
            r = self._req(rid)
        self._collect_load(r)
        return bool(r.load_ok)

    def _policy_on_commit(self, r: _Req, hs: list[bytes], buf: bytes, pages: np.ndarray) -> None:
        """The committed pages (hits, then computed) the L1 -> L2 policy moves on now."""
        pol = self.down
        hot = pol.on_insert(self.t1.hits[pages])
        if not pol.ghost:
            if hot.any():
                self._backup(*_select(hs, pages, hot), pol.reason)
            return
        start, thr = r.n_hit, pol.hit_threshold
        g = self.ghost.native.leading_of(buf, start, HASH_BYTES) if self.ghost.capacity else 0
        if g:  # rebuilt pages evicted from L1 before: proven reuse
            self._stats.ghost_hits += g
            gp = pages[start : start + g]
            self.t1.hits[gp] = np.maximum(self.t1.hits[gp], thr)
            hot[start : start + g] = False
            self._backup(hs[start : start + g], gp, "ghost")
        if hot.any():
            sel = np.flatnonzero(hot)
            self._backup([hs[i] for i in sel.tolist()], pages[sel], "selective")

    def _backup(self, hs: list[bytes], l1p: np.ndarray, reason: str) -> None:
        """L1 -> L2 of indexed L1 pages not in (or on their way to) L2, on the backup thread."""
        todo = self._l2_targets(hs, l1p, "L1 -> L2 backup")
        if todo is None:
            return
        hk, pk, dst = todo
        pend = self._pending_l2
        self.t1.pin(pk)
        pend.update(hk)
        try:
            job = self._engine.submit_backup(self.slots(pk), dst)
        except BaseException:
            self.t1.unpin(pk)
            pend.difference_update(hk)
            self.l2.free(dst)
            raise
        hits = self.t1.hits[pk].copy()
        with self._bk_idle:
            self._bk_inflight += 1
        self._backups.put(_Backup(job, hk, pk, dst, reason, hits))

    def _reap(self) -> None:
        """Backup thread's completions: index the L2 copies, unpin L1, hand on to the writer."""
        while True:
            b = self._backups.get()
            if b is None:
                return
            try:
                res = self._engine.wait([b.job])[0]
                ok, err = res.ok, res.error
            except Exception as e:
                ok, err = False, f"{type(e).__name__}: {e}"
            try:
                with self._mu:
                    self.t1.unpin(b.l1)
                    self._pending_l2.difference_update(b.hashes)
                    if ok:
                        self._backed_up(b.hashes, b.l2, b.hits, b.reason)
                    else:
                        self.l2.free(b.l2)
                        self._error(f"L1 -> L2 backup of {len(b.hashes)} pages failed: {err}")
                    self._mu.notify_all()
            except Exception as e:
                log.exception("backup completion failed")
                self._error(f"backup completion failed: {e}")
            with self._bk_idle:
                self._bk_inflight -= 1
                self._bk_idle.notify_all()

    def _backed_up(self, hs: list[bytes], dst: np.ndarray, hits: np.ndarray, reason: str) -> None:
        used = self.t2.insert(hs, dst)
        _emit(self._events, "l2", True, hs)
        dup = dst[used != dst]
        if dup.size:
            self.l2.free(dup)
        self.t2.hits[used] = np.maximum(self.t2.hits[used], hits)
        self._stats.backed_up(reason, len(hs), self.page_bytes)
        if self.writer is None:
            return
        hot = self.out.on_insert(self.t2.hits[used])
        why = self.out.reason
        if hot.any():
            self._write_l3(*_select(hs, used, hot), why)

    def _write_l3(self, hs: list[bytes], pages: np.ndarray, reason: str) -> None:
        assert self.writer is not None
        q = self._to_l3
        keep = ~self._in_l3[pages] & ~_member(q, hs)
        if not keep.any():
            return
        sel = np.flatnonzero(keep)
        hk, pk = [hs[i] for i in sel.tolist()], pages[sel]
        if not self._tp_shared:  # the TP-shared writer holds its pages without pins (cache/shared_l3.py)
            self.t2.pin(pk)
        q.update(dict.fromkeys(hk, reason))
        self.writer.submit(hk, pk)

    def _written(
        self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None, s: float
    ) -> None:
        with self._mu:
            self._written_locked(hs, pages, res, err, s, None, unpin=True)

    def _written_locked(
        self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None, s: float,
        reason: str | None, unpin: bool,
    ) -> None:  # fmt: skip
        if unpin:
            self.t2.unpin(pages)
        q = self._to_l3
        reasons = [q.pop(h, reason or "through") for h in hs]
        st = self._stats
        if err is not None or res is None:
            st.l3_put_failed += len(hs)
            self._error(f"L2 -> L3 put of {len(hs)} pages failed: {err}")
            return
        ok = np.fromiter((o is Outcome.OK for o in res), bool, len(res))
        self._in_l3[pages[ok]] = True
        _emit(self._events, "l3", True, hs, ok=ok)
        st.put_l3(reasons, ok, self.page_bytes)

    # -- release / flush / stats / close ----------------------------------------------------------
    @_timed("release")
    def release(self, request_id: str) -> None:
        """Unpin the request's pages and free its L1 pages that were not committed."""
        with self._mu:
            r = self._reqs.pop(request_id, None)
        if r is None:
            raise UnknownRequest(f"unknown request id {request_id!r}: never matched or already released")
        if r.prefetch is not None and not r.prefetch.delivered:
            r.prefetch.cancel()
        quarantine = False
        if r.load_job is not None and r.load_ok is None:
            try:
                r.load_ok = self._engine.wait([r.load_job], timeout=self.cfg.load_timeout_s)[0].ok
            except TimeoutError:  # the load thread may still write those L1 pages: never reuse them
                quarantine = True
                self._error(f"load of {request_id!r} did not finish in {self.cfg.load_timeout_s} s")
            except KeyError:
                pass
        if r.pp_held:
            self._pp_report(r)
        with self._mu:
            # one unpin per tier: the pages are distinct (hits were cached, inserted ones were not;
            # fetched pages hold other hashes than the L2 hits), order as before (hits first)
            self.t1.unpin(np.concatenate([r.l1_hit, *r.l1_inserted]))
            if r.l2_hit.size or r.l2_fetched.size:
                self.t2.unpin(np.concatenate([r.l2_hit, r.l2_fetched]))
            lo = r.l1_owned
            owned = (lo[0] if len(lo) == 1 else np.concatenate(lo)) if lo else _EMPTY
            if owned.size and not quarantine:
                self._l1_owner[owned] = -1
                free = owned[~self.t1.cached[owned]]
                if free.size:
                    self._l1_alloc.free(free)

    # -- tier events (pulled: cache/tier_events.py) ----------------------------------------------------
    def subscribe_events(self, limit_pages: int, wake: Callable[[], None] | None = None) -> None:
        """Start queueing tier changes (at most `limit_pages` pages wait; more are dropped and
        counted); `wake()` is called, under the cache's lock, when the queue stops being empty."""
        with self._mu:
            self._events.subscribe(limit_pages, wake)

    def unsubscribe_events(self) -> None:
        with self._mu:
            self._events.unsubscribe()

    def take_events(self) -> EventBatch:
        """The tier changes queued since the last take, in order."""
        with self._mu:
            return self._events.take()

    def event_snapshot(self) -> tuple[dict[str, np.ndarray], EventBatch]:
        """The L1 and L2 page keys now and, taken in the same hold of the lock, the changes queued
        before them (a reader sends those first; the contents are the state after them)."""
        with self._mu:
            tiers = (("l1", self.t1), ("l2", self.t2))
            out = {name: t.key64_of(np.flatnonzero(t.cached).astype(np.int64)) for name, t in tiers}
            return out, self._events.take()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait for queued backups and L3 writes; raise BackgroundError with the errors any thread
        recorded since the last flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._bk_idle:
            done = self._bk_idle.wait_for(lambda: self._bk_inflight == 0, timeout)
        if self.writer is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = self.writer.flush(left) and done
        self.raise_errors()
        if not done:
            raise TimeoutError(f"background copies not finished within {timeout} s")

    def raise_errors(self) -> None:
        with self._mu:
            errs, self._errors = self._errors, []
        if errs:
            more = f" (+{len(errs) - 5} more)" if len(errs) > 5 else ""
            raise BackgroundError("; ".join(errs[:5]) + more)

    def stats(self) -> dict[str, Any]:
        with self._mu, self._api_mu:
            d = self._stats.as_dict()
            d["l1_pages"], d["l2_pages"] = self.t1.page_counts(), self.t2.page_counts()
            d["ghost_entries"] = len(self.ghost)
            d["active_requests"] = len(self._reqs)
        d["writer_pending"] = self.writer.pending() if self.writer is not None else 0
        d["writer_puts"] = self.writer.puts if self.writer is not None else 0
        d["l3_client"] = self.l3.stats.as_dict() if self.l3 is not None else None
        return d

    def close(self) -> None:
        """Release what is still active, finish the background copies, stop the threads and give
        every cached page back to its allocator. Raises BackgroundError for unreported errors."""
        if self._closed:
            return
        for rid in list(self._reqs):
            log.warning("close(): releasing active request %s", rid)
            self.release(rid)
        try:
            self.flush(timeout=None)
        finally:
            self._closed = True
            self._backups.put(None)
            self._reaper.join()
            if self.writer is not None:
                self.writer.close()
            if self.prefetcher is not None:
                self.prefetcher.close()
            self._engine.close()
            with self._mu:
                final = self._stats.as_dict()
            metrics.unwatch_cache(self, final)  # its counts stay in the counters (not under _mu: a scrape takes it)
            with self._mu:
                for t, free in ((self.t1, self._l1_alloc.free), (self.t2, self.l2.free)):
                    pages = np.flatnonzero(t.cached).astype(np.int64)
                    t.drop(pages)
                    free(pages)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
