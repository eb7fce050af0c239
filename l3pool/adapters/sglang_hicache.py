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

Extra-config keys (unknown keys are refused with a ConfigError naming them):

| key | type | default | meaning |
|---|---|---|---|
| backend_name, module_path, class_name | str | required by SGLang | how SGLang finds this class |
| interface_v1 | 1/true | required | makes SGLang call the zero-copy `batch_get_v1`/`batch_set_v1` |
| master | "host:port" | required | mooncake_master RPC address |
| metadata_server | str | "P2PHANDSHAKE" | Mooncake metadata: P2PHANDSHAKE, http://H:P/metadata, etcd://H:P |
| local_hostname | str | "127.0.0.1" | this client's Mooncake local_hostname |
| protocol / rdma_devices | str | "tcp" / "" | Mooncake transport |
| segment_size | size | 0 | DRAM this process donates to the pool (0: a pure client, the prefill case) |
| local_buffer_size | size | "16MB" | Mooncake's local transfer buffer |
| etcd | str | none | etcd endpoints: namespace registry + published stats (none: no etcd) |
| key_prefix | str | "/l3pool" | etcd key prefix |
| model | str | SGLang's model name | model fingerprint in the namespace ('/' is not allowed) |
| tenant | str | "" | tenant salt in the namespace |
| checksum | bool | false | CRC32 trailer per page; a mismatch on get is a miss |
| layers | [begin, end] | host pool's start_layer + its layers | absolute layer range of this PP stage |
| batch_pages | int | 128 | pages per Mooncake call |
| layer_first_mode | "multi"/"staging" | "multi" | how layer_first pages move (see l3pool/README.md) |
| stats_interval | number | 5.0 | seconds between stats publications to etcd |
| client_id | str | generated | id under which stats are published (suffixes -r/-w) |

SGLang also reads `prefetch_threshold`, `prefetch_timeout_base`, `prefetch_timeout_per_ki_token`,
`hicache_storage_pass_prefix_keys` and `tp_lcm_size` from the same JSON (it pops them before the
backend sees them); they are accepted and ignored here.

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
Unsupported configurations (DCP, attention context parallelism, heterogeneous-TP head splitting,
page_head/page_unified layouts, hybrid side pools, dtypes outside bf16/fp16/fp8_e4m3) are refused
with a ConfigError at construction or registration, never silently mis-keyed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from l2core.layout import LAYOUTS, LayoutName
from l2core.memory import HostMemory
from l2core.pool import HostKVPool, L2Config
from l2core.spec import ConfigError, KVSpec
from l2core.units import parse_size
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig

