"""`Planner`: the tiered cache's books - requests and their pins, the tier indexes and their
eviction, the write policies, L1/L2 allocation, what is in (or on its way to) L2 and L3, the
statistics - and the plans it hands the movers (l3pool/cache/movers.py): `BackupPlan`s (L1 -> L2,
L2 pages already booked), writes (L2 -> L3: hashes and L2 pages), evictions (the victims, and which
of them the write-back policy copies down first). It moves no bytes and starts no thread; the
cache (controller.py) runs it under its lock and gives the plans to its movers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from l2core.allocator import OutOfPages, PageAllocator
from l3pool.cache._internal import _EMPTY, _emit, _member, _Req, _select
from l3pool.cache.config import CacheConfig
from l3pool.cache.index import GhostList, TierIndex
from l3pool.cache.movers import BackupPlan
from l3pool.cache.policy import eviction_policy, write_policy
from l3pool.cache.tier_events import EventQueue
from l3pool.cache.types import L1, CacheFull, CacheStats, UnknownRequest
from l3pool.pool.keys import HASH_BYTES, join_hashes, split_hashes
from l3pool.pool.protocols import HostPages, Outcome, StageLockService

log = logging.getLogger(__name__)
Write = tuple[list[bytes], np.ndarray]  # an L2 -> L3 write: hashes and their L2 pages


class Planner:
    def __init__(
        self, cfg: CacheConfig, l1: L1, l2: HostPages, locks: StageLockService | None,
        make_room_l2: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.cfg, self.l2, self.page_bytes, self.locks = cfg, l2, l2.layout.page_bytes, locks
        self.make_room_l2 = make_room_l2  # the cache's L2 eviction (it may write victims back to L3 first)
        self.l1_alloc = PageAllocator(l1.num_pages)
        self.t1 = TierIndex("L1", self.l1_alloc)
        self.t2 = TierIndex("L2", l2.allocator)  # the pool's one allocator (the prefetcher allocates there too)
        self.l1_owner = np.full(l1.num_pages, -1, dtype=np.int64)
        self.in_l3 = np.zeros(l2.num_pages, dtype=np.bool_)  # L2 page known present in L3
        self.to_l3: dict[bytes, str] = {}  # hashes queued for an L3 write -> why
        self.pending_l2: set[bytes] = set()  # hashes being backed up L1 -> L2
        self.down = write_policy(cfg.l1_to_l2, cfg.hit_threshold)  # L1 -> L2 (l3pool/cache/policy.py)
        self.out = write_policy(cfg.l2_to_l3, cfg.hit_threshold)  # L2 -> L3
        self.evict = eviction_policy(cfg.eviction)  # which pages leave a tier (l3pool/cache/eviction.py)
        # only a policy that reads the ghost list keeps it (~35 us per 256 evictions at 64K entries)
        self.ghost = GhostList(cfg.ghost_capacity if self.down.ghost else 0)
        self.stats = CacheStats()
        self.errors: list[str] = []
        self.events = EventQueue()  # tier changes, pulled by a reader (cache/tier_events.py)
        self.reqs: dict[str, _Req] = {}
        self.serial = 0

    def req(self, rid: str) -> _Req:
        r = self.reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request id {rid!r}: match() it first (or it was released)")
        return r

    def counts(self) -> dict[str, Any]:
        """stats(): the counts, the tiers' pages, the ghost list's entries, the active requests."""
        d = self.stats.as_dict()
        d["l1_pages"], d["l2_pages"] = self.t1.page_counts(), self.t2.page_counts()
        d["ghost_entries"] = len(self.ghost)
        d["active_requests"] = len(self.reqs)
        return d

    def error(self, what: str) -> None:
        self.errors.append(what)
        self.stats.errors += 1

    # -- match ------------------------------------------------------------------------------------
    def open(self, rid: str, hs: list[bytes], buf: bytes, limit: int) -> _Req:
        """A new request pinning its L1 prefix, then that prefix's continuation in L2."""
        self.serial += 1
        r = _Req(rid, self.serial, hs, buf, limit)
        r.l1_hit = self.t1.pin_prefix(buf, 0, limit)  # one native probe-and-pin call per tier
        r.n1 = len(r.l1_hit)
        r.l2_hit = self.t2.pin_prefix(buf, r.n1, limit)
        r.n2 = r.n1 + len(r.l2_hit)
        self.reqs[rid] = r
        return r

    def pp_length(self, r: _Req) -> int:
        """The hit length every PP stage uses: stage 0 locks its hit, the others join that lock."""
        assert self.locks is not None
        if self.locks.stage == 0:
            n = self.locks.acquire(r.rid, r.hashes[: r.limit]).length
        else:
            n = self.locks.join(r.rid, self.cfg.pp_join_timeout_s, r.hashes[: r.limit])
        r.pp_held = True
        return n

    def pp_report(self, r: _Req) -> str | None:
        """This stage is done with the request's lock; the error to record, if any."""
        assert self.locks is not None
        r.pp_held = False
        try:
            self.locks.report_done(r.rid)
        except Exception as e:
            return f"PP report_done({r.rid}) failed: {e}"
        return None

    def truncate(self, r: _Req, n: int) -> None:
        k1 = min(r.n1, n)
        self.t1.unpin(r.l1_hit[k1:])
        r.l1_hit = r.l1_hit[:k1]
        k2 = min(r.n2, n) - k1
        self.t2.unpin(r.l2_hit[k2:])
        r.l2_hit = r.l2_hit[:k2]
        r.n1, r.n2 = k1, k1 + k2

    def count_hits(self, r: _Req, upto: int, l1: np.ndarray | None = None) -> None:
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

    def on_use(self, r: _Req, l3: bool) -> tuple[BackupPlan | None, Write | None]:
        """What the policies move now of a request's hit (selective: pages whose distinct-request
        count reached the threshold); `l3`: the cache writes to L3."""
        backup = write = None
        if self.down.reads_use and len(r.l1_hit):
            hot = r.l1_hit[self.down.on_use(self.t1.hits[r.l1_hit])]
            if hot.size:
                backup = self.backup_plan(self.t1.keys_of(hot), hot, "selective")
        if self.out.reads_use and l3:
            p2 = self.t2.lookup(r.buf, 0, r.n2)
            p2 = p2[p2 >= 0]
            p2 = p2[~self.in_l3[p2]]
            hot = p2[self.out.on_use(self.t2.hits[p2])]
            if hot.size:
                write = (self.t2.keys_of(hot), hot)
        return backup, write

    def fetched(self, r: _Req, pages: np.ndarray) -> np.ndarray:
        """Index the intact prefix a prefetch brought into L2 (`pages`, after the request's L2 hit);
        returns the pages now indexed, pinned for the request."""
        used = self.t2.insert(r.buf, pages, r.n2)
        _emit(self.events, "l2", True, r.buf[r.n2 * HASH_BYTES : (r.n2 + len(pages)) * HASH_BYTES])
        dup = pages[used != pages]
        if dup.size:
            self.l2.free(dup)
        self.t2.pin(used)
        self.in_l3[used] = True
        return used

    # -- commit -----------------------------------------------------------------------------------
    def commit(
        self, r: _Req, hs: list[bytes], buf: bytes, pages: np.ndarray, same: bool
    ) -> tuple[int, list[BackupPlan]]:
        """Index a request's committed pages (`hs[i]` in L1 page `pages[i]`; `same`: hs is a prefix
        of the list match() got); returns the number newly indexed and the backups to do."""
        m, n1 = len(hs), r.n1
        if len(r.l1_hit) != n1 or not (pages[:n1] == r.l1_hit).all():
            raise ValueError(f"l1_pages[:{n1}] must be the L1 hit pages load() returned")
        rest = pages[n1:]
        own = r.l1_owned[0] if len(r.l1_owned) == 1 else _EMPTY
        if rest.size and rest.size <= own.size and (rest == own[: rest.size]).all():
            pass  # the pages load() allocated, in order: in range, this request's, distinct
        elif rest.size and (rest.min() < 0 or rest.max() >= len(self.l1_owner)):
            raise IndexError(f"L1 page ids out of range [0, {len(self.l1_owner)})")
        elif (self.l1_owner[rest] != r.serial).any():
            bad = rest[self.l1_owner[rest] != r.serial][:8].tolist()
            raise ValueError(f"L1 pages {bad} were not allocated to request {r.rid!r}")
        elif rest.size > 1 and not (np.diff(np.sort(rest)) != 0).all():
            raise ValueError("the same L1 page appears twice in l1_pages")
        was = self.t1.cached[rest]
        if was.any():
            idx = np.flatnonzero(was)
            if self.t1.keys_of(rest[idx]) != [hs[n1 + i] for i in idx.tolist()]:
                raise ValueError("an L1 page committed before is committed again under another hash")
        used, newly = self.t1.insert_pinned(buf, rest, n1)
        r.l1_inserted.append(newly)
        _emit(self.events, "l1", True, newly, self.t1)
        # used[i]: the L1 page of hs[n1 + i], = r.hashes[n1 + i] when `same`; counted >= n1
        fresh = used[r.counted - n1 :] if same and r.counted >= n1 else None
        self.count_hits(r, m, fresh)
        return int(newly.size), self._on_commit(r, hs, buf, np.concatenate([r.l1_hit, used]))

    def _on_commit(self, r: _Req, hs: list[bytes], buf: bytes, pages: np.ndarray) -> list[BackupPlan]:
        """The committed pages (hits, then computed) the L1 -> L2 policy moves now."""
        pol = self.down
        hot = pol.on_insert(self.t1.hits[pages])
        plans = []
        if not pol.ghost:
            if hot.any():
                plans.append(self.backup_plan(*_select(hs, pages, hot), pol.reason))
            return [p for p in plans if p is not None]
        start, thr = r.n_hit, pol.hit_threshold
        g = self.ghost.native.leading_of(buf, start, HASH_BYTES) if self.ghost.capacity else 0
        if g:  # rebuilt pages evicted from L1 before: proven reuse
            self.stats.ghost_hits += g
            gp = pages[start : start + g]
            self.t1.hits[gp] = np.maximum(self.t1.hits[gp], thr)
            hot[start : start + g] = False
            plans.append(self.backup_plan(hs[start : start + g], gp, "ghost"))
        if hot.any():
            sel = np.flatnonzero(hot)
            plans.append(self.backup_plan([hs[i] for i in sel.tolist()], pages[sel], "selective"))
        return [p for p in plans if p is not None]

    # -- L1 -> L2 ----------------------------------------------------------------------------------
    def backup_plan(
        self, hs: list[bytes], l1p: np.ndarray, reason: str, what: str = "L1 -> L2 backup"
    ) -> BackupPlan | None:
        """Of L1 pages `l1p` (hashes `hs`), those neither in L2 nor on their way there, with L2
        pages booked for them; None when there are none or L2 is full of pinned pages (counted in
        `backup_skips` by cause: `l3_slow` when the pages that wait for the L3 writer held the room)."""
        keep = (self.t2.pages_of(hs) < 0) & ~_member(self.pending_l2, hs)
        if not keep.any():
            return None
        sel = np.flatnonzero(keep)
        hk, pk = [hs[i] for i in sel.tolist()], l1p[sel]
        try:
            dst = self.alloc_l2(len(hk))
        except CacheFull as e:
            queued = len(self.to_l3)
            cause = "l3_slow" if self.l2.allocator.free_pages + queued >= len(hk) else "l2_pinned"
            log.warning("%s: %d pages skipped (%s): %s; %d L2 pages wait for the L3 writer", what, len(hk), cause, e,
                        queued)  # fmt: skip
            self.stats.backup_skips[cause] += len(hk)
            return None
        hits = self.t1.hits[pk].copy() if reason != "back" else np.zeros(len(hk), np.int32)
        return BackupPlan(hk, pk, dst, reason, hits)

    def hold(self, plan: BackupPlan) -> None:
        """A backup copied asynchronously: its L1 pages stay pinned, its hashes pending, until done."""
        self.t1.pin(plan.l1)
        self.pending_l2.update(plan.hashes)
        plan.held = True

    def unhold(self, plan: BackupPlan) -> None:
        if plan.held:
            self.t1.unpin(plan.l1)
            self.pending_l2.difference_update(plan.hashes)
            plan.held = False

    def backed_up(self, plan: BackupPlan, copied: bool, l3: bool) -> Write | None:
        """Index a backup's L2 copies (`copied`: this process moved its bytes); the L3 write the
        L2 -> L3 policy wants of them now (`l3`: the cache writes to L3)."""
        hs, dst = plan.hashes, plan.l2
        used = self.t2.insert(hs, dst)
        _emit(self.events, "l2", True, hs)
        dup = dst[used != dst]
        if dup.size:
            self.l2.free(dup)
        self.t2.hits[used] = np.maximum(self.t2.hits[used], plan.hits)
        self.stats.backed_up(plan.reason, len(hs), self.page_bytes if copied else 0)
        if not l3:
            return None
        hot = self.out.on_insert(self.t2.hits[used])
        return _select(hs, used, hot) if hot.any() else None

    # -- L2 -> L3 ----------------------------------------------------------------------------------
    def write(self, w: Write, reason: str, pin: bool) -> Write | None:
        """Of an L3 write, the pages not in L3 and not queued yet, now queued (pinned if `pin`)."""
        hs, pages = w
        keep = ~self.in_l3[pages] & ~_member(self.to_l3, hs)
        if not keep.any():
            return None
        sel = np.flatnonzero(keep)
        hk, pk = [hs[i] for i in sel.tolist()], pages[sel]
        if pin:
            self.t2.pin(pk)
        self.to_l3.update(dict.fromkeys(hk, reason))
        return hk, pk

    def written(self, hs: list[bytes], pages: np.ndarray, res: list[Outcome] | None, err: BaseException | None,
                reason: str | None, unpin: bool) -> None:  # fmt: skip
        """An L3 put's outcome, booked."""
        if unpin:
            self.t2.unpin(pages)
        reasons = [self.to_l3.pop(h, reason or "through") for h in hs]
        if err is not None or res is None:
            self.stats.l3_put_failed += len(hs)
            self.error(f"L2 -> L3 put of {len(hs)} pages failed: {err}")
            return
        ok = np.fromiter((o is Outcome.OK for o in res), bool, len(res))
        self.in_l3[pages[ok]] = True
        moved = self.t2.pages_of(hs) != pages  # evicted since (an unpinned put's page may hold another now)
        if moved.any():
            self.in_l3[pages[moved]] = False
        _emit(self.events, "l3", True, hs, ok=ok)
        self.stats.put_l3(reasons, ok, self.page_bytes)

    # -- allocation and eviction --------------------------------------------------------------------
    def evict_l1(self, short: int, n: int) -> tuple[np.ndarray, BackupPlan | None]:
        """`short` L1 pages out of the index (by the eviction policy), still allocated (the caller
        reuses or frees them), and the write-back of those not in L2 (write_back policy)."""
        t1 = self.t1
        if short > t1.evictable:
            raise CacheFull(
                f"L1 full: need {n} pages, {self.l1_alloc.free_pages} free and {t1.evictable} evictable "
                f"of {self.l1_alloc.num_pages} (the rest are pinned by in-flight requests)"
            )
        victims, keys = self.evict.victims(t1, short, self.ghost if self.ghost.capacity else None)
        _emit(self.events, "l1", False, keys)
        self.stats.evictions["l1"] += len(victims)
        if not self.down.evict_copies:
            return victims, None
        try:
            return victims, self.backup_plan(split_hashes(keys), victims, "back", "write-back of evicted L1 pages")
        except BaseException:
            self.l1_alloc.free(victims)
            raise

    def give_l1(self, r: _Req, n: int, victims: np.ndarray) -> np.ndarray:
        """`n` L1 pages for the request: the victims, then fresh ones."""
        try:
            # = free(victims) + alloc(n): the allocator hands out the pages freed last first, in
            # order; the victims skip the round trip through its stack
            pages = self.l1_alloc.alloc(n - len(victims))
        except OutOfPages as e:
            self.l1_alloc.free(victims)
            raise CacheFull(f"L1 full: {e}") from None
        if victims.size:
            pages = np.concatenate([victims, pages])
        self.l1_owner[pages] = r.serial
        r.l1_owned.append(pages)
        return pages

    def alloc_prefetch(self, n: int) -> np.ndarray:
        """L2 pages for a prefetch batch, evicting for them; fewer than `n` only when the rest of L2 is pinned."""
        self.make_room_l2(n)
        k = min(n, self.l2.allocator.free_pages)
        try:
            return self.l2.alloc(k) if k else _EMPTY
        except OutOfPages:  # another user of the pool outside the cache
            return _EMPTY

    def alloc_l2(self, n: int) -> np.ndarray:
        self.make_room_l2(n)
        try:
            return self.l2.alloc(n)
        except OutOfPages as e:
            raise CacheFull(f"L2 full: {e} ({self.t2.evictable} evictable)") from None

    def evict_l2(self, n: int, l3: bool) -> tuple[np.ndarray, list[bytes], np.ndarray | None] | None:
        """Room for `n` L2 pages: the victims out of the index (freed by `drop_l2`), their hashes,
        and which of them the write-back policy puts to L3 first (`l3`: the cache writes to L3)."""
        short = n - self.l2.allocator.free_pages
        if short <= 0:
            return None
        victims, keys = self.evict.victims(self.t2, short, None)
        if not victims.size:
            return None
        hs = split_hashes(keys)
        _emit(self.events, "l2", False, hs)
        self.stats.evictions["l2"] += len(victims)
        keep = ~self.in_l3[victims] if self.out.evict_copies and l3 else None
        return victims, hs, keep

    def drop_l2(self, victims: np.ndarray) -> None:
        self.in_l3[victims] = False
        self.l2.free(victims)

    # -- release / close ----------------------------------------------------------------------------
    def release(self, r: _Req, quarantine: bool) -> None:
        """Unpin the request's pages and free its L1 pages that were not committed (`quarantine`:
        its load may still write them: never reused)."""
        # one unpin per tier: the pages are distinct (hits were cached, inserted ones were not;
        # fetched pages hold other hashes than the L2 hits), order as before (hits first)
        self.t1.unpin(np.concatenate([r.l1_hit, *r.l1_inserted]))
        if r.l2_hit.size or r.l2_fetched.size:
            self.t2.unpin(np.concatenate([r.l2_hit, r.l2_fetched]))
        lo = r.l1_owned
        owned = (lo[0] if len(lo) == 1 else np.concatenate(lo)) if lo else _EMPTY
        if owned.size and not quarantine:
            self.l1_owner[owned] = -1
            free = owned[~self.t1.cached[owned]]
            if free.size:
                self.l1_alloc.free(free)

    def drop_all(self) -> None:
        """Every cached page back to its allocator (close)."""
        for t, free in ((self.t1, self.l1_alloc.free), (self.t2, self.l2.free)):
            pages = np.flatnonzero(t.cached).astype(np.int64)
            t.drop(pages)
            free(pages)

    def contents(self) -> dict[str, np.ndarray]:
        """The L1 and L2 page keys now (64-bit: the first 8 bytes of each hash)."""
        return {n: t.key64_of(np.flatnonzero(t.cached).astype(np.int64)) for n, t in (("l1", self.t1), ("l2", self.t2))}

    def books(self) -> tuple[np.ndarray | bytes, ...]:
        """The books a TP group compares (tp_digest): allocators, indexes (keys, eviction order, hits)."""
        out: list[np.ndarray | bytes] = []
        for a, t in ((self.l2.allocator, self.t2), (self.l1_alloc, self.t1)):
            with a.holding_free():
                out += [a._stack[: a.free_pages].copy(), a._used.copy()]
            pages = np.flatnonzero(t.cached).astype(np.int64)
            out += [pages, join_hashes(t.keys_of(pages)) if pages.size else b"", t.lru(), t.hits.copy()]
        return tuple(out)
