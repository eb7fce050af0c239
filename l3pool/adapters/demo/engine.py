"""A prefill instance of the demo's reference engine: L1 (device KV) + L2 (l2core pool) + L3.

    eng = PrefillInstance("a", model, l1_tokens=..., l2_tokens=..., l3=L3Side(store, ns))
    rec = eng.prefill(tokens)         # timed: match L1 -> L2 -> L3, load, compute the misses
    eng.backup(rec)                   # after the request, as a backup thread would: L1 -> L2 -> L3

Matching is by chained page hash (l3pool.pool.keys.page_hashes): the longest prefix in L1, then its
continuation in L2, then in L3 (`L3Client.lookup` + `get` into freshly allocated L2 pages; only
the leading run of pages that arrived intact counts). At least the last token is always computed,
so the engine returns logits. Hits move L3 -> L2 -> L1 with l2core's batched scatter, all layers in
one call; the miss pages are computed by the model straight into L1. `backup` writes the newly
computed full pages L1 -> L2 (one batched gather) and L2 -> L3 (`put`, which skips pages already
present). Both caches evict least-recently-used pages that the current request does not use.

The index structures (hash -> page dicts) are per page, like a radix tree; the byte movement is
one batched call per tier per request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from l2core import ops
from l2core.allocator import PageAllocator
from l2core.pool import HostKVPool, L2Config
from l2core.spec import ConfigError
from l3pool.adapters.demo.model import RefModel
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, Outcome


@dataclass
class Record:
    """One prefill: what hit where, what moved, how long it took."""

    instance: str
    tokens: int
    pages: int  # full pages of the prompt
    hit_l1: int = 0  # pages
    hit_l2: int = 0
    hit_l3: int = 0
    computed_tokens: int = 0
    prefill_s: float = 0.0
    lookup_s: float = 0.0  # hashing + L1/L2 index + L3 lookup
    l3_get_s: float = 0.0
    l3_get_bytes: int = 0
    load_s: float = 0.0  # L2 -> L1
    load_bytes: int = 0
    compute_s: float = 0.0
    backup_s: float = 0.0  # L1 -> L2 (after the request)
    backup_bytes: int = 0
    put_s: float = 0.0  # L2 -> L3 (after the request)
    put_bytes: int = 0
    logits: torch.Tensor | None = field(default=None, repr=False)
    # kept for backup/verification, dropped by the runner afterwards
    hashes: list[bytes] = field(default_factory=list, repr=False)
    l1_pages: np.ndarray | None = field(default=None, repr=False)

    @property
    def hit_pages(self) -> int:
        return self.hit_l1 + self.hit_l2 + self.hit_l3

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
    metadata: object = None


class _PageCache:
    """hash -> page with LRU order over an allocator; pages in `pinned` are never evicted."""

    def __init__(self, num_pages: int) -> None:
        self.alloc_ = PageAllocator(num_pages)
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.evicted = 0

    def match(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        n = start
        while n < stop and hashes[n] in self.index:
            self.index.move_to_end(hashes[n])
            n += 1
        return n

    def pages_of(self, hashes: Sequence[bytes]) -> np.ndarray:
        return np.fromiter((self.index[h] for h in hashes), dtype=np.int64, count=len(hashes))

    def alloc(self, n: int, pinned: set[int]) -> np.ndarray:
        short = n - self.alloc_.free_pages
        if short > 0:
            victims = []
            for h, p in self.index.items():
                if p not in pinned:
                    victims.append(h)
                    if len(victims) == short:
                        break
            if len(victims) < short:
                raise ConfigError(f"cache too small: need {n} pages, {len(pinned)} in use by this request")
            self.alloc_.free(np.fromiter((self.index.pop(h) for h in victims), dtype=np.int64, count=short))
            self.evicted += short
        return self.alloc_.alloc(n)

    def insert(self, hashes: Sequence[bytes], pages: np.ndarray) -> None:
        """Index `pages` under `hashes`; a page an entry pointed to before goes back to the free list."""
        old = [q for h, p in zip(hashes, pages.tolist(), strict=True) if (q := self.index.pop(h, p)) != p]
        self.index.update(zip(hashes, pages.tolist(), strict=True))
        if old:
            self.alloc_.free(np.asarray(old, dtype=np.int64))


class PrefillInstance:
    def __init__(
        self,
        name: str,
        model: RefModel,
        *,
        l1_tokens: int,
        l2_tokens: int,
        l2_layout: str = "page_first_direct",
        l3: L3Side | None = None,
        use_cache: bool = True,
    ) -> None:
        spec = model.cfg.kv_spec()
        self.P = spec.page_size
        self.name, self.model, self.use_cache = name, model, use_cache
        self.device = model.device
        l1_pages = l1_tokens // self.P
        self.l1 = _PageCache(l1_pages)
        self.bufs = model.new_l1(l1_pages * self.P)
        pin = "auto" if self.device.type == "cuda" else "never"
        self.pool = HostKVPool(L2Config(kv=spec, layout=l2_layout, tokens=l2_tokens, pin=pin))  # type: ignore[arg-type]
        self.l2 = _PageCache(self.pool.num_pages)
        self.l3: L3Client | None = None
        self.keys_of: Namespace | None = None
        if l3 is not None and use_cache:
            self.l3 = L3Client(self.pool, l3.store, l3.namespace, metadata=l3.metadata, client_id=f"demo-{name}")
            self.keys_of = l3.namespace

    @property
    def page_bytes(self) -> int:
        return self.pool.layout.page_bytes

    def _slots(self, l1_pages: np.ndarray) -> torch.Tensor:
        p = torch.from_numpy(l1_pages)
        return (p[:, None] * self.P + torch.arange(self.P)[None, :]).reshape(-1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prefill(self, tokens: np.ndarray) -> Record:
        P, n = self.P, int(tokens.size)
        t0 = time.perf_counter()
        hashes = page_hashes(tokens, P) if self.use_cache else []
        full = n // P
        rec = Record(self.name, n, full, hashes=hashes)
        usable = (n - 1) // P if self.use_cache else 0  # at least one token is computed
        n1 = self.l1.match(hashes, 0, usable)
        n2 = self.l2.match(hashes, n1, usable)
        l2_pinned = set(self.l2.pages_of(hashes[n1:n2]).tolist())
        keys = self.keys_of.keys(hashes[n2:usable]) if self.l3 is not None and self.keys_of is not None else []
        found = self.l3.lookup(keys) if self.l3 is not None and keys else 0
        rec.lookup_s = time.perf_counter() - t0
        n3 = n2
        if found:
            t = time.perf_counter()
            got = self.l2.alloc(found, l2_pinned)
            try:
                res = self.l3.get(keys[:found], got) if self.l3 is not None else []
            except BaseException:
                self.l2.alloc_.free(got)  # nothing leaks when the pool errs
                raise
            ok = 0
            while ok < len(res) and res[ok] is Outcome.OK:
                ok += 1
            self.l2.insert(hashes[n2 : n2 + ok], got[:ok])
            self.l2.alloc_.free(got[ok:])
            l2_pinned.update(got[:ok].tolist())
            n3 = n2 + ok
            rec.l3_get_s = time.perf_counter() - t
            rec.l3_get_bytes = ok * self.page_bytes
        rec.hit_l1, rec.hit_l2, rec.hit_l3 = n1, n2 - n1, n3 - n2
        # L1 pages: hits stay where they are; loaded and new pages get fresh ones
        hit_l1_pages = self.l1.pages_of(hashes[:n1])
        total_pages = -(-n // P)
        fresh = self.l1.alloc(total_pages - n1, set(hit_l1_pages.tolist()))
        l1_pages = np.concatenate([hit_l1_pages, fresh])
        slots = self._slots(l1_pages)
        if n3 > n1:
            t = time.perf_counter()
            src = self.l2.pages_of(hashes[n1:n3])
            ops.scatter_to_device(
                self.bufs, slots[n1 * P : n3 * P], self.pool.buffer, torch.from_numpy(src), self.pool.layout
            )
            self._sync()
            rec.load_s = time.perf_counter() - t
            rec.load_bytes = (n3 - n1) * self.page_bytes
        t = time.perf_counter()
        rec.logits = self.model.prefill(tokens, n3 * P, slots.to(self.device), self.bufs)
        self._sync()
        rec.compute_s = time.perf_counter() - t
        rec.computed_tokens = n - n3 * P
        rec.prefill_s = time.perf_counter() - t0
        # full pages become L1-cached (the loaded ones too); the partial last page is released
        if self.use_cache:
            self.l1.insert(hashes[n1:full], l1_pages[n1:full])
        rec.l1_pages = l1_pages
        self.l1.alloc_.free(l1_pages[full:] if self.use_cache else l1_pages)
        return rec

    def backup(self, rec: Record) -> None:
        """Write-through of the pages this request computed: L1 -> L2 (one batched gather), then
        L2 -> L3 (`put` skips keys already present)."""
        if not self.use_cache or rec.l1_pages is None or rec.pages <= rec.hit_pages:
            return
        first, full = rec.hit_pages, rec.pages
        hs = rec.hashes[first:full]
        missing = [i for i, h in enumerate(hs) if h not in self.l2.index]
        if missing:
            t = time.perf_counter()
            present = [h for h in hs if h in self.l2.index]
            dst = self.l2.alloc(len(missing), set(self.l2.pages_of(present).tolist()))
            src = rec.l1_pages[first:full][np.asarray(missing, dtype=np.int64)]
            ops.gather_to_host(self.bufs, self._slots(src), self.pool.buffer, torch.from_numpy(dst), self.pool.layout)
            self._sync()
            self.l2.insert([hs[i] for i in missing], dst)
            rec.backup_s = time.perf_counter() - t
            rec.backup_bytes = len(missing) * self.page_bytes
        if self.l3 is not None and self.keys_of is not None:
            t = time.perf_counter()
            res = self.l3.put(self.keys_of.keys(hs), self.l2.pages_of(hs))
            rec.put_s = time.perf_counter() - t
            rec.put_bytes = sum(r is Outcome.OK for r in res) * self.page_bytes

    def page_digests(self, rec: Record, upto: int) -> list[bytes]:
        """blake2b of each of the first `upto` full pages' KV bytes in L1 (all layers)."""
        import hashlib

        assert rec.l1_pages is not None
        slots = self._slots(rec.l1_pages[:upto]).to(self.device)
        per = [b[slots].reshape(upto, -1).view(torch.uint8).cpu() for b in self.bufs]  # verification only
        allb = torch.cat(per, dim=1).numpy()
        return [hashlib.blake2b(allb[i].tobytes(), digest_size=16).digest() for i in range(upto)]

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.close()
        self.pool.close()
