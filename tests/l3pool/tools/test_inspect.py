"""`l3pool inspect` / `collect()` with a real agent, etcd, master and Mooncake client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from l3pool.cli import main
from l3pool.pool.etcd import LeaseKeeper
from l3pool.pool.metadata import Metadata
from l3pool.pool.trailer import TRAILER_BYTES
from l3pool.procenv import python_env
from l3pool.tools.inspect import InspectError, collect, render

from ..conftest import AgentProc, EtcdServer, MasterServer, agent_args, agent_process, free_ports

MiB = 1 << 20
PAGE = 4096
OBJ = PAGE + TRAILER_BYTES  # what L3Client stores per page: page bytes + trailer
NS_ID = "5eed0f00d5eed0f0"
NS_RECORD = {
    "model": "toy@1",
    "attention": "mla",
    "layout": "page_first",
    "dtype": "bf16",
    "page_size": 2,
    "page_bytes": PAGE,
    "layer_begin": 0,
    "layer_end": 4,
    "tp_rank": 0,
    "tp_size": 1,
    "checksum": False,
    "tenant": "",
}


_WRITER = """
import ctypes, json, sys
from l3pool.pool.store import MooncakeStore, StoreConfig
master, metadata, page, keys = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
store = MooncakeStore(StoreConfig(master=master, metadata=metadata, local_hostname="127.0.0.1"))
buf = ctypes.create_string_buffer(len(keys) * page)
ptr = ctypes.addressof(buf)
store.register(ptr, len(keys) * page)
res = store.put(keys, [ptr + i * page for i in range(len(keys))], [page] * len(keys))
print("RESULT " + json.dumps([r.value for r in res]), flush=True)
store.close()
"""


def _put_in_subprocess(master: MasterServer, keys: list[str]) -> list[str]:
    env = python_env({"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    r = subprocess.run(
        [sys.executable, "-c", _WRITER, master.rpc, master.metadata_url, str(OBJ), *keys],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"writer failed (rc {r.returncode}): {r.stderr[-1500:]}"
    return list(json.loads(lines[-1][len("RESULT ") :]))


@pytest.fixture(scope="module")
def pool(etcd_server: EtcdServer, mooncake_master: MasterServer) -> Iterator[tuple[AgentProc, str]]:
    """One agent (32 MiB) under its own prefix, a namespace and 3 objects of it in the pool, 2 clients' stats."""
    prefix = "/l3t-inspect"
    args = agent_args(
        etcd_server, mooncake_master, prefix, "--segment-size", "32MiB", "--id", "dn-i", "--lease-ttl", "5"
    )
    with agent_process(args) as agent:
        agent.wait_registered()
        etcd = etcd_server.client()
        md = Metadata(etcd, prefix)
        assert md.register_namespace(NS_ID, NS_RECORD) == NS_RECORD
        md.register_namespace("0ther", NS_RECORD | {"page_bytes": 8192})
        keeper = LeaseKeeper(etcd, 10)
        try:
            keys = [f"{NS_ID}/{h:032x}" for h in (1, 2, 3)] + ["unrelated/00"]
            # The objects are written by a separate, short-lived process: Mooncake keeps
            # process-wide transport state, and a client made in this (long-lived, shared) test
            # process after other suites' clusters came and went failed its transfers in full
            # runs. Objects stay in the agent's segment after their writer exits.
            res = _put_in_subprocess(mooncake_master, keys)
            assert res == ["ok"] * 4, res
            md.publish_stats("client-a", {"hits": 5, "misses": 2, "puts": 3, "namespace": NS_ID}, keeper.lease)
            md.publish_stats("client-b", {"hits": 1, "misses": 4, "puts": 0, "namespace": NS_ID}, keeper.lease)
            etcd.put(f"{prefix}/locks/req-7", json.dumps({"pages": 3, "stages": [0, 1]}), lease=keeper.lease)
            yield agent, prefix
        finally:
            keeper.close(revoke=True)
            etcd.close()


def test_collect(pool: tuple[AgentProc, str], etcd_server: EtcdServer, mooncake_master: MasterServer) -> None:
    agent, prefix = pool
    r = collect(etcd_server.endpoints, mooncake_master.admin_url, prefix)
    (m,) = r["members"]
    assert m["id"] == "dn-i" and m["host"] == "127.0.0.1" and m["pid"] == agent.proc.pid
    assert m["donated_bytes"] == 32 * MiB and m["donated"] == "32MiB" and m["in_master"] is True  # as typed
    assert m["used_bytes"] == 4 * OBJ  # all 4 objects landed in the only segment
    assert 1 <= m["lease_ttl_left"] <= 5 and m["version"] and m["age_s"] >= 0
    ns = {n["ns_id"]: n for n in r["namespaces"]}
    assert ns[NS_ID]["objects"] == 3 and ns[NS_ID]["bytes"] == 3 * OBJ and ns[NS_ID]["layout"] == "page_first"
    assert ns["0ther"]["objects"] == 0 and ns["0ther"]["bytes"] == 0
    assert r["counters"] == {"hits": 6, "misses": 6, "puts": 3}
    assert r["clients"]["client-a"]["hits"] == 5 and set(r["clients"]) == {"client-a", "client-b"}
    (lk,) = r["locks"]
    assert lk["key"] == "req-7" and lk["value"]["pages"] == 3 and lk["lease_ttl_left"] > 0
    assert r["master"]["keys"] == 4 and r["master"]["capacity_bytes"] >= 32 * MiB
    assert {"name": m["segment"], "used_bytes": 4 * OBJ, "capacity_bytes": 32 * MiB, "member": "dn-i"} in r["master"][
        "segments"
    ]


