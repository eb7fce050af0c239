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
| etcd | str | none | etcd endpoints: namespace registry + published stats (none: no etcd); https:// for TLS |
| etcd_security | object | {} | etcd TLS/auth: ca, cert, key, user, password_file (paths; or L3POOL_ETCD_PASSWORD) |
| key_prefix | str | "/l3pool" | etcd key prefix |
| model | str | SGLang's model name | model fingerprint in the namespace ('/' is not allowed) |
| tenant | str | "" | namespace salt + Mooncake tenant_id (isolated by a --enable_multi_tenants master) |
| checksum | bool | false | xxh3-64 of each page's bytes in its trailer; a mismatch on get is a miss |
| layers | [begin, end] | host pool's start_layer + its layers | absolute layer range of this PP stage |
| batch_pages | int | 128 | pages per Mooncake call |
| layer_first_mode | "multi"/"staging" | "multi" | how layer_first pages move (see l3pool/README.md) |
| stats_interval | number | 5.0 | seconds between stats publications to etcd |
| client_id | str | generated | id under which stats are published (suffixes -r/-w) |
| clear_force | bool | true | `clear()` also removes pages under a read lease (see `clear`) |

SGLang's Mooncake backend names are accepted too, so a user switching backends keeps their
config: `master_server_address` (= master), `global_segment_size` (= segment_size), `device_name`
(= rdma_devices; also its JSON form mapping TP ranks to devices, '{"0": "mlx5_0", ...}') and
`tenant_id` (= tenant; "default", SGLang's name for none, is no tenant). Giving one key under both
names is refused. Keys still absent are read, like that backend does, from MOONCAKE_MASTER,
MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE,
MOONCAKE_LOCAL_HOSTNAME (then LOCAL_HOSTNAME) and MOONCAKE_TENANT_ID; otherwise our defaults
apply (protocol "tcp" and segment 0, where SGLang's would be "rdma" and "4gb"). Precedence:
extra-config, then environment — also for local_hostname, which SGLang's Mooncake backend takes
from the environment first. `master_metrics_port` and `check_server` are ignored;
`client_server_address`, `standalone_storage`, SSD offload, `extra_backend_tag` and
`enable_group_semantics` are refused by name.

Size units: our own size keys use l2core's units — "4GB" is 4 * 10**9 bytes, "4GiB" 4 * 2**30,
a bare number is bytes. SGLang's Mooncake backend (0.5.23, `_parse_global_segment_size`) reads
"4gb"/"4GB" as 4 GiB (4 * 2**30) and any other text as a plain byte count, so a size given
under its names (`global_segment_size`, MOONCAKE_GLOBAL_SEGMENT_SIZE) is read its way: the same
string donates the same bytes under both backends.

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

import contextlib
import json
import logging
import os
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
from l2core.spec import ConfigError, KVSpec, dtype_name
from l2core.units import parse_size
from l3pool import metrics
from l3pool.pool.client import L3Client
from l3pool.pool.etcd import security_mapping
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
# SGLang's Mooncake backend (mooncake_store.py, 0.5.23) names -> ours, so a user switching backends
# keeps their extra-config; giving both names of one key is refused.
MOONCAKE_ALIASES = {
    "master_server_address": "master",
    "global_segment_size": "segment_size",
    "device_name": "rdma_devices",
    "tenant_id": "tenant",
}
# Environment fallbacks, read (as SGLang's Mooncake backend does) only when the key is absent.
MOONCAKE_ENV = {
    "master": ("MOONCAKE_MASTER",),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER",),
    "segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "rdma_devices": ("MOONCAKE_DEVICE",),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "tenant": ("MOONCAKE_TENANT_ID",),
}
# Other keys of SGLang's Mooncake backend: harmless ones are accepted and ignored; the rest change
# where or how pages are stored, which this backend does not do, so they are refused by name.
MOONCAKE_IGNORED = frozenset({"master_metrics_port", "check_server"})
MOONCAKE_REFUSED = {
    "client_server_address": "a standalone Mooncake client process (MOONCAKE_CLIENT) is not supported",
    "standalone_storage": "standalone storage is not supported",
    "enable_ssd_offload": "SSD offload is not supported (the pool is decode-node DRAM)",
    "ssd_offload_path": "SSD offload is not supported (the pool is decode-node DRAM)",
    "extra_backend_tag": "use 'tenant' to separate key spaces",
    "enable_group_semantics": "group semantics are not supported",
}
SGLANG_DEFAULT_TENANT = "default"  # SGLang's Mooncake backend's name for "no tenant"
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
    clear_force: bool = True
    etcd_security: dict[str, str] = field(default_factory=dict)  # files are read when connecting
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> BackendConfig:
        """Parse the extra-config; SGLang Mooncake names and `MOONCAKE_*` variables of `env`
        (default: the process environment) fill in what the extra-config leaves out."""
        if extra is None:
            raise ConfigError("l3pool backend needs --hicache-storage-backend-extra-config with at least 'master'")
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra-config must be a JSON object, got {type(extra).__name__}")
        extra, sglang_sized = _normalize_mooncake(extra, os.environ if env is None else env)
        ours = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(extra) - ours - SGLANG_KEYS - SGLANG_CONTROLLER_KEYS - MOONCAKE_IGNORED)
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
            raise ConfigError(
                "extra-config is missing 'master' (the mooncake_master RPC address, host:port; "
                "also read as 'master_server_address' or from MOONCAKE_MASTER)"
            )
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
        sec = _typed(extra, "etcd_security", (dict,), {})
        try:
            etcd_security = security_mapping(sec, "extra-config 'etcd_security'")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        layers = _typed(extra, "layers", (list, tuple), None)
        if layers is not None:
            if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
                raise ConfigError(f"extra-config 'layers' must be [begin, end] (integers), got {layers!r}")
            if not 0 <= layers[0] < layers[1]:
                raise ConfigError(f"extra-config 'layers' {layers!r}: need 0 <= begin < end")
            layers = (layers[0], layers[1])
        return cls(
            master=master,
            segment_size=_sglang_size(extra["segment_size"]) if sglang_sized else _size(extra, "segment_size", 0),
            local_buffer_size=_size(extra, "local_buffer_size", 16 << 20),
            checksum=_typed(extra, "checksum", (bool,), False),
            clear_force=_typed(extra, "clear_force", (bool,), True),
            layers=layers,
            batch_pages=batch,
            layer_first_mode=mode,
            stats_interval=interval,
            etcd_security=etcd_security,
            extra={k: extra[k] for k in SGLANG_KEYS if k in extra},
            **{k: v for k, v in s.items() if v is not None},
        )


def _normalize_mooncake(extra: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], bool]:
    """SGLang Mooncake names -> ours, then `MOONCAKE_*` fallbacks for keys still absent.

    Returns the extra-config under our names and whether `segment_size` came from SGLang's
    `global_segment_size` or MOONCAKE_GLOBAL_SEGMENT_SIZE (read with SGLang's units: "4gb" = 4 GiB)."""
    out = dict(extra)
    refused = sorted(k for k in out if k in MOONCAKE_REFUSED)
    if refused:
        key = refused[0]
        raise ConfigError(f"extra-config key {key!r} of SGLang's Mooncake backend: {MOONCAKE_REFUSED[key]}")
    sglang_sized = False
    for alias, ours in MOONCAKE_ALIASES.items():
        if alias not in out:
            continue
        if ours in out:
            raise ConfigError(
                f"extra-config gives {ours!r} twice: as {ours!r} and as SGLang's Mooncake name {alias!r}; keep one"
            )
        out[ours] = out.pop(alias)
        sglang_sized |= ours == "segment_size"
        if ours == "tenant":
            out[ours] = _sglang_tenant(out[ours])
    for ours, names in MOONCAKE_ENV.items():
        if ours in out:
            continue
        for name in names:
            value = env.get(name)
            if value:  # set and non-empty
                out[ours] = _sglang_tenant(value) if ours == "tenant" else value
                sglang_sized |= ours == "segment_size"
                log.info("l3pool backend: %s taken from $%s", ours, name)
                break
    return out, sglang_sized


