"""SGLang HiCache storage backend over l3pool: SGLang's host KV pool pages go to/from the L3 pool.

The one module of this repository that imports `sglang` (pinned: sglang==0.5.23). SGLang loads it
with its `dynamic` storage backend:

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first_direct --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{
            "backend_name": "l3pool", "module_path": "l3pool.adapters.sglang_hicache",
            "class_name": "L3PoolStorage", "interface_v1": 1,
            "master": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata",
            "etcd": "http://10.0.0.1:2379", "local_hostname": "10.0.0.2",
            "model": "glm5-abc123"}'

Export `MC_TCP_BIND_ADDRESS=<this node's IP>` for the SGLang process: Mooncake advertises that
address (else the first non-loopback NIC), not `local_hostname`.

The extra-config keys, their SGLang Mooncake aliases, environment fallbacks and units are in
`l3pool.adapters.sglang_config` (BackendConfig).

Semantics SGLang relies on (sglang 0.5.23, `managers/cache_controller.py`):
- `batch_exists(keys)` returns how many *leading* keys are present (a prefix count); SGLang then
  all-reduces the MIN across TP/PP ranks, so every rank loads the same number of pages.
- `batch_get_v1(keys, host_indices)` / `batch_set_v1(...)` return one bool per page; SGLang uses
  the leading run of True for gets and `all(...)` for sets. `host_indices` holds
  `len(keys) * page_size` token slots of the host pool; page i starts at `host_indices[i * page_size]`.
- MLA: the latent is the same on every TP rank, so the keys are shared across ranks and only
  `storage_config.is_storage_writer` ranks write; SGLang already skips backups on the others and a
  set there is a no-op reporting True. MHA: each TP rank stores its own head shard (its own keys).
- PP: every stage has its own layer range, hence its own namespace and keys.
- MLA + `"tp_shared": true, "tp_group": ...`: `register_mem_pool_host` rebinds SGLang's host buffer
  onto the TP group's one /dev/shm copy (`l3pool.adapters.sglang_shared_pool`): rank 0 alone copies
  D2H and reads L3, the other ranks answer exists/get for it and SGLang's MIN all-reduce makes rank
  0's answer everyone's.
Wiring: SGLang's own controller drives the tiers, so the backend takes only the L3 part of the
cache builder (`l3pool.cache.stack.l3_tier`, the place every engine's L3 clients are made and
their settings checked) over SGLang's borrowed host buffer; its Mooncake store and etcd client
are the backend's own (one per rank, made in `__init__` so a bad pool address fails there).
SGLang closes a storage backend only when it is detached at runtime, never at shutdown, so the
backend registers its own `close()` with atexit (a documented last resort: otherwise the rank's
Mooncake client is torn down by Mooncake's C++ exit handler after libcurl is gone, and its records
stay on the metadata server; l3pool/pool/connection.py); `close()` unregisters it.
Unsupported configurations (DCP, attention context parallelism, heterogeneous-TP head splitting,
page_head/page_unified layouts, hybrid side pools, dtypes outside bf16/fp16/fp8_e4m3) are refused
with a ConfigError at construction or registration, never silently mis-keyed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from l2core.l1 import slot_pages
from l2core.layout import LAYOUTS, LayoutName
from l2core.memory import HostMemory
from l2core.pool import HostKVPool, L2Config
from l2core.spec import ConfigError, KVSpec, dtype_name
from l3pool import metrics
from l3pool.adapters.sglang_config import BackendConfig, _sglang_model_fingerprint
from l3pool.cache.stack import L3Tier, l3_tier
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.store import MooncakeStore, Outcome

log = logging.getLogger(__name__)


@dataclass
class AdapterStats:
    """Calls as SGLang made them (page counts), besides the L3Client counters."""

    exists_calls: int = 0
    get_calls: int = 0
    set_calls: int = 0
    set_skipped_not_writer: int = 0  # pages a non-writer MLA rank was asked to set (no-op)
    shared_skipped: int = 0  # pages a tp_shared rank > 0 answered for rank 0 (exists/get, no L3 call)
    bad_indices: int = 0  # pages refused because their host slots were not one aligned page
    errors: int = 0  # exceptions caught on the data path (reported as misses/failures)
    cleared_pages: int = 0  # pages removed by clear()
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)  # GB/s per call
    backup_bandwidth: list[float] = field(default_factory=list)


class L3PoolStorage(HiCacheStorage):
    """`HiCacheStorage` whose pages live in the l3pool L3 tier (Mooncake + etcd).

    Lifecycle (SGLang's): `__init__(storage_config, kwargs)` checks the extra-config (the L3
    client settings by the cache builder's rules, `l3pool.cache.config.l3_settings`) and connects
    to Mooncake (`BackendConfig.store_config`) and etcd; `register_mem_pool_host(host_pool)` wraps
    SGLang's host buffer as an l2core pool and opens the L3 clients over it through the cache
    builder's L3 part (`l3pool.cache.stack.l3_tier`: a reader, and a writer on writer ranks),
    which register it with Mooncake; then `batch_exists` / `batch_get_v1` / `batch_set_v1` run on
    SGLang's prefetch and backup threads; `close()` on detach (the writer, the reader, the store).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        cfg = storage_config
        self.config = BackendConfig.from_extra_config(cfg.extra_config)
        self.storage_config = cfg
        if getattr(cfg, "dcp_size", 1) > 1:
            raise ConfigError("the l3pool backend does not support decode context parallelism (dcp_size > 1)")
        if getattr(cfg, "attn_cp_size", 1) > 1:
            raise ConfigError("the l3pool backend does not support attention context parallelism (attn_cp_size > 1)")
        if getattr(cfg, "should_split_heads", False):
            raise ConfigError("the l3pool backend does not support heterogeneous-TP head splitting (tp_lcm_size)")
        self.model = self.config.model or _sglang_model_fingerprint(cfg.model_name)
        if not self.model:
            raise ConfigError("no model fingerprint: give extra-config 'model' (SGLang passed no model name)")
        self.is_writer = bool(cfg.is_storage_writer)
        metrics.set_rank(cfg.tp_rank, cfg.pp_rank)  # SGLang runs one process per rank: label its series
        # MLA + tp_shared: the TP group's one host copy (l2core.shm); validated here, before any
        # connection. Only the storage writer rank writes L3 (below); rank 0 alone fills the copy.
        self.tp_group = self.config.tp_shared_group(
            cfg.tp_rank, cfg.tp_size, cfg.pp_rank, bool(cfg.is_mla_model), pp_size=cfg.pp_size,
            dp_rank=getattr(cfg, "dp_rank", 0),
        )  # fmt: skip
        self.shared: Any = None  # the SharedHostPool once registered (tp_shared)
        # tp_shared ranks > 0 neither read L3 nor copy: rank 0 fills the one host copy, and SGLang's
        # MIN all-reduce over the ranks' answers makes rank 0's the group's (sglang_shared_pool).
        self.l3_reader = self.tp_group is None or self.tp_group.rank == 0
        self.stats = AdapterStats()
        self._stats_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._metrics_warned = False
        self.namespace: Namespace | None = None
        self.pool: HostKVPool | None = None
        self.tier: L3Tier | None = None  # the reader and writer L3 clients, once registered
        self.metadata: Any = None
        c = self.config
        self.store = MooncakeStore(c.store_config(cfg.tp_rank, cfg.tp_size, cfg.pp_size))
        self._exit_hook = _close_at_exit(self)
        if c.etcd is not None:
            from l3pool.pool.etcd import EtcdClient, EtcdSecurity
            from l3pool.pool.metadata import Metadata, check_prefix

            try:
                check_prefix(c.key_prefix)
                sec = EtcdSecurity.from_mapping(c.etcd_security, "extra-config 'etcd_security'")
                etcd = EtcdClient(c.etcd, security=sec)
            except ValueError as e:
                self.close()
                raise ConfigError(f"extra-config 'etcd'/'key_prefix'/'etcd_security': {e}") from None
            self.metadata = Metadata(etcd, c.key_prefix)
        log.info(
            "l3pool HiCache backend: master=%s tp=%d/%d pp=%d/%d mla=%s writer=%s model=%s",
            c.master,
            cfg.tp_rank,
            cfg.tp_size,
            cfg.pp_rank,
            cfg.pp_size,
            cfg.is_mla_model,
            self.is_writer,
            self.model,
        )

    # -- registration ----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.pool is not None:
            raise ConfigError("the l3pool backend already has a host pool registered")
        spec, layout = self._spec_of(mem_pool_host)
        if self.tp_group is not None and self.shared is None:
            # tp_shared: SGLang allocated this rank's buffer already; rebind it onto the group's
            # one /dev/shm copy (same addresses) before anything registers it with Mooncake.
            from l3pool.adapters.sglang_shared_pool import check_sglang_modes, share_host_pool

            check_sglang_modes(*_sglang_hicache_modes())
            self.shared = share_host_pool(mem_pool_host, self.tp_group)
        buf = mem_pool_host.kv_buffer
        pool = HostKVPool(
            L2Config(kv=spec, layout=layout, tokens=mem_pool_host.size, pin="never"),
            memory=cast(HostMemory, _BorrowedMemory(buf)),
        )
        if tuple(buf.shape) != pool.layout.shape:
            raise ConfigError(
                f"SGLang host buffer shape {tuple(buf.shape)} differs from the l2core {layout} layout "
                f"{pool.layout.shape}: this SGLang version lays pages out differently"
            )
        layers = self.config.layers
        if layers is None:
            start = getattr(mem_pool_host, "start_layer", None)
            if start is None and self.storage_config.pp_size > 1:
                raise ConfigError("pipeline parallel without a host-pool start_layer: give extra-config 'layers'")
            layers = (int(start or 0), int(start or 0) + spec.num_layers)
        cfg = self.storage_config
        self.namespace = Namespace.for_pool(
            spec,
            layout,
            self.model,  # type: ignore[arg-type]
            layers=layers,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            checksum=self.config.checksum,
            tenant=self.config.tenant,
        )
        # The cache builder's L3 part, as every engine's: two clients (an L3Client is thread-safe;
        # this keeps reader and writer stats apart, published as <client_id>-r / -w), both
        # registering the same pool buffer (refcounted); a rank that never writes gets no writer.
        self.tier = l3_tier(
            pool, self.store, self.namespace, self.config.l3_settings(), metadata=self.metadata,
            client_id=self.config.client_id or f"sglang-{uuid.uuid4().hex[:10]}", split=True, writes=self.is_writer,
        )  # fmt: skip
        self.pool = pool
        log.info(
            "l3pool namespace %s: %s %s %s page %d (%d bytes), layers %s, tp %d/%d",
            self.namespace.ns_id,
            spec.attention,
            layout,
            spec.dtype,
            spec.page_size,
            spec.page_bytes,
            layers,
            self.namespace.tp_rank,
            self.namespace.tp_size,
        )

    @property
    def _reader(self) -> L3Client | None:
        return self.tier.reader if self.tier is not None else None

    @property
    def _writer(self) -> L3Client | None:
        return self.tier.writer if self.tier is not None else None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise ConfigError(
            f"the l3pool backend stores plain KV pages only; SGLang asked it to also store pool {host_pool_name!r} "
            "(hybrid models with side pools are not supported)"
        )

    def _spec_of(self, host: Any) -> tuple[KVSpec, LayoutName]:
        layout = cast(LayoutName, getattr(host, "layout", None))
        if layout not in LAYOUTS:
            raise ConfigError(
                f"host pool layout {layout!r} is not supported by the l3pool backend; use one of {LAYOUTS}"
            )
        buf = getattr(host, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise ConfigError("the host pool has no kv_buffer tensor (a logical-only anchor pool is not supported)")
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(
                f"host kv_buffer must be a contiguous CPU tensor, got {buf.device} contiguous={buf.is_contiguous()}"
            )
        dtype = dtype_name(buf.dtype)
        if dtype is None:
            raise ConfigError(f"host KV dtype {buf.dtype} is not supported; supported: bf16, fp16, fp8 (float8_e4m3fn)")
        common = {"dtype": dtype, "page_size": int(host.page_size)}
        if self.storage_config.is_mla_model:
            if not hasattr(host, "kv_cache_dim"):
                raise ConfigError("SGLang says MLA but the host pool has no kv_cache_dim")
            # The latent row is kv_cache_dim elements; its split into lora/rope does not change bytes.
            return KVSpec.mla(int(host.layer_num), kv_lora_rank=int(host.kv_cache_dim), rope_dim=0, **common), layout
        head_dim = int(host.head_dim)
        if int(getattr(host, "v_head_dim", head_dim)) != head_dim:
            raise ConfigError(f"MHA with v_head_dim {host.v_head_dim} != head_dim {head_dim} is not supported")
        return KVSpec.mha(int(host.layer_num), int(host.head_num), head_dim, **common), layout

    # -- keys and pages -----------------------------------------------------------------------
    def _keys(self, keys: list[str]) -> list[str]:
        assert self.namespace is not None
        ns = self.namespace.ns_id
        return [f"{ns}/{k}" for k in keys]

    def _pages(self, n: int, host_indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(page ids, ok mask): page i must be `page_size` consecutive slots starting on a page boundary."""
        assert self.pool is not None
        P = self.pool.spec.page_size
        idx = host_indices.detach().to("cpu", torch.int64).reshape(-1)
        if idx.numel() != n * P:
            raise ValueError(f"{n} keys need {n * P} host indices (page size {P}), got {idx.numel()}")
        pages_t, ok_t = slot_pages(idx, P)
        pages, ok = pages_t.numpy(), ok_t.numpy() & (pages_t.numpy() < self.pool.num_pages)
        bad = int(n - ok.sum())
        if bad:
            with self._stats_lock:
                self.stats.bad_indices += bad
            log.error("%d of %d pages have host indices that are not one aligned page; failing them", bad, n)
        return np.where(ok, pages, 0), ok

    def _ready(self) -> bool:
        if self.pool is None:
            log.error("l3pool backend used before register_mem_pool_host")
            return False
        return True

    def _failed(self, what: str, e: BaseException) -> None:
        with self._stats_lock:
            self.stats.errors += 1
        metrics.ADAPTER_ERRORS("sglang").inc()
        log.warning("l3pool %s failed: %s: %s", what, type(e).__name__, e)

    # -- the v1 interface -----------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading `keys` are in the pool (0 when the pool cannot be reached)."""
        if not keys or not self._ready():
            return 0
        if not self.l3_reader:
            with self._stats_lock:
                self.stats.shared_skipped += len(keys)
            return len(keys)  # rank 0's count is the MIN SGLang takes
        assert self._reader is not None
        with self._stats_lock:
            self.stats.exists_calls += 1
        metrics.ADAPTER_CALLS("sglang", "exists").inc()
        page = self._reader.pool.spec.page_size
        metrics.ADAPTER_LOOKUP_TOKENS("sglang").inc(len(keys) * page)
        try:
            n = self._reader.lookup(self._keys(list(keys)))
        except Exception as e:
            self._failed("batch_exists", e)
            return 0
        metrics.ADAPTER_HIT_TOKENS("sglang").inc(n * page)
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Copy each page's object straight into its host slots; one bool per page. A tp_shared rank
        > 0 copies nothing and reports True: rank 0 fills the shared pages, and SGLang takes the MIN
        of the ranks' completed counts after rank 0's get returned."""
        if not self.l3_reader:
            with self._stats_lock:
                self.stats.shared_skipped += len(keys)
            return [True] * len(keys)
        return self._io(list(keys), host_indices, write=False)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page from its host slots (present keys are skipped); one bool per page.

        On an MLA rank that is not the storage writer this is a no-op reporting True: the writer
        rank stores the same bytes under the same keys."""
        if not self.is_writer:
            with self._stats_lock:
                self.stats.set_skipped_not_writer += len(keys)
            return [True] * len(keys)
        return self._io(list(keys), host_indices, write=True)

    def _io(self, keys: list[str], host_indices: torch.Tensor, write: bool) -> list[bool]:
        if not keys:
            return []
        if not self._ready():
            return [False] * len(keys)
        client = self._writer if write else self._reader
        assert client is not None and self.pool is not None
        pages, ok = self._pages(len(keys), host_indices)
        sel = np.flatnonzero(ok)
        out = [False] * len(keys)
        if sel.size == 0:
            return out
        full = self._keys(keys)
        sub = [full[i] for i in sel.tolist()]
        with self._write_lock if write else contextlib.nullcontext():
            before = client.stats.as_dict() if write else None
            t0 = time.perf_counter()
            try:
                res = client.put(sub, pages[sel]) if write else client.get(sub, pages[sel])
            except Exception as e:
                self._failed("batch_set_v1" if write else "batch_get_v1", e)
                return out
            dt = max(time.perf_counter() - t0, 1e-9)
            after = client.stats.as_dict() if write else None
        for i, r in zip(sel.tolist(), res, strict=True):
            out[i] = r is Outcome.OK
        if self.storage_config.enable_storage_metrics:
            if before is not None and after is not None:
                # Only pages this call stored: present pages were skipped (no bytes moved). One
                # writer at a time (`_write_lock`), so the counter deltas are this call's.
                written = after["puts"] + after["put_failed"] - before["puts"] - before["put_failed"]
                moved = after["bytes_put"] - before["bytes_put"]
                if written:
                    with self._stats_lock:
                        self.stats.backup_pgs.append(written)
                        self.stats.backup_bandwidth.append(moved / dt / 1e9)
            else:
                with self._stats_lock:
                    self.stats.prefetch_pgs.append(len(keys))
                    self.stats.prefetch_bandwidth.append(sum(out) * self.pool.layout.page_bytes / dt / 1e9)
        with self._stats_lock:
            if write:
                self.stats.set_calls += 1
            else:
                self.stats.get_calls += 1
        metrics.ADAPTER_CALLS("sglang", "set" if write else "get").inc()
        return out

    # -- the copying interface (abstract in SGLang; never called with interface_v1) -------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise NotImplementedError("l3pool backend: use interface_v1 (batch_get_v1), see the module docstring")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("l3pool backend: use interface_v1 (batch_get_v1), see the module docstring")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("l3pool backend: use interface_v1 (batch_set_v1), see the module docstring")

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError("l3pool backend: use interface_v1 (batch_set_v1), see the module docstring")

    # -- housekeeping -----------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's cache flush (`/flush_cache`): remove every page of this backend's namespace
        from the pool, for every instance that shares the namespace; other namespaces (other
        models, layouts, TP shards, PP stages, tenants) keep theirs.

        With `clear_force` (default) pages under a read lease go too: SGLang flushes only an idle
        engine, and without force every page looked up in the last lease TTL (10 s) would stay
        (measured: 0 of 4 removed right after a lookup). Another instance reading the namespace at
        that moment gets misses, or with `checksum` a mismatch counted as a miss."""
        if self.namespace is None:
            log.warning("l3pool backend: clear() before register_mem_pool_host: nothing to remove")
            return
        outcome, n = self.store.remove_prefix(self.namespace.key_prefix, force=self.config.clear_force)
        with self._stats_lock:
            self.stats.cleared_pages += n
        if outcome is not Outcome.OK:
            log.warning("l3pool backend: clear() of namespace %s failed: %s", self.namespace.ns_id, outcome.value)
        else:
            log.info("l3pool backend: clear() removed %d pages of namespace %s", n, self.namespace.ns_id)

    def client_stats(self) -> dict[str, int]:
        """L3Client counters of the reader and writer, summed."""
        total: dict[str, int] = {}
        for c in (self._reader, self._writer):
            if c is not None:
                for k, v in c.stats.as_dict().items():
                    total[k] = total.get(k, 0) + v
        return total

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (per-call page counts and GB/s) when storage metrics are on."""
        if not self.storage_config.enable_storage_metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError as e:  # a server that enables metrics has imported it already
            if not self._metrics_warned:
                self._metrics_warned = True
                log.warning("l3pool backend: storage metrics unavailable (%s)", e)
            return None
        m = StorageMetrics()
        with self._stats_lock:
            s = self.stats
            m.prefetch_pgs.extend(s.prefetch_pgs)
            m.backup_pgs.extend(s.backup_pgs)
            m.prefetch_bandwidth.extend(s.prefetch_bandwidth)
            m.backup_bandwidth.extend(s.backup_bandwidth)
            for lst in (s.prefetch_pgs, s.backup_pgs, s.prefetch_bandwidth, s.backup_bandwidth):
                lst.clear()
        return m

    def close(self) -> None:
        """Close the L3 clients (stats publication, buffer registrations) and the Mooncake client
        (idempotent; also run at interpreter exit while open: the module docstring)."""
        atexit.unregister(self._exit_hook)
        if self.tier is not None:
            self.tier.close()  # the writer, then the reader
            self.tier = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.store is not None:
            self.store.close()
            self.store = None  # type: ignore[assignment]
        if self.metadata is not None:
            self.metadata.etcd.close()
            self.metadata = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None


def _close_at_exit(backend: L3PoolStorage) -> Any:
    """An atexit hook that closes `backend` if it is still alive and open then (a weak reference:
    the hook keeps nothing alive); returned for `close()` to unregister."""
    ref = weakref.ref(backend)

    def hook() -> None:
        b = ref()
        if b is not None and b.store is not None:
            log.info("l3pool HiCache backend: closing at exit (SGLang does not close storage backends)")
            b.close()

    atexit.register(hook)
    return hook


def _sglang_hicache_modes() -> tuple[str | None, str | None]:
    """(write policy, host memory mode) of the running SGLang server; (None, None) outside one."""
    try:
        from sglang.srt.runtime_context import get_memory

        mem = get_memory()
    except (ImportError, ValueError, RuntimeError):
        return None, None
    return getattr(mem, "hicache_write_policy", None), getattr(mem, "hicache_host_memory_mode", None)


class _BorrowedMemory:
    """SGLang's host buffer seen as l2core host memory: HostKVPool reads `nbytes` and `tensor`
    only, and never closes memory it was handed (SGLang owns and frees it)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.tensor = buf.view(-1).view(torch.uint8)
        self.nbytes = self.tensor.numel()
        self.ptr = self.tensor.data_ptr()

    def close(self) -> None:  # pragma: no cover - never called for borrowed memory
        pass
