"""The command lines of the pool's servers: a one-member etcd and mooncake_master.

The one place that builds them: the local cluster (`l3pool.cluster.local`), `l3pool deploy render`
(`l3pool.tools.deploy`) and the tests' own servers (tests/l3pool/conftest.py) all call
`etcd_argv` / `master_argv`, so every master runs with the product's flags; what differs between
them is a named field of `EtcdFlags` / `MasterFlags`, never a flag list of their own.

etcd (one member): clients on `host` (and on 127.0.0.1 too when `host` is not a loopback
address), its peer (raft) port on loopback only (one member has no peer to talk to), zap logs on
stderr. TLS: https on the client port with the server certificate, client certificates required
(the server cert needs clientAuth too: etcd's JSON gateway dials etcd with it).

mooncake_master: RPC, admin (`--metrics_*`) and, when `metadata_port` is set, the embedded HTTP
metadata server on `host`; eviction ratios and put-start timeouts always explicit (a killed
writer's unfinished puts: their keys refused for `discard` s, their space freed `release` ..
2 x `release` s after the put started; Mooncake's own 30 / 600 s held that space for over 10
minutes; l3pool/README.md, "Puts tell the truth").

Torch-free and stdlib-only: `deploy render` runs on any node.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# the master's product defaults (`l3pool deploy`'s [master] table and the local cluster take them)
CLIENT_TTL_S = 10
EVICTION_HIGH_WATERMARK_RATIO = 0.9
EVICTION_RATIO = 0.05
PUT_START_DISCARD_S = 10
PUT_START_RELEASE_S = 30


def url(host: str, port: int, scheme: str = "http") -> str:
    """scheme://host:port, an IPv6 host in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def _port(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 65535:
        raise ValueError(f"{name} must be a TCP port (1..65535), got {v!r}")


