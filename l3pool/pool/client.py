"""Prefill-side L3 client: moves pages between an l2core host pool and the Mooncake pool.

    store = MooncakeStore(StoreConfig(master=..., metadata=..., local_hostname=...))
    ns = Namespace.for_pool(pool.spec, pool.layout.name, model="glm5-abc123")
    l3 = L3Client(pool, store, ns, metadata=md)
    keys = ns.keys(page_hashes(token_ids, page_size))
    n = l3.lookup(keys)                       # longest prefix present in L3
    res = l3.get(keys[:n], l2_pages[:n])      # per-page Outcome
    res = l3.put(keys, l2_pages)              # skips keys already present

Zero-copy: the whole pool buffer is registered with Mooncake once; page-first pages move straight
from/into their L2 bytes (one fragment per page, or K and V for MHA). layer_first pages are
`L` fragments each (`layer_first_mode="multi"`, Mooncake's multi-buffer calls) or are gathered
into a bounded, registered staging area first (`"staging"`, one vectorised copy per batch).

Key-bound objects (always on): every stored object is the page's bytes followed by a 32-byte
trailer (`TRAILER`: magic, FORMAT_VERSION, flags, page length, xxh3-64 of the full key
`ns_id/pagehash`, and the xxh3-64 of the page bytes when the namespace has `checksum`). The
trailer is one more fragment of the same Mooncake call, from a small registered area, so pages
still move zero-copy. A get counts a page as OK only after its trailer names exactly this key,
format and length (else MISS + `trailer_rejections`; an object of another size, e.g. one written
without a trailer, is the same) and, with checksums on, its bytes hash to the stored checksum
(else MISS + `checksum_failures`). So a complete object of another key — copied under this key,
or found where a reader's stale replica descriptor pointed after a master restart — is never
returned as a hit. A torn object (bytes of two writers in one place) is only caught with checksums.

Puts tell the truth: a page counts as OK only if its key is readable when `put` returns.
Mooncake's `batch_put_from*` answer a put of a key that another put started and never finished
(a writer killed mid-put) with success, without writing. So a batch is: one `exists` query (keys
already complete are skipped: OK, not written again), one `batch_put_from_multi_buffers` call
for the rest, and one `exists` query of the keys that call answered with success; a key not
complete then is `Outcome.PENDING` (retryable), never OK. (Mooncake's put sessions report such
keys directly, but their ranged transfer measured 0.75-0.86 of a plain put on the H200; the
three calls measure 0.87-1.06.) Abandoned objects are reclaimed by the master's
`--put_start_discard_timeout_sec` / `--put_start_release_timeout_sec` (l3pool/README.md, "Puts
tell the truth").

A full pool: Mooncake refuses what it cannot place (POOL_FULL) and wakes its eviction thread
(every 10 ms, >= `--eviction_ratio` of the pool per round, of objects whose read leases expired),
so the refused pages are put again every 20 ms for up to `pool_full_retry_s` (default 0.1 s per
put() call, all its batches together; 0: never) — a cache's pool is always nearly full, and a
burst larger than its free space would otherwise be dropped. `stats.put_full_retries` counts the
pages put again.

Thread-safe: one client may be shared by several threads. Each call takes one of up to
`max_concurrency` buffer slots (trailer rows, and a staging area in layer_first staging mode),
so concurrent calls never share a buffer; more concurrent calls wait for a slot.

Every call returns one `Outcome` per page. A failed get (miss, dead donor, rejected trailer,
checksum mismatch) is never OK: the page's L2 bytes must then be treated as garbage by the caller,
which only uses the leading run of OK pages.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from l2core.pool import HostKVPool
from l2core.spec import ConfigError
from l2core.units import check_int
from l3pool import metrics
from l3pool.pool.keys import FORMAT_VERSION, GEOMETRY_FIELDS, Namespace, geometry_of
from l3pool.pool.protocols import ClientStats, NamespaceRegistry, Outcome, PageStore
from l3pool.pool.trailer import FLAG_CHECKSUM, TRAILER, TRAILER_BYTES, TRAILER_MAGIC, object_bytes
from l3pool.pool.transfers import TRANSFER_LIMIT_ENV

log = logging.getLogger(__name__)

LayerFirstMode = Literal["multi", "staging"]
_FULL_RETRY_PAUSE_S = 0.02  # between puts into a full pool: two rounds of Mooncake's eviction thread (10 ms)


_FAILURES = [o for o in Outcome if o is not Outcome.OK]


def tally(res: list[Outcome]) -> list[tuple[str, int]]:
    """(outcome value, pages) for each outcome present in `res`: one C-level `list.count` per
    outcome, stopping once every page is counted (an all-OK batch is one pass)."""
    ok = res.count(Outcome.OK)
    out = [(Outcome.OK.value, ok)] if ok else []
    left = len(res) - ok
    for o in _FAILURES:
        if not left:
            break
        c = res.count(o)
        if c:
            out.append((o.value, c))
            left -= c
    return out


# content checksums of a batch are split over threads above this many bytes (xxh3 releases the GIL)
_PARALLEL_MIN_BYTES = 8 << 20
_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def key_digest(key: str) -> int:
    """The trailer's key field: xxh3-64 of the full key."""
    return xxhash.xxh3_64_intdigest(key.encode())


