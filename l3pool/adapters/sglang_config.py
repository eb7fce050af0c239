"""The SGLang backend's configuration: `--hicache-storage-backend-extra-config` -> BackendConfig.

No sglang import here (the backend, `l3pool.adapters.sglang_hicache`, is the module that imports
it), so the parsing is testable and reusable without the engine.

Extra-config keys (unknown keys are refused with a ConfigError naming them):

| key | type | default | meaning |
|---|---|---|---|
| backend_name, module_path, class_name | str | required by SGLang | how SGLang finds this class |
| interface_v1 | 1/true | required | makes SGLang call the zero-copy `batch_get_v1`/`batch_set_v1` |
| master | "host:port" | required | mooncake_master RPC address |
| metadata_server | str | "P2PHANDSHAKE" | Mooncake metadata: P2PHANDSHAKE, http://H:P/metadata, etcd://H:P |
| local_hostname | str | "127.0.0.1" | this client's Mooncake local_hostname |
| protocol / rdma_devices | str | "tcp" / "" | Mooncake transport |
| segment_size | size | 0 | DRAM the instance donates, split over its tp x pp ranks (0: pure client) |
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
| tp_shared | bool | false | MLA: the TP group keeps one shared host copy (l2core.shm); needs tp_group |
| tp_group | str | none | the instance's TP-group name, the same on its ranks (segment `<tp_group>[-dp<k>]-pp0`) |
| tp_placement | "interleave"/"socket" | "interleave" | NUMA placement of the shared copy |

`batch_pages`, `layer_first_mode` and `stats_interval` are the L3 clients' settings: checked by the
cache builder's rules (`l3pool.cache.config.l3_settings`, errors prefixed "extra-config: ") and
given to the clients it makes (`BackendConfig.l3_settings()`); `BackendConfig.store_config()` is a
rank's Mooncake client config (its RDMA devices and its share of the segment).

SGLang's Mooncake backend names are accepted too, so a user switching backends keeps their
config: `master_server_address` (= master), `global_segment_size` (= segment_size), `device_name`
(= rdma_devices; also its JSON form mapping TP ranks to devices, '{"0": "mlx5_0", ...}') and
`tenant_id` (= tenant; "default", SGLang's name for none, is no tenant). Giving one key under both
names is refused. Where the keys come from, in SGLang's order (0.5.23 `MooncakeBaseStore._load_config`):
1. the extra-config, when it names the master (`master` or `master_server_address`);
2. else the JSON file named by SGLANG_HICACHE_MOONCAKE_CONFIG_PATH (SGLang's Mooncake config file,
   its names or ours): its keys fill in what the extra-config leaves out (the extra-config still
   carries backend_name/module_path/class_name/interface_v1). A file that cannot be read or is not
   a JSON object is a ConfigError naming the path. With the master in the extra-config, a set
   SGLANG_HICACHE_MOONCAKE_CONFIG_PATH is not read, as SGLang does, and a warning says so. Its
   `local_buffer_size` is ignored (SGLang always passes 16 MiB);
3. keys still absent are read from MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER,
   MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE and MOONCAKE_TENANT_ID;
   otherwise our defaults apply (protocol "tcp" and segment 0, where SGLang's would be "rdma" and
   4 GiB).
`local_hostname` follows SGLang's per-process precedence instead: MOONCAKE_LOCAL_HOSTNAME, then
LOCAL_HOSTNAME, then the extra-config's (or file's) value, then "127.0.0.1" — so one shared
extra-config can be broadcast to every node while each node's environment names itself.
`master_metrics_port` and `check_server` are ignored; `client_server_address`, `extra_backend_tag`
and `enable_group_semantics`, and `standalone_storage` / `enable_ssd_offload` / `ssd_offload_path`
when switched on, are refused by name.

Segment size per rank: like SGLang's Mooncake backend, the size (under either name) is what the
whole SGLang instance donates; each of its `tp_size * pp_size` ranks runs one backend and donates
`size // (tp_size * pp_size)` (TP=8, PP=2, "16GiB": 1 GiB per rank, 16 GiB in all). A share
below Mooncake's 16 MiB minimum (other than 0) is refused at construction.

Sizes, one rule for every key and variable (`l2core.units.parse_size`): GB = 10^9 bytes, GiB =
2^30. Under SGLang's Mooncake names a plain "gb" ("16gb", "16GB") is refused: SGLang reads it as
GiB, this rule as 10^9 bytes; write "16GiB" (SGLang's meaning) or bytes.

Checked without SGLang or a cluster: `l3pool check-config FILE|JSON` (`check_extra_config`: every
problem, unknown keys with a did-you-mean; `deploy render` runs it on what it renders). The HA
master form `etcd://...` (the leader looked up in etcd) is refused: the backend's start-up check,
health probe and rebuild talk to one master's host:port. A loopback `local_hostname` (the
default 127.0.0.1 included) with a master elsewhere is warned about (`BackendConfig.warnings`).

SGLang also reads `prefetch_threshold`, `prefetch_timeout_base`, `prefetch_timeout_per_ki_token`,
`hicache_storage_pass_prefix_keys` and `tp_lcm_size` from the same JSON (it pops them before the
backend sees them); they are accepted and ignored here.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from l2core.shm_segment import TPGroup, check_group
from l2core.units import SIZE_RULE, ConfigError, parse_size
from l3pool.cache.config import L3Settings, l3_settings
from l3pool.pool.addr import check_host, check_metadata_url, split_host_port
from l3pool.pool.etcd import security_mapping
from l3pool.pool.metadata import DEFAULT_PREFIX
from l3pool.pool.store import MIN_SEGMENT_BYTES, PROTOCOLS, StoreConfig
from l3pool.values import unknown_key_hint

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
    "tenant": ("MOONCAKE_TENANT_ID",),
}
# local_hostname: these win over the configured value (SGLang's `_resolve_local_hostname`)
LOCAL_HOSTNAME_ENV = ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME")
CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"  # SGLang's Mooncake config file
FILE_IGNORED = frozenset({"local_buffer_size"})  # in SGLang's file but never used by it (16 MiB)
# Other keys of SGLang's Mooncake backend: harmless ones are accepted and ignored; the rest change
# where or how pages are stored, which this backend does not do, so they are refused by name when
# they are on (a config file saying "standalone_storage": false is fine).
MOONCAKE_IGNORED = frozenset({"master_metrics_port", "check_server"})
MOONCAKE_REFUSED = {
    "client_server_address": "a standalone Mooncake client process (MOONCAKE_CLIENT) is not supported",
    "standalone_storage": "standalone storage is not supported",
    "enable_ssd_offload": "SSD offload is not supported (the pool is decode-node DRAM)",
    "ssd_offload_path": "SSD offload is not supported (the pool is decode-node DRAM)",
    "extra_backend_tag": "use 'tenant' to separate key spaces",
    "enable_group_semantics": "group semantics are not supported",
}
_OFF = (None, False, 0, "", "false", "False", "0")
SGLANG_DEFAULT_TENANT = "default"  # SGLang's Mooncake backend's name for "no tenant"


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
    key_prefix: str = DEFAULT_PREFIX
    model: str | None = None
    tenant: str = ""
    checksum: bool = False
    layers: tuple[int, int] | None = None
    batch_pages: int = 128
    layer_first_mode: str = "multi"
    stats_interval: float = 5.0
    client_id: str | None = None
    clear_force: bool = True
    tp_shared: bool = False
    tp_group: str | None = None
    tp_placement: str = "interleave"
    etcd_security: dict[str, str] = field(default_factory=dict)  # files are read when connecting
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None, *, warn: bool = True
    ) -> BackendConfig:
        """Parse the extra-config; SGLang Mooncake names and `MOONCAKE_*` variables of `env`
        (default: the process environment) fill in what the extra-config leaves out. `warn`: log
        `warnings()` (a loopback local_hostname with a remote master)."""
        if extra is None:
            raise ConfigError("l3pool backend needs --hicache-storage-backend-extra-config with at least 'master'")
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra-config must be a JSON object, got {type(extra).__name__}")
        ours = {f for f in cls.__dataclass_fields__ if f != "extra"}
        extra, sglang_sized = _normalize_mooncake(extra, os.environ if env is None else env, frozenset(ours))
        unknown = sorted(set(extra) - ours - SGLANG_KEYS - SGLANG_CONTROLLER_KEYS - MOONCAKE_IGNORED)
        if unknown:
            raise ConfigError("; ".join(unknown_key_problem(k) for k in unknown))
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
        if master.startswith("etcd://"):
            raise ConfigError(
                f"extra-config 'master' {master!r}: Mooncake's high-availability form (the leader master looked "
                "up in etcd) is not supported by the l3pool backend: its start-up check, health probe and "
                "client rebuild talk to one master's host:port; give the leader's host:port"
            )
        s = {k: _typed(extra, k, (str,), None) for k in ("metadata_server", "local_hostname", "protocol")}
        try:  # the addresses as the agent checks them: a value Mooncake cannot use is refused here
            split_host_port(master, "extra-config 'master'")
            if s["metadata_server"] is not None:
                check_metadata_url(s["metadata_server"], "extra-config 'metadata_server'")
            if s["local_hostname"] is not None:
                check_host(s["local_hostname"], "extra-config 'local_hostname'")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if s["protocol"] is not None and s["protocol"] not in PROTOCOLS:
            raise ConfigError(f"extra-config 'protocol' {s['protocol']!r}: must be one of {', '.join(PROTOCOLS)}")
        s |= {k: _typed(extra, k, (str,), None) for k in ("rdma_devices", "key_prefix", "tenant", "client_id")}
        s |= {"tp_group": _typed(extra, "tp_group", (str,), None)}
        s |= {"etcd": _typed(extra, "etcd", (str,), None), "model": _typed(extra, "model", (str,), None)}
        mode = _typed(extra, "layer_first_mode", (str,), "multi")
        batch = _typed(extra, "batch_pages", (int,), 128)
        interval = float(_typed(extra, "stats_interval", (int, float), 5.0))
        _l3_settings(batch, mode, interval)  # the cache builder's rules for L3 client settings
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
        tp_shared = _typed(extra, "tp_shared", (bool,), False)
        tp_group = _typed(extra, "tp_group", (str,), None)
        placement = _typed(extra, "tp_placement", (str,), "interleave")
        if placement not in ("interleave", "socket"):
            raise ConfigError(f"extra-config 'tp_placement' must be 'interleave' or 'socket', got {placement!r}")
        if tp_shared and not tp_group:
            raise ConfigError(
                "extra-config 'tp_shared' needs 'tp_group' (the instance's name, the same on its TP ranks)"
            )
        if tp_group is not None and not tp_shared:
            raise ConfigError("extra-config 'tp_group' without \"tp_shared\": true")
        if tp_group is not None:
            check_group(f"{tp_group}-pp0", 0, 1)  # the name's characters and length, before any rank
        cfg = cls(
            master=master,
            tp_shared=tp_shared,
            tp_placement=placement,
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
        for w in cfg.warnings(given_hostname=s["local_hostname"] is not None) if warn else ():
            log.warning("l3pool backend: %s", w)
        return cfg

    def warnings(self, given_hostname: bool = True) -> list[str]:
        """What parses but cannot work across nodes: a loopback local_hostname (the default
        127.0.0.1 included) with a master on another address, so peers would transfer to
        themselves."""
        mhost = self.master.rpartition(":")[0]
        if not (_loopback(self.local_hostname) and not _loopback(mhost)):
            return []
        how = "" if given_hostname else " (the default)"
        return [
            f"extra-config 'local_hostname' {self.local_hostname!r}{how} is a loopback address but the master "
            f"{self.master} is not: Mooncake peers on other nodes cannot reach this client; set 'local_hostname' "
            "(or MOONCAKE_LOCAL_HOSTNAME) to this node's address"
        ]

    def l3_settings(self) -> L3Settings:
        """The L3 clients' settings (`l3pool.cache.config.l3_settings`, checked when parsed)."""
        return _l3_settings(self.batch_pages, self.layer_first_mode, self.stats_interval)

    def store_config(self, tp_rank: int, tp_size: int, pp_size: int) -> StoreConfig:
        """The Mooncake client of TP rank `tp_rank`: its RDMA devices (`_devices_for_rank`) and
        its share of the instance's segment (`rank_segment_bytes`)."""
        return StoreConfig(
            master=self.master,
            metadata=self.metadata_server,
            local_hostname=self.local_hostname,
            protocol=self.protocol,
            rdma_devices=_devices_for_rank(self.rdma_devices, tp_rank),
            segment_bytes=self.rank_segment_bytes(tp_size, pp_size),
            local_buffer_bytes=self.local_buffer_size,
            tenant=self.tenant,
        )

    def tp_shared_group(
        self, tp_rank: int, tp_size: int, pp_rank: int, is_mla: bool, *, pp_size: int = 1, dp_rank: int = 0
    ) -> TPGroup | None:
        """This rank's TP group for a shared L2 copy (None without `tp_shared`): MLA only (MHA
        ranks hold different heads); one group per attention-DP group (`-dp<rank>` when > 0) and
        PP stage (`-pp<rank>`). Pipeline parallelism is refused: SGLang hands stages > 0 stage 0's
        write completions (its `_all_reduce` forwards PP0's MIN), so a later stage's ranks > 0
        would not wait for their own rank 0's copy."""
        if not self.tp_shared:
            return None
        if not is_mla:
            raise ConfigError("extra-config 'tp_shared' needs an MLA model: MHA TP ranks hold different KV heads")
        if int(pp_size) > 1:
            raise ConfigError(
                "extra-config 'tp_shared' does not support pipeline parallelism: SGLang takes every stage's "
                "write completions from stage 0, so a stage's ranks > 0 would not wait for their rank 0's copy"
            )
        dp = f"-dp{int(dp_rank)}" if int(dp_rank) else ""
        return TPGroup(f"{self.tp_group}{dp}-pp{int(pp_rank)}", int(tp_rank), int(tp_size), placement=self.tp_placement)

    def rank_segment_bytes(self, tp_size: int, pp_size: int) -> int:
        """What one rank donates: `segment_size // (tp_size * pp_size)`, as SGLang's Mooncake
        backend splits `global_segment_size` (0 stays 0: a pure client). ConfigError when the
        share of a non-zero size is below Mooncake's 16 MiB minimum segment."""
        ranks = max(1, int(tp_size)) * max(1, int(pp_size))
        share = self.segment_size // ranks
        if self.segment_size and share < MIN_SEGMENT_BYTES:
            raise ConfigError(
                f"extra-config segment size {self.segment_size} bytes over tp_size x pp_size = {ranks} ranks is "
                f"{share} bytes per rank, below Mooncake's minimum segment of 16 MiB ({MIN_SEGMENT_BYTES}); "
                f"give at least {MIN_SEGMENT_BYTES * ranks} bytes, or 0 for a pure client"
            )
        return share


