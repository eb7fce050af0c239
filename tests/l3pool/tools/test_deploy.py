"""`l3pool deploy check|render|verify`: the example config, every kind of bad config, the rendered
commands, the generated start/stop scripts (run for real on 127.0.0.1) and verify against a local
cluster (netns when root)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from l3pool.cli import main
from l3pool.cluster.local import LocalCluster
from l3pool.procenv import python_env
from l3pool.tools.deploy import ADAPTER, plan, select, tenant_policy_yaml, write_file_line
from l3pool.tools.deploy_config import LAYOUTS, load_config

from ..conftest import REPO, free_ports, required_binaries

EXAMPLE = REPO / "deploy" / "cluster.example.toml"
EXAMPLE_TEXT = EXAMPLE.read_text()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["deploy", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _edit(old: str, new: str, text: str = EXAMPLE_TEXT) -> str:
    assert text.count(old) == 1, f"{old!r} must occur once in the example"
    return text.replace(old, new)


# -- check -----------------------------------------------------------------------------------------
def test_example_passes_check(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(capsys, "check", str(EXAMPLE))
    assert rc == 0, err
    assert "OK: 2 prefill, 4 decode nodes" in out and "error" not in out
    rc, out, _ = _cli(capsys, "check", str(EXAMPLE), "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["ok"] and rep["errors"] == 0 and rep["problems"] == []


def test_layouts_match_l2core() -> None:
    from l2core.layout import LAYOUTS as L2

    assert tuple(L2) == LAYOUTS


BAD = {
    "malformed TOML": (("[cluster]\n", "[cluster\n"), ["is not valid TOML"]),
    "unknown key": (('donate = "256GB"\nnumaa', 'donate = "256GB"\nnumaa'), []),  # placeholder, replaced below
    "unknown top-level key": (("[router]\n", "[routr]\n"), ["routr: unknown key (did you mean 'router'?)"]),
    "bad size": (('donate = "192GB"', 'donate = "192 gigs"'), ["decode[3].donate: cannot parse '192 gigs'"]),
    "bad IP": (('host = "10.0.1.22"', 'host = "10.0.1.300"'), ["decode[1].host: '10.0.1.300' is not an IP address"]),
    "hostname instead of IP": (('host = "10.0.0.12"', 'host = "prefill-1.example"'), ["prefill[1].host"]),
    "port clash": (
        ("admin_port = 9003", "admin_port = 50051"),
        ["master.admin_port: port 50051 on 10.0.0.1 is also master.rpc_port"],
    ),
    "port clash across roles": (
        ("port = 8000\n", "port = 2379\n"),
        ["router.port: port 2379 on 10.0.0.1 is also etcd.client_port"],
    ),
    "port out of range": (("rpc_port = 50051", "rpc_port = 70000"), ["master.rpc_port: 70000 is out of range"]),
    "metrics port clash": (
        ("metrics_port = 9464 ", "metrics_port = 30000 "),  # decode-0's SGLang port
        ["decode[0].sglang.port: port 30000 on 10.0.1.21 is also decode[0].metrics_port"],
    ),
    "metrics port out of range": (
        ("metrics_port = 9464 ", "metrics_port = 70000 "),
        ["decode[0].metrics_port: 70000 is out of range"],
    ),
    "too small donation": (
        ('donate = "192GB"', 'donate = "8MiB"'),
        ["decode[3].donate: 8 MiB is below Mooncake's minimum segment of 16 MiB; raise it"],
    ),
    "wrong type int": (("tp_size = 8", 'tp_size = "8"'), ["sglang.tp_size: expected an integer, got a string '8'"]),
    "wrong type bool": (("checksum = false ", 'checksum = "no" '), ["l3.checksum: expected true or false"]),
    "wrong type table": (("[sglang.decode]\n", "[sglang.decode]\nenv = 3\n"), ["sglang.decode.env: expected a table"]),
    "bad ratio": (("eviction_ratio = 0.05", "eviction_ratio = 1.5"), ["master.eviction_ratio: 1.5 is outside (0, 1]"]),
    "release not above discard": (
        ("put_start_release_timeout_sec = 30 ", "put_start_release_timeout_sec = 10 "),
        ["master.put_start_release_timeout_sec: 10 must exceed put_start_discard_timeout_sec (10)"],
    ),
    "bad lease ttl": (
        ('default_kv_lease_ttl = "10s"', 'default_kv_lease_ttl = "10 sec"'),
        ["master.default_kv_lease_ttl: expected milliseconds or a duration"],
    ),
    "bad layout": (
        ('hicache_layout = "page_first_direct"', 'hicache_layout = "page_last"'),
        ["sglang.prefill.hicache_layout: 'page_last' is not one of layer_first, page_first"],
    ),
    "layout/io mismatch": (
        ('hicache_io_backend = "direct"', 'hicache_io_backend = "kernel"'),
        ["sglang.prefill.hicache_io_backend: hicache_layout 'page_first_direct' needs io backend"],
    ),
    "size not whole GB": (('hicache_size = "400GB"', 'hicache_size = "400GiB"'), ["whole GB"]),
    "size and ratio": (
        ('hicache_size = "400GB"', 'hicache_size = "400GB"\nhicache_ratio = 2.0'),
        ["give hicache_size or hicache_ratio, not both"],
    ),
    "ratio <= 1": (('hicache_size = "400GB"', "hicache_ratio = 0.5"), ["sglang.prefill.hicache_ratio: 0.5: SGLang"]),
    "owned flag in extra_args": (
        ('extra_args = ["--trust-remote-code"]', 'extra_args = ["--page-size=32"]'),
        ["sglang.extra_args: '--page-size=32' is generated by `render`"],
    ),
    "owned master flag": (
        ("extra_args = []                        #", 'extra_args = ["--client_ttl=3"]  #'),
        ["master.extra_args: '--client_ttl=3' is generated from master.client_ttl"],
    ),
    "duplicate name": (
        ('name = "decode-2"', 'name = "decode-1"'),
        ["decode[2].name: 'decode-1' is already the name of decode[1]"],
    ),
    "reserved name": (('name = "decode-2"', 'name = "master"'), ["decode[2].name: 'master' is reserved"]),
    "bad fingerprint": (('model = "deepseek-v3@0324"', 'model = "deepseek/v3"'), ["l3.model: 'deepseek/v3'"]),
    "missing fingerprint": (('model = "deepseek-v3@0324"\n', ""), ["prefill[0].l3.model: missing: set the model"]),
    "bad protocol": (('protocol = "tcp"', 'protocol = "udp"'), ["cluster.protocol: 'udp' is not one of tcp, rdma"]),
    "donate beyond any host": (
        ('donate = "192GB"', 'donate = "1920TB"'),
        ["decode[3].donate: 1920 TB is more DRAM than one host has (at most 64 TiB): a typo in the unit?"],
    ),
    "RDMA devices with tcp": (
        ('rdma_devices = ""', 'rdma_devices = "mlx5_0"'),
        ["decode[3].rdma_devices: 'mlx5_0' with protocol 'tcp': RDMA devices are for protocol 'rdma'"],
    ),
    "bad RDMA device name": (
        ('rdma_devices = ""', 'rdma_devices = "mlx5_0;reboot"'),
        ["decode[3].rdma_devices: 'mlx5_0;reboot': not an RDMA device name (e.g. mlx5_0)"],
    ),
    "etcd both ways": (
        ("[etcd]\n", '[etcd]\nendpoints = ["http://10.0.0.9:2379"]\n'),
        ["give either etcd.endpoints (a running etcd) or etcd.host"],
    ),
    "bad key prefix": (('key_prefix = "/l3pool"', 'key_prefix = "l3pool/"'), ["cluster.key_prefix: key prefix"]),
    "loopback mixed": (
        ('host = "10.0.1.23"', 'host = "127.0.0.1"'),
        ["127.0.0.1 is a loopback address but other nodes are on other hosts"],
    ),
}
BAD["unknown key"] = (("numa_node = 1\nrdma", "numa_nod = 1\nrdma"), ["decode[3].numa_nod: unknown key (did you mean"])


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_exit_2_names_the_key(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (old, new), expected = BAD[case]
    path = _write(tmp_path, _edit(old, new))
    rc, out, err = _cli(capsys, "check", path)
    assert rc == 2, f"{case}: exit {rc}, out {out!r}"
    assert "Traceback" not in err and out == ""
    for text in expected:
        assert text in err, f"{case}: {text!r} not in:\n{err}"
    assert all(ln.startswith(f"{path}: ") for ln in err.splitlines()), err
    rc, out, _ = _cli(capsys, "check", path, "--json")
    rep = json.loads(out)
    assert rc == 2 and not rep["ok"] and rep["errors"] >= 1
    assert all(set(p) == {"severity", "path", "message"} for p in rep["problems"])


def test_missing_sections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, '[cluster]\nname = "x"\n')
    rc, _, err = _cli(capsys, "check", path)
    assert rc == 2
    for text in (
        "etcd: missing section [etcd]",
        "master: missing section [master]",
        "decode: missing section: at least one [[decode]] node",
        "prefill: missing section",
    ):
        assert text in err, err
    path = _write(tmp_path, 'decode = 3\n[master]\nhost = "10.0.0.1"\n[etcd]\nendpoints = ["10.0.0.1:2379"]\n')
    rc, _, err = _cli(capsys, "check", path)
    assert rc == 2 and "decode: expected [[decode]] tables (an array of tables), got an integer" in err


def test_unreadable_and_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "check", str(tmp_path / "nope.toml"))
    assert rc == 2 and "cannot read" in err and "No such file" in err
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe[cluster]")
    rc, _, err = _cli(capsys, "check", str(bad))
    assert rc == 2 and "cannot read" in err


def test_warnings_do_not_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # prefill-1 gets another fingerprint for the same weights: allowed, but they never share pages
    text = _edit(
        'name = "prefill-1"\nhost = "10.0.0.12"\n',
        'name = "prefill-1"\nhost = "10.0.0.12"\n[prefill.l3]\nmodel = "other"\n',
    )
    rc, out, _ = _cli(capsys, "check", _write(tmp_path, text))
    assert rc == 0 and "warning: prefill[1].l3.model: 'other' differs from prefill[0]" in out
    # the adapter receives the metadata URL and protocol: no warning for them; rdma without devices warns
    text = _edit("metadata_port = 8080", "metadata_port = 8081", _edit('protocol = "tcp"', 'protocol = "rdma"'))
    rc, out, _ = _cli(capsys, "check", _write(tmp_path, text))
    assert rc == 0 and "extra-config has no" not in out
    assert "warning: decode[0].rdma_devices: empty with protocol 'rdma'" in out


def test_fingerprint_consistency_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _edit(
        'name = "prefill-1"\nhost = "10.0.0.12"\n',
        'name = "prefill-1"\nhost = "10.0.0.12"\n[prefill.sglang]\npage_size = 32\nmodel_path = "/models/other"\n',
    )
    rc, _, err = _cli(capsys, "check", _write(tmp_path, text))
    assert rc == 2
    assert "prefill[1].sglang.page_size: 32 differs from prefill[0] (64) with the same model fingerprint" in err
    assert "prefill[1].sglang.model_path" in err and "the same fingerprint must mean the same weights" in err


def test_cli_subprocess_no_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path, _edit("tp_size = 8", "tp_size = 8.5"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("L3POOL_")}
    r = subprocess.run(
        [sys.executable, "-m", "l3pool.cli", "deploy", "check", path],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip() == f"{path}: error: sglang.tp_size: expected an integer, got a number 8.5\n{path}: 1 error(s)"
    )


# -- render ----------------------------------------------------------------------------------------
def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} in {argv}"
    return argv[argv.index(flag) + 1]


def test_render_json_prefill_flags(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "render", str(EXAMPLE), "--json")
    procs = {p["name"]: p for p in json.loads(out)["processes"]}
    assert rc == 0 and list(procs)[:3] == ["etcd", "metadata", "master"]
    for name, host in (("prefill-0", "10.0.0.11"), ("prefill-1", "10.0.0.12")):
        p = procs[f"sglang-{name}"]
        argv = p["argv"]
        assert p["env"]["MC_TCP_BIND_ADDRESS"] == host and p["host"] == host
        assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
        assert _flag(argv, "--disaggregation-mode") == "prefill" and "--enable-hierarchical-cache" in argv
        assert _flag(argv, "--hicache-storage-backend") == "dynamic"
        assert _flag(argv, "--hicache-mem-layout") == "page_first_direct"
        assert _flag(argv, "--hicache-io-backend") == "direct" and _flag(argv, "--hicache-size") == "400"
        assert _flag(argv, "--page-size") == "64" and _flag(argv, "--tp-size") == "8"
        assert _flag(argv, "--host") == host and _flag(argv, "--disaggregation-bootstrap-port") == "8998"
        extra = json.loads(_flag(argv, "--hicache-storage-backend-extra-config"))
        assert extra == {
            **ADAPTER,
            "master": "10.0.0.1:50051",
            "metadata_server": "http://10.0.0.1:8080/metadata",
            "etcd": "https://10.0.0.1:2379",
            "key_prefix": "/l3pool",
            "protocol": "tcp",
            "local_hostname": host,
            "model": "deepseek-v3@0324",
            "checksum": False,
            "tenant": "",
            "etcd_security": {
                "ca": "/etc/l3pool/etcd-ca.pem",
                "cert": "/etc/l3pool/etcd-client.pem",
                "key": "/etc/l3pool/etcd-client-key.pem",
                "user": "l3pool",
                "password_file": "/etc/l3pool/etcd-password",
            },
        }
        assert extra["module_path"] == "l3pool.adapters.sglang_hicache" and extra["class_name"] == "L3PoolStorage"
        ports = ["MC_MIN_RPC_PORT=15000", "MC_MAX_RPC_PORT=15999", "MC_RPC_TIMEOUT_MS=2000"]
        assert shlex.split(p["shell"]) == ["env", f"MC_TCP_BIND_ADDRESS={host}", *ports, *argv]  # copy-paste safe
    a = procs["agent-decode-3"]["argv"]
    assert a[:3] == ["numactl", "--cpunodebind=1", "--membind=1"] and a[3:5] == ["l3pool", "agent"]
    assert _flag(a, "--segment-size") == "192GB" and _flag(a, "--id") == "decode-3"
    assert _flag(a, "--metadata") == "http://10.0.0.1:8080/metadata" and _flag(a, "--host") == "10.0.1.24"
    assert _flag(a, "--metrics-port") == "9464" and _flag(a, "--metrics-host") == "10.0.1.24"  # the default
    assert procs["agent-decode-3"]["env"] == {
        "MC_TCP_BIND_ADDRESS": "10.0.1.24", "MC_MIN_RPC_PORT": "15000", "MC_MAX_RPC_PORT": "15999",
        "MC_RPC_TIMEOUT_MS": "2000",  # a call a frozen master holds returns after 2 s, not 30 s
    }  # fmt: skip
    m = procs["master"]["argv"]
    for f in (
        "--rpc_port=50051",
        "--metrics_port=9003",
        "--client_ttl=10",
        "--eviction_high_watermark_ratio=0.9",
        "--eviction_ratio=0.05",
        "--default_kv_lease_ttl=10s",
        "--put_start_discard_timeout_sec=10",
        "--put_start_release_timeout_sec=30",
    ):
        assert f in m
    # the metadata server runs on its own, bound to the master host (the master's own binds 0.0.0.0)
    assert "--enable_http_metadata_server" not in m
    assert procs["metadata"]["argv"] == ["mooncake_http_metadata_server", "--host", "10.0.0.1", "--port", "8080"]
    assert list(procs).index("metadata") < list(procs).index("master") < list(procs).index("agent-decode-0")
    d = procs["sglang-decode-0"]["argv"]
    assert _flag(d, "--disaggregation-mode") == "decode" and "--hicache-storage-backend" not in d
    r = procs["router"]["argv"]
    assert r.count("--prefill") == 2 and r.count("--decode") == 4 and "--pd-disaggregation" in r


def test_render_select_and_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "render", str(EXAMPLE), "--node", "10.0.0.1")
    assert rc == 0 and [ln for ln in out.splitlines() if ln.startswith("# ")] == [
        "# etcd (etcd) on 10.0.0.1",
        "# metadata (metadata) on 10.0.0.1",
        "# master (master) on 10.0.0.1",
        "# router (router) on 10.0.0.1",
        f"# l3pool firewall for 10.0.0.1: run as root (`l3pool deploy render {EXAMPLE} --node 10.0.0.1`)",
    ]
    rc, _, err = _cli(capsys, "render", str(EXAMPLE), "--node", "nope")
    assert rc == 2 and err.splitlines() == [
        f"l3pool deploy: error: no node or host 'nope' in {EXAMPLE}",
        "l3pool deploy: hint: nodes: decode-0, decode-1, decode-2, decode-3, etcd, master, prefill-0, prefill-1, "
        "router; hosts: 10.0.0.1, 10.0.0.11, 10.0.0.12, 10.0.1.21, 10.0.1.22, 10.0.1.23, 10.0.1.24",
    ]
    rc, out, _ = _cli(capsys, "render", str(EXAMPLE), "--out", str(tmp_path / "s"))
    assert rc == 0 and "wrote" in out
    scripts = sorted(p.name for p in (tmp_path / "s").iterdir() if p.is_file())
    assert (tmp_path / "s" / "systemd").is_dir()  # the units: test_deploy_systemd.py
    assert scripts == sorted(
        ["etcd.sh", "master.sh", "router.sh"]
        + [f"prefill-{i}.sh" for i in range(2)]
        + [f"decode-{i}.sh" for i in range(4)]
        + [f"firewall-{h}.sh" for h in ("10.0.0.1", "10.0.0.11", "10.0.0.12", "10.0.1.21", "10.0.1.22", "10.0.1.23",
                                         "10.0.1.24")]
    )  # fmt: skip
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(tmp_path / "s" / s)], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"{s}: {r.stderr}"
    text = (tmp_path / "s" / "decode-0.sh").read_text()
    env = "MC_TCP_BIND_ADDRESS=10.0.1.21 MC_MIN_RPC_PORT=15000 MC_MAX_RPC_PORT=15999 MC_RPC_TIMEOUT_MS=2000"
    assert f"_start agent-decode-0 env {env} numactl" in text
    assert "_wait_port 10.0.1.21 30000" not in text  # nothing after the decode server to wait for
    cfg, _ = load_config(EXAMPLE)
    assert cfg is not None and [p.name for p in select(plan(cfg), "decode-0")] == ["agent-decode-0", "sglang-decode-0"]


def test_render_invalid_config_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _edit('donate = "192GB"', 'donate = "1MiB"'))
    for cmd in ("render", "verify"):
        rc, out, err = _cli(capsys, cmd, path)
        assert rc == 2 and out == "" and "decode[3].donate" in err
        rc, out, _ = _cli(capsys, cmd, path, "--json")
        assert rc == 2 and json.loads(out)["ok"] is False


# -- the generated scripts, for real, on 127.0.0.1 ---------------------------------------------
def _local_config(
    tmp_path: Path,
    etcd: str,
    master: dict[str, Any],
    decode: list[tuple[str, str, str]],
    key_prefix: str = "",
    prefill_host: str = "127.0.0.2",
) -> str:
    key_prefix = key_prefix or f"/l3t-deploy-{uuid.uuid4().hex[:6]}"
    lines = [
        "[cluster]",
        f'key_prefix = "{key_prefix}"',
        f"l3pool = {json.dumps(shlex.join([sys.executable, '-m', 'l3pool.cli']))}",
        f'log_dir = "{tmp_path}/logs"',
        etcd,
        "[master]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in master.items()]
    lines += ['[l3]\nmodel = "toy@1"', '[sglang]\nmodel_path = "/models/toy"\nport = 30000']
    lines += [f'[[prefill]]\nname = "p0"\nhost = "{prefill_host}"']
    for name, host, donate in decode:
        lines += [
            f'[[decode]]\nname = "{name}"\nhost = "{host}"\ndonate = "{donate}"\nrun_sglang = false\nlease_ttl = 3\n'
            "metrics_port = 0"  # two agents on one host: the default port would clash
        ]
    return _write(tmp_path, "\n".join(lines) + "\n")


def test_scripts_start_verify_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    etcd_bin, master_bin = required_binaries()
    c, p, rpc, meta, admin = free_ports(5)
    etcd = (
        f'[etcd]\nhost = "127.0.0.1"\nclient_port = {c}\npeer_port = {p}\ndata_dir = "{tmp_path}/etcd"\n'
        f'binary = "{etcd_bin}"'
    )
    master = {
        "host": "127.0.0.1",
        "rpc_port": rpc,
        "metadata_port": meta,
        "admin_port": admin,
        "client_ttl": 3,
        "binary": master_bin,
        "metadata_binary": shlex.join([sys.executable, "-m", "mooncake.http_metadata_server"]),
    }
    path = _local_config(tmp_path, etcd, master, [("dn0", "127.0.0.1", "32MiB"), ("dn1", "127.0.0.1", "16MiB")])
    for node in ("127.0.0.1", "dn1"):  # the whole host, and one decode node
        assert _cli(capsys, "render", path, "--node", node, "--out", str(tmp_path / "s"))[0] == 0

    def run(action: str, node: str = "127.0.0.1") -> subprocess.CompletedProcess[str]:
        script = tmp_path / "s" / f"{node}.sh"
        return subprocess.run(["bash", str(script), action], capture_output=True, text=True, timeout=120)

    try:
        r = run("start")
        assert r.returncode == 0, r.stdout + r.stderr
        names = ["etcd", "metadata", "master", "agent-dn0", "agent-dn1"]
        assert [ln.split(":")[0] for ln in r.stdout.splitlines()] == names
        rc, out, _ = _cli(capsys, "verify", path, "--wait", "30", "--json")
        v = json.loads(out)
        assert rc == 0 and v["ok"], out
        assert [(n["name"], n["status"]) for n in v["decode"]] == [("dn0", "ok"), ("dn1", "ok")]
        assert v["master_capacity_bytes"] == 48 << 20
        assert run("status").returncode == 0 and run("start").stdout.count("already running") == 5
        assert run("stop", "dn1").stdout == "agent-dn1: stopped\n"
        rc, out, _ = _cli(capsys, "verify", path)
        assert rc == 1 and "MISSING  dn1 (127.0.0.1" in out and "FAILED: 1 of 2" in out
    finally:
        r = run("stop")
    assert r.returncode == 0 and "etcd: stopped" in r.stdout
    assert run("status").returncode == 1
    assert not list((tmp_path / "logs").glob("*.pid"))


# -- verify against a LocalCluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two agents (32 MiB each), in their own network namespaces when root."""
    required_binaries()
    name, state_dir = f"l3pd{uuid.uuid4().hex[:4]}", tmp_path_factory.mktemp("deploy-cluster")
    with LocalCluster(agents=2, segment_size="32MiB", name=name, state_dir=state_dir, ready_timeout=60) as c:
        if c.fallback_reason:
            print(f"namespaces unavailable ({c.fallback_reason}): agents on 127.0.0.1")
        yield c


