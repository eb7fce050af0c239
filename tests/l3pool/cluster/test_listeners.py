"""What the pool's processes really bind (mooncake_master and a Mooncake client of 0.3.13.post1),
read from /proc/<pid>/net/tcp{,6} like `ss -ltnp`. The facts behind `deploy render`'s firewall
rules: the master's RPC and admin ports honour their host flags, its HTTP metadata server binds
0.0.0.0 whatever --http_metadata_server_host says, and a client listens on all interfaces on two
ports that MC_MIN_RPC_PORT/MC_MAX_RPC_PORT confine to a range. If Mooncake fixes the metadata
bind, the first test fails: then drop the workaround note in deploy/README.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time

from l3pool.procenv import python_env

from ..conftest import REPO, free_ports, run_master


def _addr(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip, 16)))
    else:  # four little-endian 32-bit words
        host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ipaddress.ip_address(host)), int(port, 16)


def listening(pid: int) -> dict[int, str]:
    """port -> bound address of every TCP socket `pid` listens on."""
    inodes: dict[str, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                parts = line.split()
                if parts[3] == "0A":
                    inodes[parts[9]] = _addr(parts[1])
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                host, port = inodes[link[8:-1]]
                out[port] = host
    return out


def test_master_binds() -> None:
    with run_master() as m:  # every host flag 127.0.0.1
        bound = listening(m.proc.pid)
    assert bound[m.rpc_port] == "127.0.0.1" and bound[m.admin_port] == "127.0.0.1"
    assert bound[m.metadata_port] == "0.0.0.0", "the metadata server now honours its host flag: update deploy/README"


_CHILD = """
import json, os, sys
from l3pool.pool.store import MooncakeStore, StoreConfig
from tests.l3pool.cluster.test_listeners import listening
before = set(listening(os.getpid()))
store = MooncakeStore(StoreConfig(master=sys.argv[1], metadata=sys.argv[2], segment_bytes=16 << 20))
print(json.dumps({p: h for p, h in listening(os.getpid()).items() if p not in before}))
store.close()
"""


def test_client_ports_follow_mc_rpc_range() -> None:
    """In a fresh interpreter: Mooncake reads MC_MIN/MAX_RPC_PORT once per process."""
    # outside Mooncake's default 15000-17000 (so the test can fail) and <= 32767 (its limit); ports
    # taken meanwhile are retried inside the range
    lo = random.randrange(20000, 32000)
    hi = lo + 63
    env = python_env({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_MIN_RPC_PORT": str(lo), "MC_MAX_RPC_PORT": str(hi)})
    with run_master() as m:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, m.rpc, m.metadata_url],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    new = {int(p): h for p, h in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    assert len(new) == 2 and all(lo <= p <= hi for p in new), new
    assert {ipaddress.ip_address(h).is_unspecified for h in new.values()} == {True}  # all interfaces


def test_standalone_metadata_server_binds_its_host() -> None:
    """What `deploy render` runs instead of the master's embedded server (metadata_server = "standalone")."""
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1", "--port", str(port)]
    p = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while port not in listening(p.pid):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.stderr else ""
            time.sleep(0.05)
        assert listening(p.pid) == {port: "127.0.0.1"}
    finally:
        p.terminate()
        p.wait(10)