# Every key an extra-config may hold: ours, SGLang's own, its controller's, SGLang's Mooncake names.
KNOWN_KEYS = frozenset(
    {f for f in BackendConfig.__dataclass_fields__ if f != "extra"}
    | SGLANG_KEYS | SGLANG_CONTROLLER_KEYS | set(MOONCAKE_ALIASES) | MOONCAKE_IGNORED | set(MOONCAKE_REFUSED)
)  # fmt: skip


def unknown_key_problem(key: str, where: str = "extra-config ") -> str:
    """The line for an unknown key: the closest known one, else every known key (aliases too)."""
    return f"unknown {where}key {key!r} for the l3pool backend: {unknown_key_hint(key, sorted(KNOWN_KEYS))}"


def _loopback(host: str) -> bool:
    h = host.strip().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


# What `check_extra_config` puts in place of a bad required key, to find the problems after it.
_STAND_INS: dict[str, Any] = {"master": "127.0.0.1:1", "interface_v1": 1}


def check_extra_config(
    extra: Any, env: Mapping[str, str] | None = None
) -> tuple[BackendConfig | None, list[str], list[str]]:
    """Every problem of an extra-config, without SGLang or a cluster: (the parsed config or None,
    problems, warnings). Unknown keys are listed at once (each with its did-you-mean); then the
    parser's first error is noted and the key it names dropped (a required one replaced by a
    stand-in), until it parses. Warnings (`BackendConfig.warnings`) only for a valid config."""
    if not isinstance(extra, Mapping):
        return None, [f"extra-config must be a JSON object, got {type(extra).__name__}"], []
    d = dict(extra)
    problems = [unknown_key_problem(k) for k in sorted(set(d) - KNOWN_KEYS)]
    for k in set(d) - KNOWN_KEYS:
        del d[k]
    for _ in range(len(d) + len(_STAND_INS) + 1):
        try:
            cfg = BackendConfig.from_extra_config(d, env, warn=False)
        except ConfigError as e:
            problems.append(str(e))
            msg = str(e)  # the key it names: quoted first ('tp_placement'), else a bare word (batch_pages)
            named = [k for k in re.findall(r"['\"](\w+)['\"]", msg) + re.findall(r"\w+", msg) if k in KNOWN_KEYS]
            key = next((k for k in named if k in d or k in _STAND_INS), None)
            if key in _STAND_INS and d.get(key) != _STAND_INS[key]:
                d[key] = _STAND_INS[key]
            elif key in d:
                del d[key]
            else:
                break
            continue
        if problems:
            return None, problems, []
        return cfg, [], cfg.warnings(given_hostname="local_hostname" in extra or _env_hostname(env))
    return None, problems, []


