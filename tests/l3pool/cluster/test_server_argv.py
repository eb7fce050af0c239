"""l3pool.cluster.servers: the one home of the etcd and mooncake_master command lines (exact argv
for each variant, bad input refused), and its users running exactly them."""

from __future__ import annotations

import pytest

from l3pool.cluster.servers import (
    EtcdFlags,
    EtcdServerTls,
    MasterFlags,
    etcd_argv,
    master_argv,
    master_flag_names,
    url,
)

from ..conftest import EtcdServer, MasterServer


def test_etcd_argv_on_loopback() -> None:
    assert etcd_argv("/bin/etcd", EtcdFlags("e1", "/d", "127.0.0.1", 2379, 2380)) == [
        "/bin/etcd", "--name", "e1", "--data-dir", "/d",
        "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
        "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
        "--initial-cluster", "e1=http://127.0.0.1:2380", "--initial-cluster-state", "new",
        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "info",
    ]  # fmt: skip


def test_etcd_argv_off_loopback_with_tls() -> None:
    tls = EtcdServerTls("/s.pem", "/s.key", "/ca.pem")
    a = etcd_argv("etcd", EtcdFlags("e", "/d", "10.0.0.1", 2379, 2380, tls, log_level="warn"))
    assert a[a.index("--listen-client-urls") + 1] == "https://10.0.0.1:2379,https://127.0.0.1:2379"
    assert a[a.index("--advertise-client-urls") + 1] == "https://10.0.0.1:2379"
    assert a[a.index("--listen-peer-urls") + 1] == "http://127.0.0.1:2380"  # raft stays on loopback, plain
    assert a[-7:] == ["--cert-file", "/s.pem", "--key-file", "/s.key", "--trusted-ca-file", "/ca.pem",
                      "--client-cert-auth"]  # fmt: skip
    assert a[a.index("--log-level") + 1] == "warn"
    v6 = etcd_argv("etcd", EtcdFlags("e", "/d", "fd00::1", 2379, 2380))
    assert v6[v6.index("--listen-client-urls") + 1] == "http://[fd00::1]:2379,http://127.0.0.1:2379"
    assert url("::1", 5, "https") == "https://[::1]:5" and url("h", 5) == "http://h:5"


def test_master_argv_embedded_and_standalone() -> None:
    assert master_argv("mm", MasterFlags("10.0.0.1", 50051, 9003, 8080)) == [
        "mm", "--rpc_address=10.0.0.1", "--rpc_port=50051",
        "--enable_http_metadata_server", "--http_metadata_server_host=10.0.0.1", "--http_metadata_server_port=8080",
        "--metrics_host=10.0.0.1", "--metrics_port=9003", "--client_ttl=10",
        "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.05",
        "--put_start_discard_timeout_sec=10", "--put_start_release_timeout_sec=30",
    ]  # fmt: skip
    f = MasterFlags("h", 1, 2, None, client_ttl=3, default_kv_lease_ttl="2s", tenant_policy="/t.yaml")
    a = master_argv("mm", f)
    assert not any("metadata" in x for x in a)  # a standalone metadata server serves it
    assert a[a.index("--client_ttl=3") + 5] == "--default_kv_lease_ttl=2s"
    assert a[-3:] == ["--enable_multi_tenants=true", "--tenant_quota_connector_type=file",
                      "--tenant_quota_connector_uri=/t.yaml"]  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rpc_port": 0}, r"master rpc_port must be a TCP port \(1\.\.65535\), got 0"),
        ({"admin_port": 70000}, "master admin_port must be a TCP port"),
        ({"metadata_port": 1}, r"master ports must differ, got \{'rpc_port': 1"),
        ({"client_ttl": 0}, r"client_ttl must be a positive int \(seconds\), got 0"),
        ({"put_start_release_timeout_sec": 10}, r"put_start_release_timeout_sec \(10\) must exceed"),
        ({"eviction_ratio": 0.0}, r"eviction_ratio must be a ratio in \(0, 1\], got 0.0"),
        ({"eviction_high_watermark_ratio": 1.5}, "eviction_high_watermark_ratio must be a ratio"),
        ({"default_kv_lease_ttl": " "}, "default_kv_lease_ttl must be None or a duration"),
        ({"host": ""}, "the master needs a host"),
    ],
)
def test_master_flags_refuse_bad_values(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"host": "h", "rpc_port": 1, "admin_port": 2, "metadata_port": 3}
    with pytest.raises(ValueError, match=match):
        MasterFlags(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"client_port": 0}, "etcd client_port must be a TCP port"),
        ({"peer_port": 2379}, "etcd client_port and peer_port are both 2379"),
        ({"log_level": "loud"}, "etcd log_level must be debug, info, warn"),
        ({"data_dir": ""}, "etcd needs a name, a data dir and a host"),
    ],
)
def test_etcd_flags_refuse_bad_values(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"name": "e", "data_dir": "/d", "host": "h", "client_port": 2379, "peer_port": 2380}
    with pytest.raises(ValueError, match=match):
        EtcdFlags(**{**base, **kw})  # type: ignore[arg-type]


def test_the_tests_servers_run_the_product_command_lines(
    etcd_server: EtcdServer, mooncake_master: MasterServer
) -> None:
    """The suite's etcd and master are started through the product's argv (conftest's run_etcd /
    run_master), with only named options chosen: the master's --client_ttl 3."""
    m = mooncake_master
    want = master_argv(m.proc.cmd[0], MasterFlags("127.0.0.1", m.rpc_port, m.admin_port, m.metadata_port, client_ttl=3))
    assert m.proc.cmd == want
    assert "--put_start_release_timeout_sec=30" in m.proc.cmd  # the product's, not Mooncake's 600 s
    e = etcd_server
    flags = EtcdFlags(e.proc.cmd[2], str(e.data_dir), "127.0.0.1", e.client_port, e.peer_port)
    assert e.proc.cmd == etcd_argv(e.proc.cmd[0], flags)


def test_master_flag_names_are_every_flag_it_writes() -> None:
    assert master_flag_names() == {
        "rpc_address", "rpc_port", "enable_http_metadata_server", "http_metadata_server_host",
        "http_metadata_server_port", "metrics_host", "metrics_port", "client_ttl", "eviction_high_watermark_ratio",
        "eviction_ratio", "put_start_discard_timeout_sec", "put_start_release_timeout_sec", "default_kv_lease_ttl",
        "enable_multi_tenants", "tenant_quota_connector_type", "tenant_quota_connector_uri",
    }  # fmt: skip
