"""A tiny engine around TieredCache for the cache tests: deterministic page contents per page hash,
"compute" = writing those contents into L1, and checks that every hit page holds its bytes."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from l2core import KVSpec
from l2core.l1 import kv_buffers
from l3pool.cache import L1, CacheConfig, LoadHandle, Match, build
from l3pool.pool.keys import Namespace, hash_keys, page_hashes

P = 4  # tokens per page
LAYERS = 3
SPEC = KVSpec.mla(LAYERS, page_size=P, kv_lora_rank=28, rope_dim=4)  # 32 elems, 64 B items, 768 B pages
D = SPEC.dim


def chain(seed: int, pages: int, prefix: list[bytes] | None = None) -> list[bytes]:
    """Page hashes of `pages` pages, continuing `prefix` when given."""
    toks = np.random.default_rng(seed).integers(0, 1 << 30, pages * P)
    parent = prefix[-1] if prefix else b""
    return (prefix or []) + page_hashes(toks, P, parent=parent)


def contents(hs: list[bytes]) -> torch.Tensor:
    """[layers, pages, P, 1, D] bf16 values derived from each page hash (integers < 256: exact)."""
    base = np.asarray(hash_keys(hs), dtype=np.uint64) % np.uint64(1000003)
    lay = np.arange(LAYERS)[:, None, None, None, None] * 7
    tok = np.arange(P)[None, None, :, None, None] * 13
    dim = np.arange(D)[None, None, None, None, :]
    v = (base.astype(np.int64)[None, :, None, None, None] + lay + tok + dim) % 251
    return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)


class Engine:
    def __init__(
        self,
        cfg: CacheConfig | None = None,
        l1_pages: int = 16,
        l2_pages: int = 32,
        store: object | None = None,
        tenant: str = "t",
        layout: str = "page_first_direct",
        layers: tuple[int, int] | None = None,
        locks: object | None = None,
        **build_kw: Any,
    ) -> None:
        self.bufs = kv_buffers(SPEC, l1_pages * P, "cpu")
        if cfg is not None and cfg.copy_process:  # the copy process writes L1: CPU buffers in shared memory
            self.bufs = [b.share_memory_() for b in self.bufs]
        ns = None if store is None else Namespace.for_pool(SPEC, layout, "cachetest", layers=layers, tenant=tenant)
        self.stack = build(
            L1(self.bufs, P), SPEC, l2_tokens=l2_pages * P, l2_layout=layout, pin="never", cache=cfg,
            store=store, namespace=ns, batch_pages=512, locks=locks, **build_kw,  # type: ignore[arg-type]
        )  # fmt: skip
        self.pool, self.l3, self.cache = self.stack.pool, self.stack.l3, self.stack.cache

    def poison_free_l1(self) -> None:
        """NaN into every unallocated L1 page (under the cache's lock, which every L1 allocation
        holds: concurrent requests allocate either before, and are skipped, or after, and
        overwrite it)."""
        with self.cache._mu, self.cache.plan.l1_alloc.holding_free() as free:
            s = self.cache.slots(free)
            for b in self.bufs:
                b[s] = float("nan")

    def poison_free_l2(self) -> None:
        """0xEE into every unallocated L2 page, under the pool allocator's own lock. The cache's
        lock is not enough: the Prefetcher allocates L2 pages outside it, and a poison written
        between its reading of the free pages and its writing overwrote pages a prefetch had
        just filled (test_pp_stages_load_equal_page_counts, 1 of 30 runs under load: all 0xEE).
        With the allocator held, an allocation comes before (skipped) or after (its get
        overwrites the poison), so concurrent requests may poison too."""
        self.pool.fill_free(0xEE)

    def l1_of(self, pages: np.ndarray) -> torch.Tensor:
        s = self.cache.slots(pages)
        return torch.stack([b[s].view(len(pages), P, 1, D) for b in self.bufs])

    def compute(self, hs: list[bytes], pages: np.ndarray) -> None:
        s = self.cache.slots(pages)
        c = contents(hs)
        for i, b in enumerate(self.bufs):
            b[s] = c[i].reshape(-1, 1, D)

    def start(self, rid: str, hs: list[bytes], prefetch: bool = True, think_s: float = 0.0) -> tuple[Match, LoadHandle]:
        m = self.cache.match(rid, hs)
        if prefetch:
            self.cache.prefetch(m)
        if think_s:
            time.sleep(think_s)  # queued: the prefetch runs on (load() interrupts it by policy)
        self.poison_free_l1()
        self.poison_free_l2()
        h = self.cache.load(m, total_pages=len(hs))
        return m, h

    def run(
        self, rid: str, hs: list[bytes], *, release: bool = True, prefetch: bool = True, think_s: float = 0.0
    ) -> Match:
        """One request: match, (prefetch, `think_s` queued), load, check the hit bytes, compute
        the rest, commit, release."""
        m, h = self.start(rid, hs, prefetch, think_s)
        for i in range(LAYERS):
            h.wait_layer(i)
        hit = h.hit_pages
        if hit:
            got = self.l1_of(h.l1_pages[:hit])
            assert torch.equal(got, contents(hs[:hit])), f"{rid}: wrong bytes in the {hit} hit pages"
        self.compute(hs[hit:], h.l1_pages[hit:])
        self.cache.commit(rid, hs, h.l1_pages)
        if release:
            self.cache.release(rid)
        return m

    def used(self) -> tuple[int, int]:
        """(L1, L2) pages allocated and not cached after a flush(): 0 when no request is active."""
        c = self.cache
        c.flush()
        c.t1.check()
        c.t2.check()
        return (
            c.plan.l1_alloc.used_pages - int(c.t1.cached.sum()),
            self.pool.allocator.used_pages - int(c.t2.cached.sum()),
        )

    def close(self) -> None:
        self.stack.close()