def _env_hostname(env: Mapping[str, str] | None) -> bool:
    return any((os.environ if env is None else env).get(n) for n in LOCAL_HOSTNAME_ENV)


def _l3_settings(batch_pages: int, layer_first_mode: str, stats_interval: float) -> L3Settings:
    """The cache builder's L3 client settings for SGLang's writer: its backup thread hands the
    backend one batch at a time (under `_write_lock`), of up to its own STORAGE_BATCH_SIZE (128)
    pages; a smaller `batch_pages` splits them into several puts, which is allowed (writer 1 / 1)."""
    try:
        return l3_settings(batch_pages=batch_pages, layer_first_mode=layer_first_mode, stats_interval=stats_interval)
    except ConfigError as e:
        raise ConfigError(f"extra-config: {e}") from None


def _normalize_mooncake(
    extra: Mapping[str, Any], env: Mapping[str, str], ours: frozenset[str]
) -> tuple[dict[str, Any], bool]:
    """SGLang Mooncake names -> ours; then, in SGLang's order, SGLang's config file (when the
    extra-config does not name the master), `MOONCAKE_*` fallbacks for keys still absent, and
    local_hostname from the environment first (module docstring).

    Returns the config under our names and whether `segment_size` came under SGLang's names
    (`global_segment_size`, MOONCAKE_GLOBAL_SEGMENT_SIZE: ints are bytes, see `_sglang_size`)."""
    out, sglang_sized = _renamed(extra, "extra-config")
    path = env.get(CONFIG_PATH_ENV)
    if path and "master" in out:
        log.warning(
            "l3pool backend: $%s=%s is not read because the extra-config names the master "
            "(SGLang's Mooncake backend does the same); move the keys you need into the extra-config",
            CONFIG_PATH_ENV, path,
        )  # fmt: skip
    elif path:
        where = f"${CONFIG_PATH_ENV} file {path}"
        raw = _read_config_file(path, where)
        unknown = sorted(
            set(raw) - ours - set(MOONCAKE_ALIASES) - MOONCAKE_IGNORED - FILE_IGNORED - set(MOONCAKE_REFUSED)
        )
        if unknown:
            raise ConfigError(f"{where}: " + "; ".join(unknown_key_problem(k, "") for k in unknown))
        from_file, file_sized = _renamed({k: v for k, v in raw.items() if k not in FILE_IGNORED}, where)
        for k, v in from_file.items():
            if k not in out:
                out[k] = v
                sglang_sized |= file_sized and k == "segment_size"
        log.info("l3pool backend: Mooncake config read from %s (%s)", path, ", ".join(sorted(from_file)))
    for key, names in MOONCAKE_ENV.items():
        if key in out:
            continue
        for name in names:
            value = env.get(name)
            if value:  # set and non-empty
                out[key] = _sglang_tenant(value) if key == "tenant" else value
                sglang_sized |= key == "segment_size"
                log.info("l3pool backend: %s taken from $%s", key, name)
                break
    for name in LOCAL_HOSTNAME_ENV:  # the process environment wins here, as in SGLang
        value = env.get(name)
        if value:
            if out.get("local_hostname") not in (None, value):
                log.info("l3pool backend: local_hostname %s from $%s (over the configured %r)",
                         value, name, out["local_hostname"])  # fmt: skip
            out["local_hostname"] = value
            break
    return out, sglang_sized