log = logging.getLogger(__name__)

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# Read (and normally popped) by SGLang's controller before the backend is built: tolerated.
SGLANG_CONTROLLER_KEYS = frozenset(
    {
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}
_HOSTPORT = re.compile(r"^\[?[A-Za-z0-9.:-]+\]?:\d{1,5}$")


def _typed(d: Mapping[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    if key not in d:
        return default
    v = d[key]
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
        names = "/".join(t.__name__ for t in types)
        raise ConfigError(f"extra-config {key!r} must be {names}, got {type(v).__name__} {v!r}")
    return v


@dataclass(frozen=True)
class BackendConfig:
    """Our part of SGLang's `--hicache-storage-backend-extra-config` (see the module docstring)."""

    master: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_size: int = 0
    local_buffer_size: int = 16 << 20
    etcd: str | None = None
    key_prefix: str = "/l3pool"
    model: str | None = None
    tenant: str = ""
    checksum: bool = False
    layers: tuple[int, int] | None = None
    batch_pages: int = 128
    layer_first_mode: str = "multi"
    stats_interval: float = 5.0
    client_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        if extra is None:
            raise ConfigError("l3pool backend needs --hicache-storage-backend-extra-config with at least 'master'")
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra-config must be a JSON object, got {type(extra).__name__}")
        ours = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(extra) - ours - SGLANG_KEYS - SGLANG_CONTROLLER_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown extra-config key(s) {unknown} for the l3pool backend; known: {sorted(ours | SGLANG_KEYS)}"
            )
        if not _typed(extra, "interface_v1", (bool, int), 0):
            raise ConfigError(
                'extra-config needs "interface_v1": 1 — without it SGLang uses the copying batch_get/batch_set '
                "path, which the l3pool backend does not implement (it moves pages zero-copy)"
            )
        master = _typed(extra, "master", (str,), None)
        if master is None:
            raise ConfigError("extra-config is missing 'master' (the mooncake_master RPC address, host:port)")
        if not _HOSTPORT.match(master):
            raise ConfigError(f"extra-config 'master' {master!r}: expected host:port")
        s = {k: _typed(extra, k, (str,), None) for k in ("metadata_server", "local_hostname", "protocol")}
        s |= {k: _typed(extra, k, (str,), None) for k in ("rdma_devices", "key_prefix", "tenant", "client_id")}
        s |= {"etcd": _typed(extra, "etcd", (str,), None), "model": _typed(extra, "model", (str,), None)}
        mode = _typed(extra, "layer_first_mode", (str,), "multi")
        if mode not in ("multi", "staging"):
            raise ConfigError(f"extra-config 'layer_first_mode' must be 'multi' or 'staging', got {mode!r}")
        batch = _typed(extra, "batch_pages", (int,), 128)
        if batch < 1:
            raise ConfigError(f"extra-config 'batch_pages' must be >= 1, got {batch}")
        interval = float(_typed(extra, "stats_interval", (int, float), 5.0))
        if interval <= 0:
            raise ConfigError(f"extra-config 'stats_interval' must be > 0, got {interval}")
        layers = _typed(extra, "layers", (list, tuple), None)
        if layers is not None:
            if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
                raise ConfigError(f"extra-config 'layers' must be [begin, end] (integers), got {layers!r}")
            if not 0 <= layers[0] < layers[1]:
                raise ConfigError(f"extra-config 'layers' {layers!r}: need 0 <= begin < end")
            layers = (layers[0], layers[1])
        return cls(
            master=master,
            segment_size=_size(extra, "segment_size", 0),
            local_buffer_size=_size(extra, "local_buffer_size", 16 << 20),
            checksum=_typed(extra, "checksum", (bool,), False),
            layers=layers,
            batch_pages=batch,
            layer_first_mode=mode,
            stats_interval=interval,
            extra={k: extra[k] for k in SGLANG_KEYS if k in extra},
            **{k: v for k, v in s.items() if v is not None},
        )


def _size(d: Mapping[str, Any], key: str, default: int) -> int:
    v = _typed(d, key, (int, str), default)
    if v == 0 or v == "0":
        return 0
    return parse_size(v, f"extra-config {key!r}")


def _sglang_model_fingerprint(name: str | None) -> str | None:
    return name.replace("/", "-") if name else None


@dataclass
class AdapterStats:
    """Calls as SGLang made them (page counts), besides the L3Client counters."""

    exists_calls: int = 0
    get_calls: int = 0
    set_calls: int = 0
    set_skipped_not_writer: int = 0  # pages a non-writer MLA rank was asked to set (no-op)
    bad_indices: int = 0  # pages refused because their host slots were not one aligned page
    errors: int = 0  # exceptions caught on the data path (reported as misses/failures)
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)  # GB/s per call
    backup_bandwidth: list[float] = field(default_factory=list)


class L3PoolStorage(HiCacheStorage):
    """`HiCacheStorage` whose pages live in the l3pool L3 tier (Mooncake + etcd).

    Lifecycle (SGLang's): `__init__(storage_config, kwargs)` connects to Mooncake (and etcd);
    `register_mem_pool_host(host_pool)` wraps SGLang's host buffer as an l2core pool, registers
    it with Mooncake once and opens the L3 clients; then `batch_exists` / `batch_get_v1` /
    `batch_set_v1` run on SGLang's prefetch and backup threads; `close()` on detach.
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
        self.stats = AdapterStats()
        self._stats_lock = threading.Lock()
        self.namespace: Namespace | None = None
        self.pool: HostKVPool | None = None
        self._reader: L3Client | None = None
        self._writer: L3Client | None = None
        self.metadata: Any = None
        c = self.config
        self.store = MooncakeStore(
            StoreConfig(
                master=c.master,
                metadata=c.metadata_server,
                local_hostname=c.local_hostname,
                protocol=c.protocol,
                rdma_devices=c.rdma_devices,
                segment_bytes=c.segment_size,
                local_buffer_bytes=c.local_buffer_size,
            )
        )
        if c.etcd is not None:
            from l3pool.pool.etcd import EtcdClient
            from l3pool.pool.metadata import Metadata, check_prefix

            try:
                check_prefix(c.key_prefix)
            except ValueError as e:
                self.store.close()
                raise ConfigError(f"extra-config 'key_prefix': {e}") from None
            self.metadata = Metadata(EtcdClient(c.etcd), c.key_prefix)
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
        base_id = self.config.client_id or f"sglang-{uuid.uuid4().hex[:10]}"
        kw: dict[str, Any] = {
            "metadata": self.metadata,
            "batch_pages": self.config.batch_pages,
            "layer_first_mode": self.config.layer_first_mode,
            "stats_interval": self.config.stats_interval,
        }
        # Two clients so a prefetch (reader) and a backup (writer) thread never share the
        # checksum trailer or staging area; both register the same pool buffer (refcounted).
        self._reader = L3Client(pool, self.store, self.namespace, client_id=f"{base_id}-r", **kw)
        if self.is_writer:
            self._writer = L3Client(pool, self.store, self.namespace, client_id=f"{base_id}-w", **kw)
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
        dtype = _DTYPES.get(buf.dtype)
        if dtype is None:
            raise ConfigError(f"host KV dtype {buf.dtype} is not supported; supported: {sorted(map(str, _DTYPES))}")
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
        idx = host_indices.detach().to("cpu", torch.int64).numpy().reshape(-1)
        if idx.size != n * P:
            raise ValueError(f"{n} keys need {n * P} host indices (page size {P}), got {idx.size}")
        slots = idx.reshape(n, P)
        starts = slots[:, 0]
        ok = (starts % P == 0) & (starts >= 0) & (starts // P < self.pool.num_pages)
        ok &= (slots == starts[:, None] + np.arange(P, dtype=np.int64)).all(axis=1)
        bad = int(n - ok.sum())
        if bad:
            with self._stats_lock:
                self.stats.bad_indices += bad
            log.error("%d of %d pages have host indices that are not one aligned page; failing them", bad, n)
        return np.where(ok, starts // P, 0), ok

    def _ready(self) -> bool:
        if self.pool is None:
            log.error("l3pool backend used before register_mem_pool_host")
            return False
        return True

    def _failed(self, what: str, e: BaseException) -> None:
        with self._stats_lock:
            self.stats.errors += 1
        log.warning("l3pool %s failed: %s: %s", what, type(e).__name__, e)

    # -- the v1 interface -----------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading `keys` are in the pool (0 when the pool cannot be reached)."""
        if not keys or not self._ready():
            return 0
        assert self._reader is not None
        with self._stats_lock:
            self.stats.exists_calls += 1
        try:
            return self._reader.lookup(self._keys(list(keys)))
        except Exception as e:
            self._failed("batch_exists", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Copy each page's object straight into its host slots; one bool per page."""
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
        t0 = time.perf_counter()
        try:
            sub = [full[i] for i in sel.tolist()]
            res = client.put(sub, pages[sel]) if write else client.get(sub, pages[sel])
        except Exception as e:
            self._failed("batch_set_v1" if write else "batch_get_v1", e)
            return out
        dt = max(time.perf_counter() - t0, 1e-9)
        for i, r in zip(sel.tolist(), res, strict=True):
            out[i] = r is Outcome.OK
        if self.storage_config.enable_storage_metrics:
            gbps = sum(out) * self.pool.layout.page_bytes / dt / 1e9
            with self._stats_lock:
                (self.stats.backup_pgs if write else self.stats.prefetch_pgs).append(len(keys))
                (self.stats.backup_bandwidth if write else self.stats.prefetch_bandwidth).append(gbps)
        with self._stats_lock:
            if write:
                self.stats.set_calls += 1
            else:
                self.stats.get_calls += 1
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
        """SGLang's cache flush. L3 pages are shared with other instances and keyed by content, so
        they stay (they can never be wrong for this namespace); only local state would go."""
        log.info("l3pool backend: clear() leaves the shared L3 pages in place")

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
        except ImportError:  # pragma: no cover - part of every sglang that can enable metrics
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
        """Close the L3 clients (stats publication, buffer registrations) and the Mooncake client."""
        for c in (self._writer, self._reader):
            if c is not None:
                c.close()
        self._writer = self._reader = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.store is not None:
            self.store.close()
            self.store = None  # type: ignore[assignment]
        if self.metadata is not None:
            self.metadata.etcd.close()
            self.metadata = None


class _BorrowedMemory:
    """SGLang's host buffer seen as l2core host memory: HostKVPool reads `nbytes` and `tensor`
    only, and never closes memory it was handed (SGLang owns and frees it)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.tensor = buf.view(-1).view(torch.uint8)
        self.nbytes = self.tensor.numel()
        self.ptr = self.tensor.data_ptr()

    def close(self) -> None:  # pragma: no cover - never called for borrowed memory
        pass
