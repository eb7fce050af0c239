"""`TieredCache`: the per-instance cache over L1 (device), L2 (host pool) and L3 (pool); the
lifecycle is in the package docstring (l3pool/cache/__init__.py). A planner and movers: the
`Planner` (planner.py) keeps the books and returns plans, the movers (movers.py; TP-shared:
shared.py; `build()` picks the `movers` factory) move the bytes and own the threads. This class
runs one against the other under one re-entrant lock (`_mu`) around the books; blocking waits
(prefetch, load/backup jobs, the writer's puts) happen outside it, except the synchronous
write-back on eviction, which is the cost that policy pays by definition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from l2core.l1 import page_slots
from l2core.transfer import TransferError
from l2core.units import check_int
from l3pool import metrics
from l3pool.cache._internal import _EMPTY, _join, _Loads, _Req, _timed, check_parts, commit_args
from l3pool.cache.config import CacheConfig
from l3pool.cache.movers import BackupPlan, MoverFactory, plain_movers
from l3pool.cache.planner import Planner, Write
from l3pool.cache.tier_events import CacheEvents, EventBatch
from l3pool.cache.types import L1, BackgroundError, CacheError, LoadHandle, Match, PPShortLoad, UnknownRequest
from l3pool.pool.prefetch import PrefetchResult
from l3pool.pool.protocols import HostPages, L3Pages, Outcome, StageLockService

log = logging.getLogger(__name__)


class TieredCache:
    def __init__(
        self, cfg: CacheConfig, l1: L1, l2: HostPages, l3: L3Pages | None = None,
        locks: StageLockService | None = None, *, movers: MoverFactory = plain_movers,
    ) -> None:  # fmt: skip
        check_parts(cfg, l1, l2, l3, locks)
        self.cfg, self.l1buf, self.l2, self.l3, self.locks = cfg, l1, l2, l3, locks
        self.pp = locks is not None and locks.stages > 1
        self.page_size, self.page_bytes = l1.page_size, l2.layout.page_bytes
        self.plan = Planner(cfg, l1, l2, locks, self._make_room_l2)
        self.t1, self.t2, self.ghost, self._stats = self.plan.t1, self.plan.t2, self.plan.ghost, self.plan.stats
        self.mu = self._mu = threading.Condition(threading.RLock())  # wait() releases every level
        self._api_mu = threading.Lock()  # stats()["api_s"] (_timed)
        self._closed = False
        self.events = CacheEvents(self.plan.events, self._mu, self.plan.contents)  # pulled by a reader
        self.movers = movers(cfg, l1, l2, l3, self)  # they call back only through the Hooks methods below
        self._engine = self.movers.engine
        self._loads = _Loads(
            self.page_bytes, l2.spec.num_layers, self.slots, self._engine.wait_layer, self._load_ok, self._add_wait
        )
        metrics.watch_cache(self)  # its l3pool_cache_* series, derived from stats() at each scrape

    # -- the movers' hooks (l3pool/cache/movers.py Hooks) -------------------------------------------
    def slots(self, l1_pages: np.ndarray) -> torch.Tensor:
        """Token slots of L1 pages (what the engine's attention indexes)."""
        return page_slots(np.ascontiguousarray(l1_pages, dtype=np.int64), self.page_size)

    def alloc_prefetch(self, n: int) -> np.ndarray:
        with self._mu:
            return self.plan.alloc_prefetch(n)

    def free_l2(self, pages: np.ndarray) -> None:
        if len(pages):
            with self._mu:
                self.l2.free(pages)

    def hold(self, plan: BackupPlan) -> None:
        with self._mu:
            self.plan.hold(plan)

    def backup_done(self, plan: BackupPlan, ok: bool, err: str | None) -> None:
        with self._mu:
            self.plan.unhold(plan)
            if ok:
                self._write_l3(
                    self.plan.backed_up(plan, self.movers.backups.copies, self._writes()), self.plan.out.reason
                )
            else:
                self.l2.free(plan.l2)
                if err is not None:
                    self.plan.error(f"L1 -> L2 backup of {len(plan.hashes)} pages failed: {err}")
            self._mu.notify_all()

    def written(self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None,
                unpin: bool) -> None:  # fmt: skip
        self.plan.written(hs, pages, res, err, None, unpin)

    def error(self, what: str | None) -> None:
        if what is not None:
            with self._mu:
                self.plan.error(what)

    def _add_wait(self, tier: str, s: float) -> None:
        with self._mu:
            self._stats.waited(tier, s)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("the cache is closed")

    def _writes(self) -> bool:
        return self.movers.l3_out is not None

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
            if request_id in self.plan.reqs:
                raise CacheError(f"request {request_id!r} is already active: release() it first")
            r = self.plan.open(request_id, hs, buf, limit)
        n3 = r.n2
        try:
            if self.pp:
                n3 = self.plan.pp_length(r)
            elif self.movers.l3_in is not None and self.l3 is not None and limit > r.n2:
                n, failed = self.movers.l3_in.lookup(r.rid, self.l3.ns.keys(r.hashes[r.n2 : r.limit]))
                n3 = r.n2 + n
                if failed:
                    with self._mu:
                        self._stats.l3_read_failures += 1
        except BaseException:
            self.release(request_id)
            raise
        with self._mu:
            if n3 < r.n2:  # PP: the lock is shorter than what this stage holds locally
                self.plan.truncate(r, n3)
            r.n3 = n3
            self.plan.count_hits(r, r.n2, r.l1_hit if r.n2 == r.n1 else None)  # no L2 hits: L1's are known
            backup, write = self.plan.on_use(r, self._writes())
            self._backup(backup)
            self._write_l3(write, "selective")
            return Match(request_id, len(hs), r.n1, r.n2 - r.n1, r.n3 - r.n2)

    def shorten(self, request_id: str, n: int) -> Match:
        """Cut a matched request's hit to its first `n` pages (unpinning the rest) before prefetch and
        load: a hybrid model resumes only at a saved window checkpoint (l3pool.cache.hybrid)."""
        with self._mu:
            r = self.plan.req(request_id)
            if r.n_hit >= 0 or r.prefetch is not None:
                raise CacheError(f"request {request_id!r}: shorten() must come before prefetch() and load()")
            self.plan.truncate(r, n := max(0, min(int(n), r.n3)))
            r.n3, r.limit = n, min(r.limit, n)
            return Match(request_id, len(r.hashes), r.n1, r.n2 - r.n1, r.n3 - r.n2)

    # -- prefetch / load --------------------------------------------------------------------------
    @_timed("prefetch")
    def prefetch(self, m: Match) -> bool:
        """Start moving the L3 hit into L2 in the background (the request is queued). False when
        there is nothing to fetch, no L3, a prefetch already started, or the request was loaded."""
        self._check_open()
        r = self.plan.req(m.request_id)
        if self.movers.l3_in is None or self.l3 is None or r.n3 <= r.n2 or r.prefetch is not None or r.n_hit >= 0:
            return False
        r.prefetch = self.movers.l3_in.start(r.rid, self.l3.ns.keys(r.hashes[r.n2 : r.n3]), False)
        return True

    def _fetched(self, r: _Req) -> tuple[np.ndarray, str]:
        """The L3 hit's intact prefix in L2 (a prefetch load() started itself, and every one under PP,
        is waited for whole): its pages and, when short, why."""
        fetched, why, fetch = _EMPTY, "lost despite the lock", self.movers.l3_in
        if r.n3 <= r.n2 or fetch is None or self.l3 is None:
            return fetched, why
        res: PrefetchResult | None = None
        started_now = r.prefetch is None
        t0 = time.perf_counter()
        try:
            if started_now:
                r.prefetch = fetch.start(r.rid, self.l3.ns.keys(r.hashes[r.n2 : r.n3]), True)
            res = fetch.finish(r.prefetch, started_now or self.pp)  # type: ignore[arg-type]
        except CacheError:
            raise
        except Exception as e:  # a failed L3 read is a miss
            log.warning("L3 fetch for %s failed (treated as a miss): %s", r.rid, e)
            with self._mu:
                self._stats.l3_read_failures += 1
        finally:
            r.l3_wait_s = time.perf_counter() - t0
            self._add_wait("l3", r.l3_wait_s)
        if res is None:
            return fetched, why
        with self._mu:
            self._stats.fetched(res, self.page_bytes)
        return res.pages, res.error or (f"stopped by {res.stopped_by}" if res.stopped_by else why)

    @_timed("load")
    def load(self, m: Match, total_pages: int | None = None) -> LoadHandle:
        """Stop the prefetch (policy), then allocate L1 pages for the hit and submit L2 -> L1 per
        layer on the load thread. `total_pages`: the request's L1 pages in all (hit + computed
        suffix, known only now since an interrupted prefetch may shorten the hit); the handle's
        `l1_pages` then holds that many (default: the hit only; alloc_l1() adds more)."""
        self._check_open()
        r = self.plan.req(m.request_id)
        if r.n_hit >= 0:
            raise CacheError(f"request {r.rid!r} was already loaded")
        if total_pages is not None:
            check_int("total_pages", total_pages, 0, ValueError)
        fetched, why = self._fetched(r)
        with self._mu:
            k = len(fetched)
            if k:
                r.l2_fetched = self.plan.fetched(r, fetched)
            r.n_hit = r.n2 + k
            short = self.pp and r.n_hit < r.n3
            if short:
                self._stats.pp_short += 1
        if r.pp_held:
            self.error(self.plan.pp_report(r))
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
                job = self._engine.submit_load(self.slots(new[:nload]), np.concatenate([r.l2_hit, r.l2_fetched]))
                r.load_job = job
            hits = {"l1": r.n1, "l2": r.n2 - r.n1, "l3": k}
            self._stats.count_request(hits, len(r.hashes), self.page_bytes, self.page_size)
            h = LoadHandle(self._loads, r.rid, np.concatenate([r.l1_hit, new]), r.n_hit, job)
            h.l1, h.l2, h.l3 = r.n1, r.n2 - r.n1, k
            h.l3_wait_s = r.l3_wait_s
            return h

    @_timed("alloc_l1")
    def alloc_l1(self, request_id: str, n: int) -> np.ndarray:
        """`n` more L1 pages owned by the request (freed at release unless committed)."""
        self._check_open()
        check_int("n", n, 0, ValueError)
        with self._mu:
            return self._alloc_l1(self.plan.req(request_id), n)

    def _alloc_l1(self, r: _Req, n: int) -> np.ndarray:
        if n == 0:
            return _EMPTY
        p, backups = self.plan, self.movers.backups
        short = n - p.l1_alloc.free_pages
        if short > p.t1.evictable and backups.busy():
            # pages pinned by backups in flight come free when the backup thread is done with them
            deadline = time.monotonic() + self.cfg.load_timeout_s
            while short > p.t1.evictable and backups.busy() and time.monotonic() < deadline:
                self._mu.wait(0.05)
                short = n - p.l1_alloc.free_pages
        victims = _EMPTY
        if short > 0:
            victims, back = p.evict_l1(short, n)
            try:
                if back is not None:
                    self._write_back_l1(back)
                backups.before_reuse()
            except BaseException:
                p.l1_alloc.free(victims)
                raise
        return p.give_l1(r, n, victims)

    def _write_back_l1(self, plan: BackupPlan) -> None:
        """write_back: evicted L1 pages not in L2 are copied down before their pages are reused."""
        res = self._engine.wait([self._engine.submit_backup(self.slots(plan.l1), plan.l2)])[0]
        if not res.ok:
            self.l2.free(plan.l2)
            self.plan.error(f"L1 -> L2 write-back failed: {res.error}")
            return
        self._write_l3(self.plan.backed_up(plan, self.movers.backups.copies, self._writes()), self.plan.out.reason)

    def _make_room_l2(self, n: int) -> None:
        ev = self.plan.evict_l2(n, self._writes())
        if ev is None:
            return
        victims, hs, keep = ev
        try:
            if keep is not None and keep.any() and self.movers.l3_out is not None and self.l3 is not None:
                sel = np.flatnonzero(keep)
                hk, pk = [hs[i] for i in sel.tolist()], victims[sel]
                out = self.movers.l3_out.put_now(self.l3.ns.keys(hk), pk)
                if out is not None:
                    self.plan.written(hk, pk, out[0], out[1], "back", unpin=False)
        finally:
            self.plan.drop_l2(victims)

    # -- commit / backup / writer -----------------------------------------------------------------
    @_timed("commit")
    def commit(self, request_id: str, page_hashes: Sequence[bytes], l1_pages: np.ndarray | Sequence[int]) -> int:
        """Insert the request's full pages (`page_hashes[i]` held by `l1_pages[i]`) into L1 and let the write
        policies decide what moves down. May be called again with a longer prefix (PD: once unfinished, once
        finished); hit counts still count the request once. Returns the number of L1 pages newly indexed."""
        self._check_open()
        r = self.plan.req(request_id)
        if r.n_hit < 0:
            raise CacheError(f"request {request_id!r}: call load() before commit()")
        hs, pages, buf, same = commit_args(r, page_hashes, l1_pages)
        self._collect_load(r)
        if r.load_ok is False:
            raise TransferError(f"the L2 -> L1 load of {request_id!r} failed: its pages were not inserted")
        with self._mu:
            newly, plans = self.plan.commit(r, hs, buf, pages, same)
            for plan in plans:
                self._backup(plan)
            return newly

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
            r = self.plan.req(rid)
        self._collect_load(r)
        return bool(r.load_ok)

    def _backup(self, plan: BackupPlan | None) -> None:
        """L1 -> L2 of a backup plan (its L2 pages booked), by the backup sink."""
        if plan is not None:
            self.movers.backups.submit(plan)

    def _write_l3(self, w: Write | None, reason: str) -> None:
        out = self.movers.l3_out
        if w is None or out is None:
            return
        out.settle()  # what is in L3 already, up to date
        todo = self.plan.write(w, reason, out.pins)
        if todo is not None:
            out.submit(*todo)

    # -- release / flush / stats / close ----------------------------------------------------------
    @_timed("release")
    def release(self, request_id: str) -> None:
        """Unpin the request's pages and free its L1 pages that were not committed."""
        with self._mu:
            r = self.plan.reqs.pop(request_id, None)
        if r is None:
            raise UnknownRequest(f"unknown request id {request_id!r}: never matched or already released")
        if self.movers.l3_in is not None:
            self.movers.l3_in.forget(request_id)
        if r.prefetch is not None and not r.prefetch.delivered:
            r.prefetch.cancel()
        quarantine = False
        if r.load_job is not None and r.load_ok is None:
            try:
                r.load_ok = self._engine.wait([r.load_job], timeout=self.cfg.load_timeout_s)[0].ok
            except TimeoutError:  # the load thread may still write those L1 pages: never reuse them
                quarantine = True
                self.error(f"load of {request_id!r} did not finish in {self.cfg.load_timeout_s} s")
            except KeyError:
                pass
        if r.pp_held:
            self.error(self.plan.pp_report(r))
        with self._mu:
            self.plan.release(r, quarantine)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait for queued backups and L3 writes; raise BackgroundError with the errors any thread
        recorded since the last flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self.movers.backups.wait_idle(timeout)
        if self.movers.l3_out is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = self.movers.l3_out.flush(left) and done
        self.raise_errors()
        if not done:
            raise TimeoutError(f"background copies not finished within {timeout} s")

    def raise_errors(self) -> None:
        if self.movers.l3_out is not None:
            self.movers.l3_out.settle()
        with self._mu:
            errs, self.plan.errors = self.plan.errors, []
        if errs:
            more = f" (+{len(errs) - 5} more)" if len(errs) > 5 else ""
            raise BackgroundError("; ".join(errs[:5]) + more)

    def stats(self) -> dict[str, Any]:
        out = self.movers.l3_out
        if out is not None:
            out.settle()
        with self._mu, self._api_mu:
            d = self.plan.counts()
        d["writer_pending"] = out.pending() if out is not None else 0
        d["writer_puts"] = out.puts if out is not None else 0
        d["l3_client"] = self.l3.stats.as_dict() if self.l3 is not None else None
        d.update(self.movers.stats())
        return d

    def take_events(self) -> EventBatch:
        """The tier changes queued since the last take, in order (`events`: the whole reader's side)."""
        return self.events.take()

    # -- TP-shared movers: the cross-rank check ---------------------------------------------------------
    def tp_digest(self) -> int:
        """64-bit digest of this rank's books (allocators, indexes, page generations)."""
        with self._mu:
            return self.movers.tp_digest(self.plan.books())

    def tp_check(self, step: int, timeout: float = 0.0) -> list[int]:
        """Publish this rank's digest for `step` and compare it with the other ranks' (those that
        reached `step`; `timeout` > 0: wait that long for all). Raises Divergence (also recorded
        as a background error) when they differ. Returns the ranks compared."""
        return self.movers.tp_check(step, self.tp_digest, timeout, self.error)

    def close(self) -> None:
        """Release what is still active, finish the background copies, stop the threads and give
        every cached page back to its allocator. Raises BackgroundError for unreported errors."""
        if self._closed:
            return
        for rid in list(self.plan.reqs):
            log.warning("close(): releasing active request %s", rid)
            self.release(rid)
        try:
            self.flush(timeout=None)
        finally:
            self._closed = True
            self.movers.close()
            with self._mu:
                final = self._stats.as_dict()
            metrics.unwatch_cache(self, final)  # its counts stay in the counters (not under _mu: a scrape takes it)
            with self._mu:
                self.plan.drop_all()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