def _renamed(given: Mapping[str, Any], where: str) -> tuple[dict[str, Any], bool]:
    """Refused SGLang switches that are on -> ConfigError; SGLang names -> ours (both names of
    one key refused). Also returns whether the segment size came as `global_segment_size`."""
    out = dict(given)
    refused = sorted(k for k in out if k in MOONCAKE_REFUSED and out[k] not in _OFF)
    if refused:
        key = refused[0]
        raise ConfigError(f"{where} key {key!r} of SGLang's Mooncake backend: {MOONCAKE_REFUSED[key]}")
    for k in [k for k in out if k in MOONCAKE_REFUSED]:
        del out[k]  # switched off: nothing to do
    sglang_sized = False
    for alias, ours in MOONCAKE_ALIASES.items():
        if alias not in out:
            continue
        if ours in out:
            raise ConfigError(
                f"{where} gives {ours!r} twice: as {ours!r} and as SGLang's Mooncake name {alias!r}; keep one"
            )
        out[ours] = out.pop(alias)
        sglang_sized |= ours == "segment_size"
        if ours == "tenant":
            out[ours] = _sglang_tenant(out[ours])
    return out, sglang_sized


def _read_config_file(path: str, where: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    return data


def _sglang_tenant(value: Any) -> Any:
    """SGLang's Mooncake backend reads an empty tenant id as "default"; both mean no tenant here."""
    if isinstance(value, str):
        value = value.strip()
        return "" if value == SGLANG_DEFAULT_TENANT else value
    return value


def _sglang_size(value: Any) -> int:
    """A size under SGLang's Mooncake names: an int is bytes; text is read by the one rule of every
    l3pool size (`l2core.units.parse_size`: GB = 10^9, GiB = 2^30). Text in plain "gb" (any case,
    "16gb") is refused: sglang 0.5.23's `_parse_global_segment_size` reads it as GiB, l3pool's rule
    as 10^9 bytes, and a config that means 7 % more or less on one backend than on the other is
    not taken silently either way."""
    what = "extra-config 'global_segment_size' (or MOONCAKE_GLOBAL_SEGMENT_SIZE, or the config file's)"
    if value == 0 or value == "0":
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what} must be int or str, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and re.fullmatch(r"\s*[\d.]+\s*gb\s*", value, re.IGNORECASE):
        num = value.strip()[:-2].strip()
        raise ConfigError(
            f"{what} {value!r}: SGLang's Mooncake backend reads 'gb' as GiB (2^30), l3pool as GB (10^9): "
            f"write '{num}GiB' (what SGLang means) or a number of bytes ({SIZE_RULE})"
        )
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