def _positive(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int (seconds), got {v!r}")


@dataclass(frozen=True)
class EtcdServerTls:
    """The launched etcd's server side of TLS (paths on its node)."""

    cert: str
    key: str
    ca: str  # the CA client certificates must chain to


@dataclass(frozen=True)
class EtcdFlags:
    name: str
    data_dir: str
    host: str  # clients connect (and the member advertises) here
    client_port: int
    peer_port: int
    tls: EtcdServerTls | None = None
    log_level: str = "info"  # the local cluster: "warn" (its log is for errors)

    def __post_init__(self) -> None:
        if not self.name or not self.data_dir or not self.host:
            raise ValueError(f"etcd needs a name, a data dir and a host, got {self.name!r}, {self.data_dir!r}, "
                             f"{self.host!r}")  # fmt: skip
        _port("etcd client_port", self.client_port)
        _port("etcd peer_port", self.peer_port)
        if self.client_port == self.peer_port:
            raise ValueError(f"etcd client_port and peer_port are both {self.client_port}")
        if self.log_level not in ("debug", "info", "warn", "error", "panic", "fatal"):
            raise ValueError(f"etcd log_level must be debug, info, warn, error, panic or fatal, got {self.log_level!r}")

    @property
    def endpoint(self) -> str:
        """The URL clients use (and the member advertises)."""
        return url(self.host, self.client_port, "https" if self.tls else "http")


def etcd_argv(binary: str, f: EtcdFlags) -> list[str]:
    """The etcd command line of `f` (see the module docstring)."""
    client, scheme = f.endpoint, "https" if f.tls else "http"
    listen = client if _is_loopback(f.host) else f"{client},{url('127.0.0.1', f.client_port, scheme)}"
    peer = url("127.0.0.1", f.peer_port)
    argv = [binary, "--name", f.name, "--data-dir", f.data_dir, "--listen-client-urls", listen,
            "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{f.name}={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", f.log_level]  # fmt: skip
    if f.tls is not None:
        t = f.tls
        argv += ["--cert-file", t.cert, "--key-file", t.key, "--trusted-ca-file", t.ca, "--client-cert-auth"]
    return argv


@dataclass(frozen=True)
class MasterFlags:
    host: str  # RPC, admin and the embedded metadata server bind (their host flags) here
    rpc_port: int
    admin_port: int  # --metrics_port: /metrics, /health, the admin HTTP API
    metadata_port: int | None  # the embedded HTTP metadata server's; None: a standalone one serves it
    client_ttl: int = CLIENT_TTL_S
    eviction_high_watermark_ratio: float = EVICTION_HIGH_WATERMARK_RATIO
    eviction_ratio: float = EVICTION_RATIO
    put_start_discard_timeout_sec: int = PUT_START_DISCARD_S
    put_start_release_timeout_sec: int = PUT_START_RELEASE_S
    default_kv_lease_ttl: str | None = None  # None: the master's own (10 s); else raw ms or "10s", "500ms"
    tenant_policy: str | None = None  # a tenant quota file: Mooncake's multi-tenant mode on, quotas from it

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the master needs a host")
        ports = [("rpc_port", self.rpc_port), ("admin_port", self.admin_port)]
        ports += [("metadata_port", self.metadata_port)] if self.metadata_port is not None else []
        for name, v in ports:
            _port(f"master {name}", v)
        if len({v for _, v in ports}) != len(ports):
            raise ValueError(f"master ports must differ, got {dict(ports)}")
        _positive("client_ttl", self.client_ttl)
        _positive("put_start_discard_timeout_sec", self.put_start_discard_timeout_sec)
        _positive("put_start_release_timeout_sec", self.put_start_release_timeout_sec)
        if self.put_start_release_timeout_sec <= self.put_start_discard_timeout_sec:
            raise ValueError(
                f"put_start_release_timeout_sec ({self.put_start_release_timeout_sec}) must exceed "
                f"put_start_discard_timeout_sec ({self.put_start_discard_timeout_sec}): the master refuses otherwise"
            )
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
                raise ValueError(f"{name} must be a ratio in (0, 1], got {v!r}")
        if self.default_kv_lease_ttl is not None and not str(self.default_kv_lease_ttl).strip():
            raise ValueError("default_kv_lease_ttl must be None or a duration (raw ms, or 10s / 500ms)")


def master_argv(binary: str, f: MasterFlags) -> list[str]:
    """The mooncake_master command line of `f` (see the module docstring)."""
    embedded = [] if f.metadata_port is None else [
        "--enable_http_metadata_server", f"--http_metadata_server_host={f.host}",
        f"--http_metadata_server_port={f.metadata_port}",
    ]  # fmt: skip
    argv = [binary, f"--rpc_address={f.host}", f"--rpc_port={f.rpc_port}", *embedded,
            f"--metrics_host={f.host}", f"--metrics_port={f.admin_port}", f"--client_ttl={f.client_ttl}",
            f"--eviction_high_watermark_ratio={f.eviction_high_watermark_ratio:g}",
            f"--eviction_ratio={f.eviction_ratio:g}",
            f"--put_start_discard_timeout_sec={f.put_start_discard_timeout_sec}",
            f"--put_start_release_timeout_sec={f.put_start_release_timeout_sec}"]  # fmt: skip
    if f.default_kv_lease_ttl is not None:
        argv.append(f"--default_kv_lease_ttl={f.default_kv_lease_ttl}")
    if f.tenant_policy is not None:
        argv += ["--enable_multi_tenants=true", "--tenant_quota_connector_type=file",
                 f"--tenant_quota_connector_uri={f.tenant_policy}"]  # fmt: skip
    return argv


def master_flag_names() -> frozenset[str]:
    """The name (no dashes) of every flag `master_argv` can write: what a config's extra master
    arguments must not repeat (`l3pool deploy check`)."""
    every = master_argv("mooncake_master", MasterFlags("h", 1, 2, 3, default_kv_lease_ttl="1", tenant_policy="p"))
    return frozenset(a.lstrip("-").split("=", 1)[0] for a in every[1:] if a.startswith("--"))
