"""`HybridCache`: the tiered cache of a hybrid model (full attention + sliding-window layers).

Two `TieredCache`s under one lifecycle (l2core.groups explains the format):
- `full`: the full-attention layers' pages, exactly the single-group cache (chained page hashes);
- `ckpt`: window checkpoints, one "page" of `HybridSpec.ckpt_spec` each (the SWA layers' KV of
  the W tokens ending at a saved position), keyed by `checkpoint_hashes` (the prefix hash at that
  position + the group structure). Its L1 is a small stacked staging buffer (`ckpt_l1`); windows
  move between it and the engine's SWA KV with one page-granular copy (l2core.window).
Both get the same tiers, write policies, ghost list, L3 writer, prefetcher and PP locks.

    m = hc.match(rid, page_hashes, max_hit)   # m.resume: pages the engine need not compute
    hc.prefetch(m)
    h = hc.load(m, total_pages)               # h.full: the full layers' LoadHandle
    h.restore_window(swa, page_table)         # the checkpoint at m.resume into the SWA KV
    ... prefill from m.resume (full layers: h.full.wait_layer(i)) ...
    hc.commit(rid, page_hashes[:full_pages], h.full.l1_pages, swa, page_table)  # + checkpoints
    hc.release(rid)

**Resumable prefix.** match() resumes at the largest position p whose full-attention pages are all
hit AND whose checkpoint is present (pinned by the match, like the pages); the rest is recomputed.
The full match is shortened to p (`TieredCache.shorten`), so nothing past p is loaded. Evicting a
checkpoint therefore only lowers later resume positions: no prefix ever claims to be resumable
without its checkpoint (a checkpoint found missing after the probe makes the request resume at 0,
as does a page or the checkpoint that matched in L3 but did not arrive at load: `resume_lost`).
A checkpoint of another group structure lives in another namespace: a miss, never foreign bytes.

**Pipeline stages** agree through the two caches' stage locks. Stage 0 probes L3 for the largest
saved position p whose full pages and checkpoint exist for every stage, then locks the full pages
`[:p]`; if that lock comes out shorter than p it tries no checkpoint. It then locks the checkpoint
list headed by ck(p) (or by nothing: length 0). Every other stage joins the full lock (length L)
and then the checkpoint lock, heading its list by ck(L): the checkpoint lock has length 1 only
when stage 0 locked ck(p) with p == L, so all stages resume at L or all at 0 (the full match is
shortened to that on every stage). A stage whose checkpoint then fails to arrive raises
PPShortLoad from load, as for pages.

Which checkpoints a request saves: the stride policy's positions in (p_try, full pages] that are
not already in its L1/L2, plus p_try itself when it did not hit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from l2core.groups import HybridSpec, checkpoint_hashes
from l2core.l1 import kv_stack, layer_views
from l2core.pool import PinMode
from l2core.spec import ConfigError
from l2core.window import gather_windows, scatter_window
from l3pool.cache.config import CacheConfig
from l3pool.cache.controller import TieredCache
from l3pool.cache.stack import CacheStack, build
from l3pool.cache.stride import StridePolicy, stride_policy
from l3pool.cache.types import L1, LoadHandle, Match, UnknownRequest
from l3pool.pool.keys import Namespace
from l3pool.pool.pplock import StageLocks
from l3pool.pool.protocols import PageStore

log = logging.getLogger(__name__)
_EMPTY = np.empty(0, dtype=np.int64)


def _ck_rid(request_id: str) -> str:
    """The request's id in the checkpoint cache: its own stage-lock key beside the pages' lock."""
    return f"{request_id}+swa-ckpt"


@dataclass(frozen=True)
class HybridMatch:
    """`resume`: pages the engine need not compute (full pages hit and a checkpoint at `resume`);
    `full` / `ckpt`: the two caches' matches; `saves`: positions this request will checkpoint."""

    request_id: str
    pages: int
    resume: int
    full: Match
    ckpt: Match | None
    ckpt_hit: bool
    saves: tuple[int, ...]