def _cluster_config(tmp_path: Path, c: LocalCluster, decode: list[tuple[str, str, str]]) -> str:
    etcd = f"[etcd]\nendpoints = [{json.dumps(c.etcd_endpoints)}]"
    master = {
        "host": c.client_host,
        "rpc_port": c.ports["master_rpc"],
        "metadata_port": c.ports["master_metadata"],
        "admin_port": c.ports["master_admin"],
        "client_ttl": c.client_ttl,
    }
    return _local_config(tmp_path, etcd, master, decode, c.key_prefix, c.client_host)  # prefill: the root netns


def test_verify_local_cluster_all_present(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = [(a.id, a.ip, "32MiB") for a in cluster.agents]
    path = _cluster_config(tmp_path, cluster, decode)
    rc, out, err = _cli(capsys, "check", path)
    assert rc == 0, err
    rc, out, _ = _cli(capsys, "verify", path)
    assert rc == 0, out
    assert "OK: 2 of 2 decode nodes donating as configured" in out
    hint = f"l3pool prefetch-check --etcd {cluster.etcd_endpoints} --master {cluster.master} --metadata "
    assert f"{hint}{cluster.metadata_url} --host {cluster.client_host}" in out
    rc, out, _ = _cli(capsys, "verify", path, "--json")
    v = json.loads(out)
    assert rc == 0 and v["ok"] and v["unexpected_members"] == [] and v["problems"] == []
    assert [(n["name"], n["host"], n["status"]) for n in v["decode"]] == [(a.id, a.ip, "ok") for a in cluster.agents]


def test_verify_local_cluster_reports_missing_and_mismatch(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a0, a1 = cluster.agents
    decode = [(a0.id, a0.ip, "32MiB"), (a1.id, a1.ip, "64MiB"), ("dn-gone", a1.ip, "1GB")]
    path = _cluster_config(tmp_path, cluster, decode)
    rc, out, _ = _cli(capsys, "verify", path, "--json")
    v = json.loads(out)
    assert rc == 1 and not v["ok"]
    status = {n["name"]: n for n in v["decode"]}
    assert status[a0.id]["status"] == "ok"
    assert status[a1.id]["status"] == "mismatch"
    assert status[a1.id]["problems"] == ["donates 32 MiB, configured 64 MiB"]
    assert status["dn-gone"]["status"] == "missing"
    assert f"{cluster.key_prefix}/members/dn-gone" in status["dn-gone"]["problems"][0]
    rc, out, _ = _cli(capsys, "verify", path)
    assert rc == 1 and "MISSING  dn-gone" in out and "FAILED: 1 of 3" in out


def test_verify_unreachable_etcd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c, rpc, meta, admin = free_ports(4)
    master = {"host": "127.0.0.1", "rpc_port": rpc, "metadata_port": meta, "admin_port": admin}
    path = _local_config(tmp_path, f'[etcd]\nendpoints = ["127.0.0.1:{c}"]', master, [("dn0", "127.0.0.1", "1GB")])
    rc, out, _ = _cli(capsys, "verify", path)
    assert rc == 1 and f"error: etcd unreachable: 127.0.0.1:{c}" in out
    assert "UNKNOWN  dn0" in out


def test_verify_missing_password_file_is_a_config_error_not_retried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c, rpc, meta, admin = free_ports(4)
    master = {"host": "127.0.0.1", "rpc_port": rpc, "metadata_port": meta, "admin_port": admin}
    gone = tmp_path / "no-such-password"
    etcd = f'[etcd]\nendpoints = ["127.0.0.1:{c}"]\nuser = "l3pool"\npassword_file = "{gone}"'
    path = _local_config(tmp_path, etcd, master, [("dn0", "127.0.0.1", "1GB")])
    t0 = time.monotonic()
    rc, out, err = _cli(capsys, "verify", path, "--wait", "30")
    assert time.monotonic() - t0 < 10  # refused at once, not retried for --wait's 30 s
    assert rc == 2 and out == "", (out, err)
    lines = err.strip().splitlines()
    assert lines[0].startswith("l3pool deploy verify: error: etcd security:") and str(gone) in lines[0], err
    assert lines[1].startswith("l3pool deploy verify: hint: "), err
    rc, out, err = _cli(capsys, "verify", path, "--json")
    assert rc == 2 and json.loads(out)["error"].startswith("etcd security:"), (out, err)


def test_launch_sh(tmp_path: Path) -> None:
    env = python_env({"L3POOL": shlex.join([sys.executable, "-m", "l3pool.cli"]),
                      "L3POOL_DEPLOY_DIR": str(tmp_path / "d"), "L3POOL_LOG_DIR": str(tmp_path / "logs")})  # fmt: skip

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = ["bash", str(REPO / "deploy" / "launch.sh"), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)

    r = launch(str(EXAMPLE), "decode-1", "print")
    assert r.returncode == 0 and "# agent-decode-1 (agent) on 10.0.1.22" in r.stdout, r.stderr
    r = launch(str(EXAMPLE), "prefill-0", "status")  # renders DIR/prefill-0.sh, nothing runs
    assert r.returncode == 1 and r.stdout == "sglang-prefill-0: NOT running\n"
    assert (tmp_path / "d" / "prefill-0.sh").is_file()
    r = launch(str(EXAMPLE), "nope", "status")
    assert r.returncode == 2 and "no node or host 'nope'" in r.stderr
    r = launch(str(EXAMPLE), "prefill-0", "restart")
    assert r.returncode == 2 and r.stdout.startswith("Start, stop or show") and "set -e" not in r.stdout


def test_deploy_imports_without_torch() -> None:
    code = "import sys, l3pool.tools.deploy, l3pool.tools.deploy_config; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=python_env(), timeout=30)
    assert r.returncode == 0, "l3pool.tools.deploy pulled in torch: `deploy check` must run on any node"


# -- security: etcd TLS/auth flags and firewall rules ------------------------------------------------
def test_render_passes_etcd_tls_to_every_component(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "render", str(EXAMPLE), "--json")
    assert rc == 0
    procs = {p["name"]: p for p in json.loads(out)["processes"]}
    e = procs["etcd"]["argv"]
    assert _flag(e, "--listen-client-urls") == "https://10.0.0.1:2379,https://127.0.0.1:2379"
    assert _flag(e, "--cert-file") == "/etc/l3pool/etcd-server.pem" and "--client-cert-auth" in e
    assert _flag(e, "--trusted-ca-file") == "/etc/l3pool/etcd-ca.pem"
    assert _flag(e, "--listen-peer-urls") == "http://127.0.0.1:2380"  # one member: raft stays on loopback
    for i in range(4):
        a = procs[f"agent-decode-{i}"]["argv"]
        assert _flag(a, "--etcd") == "https://10.0.0.1:2379" and _flag(a, "--etcd-ca") == "/etc/l3pool/etcd-ca.pem"
        assert _flag(a, "--etcd-cert") == "/etc/l3pool/etcd-client.pem" and _flag(a, "--etcd-user") == "l3pool"
        assert _flag(a, "--etcd-password-file") == "/etc/l3pool/etcd-password"
    for p in ("prefill-0", "prefill-1"):
        extra = json.loads(_flag(procs[f"sglang-{p}"]["argv"], "--hicache-storage-backend-extra-config"))
        assert extra["etcd_security"]["password_file"] == "/etc/l3pool/etcd-password"
        assert "password" not in extra["etcd_security"]
    assert "etcd-password" not in json.dumps(procs).replace("etcd-password-file", "").replace("/etcd-password", "")


def test_embedded_metadata_server_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _edit('metadata_server = "standalone"', 'metadata_server = "embedded"')
    rc, out, _ = _cli(capsys, "render", _write(tmp_path, text), "--node", "master", "--json")
    procs = {p["name"]: p for p in json.loads(out)["processes"]}
    assert rc == 0 and list(procs) == ["master"]
    m = procs["master"]["argv"]
    assert "--enable_http_metadata_server" in m and "--http_metadata_server_port=8080" in m
    assert procs["master"]["ready_ports"] == [50051, 9003, 8080]


def test_plain_http_etcd_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "\n".join(
        ln for ln in EXAMPLE_TEXT.splitlines() if not ln.startswith(("server_", "ca =", "cert =", "key =", "user ="))
    )
    text = text.replace('password_file = "/etc/l3pool/etcd-password"   # mode 0600; never on a command line\n', "")
    rc, out, err = _cli(capsys, "check", _write(tmp_path, text))
    assert rc == 0, err
    assert "warning: etcd.server_cert: etcd at http://10.0.0.1:2379 speaks plain HTTP" in out
    rc, out, _ = _cli(capsys, "render", _write(tmp_path, text), "--node", "decode-0", "--json")
    a = json.loads(out)["processes"][0]["argv"]
    assert _flag(a, "--etcd") == "http://10.0.0.1:2379" and not any(x.startswith("--etcd-") for x in a)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('cert = "/etc/l3pool/etcd-client.pem"\n', "", "etcd.cert: missing: etcd.key needs etcd.cert too"),
        ('server_key = "/etc/l3pool/etcd-server-key.pem"\n', "", "etcd.server_key: missing"),
        ('password_file = "/etc/l3pool/etcd-password"', "password = 'x'", "etcd.password: unknown key"),
        ('client_ports = "15000-15999"', 'client_ports = "15000-15010"', "keep at least 64 ports"),
        ('admin_allow = ["10.0.0.1/32"]', 'admin_allow = ["10.0.0.300/32"]', "is not a network"),
        ('client_ports = "15000-15999"', 'client_ports = "40000-40999"', "<= 32767 (Mooncake's limit)"),
    ],
)
def test_bad_security_config(
    old: str, new: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = _cli(capsys, "check", _write(tmp_path, _edit(old, new)))
    assert rc == 2 and expected in err, err


def test_firewall_rules_cover_every_pool_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "render", str(EXAMPLE), "--json")
    fw = json.loads(out)["firewall"]
    assert rc == 0 and sorted(fw) == ["10.0.0.1", "10.0.0.11", "10.0.0.12", "10.0.1.21", "10.0.1.22", "10.0.1.23",
                                      "10.0.1.24"]  # fmt: skip
    ctl = fw["10.0.0.1"]
    jump = "iptables -I INPUT -p tcp -m multiport --dports 2379,50051,8080 -j L3POOL"
    assert any(ln.endswith(jump) for ln in ctl)  # etcd client, master RPC + metadata (binds 0.0.0.0)
    assert any(ln.endswith("--dports 9003 -j L3POOL-ADMIN") for ln in ctl)
    i = ctl.index("iptables -A L3POOL -i lo -j ACCEPT")
    assert ctl[i : i + 4] == [
        "iptables -A L3POOL -i lo -j ACCEPT",
        "iptables -A L3POOL -s 10.0.0.0/24 -j ACCEPT",
        "iptables -A L3POOL -s 10.0.1.0/24 -j ACCEPT",
        "iptables -A L3POOL -j DROP",
    ]
    assert "iptables -A L3POOL-ADMIN -s 10.0.0.1/32 -j ACCEPT" in ctl
    assert "iptables -A L3POOL-ADMIN -s 10.0.0.0/24 -j ACCEPT" not in ctl  # admin: the master host only
    # Mooncake clients: their pinned port range; a decode node also its agent's metrics port
    assert any(ln.endswith("--dports 15000:15999 -j L3POOL") for ln in fw["10.0.0.11"])
    assert any(ln.endswith("--dports 15000:15999,9464 -j L3POOL") for ln in fw["10.0.1.21"])
    for host in ("10.0.0.11", "10.0.1.21"):
        assert not any("L3POOL-ADMIN" in ln for ln in fw[host])
    # default allow without [firewall]: exactly the config's hosts
    text = EXAMPLE_TEXT[: EXAMPLE_TEXT.index("[firewall]")]
    rc, out, _ = _cli(capsys, "render", _write(tmp_path, text), "--json", "--node", "10.0.1.21")
    rules = json.loads(out)["firewall"]["10.0.1.21"]
    allowed = sorted(ln.split(" -s ")[1].split()[0] for ln in rules if ln.startswith("iptables -A L3POOL -s"))
    assert allowed == sorted(["10.0.0.1/32", "10.0.0.11/32", "10.0.0.12/32"] + [f"10.0.1.2{i}/32" for i in range(1, 5)])