def _sglang_tenant(value: Any) -> Any:
    """SGLang's Mooncake backend reads an empty tenant id as "default"; both mean no tenant here."""
    if isinstance(value, str):
        value = value.strip()
        return "" if value == SGLANG_DEFAULT_TENANT else value
    return value


def _sglang_size(value: Any) -> int:
    """A size under SGLang's Mooncake names: an int is bytes; text ending in "gb" (any case) is
    GiB, as sglang 0.5.23's `_parse_global_segment_size` reads it ("4gb" = 4 * 2**30); anything
    else is parsed as our own sizes (bytes, "512MiB", ...)."""
    what = "extra-config 'global_segment_size' (or MOONCAKE_GLOBAL_SEGMENT_SIZE)"
    if isinstance(value, str) and value.strip().lower().endswith("gb"):
        num = value.strip()[:-2].strip()
        if not num.isdigit():
            raise ConfigError(f"{what}: cannot parse {value!r}; SGLang's Mooncake names take whole GiB such as '4gb'")
        return int(num) << 30
    if value == 0 or value == "0":
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what} must be int or str, got {type(value).__name__} {value!r}")
    return parse_size(value, what)


def _size(d: Mapping[str, Any], key: str, default: int) -> int:
    v = _typed(d, key, (int, str), default)
    if v == 0 or v == "0":
        return 0
    return parse_size(v, f"extra-config {key!r}")


