"""The local-cluster launcher: real etcd, mooncake_master and agents, one network namespace per agent.

Agents are the real `l3pool agent` (`python -m l3pool.cli agent`). Every test uses its own
name prefix (`l3pt...` + random suffix), subnet and state dir, and cleans up in `finally`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import l3pool.cluster.local as cluster_mod
from l3pool.cluster.local import ClusterAlreadyUp, ClusterError, LocalCluster, down, read_state
from l3pool.cluster.processes import freeze_group
from l3pool.cluster.running import status
from l3pool.paths import runtime_dir
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.store import RPC_TIMEOUT_MS, MooncakeStore, Outcome, StoreConfig
from l3pool.procenv import python_env
from tests.conftest import default_sigint

REPO = Path(__file__).resolve().parents[3]
HAVE_NETNS = os.geteuid() == 0 and subprocess.run(["which", "ip"], capture_output=True).returncode == 0
NETNS_SKIP = "network namespaces need root and iproute2's `ip`; the loopback fallback test covers the rest"


def _name(tag: str) -> str:
    return f"l3pt{tag}{uuid.uuid4().hex[:4]}"


def _my_links(name: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]
    return [n for n in names if n.startswith(f"{name}-")]


def _my_netns(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{name}-")]


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _members(c: LocalCluster) -> dict[str, dict[str, Any]]:
    e = EtcdClient(c.etcd_endpoints)
    try:
        return {kv.key.rsplit("/", 1)[-1]: json.loads(kv.value) for kv in e.get_prefix(f"{c.key_prefix}/members/")}
    finally:
        e.close()


def _check_advertised(c: LocalCluster, members: dict[str, dict[str, Any]]) -> None:
    """Each agent's Mooncake RPC address (what peers connect to) is its own IP, never the host's NIC."""
    for a in c.agents:
        seg = members[a.id]["segment"]  # the agent publishes its Mooncake segment name
        key = urllib.parse.quote(f"mooncake/rpc_meta/{seg}", safe="")
        with urllib.request.urlopen(f"{c.metadata_url}?key={key}", timeout=5) as r:
            assert json.loads(r.read())["ip_or_host_name"] == a.ip


def _lease(c: LocalCluster, k: int) -> int | None:
    e = EtcdClient(c.etcd_endpoints)
    try:
        kv = e.get(c.member_key(k))
        return kv.lease if kv else None
    finally:
        e.close()


def _round_trip(c: LocalCluster, mp: pytest.MonkeyPatch, n: int = 8, size: int = 1 << 20) -> None:
    """A root-namespace client puts n objects of `size` bytes and gets them back bit-exact."""
    for k, v in c.client_env().items():  # advertise client_host, not the host's NIC
        mp.setenv(k, v)
    store = MooncakeStore(
        StoreConfig(master=c.master, metadata=c.metadata_url, local_hostname=c.client_host, segment_bytes=0)
    )
    try:
        src = np.random.default_rng(7).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        store.register(src.ctypes.data, src.nbytes)
        store.register(dst.ctypes.data, dst.nbytes)
        keys = [f"{c.name}-obj-{i}" for i in range(n)]
        assert store.put(keys, [src.ctypes.data + i * size for i in range(n)], [size] * n) == [Outcome.OK] * n
        assert store.get(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n) == [Outcome.OK] * n
        assert np.array_equal(src, dst)
    finally:
        store.close()


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "cluster"
    yield d
    down(d)  # whatever a failed test left running


def test_bad_config_raises_at_construction() -> None:
    for kwargs in ({"name": "l3p-x"}, {"name": "averyveryverylongname"}, {"subnet": "10.77.0.0/30"},
                   {"netns": "maybe"}, {"segment_size": "lots"}, {"lease_ttl": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            LocalCluster(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"default_kv_lease_ttl must be None or a duration \(2000, 2s\), got ' '"):
        LocalCluster(default_kv_lease_ttl=" ")


def test_agents_that_together_exceed_available_memory_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each agent's segment fits, all of them do not: refused before anything starts, in one line."""
    from l3pool.pool import store

    monkeypatch.setattr(store, "mem_available", lambda: 100 << 20)  # this host: 100 MiB available
    with pytest.raises(ValueError) as e:
        LocalCluster(agents=4, segment_size="32MiB", netns="off")
    assert str(e.value) == (
        "4 agents x --segment-size 32 MiB = 128 MiB is more than this host's available memory (100 MiB): "
        "lower --agents or --segment-size"
    )
    assert store.segment_too_large(32 << 20, "32MiB", agents=3) is None  # 96 MiB fits
    assert store.segment_too_large(128 << 20, "128MiB") == (
        "--segment-size 128 MiB is larger than this host's available memory (100 MiB): lower --segment-size"
    )
    monkeypatch.setattr(store, "mem_available", lambda: None)  # unreadable: no claim either way
    assert store.segment_too_large(1 << 50, "1PiB", agents=8) is None