@dataclass
class HybridLoad:
    """What load() set in motion: `full` is the full-attention LoadHandle (its `wait_layer(i)` is
    full layer i's), `ckpt` the checkpoints' (hit first, then one staging page per save)."""

    request_id: str
    resume: int
    full: LoadHandle
    ckpt: LoadHandle | None
    _owner: HybridCache = field(repr=False)

    @property
    def hit_pages(self) -> int:
        return self.resume

    def restore_window(self, swa: torch.Tensor, page_table: np.ndarray) -> int:
        """Copy the checkpoint at `resume` into the window pages of the request's SWA KV `swa`
        (`[N, slots, H, D]`; `page_table[i]` = the swa page of request page i). Returns bytes."""
        return self._owner._restore(self, swa, page_table)


@dataclass
class _HReq:
    resume: int
    p_try: int
    hit: bool
    positions: list[int]  # ckpt list order: [p_try if tried] + saves
    ck_hashes: list[bytes]
    load: HybridLoad | None = None
    committed: int = 0  # checkpoints of the list committed so far


class HybridCache:
    """One per engine instance of a hybrid model; `ckpt` is None when the model has no SWA layers."""

    def __init__(
        self,
        spec: HybridSpec,
        full: TieredCache,
        ckpt: TieredCache | None,
        ckpt_l1: torch.Tensor | None,
        stride: StridePolicy | str,
    ) -> None:
        if not isinstance(spec, HybridSpec):
            raise ConfigError(f"spec must be a HybridSpec, got {type(spec).__name__}")
        self.spec, self.full, self.ckpt, self.ckpt_l1 = spec, full, ckpt, ckpt_l1
        self.stride = stride_policy(stride)
        self.page_size = spec.kv.page_size
        self.wpages = spec.window_pages
        if (ckpt is None) != (spec.swa is None) or (ckpt is None) != (ckpt_l1 is None):
            raise ConfigError("a model with an swa group needs the checkpoint cache and its L1 (and only then)")
        if ckpt is not None and ckpt.page_size != spec.window:
            raise ConfigError(f"checkpoint cache page size {ckpt.page_size} != the window {spec.window}")
        self._kv = spec.ckpt_spec if spec.swa is not None else None  # the SWA group: native CPU window copies
        self._reqs: dict[str, _HReq] = {}
        self.counters = {"requests": 0, "resumed": 0, "resume_pages": 0, "ckpt_lost": 0, "resume_lost": 0,
                         "ckpts_saved": 0, "ckpt_bytes_copied": 0}  # fmt: skip
        self._mu = threading.Lock()  # the request table and counters (calls come from many threads)

    # -- match ----------------------------------------------------------------------------------
    def _present_ckpts(self, hs: Sequence[bytes], positions: np.ndarray, l3: bool = True) -> np.ndarray:
        """Which checkpoints exist (non-pinning probe; L3 only when `l3`), as a bool array."""
        assert self.ckpt is not None
        if not positions.size:
            return np.zeros(0, dtype=np.bool_)
        ck = checkpoint_hashes(hs, positions, self.spec.signature)
        have = (self.ckpt.t1.pages_of(ck) >= 0) | (self.ckpt.t2.pages_of(ck) >= 0)
        c3 = self.ckpt.l3
        if l3 and c3 is not None and not have.all():
            rest = np.flatnonzero(~have)
            keys = c3.ns.keys([ck[i] for i in rest.tolist()])
            store = getattr(c3, "store", None)  # L3Client: one batch_is_exist for every candidate
            try:
                if store is not None and hasattr(store, "present"):
                    have[rest] = store.present(keys)
                else:  # another L3Pages: one lookup per key
                    have[rest] = [c3.lookup([k]) == 1 for k in keys]
            except Exception as e:  # a failed lookup is a miss
                log.warning("L3 checkpoint probe failed (treated as a miss): %s", e)
        return have

    def _best(self, hs: Sequence[bytes], upto: int) -> int:
        """The largest saved position <= upto whose checkpoint exists (0: none)."""
        cand = self.stride.candidates(upto, self.page_size)[::-1]
        if not cand.size:
            return 0
        have = self._present_ckpts(hs, cand)
        i = np.flatnonzero(have)
        return int(cand[i[0]]) if i.size else 0

    def _pp_best(self, hs: list[bytes], limit: int) -> int:
        """Stage 0's choice under PP: the largest saved position whose full pages and checkpoint are
        in L3 for every stage (what the two stage locks will check; a failed probe is a miss)."""
        fl, cl = self.full.locks, self.ckpt.locks if self.ckpt is not None else None
        store = getattr(fl, "store", None)
        fns, cns = getattr(fl, "namespaces", None), getattr(cl, "namespaces", None)  # StageLocks'
        if fl is None or store is None or fns is None or cns is None or limit < 1 or not hasattr(store, "present"):
            return 0
        try:
            n = fl.stages
            full = store.present([k for ns in fns for k in ns.keys(hs[:limit])]).reshape(n, limit)
            miss = ~full.all(axis=0)
            avail = int(np.argmax(miss)) if miss.any() else limit
            cand = self.stride.candidates(avail, self.page_size)[::-1]
            if not cand.size:
                return 0
            ck = checkpoint_hashes(hs, cand, self.spec.signature)
            have = store.present([k for ns in cns for k in ns.keys(ck)]).reshape(n, len(ck)).all(axis=0)
        except Exception as e:
            log.warning("PP checkpoint probe failed (treated as a miss): %s", e)
            return 0
        i = np.flatnonzero(have)
        return int(cand[i[0]]) if i.size else 0

    def match(self, request_id: str, page_hashes: Sequence[bytes], max_hit: int | None = None) -> HybridMatch:
        hs = page_hashes if isinstance(page_hashes, list) else list(page_hashes)
        limit = len(hs) if max_hit is None else max(0, min(int(max_hit), len(hs)))
        if self.ckpt is None:
            m = self.full.match(request_id, hs, limit)
            with self._mu:
                self._reqs[request_id] = _HReq(m.hit_pages, 0, False, [], [])
            return HybridMatch(request_id, len(hs), m.hit_pages, m, None, False, ())
        full = self.full
        stage = full.locks.stage if full.pp and full.locks is not None else None
        if stage == 0:  # choose p first: the full lock must be exactly [:p] for the others to know p
            p = self._pp_best(hs, limit)
            m = full.match(request_id, hs, p)
            p_try = p if m.hit_pages == p else 0
        elif stage is not None:
            m = full.match(request_id, hs, limit)
            p_try = m.hit_pages if self.stride.may_hold(m.hit_pages, self.page_size) else 0
        else:
            m = full.match(request_id, hs, limit)
            p_try = self._best(hs, m.hit_pages)
        try:
            saves = self.stride.to_save(len(hs), self.page_size)
            saves = saves[saves > p_try]
            if saves.size:  # skip checkpoints this instance already holds (L1/L2)
                saves = saves[~self._present_ckpts(hs, saves, l3=False)]
            positions = ([p_try] if p_try else []) + saves.tolist()
            ck = checkpoint_hashes(hs, np.asarray(positions, dtype=np.int64), self.spec.signature)
            cm = self.ckpt.match(_ck_rid(request_id), ck, 1 if p_try else 0)
        except BaseException:
            full.release(request_id)
            raise
        hit = p_try > 0 and cm.hit_pages == 1
        resume = p_try if hit else 0
        if p_try and not hit:
            self._count("ckpt_lost", 1)
        try:
            if resume < m.hit_pages:
                m = full.shorten(request_id, resume)
        except BaseException:
            full.release(request_id)
            self.ckpt.release(_ck_rid(request_id))
            raise
        with self._mu:
            self._reqs[request_id] = _HReq(resume, p_try, hit, positions, ck)
        return HybridMatch(request_id, len(hs), resume, m, cm, hit, tuple(saves.tolist()))

    # -- prefetch / load ------------------------------------------------------------------------
    def prefetch(self, m: HybridMatch) -> bool:
        a = self.full.prefetch(m.full)
        b = self.ckpt.prefetch(m.ckpt) if self.ckpt is not None and m.ckpt is not None else False
        return a or b

    def load(self, m: HybridMatch, total_pages: int | None = None) -> HybridLoad:
        r = self._req(m.request_id)
        fh = self.full.load(m.full, total_pages)
        ch = None
        if self.ckpt is not None and m.ckpt is not None:
            ch = self.ckpt.load(m.ckpt, total_pages=len(r.positions))
        # L3 held the hit at the match, but the fetch may come up short (evicted or removed since)
        if self.ckpt is None:  # full layers only: resume where the intact pages end
            if fh.hit_pages < r.resume:
                self._count("resume_lost", 1)
                r.resume = fh.hit_pages
        elif r.resume and (fh.hit_pages < r.resume or ch is None or ch.hit_pages < 1):
            # pages or the window at `resume` never arrived and no lower checkpoint was loaded: the
            # request computes from 0, and the lost checkpoint is saved again at commit
            log.info("request %s: %s lost after the match; computing from 0 instead of resuming at %d",
                     m.request_id, "pages" if fh.hit_pages < r.resume else "the checkpoint", r.resume)  # fmt: skip
            self._count("resume_lost", 1)
            r.resume, r.hit = 0, r.hit and ch is not None and ch.hit_pages >= 1
        r.load = HybridLoad(m.request_id, r.resume, fh, ch, self)
        self._count("requests", 1)
        self._count("resumed", int(r.resume > 0))
        self._count("resume_pages", r.resume)
        return r.load

    def _restore(self, h: HybridLoad, swa: torch.Tensor, page_table: np.ndarray) -> int:
        if h.resume == 0 or h.ckpt is None or self.ckpt_l1 is None:
            return 0
        h.ckpt.wait()
        n = scatter_window(
            self.ckpt_l1,
            h.ckpt.l1_pages[:1],
            np.array([h.resume]),
            swa,
            page_table,
            self.page_size,
            self.wpages,
            self._kv,
        )
        self._count("ckpt_bytes_copied", n)
        return n

    # -- commit / release -----------------------------------------------------------------------
    def commit(
        self,
        request_id: str,
        page_hashes: Sequence[bytes],
        l1_pages: np.ndarray | Sequence[int],
        swa: torch.Tensor | None = None,
        page_table: np.ndarray | None = None,
    ) -> int:
        """Commit the full pages (as TieredCache.commit), then the checkpoints at saved positions up
        to `len(page_hashes)` copied out of `swa` (the request's SWA KV, as for restore_window).
        Returns the number of checkpoints newly committed."""
        r = self._req(request_id)
        self.full.commit(request_id, page_hashes, l1_pages)
        if self.ckpt is None or r.load is None or r.load.ckpt is None or not r.positions:
            return 0
        if swa is None or page_table is None or self.ckpt_l1 is None:
            raise ValueError("a hybrid commit needs the request's SWA KV (swa, page_table) to save checkpoints")
        pos = np.asarray(r.positions, dtype=np.int64)
        k = int(np.searchsorted(pos, len(page_hashes), side="right"))  # ascending: p_try < every save
        if k <= r.committed:
            return 0
        ck_pages = r.load.ckpt.l1_pages
        lo = max(r.committed, int(r.hit))  # the hit checkpoint is already indexed
        if k > lo:
            n = gather_windows(
                swa, page_table, pos[lo:k], self.ckpt_l1, ck_pages[lo:k], self.page_size, self.wpages, self._kv
            )
            self._count("ckpt_bytes_copied", n)
        new = self.ckpt.commit(_ck_rid(request_id), r.ck_hashes[:k], ck_pages[:k])
        self._count("ckpts_saved", new)
        r.committed = k
        return new

    def release(self, request_id: str) -> None:
        with self._mu:
            r = self._reqs.pop(request_id, None)
        if r is None:
            raise UnknownRequest(f"unknown request id {request_id!r}: never matched or already released")
        try:
            self.full.release(request_id)
        finally:
            if self.ckpt is not None:
                self.ckpt.release(_ck_rid(request_id))

    def _count(self, name: str, n: int) -> None:
        with self._mu:
            self.counters[name] += n

    def _req(self, rid: str) -> _HReq:
        with self._mu:
            r = self._reqs.get(rid)
        if r is None:
            raise UnknownRequest(f"unknown request id {rid!r}: match() it first (or it was released)")
        return r

    # -- stats / close --------------------------------------------------------------------------
    def stored_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes held per group and tier now (L1, L2: indexed pages; L3: bytes the writer stored)."""
        out = {}
        for name, c in (("full", self.full), ("swa", self.ckpt)):
            if c is None:
                out[name] = {"l1": 0, "l2": 0, "l3": 0}
                continue
            pb = c.page_bytes
            st = c.stats()
            out[name] = {
                "l1": int(c.t1.cached.sum()) * pb,
                "l2": int(c.t2.cached.sum()) * pb,
                "l3": int(st.get("l3_put_bytes", 0)),
            }
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "hybrid": self._snapshot(),
            "full": self.full.stats(),
            "ckpt": self.ckpt.stats() if self.ckpt is not None else None,
        }

    def _snapshot(self) -> dict[str, int]:
        with self._mu:
            return dict(self.counters)

    def flush(self, timeout: float | None = 30.0) -> None:
        self.full.flush(timeout)
        if self.ckpt is not None:
            self.ckpt.flush(timeout)

    def close(self) -> None:
        """Release what is still active, then close both caches (the stacks close their pools)."""
        with self._mu:
            active = list(self._reqs)
        for rid in active:
            try:
                self.release(rid)
            except Exception as e:  # close() goes on: the caches' close releases what is left
                log.warning("release of %s at close failed: %s", rid, e)
        try:
            self.full.close()
        finally:
            if self.ckpt is not None:
                self.ckpt.close()


def hybrid_namespaces(
    spec: HybridSpec,
    layout: str,
    fingerprint: str,
    *,
    tenant: str = "",
    full_layers: tuple[int, int] | None = None,
    swa_layers: tuple[int, int] | None = None,
) -> tuple[Namespace, Namespace | None]:
    """(full pages' namespace, checkpoints' namespace): both carry the group structure
    (`spec.model_tag`), the checkpoints' also their own tag, page size (= the window) and layers."""
    tag = spec.model_tag(fingerprint)
    nf = Namespace.for_pool(spec.full_spec, layout, tag, layers=full_layers, tenant=tenant)
    if spec.swa is None:
        return nf, None
    nc = Namespace.for_pool(spec.ckpt_spec, layout, f"{tag}~swa-ckpt", layers=swa_layers, tenant=tenant)
    return nf, nc


