"""The cluster config of `l3pool deploy`: one TOML file describing a real PD-disaggregated cluster.

    [cluster]   name, key_prefix, protocol (tcp | rdma), l3pool (the CLI on every node), log_dir
    [etcd]      endpoints = [...] of a running etcd, or host/client_port/peer_port/data_dir to launch one;
                TLS/auth: ca, cert, key, user, password_file (every component), server_cert/server_key (launch)
    [master]    mooncake_master: host, rpc/metadata/admin ports, client_ttl, eviction ratios, kv lease TTL,
                tenants (tenant = quota: Mooncake tenant isolation) and tenant_policy (where the policy goes)
    [l3]        adapter defaults for prefill nodes: model (fingerprint), checksum, tenant
    [sglang]    SGLang defaults for every node; [sglang.prefill] / [sglang.decode] for one role
    [[decode]]  name, host (IP), donate ("64GB"), numa_node, rdma_devices, lease_ttl, metrics_port, run_sglang,
                [decode.sglang] overrides
    [[prefill]] name, host (IP), [prefill.sglang] and [prefill.l3] overrides
    [router]    optional sglang_router in PD mode: host, port, python, extra_args
    [firewall]  allow (CIDRs that may reach the pool's ports; default: the config's hosts),
                admin_allow (the master's admin port; default: the master host), client_ports ("A-B")

`load_config(path)` returns (DeployConfig or None, problems). Every problem names the key it is
about (`prefill[1].sglang.page_size`); the config is returned only when there is no error.
Validation never raises for bad input: malformed TOML, unknown keys, wrong types, sizes, IPs,
port clashes on one host and inconsistent namespaces all become `Problem`s.
`deploy/cluster.example.toml` documents every key.

Torch-free (runs on any node, before anything is installed but l3pool itself).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l2core.names import LAYOUTS
from l2core.units import format_size
from l3pool.cluster.servers import (
    CLIENT_TTL_S,
    EVICTION_HIGH_WATERMARK_RATIO,
    EVICTION_RATIO,
    PUT_START_DISCARD_S,
    PUT_START_RELEASE_S,
    master_flag_names,
)
from l3pool.pool.etcd import SECURITY_KEYS
from l3pool.pool.metadata import DEFAULT_PREFIX
from l3pool.pool.store import (
    DEFAULT_METADATA_PORT,
    PROTOCOLS,
    check_rdma_devices,
    metadata_url,
    segment_too_small,
)
from l3pool.tools.deploy_values import (
    Problem,
    Src,
    _as_abspath,
    _as_command,
    _as_duration,
    _as_env,
    _as_fingerprint,
    _as_id,
    _as_ip,
    _as_prefix,
    _as_quotas,
    _as_size,
    _as_strlist,
    _merge,
    _none_in,
    _port,
    _Reader,
    _sub,
)
from l3pool.values import BadValue, as_bool, as_nonempty, as_str, choice, int_in, ratio, type_name

# The io backend each layout needs. SGLang rewrites other combinations (page_first + direct becomes
# layer_first or page_first_direct, page_first_direct + kernel switches to direct), so the layout
# it really runs would differ from the configured one.
LAYOUT_IO = {"layer_first": ("kernel", "direct"), "page_first": ("kernel",), "page_first_direct": ("direct",)}
IO_BACKENDS = ("kernel", "direct")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# The agent's Prometheus endpoint (`l3pool agent --metrics-port`) on each decode node; `metrics_port = 0`: none.
AGENT_METRICS_PORT = 9464
# Where `render` pins the listening ports of every Mooncake client (agents, prefill engines) with
# MC_MIN_RPC_PORT/MC_MAX_RPC_PORT: each client listens on two ports of the range, on all interfaces
# (0.3.13 has no bind-address setting for them), so the firewall rules can name them. Mooncake's
# own default range is 15000-17000; a range above 32767 is ignored (it falls back to that).
CLIENT_PORTS = (15000, 15999)
RESERVED_NAMES = ("etcd", "master", "router")

# The SGLang adapter: its identity (`--hicache-storage-backend dynamic` imports module_path and
# builds class_name) and the keys of `--hicache-storage-backend-extra-config` it reads beyond
# those. The one place to change when the adapter's keys change: `deploy.adapter_extra_config`
# fills these from the config (of: master, metadata_server, etcd, key_prefix, protocol, local_hostname,
# model, checksum, tenant), and `check` warns about settings the adapter cannot receive.
ADAPTER = {
    "backend_name": "l3pool",
    "module_path": "l3pool.adapters.sglang_hicache",
    "class_name": "L3PoolStorage",
    "interface_v1": 1,  # SGLang calls the zero-copy batch_get_v1/batch_set_v1 only with this
}
ADAPTER_KEYS = (
    "master", "metadata_server", "etcd", "key_prefix", "protocol", "local_hostname", "model", "checksum", "tenant",
    "etcd_security",
)  # fmt: skip

_TOP = ("cluster", "etcd", "master", "l3", "sglang", "decode", "prefill", "router", "firewall")
_CLUSTER = ("name", "key_prefix", "protocol", "l3pool", "log_dir")
_ETCD_LAUNCH = ("host", "client_port", "peer_port", "data_dir", "name", "binary")
_ETCD_CLIENT_SEC = SECURITY_KEYS  # what every component gets (ca, cert, key, user, password_file)
_ETCD_SERVER_SEC = ("server_cert", "server_key")  # the launched etcd's own certificate
_ETCD = ("endpoints", *_ETCD_LAUNCH, *_ETCD_CLIENT_SEC, *_ETCD_SERVER_SEC)
_FIREWALL = ("allow", "admin_allow", "client_ports")
_MASTER = ("host", "rpc_port", "metadata_port", "admin_port", "client_ttl", "eviction_high_watermark_ratio",
           "eviction_ratio", "default_kv_lease_ttl", "put_start_discard_timeout_sec",
           "put_start_release_timeout_sec", "binary", "extra_args", "metadata_server",
           "metadata_binary", "tenants", "tenant_policy")  # fmt: skip
_L3 = ("model", "checksum", "tenant")
_SG_COMMON = ("model_path", "tp_size", "page_size", "port", "python", "ib_device", "transfer_backend", "extra_args",
              "env")  # fmt: skip
_SG_PREFILL = (*_SG_COMMON, "bootstrap_port", "hicache_layout", "hicache_io_backend", "hicache_ratio",
               "hicache_size", "hicache_write_policy", "hicache_prefetch_policy")  # fmt: skip
_SG_DECODE = _SG_COMMON
# The most DRAM one decode node may donate: above any server's memory today (a 2-socket host tops out
# at a few TiB), so a larger value is a unit typo ("64TB" for "64GB"), refused before any node starts.
MAX_DONATE_BYTES = 64 << 40
_DECODE = ("name", "host", "donate", "numa_node", "rdma_devices", "lease_ttl", "metrics_port", "run_sglang", "sglang")
_PREFILL = ("name", "host", "sglang", "l3")
_ROUTER = ("host", "port", "python", "extra_args")
# Flags the render generates from typed keys: extra_args must not repeat them.
_SG_OWNED = ("--model-path", "--tp-size", "--tp", "--page-size", "--host", "--port", "--disaggregation-mode",
             "--disaggregation-transfer-backend", "--disaggregation-ib-device", "--disaggregation-bootstrap-port",
             "--enable-hierarchical-cache", "--hicache-mem-layout", "--hicache-io-backend", "--hicache-ratio",
             "--hicache-size", "--hicache-write-policy", "--hicache-storage-prefetch-policy",
             "--hicache-storage-backend", "--hicache-storage-backend-extra-config")  # fmt: skip
_MASTER_OWNED = master_flag_names() | {"port"}  # what l3pool.cluster.servers.master_argv writes; port: rpc_port


@dataclass(frozen=True)
class EtcdSpec:
    endpoints: tuple[str, ...]  # http://host:port
    launch: bool = False  # True: `render` starts this etcd (one member) on `host`
    host: str = ""
    client_port: int = 2379
    peer_port: int = 2380
    data_dir: str = "/var/lib/l3pool/etcd"
    name: str = "l3pool-etcd"
    binary: str = "etcd"
    # TLS/auth (paths on the nodes; "" = not used): what every component passes to etcd ...
    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""
    # ... and the launched etcd's server certificate (https on its client port)
    server_cert: str = ""
    server_key: str = ""

    @property
    def endpoints_str(self) -> str:
        return ",".join(self.endpoints)

    @property
    def tls(self) -> bool:
        return any(e.startswith("https://") for e in self.endpoints)

    def security_keys(self) -> dict[str, str]:
        """The set client-side keys (ca, cert, key, user, password_file): the SGLang adapter's
        `etcd_security` object."""
        return {k: getattr(self, k) for k in _ETCD_CLIENT_SEC if getattr(self, k)}

    def security_flags(self) -> list[str]:
        """The same as `l3pool agent/inspect/doctor/purge` flags."""
        return [x for k, v in self.security_keys().items() for x in (f"--etcd-{k.replace('_', '-')}", v)]

    def security(self) -> Any:
        """An `EtcdSecurity` for tools run on this machine (its files must exist here; ValueError)."""
        from l3pool.pool.etcd import EtcdSecurity

        return EtcdSecurity.from_mapping(self.security_keys(), "[etcd]")


@dataclass(frozen=True)
class FirewallSpec:
    allow: tuple[str, ...]  # CIDRs that may reach the pool's ports (loopback always may)
    admin_allow: tuple[str, ...]  # ... the master's admin port (it can remove every object)
    client_ports: tuple[int, int] = CLIENT_PORTS


@dataclass(frozen=True)
class MasterSpec:
    host: str
    rpc_port: int = 50051
    metadata_port: int = DEFAULT_METADATA_PORT
    admin_port: int = 9003
    client_ttl: int = CLIENT_TTL_S
    eviction_high_watermark_ratio: float = EVICTION_HIGH_WATERMARK_RATIO
    eviction_ratio: float = EVICTION_RATIO
    default_kv_lease_ttl: str | None = None
    # a put started and never finished (writer killed): other puts of its key are refused for
    # `discard` s, its space is freed `release` to 2 x `release` s after it started (Mooncake's
    # defaults, 30 / 600 s, held a killed writer's space for over 10 minutes). `release` must
    # exceed the longest transfer of one put batch. See l3pool/README.md.
    put_start_discard_timeout_sec: int = PUT_START_DISCARD_S
    put_start_release_timeout_sec: int = PUT_START_RELEASE_S
    binary: str = "mooncake_master"
    extra_args: tuple[str, ...] = ()
    # the transfer engine's HTTP metadata server: "standalone" runs the wheel's
    # mooncake_http_metadata_server bound to `host`; "embedded" is the master's own, which binds
    # 0.0.0.0 whatever --http_metadata_server_host says (0.3.13; tests/l3pool/cluster/test_listeners.py)
    metadata_server: str = "standalone"
    metadata_binary: str = "mooncake_http_metadata_server"  # a command ("python3 -m mooncake.http_metadata_server")
    # Mooncake's own tenant isolation: (tenant, byte quota) pairs; non-empty = the master runs with
    # --enable_multi_tenants and this policy, which the master's start script writes to tenant_policy
    tenants: tuple[tuple[str, int], ...] = ()
    tenant_policy: str = "/etc/l3pool/tenants.yaml"

    @property
    def rpc(self) -> str:
        return f"{_bracket(self.host)}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return metadata_url(self.host, self.metadata_port)

    @property
    def admin_url(self) -> str:
        return f"http://{_bracket(self.host)}:{self.admin_port}"


@dataclass(frozen=True)
class L3Spec:
    model: str
    checksum: bool = False
    tenant: str = ""


@dataclass(frozen=True)
class SGLangSpec:
    model_path: str
    tp_size: int = 1
    page_size: int = 64
    port: int = 30000
    python: str = "python3"
    ib_device: str = ""
    transfer_backend: str = "mooncake"
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # prefill only
    bootstrap_port: int = 8998
    hicache_layout: str = "page_first_direct"
    hicache_io_backend: str = "direct"
    hicache_ratio: float | None = None
    hicache_size_gb: int | None = None  # SGLang's --hicache-size is in GB (10^9 bytes)
    hicache_write_policy: str = "write_through"
    hicache_prefetch_policy: str = "best_effort"


@dataclass(frozen=True)
class DecodeNode:
    name: str
    host: str
    donate: str
    donate_bytes: int
    numa_node: int | None = None
    rdma_devices: str = ""
    lease_ttl: int = 10
    sglang: SGLangSpec | None = None
    metrics_port: int = AGENT_METRICS_PORT  # the agent's Prometheus endpoint on `host`; 0: none


@dataclass(frozen=True)
class PrefillNode:
    name: str
    host: str
    sglang: SGLangSpec
    l3: L3Spec


@dataclass(frozen=True)
class RouterSpec:
    host: str
    port: int = 8000
    python: str = "python3"
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeployConfig:
    path: str
    name: str
    key_prefix: str
    protocol: str
    l3pool: str
    log_dir: str
    etcd: EtcdSpec
    master: MasterSpec
    decode: tuple[DecodeNode, ...]
    prefill: tuple[PrefillNode, ...]
    router: RouterSpec | None = None
    firewall: FirewallSpec = FirewallSpec((), ())


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- sections ----------------------------------------------------------------------------------
def _read_etcd(r: _Reader, raw: Any) -> EtcdSpec | None:
    src = r.table(raw, "etcd", _ETCD, required=True)
    if src is None:
        return None
    launch_keys = [k for k in _ETCD_LAUNCH if k in src]
    if "endpoints" in src and launch_keys:
        r.error(f"etcd.{launch_keys[0]}", "give either etcd.endpoints (a running etcd) or etcd.host (launch one)")
        return None
    sec = {k: r.get(src, k, as_nonempty, "") for k in (*_ETCD_CLIENT_SEC, *_ETCD_SERVER_SEC)}
    if _none_in(*sec.values()) or not _etcd_security_ok(r, sec, launch="endpoints" not in src):
        return None
    if "endpoints" in src:
        eps = r.get(src, "endpoints", _as_strlist)
        if eps is None:
            return None
        from l3pool.pool.etcd import parse_urls

        try:
            parsed = parse_urls(eps)
        except ValueError as e:
            r.error("etcd.endpoints", str(e))
            return None
        tls = bool(sec["ca"] or sec["cert"])
        if tls and any(e.scheme == "http" for e in parsed):
            r.error("etcd.endpoints", "http:// endpoints with etcd.ca/cert: use https://")
            return None
        urls = tuple(e._replace(scheme=e.scheme or ("https" if tls else "http")).name for e in parsed)
        return EtcdSpec(urls, **sec)
    if "host" not in src:
        r.error("etcd", "give etcd.endpoints (a running etcd) or etcd.host (launch one with `render`)")
        return None
    host = r.get(src, "host", _as_ip)
    cport = r.get(src, "client_port", _port, 2379)
    pport = r.get(src, "peer_port", _port, 2380)
    data_dir = r.get(src, "data_dir", as_nonempty, EtcdSpec.data_dir)
    name = r.get(src, "name", _as_id, EtcdSpec.name)
    binary = r.get(src, "binary", as_nonempty, EtcdSpec.binary)
    if _none_in(host, cport, pport, data_dir, name, binary):
        return None
    scheme = "https" if sec["server_cert"] else "http"
    url = f"{scheme}://{_bracket(host)}:{cport}"
    return EtcdSpec((url,), True, host, cport, pport, data_dir, name, binary, **sec)


def _etcd_security_ok(r: _Reader, sec: dict[str, str], launch: bool) -> bool:
    """Combinations that cannot work; paths are not checked (they are paths on the nodes)."""
    pairs = [("cert", "key"), ("server_cert", "server_key"), ("user", "password_file")]
    for a, b in pairs:
        if bool(sec[a]) != bool(sec[b]):
            have, miss = (a, b) if sec[a] else (b, a)
            r.error(f"etcd.{miss}", f"missing: etcd.{have} needs etcd.{miss} too")
            return False
    if not launch and sec["server_cert"]:
        r.error("etcd.server_cert", "only for an etcd that `render` launches (etcd.host); not with etcd.endpoints")
        return False
    if launch and (sec["ca"] or sec["cert"]) and not sec["server_cert"]:
        r.error("etcd.ca", "the launched etcd serves plain HTTP: give etcd.server_cert/server_key for TLS")
        return False
    if launch and sec["server_cert"] and not sec["ca"]:
        r.error("etcd.ca", "missing: clients need the CA that signed etcd.server_cert")
        return False
    return True


def _read_firewall(r: _Reader, raw: Any, hosts: list[str], master_host: str) -> FirewallSpec | None:
    src = r.table(raw, "firewall", _FIREWALL) or {}
    default = tuple(dict.fromkeys(f"{h}/{32 if ':' not in h else 128}" for h in hosts))
    allow = r.get(src, "allow", _as_cidrs, default)
    admin = r.get(src, "admin_allow", _as_cidrs, (f"{master_host}/{32 if ':' not in master_host else 128}",))
    ports = r.get(src, "client_ports", _as_port_range, CLIENT_PORTS)
    return None if _none_in(allow, admin, ports) else FirewallSpec(allow, admin, ports)


def _as_cidrs(v: Any) -> tuple[str, ...]:
    out = []
    for x in _as_strlist(v):
        try:
            out.append(str(ipaddress.ip_network(x.strip(), strict=False)))
        except ValueError:
            raise BadValue(f"{x!r} is not a network (e.g. 10.0.0.0/16 or 10.0.0.7/32)") from None
    if not out:
        raise BadValue("empty: nothing could reach the pool")
    return tuple(out)


def _as_port_range(v: Any) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", as_str(v))
    if not m or not 1024 <= int(m[1]) < int(m[2]) <= 32767:
        # Mooncake 0.3.13 logs "Invalid port range" and falls back to 15000-17000 above 32767
        raise BadValue(f'{v!r}: expected "LOW-HIGH" with 1024 <= LOW < HIGH <= 32767 (Mooncake\'s limit)')
    if int(m[2]) - int(m[1]) < 63:
        raise BadValue(f"{v!r}: keep at least 64 ports (two per Mooncake client, one client per engine rank)")
    return int(m[1]), int(m[2])


def _read_master(r: _Reader, raw: Any) -> MasterSpec | None:
    src = r.table(raw, "master", _MASTER, required=True)
    if src is None:
        return None
    d = MasterSpec("")
    vals = {
        "host": r.get(src, "host", _as_ip, where="master"),
        "rpc_port": r.get(src, "rpc_port", _port, d.rpc_port),
        "metadata_port": r.get(src, "metadata_port", _port, d.metadata_port),
        "admin_port": r.get(src, "admin_port", _port, d.admin_port),
        "client_ttl": r.get(src, "client_ttl", int_in(1, 3600), d.client_ttl),
        "eviction_high_watermark_ratio": r.get(src, "eviction_high_watermark_ratio", ratio,
                                               d.eviction_high_watermark_ratio),
        "eviction_ratio": r.get(src, "eviction_ratio", ratio, d.eviction_ratio),
        "put_start_discard_timeout_sec": r.get(src, "put_start_discard_timeout_sec", int_in(1, 86400),
                                               d.put_start_discard_timeout_sec),
        "put_start_release_timeout_sec": r.get(src, "put_start_release_timeout_sec", int_in(2, 86400),
                                               d.put_start_release_timeout_sec),
        "binary": r.get(src, "binary", as_nonempty, d.binary),
        "extra_args": r.get(src, "extra_args", _as_strlist, ()),
        "metadata_server": r.get(src, "metadata_server", choice(("standalone", "embedded")), d.metadata_server),
        "metadata_binary": r.get(src, "metadata_binary", _as_command, d.metadata_binary),
        "tenants": r.get(src, "tenants", _as_quotas, ()),
        "tenant_policy": r.get(src, "tenant_policy", _as_abspath, d.tenant_policy),
    }  # fmt: skip
    lease = r.get(src, "default_kv_lease_ttl", _as_duration, "")
    if _none_in(lease, *vals.values()):
        return None
    discard, release = vals["put_start_discard_timeout_sec"], vals["put_start_release_timeout_sec"]
    if isinstance(discard, int) and isinstance(release, int) and release <= discard:
        r.error(
            "master.put_start_release_timeout_sec",
            f"{release} must exceed put_start_discard_timeout_sec ({discard}): mooncake_master refuses otherwise",
        )
    for arg in vals["extra_args"]:
        flag = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and flag in _MASTER_OWNED:
            key = flag if flag in _MASTER else "tenants" if "tenant" in flag else "host/ports"
            r.error("master.extra_args", f"{arg!r} is generated from master.{key}; set it there")
    if vals["tenants"] and "default" not in dict(vals["tenants"]):
        r.error("master.tenants", "list 'default' too: decode agents and clients without a tenant use it")
    return MasterSpec(**vals, default_kv_lease_ttl=lease or None)


def _read_l3(r: _Reader, src: Src, where: str) -> L3Spec | None:
    if "model" not in src:
        r.error(f"{where}.model", "missing: set the model fingerprint in [l3] (or in this node's [prefill.l3])")
        return None
    model = r.get(src, "model", _as_fingerprint)
    checksum = r.get(src, "checksum", as_bool, False)
    tenant = r.get(src, "tenant", as_str, "")
    if _none_in(model, checksum, tenant):
        return None
    return L3Spec(model, checksum, tenant)


def _read_sglang(r: _Reader, src: Src, where: str, prefill: bool) -> SGLangSpec | None:
    d = SGLangSpec("")
    v: dict[str, Any] = {
        "model_path": r.get(src, "model_path", as_nonempty, where=where),
        "tp_size": r.get(src, "tp_size", int_in(1, 1024), d.tp_size),
        "page_size": r.get(src, "page_size", int_in(1, 1 << 20), d.page_size),
        "port": r.get(src, "port", _port, d.port),
        "python": r.get(src, "python", as_nonempty, d.python),
        "ib_device": r.get(src, "ib_device", as_str, ""),
        "transfer_backend": r.get(src, "transfer_backend", as_nonempty, d.transfer_backend),
        "extra_args": r.get(src, "extra_args", _as_strlist, ()),
        "env": r.get(src, "env", _as_env, {}),
    }
    if prefill:
        layout = r.get(src, "hicache_layout", choice(LAYOUTS), d.hicache_layout)
        io_default = LAYOUT_IO.get(layout or "", ("kernel",))[0]
        size = r.get(src, "hicache_size", _as_size, 0)
        ratio = r.get(src, "hicache_ratio", _float_over_1, 0.0)
        v.update(
            bootstrap_port=r.get(src, "bootstrap_port", _port, d.bootstrap_port),
            hicache_layout=layout,
            hicache_io_backend=r.get(src, "hicache_io_backend", choice(IO_BACKENDS), io_default),
            hicache_write_policy=r.get(src, "hicache_write_policy", choice(WRITE_POLICIES), d.hicache_write_policy),
            hicache_prefetch_policy=r.get(
                src, "hicache_prefetch_policy", choice(PREFETCH_POLICIES), d.hicache_prefetch_policy
            ),
        )
        if _none_in(size, ratio, *v.values()):
            return None
        if size and ratio:
            r.error(
                src["hicache_size"][1], f"give hicache_size or hicache_ratio, not both (also {src['hicache_ratio'][1]})"
            )
            return None
        if size and size % 10**9:
            r.error(
                src["hicache_size"][1], f"SGLang takes --hicache-size in whole GB (10^9 bytes); {size} bytes is not"
            )
            return None
        layout, io = v["hicache_layout"], v["hicache_io_backend"]
        if io not in LAYOUT_IO[layout]:
            path = src["hicache_io_backend"][1] if "hicache_io_backend" in src else f"{where}.hicache_io_backend"
            need = " or ".join(LAYOUT_IO[layout])
            r.error(
                path,
                f"hicache_layout {layout!r} needs io backend {need}: with {io!r} SGLang rewrites the "
                "layout/io backend and its pages would not match the namespace",
            )
            return None
        v.update(hicache_size_gb=size // 10**9 if size else None, hicache_ratio=ratio or None)
    elif _none_in(*v.values()):
        return None
    for arg in v["extra_args"]:
        if arg.split("=", 1)[0] in _SG_OWNED:
            r.error(src["extra_args"][1], f"{arg!r} is generated by `render` from the typed keys; set those instead")
            return None
    return SGLangSpec(**v)


def _float_over_1(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadValue(f"expected a number, got {type_name(v)} {v!r}")
    if v <= 1:
        raise BadValue(f"{v}: SGLang needs the host pool larger than the GPU pool (ratio > 1)")
    return float(v)


def _nodes(r: _Reader, raw: Any, kind: str) -> list[tuple[int, Any]]:
    if raw is None:
        r.error(kind, f"missing section: at least one [[{kind}]] node")
        return []
    if not isinstance(raw, list) or not raw:
        r.error(kind, f"expected [[{kind}]] tables (an array of tables), got {type_name(raw)}")
        return []
    return list(enumerate(raw))


def _read_decode(r: _Reader, i: int, raw: Any, sg: tuple[Src | None, Src | None]) -> DecodeNode | None:
    where = f"decode[{i}]"
    src = r.table(raw, where, _DECODE)
    if src is None:
        return None
    name = r.get(src, "name", _as_id, where=where)
    host = r.get(src, "host", _as_ip, where=where)
    nbytes = r.get(src, "donate", _as_size, where=where)
    donate = str(src["donate"][0]).strip() if "donate" in src else None
    numa = r.get(src, "numa_node", int_in(0, 1023), -1)
    rdma = r.get(src, "rdma_devices", as_str, "")
    lease = r.get(src, "lease_ttl", int_in(2, 3600), 10)
    mport = r.get(src, "metrics_port", int_in(0, 65535), AGENT_METRICS_PORT)
    run_sg = r.get(src, "run_sglang", as_bool, True)
    own = r.table(_sub(src, "sglang"), f"{where}.sglang", _SG_DECODE)
    if nbytes is not None and (problem := segment_too_small(nbytes, src["donate"][0], None)) is not None:
        r.error(src["donate"][1], problem)
        nbytes = None
    if nbytes is not None and nbytes > MAX_DONATE_BYTES:  # the node's own memory is checked by its agent at start
        r.error(src["donate"][1], f"{format_size(nbytes, src['donate'][0])} is more DRAM than one host has "
                f"(at most {format_size(MAX_DONATE_BYTES)}): a typo in the unit?")  # fmt: skip
        nbytes = None
    spec = _read_sglang(r, _merge(*sg, own), f"{where}.sglang", prefill=False) if run_sg else None
    if _none_in(name, host, donate, nbytes, numa, rdma, lease, mport, run_sg) or (run_sg and spec is None):
        return None
    assert donate is not None
    return DecodeNode(name, host, donate, nbytes, None if numa < 0 else numa, rdma, lease, spec, mport)


def _read_prefill(
    r: _Reader, i: int, raw: Any, sg: tuple[Src | None, Src | None], l3: Src | None
) -> PrefillNode | None:
    where = f"prefill[{i}]"
    src = r.table(raw, where, _PREFILL)
    if src is None:
        return None
    name = r.get(src, "name", _as_id, where=where)
    host = r.get(src, "host", _as_ip, where=where)
    own_sg = r.table(_sub(src, "sglang"), f"{where}.sglang", _SG_PREFILL)
    own_l3 = r.table(_sub(src, "l3"), f"{where}.l3", _L3)
    spec = _read_sglang(r, _merge(*sg, own_sg), f"{where}.sglang", prefill=True)
    l3spec = _read_l3(r, _merge(l3, own_l3), f"{where}.l3")
    if spec is None or l3spec is None or _none_in(name, host):
        return None
    return PrefillNode(name, host, spec, l3spec)


def _read_router(r: _Reader, raw: Any) -> RouterSpec | None:
    src = r.table(raw, "router", _ROUTER)
    if src is None:
        return None
    host = r.get(src, "host", _as_ip, where="router")
    port = r.get(src, "port", _port, 8000)
    python = r.get(src, "python", as_nonempty, "python3")
    extra = r.get(src, "extra_args", _as_strlist, ())
    return None if _none_in(host, port, python, extra) else RouterSpec(host, port, python, extra)


# -- cross-checks ------------------------------------------------------------------------------
def _services(cfg: DeployConfig) -> list[tuple[str, int, str]]:
    """(host, port, key path) of every listening port the config decides."""
    out: list[tuple[str, int, str]] = []
    if cfg.etcd.launch:
        out += [
            (cfg.etcd.host, cfg.etcd.client_port, "etcd.client_port"),
            (cfg.etcd.host, cfg.etcd.peer_port, "etcd.peer_port"),
        ]
    m = cfg.master
    out += [(m.host, m.rpc_port, "master.rpc_port"), (m.host, m.metadata_port, "master.metadata_port"),
            (m.host, m.admin_port, "master.admin_port")]  # fmt: skip
    for i, d in enumerate(cfg.decode):
        if d.metrics_port:
            out.append((d.host, d.metrics_port, f"decode[{i}].metrics_port"))
        if d.sglang:
            out.append((d.host, d.sglang.port, f"decode[{i}].sglang.port"))
    for i, p in enumerate(cfg.prefill):
        out += [(p.host, p.sglang.port, f"prefill[{i}].sglang.port"),
                (p.host, p.sglang.bootstrap_port, f"prefill[{i}].sglang.bootstrap_port")]  # fmt: skip
    if cfg.router:
        out.append((cfg.router.host, cfg.router.port, "router.port"))
    return out


def _is_loopback_url(url: str) -> bool:
    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _cross_check(r: _Reader, cfg: DeployConfig) -> None:
    seen: dict[str, str] = {}
    names = [(f"decode[{i}]", d.name) for i, d in enumerate(cfg.decode)]
    names += [(f"prefill[{i}]", p.name) for i, p in enumerate(cfg.prefill)]
    for where, name in names:
        if name in RESERVED_NAMES:
            r.error(f"{where}.name", f"{name!r} is reserved for the {name} process; pick another name")
        elif name in seen:
            r.error(f"{where}.name", f"{name!r} is already the name of {seen[name]}")
        seen.setdefault(name, where)

    taken: dict[tuple[str, int], str] = {}
    for host, port, path in _services(cfg):
        if (host, port) in taken and taken[(host, port)] != path:
            r.error(path, f"port {port} on {host} is also {taken[(host, port)]}")
        taken.setdefault((host, port), path)
    mooncake_hosts = {d.host for d in cfg.decode} | {p.host for p in cfg.prefill}
    lo, hi = cfg.firewall.client_ports  # where render makes Mooncake clients listen
    for host, port, path in _services(cfg):
        if host in mooncake_hosts and lo <= port <= hi:
            r.warn(path, f"port {port} on {host} is in {lo}-{hi}, where Mooncake clients on that host take ports")

    hosts = [(host, path) for host, _, path in _services(cfg)] + [(d.host, f"decode[{i}].host")
                                                                   for i, d in enumerate(cfg.decode)]  # fmt: skip
    loop = [(h, p) for h, p in hosts if ipaddress.ip_address(h).is_loopback]
    if loop and len(loop) != len(hosts):
        r.error(loop[0][1], f"{loop[0][0]} is a loopback address but other nodes are on other hosts; use the node's IP")

    e = cfg.etcd
    clear = [u for u in e.endpoints if u.startswith("http://") and not _is_loopback_url(u)]
    if clear:
        where = "etcd.server_cert" if e.launch else "etcd.endpoints"
        msg = (
            f"etcd at {', '.join(clear)} speaks plain HTTP: pool keys cross the network in clear and anyone who "
            "reaches it can register members (deploy/README.md, threat model); add TLS and a user"
        )
        r.warn(where, msg)

    # settings prefill nodes would need but the adapter's extra-config cannot carry (yet)
    meta_differs = cfg.master.metadata_port != DEFAULT_METADATA_PORT
    unsent = [("metadata_server", "master.metadata_port", meta_differs, metadata_url("<master>")),
              ("key_prefix", "cluster.key_prefix", cfg.key_prefix != DEFAULT_PREFIX, DEFAULT_PREFIX),
              ("protocol", "cluster.protocol", cfg.protocol != "tcp", "tcp")]  # fmt: skip
    for key, path, differs, default in unsent:
        if differs and key not in ADAPTER_KEYS:
            r.warn(path, f"the SGLang adapter's extra-config has no {key!r} key (it has: {', '.join(ADAPTER_KEYS)}): "
                         f"prefill nodes use their default ({default})")  # fmt: skip
    # a tenant is Mooncake-isolated only by a master run with --enable_multi_tenants (master.tenants)
    quotas = dict(cfg.master.tenants)
    for i, p in enumerate(cfg.prefill):
        if p.l3.tenant and not quotas:
            r.warn(f"prefill[{i}].l3.tenant", f"{p.l3.tenant!r} keeps this node's pages in its own namespace, but "
                   "without master.tenants the master ignores tenant ids: any client can read or remove them; "
                   "list each tenant with its quota there (deploy/README.md, Tenants)")  # fmt: skip
        elif quotas and (p.l3.tenant or "default") not in quotas:
            r.error(f"prefill[{i}].l3.tenant", f"{p.l3.tenant!r} is not in master.tenants: the master would refuse "
                    "every put of this node (TENANT_NOT_REGISTERED)")  # fmt: skip
    for i, d in enumerate(cfg.decode):  # names only: the devices are the node's, not this machine's
        try:
            check_rdma_devices(d.rdma_devices, cfg.protocol, what="", sys_root=None)
        except ValueError as e:
            r.error(f"decode[{i}].rdma_devices", str(e))
        if cfg.protocol == "rdma" and not d.rdma_devices.strip():
            r.warn(f"decode[{i}].rdma_devices", "empty with protocol 'rdma': Mooncake picks devices itself")

    # Namespaces: pages are shared by prefill nodes whose namespace matches. The same fingerprint
    # must mean the same weights, and nodes meant to share must agree on page size and layout.
    by_fp: dict[tuple[str, str, bool], list[tuple[int, PrefillNode]]] = {}
    for i, p in enumerate(cfg.prefill):
        by_fp.setdefault((p.l3.model, p.l3.tenant, p.l3.checksum), []).append((i, p))
    for group in by_fp.values():
        i0, p0 = group[0]
        for i, p in group[1:]:
            for attr in ("model_path", "page_size", "hicache_layout", "tp_size"):
                a, b = getattr(p0.sglang, attr), getattr(p.sglang, attr)
                if a != b:
                    why = (
                        "the same fingerprint must mean the same weights"
                        if attr == "model_path"
                        else "they would write different namespaces and never share pages"
                    )
                    r.error(
                        f"prefill[{i}].sglang.{attr}",
                        f"{b!r} differs from prefill[{i0}] ({a!r}) with the same model fingerprint "
                        f"{p.l3.model!r}: {why}",
                    )
    paths: dict[str, tuple[int, str]] = {}
    for i, p in enumerate(cfg.prefill):
        j, fp = paths.setdefault(p.sglang.model_path, (i, p.l3.model))
        if fp != p.l3.model:
            r.warn(f"prefill[{i}].l3.model", f"{p.l3.model!r} differs from prefill[{j}] ({fp!r}) for the same "
                   "model_path: these nodes never share pages")  # fmt: skip
    served = {p.sglang.model_path for p in cfg.prefill}
    for i, d in enumerate(cfg.decode):
        if d.sglang and d.sglang.model_path not in served:
            r.error(f"decode[{i}].sglang.model_path", f"{d.sglang.model_path!r} is served by no prefill node")
    if cfg.router and not any(d.sglang for d in cfg.decode):
        r.error("router", "a PD router needs decode nodes with run_sglang = true")


# -- entry points ------------------------------------------------------------------------------
def parse_config(data: dict[str, Any], path: str = "<config>") -> tuple[DeployConfig | None, list[Problem]]:
    """Validate an already-parsed TOML document."""
    r = _Reader()
    top = r.table(data, "", _TOP) or {}
    cl = r.table(_sub(top, "cluster"), "cluster", _CLUSTER) or {}
    name = r.get(cl, "name", _as_id, "l3pool")
    prefix = r.get(cl, "key_prefix", _as_prefix, DEFAULT_PREFIX)
    protocol = r.get(cl, "protocol", choice(PROTOCOLS), "tcp")
    l3pool = r.get(cl, "l3pool", _as_command, "l3pool")
    log_dir = r.get(cl, "log_dir", as_nonempty, "/var/log/l3pool")
    etcd = _read_etcd(r, _sub(top, "etcd"))
    master = _read_master(r, _sub(top, "master"))
    l3 = r.table(_sub(top, "l3"), "l3", _L3)
    sg_raw = _sub(top, "sglang")
    sg_all = r.table(sg_raw, "sglang", (*_SG_PREFILL, "prefill", "decode"))
    sg_common: Src | None = None
    if sg_all is not None:  # prefill-only keys at the top level apply to prefill nodes only
        sg_common = {k: v for k, v in sg_all.items() if k not in ("prefill", "decode")}
    sg_prefill = r.table(_sub(sg_all or {}, "prefill"), "sglang.prefill", _SG_PREFILL)
    sg_decode = r.table(_sub(sg_all or {}, "decode"), "sglang.decode", _SG_DECODE)
    common_decode = {k: v for k, v in (sg_common or {}).items() if k in _SG_DECODE}
    decode = [
        _read_decode(r, i, raw, (common_decode, sg_decode)) for i, raw in _nodes(r, _sub(top, "decode"), "decode")
    ]
    prefill = [_read_prefill(r, i, raw, (sg_common, sg_prefill), l3)
               for i, raw in _nodes(r, _sub(top, "prefill"), "prefill")]  # fmt: skip
    router = _read_router(r, _sub(top, "router"))
    hosts = [x.host for x in (*decode, *prefill, router, master) if x is not None]
    hosts += [etcd.host] if etcd is not None and etcd.launch else []
    firewall = _read_firewall(r, _sub(top, "firewall"), hosts, master.host if master else "127.0.0.1")
    if r.errors or _none_in(name, prefix, protocol, l3pool, log_dir, etcd, master, firewall, *decode, *prefill):
        if not r.errors:  # pragma: no cover - every None above comes with an error
            r.error("", "invalid config")
        return None, r.problems
    assert etcd is not None and master is not None and firewall is not None
    cfg = DeployConfig(path, name, prefix, protocol, l3pool, log_dir, etcd, master,
                       tuple(d for d in decode if d), tuple(p for p in prefill if p), router, firewall)  # fmt: skip
    _cross_check(r, cfg)
    return (None if r.errors else cfg), r.problems


def load_config(path: str | Path) -> tuple[DeployConfig | None, list[Problem]]:
    """Read and validate a TOML cluster config; never raises for bad input."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return None, [Problem("error", "", f"cannot read {p}: {getattr(e, 'strerror', None) or e}")]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return None, [Problem("error", "", f"{p} is not valid TOML: {e}")]
    return parse_config(data, str(p))