def test_tenant_without_master_tenants_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tenant is kept apart by Mooncake only on a master with --enable_multi_tenants: say so."""
    rc, out, err = _cli(capsys, "check", _write(tmp_path, _edit('tenant = ""', 'tenant = "team-a"')))
    assert rc == 0, err
    assert "warning: prefill[0].l3.tenant: 'team-a' keeps this node's pages in its own namespace" in out
    assert "without master.tenants the master ignores tenant ids" in out


TENANTS = 'tenants = { default = "1GB", team-a = "2GB" }'


def test_master_tenants_render_flags_and_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "etc" / "tenants.yaml"
    text = _edit('tenant = ""', 'tenant = "team-a"', _edit("tenants = {}", TENANTS))
    text = _edit('tenant_policy = "/etc/l3pool/tenants.yaml"', f'tenant_policy = "{policy}"', text)
    path = _write(tmp_path, text)
    rc, out, err = _cli(capsys, "check", path)
    assert rc == 0 and "l3.tenant" not in out, out + err
    rc, out, _ = _cli(capsys, "render", path, "--node", "master", "--json")
    master = json.loads(out)["processes"][-1]
    want = "version: 1\ntenants:\n  - name: default\n    quota: 1000000000\n  - name: team-a\n    quota: 2000000000\n"
    assert (
        master["files"] == {str(policy): want}
        and tenant_policy_yaml((("default", 10**9), ("team-a", 2 * 10**9))) == want
    )
    a = master["argv"]
    assert "--enable_multi_tenants=true" in a and "--tenant_quota_connector_type=file" in a
    assert f"--tenant_quota_connector_uri={policy}" in a
    # the start script writes the policy before it starts the master: run just that line
    rc, _, _ = _cli(capsys, "render", path, "--node", "master", "--out", str(tmp_path / "out"))
    line = next(ln for ln in (tmp_path / "out" / "master.sh").read_text().splitlines() if "printf %s" in ln)
    assert subprocess.run(["bash", "-c", line], timeout=30).returncode == 0
    assert policy.read_text() == want
    rc, out, _ = _cli(capsys, "render", path, "--node", "master")
    assert f"# master reads {policy}:\n#   version: 1\n" in out


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("tenants = {}", 'tenants = { team-a = "2GB" }', "master.tenants: list 'default' too"),
        ("tenants = {}", 'tenants = { default = "1GB", "a b" = "2GB" }', "'a b': a tenant is 1-64 of"),
        ("tenants = {}", 'tenants = { default = "lots" }', "master.tenants: 'default': "),
        ("tenants = {}", "tenants = { default = 0 }", "'default': must be positive, got 0"),
        ("tenants = {}", 'tenants = "default"', "expected a table of tenant"),
        ('tenant_policy = "/etc/l3pool/tenants.yaml"', 'tenant_policy = "tenants.yaml"', "expected an absolute path"),
        ("extra_args = []                        # more", 'extra_args = ["--enable_multi_tenants=true"]  #',
         "is generated from master.tenants"),
        ('tenant = ""', 'tenant = "team-b"', "prefill[0].l3.tenant: 'team-b' is not in master.tenants"),
    ],
)  # fmt: skip
def test_bad_master_tenants(
    old: str, new: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _edit("tenants = {}", TENANTS) if old != "tenants = {}" else EXAMPLE_TEXT
    rc, _, err = _cli(capsys, "check", _write(tmp_path, _edit(old, new, text)))
    assert rc == 2 and expected in err, err


def test_write_file_line_keeps_any_text(tmp_path: Path) -> None:
    text = "it's a \\ back'slash\n$HOME `x` \"q\"\n\ttab\n"
    path = tmp_path / "d e" / "f.txt"
    line = write_file_line(str(path), text)
    assert "\n" not in line
    assert subprocess.run(["bash", "-c", line], timeout=30).returncode == 0
    assert path.read_text() == text