def test_collect_without_master(pool: tuple[AgentProc, str], etcd_server: EtcdServer) -> None:
    _, prefix = pool
    r = collect(etcd_server.endpoints, None, prefix)
    assert r["members"][0]["used_bytes"] is None and r["members"][0]["donated_bytes"] == 32 * MiB
    assert all(n["objects"] is None for n in r["namespaces"])
    assert r["master"] == {"admin_url": None}


def test_cli_json(
    pool: tuple[AgentProc, str],
    etcd_server: EtcdServer,
    mooncake_master: MasterServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, prefix = pool
    argv = ["inspect", "--etcd", etcd_server.endpoints, "--master-admin", mooncake_master.admin_url]
    assert main([*argv, "--key-prefix", prefix, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"members", "namespaces", "counters", "clients", "locks", "master"}
    assert out["members"][0]["donated_bytes"] == 32 * MiB
    assert {n["ns_id"]: n["objects"] for n in out["namespaces"]} == {NS_ID: 3, "0ther": 0}


def test_cli_table(
    pool: tuple[AgentProc, str],
    etcd_server: EtcdServer,
    mooncake_master: MasterServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, prefix = pool
    monkeypatch.setenv("L3POOL_ETCD", etcd_server.endpoints)  # the env fallbacks
    monkeypatch.setenv("L3POOL_MASTER_ADMIN", mooncake_master.admin_url)
    assert main(["inspect", "--key-prefix", prefix]) == 0
    out = capsys.readouterr().out
    print(out)
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.strip().startswith("ID"))
    row = next(ln for ln in lines if ln.strip().startswith("dn-i"))
    assert "32MiB" in row and "16.12 KiB" in row  # donated (as the agent was told), used: 4 x (4 KiB + 32 B)
    assert header.index("DONATED") == row.index("32MiB")  # aligned columns
    ns_row = next(ln for ln in lines if ln.strip().startswith(NS_ID))
    assert ns_row.split()[-3:] == ["3", "12.09", "KiB"]
    assert "COUNTERS (2)" in lines and any(ln.strip().startswith("(total)") and " 6 " in ln for ln in lines)
    assert any(ln.strip().startswith("req-7") for ln in lines)
    assert any(ln.startswith("MASTER http://127.0.0.1") and "keys 4," in ln for ln in lines)


def test_table_sizes_follow_the_units_the_donations_were_typed_in() -> None:
    """Members donating "512MB" (decimal): the master's totals are decimal too, not "976.6 MiB" next
    to "512MB"; typed in binary units or not at all: binary."""

    def report(donated: str | None) -> dict[str, Any]:
        member = {"id": "a", "host": "h", "donated": donated, "donated_bytes": 512 * 10**6, "used_bytes": 1500,
                  "lease_ttl_left": 3, "version": "v", "age_s": 1.0}  # fmt: skip
        master = {"admin_url": "http://m", "keys": 1, "allocated_bytes": 1500, "capacity_bytes": 1024 * 10**6,
                  "segments": [], "active_clients": 1}  # fmt: skip
        return {"members": [member, {**member, "id": "b"}], "namespaces": [], "counters": {}, "clients": {},
                "locks": [], "master": master}  # fmt: skip

    dec = render(report("512MB"))
    assert "used 1.5 KB of 1.024 GB" in dec and "976.6 MiB" not in dec, dec
    assert any(ln.split()[:4] == ["a", "h", "512MB", "1.5"] for ln in dec.splitlines()), dec
    binary = render(report(None))
    assert "used 1.465 KiB of 976.6 MiB" in binary and "488.3 MiB" in binary, binary


def test_empty_prefix_table_says_none(etcd_server: EtcdServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--etcd", etcd_server.endpoints, "--key-prefix", "/l3t-empty"]) == 0
    out = capsys.readouterr().out
    assert "MEMBERS (0)" in out and "(none)" in out and "MASTER: not queried" in out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = python_env(base={k: v for k, v in os.environ.items() if not k.startswith("L3POOL_")})
    return subprocess.run(
        [sys.executable, "-m", "l3pool.cli", "inspect", *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_unreachable_etcd_exit_1_one_line_and_the_hint() -> None:
    (port,) = free_ports(1)
    r = _cli("--etcd", f"127.0.0.1:{port}")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"l3pool inspect: error: etcd unreachable: 127.0.0.1:{port}: [Errno 111] Connection refused",
        "l3pool inspect: hint: is etcd running at that address? (--etcd, or L3POOL_ETCD)",
    ]


def test_unreachable_master_admin_exit_1_one_line_and_the_hint(etcd_server: EtcdServer) -> None:
    (port,) = free_ports(1)
    r = _cli("--etcd", etcd_server.endpoints, "--master-admin", f"http://127.0.0.1:{port}")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("l3pool inspect: error: mooncake master admin unreachable at")
    assert (
        lines[1]
        == "l3pool inspect: hint: is mooncake_master's admin port there? (--master-admin, or L3POOL_MASTER_ADMIN)"
    )


def test_missing_etcd_and_bad_input_exit_2(tmp_path: Path) -> None:
    r = _cli("--state-dir", str(tmp_path))  # no --etcd, and no local cluster recorded there
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "l3pool inspect: error: no pool to inspect: no --etcd (or L3POOL_ETCD) and no local cluster running in "
        f"{tmp_path}",
        "l3pool inspect: hint: start one with `l3pool cluster up`, or give --etcd ENDPOINTS [--master-admin URL]",
    ]
    r = _cli("--etcd", "127.0.0.1:1", "--key-prefix", "l3pool")
    assert r.returncode == 2 and "key prefix must start with '/'" in r.stderr and "Traceback" not in r.stderr


def test_collect_raises_inspect_error() -> None:
    with pytest.raises(InspectError, match="etcd unreachable"):
        collect("127.0.0.1:1", None)