@dataclass
class HybridStack:
    """What build_hybrid() made; close() closes the controller, then both stacks."""

    cache: HybridCache
    full: CacheStack
    ckpt: CacheStack | None

    def close(self) -> None:
        try:
            self.cache.close()
        finally:
            try:
                self.full.close()
            finally:
                if self.ckpt is not None:
                    self.ckpt.close()

    def __enter__(self) -> HybridStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_hybrid(
    l1: L1,
    spec: HybridSpec,
    *,
    l2_tokens: int,
    ckpt_l1: int,
    ckpt_l2: int,
    stride: StridePolicy | str = "dynamic",
    l2_layout: str = "page_first_direct",
    pin: PinMode = "auto",
    cache: CacheConfig | None = None,
    store: PageStore | None = None,
    fingerprint: str = "",
    tenant: str = "",
    locks: tuple[StageLocks, StageLocks] | None = None,
    layers: tuple[tuple[int, int], tuple[int, int]] | None = None,
    batch_pages: int | None = None,
) -> HybridStack:
    """A hybrid model's cache: `l1` holds the full-attention layers' buffers (`spec.full_spec`);
    `ckpt_l1` / `ckpt_l2` checkpoints of staging (device) and host room; with a `store`, both
    groups get an L3 tier under `hybrid_namespaces(spec, l2_layout, fingerprint, tenant=...)`.
    `locks`: (full pages' StageLocks, checkpoints' StageLocks) for PP; `layers`: this stage's
    (full, swa) layer ranges inside their groups (namespaces)."""
    if store is not None and not fingerprint:
        raise ConfigError("an L3 tier needs the model fingerprint (the namespaces' model)")
    nf = nc = None
    if store is not None:
        nf, nc = hybrid_namespaces(spec, l2_layout, fingerprint, tenant=tenant,
                                   full_layers=layers[0] if layers else None,
                                   swa_layers=layers[1] if layers else None)  # fmt: skip
    lf, lc = locks if locks is not None else (None, None)
    kw: dict[str, Any] = {"l2_layout": l2_layout, "pin": pin, "cache": cache, "batch_pages": batch_pages}
    fs = build(l1, spec.full_spec, l2_tokens=l2_tokens, store=store, namespace=nf, locks=lf, **kw)
    cs: CacheStack | None = None
    buf: torch.Tensor | None = None
    try:
        if spec.swa is not None:
            ks = spec.ckpt_spec
            dev = l1.bufs[0].device
            buf = kv_stack(ks, ckpt_l1 * ks.page_size, dev)
            cl1 = L1(layer_views(buf, ks.num_kv), ks.page_size)  # kv-major stack, ops-order views
            cs = build(cl1, ks, l2_tokens=ckpt_l2 * ks.page_size, store=store, namespace=nc, locks=lc, **kw)
        hc = HybridCache(spec, fs.cache, cs.cache if cs is not None else None, buf, stride)
    except BaseException:
        fs.close()
        if cs is not None:
            cs.close()
        raise
    return HybridStack(hc, fs, cs)