def test_available_memory_counts_free_reserved_huge_pages(tmp_path: Path) -> None:
    from l3pool.pool.connection import mem_available

    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable:  1000 kB\nHugePages_Free:  3\nHugepagesize:  2048 kB\n")
    assert mem_available(str(info)) == (1000 + 3 * 2048) * 1024
    info.write_text("MemAvailable: 1000 kB\n")  # no huge page lines (a kernel without hugetlb)
    assert mem_available(str(info)) == 1000 * 1024
    info.write_text("MemFree: 1000 kB\n")  # no MemAvailable: unknown, never a guess
    assert mem_available(str(info)) is None
    info.write_text("MemAvailable: lots kB\n")
    assert mem_available(str(info)) is None
    assert mem_available(str(tmp_path / "absent")) is None


def test_netns_unavailable_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cluster_mod._netns_unavailable("off") == "netns='off' was asked for"
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 1000)
    assert cluster_mod._netns_unavailable("auto") == "not running as root"
    with pytest.raises(ClusterError, match="namespaces unavailable: not running as root"):
        LocalCluster(agents=1, netns="on", name=_name("8"), state_dir=Path("/tmp") / _name("8"))._setup_network()


@pytest.mark.skipif(not HAVE_NETNS, reason=NETNS_SKIP)
def test_netns_cluster(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _name("1")
    c = LocalCluster(agents=2, segment_size="32MiB", state_dir=state_dir, netns="on", lease_ttl=3, name=name,
                     subnet="10.77.101.0/24")  # fmt: skip
    try:
        c.start()
        print(f"\n[cluster] up with 2 agents in {c.up_seconds:.2f} s ({c.mode})")
        assert c.mode == "netns" and c.client_host == "10.77.101.1"
        st = status(state_dir)
        assert st is not None and st["ready"] and st["all_alive"] and all(st["netns"].values())
        assert sorted(_my_netns(name)) == [f"{name}-a0", f"{name}-a1"]
        members = _members(c)
        assert sorted(members) == [a.id for a in c.agents]
        for a in c.agents:
            assert a.netns == a.id and a.ip == f"10.77.101.{10 + a.index}"
            assert members[a.id]["host"] == a.ip
        _check_advertised(c, members)
        with pytest.raises(ClusterAlreadyUp):
            LocalCluster(agents=1, state_dir=state_dir, name=_name("x")).start()
        _round_trip(c, monkeypatch)

        old_lease = _lease(c, 0)
        t0 = time.monotonic()
        assert c.kill_agent(0) is False
        while c.agents[0].id in _members(c):
            assert time.monotonic() - t0 < c.lease_ttl + 2, "member key outlived its lease"
            time.sleep(0.1)
        print(f"[cluster] killed agent's member key gone after {time.monotonic() - t0:.1f} s")
        c.start_agent(0)
        assert _members(c)[c.agents[0].id]["host"] == c.agents[0].ip
        assert _lease(c, 0) not in (None, old_lease) and c.agents[0].pid is not None

        master = (c.client_host, c.ports["master_rpc"])
        c.stop_master()
        assert not any(p["state"] == "alive" for p in c.processes() if p["role"] == "master")
        with pytest.raises(OSError):
            socket.create_connection(master, timeout=1).close()
        c.start_master()  # same ports
        socket.create_connection(master, timeout=1).close()
        assert c.master == f"{master[0]}:{master[1]}"
    finally:
        pids = [p["pid"] for p in c.processes()]
        c.close()
    assert pids and not [p for p in pids if _pid_alive(p)]
    assert _my_links(name) == [] and _my_netns(name) == []
    assert read_state(state_dir) is None


@pytest.mark.skipif(not HAVE_NETNS, reason=NETNS_SKIP)
def test_concurrent_clusters_get_own_subnets_and_dirs(tmp_path: Path) -> None:
    """No subnet given: two clusters up at once take different free 10.77.N.0/24."""
    a = LocalCluster(agents=1, segment_size="16MiB", netns="on", name=_name("6"))
    b = LocalCluster(agents=1, segment_size="16MiB", netns="on", name=_name("7"))
    assert a.state_dir != b.state_dir and a.state_dir.name.startswith("cluster-l3pt6")
    assert a.state_dir.parent == runtime_dir().resolve() and oct(runtime_dir().stat().st_mode & 0o777) == "0o700"
    try:
        with a, b:
            assert a.subnet != b.subnet and a.client_host != b.client_host
            assert a.subnet.subnet_of(ipaddress.IPv4Network("10.77.0.0/16"))
            assert [m["host"] for m in _members(b).values()] == [b.agents[0].ip]
    finally:
        for c in (a, b):
            shutil.rmtree(c.state_dir, ignore_errors=True)  # logs under /tmp
    assert _my_links(a.name) == _my_links(b.name) == []


def test_port_taken_before_bind_is_retried(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process grabs a chosen port before etcd/the master bind it: new ports, no false ready."""
    held = socket.socket()
    held.bind(("0.0.0.0", 0))
    held.listen()
    busy, real, calls = held.getsockname()[1], cluster_mod.free_ports, []

    def free_ports(n: int) -> list[int]:
        ports = real(n)
        calls.append(n)
        if len(calls) <= 2:
            ports[2 if len(calls) == 1 else 0] = busy  # 1st try: the master's RPC port, 2nd: etcd's
        return ports

    monkeypatch.setattr(cluster_mod, "free_ports", free_ports)
    try:
        with LocalCluster(agents=0, state_dir=state_dir, netns="off", name=_name("9")) as c:
            assert len(calls) == 3 and busy not in c.ports.values()
            assert EtcdClient(c.etcd_endpoints).status()
    finally:
        held.close()


def _cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "l3pool.cli", "cluster", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_cli_up_status_down(state_dir: Path) -> None:
    name = _name("2")
    r = _cli("up", "--agents", "2", "--segment-size", "16MiB", "--state-dir", str(state_dir), "--name", name,
             "--subnet", "10.77.102.0/24", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    up = json.loads(r.stdout)
    pids = [p["pid"] for p in up["processes"]]
    assert len(pids) == 4 and all(_pid_alive(p) for p in pids)
    assert up["endpoints"]["master"] and up["endpoints"]["metadata"].endswith("/metadata")
    mports = [a["metrics_port"] for a in up["agents"]]
    assert len(set(mports)) == 2 and all(a["metrics"] == f"http://{a['ip']}:{a['metrics_port']}/metrics"
                                         for a in up["agents"])  # fmt: skip
    print(f"\n[cluster] CLI up: {up['mode']} in {up['up_seconds']:.2f} s")
    if HAVE_NETNS:
        assert up["mode"] == "netns" and sorted(_my_netns(name)) == [f"{name}-a0", f"{name}-a1"]

    again = _cli("up", "--state-dir", str(state_dir), "--name", _name("y"))
    assert again.returncode == 1 and "already up" in again.stderr

    st = _cli("status", "--state-dir", str(state_dir), "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert status["up"] and status["ready"] and all(p["alive"] for p in status["processes"])
    assert all(status["netns"].values()) and all(status["links"].values())
    plain = _cli("status", "--state-dir", str(state_dir))  # the table: shell assignments, not a Python dict
    env_line = next(ln for ln in plain.stdout.splitlines() if ln.startswith("client_env"))
    rpc_timeout = os.environ.get("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))  # bounds a call a frozen master holds
    want_env = [f"MC_TCP_BIND_ADDRESS={up['endpoints']['client_host']}", f"MC_RPC_TIMEOUT_MS={rpc_timeout}"]
    assert env_line.split()[1:] == want_env, plain.stdout

    dn = _cli("down", "--state-dir", str(state_dir), "--keep-logs")
    assert dn.returncode == 0, dn.stderr
    assert not [p for p in pids if _pid_alive(p)]
    kept = sorted(x.name for x in state_dir.glob("*.log"))  # kept as asked, and said so
    assert kept == ["agent-0.log", "agent-1.log", "etcd.log", "master.log"] and "logs kept in" in dn.stdout
    if HAVE_NETNS:
        assert _my_links(name) == [] and _my_netns(name) == []
    dn2 = _cli("down", "--state-dir", str(state_dir))
    assert dn2.returncode == 0 and "nothing to stop" in dn2.stdout
    st2 = _cli("status", "--state-dir", str(state_dir))
    assert st2.returncode == 1 and "no cluster up" in st2.stdout


def test_sigint_during_up_cleans_up(state_dir: Path) -> None:
    """Ctrl-C while `up` waits for agents that never register: everything it started is gone."""
    name = _name("3")
    hang = f"{sys.executable} -c 'import time; time.sleep(120)'"
    p = subprocess.Popen([sys.executable, "-m", "l3pool.cli", "cluster", "up", "--agents", "2", "--state-dir",
                          str(state_dir), "--name", name, "--subnet", "10.77.103.0/24", "--agent-cmd", hang],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        state = None
        while time.monotonic() < deadline:
            state = read_state(state_dir) if (state_dir / "state.json").exists() else None
            if state and sum(x["role"] == "agent" for x in state["processes"]) == 2:
                break
            time.sleep(0.1)
        assert state is not None, "up never recorded its agents"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err
    assert not [x["pid"] for x in state["processes"] if _pid_alive(x["pid"])]
    if HAVE_NETNS:
        assert _my_links(name) == [] and _my_netns(name) == []
    assert read_state(state_dir) is None


def test_agent_failure_tears_down_and_shows_log(state_dir: Path) -> None:
    name = _name("4")
    fail = [sys.executable, "-c", "import sys; print('agent-boom-marker', file=sys.stderr); sys.exit(2)"]
    c = LocalCluster(agents=1, segment_size="16MiB", state_dir=state_dir, name=name, subnet="10.77.104.0/24",
                     agent_cmd=fail)  # fmt: skip
    with pytest.raises(ClusterError, match="agent-boom-marker"):
        c.start()
    assert not [p["pid"] for p in c.processes() if _pid_alive(p["pid"])]
    if HAVE_NETNS:
        assert _my_links(name) == [] and _my_netns(name) == []
    assert read_state(state_dir) is None

    # an agent that never registers: bounded wait, its own log (this run's part only) in the error
    hang = [sys.executable, "-c", "import time; print('agent-hang-marker', flush=True); time.sleep(60)"]
    c = LocalCluster(agents=1, state_dir=state_dir, name=name, netns="off", agent_cmd=hang, ready_timeout=2)
    with pytest.raises(ClusterError, match="not done within 2 s") as err:
        c.start()
    assert "agent-hang-marker" in str(err.value) and "agent-boom-marker" not in str(err.value)
    assert not [p["pid"] for p in c.processes() if _pid_alive(p["pid"])]


def test_loopback_fallback(state_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    name = _name("5")
    c = LocalCluster(agents=2, segment_size="32MiB", state_dir=state_dir, netns="off", lease_ttl=3, name=name)
    try:
        c.start()
        print(f"\n[cluster] namespaces off: {c.fallback_reason}; loopback up in {c.up_seconds:.2f} s")
        assert "namespaces unavailable: netns='off'" in caplog.text and "falling back to loopback ports" in caplog.text
        assert c.mode == "loopback" and c.client_host == "127.0.0.1" and c.master.startswith("127.0.0.1:")
        assert all(a.netns is None and a.ip == "127.0.0.1" for a in c.agents)
        members = _members(c)
        assert sorted(members) == [a.id for a in c.agents]
        assert all(m["host"] == "127.0.0.1" for m in members.values())
        # every agent serves its metrics on its own port of 127.0.0.1, named in its member record
        assert len({a.metrics_port for a in c.agents}) == 2 and all(a.metrics_port > 0 for a in c.agents)
        for a in c.agents:
            assert a.metrics_url == f"http://127.0.0.1:{a.metrics_port}/metrics" == members[a.id]["metrics"]
            with urllib.request.urlopen(a.metrics_url, timeout=3) as r:
                assert "l3pool_agent_registered 1.0" in r.read().decode()
        assert [x["metrics"] for x in c.state()["agents"]] == [a.metrics_url for a in c.agents]
        _check_advertised(c, members)
        _round_trip(c, monkeypatch)
    finally:
        pids = [p["pid"] for p in c.processes()]
        c.close()
    assert pids and not [p for p in pids if _pid_alive(p)]
    if HAVE_NETNS:
        assert _my_links(name) == [] and _my_netns(name) == []


def test_binaries_found_without_the_venv_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """One lookup for LocalCluster and the fixtures: it works with PATH lacking the venv's bin (the
    master ships inside the mooncake package), and a missing binary is a ClusterError with a hint."""
    venv_bin = os.path.dirname(sys.executable)  # the rest of PATH stays (a GPU host has etcd from a bundle there)
    rest = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and os.path.abspath(d) != venv_bin]
    monkeypatch.setenv("PATH", os.pathsep.join(rest) or "/nonexistent")
    etcd, master = cluster_mod.etcd_binary(), cluster_mod.master_binary()
    for exe in (etcd, master):
        assert os.path.isfile(exe) and os.access(exe, os.X_OK), exe
    assert os.path.basename(etcd) == "etcd" and os.path.basename(master) == "mooncake_master"
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(cluster_mod, "_first_executable", lambda candidates: None)
    with pytest.raises(ClusterError, match=r"etcd not found.*etcd-server"):
        cluster_mod.etcd_binary()
    with pytest.raises(ClusterError, match=r"mooncake_master not found.*mooncake-transfer-engine"):
        cluster_mod.master_binary()


def test_status_without_iproute2(tmp_path: Path) -> None:
    """A host without `ip` (the H200 host has no iproute2): `cluster status` lists no links and
    namespaces instead of dying with FileNotFoundError, and says which recorded ones it cannot see."""
    state = {"name": "noip", "mode": "netns", "links": ["noip-br0"], "netns": ["noip-a0"], "processes": [],
             "endpoints": {"etcd": "http://127.0.0.1:1"}, "up_seconds": 1.0}  # fmt: skip
    (tmp_path / "state.json").write_text(json.dumps(state))
    bindir = tmp_path / "bin"  # an empty PATH: no `ip`. The interpreter by its own path (a symlink to a
    bindir.mkdir()  # venv's python elsewhere loses the venv: the H200 host's base python has no numpy)
    r = subprocess.run([sys.executable, "-m", "l3pool.cli", "cluster", "status", "--state-dir", str(tmp_path),
                        "--json"], capture_output=True, text=True, timeout=60,
                       env=python_env({"PATH": str(bindir)}))  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["links"] == {"noip-br0": False} and out["netns"] == {"noip-a0": False}


def test_freeze_group_returns_once_every_thread_is_stopped() -> None:
    """The fault tests rely on this: kill() only queues SIGSTOP, so a request sent right after it can
    still be answered; freeze_group returns only once every thread of the group is in state T."""
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        time.sleep(0.3)
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 4
        assert freeze_group(proc.pid, timeout=5)
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "T"
        os.killpg(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert not freeze_group(proc.pid, timeout=0.2)  # gone: says so
