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

Every call returns one `Outcome` per page. A failed get (miss, dead donor, checksum mismatch)
is never OK: the page's L2 bytes must then be treated as garbage by the caller, which only uses
the leading run of OK pages.
"""

from __future__ import annotations

import logging
import threading
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch

from l2core.pool import HostKVPool
from l2core.spec import ConfigError
from l3pool.pool.keys import Namespace
from l3pool.pool.store import MooncakeStore, Outcome

log = logging.getLogger(__name__)

LayerFirstMode = Literal["multi", "staging"]
TRAILER_BYTES = 8


@dataclass
class ClientStats:
    lookups: int = 0
    hits: int = 0  # pages found by lookup
    misses: int = 0  # lookups that ended before the end of the key list
    puts: int = 0  # pages stored
    put_skipped: int = 0  # already present
    put_failed: int = 0
    gets: int = 0  # pages copied into L2
    get_failed: int = 0
    checksum_failures: int = 0
    bytes_put: int = 0
    bytes_got: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class L3Client:
    def __init__(
        self,
        pool: HostKVPool,
        store: MooncakeStore,
        namespace: Namespace,
        *,
        metadata: Any = None,
        batch_pages: int = 64,
        layer_first_mode: LayerFirstMode = "multi",
        client_id: str | None = None,
        stats_interval: float = 5.0,
        stats_ttl: int = 30,
        create_namespace: bool = True,
    ) -> None:
        ns, lay = namespace, pool.layout
        mismatch = [
            f"{name}: namespace {a!r} != pool {b!r}"
            for name, a, b in (
                ("layout", ns.layout, lay.name),
                ("dtype", ns.dtype, pool.spec.dtype),
                ("attention", ns.attention, pool.spec.attention),
                ("page_size", ns.page_size, pool.spec.page_size),
                ("page_bytes", ns.page_bytes, lay.page_bytes),
            )
            if a != b
        ]
        if mismatch:
            raise ConfigError("namespace does not describe this pool: " + "; ".join(mismatch))
        if batch_pages < 1:
            raise ConfigError("batch_pages must be >= 1")
        if layer_first_mode not in ("multi", "staging"):
            raise ConfigError(f"layer_first_mode must be 'multi' or 'staging', got {layer_first_mode!r}")
        self.pool, self.store, self.ns = pool, store, ns
        self.ns_id = ns.ns_id
        self.batch_pages = batch_pages
        self.stats = ClientStats()
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._registered = [pool.buffer.data_ptr()]
        store.register(pool.buffer.data_ptr(), pool.buffer.numel())
        self._staging: torch.Tensor | None = None
        if lay.name == "layer_first" and layer_first_mode == "staging":
            self._staging = torch.empty(batch_pages * lay.page_bytes, dtype=torch.uint8)
            store.register(self._staging.data_ptr(), self._staging.numel())
            self._registered.append(self._staging.data_ptr())
        self._trailer: np.ndarray | None = None
        if ns.checksum:
            self._trailer = np.zeros(batch_pages, dtype=np.uint64)
            store.register(self._trailer.ctypes.data, self._trailer.nbytes)
            self._registered.append(self._trailer.ctypes.data)
        self.metadata = metadata
        self.reregistrations = 0  # namespace records written again after etcd lost them
        self._stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        if metadata is not None:
            if not create_namespace and metadata.namespace(self.ns_id) is None:
                self.close()
                raise ConfigError(
                    f"unknown namespace {self.ns_id} ({ns.model}, {ns.layout}, {ns.dtype}, page {ns.page_size}): "
                    "no writer has registered it in etcd"
                )
            stored = metadata.register_namespace(self.ns_id, ns.record())
            if stored != ns.record():
                raise ConfigError(f"namespace id {self.ns_id} is registered with a different record: {stored}")
            self._stats_thread = threading.Thread(
                target=self._publish_loop, args=(stats_interval, stats_ttl), name="l3pool-stats", daemon=True
            )
            self._stats_thread.start()

    @property
    def staging_bytes(self) -> int:
        """Bytes of the bounded staging area (layer_first staging mode only; else 0)."""
        return 0 if self._staging is None else self._staging.numel()

    # -- lookups -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` present in L3 (stops at the first miss)."""
        n = 0
        for b in range(0, len(keys), max(self.batch_pages, 512)):
            chunk = keys[b : b + max(self.batch_pages, 512)]
            res = self.store.exists(chunk)
            k = next((i for i, r in enumerate(res) if r is not Outcome.OK), len(res))
            n += k
            if k < len(res):
                break
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += n
            self.stats.misses += int(n < len(keys))
        return n

    # -- data --------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]:
        """Store L2 `pages` under `keys`; keys already in L3 are skipped (reported OK)."""
        p = self._pages(keys, pages)
        out: list[Outcome] = []
        for b in range(0, len(keys), self.batch_pages):
            ks, ps = list(keys[b : b + self.batch_pages]), p[b : b + self.batch_pages]
            present = self.store.exists(ks)
            todo = [i for i, r in enumerate(present) if r is not Outcome.OK]
            res = [Outcome.OK] * len(ks)
            if todo:
                for i, r in zip(todo, self._move([ks[i] for i in todo], ps[todo], to_l3=True), strict=True):
                    res[i] = r
            ok_new = sum(1 for i in todo if res[i] is Outcome.OK)
            with self._lock:
                self.stats.put_skipped += len(ks) - len(todo)
                self.stats.puts += ok_new
                self.stats.put_failed += len(todo) - ok_new
                self.stats.bytes_put += ok_new * self.pool.layout.page_bytes
            out += res
        return out

    def get(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]:
        """Copy the objects `keys` into L2 `pages`; per-page outcome (OK, MISS, ...)."""
        p = self._pages(keys, pages)
        out: list[Outcome] = []
        for b in range(0, len(keys), self.batch_pages):
            res = self._move(list(keys[b : b + self.batch_pages]), p[b : b + self.batch_pages], to_l3=False)
            ok = sum(1 for r in res if r is Outcome.OK)
            with self._lock:
                self.stats.gets += ok
                self.stats.get_failed += len(res) - ok
                self.stats.bytes_got += ok * self.pool.layout.page_bytes
            out += res
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
        if any(not k.startswith(self.ns_id + "/") for k in keys):
            raise ValueError(f"keys must belong to this client's namespace {self.ns_id}")
        return p

    def _move(self, keys: list[str], pages: np.ndarray, to_l3: bool) -> list[Outcome]:
        """One bounded batch (<= batch_pages) in one Mooncake call."""
        if self._staging is not None:
            return self._move_staged(keys, pages, to_l3)
        addrs, sizes = self.pool.page_runs(pages)
        if to_l3 and self._trailer is not None:
            self._trailer[: len(keys)] = [self._crc(a, s) for a, s in zip(addrs, sizes, strict=True)]
        frags, lens = addrs.tolist(), sizes.tolist()
        if self._trailer is not None:
            base = self._trailer.ctypes.data
            for i in range(len(keys)):
                frags[i].append(base + TRAILER_BYTES * i)
                lens[i].append(TRAILER_BYTES)
        if len(frags[0]) == 1:  # one contiguous fragment per page: the plain zero-copy calls
            flat_a, flat_s = [f[0] for f in frags], [s[0] for s in lens]
            res = self.store.put(keys, flat_a, flat_s) if to_l3 else self.store.get(keys, flat_a, flat_s)
        else:
            res = self.store.put_multi(keys, frags, lens) if to_l3 else self.store.get_multi(keys, frags, lens)
        if not to_l3 and self._trailer is not None:
            res = self._verify(res, addrs, sizes)
        return res

    def _page_view(self) -> torch.Tensor:
        """layer_first pool as [kv, L, pages, page_size * item] (uint8)."""
        s, lay = self.pool.spec, self.pool.layout
        return self.pool.buffer.view(s.num_kv, s.num_layers, lay.num_pages, s.page_size * s.item_bytes)

    def _move_staged(self, keys: list[str], pages: np.ndarray, to_l3: bool) -> list[Outcome]:
        assert self._staging is not None
        n, pb = len(keys), self.pool.layout.page_bytes
        st = self._staging[: n * pb]
        v, idx = self._page_view(), torch.from_numpy(pages)
        st4 = st.view(n, v.shape[0], v.shape[1], v.shape[3])  # [n, kv, L, run]
        if to_l3:
            st4.copy_(v.index_select(2, idx).permute(2, 0, 1, 3))
        ptrs = [st.data_ptr() + i * pb for i in range(n)]
        if self._trailer is not None:
            tb = self._trailer.ctypes.data
            if to_l3:
                self._trailer[:n] = [_crc(st[i * pb : (i + 1) * pb]) for i in range(n)]
            frags = [[ptrs[i], tb + TRAILER_BYTES * i] for i in range(n)]
            lens = [[pb, TRAILER_BYTES]] * n
            res = self.store.put_multi(keys, frags, lens) if to_l3 else self.store.get_multi(keys, frags, lens)
        else:
            res = self.store.put(keys, ptrs, [pb] * n) if to_l3 else self.store.get(keys, ptrs, [pb] * n)
        if not to_l3:
            if self._trailer is not None:
                res = [
                    r
                    if r is not Outcome.OK or _crc(st[i * pb : (i + 1) * pb]) == int(self._trailer[i])
                    else self._bad_checksum(keys[i])
                    for i, r in enumerate(res)
                ]
            ok = [i for i, r in enumerate(res) if r is Outcome.OK]
            if ok:  # scatter only pages that arrived intact
                sel = torch.tensor(ok, dtype=torch.int64)
                v.index_copy_(2, idx[sel], st4.index_select(0, sel).permute(1, 2, 0, 3))
        return res

    # -- checksums (optional; off by default) --------------------------------------------------
    def _crc(self, addrs: np.ndarray, sizes: np.ndarray) -> int:
        flat, base = self.pool.buffer.numpy(), self.pool.buffer.data_ptr()
        c = 0
        for a, s in zip(addrs.tolist(), sizes.tolist(), strict=True):
            c = zlib.crc32(flat[a - base : a - base + s].data, c)
        return c

    def _verify(self, res: list[Outcome], addrs: np.ndarray, sizes: np.ndarray) -> list[Outcome]:
        assert self._trailer is not None
        out = []
        for i, r in enumerate(res):
            if r is Outcome.OK and self._crc(addrs[i], sizes[i]) != int(self._trailer[i]):
                r = self._bad_checksum(f"page {i} of batch")
            out.append(r)
        return out

    def _bad_checksum(self, what: str) -> Outcome:
        with self._lock:
            self.stats.checksum_failures += 1
        log.warning("L3 checksum mismatch for %s: treated as a miss", what)
        return Outcome.MISS

    # -- stats ---------------------------------------------------------------------------------
    def _publish_loop(self, interval: float, ttl: int) -> None:
        from l3pool.pool.etcd import EtcdError, LeaseKeeper

        keeper = None
        while True:
            try:
                if keeper is None or keeper.lost.is_set():
                    if keeper is not None:
                        keeper.close(revoke=False)
                    keeper = LeaseKeeper(self.metadata.etcd, ttl)
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
        if self.metadata.namespace(self.ns_id) is not None:
            return
        stored = self.metadata.register_namespace(self.ns_id, self.ns.record())
        if stored != self.ns.record():
            log.warning("namespace %s came back with a different record: %s", self.ns_id, stored)
            return
        self.reregistrations += 1
        log.warning("namespace %s was missing from etcd (restarted empty?): registered again", self.ns_id)

    def publish_stats(self, lease: int = 0) -> None:
        with self._lock:
            counters: dict[str, Any] = self.stats.as_dict()
        counters["namespace"] = self.ns_id
        self.metadata.publish_stats(self.client_id, counters, lease)

    def close(self) -> None:
        """Stop publishing stats and unregister this client's buffers (the store stays open)."""
        self._stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()
            self._stats_thread = None
        for ptr in self._registered:
            self.store.unregister(ptr)
        self._registered.clear()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().data)
