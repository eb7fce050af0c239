"""Real etcd and mooncake_master processes for the l3pool tests, on 127.0.0.1 only.

`run_etcd(tmp)` and `run_master(tmp)` are context managers: they pick free ports, start the
server in its own process group (logs and the etcd data dir under a temporary dir on /dev/shm),
wait until it answers, and on exit stop the whole group and delete the dir — also when the test
failed. A port taken between choosing and binding (other processes on this machine) is retried
with new ports. Processes and ports are handled as the local cluster handles its own
(`l3pool.cluster.processes`: `spawn`, `stop`, `free_ports`, `listening`), and the command lines
are the product's (`l3pool.cluster.servers`: what the local cluster and `deploy render` run; the
tests choose only named options of it). The fixtures
`etcd_server` and `mooncake_master` are module-scoped; tests isolate themselves with their own key
prefix. The master runs with --client_ttl 3 so a killed agent's segment disappears within seconds.

The binaries are found exactly as `LocalCluster` finds them (`l3pool.cluster.local.etcd_binary` /
`master_binary`: PATH, the installed mooncake package, this environment's bin/), so the tests do
not depend on an activated venv. They are required parts of the suite: a missing one fails the
tests that need it, with the install hint, rather than skipping them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from l3pool.cluster.local import ClusterError, etcd_binary, master_binary
from l3pool.cluster.processes import Proc, alive, free_ports, listening, spawn, stop
from l3pool.cluster.servers import EtcdFlags, EtcdServerTls, MasterFlags, etcd_argv, master_argv
from l3pool.pool.etcd import EtcdClient, EtcdError, EtcdSecurity
from l3pool.pool.store import metadata_url
from l3pool.procenv import python_env

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 15.0
STOP_GRACE = 3.0  # s from SIGTERM to SIGKILL


def _tmpdir(tag: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix=f"l3pool-test-{tag}-", dir=base)


def required(find: Callable[[], str]) -> str:
    """`find()` (etcd_binary or master_binary); fails the calling test when the binary is missing."""
    try:
        return find()
    except ClusterError as e:
        pytest.fail(f"required component missing: {e}", pytrace=False)


def required_binaries() -> tuple[str, str]:
    """(etcd, mooncake_master) paths; fails the calling test when either is missing."""
    return required(etcd_binary), required(master_binary)


class _Server(Protocol):
    proc: Proc


_S = TypeVar("_S", bound=_Server)


@contextlib.contextmanager
def serve(what: str, attempts: int, start: Callable[[Path, int], _S], ready: Callable[[_S], bool]) -> Iterator[_S]:
    """`start(dir, attempt)` a server in a temporary dir of its own and wait until `ready(server)`;
    one that exits meanwhile (most likely: a port taken between choosing and binding) is started
    again, on new ports. On exit its process group is stopped and the dir deleted."""
    tmp = Path(_tmpdir(what))
    server = None
    try:
        for attempt in range(attempts):
            server = start(tmp, attempt)
            deadline = time.monotonic() + START_TIMEOUT
            while alive(server.proc) and not ready(server):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} not ready within {START_TIMEOUT} s; {server.proc.tail()}")
                time.sleep(0.05)
            if alive(server.proc):
                yield server
                return
            stop([server.proc], grace=STOP_GRACE)  # reaps it, and kills what it left in its group
        assert server is not None
        raise RuntimeError(f"{what} failed to start {attempts} times; {server.proc.tail()}")
    finally:
        if server is not None:
            stop([server.proc], grace=STOP_GRACE)
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class EtcdServer:
    client_port: int
    peer_port: int
    data_dir: Path
    proc: Proc
    security: EtcdSecurity | None = None  # what `client()` uses (a TLS server: its CA + a client cert)

    @property
    def endpoints(self) -> str:
        scheme = "https" if self.security is not None else "http"
        return f"{scheme}://{HOST}:{self.client_port}"

    def client(self) -> EtcdClient:
        return EtcdClient(self.endpoints, timeout=2.0, security=self.security)


@dataclass(frozen=True)
class EtcdTls:
    """Files for an etcd serving TLS on its client port and requiring client certificates."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@contextlib.contextmanager
def run_etcd(attempts: int = 3, tls: EtcdTls | None = None) -> Iterator[EtcdServer]:
    """`tls`: serve https on the client port (server cert, CA, --client-cert-auth); peers stay
    plain http on 127.0.0.1."""
    exe = required(etcd_binary)
    security = None if tls is None else EtcdSecurity(str(tls.ca), str(tls.client_cert), str(tls.client_key))
    server_tls = None if tls is None else EtcdServerTls(str(tls.server_cert), str(tls.server_key), str(tls.ca))

    def start(tmp: Path, attempt: int) -> EtcdServer:
        cport, pport = free_ports(2)
        name = f"l3t{uuid.uuid4().hex[:6]}"
        flags = EtcdFlags(name, str(tmp / f"data{attempt}"), HOST, cport, pport, server_tls)
        proc = spawn("etcd", name, etcd_argv(exe, flags), tmp / "etcd.log")
        return EtcdServer(cport, pport, tmp / f"data{attempt}", proc, security)

    def answers(server: EtcdServer) -> bool:
        if server.client_port not in listening(server.proc.pid):
            return False
        client = server.client()
        try:
            client.status()
            return True
        except EtcdError:
            return False
        finally:
            client.close()

    with serve("etcd", attempts, start, answers) as server:
        yield server


