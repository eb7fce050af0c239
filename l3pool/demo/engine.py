"""A prefill instance of the demo's reference engine, a thin user of `l3pool.cache.TieredCache`.

    eng = PrefillInstance("a", model, l1_tokens=..., l2_tokens=..., l3=L3Side(store, ns))
    q = eng.arrive(tokens)            # the request is queued: match (no bytes move) + prefetch L3 -> L2
    rec = eng.prefill(q, hold=True)   # scheduled: load L2 -> L1 per layer, compute the misses, commit
    eng.page_digests(rec, n)          # (verification) the KV bytes of its first n pages in L1
    eng.release(rec)                  # the device no longer reads its pages
    eng.prefill(tokens)               # arrive + prefill + release at once

L1 is the model's per-layer buffers (`L1(bufs, page_size)`), L2 an l2core `HostKVPool`, L3 an
`L3Client` (optional). Matching, reference counts, LRU eviction, the write policies, the L3 -> L2
prefetch and the background backups (L1 -> L2 on the cache's backup thread, L2 -> L3 on its
writer thread) all live in the cache; this class only times the request and computes. At least
the last token is always computed, so the engine returns logits.

Per-layer overlap (`overlap=True`): the model calls `h.wait_layer(i)` before layer i of its first
chunk, so layer i's L2 -> L1 copy overlaps the compute of layers < i; with `overlap=False` the
engine waits for the whole load before computing. `prefetch=False`: arrive() only matches, and
load() fetches the L3 part synchronously (what prefetch-on-queue saves is measured against that).

Without cache (`use_cache=False`) there is no TieredCache: the request's KV goes to slots
[0, n) of L1 and everything is computed.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from l2core.l1 import page_slots
from l2core.pool import HostKVPool
from l2core.spec import ConfigError
from l3pool.cache import L1, CacheConfig, CacheFull, CacheStack, LoadHandle, Match, TieredCache, build
from l3pool.demo.model import RefModel
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.protocols import NamespaceRegistry
from l3pool.pool.store import MooncakeStore

if TYPE_CHECKING:
    from l3pool.demo.hf import HFModel

# The demo waits for the L3 -> L2 prefetch at load (wait_complete): every variant then gets the
# same hits, and what prefetch-on-queue saves is time, not a different amount of compute.
DEMO_CACHE = CacheConfig(prefetch_policy="wait_complete")


CONFIGS = ("no_cache", "l1_l2", "l1_l2_l3")  # the cache configurations every report compares
TIERS = ("L1", "L2", "L3", "miss")  # where a request's tokens came from (Record.tier_tokens)


@dataclass
class Record:
    """One prefill: what hit where, what moved, how long it took. `prefill_s` runs from the
    moment the request is scheduled (load) to its logits (commit included); `lookup_s` is the
    match + prefetch start at arrival, while the request was queued."""

    instance: str
    tokens: int
    pages: int  # full pages of the prompt
    request_id: str = ""
    hit_l1: int = 0  # pages
    hit_l2: int = 0
    hit_l3: int = 0
    computed_tokens: int = 0
    prefill_s: float = 0.0
    lookup_s: float = 0.0  # match (L1/L2 index + L3 lookup) + prefetch submit, at arrival
    l3_get_s: float = 0.0  # load() waiting for the rest of the L3 -> L2 fetch
    l3_get_bytes: int = 0
    load_s: float = 0.0  # compute blocked on the L2 -> L1 copy (wait_layer / wait)
    load_bytes: int = 0
    compute_s: float = 0.0  # model time, waits excluded
    backup_bytes: int = 0  # L1 -> L2 bytes the background finished during this request (stats delta)
    put_bytes: int = 0  # L2 -> L3 bytes the writer finished during this request (stats delta)
    logits: torch.Tensor | None = field(default=None, repr=False)
    # kept for verification until release
    hashes: list[bytes] = field(default_factory=list, repr=False)
    l1_pages: np.ndarray | None = field(default=None, repr=False)
    # (verification) the same suffix recomputed on this request's own L1 once its load finished:
    # set only to explain a logits mismatch (Demo._all_hit)
    recomputed: torch.Tensor | None = field(default=None, repr=False)
    # (verification) the KV tensors the last chunk's layers read (model.prefill's `keep`): set
    # only when prefill was asked to keep them (Demo.short_prompts)
    consumed: list[torch.Tensor] | None = field(default=None, repr=False)
    read_check: dict[str, object] | None = field(default=None, repr=False)  # replay.read_kv_check

    @property
    def hit_pages(self) -> int:
        return self.hit_l1 + self.hit_l2 + self.hit_l3

    @property
    def total_s(self) -> float:
        """Arrival to logits when the request is scheduled at once (no queue)."""
        return self.lookup_s + self.prefill_s

    def tier_tokens(self, page_size: int) -> dict[str, int]:
        return {
            "L1": self.hit_l1 * page_size,
            "L2": self.hit_l2 * page_size,
            "L3": self.hit_l3 * page_size,
            "miss": self.computed_tokens,
        }


@dataclass
class L3Side:
    store: MooncakeStore
    namespace: Namespace
    metadata: NamespaceRegistry | None = None


@dataclass
class Queued:
    """A request that arrived: matched (and prefetching) on its instance, not yet scheduled."""

    request_id: str
    tokens: np.ndarray = field(repr=False)
    hashes: list[bytes] = field(repr=False)
    match: Match | None
    lookup_s: float


class PrefillInstance:
    def __init__(
        self,
        name: str,
        model: RefModel | HFModel,
        *,
        l1_tokens: int,
        l2_tokens: int,
        l2_layout: str = "page_first_direct",
        l3: L3Side | None = None,
        use_cache: bool = True,
        cache: CacheConfig = DEMO_CACHE,
        overlap: bool = True,
        prefetch: bool = True,
    ) -> None:
        spec = self.spec = model.cfg.kv_spec()
        self.P = spec.page_size
        self.name, self.model, self.use_cache = name, model, use_cache
        self.overlap, self.prefetch_on_queue = overlap, prefetch
        self.device = model.device
        l1_pages = l1_tokens // self.P
        if l1_pages < 1:
            raise ConfigError(f"l1_tokens {l1_tokens} must hold at least one page of {self.P} tokens")
        self.bufs = model.new_l1(l1_pages * self.P)
        if use_cache and cache.copy_process and self.device.type == "cpu":  # the copy process writes L1 too
            self.bufs = [b.share_memory_() for b in self.bufs]
        pin = "auto" if self.device.type == "cuda" else "never"
        self._ids = itertools.count()
        self.stack: CacheStack | None = None
        self.pool: HostKVPool | None = None  # the no-cache instance has none (nothing is cached)
        if use_cache:
            self.stack = build(
                L1(self.bufs, self.P), spec, l2_tokens=l2_tokens, l2_layout=l2_layout, pin=pin, cache=cache,  # type: ignore[arg-type]
                store=l3.store if l3 else None, namespace=l3.namespace if l3 else None,
                metadata=l3.metadata if l3 else None, client_id=f"demo-{name}",
            )  # fmt: skip
            self.pool = self.stack.pool
        self.cache: TieredCache | None = self.stack.cache if self.stack else None
        self.l3: L3Client | None = self.stack.l3 if self.stack else None

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    def _slots(self, l1_pages: np.ndarray) -> torch.Tensor:
        return page_slots(l1_pages, self.P)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def arrive(self, tokens: np.ndarray) -> Queued:
        """The request is queued on this instance: match it (pins its L1/L2 hit) and start the
        L3 -> L2 prefetch of its L3 hit, as an engine's scheduler does on arrival."""
        n = int(tokens.size)
        if n < 1:
            raise ValueError("a request needs at least one token")
        rid = f"{self.name}-{next(self._ids)}"
        t0 = time.perf_counter()
        if self.cache is None:
            return Queued(rid, tokens, [], None, 0.0)
        hs = page_hashes(tokens, self.P)
        m = self.cache.match(rid, hs, max_hit=(n - 1) // self.P)  # the last token is always computed
        per = getattr(self.model, "align", self.P) // self.P  # hits used up to a chunk boundary (hf.py)
        while per > 1 and m.hit_pages % per:
            self.cache.release(rid)
            m = self.cache.match(rid, hs, max_hit=m.hit_pages // per * per)
        if self.prefetch_on_queue:
            self.cache.prefetch(m)
        return Queued(rid, tokens, hs, m, time.perf_counter() - t0)

    def prefill(self, req: Queued | np.ndarray, hold: bool = False, keep: bool = False) -> Record:
        """Schedule the request (arrive() first when given tokens): load, compute, commit. With
        `hold` the request stays active (its L1 pages pinned, e.g. for page_digests) until
        release(rec). With `keep` the record's `consumed` holds the KV tensors its last chunk's
        layers read (verification; references, no copy)."""
        q = req if isinstance(req, Queued) else self.arrive(req)
        P, n = self.P, int(q.tokens.size)
        rec = Record(self.name, n, n // P, request_id=q.request_id, hashes=q.hashes, lookup_s=q.lookup_s,
                     consumed=[] if keep else None)  # fmt: skip
        try:
            if self.cache is None or q.match is None:
                self._compute_uncached(q, rec)
            else:
                self._compute_cached(self.cache, q, q.match, rec)
        except BaseException:
            if self.cache is not None and q.match is not None:
                self.cache.release(q.request_id)
            raise
        if not hold:
            self.release(rec)
        return rec

    def _compute_uncached(self, q: Queued, rec: Record) -> None:
        n = rec.tokens
        pages = -(-n // self.P)
        if pages * self.P > self.bufs[0].shape[0]:
            raise ConfigError(f"cache too small: a request of {n} tokens needs {pages} L1 pages")
        t0 = time.perf_counter()
        rec.l1_pages = np.arange(pages, dtype=np.int64)
        rec.logits = self.model.prefill(q.tokens, 0, self._slots(rec.l1_pages).to(self.device), self.bufs,
                                        keep=rec.consumed)  # fmt: skip
        self._sync()
        rec.compute_s = rec.prefill_s = time.perf_counter() - t0
        rec.computed_tokens = n

    def _compute_cached(self, cache: TieredCache, q: Queued, m: Match, rec: Record) -> None:
        P, n = self.P, rec.tokens
        st0 = cache.stats()
        t0 = time.perf_counter()
        try:
            h: LoadHandle = cache.load(m, total_pages=-(-n // P))
        except CacheFull as e:
            raise ConfigError(f"cache too small: {e}") from None
        t1 = time.perf_counter()
        slots = h.slots.to(self.device)
        if self.overlap:
            logits = self.model.prefill(q.tokens, h.hit_pages * P, slots, self.bufs, before_layer=h.wait_layer,
                                        keep=rec.consumed)  # fmt: skip
        else:
            h.wait()
            logits = self.model.prefill(q.tokens, h.hit_pages * P, slots, self.bufs, keep=rec.consumed)
        self._sync()
        t2 = time.perf_counter()
        k = self.committable(n)  # pages of a partial last chunk are not cached (hf.py: exactness)
        cache.commit(q.request_id, q.hashes[:k], h.l1_pages[:k])
        rec.prefill_s = time.perf_counter() - t0
        st1 = cache.stats()
        rec.logits, rec.l1_pages = logits, h.l1_pages
        rec.hit_l1, rec.hit_l2, rec.hit_l3 = h.l1, h.l2, h.l3
        rec.computed_tokens = n - h.hit_pages * P
        rec.l3_get_s, rec.l3_get_bytes = h.l3_wait_s, h.l3 * self.page_bytes
        rec.load_s, rec.load_bytes = h.wait_s, h.loaded_bytes
        rec.compute_s = max(0.0, (t2 - t1) - h.wait_s)
        rec.backup_bytes = st1["d2h_bytes"] - st0["d2h_bytes"]
        rec.put_bytes = st1["l3_put_bytes"] - st0["l3_put_bytes"]

    def recompute(self, rec: Record, tokens: np.ndarray) -> torch.Tensor:
        """(Verification) The held request's computed suffix again, on its own L1 pages and slots
        (the bytes its load left there), with no load in flight: the forward pass's inputs exactly
        as the request's own prefill saw them once every copy had landed."""
        assert rec.l1_pages is not None
        start = rec.hit_pages * self.P
        out = self.model.prefill(tokens, start, self._slots(rec.l1_pages).to(self.device), self.bufs)
        self._sync()
        return out

    def committable(self, n: int) -> int:
        """Full pages of an n-token request that the cache may keep: those in whole alignment
        units (chunks) of the model; every page for the reference model (align = page)."""
        a = getattr(self.model, "align", self.P)
        return n // a * a // self.P

    def release(self, rec: Record) -> None:
        """The request is done: its uncommitted L1 pages go back to the cache."""
        if self.cache is not None:
            self.cache.release(rec.request_id)

    def page_digests(self, rec: Record, upto: int) -> list[bytes]:
        """A 128-bit checksum of each of the first `upto` full pages' KV bytes in L1 (all layers),
        computed where the KV lives: per buffer, the page's int32 words times two fixed odd
        weight vectors, summed mod 2^64 (any changed word changes both sums). The request must
        still be held (prefill(..., hold=True))."""
        assert rec.l1_pages is not None
        slots = self._slots(rec.l1_pages[:upto]).to(self.device)
        sums = []
        for b in self.bufs:
            x = b[slots].reshape(upto, -1).view(torch.int32).to(torch.int64)
            w = self._weights(x.shape[1])
            sums.append((x[:, :, None] * w[None]).sum(dim=1))  # [upto, 2], wraps mod 2^64
        allb = torch.cat(sums, dim=1).cpu().numpy()
        return [hashlib.blake2b(allb[i].tobytes(), digest_size=16).digest() for i in range(upto)]

    def _weights(self, n: int) -> torch.Tensor:
        w = getattr(self, "_w", None)
        if w is None or w.shape[0] != n:
            g = torch.Generator().manual_seed(n)
            w = (torch.randint(0, 2**31 - 1, (n, 2), generator=g, dtype=torch.int64) * 2 + 1).to(self.device)
            self._w = w
        return w

    def flush(self) -> None:
        """Wait for the background backups (L1 -> L2, L2 -> L3); raise their errors."""
        if self.cache is not None:
            self.cache.flush(timeout=120.0)

    def stats(self) -> dict[str, object]:
        return self.cache.stats() if self.cache is not None else {}

    def close(self) -> None:
        """Close the cache and free this instance's L1 (GPU) buffers now. The controller's roles
        hold bound methods of each other (reference cycles) and the stack's L1 holds the buffers,
        so they would otherwise wait for Python's next full collection: on the H200 the demo's
        closed instances (5.2 GB of L1 each for llama-8b) filled the GPU before it ran. (The L2
        pool is unmapped by the stack's own close.)"""
        stack, self.stack = self.stack, None
        self.cache = self.pool = self.l3 = None
        self.bufs = []
        try:
            if stack is not None:
                stack.close()
        finally:
            del stack
            gc.collect()