def _devices_for_rank(devices: str, tp_rank: int) -> str:
    """`rdma_devices` as a string, or (like SGLang's Mooncake `device_name`) a JSON object
    mapping TP ranks to device lists: '{"0": "mlx5_0", "1": "mlx5_1"}'."""
    if not devices.strip().startswith("{"):
        return devices
    try:
        table = json.loads(devices)
    except json.JSONDecodeError as e:
        raise ConfigError(f"extra-config 'rdma_devices'/'device_name' looks like JSON but is not: {e}") from None
    if not isinstance(table, dict):
        raise ConfigError("extra-config 'rdma_devices'/'device_name' JSON must map TP ranks to device names")
    value = table.get(str(tp_rank), table.get(tp_rank))  # type: ignore[call-overload]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"extra-config 'rdma_devices'/'device_name' has no device for TP rank {tp_rank}: {devices}")
    return value


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
    cleared_pages: int = 0  # pages removed by clear()
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
        self._write_lock = threading.Lock()
        self._metrics_warned = False
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
                rdma_devices=_devices_for_rank(c.rdma_devices, cfg.tp_rank),
                segment_bytes=c.segment_size,
                local_buffer_bytes=c.local_buffer_size,
                tenant=c.tenant,
            )
        )
        if c.etcd is not None:
            from l3pool.pool.etcd import EtcdClient, EtcdSecurity
            from l3pool.pool.metadata import Metadata, check_prefix

            try:
                check_prefix(c.key_prefix)
                sec = EtcdSecurity.from_mapping(c.etcd_security, "extra-config 'etcd_security'")
                etcd = EtcdClient(c.etcd, security=sec)
            except ValueError as e:
                self.store.close()
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
        # Two clients (an L3Client is thread-safe; this keeps reader and writer stats apart);
        # both register the same pool buffer (refcounted).
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
        metrics.ADAPTER_ERRORS("sglang").inc()
        log.warning("l3pool %s failed: %s: %s", what, type(e).__name__, e)

    # -- the v1 interface -----------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading `keys` are in the pool (0 when the pool cannot be reached)."""
        if not keys or not self._ready():
            return 0
        assert self._reader is not None
        with self._stats_lock:
            self.stats.exists_calls += 1
        metrics.ADAPTER_CALLS("sglang", "exists").inc()
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