def key_digests(keys: Sequence[str]) -> np.ndarray:
    return np.fromiter((xxhash.xxh3_64_intdigest(k.encode()) for k in keys), dtype=np.uint64, count=len(keys))


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(max_workers=_hash_workers(), thread_name_prefix="l3pool-xxh3")
        return _hash_pool


def page_checksums(flat: np.ndarray, base: int, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """xxh3-64 of each page's bytes, its runs hashed in order (= the stored object's page bytes).

    `flat` is a uint8 view of the memory starting at address `base`; `addrs`/`sizes` are the
    absolute [pages, runs] runs. Large batches are split over a thread pool."""
    n = addrs.shape[0]
    out = np.empty(n, dtype=np.uint64)
    offs, lens = (addrs - base).tolist(), sizes.tolist()

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            o, s = offs[i], lens[i]
            if len(o) == 1:
                out[i] = xxhash.xxh3_64_intdigest(flat[o[0] : o[0] + s[0]].data)
            else:
                h = xxhash.xxh3_64()
                for a, b in zip(o, s, strict=True):
                    h.update(flat[a : a + b].data)
                out[i] = h.intdigest()

    total = int(sizes.sum()) if n else 0
    w = _hash_workers()
    if w > 1 and n > 1 and total >= _PARALLEL_MIN_BYTES:
        k = min(w, n)
        bounds = [(j * n // k, (j + 1) * n // k) for j in range(k)]
        for f in [_executor().submit(run, lo, hi) for lo, hi in bounds]:
            f.result()
    else:
        run(0, n)
    return out


class _Slot:
    """The buffers of one in-flight call: trailer rows (and a staging area)."""

    __slots__ = ("index", "staging", "trailers")

    def __init__(self, index: int, trailers: np.ndarray, staging: torch.Tensor | None) -> None:
        self.index, self.trailers, self.staging = index, trailers, staging


class L3Client:
    def __init__(
        self,
        pool: HostKVPool,
        store: PageStore,
        namespace: Namespace,
        *,
        metadata: NamespaceRegistry | None = None,
        batch_pages: int = 64,
        layer_first_mode: LayerFirstMode = "multi",
        client_id: str | None = None,
        stats_interval: float = 5.0,
        stats_ttl: int = 30,
        create_namespace: bool = True,
        max_concurrency: int = 8,
        pool_full_retry_s: float = 0.1,
    ) -> None:
        ns, lay, spec = namespace, pool.layout, pool.spec
        geo = geometry_of(spec)
        mismatch = [
            f"{name}: namespace {a!r} != pool {b!r}"
            for name, a, b in (
                ("layout", ns.layout, lay.name),
                ("dtype", ns.dtype, spec.dtype),
                ("attention", ns.attention, spec.attention),
                ("page_size", ns.page_size, spec.page_size),
                ("page_bytes", ns.page_bytes, lay.page_bytes),
                ("layers", ns.layer_end - ns.layer_begin, spec.num_layers),
                *((f, getattr(ns, f), geo[f]) for f in GEOMETRY_FIELDS),
            )
            if a != b
        ]
        if ns.format_version != FORMAT_VERSION:
            mismatch.append(f"format_version: namespace {ns.format_version} != this client's {FORMAT_VERSION}")
        if mismatch:
            raise ConfigError("namespace does not describe this pool: " + "; ".join(mismatch))
        if store.tenant and store.tenant != ns.tenant:  # a Mooncake tenant holds only its own pages
            raise ConfigError(f"namespace tenant {ns.tenant!r} != the store's Mooncake tenant {store.tenant!r}")
        if batch_pages < 1:
            raise ConfigError("batch_pages must be >= 1")
        check_int("max_concurrency", max_concurrency, 1)
        if isinstance(pool_full_retry_s, bool) or not isinstance(pool_full_retry_s, int | float):
            raise ConfigError(f"pool_full_retry_s must be a number of seconds, got {pool_full_retry_s!r}")
        if not 0 <= pool_full_retry_s <= 60:
            raise ConfigError(f"pool_full_retry_s must be within [0, 60] s, got {pool_full_retry_s}")
        if layer_first_mode not in ("multi", "staging"):
            raise ConfigError(f"layer_first_mode must be 'multi' or 'staging', got {layer_first_mode!r}")
        self.pool, self.store, self.ns = pool, store, ns
        self.ns_id = ns.ns_id
        self._staged = lay.name == "layer_first" and layer_first_mode == "staging"
        # one Mooncake call moves every fragment of its pages (runs + trailer): a batch never holds
        # more than the store lets be in flight (l3pool.pool.transfers), or it would fail or hang
        self.fragments_per_page = (1 if self._staged else lay.runs_per_page) + 1
        limit = store.max_transfers
        if self.fragments_per_page > limit:
            raise ConfigError(
                f"a {lay.name} page is {self.fragments_per_page} transfer fragments, over the {limit} "
                f"Mooncake lets be in flight ({TRANSFER_LIMIT_ENV}): use layer_first_mode='staging' or raise it"
            )
        self.batch_pages = min(batch_pages, limit // self.fragments_per_page)
        if self.batch_pages < batch_pages:
            log.info(
                "L3Client: batch_pages %d -> %d (%d fragments per page, %d in flight at most)",
                batch_pages, self.batch_pages, self.fragments_per_page, limit,
            )  # fmt: skip
        self.max_concurrency = max_concurrency
        self.pool_full_retry_s = float(pool_full_retry_s)
        self.stats = ClientStats()
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()  # stats
        self._flags = FLAG_CHECKSUM if ns.checksum else 0
        self._registered: list[int] = []  # only what this client registered (and must unregister)
        self.metadata = metadata
        self.reregistrations = 0  # namespace records written again after etcd lost them
        self._stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        self._slot_lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        # trailer rows of every slot: one small registered area (batch_pages x 32 B per slot)
        self._trailers = np.zeros((max_concurrency, self.batch_pages), dtype=TRAILER)
        try:  # whatever fails from here on, nothing this client registered stays registered
            self._register(pool.buffer.data_ptr(), pool.buffer.numel())
            self._register(self._trailers.ctypes.data, self._trailers.nbytes)
            self._free.put(self._new_slot())
            if metadata is not None:
                self._attach(metadata, create_namespace, stats_interval, stats_ttl)
        except BaseException:
            self.close()
            raise

    def _register(self, ptr: int, nbytes: int) -> None:
        self.store.register(ptr, nbytes)
        self._registered.append(ptr)

    def _attach(self, metadata: NamespaceRegistry, create: bool, interval: float, ttl: int) -> None:
        """Find (or register) this client's namespace in etcd and start publishing stats."""
        ns = self.ns
        if not create and metadata.namespace(self.ns_id) is None:
            raise ConfigError(
                f"unknown namespace {self.ns_id} ({ns.model}, {ns.layout}, {ns.dtype}, page {ns.page_size}): "
                "no writer has registered it in etcd"
            )
        stored = metadata.register_namespace(self.ns_id, ns.record())
        if stored != ns.record():
            raise ConfigError(f"namespace id {self.ns_id} is registered with a different record: {stored}")
        self._stats_thread = threading.Thread(
            target=self._publish_loop, args=(interval, ttl), name="l3pool-stats", daemon=True
        )
        self._stats_thread.start()

    @property
    def staging_bytes(self) -> int:
        """Bytes of one bounded staging area (layer_first staging mode only; else 0). There is
        one per concurrent call, up to `max_concurrency`, made on first use."""
        return self.batch_pages * self.pool.layout.page_bytes if self._staged else 0

    # -- buffer slots ------------------------------------------------------------------------
    def _new_slot(self) -> _Slot:
        """Called with at most one slot per index; registers its staging area (if any)."""
        i = len(self._slots)
        staging = None
        if self._staged:
            staging = torch.empty(self.staging_bytes, dtype=torch.uint8)
            self._register(staging.data_ptr(), staging.numel())
        slot = _Slot(i, self._trailers[i], staging)
        self._slots.append(slot)
        return slot

    @contextlib.contextmanager
    def _slot(self) -> Iterator[_Slot]:
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            with self._slot_lock:
                fresh = self._new_slot() if len(self._slots) < self.max_concurrency else None
            slot = fresh if fresh is not None else self._free.get()
        try:
            yield slot
        finally:
            self._free.put(slot)

    # -- lookups -----------------------------------------------------------------------------
    @property
    def call_deadline_s(self) -> float | None:
        """The store's deadline for metadata calls (`StoreConfig.call_deadline_s`; None: none)."""
        return self.store.call_deadline_s

    def answering(self, deadline_s: float) -> bool:
        """Whether the store answers a one-key lookup within `deadline_s` now."""
        return self.store.answers(deadline_s)

    def lookup(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` present in L3 (stops at the first miss)."""
        n, acc, lat = 0, dict[str, int](), metrics.CLIENT_BATCH_SECONDS("exists")
        try:
            for b in range(0, len(keys), max(self.batch_pages, 512)):
                chunk = keys[b : b + max(self.batch_pages, 512)]
                t0 = time.perf_counter()
                res = self.store.exists(chunk)
                lat.observe(time.perf_counter() - t0)
                metrics.add_tally(acc, tally(res))
                k = next((i for i, r in enumerate(res) if r is not Outcome.OK), len(res))
                n += k
                if k < len(res):
                    break
        finally:
            metrics.count_pages("exists", acc, 0)
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += n
            self.stats.misses += int(n < len(keys))
        metrics.CLIENT_LOOKUPS.inc()
        if n:
            metrics.CLIENT_LOOKUP_HIT_PAGES.inc(n)
        return n

    # -- data --------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]:
        """Store L2 `pages` under `keys`. OK means readable now: stored by this call, or already
        present (skipped). A key whose earlier put has not finished — another writer's, or one
        whose writer was killed — is PENDING, never OK."""
        p = self._pages(keys, pages)
        out: list[Outcome] = []
        pb, acc, lat = self.pool.layout.page_bytes, dict[str, int](), metrics.CLIENT_BATCH_SECONDS("put")
        full_until: list[float] = []  # the retry deadline, set at this call's first full-pool answer
        try:
            for b in range(0, len(keys), self.batch_pages):
                ks, ps = list(keys[b : b + self.batch_pages]), p[b : b + self.batch_pages]
                t0 = time.perf_counter()
                with self._slot() as slot:
                    res, taken = self._put_batch(ks, ps, slot, full_until)
                lat.observe(time.perf_counter() - t0)
                counts = dict(tally(res))
                pending = counts.get(Outcome.PENDING.value, 0)
                skipped = taken.count(True) - pending  # another put held it: complete (OK) or PENDING
                stored = counts.pop(Outcome.OK.value, 0) - skipped
                # put's OK is two outcomes: stored now (ok), or already present (skipped)
                metrics.add_tally(acc, [("ok", stored), ("skipped", skipped), *counts.items()])
                with self._lock:
                    self.stats.puts += stored
                    self.stats.put_skipped += skipped
                    self.stats.put_pending += pending
                    self.stats.put_failed += len(ks) - stored - skipped - pending
                    self.stats.bytes_put += stored * pb
                out += res
        finally:
            metrics.count_pages("put", acc, acc.get("ok", 0) * pb)
        return out

    def get(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]:
        """Copy the objects `keys` into L2 `pages`; per-page outcome (OK, MISS, ...). OK only
        for an object whose trailer names this key (and whose checksum matches, if on)."""
        p = self._pages(keys, pages)
        out: list[Outcome] = []
        pb, acc, lat = self.pool.layout.page_bytes, dict[str, int](), metrics.CLIENT_BATCH_SECONDS("get")
        try:
            for b in range(0, len(keys), self.batch_pages):
                t0 = time.perf_counter()
                with self._slot() as slot:
                    res = self._get_batch(list(keys[b : b + self.batch_pages]), p[b : b + self.batch_pages], slot)
                lat.observe(time.perf_counter() - t0)
                counts = tally(res)
                metrics.add_tally(acc, counts)
                ok = counts[0][1] if counts and counts[0][0] == Outcome.OK.value else 0
                with self._lock:
                    self.stats.gets += ok
                    self.stats.get_failed += len(res) - ok
                    self.stats.bytes_got += ok * pb
                out += res
        finally:
            metrics.count_pages("get", acc, acc.get("ok", 0) * pb)
        return out

    def _pages(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> np.ndarray:
        p = np.asarray(pages)
        if p.size and p.dtype.kind not in "iu":
            raise TypeError(f"pages must be integers, got {p.dtype}")
        p = p.astype(np.int64).reshape(-1)
        if len(p) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(p)} pages")
        if p.size and (p.min() < 0 or p.max() >= self.pool.num_pages):
            raise IndexError(f"L2 page index out of range [0, {self.pool.num_pages})")
        prefix = self.ns.key_prefix
        if any(not k.startswith(prefix) for k in keys):
            raise ValueError(f"keys must belong to this client's namespace {self.ns_id}")
        return p

    def _runs(
        self, pages: np.ndarray, slot: _Slot, gather: bool
    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, list[list[int]], list[list[int]]]:
        """The object fragments of a batch: each page's runs (in L2, or in the slot's staging
        area, gathered there first when `gather`) followed by its trailer row.
        Returns (flat, base, addrs, sizes, frags, lens): `flat` a uint8 view of the memory at
        address `base` that holds the page runs `addrs`/`sizes` ([pages, runs])."""
        n, pb = len(pages), self.pool.layout.page_bytes
        if slot.staging is not None:
            st = slot.staging[: n * pb]
            if gather:
                v = self._page_view()
                st.view(n, v.shape[0], v.shape[1], v.shape[3]).copy_(
                    v.index_select(2, torch.from_numpy(pages)).permute(2, 0, 1, 3)
                )
            flat, base = st.numpy(), st.data_ptr()
            addrs = (base + pb * np.arange(n, dtype=np.int64))[:, None]
            sizes = np.full((n, 1), pb, dtype=np.int64)
        else:
            flat, base = self.pool.buffer.numpy(), self.pool.buffer.data_ptr()
            addrs, sizes = self.pool.page_runs(pages)
        t_addr = slot.trailers.ctypes.data + TRAILER_BYTES * np.arange(n, dtype=np.int64)
        frags = np.concatenate([addrs, t_addr[:, None]], axis=1).tolist()
        lens = np.concatenate([sizes, np.full((n, 1), TRAILER_BYTES, dtype=np.int64)], axis=1).tolist()
        return flat, base, addrs, sizes, frags, lens

    def _put_batch(
        self, keys: list[str], pages: np.ndarray, slot: _Slot, full_until: list[float]
    ) -> tuple[list[Outcome], list[bool]]:
        """One bounded batch: keys already complete are skipped (OK); the others go in one
        multi-buffer put of [page runs..., trailer]; of those the put answered with success, a
        key that is not complete right after is held by another, unfinished put (PENDING).
        Returns the outcomes and, per key, whether another put held it (skipped or pending)."""
        n, pb = len(keys), self.pool.layout.page_bytes
        taken: list[bool] = self.store.present(keys).tolist()  # unreachable: all False, the put says why
        res: list[Outcome] = [Outcome.OK] * n
        new = [i for i, t in enumerate(taken) if not t]
        if not new:
            return res, taken
        nk = [keys[i] for i in new]
        flat, base, addrs, sizes, frags, lens = self._runs(pages[new], slot, gather=True)
        tr = slot.trailers[: len(new)]
        tr["magic"], tr["version"], tr["flags"], tr["length"] = TRAILER_MAGIC, FORMAT_VERSION, self._flags, pb
        tr["key"] = key_digests(nk)
        tr["checksum"] = page_checksums(flat, base, addrs, sizes) if self._flags else 0
        put, retried = self._retry_full(nk, frags, lens, self.store.put_multi(nk, frags, lens), full_until)
        said_ok = [j for j, r in enumerate(put) if r is Outcome.OK]
        for i, r in zip(new, put, strict=True):
            res[i] = r
        if said_ok:  # success also means "another put holds the key": complete now, or not stored
            gone: list[int] = []
            for j, r in zip(said_ok, self.store.exists([nk[j] for j in said_ok]), strict=True):
                if r is Outcome.MISS and j in retried:  # the pool took it back at once: still full
                    res[new[j]] = Outcome.POOL_FULL
                elif r is Outcome.MISS:
                    gone.append(j)
                elif r is not Outcome.OK:
                    res[new[j]] = r  # unknown (master unreachable): not OK
            if gone:  # another writer's unfinished put (PENDING), or stored and evicted at once (full)
                for j, held in zip(gone, self.store.unfinished([nk[j] for j in gone]), strict=True):
                    if held is False:
                        res[new[j]] = Outcome.POOL_FULL
                    else:
                        res[new[j]], taken[new[j]] = Outcome.PENDING, True
        return res, taken

    def _retry_full(
        self,
        keys: list[str],
        frags: list[list[int]],
        lens: list[list[int]],
        put: list[Outcome],
        full_until: list[float],
    ) -> tuple[list[Outcome], frozenset[int]]:
        """Put again, every 20 ms until `pool_full_retry_s` after the first refusal of this put()
        call (one budget for all its batches), the pages a full pool refused.
        Mooncake answers a put it cannot place with NO_AVAILABLE_HANDLE (POOL_FULL) and wakes its
        eviction thread, which runs every 10 ms and frees at least `--eviction_ratio` (5 %) of the
        pool per round, of objects whose read leases expired: a burst larger than the free space
        (a cache's pool is always nearly full) lands over a few rounds instead of being dropped
        (measured: 60-page bursts into a full 2 x 64 MB pool, 10 pages per round). A pool full of
        leased objects can evict only the fresh ones (no read lease until our `exists`): a page a
        retry stored and that is gone right after is POOL_FULL, and the retries stop there, as
        further ones would only evict each other (measured without this check: 16 of 128 pages
        put into a full 48 MB pool stored and evicted at once). Returns the outcomes and the
        indices put again."""
        full = [j for j, r in enumerate(put) if r is Outcome.POOL_FULL]
        if not full or self.pool_full_retry_s <= 0:
            return put, frozenset()
        if not full_until:  # one budget per put() call, however many batches it has
            full_until.append(time.monotonic() + self.pool_full_retry_s)
        deadline, retried, tries = full_until[0], set(full), 0
        while full and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_FULL_RETRY_PAUSE_S, left))
            again = self.store.put_multi([keys[j] for j in full], [frags[j] for j in full], [lens[j] for j in full])
            tries += len(full)
            for j, r in zip(full, again, strict=True):
                put[j] = r
            landed = [j for j in full if put[j] is Outcome.OK]
            full = [j for j in full if put[j] is Outcome.POOL_FULL]
            there = self.store.exists([keys[j] for j in landed]) if landed else []
            gone = [j for j, e in zip(landed, there, strict=True) if e is Outcome.MISS]
            if gone:  # evicted as soon as stored: only fresh objects are evictable, retrying is futile
                for j in gone:
                    put[j] = Outcome.POOL_FULL
                full_until[0] = 0.0  # nor for the later batches of this call
                break
        with self._lock:
            self.stats.put_full_retries += tries
        return put, frozenset(retried)

    def _get_batch(self, keys: list[str], pages: np.ndarray, slot: _Slot) -> list[Outcome]:
        """One bounded batch (<= batch_pages) in one Mooncake call into [page runs..., trailer]."""
        flat, base, addrs, sizes, frags, lens = self._runs(pages, slot, gather=False)
        tr = slot.trailers[: len(keys)]
        tr.view(np.uint8)[:] = 0  # nothing stale from an earlier call can pass for this one's trailer
        digests = key_digests(keys)
        res = self.store.get_multi(keys, frags, lens)
        res = self._verify(keys, res, tr, digests, flat, base, addrs, sizes)
        if slot.staging is not None:
            ok = [i for i, r in enumerate(res) if r is Outcome.OK]
            if ok:  # scatter only pages that arrived intact
                n, pb, v = len(keys), self.pool.layout.page_bytes, self._page_view()
                st4 = slot.staging[: n * pb].view(n, v.shape[0], v.shape[1], v.shape[3])
                sel = torch.tensor(ok, dtype=torch.int64)
                v.index_copy_(2, torch.from_numpy(pages)[sel], st4.index_select(0, sel).permute(1, 2, 0, 3))
        return res

    def _verify(
        self,
        keys: list[str],
        res: list[Outcome],
        tr: np.ndarray,
        digests: np.ndarray,
        flat: np.ndarray,
        base: int,
        addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> list[Outcome]:
        """A page is OK only if Mooncake copied an object of exactly page + trailer bytes whose
        trailer names this key, format and length, and (checksums on) whose bytes match."""
        good = (
            (tr["magic"] == TRAILER_MAGIC)
            & (tr["version"] == FORMAT_VERSION)
            & (tr["flags"] == self._flags)
            & (tr["length"] == self.pool.layout.page_bytes)
            & (tr["key"] == digests)
        )
        out = list(res)
        # an object of another size: a single-buffer get answers BAD_REQUEST, a multi-buffer get
        # (ours) TRANSFER_FAIL, which a dead donor gives too: ask the master for those sizes
        rejected = [i for i, r in enumerate(res) if (r is Outcome.OK and not good[i]) or r is Outcome.BAD_REQUEST]
        failed = [i for i, r in enumerate(res) if r is Outcome.TRANSFER_FAIL]
        if failed:
            want = object_bytes(self.pool.layout.page_bytes)
            sizes_now = self.store.object_sizes([keys[i] for i in failed])
            rejected += [i for i, z in zip(failed, sizes_now, strict=True) if z is not None and z != want]
        for i in rejected:
            out[i] = Outcome.MISS
        bad_sum: list[int] = []
        if self._flags:
            ok = np.array([i for i, r in enumerate(out) if r is Outcome.OK], dtype=np.int64)
            if ok.size:
                sums = page_checksums(flat, base, addrs[ok], sizes[ok])
                bad_sum = ok[sums != tr["checksum"][ok]].tolist()
                for i in bad_sum:
                    out[i] = Outcome.MISS
        if rejected or bad_sum:
            with self._lock:
                self.stats.trailer_rejections += len(rejected)
                self.stats.checksum_failures += len(bad_sum)
            if rejected:
                metrics.CLIENT_TRAILER_REJECTIONS.inc(len(rejected))
            if bad_sum:
                metrics.CLIENT_CHECKSUM_FAILURES.inc(len(bad_sum))
            log.warning(
                "L3 get: %d object(s) not bound to their key (e.g. %s) and %d checksum mismatch(es): treated as misses",
                len(rejected),
                keys[rejected[0]] if rejected else "-",
                len(bad_sum),
            )
        return out

    def _page_view(self) -> torch.Tensor:
        """layer_first pool as [kv, L, pages, page_size * item] (uint8)."""
        s, lay = self.pool.spec, self.pool.layout
        return self.pool.buffer.view(s.num_kv, s.num_layers, lay.num_pages, s.page_size * s.item_bytes)

    # -- stats ---------------------------------------------------------------------------------
    def _publish_loop(self, interval: float, ttl: int) -> None:
        from l3pool.pool.etcd import EtcdError, LeaseKeeper

        keeper = None
        while True:
            try:
                if keeper is None or keeper.lost.is_set():
                    if keeper is not None:
                        keeper.close(revoke=False)
                    keeper = LeaseKeeper(self._registry().etcd, ttl, owner="stats")
                self._ensure_namespace()
                self.publish_stats(keeper.lease)
            except EtcdError as e:
                if keeper is not None and "lease not found" in str(e):  # etcd came back without our lease
                    keeper.close(revoke=False)
                    keeper = None
                log.debug("stats publish failed: %s", e)
            if self._stop.wait(interval):
                break
        if keeper is not None:
            keeper.close(revoke=True)

    def _ensure_namespace(self) -> None:
        """Self-healing: write the namespace record again when etcd lost it (restarted empty),
        so readers that do not create namespaces can attach again. One etcd read per interval."""
        md = self._registry()
        if md.namespace(self.ns_id) is not None:
            return
        stored = md.register_namespace(self.ns_id, self.ns.record())
        if stored != self.ns.record():
            log.warning("namespace %s came back with a different record: %s", self.ns_id, stored)
            return
        self.reregistrations += 1
        log.warning("namespace %s was missing from etcd (restarted empty?): registered again", self.ns_id)

    def publish_stats(self, lease: int = 0) -> None:
        with self._lock:
            counters: dict[str, Any] = self.stats.as_dict()
        counters["namespace"] = self.ns_id
        self._registry().publish_stats(self.client_id, counters, lease)

    def _registry(self) -> NamespaceRegistry:
        if self.metadata is None:
            raise ConfigError("this L3Client was made without metadata (an etcd registry): nothing to publish to")
        return self.metadata

    def close(self) -> None:
        """Stop publishing stats and unregister this client's buffers (the store stays open).
        Call it after the last put/get returned."""
        self._stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()
            self._stats_thread = None
        for ptr in self._registered:
            self.store.unregister(ptr)
        self._registered.clear()