@dataclass
class MasterServer:
    rpc_port: int
    metadata_port: int
    admin_port: int
    proc: Proc
    log: Path

    @property
    def rpc(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return metadata_url(HOST, self.metadata_port)

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.admin_url}{path}", timeout=3) as r:
            return str(r.read().decode())

    def segments(self) -> list[str]:
        return [s for s in self.admin("/get_all_segments").splitlines() if s]


@contextlib.contextmanager
def run_master(
    client_ttl: int = 3, attempts: int = 3, *, tenant_policy: str | None = None, default_kv_lease_ttl: str | None = None
) -> Iterator[MasterServer]:
    """The product's master (`l3pool.cluster.servers.master_argv`, embedded metadata server) with
    --client_ttl 3 by default: a killed agent's segment disappears within seconds, not the
    product's 10 s. `tenant_policy` / `default_kv_lease_ttl`: the product's options of those names."""
    exe = required(master_binary)

    def start(tmp: Path, attempt: int) -> MasterServer:
        rpc, meta, admin = free_ports(3)
        log = tmp / "master.log"
        flags = MasterFlags(HOST, rpc, admin, meta, client_ttl=client_ttl, tenant_policy=tenant_policy,
                            default_kv_lease_ttl=default_kv_lease_ttl)  # fmt: skip
        proc = spawn("master", "master", master_argv(exe, flags), log)
        return MasterServer(rpc, meta, admin, proc, log)

    def listens(m: MasterServer) -> bool:
        return {m.rpc_port, m.metadata_port, m.admin_port} <= listening(m.proc.pid)

    with serve("mooncake_master", attempts, start, listens) as server:
        yield server


@pytest.fixture(scope="session", autouse=True)
def _native_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Agents and CLIs started by the tests write Mooncake's log lines (l3pool/logs.py) under
    pytest's own temporary directory (pruned by pytest), not into the user's log dir."""
    old = os.environ.get("L3POOL_LOG_DIR")
    os.environ["L3POOL_LOG_DIR"] = str(tmp_path_factory.mktemp("mooncake-logs"))
    yield
    if old is None:
        os.environ.pop("L3POOL_LOG_DIR", None)
    else:
        os.environ["L3POOL_LOG_DIR"] = old


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    with run_etcd() as server:
        yield server


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MasterServer]:
    with run_master() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing one etcd never see each other's keys."""
    return f"/l3t-{uuid.uuid4().hex[:8]}"


# -- agents as subprocesses ----------------------------------------------------------------------
@dataclass
class AgentProc:
    """`python -m l3pool.cli agent ...` with stderr collected by a thread (Mooncake logs a lot)."""

    args: list[str]
    proc: subprocess.Popen[str] = field(init=False)
    lines: list[str] = field(default_factory=list)
    registered_after: float | None = None

    def __post_init__(self) -> None:
        self._t0 = time.monotonic()
        self._registered = threading.Event()
        env = python_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "l3pool.cli", "agent", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "donating" in line and not self._registered.is_set():
                self.registered_after = time.monotonic() - self._t0
                self._registered.set()

    def wait_registered(self, timeout: float = 15.0) -> float:
        deadline = time.monotonic() + timeout
        while not self._registered.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(2)
                raise AssertionError(f"agent not registered (rc={self.proc.poll()}):\n" + "\n".join(self.lines[-20:]))
        assert self.registered_after is not None
        return self.registered_after

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._reader.join(5)

    def our_lines(self) -> list[str]:
        """stderr without Mooncake's glog lines (I/W/E + date) and its one-time banner."""
        return [
            ln
            for ln in self.lines
            if not (len(ln) > 5 and ln[0] in "IWEF" and ln[1:5].isdigit()) and not ln.startswith("WARNING: Logging")
        ]


@contextlib.contextmanager
def agent_process(args: Sequence[str]) -> Iterator[AgentProc]:
    a = AgentProc(list(args))
    try:
        yield a
    finally:
        a.kill()


def agent_args(etcd: EtcdServer, master: MasterServer, prefix: str, *extra: str) -> list[str]:
    return [
        "--master",
        master.rpc,
        "--metadata",
        master.metadata_url,
        "--etcd",
        etcd.endpoints,
        "--key-prefix",
        prefix,
        *extra,
    ]


def free_port() -> int:
    """A loopback TCP port nothing listens on now (connections to it are refused until used)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def slack() -> float:
    """How much wall-clock limits of latency tests stretch on an overloaded host: 1 when the
    1-minute load is below the core count, else 3 (other processes deschedule our threads for
    100+ ms; measured on the shared 2-core VM at load 2.7)."""
    return 1.0 if os.getloadavg()[0] < (os.cpu_count() or 1) else 3.0


def wait_for(cond: object, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll `cond()` until true; returns the seconds it took; AssertionError after `timeout`."""
    assert callable(cond)
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0
